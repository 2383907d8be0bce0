"""JupyterLab started the way the workshop images start it (docker/start-lab.sh), for the tests.

``start_lab(env, port, log)`` runs the script and waits until the server answers; ``stop_lab(proc)``
ends it and its kernels; ``lab_env(tmp, port, **extra)`` is a clean environment with a work folder
and home under ``tmp``, on this checkout (the instructor's edition); ``student_edition(dest)`` builds the
student edition at ``dest`` and gives the settings that serve it instead, as the student image does;
``http_get(url, token)`` is one HTTP request that does not follow redirects.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
START = ROOT / "docker" / "start-lab.sh"


def http_get(url: str, token: str | None = None, timeout: float = 5) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"token {token}"} if token else {})

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *a, **k):
            return None

    opener = urllib.request.build_opener(NoRedirect)
    try:
        with opener.open(req, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Location", "") or ""


def start_lab(env: dict, port: int, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(["bash", str(START)], env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"start-lab.sh exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if http_get(f"http://127.0.0.1:{port}/api/status", timeout=1)[0] in (200, 403):
                return proc
        except OSError:
            pass
        time.sleep(0.3)
    stop_lab(proc)
    raise AssertionError(f"JupyterLab did not answer within 90 s:\n{log.read_text()[-3000:]}")


def stop_lab(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)  # jupyter shuts its kernels down first
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def lab_env(tmp: Path, port: int, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "COURSE_"))}
    env.update(COURSE_DIR=str(ROOT), WORK_DIR=str(tmp / "work"), HOME=str(tmp / "home"), PORT=str(port),
               LAB_IP="127.0.0.1", COURSE_ALLOW_ROOT="1", JUPYTER_CONFIG_DIR=str(tmp / "home" / ".jupyter"))
    env.update(extra)
    return env


def student_edition(dest: Path) -> dict:
    """The student edition (course_grader/edition.py) built at ``dest`` and served as the student image serves
    its own: ``lab_env`` settings with ``COURSE_DIR=dest`` (its notebooks, its docker/student-lab) and its stubbed
    ``course_lib`` first on the kernels' path. This checkout's .venv is linked in and installs the checkout's
    ``course_lib`` (editable), so ``dest`` goes on PYTHONPATH, ahead of it, as the image's install of its edition."""
    from course_grader.edition import build_student_edition

    build_student_edition(dest)
    (dest / ".venv").symlink_to(ROOT / ".venv")
    return {"COURSE_DIR": str(dest), "PYTHONPATH": str(dest)}
