"""Build student submissions from the solutions and grade them: by calling the checks, or with nbgrader's autograde.

A submission is the released notebook with its solution cells filled in: from the reference solution, or from a
known-wrong replacement (tests/submissions/<assignment>.py), or left blank. ``checks_score`` grades one by calling
its checks (tests/test_grading.py); in a scratch course nbgrader's autograde grades them all in one call and the
gradebook gives each test cell's score (tests/test_instructor_flow.py).
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
from pathlib import Path

from course_grader.release import nbgrader

ROOT = Path(__file__).resolve().parent.parent
LOOP = "while True:  # a submission that never finishes\n    pass\n"


def cases(assignment: str) -> dict:
    """The module of known submissions for an assignment (its CASES)."""
    path = ROOT / "tests" / "submissions" / f"{assignment}.py"
    spec = importlib.util.spec_from_file_location(f"submissions_{assignment}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_solution(assignment: str) -> dict:
    return json.loads((ROOT / "solutions" / assignment / f"{assignment}.ipynb").read_text())


def checked_ids(nb: dict) -> set[str]:
    """The grade_ids of the test cells that call course_grader.checks (graded outside the kernel)."""
    return {c["metadata"]["nbgrader"]["grade_id"] for c in nb["cells"]
            if c["metadata"].get("nbgrader", {}).get("grade") and "check(" in cell_source(c)}


def strip_markers(source: str) -> str:
    return "\n".join(line for line in source.splitlines()
                     if line.strip() not in ("### BEGIN SOLUTION", "### END SOLUTION"))


def cell_source(cell) -> str:
    return cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])


def grade_cells(nb: dict) -> dict[str, int]:
    """grade_id → points of every autograded test cell."""
    return {c["metadata"]["nbgrader"]["grade_id"]: c["metadata"]["nbgrader"]["points"]
            for c in nb["cells"] if c["metadata"].get("nbgrader", {}).get("grade")}


def solution_cells(nb: dict) -> dict[str, str]:
    """grade_id → source of every solution cell."""
    return {c["metadata"]["nbgrader"]["grade_id"]: cell_source(c)
            for c in nb["cells"] if c["metadata"].get("nbgrader", {}).get("solution")}


def tests_of(nb: dict, solution_id: str) -> list[str]:
    """The test cells that follow a solution cell, up to the next solution cell."""
    out, inside = [], False
    for c in nb["cells"]:
        md = c["metadata"].get("nbgrader", {})
        if md.get("solution"):
            inside = md["grade_id"] == solution_id
        elif inside and md.get("grade"):
            out.append(md["grade_id"])
    return out


def submission(release: dict, solution: dict, replace: dict[str, str] | None = None, blank: bool = False,
               tamper: dict[str, str] | None = None) -> dict:
    """A student's notebook: the release with solution cells filled in (and test cells edited, for tamper)."""
    nb = copy.deepcopy(release)
    answers = {k: strip_markers(v) for k, v in solution_cells(solution).items()}
    for c in nb["cells"]:
        md = c["metadata"].get("nbgrader", {})
        gid = md.get("grade_id")
        if md.get("solution") and not blank:
            c["source"] = (replace or {}).get(gid, answers[gid])
        if md.get("grade") and tamper and gid in tamper:
            c["source"] = tamper[gid]
    return nb


def autograde(course: Path, assignment: str, cell_timeout: int = 20) -> str:
    """Autograde every submission of ``assignment``; what nbgrader logged (its warnings name restored test cells)."""
    proc = nbgrader(course, "autograde", assignment, "--force", env={"COURSE_CELL_TIMEOUT": str(cell_timeout)},
                    timeout=1800)
    return proc.stdout + proc.stderr


def scores(course: Path, assignment: str) -> dict[str, dict[str, float]]:
    """student → grade_id → score, read from the gradebook."""
    from nbgrader.api import Gradebook

    out = {}
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        for sub in gb.assignment_submissions(assignment):
            nb = sub.notebooks[0]
            out[sub.student_id] = {g.name: g.score for g in nb.grades}
    return out


def outputs(course: Path, assignment: str, student: str, grade_ids) -> str:
    """What the given cells printed when autograde ran this student's notebook (to explain a wrong score)."""
    path = course / "autograded" / student / assignment / f"{assignment}.ipynb"
    if not path.exists():
        return f"(no autograded notebook at {path})"
    text = []
    for c in json.loads(path.read_text())["cells"]:
        if c["metadata"].get("nbgrader", {}).get("grade_id") in grade_ids:
            text.append(f"--- {c['metadata']['nbgrader']['grade_id']}:")
            for o in c.get("outputs", []):
                if o["output_type"] == "stream":
                    text.append(o["text"] if isinstance(o["text"], str) else "".join(o["text"]))
                elif o["output_type"] == "error":
                    text.append("\n".join(o["traceback"]))
    return "\n".join(text)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def bundle(cases: dict[str, dict], solution: dict, points: dict[str, float]) -> dict[str, dict]:
    """Known-wrong submissions packed several to one autograded notebook (each autograde is a whole execution).

    A case that replaces some exercises' cells and loses points only on those exercises' own test cells
    shares a notebook with such cases that replace other exercises; that notebook must score each member's
    losses and full marks elsewhere. A case that moves another exercise's scores (its tests use this code)
    grades alone. Returns ``{name: {"cells": ..., "scores": ...}}``, a bundle named by its members joined by "__".
    """
    def alone(case):
        own = {t for cell in case["cells"] for t in tests_of(solution, cell)}
        return any(v != points[k] for k, v in case["scores"].items() if k not in own)

    packed: list[list[str]] = []
    for name, case in cases.items():
        home = None if alone(case) else next(
            (b for b in packed if not any(alone(cases[m]) or set(cases[m]["cells"]) & set(case["cells"]) for m in b)),
            None)
        packed.append([name]) if home is None else home.append(name)
    out = {}
    for members in packed:
        scores = dict(points)
        for m in members:
            scores.update({k: v for k, v in cases[m]["scores"].items() if v != points[k]})
        out["__".join(members)] = {"cells": {k: v for m in members for k, v in cases[m]["cells"].items()},
                                   "scores": scores}
    return out


