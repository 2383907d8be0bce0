#!/usr/bin/env python3
"""The checks that docker/images_check.sh runs on the workshop images it built FROM stand-in bases.

    podman save --format docker-archive IMAGE | python docker/images_check.py scan-student
        every layer of the student image: no solutions/, tests/, nbgrader_config.py, *_hidden.py or other instructor
        file (course_grader/edition.py's student edition leaves them out), and every graded reference of course_lib
        (edition.graded_references: the ``# graded:`` markers of this checkout) a stub, in every layer that holds it
    python docker/images_check.py student-lab --container NAME --work DIR --url URL --token TOKEN
        the running student container: JupyterLab answers, as the image's non-root user; headless Chromium (the
        course's browser test's helpers, tests/test_browser.py) opens notebook 00 with a correct student's answers,
        runs its first cells and presses nbgrader's Validate, which must answer "Success"; no Formgrader is served
    python /tmp/images_check.py grade ASSIGNMENT        (inside the grader image, as its user)
        a scratch nbgrader course from the image's /opt/course (course_grader.release.make_course, without the cells
        tagged demo), two submissions (a correct student's answers, and the release untouched), nbgrader autograde:
        the correct one must get every point, the untouched one fewer

The first two run with the course's .venv on the host; ``grade`` runs with the image's own Python and course.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = "00_orientation"
# what the student edition never holds (course_grader/edition.py writes none of it; tests/test_docker.py checks the
# edition stage's output for the same)
FORBIDDEN_DIRS = ("solutions", "tests", "release", "submitted", "autograded", "feedback", "runs", "build")
FORBIDDEN_FILES = ("nbgrader_config.py", "gradebook.db", "grades.csv")


# --- scan-student ---------------------------------------------------------------------------------------------------

def is_stub(source: str, name: str, assignment: str, exercise: str) -> bool:
    """Whether the top-level def or class ``name`` in ``source`` is the student edition's stub of a graded reference:
    a docstring and one raise that names the notebook's exercise (edition.stub_source), nothing else."""
    tree = ast.parse(source)
    node = next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                 and n.name == name), None)
    if node is None:
        return True  # not defined here at all: nothing to leak

    def code(body):
        return [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]

    body = code(node.body)
    if isinstance(node, ast.ClassDef) and len(body) == 1 and getattr(body[0], "name", "") == "__init__":
        body = code(body[0].body)
    return len(body) == 1 and isinstance(body[0], ast.Raise) and \
        f"notebook {assignment}'s exercise {exercise}" in ast.unparse(body[0])


def leaks(path: str, read, refs_by_module: dict[str, list[tuple[str, str, str]]]) -> list[str]:
    """What is wrong with one file of one layer of the student image (its path without a leading slash)."""
    parts = path.split("/")
    name = parts[-1]
    if name.startswith(".wh."):
        return []  # a whiteout: a deletion, not content
    out = []
    if "course_grader" in parts or "course_lib" in parts or path.startswith("opt/course/"):
        if name.endswith("_hidden.py"):
            out.append(f"{path}: a hidden test's check")
    if path.startswith("opt/course/"):
        rel = parts[2:]
        if rel and (rel[0] in FORBIDDEN_DIRS and len(rel) > 1 or (len(rel) == 1 and rel[0] in FORBIDDEN_FILES)):
            out.append(f"{path}: an instructor's file")
        if len(rel) >= 2 and rel[0] == "course_lib" and name.endswith(".py"):
            module = ".".join(rel[1:])[:-3]
            if module in refs_by_module:
                source = read().decode()
                for ref, assignment, exercise in refs_by_module[module]:
                    if not is_stub(source, ref, assignment, exercise):
                        out.append(f"{path}: course_lib.{module}.{ref} is the graded reference, not its stub")
    return out


def scan_student(stream) -> int:
    sys.path.insert(0, str(ROOT))
    from course_grader.edition import MARKER_FILE, graded_references

    refs_by_module: dict[str, list[tuple[str, str, str]]] = {}
    for ref, (assignment, exercise) in graded_references(ROOT).items():
        module, name = ref.rsplit(".", 1)
        refs_by_module.setdefault(module, []).append((name, assignment, exercise))
    problems: list[str] = []
    layers = files = 0
    seen: set[str] = set()
    with tarfile.open(fileobj=stream, mode="r|") as archive:
        for member in archive:
            if not (member.isfile() and member.name.endswith(".tar")):
                continue
            layers += 1
            with tarfile.open(fileobj=archive.extractfile(member), mode="r|*") as layer:
                for entry in layer:
                    path = entry.name.lstrip("./")
                    seen.add(path)
                    files += 1
                    if entry.isfile():
                        problems += [f"layer {layers}: {p}" for p in
                                     leaks(path, lambda e=entry: layer.extractfile(e).read(), refs_by_module)]
                    elif entry.isdir() and path.startswith("opt/course/") and path.split("/")[2] in FORBIDDEN_DIRS:
                        problems.append(f"layer {layers}: {path}/: an instructor's folder")
    print(f"scanned {layers} layers, {files} entries; {sum(len(v) for v in refs_by_module.values())} graded references")
    for must in (f"opt/course/{MARKER_FILE}", f"opt/course/notebooks/{NOTEBOOK}.ipynb",
                 "opt/course/course_lib/__init__.py"):
        if must not in seen:
            problems.append(f"the student image has no {must}")
    for p in problems:
        print(f"LEAK {p}")
    if problems:
        return 1
    print("ok: no layer of the student image holds solutions/, tests/, nbgrader_config.py, a *_hidden.py or a graded "
          "reference")
    return 0


