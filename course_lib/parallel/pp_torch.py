"""Pipeline parallelism with torch's API applied to the course's Llama: cut into stages, one per rank (or several),
micro-batches flowing through ``torch.distributed.pipelining``'s schedules.

The schedules by hand (the orders, the 1F1B executor, the recorded timeline) are ``course_lib.parallel.pp``, what
they cost (the bubble formula, the simulated makespan, a timeline's bubble) ``course_lib.parallel.pp_cost``; this
module puts the Llama through them.

- ``LlamaStage`` / ``split_llama``: the course's Llama cut by decoder layers (stage 0 has the
  embedding, the last has the final norm and the LM head; the loss is the schedule's ``loss_fn``).
- ``naive_step``: the seed's split written out with ``dist.send``/``dist.recv``: whole batch, forward
  stage by stage, backward in reverse.
- ``apply_pp``: this rank's stages of the Llama and torch's schedule over them (torchtitan's ``pipeline_llama``).
- ``train``: the worker for ``launch("course_lib.parallel.pp_torch:train", p, {"spec": {...}})``, one ``PPRun``:
  naive or one of torch's schedules, timed by ``pp.Recorder``; ``memory.SavedTensorMeter``'s peak is the bytes
  autograd keeps for backward. ``reference_losses``: the one-process run it must equal.

Honest timings on a 2-core CPU: p ranks share 2 cores, so measured compute times include waiting
for a core. ``simulate_ms=(f, b)`` adds ``time.sleep`` of f ms to every stage's forward and b ms to
its backward (``SimulatedWork``): sleeping needs no core, so the measured timeline then shows the
schedule itself, with its communication overhead. That is simulated work, not compute: the real
compute still runs beside it, and without ``simulate_ms`` the timeline is real compute only.
"""

from __future__ import annotations

import contextlib
import inspect
import statistics
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from course_lib import profiling
from course_lib.data import lm_batch
from course_lib.distributed import each_run, rank_device
from course_lib.loss import forward_loss, next_token_loss
from course_lib.memory import SavedTensorMeter
from course_lib.models import build_llama
from course_lib.parallel.pp import PP_SPAN, Recorder, SimulatedWork, torch_order
from course_lib.parallel.pp_cost import bubble_formula, bubble_fraction, in_flight_peak
from course_lib.train import RunSpec, fit, rank_and_world, worker_result

# torch's multi-stage schedules: name -> (class, V layout: rank r holds stages r and 2p-1-r, else r, r+p, ...)
MULTI_STAGE = {"interleaved": ("ScheduleInterleaved1F1B", False), "zb": ("ScheduleInterleavedZeroBubble", False),
               "zbv": ("ScheduleZBVZeroBubble", True), "dualpipev": ("ScheduleDualPipeV", True)}
SCHEDULES = ("naive", "gpipe", "1f1b", *MULTI_STAGE)


@dataclass(frozen=True)
class PPRun(RunSpec):
    """One pipelined run of ``train``, as plain values. ``schedule``: one of ``SCHEDULES``; ``microbatches``: m
    (the naive split ignores it: the whole batch); ``layers``: the preset's decoder layers where None (one per
    stage at least); ``stages_per_rank``: 2 for torch's multi-stage schedules and 1 for the others where None;
    ``simulate_ms``: (f, b) ms of sleep padding every stage's forward and backward (``SimulatedWork``), or None."""

    schedule: str = "gpipe"
    microbatches: int = 4
    steps: int = 5
    preset: str = "tiny"
    layers: int | None = None
    stages_per_rank: int | None = None
    batch: int = 8
    seq: int = 32
    lr: float = 3e-3
    seed: int = 0
    simulate_ms: list[float] | None = None


def unsupported(schedule: str) -> str | None:
    """Why this torch cannot run ``schedule``, or None where it can.

    ``ScheduleDualPipeV`` came after torch 2.7. A V puts two adjacent stages on the last rank (p - 1 and p), whose
    activation and gradient must stay in the process: torch hands them over in place only in
    ``_PipelineScheduleRuntime``, which later torch's ZBV runs on (2.13's does); 2.7's ZBV is a
    ``PipelineScheduleMulti`` that sends them to its own rank, which gloo cannot do ("writev: Bad file descriptor"),
    so it is left out there.
    Asked, not read at import: importing ``torch.distributed.pipelining`` takes seconds.
    """
    from torch.distributed import pipelining
    from torch.distributed.pipelining import schedules as torch_schedules

    if schedule not in MULTI_STAGE:
        return None if schedule in SCHEDULES else f"no schedule {schedule!r}: use one of {SCHEDULES}"
    cls = getattr(pipelining, MULTI_STAGE[schedule][0], None)
    if cls is None:
        return f"torch {torch.__version__} has no {MULTI_STAGE[schedule][0]}"
    runtime = getattr(torch_schedules, "_PipelineScheduleRuntime", None)
    if MULTI_STAGE[schedule][1] and not (runtime and issubclass(cls, runtime)):
        return (f"torch {torch.__version__}'s {cls.__name__} sends stage p-1's output to stage p on its own rank, "
                "and gloo cannot send to itself")
    return None


