"""Pipeline parallelism in one file: a model cut into stages, one stage per rank, micro-batches flowing through.

Seed 002's ``PipelinedModel`` puts stage s on cuda:s and pushes the whole batch through: while one
device computes, the others wait. With p stages the bubble (the idle share of p × makespan) is
(p-1)/p. Cut the batch into m micro-batches and stage s can work on micro-batch i while stage s+1
works on i-1: GPipe (all forwards, then all backwards) idles (p-1)/(m+p-1); 1F1B runs the same
bubble but starts each micro-batch's backward as early as it can, so a rank keeps at most p
micro-batches of activations alive instead of m; interleaved 1F1B gives each rank v stages
(rank r holds stages r, r+p, ...) and cuts the bubble by about v.

- ``gpipe_order`` / ``one_f_one_b_order`` / ``schedule_makespan``: the schedules as pure functions
  (the order of F and B each rank runs) and a simulator of their timeline with unit costs. 1F1B's order is
  notebook 13's exercise (a stub in the student edition); the runs below execute torch's own schedules.
- ``LlamaStage`` / ``split_llama``: the course's Llama cut by decoder layers (stage 0 has the
  embedding, the last has the final norm and the LM head; the loss is the schedule's ``loss_fn``).
- ``naive_step``: the seed's split written out with ``dist.send``/``dist.recv``: whole batch, forward
  stage by stage, backward in reverse.
- ``run_1f1b``: a pipeline executor by hand: one rank's forwards and backwards of its micro-batches in the
  order given (1F1B's or GPipe's), activations up and gradients down with ``isend``/``irecv``, holding only
  the micro-batches the order has in flight. Notebook 13's exercise 3 (a stub in the student edition).
- ``Recorder``: wall-clock start and end of every forward and backward of every micro-batch on every
  rank, on a time base shared through a barrier; ``bubble_fraction``, ``in_flight_peak`` and
  ``plot_timeline`` read it; ``memory.SavedTensorMeter``'s peak is the bytes autograd keeps for backward.
- ``train``: the worker for ``launch("course_lib.pp:train", p, {...})``, naive or one of torch's
  schedules (``torch.distributed.pipelining``); ``reference_losses``: the one-process run it must equal.

Honest timings on a 2-core CPU: p ranks share 2 cores, so measured compute times include waiting
for a core. ``simulate_ms=(f, b)`` adds ``time.sleep`` of f ms to every stage's forward and b ms to
its backward (``SimulatedWork``): sleeping needs no core, so the measured timeline then shows the
schedule itself, with its communication overhead. That is simulated work, not compute: the real
compute still runs beside it, and without ``simulate_ms`` the timeline is real compute only.
"""

from __future__ import annotations

import contextlib
import inspect
import socket
import statistics
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn

from course_lib.data import lm_batch
from course_lib.distributed import Timeline, rank_device
from course_lib.loss import forward_loss, next_token_loss
from course_lib.memory import SavedTensorMeter
from course_lib.models import build_llama
from course_lib.train import fit, rank_and_world, worker_result

SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved")

Action = tuple  # ("F" or "B", micro-batch) or ("F" or "B", micro-batch, stage)


# ---------------------------------------------------------------- the schedules as pure functions

def bubble_formula(p: int, m: int) -> float:
    """The idle share of a fill-drain pipeline of p equal stages and m micro-batches: (p-1)/(m+p-1)."""
    return (p - 1) / (m + p - 1)


def gpipe_order(p: int, m: int) -> list[list[Action]]:
    """Per rank, the actions GPipe runs: every micro-batch's forward, then every backward, in order."""
    return [[("F", i) for i in range(m)] + [("B", i) for i in range(m)] for _ in range(p)]


# graded: 13_model_parallelism one_f_one_b_order
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


