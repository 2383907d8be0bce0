"""Pipeline parallelism by hand: which forward and backward each rank runs, and when; planned, run, recorded.

Seed 002's ``PipelinedModel`` puts stage s on cuda:s and pushes the whole batch through: while one
device computes, the others wait. With p stages the bubble (the idle share of p × makespan) is
(p-1)/p. Cut the batch into m micro-batches and stage s can work on micro-batch i while stage s+1
works on i-1: GPipe (all forwards, then all backwards) idles (p-1)/(m+p-1); 1F1B runs the same
bubble but starts each micro-batch's backward as early as it can, so a rank keeps at most p
micro-batches of activations alive instead of m; interleaved 1F1B gives each rank v stages
(rank r holds stages r, r+p, ...) and cuts the bubble by about v.

- ``gpipe_order`` / ``one_f_one_b_order``: the schedules as pure functions (the order of F and B each rank
  runs); ``torch_order`` reads the same orders out of torch's schedule objects. 1F1B's order is notebook 15's
  exercise 1 (a stub in the student edition).
- Zero bubble: a backward split in two, I (the gradient of the stage's input, which the stage before waits
  for) and W (the gradient of its weights, which nothing waits for), so W can fill the bubble.
  ``planned_orders`` reads torch's plans (interleaved 1F1B, the zero bubble schedules, DualPipeV where torch
  has it) without a process group.
- ``run_1f1b``: a pipeline executor by hand: one rank's forwards and backwards of its micro-batches in the
  order given (1F1B's or GPipe's), activations up and gradients down with ``isend``/``irecv``, holding only
  the micro-batches the order has in flight. Notebook 15's exercise 2 (a stub in the student edition).
- ``Recorder``: wall-clock start and end of every forward and backward of every micro-batch on every
  rank, on a time base shared through a barrier; ``rank_orders`` reads the order each rank ran from it.
  ``SimulatedWork`` pads a stage's work with sleep, so that ranks sharing a few cores still show the schedule
  itself.

What an order costs (the bubble formula, the simulated makespan, the bubble and the activations in flight of a
recorded timeline, its plot) is ``course_lib.parallel.pp_cost``. Nothing here knows the model: a stage is any
``nn.Module`` (the checks run MLPs). ``course_lib.parallel.pp_torch`` cuts the course's Llama into stages and trains
it under torch's schedules and the naive split.
"""

from __future__ import annotations

import contextlib
import socket
import time
import types

import torch
import torch.distributed as dist
from torch import nn

from course_lib.distributed import Timeline

# (kind, micro-batch) or (kind, micro-batch, stage); kind: "F" forward, "B" full backward, or the backward
# split in two: "I" the gradient of the stage's input, "W" the gradient of its weights (B = I then W)
Action = tuple


# ---------------------------------------------------------------- the schedules as pure functions

def gpipe_order(p: int, m: int) -> list[list[Action]]:
    """Per rank, the actions GPipe runs: every micro-batch's forward, then every backward, in order."""
    return [[("F", i) for i in range(m)] + [("B", i) for i in range(m)] for _ in range(p)]


# graded: 15_pipeline_parallelism one_f_one_b_order
def one_f_one_b_order(p: int, m: int) -> list[list[Action]]:
    """Per rank, the actions 1F1B runs: rank r warms up with min(m, p-r) forwards, then alternates
    one backward and one forward, then drains the backwards left (torch's ``Schedule1F1B``)."""
    orders = []
    for r in range(p):
        warmup = min(m, p - r)
        order = [("F", i) for i in range(warmup)]
        for i in range(m - warmup):  # steady state: the oldest backward, then the next forward
            order += [("B", i), ("F", warmup + i)]
        order += [("B", i) for i in range(m - warmup, m)]
        orders.append(order)
    return orders


# torch's action kinds by member name: their values were ints (FORWARD = 1) up to torch 2.10 and are the
# letters ("F") since, and the names are what stayed the same
_TORCH_KINDS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}


def torch_order(schedule) -> list[list[Action]] | None:
    """The compute actions torch's schedule object plans per rank (its ``pipeline_order``), as
    (kind, mb) for one stage per rank and (kind, mb, stage) for several, kind one of F, B, I, W; None if it has
    none (older torch, 2.7 among them, plans ahead only for the multi-stage schedules: GPipe and 1F1B have none).
    A composite action (DualPipeV's OVERLAP_F_B: a forward and a backward issued together) counts as its
    parts, in order: one device runs them one after the other."""
    plan = getattr(schedule, "pipeline_order", None)
    if not plan:
        return None
    parts = {r: [b for a in plan[r] if a is not None for b in (getattr(a, "sub_actions", None) or (a,))] for r in plan}
    multi = len({a.stage_index for actions in parts.values() for a in actions}) > len(plan)
    out = []
    for r in sorted(parts):
        acts = [a for a in parts[r] if a.computation_type.name in _TORCH_KINDS]
        out.append([(_TORCH_KINDS[a.computation_type.name], a.microbatch_index) + ((a.stage_index,) if multi else ())
                    for a in acts])
    return out


