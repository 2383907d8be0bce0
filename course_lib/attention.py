"""Attention that runs a fused kernel in every dtype, or says loudly that it cannot.

torch's ``scaled_dot_product_attention`` (SDPA) picks a kernel for every call: FlashAttention,
memory-efficient attention, cuDNN, or the "math" fallback. The fused kernels never build the
T×T score matrix (they keep one log-sum-exp per query for backward); the math fallback builds it
and keeps the probabilities for backward: 4·B·H·T² bytes per layer in fp32, 8 GiB for the 1B
Llama shape at batch 4 and 1024 tokens. Which kernel runs depends on the device, the dtype, the
mask, dropout and grouped K/V heads (GQA), and the fallback is silent.

The trap the course's Llama fell into: transformers' ``"sdpa"`` passes grouped K/V heads as
they are (``enable_gqa=True``) when there is no mask, and which fused kernels take grouped heads
differs by device, dtype and release (on CUDA, FlashAttention in fp16/bf16 only, and since torch
2.14 the memory-efficient kernel; on ROCm, AOTriton's flash refused them for several releases), so
in fp32 SDPA took the math path and every fp32-vs-bf16 memory comparison measured a kernel switch
as well as a dtype.

``course_sdpa`` (registered with transformers as ``attn_implementation="course_sdpa"``, the
course's default) asks SDPA's own dispatcher, inside the ``sdpa_kernel`` context the call runs in
(only the fused kernels allowed), whether a fused kernel takes the K/V heads grouped, else repeated,
once per kind of call (``kv_plan``); where neither would, it raises ``AttentionFallback`` with what
to change. ``attention_kernels(fn)`` says which kernels really ran (torch's profiler sees the aten
op of each), ``sdpa_backend`` which one SDPA's dispatcher picks for given inputs.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import warnings
from collections import Counter
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

IMPLEMENTATION = "course_sdpa"
# every kernel that never stores the T×T matrix; on a CPU only FlashAttention exists besides math
FUSED_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
# the aten op each SDPA kernel runs as, as torch's profiler names it
KERNEL_OPS = {
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_fused_attention_overrideable": "fused (other device)",
}


class AttentionFallback(RuntimeError):
    """No fused SDPA kernel can run these inputs: SDPA would take its math path and store T×T."""


def sdpa_backend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
                 dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                 enable_gqa: bool = False) -> SDPBackend:
    """The kernel SDPA's own dispatcher picks for these inputs (under the backends allowed right now).

    Raises ``RuntimeError`` ("No available kernel") where none of the allowed kernels runs them.
    """
    choice = torch._fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                     enable_gqa=enable_gqa)
    return SDPBackend(choice)


@contextlib.contextmanager
def counting_kernels() -> Iterator[Counter]:
    """A block run under torch's profiler; the Counter it yields says, once the block ends, how many times each
    SDPA kernel ran ("flash", "math", ...).

    The profiler records the aten op each kernel dispatches to, forward and backward alike
    (the backward ops end in ``_backward`` and are counted under the same name).
    """
    counts: Counter = Counter()
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    with _quiet_stderr():  # the profiler's C++ side logs its start and stop to stderr: noise in a notebook
        prof.start()
    try:
        yield counts
    finally:
        with _quiet_stderr():
            prof.stop()
    for event in prof.events():
        name = event.name.removesuffix("_backward")
        if name in KERNEL_OPS:
            counts[KERNEL_OPS[name]] += 1


def attention_kernels(fn: Callable[[], object]) -> Counter:
    """Run ``fn()`` under ``counting_kernels``; how many times each SDPA kernel ran."""
    with counting_kernels() as counts:
        fn()
    return counts


@contextlib.contextmanager
def _quiet_stderr():
    """Send file descriptor 2 to /dev/null for the block (C++ logging goes there, not to ``sys.stderr``)."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(batch, kv_heads, T, d) → (batch, kv_heads·n_rep, T, d): each K/V head once per query head of its group."""
    if n_rep == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


def kv_layout(ask: Callable[[bool], SDPBackend | None], grouped_heads: bool = True) -> str:
    """How to hand K/V heads to SDPA, from its dispatcher's answers: "grouped", "repeated" or "fallback".

    ``ask(True)`` is the kernel the dispatcher picks for K/V as they are (``enable_gqa`` where the
    heads are grouped), ``ask(False)`` for them repeated to one head per query head; ``None`` means
    no kernel allowed here runs them. Grouped first (no copy), repeated only where grouped would take
    the math path, "fallback" where both would. Which kernels take grouped heads differs by device and
    release (AOTriton's flash on ROCm refused them for several releases; CUDA's memory-efficient
    kernel takes them since torch 2.14), so only the dispatcher knows.
    """
    if _is_fused(ask(True)):
        return "grouped"
    if grouped_heads and _is_fused(ask(False)):
        return "repeated"
    return "fallback"


