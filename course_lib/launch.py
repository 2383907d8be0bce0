"""Run N worker processes from a notebook cell and get their results back.

    results = launch("course_lib.parallel.ddp_torch:train", nprocs=2, kwargs={"spec": DDPRun(steps=5)})

``launch`` starts ``torchrun`` on ``course_lib.workers`` with a target ``"module:function"``
(a function of this package, or of a file the notebook wrote with ``%%writefile``). Every
rank runs ``function(**kwargs)`` inside an initialised process group; ``launch`` returns the
ranks' results ordered by rank. While it runs, each rank's output streams into the cell,
every line prefixed with its rank.

**The worker contract.** A worker is a module-level function that takes JSON-able keyword
arguments and returns a JSON-able dict (or None). Each result carries ``rank`` and
``world_size`` (``course_lib.workers`` adds them where the function did not); a training
worker (``ddp_torch.train``, ``fsdp_torch.train``, ``zero_deepspeed.train``) returns ``train.worker_result``:
also ``losses``, a list with the global batch's loss of every step it ran.

It never hangs: the rendezvous port is a free one picked for this launch, a rank that
raises ends the launch at once (torchrun stops the others) and its traceback is raised
here as ``WorkerError``, and the whole launch has a ``timeout``. The same entry point
runs across machines: give each node ``nnodes``, its ``node_rank`` and one
``rdzv_endpoint`` (host:port of node 0), exactly as torchrun's rendezvous wants.

``run_forked(fn, nprocs, kwargs)`` is the other way in, with the same worker contract (``fn(**kwargs)`` in an
initialised group; a rank asks ``torch.distributed`` for its rank, as a torchrun worker does): it runs a function
defined in the notebook itself, a lambda or a closure too, on N CPU ranks over gloo (plain spawned processes cannot
unpickle those), and returns whatever each rank returned (anything picklable, not only JSON). It forks the notebook's
process where that is safe, which is instant. On a machine with GPUs it is not: the parent's
first backward starts autograd's per-device threads, and a forked child that then calls
backward fails. There it starts fresh processes instead and ships the function by value with
cloudpickle, which costs a few seconds of start-up per rank, and hides the GPUs from them
(``CPU_ONLY_ENV``, as ``launch(device_type="cpu")`` does): a CPU rank that saw them would put its
model on cuda:0, every rank on the same GPU, talking over gloo.

``on_ranks(fn, nprocs, device, **kwargs)`` makes the one choice between the two for a notebook: torchrun on one
GPU per rank where the machine has that many, else CPU ranks through ``run_forked``, the worker contract the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import types
import uuid
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from course_lib.device import backend_for, default_device, emulating_node, ranks_device
from course_lib.distributed import average_over_gloo, free_port
from course_lib.results import run_dir
from course_lib.workers import STACKS_SIGNAL, exit_now, set_parent_death_signal


class WorkerError(RuntimeError):
    """A rank raised: the message holds its rank and traceback; ``kind`` is its exception's type name (None where
    the rank died without a Python exception)."""

    def __init__(self, message: str, kind: str | None = None):
        super().__init__(message)
        self.kind = kind


def check_world(nprocs: int, device_type: str | None = None) -> None:
    """Refuse a world size the hardware lacks, before anything starts."""
    device_type = device_type or default_device().type
    if nprocs < 1:
        raise ValueError(f"nprocs={nprocs} must be at least 1")
    if device_type == "cuda" and nprocs > torch.cuda.device_count():
        raise ValueError(f"nprocs={nprocs} but this machine has {torch.cuda.device_count()} GPU(s): "
                         f"use nprocs <= {torch.cuda.device_count()} (one process per GPU)")
    # an emulated node (run_all --tier node --emulate) runs its 8 ranks of a tiny model on any CPU, slowly
    if device_type == "cpu" and nprocs > (os.cpu_count() or 1) * 2 and not emulating_node():
        raise ValueError(f"nprocs={nprocs} CPU processes on {os.cpu_count()} cores would only thrash: "
                         f"use nprocs <= {(os.cpu_count() or 1) * 2}")


# torchrun on one machine: host the rendezvous here (is_host) and give the ranks 127.0.0.1 as MASTER_ADDR. Left to
# itself torchrun (2.7 at least) names this machine by socket.getfqdn() and the ranks look that name up: no lookup
# on the loopback, which every machine has, whatever its /etc/hosts or DNS say.
ONE_MACHINE = ["--rdzv-conf=is_host=1", "--local-addr=127.0.0.1"]
PORT_TRIES = 3  # launches whose free port another process took meanwhile are retried on a new one
KILL_GRACE = 5.0  # seconds torchrun gets to stop its ranks after SIGTERM, before SIGKILL


def launch(target: str, nprocs: int = 2, kwargs: dict | None = None, *, timeout: float = 300,
           nnodes: int = 1, node_rank: int = 0, rdzv_endpoint: str | None = None,
           device_type: str | None = None, echo: bool = True) -> list[dict]:
    """Run ``target`` ("module:function") on ``nprocs`` local ranks with torchrun; return their results."""
    if ":" not in target:
        raise ValueError(f"target={target!r} must be 'module:function', e.g. 'course_lib.parallel.ddp_torch:train'")
    check_world(nprocs, device_type)
    clear_stale_extension_locks()
    out = Path(tempfile.mkdtemp(prefix="course_launch_"))
    try:
        (out / "kwargs.json").write_text(json.dumps(kwargs or {}, default=_as_json))
        # the timeout is for the ranks' work; starting them (torchrun, then each rank's imports) has its own,
        # generous bound, and the timeout starts once every rank has said it runs (its pid file, the handshake)
        deadline = time.monotonic() + max(timeout, STARTUP_TIMEOUT)
        for _ in range(PORT_TRIES):
            # a port we picked is hosted here (is_host): taken meanwhile, torchrun fails at once instead of
            # joining whatever listens there as a client and waiting for a rendezvous that never comes
            endpoint = rdzv_endpoint or f"127.0.0.1:{free_port()}"
            cmd = [sys.executable, "-m", "course_lib.workers", "torchrun", f"--nnodes={nnodes}",  # workers.agent_main
                   f"--node-rank={node_rank}", f"--nproc-per-node={nprocs}", "--rdzv-backend=c10d",
                   f"--rdzv-endpoint={endpoint}", f"--rdzv-id={'course' if rdzv_endpoint else uuid.uuid4().hex[:8]}",
                   "--max-restarts=0", "--monitor-interval=0.2", *([] if rdzv_endpoint else ONE_MACHINE),
                   "-m", "course_lib.workers", target, str(out)]
            proc, lines, shown = _run_torchrun(cmd, _launch_env(nprocs, device_type, out), out, deadline, timeout,
                                               echo, nprocs)
            if rdzv_endpoint or not _port_was_taken(proc, lines, out):
                break
        if echo and not shown:  # torchrun's own lines, held back while a retry was possible
            print("".join(lines), end="", flush=True)
        return _results(proc, lines, out, target)
    finally:  # whatever happened: no rank lives on, no folder is left behind
        _kill_ranks(out, expected=nprocs)
        shutil.rmtree(out, ignore_errors=True)


def _as_json(value):
    """A worker's frozen run spec (a dataclass) as the dict of its fields; the worker rebuilds it (``RunSpec.of``)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    raise TypeError(f"{type(value).__name__} is not JSON-able: a worker on torchrun's ranks takes plain values "
                    "(numbers, strings, lists, dicts) or a run spec")


