"""Notebook 00's hidden tests (instructor edition only): other shapes, autocast, and the meter on a Llama."""

from __future__ import annotations

import gc
import random
import weakref

import torch

from course_grader.checks import case_seed, number, outcome, register
from course_grader.checks.nb00 import ESTIMATES, METERS, counts, estimate, judge_counts, judge_estimate, real_step
from course_grader.grading import forbid
from course_lib import memory
from course_lib.data import random_tokens
from course_lib.loss import forward_loss
from course_lib.models import build_llama, empty_llama, llama_config
from course_lib.precision import autocast


def other_shape() -> dict:
    """A Llama's sizes, new to every grading (``case_seed``): fewer kv heads than heads, a head width, an MLP width, a
    depth and a vocabulary that no table of known counts holds."""
    rng = random.Random(case_seed("nb00", "param count shape"))
    heads = rng.choice((2, 4, 6, 8))
    return dict(hidden_size=heads * rng.choice((8, 12, 16)), num_attention_heads=heads,
                num_key_value_heads=rng.choice([k for k in range(1, heads) if heads % k == 0]),
                intermediate_size=rng.randint(64, 320), num_hidden_layers=rng.randint(1, 4),
                vocab_size=rng.randint(100, 600))


def shapes() -> dict:
    """Tied embeddings, kv heads = heads, other shapes, and the 1B, 8B and 70B presets (built on the meta device)."""
    out = {f"tiny {over}": llama_config("tiny", **over) for over in (
        dict(tie_word_embeddings=True), dict(num_key_value_heads=4), other_shape())}
    return {**out, **{p: llama_config(p) for p in ("1b", "llama3-8b", "70b")}}


register("test_llama_param_count_hidden", lambda ns: counts(ns, shapes()),
         lambda got: judge_counts(got, shapes(), build=empty_llama))

SIZES = (1, 1000, 8_030_261_248)


def sizes() -> tuple:
    """``SIZES`` and a parameter count new to every grading (``case_seed``)."""
    return (*SIZES, random.Random(case_seed("nb00", "model size")).randint(2, 10**11))


def probe_memory(ns: dict) -> dict:
    with forbid(*ESTIMATES, namespace=ns):
        fp8 = outcome(ns["training_memory"], 10, "fp8")
    return {"autocast": estimate(ns, real_step(torch.float32)[0], "autocast"),
            "many": {str(k): {"fp32": estimate(ns, k, "fp32"), "autocast": estimate(ns, k, "autocast")}
                     for k in sizes()},
            "fp8": {"raised": fp8.get("raised"), "message": fp8.get("message", "")}}


def judge_memory(got: dict) -> str:
    assert got["fp8"]["raised"] == "ValueError", "mode='fp8' is not supported: expected ValueError"
    assert "fp8" in got["fp8"]["message"], "the message should name the mode"
    judge_estimate(got["autocast"], "autocast", real_step(torch.float32, torch.bfloat16)[1])
    for k in sizes():
        f, a = got["many"][str(k)]["fp32"], got["many"][str(k)]["autocast"]
        assert (f.get("weights"), f.get("gradients"), f.get("optimizer states")) == (4 * k, 4 * k, 8 * k), \
            f"fp32, {k} parameters"
        assert a.get("optimizer states") == 8 * k, f"autocast, {k} parameters"
    return "autocast, other sizes and an unknown mode"


register("test_training_memory_hidden", probe_memory, judge_memory)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def meter_case() -> dict:
    """The meter's hidden sizes, new to every grading (``case_seed``): a square matrix's side, a big tensor's rows and
    how many of them a layer takes (a slice: fewer than all), the tiny Llama's batch and sequence length."""
    rng = random.Random(case_seed("nb00", "meter sizes"))
    return {"side": rng.randint(4, 16), "rows": rng.randint(200, 2000), "taken": rng.randint(1, 100),
            "batch": rng.randint(1, 3), "seq": rng.randint(8, 48)}


def tiny_llama_forward(dtype: torch.dtype):
    """The tiny Llama's forward and loss under ``dtype`` autocast (whose bf16 weight copies are activations), its
    weights and tokens from a seed new to every grading."""
    case, seed = meter_case(), case_seed("nb00", "meter llama")
    llama = build_llama("tiny", seed=seed)
    ids = random_tokens(case["batch"], case["seq"], llama.config.vocab_size, seed=seed)

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
    case = meter_case()
    a = torch.randn(case["side"], case["side"], requires_grad=True)
    big, lin = torch.randn(case["rows"], 16), torch.nn.Linear(16, 4)
    fn = ns["saved_activation_bytes"]
    with forbid(*METERS, namespace=ns):
        out = {"square": fn(torch.nn.Linear(1, 1), lambda: (a * a).sum()),
               "gram": fn(torch.nn.Linear(1, 1), lambda: (a.t() @ a).sum()),
               "slice": fn(lin, lambda: lin(big[:case["taken"]]).sum())}
        out.update({name: fn(*tiny_llama_forward(dt)) for name, dt in DTYPES.items()})
        leaks = outlives_the_meter(fn)
    return {**{k: number(v) for k, v in out.items()}, "leaks": bool(leaks)}


def judge_meter(got: dict) -> str:
    case = meter_case()
    square, big = case["side"] * case["side"] * 4, case["rows"] * 16 * 4
    assert got["square"] == square, f"a * a saves a twice: one storage, {square} bytes, not {got['square']}"
    assert got["gram"] == square, f"a.t() @ a saves a view of a and a: one storage, {square} bytes, not {got['gram']}"
    assert got["slice"] == big, f"a saved slice keeps its whole storage alive: {big} bytes, not {got['slice']}"
    for name, dt in DTYPES.items():
        ref = memory.activation_bytes(*tiny_llama_forward(dt))
        assert got[name] == ref, f"tiny Llama, {name}: expected {ref:,} bytes, got {got[name]:,}"
    assert not got["leaks"], ("an activation outlived your meter: pack returned the saved tensor itself, so a saved "
                              "output holds its own grad_fn, a cycle autograd never frees (each metered forward "
                              "leaks its activations: on a GPU, out of memory); return t.detach(), the same storage "
                              "without its history")
    return "saved twice, through a view, a slice's storage, the tiny Llama in fp32 and bf16, and nothing kept alive"


register("test_saved_activation_bytes_hidden", probe_meter, judge_meter)
