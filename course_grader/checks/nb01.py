"""Notebook 01's visible tests: the dynamic loss scaler against GradScaler, and the AMP step."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from course_grader.checks import number, register
from course_grader.grading import forbid, max_abs_diff, params
from course_lib import precision, train
from course_lib.data import synthetic_images
from course_lib.models import SmallCNN

# What each exercise builds, out of reach while the student's code runs.
SCALERS = (torch.amp.GradScaler, torch.cuda.amp.GradScaler, precision.make_scaler)
STEPS = (train.train_step, train.fit)  # the course's step holds the AMP step's answer


def tensor(x):
    """A tensor the student's code gave, as plain data (detached, on the CPU); anything else as its ``repr``."""
    return x.detach().cpu().as_subclass(torch.Tensor).clone() if isinstance(x, torch.Tensor) else repr(x)[:200]


# ---------------------------------------------------------------- DynamicLossScaler
def trajectory(scaler, injections: dict, steps: int = 12, through_train_step: bool = False, clip=None,
               seed: int = 0) -> list:
    """A small classifier (its weights from ``seed``, its inputs from ``seed + 1``) trained on ``scaler`` with the
    loss multiplied by ``injections[step]`` (inf, nan) at some steps: ``[(scale, [weights])]`` after every step, as
    plain data."""
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    m[0].bias.requires_grad_(False)  # a parameter without a gradient: unscale_ must skip it
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = torch.randn(8, 6, generator=torch.Generator().manual_seed(seed + 1)), torch.arange(8) % 3
    trace = []
    for i in range(steps):
        f = injections.get(i, 1.0)
        if through_train_step:  # the course's step: scale, backward, unscale_, clip, step, update
            train.train_step(m, opt, (x, y), scaler=scaler, clip_norm=clip,
                             loss_fn=lambda model, b: F.cross_entropy(model(b[0]), b[1]) * f)
        else:
            scaler.scale(F.cross_entropy(m(x), y) * f).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        trace.append([number(scaler.get_scale()), [p.detach().clone() for p in m.parameters()]])
    return trace


def students_trajectory(ns: dict, kw: dict, injections: dict, **how) -> list:
    """The student's ``DynamicLossScaler(**kw)`` on the trajectory, torch's and course_lib's scalers forbidden."""
    with forbid(*SCALERS, namespace=ns):
        return trajectory(ns["DynamicLossScaler"](**kw), injections, **how)


def compare(mine: list, ref: list, what: str) -> None:
    """Step by step, the student's scale and weights against GradScaler's."""
    assert len(mine) == len(ref), f"{what}: {len(mine)} steps, expected {len(ref)}"
    for i, ((s, w), (rs, rw)) in enumerate(zip(mine, ref)):
        assert s == rs, f"{what}, after step {i}: scale {s}, GradScaler's {rs}"
        assert len(w) == len(rw), f"{what}, after step {i}: {len(w)} weight tensors, the model has {len(rw)}"
        for a, b in zip(w, rw):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), \
                f"{what}, after step {i}: the weights differ from GradScaler's"


def gradscaler_trajectory(kw: dict, injections: dict, **how) -> list:
    return trajectory(torch.amp.GradScaler("cpu", **kw), injections, **how)


SEED002 = (dict(init_scale=2.0**10, growth_interval=3), {2: float("inf"), 5: float("nan")})  # overflows at 2 and 5


def probe_scaler(ns: dict) -> dict:
    kw, injections = SEED002
    mine = students_trajectory(ns, kw, injections)
    with forbid(*SCALERS, namespace=ns):
        default = ns["DynamicLossScaler"]()
        start = {"scale": number(default.get_scale()), "enabled": ns["DynamicLossScaler"]().is_enabled() is True}
    return {"trace": mine, "default": start}


def judge_scaler(got: dict) -> str:
    assert got["default"]["scale"] == 2.0**16 and got["default"]["enabled"] is True, \
        "DynamicLossScaler() starts at a scale of 2**16, and is_enabled() returns True"
    compare(got["trace"], gradscaler_trajectory(*SEED002), "seed 002's loop")
    return f"step by step, the same scale and weights as torch's GradScaler: {[s for s, _ in got['trace']]}"


register("test_DynamicLossScaler", probe_scaler, judge_scaler)


# ---------------------------------------------------------------- amp_train_step
AMP_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def probe_amp(ns: dict) -> dict:
    out = {}
    for name, dt in AMP_DTYPES.items():
        torch.manual_seed(2)
        m = SmallCNN(width=8)
        x, y = synthetic_images(16, seed=2).tensors
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        seen = []
        hook = m.head.register_forward_hook(lambda mod, inp, o: seen.append(str(o.dtype)))
        scaler = precision.make_scaler("cpu", dt)
        try:
            with forbid(*STEPS, namespace=ns):
                loss = ns["amp_train_step"](m, opt, scaler, x, y, dt)
        finally:
            hook.remove()
        out[name] = {"seen": seen, "loss": float(loss) if isinstance(loss, float) else repr(loss)[:200],
                     "params": params(m)}
    return out


def reference_amp_step(dt: torch.dtype) -> tuple[float, dict]:
    """The reference step of the visible test: its loss and the weights after it."""
    torch.manual_seed(2)
    r = SmallCNN(width=8)
    x, y = synthetic_images(16, seed=2).tensors
    ropt = torch.optim.SGD(r.parameters(), lr=0.1)
    rscaler = precision.make_scaler("cpu", dt)
    with torch.autocast("cpu", dtype=dt):
        rloss = F.cross_entropy(r(x), y)
    rscaler.scale(rloss).backward()
    rscaler.step(ropt)
    rscaler.update()
    return rloss.item(), params(r)


def judge_amp(got: dict) -> str:
    for name, dt in AMP_DTYPES.items():
        g = got[name]
        rloss, rparams = reference_amp_step(dt)
        assert g["seen"] and g["seen"][0] == str(dt), \
            f"the model's forward ran in {g['seen'][0] if g['seen'] else 'nothing'}, expected {dt}: use autocast"
        assert isinstance(g["loss"], float) and abs(g["loss"] - rloss) < 1e-3, "return the unscaled loss as a float"
        assert max_abs_diff(g["params"], rparams) < 1e-5, (f"{dt}: the weights after one step differ from the "
                                                           "reference (in fp16, did the backward go through "
                                                           "scaler.scale(loss)?)")
    return "bf16 and fp16 steps match the reference"


register("test_amp_train_step", probe_amp, judge_amp)