# What a process needs in its environment, from its start, to see no GPU: torch (CUDA, and ROCm's HIP, which
# reads CUDA_VISIBLE_DEVICES too), ROCm's runtime below HIP (an empty HIP_VISIBLE_DEVICES alone was ignored by
# some ROCm releases: ROCm/hip#3001; an empty ROCR_VISIBLE_DEVICES hides every GPU), and DeepSpeed, which
# otherwise picks its accelerator from the hardware.
CPU_ONLY_ENV = {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": "", "ROCR_VISIBLE_DEVICES": "",
                "DS_ACCELERATOR": "cpu"}


def _launch_env(nprocs: int, device_type: str | None, out: Path) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COURSE_LAUNCH_PID": str(os.getpid()), "COURSE_LAUNCH_DIR": str(out)}
    # one BLAS/OpenMP thread pool per rank sized to its share of the cores, so ranks do not thrash
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nprocs)))
    if device_type == "cpu":  # CPU ranks on a GPU machine: hide the GPUs from torch and from DeepSpeed
        env.update(CPU_ONLY_ENV)
    return env


def _run_torchrun(cmd: list[str], env: dict, out: Path, deadline: float, timeout: float,
                  echo: bool, nprocs: int) -> tuple[subprocess.Popen, list[str], bool]:
    """One torchrun: (its process, its output lines, whether they were shown); stopped at ``deadline``, or
    ``timeout`` seconds after its ``nprocs`` ranks have all started."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        return (proc, *_stream(proc, out, deadline, timeout, echo, nprocs))
    except BaseException:  # a timeout, or an interrupted cell (KeyboardInterrupt): no rank may keep running
        _kill(proc, out)
        raise


def _port_was_taken(proc: subprocess.Popen, lines: list[str], out: Path) -> bool:
    """Whether torchrun failed because its rendezvous port was taken, before any rank started."""
    return (proc.returncode != 0 and not any(out.glob("rank*.pid"))
            and any("EADDRINUSE" in line or "address already in use" in line.lower() for line in lines))


def _results(proc: subprocess.Popen, lines: list[str], out: Path, target: str) -> list[dict]:
    # the first rank to fail is the cause; the others usually fail after it, losing their peer
    errors = sorted(out.glob("rank*.error"), key=lambda p: p.stat().st_mtime_ns)
    if errors:
        rank = errors[0].stem[4:]
        raise WorkerError(f"rank {rank} of {target} failed:\n{errors[0].read_text()}")
    if proc.returncode != 0:  # a rank died without a Python traceback (a signal, a crash in C++)
        # enough lines to reach past torchrun's own summary into what the ranks printed (faulthandler's stack)
        raise WorkerError(f"torchrun exited with {proc.returncode} running {target}; last output:\n"
                          + "".join(lines[-80:]))
    files = sorted(out.glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    return [json.loads(p.read_text()) for p in files]


STACKS_WAIT = 3.0  # seconds a timed-out launch waits for the stacks it asked of torchrun and the ranks


def _stream(proc: subprocess.Popen, out: Path, deadline: float, timeout: float,
            echo: bool, nprocs: int) -> tuple[list[str], bool]:
    """Print the launch's output as it comes; raise TimeoutError past ``deadline``, which moves to ``timeout``
    seconds from the moment all ``nprocs`` ranks have started (their pid files). Returns (lines, shown).

    torchrun's own lines are held back until a rank speaks: a launch retried on a new port then
    shows nothing of the attempt that failed. Past the deadline torchrun and every rank that started
    are asked for their stacks, and the error holds them: where each one waited.
    """
    lines, buf, shown, started = [], b"", False, False
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    while True:
        if not started and len(list(out.glob("rank*.pid"))) >= nprocs:
            started, deadline = True, time.monotonic() + timeout
        if time.monotonic() > deadline:
            when = ("after its ranks started" if started else
                    f"its ranks did not all start within {max(timeout, STARTUP_TIMEOUT):.0f} s")
            raise TimeoutError(f"the launch ran past timeout={timeout} s ({when}) and was stopped; last output:\n"
                               + "".join(lines[-30:]) + _stacks(proc, out))
        if sel.select(timeout=0.2):
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            buf += chunk
            *complete, buf = buf.split(b"\n")
            for raw in complete:
                lines.append(raw.decode(errors="replace") + "\n")
                if echo and not shown and lines[-1].startswith("[rank"):
                    print("".join(lines[:-1]), end="", flush=True)
                    shown = True
                if echo and shown:
                    print(lines[-1], end="", flush=True)
    proc.wait()
    return lines, shown


def clear_stale_extension_locks(root: str | None = None) -> list[Path]:
    """Remove JIT-build lock files that no live process holds; return the ones removed.

    torch's extension loader (DeepSpeed's ops use it) takes ``<build dir>/lock`` on every load and
    waits, forever, while the file exists. A rank killed inside that window (an interrupted cell, a
    timeout) leaves the file behind, and every later DeepSpeed launch would hang. The process that
    holds the lock keeps it open, so a lock that no process has open is stale.
    """
    base = Path(root or extensions_dir())
    locks = list(base.glob("*/lock")) + list(base.glob("*/*/lock"))
    if not locks:
        return []
    held = _open_files()
    removed = []
    for lock in locks:
        if str(lock.resolve()) not in held:
            lock.unlink(missing_ok=True)
            removed.append(lock)
    return removed


def extensions_dir() -> str:
    """Where torch keeps JIT-built extensions (DeepSpeed's ops): TORCH_EXTENSIONS_DIR; else, in the course's
    venv, .venv/torch_extensions, where ``make setup`` (``make ops``) builds DeepSpeed's CPU ops; else torch's
    default. ``make``, the images and .ci/run set the variable; everything else asks here."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return os.environ["TORCH_EXTENSIONS_DIR"]
    if sys.prefix != sys.base_prefix:
        return os.path.join(sys.prefix, "torch_extensions")
    from torch.utils.cpp_extension import get_default_build_root  # 0.2 s of imports: only where it is the answer

    return get_default_build_root()


def use_extensions_dir() -> str:
    """Set TORCH_EXTENSIONS_DIR to ``extensions_dir()`` unless it is set, and put this environment's ninja (pip's, which
    torch's extension builds need) first on PATH: DeepSpeed and every process started from here (a grading kernel,
    torchrun's ranks) then load the ops ``make setup`` built instead of building their own. A machine's own ninja
    (Debian's 1.11) and pip's (1.13) each read the other's .ninja_log as foreign and rebuild every op: the floor's
    notebooks 09 and 10 paid 60-80 s each for that in CI, their ops built from a shell and loaded from a kernel."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", extensions_dir())
    here = os.path.dirname(sys.executable)
    ninja = os.path.join(here, "ninja")
    if os.path.exists(ninja) and shutil.which("ninja") != ninja:
        os.environ["PATH"] = here + os.pathsep + os.environ.get("PATH", "")
    return os.environ["TORCH_EXTENSIONS_DIR"]


def _open_files() -> set[str]:
    """Every path some process of this machine has open (what /proc lets us see)."""
    held = set()
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            for fd in fd_dir.iterdir():
                try:
                    held.add(os.readlink(fd))
                except OSError:
                    continue
        except OSError:
            continue
    return held


def _stacks(proc: subprocess.Popen, out: Path) -> str:
    """Where torchrun and each rank that started are waiting: their Python stacks, asked for with
    ``workers.STACKS_SIGNAL`` and written to ``out/NAME.stacks``."""
    asked = {"torchrun": proc.pid}
    for f in sorted(out.glob("rank*.pid"), key=lambda f: int(f.stem[4:])):
        with contextlib.suppress(OSError, ValueError):
            asked[f.stem] = int(f.read_text())
    for pid in asked.values():
        if _of_launch(pid, out):
            with contextlib.suppress(OSError):  # gone meanwhile
                os.kill(pid, STACKS_SIGNAL)
    deadline = time.monotonic() + STACKS_WAIT
    while time.monotonic() < deadline and not all(_written(out / f"{name}.stacks") for name in asked):
        time.sleep(0.1)
    started = [name for name in asked if name != "torchrun"]
    report = f"\nranks started: {', '.join(started) or 'none'} of this launch\n"
    for name in asked:
        text = _written(out / f"{name}.stacks")
        report += f"--- {name}'s stack ---\n{text or '(none came: it had not started or did not answer)'}\n"
    return report


def _written(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _kill(proc: subprocess.Popen, out: Path) -> None:
    """Stop torchrun (SIGTERM to its group, SIGKILL after KILL_GRACE), then any rank it left, by pid."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=KILL_GRACE)
            break
        except ProcessLookupError:
            break
        except subprocess.TimeoutExpired:
            continue
    _kill_ranks(out)


def _kill_ranks(out: Path, expected: int = 0, wait: float = 5.0) -> None:
    """SIGKILL every rank of this launch still alive (the pids they wrote to ``out``); wait until they are gone.

    torchrun starts its ranks in sessions of their own, so killing its group misses them. A pid
    counts only while its command line names ``out``: a recycled pid belongs to someone else. Until
    ``expected`` ranks have written their pid (or ``wait`` seconds pass) the folder is read again: a
    rank still starting up (importing torch on a busy machine) writes its pid after the first look.
    """
    seen: set[int] = set()
    deadline = time.monotonic() + wait
    while True:
        for f in out.glob("rank*.pid"):
            try:
                pid = int(f.read_text())
            except (OSError, ValueError):  # the pid file half written: read it on the next look
                continue
            if pid not in seen:
                seen.add(pid)
                if _of_launch(pid, out):
                    with contextlib.suppress(OSError):  # gone meanwhile
                        os.kill(pid, signal.SIGKILL)
        if time.monotonic() >= deadline or (len(seen) >= expected and not any(_running(pid) for pid in seen)):
            return
        time.sleep(0.05)


def _of_launch(pid: int, out: Path) -> bool:
    """Whether ``pid`` is a process of the launch in ``out`` (its command line names the folder), past its exec: not
    a recycled pid, and not the fork that has yet to become torchrun."""
    try:
        return str(out).encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # gone already
        return False


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def run_forked(fn: Callable, nprocs: int = 2, kwargs: dict | None = None, *, timeout: float = 60,
               join: tuple[int, int] | None = None) -> list:
    """Fork ``nprocs`` copies of this process; each runs ``fn(**kwargs)`` in a CPU (gloo) group.

    ``launch``'s worker contract: a rank learns its place from ``torch.distributed`` (``dist.get_rank()``,
    ``dist.get_world_size()``, or ``train.rank_and_world()``), so one worker runs under either.

    Returns the ranks' return values (picklable) in rank order. A rank that raises ends the run and its
    traceback is raised here as ``WorkerError``; when ``fn`` runs past ``timeout`` (counted from the moment
    every rank has joined the group) every rank is killed and ``TimeoutError`` is raised.

    ``join=(port, before)``: the group's rendezvous is hosted by another process, rank 0 of it, on 127.0.0.1:``port``
    (a ``TCPStore``), with ``before`` ranks of its own; these ``nprocs`` ranks are ranks ``before`` to
    ``before + nprocs - 1`` of a world of ``before + nprocs``. (A grader's ranks join a student's this way.)
    """
    check_world(nprocs, "cpu")
    if dist.is_initialized():  # the forked ranks would inherit it and could not start their own
        raise RuntimeError(f"run_forked needs a process without a process group, and this one has one (world size "
                           f"{dist.get_world_size()}): call torch.distributed.destroy_process_group() first")
    log = rank_log()
    before = log.stat().st_size if log.exists() else 0
    try:
        for attempt in range(1 if join else 3):
            try:
                return _run_forked_once(fn, nprocs, kwargs or {}, timeout, backend_for("cpu"), join)
            except _SetupFailed as err:  # the rendezvous itself failed (a port taken meanwhile): try a new port
                last = err
        raise WorkerError(f"the process group could not be set up three times: {last}")
    finally:
        if log.exists() and log.stat().st_size > before:
            print(f"(the ranks' warnings and messages are in {log})")


def rank_log() -> Path:
    """Where the standard error of ``run_forked``'s ranks goes: ``<run dir>/logs/ranks.log`` (appended)."""
    return run_dir() / "logs" / "ranks.log"


def _stderr_to_log(rank: int, world: int) -> None:
    """This rank's standard error, Python's and the C library's (and so its children's: a compiler DeepSpeed probes
    with), appended to ``rank_log()``. A rank's warnings are not the cell's errors: nbgrader's Validate fails a
    graded cell that wrote anything to stderr, and DeepSpeed's ranks write dozens of lines there on a correct run.
    A rank that raises still reaches the cell: its traceback comes back as ``WorkerError``."""
    path = rank_log()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True)
    print(f"== rank {rank} of {world}, pid {os.getpid()}, {time.strftime('%Y-%m-%d %H:%M:%S')}", file=sys.stderr)


