"""Tensor parallelism with torch's API applied to the course's Llama: the DTensor plan, DP×TP, and the worker.

``apply_tp`` splits transformers' Llama with torch's DTensor plan (``parallelize_module``): the column/row pairs
that ``course_lib.parallel.tp`` writes by hand, sequence parallelism on the norms included. ``train`` runs one
``TPRun``: one mode over this process group, one process (the reference), ``tp``'s split by hand, torch's plan,
DDP, FSDP2, or DP×TP on a 2-D mesh with FSDP2, and counts the bytes of every collective (``CollectiveBytes``).
``compare`` runs several modes in one launch; ``comm_bytes`` the bytes one step sends per dimension (DP, TP,
DP×TP). What the split by hand all-reduces is ``course_lib.parallel.tp_cost``'s formula.

A module apart from ``tp`` because it is a different thing: ``tp`` is the mechanism (the layers notebook 14's
students write, stubbed in their edition); this is the harness that trains with it and with torch's version.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)
from torch.distributed.tensor.parallel import loss_parallel as parallel_loss
from torch.nn.parallel import DistributedDataParallel

from course_lib.data import lm_batch
from course_lib.device import default_device
from course_lib.distributed import CollectiveBytes, rank_device
from course_lib.launch import on_ranks
from course_lib.loss import forward_loss
from course_lib.memory import PeakMemory, tensor_bytes
from course_lib.models import build_llama
from course_lib.parallel.tp import Layers, check_heads, parallelize_llama_by_hand
from course_lib.train import Dims, RunSpec, fit, rank_and_world, tokens_per_second, worker_result

MODES = ("single", "hand", "torch", "ddp", "dp", "dp_tp")
MODEL_FIELDS = ("num_attention_heads", "num_key_value_heads", "tie_word_embeddings")  # None: the preset's


@dataclass(frozen=True)
class TPRun(RunSpec):
    """One tensor-parallel run of ``train``, as plain values (``mode``: one of ``MODES``; ``dp``: the data-parallel
    size of "dp_tp"'s mesh; ``sequence_parallel`` and ``loss_parallel``: ``apply_tp``'s options; ``device``: this
    rank's, or None for ``rank_device``). ``num_attention_heads``, ``num_key_value_heads`` and
    ``tie_word_embeddings`` change the preset's config where given (a TP size must divide the head counts)."""

    mode: str = "torch"
    steps: int = 5
    preset: str = "tiny"
    batch: int = 4
    seq: int = 32
    lr: float = 3e-3
    seed: int = 0
    dp: int = 1
    sequence_parallel: bool = True
    loss_parallel: bool = False
    device: str | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    tie_word_embeddings: bool | None = None


def apply_tp(model: nn.Module, mesh: DeviceMesh, cfg: TPRun | None = None) -> nn.Module:
    """transformers' ``LlamaForCausalLM`` split with torch's DTensor plan over ``mesh`` (1-D: the "tp" dim), in
    place; ``cfg`` (a ``TPRun``, its defaults where None) gives ``sequence_parallel`` and ``loss_parallel``.

    q, k, v, gate, up: ``ColwiseParallel``; o, down: ``RowwiseParallel``; the embedding row-wise
    (split by vocabulary); the LM head column-wise, its logits gathered (or, ``loss_parallel``, left
    split by vocabulary for ``torch.distributed.tensor.parallel.loss_parallel``). With
    ``sequence_parallel`` the norms and residuals run on 1/N of the tokens (``Shard(1)``): each block's
    all-reduce becomes an all-gather before it and a reduce-scatter after it, same bytes, 1/N activations.
    Between modules the hidden states stay DTensors (``use_local_output=False``): transformers adds the
    residual to them and reads their (global) sequence length for positions.
    """
    cfg = cfg or TPRun()
    sequence_parallel, loss_parallel = cfg.sequence_parallel, cfg.loss_parallel
    if model.lm_head.weight is model.model.embed_tokens.weight:  # measured: trains, silently wrong, from step 2
        raise ValueError("the LM head shares its weight with the embedding (tie_word_embeddings=True), which this "
                         "plan splits two ways: build the model with tie_word_embeddings=False")
    check_heads(model.config.num_attention_heads, model.config.num_key_value_heads, mesh.size())
    seq, local = (Shard(1), False) if sequence_parallel else (Replicate(), True)  # without SP: plain tensors between
    layer_plan = {
        "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": seq},
                                        desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=seq, use_local_output=local),
        "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=seq, use_local_output=local),
    }
    if sequence_parallel:
        layer_plan.update({"input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel()})
    for layer in model.model.layers:
        parallelize_module(layer, mesh, layer_plan)
    top_plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq, use_local_output=local),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                   use_local_output=not loss_parallel),
    }
    if sequence_parallel:
        top_plan["model.norm"] = SequenceParallel()
    return parallelize_module(model, mesh, top_plan)


