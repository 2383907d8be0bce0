"""Fully sharded data parallelism with torch's API applied to the Llama: FSDP2 (``fully_shard``).

Each rank keeps only a shard (a slice along dim 0) of every weight, gradient and Adam
state. A wrapped unit (here: the embedding, each decoder layer, the LM head, then the
root for what is left: ``apply_fsdp``) all-gathers its full weights just before its forward and backward,
and reduce-scatters its gradients after backward, so each rank ends up with the *average*
gradient of its own shard only. The strategies of seed 003 in FSDP2 terms:

| seed 003 (FSDP1)  | FSDP2 here                                   | kept per rank between steps |
| ----------------- | -------------------------------------------- | --------------------------- |
| ``FULL_SHARD``    | 1-D mesh, ``reshard_after_forward=True``     | 1/N of everything            |
| ``SHARD_GRAD_OP`` | 1-D mesh, ``reshard_after_forward=False``    | 1/N; full weights from forward to backward |
| ``NO_SHARD``      | 2-D mesh (N, 1): replicate N, shard over 1   | everything (= DDP)           |
| ``HYBRID_SHARD``  | 2-D mesh (N/s, s): replicate, shard over s   | 1/s (s = GPUs of one node)   |

``train``, the parallelism's one worker, runs one ``FSDPRun``: any of them (plus bf16 mixed precision, CPU offload,
meta-device init with weights broadcast from rank 0, and a sharded ``torch.distributed.checkpoint`` save/resume),
and returns the global-batch losses and the bytes this rank holds; ``sweep`` runs several in one process group.
``trace_step`` traces one step's collectives and ``step_collectives`` reads them. The mechanism written out by hand,
``ShardedModule``, is ``fsdp``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from course_lib import profiling
from course_lib.data import lm_batch
from course_lib.distributed import each_run, param_digest, rank_device
from course_lib.loss import forward_loss
from course_lib.memory import estimate_model_state, optimizer_state_bytes, tensor_bytes
from course_lib.models import build_llama, empty_llama, llama_config, llama_num_parameters
from course_lib.train import Dims, RunSpec, fit, rank_and_world, worker_result

if TYPE_CHECKING:  # pandas starts a thread when imported, and nothing the grader forks may import one
    import pandas as pd

STRATEGIES = {"full": "FULL_SHARD", "grad_op": "SHARD_GRAD_OP", "no_shard": "NO_SHARD", "hybrid": "HYBRID_SHARD"}


@dataclass(frozen=True)
class FSDPRun(RunSpec):
    """One FSDP2 training run of a Llama preset (``train``): ``steps`` AdamW steps at ``lr`` on global batches of
    ``batch`` sequences of ``seq`` tokens, each rank's share cut into ``accum_steps`` micro-batches.

    ``strategy``: a key of ``STRATEGIES``, or ``"single"`` (one plain process); ``shard_size``: HYBRID_SHARD's shard
    group (None: ``hybrid_shard_size``). ``mixed_precision`` ("bfloat16"), ``offload`` and ``meta_init`` as
    ``apply_fsdp`` and ``train`` say. ``stop_after=k`` saves a DCP checkpoint to ``checkpoint_dir`` after step k and
    stops; ``resume=True`` loads it and continues to ``steps``. ``device``: where a rank computes (None: its own,
    ``distributed.rank_device``)."""

    preset: str = "tiny"
    steps: int = 5
    strategy: str = "full"
    mixed_precision: str | None = None
    offload: bool = False
    meta_init: bool = False
    checkpoint_dir: str | None = None
    resume: bool = False
    stop_after: int | None = None
    shard_size: int | None = None
    seed: int = 0
    batch: int = 4
    seq: int = 32
    lr: float = 3e-3
    accum_steps: int = 1
    device: str | None = None


def hybrid_shard_size(world: int) -> int:
    """HYBRID_SHARD's shard group when none is given: two "nodes" where two divide the world, else the largest
    divisor of the world below it (3, 5 or 7 ranks: 1, each rank a "node"; 6: 3)."""
    return max(d for d in range(1, max(world // 2, 1) + 1) if world % d == 0)


def make_mesh(strategy: str, shard_size: int | None = None, device_type: str | None = None):
    """The DeviceMesh of a strategy over the whole world (see the module's table)."""
    world = dist.get_world_size()
    device_type = device_type or rank_device().type
    if strategy in ("full", "grad_op"):
        return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
    if strategy == "no_shard":
        shard_size = 1
    elif strategy == "hybrid":
        shard_size = shard_size or hybrid_shard_size(world)
        if world % shard_size:
            raise ValueError(f"shard_size={shard_size} must divide the world size {world}")
    else:
        raise ValueError(f"strategy={strategy!r}: use one of {sorted(STRATEGIES)}")
    return init_device_mesh(device_type, (world // shard_size, shard_size), mesh_dim_names=("replicate", "shard"))


def apply_fsdp(model: nn.Module, mesh, cfg: FSDPRun | dict | None = None) -> nn.Module:
    """Wrap a Llama with ``fully_shard`` over ``mesh``: the embedding, each decoder layer, the LM head, then the root.

    One unit per transformer block is accelerate's ``TRANSFORMER_BASED_WRAP`` with
    ``LlamaDecoderLayer``: only one block's full weights exist at a time. ``cfg`` (an ``FSDPRun``, a dict of its
    fields, or None for its defaults) says how: ``strategy="grad_op"`` keeps each unit's full weights from forward to
    backward (``reshard_after_forward=False``), every other strategy frees them after forward; ``mixed_precision``
    ("bfloat16") computes in bf16 and reduces gradients in float32 over float32 shards;
    ``offload`` keeps shards, gradients and the optimizer step on the CPU.
    """
    cfg = FSDPRun.of(cfg)
    kw = dict(mesh=mesh, reshard_after_forward=cfg.strategy != "grad_op")
    if cfg.mixed_precision:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=getattr(torch, cfg.mixed_precision),
                                               reduce_dtype=torch.float32)
    if cfg.offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    for unit in (model.model.embed_tokens, *model.model.layers, model.lm_head):
        fully_shard(unit, **kw)
    fully_shard(model, **kw)
    return model


def _build(preset: str, seed: int, meta_init: bool, shard, device: torch.device) -> tuple[nn.Module, int]:
    """Build and shard; with ``meta_init`` only rank 0 materialises weights, the others get them by broadcast.

    Returns the model and the bytes of full (unsharded) weights this rank built on the way.
    """
    if not meta_init:
        model = build_llama(preset, seed=seed, device=device)
        built = tensor_bytes(model.parameters())  # every rank holds a full copy before sharding
        return shard(model), built
    # one full copy, on rank 0
    full = build_llama(preset, seed=seed, device=device).state_dict() if dist.get_rank() == 0 else {}
    built = tensor_bytes(full.values())  # counted now: loading below turns the dict's tensors into local shards
    model = shard(empty_llama(preset))  # shapes only: sharding a meta model allocates nothing
    model.to_empty(device=device)  # allocate this rank's shards, uninitialised
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    rot = model.model.rotary_emb  # non-persistent buffers are not in a state dict: recompute them
    with device:
        fresh = type(rot)(config=model.config)
    for name, buf in fresh.named_buffers():
        getattr(rot, name).copy_(buf)
    return model, built


def save_checkpoint(model: nn.Module, opt: torch.optim.Optimizer, step: int, checkpoint_dir: str) -> None:
    """A sharded DCP checkpoint of model, optimizer and step: every rank writes its own shards."""
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "step": torch.tensor(step)}, checkpoint_id=checkpoint_dir)