def on_ranks(fn: Callable, nprocs: int, device: torch.device | str, *, timeout: float = 300, **kwargs) -> list[dict]:
    """Run the worker ``fn(**kwargs)`` on ``nprocs`` ranks where a notebook on ``device`` puts them; results by rank.

    The course's one choice of ranks and launcher (``device.ranks_device``): one torchrun worker per GPU where there
    are ``nprocs`` GPUs (``launch``: fork and an initialised GPU do not mix), else CPU ranks over gloo
    (``run_forked``: forked, or spawned with the GPUs hidden on a GPU machine). The worker contract is ``launch``'s
    on both: keyword arguments in, a dict (or None) out, each result with ``rank`` and ``world_size``. On GPUs
    ``fn`` must be a module-level function of an importable module, which torchrun's workers import by name.
    """
    if ranks_device(nprocs, device) == "cuda":
        module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
        if not module or module == "__main__" or "<" in name or "." in name:
            raise ValueError(f"{getattr(fn, '__name__', fn)!r} cannot run on GPU ranks: torchrun's workers import "
                             "their function by name, so put it at the top level of a module (a course_lib one, or a "
                             "file the notebook writes with %%writefile)")
        return launch(f"{module}:{name}", nprocs, kwargs, timeout=timeout, device_type="cuda", echo=False)
    return run_forked(_with_rank, nprocs, {"fn": fn, "kwargs": kwargs}, timeout=timeout)


