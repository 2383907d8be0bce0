"""FP8 numbers: the two 8-bit float formats, and the scales that fit a tensor into them (per-tensor, delayed).

An FP8 number has 8 bits: a sign, then exponent and mantissa bits in one of two splits.
- **e4m3** (``torch.float8_e4m3fn``): 4 exponent bits, 3 mantissa bits, max 448, no inf ("fn": finite);
  weights and activations, which need precision more than range.
- **e5m2** (``torch.float8_e5m2``): 5 exponent bits, 2 mantissa bits, max 57344, with inf; gradients,
  whose magnitudes spread over more octaves.
AMD's MI300X (gfx942) computes in the "fnuz" variants (``float8_e4m3fnuz``, max 240; ``float8_e5m2fnuz``, max
57344): finite, no negative zero (its bit pattern is the one NaN), exponent bias one higher. torch casts
anything past their max to NaN (480 in e4m3fnuz), so a quantiser must clamp first. OCP's e4m3fn/e5m2
arrive on AMD with gfx950 (MI350X, MI355X).

Either range is far too narrow for raw tensors, so every FP8 tensor travels with a **scale**: store
``q = cast(clamp(x * scale))`` with ``scale = fp8_max / amax(x)``, compute with ``q``, and divide by
the scale afterwards (``torch._scaled_mm`` takes the inverse scales and does it inside the matmul).
*Current* (just-in-time) scaling measures this tensor's amax first: one more pass over the data.
*Delayed* scaling (Transformer Engine's default on Hopper and Ada; its default is MXFP8 block scaling
on Blackwell, and torchao dropped delayed scaling in 0.10) takes the scale from the amaxes of the
previous steps (a history of length N) and records this step's amax for the next: no extra pass, but
a tensor whose amax jumps past the history's overflows and must be clamped (saturated) to ±max.

The formats' facts are read from ``torch.finfo`` and from torch's own casts, never typed in. Computing
in FP8 (the scaled matmul, its error and speed, training through torchao) is ``course_lib.fp8_compute``.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from course_lib.device import gpu_architecture

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2,
              "e4m3fnuz": torch.float8_e4m3fnuz, "e5m2fnuz": torch.float8_e5m2fnuz}
# The formats next to each other in the notebook's table: the 16- and 32-bit ones for comparison, OCP's FP8
# (NVIDIA Ada/Hopper/Blackwell, AMD gfx950) and the FNUZ variants an MI300X (gfx942) computes in.
TABLE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
                "fp8 e4m3": torch.float8_e4m3fn, "fp8 e5m2": torch.float8_e5m2,
                "fp8 e4m3fnuz": torch.float8_e4m3fnuz, "fp8 e5m2fnuz": torch.float8_e5m2fnuz}


# The AMD architectures that compute in the fnuz formats: CDNA 3 (MI300A, MI300X, MI325X). CDNA 4's gfx950
# (MI350X, MI355X) computes in OCP's e4m3fn/e5m2, as NVIDIA's Ada, Hopper and Blackwell do. torchao and
# AMD's own kernels decide the same way (torchao's float8 config: fnuz on gfx940/941/942).
FNUZ_ARCHS = ("gfx940", "gfx941", "gfx942")


def device_arch(device: torch.device | str) -> str:
    """``device``'s architecture as a name: "cpu"; "sm_90" for an NVIDIA GPU of compute capability 9.0;
    ROCm's ``gcnArchName`` without its feature flags ("gfx942") for an AMD GPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    # device's one reading of the architecture, "gfx942:sramecc+:xnack-" or "sm_90 (CUDA compute capability 9.0)"
    return gpu_architecture(device.index or 0).split()[0].split(":")[0]