def _is_fused(backend: SDPBackend | None) -> bool:
    return backend is not None and backend not in (SDPBackend.MATH, SDPBackend.ERROR)


def sdpa_signature(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                   dropout_p: float, is_causal: bool, scale: float | None) -> tuple:
    """What SDPA's dispatcher decides from, as plain values: device, grad mode, and per tensor its shape,
    strides, dtype (the autocast dtype where autocast will cast it) and ``requires_grad``; dropout, causal, scale.

    While ``torch.compile`` traces, the decision becomes a constant of the graph, and a graph that recompiled for
    a second length or batch size (dynamo's automatic dynamic shapes) runs every length with it: there the batch
    and sequence sizes are symbols, not values. So when compiling, those sizes are asked about as
    ``TRACED_SIZE`` (1 stays 1: a one-token query decodes) and strides as the layout they make ("bhsd", "bshd");
    heads and head dim, which do not change between calls, stay exact."""
    device = query.device
    cast = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
    compiling = torch.compiler.is_compiling()

    def meta(t: torch.Tensor, sizes: tuple[int, ...]) -> tuple:
        dtype = cast if cast is not None and t.is_floating_point() else t.dtype
        if not compiling:
            return tuple(t.shape), tuple(t.stride()), dtype, t.requires_grad
        shape = tuple(1 if n == 1 else TRACED_SIZE if i in sizes else n for i, n in enumerate(t.shape))
        return shape, _layout(t), dtype, t.requires_grad

    mask = None if attn_mask is None else meta(attn_mask, (0, 2, 3))  # (batch, 1 or heads, T, T)
    qkv = (meta(t, (0, 2)) for t in (query, key, value))  # (batch, heads, T, head dim)
    return (str(device), torch.is_grad_enabled(), *qkv, mask, float(dropout_p),
            bool(is_causal), scale)


# The batch and sequence size the dispatcher is asked about while torch.compile traces (they may be symbols): a
# multiple of the tiles the fused kernels like, small enough that the stand-in tensors cost little.
TRACED_SIZE = 64
# (signature, backend context) -> (layout, torch's reasons): the dispatcher is asked once per kind of call
_PLANS: dict[tuple, tuple[str, str]] = {}
_BACKEND_FLAGS = ("flash", "mem_efficient", "cudnn", "math", "overrideable")


@torch.compiler.assume_constant_result  # compiled: decided while tracing, a constant in the graph
def kv_plan(signature: tuple) -> tuple[str, str]:
    """The layout (``kv_layout``) for calls of this ``sdpa_signature`` under the backends enabled now, and
    torch's reasons where it is "fallback". Asked of the dispatcher the first time, cached after."""
    enabled = tuple(getattr(torch._C, f"_get_{name}_sdp_enabled", lambda: False)() for name in _BACKEND_FLAGS)
    key = (signature, enabled, tuple(torch._C._get_sdp_priority_order()))  # the context: which kernels, in which order
    if key not in _PLANS:
        _PLANS[key] = _ask_dispatcher(signature)
    return _PLANS[key]


def _ask_dispatcher(signature: tuple) -> tuple[str, str]:
    """``kv_layout`` on the dispatcher's answers for stand-in tensors with the signature's metadata."""
    device, grad_mode, q, k, v, mask, dropout_p, is_causal, scale = signature
    n_rep = q[0][1] // k[0][1]
    reasons: list[str] = []

    def ask(grouped: bool) -> SDPBackend | None:
        kv = (k, v) if grouped else tuple(_repeated(m, n_rep) for m in (k, v))
        query, key, value = (_stand_in(device, m) for m in (q, *kv))
        attn_mask = None if mask is None else _stand_in(device, mask)
        with torch.set_grad_enabled(grad_mode), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # the dispatcher warns why each fused kernel declined: keep them
            try:
                return sdpa_backend(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                    enable_gqa=grouped and n_rep > 1)
            except RuntimeError as err:  # with math disabled, "no kernel" is how the dispatcher says "math"
                if "No available kernel" not in str(err):
                    raise
                return None
            finally:
                said = (re.sub(r" ?\(Triggered internally at [^)]*\)", "", str(w.message)) for w in caught)
                reasons.extend(r for r in said if r not in reasons)

    return kv_layout(ask, grouped_heads=n_rep > 1), " ".join(reasons)


