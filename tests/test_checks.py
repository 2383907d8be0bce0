"""course_lib.checks: test cells as checks, graded in a process the student's code never ran in."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import nbgrading as g
from course_lib import checks, edition
from course_lib.checks import grade

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
    code = ("import course_lib.checks as c; c.load_all(); print(sorted(c.REGISTRY))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(path)}, cwd=tmp_path,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "test_llama_param_count" in out.stdout and "_hidden" not in out.stdout, out.stdout
