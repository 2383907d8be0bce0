"""QLoRA: the frozen base model stored in 4-bit NormalFloat (NF4), LoRA adapters trained on top.

QLoRA (Dettmers et al. 2023) keeps LoRA's recipe (notebook 11: a frozen base, small adapters that
train) and shrinks the one big thing left, the frozen base weights, from 16 bits to about 4:
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
At compute time each 4-bit weight is dequantised (``level[index] * absmax``) to bf16 for the matmul; the
gradient flows through it to the adapters, the base never changes.

Everything here follows bitsandbytes' own layout (its ``quantize_4bit`` with ``quant_type="nf4"``): two
indices per byte, the first element in the high nibble, a last block that may be partial, and for the
scales its 8-bit "dynamic" code book (``dynamic_code``). ``memory_table`` gives the bf16-LoRA and QLoRA
model state of a Llama shape. On a GPU, ``compare_qlora`` fine-tunes the same model twice through
transformers' ``BitsAndBytesConfig`` and peft, bf16 LoRA and then QLoRA; bitsandbytes is imported only there.

What QLoRA stores and runs is notebook 12's exercises, stubs in the student edition: the quantiser and its round
trip (``quantize_nf4``, ``dequantize_nf4``, ``nf4_round_trip``, ``blockwise_absmax``), the storage (``pack_4bit``,
``unpack_4bit``, ``compress_absmax``, ``decompress_absmax``) and the layer (``QLoRALinear``). What measures them
(``round_trip_model``, ``layer_errors``) takes the student's as an argument. The adapters on a whole model are
``course_lib.lora``'s (peft): QLoRA is NF4 under LoRA.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import logging
import math
import tempfile
from typing import Callable, NamedTuple

import torch
from torch import nn

from course_lib.data import lm_batch
from course_lib.lora import ALL_LINEAR, apply_lora
from course_lib.memory import PeakMemory
from course_lib.models import build_llama, llama_num_parameters
from course_lib.train import fit, tokens_per_second

# The quantile of the outermost levels: halfway between 1 - 1/(2·15) and 1 - 1/(2·16), the paper's choice
# (bitsandbytes' create_normal_map(offset=0.9677083)). N(0,1)'s quantile at 1 itself would be infinite.
NF4_OFFSET = 0.5 * ((1 - 1 / (2 * 15)) + (1 - 1 / (2 * 16)))
BLOCKSIZE = 64            # weights per absmax scale (QLoRA's and bitsandbytes' default)
ABSMAX_BLOCKSIZE = 256    # scales per second-level scale, under double quantisation
ZERO_INDEX = 7            # the index of NF4's level 0.0
QLORA_TARGETS = ALL_LINEAR  # QLoRA puts adapters on every linear layer of a block (lora's own list)
INSTALL_BITSANDBYTES = ("pip install bitsandbytes (a build for your GPU stack: CUDA wheels come from PyPI; "
                        "for ROCm see bitsandbytes' installation guide)")
# bitsandbytes logs a warning on import on CPUs with AVX512-bf16 (an optional CPU kernel package is missing).
# It lands on stderr, and nbgrader scores a test cell that writes to stderr 0: peft imports bitsandbytes
# whenever it is installed, so the notebook that imports this module must not see that line.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


@functools.cache
def _nf4_levels() -> tuple[float, ...]:
    # 8 positive quantiles from NF4_OFFSET towards the median, 7 negative ones (the median itself is the 0)
    positive = torch.special.ndtri(torch.linspace(NF4_OFFSET, 0.5, 9, dtype=torch.float64)[:-1])
    negative = -torch.special.ndtri(torch.linspace(NF4_OFFSET, 0.5, 8, dtype=torch.float64)[:-1])
    levels = torch.cat([negative, torch.zeros(1, dtype=torch.float64), positive]).sort().values
    return tuple((levels / levels.max()).tolist())


def nf4_code(dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """NF4's 16 levels, ascending, from -1 to 1 with 0 at index 7: quantiles of N(0, 1), normalised.

    Derived here from the normal distribution's quantile function (``torch.special.ndtri``), in float64:
    8 quantiles from ``NF4_OFFSET`` down to 0.5 for the positive half, 7 for the negative half, and an
    exact zero, all divided by the largest.
    """
    return torch.tensor(_nf4_levels(), dtype=dtype, device=device)


def check_blocksize(blocksize: int) -> int:
    """``blocksize`` if it is a positive even integer; stops with what to pass otherwise."""
    if not isinstance(blocksize, int) or blocksize < 2 or blocksize % 2:
        raise ValueError(f"blocksize={blocksize!r}: pass a positive even integer (QLoRA uses 64)")
    return blocksize


def _blocks(w: torch.Tensor, blocksize: int) -> torch.Tensor:
    """``w`` flattened (row-major) into rows of ``blocksize``, the last one padded with zeros."""
    flat = w.detach().reshape(-1).float()
    pad = -flat.numel() % blocksize
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, blocksize)


# graded: 12_qlora_recipe nf4_quantize
def blockwise_absmax(w: torch.Tensor, blocksize: int = BLOCKSIZE) -> torch.Tensor:
    """The absolute maximum of each block of ``blocksize`` consecutive values of ``w`` (float32)."""
    return _blocks(w, check_blocksize(blocksize)).abs().amax(dim=1)


def nearest_level(x: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """The index (int64) of the level of ``code`` (ascending) nearest to each value of ``x``.

    ``bucketize`` on the midpoints between neighbouring levels: what bitsandbytes does (a value exactly
    on a midpoint goes to the lower level).
    """
    midpoints = (code[1:] + code[:-1]) / 2
    return torch.bucketize(x, midpoints)


# graded: 12_qlora_recipe nf4_storage
def pack_4bit(indices: torch.Tensor) -> torch.Tensor:
    """Indices 0..15 (any shape, row-major) → uint8, two per byte, the first in the high nibble.

    An odd count fills the last low nibble with 7, the index of the level 0 (what bitsandbytes stores there).
    """
    flat = indices.reshape(-1).to(torch.uint8)
    flat = torch.nn.functional.pad(flat, (0, flat.numel() % 2), value=ZERO_INDEX)
    return (flat[0::2] << 4) | flat[1::2]


# graded: 12_qlora_recipe nf4_storage
def unpack_4bit(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` indices (int64) held in ``packed`` (``pack_4bit``'s layout)."""
    pairs = torch.stack([packed >> 4, packed & 0xF], dim=1)
    return pairs.reshape(-1)[:n].long()


