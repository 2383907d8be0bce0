"""Notebook 12's hidden tests (instructor edition only): NF4 on many blocks, and the QLoRA layer on normal weights
(double quantisation, the bytes it stores, bf16 autocast, a 3-D input, no bias)."""

from __future__ import annotations

from typing import Callable

import torch

from course_grader.checks import case_seed, error_text, register
from course_grader.checks.nb11 import is_tensor
from course_grader.grading import worst
from course_lib import nf4
from course_grader.checks.nb12 import (NF4_ANSWERS, QUANTIZER_STAND_INS, judge_qlora_layer, my_nf4,
                                    probe_qlora, qlora_base)
from course_grader.grading import forbid


# ---------------------------------------------------------------- nf4_quantize: many blocks
def many_blocks() -> dict:
    """The inputs, drawn in the order the test had them: 150 values in blocks of 64, 64 and 22; 400 in 3 × 128 and
    16; an all-zero block; a block ten thousand times larger than the next. Their values are new to every grading."""
    torch.manual_seed(case_seed("nf4", "many blocks"))
    many = [(torch.randn(shape) * 0.02, bs) for shape, bs in (((5, 30), 64), ((2, 200), 128))]
    zero = torch.randn(3, 64)
    zero[1] = 0.0
    scales = torch.randn(2, 64) * 1e-3
    scales[0] *= 1e4
    return {"many": many, "zero": zero, "scales": scales}


def block_errors(w, back, blocksize):
    f, b = w.reshape(-1).float(), back.reshape(-1).float()
    return [float((b[s:s + blocksize] - f[s:s + blocksize]).norm() / f[s:s + blocksize].norm())
            for s in range(0, f.numel(), blocksize)]


def on_meta(calls: Callable[[], tuple]) -> list[str] | str:
    """The device of every tensor ``calls`` returns when its inputs are on torch's ``meta`` device (shapes, no data:
    every machine has it), or the error it raised: a function that leaves its table on the CPU fails on a GPU's
    weights the same way, which a CPU-only grading run could not see otherwise."""
    try:
        return [t.device.type for t in calls() if torch.is_tensor(t)]
    except Exception as err:  # noqa: BLE001 (the student's code may raise anything)
        return error_text(err).splitlines()[0][:300]


def judge_on_meta(devices: list[str] | str, what: str, table: str, count: int) -> None:
    """``count`` tensors came back, all on the meta device."""
    assert isinstance(devices, list) and len(devices) == count and set(devices) == {"meta"}, \
        (f"{what} on tensors of another device (torch's meta device here, a GPU's in the notebook's fine-tune): "
         f"{devices if isinstance(devices, str) else 'returned tensors on ' + ', '.join(sorted(set(devices)))}; "
         f"compute on the input's device, with the table brought there ({table}.to(x.device))")


def probe_nf4(ns: dict) -> dict:
    inputs = many_blocks()
    w = torch.empty(3, 50, device="meta")

    def meta_round_trip():
        codes, absmax = ns["nf4_quantize"](w)
        return codes, absmax, ns["nf4_dequantize"](codes, absmax, w.shape)

    with forbid(*NF4_ANSWERS, namespace=ns):
        meta = on_meta(meta_round_trip)
    return {"many": [my_nf4(ns, w, bs) for w, bs in inputs["many"]], "zero": my_nf4(ns, inputs["zero"]),
            "scales": my_nf4(ns, inputs["scales"]), "meta": meta}


def judge_absmax(w: torch.Tensor, bs: int, absmax: torch.Tensor) -> None:
    want = torch.stack([w.reshape(-1)[s:s + bs].abs().max() for s in range(0, w.numel(), bs)])
    assert absmax.shape == want.shape and torch.allclose(absmax.float(), want), \
        (f"one absmax per block of {bs} (the last one shorter): expected shape {tuple(want.shape)}, "
         f"got {tuple(absmax.shape)}, or other values than each block's largest |value|")


def judge_nf4(got: dict) -> str:
    inputs = many_blocks()
    assert len(got["many"]) == len(inputs["many"]), f"{len(got['many'])} results for {len(inputs['many'])} tensors"
    for mine in got["many"] + [got["zero"], got["scales"]]:
        for key in ("codes", "absmax", "back"):
            is_tensor(mine[key], key)
    for (w, bs), mine in zip(inputs["many"], got["many"]):
        codes, absmax, back = mine["codes"], mine["absmax"], mine["back"]
        judge_absmax(w, bs, absmax)
        assert codes.numel() == w.numel() and tuple(back.shape) == tuple(w.shape), \
            f"{w.numel()} values of shape {tuple(w.shape)}: {codes.numel()} codes, a round trip of {tuple(back.shape)}"
        errors = block_errors(w, back, bs)
        assert worst(errors) < 0.2, f"blocks of {bs}: the round trip is off each block by {errors} (relative)"
    codes, absmax, back = got["zero"]["codes"], got["zero"]["absmax"], got["zero"]["back"]
    assert absmax[1] == 0 and bool((codes.reshape(3, 64)[1] == 7).all()), \
        "an all-zero block: absmax 0, and index 7 everywhere"
    assert torch.isfinite(back).all() and bool((back[1] == 0).all()), "an all-zero block comes back as zeros, not nan"
    assert worst(block_errors(inputs["scales"], got["scales"]["back"], 64)) < 0.2, \
        "each block has its own scale: huge values must not ruin a block of small ones"
    judge_absmax(inputs["zero"], 64, got["zero"]["absmax"])
    judge_absmax(inputs["scales"], 64, got["scales"]["absmax"])
    judge_on_meta(got["meta"], "nf4_quantize and nf4_dequantize", "NF4", 3)
    return ("many blocks and a shorter last one, blocksize 128, an all-zero block, blocks of very different scales, "
            "and the input's device followed")


