"""Grading: every notebook's known submissions, graded by calling its checks.

Every test cell of every notebook calls ``check(...)`` (course_grader.checks): its score is judged outside the
kernel, from data a fenced child process returns. So the known-wrong submissions and the attacks of every
notebook are graded here by calling the checks (``test_checks_grade_known_submissions``, seconds each), without
nbgrader. What nbgrader's autograde adds over that path (the collection, the restored test cells, the kernel's
sandbox and timeout, the gradebook, the export) is the same for every notebook: tests/test_instructor_flow.py runs
it whole, once, on 00 through nbgrader's exchange, with a tampered test cell, a loop, the attacks on the kernel and
a bystander's grades; tests/test_sandbox.py starts ranks inside the grading kernel. Grading never changes a
submitted file.
"""

from __future__ import annotations

import time

import pytest

import fuzzing
import nbgrading as g
from course_grader.release import assignments

# Grading rule 2 (README, "What the exercises grade"): every exercise of every notebook has a known-wrong
# submission named calls_library_<exercise> that calls course_lib's counterpart, and it must score 0 on every
# test of that exercise (the tests run the student's code inside course_grader.grading.forbid).


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


@pytest.mark.parametrize("assignment", assignments())
def test_no_known_wrong_submission_is_a_hand_copy_of_a_solution_cell(assignment):
    """A mistake is an edit of today's solution cell (tests/solved.py): a code string written into the submissions
    file that is most of a solution cell is a copy, which drifts from the solution it meant to break."""
    import ast
    import difflib

    tree = ast.parse((g.ROOT / "tests" / "submissions" / f"{assignment}.py").read_text())
    cells = {k: g.strip_markers(v).strip() for k, v in g.solution_cells(g.load_solution(assignment)).items()}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for cell, text in cells.items():
                ratio = difflib.SequenceMatcher(None, node.value.value.strip(), text).ratio()
                assert ratio < 0.75, (f"{assignment}: {ast.unparse(node.targets[0])} is {ratio:.0%} of the solution "
                                      f"cell {cell}: derive it with solved.solution and solved.edit")


@pytest.fixture(scope="module")
def server():
    """One grading server for every assignment this worker grades, with every notebook's hidden checks loaded: it
    imports torch, course_lib and the checks once (10-20 s), where grading one assignment starts one of its own."""
    from course_grader import checks
    from course_grader import grade

    checks.load_all()
    running = grade.Server(grade.hidden_modules(list(checks.REGISTRY)))
    yield running
    running.close()


@pytest.fixture(scope="module")
def reference(server):
    """``reference(assignment)``: the raw output of the reference solution graded once on ``server``
    (``nbgrading.solution_run``: its cells and every probe). The reference case of
    ``test_checks_grade_known_submissions`` is judged from it, and ``test_judges_refuse_mutated_data`` rewrites its
    data: one execution of the notebook serves both (each test of an assignment runs on the same worker)."""
    runs: dict[str, dict] = {}

    def run(assignment: str) -> dict:
        if assignment not in runs:
            runs[assignment] = g.solution_run(assignment, server)
        return runs[assignment]

    return run


@pytest.mark.parametrize("assignment", assignments())
def test_checks_grade_known_submissions(assignment, server, reference, gate):
    """Every known-wrong submission and every attack, graded by calling the assignment's checks (its code in a
    fenced child process, each judge in this one): the scores its case expects. The child is fenced as the kernel
    is, so a copied reference is a stub and solutions/ cannot be read there either.

    Known-wrong cases and attacks that lose points only on their own exercise's tests are graded several to one
    submission (``nbgrading.bundle``: each grading runs every probe), one case per exercise: each must still lose
    exactly its own points, and the others keep full marks beside it. Only the test cells a case can move run
    (``nbgrading.touched``: the exercises it rewrites, and the tests it is expected to lose). (What this cannot see:
    a case that spoils another exercise's test which it is not expected to lose.) The reference solution is graded
    too, full marks on every test (the ``reference`` fixture's run, which the fuzz below reuses). The gate
    (``make test``), for a change that reaches this notebook only through the grader's core, grades a sample
    (``nbgrading.sample``): the reference, the library calls, the attacks and one bundle of mistakes; every case
    runs when the notebook's own files changed."""
    solution = g.load_solution(assignment)
    points = g.grade_cells(solution)
    known, attacks = g.cases(assignment).CASES, g.attack_cases(assignment, solution, points)
    if gate is not None and not gate.notebook_changed(assignment):  # the gate, for a change outside this notebook
        cases = g.sample(known, attacks, solution, points)
    else:
        cases = {"reference": g.reference_case(points), **g.bundle({**known, **attacks}, solution, points)}
    wrong = {}
    for name, case in cases.items():
        tests = g.touched(case, solution, points)  # the probes of the other exercises never start
        if not case["cells"]:  # the reference: graded once, its data kept for the fuzz
            got = g.run_scores(solution, reference(assignment), points)
        else:
            got = g.checks_score(solution, case["cells"], points, server, only=tests)  # every test cell calls check()
        want = {k: v for k, v in case["scores"].items() if k in tests}
        if got != want:
            wrong[name] = {k: (got.get(k), v) for k, v in want.items() if got.get(k) != v}
    assert not wrong, f"{assignment}: (got, expected) where they differ: {wrong}"


@pytest.mark.parametrize("assignment", assignments())
def test_judges_refuse_mutated_data(assignment, reference):
    """Issue 44, item 3: a probe's data comes from the student's process, which can rewrite it before the grader reads
    it. Every judge, fed the reference solution's data rewritten (``fuzzing.families()``: every list emptied, every
    list shortened by its last item, every float and float tensor NaN, place by place; where the grader validates
    the data first, a float tensor replaced by a stride-0 view of 2**27 elements, and a tensor made non-contiguous),
    refuses every rewrite that changes the data (a rewrite of the layout alone reaches the judge as the original's
    data). The data is the ``reference`` fixture's, which the grading above judged already: no notebook runs here.
    Adding one integer to every int is no family: many judges rightly take a count within a slack (bytes held, the
    micro-batches in flight)."""
    from course_grader import grade

    results, started, accepted = reference(assignment)["results"], time.perf_counter(), {}
    assert results, f"{assignment}: the reference's grading returned no data"
    for name, result in results.items():
        verdict = grade.judge(name, result, [])
        assert verdict.passed, f"{name}: the reference's own data fails its judge: {verdict.message}"
        taken = fuzzing.accepted(name, result["data"], result.get("wire"))
        if taken:
            accepted[name] = taken[:5] + ([f"... {len(taken) - 5} more"] if len(taken) > 5 else [])
    assert not accepted, f"{assignment}: judges that pass rewritten data (judge: rewrites): {accepted}"
    print(f"{assignment}: {len(results)} judges fuzzed in {time.perf_counter() - started:.1f} s")
