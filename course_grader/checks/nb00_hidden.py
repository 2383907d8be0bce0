"""Notebook 00's hidden tests (instructor edition only): other shapes, autocast, and the meter on a Llama."""

from __future__ import annotations

import gc
import weakref

import torch

from course_grader.checks import number, outcome, register
from course_grader.checks.nb00 import ESTIMATES, METERS, counts, estimate, judge_counts, judge_estimate, real_step
from course_grader.grading import forbid
from course_lib import memory
from course_lib.data import random_tokens
from course_lib.loss import forward_loss
from course_lib.models import build_llama, empty_llama, llama_config
from course_lib.precision import autocast


def shapes() -> dict:
    """Tied embeddings, kv heads = heads, other shapes, and the 1B, 8B and 70B presets (built on the meta device)."""
    out = {f"tiny {over}": llama_config("tiny", **over) for over in (
        dict(tie_word_embeddings=True), dict(num_key_value_heads=4),
        dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=1, intermediate_size=200, num_hidden_layers=3,
             vocab_size=300))}
    return {**out, **{p: llama_config(p) for p in ("1b", "llama3-8b", "70b")}}


register("test_llama_param_count_hidden", lambda ns: counts(ns, shapes()),
         lambda got: judge_counts(got, shapes(), build=empty_llama))

SIZES = (1, 1000, 8_030_261_248)


def probe_memory(ns: dict) -> dict:
    with forbid(*ESTIMATES, namespace=ns):
        fp8 = outcome(ns["training_memory"], 10, "fp8")
    return {"autocast": estimate(ns, real_step(torch.float32)[0], "autocast"),
            "many": {str(k): {"fp32": estimate(ns, k, "fp32"), "autocast": estimate(ns, k, "autocast")} for k in SIZES},
            "fp8": {"raised": fp8.get("raised"), "message": fp8.get("message", "")}}


def judge_memory(got: dict) -> str:
    assert got["fp8"]["raised"] == "ValueError", "mode='fp8' is not supported: expected ValueError"
    assert "fp8" in got["fp8"]["message"], "the message should name the mode"
    judge_estimate(got["autocast"], "autocast", real_step(torch.float32, torch.bfloat16)[1])
    for k in SIZES:
        f, a = got["many"][str(k)]["fp32"], got["many"][str(k)]["autocast"]
        assert (f.get("weights"), f.get("gradients"), f.get("optimizer states")) == (4 * k, 4 * k, 8 * k), \
            f"fp32, {k} parameters"
        assert a.get("optimizer states") == 8 * k, f"autocast, {k} parameters"
    return "autocast, other sizes and an unknown mode"


register("test_training_memory_hidden", probe_memory, judge_memory)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def tiny_llama_forward(dtype: torch.dtype):
    """The tiny Llama's forward and loss under ``dtype`` autocast (whose bf16 weight copies are activations)."""
    llama = build_llama("tiny", seed=1)
    ids = random_tokens(2, 32, llama.config.vocab_size, seed=1)

    def run():
        with autocast("cpu", dtype):
            return forward_loss(llama, ids)
    return llama, run


def outlives_the_meter(fn) -> bool:
    """Whether an activation is still alive once ``fn`` (the student's meter) has returned and dropped the forward:
    softmax saves its own output, and a pack hook that hands autograd that tensor itself ties it to its grad_fn, a
    cycle inside autograd that no collector frees."""
    lin, x, seen = torch.nn.Linear(4, 4), torch.randn(3, 4), []

    def forward():
        y = torch.softmax(lin(x), dim=-1)
        seen.append(weakref.ref(y))
        return y.sum()

    fn(lin, forward)
    gc.collect()
    return seen[0]() is not None


def probe_meter(ns: dict) -> dict:
    a = torch.randn(8, 8, requires_grad=True)
    big, lin = torch.randn(1000, 16), torch.nn.Linear(16, 4)
    fn = ns["saved_activation_bytes"]
    with forbid(*METERS, namespace=ns):
        out = {"square": fn(torch.nn.Linear(1, 1), lambda: (a * a).sum()),
               "gram": fn(torch.nn.Linear(1, 1), lambda: (a.t() @ a).sum()),
               "slice": fn(lin, lambda: lin(big[:10]).sum())}
        out.update({name: fn(*tiny_llama_forward(dt)) for name, dt in DTYPES.items()})
        leaks = outlives_the_meter(fn)
    return {**{k: number(v) for k, v in out.items()}, "leaks": bool(leaks)}


def judge_meter(got: dict) -> str:
    assert got["square"] == 8 * 8 * 4, f"a * a saves a twice: one storage, {8 * 8 * 4} bytes, not {got['square']}"
    assert got["gram"] == 8 * 8 * 4, \
        f"a.t() @ a saves a view of a and a: one storage, {8 * 8 * 4} bytes, not {got['gram']}"
    assert got["slice"] == 1000 * 16 * 4, \
        f"a saved slice keeps its whole storage alive: {1000 * 16 * 4} bytes, not {got['slice']}"
    for name, dt in DTYPES.items():
        ref = memory.activation_bytes(*tiny_llama_forward(dt))
        assert got[name] == ref, f"tiny Llama, {name}: expected {ref:,} bytes, got {got[name]:,}"
    assert not got["leaks"], ("an activation outlived your meter: pack returned the saved tensor itself, so a saved "
                              "output holds its own grad_fn, a cycle autograd never frees (each metered forward "
                              "leaks its activations: on a GPU, out of memory); return t.detach(), the same storage "
                              "without its history")
    return "saved twice, through a view, a slice's storage, the tiny Llama in fp32 and bf16, and nothing kept alive"


register("test_saved_activation_bytes_hidden", probe_meter, judge_meter)
