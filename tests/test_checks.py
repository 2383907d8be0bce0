"""course_grader.checks: test cells as checks, graded in a process the student's code never ran in."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import nbgrading as g
from course_grader import checks, edition, grade

SOLUTION = g.load_solution("00_orientation")
POINTS = g.grade_cells(SOLUTION)


def test_the_reference_solution_passes_every_check_and_the_release_none():
    passed = grade.grade(g.submission(SOLUTION, SOLUTION))
    assert set(passed) == set(POINTS) and all(v.passed for v in passed.values()), passed
    stub = "# YOUR CODE HERE\nraise NotImplementedError()"  # the release's solution cells
    blank = grade.grade(g.submission(SOLUTION, SOLUTION, replace={ex: stub for ex in g.solution_cells(SOLUTION)}))
    assert not any(v.passed for v in blank.values())
    assert all("NotImplementedError" in v.message or "is not defined" in v.message for v in blank.values()), blank


def test_a_looping_cell_loses_its_exercise_only():
    loops = g.submission(SOLUTION, SOLUTION, replace={"training_memory": g.LOOP})
    verdicts = grade.grade(loops, seconds=20)  # each cell and probe: time enough on a loaded machine
    lost = {k for k, v in verdicts.items() if not v.passed}
    assert lost == {"test_training_memory", "test_training_memory_hidden"}, verdicts


def test_under_autograde_the_kernel_leaves_the_checks_to_the_grader(monkeypatch, capsys):
    monkeypatch.setenv("NBGRADER_EXECUTION", "autograde")
    checks.check("test_llama_param_count", {})  # no student code at all: nothing runs here
    assert "scored by the grader" in capsys.readouterr().out
    monkeypatch.setenv("NBGRADER_EXECUTION", "validate")  # nbgrader validate: the student's own check runs
    with pytest.raises(KeyError):
        checks.check("test_llama_param_count", {})


def test_only_plain_data_crosses_to_the_grader():
    assert checks.plain({"a": [1, 2.5, "x"], "t": torch.ones(2)})["a"] == [1, 2.5, "x"]
    with pytest.raises(TypeError, match="numbers, strings, tensors"):
        checks.plain({"model": torch.nn.Linear(1, 1)})
    assert checks.number(torch.tensor(3)) == 3 and checks.number(True) == "True" and checks.number([1]) == "[1]"


def test_the_student_edition_has_the_visible_checks_and_not_the_hidden_ones(tmp_path):
    path = edition.for_grading()
    code = ("import course_grader.checks as c; c.load_all(); print(sorted(c.REGISTRY))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(path)}, cwd=tmp_path,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "test_llama_param_count" in out.stdout and "_hidden" not in out.stdout, out.stdout


def test_loading_course_lib_and_every_check_starts_no_thread():
    """The grading server forks a child per submission after loading course_lib and the checks: a thread started
    at import (an OpenMP pool from a large float op, a monitor) would be missing in the child, and a lock it held
    would hang it. So no module may start one when it is imported."""
    code = ("import os, pkgutil, importlib, torch\n"
            "before = len(os.listdir('/proc/self/task'))\n"
            "import course_lib, course_grader, course_grader.checks as c\n"
            "c.load_all()\n"
            "for pkg in (course_lib, course_grader):  # course_lib/apps/ too\n"
            "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
            "        importlib.import_module(m.name)\n"
            "print(before, len(os.listdir('/proc/self/task')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "4"})
    assert out.returncode == 0, out.stderr[-2000:]
    before, after = map(int, out.stdout.split()[-2:])
    assert after == before, f"importing course_lib started {after - before} thread(s)"


# One multi-rank check of each notebook whose tests start ranks: on a machine with GPUs, run_forked spawns its
# ranks and a probe sends them the student's definitions by value (cloudpickle), not the forked namespace. Each
# notebook's checks name what they send (checks.student(ns, *names)), and a name wrong there fails only on that
# path. COURSE_SPAWN_RANKS=by-value takes that data path with forked ranks: what a rank gets of the notebook is the
# spawned rank's, without a fresh Python per rank (about 40 s of a worker per notebook); one notebook's check spawns
# its ranks for real (=1), inside the grading fence as on the GPU machine.
SPAWNED = {"06_ddp": "test_average_gradients", "07_ddp_reducer": "test_BucketedDDP", "08_fsdp": "test_ShardedModule",
           "09_deepspeed_zero": "test_ShardedOptimizer", "14_tensor_parallelism": "test_tensor_parallel_pair",
           "16_context_parallelism": "test_ring_attention"}
REALLY_SPAWNED = "07_ddp_reducer"


@pytest.mark.parametrize("assignment", sorted(SPAWNED))
def test_multi_rank_checks_pass_and_fail_on_the_gpu_machines_spawned_ranks(assignment, monkeypatch):
    """The grading path a GPU machine takes (``fork_is_safe()`` is False there), forced on this CPU: the reference
    passes, and a known-wrong submission of that exercise still fails, with ranks that got the student's definitions
    by value (spawned for real in one notebook, inside the fence)."""
    # read by the grading server started below, and by its ranks
    monkeypatch.setenv("COURSE_SPAWN_RANKS", "1" if assignment == REALLY_SPAWNED else "by-value")
    solution = g.load_solution(assignment)
    test_id = SPAWNED[assignment]
    meta = lambda c: c.get("metadata", {}).get("nbgrader", {})  # noqa: E731
    only = {**solution, "cells": [c for c in solution["cells"]
                                  if not meta(c).get("grade") or meta(c)["grade_id"] == test_id]}
    exercise = next(ex for ex in g.solution_cells(solution) if test_id in g.tests_of(solution, ex))
    wrong = next(c for n, c in g.cases(assignment).CASES.items()
                 if list(c["cells"]) == [exercise] and c["scores"][test_id] == 0 and not n.startswith("calls_"))
    server = grade.Server(grade.hidden_modules([test_id]))
    try:
        right = grade.grade(g.submission(only, only), seconds=120, server=server)[test_id]
        failed = grade.grade(g.submission(only, only, replace=wrong["cells"]), seconds=120, server=server)[test_id]
        # unpickling in the rank runs what the submission chose: forbid switched off there is put back before use
        disarmed = (grade.grade(g.submission(only, only, replace={exercise: g.attacks().DISARM_IN_RANK}), seconds=120,
                                server=server)[test_id] if assignment == REALLY_SPAWNED else None)
    finally:
        server.close()
    assert right.passed, right.message
    assert not failed.passed and "WorkerError" not in failed.message, failed.message
    # torch's DDP refused in the rank (forbid on), not merely failing the judge (forbid off: it ran)
    assert disarmed is None or (not disarmed.passed and "DistributedDataParallel is what this exercise asks you to "
                                "build" in disarmed.message), disarmed.message
