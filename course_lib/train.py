"""One training step, written once for the whole course.

``train_step`` takes a batch, splits it into ``accum_steps`` micro-batches, and for each:
forward under autocast, loss divided by ``accum_steps`` (so the summed gradient equals the
big batch's), backward through the GradScaler. Under DDP every micro-batch but the last
runs inside ``no_sync()`` so gradients are all-reduced once per step. Then: unscale,
clip, step (skipped by the scaler if fp16 overflowed), zero the gradients.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from course_lib.precision import autocast, resolve_dtype


def check_accumulation(batch_size: int, accum_steps: int) -> int:
    """The micro-batch size of ``batch_size`` split into ``accum_steps``; stops with the fix if it does not divide."""
    if accum_steps < 1:
        raise ValueError(f"accum_steps={accum_steps} must be at least 1")
    if batch_size % accum_steps:
        lower = batch_size // accum_steps * accum_steps or accum_steps
        raise ValueError(f"batch_size={batch_size} does not divide by accum_steps={accum_steps}: "
                         f"use a batch size that is a multiple of {accum_steps} (e.g. {lower}) or another accum_steps")
    return batch_size // accum_steps


def split_batch(x: torch.Tensor, y: torch.Tensor, accum_steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Cut a batch into ``accum_steps`` equal micro-batches."""
    check_accumulation(x.shape[0], accum_steps)
    return list(zip(x.chunk(accum_steps), y.chunk(accum_steps)))


def forward_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean loss of a batch: cross-entropy for a classifier, next-token loss for a causal LM."""
    out = model(x)
    logits = getattr(out, "logits", out)
    if logits.dim() == 3:  # causal LM: predict token t+1 from tokens ≤ t
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), y[:, 1:].flatten(), ignore_index=-100)
    return F.cross_entropy(logits.float(), y)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, *,
               accum_steps: int = 1, amp_dtype: str | torch.dtype = torch.float32,
               scaler: torch.amp.GradScaler | None = None, clip_norm: float | None = None,
               loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] = forward_loss) -> dict:
    """One optimizer step on the batch ``(x, y)``; returns the loss, gradient norm and whether it was skipped."""
    device = next(model.parameters()).device
    amp_dtype = resolve_dtype(amp_dtype)
    scaler = scaler or torch.amp.GradScaler(device.type, enabled=False)
    micro = split_batch(x.to(device), y.to(device), accum_steps)
    total = 0.0
    for i, (xm, ym) in enumerate(micro):
        last = i == len(micro) - 1
        sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            with autocast(device, amp_dtype):
                loss = loss_fn(model, xm, ym) / accum_steps
            scaler.scale(loss).backward()
        total += loss.item()
    scaler.unscale_(optimizer)  # gradients back in true units before clipping
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), clip_norm if clip_norm else float("inf"))
    scale_before = scaler.get_scale() if scaler.is_enabled() else 1.0
    scaler.step(optimizer)  # skipped when the unscaled gradients hold inf or nan
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    skipped = scaler.is_enabled() and scaler.get_scale() < scale_before
    return {"loss": total, "grad_norm": float(grad_norm), "skipped": bool(skipped)}


def fit(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
        steps: int, *, progress: bool = True, desc: str = "train", **step_kwargs) -> list[dict]:
    """Run ``steps`` calls of ``train_step`` over ``batches`` (cycled) and return their records."""
    from tqdm.auto import tqdm

    history, it = [], iter(batches)
    bar = tqdm(range(steps), desc=desc, disable=not progress, leave=False)
    for _ in bar:
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(batches)
            x, y = next(it)
        history.append(train_step(model, optimizer, x, y, **step_kwargs))
        bar.set_postfix(loss=f"{history[-1]['loss']:.3f}")
    return history


def batches_from(dataset, batch_size: int, seed: int = 0, drop_last: bool = True) -> torch.utils.data.DataLoader:
    """A shuffled DataLoader with a fixed seed, so runs compare like for like."""
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, generator=g, drop_last=drop_last)
