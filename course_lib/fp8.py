"""FP8: two 8-bit float formats, per-tensor scaling, delayed scaling, and FP8 training on a GPU.

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

The formats' facts are read from ``torch.finfo`` and from torch's own casts, never typed in.
The GPU training path (``train_llama``) uses torchao's float8 training, imported only when asked for.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from typing import Callable, NamedTuple

import torch
from torch import nn

from course_lib.data import lm_batch
from course_lib.device import gpu_architecture
from course_lib.memory import PeakMemory
from course_lib.models import build_llama
from course_lib.throughput import time_interleaved
from course_lib.train import fit, tokens_per_second

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2,
              "e4m3fnuz": torch.float8_e4m3fnuz, "e5m2fnuz": torch.float8_e5m2fnuz}
# The formats next to each other in the notebook's table: the 16- and 32-bit ones for comparison, OCP's FP8
# (NVIDIA Ada/Hopper/Blackwell, AMD gfx950) and the FNUZ variants an MI300X (gfx942) computes in.
TABLE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
                "fp8 e4m3": torch.float8_e4m3fn, "fp8 e5m2": torch.float8_e5m2,
                "fp8 e4m3fnuz": torch.float8_e4m3fnuz, "fp8 e5m2fnuz": torch.float8_e5m2fnuz}
INSTALL_TORCHAO = "pip install torchao (0.18 or newer; it must match your torch build)"


# The AMD architectures that compute in the fnuz formats: CDNA 3 (MI300A, MI300X, MI325X). CDNA 4's gfx950
# (MI350X, MI355X) computes in OCP's e4m3fn/e5m2, as NVIDIA's Ada, Hopper and Blackwell do. torchao and
# AMD's own kernels decide the same way (torchao's float8 config: fnuz on gfx940/941/942).
FNUZ_ARCHS = ("gfx940", "gfx941", "gfx942")
FP8_AMD_ARCHS = FNUZ_ARCHS + ("gfx950",)  # AMD GPUs with FP8 matrix cores, for training


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


class MatmulResult(NamedTuple):
    """An FP8 matmul's float32 output and which code computed it."""

    out: torch.Tensor
    path: str


SCALED_MM = "torch._scaled_mm"
EMULATED = "emulated: dequantized to float32, float32 matmul"


@functools.lru_cache(maxsize=None)
def scaled_mm_runs(device_type: str, dtype_a: torch.dtype, dtype_b: torch.dtype) -> str | None:
    """None if ``torch._scaled_mm`` runs an ``dtype_a`` × ``dtype_b`` matmul on this device type, else why not.

    Tried once on 16×16 operands (the smallest shape CUDA's kernels take) and remembered: a CPU build of
    recent torch has a kernel (oneDNN's), an NVIDIA GPU needs compute capability 8.9 (Ada, Hopper) or newer,
    an AMD one the fnuz dtypes on MI300X.
    """
    device = torch.device(device_type)
    a = torch.ones(16, 16, device=device).to(dtype_a)
    b = torch.ones(16, 16, device=device).to(dtype_b).t()  # column-major, as cuBLASLt wants it
    one = torch.ones((), device=device)
    try:
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32)
    except Exception as err:  # torch 2.11 refuses e5m2 x e5m2 on an H200 with a ValueError, others a RuntimeError
        return f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
    return None


def _scaled_mm_fits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return all(n % 16 == 0 for n in (*a.shape, b.shape[1]))


def fp8_matmul(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, *,
               scaled: bool = True, dtype_b: torch.dtype | None = None) -> MatmulResult:
    """``a @ b`` with both operands quantised to FP8, one scale per tensor (current scaling), in float32 units.

    ``scaled=False`` casts the operands as they are (scale 1): what FP8 without scaling loses. The product
    runs in ``torch._scaled_mm`` where this device has it (and every dimension is a multiple of 16),
    otherwise the quantised operands are dequantised and multiplied in float32: the same numbers, without
    the speed. ``MatmulResult.path`` says which ran.
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"fp8_matmul multiplies two matrices (m, k) @ (k, n): got {tuple(a.shape)} @ {tuple(b.shape)}")
    dtype_a, dtype_b = check_fp8_dtype(dtype), check_fp8_dtype(dtype_b or dtype)
    sa = scale_for(amax(a), dtype_a) if scaled else 1.0
    sb = scale_for(amax(b), dtype_b) if scaled else 1.0
    qa = quantize(a.contiguous(), sa, dtype_a)  # row-major, as the FP8 GEMM kernels want it
    qb = quantize(b.t().contiguous(), sb, dtype_b).t()  # column-major: b's transpose quantised row by row
    if _scaled_mm_fits(a, b) and scaled_mm_runs(a.device.type, dtype_a, dtype_b) is None:
        inv = [torch.tensor(1.0 / s, device=a.device, dtype=torch.float32) for s in (sa, sb)]
        out = torch._scaled_mm(qa, qb, scale_a=inv[0], scale_b=inv[1], out_dtype=torch.float32)
        return MatmulResult(out, SCALED_MM)
    return MatmulResult(dequantize(qa, sa) @ dequantize(qb, sb), EMULATED)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖out − ref‖ / ‖ref‖`` (Frobenius norms, in float64): the error of a whole product, one number."""
    out, ref = out.detach().double(), ref.detach().double()
    return float((out - ref).norm() / ref.norm())


