"""JupyterLab in a real browser: a student's lab and the instructor's, driven in headless Chromium.

Each lab is started the way the workshop images start it (docker/start-lab.sh, which runs the course .venv's
`jupyter lab` with a token), on a free port. Playwright drives Debian's Chromium (/usr/bin/chromium; `.ci/run`
installs it, Playwright's own browser download is never used) and saves screenshots to runs/test-artifacts/.

The student (start-lab.sh's default role) is served the student edition, as the student image serves it: its
notebooks, its stubbed course_lib in the kernels, its docker/student-lab/ configuration. Their work folder holds
notebook 00 with a correct student's answers written in. They open it, run the first code cells with
Shift+Enter, find nbgrader's Validate button and Assignment List and none of the instructor's tools (no Create
Assignment sidebar, no Formgrader or Course List in the Nbgrader menu, no question about Jupyter news), and press
Validate: nbgrader runs the notebook with the course's cell limits and answers "Success".

The instructor (COURSE_ROLE=instructor, on this checkout) has every nbgrader tool: Create Assignment, the
Formgrader (opened), the Course List; and JupyterLab's news question, which the student's lab turns off.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest

from course_lib.distributed import free_port
from labserver import http_get, lab_env, start_lab, stop_lab, student_edition

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = ROOT / "runs" / "test-artifacts"
# what this machine's Chromium needs headless as root, with no network beyond loopback
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
NOTEBOOK = "00_orientation"
TOKEN = "browser-test-token-0123456789abcdef"
# JupyterLab's announcements plugin asks "Would you like to get notified about official Jupyter news?"
NEWS = "official Jupyter news"
# what nbgrader 0.9's lab extension shows when Validate finds every test passing (its validation-success dialog)
SUCCESS = "Success! Your notebook passes all the tests."
PNG = b"\x89PNG\r\n\x1a\n"


def test_nbgrader_labextensions_are_installed_and_enabled():
    proc = subprocess.run([str(Path(sys.executable).parent / "jupyter"), "labextension", "list"],
                          capture_output=True, text=True, timeout=120)
    listing = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)
    line = next((ln for ln in listing.splitlines() if "@jupyter/nbgrader" in ln), "")
    assert "enabled" in line and "OK" in line, f"nbgrader's labextension is not enabled:\n{listing}"


@contextmanager
def lab(tmp: Path, **extra):
    """JupyterLab through docker/start-lab.sh on a free port: (base URL, the server's process)."""
    port = free_port()
    (tmp / "home").mkdir(exist_ok=True)
    proc = start_lab(lab_env(tmp, port, JUPYTER_TOKEN=TOKEN, **extra), port, tmp / "lab.log")
    try:
        yield f"http://127.0.0.1:{port}", proc
    finally:
        stop_lab(proc)


@contextmanager
def chromium(name: str, shots: list[Path]):
    """A page in headless Chromium, and ``shot(tag)``, which saves it as runs/test-artifacts/browser_<name>_<tag>.png
    (a failure is saved as ..._failure.png)."""
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: run .ci/run's install step (apt-get update && apt-get install -y "
                    f"--no-install-recommends chromium). Playwright's own browser download is not used.")
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 900})

        def shot(tag: str) -> None:
            path = ARTIFACTS / f"browser_{name}_{tag}.png"
            page.screenshot(path=str(path))
            shots.append(path)
            print(f"screenshot: {path}")

        try:
            yield page, shot
        except Exception:
            shot("failure")
            raise
        finally:
            browser.close()


def nbgrader_menu(page) -> list[str]:
    """Open the Nbgrader menu; the labels of its items."""
    from playwright.sync_api import expect

    page.get_by_role("menuitem", name="Nbgrader").click()
    menu = page.locator(".lm-Menu-content .lm-Menu-itemLabel")
    expect(menu.first).to_be_visible()
    return menu.all_inner_texts()


def create_assignment_tabs(page):
    """nbgrader's Create Assignment sidebar, as its tab in the right-hand tab bar."""
    return page.locator(".lm-TabBar-tab[title*='Create Assignment'], .lm-TabBar-tab:has-text('Create Assignment')")