# graded: 12_qlora_recipe nf4_quantize
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


# graded: 12_qlora_recipe nf4_quantize
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


# graded: 12_qlora_recipe nf4_storage
def compress_absmax(absmax: torch.Tensor, blocksize: int = ABSMAX_BLOCKSIZE) -> CompressedAbsmax:
    """Double quantisation: absmax − mean, in blocks of ``blocksize``, each as 8-bit codes of its own absmax."""
    offset = absmax.float().mean()
    centred = _blocks(absmax.float() - offset, check_blocksize(blocksize))
    scales = centred.abs().amax(dim=1)
    scaled = centred / scales.clamp(min=torch.finfo(torch.float32).tiny)[:, None]
    codes = nearest_level(scaled, dynamic_code(absmax.device)).reshape(-1)[: absmax.numel()].to(torch.uint8)
    return CompressedAbsmax(codes, scales, offset)


# graded: 12_qlora_recipe nf4_storage
def decompress_absmax(c: CompressedAbsmax, blocksize: int = ABSMAX_BLOCKSIZE) -> torch.Tensor:
    """The absmax scales that ``compress_absmax`` stored (to its 8-bit precision)."""
    n = c.codes.numel()
    values = torch.nn.functional.pad(dynamic_code(c.codes.device)[c.codes.long()], (0, -n % blocksize))
    return (values.view(-1, blocksize) * c.scales[:, None]).reshape(-1)[:n] + c.offset


