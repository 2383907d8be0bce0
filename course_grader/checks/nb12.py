"""Notebook 12's visible tests: NF4 on single blocks (against bitsandbytes' codes, stored here: the student edition's
course_lib has no quantiser to compare with) and the QLoRA layer (against peft's LoRA on a weight NF4 stores exactly,
stored with course_lib's given storage)."""

from __future__ import annotations

import contextlib
import copy
import importlib

import torch

from course_grader.checks import register
from course_grader.checks.nb11 import PEFT, is_tensor, tensor
from course_grader.grading import forbid
from course_lib import nf4, qlora  # qlora first: it quiets the bitsandbytes log line that importing peft can write
from course_lib.lora import lora_linear

# What each exercise builds, out of reach while the student's code runs (and peft's LoRA layer: PEFT).
# The storage (nf4.pack_4bit, compress_absmax and their inverses) is given: the student's layer stores with it.
NF4_ANSWERS = (nf4.quantize_nf4, nf4.dequantize_nf4, nf4.nf4_round_trip, nf4.nearest_level, nf4.blockwise_absmax,
               nf4.absmax_round_trip, nf4.round_trip_model, nf4.stored_bytes, qlora.QLoRALinear,
               qlora.DequantizedLinear)
_bnb = None if qlora.bitsandbytes_error() else importlib.import_module("bitsandbytes.functional")
if _bnb is not None:
    NF4_ANSWERS += (_bnb.quantize_4bit, _bnb.dequantize_4bit)

# The notebook's given table (its cell "nf4_table"): QLoRA's 16 NF4 levels as published, course_lib's one table.
NF4 = nf4.nf4_code()


# ---------------------------------------------------------------- nf4_quantize
def my_nf4(ns: dict, w: torch.Tensor, blocksize: int = 64) -> dict:
    """The student's codes, absmax and round trip of ``w``, course_lib's and bitsandbytes' NF4 out of reach."""
    given_tables(ns)
    with forbid(*NF4_ANSWERS, namespace=ns):
        codes, absmax = ns["nf4_quantize"](w, blocksize)
        back = ns["nf4_dequantize"](codes, absmax, w.shape, blocksize)
    return {"codes": tensor(codes), "absmax": tensor(absmax), "back": tensor(back)}


def single_blocks() -> list[tuple[torch.Tensor, int, str]]:
    """Three tensors, each one block, and the NF4 index of each value as bitsandbytes 0.50.2 stores it (quantize_4bit
    with quant_type="nf4" on the float32 values, then its packed bytes in hex: one hex digit per value, in order,
    the first value in the high nibble)."""
    w = torch.sin(torch.arange(64) * 0.37) * 0.02
    w[10] = 0.0
    return [(w, 64, "7befffed9571000137befffed9521000137befffed9521000137befffed95210"),
            ((torch.sin(torch.arange(64) * 0.91) * torch.linspace(0.5, 2, 64)).reshape(4, 16), 64,
             "7aa95447bb95348cc84249dc8324add8214bed7114ced6114dfd5005dfd4006e"),
            (torch.cos(torch.arange(32) * 1.3).reshape(2, 16).bfloat16(), 32, "fa01cf802ef503ee305fe208fc10afa0")]


def probe_nf4(ns: dict) -> dict:
    blocks = single_blocks()
    return {"first": my_nf4(ns, blocks[0][0]), "stored": [my_nf4(ns, w, bs) for w, bs, _ in blocks]}


# bitsandbytes' round trip of each of single_blocks() (dequantize_4bit, in float32): its relative RMS error
SINGLE_BLOCK_ERRORS = (0.07674517487275413, 0.09665291498071008, 0.08566460164062104)


