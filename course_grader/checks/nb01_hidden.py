"""Notebook 01's hidden tests (instructor edition only): the scaler through train_step and with other factors, and
an overflowing AMP step."""

from __future__ import annotations

import math
import random

import torch

from course_grader.checks import case_seed, number, register
from course_grader.checks.nb01 import (STEPS, compare, gradscaler_trajectory, max_abs_diff, students_trajectory,
                                   tensor)
from course_grader.grading import forbid, params
from course_lib.data import synthetic_images
from course_lib.models import SmallCNN

# ---------------------------------------------------------------- DynamicLossScaler
INF, NAN = float("inf"), float("nan")


def scaler_cases() -> list:
    """The scaler's arguments, the steps whose loss is multiplied by inf or nan, and how the trajectory steps (its
    model's and inputs' seed too): new to every grading (``case_seed``). Whatever the draw, within the trajectory's
    12 steps, each case keeps its shape: (1) through train_step with clipping, an overflow after a clean run one step
    short of growth (the count of clean steps must restart), a nan before the next growth, growth after; (2) other
    growth and backoff factors from a scale that is no power of two, two overflows in a row right after a growth, a
    nan later; (3) growth after every clean step, through train_step, an overflow right after a growth, then a run."""
    rng = random.Random(case_seed("nb01", "scaler cases"))
    g1, g2, first, run = rng.randint(2, 4), rng.randint(2, 3), rng.randint(1, 2), rng.randint(2, 3)
    later = rng.randint(first + 2, 11 - run)  # a clean step (a growth) before the run, and one after it
    cases = [
        (dict(init_scale=2.0 ** rng.randint(6, 14), growth_interval=g1), {g1 - 1: INF, 2 * g1 - 1: NAN},
         dict(through_train_step=True, clip=rng.choice((0.25, 0.5, 1.0)))),
        (dict(init_scale=rng.choice((3.0, 5.0, 6.0)), growth_factor=rng.choice((3.0, 4.0)),
              backoff_factor=rng.choice((0.25, 0.125)), growth_interval=g2),
         {g2: INF, g2 + 1: INF, rng.randint(g2 + 3, 10): NAN}, {}),
        (dict(init_scale=2.0 ** rng.randint(4, 12), growth_interval=1),
         {first: INF, **{step: INF for step in range(later, later + run)}}, dict(through_train_step=True)),
    ]
    return [(kw, injections, {**how, "seed": case_seed("nb01", "scaler model", i)})
            for i, (kw, injections, how) in enumerate(cases)]


def probe_scaler(ns: dict) -> list:
    return [students_trajectory(ns, kw, injections, **how) for kw, injections, how in scaler_cases()]


def judge_scaler(got: list) -> str:
    for mine, (kw, injections, how) in zip(got, scaler_cases(), strict=True):
        compare(mine, gradscaler_trajectory(kw, injections, **how), f"{kw}, overflows at {injections}, {how}")
    return "through train_step, other growth and backoff factors, overflows right after growth and in a row"


register("test_DynamicLossScaler_hidden", probe_scaler, judge_scaler)


# ---------------------------------------------------------------- amp_train_step
def overflow_case() -> tuple[SmallCNN, torch.Tensor, torch.Tensor, float]:
    """A SmallCNN, 16 images and a start scale from 2^32 to 2^40, new to every grading (``case_seed``). At any of them
    the fp16 gradients overflow: the scaled loss's gradient for a row's logits is 2^32 x (1 - p) / 16 or more, p the
    true class's probability, which an untrained model puts near 1/10: far past fp16's largest value, 65504."""
    seed = case_seed("nb01", "amp overflow")
    torch.manual_seed(seed)
    model = SmallCNN(width=8)
    x, y = synthetic_images(16, seed=seed).tensors
    return model, x, y, 2.0 ** random.Random(seed).randint(32, 40)


def probe_amp(ns: dict) -> dict:
    m, x, y, init_scale = overflow_case()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    with forbid(*STEPS, namespace=ns):
        loss = ns["amp_train_step"](m, opt, scaler, x, y, torch.float16)
    return {"loss": number(loss), "params": params(m), "scale": number(scaler.get_scale()),
            "grads": {n: None if p.grad is None else tensor(p.grad) for n, p in m.named_parameters()}}


def judge_amp(got: dict) -> str:
    model, _, _, init_scale = overflow_case()
    loss = got["loss"]
    assert isinstance(loss, (int, float)) and math.isfinite(loss), \
        "the returned loss is the unscaled loss, a finite float"
    assert max_abs_diff(got["params"], params(model)) == 0, \
        f"at scale 2^{math.log2(init_scale):.0f} the fp16 gradients overflow: scaler.step must skip the step"
    assert got["scale"] < init_scale, "after an overflow scaler.update() must lower the scale"
    assert all(g is None or not g.any() for g in got["grads"].values()), "clear the gradients after the step"
    return "an overflowing fp16 step skipped, the scale lowered, the gradients cleared"


register("test_amp_train_step_hidden", probe_amp, judge_amp)
