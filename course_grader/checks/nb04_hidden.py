"""Notebook 04's hidden tests (instructor edition only): a frozen input, keyword arguments, a Llama's decoder
layers, dropout and bf16 autocast."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from course_grader.checks import case_seed, register, tensor_data
from course_grader.checks.nb04 import CHECKPOINTS, judge_block, probe_block
from course_grader.grading import forbid, grads, max_rel_diff
from course_lib.checkpointing import transformer_layers
from course_lib.loss import forward_loss
from course_lib.models import build_llama


# ---------------------------------------------------------------- checkpointed_inputs_hidden
class ScaledBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 24)
        self.out = nn.Linear(24, 8)

    def forward(self, h, *, scale=1.0):
        return self.out(torch.tanh(self.lin(h))) * scale


# Every case's weights and input come from a seed new to every grading (``case_seed``).
def frozen_input() -> tuple[nn.Module, torch.Tensor]:  # a frozen embedding's output: no input requires grad
    torch.manual_seed(case_seed("nb04", "frozen input"))
    return ScaledBlock(), torch.randn(5, 8)


def input_with_grad() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(case_seed("nb04", "keyword"))
    return ScaledBlock(), torch.randn(5, 8, requires_grad=True)


def llama() -> tuple[nn.Module, torch.Tensor]:
    seed = case_seed("nb04", "llama")
    lm = build_llama("tiny", num_hidden_layers=2, use_cache=False, seed=seed)
    return lm, torch.randint(0, lm.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))


class Checkpointed(nn.Module):
    """A decoder layer whose forward is the student's ``checkpointed``, looked up when it runs."""

    def __init__(self, block: nn.Module, ns: dict):
        super().__init__()
        self.block, self.ns = block, ns

    def forward(self, hidden_states, **kwargs):
        return self.ns["checkpointed"](self.block, hidden_states, **kwargs)


def probe_llama(ns: dict) -> dict:
    """The gradients of the tiny Llama (2 layers) with every decoder layer under the student's checkpoint."""
    lm, ids = llama()
    layers, named = transformer_layers(lm), list(lm.named_parameters())
    for i in range(len(layers)):
        layers[i] = Checkpointed(layers[i], ns)
    with forbid(*CHECKPOINTS, namespace=ns), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        forward_loss(lm, ids).backward()
    return {n: tensor_data(p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in named}


def probe_inputs(ns: dict) -> dict:
    return {"frozen": probe_block(ns, *frozen_input(), scale=0.5),
            "keyword": probe_block(ns, *input_with_grad(), scale=2.0),
            "llama": probe_llama(ns)}


def judge_inputs(got: dict) -> str:
    saved, gaps = judge_block(got["frozen"], *frozen_input(), scale=0.5)
    assert gaps["parameters"] < 1e-6 and gaps["output"] < 1e-6, f"frozen input, keyword argument: {gaps}"
    assert saved <= 5 * 8 * 4, f"frozen input: {saved} bytes kept"
    saved, gaps = judge_block(got["keyword"], *input_with_grad(), scale=2.0)
    assert gaps["parameters"] < 1e-6 and gaps["input"] < 1e-6 and gaps["output"] < 1e-6, f"keyword argument: {gaps}"
    lm, ids = llama()
    forward_loss(lm, ids).backward()
    assert max_rel_diff(got["llama"], grads(lm)) < 1e-5, "Llama decoder layers: the gradients differ"
    return "a frozen input, keyword arguments and a Llama's decoder layers: the block's gradients, only the inputs kept"


register("test_checkpointed_inputs_hidden", probe_inputs, judge_inputs)


# ---------------------------------------------------------------- checkpointed_rng_autocast_hidden
# Every case's weights and input, and the seed of dropout's random numbers, are new to every grading (``case_seed``).
def dropout_block() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(case_seed("nb04", "dropout block"))
    block = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 16)).train()
    return block, torch.randn(12, 16, requires_grad=True)


def amp_block() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(case_seed("nb04", "bf16 block"))
    block = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    return block, torch.randn(32, 64, requires_grad=True)


def probe_rng_autocast(ns: dict) -> dict:
    return {"dropout": probe_block(ns, *dropout_block(), seed=case_seed("nb04", "dropout rng"), disturb_rng=True),
            "bf16": probe_block(ns, *amp_block(), amp_dtype=torch.bfloat16)}


def judge_rng_autocast(got: dict) -> str:
    saved, gaps = judge_block(got["dropout"], *dropout_block(), seed=case_seed("nb04", "dropout rng"))
    assert gaps["parameters"] < 1e-6 and gaps["input"] < 1e-6 and gaps["output"] < 1e-6, \
        f"dropout: the recomputation used other random numbers: {gaps}"
    assert saved <= 12 * 16 * 4, f"dropout block: {saved} bytes kept"
    saved, gaps = judge_block(got["bf16"], *amp_block(), amp_dtype=torch.bfloat16)
    assert gaps["output"] < 1e-6, f"bf16 autocast: the output differs from the block's under autocast: {gaps}"
    assert gaps["parameters"] < 1e-6 and gaps["input"] < 1e-6, \
        f"bf16 autocast: the recomputation ran in another dtype: {gaps}"
    return "dropout draws the forward's random numbers again, and the recomputation runs under the forward's autocast"


register("test_checkpointed_rng_autocast_hidden", probe_rng_autocast, judge_rng_autocast)
