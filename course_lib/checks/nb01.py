"""Notebook 01's visible tests: the dynamic loss scaler against GradScaler, the AMP step, delayed-scaling FP8."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from course_lib import fp8, precision, train
from course_lib.checks import number, register
from course_lib.data import synthetic_images
from course_lib.grading import forbid, max_abs_diff, params
from course_lib.models import SmallCNN

# What each exercise builds, out of reach while the student's code runs.
SCALERS = (torch.amp.GradScaler, torch.cuda.amp.GradScaler, precision.make_scaler)
STEPS = (train.train_step, train.fit)  # the course's step holds the AMP step's answer
FP8_ANSWERS = (fp8.DelayedScaler, fp8.quantize, fp8.dequantize, fp8.scale_for, fp8.current_scaler)


def tensor(x):
    """A tensor the student's code gave, as plain data (detached, on the CPU); anything else as its ``repr``."""
    return x.detach().cpu().as_subclass(torch.Tensor).clone() if isinstance(x, torch.Tensor) else repr(x)[:200]


# ---------------------------------------------------------------- DynamicLossScaler
def trajectory(scaler, injections: dict, steps: int = 12, through_train_step: bool = False, clip=None) -> list:
    """A small classifier trained on ``scaler`` with the loss multiplied by ``injections[step]`` (inf, nan) at some
    steps: ``[(scale, [weights])]`` after every step, as plain data."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    m[0].bias.requires_grad_(False)  # a parameter without a gradient: unscale_ must skip it
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = torch.randn(8, 6, generator=torch.Generator().manual_seed(1)), torch.arange(8) % 3
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
        for a, b in zip(w, rw):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), f"{what}, after step {i}: the weights differ from GradScaler's"


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
        assert max_abs_diff(g["params"], rparams) < 1e-5, (f"{dt}: the weights after one step differ from the reference "
                                                           "(in fp16, did the backward go through scaler.scale(loss)?)")
    return "bf16 and fp16 steps match the reference"


register("test_amp_train_step", probe_amp, judge_amp)


# ---------------------------------------------------------------- DelayedScalingFP8
def visible_stream() -> list:
    """Four 16x16 tensors whose amaxes are exactly 4, 2, 1 and 0.5."""
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(16, 16, generator=g) for _ in range(4)]
    return [x / x.abs().max() * m for x, m in zip(xs, (4.0, 2.0, 1.0, 0.5))]


def quantized(q) -> dict:
    """An FP8 tensor the student's quantiser gave, as data: its dtype and its values in float32."""
    return {"dtype": str(q.dtype), "values": tensor(q.float())}


def probe_fp8(ns: dict) -> dict:
    xs = visible_stream()
    with forbid(*FP8_ANSWERS, namespace=ns):
        q8 = ns["DelayedScalingFP8"](torch.float8_e4m3fn, history_len=2)
        start = {"scale": float(q8.scale), "history": list(q8.amax_history) == []}
        out = [q8(x) for x in xs]
        hist, nxt = [float(a) for a in q8.amax_history], float(q8.scale)
        deq = q8.dequantize(out[1][0], out[1][1])
    return {"start": start, "steps": [{"q": quantized(q), "scale": float(s)} for q, s in out],
            "history": hist, "next": nxt, "dequantized": tensor(deq)}


def judge_fp8(got: dict) -> str:
    assert got["start"]["scale"] == 1.0 and got["start"]["history"] is True, "start with scale 1.0 and an empty amax_history"
    want = [1.0, 448 / 4, 448 / 4, 448 / 2]  # the history before each step: [], [4], [4, 2], [2, 1]
    scales = [step["scale"] for step in got["steps"]]
    assert scales == want, (f"scales used {scales}, expected {want}: each step's scale comes from the amaxes of the steps "
                            "before it (delayed scaling), never from the tensor being quantised")
    for i, (step, x) in enumerate(zip(got["steps"], visible_stream())):
        assert step["q"]["dtype"] == str(torch.float8_e4m3fn), \
            f"step {i}: return the FP8 tensor itself, not a {step['q']['dtype']} one"
        assert torch.equal(step["q"]["values"], fp8.quantize(x, want[i], torch.float8_e4m3fn).float()), \
            f"step {i}: the values differ from torch's cast of x * scale"
    assert got["history"] == [1.0, 0.5], f"after 4 steps with history_len=2 amax_history is {got['history']}, expected [1.0, 0.5]"
    assert got["next"] == 448.0, f"after 4 steps the next scale is {got['next']}, expected 448 / max([1.0, 0.5]) = 448.0"
    assert torch.equal(got["dequantized"], got["steps"][1]["q"]["values"] / 112.0), \
        "dequantize(q, scale) is q in float32 divided by the scale"
    return f"delayed scaling, step by step, as torch's casts give it: scales {scales}"


register("test_DelayedScalingFP8", probe_fp8, judge_fp8)