def judge_nf4(got: dict) -> str:
    blocks = single_blocks()
    w = blocks[0][0]
    codes, absmax, back = got["first"]["codes"], got["first"]["absmax"], got["first"]["back"]
    for name, x in (("codes", codes), ("absmax", absmax), ("the round trip", back)):
        is_tensor(x, name)
    assert tuple(codes.shape) == (64,) and not codes.is_floating_point() and 0 <= codes.min() and codes.max() <= 15, \
        f"codes: one integer index 0..15 per value, of shape (numel,); got {codes.dtype} of shape {tuple(codes.shape)}"
    assert absmax.numel() == 1 and torch.allclose(absmax.reshape(-1).float(), w.abs().max().reshape(1)), \
        "absmax: the block's largest |value|, one per block"
    assert codes[10] == 7 and back[10] == 0, "an exact zero is stored as the level 0.0 (index 7) and comes back as 0"
    assert len(got["stored"]) == len(blocks), f"{len(got['stored'])} results for the {len(blocks)} blocks"
    for (w, _, hexes), mine, error in zip(blocks, got["stored"], SINGLE_BLOCK_ERRORS):
        codes, back = mine["codes"], mine["back"]
        is_tensor(codes, "codes")
        is_tensor(back, "the round trip")
        is_tensor(mine["absmax"], "absmax")
        assert mine["absmax"].numel() == 1 and torch.equal(mine["absmax"].reshape(1).float(),
                                                           w.float().abs().max().reshape(1)), \
            f"shape {tuple(w.shape)}: absmax is the block's largest |value|, one per block"
        want = torch.tensor([int(digit, 16) for digit in hexes])
        assert tuple(back.shape) == tuple(w.shape), \
            f"nf4_dequantize must return shape {tuple(w.shape)}, not {tuple(back.shape)}"
        assert codes.numel() == want.numel(), f"codes: one index per value, {want.numel()} here, not {codes.numel()}"
        off = (codes.reshape(-1).long() != want).nonzero().flatten().tolist()
        assert not off, (f"shape {tuple(w.shape)}: your indices differ from bitsandbytes' at positions {off[:8]}: "
                         f"each value goes to the NF4 level nearest to value / absmax "
                         f"(not to a grid of evenly spaced levels)")
        assert back.float().abs().max() == w.float().abs().max(), \
            "the block's largest |value| sits on the level ±1: it comes back exactly"
        mine_error = nf4.relative_rms_error(back.float(), w.float())
        assert abs(mine_error - error) <= 1e-4 * error, \
            (f"shape {tuple(w.shape)}: your round trip is off the weights by {mine_error:.6f} (relative RMS), "
             f"bitsandbytes' by {error:.6f}: a value comes back as its level of NF4 times its block's absmax")
    return "single blocks: bitsandbytes' NF4 indices, and the error of its round trip"


register("test_nf4_quantize", probe_nf4, judge_nf4)


def given_tables(ns: dict) -> None:
    """The notebook's given table, where the graded run has not defined it."""
    ns.setdefault("NF4", NF4.clone())


# ---------------------------------------------------------------- QLoRALinear
# The student's layer quantises with the student's exercise-1 functions. In the grader the hidden tests fill this
# with right ones, which stand in for those while the layer is tested: the layer is graded on its own (a wrong or
# copied quantiser loses its own tests, not the layer's). In the student's kernel the layer runs on theirs.
QUANTIZER_STAND_INS: dict = {}


@contextlib.contextmanager
def standing_in(ns: dict, stand_ins: dict):
    """``ns`` with ``stand_ins``' names bound to them while the block runs; the student's own bindings after."""
    saved = {name: ns[name] for name in stand_ins if name in ns}
    ns.update(stand_ins)
    try:
        yield
    finally:
        for name in stand_ins:
            if name in saved:
                ns[name] = saved[name]
            else:
                ns.pop(name, None)


def qlora_base(out_features: int, in_features: int, seed: int, exact: bool = True,
               bias: bool = True) -> torch.nn.Linear:
    """A linear layer with a bias; its weight one NF4 stores exactly (``nf4_exact_weight``) or normal, std 0.02."""
    g = torch.Generator().manual_seed(seed)
    layer = torch.nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(qlora.nf4_exact_weight(out_features, in_features, g) if exact
                           else torch.randn(out_features, in_features, generator=g) * 0.02)
        if bias:
            layer.bias.copy_(torch.randn(out_features, generator=g) * 0.1)
    return layer


def qlora_adapters(base: torch.nn.Linear, r: int, shape: tuple, seed: int):
    """The A (r x in) and B (out x r) both layers get, and the input. B is small, as after some training: the
    adapters' term must not drown the base's, whose error the test measures."""
    g = torch.Generator().manual_seed(seed + 1)
    a = torch.randn(r, base.in_features, generator=g) * 0.3
    return a, torch.randn(base.out_features, r, generator=g) * 0.01, torch.randn(*shape, base.in_features, generator=g)


