"""Helpers the graded test cells call: comparing gradients and models by behaviour."""

from __future__ import annotations

import copy

import torch
from torch import nn


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter's gradient, by name (zeros where a gradient is missing)."""
    return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference between two name → tensor dicts with the same keys."""
    assert a.keys() == b.keys(), f"different parameters: {sorted(set(a) ^ set(b))}"
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest difference relative to the largest magnitude in ``b``, over all tensors."""
    scale = max(float(v.float().abs().max()) for v in b.values()) or 1.0
    return max_abs_diff(a, b) / scale


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the parameters, by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def twin(model: nn.Module) -> nn.Module:
    """An independent deep copy, to run a reference computation beside the student's."""
    return copy.deepcopy(model)