def load_checkpoint(model: nn.Module, opt: torch.optim.Optimizer, checkpoint_dir: str) -> int:
    """Load a ``save_checkpoint`` into model and optimizer (each rank reads its shards); return the step."""
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": torch.zeros((), dtype=torch.long)}
    dcp.load(state, checkpoint_id=checkpoint_dir)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["step"])


def train(spec: FSDPRun | dict | None = None) -> dict:
    """Train a Llama preset with FSDP2 over this process group (or, ``strategy="single"``, one plain process): FSDP's
    one worker, one ``FSDPRun`` (a dict of its fields as launch's JSON brings it; None: the defaults).

    Each rank trains on its slice of every global batch; the reported loss is the global
    batch's. ``bytes`` are this rank's local shards: weights at rest, weights present between forward and backward,
    gradients, Adam states.
    """
    spec = FSDPRun.of(spec)
    single = spec.strategy == "single"
    dev = torch.device(spec.device) if spec.device else rank_device()
    rank, world = (0, 1) if single else rank_and_world()
    dims = Dims(spec.batch, spec.accum_steps, dp=world)
    if single:
        model, built = _build(spec.preset, spec.seed, False, lambda m: m, dev)
        mesh_shape = [1]
    else:
        mesh = make_mesh(spec.strategy, spec.shard_size, dev.type)
        mesh_shape = list(mesh.shape)
        model, built = _build(spec.preset, spec.seed, spec.meta_init, lambda m: apply_fsdp(m, mesh, spec), dev)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr)
    measured: dict[str, int] = {}

    def loss_fn(m, tokens):  # forward, then note what weights are resident until backward
        loss = forward_loss(m, tokens)
        measured["weights_in_backward"] = tensor_bytes(m.parameters())
        return loss

    opt.register_step_pre_hook(lambda *a: measured.update(gradients=tensor_bytes(p.grad for p in model.parameters())))
    start = load_checkpoint(model, opt, spec.checkpoint_dir) if spec.resume else 0

    def stop_here(step: int, record: dict) -> bool:  # save after step ``stop_after`` and stop there
        if spec.stop_after is not None and step + 1 == spec.stop_after:
            save_checkpoint(model, opt, step + 1, spec.checkpoint_dir)
            return True
        return False

    def batch(step: int) -> torch.Tensor:  # this rank's slice of the step's global batch
        return dims.local(lm_batch(step, spec.batch, spec.seq, model.config.vocab_size, spec.seed), rank)

    history = fit(model, opt, batch, spec.steps, start=start, dims=dims, loss_fn=loss_fn, after_step=stop_here,
                  progress=False)
    held = {"weights": tensor_bytes(model.parameters()), "weights_in_backward": measured.get("weights_in_backward", 0),
            "gradients": measured.get("gradients", 0), "optimizer states": optimizer_state_bytes(opt)}
    held["total"] = held["weights"] + held["gradients"] + held["optimizer states"]
    n_params = llama_num_parameters(llama_config(spec.preset))
    layer = model.model.layers[0].mlp.gate_proj.weight
    return worker_result([r["loss"] for r in history], strategy=spec.strategy, mesh_shape=mesh_shape,
                         start_step=start, bytes=held, full_bytes=estimate_model_state(n_params), n_params=n_params,
                         full_weights_built=built, digest=param_digest(model),
                         layer_placements=[str(pl) for pl in getattr(layer, "placements", [])])