def touched(case: dict, solution: dict, points: dict[str, float]) -> set[str]:
    """The test cells a case can move: those of the exercises it rewrites, and any it is expected to lose. The
    reference (no cell rewritten) touches every test."""
    own = {t for cell in case["cells"] for t in tests_of(solution, cell)}
    lost = {t for t, v in case["scores"].items() if v != points[t]}
    return (own | lost) if case["cells"] else set(points)


def reference_case(points: dict[str, float]) -> dict:
    """The reference solution as a case: no cell rewritten, full marks on every test cell."""
    return {"cells": {}, "scores": dict(points)}


def sample(known: dict[str, dict], attacks: dict[str, dict], solution: dict, points: dict[str, float]) -> dict:
    """The gate's sample of an assignment's gradings, bundled: the reference (full marks), every case that calls the
    library, the attacks, and the first bundle of the other known mistakes."""
    library = {n: c for n, c in known.items() if n.startswith("calls_library_")}
    mistakes = {n: c for n, c in known.items() if n not in library}
    first = dict(list(bundle(mistakes, solution, points).items())[:1])
    return {"reference": reference_case(points), **bundle({**library, **attacks}, solution, points), **first}


def attacks():
    """tests/submissions/attacks.py, loaded (it imports this module: no package holds them)."""
    spec = importlib.util.spec_from_file_location("submissions_attacks", ROOT / "tests" / "submissions" / "attacks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def attack_cases(assignment: str, solution: dict, points: dict[str, float]) -> dict[str, dict]:
    """The attacks of tests/submissions/attacks.py on an assignment, as known-wrong cases (0 on the tests they lose):
    those the sandbox stops, and where the tests are checks, those on the tests themselves."""
    mod = attacks()
    found = mod.cases(assignment, {ex: tests_of(solution, ex) for ex in solution_cells(solution)})
    out = {name: {"cells": a["cells"], "scores": {**points, **{t: 0 for t in a["loses"]}}}
           for name, a in found.items()}
    return {**out, **mod.on_the_tests(assignment)}


def checks_score(solution: dict, replace: dict[str, str], points: dict[str, float], server=None,
                 only: set[str] | None = None) -> dict[str, float]:
    """grade_id → score of the solution notebook with ``replace``'s solution cells, graded by calling its checks
    (course_grader.grade: the submission's code in a fenced child of ``server``, the judges here), without
    nbgrader. ``only``: grade these test cells alone."""
    from course_grader import grade

    # one fixed seed for the hidden cases, so a failure here replays; tests/test_grading_guard.py checks that grading
    # for credit draws a new one every time
    verdicts = grade.grade(submission(solution, solution, replace=replace), server=server, only=only, seed=1)
    return {k: (points[k] if v.passed else 0) for k, v in verdicts.items()}


def solution_run(assignment: str, server, seconds: int = 60) -> dict:
    """The reference solution graded by ``server`` once: its setup and solution cells, then every check's probe, in
    a fenced child; the raw ``{"results": {check: {"data": ...} | {"error": ...}}, "cell_errors": [...]}`` that
    ``grade.grade`` judges. Its data is what tests/fuzzing.py rewrites."""
    from course_grader import grade

    solution = load_solution(assignment)
    nb = submission(solution, solution)
    names = [n for ns in grade.checked_cells(nb).values() for n in ns]
    return server.run(grade.cells_to_run(nb), names, seconds)


def run_scores(solution: dict, out: dict, points: dict[str, float]) -> dict[str, float]:
    """grade_id → score of a grading's raw output (``solution_run``), judged here as ``grade.grade`` judges it: a
    test cell scores where every check it calls passes."""
    from course_grader import grade

    results, errors = out.get("results", {}), out.get("cell_errors", [])
    return {gid: points[gid] if all(grade.judge(n, results.get(n), errors).passed for n in names) else 0
            for gid, names in grade.checked_cells(solution).items()}


def gradebook_rows(course: Path) -> dict[tuple[str, str, str], tuple]:
    """Every grade in the gradebook: (assignment, student, grade cell) → (auto score, manual score, extra credit)."""
    from nbgrader.api import Gradebook

    out = {}
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        for assignment in gb.assignments:
            for sub in gb.assignment_submissions(assignment.name):
                for nb in sub.notebooks:
                    for grade in nb.grades:
                        out[assignment.name, sub.student_id, grade.name] = (grade.auto_score, grade.manual_score,
                                                                             grade.extra_credit)
    return out


def add_bystander(course: Path, assignment: str, student: str = "bystander") -> None:
    """A student graded before this run (half marks on every cell), whose grades no later autograde may change."""
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        gb.update_or_create_student(student)
        with gb.db.no_autoflush:  # else SQLAlchemy warns while nbgrader builds the submission's grades
            sub = gb.add_submission(assignment, student)
        for nb in sub.notebooks:
            for grade in nb.grades:
                grade.auto_score = grade.max_score / 2
                grade.needs_manual_grade = False
        gb.db.commit()
