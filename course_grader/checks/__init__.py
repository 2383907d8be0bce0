"""Graded checks: a notebook's test cell is one call, ``check("test_llama_param_count", globals())``.

A check has two halves, written side by side in ``course_grader/checks/nbNN.py`` (the visible tests, which the
student edition keeps) and ``nbNN_hidden.py`` (the hidden ones, instructor edition only):

- its **probe** runs beside the student's code. It calls the student's functions on chosen inputs, inside
  ``forbid(...)``, and returns plain data: numbers, strings, tensors, and lists and dicts of them.
- its **judge** runs where the student's code never ran. It computes the reference with torch and course_lib,
  and raises ``AssertionError`` with the student's message where the data differ; else it returns what passed.

In the student's own notebook both halves run in the kernel, so the visible test reads as before. Under
nbgrader's autograde the kernel skips them: the grader (``course_grader.grade``) runs the submission's
setup and solution cells in a fenced child process, takes back the probes' data, and judges it in its own
process, where a patched helper, a swallowed error, a rebound ``forbid`` or a gradebook write cannot reach.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import importlib
import io
import os
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable

import torch

from course_grader.peer import Peer, running
from course_lib.launch import run_forked, ships_by_value

REGISTRY: dict[str, "Check"] = {}
# check name -> the ports of its peer's rounds, while its probe runs (set by check() and by the grading process)
PORTS: dict[str, list[int]] = {}
# The seed of the grading under way: the grader draws one per submission (``grade.grade``) and sets it in the
# process that runs the probes and around its own judges, so the hidden cases built from it (``case_seed``) are new
# at every grading and outputs learned from an earlier one answer nothing. 0 in a notebook's own kernel.
GRADING_SEED = 0


@dataclass(frozen=True)
class Check:
    """One graded test: ``probe(namespace) -> data`` beside the student's code, ``judge(data) -> str`` in the grader.
    With a ``peer`` (``course_grader.peer``), the grader's own rank joins the probe's ranks and the judge reads what
    it recorded too: ``judge(data, wire)``."""

    name: str
    probe: Callable[[dict], Any]
    judge: Callable[..., str]
    peer: Peer | None = None

    def verdict(self, data: Any, wire: list | None) -> str:
        """The judge's message on the probe's ``data`` (and the peer's ``wire``, for a check with a peer)."""
        return self.judge(data, wire or []) if self.peer else self.judge(data)


def register(name: str, probe: Callable[[dict], Any], judge: Callable[..., str], peer: Peer | None = None) -> Check:
    """Make ``probe`` and ``judge`` the check of the test cell whose grade_id is ``name`` (with the grader's own rank
    ``peer``, where the probe's ranks join one)."""
    if name in REGISTRY and REGISTRY[name].probe.__module__ != probe.__module__:
        raise ValueError(f"two checks are named {name!r}: each test cell's grade_id names one")
    REGISTRY[name] = Check(name, probe, judge, peer)
    return REGISTRY[name]


def peer_port(name: str, round: int = 0) -> int:
    """The port on which check ``name``'s peer hosts round ``round``'s group: the probe's ranks join it there."""
    if name not in PORTS:
        raise RuntimeError(f"{name} grades what reaches the grader's own rank, and none was started: run it with "
                           f"check({name!r}, globals())")
    return PORTS[name][round]


def case_seed(*parts) -> int:
    """A seed for one hidden case, from this grading's seed and the case's name (``parts``): the probe, in the grading
    process, and the judge, in the grader, derive the same one; every grading a new one."""
    digest = hashlib.sha256(repr((GRADING_SEED, parts)).encode()).digest()
    return int.from_bytes(digest[:4], "little") % (1 << 31)


@contextlib.contextmanager
def grading_seed(seed: int):
    """Checks run inside this block build their hidden cases from ``seed`` (``case_seed``); the previous seed after."""
    global GRADING_SEED
    before, GRADING_SEED = GRADING_SEED, int(seed)
    try:
        yield
    finally:
        GRADING_SEED = before


def load_all() -> None:
    """Import every checks module this edition has (the student edition has no ``*_hidden`` modules)."""
    for info in pkgutil.iter_modules(__path__):
        if info.name not in ("child", "grade"):
            importlib.import_module(f"{__name__}.{info.name}")


def forbidden(space: dict) -> list:
    """Every answer the probes of a checks module forbid (``space``: its globals): each argument of each
    ``forbid(...)`` call in its file, evaluated in its globals (``*TUPLE`` spread). An argument that is not a
    module-level name or attribute is an error here, not a silent gap."""
    path = space["__file__"]
    tree = ast.parse(open(path).read(), path)
    out: list = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "forbid":
            for arg in node.args:
                spread = isinstance(arg, ast.Starred)
                value = eval(compile(ast.Expression(arg.value if spread else arg), path, "eval"), space)
                out += [a for a in (value if spread else [value]) if all(a is not b for b in out)]
    return out


def plain(data: Any) -> Any:
    """``data`` after the trip the grader's data takes (``torch.save``, then ``torch.load(weights_only=True)``):
    raises ``TypeError`` where the data is not plain (an object of the student's, say)."""
    buffer = io.BytesIO()
    torch.save(data, buffer)
    buffer.seek(0)
    try:
        return torch.load(buffer, weights_only=True)
    except Exception as err:  # an unpicklable-under-weights_only type
        raise TypeError(f"the test's data must be numbers, strings, tensors, lists and dicts: {err}") from None


def number(x: Any) -> Any:
    """A student's number as plain data: a Python int or float (from a 0-d tensor or a numpy scalar too); anything
    else becomes its ``repr``, which no judge takes for a number."""
    if hasattr(x, "item") and not isinstance(x, (int, float)):
        try:
            x = x.item()
        except (ValueError, RuntimeError):  # a tensor of several numbers
            pass
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) else repr(x)[:200]