# graded: 12_qlora_recipe nf4_quantize
def nf4_round_trip(w: torch.Tensor, blocksize: int = BLOCKSIZE, double_quant: bool = True) -> torch.Tensor:
    """``w`` quantised to NF4 and back (what a QLoRA matmul computes with), in ``w``'s dtype and shape."""
    packed, absmax = quantize_nf4(w, blocksize)
    if double_quant:
        absmax = decompress_absmax(compress_absmax(absmax))
    return dequantize_nf4(packed, absmax, w.shape, blocksize, dtype=w.dtype)


# graded: 12_qlora_recipe QLoRALinear
class QLoRALinear(nn.Module):
    """QLoRA's layer: ``base``'s weight stored in NF4, dequantised on the fly in every forward, beside LoRA adapters
    of rank ``r`` (``lora_A``, ``lora_B``: the only parameters that train; ``B`` starts at zero).

    It keeps no float copy of the weight. Its buffers are what QLoRA stores: ``packed`` (uint8, two codes a byte),
    ``absmax_codes`` (uint8), ``absmax_scales`` and ``absmax_offset`` (float32), ``stored_bytes`` in all; the bias,
    if any, stays as it was, frozen. Each forward dequantises the weight to the input's dtype (bf16 under autocast,
    QLoRA's compute dtype): the gradient flows through it to the input and the adapters, the base never changes.
    """

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0, blocksize: int = BLOCKSIZE):
        super().__init__()
        self.shape, self.blocksize = tuple(base.weight.shape), blocksize
        packed, absmax = quantize_nf4(base.weight, blocksize)
        self.register_buffer("packed", packed)
        for name, part in zip(("absmax_codes", "absmax_scales", "absmax_offset"), compress_absmax(absmax)):
            self.register_buffer(name, part)
        self.bias = None if base.bias is None else nn.Parameter(base.bias.detach().clone(), requires_grad=False)
        kw = dict(bias=False, device=base.weight.device)
        self.lora_A, self.lora_B = nn.Linear(base.in_features, r, **kw), nn.Linear(r, base.out_features, **kw)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.scaling = alpha / r
        self.dropout = nn.Dropout(dropout)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the buffers hold, in ``dtype``: made anew at every call, never kept."""
        absmax = decompress_absmax(CompressedAbsmax(self.absmax_codes, self.absmax_scales, self.absmax_offset))
        return dequantize_nf4(self.packed, absmax, self.shape, self.blocksize, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        y = nn.functional.linear(x, self.dequantized_weight(x.dtype), bias)
        return y + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling


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


def _quantized_shapes(config) -> dict[str, tuple[int, int]]:
    """(in, out) of every linear layer QLoRA quantises in a Llama of ``config``, by module name: read from
    transformers' own modules, built on the meta device (no storage: a tenth of a second for 70B)."""
    from transformers import LlamaForCausalLM  # heavy: only when a table is asked for

    with torch.device("meta"):
        model = LlamaForCausalLM(copy.deepcopy(config))  # a copy: transformers writes into the config it is given
    return {name: (m.in_features, m.out_features) for name, m in quantized_linears(model).items()}


def adapter_parameters(config, r: int = 16, targets: tuple[str, ...] = QLORA_TARGETS) -> int:
    """LoRA's trainable parameters on a Llama of ``config``: r·(in + out) for every linear layer named in
    ``targets``, the shapes read from transformers' own modules (as peft finds them), not from a formula."""
    shapes = _quantized_shapes(config)
    kinds = sorted({name.rsplit(".", 1)[-1] for name in shapes})  # q_proj, ..., down_proj
    if unknown := set(targets) - set(kinds):
        raise ValueError(f"targets {sorted(unknown)} are not linear layers of a Llama; use some of {kinds}")
    return sum(r * (i + o) for name, (i, o) in shapes.items() if name.rsplit(".", 1)[-1] in targets)