def _with_rank(fn: Callable, kwargs: dict) -> dict:
    """``fn(**kwargs)``'s dict with the rank and world size, as ``launch``'s ranks return it (``workers``)."""
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), **(fn(**kwargs) or {})}


STARTUP_TIMEOUT = 120.0  # seconds for the ranks of run_forked to start and join their group
# "module:function" that a rank receiving its work by value calls before unpickling it (unpickling runs code the
# sender chose): it returns what to call once the work is unpickled. Set by a grading process (course_grader.child);
# None everywhere else.
RANK_GUARD: str | None = None


class _SetupFailed(RuntimeError):
    pass


def _run_forked_once(fn: Callable, nprocs: int, kwargs: dict, timeout: float, backend: str,
                     join: tuple[int, int] | None = None) -> list:
    import multiprocessing as mp

    spawned = not fork_is_safe()
    ctx = mp.get_context("spawn" if spawned else "fork")
    if ships_by_value():
        shipped = by_value((fn, kwargs))  # a notebook's function too, and one among the kwargs
    else:
        shipped = (fn, kwargs)
    (port, before), queue = join or (free_port(), 0), ctx.SimpleQueue()
    # daemon=True stops the ranks when this process exits normally; _forked_rank covers a kill (SIGKILL)
    procs = [ctx.Process(target=_forked_rank, daemon=True, args=(shipped, before + rank, before + nprocs, port, backend,
                                                                 queue, os.getpid(), spawned, RANK_GUARD))
             for rank in range(nprocs)]
    with _environment(CPU_ONLY_ENV):  # a spawned rank's Python starts with this process's environment
        for p in procs:
            p.start()
    # the timeout is for fn; starting the ranks (a spawn imports torch afresh) has its own, generous bound
    deadline, got, ready = time.monotonic() + max(timeout, STARTUP_TIMEOUT), {}, set()
    try:
        while len(got) < nprocs:
            if not queue.empty():
                rank, ok, payload = queue.get()
                if ok is None:
                    raise _SetupFailed(f"rank {rank}: {payload.strip().splitlines()[-1]}")
                if ok == "ready":
                    ready.add(rank)
                    if len(ready) == nprocs:
                        deadline = time.monotonic() + timeout
                    continue
                if not ok:
                    kind, text = payload
                    raise WorkerError(f"rank {rank} failed:\n{text}", kind)
                got[rank] = payload
                continue
            if any(p.exitcode not in (None, 0) for p in procs) and queue.empty():
                bad = next(r for r, p in enumerate(procs) if p.exitcode not in (None, 0))
                raise WorkerError(f"rank {before + bad} died with exit code {procs[bad].exitcode} before returning")
            if time.monotonic() > deadline:
                raise TimeoutError(f"run_forked passed timeout={timeout} s; ranks still running were killed")
            time.sleep(0.01)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
    return [got[before + r] for r in range(nprocs)]


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    """``os.environ`` with ``values`` set while the block runs, then as it was.

    multiprocessing's spawn has no ``env`` argument: its children start with ``os.environ`` as it is at
    ``start()``, before they import torch. A forked child gets it too (where no GPU exists: nothing to hide).
    """
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def fork_is_safe() -> bool:
    """Whether forking this process gives children that can run autograd.

    On a machine with GPUs the first backward starts autograd's per-device threads, and a
    forked child cannot run backward after that. ``device_count`` does not initialise CUDA.
    ``COURSE_SPAWN_RANKS=1`` takes the GPU machine's answer on any machine (how the tests run that path on a CPU).
    """
    return torch.cuda.device_count() == 0 and os.environ.get("COURSE_SPAWN_RANKS") != "1"


