"""The student's path (course_grader.student_path): the student edition, validated as a student's Validate does.

CI runs it whole on the floor (``.ci/floor``: every notebook with a correct student's answers, on torch 2.7, must
say "Success"). Here: what a student's Validate is configured with, what a correct student's notebook holds, how an
exercise not written yet reads, and the untouched release failing Validate at every exercise of every notebook.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import nbgrading as g
from course_grader import checks, student_path as sp
from course_grader.edition import build_student_edition
from course_grader.release import assignments

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def edition(tmp_path_factory) -> Path:
    return build_student_edition(tmp_path_factory.mktemp("student") / "edition")


def test_validate_in_the_student_edition_has_the_course_s_cell_limits(edition, tmp_path):
    """The Validate button's own configuration code, run where the student's lab runs, finds the student-lab
    config: 60 s a cell, 20 s a solution cell (nbgrader's default is 30 s for every cell), as autograde has."""
    from nbgrader.server_extensions.validate_assignment.handlers import ValidateAssignmentHandler

    with sp.student_process(edition, tmp_path):
        config = ValidateAssignmentHandler.load_config(None)
    solution = {"metadata": {"nbgrader": {"solution": True}}}
    cell = type("Cell", (), {"metadata": {"nbgrader": {"grade": True}}})
    assert config.Execute.timeout == 60 and config.Execute.iopub_timeout == 60 and config.Execute.interrupt_on_timeout
    assert config.Execute.timeout_func(cell) == 60
    assert config.Execute.timeout_func(type("Cell", (), solution)) == 20


def test_a_correct_student_s_notebook_is_the_release_with_the_solutions_written_in(edition):
    name = "15_pipeline_parallelism"
    release = json.loads((edition / "notebooks" / f"{name}.ipynb").read_text())
    solution = g.load_solution(name)
    filled = sp.filled(release, solution)
    assert len(filled["cells"]) == len(release["cells"])
    answers = {sp.nbgrader_meta(c).get("grade_id"): "".join(c["source"]) for c in solution["cells"]}
    written = 0
    for before, after in zip(release["cells"], filled["cells"]):
        if sp.nbgrader_meta(before).get("solution"):
            src = "".join(after["source"])
            assert "raise NotImplementedError()" in "".join(before["source"]) and "NotImplementedError()" not in src
            unmarked = re.sub(r"^ *### (BEGIN|END) SOLUTION *\n?", "", answers[sp.nbgrader_meta(before)["grade_id"]],
                              flags=re.M)
            assert src.rstrip() == unmarked.rstrip() and "### " not in src
            written += 1
        else:
            assert after == before  # test cells untouched: their checksums still hold
    assert written == 2
    assert sp.exercises(solution) == {
        "one_f_one_b_order": {"names": ["one_f_one_b_order"],
                              "tests": ["test_one_f_one_b_order", "test_one_f_one_b_order_measured"]},
        "run_1f1b": {"names": ["run_1f1b"], "tests": ["test_run_1f1b", "test_run_1f1b_activations"]}}


def test_an_exercise_not_written_yet_is_named_by_its_test():
    def dispatch(tokens):
        raise NotImplementedError()

    class LoRALinear:
        def __init__(self):
            raise NotImplementedError()

    def probe(ns):
        return ns["fn"]()

    checks.register("test_unwritten_example", probe, lambda data: "passed")
    try:
        for fn, name in ((dispatch, "dispatch"), (LoRALinear, "LoRALinear")):
            with pytest.raises(AssertionError,
                               match=rf"{name} is not written yet .*replace `raise NotImplementedError"):
                checks.check("test_unwritten_example", {"fn": lambda fn=fn: fn(None) if fn is dispatch else fn()})
        got = checks.outcome(dispatch, None)
        assert got["raised"] == "NotImplementedError" and "dispatch is not written yet" in got["message"]
        library = NotImplementedError("course_lib.x.y is written in notebook 07's exercise z")  # named already
        assert checks.error_text(library) == f"NotImplementedError: {library}"
    finally:
        del checks.REGISTRY["test_unwritten_example"]


@pytest.mark.parametrize("name", assignments())
def test_the_untouched_release_fails_validate_at_every_exercise_naming_it(name, edition, tmp_path):
    """A notebook of the release, as it ships (demonstrations left out), through Validate: every visible test of
    every exercise fails, and its message names a function or class of that exercise."""
    problems = sp.check_blank(name, edition, tmp_path)
    assert not problems, problems
