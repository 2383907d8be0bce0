"""The processes where a submission's code runs at grading time: ``python -m course_lib.checks.child --serve``.

The server loads torch, course_lib (the student edition: first on its path) and the checks once (the hidden
modules by path: the student edition has none), and snapshots what the probes use. It runs no student code itself.
For each job file named on its stdin it forks; the fork redirects its output to the job's log, moves into the
job's scratch folder, fences itself (``course_lib.apps.sandbox.restrict``: the Python installation and the edition to
read, the scratch folder to write), runs the notebook's setup cells and the student's solution cells in one
namespace, as a kernel would (an error is kept and the next cell runs), restores what the probes use, runs each
probe, and writes their data (or errors) with ``torch.save``. The grader reads that file with
``weights_only=True``: nothing but plain data comes back."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import tempfile
import time
import traceback

import torch

from course_lib import checks, grading
from course_lib.apps import sandbox


class OutOfTime(Exception):
    """A cell or a probe ran past its time limit."""


def _alarm(signum, frame):
    raise OutOfTime("ran past its time limit")


def runnable(source: str) -> str:
    """A cell's source without IPython's magics and shell lines, which plain Python cannot run."""
    return "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))


def run_cells(cells: list[str], namespace: dict, seconds: int) -> list[str]:
    """Run each cell in ``namespace``; a cell's error (or time-out) is kept and the next cell runs."""
    errors = []
    for i, source in enumerate(cells):
        signal.alarm(seconds)
        try:
            exec(compile(runnable(source), f"<cell {i}>", "exec"), namespace)
        except BaseException as err:  # SystemExit and KeyboardInterrupt from a cell are its errors too
            errors.append(f"cell {i}: {type(err).__name__}: {err}")
        finally:
            signal.alarm(0)
    return errors


def snapshot(modules: list) -> tuple[dict, list, list]:
    """Taken before any student code runs: the checks as registered; the names of every module the probes and the
    instruments they measure with live in (every course_lib module loaded, the checks', ``torch`` itself) and of
    every class defined there (``torch.Tensor`` and ``torch.nn.Module`` too); and the code of every function there."""
    spaces, code = [], []
    classes = [torch.Tensor, torch.nn.Module]
    for module in modules:
        spaces.append((module, dict(vars(module))))
        for value in list(vars(module).values()):
            if isinstance(value, type) and getattr(value, "__module__", None) == module.__name__:
                classes.append(value)
            for fn in (value, getattr(value, "__wrapped__", None)):  # forbid is a contextmanager's wrapper
                if callable(fn) and hasattr(fn, "__code__"):
                    code.append((fn, fn.__code__, fn.__defaults__))
    spaces += [(cls, dict(vars(cls))) for cls in classes]
    for cls in classes:
        for fn in list(vars(cls).values()):
            if hasattr(fn, "__code__"):
                code.append((fn, fn.__code__, fn.__defaults__))
    return dict(checks.REGISTRY), spaces, code


def restore(frozen: tuple[dict, list, list]) -> None:
    """Undo what a solution cell rebound or patched there: the registry, every snapshotted name that now holds
    something else (names the cell added stay: nothing the probes run reads them) and every function's code."""
    registry, spaces, code = frozen
    checks.REGISTRY.clear()
    checks.REGISTRY.update(registry)
    for owner, saved in spaces:
        now = vars(owner)
        for name, value in saved.items():
            if now.get(name, now) is not value:
                setattr(owner, name, value)
    for fn, original, defaults in code:
        if fn.__code__ is not original or fn.__defaults__ is not defaults:
            fn.__code__, fn.__defaults__ = original, defaults


def run_probes(names: list[str], namespace: dict, seconds: int, frozen: tuple[dict, list, list]) -> dict:
    """Each check's probe on ``namespace``: ``{name: {"data": ...}}`` or ``{name: {"error": "..."}}``."""
    out = {}
    for name in names:
        restore(frozen)
        signal.alarm(seconds)
        try:
            out[name] = {"data": checks.plain(checks.REGISTRY[name].probe(namespace))}
        except BaseException as err:
            last = traceback.extract_tb(err.__traceback__)[-1:] if err.__traceback__ else []
            where = (f" (line {last[0].lineno} of {last[0].filename})"
                     if last and last[0].filename.startswith("<cell") else "")
            out[name] = {"error": f"{type(err).__name__}: {err}{where}"}
        finally:
            signal.alarm(0)
    return out


def prepare(modules: list[str]) -> tuple[dict, list, list]:
    """Load the checks (this edition's visible ones, then the hidden modules by path) and snapshot what the probes
    use: all of it before any student code runs."""
    signal.signal(signal.SIGALRM, _alarm)
    checks.load_all()
    loaded = [checks, grading]
    for i, path in enumerate(modules):
        spec = importlib.util.spec_from_file_location(f"course_lib.checks._graded{i}", path)
        loaded.append(importlib.util.module_from_spec(spec))
        spec.loader.exec_module(loaded[-1])
    loaded += [m for name, m in sorted(sys.modules.items())
               if name.startswith("course_lib") and m is not None and m not in loaded]
    return snapshot([*loaded, torch])


def run_job(job: dict, frozen: tuple[dict, list, list]) -> None:
    """One submission: its cells in a fresh namespace, then the probes; the data to ``job["out"]``."""
    namespace = {"__name__": "__main__", "display": print}
    cell_errors = run_cells(job["cells"], namespace, job["seconds"])
    results = run_probes(job["names"], namespace, job["seconds"], frozen)
    torch.save({"results": results, "cell_errors": cell_errors}, job["out"])


def serve(modules: list[str]) -> None:
    """Load once, then grade one submission per line of stdin (a job file) in a fork of this process, each fork
    fenced to its own scratch folder before any of its code runs; answer each line with one line when it is done.

    The imports (torch, transformers, course_lib) and the checks cost seconds; a fork costs milliseconds, and no
    student code ever runs in this process, so every fork starts from the same clean state."""
    frozen = prepare(modules)
    for line in sys.stdin:
        job = json.loads(open(line.strip()).read())
        pid = os.fork()
        if pid == 0:  # the submission's process
            try:
                os.setsid()  # its own process group: a time-out kills it and every rank it started
                torch.set_num_threads(1)  # more than one OpenMP thread after fork can hang (a bf16 Linear did)
                log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.dup2(log, 1)  # the student's prints go to the log, never into the answer to the grader
                os.dup2(log, 2)
                os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # nor read the server's next jobs
                os.environ.update(job["env"])
                tempfile.tempdir = None  # the server's cached folder is not this job's: take TMPDIR (its scratch)
                os.chdir(job["scratch"])
                if job["fence"]:
                    sandbox.restrict(job["read"], job["write"])
                run_job(job, frozen)
            finally:
                os._exit(0)
        deadline = time.monotonic() + job["limit"]
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.05)
        print("done", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] != ["--serve"]:
        sys.exit("usage: python -m course_lib.checks.child --serve [HIDDEN_CHECKS.py ...]  (then job files on stdin)")
    serve(sys.argv[2:])