def kernel_output(base: str, notebook_path: str, code: str, timeout: float = 60) -> str:
    """Run ``code`` in the kernel of the open notebook at ``notebook_path`` (Jupyter's REST API and kernel
    protocol, as the lab's own page speaks it); what it printed."""
    import websocket  # websocket-client, a dependency of jupyter_server

    sessions = json.loads(http_get(f"{base}/api/sessions", TOKEN)[1])
    kernel = next(s["kernel"]["id"] for s in sessions if s["path"] == notebook_path)
    ws = websocket.create_connection(f"ws{base[4:]}/api/kernels/{kernel}/channels?token={TOKEN}", timeout=timeout)
    msg_id = uuid.uuid4().hex
    header = {"msg_id": msg_id, "msg_type": "execute_request", "session": uuid.uuid4().hex, "username": "test",
              "version": "5.3", "date": ""}
    ws.send(json.dumps({"header": header, "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
                        "content": {"code": code, "silent": False, "store_history": False, "user_expressions": {},
                                    "allow_stdin": False, "stop_on_error": True}}))
    out, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            msg = json.loads(ws.recv())
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                raise AssertionError(f"{code!r} raised in the kernel: {msg['content']['evalue']}")
            elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                return "".join(out)
    finally:
        ws.close()
    raise AssertionError(f"{code!r}: the kernel did not finish within {timeout} s")


def check_pngs(shots: list[Path]) -> None:
    assert shots
    for path in shots:
        assert path.read_bytes()[:8] == PNG and path.stat().st_size > 10_000, f"{path} is not a screenshot"


