"""The instructor's flow end to end, with nbgrader's real commands and a real exchange folder: the one whole autograde.

A course made by course_grader.release.make_course from solutions/ (generate_assignment), less its long demonstrations
(the cells tagged "demo", as make_course's exercise-only course leaves them out), releases 00_orientation, the
cheapest notebook, into a temporary exchange (release_assignment). The students fetch it
(fetch_assignment), put in their answers (built like tests/nbgrading.py does) and submit (submit). The
instructor collects (collect), autogrades with a per-cell timeout, generates and releases feedback, the students
fetch it (fetch_feedback), and the grades are exported to CSV (export).

This is the suite's one whole-notebook autograde: what autograde adds over calling the checks
(tests/test_grading.py grades every notebook's known-wrong submissions so) is the same for every notebook, and each
student here proves one part of it. ada: the reference (full marks); ben: a wrong answer with a test cell he fails
edited to pass (autograde restores the cell: he scores what his code deserves), and another exercise that never
finishes (the cell timeout stops it; only its own test cells lose points); mal0 and mal1: the attacks on the grading
kernel and on the tests (tests/submissions/attacks.py: writing the gradebook, rebinding the tests' helpers, patching
their judges, swallowing later errors), several exercises wrong in one notebook, each losing only its own points; and
zoe, graded before, whose grades the gradebook attack tries to raise and must not change. (That the untouched release
scores zero is the checks' own test, tests/test_checks.py: autograde's scores are the checks'.) Checked: every
student's score per test cell and in total, the feedback each one gets back, the CSV, that no submitted file changed
while it was graded, and that no other student's grade moved.
"""

from __future__ import annotations

import csv
import html
import json
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import nbgrading as g
from course_grader.release import make_course, nbgrader

ROOT = Path(__file__).resolve().parent.parent
ASSIGNMENT = "00_orientation"
COURSE_ID = "scaling-pytorch-training"  # nbgrader_config.py
CELL_TIMEOUT = 20  # seconds per cell while autograding (COURSE_CELL_TIMEOUT, read by nbgrader_config.py)
BYSTANDER = "zoe"  # graded before this run, with half marks on every cell (nbgrading.add_bystander)
# what the submissions whose grading the audit hook reports carry (tests/submissions/attacks.py, FLAGGED)
FLAG_MARKS = ("inspect.getsource(course_lib.memory", "course_grader.grading._swap_in.__code__")


def bens_edited_test() -> str:
    """The test cell ben edits to pass: the one his wrong answer (lm_head counted when tied) fails."""
    return next(k for k, v in g.cases(ASSIGNMENT).CASES["lm_head_counted_when_tied"]["scores"].items() if v == 0)


def students(release: dict, solution: dict) -> dict[str, tuple[dict, dict[str, int]]]:
    """student id → (their notebook, the points each test cell must give it)."""
    known = g.cases(ASSIGNMENT).CASES
    points = g.grade_cells(solution)
    assert points == g.cases(ASSIGNMENT).FULL and sum(points.values()) == 10
    tied = known["lm_head_counted_when_tied"]  # passes the visible test, fails the hidden one
    failed = bens_edited_test()
    assert "training_memory" not in tied["cells"], "ben's loop is in another exercise than his wrong answer"
    cohort = {
        "ada": (g.submission(release, solution), points),
        # Exercise 1 wrong, with its failed test cell edited to pass; Exercise 2 never finishes: the cell timeout
        # stops it, and only its two test cells score 0 beside what Exercise 1's wrong answer loses
        "ben": (g.submission(release, solution, replace={**tied["cells"], "training_memory": g.LOOP},
                             tamper={failed: "print('all tests passed')\n"}),
                {**tied["scores"], "test_training_memory": 0, "test_training_memory_hidden": 0}),
    }
    # the attacks on the kernel and on the tests, several to a notebook where they touch different exercises; the
    # copies of the reference and the reads of solutions/ are the checks' to stop (test_checks_grade_known_submissions)
    attacks = {n: a for n, a in g.attack_cases(ASSIGNMENT, solution, points).items()
               if not n.startswith(("copy_reference_", "read_solutions_"))}
    assert "write_gradebook" in attacks, "the gradebook attack is aimed at this assignment (attacks.GRADEBOOK_...)"
    for i, case in enumerate(g.bundle(attacks, solution, points).values()):
        cohort[f"mal{i}"] = (g.submission(release, solution, replace=case["cells"]), case["scores"])
    return cohort