# ---------------------------------------------------------------- the model, cut into stages

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


def stage_indices(rank: int, world: int, stages_per_rank: int = 1, v_shape: bool = False) -> list[int]:
    """The stages rank ``rank`` holds: rank, rank + world, ... (the looped layout of interleaved 1F1B), or with
    ``v_shape`` rank and 2 world - 1 - rank (ZBV's and DualPipeV's V: the last stage sits with the first)."""
    if v_shape:
        return [rank, 2 * world - 1 - rank]
    return [rank + k * world for k in range(stages_per_rank)]


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


# ---------------------------------------------------------------- torch's schedules and the worker

def make_schedule(name: str, stages: list, microbatches: int):
    """torch's schedule for ``name`` over this rank's ``PipelineStage``s, with the mean next-token loss
    per micro-batch; ``scale_grads=True`` divides the summed gradients by m: the global batch's mean."""
    from torch.distributed import pipelining

    loss_fn = next_token_loss
    if name in MULTI_STAGE:
        return getattr(pipelining, MULTI_STAGE[name][0])(stages, microbatches, loss_fn=loss_fn, scale_grads=True)
    if name == "gpipe":
        return gpipe_schedule(stages[0], microbatches, loss_fn)
    return pipelining.Schedule1F1B(stages[0], microbatches, loss_fn=loss_fn, scale_grads=True)


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
                  device: torch.device, simulate_ms, group=None) -> list:
    """This rank's ``PipelineStage``s, with their input and output shapes given (no shape inference)."""
    from torch.distributed.pipelining import PipelineStage

    parts = split_llama(model, n_stages, simulate_ms)
    d, vocab, out = model.config.hidden_size, model.config.vocab_size, []
    for s in indices:
        # requires_grad matters: the stage sends a gradient back only for inputs that require one
        inp = (torch.zeros(mb_rows, seq, dtype=torch.long) if s == 0
               else torch.zeros(mb_rows, seq, d, requires_grad=True))
        outp = torch.zeros(mb_rows, seq, vocab if s == n_stages - 1 else d, requires_grad=True)
        out.append(PipelineStage(parts[s].to(device), s, n_stages, device, input_args=inp.to(device),
                                 output_args=outp.to(device), group=group))
    return out


def _step(schedule, tokens: torch.Tensor, first: bool, last: bool) -> torch.Tensor | None:
    """One pipelined step: the rank with the first stage feeds the tokens, the rank with the last the targets
    (rank 0 both in a V) and returns the mean loss."""
    losses: list = []
    args = (tokens,) if first else ()
    # torch >= 2.10 can skip merging the last stage's logits (return_outputs=False); older step() has no such
    # argument and hands every unknown keyword to the model's forward as an input, so it is passed only where known
    skip = {"return_outputs": False} if "return_outputs" in inspect.signature(schedule.step).parameters else {}
    with waits_for_every_p2p():
        schedule.step(*args, **({"target": tokens, "losses": losses} if last else {}), **skip)
    return torch.stack(losses).mean().detach() if last else None  # micro-batch means, equal sizes: the batch mean


def apply_pp(model: nn.Module, mesh: DeviceMesh | None, cfg: PPRun, device: torch.device | None = None) -> tuple:
    """This rank's stages of ``model`` and torch's schedule over them, for ``cfg``'s schedule (torchtitan's
    ``pipeline_llama``): ``(stages, schedule)``, the stages torch ``PipelineStage``s.

    ``mesh``: the pipeline's 1-D mesh, or None for the whole world. Rank r of p holds ``stage_indices`` (a V for
    the V schedules) of the Llama cut into p·v stages (``split_llama``), v = ``cfg.stages_per_rank`` (2 for torch's
    multi-stage schedules, 1 for the others, where None); their shapes
    are one micro-batch's, ``cfg.batch / cfg.microbatches`` rows of ``cfg.seq`` tokens; ``device``: theirs
    (``rank_device`` where None). The naive split is no torch schedule: ``naive_step``.
    """
    if cfg.schedule == "naive":
        raise ValueError("schedule='naive' is the split by hand (naive_step): apply_pp builds torch's schedules")
    rank, world = (mesh.get_local_rank(), mesh.size()) if mesh is not None else (dist.get_rank(), dist.get_world_size())
    v = _stages_per_rank(cfg.schedule, cfg.stages_per_rank)
    v_shape = MULTI_STAGE.get(cfg.schedule, (None, False))[1]
    stages = _torch_stages(model, stage_indices(rank, world, v, v_shape), world * v, cfg.batch // cfg.microbatches,
                           cfg.seq, device or rank_device(), cfg.simulate_ms,
                           mesh.get_group() if mesh is not None else None)
    return stages, make_schedule(cfg.schedule, stages, cfg.microbatches)