def fp8_formats(arch: str) -> tuple[torch.dtype, torch.dtype]:
    """(e4m3, e5m2) as the architecture ``arch`` computes them (``device_arch``'s names: "gfx942", "sm_90", "cpu").

    The fnuz variants (e4m3fnuz, max 240; e5m2fnuz) on CDNA 3 (``FNUZ_ARCHS``: MI300X, MI325X), OCP's
    e4m3fn (max 448) and e5m2 everywhere else, gfx950 (MI350X/MI355X) included. OCP operands on an
    MI300X are refused by its FP8 GEMM, so the product would only be emulated there.
    """
    if arch.split(":")[0] in FNUZ_ARCHS:
        return torch.float8_e4m3fnuz, torch.float8_e5m2fnuz
    return torch.float8_e4m3fn, torch.float8_e5m2


def device_fp8_dtypes(device: torch.device | str) -> tuple[torch.dtype, torch.dtype]:
    """(e4m3, e5m2) as ``device`` computes them: ``fp8_formats`` of its ``device_arch``."""
    return fp8_formats(device_arch(device))


def check_fp8_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``"e4m3"``, ``"e5m2"`` (or their fnuz variants) or an FP8 torch dtype → the torch dtype; anything else stops."""
    if isinstance(dtype, str) and dtype in FP8_DTYPES:
        return FP8_DTYPES[dtype]
    if isinstance(dtype, torch.dtype) and dtype in FP8_DTYPES.values():
        return dtype
    raise ValueError(f"dtype={dtype!r} is not an FP8 dtype: use one of {sorted(FP8_DTYPES)} "
                     "or torch.float8_e4m3fn / torch.float8_e5m2")


def fp8_max(dtype: torch.dtype | str) -> float:
    """The largest finite value of an FP8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    return float(torch.finfo(check_fp8_dtype(dtype)).max)


def overflow_threshold(dtype: torch.dtype) -> float:
    """The magnitude from which values no longer round to the max: max plus half its step (464 for e4m3fn,
    61440 for e5m2). Between max and this they round down to max like any other value; beyond, they overflow."""
    fi = torch.finfo(dtype)
    return float(fi.max) + 2.0 ** math.floor(math.log2(fi.max)) * float(fi.eps) / 2


def cast_past_max(dtype: torch.dtype) -> dict[str, float]:
    """What torch's cast does to values beyond ``dtype``'s max, measured: 2·max and inf, cast and read back.

    The answer depends on the format and the torch version: e4m3fn has no inf, and older torch cast overflow
    to nan where newer torch saturates to ±448; e5m2 overflows to inf; the fnuz formats have no inf and
    torch 2.13 casts overflow to their one NaN. A quantiser that clamps first does not depend on which.
    """
    fmax = float(torch.finfo(dtype).max)
    out = torch.tensor([2 * fmax, math.inf]).to(dtype).float()
    return {"2*max": float(out[0]), "inf": float(out[1])}


def _describe(value: float, fmax: float) -> str:
    return "nan" if math.isnan(value) else "inf" if math.isinf(value) else f"saturates to {value:g}" if value == fmax \
        else f"{value:g}"


def step_after_one(dtype: torch.dtype) -> float:
    """The gap between 1.0 and the next value of ``dtype`` (2^-mantissa bits), measured by casting 1 + 2^-k.

    Not ``torch.finfo(dtype).eps``: torch 2.13's finfo gives e5m2fnuz (2 mantissa bits) an eps of 0.125."""
    k = 1
    while float(torch.tensor(1.0 + 2.0**-k, dtype=torch.float64).to(dtype).double()) == 1.0 + 2.0**-k:
        k += 1
    return 2.0 ** -(k - 1)


def special_values(dtype: torch.dtype) -> dict:
    """Whether ``dtype`` has inf and -0, and how many of its bit patterns are NaN: every pattern enumerated
    for formats of up to 16 bits; float32's 2^32 are too many, its count follows IEEE 754 (all-ones exponent,
    nonzero mantissa, either sign)."""
    fi = torch.finfo(dtype)
    if fi.bits <= 16:
        uint = {8: torch.uint8, 16: torch.uint16}[fi.bits]
        every = torch.arange(2**fi.bits, dtype=torch.int32).to(uint).view(dtype).float()
        return {"NaN patterns": int(every.isnan().sum()), "inf": bool(every.isinf().any()),
                "-0": bool(((every == 0) & every.signbit()).any())}
    mantissa = round(-math.log2(step_after_one(dtype)))
    zero = torch.tensor(-0.0).to(dtype)
    return {"NaN patterns": 2 * (2**mantissa - 1), "inf": bool(torch.tensor(math.inf).to(dtype).isinf()),
            "-0": bool(zero.signbit())}


