"""The processes where a submission's code runs at grading time: ``python -m course_grader.child --serve``.

The server loads torch, course_lib (the student edition: first on its path) and the checks once (the hidden
modules by path: the student edition has none), and snapshots what the probes use. It runs no student code itself.
For each job file named on its stdin it forks; the fork redirects its output to the job's log, moves into the
job's scratch folder, fences itself (``course_grader.sandbox.restrict``: the Python installation and the edition to
read, the scratch folder to write), runs the notebook's setup cells and the student's solution cells in one
namespace, as a kernel would (an error is kept and the next cell runs), restores what the probes use, runs each
probe, and writes their data (or errors) with ``torch.save``. The grader reads that file with
``weights_only=True``: nothing but plain data comes back.

Before the student's first cell the fork adds ``course_grader.audit``'s hook (what the code may not do there,
and what is reported to the server through a pipe as it happens). Each job is contained: the fork's resource
limits (no core files, files of at most ``FILE_LIMIT`` bytes, at most ``MEMORY_LIMIT`` of memory per process), a
``/dev/shm`` of its own (``sandbox.private_shm``; where the machine refuses one, the server removes what the job left
in the machine's), and the server as the subreaper of everything it starts (a daemon that left its process group is
still its child, and is killed when the job ends)."""

from __future__ import annotations

import builtins
import contextlib
import copy
import copyreg
import ctypes
import functools
import importlib.util
import io
import json
import os
import pickle
import resource
import select
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

from course_grader import audit, checks, grading, peer, sandbox
from course_lib import launch

# What the probes, forbid and the results' way out rely on beyond course_lib and torch's top level: a cell that
# rebinds a name here (builtins.setattr, torch.serialization._save, contextlib's context managers) is undone
# before every probe and before the results are written.
RELIED_ON = [builtins, contextlib, copy, copyreg, functools, io, json, pickle, torch.serialization, sys, os]
FILE_LIMIT = 1 << 30  # bytes: a checkpoint of the course's models is megabytes
# bytes of data per process (RLIMIT_DATA): the server's own (torch, transformers, the checks: about 1 GiB, which the
# fork inherits) and the course's models at grading sizes fit many times over; a submission that allocates without
# end fails with MemoryError in its own process instead of taking the machine's memory from every other grading
MEMORY_LIMIT = min(8 << 30, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2)
GRACE = 10  # seconds the server waits past a cell's or a probe's limit before it kills the job
PR_SET_CHILD_SUBREAPER = 36
PACKAGES = ("course_lib", "course_grader")  # the modules a job's probes rely on, snapshotted before its cells run
IMMUTABLE_TYPE = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE: a builtin type whose attributes cannot be set at all


class OutOfTime(Exception):
    """A cell or a probe ran past its time limit."""


def _alarm(signum, frame):
    raise OutOfTime("ran past its time limit")


CLOCK = {"fd": None}  # the job's pipe to the server, where each cell and probe says it started
PEER_PORTS: dict[str, list[int]] = {}  # check name -> its peer's ports, for the job this fork runs


def start_clock(seconds: int) -> None:
    """A cell or a probe starts, with ``seconds`` to run: this process's alarm, and the server's own deadline (it
    kills the job ``GRACE`` seconds after that, should the code have switched the alarm off)."""
    if CLOCK["fd"] is not None:
        with contextlib.suppress(OSError):  # a closed pipe: the server's deadline stays where it was
            os.write(CLOCK["fd"], json.dumps({"started": seconds}).encode() + b"\n")
    signal.alarm(seconds)


def runnable(source: str) -> str:
    """A cell's source without IPython's magics and shell lines, which plain Python cannot run."""
    return "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))


def run_cells(cells: list[str], namespace: dict, seconds: int) -> list[str]:
    """Run each cell in ``namespace``; a cell's error (or time-out) is kept and the next cell runs."""
    errors = []
    for i, source in enumerate(cells):
        start_clock(seconds)
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
            if isinstance(value, type) and getattr(value, "__module__", None) == module.__name__ \
                    and not value.__flags__ & IMMUTABLE_TYPE:
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


