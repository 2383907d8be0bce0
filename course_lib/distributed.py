"""The distributed toolkit: what every parallel technique (ddp, fsdp, zero) builds on, written once.

- **The process group.** ``rank_device`` is this rank's device (its GPU, ``cuda:LOCAL_RANK``, or the
  CPU) and ``init_process_group`` joins the group with the backend ``device.backend_for`` picks for
  it; ``single_process_group`` makes a world of one inside a notebook; ``free_port`` finds a port
  nobody uses (fixed MASTER_PORTs collide when tests run side by side). ``each_run`` runs one worker several
  times in the group a launch started (on a CPU, starting the ranks costs more than a small run), and ``per_run``
  sorts what the ranks returned by run.
- **The data.** ``sharded_loader`` and ``step_batches``: this rank's share of every global batch,
  step after step, epoch after epoch (``DistributedSampler`` with ``set_epoch``).
- **Slices of a tensor.** ``rank_slice`` (this rank's 1/N of a flattened, zero-padded tensor) and
  ``gather_slices`` (the all-gather that undoes it): the sharding of ZeRO and FSDP, written once.
- **What ranks agree on.** ``param_digest`` (one number for the full weights, sharded ones gathered); the
  loss of the global batch (``mean_over_ranks``) and what a worker returns (``worker_result``) belong to the
  training loop, ``course_lib.train.fit``.
- **Counting communication.** ``AllReduceCounter`` counts DDP's gradient all-reduces; ``Timeline`` is the
  course's one recorder of when things happen on a rank (marks and intervals), and ``CollectiveLog``, a timeline,
  records every ``dist.all_reduce`` Python code issues (when, how big, async or
  not, waited on or not), beside marks of your own (a gradient arriving): the timeline of overlap.
  ``CollectiveBytes`` counts every collective a block runs and its bytes, per kind: ``torch.distributed``
  calls (DDP's reducer and FSDP2 included) and DTensor's functional collectives (``parallelize_module``) alike.

Byte counting of local shards is ``course_lib.memory.tensor_bytes``: the course's one counter.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import math
import os
import socket
import time
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, DistributedSampler

from course_lib.device import backend_for, default_device
from course_lib.train import Dims, rank_and_world


def free_port() -> int:
    """A TCP port on localhost that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device() -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` (torchrun sets it) where there are GPUs, else the CPU."""
    device = default_device()
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if device.type == "cuda" else device


def init_process_group() -> torch.device:
    """Join the process group torchrun describes in the environment, on this rank's device; return it."""
    device = rank_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device))
    average_over_gloo()
    return device


@functools.cache
def gloo_averages() -> bool:
    """Whether gloo computes ``ReduceOp.AVG`` (torch 2.8 and later), asked of a one-rank gloo group of this process."""
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=10))
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.AVG
    try:
        group.allreduce([torch.ones(1)], opts).wait()
        return True
    except RuntimeError:  # torch 2.7: "Cannot use ReduceOp.AVG with Gloo"
        return False


def _gloo_average(op, group, async_op: bool) -> bool:
    return op == dist.ReduceOp.AVG and not async_op and dist.get_backend(group) == "gloo"


def average_over_gloo() -> None:
    """FSDP2 on CPU ranks under torch 2.7: averages over gloo, and HSDP's all-reduce event (nothing where torch has
    both).

    FSDP2 averages gradients with ``ReduceOp.AVG``: a reduce-scatter and, for HSDP (2-D meshes: NO_SHARD,
    HYBRID), an all-reduce. torch 2.7's gloo sums where the reduce-scatter asks for the average, silently
    (gradients world-size times too large), and refuses the all-reduce ("Cannot use ReduceOp.AVG with Gloo");
    and its FSDP2 asserts that the all-reduce recorded a stream event, which a CPU stream never does. torch 2.8
    fixed all three. Here, once per process: ``dist.all_reduce`` and ``dist.reduce_scatter_tensor`` (what FSDP2
    calls) turn a blocking average over a gloo group into a sum, then a division, every other call going to torch
    unchanged; and a CPU stream's ``record_event`` returns a CPU event (whose every method does nothing) for FSDP2.
    """
    if hasattr(dist.all_reduce, "torch_all_reduce") or gloo_averages():
        return
    torch_all_reduce, torch_reduce_scatter = dist.all_reduce, dist.reduce_scatter_tensor

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not _gloo_average(op, group, async_op):
            return torch_all_reduce(tensor, op=op, group=group, async_op=async_op)
        torch_all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        tensor.div_(dist.get_world_size(group))

    def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not _gloo_average(op, group, async_op):
            return torch_reduce_scatter(output, input, op=op, group=group, async_op=async_op)
        torch_reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=group)
        output.div_(dist.get_world_size(group))

    all_reduce.torch_all_reduce = torch_all_reduce
    dist.all_reduce, dist.reduce_scatter_tensor = all_reduce, reduce_scatter_tensor
    torch.cpu.Stream.record_event = lambda self, event=None: event or torch.cpu.Event()


def single_process_group(backend: str | None = None) -> None:
    """Initialise a world of size 1 in this process (once; later calls do nothing). Gloo unless told."""
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group(backend or backend_for("cpu"), rank=0, world_size=1)
    average_over_gloo()


def sharded_loader(dataset, global_batch: int, seed: int = 0) -> tuple[DataLoader, DistributedSampler]:
    """A DataLoader over this rank's shard: each step, the ranks' local batches make one global batch."""
    rank, world = rank_and_world()
    local = Dims(global_batch, dp=world).local_batch
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True)
    return DataLoader(dataset, batch_size=local, sampler=sampler, drop_last=True), sampler


def step_batches(dataset, global_batch: int, steps: int, seed: int = 0) -> Iterator:
    """Yield this rank's local batch for each of ``steps`` steps, epoch after epoch.

    Each epoch is a new shuffle, the same on every rank; the order depends on ``seed`` only, so a
    run resumed at step k sees the batches the uninterrupted run saw from step k on.
    """
    loader, sampler = sharded_loader(dataset, global_batch, seed)
    if len(loader) == 0:
        raise ValueError(f"the dataset has {len(dataset)} samples, fewer than one global batch of {global_batch}: "
                         f"use more samples or a smaller batch")
    done, epoch = 0, 0
    while done < steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            yield batch
            done += 1
            if done == steps:
                return
        epoch += 1


def rank_slice(t: torch.Tensor) -> torch.Tensor:
    """This rank's slice of ``t``, flattened and zero-padded to a multiple of the world size: ceil(numel / N) values."""
    rank, world = dist.get_rank(), dist.get_world_size()
    n = math.ceil(t.numel() / world)
    return nn.functional.pad(t.reshape(-1), (0, n * world - t.numel()))[rank * n:(rank + 1) * n]


# graded: 08_fsdp ShardedModule
def gather_slices(piece: torch.Tensor, numel: int) -> torch.Tensor:
    """Every rank's ``rank_slice`` of a tensor of ``numel`` values, all-gathered: the flat tensor again."""
    n = piece.numel()
    full = piece.new_empty(n * dist.get_world_size())
    dist.all_gather(list(full.split(n)), piece.detach().contiguous())  # rank r's slice lands at r * n
    return full[:numel]


def each_run(fn: Callable[..., dict], runs: list[dict]) -> dict:
    """``{"runs": [fn(**run) for run in runs]}`` in this process group, one run after another: the body of every
    technique's ``sweep`` worker (``launch("course_lib.parallel.pp_torch:sweep", p, {"runs": [...]})``). Each run seeds
    itself, so its result is the one a launch of its own would give."""
    out = {"runs": [fn(**run) for run in runs]}
    dist.barrier()  # no rank tears the group down while another still uses it
    return out


def per_run(answers: list[dict]) -> list[list[dict]]:
    """What the ranks of an ``each_run`` worker returned, run by run: ``per_run(answers)[i][r]`` is run i on rank r."""
    return [list(ranks) for ranks in zip(*(answer["runs"] for answer in answers))]


def param_digest(model: nn.Module) -> float:
    """A number that changes when any weight does: the sum of |w| over all parameters, in float64.

    Sharded weights (FSDP2's DTensors) are gathered first, which is a collective: every rank calls it.
    """
    total = 0.0
    for p in model.parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        total += float(full.detach().double().abs().sum())
    return total


class AllReduceCounter:
    """Counts DDP's gradient all-reduces (one per bucket) and then does them as usual.

    ``counter = AllReduceCounter().attach(ddp_model)``; ``counter.calls`` is the number of
    gradient buckets all-reduced so far.
    """

    def __init__(self):
        self.calls = 0

    def attach(self, ddp_model) -> "AllReduceCounter":
        ddp_model.register_comm_hook(self, _counting_allreduce_hook)
        return self


def _counting_allreduce_hook(counter: AllReduceCounter, bucket):
    counter.calls += 1
    return allreduce_hook(dist.group.WORLD, bucket)


class Timeline:
    """The course's one recorder of when things happen on a rank: point events (``mark``) and intervals (``span``),
    on one clock that starts at ``t0`` and, on a GPU, waits for the device before it is read.

    ``events`` is a list of plain dicts (picklable), in order: a mark is ``{"what", "t", **info}``, a span
    ``{**info, "start", "end"}``. ``CollectiveLog`` adds the all-reduces Python issues; ``pp.Recorder`` adds a
    step origin every rank shares and the forwards and backwards of pipeline stages.
    """

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.events: list[dict] = []
        self.t0 = time.perf_counter()

    def now(self) -> float:
        """Seconds since ``t0``, after the device has finished what it was given."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - self.t0

    def mark(self, what: str, **info) -> None:
        """Append an event ``what`` at this moment (returns None: usable as a hook)."""
        self._event(what, **info)

    def _event(self, what: str, **info) -> dict:
        event = {"what": what, "t": self.now(), **info}
        self.events.append(event)
        return event

    @contextlib.contextmanager
    def span(self, **info):
        """Record the block as one interval, ``{**info, "start", "end"}``."""
        start = self.now()
        yield
        self.events.append({**info, "start": start, "end": self.now()})


class CollectiveLog(Timeline):
    """Records the ``dist.all_reduce`` calls made while it is active, and marks of your own, on one clock.

    ``with CollectiveLog() as log: ...``; ``log.mark("grad", name=...)`` adds an event of your own
    (a gradient hook firing, say). Each all-reduce adds ``{"what": "all_reduce", "t", "numel",
    "async_op", "waited"}``; ``waited`` turns True when the returned work's ``wait()`` is called (a
    synchronous call counts as waited). ``log.events`` is a list of plain dicts (picklable), in order.
    Collectives issued from C++ (DDP's reducer) are not seen: use ``AllReduceCounter`` for those.
    """

    def __enter__(self) -> "CollectiveLog":
        self._original = dist.all_reduce
        log, original = self, self._original

        def logged_all_reduce(tensor, *args, **kwargs):
            async_op = bool(kwargs.get("async_op", args[2] if len(args) > 2 else False))
            event = log._event("all_reduce", numel=tensor.numel(), async_op=async_op, waited=not async_op)
            work = original(tensor, *args, **kwargs)
            return _LoggedWork(work, event, log) if async_op else work

        dist.all_reduce = dist.distributed_c10d.all_reduce = logged_all_reduce
        return self

    def __exit__(self, *exc) -> None:
        dist.all_reduce = dist.distributed_c10d.all_reduce = self._original


class _LoggedWork:
    """An async collective's work handle that notes in its log when it is waited on."""

    def __init__(self, work, event: dict, log: CollectiveLog):
        self._work, self._event, self._log = work, event, log

    def wait(self, *args, **kwargs):
        out = self._work.wait(*args, **kwargs)
        if not self._event["waited"]:
            self._event["waited"] = True
            self._log._event("wait", launched_at=self._event["t"])
        return out

    def __getattr__(self, name):
        return getattr(self._work, name)


_C10D, _FUNCOL = torch.ops.c10d, torch.ops._c10d_functional
# kind of each collective op, and which argument holds the full tensor(s) its bytes are counted on:
# the tensor an all-reduce reduces, the gathered output of an all-gather, the unscattered input of a reduce-scatter
_COLLECTIVES = {
    _C10D.allreduce_: ("all_reduce", 0), _C10D.allreduce_coalesced_: ("all_reduce", 0),
    _C10D.allgather_: ("all_gather", 0), _C10D._allgather_base_: ("all_gather", 0),
    _C10D.allgather_coalesced_: ("all_gather", 0), _C10D.allgather_into_tensor_coalesced_: ("all_gather", 0),
    _C10D.reduce_scatter_: ("reduce_scatter", 1), _C10D._reduce_scatter_base_: ("reduce_scatter", 1),
    _C10D.reduce_scatter_tensor_coalesced_: ("reduce_scatter", 1),
    _C10D.broadcast_: ("broadcast", 0), _C10D.reduce_: ("reduce", 0), _C10D.send: ("send", 0), _C10D.recv_: ("recv", 0),
    _C10D.alltoall_: ("all_to_all", 1), _C10D.alltoall_base_: ("all_to_all", 1),
    _C10D.gather_: ("gather", 0), _C10D.scatter_: ("scatter", 1),
    _FUNCOL.all_reduce: ("all_reduce", 0), _FUNCOL.all_reduce_: ("all_reduce", 0),
    _FUNCOL.all_reduce_coalesced: ("all_reduce", 0), _FUNCOL.all_to_all_single: ("all_to_all", 0),
    _FUNCOL.broadcast: ("broadcast", 0),
    _FUNCOL.all_gather_into_tensor: ("all_gather", "out"),
    _FUNCOL.all_gather_into_tensor_coalesced: ("all_gather", "out"),
    _FUNCOL.reduce_scatter_tensor: ("reduce_scatter", 0),
    _FUNCOL.reduce_scatter_tensor_coalesced: ("reduce_scatter", 0),
}

# the share of a collective's full tensor that each rank sends in a ring algorithm (N ranks in the group)
_RING_SHARE = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
               "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n}


def _nbytes(obj) -> int:
    """Bytes of the tensors in ``obj`` (a tensor, or lists of them)."""
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    return sum(_nbytes(o) for o in obj) if isinstance(obj, (list, tuple)) else 0


class CollectiveBytes(TorchDispatchMode):
    """Counts the collectives run inside a ``with`` block and their bytes, per kind.

    ``with CollectiveBytes() as c: step()``; then ``c.calls_by_kind`` ({"all_reduce": 2, ...}) and
    ``c.bytes_by_kind``; ``c.bytes_by_group`` splits them by process group (named by ``groups``, e.g.
    ``{"tp": mesh.get_group("tp"), "dp": mesh.get_group("dp")}``). Bytes are those of the full tensor of
    each call, on this rank: the tensor an all-reduce reduces, the gathered result of an all-gather, the
    input of a reduce-scatter, what a send sends. ``c.sent_bytes_by_kind`` is what each rank sends over the
    wire in a ring algorithm: 2(N-1)/N of that for an all-reduce (a reduce-scatter then an all-gather),
    (N-1)/N for the others.

    It sees what goes through torch's dispatcher: ``torch.distributed`` calls (``c10d`` ops, FSDP2's
    all-gathers and reduce-scatters among them) and the functional collectives DTensor issues
    (``_c10d_functional``: ``parallelize_module``'s redistributions). DDP's C++ reducer is seen too (its
    bucket all-reduces go through the c10d op; its second step also broadcasts the rebuilt bucket layout).
    ``CollectiveLog``, which patches the Python function, does not see the reducer.
    """

    def __init__(self, groups: dict | None = None):
        super().__init__()
        self.calls_by_kind: dict[str, int] = {}
        self.bytes_by_kind: dict[str, int] = {}
        self.sent_bytes_by_kind: dict[str, int] = {}  # what a ring algorithm sends from each rank
        self.bytes_by_group: dict[str, dict[str, int]] = {}  # {group: {kind: bytes}}, e.g. the "dp" and "tp" dims
        self._names = {pg.group_name: name for name, pg in (groups or {}).items()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor turn the op into local ops and collectives first: we count those
        out = func(*args, **(kwargs or {}))
        found = _COLLECTIVES.get(getattr(func, "_overloadpacket", None))
        if found:
            kind, where = found
            size = _nbytes(out) if where == "out" else _nbytes(args[where])
            self.calls_by_kind[kind] = self.calls_by_kind.get(kind, 0) + 1
            self.bytes_by_kind[kind] = self.bytes_by_kind.get(kind, 0) + size
            name, n = self._group(args)
            group = self.bytes_by_group.setdefault(self._names.get(name, name), {})
            group[kind] = group.get(kind, 0) + size
            sent = size * _RING_SHARE.get(kind, lambda n: 1.0)(n)
            self.sent_bytes_by_kind[kind] = self.sent_bytes_by_kind.get(kind, 0) + round(sent)
        return out

    @staticmethod
    def _group(args) -> tuple[str, int]:
        """The name and size of the process group a collective runs on."""
        name = next((a for a in reversed(args) if isinstance(a, str)), None)  # functional ops: group_name last
        if name is not None:
            return name, dist.distributed_c10d._resolve_process_group(name).size()
        pg = next((a for a in args if isinstance(a, torch.ScriptObject)), None)  # c10d ops: the group, then the op
        pg = dist.ProcessGroup.unbox(pg) if pg is not None else dist.group.WORLD
        return pg.group_name, pg.size()

    @property
    def total_bytes(self) -> int:
        """Bytes of all the collectives counted."""
        return sum(self.bytes_by_kind.values())