def schedule_makespan(order: list[list[Action]], t_f: float = 1.0, t_b: float = 2.0) -> dict:
    """Simulate the timeline of ``order`` (per rank, its actions) with forward cost ``t_f``, backward ``t_b``.

    An action ("F", i) or ("B", i) runs stage = rank; ("F", i, s) names its stage. F of micro-batch i
    on stage s waits for F i on s-1; B i on s for B i on s+1 and F i on s. A rank runs its actions in
    order, each as soon as it is free and the inputs are there; communication is free. Returns per rank
    its (kind, mb, stage, start, end) intervals, the makespan, and bubble = 1 - busy / (p × makespan).
    """
    p = len(order)
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
                deps = [("F", mb, s - 1)] if kind == "F" and s > 0 else []
                if kind == "B":
                    deps = [("F", mb, s)] + ([("B", mb, s + 1)] if s < last_stage else [])
                if any(d not in done for d in deps):
                    break
                start = max([free[r]] + [done[d] for d in deps])
                free[r] = done[(kind, mb, s)] = start + (t_f if kind == "F" else t_b)
                intervals[r].append((kind, mb, s, start, free[r]))
                nxt[r], progressed = nxt[r] + 1, True
        if not progressed:
            raise ValueError(f"the order deadlocks: next actions {[acts[r][nxt[r]:nxt[r] + 1] for r in range(p)]}")
    makespan = max(free)
    busy = sum(e - s for rank in intervals for *_, s, e in rank)
    return {"intervals": intervals, "makespan": makespan, "bubble": 1 - busy / (p * makespan)}


# torch's action kinds by member name: their values were ints (FORWARD = 1) up to torch 2.10 and are the
# letters ("F") since, and the names are what stayed the same
_TORCH_KINDS = {"FORWARD": "F", "FULL_BACKWARD": "B"}


def torch_order(schedule) -> list[list[Action]] | None:
    """The compute actions torch's schedule object plans per rank (its ``pipeline_order``), as
    ("F"/"B", mb) for one stage per rank and ("F"/"B", mb, stage) for several; None if it has none
    (older torch, 2.7 among them, plans ahead only for the multi-stage schedules: GPipe and 1F1B have none)."""
    plan = getattr(schedule, "pipeline_order", None)
    if not plan:
        return None
    multi = len({a.stage_index for actions in plan.values() for a in actions if a is not None}) > len(plan)
    out = []
    for r in sorted(plan):
        acts = [a for a in plan[r] if a is not None and a.computation_type.name in _TORCH_KINDS]
        out.append([(_TORCH_KINDS[a.computation_type.name], a.microbatch_index) + ((a.stage_index,) if multi else ())
                    for a in acts])
    return out


# ---------------------------------------------------------------- the model, cut into stages

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


class LlamaStage(nn.Module):
    """Some decoder layers of a ``LlamaForCausalLM``; the first stage embeds, the last normalises and
    projects to logits. Each stage recomputes the rotary embedding and the causal mask for itself,
    so only the hidden states (batch, T, d) travel between stages."""

    def __init__(self, model: nn.Module, layers: range, first: bool, last: bool, simulate_ms=None):
        super().__init__()
        inner = model.model
        self.config, self.rotary_emb = model.config, inner.rotary_emb  # rotary: buffers only, no weights
        self.embed_tokens = inner.embed_tokens if first else None
        self.layers = nn.ModuleList(inner.layers[i] for i in layers)
        self.norm, self.lm_head = (inner.norm, model.lm_head) if last else (None, None)
        self.simulate = tuple(ms / 1000 for ms in simulate_ms) if simulate_ms else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        clock: dict = {}  # this micro-batch's start times, shared by the two ends of the padding
        if self.simulate:
            h = SimulatedWork.apply(h, "enter", clock, *self.simulate)
        pos = torch.arange(h.shape[1], device=h.device)[None]
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None, past_key_values=None,
                                  position_ids=pos)
        rope = self.rotary_emb(h, position_ids=pos)
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=rope)
        if self.lm_head is not None:
            h = self.lm_head(self.norm(h))
        return SimulatedWork.apply(h, "leave", clock, *self.simulate) if self.simulate else h


