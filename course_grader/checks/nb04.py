"""Notebook 04's visible test: the hand-written checkpoint of an MLP block, against the block itself."""

from __future__ import annotations

import warnings

import torch
import torch.utils.checkpoint
from torch import nn

from course_grader.checks import number, register, tensor_data
from course_grader.grading import forbid, grads, max_rel_diff
from course_lib import checkpointing
from course_lib.memory import activation_bytes
from course_lib.precision import autocast

# What the exercise builds, out of reach while the student's code runs.
CHECKPOINTS = (torch.utils.checkpoint.checkpoint, torch.utils.checkpoint.checkpoint_sequential,
               checkpointing.CheckpointedBlock, checkpointing.checkpoint_layers, checkpointing.apply_policy)


# ---------------------------------------------------------------- one block, checkpointed and plain
def probe_block(ns: dict, block: nn.Module, x: torch.Tensor, *, scale=None, seed: int = 0, disturb_rng: bool = False,
                amp_dtype: torch.dtype = torch.float32) -> dict:
    """The student's ``checkpointed(block, x)``, the checkpoints forbidden: the bytes autograd keeps, the output and
    the gradients of one backward (of the output's squares, under the RNG seed ``seed`` and ``amp_dtype`` autocast)."""
    kw = {} if scale is None else {"scale": scale}
    mx = x.detach().clone().requires_grad_(x.requires_grad)
    with forbid(*CHECKPOINTS, namespace=ns), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a warning is output on stderr, which nbgrader scores as a failure
        saved = activation_bytes(block, lambda: ns["checkpointed"](block, mx.detach(), **kw))
        torch.manual_seed(seed)
        with autocast("cpu", amp_dtype):
            out = ns["checkpointed"](block, mx, **kw)
        if disturb_rng:
            torch.rand(1000)  # other work between forward and backward moves the RNG on
        out.float().square().sum().backward()
    return {"saved": number(saved),
            "missing": [n for n, p in block.named_parameters() if p.requires_grad and p.grad is None],
            "output": tensor_data(out), "grads": {n: tensor_data(g) for n, g in grads(block).items()},
            "input": tensor_data(mx.grad) if x.requires_grad else None}


def judge_block(got: dict, block: nn.Module, x: torch.Tensor, *, scale=None, seed: int = 0,
                amp_dtype: torch.dtype = torch.float32) -> tuple[int, dict]:
    """The plain block's output and gradients from the same weights, input and seed, against the student's:
    ``(bytes kept, {"output", "parameters", "input": largest gaps})``."""
    kw = {} if scale is None else {"scale": scale}
    rx = x.detach().clone().requires_grad_(x.requires_grad)
    torch.manual_seed(seed)
    with autocast("cpu", amp_dtype):
        ref_out = block(rx, **kw)
    ref_out.float().square().sum().backward()
    assert not got["missing"], f"no gradient for {got['missing']}: every parameter of the block must get its gradient"
    assert isinstance(got["output"], torch.Tensor), f"return the block's output, a tensor, not {got['output']}"
    assert got["output"].shape == ref_out.shape, \
        f"the output has shape {tuple(got['output'].shape)}, the block's {tuple(ref_out.shape)}"
    assert torch.isfinite(got["output"]).all(), "the output holds NaN or inf, where the block's is finite"
    if x.requires_grad:
        assert isinstance(got["input"], torch.Tensor), "the input requires grad and got no gradient"
        assert got["input"].shape == rx.shape, \
            f"the input's gradient has shape {tuple(got['input'].shape)}, the input {tuple(rx.shape)}"
    gaps = {"output": float((got["output"].float() - ref_out.detach().float()).abs().max()),
            "parameters": max_rel_diff(got["grads"], grads(block)),
            "input": float((got["input"] - rx.grad).abs().max()) if x.requires_grad else 0.0}
    return got["saved"], gaps


# ---------------------------------------------------------------- checkpointed
def mlp_block() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
    return block, torch.randn(16, 32, requires_grad=True)


def judge_checkpointed(got: dict) -> str:
    saved, gaps = judge_block(got, *mlp_block())
    assert gaps["output"] < 1e-6, "the output differs from the block's"
    assert gaps["parameters"] < 1e-6 and gaps["input"] < 1e-6, f"the gradients differ from the block's: {gaps}"
    assert saved <= 16 * 32 * 4, (f"autograd kept {saved} bytes for the block; the input alone is {16 * 32 * 4}: "
                                  "keep only the inputs, recompute the rest in backward")
    block = mlp_block()[0]
    plain = activation_bytes(block, lambda: block(torch.randn(16, 32, requires_grad=True)))
    return f"same output and gradients; {saved} bytes kept instead of the plain block's {plain}"


register("test_checkpointed", lambda ns: probe_block(ns, *mlp_block()), judge_checkpointed)
