"""Grade a submission by its checks, in a process the student's code never ran in.

    verdicts = grade(notebook)   # {grade_id: Verdict(passed, message)} for every test cell that calls check()

The submission's setup cells (the code cells before its first exercise), its solution cells and the given
read-only cells run in a fork of a grading server (``course_grader.child``), fenced by ``course_grader.sandbox``:
it reads the Python installation and the student edition of course_lib, and writes one scratch folder. The probes'
data come back as a file read with ``torch.load(weights_only=True)``; every judge runs here, on the instructor's
course_lib. nbgrader_config.py's ``GradeByChecks`` writes the verdicts into the autograded notebook's test cells,
from which nbgrader scores them; tests/test_grading.py calls ``grade`` directly on the known-wrong submissions.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from course_grader import checks, edition, peer, sandbox

CALL = re.compile(r"""^\s*check\(\s*["'](\w+)["']""", re.MULTILINE)


# What the grader accepts back from a grading process, before any judge reads it: the course's probes return
# the gradients and outputs of small models, far below these.
MAX_ELEMENTS = 1 << 24  # elements in all the tensors of one probe's data
MAX_ITEMS = 1 << 20  # numbers, strings, lists and dicts in it
MAX_DEPTH = 16


@dataclass(frozen=True)
class Verdict:
    """A test cell's result: whether it passed, what to tell the student (the judge's message), and what the
    grading process's audit hook reported of the submission (``course_grader.audit``), for the instructor."""

    passed: bool
    message: str
    reports: tuple = ()


class Malformed(ValueError):
    """Data from a grading process that no judge is given: too large, too deep, or a tensor that is not its own."""


def validated(data, depth: int = 0, budget: list | None = None):
    """``data`` as the grading process sent it, if it is plain data a judge may read, with every tensor dense and
    contiguous. Refused (``Malformed``): a tensor that claims more elements than its storage holds (a stride-0
    tensor of 1 KB can claim 2**33, which a judge would then materialise), more than ``MAX_ELEMENTS`` elements in
    all, more than ``MAX_ITEMS`` items, deeper than ``MAX_DEPTH``, or anything that is not plain data."""
    budget = [MAX_ELEMENTS, MAX_ITEMS] if budget is None else budget
    budget[1] -= 1
    if depth > MAX_DEPTH or budget[1] < 0:
        raise Malformed("nested too deep or too many items")
    if isinstance(data, torch.Tensor):
        if data.layout != torch.strided or data.is_quantized or type(data) is not torch.Tensor:
            raise Malformed(f"a tensor of layout {data.layout} and type {type(data).__name__}")
        budget[0] -= max(data.numel(), data.untyped_storage().nbytes() // max(data.element_size(), 1))
        if budget[0] < 0:
            raise Malformed(f"more than {MAX_ELEMENTS} tensor elements")
        if data.numel() * data.element_size() > data.untyped_storage().nbytes():
            raise Malformed(f"a tensor of shape {tuple(data.shape)} with strides {data.stride()} claims more "
                            f"elements than its storage of {data.untyped_storage().nbytes()} bytes holds")
        return data if data.is_contiguous() and data.storage_offset() == 0 else data.contiguous().clone()
    if isinstance(data, dict):
        return {validated(k, depth + 1, budget): validated(v, depth + 1, budget) for k, v in data.items()}
    if isinstance(data, (list, tuple)) and type(data) in (list, tuple, torch.Size):
        items = [validated(v, depth + 1, budget) for v in data]
        return items if type(data) is list else torch.Size(items) if type(data) is torch.Size else tuple(items)
    if isinstance(data, str):
        if len(data) > 1 << 20:
            raise Malformed("a string of more than 1 MiB")
        return data
    if data is None or type(data) in (bool, int, float, complex, torch.dtype, torch.device):
        return data
    raise Malformed(f"a {type(data).__name__}")


def _meta(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


def _source(cell) -> str:
    return cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])


def checked_cells(nb: dict) -> dict[str, list[str]]:
    """``{grade_id: [check names]}`` of every test cell that calls ``check(...)``."""
    out = {}
    for cell in nb["cells"]:
        names = CALL.findall(_source(cell)) if _meta(cell).get("grade") and cell["cell_type"] == "code" else []
        if names:
            out[_meta(cell)["grade_id"]] = names
    return out


def cells_to_run(nb: dict) -> list[str]:
    """The code the child runs, in order: the code cells before the first exercise (parameters, imports, setup; not
    those tagged ``demo``), every solution cell, and every given read-only cell (nbgrader's ``locked``: helpers and
    tables the student's code may call), but no test cell and no measurement between the exercises."""
    out, seen_solution = [], False
    for cell in nb["cells"]:
        if cell["cell_type"] != "code" or "demo" in cell.get("metadata", {}).get("tags", []):
            continue
        meta = _meta(cell)
        seen_solution |= bool(meta.get("solution"))
        given = meta.get("locked") and not meta.get("grade")
        if meta.get("solution") or given or not seen_solution and not meta.get("grade"):
            out.append(_source(cell))
    return out


def hidden_modules(names: list[str]) -> list[Path]:
    """The instructor's ``*_hidden.py`` files that define some of ``names``: the student edition lacks them, so the
    child gets copies and loads them by path."""
    checks.load_all()
    files = {Path(sys.modules[checks.REGISTRY[n].probe.__module__].__file__) for n in names if n in checks.REGISTRY}
    return sorted(f for f in files if f.stem.endswith("_hidden"))


class Server:
    """``course_grader.child --serve``, started with the student edition first on its path: one fenced fork per
    submission. Started on first use for a set of hidden check modules and kept for the grader's whole run."""

    def __init__(self, modules: list[Path]):
        sandbox.refuse_root()
        self.folder = Path(sandbox.scratch_folder())  # the hidden checks' copies: never the instructor's folder
        copies = [str(shutil.copy(path, self.folder / path.name)) for path in modules]
        self.edition = str(edition.for_grading())
        env = {**sandbox.grading_env(dict(os.environ), str(self.folder), self.edition),
               "NBGRADER_EXECUTION": "autograde"}
        self.proc = subprocess.Popen([sys.executable, "-m", "course_grader.child", "--serve", *copies],
                                     cwd=self.folder, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(self, cells: list[str], names: list[str], seconds: int, fence: bool = True, seed: int = 0) -> dict:
        """Run ``cells`` then the probes of ``names`` in a fenced fork, the hidden cases built from ``seed``
        (``checks.case_seed``); returns what it wrote (plain data only)."""
        scratch = Path(sandbox.scratch_folder())
        wires = Path(tempfile.mkdtemp(prefix="course-wire-"))  # the peers' records: outside the fence's lists
        try:
            read, write = sandbox.allow_lists([], str(scratch), [], str(edition.grading_cache()), self.edition,
                                              [str(p) for p in edition.packages()])
            job = {"cells": cells, "names": names, "seconds": seconds, "seed": int(seed),
                   "out": str(scratch / "out.pt"), "log": str(scratch / "log.txt"), "scratch": str(scratch),
                   "fence": fence, "read": read, "write": write, "limit": seconds * (len(cells) + len(names)) + 60,
                   "wires": str(wires),
                   "env": {k: v for k, v in sandbox.grading_env({}, str(scratch), self.edition).items()
                           if k != "PYTHONPATH"}}
            (scratch / "job.json").write_text(json.dumps(job))
            self.proc.stdin.write(f"{scratch / 'job.json'}\n")
            self.proc.stdin.flush()
            answer = self.proc.stdout.readline().strip()
            if not answer.startswith("done"):
                raise RuntimeError(f"the grading server stopped (exit code {self.proc.poll()})")
            reports = json.loads(answer[len("done"):].strip() or "[]")
            try:
                out = torch.load(scratch / "out.pt", weights_only=True)
                if not isinstance(out, dict) or not isinstance(out.get("results"), dict):
                    raise Malformed("not the results of a grading process")
            except Exception as err:
                log = scratch / "log.txt"
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                out = {"results": {}, "cell_errors": [f"the grading process wrote no results ({type(err).__name__}); "
                                                      f"its last output:\n{tail}"]}
            checks.load_all()  # which checks have a peer
            for name, result in out["results"].items():  # what the grading process wrote under "wire" is dropped
                if isinstance(result, dict):
                    result["wire"] = peer.read(wires / f"{name}.pt") if name in checks.REGISTRY and \
                        checks.REGISTRY[name].peer else None
            return {**out, "reports": reports}
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
            shutil.rmtree(wires, ignore_errors=True)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


_SERVERS: dict[tuple[Path, ...], Server] = {}


def server_for(names: list[str]) -> Server:
    """The running server that holds the hidden checks among ``names``: started on first use and kept while the
    same assignment is graded (one at a time: another assignment's stops it), stopped at exit."""
    key = tuple(hidden_modules(names))
    if key not in _SERVERS or _SERVERS[key].proc.poll() is not None:
        if not _SERVERS:
            atexit.register(lambda: [s.close() for s in _SERVERS.values()])
        for other in list(_SERVERS):
            _SERVERS.pop(other).close()
        _SERVERS[key] = Server(list(key))
    return _SERVERS[key]


def hidden(name: str) -> bool:
    """Whether check ``name`` is a hidden test (its module is one of the instructor's ``*_hidden`` files)."""
    return name in checks.REGISTRY and checks.REGISTRY[name].probe.__module__.endswith("_hidden")


def judge(name: str, result: dict | None, cell_errors: list[str], seed: int = 0) -> Verdict:
    """One check's verdict, from its probe's data, in this process, its hidden cases built from the grading's
    ``seed``, as the probe's were. The data is ``validated`` before the judge reads it. A hidden test's feedback names
    the error's type and line, never its text: the student's code could put the hidden inputs in it."""
    if not isinstance(result, dict) or "data" not in result:
        why = result.get("error") if isinstance(result, dict) else "the probe never ran"
        if isinstance(result, dict) and hidden(name):
            why = (f"your code raised {str(result.get('type', 'an error'))[:80]} when the hidden test called it"
                   f"{str(result.get('where', ''))[:200]}")
        context = f"\n(errors in your cells: {'; '.join(str(e) for e in cell_errors)})" if cell_errors else ""
        return Verdict(False, f"{name}: {why}{context}")
    try:
        with checks.grading_seed(seed):
            wire = validated(result.get("wire") or [])  # the grader's own rank's record, where the check has one
            return Verdict(True, str(checks.REGISTRY[name].verdict(validated(result["data"]), wire)))
    except Malformed as err:
        return Verdict(False, f"{name}: the data your code gave back is not plain data a test can read ({err})")
    except AssertionError as err:
        return Verdict(False, f"{name}: {err}")
    except Exception as err:  # data of the wrong shape: the student's function returned something else
        return Verdict(False, f"{name}: {type(err).__name__}: {err}")


def grade(nb: dict, seconds: int = 60, fence: bool = True, server: Server | None = None,
          only: set[str] | None = None, seed: int | None = None) -> dict[str, Verdict]:
    """``{grade_id: Verdict}`` of every test cell of ``nb`` that calls ``check``; a cell passes if all its checks do.
    ``server``: a grading server of the caller's (else the shared one for these checks). ``only``: these test cells'
    checks alone run (the others' probes are never started). ``seed``: the hidden cases' (``checks.case_seed``); by
    default a new secret one for this grading, which the submission's code can neither choose nor know ahead."""
    seed = secrets.randbelow(1 << 31) if seed is None else seed
    cells = {k: v for k, v in checked_cells(nb).items() if only is None or k in only}
    names = [n for ns in cells.values() for n in ns]
    if not names:
        return {}
    out = (server or server_for(names)).run(cells_to_run(nb), names, seconds, fence, seed)
    results, errors = out.get("results", {}), out.get("cell_errors", [])
    errors = errors if isinstance(errors, list) else []
    reports = tuple(f"{r['kind']}: {r['detail']}" + (" (refused)" if r["refused"] else "")
                    for r in out.get("reports", []))
    verdicts = {}
    for grade_id, ns in cells.items():
        each = [judge(n, results.get(n), errors, seed) for n in ns]
        failed = [v for v in each if not v.passed]
        verdict = failed[0] if failed else Verdict(True, "; ".join(v.message for v in each))
        verdicts[grade_id] = dataclasses.replace(verdict, reports=reports)
    return verdicts
