"""Grading: every notebook's known submissions by its checks, and nbgrader's real autograde on two of them.

Every test cell of every notebook calls ``check(...)`` (course_lib.checks): its score is judged outside the
kernel, from data a fenced child process returns. So the known-wrong submissions and the attacks of every
notebook are graded by calling the checks (``test_checks_grade_known_submissions``, seconds each), and the whole
pipeline, nbgrader's autograde with the sandboxed kernel and ``GradeByChecks``, runs on two notebooks that
prove it (``PIPELINE``): 03, whose code runs in one process and whose attacks include writing the gradebook, and
06, whose tests start ranks. What autograde adds over the direct path is the same for every notebook (the
collection, the restored test cells, the kernel's timeout, the gradebook), and the instructor-flow test runs it
once more on 00 with nbgrader's exchange.

On each of those two, one autograde run grades: the reference solution (full marks), the untouched release (zero
on every test cell), a wrong submission with one of its failed test cells edited to pass (autograde restores the
cell, so it scores what the wrong code deserves), one that loops forever in one exercise (it loses only that
exercise's cells, within the cell timeout), and the attacks on the kernel itself (tests/submissions/attacks.py:
swallowing every later cell's errors, rebinding the tests' helpers, writing the gradebook, whose other students'
rows must not change). Grading never changes a submitted file.

The course graded here is exercise-only: cells tagged ``demo`` (long demonstrations that no test
cell reads, such as notebook 06's torchrun launch) are left out of it, because autograde
re-runs the whole notebook for every submission. The test_notebook_NN tests execute those cells,
and the instructor-flow test grades complete notebooks.
"""

from __future__ import annotations

import csv
import json
import time

import pytest

import nbgrading as g
from course_lib.release import assignments, make_course, nbgrader

CELL_TIMEOUT = 20  # seconds per cell; a submissions module may ask for more (cells that launch processes)
# Grading rule 2 (README, "What the exercises grade"): every exercise of every notebook has a known-wrong
# submission named calls_library_<exercise> that calls course_lib's counterpart, and it must score 0 on every
# test of that exercise (the tests run the student's code inside course_lib.grading.forbid).




@pytest.mark.parametrize("assignment", assignments())
def test_every_exercise_has_known_wrong_submissions_that_score_every_cell(assignment):
    """Grading rule 2 holds for every exercise: a ``calls_library_<exercise>`` submission calls course_lib and is
    expected to score 0 on that exercise's tests; every case lists every test cell."""
    solution = g.load_solution(assignment)
    points = g.grade_cells(solution)
    known = g.cases(assignment)
    assert len(known.CASES) >= 2, "each notebook needs at least two known-wrong submissions"
    for exercise in g.solution_cells(solution):
        case = known.CASES.get(f"calls_library_{exercise}")
        assert case, f"{assignment}: no known-wrong submission calls_library_{exercise} (the library's answer)"
        assert "course_lib" in "".join(case["cells"].values()), f"calls_library_{exercise} must call course_lib"
        assert all(case["scores"][t] == 0 for t in g.tests_of(solution, exercise)), \
            f"calls_library_{exercise} must be expected to score 0 on {g.tests_of(solution, exercise)}"
    for name, case in known.CASES.items():
        assert set(case["scores"]) == set(points), f"{name}: scores must list every test cell {sorted(points)}"
    assert set(g.checked_ids(solution)) == set(points), "every test cell is a check (scored outside the kernel)"


PIPELINE = ("03_gradient_accumulation", "06_ddp")


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    return make_course(tmp_path_factory.mktemp("grading") / "course", drop_tags=("demo",), only=PIPELINE)