def run_probes(names: list[str], namespace: dict, seconds: int, frozen: tuple[dict, list, list],
               seed: int = 0) -> dict:
    """Each check's probe on ``namespace``, its hidden cases built from the grading's ``seed``: ``{name: {"data":
    ...}}`` or ``{name: {"error": "..."}}``."""
    out = {}
    for name in names:
        restore(frozen)
        checks.GRADING_SEED = seed  # after restore, whose snapshot holds the default: the grader's, not the cells'
        checks.PORTS.clear()
        checks.PORTS.update(PEER_PORTS)  # where the grader's own ranks listen (``peers``), as the server said
        start_clock(seconds)
        try:
            out[name] = {"data": checks.plain(checks.REGISTRY[name].probe(namespace))}
        except BaseException as err:
            frames = traceback.walk_tb(err.__traceback__)  # no source read: the lines' numbers are enough
            last = list(traceback.StackSummary.extract(frames, lookup_lines=False))[-1:]
            where = (f" (line {last[0].lineno} of {last[0].filename})"
                     if last and last[0].filename.startswith("<cell") else "")
            out[name] = {"error": f"{type(err).__name__}: {err}{where}", "type": type(err).__name__, "where": where}
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
        spec = importlib.util.spec_from_file_location(f"course_grader.checks._graded{i}", path)
        loaded.append(importlib.util.module_from_spec(spec))
        spec.loader.exec_module(loaded[-1])
    loaded += [m for name, m in sorted(sys.modules.items())
               if name.startswith(PACKAGES) and m is not None and m not in loaded]
    return snapshot([*loaded, torch, *RELIED_ON])


def forbidden_answers() -> dict[int, tuple[list, dict[str, frozenset]]]:
    """Per checks module (by the id of its globals): the answers its probes forbid and their source lines
    (``audit.sources``). Read in the server, before any fork is fenced away from the hidden modules' files."""
    out = {}
    for entry in checks.REGISTRY.values():
        space = entry.probe.__globals__
        if id(space) not in out:
            answers = checks.forbidden(space)
            out[id(space)] = (answers, audit.sources(answers))
    return out


def guard(job: dict, frozen: tuple[dict, list, list], forbidden: dict[int, tuple[list, dict]]) -> None:
    """Add the audit hook before the student's first cell: reports go to the job's pipe; the code of course_lib's
    functions, torch's top level's and the answers the job's checks forbid can be rebound by forbid alone; those
    answers' sources are what a compiled source is compared with. (``restore`` may put code back too.)"""
    compared: dict[str, frozenset] = {}
    protected = {id(fn) for fn, _, _ in frozen[2]}
    for name in job["names"]:
        if name in checks.REGISTRY:
            answers, sources = forbidden.get(id(checks.REGISTRY[name].probe.__globals__), ([], {}))
            compared.update(sources)
            protected |= {id(fn) for answer in answers for fn in grading.answer_functions(answer)}
    audit.install(job["report_fd"], protected, audit.allowed(*grading.code_rebinders(), restore),
                  audit.loaded_files(), compared)


def rank_guard(spawned: bool) -> Callable[[], None]:
    """``launch.RANK_GUARD`` in a grading job's ranks that receive the student's definitions by value (cloudpickle,
    as a GPU machine's spawned ranks do): unpickling runs code the submission chose, so what the probes rely on is
    snapshotted before and restored after. A spawned rank (a fresh Python, without the job's audit hook) adds the
    hook first; it refuses what the job's refuses, and reports nowhere (a spawned rank keeps none of the job's pipes).
    """
    loaded = [m for name, m in sorted(sys.modules.items()) if name.startswith(PACKAGES) and m is not None]
    frozen = snapshot([*loaded, torch, *RELIED_ON])
    if spawned:
        audit.install(os.open(os.devnull, os.O_WRONLY), {id(fn) for fn, _, _ in frozen[2]},
                      audit.allowed(*grading.code_rebinders(), restore), audit.loaded_files(), {})
    return lambda: restore(frozen)


def run_job(job: dict, frozen: tuple[dict, list, list], forbidden: dict[int, tuple[list, dict]]) -> None:
    """One submission: its cells in a fresh namespace, then the probes; the data to ``job["out"]``."""
    namespace = {"__name__": "__main__", "display": print}
    CLOCK["fd"] = job["report_fd"]
    PEER_PORTS.update(job.get("ports", {}))
    guard(job, frozen, forbidden)
    cell_errors = run_cells(job["cells"], namespace, job["seconds"])
    results = run_probes(job["names"], namespace, job["seconds"], frozen, int(job.get("seed", 0)))
    restore(frozen)  # the way out (torch.save, pickle, io) as it was before the student's code ran
    torch.save({"results": results, "cell_errors": cell_errors}, job["out"])


