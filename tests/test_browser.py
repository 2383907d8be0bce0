"""JupyterLab in a real browser: the student's first minutes, driven in headless Chromium.

JupyterLab is started from the installed course the way the workshop images start it
(docker/start-lab.sh, which runs the course .venv's `jupyter lab` with a token), on a free port.
Playwright drives Debian's Chromium (/usr/bin/chromium; `.ci/run` installs it, Playwright's own
browser download is never used): it opens notebooks/00_orientation.ipynb with the token, runs the
first code cells with Shift+Enter and waits for the result in the output area, checks that
nbgrader's student (Validate button, Assignment List) and instructor (Formgrader, Create
Assignment) extensions are in the page, opens the Formgrader, and saves screenshots to
runs/test-artifacts/.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from course_lib.distributed import free_port
from labserver import lab_env, start_lab, stop_lab

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = ROOT / "runs" / "test-artifacts"
# what this machine's Chromium needs headless as root, with no network beyond loopback
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
NOTEBOOK = "00_orientation"


def test_nbgrader_labextensions_are_installed_and_enabled():
    proc = subprocess.run([str(Path(sys.executable).parent / "jupyter"), "labextension", "list"],
                          capture_output=True, text=True, timeout=120)
    listing = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)
    line = next((l for l in listing.splitlines() if "@jupyter/nbgrader" in l), "")
    assert "enabled" in line and "OK" in line, f"nbgrader's labextension is not enabled:\n{listing}"


@pytest.fixture
def lab(tmp_path):
    """JupyterLab through docker/start-lab.sh on a free port: (base URL, token, work folder)."""
    port, token = free_port(), "browser-test-token-0123456789abcdef"
    (tmp_path / "home").mkdir()
    proc = start_lab(lab_env(tmp_path, port, JUPYTER_TOKEN=token), port, tmp_path / "lab.log")
    yield f"http://127.0.0.1:{port}", token, tmp_path / "work"
    stop_lab(proc)


def test_student_runs_notebook_00_in_chromium_with_nbgrader_extensions(lab):
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: run .ci/run's install step (apt-get update && apt-get install -y "
                    f"--no-install-recommends chromium). Playwright's own browser download is not used.")
    from playwright.sync_api import expect, sync_playwright

    base, token, work = lab
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shots = []

    def shot(page, name):
        path = ARTIFACTS / f"browser_{NOTEBOOK}_{name}.png"
        page.screenshot(path=str(path))
        shots.append(path)
        print(f"screenshot: {path}")

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        try:
            page.goto(f"{base}/lab/tree/notebooks/{NOTEBOOK}.ipynb?token={token}")
            cells = page.locator(".jp-Notebook .jp-CodeCell")
            expect(cells.first).to_be_visible(timeout=60_000)
            expect(page.locator("#jp-main-statusbar")).to_contain_text("Idle", timeout=60_000)  # kernel is up

            # The first code cell (papermill's parameters) and the set-up cell after it, run as a student
            # does: select, Shift+Enter, Shift+Enter. The set-up cell prints the tier it picked.
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
            shot(page, "ran_first_cells")

            # nbgrader, student side: the notebook toolbar's Validate button; instructor side: the
            # Create Assignment sidebar. The Nbgrader menu holds both sides' panels.
            expect(page.locator(".jp-NotebookPanel-toolbar").get_by_text("Validate")).to_be_visible()
            expect(page.locator(".lm-TabBar-tab[title*='Create Assignment'], "
                                ".lm-TabBar-tab:has-text('Create Assignment')").first).to_be_attached()
            page.get_by_role("menuitem", name="Nbgrader").click()
            menu = page.locator(".lm-Menu-content .lm-Menu-itemLabel")
            expect(menu.first).to_be_visible()
            labels = menu.all_inner_texts()
            for item in ("Assignment List", "Course List", "Formgrader"):
                assert item in labels, f"nbgrader menu lacks {item!r}: {labels}"
            shot(page, "nbgrader_menu")
            page.get_by_role("menuitem", name="Formgrader", exact=True).click()
            formgrader = page.frame_locator("iframe").first
            expect(formgrader.get_by_text("Manage Assignments").first).to_be_visible(timeout=30_000)
            expect(formgrader.locator("body")).not_to_contain_text("does not exist and could not be created")
            shot(page, "formgrader")
        except Exception:
            shot(page, "failure")
            raise
        finally:
            browser.close()

    # the kernel ran in the course's environment and the work folder holds the notebook, unchanged on disk
    # (nothing was saved); the screenshots are real PNGs
    assert json.loads((work / "notebooks" / f"{NOTEBOOK}.ipynb").read_text())["cells"]
    for path in shots:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