def outlier_operands(n: int, *, outlier_channels: int = 4, outlier_scale: float = 200.0, weight_std: float = 0.02,
                     seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """An activation ``x`` (n × n) and a weight ``w`` (n × n) shaped like a transformer's.

    ``x`` is standard normal except ``outlier_channels`` feature columns ``outlier_scale`` times larger
    (LLM activations have a few such channels, LLM.int8() measured them); ``w`` is normal with the
    initialisation's ``weight_std``, so most of its values sit far below 1.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, n, generator=g)
    cols = torch.randperm(n, generator=g)[:outlier_channels]
    x[:, cols] *= outlier_scale
    return x, torch.randn(n, n, generator=g) * weight_std


def matmul_errors(x: torch.Tensor, w: torch.Tensor,
                  formats: tuple[torch.dtype, torch.dtype] | None = None) -> dict[str, dict]:
    """The relative error of ``x @ w`` in each format against the float64 product, and the code that ran.

    Keys: ``bf16``, ``fp16`` (operands rounded to 16 bits, the product accumulated in float32, as tensor cores do);
    ``e4m3_unscaled`` and ``e4m3_scaled`` (``fp8_matmul`` without and with per-tensor scales: the forward pass's
    GEMM); ``e5m2_e4m3_scaled``, the precision the backward's GEMMs get (their gradient operand is e5m2).
    The FP8 formats are ``formats`` (e4m3, e5m2), by default those ``x``'s device computes in
    (``device_fp8_dtypes``: the fnuz variants on an MI300X); the labels name them.
    """
    ref = x.double() @ w.double()
    out = {}
    for key, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        got = x.to(dt).float() @ w.to(dt).float()
        out[key] = {"format": f"{key} operands", "error": relative_error(got, ref), "path": "float32 matmul"}
    e4m3, e5m2 = formats or device_fp8_dtypes(x.device)
    n4, n5 = (_format_name(dt) for dt in (e4m3, e5m2))
    for key, label, kw in (("e4m3_unscaled", f"{n4} × {n4}, no scaling", dict(dtype=e4m3, scaled=False)),
                           ("e4m3_scaled", f"{n4} × {n4}, per-tensor scales", dict(dtype=e4m3)),
                           ("e5m2_e4m3_scaled", f"{n5} × {n4}, per-tensor scales", dict(dtype=e5m2, dtype_b=e4m3))):
        res = fp8_matmul(x, w, **kw)
        out[key] = {"format": label, "error": relative_error(res.out, ref), "path": res.path}
    return out


def _format_name(dtype: torch.dtype) -> str:
    """"e4m3" for OCP's e4m3fn (the name the notebook uses), otherwise the dtype's own: "e5m2", "e4m3fnuz"."""
    return {torch.float8_e4m3fn: "e4m3"}.get(dtype, str(dtype).removeprefix("torch.float8_"))

SWEEP = {"bf16": None, "e4m3, no scaling": (torch.float8_e4m3fn, False), "e4m3, per-tensor scale": (torch.float8_e4m3fn, True),
         "e5m2, no scaling": (torch.float8_e5m2, False)}


def magnitude_sweep(x: torch.Tensor, w: torch.Tensor, exponents) -> dict[str, list[float]]:
    """The relative error of ``(x · 2^k) @ w`` for each k of ``exponents``, in bf16 and in the FP8 variants of
    ``SWEEP``: where a format without a scale flushes (k small) or saturates (k large), and a scale does not."""
    out: dict[str, list[float]] = {name: [] for name in SWEEP}
    for k in exponents:
        xk = x * 2.0**k  # a power of two: the values' bits are unchanged, only their exponent moves
        ref = xk.double() @ w.double()
        for name, how in SWEEP.items():
            got = xk.bfloat16().float() @ w.bfloat16().float() if how is None \
                else fp8_matmul(xk, w, how[0], scaled=how[1]).out
            out[name].append(relative_error(got, ref))
    return out


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


def matmul_speed(n: int, device: torch.device | str, repeat: int = 5) -> dict[str, float]:
    """Seconds (the fastest of ``repeat``) of an n×n×n product: bf16 against FP8 e4m3 (``fp8_matmul``'s kernel,
    in the e4m3 variant the device computes in: ``device_fp8_dtypes``).

    Operands are quantised before the clock starts: a training step keeps FP8 weights, and the casts of
    activations fuse into the previous kernel under ``torch.compile``. Returns seconds by name and the path.
    """
    device = torch.device(device)
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=g).to(device) for _ in range(2))
    ab, bb = a.bfloat16(), b.bfloat16()
    e4m3 = device_fp8_dtypes(device)[0]
    qa, qb = quantize(a, 1.0, e4m3), quantize(b.t().contiguous(), 1.0, e4m3).t()
    why_not = scaled_mm_runs(device.type, e4m3, e4m3) if n % 16 == 0 else "n is not a multiple of 16"
    one = torch.ones((), device=device)
    fp8 = (lambda: torch._scaled_mm(qa, qb, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)) if why_not is None \
        else (lambda: (qa.float() @ qb.float()).bfloat16())
    times = time_interleaved({"bf16": lambda: ab @ bb, "fp8": fp8}, device, warmup=1, repeat=repeat)
    return {"bf16_s": times["bf16"]["min_s"], "fp8_s": times["fp8"]["min_s"],
            "path": SCALED_MM if why_not is None else f"{EMULATED} ({why_not})"}


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
    values saturate), the fraction of values past ``overflow_threshold`` (clamped to ±max), the relative error of the dequantised tensor,
    and whether every quantised value is finite.
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


def fp8_training_support(device: torch.device | str) -> str | None:
    """None where ``train_llama(..., fp8=True)`` can run on ``device``; otherwise what it needs, in words."""
    device = torch.device(device)
    if device.type != "cuda":
        return (f"FP8 training needs a GPU with FP8 matrix units (NVIDIA H100/H200 or another of compute "
                f"capability 8.9 or newer, AMD MI300X); this notebook runs on {device.type}")
    return fp8_training_support_for(device_arch(device), str(device), torch.cuda.get_device_name(device))


def fp8_hardware_error(arch: str) -> str | None:
    """None if the architecture ``arch`` ("sm_90", "gfx942": ``device_arch``'s names) has FP8 matrix units; else why."""
    arch = arch.split(":")[0]
    if arch.startswith("gfx"):
        return None if arch in FP8_AMD_ARCHS else (
            f"FP8 training needs an MI300X-class AMD GPU ({'/'.join(FP8_AMD_ARCHS)})")
    if arch.startswith("sm_") and len(arch) > 4 and arch[3:].isdigit():
        major, minor = int(arch[3:-1]), int(arch[-1])  # sm_90 is 9.0, sm_100 is 10.0
        if (major, minor) >= (8, 9):
            return None
        return f"FP8 training needs compute capability 8.9 or newer (H100, H200, L40S), not {major}.{minor}"
    return f"FP8 training needs a GPU with FP8 matrix units (NVIDIA sm_89 or newer, AMD gfx942/gfx950), not {arch!r}"


def fp8_training_support_for(arch: str, device: str = "cuda", name: str = "") -> str | None:
    """The FP8 training decision for a GPU of architecture ``arch`` (called ``name``) at ``device``: None where
    its hardware has FP8 matrix units and torchao's float8 training runs one real step there
    (``torchao_fp8_runs``); otherwise what is missing. Only the probe touches the device."""
    if why := fp8_hardware_error(arch):
        return f"{why}; {name or device} is {arch}"
    return torchao_fp8_runs(device)


@functools.lru_cache(maxsize=None)
def torchao_fp8_runs(device: str = "cuda") -> str | None:
    """None if torchao's float8 training runs on ``device``: a 32×32 linear converted with
    ``convert_to_fp8_training``, one forward and backward under bf16 autocast, finite and within FP8's
    error of the float32 product. Otherwise why not, with the install command. Remembered per device;
    the same contract as ``scaled_mm_runs``: what a preflight calls.

    torchao can import and still fail at its first step: a build for another torch, or a GPU whose
    FP8 GEMM refuses the formats torchao picked.
    """
    if importlib.util.find_spec("torchao") is None:
        return f"FP8 training here uses torchao's float8 training, and torchao is not installed: {INSTALL_TORCHAO}"
    try:
        g = torch.Generator().manual_seed(0)
        layer = nn.Linear(32, 32, bias=False)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(32, 32, generator=g) * 0.1)
        x = torch.randn(16, 32, generator=g)
        ref = x @ layer.weight.detach().t()
        model = convert_to_fp8_training(nn.Sequential(layer.to(device)))
        xd = x.to(device).requires_grad_()
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            y = model(xd)
        y.float().sum().backward()
        kinds = {type(m).__name__ for m in model.modules()}
        y, grad = y.detach().float().cpu(), xd.grad.float().cpu()
    except Exception as err:  # noqa: BLE001 (a build for another torch or GPU fails with any error type)
        first = (str(err).splitlines() or [""])[0][:200]
        return (f"torchao imports but its float8 training does not run on {device} ({type(err).__name__}: {first}): "
                f"{INSTALL_TORCHAO}")
    if "Float8Linear" not in kinds:
        return f"torchao did not convert the linear to Float8Linear (got {sorted(kinds)}): {INSTALL_TORCHAO}"
    error = relative_error(y, ref)
    if not (torch.isfinite(grad).all() and error < 0.1):  # e4m3 with bf16 autocast is off by a few percent
        return f"torchao's float8 training runs on {device} but computes wrong values (relative error {error:.2g})"
    return None


def _fp8_linear(module: nn.Module, fqn: str) -> bool:
    """Which linears go to FP8: not the LM head (the logits need the precision; torchtitan leaves it out
    too) and only those whose both dimensions are multiples of 16 (what the FP8 GEMM kernels take)."""
    return (isinstance(module, nn.Linear) and "lm_head" not in fqn
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def convert_to_fp8_training(model: nn.Module) -> nn.Module:
    """``model`` with its linears (but the LM head) swapped for torchao's ``Float8Linear``, in place.

    torchao's default recipe: tensorwise *current* scaling, e4m3 for weights and activations, e5m2 for
    the gradients; the weights themselves stay in their dtype (float32 master weights, as in Transformer
    Engine's row of seed 003's table). Stops with the install command if torchao is missing.
    """
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError as err:
        raise ImportError(f"FP8 training uses torchao's float8 training, and torchao cannot be imported ({err}): "
                          f"{INSTALL_TORCHAO}") from err
    return convert_to_float8_training(model, module_filter_fn=_fp8_linear)


def train_llama(preset: str = "8b", *, fp8: bool, steps: int, batch: int, seq: int, device: torch.device | str,
                compile: bool = True, lr: float = 3e-4, warmup: int = 3, seed: int = 0, **overrides) -> dict:
    """Train a Llama of ``preset`` (random weights, ``overrides`` such as ``num_hidden_layers=4``) for ``steps``
    steps under bf16 autocast, with its linears in FP8 (torchao) if ``fp8``.

    Float32 master weights and AdamW states either way; the batches are ``lm_batch``'s learnable rows, the
    same for both runs. Returns the loss of every step, tokens/s over the steps after ``warmup`` (the first
    ones compile), and the peak memory allocated, weights included (None on a CPU).
    """
    device = torch.device(device)
    if steps <= warmup:
        raise ValueError(f"steps={steps} must exceed warmup={warmup}: the first steps compile and are not timed")
    with PeakMemory(device) as mem:
        model = build_llama(preset, device=device, seed=seed, **overrides)
        vocab = model.config.vocab_size
        if fp8:
            convert_to_fp8_training(model)
        step_model = torch.compile(model) if compile else model
        opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=device.type == "cuda")
        history = fit(step_model, opt, lambda step: lm_batch(step, batch, seq, vocab, seed).to(device), steps,
                      amp_dtype="bfloat16", progress=False)
        del model, step_model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    timed = sorted(r["seconds"] for r in history[warmup:])
    return {"losses": [r["loss"] for r in history], "tokens_per_s": tokens_per_second(history, batch * seq, warmup),
            "peak_bytes": mem.peak, "step_s": timed[len(timed) // 2], "fp8": fp8}


def compare_training(preset: str = "8b", *, steps: int, batch: int, seq: int, device: torch.device | str,
                     compile: bool = True, **overrides) -> dict[str, dict]:
    """``train_llama`` twice from the same weights on the same batches: bf16 autocast, then FP8 (torchao).

    Stops first, with what is missing, where ``fp8_training_support`` says FP8 cannot run.
    """
    why_not = fp8_training_support(device)
    if why_not:
        raise RuntimeError(why_not)
    kw = dict(steps=steps, batch=batch, seq=seq, device=device, compile=compile, **overrides)
    return {"bf16 autocast": train_llama(preset, fp8=False, **kw),
            "fp8 (torchao) + bf16 autocast": train_llama(preset, fp8=True, **kw)}