def _parallelize(model: nn.Module, spec: TPRun, device: torch.device,
                 layers: Layers | None = None) -> tuple[nn.Module, dict, int, int]:
    """Split ``model`` for ``spec.mode``; returns it, its process groups by name, and this rank's (dp index, dp
    size)."""
    rank, world = rank_and_world()
    mode = spec.mode
    if mode == "single":
        return model, {}, 0, 1
    if mode == "hand":
        return parallelize_llama_by_hand(model, rank, world, layers=layers), {"tp": dist.group.WORLD}, 0, 1
    if mode == "torch":
        mesh = Dims(spec.batch, tp=world).mesh(device.type, ("tp",))
        return apply_tp(model, mesh["tp"], spec), {"tp": mesh.get_group("tp")}, 0, 1
    if mode == "ddp":
        return DistributedDataParallel(model), {"dp": dist.group.WORLD}, rank, world
    if mode not in ("dp", "dp_tp"):
        raise ValueError(f"mode={mode!r}: use one of {MODES}")
    dp = world if mode == "dp" else spec.dp
    if world % dp:
        raise ValueError(f"dp={dp} does not divide the world size {world}: use a divisor of {world}")
    mesh = Dims(spec.batch, dp=dp, tp=world // dp).mesh(device.type, ("dp", "tp"))
    if mode == "dp_tp":  # TP inside the "tp" dim first, then FSDP2 shards the (already split) weights over "dp"
        apply_tp(model, mesh["tp"], spec)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    groups = {"dp": mesh.get_group("dp"), "tp": mesh.get_group("tp")}
    return model, groups, mesh.get_local_rank("dp"), dp


def _quiet() -> None:
    """Keep torch's deprecation and DTensor notes off stderr (nbgrader scores 0 a test cell that writes there)."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\..*")


def reduce_partial_grads(model: nn.Module) -> None:
    """All-reduce, once, every gradient DTensor left as a ``Partial`` sum (the sequence-parallel norms' weights).

    Left alone, each optimizer op that reads such a gradient reduces it again: AdamW does 3
    all-reduces per norm weight per step. Pass it to ``train_step`` as ``sync_grads``.
    """
    for p in model.parameters():
        if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements):
            p.grad = p.grad.redistribute(
                placements=[Replicate() if pl.is_partial() else pl for pl in p.grad.placements])


def _loss_fn(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    loss = forward_loss(model, tokens)
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss  # loss parallel: a replicated DTensor


def _model(spec: TPRun, device: torch.device) -> nn.Module:
    """The run's Llama: its preset, with the config fields ``spec`` sets (``MODEL_FIELDS``), on ``device``."""
    overrides = {k: getattr(spec, k) for k in MODEL_FIELDS if getattr(spec, k) is not None}
    return build_llama(spec.preset, seed=spec.seed, device=device, **overrides)


def train(spec: TPRun | dict | None = None, layers: Layers | None = None) -> dict:
    """Train a Llama preset with tensor parallelism over this process group, the run ``spec`` (a ``TPRun``, or a
    dict of its fields: what ``launch`` hands its ranks); the worker of ``launch``.

    ``mode``: "single" (the whole model in this process: the reference), "hand" (``parallelize_llama_by_hand``
    over the world), "torch" (``apply_tp`` on a 1-D mesh), "ddp" (torch's DDP over the world), "dp"
    (FSDP2 over the world, no TP) or "dp_tp" (a (dp, world/dp) mesh: TP inside "tp", FSDP2 over "dp"). TP
    ranks see the same tokens; DP ranks their slice of the global batch. ``layers=(column, row)`` gives "hand"
    another pair (notebook 14's, in ranks forked from it: ``run_forked``). Returns the global batch's losses,
    tokens/s, peak GPU memory, and the last step's collectives.
    """
    spec = TPRun.of(spec)
    steps, batch, seq, seed = spec.steps, spec.batch, spec.seq, spec.seed
    if steps < 1:
        raise ValueError(f"steps={steps} must be at least 1")
    _quiet()
    dev = torch.device(spec.device) if spec.device else rank_device()
    model = _model(spec, dev)
    vocab = model.config.vocab_size
    model, groups, dp_rank, dp_size = _parallelize(model, spec, dev, layers)
    dims = Dims(batch, dp=dp_size)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr)
    counter = CollectiveBytes(groups)

    @contextlib.contextmanager
    def step_context(step: int):  # count the last step's collectives only: counting is slow
        with (counter if step == steps - 1 else contextlib.nullcontext(),
              parallel_loss() if spec.loss_parallel else contextlib.nullcontext()):
            yield

    with PeakMemory(dev) as peak:  # TP ranks agree on the loss; fit's mean over DP ranks is the global batch's
        history = fit(model, opt, lambda step: dims.local(lm_batch(step, batch, seq, vocab, seed), dp_rank), steps,
                      dims=dims, step_context=step_context, loss_fn=_loss_fn, sync_grads=reduce_partial_grads,
                      progress=False)
    timed = history[1:-1] or history  # not the warm-up step, not the counted one
    return worker_result([r["loss"] for r in history], mode=spec.mode,
                         tokens_per_s=tokens_per_second(timed, batch * seq),
                         peak_memory=peak.peak, weight_bytes=tensor_bytes(model.parameters()),
                         calls_by_kind=counter.calls_by_kind, bytes_by_kind=counter.bytes_by_kind,
                         sent_bytes_by_kind=counter.sent_bytes_by_kind, bytes_by_group=counter.bytes_by_group)


# bytes_per_dimension's run unless told: 2 steps (the warm-up, then the counted one), a (2, world/2) mesh for DP×TP
COMM_RUN = TPRun(steps=2, dp=2)


def bytes_per_dimension(spec: TPRun | dict | None = None) -> dict:
    """The bytes one training step sends, counted, for DP (DDP, and FSDP2, over the world), TP (torch's, over
    the world) and DP×TP (``spec.dp`` × world/dp), in one process group: a worker for ``launch``. Each mode trains
    ``spec`` (its mode aside; ``COMM_RUN`` where None). Counts per mode."""
    spec = TPRun.of(spec if spec is not None else COMM_RUN)
    out = {}
    for name, mode in (("ddp", "ddp"), ("dp", "dp"), ("tp", "torch"), ("dp_tp", "dp_tp")):
        r = train(TPRun.of(spec, mode=mode))
        out[name] = {k: r[k] for k in ("bytes_by_kind", "sent_bytes_by_kind", "calls_by_kind", "bytes_by_group",
                                       "losses")}
    dist.barrier()
    return out


def comm_bytes(spec: TPRun | dict | None = None, nprocs: int = 4) -> dict:
    """``bytes_per_dimension(spec)`` on ``nprocs`` fresh ranks (``on_ranks``: GPUs where there are enough, else CPU
    ranks): {"ddp"|"dp"|"tp"|"dp_tp": counts} of rank 0."""
    return on_ranks(bytes_per_dimension, nprocs, default_device(), spec=spec)[0]


def compare(modes: list[str] = ("single", "hand", "torch", "dp_tp"), spec: TPRun | dict | None = None,
            layers: Layers | None = None) -> dict:
    """``train`` of ``spec`` in each of ``modes`` (``layers``: "hand"'s pair), one after the other, in this process
    group: one launch for a notebook's whole comparison (starting ranks costs more than a few tiny steps).
    {mode: train's result}."""
    out = {mode: train(TPRun.of(spec, mode=mode), layers) for mode in modes}
    dist.barrier()
    return out