def ships_by_value() -> bool:
    """Whether ``run_forked``'s ranks get their function by value (cloudpickle) rather than inheriting it: where they
    are spawned (``fork_is_safe()`` is False), and under ``COURSE_SPAWN_RANKS=by-value``, which forks the ranks but
    ships the function as a spawn does. That is the GPU machine's data path at fork's cost: what a rank receives of a
    notebook (only what the function names, by value) without a fresh Python per rank, which the tests use for every
    multi-rank check but one."""
    return not fork_is_safe() or os.environ.get("COURSE_SPAWN_RANKS") == "by-value"


def by_value(obj) -> bytes:
    """``obj`` pickled as a spawned rank receives it: cloudpickle, a notebook's functions by value, and a module by
    reference even where it is not a plain ``ModuleType``.

    cloudpickle ships, with a function, each submodule of a module it uses whose name the function's code spells:
    a worker that reads ``dist.get_rank()`` and some ``stage.config`` takes ``torch.distributed.config`` along
    (torch 2.13 has it, 2.7 not), and torch's config modules are a ``ModuleType`` subclass that pickle refuses
    ("cannot pickle 'ConfigModuleInstance' object"): notebook 15's executor on the Llama failed so wherever ranks
    are spawned, i.e. on every GPU machine (found forcing that path here: ``COURSE_SPAWN_RANKS=1``).
    """
    import cloudpickle

    class Pickler(cloudpickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, types.ModuleType) and type(obj) is not types.ModuleType and obj.__name__ in sys.modules:
                return importlib.import_module, (obj.__name__,)
            return super().reducer_override(obj)

    buffer = io.BytesIO()
    Pickler(buffer).dump(obj)
    return buffer.getvalue()


