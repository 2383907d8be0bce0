"""Computing in FP8: the scaled matmul (``torch._scaled_mm`` or its float32 emulation), its error and speed
against bf16, and training a Llama with its linears in FP8 through torchao.

The numbers themselves (formats, ``quantize``, per-tensor and delayed scaling) are ``course_lib.fp8``; this
module multiplies with them. ``fp8_matmul`` quantises both operands with one scale each (current scaling) and
runs the product in ``torch._scaled_mm`` where the device has the kernel, otherwise dequantises and multiplies
in float32: the same numbers without the speed, and ``MatmulResult.path`` says which ran. Each path that needs
the hardware has a probe that tries it once per device and says why not (``scaled_mm_runs``,
``torchao_fp8_runs``): what a preflight calls.

The GPU training path (``train_llama``) uses torchao's float8 training, imported only when asked for.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import NamedTuple

import torch
from torch import nn

from course_lib.data import lm_batch
from course_lib.device import free_memory
from course_lib.fp8 import (FNUZ_ARCHS, amax, check_fp8_dtype, dequantize, device_arch, device_fp8_dtypes, quantize,
                            relative_error, scale_for)
from course_lib.memory import PeakMemory
from course_lib.models import build_llama, quiet_torchao_import
from course_lib.throughput import time_interleaved
from course_lib.train import fit, tokens_per_second

INSTALL_TORCHAO = "pip install torchao (0.18 or newer; it must match your torch build)"
FP8_AMD_ARCHS = FNUZ_ARCHS + ("gfx950",)  # AMD GPUs with FP8 matrix cores, for training


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

SWEEP = {"bf16": None, "e4m3, no scaling": (torch.float8_e4m3fn, False),
         "e4m3, per-tensor scale": (torch.float8_e4m3fn, True), "e5m2, no scaling": (torch.float8_e5m2, False)}


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
        with quiet_torchao_import():
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
    free_memory(device)
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