def memory_table(config, r: int = 16, targets: tuple[str, ...] = QLORA_TARGETS, blocksize: int = BLOCKSIZE,
                 double_quant: bool = True) -> dict[str, dict[str, float]]:
    """Model state in bytes of a LoRA fine-tune of a Llama ``config``: bf16 base vs NF4 base (QLoRA).

    Base: bf16 LoRA keeps every weight in 2 bytes; QLoRA stores the decoder's linear layers in
    ``bits_per_parameter`` bits and the rest (embeddings, norms, LM head) in bf16. Adapters of rank ``r``
    on ``targets`` in every layer, the same for both: fp32 weights (4 bytes) with fp32 gradients (4) and
    AdamW's two moments (8). Activations come on top and are the same for both (they grow with batch × sequence).
    """
    shapes = _quantized_shapes(config)
    total = llama_num_parameters(config)
    linear = sum(i * o for i, o in shapes.values())
    adapters = adapter_parameters(config, r, targets)
    nf4_bytes = linear * bits_per_parameter(blocksize, double_quant) / 8 + (total - linear) * 2
    rows = {"bf16 LoRA": {"base weights": 2.0 * total}, "QLoRA (NF4)": {"base weights": nf4_bytes}}
    for row in rows.values():
        row.update({"adapters (fp32)": 4.0 * adapters, "adapter gradients + AdamW": 12.0 * adapters})
        row["total"] = sum(row.values())
    return rows