def _forked_rank(work, rank, world, port, backend, queue, parent, spawned, guard=None):
    # a daemon child is only stopped by its parent's normal exit: a killed kernel would leave it running
    if set_parent_death_signal(signal.SIGKILL) and os.getppid() != parent:  # the parent went before we asked
        os._exit(1)
    _stderr_to_log(rank, world)
    if isinstance(work, bytes):  # the function and its kwargs came by value
        import cloudpickle

        module, _, name = (guard or ":").partition(":")
        after = getattr(importlib.import_module(module), name)(spawned) if guard else None
        work = cloudpickle.loads(work)
        if after:
            after()
    fn, kwargs = work
    torch.set_num_threads(1)  # more than one OpenMP thread after fork can hang (libgomp)
    # what torchrun tells each rank: DeepSpeed's engine refuses to start without LOCAL_RANK
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        average_over_gloo()
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))
        return
    queue.put((rank, "ready", None))
    try:
        ok, payload = True, fn(**kwargs)
    except BaseException as err:
        ok, payload = False, (type(err).__name__, traceback.format_exc())
    # the answer goes out before the teardown: a rank that left a send or a receive unwaited (a student's ring that
    # raised midway) makes gloo's barrier wait for ever, and run_forked stops every rank once all have answered
    queue.put((rank, ok, payload))
    try:
        if ok:
            dist.barrier()  # nobody tears down the store while a slower rank still talks to it
    except Exception:  # a peer is gone: run_forked stops the ranks once all have answered, maybe mid-barrier
        pass  # this rank's answer is out already, and a traceback here would only land in the notebook's output
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if spawned:  # a forked rank ends with os._exit already; a spawned one would shut Python down (see exit_now)
        exit_now(0)