def train(spec: PPRun | dict | None = None) -> dict:
    """Train a Llama preset pipelined over this process group, the run ``spec`` (a ``PPRun``, or a dict of its fields:
    what ``launch`` hands its ranks); the worker of ``launch("course_lib.parallel.pp_torch:train")``.

    ``schedule``: "naive" (hand-written send/recv, the whole batch: ``microbatches`` is ignored),
    "gpipe", "1f1b", or a multi-stage one: "interleaved" (1F1B), "zb" (interleaved zero bubble: backwards split
    into I and W), "zbv" (zero bubble in a V) or "dualpipev" (where torch has it), ``stages_per_rank`` stages per
    rank, 2 unless told (the V schedules need 2). ``layers``
    overrides the preset's decoder layers (it needs one per stage at least). Returns the losses (the
    global batch's, on every rank), the last step's gathered timeline, its measured bubble and the
    formula's (``bubble`` is the least over the steps after the first, ``bubble_median`` their median,
    ``bubbles`` every step's), the in-flight peak per rank, this rank's peak bytes saved for
    backward, tokens/s over the steps after the first, and the per-rank order torch planned.
    """
    spec = PPRun.of(spec)
    if why := unsupported(spec.schedule):
        raise ValueError(f"schedule={spec.schedule!r}: {why}")
    with _quiet_pipelining():
        return _train(spec)


@contextlib.contextmanager
def _quiet_pipelining():
    """torch.distributed.pipelining warns about its API at every use: keep the notebooks' cells clean."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", UserWarning)
        yield


def _stages_per_rank(schedule: str, given: int | None = None) -> int:
    """``given``, else 2 for torch's multi-stage schedules and 1 for the others."""
    return given or (2 if schedule in MULTI_STAGE else 1)


def _model(spec: PPRun) -> nn.Module:
    """The run's Llama, untied: the embedding and the LM head live on the first and the last stage (the 1b preset
    ties them); ``spec.layers`` decoder layers where given."""
    return build_llama(spec.preset, seed=spec.seed, tie_word_embeddings=False,
                       **({"num_hidden_layers": spec.layers} if spec.layers else {}))


def _build(spec: PPRun, model: nn.Module, recorder: Recorder):
    """This rank's part of the model, the function that runs one step on a batch, and torch's planned order."""
    if spec.schedule == "naive":
        rank, world = dist.get_rank(), dist.get_world_size()
        stage = split_llama(model, world, spec.simulate_ms)[rank].to(recorder.device)
        return stage, lambda tokens: naive_step(stage, tokens, recorder), None
    stages, sched = apply_pp(model, None, spec, recorder.device)
    for st in stages:  # the schedule calls each stage's methods when it runs: wrapped now, they are timed
        recorder.wrap(st)
    first, last = any(st.is_first for st in stages), any(st.is_last for st in stages)
    return (nn.ModuleList(st.submod for st in stages), lambda tokens: _step(sched, tokens, first, last),
            torch_order(sched))


