"""The process where a submission's code runs at grading time: ``python -m course_lib.checks.child JOB``.

JOB (JSON) names the hidden check modules (files: the student edition has none), the cells to run (the notebook's setup cells, then the student's
solution cells), the checks, a time limit per cell and per check, and the file to write. The check modules are
loaded first, so the probes hold ``forbid`` and the helpers as they were before any student code ran; the cells
run in one namespace, as a kernel would run them (an error is kept and the next cell runs); then each probe runs
on that namespace. The probes' data (or their errors) go to the output file with ``torch.save``, and the grader
reads it with ``weights_only=True``: nothing but plain data comes back. The grader starts this process fenced
(``course_lib.sandbox``), with the student edition first on its path.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import sys
import traceback

import torch

from course_lib import checks, grading


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
    """Taken before any student code runs: the checks as registered, the globals of the modules the probes use
    (theirs, ``course_lib.grading``'s, the registry's) and the code of every function in them."""
    code = []
    for module in modules:
        for value in vars(module).values():
            for fn in (value, getattr(value, "__wrapped__", None)):  # forbid is a contextmanager's wrapper
                if callable(fn) and hasattr(fn, "__code__"):
                    code.append((fn, fn.__code__, fn.__defaults__))
    return dict(checks.REGISTRY), [(vars(m), dict(vars(m))) for m in modules], code


def restore(frozen: tuple[dict, list, list]) -> None:
    """Undo what a solution cell rebound or patched there: the registry, ``forbid`` and the probes' globals and code."""
    registry, spaces, code = frozen
    checks.REGISTRY.clear()
    checks.REGISTRY.update(registry)
    for space, saved in spaces:
        space.clear()
        space.update(saved)
    for fn, original, defaults in code:
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
            where = f" (line {last[0].lineno} of {last[0].filename})" if last and last[0].filename.startswith("<cell") else ""
            out[name] = {"error": f"{type(err).__name__}: {err}{where}"}
        finally:
            signal.alarm(0)
    return out


def main(job_path: str) -> None:
    job = json.loads(open(job_path).read())
    signal.signal(signal.SIGALRM, _alarm)
    checks.load_all()  # the visible checks of this edition
    loaded = [checks, grading]
    for i, path in enumerate(job["modules"]):  # before any student code: the probes bind the real helpers
        spec = importlib.util.spec_from_file_location(f"course_lib.checks._graded{i}", path)
        loaded.append(importlib.util.module_from_spec(spec))
        spec.loader.exec_module(loaded[-1])
    loaded += [m for name, m in sorted(sys.modules.items()) if name.startswith("course_lib.checks.")]
    frozen = snapshot(loaded)
    namespace = {"__name__": "__main__", "display": print}
    cell_errors = run_cells(job["cells"], namespace, job["seconds"])
    results = run_probes(job["names"], namespace, job["seconds"], frozen)
    torch.save({"results": results, "cell_errors": cell_errors}, job["out"])


if __name__ == "__main__":
    main(sys.argv[1])