def sweep(runs: list[FSDPRun | dict] = ()) -> dict:
    """Several ``train`` runs (``FSDPRun`` specs, or dicts of their fields) in one process group (process start-up is
    the slow part on a CPU): a worker for ``launch.on_ranks(sweep, n, device, runs=[...])``, which puts the ranks on
    GPUs or CPU ranks."""
    return each_run(train, [{"spec": run} for run in runs])


# The compute an all-gather could hide behind: the matmuls of forward and of backward, both on the rank's main
# thread (autograd runs a CPU backward on the thread that called it)
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
# FSDP2's record_function spans: "FSDP::all_gather (model.layers.0)", the root's without a name in brackets
_FSDP_SPAN = r"FSDP::(\w+)(?: \((.*)\))?$"


def trace_step(trace_dir: str, preset: str = "tiny", batch: int = 4, seq: int = 32, seed: int = 0) -> dict:
    """A worker for ``launch.run_forked``: one FULL_SHARD step (forward and backward) of a Llama wrapped by
    ``apply_fsdp``, traced by ``profiling.trace`` twice: as wrapped ("default"), then with explicit prefetching,
    each unit all-gathering the next one in forward and the previous one in backward ("prefetch").

    Writes ``08_fsdp_step_{default,prefetch}_rank{r}.json`` into ``trace_dir``. Returns ``paths`` (theirs, by
    "default" and "prefetch"), ``units`` (in forward order, as ``step_collectives`` names them: "root" the
    outermost) and ``resharded``: the units that forward left sharded again, so that backward gathers them again.
    """
    from torch.distributed.tensor import DTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)  # one core per rank on a CPU: the ranks' matmuls do not compete for cores
    model = apply_fsdp(build_llama(preset, seed=seed), make_mesh("full", device_type="cpu"), FSDPRun(strategy="full"))
    chain = {"model.embed_tokens": model.model.embed_tokens,
             **{f"model.layers.{i}": layer for i, layer in enumerate(model.model.layers)}, "lm_head": model.lm_head}
    tokens = lm_batch(0, batch, seq, model.config.vocab_size, seed).chunk(world)[rank]

    def step():
        model.zero_grad(set_to_none=True)
        forward_loss(model, tokens).backward()

    # an untraced step: FSDP's lazy init, and which units hold sharded weights (DTensors) between forward and
    # backward; read after forward, since an unsharded unit's modules hold other (plain) parameters than a sharded's
    loss = forward_loss(model, tokens)
    nested = {id(p) for unit in chain.values() for p in unit.parameters()}
    own = {"root": [p for p in model.parameters() if id(p) not in nested],
           **{name: list(unit.parameters()) for name, unit in chain.items()}}
    resharded = [name for name, params in own.items() if all(isinstance(p, DTensor) for p in params)]
    loss.backward()
    paths = {"default": profiling.trace(step, Path(trace_dir) / f"08_fsdp_step_default_rank{rank}.json")}
    units = list(chain.values())
    for unit, after in zip(units, units[1:]):
        unit.set_modules_to_forward_prefetch([after])
        after.set_modules_to_backward_prefetch([unit])
    paths["prefetch"] = profiling.trace(step, Path(trace_dir) / f"08_fsdp_step_prefetch_rank{rank}.json")
    return {"paths": {k: str(p) for k, p in paths.items()}, "units": list(own), "resharded": resharded}


