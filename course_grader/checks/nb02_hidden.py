"""Notebook 02's hidden tests (instructor edition only): delayed scaling in e5m2 and e4m3 with jumps, a rolling
history, a margin and zeros."""

from __future__ import annotations

import math
import random

import torch

from course_grader.checks import case_seed, register
from course_grader.checks.nb01 import tensor
from course_grader.checks.nb02 import FP8_ANSWERS
from course_grader.grading import forbid
from course_lib import fp8

# ---------------------------------------------------------------- DelayedScalingFP8
FP8_DTYPES = {"e5m2": torch.float8_e5m2, "e4m3": torch.float8_e4m3fn}


def stream() -> list:
    """Eight 24x24 tensors whose amaxes jump past a history of 3 (x16 to x128, then x200 to x1000) and fall to zero
    once: values and jumps new to every grading (``case_seed``). The amaxes of two such normal draws (576 values each)
    are within x2 of each other, so whatever the draw each jump takes x * scale 8 times or more past both formats'
    largest value: saturation, or an inf or nan where the student's cast does not clamp."""
    seed = case_seed("nb02", "fp8 stream")
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    jumps = (rng.uniform(16.0, 128.0), rng.uniform(200.0, 1000.0))
    return [torch.randn(24, 24, generator=g) * m for m in (1.0, 1.0, jumps[0], 0.5, 0.0, 2.0, jumps[1], 0.25)]


def probe_fp8(ns: dict) -> dict:
    xs, out = stream(), {}
    for name, dt in FP8_DTYPES.items():
        cls = ns["DelayedScalingFP8"]
        with forbid(*FP8_ANSWERS, namespace=ns):
            a, b = cls(dt, history_len=3), cls(dt, history_len=3, margin=2)
            outs = [(a(x), b(x)) for x in xs]
            hist = [float(v) for v in a.amax_history]
            z = cls(dt, history_len=2)
            zeros = [z(torch.zeros(8, 8)) for _ in range(2)] + [z(xs[0])]
        out[name] = {"steps": [{"q": tensor(q.float()), "scale": float(s), "scale_margin": float(sm)}
                               for (q, s), (_, sm) in outs],
                     "history": hist,
                     "zeros": [{"q": tensor(q.float()), "scale": float(s)} for q, s in zeros]}
    return out


def judge_fp8(got: dict) -> str:
    xs = stream()
    for name, dt in FP8_DTYPES.items():
        g = got[name]
        for i, (step, x) in enumerate(zip(g["steps"], xs, strict=True)):
            q, s, sm = step["q"], step["scale"], step["scale_margin"]
            assert torch.isfinite(q).all(), \
                (f"{dt}, step {i}: inf or nan in the FP8 tensor: "
                 f"clamp x * scale to ±{torch.finfo(dt).max} before the cast")
            assert torch.equal(q, fp8.quantize(x, s, dt).float()), \
                f"{dt}, step {i}: the values differ from torch's cast of x * scale clamped to ±max"
            if i == 0:  # an empty history: the start scale, with a margin too (or, scaled by x, a quarter of it)
                assert sm == s or s == 4 * sm, f"{dt}, step 0: the scale {s}, with margin=2 {sm}"
            else:
                assert s == 4 * sm, f"{dt}, step {i}: margin=2 divides the scale by 2**2 ({s} vs {sm})"
        assert g["history"] == [x.abs().max().item() for x in xs[-3:]], \
            "amax_history holds the last history_len amaxes, oldest first"
        assert len(g["zeros"]) == 3, f"{dt}: {len(g['zeros'])} results for the 3 calls of the all-zero case"
        for zero in g["zeros"]:
            assert math.isfinite(zero["scale"]) and zero["scale"] > 0 and torch.isfinite(zero["q"]).all(), \
                f"{dt}: all-zero tensors gave the scale {zero['scale']}: keep the old scale when the history's max is 0"
    return "e5m2 and e4m3: saturation past the range, a rolling history, a margin, all-zero tensors"


register("test_DelayedScalingFP8_hidden", probe_fp8, judge_fp8)