def format_facts(dtype: torch.dtype) -> dict:
    """One row of the formats table: bits, exponent and mantissa bits, max, smallest normal and subnormal, eps,
    the special values (``special_values``) and (for FP8, measured) what a cast past max gives."""
    fi = torch.finfo(dtype)
    eps = step_after_one(dtype)
    mantissa = round(-math.log2(eps))  # eps = 2^-mantissa bits: the step after 1.0
    row = {"bits": fi.bits, "exponent bits": fi.bits - 1 - mantissa, "mantissa bits": mantissa,
           "max": float(fi.max), "smallest normal": float(fi.tiny), "smallest subnormal": float(fi.tiny) * eps,
           "eps (step after 1.0)": eps, **special_values(dtype)}
    if dtype in FP8_DTYPES.values():
        past = cast_past_max(dtype)
        row["cast of 2*max"] = _describe(past["2*max"], fi.max)
        row["cast of inf"] = _describe(past["inf"], fi.max)
    else:
        row["cast of 2*max"] = row["cast of inf"] = "inf"
    return row


def format_table(dtypes: dict[str, torch.dtype] = TABLE_DTYPES) -> list[dict]:
    """``format_facts`` of each named dtype, as rows with a "type" column."""
    return [{"type": name, **format_facts(dt)} for name, dt in dtypes.items()]


def round_trip(values, dtypes: dict[str, torch.dtype] = TABLE_DTYPES) -> list[dict]:
    """Each value (a float32 number) stored in each dtype and read back: what rounds to zero, what saturates."""
    values = [float(v) for v in values]
    x = torch.tensor(values, dtype=torch.float64)  # float64: the fp32 column shows float32's own rounding
    return [{"value": v, **{name: float(r) for name, r in zip(dtypes, rs)}}
            for v, *rs in zip(values, *(x.to(dt).float().tolist() for dt in dtypes.values()))]


def amax(x: torch.Tensor) -> float:
    """The largest magnitude in ``x`` (0.0 for an empty tensor)."""
    return float(x.detach().abs().max()) if x.numel() else 0.0