def unwritten(err: BaseException) -> str | None:
    """The student's definition that raised ``err``, where ``err`` is the release's stub (``raise
    NotImplementedError()``, no message: course_lib's stubs name their exercise), i.e. an exercise not written yet."""
    if not isinstance(err, NotImplementedError) or str(err) or err.__traceback__ is None:
        return None
    tb = err.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    name, owner = code.co_name, tb.tb_frame.f_locals.get("self")
    if owner is not None:
        name = type(owner).__name__ + ("" if name == "__init__" else f".{name}")
    elif "." in getattr(code, "co_qualname", "") and "<locals>" not in code.co_qualname:
        name = code.co_qualname  # a static method, an autograd Function's forward: named with its class
    return name


def not_written(name: str) -> str:
    """What a test says of an exercise the student has not written yet."""
    return (f"{name} is not written yet (it raises NotImplementedError): replace `raise NotImplementedError()` in its "
            "exercise cell with your code, run that cell, then this test")


def error_message(err: BaseException) -> str:
    """The message of the student's error, or which definition is not written yet where it is the release's stub."""
    name = unwritten(err)
    return not_written(name) if name else str(err)


def error_text(err: BaseException) -> str:
    """The student's error as a judge shows it: its type, then ``error_message``."""
    return f"{type(err).__name__}: {error_message(err)}"


def outcome(fn: Callable, *args, **kwargs) -> dict:
    """What calling ``fn`` gave, as data: ``{"value": ...}`` or ``{"raised": "ValueError", "message": ...}``."""
    try:
        return {"value": fn(*args, **kwargs)}
    except Exception as err:  # the student's code's error is data the judge reads
        return {"raised": type(err).__name__, "message": error_message(err)}


def tensor_data(x: Any, dtype: torch.dtype | None = None) -> Any:
    """A tensor the student's code gave, as data: a detached copy on the CPU (in ``dtype`` if given); None stays
    None; anything else its repr, which no judge takes for a tensor."""
    if x is None or not isinstance(x, torch.Tensor):
        return None if x is None else repr(x)[:200]
    x = x.detach().cpu()
    return (x if dtype is None else x.to(dtype)).clone()


def student(ns: dict, *names: str) -> dict:
    """What a rank captures of the notebook: its namespace itself where the ranks inherit it (forked: ``forbid`` then
    reaches the names the student's code looks up), else only the named definitions the student made, which a
    spawned rank gets by value (cloudpickle; ``launch.ships_by_value``)."""
    return {name: ns[name] for name in names if name in ns} if ships_by_value() else ns


def in_ranks(ns: dict, names: tuple, fn: Callable, nprocs: int, timeout: float = 45, **kwargs) -> list:
    """``fn(ns=..., **kwargs)`` on ``nprocs`` ranks (``launch.run_forked``), each rank's ``packed`` result unpacked.
    ``ns`` is what ``student(ns, *names)`` lets a rank capture: the whole namespace where the ranks fork, the
    student's ``names`` only, by value, where they are spawned."""
    rank = functools.partial(fn, ns=student(ns, *names))
    return [unpacked(run) for run in run_forked(rank, nprocs, kwargs, timeout=timeout)]


def packed(data: Any) -> bytes:
    """A rank's data as bytes (``torch.save``): tensors sent through multiprocessing's queue as themselves would be
    shared through file descriptors and a listener socket in a temporary folder, which the grading fence does not
    allow, and can be lost when the rank exits first."""
    buffer = io.BytesIO()
    torch.save(data, buffer)
    return buffer.getvalue()


def unpacked(data: bytes) -> Any:
    """What ``packed`` packed, read as plain data only."""
    return torch.load(io.BytesIO(data), weights_only=True)


def check(name: str, namespace: dict) -> None:
    """A notebook's test cell: run check ``name`` on the student's code in ``namespace`` (``globals()``).

    Raises ``AssertionError`` with the test's message where the code is wrong; prints what passed. Under
    nbgrader's autograde the grader runs it outside the kernel, so here it only says so.
    """
    if os.environ.get("NBGRADER_EXECUTION") == "autograde":
        print(f"{name}: scored by the grader, outside this notebook")
        return
    load_all()
    if name not in REGISTRY:
        raise KeyError(f"no check named {name!r} in this edition of course_lib (hidden tests run when you are graded)")
    entry = REGISTRY[name]
    try:
        with running(name, entry.peer) as wire:
            data = entry.probe(namespace)
    except NotImplementedError as err:  # an exercise this test calls is still the release's stub: say which
        if unwritten(err) is None:
            raise
        raise AssertionError(f"{name}: {not_written(unwritten(err))}") from None
    print(entry.verdict(plain(data), wire))
