"""One training step, written once for the whole course.

``train_step`` takes a batch (a tensor, a tuple of tensors, or a dict of tensors: see
``course_lib.loss``), splits it into ``accum_steps`` micro-batches, and for each: forward under
autocast, loss divided by ``accum_steps`` (so the summed gradient equals the big batch's),
backward through the GradScaler. Gradients cross ranks once per step: DDP's ``no_sync()`` and
FSDP2's ``set_requires_gradient_sync(False)`` hold them back on every micro-batch but the last
(``grad_sync_context``), and a hand-written data parallelism passes ``sync_grads``, called once
after the last backward. Then: unscale, clip, step (skipped by the scaler if fp16 overflowed),
zero the gradients. Every loop of the course (the notebooks, DDP's manual mode, FSDP, the
fine-tune and its benchmark) calls it; DeepSpeed's engine runs its own backward and step, on
the same ``split_batch``.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, fields, replace
from typing import Callable, ContextManager, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from tqdm.auto import tqdm

from course_lib.data import batch_len, to_device
from course_lib.device import compute_device
from course_lib.loss import forward_loss, scored_tokens
from course_lib.precision import autocast, resolve_dtype
from course_lib.throughput import synchronize


class RunSpec:
    """A worker's run as plain values. Each worker's spec is a frozen dataclass built on this: one object a notebook
    builds, prints and passes on, JSON-able (``launch`` sends it to torchrun's ranks as JSON, where it arrives as a
    dict), and ``of`` turns whatever arrived back into the spec, refusing a field the spec does not have."""

    @classmethod
    def of(cls, spec: "RunSpec | dict | None" = None, **changes):
        """``spec`` as this class (itself, a dict of its fields, or None for the defaults) with ``changes`` applied."""
        if spec is None:
            spec = {}
        if isinstance(spec, dict):
            names = [f.name for f in fields(cls)]
            unknown = sorted(set(spec) - set(names))
            if unknown:
                raise ValueError(f"{cls.__name__} has no field {', '.join(unknown)}: its fields are {', '.join(names)}")
            spec = cls(**spec)
        if not isinstance(spec, cls):
            raise TypeError(f"spec is a {type(spec).__name__}: pass a {cls.__name__} or a dict of its fields")
        return replace(spec, **changes) if changes else spec


@dataclass(frozen=True)
class Dims:
    """How one run's global batch is cut and its ranks laid out, checked once, with the fix in the message.

    ``global_batch = micro_batch × accum_steps × dp`` (the DeepSpeed rule) and ``world = pp × dp × cp × tp``:
    tensor-, context- and pipeline-parallel ranks of one replica see the same rows (context-parallel ones each a part
    of every sequence); data-parallel ranks see their slice. ``mesh`` lays the ranks out in that order.
    """

    global_batch: int
    accum_steps: int = 1
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1

    def __post_init__(self):
        for name in ("global_batch", "accum_steps", "dp", "tp", "pp", "cp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        step = self.accum_steps * self.dp
        if self.global_batch % step == 0:
            return
        example = max(step, self.global_batch // step * step)
        if self.dp == 1:  # accumulation alone: name the two numbers a notebook's user chose
            raise ValueError(f"batch_size={self.global_batch} does not divide by accum_steps={self.accum_steps}: use a "
                             f"batch size that is a multiple of {step} (e.g. {example}) or another accum_steps")
        split = (f"the data-parallel size dp={self.dp}" if self.accum_steps == 1 else
                 f"accum_steps {self.accum_steps} x dp {self.dp} = {step} (each data-parallel rank takes accum_steps "
                 f"equal micro-batches)")
        raise ValueError(f"global_batch={self.global_batch} does not divide by {split}: use a multiple of {step} "
                         f"(e.g. {example}), or change the world size"
                         f"{'' if self.accum_steps == 1 else ' or accum_steps'}")

    @classmethod
    def rounded(cls, global_batch: int, dp: int, accum_steps: int = 1) -> "Dims":
        """The layout of the global batch nearest ``global_batch`` that ``dp`` ranks of ``accum_steps`` micro-batches
        divide: the largest multiple of ``dp * accum_steps`` not above it, and at least one. For a size chosen before
        the world is known (a tier's, on 3, 5, 6 or 7 GPUs)."""
        step = max(1, dp) * max(1, accum_steps)
        return cls(max(step, global_batch // step * step), accum_steps, dp)

    @classmethod
    def for_world(cls, global_batch: int, world: int, *, accum_steps: int = 1, tp: int = 1, pp: int = 1,
                  cp: int = 1) -> "Dims":
        """The layout of ``world`` ranks with the given ``tp``, ``pp`` and ``cp``: ``dp`` is what is left."""
        replica = tp * pp * cp
        if world < 1 or world % replica:
            raise ValueError(f"world={world} does not divide into tp={tp} x pp={pp} x cp={cp} = {replica} ranks per "
                             f"replica: use a world size that is a multiple of {replica}, or change tp, pp and cp")
        return cls(global_batch, accum_steps, world // replica, tp, pp, cp)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def mesh(self, device_type: str = "cpu", names: tuple[str, ...] | None = None) -> DeviceMesh:
        """The device mesh of this layout over the process group's ranks: one dimension per name of ``names``
        (default: every dimension above 1, in the order pp, dp, cp, tp, so tensor-parallel ranks are neighbours; "dp"
        alone where all are 1). torchtitan's habit: every ``apply_<p>(model, mesh[...], cfg)`` takes its part of one
        mesh. Stops with the fix if the group does not have ``world`` ranks."""
        sizes = {"pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp}
        names = names or tuple(n for n, size in sizes.items() if size > 1) or ("dp",)
        unknown = sorted(set(names) - set(sizes))
        if unknown:
            raise ValueError(f"mesh dimension {', '.join(unknown)} is not one of Dims': use pp, dp, cp or tp")
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world != self.world:
            raise ValueError(f"these dims lay out pp {self.pp} x dp {self.dp} x cp {self.cp} x tp {self.tp} = "
                             f"{self.world} ranks but the process group has {world}: launch {self.world} ranks, or "
                             f"change the dims (Dims.for_world fits dp to the world)")
        kept = [n for n in sizes if n in names]
        if any(sizes[n] > 1 for n in sizes if n not in kept):
            raise ValueError(f"the mesh {kept} leaves out a dimension above 1 of {sizes}: name it too")
        return init_device_mesh(device_type, tuple(sizes[n] for n in kept), mesh_dim_names=tuple(kept))

    @property
    def local_batch(self) -> int:
        """Rows of the global batch one data-parallel rank takes per step."""
        return self.global_batch // self.dp

    @property
    def micro_batch(self) -> int:
        """Rows of one forward and backward on one rank."""
        return self.local_batch // self.accum_steps

    def local(self, batch, dp_rank: int):
        """Data-parallel rank ``dp_rank``'s rows of a global ``batch`` (a tensor, a tuple or a dict of tensors)."""
        if not 0 <= dp_rank < self.dp:
            raise ValueError(f"dp_rank={dp_rank} is outside 0..{self.dp - 1}")
        rows = slice(dp_rank * self.local_batch, (dp_rank + 1) * self.local_batch)
        if torch.is_tensor(batch):
            return batch[rows]
        if isinstance(batch, dict):
            return {k: v[rows] for k, v in batch.items()}
        return tuple(t[rows] for t in batch)


def check_accumulation(batch_size: int, accum_steps: int) -> int:
    """The micro-batch size of ``batch_size`` split into ``accum_steps``; stops with the fix if it does not divide."""
    return Dims(batch_size, accum_steps).micro_batch


def split_batch(batch, accum_steps: int) -> list:
    """Cut a batch into ``accum_steps`` equal micro-batches of the same form (tensor, tuple or dict)."""
    check_accumulation(batch_len(batch), accum_steps)
    if torch.is_tensor(batch):
        return list(batch.chunk(accum_steps))
    if isinstance(batch, dict):
        return [dict(zip(batch, parts)) for parts in zip(*(v.chunk(accum_steps) for v in batch.values()))]
    return [tuple(parts) for parts in zip(*(t.chunk(accum_steps) for t in batch))]


def token_weights(micro_batches: list[dict]) -> list[float]:
    """Each micro-batch's share of the batch's scored tokens, to weight its mean loss by.

    With masked labels (prompts, padding) micro-batches score different numbers of tokens, and the
    mean of their means is not the batch's token mean. Weighting micro-batch i's mean loss by
    ``n_i / N`` gives ``sum of token losses / N``: the whole batch's loss, and its gradient. Where a
    process group exists, ``N`` is counted over every rank's batch and the weights are multiplied by
    the world size, so that DDP's or FSDP's average over ranks gives the global batch's token mean.
    """
    counts = torch.stack([scored_tokens(mb) for mb in micro_batches]).double()
    total, world = counts.sum(), 1
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        dist.all_reduce(total)
    if total == 0:
        raise ValueError("the batch scores no token (every label is -100): nothing to train on")
    return (counts * world / total).tolist()


def grad_sync_context(model: nn.Module, last: bool):
    """The context for one micro-batch's forward and backward: gradients cross ranks on the last one only.

    DDP all-reduces during every backward unless inside ``model.no_sync()``; FSDP2 (``fully_shard``)
    reduce-scatters unless ``set_requires_gradient_sync(False)`` was called. A model of neither kind
    (one process, or data parallelism by hand) gets a context that does nothing.
    """
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2: a switch, not a context
        model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()
    if last or not hasattr(model, "no_sync"):
        return contextlib.nullcontext()
    return model.no_sync()


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch, *,
               loss_fn: Callable[[nn.Module, object], torch.Tensor] = forward_loss, accum_steps: int = 1,
               amp_dtype: str | torch.dtype = torch.float32, scaler: torch.amp.GradScaler | None = None,
               clip_norm: float | None = None, sync_grads: Callable[[nn.Module], None] | None = None,
               backward: Callable[[torch.Tensor], None] | None = None, token_weighted: bool = False,
               clip_grad_norm: Callable = nn.utils.clip_grad_norm_) -> dict:
    """One optimizer step on ``batch``; returns its mean loss, the gradient norm and whether it was skipped.

    ``loss_fn(model, micro_batch)`` gives a micro-batch's mean loss (default: ``forward_loss``); each
    is weighted by ``1 / accum_steps``, or, with ``token_weighted`` (dict batches with labels), by
    its share of the scored tokens (``token_weights``), and a micro-batch that scores none is skipped
    (under a process group it runs with a zero loss, so that every rank runs the same collectives).
    ``sync_grads(model)`` runs once after the last backward, before unscaling and clipping: where a
    hand-written data parallelism averages the gradients over ranks. ``backward(loss)`` replaces
    ``loss.backward()`` (``accelerator.backward`` under accelerate). The gradient norm is computed
    (and the gradients clipped) only when ``clip_norm`` is given; otherwise it is None.
    ``clip_grad_norm(parameters, clip_norm)`` does the clipping (``accelerator.clip_grad_norm_`` under
    accelerate, which knows where DeepSpeed keeps the gradients).
    """
    device = compute_device(model)
    amp_dtype = resolve_dtype(amp_dtype)
    scaler = scaler or torch.amp.GradScaler(device.type, enabled=False)
    micro = split_batch(to_device(batch, device, non_blocking=True), accum_steps)
    weights = token_weights(micro) if token_weighted else [1.0 / accum_steps] * accum_steps
    # A micro-batch that scores no token adds nothing. Alone, skip it; under a process group run it anyway,
    # with a zero loss: every rank must run as many forwards and backwards as the others (DDP's all-reduce,
    # FSDP's gathers), or the ranks wait for each other forever.
    together = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    micro = [(mb, w) for mb, w in zip(micro, weights) if w > 0 or together]
    total = torch.zeros((), device=device)
    for i, (micro_batch, weight) in enumerate(micro):
        with grad_sync_context(model, last=i == len(micro) - 1):
            with autocast(device, amp_dtype):
                loss = loss_fn(model, micro_batch)
                # its mean over no token is nan (0/0); nan_to_num's gradient there is 0, so nothing flows back
                loss = torch.nan_to_num(loss, nan=0.0) * weight if weight == 0 else loss * weight
            scaled = scaler.scale(loss)
            backward(scaled) if backward is not None else scaled.backward()
        total += loss.detach().float()
    if sync_grads is not None:
        sync_grads(model)
    scaler.unscale_(optimizer)  # gradients back in true units before clipping
    grad_norm = clip_grad_norm(model.parameters(), clip_norm) if clip_norm else None
    if hasattr(grad_norm, "full_tensor"):  # FSDP2's sharded gradients give a DTensor norm
        grad_norm = grad_norm.full_tensor()
    scale_before = scaler.get_scale() if scaler.is_enabled() else 1.0
    scaler.step(optimizer)  # skipped when the unscaled gradients hold inf or nan
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    skipped = scaler.is_enabled() and scaler.get_scale() < scale_before
    return {"loss": float(total), "grad_norm": None if grad_norm is None else float(grad_norm),
            "skipped": bool(skipped)}


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of this process: (0, 1) where there is no process group."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def mean_over_ranks(value: float, device: torch.device | str | None = None) -> float:
    """The mean of ``value`` over all ranks (``value`` itself where there is no process group).

    With equal shards, the mean of the ranks' losses is the loss of the global batch. ``device``
    is where the number is reduced: NCCL reduces GPU tensors only.
    """
    if not dist.is_initialized():
        return float(value)
    t = torch.tensor(value, device=device)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def worker_result(losses, **extra) -> dict:
    """What a training worker returns: ``rank``, ``world_size``, ``losses`` (a list, one per step), and ``extra``."""
    rank, world = rank_and_world()
    return {"rank": rank, "world_size": world, "losses": [float(loss) for loss in losses], **extra}


def _batch_source(batches: Iterable | Callable[[int], object]) -> Callable[[int], object]:
    """``batches`` as a function of the step: called as is, or an iterable read in order and cycled."""
    if callable(batches) and not hasattr(batches, "__iter__"):
        return batches
    it = iter(batches)

    def next_batch(step: int):
        nonlocal it
        try:
            return next(it)
        except StopIteration:
            it = iter(batches)
            return next(it)
    return next_batch


def fit(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Iterable | Callable[[int], object], steps: int, *,
        start: int = 0, dims: Dims | None = None, step_context: Callable[[int], ContextManager] | None = None,
        after_step: Callable[[int, dict], bool] | None = None, step: Callable[[object], dict] | None = None,
        progress: bool = True, desc: str = "train", **step_kwargs) -> list[dict]:
    """The course's one training loop: ``train_step`` for steps ``start .. steps-1``; returns one record per step.

    ``batches``: this rank's batch of each step, as an iterable (cycled) or a function of the step (a resumed
    run asks for step ``start`` first). ``dims`` gives the accumulation (``step_kwargs`` pass the rest to
    ``train_step``). ``step_context(step)`` wraps a step (a byte counter on the last one); ``after_step(step,
    record)`` returning True stops the run (a checkpoint saved mid-run). ``step(batch)`` replaces ``train_step``
    where an engine owns backward and the optimizer step (DeepSpeed's); it returns a record with ``loss``.
    Each record is ``train_step``'s, with
    ``loss`` the mean over ranks (the global batch's, with equal shards), ``step``, and ``seconds`` (wall time,
    the device synchronised: a GPU runs ahead of the clock otherwise).
    """
    if dims is not None:
        if step_kwargs.get("accum_steps", dims.accum_steps) != dims.accum_steps:
            raise ValueError(f"fit got dims (accumulation {dims.accum_steps}) and "
                             f"accum_steps={step_kwargs['accum_steps']}: give the accumulation once, in dims")
        step_kwargs["accum_steps"] = dims.accum_steps
    device = compute_device(model)
    batch_for, history = _batch_source(batches), []
    bar = tqdm(range(start, steps), desc=desc, disable=not progress, leave=False)
    one_step = step or (lambda batch: train_step(model, optimizer, batch, **step_kwargs))
    for i in bar:
        batch = batch_for(i)
        synchronize(device)
        began = time.perf_counter()
        with step_context(i) if step_context else contextlib.nullcontext():
            record = one_step(batch)
        synchronize(device)
        record.update(step=i, seconds=time.perf_counter() - began, loss=mean_over_ranks(record["loss"], device))
        history.append(record)
        bar.set_postfix(loss=f"{record['loss']:.3f}")
        if after_step is not None and after_step(i, record):
            break
    return history


def tokens_per_second(history: list[dict], tokens_per_step: int, warmup: int = 0) -> float:
    """Throughput of a ``fit`` run over its steps after the first ``warmup`` (compilation, allocator warm-up)."""
    timed = [r["seconds"] for r in history[warmup:]] or [r["seconds"] for r in history]
    return tokens_per_step * len(timed) / sum(timed)


def batches_from(dataset, batch_size: int, seed: int = 0, drop_last: bool = True) -> torch.utils.data.DataLoader:
    """A shuffled DataLoader with a fixed seed, so runs compare like for like."""
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, generator=g, drop_last=drop_last)