def probe_qlora(ns: dict, base: torch.nn.Linear, r: int, alpha: float, shape: tuple, seed: int,
                dtype: torch.dtype = torch.float32) -> dict:
    """The student's QLoRALinear on a copy of ``base``: what trains, what it stores, its output and gradients with A
    and B set, and its output once ``packed`` holds only the level 0 (a layer that dequantises in forward follows).
    A bf16 input runs under bf16 autocast, as QLoRA trains (fp32 adapters, bf16 compute)."""
    given_tables(ns)
    with standing_in(ns, QUANTIZER_STAND_INS), forbid(*NF4_ANSWERS, *PEFT, namespace=ns):
        layer = ns["QLoRALinear"](copy.deepcopy(base), r, alpha)
    out = {"trainable": {n: list(p.shape) for n, p in layer.named_parameters() if p.requires_grad},
           "B": tensor(layer.lora_B.weight),
           "buffers": {n: [str(b.dtype), b.numel(), b.element_size()] for n, b in layer.named_buffers()},
           "stored float bytes": sum(t.numel() * t.element_size()
                                     for n, t in [*layer.named_parameters(), *layer.named_buffers()]
                                     if t.is_floating_point() and not n.startswith("lora_"))}
    a, b, x = qlora_adapters(base, r, shape, seed)
    layer.lora_A.weight.data.copy_(a)
    layer.lora_B.weight.data.copy_(b)
    x = x.to(dtype).requires_grad_()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
    with standing_in(ns, QUANTIZER_STAND_INS), forbid(*NF4_ANSWERS, *PEFT, namespace=ns), autocast:
        y = layer(x)
        y.float().sum().backward()
    out.update({"y": tensor(y), "x grad": tensor(x.grad), "A grad": tensor(layer.lora_A.weight.grad),
                "B grad": tensor(layer.lora_B.weight.grad),
                "base grads": [n for n, p in layer.named_parameters()
                               if p.grad is not None and not n.startswith("lora_")]})
    with torch.no_grad(), standing_in(ns, QUANTIZER_STAND_INS), forbid(*NF4_ANSWERS, *PEFT, namespace=ns), autocast:
        layer.packed.fill_(0x77)  # every code 7: the level 0.0
        out["y, packed all zero"] = tensor(layer(x))
    return out


def peft_reference(base: torch.nn.Linear, weight: torch.Tensor, r: int, alpha: float, shape: tuple, seed: int) -> dict:
    """peft's LoRA (bf16 LoRA's layer) on ``base`` with ``weight`` in place of its own, the same A, B and input."""
    frozen = copy.deepcopy(base)
    with torch.no_grad():
        frozen.weight.copy_(weight)
    theirs = lora_linear(frozen, r, alpha)
    a, b, x = qlora_adapters(base, r, shape, seed)
    theirs.lora_A["default"].weight.data.copy_(a)
    theirs.lora_B["default"].weight.data.copy_(b)
    x.requires_grad_()
    y = theirs(x)
    y.sum().backward()
    return {"y": y.detach(), "x grad": x.grad, "A grad": theirs.lora_A["default"].weight.grad,
            "B grad": theirs.lora_B["default"].weight.grad}