# --- student-lab ----------------------------------------------------------------------------------------------------

def http_status(url: str, token: str | None = None) -> int:
    req = urllib.request.Request(url, headers={"Authorization": f"token {token}"} if token else {})

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *a, **k):
            return None

    try:
        with urllib.request.build_opener(NoRedirect).open(req, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def engine_out(engine: str, *args: str) -> str:
    return subprocess.run([engine, *args], capture_output=True, text=True, check=True, timeout=120).stdout.strip()


def student_lab(args) -> int:
    deadline = time.monotonic() + 180
    while True:
        state = engine_out(args.engine, "inspect", "--format", "{{.State.Status}}", args.container)
        if state != "running":
            raise SystemExit(f"the container is {state}:\n" + engine_out(args.engine, "logs", args.container))
        try:
            if http_status(f"{args.url}/api/status") in (200, 403):
                break
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit("JupyterLab did not answer within 180 s")
        time.sleep(1)
    print(f"JupyterLab answers at {args.url}")
    assert http_status(f"{args.url}/api/status") in (302, 403), "the lab answers without its token"
    assert http_status(f"{args.url}/api/status", args.token) == 200, "the lab refuses its token"
    assert http_status(f"{args.url}/formgrader", args.token) == 404, "a student's lab serves the Formgrader"

    # the server is the container's first process (start-lab.sh execs jupyter lab): its user, seen from the host
    pid = engine_out(args.engine, "inspect", "--format", "{{.State.Pid}}", args.container)
    status = Path(f"/proc/{pid}/status").read_text()
    uids = re.search(r"^Uid:\s+(.*)$", status, re.M).group(1).split()
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    print(f"the server, pid {pid} on the host: uids {uids}, {cmdline[:120]}")
    assert re.search(r"jupyter(-lab| lab)", cmdline), cmdline
    assert set(uids) == {"1000"}, f"JupyterLab runs as uids {uids}, not the image's student (1000)"
    who = engine_out(args.engine, "exec", args.container, "sh", "-c", "id -un; id -u")
    assert who.split() == ["student", "1000"], who
    kernel_lib = engine_out(args.engine, "exec", args.container, "/opt/course/.venv/bin/python", "-c",
                            "import course_lib, os; print(course_lib.__file__); "
                            "print(os.path.exists('/opt/course/.student-edition.json'))")
    assert kernel_lib.split() == ["/opt/course/course_lib/__init__.py", "True"], kernel_lib
    print(f"served as {who.split()[0]} (uid {who.split()[1]}); kernels import the student edition's course_lib")

    # start-lab.sh copied the image's notebooks into the work folder; a correct student's answers go into notebook 00
    sys.path.insert(0, str(ROOT))
    from course_grader.student_path import filled

    work_nb = Path(args.work) / "notebooks" / f"{NOTEBOOK}.ipynb"
    assert work_nb.exists(), f"start-lab.sh did not copy the notebooks into the work folder: no {work_nb}"
    release = json.loads(work_nb.read_text())
    solution = json.loads((ROOT / "solutions" / NOTEBOOK / f"{NOTEBOOK}.ipynb").read_text())
    answers = filled(release, solution)
    assert answers != release, "the image's notebook 00 has no solution cell to fill"
    work_nb.write_text(json.dumps(answers, indent=1) + "\n")
    os.chown(work_nb, 1000, 1000)

    sys.path.insert(0, str(ROOT / "tests"))
    from playwright.sync_api import expect
    from test_browser import NEWS, SUCCESS, chromium, create_assignment_tabs, nbgrader_menu

    shots: list[Path] = []
    t0 = time.monotonic()
    with chromium(f"images-check-{args.tag}", shots) as (page, shot):
        page.goto(f"{args.url}/lab/tree/notebooks/{NOTEBOOK}.ipynb?token={args.token}")
        cells = page.locator(".jp-Notebook .jp-CodeCell")
        expect(cells.first).to_be_visible(timeout=60_000)
        expect(page.locator("#jp-main-statusbar")).to_contain_text("Idle", timeout=90_000)
        first, setup = cells.nth(0), cells.nth(1)
        first.locator(".jp-InputPrompt").click()
        page.keyboard.press("Shift+Enter")
        expect(first.locator(".jp-InputPrompt")).to_have_text("[1]:", timeout=60_000)
        page.keyboard.press("Shift+Enter")
        expect(setup.locator(".jp-OutputArea")).to_contain_text("tier=cpu, device=cpu", timeout=180_000)
        assert "Traceback" not in setup.locator(".jp-OutputArea").inner_text()
        shot("ran_first_cells")
        validate = page.locator(".jp-NotebookPanel-toolbar").get_by_text("Validate", exact=True)
        expect(validate).to_be_visible()
        expect(create_assignment_tabs(page)).to_have_count(0)
        labels = nbgrader_menu(page)
        assert "Assignment List" in labels and not {"formgrader", "course list"} & {x.lower() for x in labels}, labels
        page.keyboard.press("Escape")
        page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab", has_text=f"{NOTEBOOK}.ipynb").click()
        validate.click()
        dialog = page.locator(".jp-Dialog")
        expect(dialog).to_contain_text(SUCCESS, timeout=420_000)
        shot("validated")
        assert page.get_by_text(NEWS).count() == 0, "the student's lab asks about Jupyter news"
    print(f"Chromium: notebook 00 opened, its first cells ran, Validate answered {SUCCESS!r} "
          f"({time.monotonic() - t0:.0f} s); screenshots: {', '.join(str(s) for s in shots)}")
    return 0


# --- grade (inside the grader image) ----------------------------------------------------------------------------------

def grade(assignment: str) -> int:
    from nbgrader.api import Gradebook

    from course_grader.release import make_course, nbgrader
    from course_grader.student_path import filled

    course_root = Path(os.environ.get("COURSE_DIR", "/opt/course"))
    print(f"grading as uid {os.getuid()} ({os.environ.get('USER') or os.environ.get('HOME')}), course {course_root}")
    if os.getuid() == 0:
        print("FAIL: grading runs as root", file=sys.stderr)
        return 1
    tmp = Path(tempfile.mkdtemp(prefix="images-check-grade-"))
    t0 = time.monotonic()
    course = make_course(tmp / "course", root=course_root, drop_tags=("demo",), only=(assignment,))
    release = json.loads((course / "release" / assignment / f"{assignment}.ipynb").read_text())
    solution = json.loads((course / "solutions" / assignment / f"{assignment}.ipynb").read_text())
    submissions = {"solved": filled(release, solution), "untouched": release}
    for student, nb in submissions.items():
        path = course / "submitted" / student / assignment / f"{assignment}.ipynb"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(nb, indent=1))
    print(f"course and submissions made ({time.monotonic() - t0:.0f} s)")
    t0 = time.monotonic()
    nbgrader(course, "autograde", assignment, "--force", timeout=1800)
    print(f"nbgrader autograde: {time.monotonic() - t0:.0f} s")
    totals = {}
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        for sub in gb.assignment_submissions(assignment):
            totals[sub.student_id] = (sub.score, sub.max_score)
    for student, (score, top) in sorted(totals.items()):
        print(f"{student:<10} {score:g} / {top:g}")
    solved, top = totals["solved"]
    untouched, _ = totals["untouched"]
    if not (top > 0 and solved == top and untouched < solved):
        print(f"FAIL: the correct submission scored {solved:g} of {top:g}, the untouched one {untouched:g}",
              file=sys.stderr)
        return 1
    print("ok: the correct submission gets every point, the untouched release fewer")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("scan-student", help="a `podman save --format docker-archive` of the student image on stdin")
    lab = sub.add_parser("student-lab", help="the running student container, driven in headless Chromium")
    lab.add_argument("--engine", default="podman")
    lab.add_argument("--container", required=True)
    lab.add_argument("--work", required=True, help="the host folder mounted at /home/student/work")
    lab.add_argument("--url", required=True)
    lab.add_argument("--token", required=True)
    lab.add_argument("--tag", default="student", help="names the screenshots (runs/test-artifacts/)")
    g = sub.add_parser("grade", help="inside the grader image: autograde a correct and an untouched submission")
    g.add_argument("assignment", nargs="?", default=NOTEBOOK)
    args = parser.parse_args(argv)
    if args.command == "scan-student":
        return scan_student(sys.stdin.buffer)
    if args.command == "student-lab":
        return student_lab(args)
    return grade(args.assignment)


if __name__ == "__main__":
    sys.exit(main())
