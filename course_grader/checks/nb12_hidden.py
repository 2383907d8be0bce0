"""Notebook 12's hidden tests (instructor edition only): NF4 on many blocks, its storage against course_lib's (odd
counts, blocks of scales far apart, another blocksize) and the QLoRA layer on normal weights (double quantisation,
the bytes it stores, bf16 autocast, a 3-D input, no bias)."""

from __future__ import annotations

from typing import Callable

import torch

from course_grader.checks import case_seed, error_text, register
from course_grader.checks.nb11 import is_tensor, tensor
from course_grader.grading import worst
from course_lib import nf4
from course_grader.checks.nb12 import (NF4_ANSWERS, STORAGE_STAND_INS, given_tables, judge_qlora_layer, my_nf4,
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


# ---------------------------------------------------------------- nf4_storage: odd counts, many blocks, other sizes
def absmax_cases() -> list[tuple[torch.Tensor, int]]:
    """Scales to compress: 1000 in blocks of 256 (the last of 232), each block of another magnitude; 300 in blocks
    of 128; 70 equal scales (nothing left once the mean is subtracted)."""
    g = torch.Generator().manual_seed(4)
    spread = (torch.rand(1000, generator=g) + 0.5) * torch.tensor([1.0, 30.0, 0.03, 3.0]).repeat_interleave(256)[:1000]
    return [(spread, 256), (torch.rand(300, generator=g) * 0.1, 128), (torch.full((70,), 0.02), 256)]


def storage_codes() -> list[torch.Tensor]:
    """Codes to pack: an odd count (the last low nibble is padding), a 2-D tensor of an odd count, an even one."""
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 16, (101,), generator=g), torch.randint(0, 16, (3, 7), generator=g),
            torch.randint(0, 16, (256,), generator=g)]