@pytest.mark.parametrize("assignment", PIPELINE)
def test_autograde_known_submissions(course, assignment):
    solution = json.loads((course / "solutions" / assignment / f"{assignment}.ipynb").read_text())
    release = json.loads((course / "release" / assignment / f"{assignment}.ipynb").read_text())
    points = g.grade_cells(solution)
    known = g.cases(assignment)
    expected = {"solution": points, "release": {k: 0 for k in points}}
    subs = {"solution": g.submission(release, solution), "release": g.submission(release, solution, blank=True)}
    bundles = g.bundle(known.CASES, solution, points)
    for name, case in bundles.items():
        subs[name] = g.submission(release, solution, replace=case["cells"])
        expected[name] = case["scores"]

    # Tamper: a wrong submission with a test cell it fails replaced by one that always passes; graded only
    # in this form (autograde restores the cell, so it must score what the wrong code deserves).
    name, case = next((n, c) for n, c in bundles.items() if 0 in c["scores"].values())
    failed = next(k for k, v in case["scores"].items() if v == 0)
    subs["tampered_" + name] = g.submission(release, solution, replace=case["cells"],
                                            tamper={failed: "print('all tests passed')\n"})
    expected["tampered_" + name] = expected.pop(name)
    del subs[name]

    # Loop: one exercise never finishes; only its own test cells lose points. It rides on another wrong
    # submission that leaves that exercise alone, whose other scores must survive the loop.
    loses = g.tests_of(solution, known.LOOP_CELL)
    assert loses, f"LOOP_CELL {known.LOOP_CELL!r} has no test cells after it"
    # (A notebook with one exercise has no such submission: its loop rides on the reference solution.)
    name, case = next(((n, c) for n, c in bundles.items()
                       if n in subs and known.LOOP_CELL not in c["cells"]
                       and any(v for k, v in c["scores"].items() if k not in loses)), ("solution", {"cells": {}}))
    subs["loops_" + name] = g.submission(release, solution, replace={**case["cells"], known.LOOP_CELL: g.LOOP})
    expected["loops_" + name] = {k: (0 if k in loses else v) for k, v in expected[name].items()}
    if name != "solution":
        del subs[name], expected[name]

    # Where the tests are checks, the known-wrong submissions are graded by calling them (test_checks_grade_...);
    # autograde keeps the tampered and the looping ones, whose expected scores are the same on both paths.
    # (A test cell still written inline is graded by autograde alone: a bundle that loses points there stays.)
    checked = g.checked_ids(solution)
    for name in [n for n in bundles if n in subs and checked]:
        if all(k in checked for k, v in expected[name].items() if v != points[k]):
            del subs[name], expected[name]

    # Attacks (issue 22): one notebook attacks every exercise at once (each attack loses only its exercise's tests)
    attacks = g.attack_cases(assignment, solution, points)
    # where scores come from the checks' fenced child, the direct test grades the copies and the reads
    attacks = {n: a for n, a in attacks.items() if not n.startswith(("copy_reference_", "read_solutions_"))
               or not all(k in checked for k, v in a["scores"].items() if v != points[k])}
    for i, case in enumerate(g.bundle(attacks, solution, points).values()):
        subs[f"attacks{i or ''}"] = g.submission(release, solution, replace=case["cells"])
        expected[f"attacks{i or ''}"] = case["scores"]
    if "write_gradebook" in attacks:  # someone graded earlier, whose grades the attack tries to raise
        g.add_bystander(course, assignment)
    grades_before = g.gradebook_rows(course)

    paths = {student: g.submit(course, assignment, student, nb) for student, nb in subs.items()}
    before = {student: g.digest(p) for student, p in paths.items()}
    start = time.perf_counter()
    g.autograde(course, assignment, getattr(known, "CELL_TIMEOUT", CELL_TIMEOUT))
    seconds = time.perf_counter() - start
    got = g.scores(course, assignment)
    grades_after = g.gradebook_rows(course)

    for student in subs:
        wrong = [k for k in expected[student] if got[student].get(k) != pytest.approx(expected[student][k])]
        assert not wrong, (f"{assignment} / {student}: {wrong} scored {[got[student].get(k) for k in wrong]}, expected "
                           f"{[expected[student][k] for k in wrong]}; what those cells printed:\n"
                           + g.outputs(course, assignment, student, wrong))
    assert {s: g.digest(p) for s, p in paths.items()} == before, "autograde changed a submitted notebook"
    others = {k: v for k, v in grades_before.items() if not (k[0] == assignment and k[1] in subs)}
    changed = {k: (v, grades_after.get(k)) for k, v in others.items() if grades_after.get(k) != v}
    assert not changed, f"grading {assignment} changed other students' grades (before, after): {changed}"
    by_hand = {k: v for k, v in grades_after.items() if k[0] == assignment and k[1] in subs and (v[1] is not None or v[2])}
    assert not by_hand, f"manual scores or extra credit appeared during autograde: {by_hand}"
    print(f"{assignment}: {len(subs)} submissions autograded in {seconds:.0f} s")

    # export: the grades file has each student's total of its test cells for this assignment
    nbgrader(course, "export", "--to", str(course / f"grades_{assignment}.csv"))
    with open(course / f"grades_{assignment}.csv") as f:
        rows = {r["student_id"]: float(r["raw_score"]) for r in csv.DictReader(f) if r["assignment"] == assignment}
    assert {s: rows[s] for s in expected} == pytest.approx({s: sum(v.values()) for s, v in expected.items()})


@pytest.mark.parametrize("assignment", [a for a in assignments() if g.checked(g.load_solution(a))])
def test_checks_grade_known_submissions(assignment, deepspeed_ops):
    """Every known-wrong submission and every attack, graded by calling the assignment's checks (its code in a
    fenced child process, each judge in this one): the scores its case expects. The child is fenced as the kernel
    is, so a copied reference is a stub and solutions/ cannot be read there either.

    Known-wrong cases that lose points only on their own exercise's tests are graded several to one submission
    (``nbgrading.bundle``, as autograde does: each grading runs every probe), one case per exercise: each must
    still lose exactly its own points, and the others keep full marks beside it. (What this cannot see: a case
    that also spoils another exercise's test which its partner loses anyway.) Attacks grade alone."""
    solution = g.load_solution(assignment)
    points = g.grade_cells(solution)
    cases = {**g.bundle(g.cases(assignment).CASES, solution, points), **g.attack_cases(assignment, solution, points)}
    wrong = {}
    for name, case in cases.items():
        got = g.checks_score(solution, case["cells"], points)  # the test cells that call check(): the others
        want = {k: v for k, v in case["scores"].items() if k in got}  # are autograde's (test_autograde_...)
        if got != want:
            wrong[name] = {k: (got.get(k), v) for k, v in want.items() if got.get(k) != v}
    assert not wrong, f"{assignment}: (got, expected) where they differ: {wrong}"