def test_student_lab_runs_and_validates_notebook_00_without_instructor_tools(tmp_path):
    from playwright.sync_api import expect

    from course_grader.student_path import filled

    # the student edition, and a work folder that holds its notebooks with 00's exercises written correctly
    # (start-lab.sh copies notebooks/ on the first start only: what is there stays)
    edition = tmp_path / "edition"
    served = student_edition(edition)
    notebooks = tmp_path / "work" / "notebooks"
    shutil.copytree(edition / "notebooks", notebooks)
    release = json.loads((edition / "notebooks" / f"{NOTEBOOK}.ipynb").read_text())
    solution = json.loads((ROOT / "solutions" / NOTEBOOK / f"{NOTEBOOK}.ipynb").read_text())
    answers = filled(release, solution)
    assert answers != release, "notebook 00 has no solution cell to fill"
    (notebooks / f"{NOTEBOOK}.ipynb").write_text(json.dumps(answers, indent=1) + "\n")

    shots: list[Path] = []
    with lab(tmp_path, **served) as (base, proc), chromium("student", shots) as (page, shot):
        # the server reads the edition's student configuration, and serves no Formgrader or Course List
        environ = dict(v.split("=", 1) for v in Path(f"/proc/{proc.pid}/environ").read_text().split("\0") if "=" in v)
        assert environ["JUPYTER_CONFIG_PATH"] == str(edition / "docker" / "student-lab"), environ["JUPYTER_CONFIG_PATH"]
        assert http_get(f"{base}/formgrader", TOKEN)[0] == 404
        assert http_get(f"{base}/formgraders", TOKEN)[0] == 404  # the Course List's handler

        page.goto(f"{base}/lab/tree/notebooks/{NOTEBOOK}.ipynb?token={TOKEN}")
        cells = page.locator(".jp-Notebook .jp-CodeCell")
        expect(cells.first).to_be_visible(timeout=60_000)
        expect(page.locator("#jp-main-statusbar")).to_contain_text("Idle", timeout=60_000)  # kernel is up

        # The first code cell (papermill's parameters) and the set-up cell after it, run as a student does:
        # select, Shift+Enter, Shift+Enter. The set-up cell prints the tier it picked.
        first, setup = cells.nth(0), cells.nth(1)
        expect(first).to_contain_text('tier = "auto"')
        first.locator(".jp-InputPrompt").click()
        page.keyboard.press("Shift+Enter")
        expect(first.locator(".jp-InputPrompt")).to_have_text("[1]:", timeout=60_000)
        page.keyboard.press("Shift+Enter")
        output = setup.locator(".jp-OutputArea-output")
        expect(output).to_contain_text("tier=cpu, device=cpu", timeout=120_000)
        expect(setup.locator(".jp-InputPrompt")).to_have_text("[2]:")
        assert "Traceback" not in setup.locator(".jp-OutputArea").inner_text()
        # that kernel imports the student edition's course_lib, with its stubbed references
        origin = kernel_output(base, f"notebooks/{NOTEBOOK}.ipynb", "import course_lib; print(course_lib.__file__)")
        assert origin.strip() == str(edition / "course_lib" / "__init__.py"), origin
        shot("ran_first_cells")

        # nbgrader, the student's side only: Validate in the notebook's toolbar, the Assignment List; no
        # Create Assignment sidebar, no Formgrader or Course List
        validate = page.locator(".jp-NotebookPanel-toolbar").get_by_text("Validate", exact=True)
        expect(validate).to_be_visible()
        expect(create_assignment_tabs(page)).to_have_count(0)
        labels = nbgrader_menu(page)
        assert "Assignment List" in labels, labels
        assert not {"formgrader", "course list", "create assignment"} & {label.lower() for label in labels}, labels
        shot("nbgrader_menu")
        page.get_by_role("menuitem", name="Assignment List", exact=True).click()
        expect(page.locator("#released_assignments_list")).to_be_visible(timeout=30_000)
        shot("assignment_list")

        # Validate, as the student presses it: nbgrader saves the notebook and runs it (the smoke tier, the
        # course's cell limits) in a kernel of its own
        page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab", has_text=f"{NOTEBOOK}.ipynb").click()
        validate.click()
        dialog = page.locator(".jp-Dialog")
        expect(dialog).to_contain_text(SUCCESS, timeout=300_000)
        expect(dialog.locator("#validation-message")).to_have_class(re.compile("validation-success"))
        shot("validated")
        # the news question never came (the instructor's lab, which asks it, holds this selector to it)
        assert page.get_by_text(NEWS).count() == 0, "the student's lab asks about Jupyter news"

    # Validate saved the notebook first: the answers are there, as the student wrote them
    saved = json.loads((notebooks / f"{NOTEBOOK}.ipynb").read_text())
    def text(nb):
        return ["".join(c["source"]) for c in nb["cells"]]

    assert text(saved) == text(answers)
    check_pngs(shots)


def test_instructor_lab_has_the_formgrader_and_create_assignment(tmp_path):
    from playwright.sync_api import expect

    shots: list[Path] = []
    with lab(tmp_path, COURSE_ROLE="instructor") as (base, _), chromium("instructor", shots) as (page, shot):
        page.goto(f"{base}/lab?token={TOKEN}")
        expect(page.locator("#jp-main-dock-panel")).to_be_visible(timeout=60_000)
        # nbgrader's instructor side: the Create Assignment sidebar, the Formgrader and Course List, and the
        # student's Assignment List
        expect(create_assignment_tabs(page).first).to_be_attached(timeout=30_000)
        # without the student configuration JupyterLab asks about news: what the student's lab must not show
        expect(page.get_by_text(NEWS)).to_be_visible(timeout=30_000)
        labels = nbgrader_menu(page)
        for item in ("Assignment List", "Course List", "Formgrader", "Create assignment"):
            assert item in labels, f"nbgrader menu lacks {item!r}: {labels}"
        shot("nbgrader_menu")
        page.get_by_role("menuitem", name="Formgrader", exact=True).click()
        formgrader = page.frame_locator("iframe").first
        expect(formgrader.get_by_text("Manage Assignments").first).to_be_visible(timeout=30_000)
        expect(formgrader.locator("body")).not_to_contain_text("does not exist and could not be created")
        shot("formgrader")
    check_pngs(shots)