def _train(spec: PPRun) -> dict:
    rank, world = rank_and_world()
    schedule, steps, batch, seq, seed = spec.schedule, spec.steps, spec.batch, spec.seq, spec.seed
    m = 1 if schedule == "naive" else spec.microbatches
    v = _stages_per_rank(schedule, spec.stages_per_rank)
    if batch % m:
        raise ValueError(f"batch={batch} does not split into microbatches={m}")
    model = _model(spec)
    recorder = Recorder(rank, rank_device())
    mine, run, planned = _build(spec, model, recorder)
    opt = torch.optim.AdamW(mine.parameters(), lr=spec.lr)
    bubbles, times, meter = [], [], SavedTensorMeter(exclude=mine)  # the stages' weights are not activations

    def pipelined(tokens) -> dict:  # the schedule runs every stage's forward and backward itself
        with meter:
            loss = run(tokens)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(recorder.now())  # from the step's shared t0: the barrier before it is not the step's time
        return {"loss": _on_every_rank(loss, recorder.device)}

    def timed(step: int, record: dict) -> bool:
        bubbles.append(bubble_fraction(recorder.gathered(step)))
        return False

    history = fit(mine, opt, lambda step: lm_batch(step, batch, seq, model.config.vocab_size, seed).to(recorder.device),
                  steps, step_context=lambda step: _step_started(recorder, step), step=pipelined, after_step=timed,
                  progress=False)
    losses = [r["loss"] for r in history]
    timeline, measured = recorder.gathered(steps - 1), bubbles[1:] or bubbles  # the first step sets up: left out
    # other processes on the machine only ever add idle time: the least of the steps is the schedule's own
    # (timeit takes the minimum for the same reason); the median shows the spread
    return worker_result(losses, schedule=schedule, microbatches=m, stages_per_rank=v, timeline=timeline,
                         bubble=min(measured), bubble_median=statistics.median(measured), bubbles=bubbles,
                         formula=bubble_formula(world, m), in_flight_peak=in_flight_peak(timeline),
                         saved_bytes_peak=meter.peak,
                         tokens_per_s=batch * seq * len(measured) / sum(times[-len(measured):]),
                         planned_order=planned, simulated_ms=spec.simulate_ms)


@contextlib.contextmanager
def _step_started(recorder: Recorder, step: int):
    """Every rank starts the step together (``Recorder.start_step``: a barrier, then the shared t0)."""
    recorder.start_step(step)
    yield


def _on_every_rank(loss: torch.Tensor | None, device: torch.device) -> float:
    """The step's loss, which only the rank holding the last stage has, on every rank: a sum of it and the others'
    zeros, exact (the last stage is on the last rank, or on rank 0 in a V)."""
    t = loss.reshape(1).float() if loss is not None else torch.zeros(1, device=device)
    dist.all_reduce(t)
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


def sweep(runs: list[PPRun | dict] = ()) -> dict:
    """Several ``train`` runs (``PPRun``s, or dicts of their fields) in one process group, for
    ``launch("course_lib.parallel.pp_torch:sweep", p, {"runs": [...]})`` (starting the processes is the slow part on
    a CPU)."""
    return each_run(train, [{"spec": run} for run in runs])


# ---------------------------------------------------------------- one step in torch's profiler

def trace_step(schedule: str, trace_dir: str, microbatches: int = 4, batch: int = 8, seq: int = 32) -> dict:
    """A worker (call on every rank): one step of the tiny Llama under ``schedule`` traced by ``torch.profiler``
    (after one untraced step), written to ``trace_dir/15_pp_{schedule}_rank{r}.json`` for Perfetto: ``{"path"}``.

    The ``Recorder`` names every stage's F, B, I and W in the trace (``pp.PP_SPAN``), whatever the schedule;
    the point-to-point sends and receives are gloo's own spans. ``pipeline_spans`` reads both back."""
    if why := unsupported(schedule):
        raise ValueError(f"schedule={schedule!r}: {why}")
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = PPRun(schedule=schedule, microbatches=microbatches, batch=batch, seq=seq,
                 layers=world * _stages_per_rank(schedule))
    model = _model(spec)  # the tiny Llama, a layer per stage
    with _quiet_pipelining():
        _, run, _ = _build(spec, model, Recorder(rank, rank_device()))
        tokens = lm_batch(0, batch, seq, model.config.vocab_size)
        path = profiling.trace(lambda: run(tokens), f"{trace_dir}/15_pp_{schedule}_rank{rank}.json")
    return {"path": str(path)}


def pipeline_spans(path: str):
    """A ``trace_step`` trace as a table: one row per stage action (kind F, B, I or W; mb; stage) and per
    point-to-point transfer (kind "send" or "recv", gloo's span), with start_ms and duration_ms, by start."""
    import pandas as pd

    frame = profiling.read_trace(path)
    actions = frame.name.str.extract(PP_SPAN)
    acts = frame[actions.kind.notna()].assign(kind=actions.kind, mb=actions.mb.astype(float),
                                              stage=actions.stage.astype(float))
    p2p = frame[frame.name.isin(["gloo:send", "gloo:recv"])]
    p2p = p2p.assign(kind=p2p.name.str.removeprefix("gloo:"), mb=float("nan"), stage=float("nan"))
    columns = ["name", "kind", "mb", "stage", "start_ms", "duration_ms"]
    return pd.concat([acts[columns], p2p[columns]]).sort_values("start_ms", ignore_index=True)
