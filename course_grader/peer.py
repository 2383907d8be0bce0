"""The grader's own rank in a multi-rank check: rank 0 of the group that the student's ranks join.

A multi-rank exercise is graded by what crosses the wire, not by what the student's ranks say about themselves. A
check names a ``Peer``; before its probe starts, a process of the grader's (a fork of the grading server, outside
the fence, where no student code ever ran; in a notebook's own kernel, a process of the kernel's) hosts each
round's rendezvous and joins it as rank 0. It plays the reference's side of every collective (torch's buckets, in
torch's order, say) and records, as it happens, what arrived from the student's ranks and when. The probe's ranks
join it (``launch.run_forked(..., join=(peer_port(name), 1))``) as ranks 1 to ``world - 1``; the judge reads the
record beside the probe's data: ``judge(data, wire)``.

    register("test_x", probe, judge, peer=Peer(world=2, play=play_x))

The record is saved after every event, so a peer that gloo stops (a student's rank that sent another size than
the reference's aborts the side that receives more than it expected) leaves it up to the collective that failed.
The student's process can neither read nor write it: it lies outside the grading fence (``grade.Server``).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

HOST = "127.0.0.1"


@dataclass(frozen=True)
class Peer:
    """A check's own rank: ``play(wire, round)`` runs as rank 0 of a group of ``world`` ranks, once per round (each
    round a new group, on a port of its own), and records what arrives with ``wire.record``. ``world``: one size for
    every round, or each round's."""

    world: int | tuple[int, ...]
    play: Callable[["Wire", int], None]
    rounds: int = 1

    def world_of(self, round: int) -> int:
        """The size of round ``round``'s group."""
        return self.world if isinstance(self.world, int) else self.world[round]


class Wire:
    """What the peer saw, in order: ``record(what, **data)`` appends ``{"what", "t", **data}`` (``t``: this machine's
    monotonic clock) and saves the whole list, so the file always holds every event so far."""

    def __init__(self, path: Path):
        self.path, self.events = Path(path), []

    def record(self, what: str, **data) -> None:
        self.events.append({"what": what, "t": time.monotonic(), **data})
        part = self.path.with_name(self.path.name + ".part")
        torch.save(self.events, part)
        os.replace(part, self.path)


def rounds(wire: list, n: int) -> list[list]:
    """A peer's record (``wire``) cut into its ``n`` rounds' events; a round it never reached is an empty list."""
    out: list[list] = []
    for e in wire:
        if e["what"] == "round":
            out.append([])
        elif out:
            out[-1].append(e)
    return (out + [[] for _ in range(n)])[:n]


def read(path: Path) -> list:
    """A peer's record as plain data; [] where it recorded nothing."""
    try:
        out = torch.load(path, weights_only=True)
    except (OSError, RuntimeError, EOFError):
        return []
    return out if isinstance(out, list) else []


def _serve(peer: Peer, path: str, seed: int, seconds: float, ports) -> None:
    """The peer's process: one store per round, their ports to ``ports`` (a pipe's end), then each round as rank 0.
    Its output goes to ``path``.log; it never returns where it was forked."""
    from course_grader import checks

    with open(path + ".log", "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    torch.set_num_threads(1)
    wire, timeout = Wire(Path(path)), timedelta(seconds=seconds)
    stores = [dist.TCPStore(HOST, 0, peer.world_of(i), is_master=True, wait_for_workers=False, timeout=timeout)
              for i in range(peer.rounds)]
    ports.send([s.port for s in stores])
    ports.close()
    with checks.grading_seed(seed):
        for i, store in enumerate(stores):  # a round that fails stops there; the next has its own group
            wire.record("round", index=i)
            try:
                # init_process_group's own rendezvous puts its keys under "default_pg": the student's ranks use it
                dist.init_process_group("gloo", store=dist.PrefixStore("default_pg", store), rank=0,
                                        world_size=peer.world_of(i), timeout=timeout)
                peer.play(wire, i)
            except Exception as err:  # the student's ranks went away, or never came: the record says where
                wire.record("stopped", message=f"{type(err).__name__}: {err}"[:400])
                traceback.print_exc()
            finally:
                if dist.is_initialized():
                    dist.destroy_process_group()
    wire.record("done")


def join_ranks(fn: Callable, nprocs: int, kwargs: dict | None = None, *, port: int, timeout: float = 10) -> list:
    """The probe's side: ``fn(**kwargs)`` on ``nprocs`` forked ranks that join the group whose rank 0 (the grader's)
    hosts on ``port``, as ranks 1 to ``nprocs``; each rank's ``packed`` result, unpacked. Where they did not finish
    (a collective that did not match stops gloo, or waits): ``[{"stopped": why}]``, and the judge reads where from
    rank 0's record. A rank that met an exercise not written yet (the release's ``NotImplementedError``) raises
    here, so the test says that instead. ``timed out``: whether they were still running at ``timeout`` (a
    deadlock), rather than stopped by an error."""
    from course_grader.checks import unpacked
    from course_lib.launch import WorkerError, run_forked

    try:
        return [unpacked(run) for run in run_forked(fn, nprocs, kwargs, timeout=timeout, join=(port, 1))]
    except (TimeoutError, WorkerError) as err:
        if getattr(err, "kind", None) == "NotImplementedError":
            raise
        return [{"stopped": str(err)[-300:], "timed out": isinstance(err, TimeoutError)}]


@dataclass
class Running:
    """A started peer: its process, its rounds' ports, its record's path."""

    process: object
    ports: list[int]
    path: Path

    def finish(self, wait: float = 5.0) -> list:
        """The record, once the process has ended (killed after ``wait`` seconds: a peer still waiting for ranks
        that are gone)."""
        self.process.join(wait)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        return read(self.path)


def start(peer: Peer, path: Path, seed: int, seconds: float, fork: bool = True) -> Running:
    """Start ``peer`` in a new process (forked, or spawned where forking this process is not safe), its record at
    ``path``; returns once its stores listen. ``seed``: the grading's (``checks.case_seed`` in ``play``);
    ``seconds``: how long it waits for its ranks to join, and for any collective (ranks that went away end it
    sooner: gloo sees their sockets close)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork" if fork else "spawn")
    mine, theirs = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_serve, args=(peer, str(path), seed, seconds, theirs), daemon=True)
    process.start()
    theirs.close()
    try:
        if not mine.poll(60):
            raise EOFError
        ports = mine.recv()
    except EOFError:  # it never said where it listens, or it ended first (its pipe's end closed)
        process.kill()
        raise RuntimeError(f"the grader's rank did not start; its log: {path}.log") from None
    return Running(process, ports, Path(path))


@contextlib.contextmanager
def running(name: str, peer: Peer | None, seconds: float = 60):
    """In a notebook's own kernel: check ``name``'s peer started for the probe (its ports in ``checks.PORTS``); the
    list yielded holds its record once the block ends. Nothing is started where the check has no peer."""
    from course_grader import checks
    from course_lib.launch import fork_is_safe

    wire: list = []
    if peer is None:
        yield wire
        return
    with tempfile.TemporaryDirectory(prefix="course-peer-") as folder:
        started = start(peer, Path(folder) / "wire.pt", checks.GRADING_SEED, seconds, fork=fork_is_safe())
        checks.PORTS[name] = started.ports
        try:
            yield wire
        finally:
            checks.PORTS.pop(name, None)
            wire += started.finish()
