"""Notebook 01's hidden tests (instructor edition only): the scaler through train_step and with other factors, and
an overflowing AMP step."""

from __future__ import annotations

import math

import torch

from course_grader.checks import number, register
from course_grader.checks.nb01 import (STEPS, compare, gradscaler_trajectory, max_abs_diff, students_trajectory,
                                   tensor)
from course_grader.grading import forbid, params
from course_lib.data import synthetic_images
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
    assert isinstance(loss, (int, float)) and math.isfinite(loss), \
        "the returned loss is the unscaled loss, a finite float"
    assert max_abs_diff(got["params"], params(overflow_model())) == 0, \
        "at scale 2^40 the fp16 gradients overflow: scaler.step must skip the step"
    assert got["scale"] < 2.0**40, "after an overflow scaler.update() must lower the scale"
    assert all(g is None or not g.any() for g in got["grads"].values()), "clear the gradients after the step"
    return "an overflowing fp16 step skipped, the scale lowered, the gradients cleared"


register("test_amp_train_step_hidden", probe_amp, judge_amp)
