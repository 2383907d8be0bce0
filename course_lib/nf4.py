"""NF4, 4-bit NormalFloat: how QLoRA stores a frozen weight in about 4 bits, in bitsandbytes' layout.

QLoRA (Dettmers et al. 2023) keeps LoRA's recipe (notebook 11: a frozen base, small adapters that
train) and shrinks the one big thing left, the frozen base weights, from 16 bits to about 4. This module
is that storage format alone, in plain torch; ``course_lib.qlora`` builds the layer and the fine-tune on it:
- **The NF4 code book.** 16 levels placed at quantiles of N(0, 1), normalised to [-1, 1], with an
  exact 0: each level is equally likely for normally distributed weights, which is what trained
  weights look like. 8 levels for the positive half, 7 for the negative one, and 0 (``nf4_code``).
- **Block-wise absmax.** The weights are cut into blocks of 64 consecutive values (row-major order);
  each block is divided by its own absolute maximum (one float32 scale, ``absmax``) and every value is
  stored as the index of the nearest level: 4 bits. One outlier spoils only its own block.
- **Double quantisation.** 32 bits of scale per 64 weights is 0.5 bit per weight. The scales are
  quantised themselves: their mean is subtracted (one float32 ``offset``), and they are stored as 8-bit
  codes in blocks of 256 with one float32 scale each: 8/64 + 32/(64·256) = 0.127 bit per weight.
  4 + 0.5 = 4.5 bits per weight becomes 4.127. The price: a scale is now known only to 8 bits of the
  largest of its 256 neighbours, so a block whose scale is many orders of magnitude below theirs loses it
  (bitsandbytes the same); in trained weights the scales of nearby blocks differ by a few times.
At compute time each 4-bit weight is dequantised (``level[index] * absmax``) to bf16 for the matmul.

Everything here follows bitsandbytes' own layout (its ``quantize_4bit`` with ``quant_type="nf4"``): two
indices per byte, the first element in the high nibble, a last block that may be partial, and for the
scales its 8-bit "dynamic" code book (``dynamic_code``). Beside NF4, the same blocks and scales on other
4-bit levels (uniform int4, FP4 E2M1) and bf16, to compare: their round trips, the bits stored per weight
(``bits_per_parameter``, ``stored_bytes``) and the error of each on a model's linear layers (``layer_errors``).

Notebook 12's first exercise, stubs in the student edition: the quantiser and its round trip (``quantize_nf4``,
``dequantize_nf4``, ``nf4_round_trip``, ``blockwise_absmax``, and the blocks, the nearest level and the round trip
onto any levels they are made of: ``_blocks``, ``nearest_level``, ``absmax_round_trip``, which ``int4_round_trip``
and ``fp4_round_trip`` call). The storage (``pack_4bit``, ``unpack_4bit``, ``compress_absmax``,
``decompress_absmax``) is given: the notebook measures its bytes against bitsandbytes'. What measures them
(``round_trip_model``, ``layer_errors``) takes the student's as an argument; the notebook compares int4 and FP4 with
NF4 on the student's quantiser, their levels in NF4's place.
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Callable, NamedTuple

import torch
from torch import nn

# The quantile of the outermost levels: halfway between 1 - 1/(2·15) and 1 - 1/(2·16), the paper's choice
# (bitsandbytes' create_normal_map(offset=0.9677083)). N(0,1)'s quantile at 1 itself would be infinite.
NF4_OFFSET = 0.5 * ((1 - 1 / (2 * 15)) + (1 - 1 / (2 * 16)))
BLOCKSIZE = 64            # weights per absmax scale (QLoRA's and bitsandbytes' default)
ABSMAX_BLOCKSIZE = 256    # scales per second-level scale, under double quantisation
ZERO_INDEX = 7            # the index of NF4's level 0.0


# NF4's 16 levels as QLoRA published them (the paper's appendix) and bitsandbytes stores them (functional.get_4bit_type
# "nf4"): the one table the course quantises with, the notebook's exercise included.
NF4_LEVELS = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
              -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
              0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023,
              1.0)


def derived_nf4_levels() -> torch.Tensor:
    """NF4's levels derived from the normal distribution's quantile function (``torch.special.ndtri``), in float64:
    8 quantiles from ``NF4_OFFSET`` down to 0.5 for the positive half, 7 for the negative half, and an exact zero, all
    divided by the largest. They are ``NF4_LEVELS`` to within 2e-7 (bitsandbytes computed its table in float32)."""
    positive = torch.special.ndtri(torch.linspace(NF4_OFFSET, 0.5, 9, dtype=torch.float64)[:-1])
    negative = -torch.special.ndtri(torch.linspace(NF4_OFFSET, 0.5, 8, dtype=torch.float64)[:-1])
    levels = torch.cat([negative, torch.zeros(1, dtype=torch.float64), positive]).sort().values
    return levels / levels.max()


def nf4_code(dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """NF4's 16 levels, ascending, from -1 to 1 with 0 at index 7: ``NF4_LEVELS``, the published table (quantiles of
    N(0, 1), normalised: ``derived_nf4_levels``)."""
    return torch.tensor(NF4_LEVELS, dtype=dtype, device=device)


def check_blocksize(blocksize: int) -> int:
    """``blocksize`` if it is a positive even integer; stops with what to pass otherwise."""
    if not isinstance(blocksize, int) or blocksize < 2 or blocksize % 2:
        raise ValueError(f"blocksize={blocksize!r}: pass a positive even integer (QLoRA uses 64)")
    return blocksize


# graded: 12_qlora nf4_quantize
def _blocks(w: torch.Tensor, blocksize: int) -> torch.Tensor:
    """``w`` flattened (row-major), float32, one row per block of ``blocksize`` values (a shorter last block's row
    filled out to full length)."""
    flat = w.detach().reshape(-1).float()
    pad = -flat.numel() % blocksize
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, blocksize)


# graded: 12_qlora nf4_quantize
def blockwise_absmax(w: torch.Tensor, blocksize: int = BLOCKSIZE) -> torch.Tensor:
    """The absolute maximum of each block of ``blocksize`` consecutive values of ``w`` (float32)."""
    return _blocks(w, check_blocksize(blocksize)).abs().amax(dim=1)


# graded: 12_qlora nf4_quantize
def nearest_level(x: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """The index (int64) of the level of ``code`` (ascending) nearest to each value of ``x``; a value exactly
    halfway between two levels goes to the lower one, as in bitsandbytes."""
    midpoints = (code[1:] + code[:-1]) / 2
    return torch.bucketize(x, midpoints)


def pack_4bit(indices: torch.Tensor) -> torch.Tensor:
    """Indices 0..15 (any shape, row-major) → uint8, two per byte, the first in the high nibble.

    An odd count fills the last low nibble with 7, the index of the level 0 (what bitsandbytes stores there).
    """
    flat = indices.reshape(-1).to(torch.uint8)
    flat = torch.nn.functional.pad(flat, (0, flat.numel() % 2), value=ZERO_INDEX)
    return (flat[0::2] << 4) | flat[1::2]


def unpack_4bit(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` indices (int64) held in ``packed`` (``pack_4bit``'s layout)."""
    pairs = torch.stack([packed >> 4, packed & 0xF], dim=1)
    return pairs.reshape(-1)[:n].long()