def _main_thread(frame: pd.DataFrame):
    """The rank's main thread in a ``trace_step`` trace: the one FSDP's hooks run on."""
    return frame.thread[frame.name.str.startswith("FSDP::")].mode()[0]


def label_step(frame: pd.DataFrame) -> pd.DataFrame:
    """A ``trace_step`` trace (``profiling.read_trace``) with two kinds more, for ``profiling.hidden``: the main
    thread's matmuls are "compute", its spans that issue an all-gather and wait for it are "gather_wait"."""
    main = _main_thread(frame)
    on_main = frame.thread == main
    kind = frame.kind.mask(on_main & frame.name.isin(MATMULS), "compute")
    return frame.assign(kind=kind.mask(on_main & frame.name.str.fullmatch(r"FSDP::all_gather( \(.*\))?"),
                                       "gather_wait"))


def step_collectives(frame: pd.DataFrame) -> pd.DataFrame:
    """The collectives of a ``trace_step`` trace, one row each in the order they ran: name, thread (gloo's),
    start_ms, duration_ms; the unit and phase ("forward", "backward") of the FSDP span on the main thread that
    issued the collective and waited for it, and that span's start (``issued_ms``); ``prefetch``: issued by
    another unit's prefetch. An all-gather also gets ``previous``, the unit that computes just before its own in
    that phase, and ``previous_first_mm_ms``, ``previous_last_mm_ms``: when that unit's matmuls began and ended
    (NaN where there is none: no unit before it, or the embedding, which has no matmul)."""
    import pandas as pd

    frame = label_step(frame)
    main = _main_thread(frame)
    spans = frame[(frame.thread == main) & frame.name.str.startswith("FSDP::")]
    ends = spans.start_ms + spans.duration_ms
    parsed = spans.name.str.extract(_FSDP_SPAN)  # the prefetch spans match neither group: NaN
    what, unit = parsed[0], parsed[1].fillna("root").str.strip().replace("", "root")
    backward_at = spans.start_ms[what == "pre_backward"].min()
    compute = frame[frame.kind == "compute"].start_ms

    windows = []  # (start, end, unit, phase): from a unit's pre-hook to its post-hook, its compute in between
    for phase, pre, post in (("forward", "pre_forward", "post_forward"), ("backward", "pre_backward", "post_backward")):
        for i in spans.index[(what == pre) & (unit != "root")]:
            after = spans.start_ms[(unit == unit[i]) & what.str.startswith(post) & (spans.start_ms > ends[i])]
            if len(after):
                windows.append((ends[i], after.min(), unit[i], phase))
    mm = {(u, p): compute[(compute >= a) & (compute <= b)] for a, b, u, p in windows}
    order = {p: [u for _, _, u, q in sorted(windows) if q == p] for p in ("forward", "backward")}

    rows = []
    issuing = spans[what.isin(["all_gather", "post_backward_reduce"])]
    prefetches = spans[spans.name.str.contains("_prefetch for ")]
    for c in frame[frame.kind == "collective"].itertuples():
        holds = issuing[(issuing.start_ms <= c.start_ms) & (ends[issuing.index] >= c.start_ms)]
        if holds.empty:
            raise ValueError(f"{c.name} at {c.start_ms:.3f} ms: no FSDP span on the main thread issued it")
        i = holds.index[holds.start_ms.argmax()]  # the innermost
        phase = "forward" if spans.start_ms[i] < backward_at else "backward"
        chain = order[phase]
        before = chain[chain.index(unit[i]) - 1] if unit[i] in chain[1:] else None
        gather = c.name.endswith("all_gather")
        times = mm.get((before, phase), pd.Series(dtype=float)) if gather else pd.Series(dtype=float)
        rows.append({"name": c.name, "thread": c.thread, "unit": unit[i], "phase": phase,
                     "issued_ms": spans.start_ms[i], "start_ms": c.start_ms, "duration_ms": c.duration_ms,
                     "prefetch": bool(((prefetches.start_ms <= spans.start_ms[i])
                                       & (prefetches.start_ms + prefetches.duration_ms >= ends[i])).any()),
                     "previous": before if gather else None,
                     "previous_first_mm_ms": times.min(), "previous_last_mm_ms": times.max()})
    return pd.DataFrame(rows)


def step_summary(collectives: pd.DataFrame) -> dict:
    """``step_collectives``'s table counted: all-gathers per phase, the reductions by name, and per phase the
    all-gathers whose previous unit computes ("paced"), of which those issued before its first matmul ("early") and
    after its last ("late")."""
    gathers = collectives[collectives.name.str.endswith("all_gather")]
    paced = gathers[gathers.previous_first_mm_ms.notna()]

    def per_phase(rows: pd.DataFrame) -> dict:
        return {phase: int((rows.phase == phase).sum()) for phase in ("forward", "backward")}

    reductions = collectives.name[~collectives.name.str.endswith("all_gather")].value_counts()
    return {"all_gathers": per_phase(gathers), "reductions": {k: int(n) for k, n in reductions.items()},
            "paced": per_phase(paced), "early": per_phase(paced[paced.issued_ms < paced.previous_first_mm_ms]),
            "late": per_phase(paced[paced.issued_ms > paced.previous_last_mm_ms])}