def bitsandbytes_error() -> str | None:
    """None if bitsandbytes imports here; otherwise why not, with the command that installs it."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return f"bitsandbytes is not installed: {INSTALL_BITSANDBYTES}"
    try:
        import bitsandbytes  # noqa: F401
    except Exception as err:  # a build for another GPU stack fails at import with many error types
        return f"bitsandbytes is installed but does not import ({type(err).__name__}: {err}): {INSTALL_BITSANDBYTES}"
    return None


PROBE_TOLERANCE = 0.02  # relative RMS: bf16 rounding of a right answer is ~0.4%; a wrong kernel is off by far more
NF4_ERROR_BOUND = 0.15  # relative RMS of NF4 itself on normal weights is ~0.1; a weight out of place is ~1 (or nan)


def nf4_exact_weight(rows: int, cols: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """A float32 weight that NF4 stores exactly: each block of ``BLOCKSIZE`` values is NF4 levels times one
    scale, and holds the level 1.0 once (so the scale is its absmax). Its round trip is the weight itself,
    to the precision its scale is stored in: a reference that needs no quantiser."""
    n = rows * cols
    if n % BLOCKSIZE:
        raise ValueError(f"rows x cols = {n} is not a multiple of {BLOCKSIZE}: pick whole blocks")
    blocks = torch.randint(0, 16, (n // BLOCKSIZE, BLOCKSIZE), generator=generator)
    blocks[:, 0] = 15  # the level 1.0 in every block ...
    blocks = blocks[:, torch.randperm(BLOCKSIZE, generator=generator)]  # ... somewhere in it
    scales = 0.01 * (1 + torch.rand(n // BLOCKSIZE, 1, generator=generator))  # scales of neighbouring blocks: within 2x
    return (nf4_code()[blocks] * scales).reshape(rows, cols)


@functools.lru_cache(maxsize=None)
def bitsandbytes_4bit_runs(device: str = "cuda") -> str | None:
    """None if bitsandbytes' 4-bit NF4 path runs on ``device`` and computes what it should; else why not.

    An installed bitsandbytes can import and still have no kernels for this GPU stack (a CUDA wheel on
    ROCm, a build for another CUDA): then ``from_pretrained`` fails mid-cell. So this runs what QLoRA
    runs, once, on a 64×64 bf16 weight: ``quantize_4bit`` (NF4, double quantisation), ``dequantize_4bit``,
    and ``matmul_4bit`` forward and backward. The weight is one NF4 stores exactly (``nf4_exact_weight``), so
    the dequantised weight must be the weight, and the product ``x @ dequantised.T``, to ``PROBE_TOLERANCE``.
    Remembered per device; the same contract as ``fp8_compute.scaled_mm_runs``: what a preflight calls.
    """
    if error := bitsandbytes_error():
        return error
    try:
        from bitsandbytes import functional as bnb_functional
        from bitsandbytes import matmul_4bit

        g = torch.Generator().manual_seed(0)
        w = nf4_exact_weight(64, 64, g).to(device, torch.bfloat16)
        x = torch.randn(4, 64, generator=g).to(device, torch.bfloat16).requires_grad_()
        q, state = bnb_functional.quantize_4bit(w, blocksize=BLOCKSIZE, quant_type="nf4", compress_statistics=True)
        back = bnb_functional.dequantize_4bit(q, state).float().cpu()
        y = matmul_4bit(x, q.t(), quant_state=state)
        y.float().sum().backward()
        y, grad = y.detach().float().cpu(), x.grad.float().cpu()
    except Exception as err:  # noqa: BLE001 (a missing kernel raises anything from AssertionError to a CUDA error)
        first = (str(err).splitlines() or [""])[0][:200]
        return (f"bitsandbytes imports but its 4-bit kernels do not run on {device} ({type(err).__name__}: {first}): "
                f"{INSTALL_BITSANDBYTES}")
    return _probe_mismatch(device, w.float().cpu(), x.detach().float().cpu(), back, y, grad,
                           weight_tolerance=PROBE_TOLERANCE)


def _probe_mismatch(device: str, w: torch.Tensor, x: torch.Tensor, back: torch.Tensor, y: torch.Tensor,
                    grad: torch.Tensor, weight_tolerance: float = NF4_ERROR_BOUND) -> str | None:
    """Why bitsandbytes' probe results are wrong (weights, product or gradient), or None when they are right.

    The dequantised weight ``back`` must be within ``weight_tolerance`` of ``w`` (relative RMS): NF4's own error
    for any weight, ``PROBE_TOLERANCE`` for one that NF4 stores exactly (``nf4_exact_weight``).
    """
    errors = {"dequantised weight": relative_rms_error(back, w),
              "matmul_4bit output": relative_rms_error(y, x @ back.t()),
              "matmul_4bit input gradient": relative_rms_error(grad, torch.ones_like(y) @ back)}
    tolerance = {"dequantised weight": weight_tolerance}
    wrong = {k: v for k, v in errors.items() if not v <= tolerance.get(k, PROBE_TOLERANCE)}  # nan is wrong too
    if wrong:
        return (f"bitsandbytes' 4-bit kernels run on {device} but compute wrong values (relative error "
                + ", ".join(f"{k} {v:.2g}" for k, v in wrong.items()) + f"): {INSTALL_BITSANDBYTES}")
    return None


def qlora_support(device: torch.device | str) -> str | None:
    """None where ``compare_qlora`` can run on ``device``; otherwise what it needs, in words.

    On a GPU that is bitsandbytes' 4-bit path really running there (``bitsandbytes_4bit_runs``), not
    only importing."""
    device = torch.device(device)
    if device.type != "cuda":
        return (f"the QLoRA comparison measures GPU memory and speed, so it needs a GPU (CUDA or ROCm) with "
                f"bitsandbytes; this notebook runs on {device.type}")
    return bitsandbytes_4bit_runs(str(device))


def bnb_config(compute_dtype: torch.dtype = torch.bfloat16, double_quant: bool = True):
    """transformers' ``BitsAndBytesConfig`` for QLoRA: 4-bit NF4 base, double quantisation, bf16 compute."""
    from transformers import BitsAndBytesConfig

    if error := bitsandbytes_error():
        raise ImportError(error)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=double_quant,
                              bnb_4bit_compute_dtype=compute_dtype)


