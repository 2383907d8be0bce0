"""Mixed precision: which dtype the math runs in, and when the loss needs scaling.

autocast runs matmuls and convolutions in a 16-bit dtype while the weights (the "master"
copy the optimizer updates) stay float32. fp16 has a narrow range (max 65504, smallest
normal 6.1e-5), so small gradients underflow unless the loss is scaled up first: that is
GradScaler. bf16 keeps float32's exponent range and needs no scaling.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

# The course's one table of training dtypes: name (and short name) -> torch dtype. Bytes per value
# come from the dtype itself (``torch.bfloat16.itemsize == 2``).
DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype, what: str = "amp_dtype") -> torch.dtype:
    """``"bf16"``, ``"bfloat16"`` or ``torch.bfloat16`` → ``torch.bfloat16`` (same for fp16, fp32).

    ``what`` names the argument in the error a dtype outside the table gets.
    """
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
    elif dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"{what}={dtype!r} is not supported: use 'float32', 'bfloat16' or 'float16'")


def dtype_bytes(dtype: str | torch.dtype, what: str = "dtype") -> int:
    """Bytes per value of a training dtype: 4 for float32, 2 for bfloat16 and float16."""
    return resolve_dtype(dtype, what).itemsize


def check_amp_dtype(device: torch.device | str, dtype: str | torch.dtype) -> torch.dtype:
    """Stop early, with the fix, if ``device`` cannot run autocast in ``dtype``."""
    device, dtype = torch.device(device), resolve_dtype(dtype)
    if dtype == torch.float32:
        return dtype
    if device.type == "cuda":
        if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported(including_emulation=False):
            raise ValueError(f"amp_dtype=bfloat16: {torch.cuda.get_device_name(device)} has no bf16 units; "
                             "use amp_dtype='float16' (with a GradScaler) or 'float32'")
        return dtype
    if not torch.amp.is_autocast_available(device.type):
        raise ValueError(f"amp_dtype={dtype}: autocast is not available on {device.type}; use amp_dtype='float32'")
    try:  # a CPU build may lack the 16-bit kernels: try one matmul rather than guess
        with torch.autocast(device.type, dtype=dtype):
            torch.ones(2, 2, device=device) @ torch.ones(2, 2, device=device)
    except RuntimeError as err:
        raise ValueError(f"amp_dtype={dtype} does not run on this {device.type} ({err}); "
                         "use amp_dtype='bfloat16' or 'float32'") from err
    return dtype


def autocast(device: torch.device | str, dtype: str | torch.dtype):
    """``torch.autocast`` for a 16-bit dtype; a no-op context for float32."""
    device, dtype = torch.device(device), resolve_dtype(dtype)
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


@contextlib.contextmanager
def strict_float32():
    """Float32 that is float32 while the block runs, then the settings as they were.

    On NVIDIA GPUs PyTorch runs float32 convolutions (and, if asked, matmuls) in TF32, a 10-bit
    mantissa, and cuDNN may pick non-deterministic algorithms: either hides float32 rounding under a
    1e-3 noise. The block turns both off; on a CPU it changes nothing that matters.
    """
    saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.deterministic)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    try:
        yield
    finally:
        (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32,
         torch.backends.cudnn.deterministic) = saved


def make_scaler(device: torch.device | str, dtype: str | torch.dtype,
                init_scale: float = 2.0**16) -> torch.amp.GradScaler:
    """A GradScaler that is enabled only for float16 (bf16 and fp32 need no loss scaling)."""
    device, dtype = torch.device(device), resolve_dtype(dtype)
    return torch.amp.GradScaler(device.type, init_scale=init_scale, enabled=dtype == torch.float16)


def range_table() -> list[dict]:
    """Seed 002's precision table, read from ``torch.finfo`` instead of typed in."""
    rows = []
    for name, dt in [("FP32", torch.float32), ("FP16", torch.float16), ("BF16", torch.bfloat16),
                     ("FP8 e4m3", torch.float8_e4m3fn), ("FP8 e5m2", torch.float8_e5m2)]:
        fi = torch.finfo(dt)
        rows.append({"type": name, "bits": fi.bits, "max": float(fi.max), "smallest normal": float(fi.tiny),
                     "eps (step after 1.0)": float(fi.eps)})
    return rows


def fp16_fate(values: torch.Tensor, scale: float = 1.0) -> dict[str, float]:
    """What happens to nonzero ``values`` (float32) when multiplied by ``scale`` and stored in fp16.

    Fractions of the nonzero values that become 0 (underflow), subnormal (below fp16's smallest
    normal 6.1e-5: fewer significant bits), inf (overflow), or stay normal.
    """
    v = values.detach().float().flatten()
    v = v[v != 0] * scale
    if v.numel() == 0:
        return {"zero": 0.0, "subnormal": 0.0, "inf": 0.0, "normal": 0.0}
    h = v.half()
    zero, inf = h == 0, h.isinf()
    sub = (h.abs() < torch.finfo(torch.float16).tiny) & ~zero
    n = v.numel()
    out = {"zero": zero.sum().item() / n, "subnormal": sub.sum().item() / n, "inf": inf.sum().item() / n}
    out["normal"] = 1.0 - sum(out.values())
    return out


def activation_gradients(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Gradients of the cross-entropy loss with respect to every leaf module's output, flattened (float32 run).

    These are the numbers that flow backward through the network; under fp16 autocast they
    are stored in fp16, which is where small gradients underflow.
    """
    found: list[torch.Tensor] = []

    def hook(module, inputs, output):
        if torch.is_tensor(output) and output.requires_grad:
            output.register_hook(lambda g: found.append(g.detach().float().flatten()))

    handles = [m.register_forward_hook(hook) for m in model.modules() if not list(m.children())]
    try:
        F.cross_entropy(model(x), y).backward()
    finally:
        for h in handles:
            h.remove()
    model.zero_grad(set_to_none=True)
    return torch.cat(found)


def lost_update_fraction(weights: torch.Tensor, update: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> float:
    """Fraction of the nonzero entries of ``update`` that vanish when added to ``weights`` stored in ``dtype``.

    An update smaller than half the gap between neighbouring ``dtype`` numbers at the weight
    rounds back to the same weight: with pure 16-bit weights that step is simply lost.
    """
    w = weights.detach().to(dtype)
    u = update.detach().float()
    moved = (w.float() + u).to(dtype) != w
    nonzero = u != 0
    return 1.0 - (moved & nonzero).sum().item() / max(nonzero.sum().item(), 1)


def changed_fraction(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    """Fraction of all elements of two name → tensor dicts (e.g. parameters before and after a step) that differ."""
    changed = sum((before[k] != after[k]).sum().item() for k in before)
    return changed / sum(v.numel() for v in before.values())