# torch's multi-stage schedules: class name -> (stages per rank, V layout: rank r holds stages r and 2p-1-r)
TORCH_MULTI_STAGE = {"ScheduleInterleaved1F1B": (2, False), "ScheduleInterleavedZeroBubble": (2, False),
                     "ScheduleZBVZeroBubble": (2, True), "ScheduleDualPipeV": (2, True)}


def planned_orders(p: int, m: int) -> dict[str, list[list[Action]]]:
    """The order each of ``p`` ranks runs for ``m`` micro-batches in each of torch's multi-stage schedules this torch
    has (``ScheduleDualPipeV`` came after 2.7), by class name: its plan, read with ``torch_order``. No process
    group: a schedule's constructor reads only its stages' place in the pipeline (group size and rank, the number
    of stages) and plans every rank's order, so stand-ins for rank 0's stages are enough to read it."""
    from torch.distributed.pipelining import schedules as torch_schedules

    orders = {}
    for name, (v, v_shape) in TORCH_MULTI_STAGE.items():
        cls = getattr(torch_schedules, name, None)
        if cls is None:
            continue
        n = p * v
        held = [0, n - 1] if v_shape else [k * p for k in range(v)]
        stand_ins = [types.SimpleNamespace(group_size=p, group_rank=0, num_stages=n, stage_index=s, submod=nn.Module(),
                                           is_first=s == 0, is_last=s == n - 1) for s in held]
        orders[name] = torch_order(cls(stand_ins, m, loss_fn=lambda out, target: out))
    return orders


# ---------------------------------------------------------------- 1F1B, by hand

# graded: 15_pipeline_parallelism run_1f1b
def run_1f1b(stage: nn.Module, rank: int, p: int, micro_batches: list, order: list, loss_fn, shape) -> tuple[list, int]:
    """One step's forwards and backwards of this rank's ``stage`` over m micro-batches, in ``order``.

    ``micro_batches``: m (inputs, targets) pairs, the same on every rank: rank 0 feeds the inputs to its stage,
    the last rank scores its output with ``loss_fn(out, targets)``. ``order``: this rank's actions, ("F", i) or
    ("B", i), e.g. ``one_f_one_b_order(p, m)[rank]`` (any runnable order works: GPipe's too). ``shape``: one
    micro-batch's activation, the tensor a stage receives from the one before (float32). Activations go to
    rank + 1 and gradients to rank - 1 with ``isend``, waited on only once the peer surely has them: a
    blocking send waits for the peer's receive, and in 1F1B's steady state rank r sends an activation up while
    rank r + 1 sends a gradient down, each before it receives the other's: two blocking sends deadlock. The
    stage's ``.grad`` gets the gradient of the mean of the m losses (each backward scaled by 1/m). Returns the
    last rank's m losses ([] elsewhere) and the most micro-batches whose tensors this rank held at once (a
    micro-batch is dropped as soon as its backward ran).
    """
    m, first, last = len(micro_batches), rank == 0, rank == p - 1
    held, sends, losses, alive, peak = {}, [], [], 0, 0  # held: micro-batch -> (its input, output, send)
    for kind, i in order:
        if kind == "F":
            x = micro_batches[i][0]
            if not first:
                x = torch.empty(shape)
                dist.irecv(x, rank - 1).wait()
                x.requires_grad_()  # its gradient is what rank - 1 needs back
            out = stage(x)
            send = None
            if last:
                out = loss_fn(out, micro_batches[i][1])
                losses.append(out.item())
            else:  # not waited here: rank + 1 may be sending us a gradient right now, waiting for our receive
                send = dist.isend(out.detach(), rank + 1)
            held[i] = (x, out, send)
            alive += 1
            peak = max(peak, alive)
        else:
            x, out, send = held.pop(i)  # the last references to micro-batch i: backward frees its graph
            if last:
                (out / m).backward()  # the mean over micro-batches: every gradient downstream carries the 1/m
            else:
                grad = torch.empty_like(out)
                dist.irecv(grad, rank + 1).wait()
                send.wait()  # done already: rank + 1 ran B i, so it had received F i's output
                out.backward(grad)
            if not first:
                sends.append(dist.isend(x.grad, rank - 1))
            del x, out  # micro-batch i's tensors go now, not when the next forward rebinds the names
            alive -= 1
    for work in sends:  # each gradient buffer stays alive until its send has gone
        work.wait()
    return losses, peak


# ---------------------------------------------------------------- measuring the timeline