def scale_for(amax_value: float, dtype: torch.dtype, margin: int = 0, fallback: float = 1.0) -> float:
    """The per-tensor scale that maps ``amax_value`` to the FP8 max, divided by ``2**margin`` (headroom).

    An amax of 0 (an all-zero tensor) or inf/nan gives no information: the ``fallback`` scale is kept,
    as Transformer Engine does, instead of dividing by zero.
    """
    if not math.isfinite(amax_value) or amax_value <= 0:
        return fallback
    return fp8_max(dtype) / amax_value / 2.0**margin


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x * scale`` clamped to ±max of ``dtype`` and cast: values past the range saturate instead of
    becoming inf (e5m2) or, on older torch, nan (e4m3fn)."""
    dtype = check_fp8_dtype(dtype)
    fmax = fp8_max(dtype)
    return (x.float() * scale).clamp(-fmax, fmax).to(dtype)


def dequantize(q: torch.Tensor, scale: float) -> torch.Tensor:
    """An FP8 tensor back in float32 units: ``q / scale``."""
    return q.float() / scale


# graded: 02_fp8 DelayedScalingFP8
class DelayedScaler:
    """Per-tensor FP8 quantisation with delayed scaling (Transformer Engine's ``DelayedScaling`` recipe, by hand).

    Each call quantises with the current ``scale``, computed from the amaxes of the *previous* calls, then
    appends this call's amax to ``amax_history`` (the last ``history_len`` of them, oldest first) and
    recomputes the scale for the next call: ``fp8_max / max(history) / 2**margin``. The first call uses 1.0.
    """

    def __init__(self, dtype: torch.dtype = torch.float8_e4m3fn, history_len: int = 16, margin: int = 0):
        if history_len < 1:
            raise ValueError(f"history_len={history_len} must be at least 1 (1: the previous step's amax alone)")
        self.dtype, self.history_len, self.margin = check_fp8_dtype(dtype), history_len, margin
        self.amax_history: list[float] = []
        self.scale = 1.0

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        """``(fp8 tensor, the scale it was quantised with)``; then the history and the scale move on."""
        used = self.scale
        q = quantize(x, used, self.dtype)
        self.amax_history = (self.amax_history + [amax(x)])[-self.history_len:]
        self.scale = scale_for(max(self.amax_history), self.dtype, self.margin, fallback=self.scale)
        return q, used

    def dequantize(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        """``q`` back in float32 units."""
        return dequantize(q, scale)


def current_scaler(dtype: torch.dtype = torch.float8_e4m3fn, margin: int = 0) -> Callable:
    """A quantiser with current (just-in-time) scaling: each tensor scaled by its own amax, as torchao's default."""
    dtype = check_fp8_dtype(dtype)

    def quantise(x: torch.Tensor) -> tuple[torch.Tensor, float]:
        scale = scale_for(amax(x), dtype, margin)
        return quantize(x, scale, dtype), scale

    return quantise


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖out − ref‖ / ‖ref‖`` (Frobenius norms, in float64): the error of a whole product, one number."""
    out, ref = out.detach().double(), ref.detach().double()
    return float((out - ref).norm() / ref.norm())


def flushed_fraction(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> dict[str, float]:
    """Fractions of the nonzero values of ``x`` that ``quantize(x, scale, dtype)`` sends to 0, to a subnormal,
    or that saturate at ±max.

    Counted on what the cast stores: a value just below the smallest normal that rounds up to it is normal,
    one at half the smallest subnormal or below rounds (to even) to 0. In e4m3fn (smallest normal 2^-6 =
    0.015625) about half of N(0, 0.02) weights are subnormal and about 4% become 0."""
    v = x.detach().float().flatten()
    v = v[v != 0]
    q = quantize(v, scale, dtype).float()
    fi = torch.finfo(dtype)
    n = max(v.numel(), 1)
    return {"zero": float((q == 0).sum()) / n, "subnormal": float(((q.abs() < fi.tiny) & (q != 0)).sum()) / n,
            "saturated": float(((v * scale).abs() >= overflow_threshold(dtype)).sum()) / n}


def drifting_stream(steps: int, n: int = 64, *, growth: float = 1.05, spike_at: int | None = None,
                    spike: float = 8.0, seed: int = 0) -> list[torch.Tensor]:
    """``steps`` activation-like tensors (n × n) whose amax grows by ``growth`` per step, with one ``spike``
    times larger at step ``spike_at``: what a delayed scale has to follow during training."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in range(steps):
        x = torch.randn(n, n, generator=g) * growth**t
        out.append(x * spike if t == spike_at else x)
    return out


def scaling_trace(quantise: Callable[[torch.Tensor], tuple[torch.Tensor, float]], stream: list[torch.Tensor],
                  dtype: torch.dtype) -> dict[str, list]:
    """Run a quantiser (``x -> (fp8 tensor, scale)``: yours, or ``current_scaler``'s) over a stream of tensors.

    Per step: the scale used, how full it makes the range (``amax · scale / fp8_max``: above 1 the largest
    values saturate), the fraction of values past ``overflow_threshold`` (clamped to ±max), the relative error
    of the dequantised tensor, and whether every quantised value is finite.
    """
    fmax, over = fp8_max(dtype), overflow_threshold(dtype)
    trace: dict[str, list] = {"scale": [], "fill": [], "saturated": [], "error": [], "finite": []}
    for x in stream:
        q, scale = quantise(x)
        scale = float(scale)
        trace["scale"].append(scale)
        trace["fill"].append(amax(x) * scale / fmax)
        trace["saturated"].append(float(((x.float() * scale).abs() >= over).float().mean()))
        trace["error"].append(relative_error(q.float() / scale, x))
        trace["finite"].append(bool(torch.isfinite(q.float()).all()))
    return trace