register("test_nf4_quantize_hidden", probe_nf4, judge_nf4)


# ---------------------------------------------------------------- QLoRALinear: normal weights, double-quantised, bytes
# A right exercise 1, in torch alone (the grading process has the student edition: course_lib's quantiser is a stub
# there), which stands in for the student's while their QLoRALinear is tested (nb12.QUANTIZER_STAND_INS).
def _blocks(x: torch.Tensor, blocksize: int) -> torch.Tensor:
    flat = x.reshape(-1).float()
    return torch.nn.functional.pad(flat, (0, -flat.numel() % blocksize)).view(-1, blocksize)


def _nearest(x: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    return (x[..., None] - levels.to(x.device)).abs().argmin(dim=-1)


def _nf4_quantize(w, blocksize=64):
    blocks = _blocks(w.detach(), blocksize)
    absmax = blocks.abs().amax(dim=1)
    scaled = blocks / torch.where(absmax > 0, absmax, torch.ones_like(absmax))[:, None]
    return _nearest(scaled, nf4.nf4_code()).reshape(-1)[:w.numel()], absmax


def _nf4_dequantize(codes, absmax, shape, blocksize=64):
    n = codes.numel()
    values = _blocks(nf4.nf4_code(device=codes.device)[codes.long()], blocksize) * absmax.float()[:, None]
    return values.reshape(-1)[:n].reshape(shape)


QUANTIZER_STAND_INS.update(nf4_quantize=_nf4_quantize, nf4_dequantize=_nf4_dequantize)

QLORA_CASES = {"float32": dict(r=4, alpha=16, shape=(2, 3)),          # a 3-D input, scaling 4
               "bf16": dict(r=8, alpha=8, shape=(6,), dtype=torch.bfloat16),  # bf16 autocast
               "no bias": dict(r=2, alpha=4, shape=(4,)),
               "more outputs": dict(r=4, alpha=8, shape=(3,))}  # a Llama's gate_proj and up_proj widen
WIDER = {"more outputs": (96, 40)}  # (out, in) where a case's weight is not (40, 96)


def qlora_case(case: str) -> dict:
    """The case's settings and its seed (weights, adapters, input): new to every grading (``case_seed``)."""
    return {**QLORA_CASES[case], "seed": case_seed("qlora", case)}


def hidden_base(case: str) -> torch.nn.Linear:
    out_features, in_features = WIDER.get(case, (40, 96))
    return qlora_base(out_features, in_features, qlora_case(case)["seed"], exact=False, bias=case != "no bias")


def probe_qlora_hidden(ns: dict) -> dict:
    return {case: probe_qlora(ns, hidden_base(case), **qlora_case(case)) for case in QLORA_CASES}


def judge_qlora_hidden(got: dict) -> str:
    for case in QLORA_CASES:
        mine, base = got[case], hidden_base(case)
        kw = {k: v for k, v in qlora_case(case).items() if k != "dtype"}
        weight = nf4.nf4_round_trip(base.weight.detach())  # NF4 with double quantisation: what QLoRA computes with
        judge_qlora_layer(mine, base, weight, **kw, tolerance=2e-2 if case == "bf16" else 1e-4)
        is_tensor(mine["y"], "the output")
        if case == "bf16":
            assert mine["y"].dtype == torch.bfloat16, "a bf16 input under bf16 autocast gives a bf16 output"
        stored = sum(numel * size for dtype, numel, size in mine["buffers"].values())
        assert stored == nf4.stored_bytes(base.weight), \
            (f"{case}: the buffers hold {stored} bytes; QLoRA stores {nf4.stored_bytes(base.weight)} "
             f"(codes two a byte, 8-bit scales, a scale per 256 of them and the offset)")
    return ("normal weights with double quantisation: outputs and gradients, stored bytes, a 3-D input, "
            "bf16 autocast, no bias, more outputs than inputs")


register("test_QLoRALinear_hidden", probe_qlora_hidden, judge_qlora_hidden)