class SimulatedWork(torch.autograd.Function):
    """Pads a stage's work with sleep: forward to ``f`` seconds, backward to ``b``, the real compute included.

    Applied twice per stage around its layers: on the way in ("enter") it notes when the forward
    began and, in backward, sleeps until the backward has lasted ``b``; on the way out ("leave") it
    sleeps until the forward has lasted ``f`` and, in backward, notes when the backward began. Every
    stage then costs the same, and sleeping needs no core: p ranks on 2 cores show the schedule itself.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, role: str, clock: dict, f: float, b: float) -> torch.Tensor:
        ctx.role, ctx.clock, ctx.b = role, clock, b
        if role == "enter":
            clock["forward"] = time.perf_counter()
        else:
            time.sleep(max(0.0, f - (time.perf_counter() - clock["forward"])))
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.role == "leave":
            ctx.clock["backward"] = time.perf_counter()
        else:
            time.sleep(max(0.0, ctx.b - (time.perf_counter() - ctx.clock["backward"])))
        return grad, None, None, None, None


class Recorder(Timeline):
    """Start and end (seconds since this step's shared t0) of every F and B, on this rank: a ``Timeline``.

    ``start_step`` waits at a barrier and reads the clock: every rank leaves the barrier at about the
    same moment, which is the common time base (one host or many). ``wrap(stage)`` times the
    ``forward_one_chunk`` and ``backward_one_chunk`` of a torch ``PipelineStage``; ``interval`` times
    anything. On a GPU the clock synchronises first, so an interval ends when its kernels have.
    """

    def __init__(self, rank: int, device: torch.device):
        super().__init__(device)
        self.rank, self.step = rank, 0
        self.same_host: bool | None = None  # decided at the first step (a collective)

    def start_step(self, step: int) -> None:
        """Barrier, then t0: the shared origin of this step's intervals.

        On one host every process reads the same monotonic clock, so rank 0's t0 is broadcast and the
        ranks' intervals share an exact origin; across hosts each takes its own t0 at the barrier's exit
        (a skew of about a millisecond, more on a busy machine).
        """
        if self.same_host is None:
            hosts: list = [None] * dist.get_world_size()
            dist.all_gather_object(hosts, socket.gethostname())
            self.same_host = len(set(hosts)) == 1
        dist.barrier()
        self.step, self.t0 = step, time.perf_counter()
        if self.same_host:
            t0 = torch.tensor([self.t0], dtype=torch.float64, device=self.device)
            dist.broadcast(t0, 0)
            self.t0 = float(t0)

    @contextlib.contextmanager
    def interval(self, kind: str, mb: int, stage: int):
        """Record the block as one interval of ``kind`` (F, B, I or W) for micro-batch ``mb`` on ``stage``; under
        ``torch.profiler`` it is also a span named "PP F0 stage 1" (``PP_SPAN``), so a trace shows every schedule's
        actions (torch names only GPipe's)."""
        with torch.profiler.record_function(f"PP {kind}{mb} stage {stage}"), \
                self.span(step=self.step, rank=self.rank, stage=stage, kind=kind, mb=mb):
            yield

    def wrap(self, stage) -> None:
        """Time every forward and backward a torch ``PipelineStage`` runs (its instance methods, wrapped): a
        backward is B, or I (``full_backward=False``: the input's gradient only) and W (the weights')."""
        fwd, bwd, bwd_w = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk
        index = stage.stage_index

        def forward_one_chunk(mb, *args, **kwargs):
            with self.interval("F", mb, index):
                return fwd(mb, *args, **kwargs)

        def backward_one_chunk(mb, *args, **kwargs):
            with self.interval("B" if kwargs.get("full_backward", True) else "I", mb, index):
                return bwd(mb, *args, **kwargs)

        def backward_weight_one_chunk(mb, *args, **kwargs):
            with self.interval("W", mb, index):
                return bwd_w(mb, *args, **kwargs)

        stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk
        stage.backward_weight_one_chunk = backward_weight_one_chunk

    def gathered(self, step: int) -> list[dict]:
        """Every rank's intervals of ``step`` (a collective: all ranks call it), sorted by rank and start."""
        mine = [e for e in self.events if e["step"] == step]
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return sorted((e for rank in everyone for e in rank), key=lambda e: (e["rank"], e["start"]))


# The profiler span of a Recorder interval: kind, micro-batch, stage
PP_SPAN = r"PP (?P<kind>[FBIW])(?P<mb>\d+) stage (?P<stage>\d+)$"


def rank_orders(timeline: list[dict]) -> list[list[Action]]:
    """Per rank, the (kind, mb) actions in the order the timeline shows them run (stage added when a rank has
    several)."""
    ranks = sorted({e["rank"] for e in timeline})
    multi = len({e["stage"] for e in timeline}) > len(ranks)
    return [[(e["kind"], e["mb"]) + ((e["stage"],) if multi else ())
             for e in sorted((e for e in timeline if e["rank"] == r), key=lambda e: e["start"])] for r in ranks]