def save_random_llama(preset: str, path: str, seed: int = 0, **overrides) -> str:
    """A Llama of ``preset`` (``overrides`` such as ``intermediate_size=256``) with random weights saved in bf16
    under ``path`` (for ``from_pretrained``)."""
    model = build_llama(preset, seed=seed, **overrides)
    model.config._attn_implementation = "sdpa"  # the saved config must load without course_lib's attention
    model.to(torch.bfloat16).save_pretrained(path)
    del model
    return path


def load_lora_model(path: str, *, quantize: bool, device: torch.device | str, r: int = 16, alpha: int = 32,
                    seed: int = 0) -> nn.Module:
    """The checkpoint at ``path`` with LoRA adapters (peft) on ``QLORA_TARGETS``: its base in bf16, or,
    with ``quantize``, in NF4 through ``BitsAndBytesConfig`` (QLoRA). Adapters start from ``seed``."""
    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, attn_implementation="sdpa", device_map={"": device},
        quantization_config=bnb_config() if quantize else None)
    model.config.use_cache = False
    torch.manual_seed(seed)
    return apply_lora(model, r=r, alpha=alpha, target_modules=QLORA_TARGETS)


def lora_run(path: str, *, quantize: bool, steps: int, batch: int, seq: int, device: torch.device | str,
             lr: float = 1e-4, warmup: int = 2, seed: int = 0, **lora) -> dict:
    """Load ``path`` for LoRA (``load_lora_model``) and train ``steps`` steps of bf16 autocast on ``lm_batch`` rows.

    Returns every step's loss, tokens/s over the steps after ``warmup``, the memory the loaded model holds
    (``weights_bytes``: base and adapters) and the peak memory of the whole run (GPU only; None on a CPU).
    """
    device = torch.device(device)
    if steps <= warmup:
        raise ValueError(f"steps={steps} must exceed warmup={warmup}: the first steps are not timed")
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    with PeakMemory(device) as peak:
        model = load_lora_model(path, quantize=quantize, device=device, seed=seed, **lora)
        weights = torch.cuda.memory_allocated(device) - before if before is not None else None
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, fused=device.type == "cuda")
        vocab = model.config.vocab_size
        history = fit(model, opt, lambda step: lm_batch(step, batch, seq, vocab, seed).to(device), steps,
                      amp_dtype=torch.bfloat16, progress=False)
        del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"losses": [r["loss"] for r in history], "tokens_per_s": tokens_per_second(history, batch * seq, warmup),
            "weights_bytes": weights, "peak_bytes": peak.peak, "quantized": quantize}


def compare_qlora(model_name: str | None = None, *, preset: str = "1b", steps: int, batch: int, seq: int,
                  device: torch.device | str, seed: int = 0, **kwargs) -> dict[str, dict]:
    """bf16 LoRA, then QLoRA, from the same checkpoint on the same batches (``lora_run`` twice).

    ``model_name`` (a hub name or a folder) is loaded as it is; without it a ``preset`` Llama with random
    weights is saved to a temporary folder first. Stops first, with what is missing, where
    ``qlora_support`` says QLoRA cannot run.
    """
    if why_not := qlora_support(device):
        raise RuntimeError(why_not)
    with tempfile.TemporaryDirectory(prefix="qlora_") as tmp:
        path = model_name or save_random_llama(preset, tmp, seed)
        kw = dict(steps=steps, batch=batch, seq=seq, device=device, seed=seed, **kwargs)
        return {"bf16 LoRA": lora_run(path, quantize=False, **kw), "QLoRA (NF4)": lora_run(path, quantize=True, **kw)}