def stored_absmax(n: int, blocksize: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Double-quantised scales to decompress, made up: n random 8-bit codes, a scale per block, an offset."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
    return codes, torch.rand(-(-n // blocksize), generator=g) + 0.1, torch.tensor(0.5)


def probe_storage(ns: dict) -> dict:
    given_tables(ns)
    out = {"packed": [], "unpacked": [], "compressed": [], "back": []}
    g = torch.Generator().manual_seed(6)
    with forbid(*NF4_ANSWERS, namespace=ns):
        for codes in storage_codes():
            out["packed"].append(tensor(ns["pack_4bit"](codes)))
        for n in (101, 21, 256):  # random bytes: an odd n leaves the last low nibble out
            out["unpacked"].append(tensor(ns["unpack_4bit"](torch.randint(0, 256, ((n + 1) // 2,), generator=g,
                                                                          dtype=torch.uint8), n)))
        for (absmax, bs), seed in zip(absmax_cases(), (7, 8, 9)):
            out["compressed"].append([tensor(t) for t in ns["compress_absmax"](absmax, bs)])
            out["back"].append(tensor(ns["decompress_absmax"](*stored_absmax(absmax.numel(), bs, seed), bs)))
        out["meta"] = on_meta(lambda: meta_storage(ns))
    return out


def meta_storage(ns: dict) -> tuple:
    """The four storage functions on meta tensors: 101 codes, their 51 bytes, 300 scales and their 8-bit codes."""
    meta = torch.device("meta")
    return (ns["pack_4bit"](torch.empty(101, dtype=torch.int64, device=meta)),
            ns["unpack_4bit"](torch.empty(51, dtype=torch.uint8, device=meta), 101),
            *ns["compress_absmax"](torch.empty(300, device=meta)),
            ns["decompress_absmax"](torch.empty(300, dtype=torch.uint8, device=meta), torch.empty(2, device=meta),
                                    torch.empty((), device=meta)))


def judge_storage(got: dict) -> str:
    assert len(got["packed"]) == len(got["unpacked"]) == len(got["compressed"]) == len(got["back"]) == 3, \
        (f"{len(got['packed'])}, {len(got['unpacked'])}, {len(got['compressed'])} and {len(got['back'])} results "
         "for the 3 cases of pack_4bit, unpack_4bit, compress_absmax and decompress_absmax")
    for codes, packed in zip(storage_codes(), got["packed"]):
        is_tensor(packed, "pack_4bit's bytes")
        want = nf4.pack_4bit(codes)
        assert packed.dtype == torch.uint8 and torch.equal(packed.reshape(-1), want), \
            (f"{codes.numel()} codes: bytes {bytes(packed.reshape(-1).tolist()[:8]).hex()}..., expected "
             f"{bytes(want.tolist()[:8]).hex()}...; an odd count fills the last low nibble with 7 (the level 0.0)")
    g = torch.Generator().manual_seed(6)
    for n, unpacked in zip((101, 21, 256), got["unpacked"]):
        want = nf4.unpack_4bit(torch.randint(0, 256, ((n + 1) // 2,), generator=g, dtype=torch.uint8), n)
        is_tensor(unpacked, "unpack_4bit's codes")
        assert tuple(unpacked.shape) == (n,) and torch.equal(unpacked.long(), want), \
            f"unpack_4bit(packed, {n}): the first {n} codes"
    for (absmax, bs), mine, back, seed in zip(absmax_cases(), got["compressed"], got["back"], (7, 8, 9)):
        assert isinstance(mine, list) and len(mine) == 3, "compress_absmax returns (codes, scales, offset)"
        ref = nf4.compress_absmax(absmax, bs)
        for name, x in zip(ref._fields, mine):
            is_tensor(x, name)
        codes, scales, offset = mine
        assert torch.allclose(offset.float(), ref.offset) and tuple(scales.shape) == tuple(ref.scales.shape) \
            and torch.allclose(scales.float(), ref.scales, rtol=1e-6), \
            (f"{absmax.numel()} scales in blocks of {bs}: one scale per block ({ref.scales.numel()}) "
             "and the offset, their mean")
        assert codes.dtype == torch.uint8 and codes.numel() == absmax.numel()
        diff = (codes.reshape(-1).int() - ref.codes.int()).abs()  # a near-tie may round to the neighbouring code
        assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 0.01, \
            (f"{absmax.numel()} scales in blocks of {bs}, of different magnitudes: "
             "each block is scaled by its own largest")
        want = nf4.decompress_absmax(nf4.CompressedAbsmax(*stored_absmax(absmax.numel(), bs, seed)), bs)
        is_tensor(back, "decompress_absmax's scales")
        assert tuple(back.shape) == tuple(want.shape) and torch.isfinite(back).all() \
            and torch.allclose(back.float(), want, rtol=1e-6, atol=1e-7), \
            f"{absmax.numel()} codes in blocks of {bs}: DYNAMIC[code] times its block's scale, plus the offset"
    judge_on_meta(got["meta"], "pack_4bit, unpack_4bit, compress_absmax and decompress_absmax", "DYNAMIC", 6)
    return ("odd counts packed and unpacked, scales of four magnitudes in blocks of 256, blocks of 128, equal scales, "
            "and the input's device followed")


register("test_nf4_storage_hidden", probe_storage, judge_storage)


# ---------------------------------------------------------------- QLoRALinear: normal weights, double-quantised, bytes
# Right exercise-4 and -5 functions, in torch alone (the grading process has the student edition: course_lib's are
# stubs there), which stand in for the student's while their QLoRALinear is tested (nb11.STORAGE_STAND_INS).
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


def _pack_4bit(codes):
    flat = codes.reshape(-1).to(torch.uint8)
    flat = torch.nn.functional.pad(flat, (0, flat.numel() % 2), value=7)
    return flat[0::2] * 16 + flat[1::2]


def _unpack_4bit(packed, n):
    return torch.stack([packed // 16, packed % 16], dim=1).reshape(-1)[:n].long()


def _compress_absmax(absmax, blocksize=256):
    offset = absmax.float().mean()
    blocks = _blocks(absmax.float() - offset, blocksize)
    scales = blocks.abs().amax(dim=1)
    scaled = blocks / torch.where(scales > 0, scales, torch.ones_like(scales))[:, None]
    return _nearest(scaled, nf4.dynamic_code()).reshape(-1)[:absmax.numel()].to(torch.uint8), scales, offset


def _decompress_absmax(codes, scales, offset, blocksize=256):
    levels = _blocks(nf4.dynamic_code(codes.device)[codes.long()], blocksize) * scales[:, None]
    return levels.reshape(-1)[:codes.numel()] + offset


STORAGE_STAND_INS.update(nf4_quantize=_nf4_quantize, nf4_dequantize=_nf4_dequantize, pack_4bit=_pack_4bit,
                         unpack_4bit=_unpack_4bit, compress_absmax=_compress_absmax,
                         decompress_absmax=_decompress_absmax)

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