def contain() -> None:
    """The fork's limits, set before any of the job's code runs and inherited by every process it starts: no core
    files, no file past ``FILE_LIMIT``, no process's data (its heap and private memory) past ``MEMORY_LIMIT``."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    for which, cap in ((resource.RLIMIT_FSIZE, FILE_LIMIT), (resource.RLIMIT_DATA, MEMORY_LIMIT)):
        soft, hard = resource.getrlimit(which)
        limit = cap if hard == resource.RLIM_INFINITY else min(cap, hard)
        resource.setrlimit(which, (limit, limit))


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:  # gone meanwhile
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                out.append(int(entry))
    return out


def reap_leftovers() -> int:
    """Kill and reap every process this server still has as a child once a job ended: a job's ranks, and any
    daemon it double-forked into a session of its own (the server is their subreaper). Returns how many."""
    killed = 0
    for _ in range(100):
        left = children(os.getpid())
        if not left:
            break
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            killed += 1
    return killed


def drain(fd: int, into: bytearray, cap: int = 1 << 16) -> None:
    """Read what the fork reported so far, without waiting; keep at most ``cap`` bytes."""
    while select.select([fd], [], [], 0)[0]:
        chunk = os.read(fd, 4096)
        if not chunk:
            return
        if len(into) < cap:
            into += chunk[:cap - len(into)]


def run_fork(job: dict, frozen: tuple[dict, list, list], forbidden: dict, private_shm: bool) -> None:
    """The submission's process, a fork of the server: contained and fenced before any of the job's code runs, its
    output to the job's log; it never returns (``os._exit``)."""
    try:
        os.setsid()  # its own process group: a time-out kills it and every rank it started
        if private_shm and not sandbox.private_shm():
            raise RuntimeError("this machine gave the grading server a private /dev/shm, and this job none")
        contain()
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
        run_job(job, frozen, forbidden)
    except BaseException:  # the grader's own failure: to the job's log, which the grader shows
        traceback.print_exc()
    finally:
        os._exit(0)


def watch(pid: int, job: dict, reports_r: int) -> bytearray:
    """Wait for the fork ``pid`` to end, reading what it reports; kill its group once it runs ``GRACE`` seconds past
    a cell's or a probe's limit (each ``started`` report restarts that clock) or past the job's, even with its alarm
    switched off. Returns what it reported."""
    reported = bytearray()
    start = last = time.monotonic()
    seen = 0
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        drain(reports_r, reported)
        started = reported.count(b'{"started"')
        if started != seen:  # a cell or a probe started: its time counts from now
            seen, last = started, time.monotonic()
        now = time.monotonic()
        if now > start + job["limit"] or now > last + job["seconds"] + GRACE:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            break
        time.sleep(0.05)
    return reported


def peers(job: dict) -> dict[str, peer.Running]:
    """The grader's own ranks of the job's checks that have one, forked from this server before the job's fork (so
    never from a process that ran student code), their records in ``job["wires"]``, which the job cannot reach; their
    ports go into the job (``job["ports"]``). Each waits for its ranks as long as the whole job may run: its probe
    starts after the job's cells and the probes before it."""
    started = {}
    for name in job["names"]:
        entry = checks.REGISTRY.get(name)
        if entry is not None and entry.peer is not None and job.get("wires"):
            started[name] = peer.start(entry.peer, Path(job["wires"]) / f"{name}.pt", int(job.get("seed", 0)),
                                       job["limit"])
    job["ports"] = {name: running.ports for name, running in started.items()}
    return started


def serve(modules: list[str]) -> None:
    """Load once, then grade one submission per line of stdin (a job file) in a fork of this process, each fork
    fenced to its own scratch folder before any of its code runs; answer each line with one line when it is done:
    ``done`` and the JSON list of what its audit hook reported.

    The imports (torch, transformers, course_lib) and the checks cost seconds; a fork costs milliseconds, and no
    student code ever runs in this process, so every fork starts from the same clean state."""
    launch.RANK_GUARD = "course_grader.child:rank_guard"
    frozen = prepare(modules)  # snapshots RANK_GUARD too: restored before every probe
    forbidden = forbidden_answers()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans of a job are this server's, to kill at its end
    private_shm = sandbox.shm_can_be_private()  # else each job's leftovers in /dev/shm are removed after it
    for line in sys.stdin:
        job = json.loads(open(line.strip()).read())
        shm_before = None if private_shm else set(os.listdir("/dev/shm"))
        reports_r, reports_w = os.pipe()
        job["report_fd"] = reports_w
        ranks = peers(job)
        pid = os.fork()
        if pid == 0:
            os.close(reports_r)
            run_fork(job, frozen, forbidden, private_shm)
        os.close(reports_w)
        reported = watch(pid, job, reports_r)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)  # the ranks it left in its group
        for running in ranks.values():  # each has saved its record; one still waiting for the job's ranks is killed
            running.finish(wait=2.0)
        reap_leftovers()
        if shm_before is not None:
            sandbox.clear_shm(shm_before)
        drain(reports_r, reported)
        os.close(reports_r)
        print("done", json.dumps(audit.read_reports(reported.decode(errors="replace"))), flush=True)

if __name__ == "__main__":
    if sys.argv[1:2] != ["--serve"]:
        sys.exit("usage: python -m course_grader.child --serve [HIDDEN_CHECKS.py ...]  (then job files on stdin)")
    sys.modules["course_grader.child"] = sys.modules[__name__]  # a forked rank's RANK_GUARD is this module's
    serve(sys.argv[2:])
