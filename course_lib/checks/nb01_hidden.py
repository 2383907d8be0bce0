"""Notebook 01's hidden tests (instructor edition only): the scaler through train_step and with other factors, an
overflowing AMP step, and delayed scaling in e5m2 and e4m3 with jumps, a rolling history, a margin and zeros."""

from __future__ import annotations

import math

import torch

from course_lib import fp8
from course_lib.checks import number, register
from course_lib.checks.nb01 import FP8_ANSWERS, STEPS, compare, gradscaler_trajectory, students_trajectory, tensor
from course_lib.data import synthetic_images
from course_lib.grading import forbid, max_abs_diff, params
from course_lib.models import SmallCNN

# ---------------------------------------------------------------- DynamicLossScaler
INF, NAN = float("inf"), float("nan")
CASES = [  # the scaler's arguments, the steps whose loss is multiplied by inf or nan, how the trajectory steps
    (dict(init_scale=2.0**10, growth_interval=3), {2: INF, 5: NAN}, dict(through_train_step=True, clip=0.5)),
    (dict(init_scale=3.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=2), {2: INF, 3: INF, 9: NAN}, {}),
    (dict(init_scale=2.0**8, growth_interval=1), {1: INF, 4: INF, 5: INF}, dict(through_train_step=True)),
]


def probe_scaler(ns: dict) -> list:
    return [students_trajectory(ns, kw, injections, **how) for kw, injections, how in CASES]


def judge_scaler(got: list) -> str:
    for mine, (kw, injections, how) in zip(got, CASES, strict=True):
        compare(mine, gradscaler_trajectory(kw, injections, **how), f"{kw}, {how}")
    return "through train_step, other growth and backoff factors, overflows right after growth and in a row"


register("test_DynamicLossScaler_hidden", probe_scaler, judge_scaler)


# ---------------------------------------------------------------- amp_train_step
def overflow_model() -> SmallCNN:
    torch.manual_seed(3)
    return SmallCNN(width=8)


def probe_amp(ns: dict) -> dict:
    m = overflow_model()
    x, y = synthetic_images(16, seed=3).tensors
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    with forbid(*STEPS, namespace=ns):
        loss = ns["amp_train_step"](m, opt, scaler, x, y, torch.float16)
    return {"loss": number(loss), "params": params(m), "scale": number(scaler.get_scale()),
            "grads": {n: None if p.grad is None else tensor(p.grad) for n, p in m.named_parameters()}}


def judge_amp(got: dict) -> str:
    loss = got["loss"]
    assert isinstance(loss, (int, float)) and math.isfinite(loss), "the returned loss is the unscaled loss, a finite float"
    assert max_abs_diff(got["params"], params(overflow_model())) == 0, \
        "at scale 2^40 the fp16 gradients overflow: scaler.step must skip the step"
    assert got["scale"] < 2.0**40, "after an overflow scaler.update() must lower the scale"
    assert all(g is None or not g.any() for g in got["grads"].values()), "clear the gradients after the step"
    return "an overflowing fp16 step skipped, the scale lowered, the gradients cleared"


register("test_amp_train_step_hidden", probe_amp, judge_amp)


# ---------------------------------------------------------------- DelayedScalingFP8
FP8_DTYPES = {"e5m2": torch.float8_e5m2, "e4m3": torch.float8_e4m3fn}


def stream() -> list:
    """Eight 24x24 tensors whose amaxes jump past a history of 3 (x64, x300) and fall to zero once."""
    g = torch.Generator().manual_seed(6)
    return [torch.randn(24, 24, generator=g) * m for m in (1.0, 1.0, 64.0, 0.5, 0.0, 2.0, 300.0, 0.25)]


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
                f"{dt}, step {i}: inf or nan in the FP8 tensor: clamp x * scale to ±{torch.finfo(dt).max} before the cast"
            assert torch.equal(q, fp8.quantize(x, s, dt).float()), \
                f"{dt}, step {i}: the values differ from torch's cast of x * scale clamped to ±max"
            assert i == 0 or s == 4 * sm, f"{dt}, step {i}: margin=2 divides the scale by 2**2 ({s} vs {sm})"
        assert g["history"] == [x.abs().max().item() for x in xs[-3:]], \
            "amax_history holds the last history_len amaxes, oldest first"
        for zero in g["zeros"]:
            assert math.isfinite(zero["scale"]) and zero["scale"] > 0 and torch.isfinite(zero["q"]).all(), \
                f"{dt}: all-zero tensors gave the scale {zero['scale']}: keep the old scale when the history's max is 0"
    return "e5m2 and e4m3: saturation past the range, a rolling history, a margin, all-zero tensors"


register("test_DelayedScalingFP8_hidden", probe_fp8, judge_fp8)
