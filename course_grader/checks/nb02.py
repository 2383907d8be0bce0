"""Notebook 02's visible checks: delayed-scaling FP8 quantisation, step by step, against torch's own casts."""

from __future__ import annotations

import torch

from course_grader.checks import register
from course_grader.checks.nb01 import tensor
from course_grader.grading import forbid
from course_lib import fp8

FP8_ANSWERS = (fp8.DelayedScaler, fp8.quantize, fp8.dequantize, fp8.scale_for, fp8.current_scaler)


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
    assert got["start"]["scale"] == 1.0 and got["start"]["history"] is True, \
        "start with scale 1.0 and an empty amax_history"
    want = [1.0, 448 / 4, 448 / 4, 448 / 2]  # the history before each step: [], [4], [4, 2], [2, 1]
    scales = [step["scale"] for step in got["steps"]]
    assert scales == want, (f"scales used {scales}, expected {want}: each step's scale comes from the amaxes of the "
                            "steps before it (delayed scaling), never from the tensor being quantised")
    for i, (step, x) in enumerate(zip(got["steps"], visible_stream())):
        assert step["q"]["dtype"] == str(torch.float8_e4m3fn), \
            f"step {i}: return the FP8 tensor itself, not a {step['q']['dtype']} one"
        assert torch.equal(step["q"]["values"], fp8.quantize(x, want[i], torch.float8_e4m3fn).float()), \
            f"step {i}: the values differ from torch's cast of x * scale"
    assert got["history"] == [1.0, 0.5], \
        f"after 4 steps with history_len=2 amax_history is {got['history']}, expected [1.0, 0.5]"
    assert got["next"] == 448.0, \
        f"after 4 steps the next scale is {got['next']}, expected 448 / max([1.0, 0.5]) = 448.0"
    assert torch.equal(got["dequantized"], got["steps"][1]["q"]["values"] / 112.0), \
        "dequantize(q, scale) is q in float32 divided by the scale"
    return f"delayed scaling, step by step, as torch's casts give it: scales {scales}"


register("test_DelayedScalingFP8", probe_fp8, judge_fp8)
