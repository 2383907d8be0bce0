"""Notebook 13's visible tests: the chunked cross-entropy against torch's on the whole logits (the loss, the gradients
of the hidden states and of the LM head's weight), and the largest tensor any of its ops creates, forward and
backward."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from course_grader.checks import number, register, tensor_data
from course_grader.grading import forbid
from course_lib import loss
from course_lib.memory import LargestTensor

# What the exercise builds, out of reach while the student's code runs.
CHUNKED = (loss.chunked_lm_loss, loss.lm_loss, loss._ChunkedLinearCrossEntropy)
SHAPE = dict(tokens=64, d=8, vocab=96, chunk=8)  # the logits, 64 x 96, are 8 times the largest chunk


def case(tokens: int, d: int, vocab: int, seed: int, scale: float = 1.0, ignored: str = "every fifth",
         dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states (tokens, d), an LM head's weight (vocab, d) and targets (tokens,), -100 where ``ignored``."""
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(tokens, d, generator=g) * scale).to(dtype)
    weight = torch.randn(vocab, d, generator=g).to(dtype)
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    if ignored == "every fifth":
        targets[::5] = -100
    elif ignored == "all":
        targets[:] = -100
    return hidden, weight, targets


def probe_loss(ns: dict, hidden, weight, targets, chunk: int, grad_scale: float = 1.0, watch: bool = False) -> dict:
    """The student's ``chunked_cross_entropy`` on copies of the inputs, the library's chunked losses forbidden: the
    loss and the gradients of ``grad_scale`` times it; with ``watch``, the largest tensor its ops created instead."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with forbid(*CHUNKED, namespace=ns), LargestTensor() as largest:
        out = ns["chunked_cross_entropy"](h, w, targets.clone(), chunk)
        (out * grad_scale).backward()
    if watch:
        return {"largest": number(largest.numel), "largest shape": list(largest.shape)}
    return {"loss": tensor_data(out.detach()), "hidden grad": tensor_data(h.grad), "weight grad": tensor_data(w.grad)}


def reference(hidden, weight, targets, grad_scale: float = 1.0) -> dict:
    """torch's cross-entropy of the whole fp32 logits: the loss and the gradients (zeros where no target counts)."""
    h, w = (t.detach().float().clone().requires_grad_() for t in (hidden, weight))
    valid = targets != -100
    logits = h @ w.t()
    out = F.cross_entropy(logits, targets, ignore_index=-100) if valid.any() else (logits * 0).sum()
    (out * grad_scale).backward()
    return {"loss": out.detach(), "hidden grad": h.grad, "weight grad": w.grad}


def judge_values(got: dict, hidden, weight, targets, label: str, grad_scale: float = 1.0, tol: float = 1e-5) -> None:
    want = reference(hidden, weight, targets, grad_scale)
    assert isinstance(got["loss"], torch.Tensor) and got["loss"].numel() == 1, \
        f"{label}: return the loss as a 0-d tensor, not {got['loss']!r}"
    assert torch.isfinite(got["loss"]).all(), f"{label}: the loss is {float(got['loss'])}, not finite"
    assert abs(float(got["loss"]) - float(want["loss"])) <= tol * max(1.0, abs(float(want["loss"]))), \
        f"{label}: the loss is {float(got['loss']):.6f}, torch's cross-entropy {float(want['loss']):.6f}"
    for name, like in (("hidden grad", hidden), ("weight grad", weight)):
        g = got[name]
        assert isinstance(g, torch.Tensor), f"{label}: no gradient reached the {name.split()[0]} states"
        assert g.shape == like.shape, f"{label}: the {name} has shape {tuple(g.shape)}, not {tuple(like.shape)}"
        assert g.dtype == like.dtype, f"{label}: the {name} is {g.dtype}; return it in its input's dtype, {like.dtype}"
        gap = float((g.float() - want[name]).abs().max())
        scale = max(float(want[name].abs().max()), 1e-6)
        assert gap <= tol * 10 * scale or gap < 1e-7, \
            f"{label}: the {name} differs from torch's by {gap:.2e} (largest entry {scale:.2e})"


def judge_largest(got: dict, tokens: int, d: int, vocab: int, chunk: int, label: str) -> None:
    allowed = max(min(chunk, tokens) * vocab, tokens * d, vocab * d)
    size, shape = got["largest"], got["largest shape"]
    assert isinstance(size, int) and size > 0 and size == math.prod(shape), \
        f"{label}: the watched ops reported no tensor, or a size that is not their shape's: {got}"
    assert got["largest"] <= allowed, (
        f"{label}: one op made a tensor of shape {tuple(got['largest shape'])}, {got['largest']} values; the logits "
        f"of {min(chunk, tokens)} tokens are {min(chunk, tokens) * vocab}: compute them chunk by chunk, in forward and "
        f"in backward, and keep none of the whole ({tokens} x {vocab})")


VISIBLE = case(SHAPE["tokens"], SHAPE["d"], SHAPE["vocab"], seed=0)


def judge_visible(got: dict) -> str:
    judge_values(got, *VISIBLE, label=f"{SHAPE['tokens']} tokens, chunks of {SHAPE['chunk']}")
    return "the loss and both gradients equal torch's cross-entropy on the whole logits"


def judge_memory(got: dict) -> str:
    judge_largest(got, SHAPE["tokens"], SHAPE["d"], SHAPE["vocab"], SHAPE["chunk"],
                  f"{SHAPE['tokens']} tokens, chunks of {SHAPE['chunk']}")
    return f"no op made more than {SHAPE['chunk']} rows of logits, forward or backward"


register("test_chunked_cross_entropy", lambda ns: probe_loss(ns, *VISIBLE, SHAPE["chunk"]), judge_visible)
register("test_chunked_cross_entropy_memory", lambda ns: probe_loss(ns, *VISIBLE, SHAPE["chunk"], watch=True),
         judge_memory)