def _repeated(meta: tuple, n_rep: int) -> tuple:
    """The metadata of ``repeat_kv``'s output: n_rep times the heads, contiguous."""
    (b, h, t, d), _, dtype, requires_grad = meta
    return (b, h * n_rep, t, d), (h * n_rep * t * d, t * d, d, 1), dtype, requires_grad


def _layout(t: torch.Tensor) -> str:
    """The memory layout of a 4-d (batch, heads, T, d) tensor, as a compiled graph can hold it for every size:
    "bhsd" (contiguous as shaped) or "bshd" (heads and T swapped, as transformers' projections are viewed)."""
    if t.is_contiguous():
        return "bhsd"
    if t.dim() == 4 and t.transpose(1, 2).is_contiguous():
        return "bshd"
    raise ValueError(f"compiled attention on an input of shape {tuple(t.shape)} and strides {t.stride()}: only "
                     "(batch, heads, T, d) tensors laid out contiguously, or with heads and T swapped, have a kernel "
                     "decided once for every size; call .contiguous() on it before attention")


def _stand_in(device: str, meta: tuple) -> torch.Tensor:
    """An uninitialised tensor with this metadata: all the dispatcher looks at."""
    shape, stride, dtype, requires_grad = meta
    if stride == "bhsd":
        stride = torch.empty(shape, device="meta").stride()
    elif stride == "bshd":
        b, h, t, d = shape
        stride = torch.empty(b, t, h, d, device="meta").transpose(1, 2).stride()
    return torch.empty_strided(shape, stride, dtype=dtype, device=device).requires_grad_(requires_grad)


def fused_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """SDPA over (batch, heads, T, d) tensors on a fused kernel only; K/V may have fewer heads (GQA).

    K/V go grouped where a fused kernel takes them so, repeated where only that keeps the call fused
    (``kv_plan`` asks SDPA's dispatcher, once per kind of call); raises ``AttentionFallback`` where SDPA
    could only run its math path, naming the cause.
    """
    if query.shape[1] % key.shape[1] or key.shape[1] != value.shape[1]:
        raise ValueError(f"{query.shape[1]} query heads cannot share {key.shape[1]} key and {value.shape[1]} value "
                         "heads: the key and value head counts must be equal and divide the query heads")
    with sdpa_kernel(FUSED_BACKENDS):  # asked in the very context the call runs in: cuDNN counts, math does not
        layout, reasons = kv_plan(sdpa_signature(query, key, value, attn_mask, dropout_p, is_causal, scale))
        if layout == "fallback":
            raise AttentionFallback(_fallback_message(query, value, attn_mask, dropout_p, reasons))
        n_rep = query.shape[1] // key.shape[1]
        if layout == "repeated":
            key, value = repeat_kv(key, n_rep), repeat_kv(value, n_rep)
        grouped = layout == "grouped" and n_rep > 1
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=grouped)


def _fallback_message(query: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None, dropout_p: float,
                      reasons: str) -> str:
    device = query.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype
    mask = "none" if attn_mask is None else f"{attn_mask.dtype}, requires_grad={attn_mask.requires_grad}"
    return (f"no fused attention kernel runs these inputs (device {device}, {dtype}, head dim "
            f"{query.shape[-1]}/{value.shape[-1]}, dropout {dropout_p}, mask {mask}), with K/V heads grouped or "
            "repeated: SDPA would fall back to its math kernel and store the T×T probabilities for backward. Change "
            "what blocks the fused kernels (attention dropout 0, a mask that needs no gradient, equal head dims, "
            "fp16/bf16 or head dim <= 256 on GPUs), or choose the fallback knowingly with attn_implementation='sdpa'."
            + (f" torch says: {reasons}" if reasons else ""))


def course_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface on ``fused_sdpa``: (batch, T, heads, d) out, no weights.

    Causal by flag where transformers gives no mask (the case of plain causal rows), as its own "sdpa" does.
    """
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = query.shape[2] > 1 and attention_mask is None and is_causal
    out = fused_sdpa(query, key, value, attn_mask=attention_mask, dropout_p=dropout, is_causal=is_causal,
                     scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make ``attn_implementation="course_sdpa"`` known to transformers (its masks are SDPA's)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, course_sdpa)
    AttentionMaskInterface.register(IMPLEMENTATION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