def judge_qlora_layer(got: dict, base: torch.nn.Linear, weight: torch.Tensor, r: int, alpha: float, shape: tuple,
                      seed: int, tolerance: float) -> None:
    """The student's layer trains only its adapters, stores packed codes and no float weight, computes peft's LoRA
    on ``weight`` (within ``tolerance``, relative RMS) and dequantises from ``packed`` at every forward."""
    out_f, in_f = base.weight.shape
    trainable = {n: tuple(s) for n, s in got["trainable"].items()}
    assert trainable == {"lora_A.weight": (r, in_f), "lora_B.weight": (out_f, r)}, \
        (f"only lora_A (r x in) and lora_B (out x r) train; the base (its bias too) is frozen. "
         f"Trainable here: {trainable}")
    is_tensor(got["B"], "lora_B.weight")
    assert (got["B"] == 0).all(), "lora_B starts at zero, so the layer starts as the (quantised) base"
    for name, triple in got["buffers"].items():  # the probe's [dtype, numel, element size] of each buffer
        assert isinstance(triple, list) and len(triple) == 3 and isinstance(triple[0], str) \
            and all(isinstance(v, int) and v >= 0 for v in triple[1:]), f"the buffer {name}: {triple!r:.80}"
    packed = got["buffers"].get("packed")
    assert packed == ["torch.uint8", out_f * in_f // 2, 1], \
        (f"a buffer named packed holds the {out_f * in_f} codes, two a byte (uint8, {out_f * in_f // 2}); "
         f"buffers: {got['buffers']}")
    assert got["stored float bytes"] < out_f * in_f, \
        (f"the layer keeps {got['stored float bytes']} bytes of float tensors besides its adapters: "
         f"QLoRA keeps no float copy of the weight ({out_f * in_f} weights), it dequantises the packed codes "
         f"at every forward")
    assert not got["base grads"], f"only the adapters get gradients, not {got['base grads']}"
    ref = peft_reference(base, weight, r, alpha, shape, seed)
    for key in ("y", "x grad", "A grad", "B grad"):
        is_tensor(got[key], key)
        assert tuple(got[key].shape) == tuple(ref[key].shape), \
            f"{key}: shape {tuple(ref[key].shape)}, not {tuple(got[key].shape)}"
        error = nf4.relative_rms_error(got[key].float(), ref[key])
        assert error < tolerance, (f"{key} is off LoRA's on the dequantised weight by {error:.2e} (relative RMS): "
                                   f"base(x) with the weight dequantised + lora_B(lora_A(x)) * alpha / r")
    zero = peft_reference(base, torch.zeros_like(weight), r, alpha, shape, seed)["y"]
    is_tensor(got["y, packed all zero"], "the output")
    assert nf4.relative_rms_error(got["y, packed all zero"].float(), zero) < tolerance, \
        ("with every packed code set to 7 (the level 0.0) the layer must compute bias + adapters alone: dequantise the "
         "weight from the buffer packed at every forward, do not keep it")


QLORA_VISIBLE = dict(r=4, alpha=8, shape=(5,), seed=3)
SAVED = dict(out_features=512, in_features=256, r=8, alpha=16, tokens=4, seed=5)  # the weight dwarfs the input


def saved_case() -> tuple[torch.nn.Linear, torch.Tensor]:
    base = qlora_base(SAVED["out_features"], SAVED["in_features"], SAVED["seed"], exact=False)
    g = torch.Generator().manual_seed(SAVED["seed"] + 1)
    return base, torch.randn(SAVED["tokens"], SAVED["in_features"], generator=g).to(torch.bfloat16).requires_grad_()


def probe_qlora_visible(ns: dict) -> dict:
    out = probe_qlora(ns, qlora_base(12, 64, QLORA_VISIBLE["seed"]), **QLORA_VISIBLE)
    base, x = saved_case()
    given_tables(ns)
    with standing_in(ns, QUANTIZER_STAND_INS), forbid(*NF4_ANSWERS, *PEFT, namespace=ns):
        layer = ns["QLoRALinear"](base, SAVED["r"], SAVED["alpha"])
        out["saved bytes"] = qlora.saved_bytes(layer, x)
    return out


def lora_saved_bytes() -> int:
    """What LoRA over the same weight in bf16 (peft's layer) saves for backward: the bytes QLoRA may save too."""
    base, x = saved_case()
    layer = lora_linear(base.to(torch.bfloat16), SAVED["r"], SAVED["alpha"])
    layer.lora_A.float(), layer.lora_B.float()  # fp32 adapters, as QLoRA trains them
    return qlora.saved_bytes(layer, x)


def judge_saved(got: dict) -> str:
    saved, lora = got.get("saved bytes"), lora_saved_bytes()
    assert isinstance(saved, int) and saved >= 0, f"the saved bytes: {saved!r:.80}"
    weight = SAVED["out_features"] * SAVED["in_features"] * 2  # the weight in bf16
    assert saved <= lora + weight // 4, (
        f"one forward of your layer ({SAVED['out_features']} x {SAVED['in_features']}, bf16 autocast) saved {saved} "
        f"bytes for backward beyond its buffers and parameters; LoRA over the same weight in bf16 saves {lora}. The "
        f"{saved - lora} bytes more are {(saved - lora) / weight:.2f} of the weight in bf16: autograd kept your "
        "dequantised (or unpacked) weight. Multiply in DequantizedLinear, which saves no tensor and dequantises "
        "again in backward")
    return f"{saved} bytes saved for backward, LoRA over bf16 saves {lora}"


def judge_qlora_visible(got: dict) -> str:
    base = qlora_base(12, 64, QLORA_VISIBLE["seed"])
    # NF4 stores this weight exactly; its scales, double-quantised, to 8 bits of their spread (within 2x): ~0.3%
    judge_qlora_layer(got, base, base.weight.detach(), **QLORA_VISIBLE, tolerance=5e-3)
    return ("one layer, a weight NF4 stores exactly: only the adapters train, packed codes, "
            f"peft's LoRA outputs and gradients; {judge_saved(got)}")


register("test_QLoRALinear", probe_qlora_visible, judge_qlora_visible)
