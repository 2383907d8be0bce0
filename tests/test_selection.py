"""The gate's selection (tests/selection.py): what a change reaches, and what the gate then runs and skips."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbgrading as g
import selection as sel

ROOT = Path(__file__).resolve().parent.parent
EP = "course_lib/parallel/ep.py"


def test_a_library_module_selects_the_tests_and_the_notebook_that_reach_it():
    change = sel.Selection("HEAD", {EP})
    assert not change.everything
    assert change.keeps("tests/test_ep.py") and change.keeps("tests/test_notebook_17.py")
    assert change.keeps("tests/test_grading.py", "17_expert_parallelism")
    assert not change.keeps("tests/test_grading.py", "15_pipeline_parallelism")
    assert not change.keeps("tests/test_pp.py") and not change.keeps("tests/test_notebook_15.py")
    assert not change.keeps("tests/test_hub.py") and not change.keeps("tests/test_instructor_flow.py")
    assert change.notebook_changed("17_expert_parallelism")
    assert not change.notebook_changed("15_pipeline_parallelism")


def test_a_notebook_selects_its_own_tests_and_its_grading_only():
    change = sel.Selection("HEAD", {"solutions/04_activation_checkpointing/04_activation_checkpointing.ipynb"})
    assert change.keeps("tests/test_notebook_04.py") and change.keeps("tests/test_release.py")
    assert change.keeps("tests/test_grading.py", "04_activation_checkpointing")
    assert change.keeps("tests/test_student_path.py", "04_activation_checkpointing")
    assert not change.keeps("tests/test_student_path.py", "05_input_pipeline")
    assert not change.keeps("tests/test_notebook_05.py") and not change.keeps("tests/test_launch.py")


def test_a_known_submission_reaches_its_grading_not_the_notebook_s_run():
    change = sel.Selection("HEAD", {"tests/submissions/07_ddp_reducer.py"})
    assert change.keeps("tests/test_grading.py", "07_ddp_reducer")
    assert not change.keeps("tests/test_notebook_07.py")  # running the notebook never reads its submissions


def test_a_global_file_selects_everything_and_no_base_too():
    for path in ("tests/conftest.py", "course_grader/grade.py", "pyproject.toml"):
        assert sel.Selection("HEAD", {path}).everything
    assert sel.Selection(None).everything and sel.Selection(None).notebook_changed("00_orientation")
    assert sel.Selection("HEAD", set()).keeps("tests/test_pp.py") is False


def test_deepspeed_s_ops_are_built_for_the_tests_whose_code_can_start_it_only():
    # notebooks 09 and 10 start DeepSpeed's engine; 04 does not, and a test that reads notebooks as text runs none
    assert sel.needs_deepspeed_ops("tests/test_grading.py", "09_deepspeed_zero")
    assert sel.needs_deepspeed_ops("tests/test_student_path.py", "10_zero_offload")
    assert sel.needs_deepspeed_ops("tests/test_notebook_09.py")
    assert not sel.needs_deepspeed_ops("tests/test_grading.py", "04_activation_checkpointing")
    assert not sel.needs_deepspeed_ops("tests/test_notebook_04.py")
    assert not sel.needs_deepspeed_ops("tests/test_node_emulation.py", "", "test_16_runs_its_ring_on_8_ranks")
    assert not sel.needs_deepspeed_ops("tests/test_edition.py")  # it names 09 and the preflight, runs neither
    assert sel.needs_deepspeed_ops("tests/test_launch.py")  # it launches "course_lib.parallel.zero_deepspeed:train"


def test_a_module_named_as_text_is_reached_but_not_run():
    import ast

    tree = ast.parse('launch("course_lib.parallel.ddp_torch:train")\n'
                     'run([sys.executable, "-m", "course_lib.apps.preflight"])\n'
                     'assert "course_lib.parallel.zero" in printed\n')
    imported, named, _ = sel._reached(tree, "tests/test_x.py")
    assert "course_lib/parallel/ddp_torch.py" in imported and "course_lib/apps/preflight.py" in imported
    assert "course_lib/parallel/zero.py" in named and "course_lib/parallel/zero.py" not in imported


def test_the_base_is_the_recorded_commit_when_this_clone_has_it(monkeypatch):
    monkeypatch.setenv("COURSE_GATE_BASE", "HEAD~1")
    assert sel.base() == subprocess.run(["git", "rev-parse", "HEAD~1"], cwd=ROOT, capture_output=True,
                                        text=True).stdout.strip()
    monkeypatch.setenv("COURSE_GATE_BASE", "0" * 40)  # not a commit of this clone: everything runs
    assert sel.base() is None


def test_the_floor_runs_only_when_a_version_sensitive_test_is_reached():
    assert sel.floor(sel.Selection("HEAD", {EP})) == ([], [])
    tests, notebooks = sel.floor(sel.Selection("HEAD", {"course_lib/parallel/pp_torch.py"}))
    assert tests == ["tests/test_pp.py"] and notebooks == ["15_pipeline_parallelism"]
    assert sel.floor(sel.Selection(None)) == (list(sel.FLOOR_TESTS), list(sel.assignments()))


def test_under_gate_pytest_keeps_what_the_change_reaches_and_deselects_the_rest(tmp_path):
    """A clone whose only change since its base is one line in ep.py: pytest --gate collects test_ep whole, 16's
    grading of test_grading's assignments, and nothing of test_pp."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    subprocess.run(["git", "-C", str(clone), "checkout", "-q", subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()], check=True)
    for rel in ("tests/selection.py", "tests/conftest.py", "tests/nbgrading.py", "tests/recorded.py"):
        (clone / rel).write_text((ROOT / rel).read_text())  # this checkout's harness, committed or not
    subprocess.run(["git", "-C", str(clone), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(clone), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base",
                    "--allow-empty"], check=True)
    with (clone / EP).open("a") as f:
        f.write("\n# a change\n")
    env = {**os.environ, "COURSE_GATE_BASE": "HEAD"}
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "--gate", "-p", "no:cacheprovider",
                          "tests/test_ep.py", "tests/test_grading.py", "tests/test_pp.py"],
                         cwd=clone, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    kept = [line for line in out.stdout.splitlines() if "::" in line]
    assert kept and all("test_pp.py" not in k for k in kept)
    assert [k for k in kept if "test_grading.py" in k] == [
        "tests/test_grading.py::test_every_exercise_has_known_wrong_submissions_that_score_every_cell"
        "[17_expert_parallelism]",
        "tests/test_grading.py::test_no_known_wrong_submission_is_a_hand_copy_of_a_solution_cell"
        "[17_expert_parallelism]",
        "tests/test_grading.py::test_checks_grade_known_submissions[17_expert_parallelism]",
        "tests/test_grading.py::test_judges_refuse_mutated_data[17_expert_parallelism]"]
    assert len([k for k in kept if "test_ep.py" in k]) >= 8 and "deselected" in out.stdout


def test_the_gate_s_sample_of_gradings():
    """The reference, every library call, the attacks and one bundle of mistakes; each case runs the tests it can
    move only."""
    name = "07_ddp_reducer"
    solution = g.load_solution(name)
    points = g.grade_cells(solution)
    known, attacks = g.cases(name).CASES, g.attack_cases(name, solution, points)
    sample = g.sample(known, attacks, solution, points)
    members = {m for bundle in sample for m in bundle.split("__")}
    assert "reference" in sample and sample["reference"]["scores"] == points
    assert {n for n in known if n.startswith("calls_library_")} | set(attacks) <= members
    mistakes = {n for n in known if not n.startswith("calls_library_")}
    assert 0 < len(members & mistakes) < len(mistakes)  # one bundle of them, not all
    assert g.touched(sample["reference"], solution, points) == set(points)
    nb17 = g.load_solution("17_expert_parallelism")
    case = g.cases("17_expert_parallelism").CASES["capacity_ignored"]  # rewrites the expert-parallel cell
    assert g.touched(case, nb17, g.grade_cells(nb17)) == set(g.tests_of(nb17, "expert_parallel"))