def split_llama(model: nn.Module, n_stages: int, simulate_ms=None) -> list[LlamaStage]:
    """Cut a Llama into ``n_stages`` stages of consecutive decoder layers (the earlier ones get the extra)."""
    n = model.config.num_hidden_layers
    if n < n_stages:
        raise ValueError(f"{n} decoder layers cannot make {n_stages} stages: build the Llama with "
                         f"num_hidden_layers >= {n_stages}")
    if getattr(model.config, "tie_word_embeddings", False) and n_stages > 1:
        raise ValueError("tied embedding and LM head would live on two stages: untie them first")
    cuts = [-(-i * n // n_stages) for i in range(n_stages + 1)]  # ceil: the earlier stages get the extra layer
    return [LlamaStage(model, range(cuts[s], cuts[s + 1]), s == 0, s == n_stages - 1, simulate_ms)
            for s in range(n_stages)]


def stage_indices(rank: int, world: int, stages_per_rank: int = 1) -> list[int]:
    """The stages rank ``rank`` holds: rank, rank + world, ... (the looped layout of interleaved 1F1B)."""
    return [rank + k * world for k in range(stages_per_rank)]


# ---------------------------------------------------------------- measuring the timeline

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

    def interval(self, kind: str, mb: int, stage: int):
        """Record the block as one interval of ``kind`` ("F" or "B") for micro-batch ``mb`` on ``stage``."""
        return self.span(step=self.step, rank=self.rank, stage=stage, kind=kind, mb=mb)

    def wrap(self, stage) -> None:
        """Time every forward and backward a torch ``PipelineStage`` runs (its instance methods, wrapped)."""
        fwd, bwd, index = stage.forward_one_chunk, stage.backward_one_chunk, stage.stage_index

        def forward_one_chunk(mb, *args, **kwargs):
            with self.interval("F", mb, index):
                return fwd(mb, *args, **kwargs)

        def backward_one_chunk(mb, *args, **kwargs):
            with self.interval("B", mb, index):
                return bwd(mb, *args, **kwargs)

        stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk

    def gathered(self, step: int) -> list[dict]:
        """Every rank's intervals of ``step`` (a collective: all ranks call it), sorted by rank and start."""
        mine = [e for e in self.events if e["step"] == step]
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return sorted((e for rank in everyone for e in rank), key=lambda e: (e["rank"], e["start"]))


def bubble_fraction(timeline: list[dict]) -> float:
    """Measured idle share: 1 - busy / (p × makespan), p the ranks in ``timeline``, the makespan from the
    first start to the last end on any rank."""
    p = len({e["rank"] for e in timeline})
    makespan = max(e["end"] for e in timeline) - min(e["start"] for e in timeline)
    busy = sum(e["end"] - e["start"] for e in timeline)
    return 1 - busy / (p * makespan)


def in_flight_peak(timeline: list[dict]) -> list[int]:
    """Per rank, the most micro-batches whose activations were alive at once: forwards done minus backwards
    done, at its maximum (several stages on one rank count together)."""
    peaks = []
    for r in sorted({e["rank"] for e in timeline}):
        alive = peak = 0
        for e in sorted((e for e in timeline if e["rank"] == r), key=lambda e: e["start"]):
            alive += 1 if e["kind"] == "F" else -1
            peak = max(peak, alive)
        peaks.append(peak)
    return peaks


def rank_orders(timeline: list[dict]) -> list[list[Action]]:
    """Per rank, the (kind, mb) actions in the order the timeline shows them run (stage added when a rank has several)."""
    ranks = sorted({e["rank"] for e in timeline})
    multi = len({e["stage"] for e in timeline}) > len(ranks)
    return [[(e["kind"], e["mb"]) + ((e["stage"],) if multi else ())
             for e in sorted((e for e in timeline if e["rank"] == r), key=lambda e: e["start"])] for r in ranks]


def plot_timeline(timeline: list[dict], ax=None, title: str | None = None):
    """One row per rank, a box per forward (light) and backward (dark), coloured per micro-batch and
    labelled F0, B0, ...; the title gives the measured bubble. Returns the figure."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.6 + 0.5 * len({e["rank"] for e in timeline})))
    colours, t0 = plt.get_cmap("tab10"), min(e["start"] for e in timeline)
    for e in timeline:
        start, width = (e["start"] - t0) * 1e3, (e["end"] - e["start"]) * 1e3
        colour = colours(e["mb"] % 10)
        ax.broken_barh([(start, width)], (e["rank"] - 0.4, 0.8), facecolors=colour, edgecolor="black", linewidth=0.5,
                       alpha=0.55 if e["kind"] == "F" else 1.0)
        ax.text(start + width / 2, e["rank"], f"{e['kind']}{e['mb']}", ha="center", va="center", fontsize=7)
    ranks = sorted({e["rank"] for e in timeline})
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step began")
    ax.set_title(title or f"measured bubble {bubble_fraction(timeline):.1%}")
    ax.figure.tight_layout()
    return ax.figure


# ---------------------------------------------------------------- the naive split, by hand

def naive_step(stage: LlamaStage, tokens: torch.Tensor, recorder: Recorder) -> torch.Tensor | None:
    """One forward and backward of the whole batch through the ranks' stages, written with send/recv.

    Rank r receives the hidden states from r-1, runs its stage, sends them to r+1, then waits for their
    gradient from r+1, backpropagates and sends the gradient of its input to r-1: while one rank
    computes, every other one waits. The last rank returns the loss; the others None.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    first, last = rank == 0, rank == world - 1
    x = tokens
    if not first:  # the shape is known: (batch, T, hidden); nothing but the values travels
        x = torch.empty(*tokens.shape, stage.config.hidden_size, device=tokens.device)
        dist.recv(x, rank - 1)
        x.requires_grad_()
    with recorder.interval("F", 0, rank):
        out = stage(x)
        loss = next_token_loss(out, tokens) if last else None
    if not last:
        dist.send(out.detach(), rank + 1)
    grad = None if last else torch.empty_like(out)
    if not last:
        dist.recv(grad, rank + 1)
    with recorder.interval("B", 0, rank):
        torch.autograd.backward(loss if last else out, grad)
    if not first:
        dist.send(x.grad, rank - 1)
    return loss.detach() if last else None


# ---------------------------------------------------------------- 1F1B, by hand

# graded: 13_model_parallelism run_1f1b
def run_1f1b(stage: nn.Module, rank: int, p: int, micro_batches: list, order: list, loss_fn, shape) -> tuple[list, int]:
    """One step's forwards and backwards of this rank's ``stage`` over m micro-batches, in ``order``.

    ``micro_batches``: m (inputs, targets) pairs, the same on every rank: rank 0 feeds the inputs to its stage,
    the last rank scores its output with ``loss_fn(out, targets)``. ``order``: this rank's actions, ("F", i) or
    ("B", i), e.g. ``one_f_one_b_order(p, m)[rank]`` (any runnable order works: GPipe's too). ``shape``: one
    micro-batch's activation, the tensor a stage receives from the one before (float32). Activations go to
    rank + 1 and gradients to rank - 1 with ``isend``, waited on only once the peer surely has them: a
    blocking send waits for the peer's receive, and in 1F1B's steady state rank r sends an activation up while
    rank r + 1 sends a gradient down, each before it receives the other's: two blocking sends deadlock. The stage's ``.grad`` gets the gradient of the mean of the m
    losses (each backward scaled by 1/m). Returns the last rank's m losses ([] elsewhere) and the most
    micro-batches whose tensors this rank held at once (a micro-batch is dropped as soon as its backward ran).
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


# ---------------------------------------------------------------- torch's schedules and the worker

def make_schedule(name: str, stages: list, microbatches: int):
    """torch's schedule for ``name`` over this rank's ``PipelineStage``s, with the mean next-token loss
    per micro-batch; ``scale_grads=True`` divides the summed gradients by m: the global batch's mean."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleaved1F1B

    loss_fn = next_token_loss
    if name == "interleaved":
        return ScheduleInterleaved1F1B(stages, microbatches, loss_fn=loss_fn, scale_grads=True)
    if name == "gpipe":
        return gpipe_schedule(stages[0], microbatches, loss_fn)
    return Schedule1F1B(stages[0], microbatches, loss_fn=loss_fn, scale_grads=True)


def gpipe_schedule(stage, microbatches: int, loss_fn):
    """torch's ``ScheduleGPipe``, with fewer micro-batches than stages too (m = 1 is the naive split's bubble).

    torch 2.7 to 2.10 refuse m < p in every one-stage-per-rank schedule, a limit of 1F1B's warm-up that
    GPipe (all forwards, then all backwards) does not have; 2.11 moved the check into ``Schedule1F1B``.
    Where torch refuses, the schedule is built for p micro-batches and then told m: every use of the count
    (splitting the batch, the loop, the gradient scale, 2.8+'s planned order) reads it at run time.
    """
    from torch.distributed.pipelining import ScheduleGPipe

    try:
        return ScheduleGPipe(stage, microbatches, loss_fn=loss_fn, scale_grads=True)
    except ValueError:
        if microbatches < 1 or microbatches >= stage.num_stages:
            raise
    schedule = ScheduleGPipe(stage, stage.num_stages, loss_fn=loss_fn, scale_grads=True)
    schedule._n_microbatches = microbatches
    if getattr(schedule, "pipeline_order", None):  # torch 2.8-2.10 plan at construction: plan again for m
        schedule.pipeline_order = schedule._get_pipeline_order()
    return schedule


class _EveryWork:
    """The works of one ``batch_isend_irecv``, waited on together: what torch's schedules wait on since 2.8."""

    def __init__(self, works: list):
        self.works = works

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True


def _batch_p2p_waiting_for_all(p2p_ops: list, desc: str | None = None) -> _EveryWork | None:
    return _EveryWork(dist.batch_isend_irecv(p2p_ops)) if p2p_ops else None


@contextlib.contextmanager
def waits_for_every_p2p():
    """Within the block, torch's schedules wait on every send and receive of a batch, not only the last.

    torch 2.7's ``_batch_p2p`` keeps only the last of the works ``batch_isend_irecv`` returns: NCCL
    coalesces a batch into one, but gloo (CPU ranks) returns one per op, and the sends left unwaited
    deadlock 1F1B and interleaved 1F1B (pytorch issue 132644, fixed in 2.8 with ``_wait_batch_p2p``).
    Where torch has that fix this does nothing.
    """
    from torch.distributed.pipelining import schedules

    if hasattr(schedules, "_wait_batch_p2p"):
        yield
        return
    original, schedules._batch_p2p = schedules._batch_p2p, _batch_p2p_waiting_for_all
    try:
        yield
    finally:
        schedules._batch_p2p = original


def _torch_stages(model: nn.Module, indices: list[int], n_stages: int, mb_rows: int, seq: int,
                  device: torch.device, simulate_ms) -> list:
    """This rank's ``PipelineStage``s, with their input and output shapes given (no shape inference)."""
    from torch.distributed.pipelining import PipelineStage

    parts = split_llama(model, n_stages, simulate_ms)
    d, vocab, out = model.config.hidden_size, model.config.vocab_size, []
    for s in indices:
        # requires_grad matters: the stage sends a gradient back only for inputs that require one
        inp = torch.zeros(mb_rows, seq, dtype=torch.long) if s == 0 else torch.zeros(mb_rows, seq, d, requires_grad=True)
        outp = torch.zeros(mb_rows, seq, vocab if s == n_stages - 1 else d, requires_grad=True)
        out.append(PipelineStage(parts[s].to(device), s, n_stages, device, input_args=inp.to(device),
                                 output_args=outp.to(device)))
    return out


def _step(schedule, tokens: torch.Tensor, rank: int, world: int) -> torch.Tensor | None:
    """One pipelined step: rank 0 feeds the tokens, the last rank the targets; the last returns the mean loss."""
    losses: list = []
    args = (tokens,) if rank == 0 else ()
    # torch >= 2.10 can skip merging the last stage's logits (return_outputs=False); older step() has no such
    # argument and hands every unknown keyword to the model's forward as an input, so it is passed only where known
    skip = {"return_outputs": False} if "return_outputs" in inspect.signature(schedule.step).parameters else {}
    last = rank == world - 1
    with waits_for_every_p2p():
        schedule.step(*args, **({"target": tokens, "losses": losses} if last else {}), **skip)
    return torch.stack(losses).mean().detach() if last else None  # micro-batch means, equal sizes: the batch mean


def train(schedule: str = "gpipe", microbatches: int = 4, steps: int = 5, preset: str = "tiny",
          layers: int | None = None, stages_per_rank: int | None = None, batch: int = 8, seq: int = 32,
          lr: float = 3e-3, seed: int = 0, simulate_ms: list[float] | None = None) -> dict:
    """Train a Llama preset pipelined over this process group; the worker of ``launch("course_lib.pp:train")``.

    ``schedule``: "naive" (hand-written send/recv, the whole batch: ``microbatches`` is ignored),
    "gpipe", "1f1b" or "interleaved" (``stages_per_rank`` stages per rank, 2 unless told). ``layers``
    overrides the preset's decoder layers (it needs one per stage at least). Returns the losses (the
    global batch's, on every rank), the last step's gathered timeline, its measured bubble and the
    formula's (``bubble`` is the least over the steps after the first, ``bubble_median`` their median,
    ``bubbles`` every step's), the in-flight peak per rank, this rank's peak bytes saved for
    backward, tokens/s over the steps after the first, and the per-rank order torch planned.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: use one of {SCHEDULES}")
    with warnings.catch_warnings():  # torch.distributed.pipelining warns about its API; keep the cell clean
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", UserWarning)
        return _train(schedule, microbatches, steps, preset, layers, stages_per_rank, batch, seq, lr, seed, simulate_ms)


def _build(schedule: str, model: nn.Module, m: int, v: int, batch: int, seq: int, recorder: Recorder, simulate_ms):
    """This rank's part of the model, the function that runs one step on a batch, and torch's planned order."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = recorder.device
    if schedule == "naive":
        stage = split_llama(model, world, simulate_ms)[rank].to(device)
        return stage, lambda tokens: naive_step(stage, tokens, recorder), None
    stages = _torch_stages(model, stage_indices(rank, world, v), world * v, batch // m, seq, device, simulate_ms)
    for st in stages:
        recorder.wrap(st)
    sched = make_schedule(schedule, stages, m)
    return nn.ModuleList(st.submod for st in stages), lambda tokens: _step(sched, tokens, rank, world), torch_order(sched)


def _train(schedule, microbatches, steps, preset, layers, stages_per_rank, batch, seq, lr, seed, simulate_ms) -> dict:
    rank, world = rank_and_world()
    m = 1 if schedule == "naive" else microbatches
    v = stages_per_rank or (2 if schedule == "interleaved" else 1)
    if batch % m:
        raise ValueError(f"batch={batch} does not split into microbatches={m}")
    # untied: the embedding and the LM head live on the first and the last stage (the 1b preset ties them)
    model = build_llama(preset, seed=seed, tie_word_embeddings=False, **({"num_hidden_layers": layers} if layers else {}))
    recorder = Recorder(rank, rank_device())
    mine, run, planned = _build(schedule, model, m, v, batch, seq, recorder, simulate_ms)
    opt = torch.optim.AdamW(mine.parameters(), lr=lr)
    losses, bubbles, times, meter = [], [], [], SavedTensorMeter(exclude=mine)  # the stages' weights are not activations
    for step in range(steps):
        tokens = lm_batch(step, batch, seq, model.config.vocab_size, seed).to(recorder.device)
        recorder.start_step(step)
        with meter:
            loss = run(tokens)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(recorder.now())
        losses.append(_from_last_rank(loss, recorder.device))
        bubbles.append(bubble_fraction(recorder.gathered(step)))
    timeline, measured = recorder.gathered(steps - 1), bubbles[1:] or bubbles  # the first step sets up: left out
    # other processes on the machine only ever add idle time: the least of the steps is the schedule's own
    # (timeit takes the minimum for the same reason); the median shows the spread
    return worker_result(losses, schedule=schedule, microbatches=m, stages_per_rank=v, timeline=timeline,
                         bubble=min(measured), bubble_median=statistics.median(measured), bubbles=bubbles,
                         formula=bubble_formula(world, m), in_flight_peak=in_flight_peak(timeline),
                         saved_bytes_peak=meter.peak, tokens_per_s=batch * seq * len(measured) / sum(times[-len(measured):]),
                         planned_order=planned, simulated_ms=simulate_ms)


def _from_last_rank(loss: torch.Tensor | None, device: torch.device) -> float:
    """The step's loss, which only the last rank has, on every rank (a broadcast from it)."""
    t = loss.reshape(1).float() if loss is not None else torch.zeros(1, device=device)
    dist.broadcast(t, dist.get_world_size() - 1)
    return float(t)


def reference_losses(steps: int = 5, preset: str = "tiny", layers: int | None = None, batch: int = 8,
                     seq: int = 32, lr: float = 3e-3, seed: int = 0, device: str = "cpu") -> list[float]:
    """The losses of the same training in one process on the whole model and the whole batch: what every
    schedule must reproduce (same weights, batches, AdamW; ``forward_loss``, no pipeline)."""
    overrides = {"num_hidden_layers": layers} if layers else {}
    model = build_llama(preset, seed=seed, device=device, **overrides)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    history = fit(model, opt, lambda step: lm_batch(step, batch, seq, model.config.vocab_size, seed), steps,
                  loss_fn=forward_loss, progress=False)
    return [r["loss"] for r in history]


def sweep(runs: list[dict] = ()) -> dict:
    """Several ``train`` runs in one process group, for ``launch("course_lib.pp:sweep", p, {"runs": [...]})``
    (starting the processes is the slow part on a CPU)."""
    out = {"runs": [train(**r) for r in runs]}
    dist.barrier()  # no rank tears the group down while another still uses it
    return out
