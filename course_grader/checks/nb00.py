"""Notebook 00's visible tests: the parameter count, the model-state bytes and the saved-activation meter."""

from __future__ import annotations

import torch
import transformers

from course_grader.checks import number, register
from course_grader.grading import forbid
from course_lib import memory, models
from course_lib.data import random_tokens
from course_lib.memory import measure_training_step
from course_lib.models import build_llama, count_parameters, llama_config

# What each exercise builds, out of reach while the student's code runs.
COUNTERS = (models.llama_num_parameters, models.count_parameters, models.build_llama, models.empty_llama,
            transformers.LlamaForCausalLM, transformers.LlamaModel)
ESTIMATES = (memory.estimate_model_state, memory.training_bytes_per_param, memory.model_state_bytes)
METERS = (memory.SavedTensorMeter, memory.activation_bytes, memory.saved_bytes_by_dtype, memory.saved_bytes_by_part,
          memory.measure_training_step)
PARTS = ("weights", "gradients", "optimizer states")


# ---------------------------------------------------------------- llama_param_count
def counts(ns: dict, configs: dict) -> dict:
    """The student's ``llama_param_count`` of each config, the counters forbidden."""
    with forbid(*COUNTERS, namespace=ns):
        return {key: number(ns["llama_param_count"](cfg)) for key, cfg in configs.items()}


def judge_counts(got: dict, configs: dict, build=build_llama) -> str:
    for key, cfg in configs.items():
        built = count_parameters(build(cfg))
        assert isinstance(got[key], (int, float)) and int(got[key]) == got[key], \
            f"{key}: return a whole number, not {got[key]!r}"
        assert got[key] == built, (f"{key} (d={cfg.hidden_size}, layers={cfg.num_hidden_layers}, "
                                   f"tied={cfg.tie_word_embeddings}): you count {got[key]:,}, "
                                   f"the built model has {built:,}")
    return "parameter counts match the built models"


def presets() -> dict:  # the tiny and small presets: grouped-query attention, separate lm_head
    return {p: llama_config(p) for p in ("tiny", "small")}


register("test_llama_param_count", lambda ns: counts(ns, presets()), lambda got: judge_counts(got, presets()))


# ---------------------------------------------------------------- training_memory
def real_step(dtype: torch.dtype, amp_dtype: torch.dtype = torch.float32) -> tuple[int, dict]:
    """The tiny Llama's parameter count and the model-state bytes of one real AdamW step."""
    model = build_llama("tiny", dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return count_parameters(model), measure_training_step(model, opt, random_tokens(2, 16, model.config.vocab_size),
                                                          amp_dtype=amp_dtype)


def estimate(ns: dict, n: int, mode: str) -> dict:
    """The student's ``training_memory(n, mode)``, the estimators forbidden, as data."""
    with forbid(*ESTIMATES, namespace=ns):
        got = ns["training_memory"](n, mode)
    return {part: number(got[part]) for part in PARTS} if isinstance(got, dict) and set(PARTS) <= set(got) \
        else {"not a dict of the three parts": repr(got)[:200]}


def judge_estimate(got: dict, mode: str, measured: dict) -> None:
    for part in PARTS:
        assert part in got, f"{mode}: return a dict with {PARTS}, not {got}"
        assert got[part] == measured[part], f"{mode}, {part}: you say {got[part]:,} bytes, measured {measured[part]:,}"


MODES = {"fp32": torch.float32, "pure_bf16": torch.bfloat16}  # the weights' dtype of each mode


def probe_memory(ns: dict) -> dict:
    return {mode: estimate(ns, real_step(dtype)[0], mode) for mode, dtype in MODES.items()}


def judge_memory(got: dict) -> str:
    for mode, dtype in MODES.items():
        judge_estimate(got[mode], mode, real_step(dtype)[1])
    return "fp32 and pure bf16 match the measured model state"


register("test_training_memory", probe_memory, judge_memory)


# ---------------------------------------------------------------- saved_activation_bytes
def probe_meter(ns: dict) -> int:
    # x (16x64) is saved by the first layer; the ReLU saves its output r (16x32) and the second layer saves r
    # again as its input (one storage, counted once) and W2.t() (a view of a parameter: not counted)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    x = torch.randn(16, 64)
    with forbid(*METERS, namespace=ns):
        return number(ns["saved_activation_bytes"](net, lambda: net(x).sum()))


def judge_meter(got) -> str:
    want = (16 * 64 + 16 * 32) * 4
    assert isinstance(got, int), f"return an int, not {got!r}"
    assert got != want + 16 * 32 * 4, "the ReLU's output was counted twice: count each storage once"
    assert got != want + 8 * 32 * 4, "W2.t() is a view of a parameter's storage: leave the weights out"
    assert got == want, f"expected {want} bytes (x and the ReLU output, once each), got {got}"
    return "the saved storages of a small network, each counted once, weights left out"


register("test_saved_activation_bytes", probe_meter, judge_meter)