def test_release_collect_autograde_feedback_export(tmp_path):
    timings = {}
    clock = time.perf_counter()

    def lap(step):
        nonlocal clock
        timings[step] = time.perf_counter() - clock
        clock = time.perf_counter()

    # the course: the project's nbgrader config and this assignment's source (generate_assignment runs in it)
    src = tmp_path / "src"
    (src / "solutions").mkdir(parents=True)
    shutil.copy(ROOT / "nbgrader_config.py", src / "nbgrader_config.py")
    shutil.copytree(ROOT / "solutions" / ASSIGNMENT, src / "solutions" / ASSIGNMENT)
    # without the cells tagged "demo" (00's: one training step of bert-base-cased in fp32 and under bf16 autocast, about
    # 13 s of every student's autograde on a CPU without bf16 kernels): what this test proves is the same without them
    course = make_course(tmp_path / "course", root=src, drop_tags=("demo",))
    release_nb = course / "release" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb"
    release = json.loads(release_nb.read_text())
    solution = json.loads((course / "solutions" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb").read_text())
    text = release_nb.read_text()
    assert "BEGIN SOLUTION" not in text and "BEGIN HIDDEN TESTS" not in text, "no solution, no hidden test"
    assert not any("demo" in c.get("metadata", {}).get("tags", []) for c in release["cells"]), "the demos are left out"
    stubs = g.solution_cells(release)
    assert stubs and all("raise NotImplementedError()" in v for v in stubs.values())
    lap("generate_assignment")

    exchange = tmp_path / "exchange"
    exchange.mkdir()
    ex = [f"--Exchange.root={exchange}"]
    nbgrader(course, "release_assignment", ASSIGNMENT, *ex)
    lap("release_assignment")

    # students: fetch, answer, submit, each in their own home as on a JupyterHub (in parallel: each
    # nbgrader command spends seconds importing, and the students do not share anything)
    cohort = students(release, solution)

    def student_side(student: str) -> bytes:
        home = tmp_path / "students" / student
        home.mkdir(parents=True)
        args = [f"--course={COURSE_ID}", *ex]
        nbgrader(home, "fetch_assignment", ASSIGNMENT, *args, env=_home(home))
        mine = home / ASSIGNMENT / f"{ASSIGNMENT}.ipynb"
        assert json.loads(mine.read_text()) == release, "the fetched notebook is the release"
        mine.write_text(json.dumps(cohort[student][0], indent=1))
        nbgrader(home, "submit", ASSIGNMENT, f"--student={student}", *args, env=_home(home))
        return mine.read_bytes()

    with ThreadPoolExecutor(max_workers=3) as pool:
        sent = dict(zip(cohort, pool.map(student_side, cohort)))
    lap("fetch+submit (4 students)")

    nbgrader(course, "collect", ASSIGNMENT, *ex)
    submitted = {s: course / "submitted" / s / ASSIGNMENT / f"{ASSIGNMENT}.ipynb" for s in cohort}
    for s, path in submitted.items():
        assert path.read_bytes() == sent[s], f"collect changed {s}'s notebook"
    before = {s: g.digest(p) for s, p in submitted.items()}
    others = {p: g.digest(p) for p in (course / "submitted").rglob("*") if p.is_file()}
    g.add_bystander(course, ASSIGNMENT, BYSTANDER)  # graded earlier: the gradebook attack tries to raise these
    grades_before = g.gradebook_rows(course)
    lap("collect")

    log = g.autograde(course, ASSIGNMENT, CELL_TIMEOUT)
    lap("autograde")
    # a restored test cell is reported only where a student edited it: ben's, never a hidden test cell as released
    # what the grading process's audit hook saw is in the instructor's report: the log and each graded notebook
    flagged = {s for s, (nb, _) in cohort.items() if any(f in json.dumps(nb) for f in FLAG_MARKS)}
    reported = {s for s in cohort if "course_grading_reports" in json.loads(
        (course / "autograded" / s / ASSIGNMENT / f"{ASSIGNMENT}.ipynb").read_text())["metadata"]}
    assert flagged and reported == flagged, f"flagged {sorted(reported)}, expected {sorted(flagged)}"
    assert "FLAGGED" in log and "the source of a forbidden answer" in log and "_swap_in" in log
    changed = re.findall(r"Attribute '(\w+)' for cell (\w+) has changed", log)
    assert {cell for _, cell in changed} == {bens_edited_test()}, changed
    assert "not recognized" not in log, [ln for ln in log.splitlines() if "not recognized" in ln]
    got = g.scores(course, ASSIGNMENT)
    for s, (_, expected) in cohort.items():
        wrong = [k for k in expected if got[s].get(k) != pytest.approx(expected[k])]
        assert not wrong, (f"{s}: {wrong} scored {[got[s].get(k) for k in wrong]}, expected "
                           f"{[expected[k] for k in wrong]}; what those cells printed:\n"
                           + g.outputs(course, ASSIGNMENT, s, wrong))
    totals = {s: float(sum(expected.values())) for s, (_, expected) in cohort.items()}
    grades_after = g.gradebook_rows(course)
    bystander = {k: v for k, v in grades_before.items() if k[1] == BYSTANDER}
    assert bystander and {k: grades_after.get(k) for k in bystander} == bystander, "an attack changed another's grades"
    by_hand = {k: v for k, v in grades_after.items() if k[1] in cohort and (v[1] is not None or v[2])}
    assert not by_hand, f"manual scores or extra credit appeared during autograde: {by_hand}"
    # the looping student was stopped by the cell timeout: their graded notebook says so
    looped = json.loads((course / "autograded" / "ben" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb").read_text())
    assert "CellTimeoutError" in json.dumps(looped) or "timed out" in json.dumps(looped).lower()

    nbgrader(course, "generate_feedback", ASSIGNMENT)
    nbgrader(course, "release_feedback", ASSIGNMENT, *ex)
    lap("generate+release_feedback")
    for s, total in totals.items():
        report = course / "feedback" / s / ASSIGNMENT / f"{ASSIGNMENT}.html"
        assert report.exists(), f"no feedback for {s}"
        assert _score(report) == (total, 10.0), f"{s}'s feedback shows {_score(report)}, expected {total} / 10"

    def fetch_feedback(student: str) -> list[Path]:
        home = tmp_path / "students" / student
        nbgrader(home, "fetch_feedback", ASSIGNMENT, f"--student={student}", f"--course={COURSE_ID}", *ex,
                 env=_home(home))
        return list((home / ASSIGNMENT / "feedback").rglob(f"{ASSIGNMENT}.html"))

    with ThreadPoolExecutor(max_workers=3) as pool:
        for s, fetched in zip(totals, pool.map(fetch_feedback, totals)):
            assert len(fetched) == 1 and _score(fetched[0]) == (totals[s], 10.0), f"{s} fetched {fetched}"
    lap("fetch_feedback (4 students)")

    grades = tmp_path / "grades.csv"
    nbgrader(course, "export", "--to", str(grades))
    lap("export")
    with open(grades) as f:
        rows = {r["student_id"]: r for r in csv.DictReader(f) if r["assignment"] == ASSIGNMENT}
    assert set(rows) == {*cohort, BYSTANDER}
    assert {s: float(r["raw_score"]) for s, r in rows.items()} == pytest.approx({**totals, BYSTANDER: 5.0})
    assert {float(r["max_score"]) for r in rows.values()} == {10.0}

    # grading wrote to autograded/, feedback/ and the gradebook, never into submitted/
    assert {s: g.digest(p) for s, p in submitted.items()} == before, "grading changed a submitted notebook"
    assert {p: g.digest(p) for p in (course / "submitted").rglob("*") if p.is_file()} == others
    print("instructor flow: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()))


def _home(home: Path) -> dict:
    """A student's environment: their own home, and no nbgrader config but the exchange given on the line."""
    return {"HOME": str(home), "JUPYTER_CONFIG_DIR": str(home / ".jupyter")}


def _score(report: Path) -> tuple[float, float]:
    """(score, max) from the header of an nbgrader feedback page."""
    text = html.unescape(re.sub(r"<[^>]+>", " ", report.read_text()))
    m = re.search(r"Score:\s*([\d.]+)\s*/\s*([\d.]+)", text)
    assert m, f"no 'Score: x / y' in {report}"
    return float(m.group(1)), float(m.group(2))