# graded: 12_qlora nf4_quantize
def quantize_nf4(w: torch.Tensor, blocksize: int = BLOCKSIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """NF4 quantisation of ``w`` (any shape): (packed indices, uint8 with two per byte; absmax per block, float32).

    Blocks of ``blocksize`` consecutive values in row-major order, the last one partial if ``w.numel()``
    is not a multiple; an all-zero block gets absmax 0 and the zero level.
    """
    blocks = _blocks(w, check_blocksize(blocksize))
    absmax = blocks.abs().amax(dim=1)
    scaled = blocks / absmax.clamp(min=torch.finfo(torch.float32).tiny)[:, None]  # 0/0 would be nan
    indices = nearest_level(scaled, nf4_code(device=w.device)).reshape(-1)[: w.numel()]
    return pack_4bit(indices), absmax


# graded: 12_qlora nf4_quantize
def dequantize_nf4(packed: torch.Tensor, absmax: torch.Tensor, shape, blocksize: int = BLOCKSIZE,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The tensor of ``shape`` that ``quantize_nf4`` encoded: level[index] × its block's absmax."""
    n = math.prod(shape)
    if absmax.numel() != -(-n // check_blocksize(blocksize)):
        raise ValueError(f"absmax has {absmax.numel()} scales; a tensor of shape {tuple(shape)} in blocks of "
                         f"{blocksize} needs {-(-n // blocksize)}: pass the shape and blocksize it was quantised with")
    values = nf4_code(device=packed.device)[unpack_4bit(packed, n)]
    values = torch.nn.functional.pad(values, (0, -n % blocksize)).view(-1, blocksize) * absmax.float()[:, None]
    return values.reshape(-1)[:n].reshape(shape).to(dtype)


@functools.cache
def _dynamic_levels() -> tuple[float, ...]:
    values = [0.0, 1.0]
    for i in range(7):  # exponent 10^(i-6): 2^i fraction values, each with both signs
        edges = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        means = ((edges[:-1] + edges[1:]) / 2 * 10 ** (i - 6)).tolist()
        values += means + [-m for m in means]
    return tuple(sorted(values))


def dynamic_code(device: torch.device | str = "cpu") -> torch.Tensor:
    """bitsandbytes' signed 8-bit "dynamic" code book (``create_dynamic_map()``): 256 levels in [-1, 1].

    A decimal exponent 10^-6 … 10^0 and a fraction whose precision grows with the exponent, plus 0 and 1:
    fine steps near zero, coarse ones near ±1 (the code double quantisation stores the scales in).
    """
    return torch.tensor(_dynamic_levels(), dtype=torch.float32, device=device)


class CompressedAbsmax(NamedTuple):
    """Double-quantised scales: ``codes`` (uint8, one per absmax), one float32 ``scales`` per block of them,
    and the float32 ``offset`` (their mean) subtracted first."""
    codes: torch.Tensor
    scales: torch.Tensor
    offset: torch.Tensor


def compress_absmax(absmax: torch.Tensor, blocksize: int = ABSMAX_BLOCKSIZE) -> CompressedAbsmax:
    """Double quantisation: absmax − mean, in blocks of ``blocksize``, each as 8-bit codes of its own absmax."""
    offset = absmax.float().mean()
    n = absmax.numel()
    centred = torch.nn.functional.pad(absmax.float() - offset, (0, -n % check_blocksize(blocksize)))
    blocks = centred.view(-1, blocksize)
    scales = blocks.abs().amax(dim=1)
    scaled = blocks / scales.clamp(min=torch.finfo(torch.float32).tiny)[:, None]
    # the nearest level, a tie to the lower one; not nearest_level, the quantiser's own (a stub where it is an exercise)
    code = dynamic_code(absmax.device)
    codes = torch.bucketize(scaled, (code[1:] + code[:-1]) / 2).reshape(-1)[:n].to(torch.uint8)
    return CompressedAbsmax(codes, scales, offset)


def decompress_absmax(codes: torch.Tensor, scales: torch.Tensor, offset: torch.Tensor,
                      blocksize: int = ABSMAX_BLOCKSIZE) -> torch.Tensor:
    """The absmax scales that ``compress_absmax`` stored (to its 8-bit precision): ``decompress_absmax(*stored)``."""
    n = codes.numel()
    values = torch.nn.functional.pad(dynamic_code(codes.device)[codes.long()], (0, -n % blocksize))
    return (values.view(-1, blocksize) * scales[:, None]).reshape(-1)[:n] + offset


# graded: 12_qlora nf4_quantize
def nf4_round_trip(w: torch.Tensor, blocksize: int = BLOCKSIZE, double_quant: bool = True) -> torch.Tensor:
    """``w`` quantised to NF4 and back (what a QLoRA matmul computes with), in ``w``'s dtype and shape."""
    packed, absmax = quantize_nf4(w, blocksize)
    if double_quant:
        absmax = decompress_absmax(*compress_absmax(absmax))
    return dequantize_nf4(packed, absmax, w.shape, blocksize, dtype=w.dtype)


def int4_code(dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """Uniform int4's 16 levels, ascending: k/8 for the two's-complement integers k = -8..7.

    The grid every 4-bit integer has: 16 evenly spaced levels with an exact 0, one more below it than
    above, so a block's absmax maps onto -1 exactly but a positive absmax rounds down to 7/8.
    (bitsandbytes' ``create_linear_map(total_bits=4)`` drops the -8 to stay symmetric: 15 levels k/7.)
    """
    return torch.arange(-8, 8, dtype=dtype, device=device) / 8


def fp4_code(dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """FP4 E2M1's levels, ascending, divided by its max 6: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives.

    2 exponent bits and 1 mantissa bit (OCP's MX FP4, the format QLoRA compares NF4 with): 16 codes, but +0
    and -0 are one level, so 15 distinct values, dense near 0 and sparse near the max, like a float.
    """
    positive = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    return (torch.cat([-positive.flip(0)[:-1], positive]) / 6).to(dtype=dtype, device=device)


# graded: 12_qlora nf4_quantize
def absmax_round_trip(w: torch.Tensor, code: torch.Tensor, blocksize: int = BLOCKSIZE) -> torch.Tensor:
    """``w`` through block-wise absmax quantisation onto the levels of ``code`` (ascending, within [-1, 1])
    and back, in ``w``'s dtype and shape: NF4's blocks and float32 scales, only the levels differ."""
    blocks = _blocks(w, check_blocksize(blocksize))
    absmax = blocks.abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    code = code.to(blocks)
    q = code[nearest_level(blocks / absmax, code)]
    return (q * absmax).reshape(-1)[: w.numel()].reshape(w.shape).to(w.dtype)


def int4_round_trip(w: torch.Tensor, blocksize: int = BLOCKSIZE) -> torch.Tensor:
    """``w`` through uniform (integer) 4-bit absmax quantisation and back: levels k/8, k = -8..7 (``int4_code``),
    per block. The same blocks and scales as NF4, only the levels differ: evenly spaced instead of normal quantiles.
    """
    return absmax_round_trip(w, int4_code(), blocksize)


def fp4_round_trip(w: torch.Tensor, blocksize: int = BLOCKSIZE) -> torch.Tensor:
    """``w`` through FP4 (E2M1) absmax quantisation and back: each block scaled so that its absmax is FP4's max, 6
    (``fp4_code``). The same blocks and scales as NF4."""
    return absmax_round_trip(w, fp4_code(), blocksize)


def bf16_round_trip(w: torch.Tensor) -> torch.Tensor:
    """``w`` rounded to bfloat16 and back: the precision bf16 LoRA keeps its base in."""
    return w.to(torch.bfloat16).to(w.dtype)


def relative_rms_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """‖approx − exact‖ / ‖exact‖ (root mean square of the error over that of the values)."""
    exact = exact.detach().double()
    return float((approx.detach().double() - exact).norm() / exact.norm().clamp(min=1e-300))


def bits_per_parameter(blocksize: int = BLOCKSIZE, double_quant: bool = True,
                       absmax_blocksize: int = ABSMAX_BLOCKSIZE) -> float:
    """Storage bits per quantised weight: 4 + 32/blocksize, or 4 + 8/blocksize + 32/(blocksize·absmax_blocksize)."""
    if double_quant:
        return 4 + 8 / blocksize + 32 / (blocksize * absmax_blocksize)
    return 4 + 32 / blocksize


def stored_bytes(w: torch.Tensor, blocksize: int = BLOCKSIZE, double_quant: bool = True) -> int:
    """Bytes of the tensors that hold ``w`` in NF4: measured on what ``quantize_nf4`` (and ``compress_absmax``)
    return, not computed from a formula. (Notebook 12 measures the buffers of the student's ``QLoRALinear``.)"""
    packed, absmax = quantize_nf4(w, blocksize)
    parts = [packed, *compress_absmax(absmax)] if double_quant else [packed, absmax]
    return sum(t.numel() * t.element_size() for t in parts)


def quantized_linears(model: nn.Module, skip: tuple[str, ...] = ("lm_head",)) -> dict[str, nn.Linear]:
    """The linear layers QLoRA stores in 4 bits: every ``nn.Linear`` but the LM head (transformers' default)."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and not any(name.endswith(s) for s in skip)}


def round_trip_model(model: nn.Module, round_trip: Callable[[torch.Tensor], torch.Tensor] = nf4_round_trip,
                     skip: tuple[str, ...] = ("lm_head",)) -> nn.Module:
    """A copy of ``model`` whose quantised linears (``quantized_linears``) hold ``round_trip(weight)``:
    the weights a QLoRA model computes with. Embeddings, norms and the LM head keep their values."""
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for layer in quantized_linears(twin, skip).values():
            layer.weight.copy_(round_trip(layer.weight))
    return twin


def layer_errors(model: nn.Module, round_trips: dict[str, Callable[[torch.Tensor], torch.Tensor]]) -> list[dict]:
    """Per quantised linear layer of ``model``: its relative RMS error under each named round trip."""
    return [{"layer": name, "weights": layer.weight.numel(),
             **{k: relative_rms_error(f(layer.weight), layer.weight) for k, f in round_trips.items()}}
            for name, layer in quantized_linears(model).items()]
