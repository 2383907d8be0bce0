"""Activation checkpointing: keep fewer activations, recompute them during backward.

A checkpointed block saves only its input; backward runs its forward again to get the
rest. ``use_reentrant=False`` is the implementation to use: it supports keyword
arguments, and gives the block's parameters gradients even when the block's input does
not require grad (the old reentrant one silently does not; notebook 04 shows it).

Policies, from most memory to least:
- none: every activation kept;
- selective (``part="mlp"``): only the MLP of each block is recomputed; the MLP is where a
  Llama keeps most activations per token (4 × the wide intermediate size), so this saves
  much of the memory for a fraction of the recompute;
- every k-th block (``every=k``): whole blocks, every k-th one;
- full (``every=1``): whole blocks, all of them.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from course_lib.memory import PeakMemory, activation_bytes


class CheckpointedBlock(nn.Module):
    """Wraps a module so that its forward runs under ``torch.utils.checkpoint``."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        if not torch.is_grad_enabled():  # inference: nothing to save, nothing to recompute
            return self.block(*args, **kwargs)
        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)


def checkpoint_layers(layers: nn.ModuleList, every: int = 1, part: str | None = None) -> nn.ModuleList:
    """Checkpoint every ``every``-th layer of ``layers`` in place.

    ``part=None`` wraps whole layers; ``part="mlp"`` (or any submodule name) wraps only that
    submodule of each chosen layer: selective checkpointing.
    """
    if every < 1:
        raise ValueError(f"every={every} must be at least 1 (1 checkpoints every layer)")
    for i in range(0, len(layers), every):
        if part is None:
            if not isinstance(layers[i], CheckpointedBlock):
                layers[i] = CheckpointedBlock(layers[i])
            continue
        sub = getattr(layers[i], part, None)
        if sub is None:
            raise ValueError(f"part={part!r}: {type(layers[i]).__name__} has no such submodule "
                             f"(it has {[n for n, _ in layers[i].named_children()]})")
        if not isinstance(sub, CheckpointedBlock):
            setattr(layers[i], part, CheckpointedBlock(sub))
    return layers


def remove_checkpointing(layers: nn.ModuleList) -> nn.ModuleList:
    """Undo ``checkpoint_layers``, whole-layer or selective."""
    for i, layer in enumerate(layers):
        if isinstance(layer, CheckpointedBlock):
            layers[i] = layer = layer.block
        for name, child in list(layer.named_children()):
            if isinstance(child, CheckpointedBlock):
                setattr(layer, name, child.block)
    return layers


def transformer_layers(model: nn.Module) -> nn.ModuleList:
    """The list of transformer blocks of a Llama (``model.model.layers``)."""
    inner = getattr(model, "model", model)
    if not hasattr(inner, "layers"):
        raise ValueError(f"{type(model).__name__} has no .layers: pass the ModuleList of blocks yourself")
    return inner.layers


# The four policies notebook 04 compares, from most memory kept to least.
POLICIES: dict[str, dict | None] = {
    "none": None,
    "selective (MLP)": dict(every=1, part="mlp"),
    "every 2nd block": dict(every=2),
    "full": dict(every=1),
}


def apply_policy(layers: nn.ModuleList, policy: str) -> nn.ModuleList:
    """Remove any checkpointing from ``layers``, then apply the named policy of ``POLICIES``."""
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} is unknown; choose one of {list(POLICIES)}")
    remove_checkpointing(layers)
    if POLICIES[policy] is not None:
        checkpoint_layers(layers, **POLICIES[policy])
    return layers


def activation_memory(model: nn.Module, loss_fn: Callable[[], torch.Tensor], device: torch.device | str) -> int:
    """Activation memory of one training step of ``loss_fn()`` (a callable returning the loss).

    On a GPU: the allocator's peak during forward and backward, above what the weights and
    the (already allocated) gradients hold; it includes the recomputed block during backward.
    On a CPU, which has no such counter: the bytes autograd saves for backward
    (``memory.activation_bytes``), i.e. what stays alive between forward and backward.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return activation_bytes(model, loss_fn)
    loss_fn().backward()  # allocate the gradients first, so that they count as baseline
    model.zero_grad(set_to_none=False)
    with PeakMemory(device) as peak:
        loss_fn().backward()
    model.zero_grad(set_to_none=False)
    return int(peak.peak)
