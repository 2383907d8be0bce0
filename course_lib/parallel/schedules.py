"""Pipeline schedules: which forward and backward each rank runs, and when; planned, run by hand, measured.

Seed 002's ``PipelinedModel`` puts stage s on cuda:s and pushes the whole batch through: while one
device computes, the others wait. With p stages the bubble (the idle share of p × makespan) is
(p-1)/p. Cut the batch into m micro-batches and stage s can work on micro-batch i while stage s+1
works on i-1: GPipe (all forwards, then all backwards) idles (p-1)/(m+p-1); 1F1B runs the same
bubble but starts each micro-batch's backward as early as it can, so a rank keeps at most p
micro-batches of activations alive instead of m; interleaved 1F1B gives each rank v stages
(rank r holds stages r, r+p, ...) and cuts the bubble by about v.

- ``gpipe_order`` / ``one_f_one_b_order`` / ``schedule_makespan``: the schedules as pure functions
  (the order of F and B each rank runs) and a simulator of their timeline with unit costs; ``torch_order``
  reads the same orders out of torch's schedule objects. 1F1B's order is notebook 15's exercise 1 (a stub
  in the student edition).
- Zero bubble: a backward split in two, I (the gradient of the stage's input, which the stage before waits
  for) and W (the gradient of its weights, which nothing waits for), so W can fill the bubble.
  ``schedule_makespan`` runs I and W too; ``planned_orders`` reads torch's plans (interleaved 1F1B, the zero
  bubble schedules, DualPipeV where torch has it) without a process group.
- ``run_1f1b``: a pipeline executor by hand: one rank's forwards and backwards of its micro-batches in the
  order given (1F1B's or GPipe's), activations up and gradients down with ``isend``/``irecv``, holding only
  the micro-batches the order has in flight. Notebook 15's exercise 2 (a stub in the student edition).
- ``Recorder``: wall-clock start and end of every forward and backward of every micro-batch on every
  rank, on a time base shared through a barrier; ``bubble_fraction``, ``in_flight_peak``, ``rank_orders``
  and ``plot_timeline`` read it. ``SimulatedWork`` pads a stage's work with sleep, so that ranks sharing
  a few cores still show the schedule itself.

Nothing here knows the model: a stage is any ``nn.Module`` (the checks run MLPs). ``course_lib.parallel.pp`` cuts
the course's Llama into stages and trains it under these schedules, torch's and the hand-written ones.
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

def bubble_formula(p: int, m: int) -> float:
    """The idle share of a fill-drain pipeline of p equal stages and m micro-batches: (p-1)/(m+p-1)."""
    return (p - 1) / (m + p - 1)


def pp_bytes_per_rank(tokens: int, hidden: int, dtype_bytes: int = 4, micro_batches: int = 1) -> int:
    """Bytes a middle pipeline stage sends per step, as ``CollectiveBytes`` counts them: each micro-batch's
    activation to the next stage and its gradient back to the one before, ``tokens x hidden`` each (the first
    and the last stage send one of the two)."""
    return 2 * micro_batches * tokens * hidden * dtype_bytes


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


def _needs(kind: str, mb: int, s: int, last_stage: int) -> list[tuple]:
    """What action (kind, mb, s) waits for. ("dx", mb, s) is the gradient of stage s's input, made by its I or B."""
    if kind == "F":
        return [("F", mb, s - 1)] if s > 0 else []
    if kind == "W":  # the weights' gradient reuses what I computed (the output's gradient, the saved inputs)
        return [("I", mb, s)]
    if kind in ("B", "I"):
        return [("F", mb, s)] + ([("dx", mb, s + 1)] if s < last_stage else [])
    raise ValueError(f"unknown action kind {kind!r}: use F, B, I or W")


def schedule_makespan(order: list[list[Action]], t_f: float = 1.0, t_b: float = 2.0, t_w: float | None = None) -> dict:
    """Simulate the timeline of ``order`` (per rank, its actions) with forward cost ``t_f``, backward ``t_b``.

    An action ("F", i) runs stage = rank; ("F", i, s) names its stage. A backward is B (whole) or split:
    I (the input's gradient, ``t_b - t_w``) then W (the weights' gradient, ``t_w``; half of ``t_b`` unless
    told). F of micro-batch i on stage s waits for F i on s-1; B or I of i on s for F i on s and for B or
    I of i on s+1 (not its W: the stage before needs only the input's gradient); W for I of i on the same
    stage. A rank runs its actions in order, each as soon as it is free and the inputs are there;
    communication is free. Returns per rank its (kind, mb, stage, start, end) intervals, the makespan,
    bubble = 1 - busy / (p × makespan), and ``in_flight``: per rank the most micro-batch-stages whose
    activations were held at once (``in_flight_peak``: from F until W or B).
    """
    p = len(order)
    t_w = t_b / 2 if t_w is None else t_w
    cost = {"F": t_f, "B": t_b, "I": t_b - t_w, "W": t_w}
    acts = [[(a[0], a[1], a[2] if len(a) > 2 else r) for a in actions] for r, actions in enumerate(order)]
    last_stage = max(s for actions in acts for _, _, s in actions)
    done: dict[tuple, float] = {}  # (kind, mb, stage) -> end time
    free, nxt = [0.0] * p, [0] * p
    intervals: list[list[tuple]] = [[] for _ in range(p)]
    while any(nxt[r] < len(acts[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while nxt[r] < len(acts[r]):
                kind, mb, s = acts[r][nxt[r]]
                deps = _needs(kind, mb, s, last_stage)
                if any(d not in done for d in deps):
                    break
                start = max([free[r]] + [done[d] for d in deps])
                free[r] = done[(kind, mb, s)] = start + cost[kind]
                if kind in ("B", "I"):
                    done[("dx", mb, s)] = free[r]
                intervals[r].append((kind, mb, s, start, free[r]))
                nxt[r], progressed = nxt[r] + 1, True
        if not progressed:
            raise ValueError(f"the order deadlocks: next actions {[acts[r][nxt[r]:nxt[r] + 1] for r in range(p)]}")
    makespan = max(free)
    busy = sum(e - s for rank in intervals for *_, s, e in rank)
    return {"intervals": intervals, "makespan": makespan, "bubble": 1 - busy / (p * makespan),
            "in_flight": in_flight_peak(simulated_timeline(intervals))}


def simulated_timeline(intervals: list[list[tuple]]) -> list[dict]:
    """``schedule_makespan``'s intervals as a ``Recorder`` timeline (one dict per action, times in the simulator's
    units), so that ``bubble_fraction``, ``in_flight_peak``, ``rank_orders`` and ``plot_timeline`` read it."""
    return [dict(rank=r, kind=kind, mb=mb, stage=s, start=start, end=end)
            for r, rank in enumerate(intervals) for kind, mb, s, start, end in rank]


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


def bubble_fraction(timeline: list[dict]) -> float:
    """Measured idle share: 1 - busy / (p × makespan), p the ranks in ``timeline``, the makespan from the
    first start to the last end on any rank."""
    p = len({e["rank"] for e in timeline})
    makespan = max(e["end"] for e in timeline) - min(e["start"] for e in timeline)
    busy = sum(e["end"] - e["start"] for e in timeline)
    return 1 - busy / (p * makespan)


def in_flight_peak(timeline: list[dict]) -> list[int]:
    """Per rank, the most micro-batches whose activations were alive at once: forwards done minus backwards
    done, at its maximum (several stages on one rank count together: micro-batch-stages). A split backward
    frees them at its W, not its I: the weights' gradient needs the inputs each layer saved."""
    peaks = []
    for r in sorted({e["rank"] for e in timeline}):
        alive = peak = 0
        for e in sorted((e for e in timeline if e["rank"] == r), key=lambda e: e["start"]):
            alive += {"F": 1, "B": -1, "W": -1}.get(e["kind"], 0)
            peak = max(peak, alive)
        peaks.append(peak)
    return peaks


def rank_orders(timeline: list[dict]) -> list[list[Action]]:
    """Per rank, the (kind, mb) actions in the order the timeline shows them run (stage added when a rank has
    several)."""
    ranks = sorted({e["rank"] for e in timeline})
    multi = len({e["stage"] for e in timeline}) > len(ranks)
    return [[(e["kind"], e["mb"]) + ((e["stage"],) if multi else ())
             for e in sorted((e for e in timeline if e["rank"] == r), key=lambda e: e["start"])] for r in ranks]


def plot_timeline(timeline: list[dict], ax=None, title: str | None = None, scale: float = 1e3,
                  xlabel: str = "ms since the step began"):
    """One row per rank, a box per forward (light), backward (dark: B whole, I the input's gradient) and weight
    gradient (W, hatched), coloured per micro-batch and labelled F0, B0, I0, W0, ...; the title gives the measured
    bubble. ``scale`` turns the timeline's times into the x axis' (seconds to ms; 1 for ``simulated_timeline``).
    Returns the figure."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.6 + 0.5 * len({e["rank"] for e in timeline})))
    colours, t0 = plt.get_cmap("tab10"), min(e["start"] for e in timeline)
    for e in timeline:
        start, width = (e["start"] - t0) * scale, (e["end"] - e["start"]) * scale
        colour = colours(e["mb"] % 10)
        ax.broken_barh([(start, width)], (e["rank"] - 0.4, 0.8), facecolors=colour, edgecolor="black", linewidth=0.5,
                       alpha=0.55 if e["kind"] == "F" else 1.0, hatch="///" if e["kind"] == "W" else None)
        ax.text(start + width / 2, e["rank"], f"{e['kind']}{e['mb']}", ha="center", va="center", fontsize=7)
    ranks = sorted({e["rank"] for e in timeline})
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title or f"measured bubble {bubble_fraction(timeline):.1%}")
    ax.figure.tight_layout()
    return ax.figure
