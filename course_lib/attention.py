"""Attention that runs a fused kernel in every dtype, or says loudly that it cannot.

torch's ``scaled_dot_product_attention`` (SDPA) picks a kernel for every call: FlashAttention,
memory-efficient attention, cuDNN, or the "math" fallback. The fused kernels never build the
T×T score matrix (they keep one log-sum-exp per query for backward); the math fallback builds it
and keeps the probabilities for backward: 4·B·H·T² bytes per layer in fp32, 8 GiB for the 1B
Llama shape at batch 4 and 1024 tokens. Which kernel runs depends on the device, the dtype, the
mask, dropout and grouped K/V heads (GQA), and the fallback is silent.

The trap the course's Llama fell into: transformers' ``"sdpa"`` passes grouped K/V heads as
they are (``enable_gqa=True``) when there is no mask. On CUDA and ROCm only FlashAttention takes
grouped heads, and FlashAttention runs fp16/bf16 only, so in fp32 SDPA takes the math path, and
every fp32-vs-bf16 memory comparison measured a kernel switch as well as a dtype.

``course_sdpa`` (registered with transformers as ``attn_implementation="course_sdpa"``, the
course's default) repeats the K/V heads where no fused kernel takes them grouped, and calls SDPA
with only the fused kernels allowed: a call that would fall back raises ``AttentionFallback``
with what to change. ``attention_kernels(fn)`` says which kernels really ran (torch's profiler
sees the aten op of each), ``sdpa_backend`` which one SDPA's dispatcher picks for given inputs.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections import Counter
from typing import Callable

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
                 dropout_p: float = 0.0, is_causal: bool = False, enable_gqa: bool = False) -> SDPBackend:
    """The kernel SDPA's own dispatcher picks for these inputs (under the backends allowed right now)."""
    choice = torch._fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa=enable_gqa)
    return SDPBackend(choice)


def attention_kernels(fn: Callable[[], object]) -> Counter:
    """Run ``fn()`` under torch's profiler; how many times each SDPA kernel ran ("flash", "math", ...).

    The profiler records the aten op each kernel dispatches to, forward and backward alike
    (the backward ops end in ``_backward`` and are counted under the same name).
    """
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    with _quiet_stderr():  # the profiler's C++ side logs its start and stop to stderr: noise in a notebook
        prof.start()
    try:
        fn()
    finally:
        with _quiet_stderr():
            prof.stop()
    counts: Counter = Counter()
    for event in prof.events():
        name = event.name.removesuffix("_backward")
        if name in KERNEL_OPS:
            counts[KERNEL_OPS[name]] += 1
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


def gqa_runs_fused(device_type: str, dtype: torch.dtype, masked: bool) -> bool:
    """Whether a fused kernel takes grouped K/V heads as they are (``enable_gqa=True``) here.

    CPU: its FlashAttention kernel does, in every dtype. CUDA and ROCm: only FlashAttention
    does, and it runs fp16/bf16 without an arbitrary mask; elsewhere the heads are repeated.
    """
    if device_type == "cpu":
        return True
    return dtype in (torch.float16, torch.bfloat16) and not masked


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(batch, kv_heads, T, d) → (batch, kv_heads·n_rep, T, d): each K/V head once per query head of its group."""
    if n_rep == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


def fused_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """SDPA over (batch, heads, T, d) tensors on a fused kernel only; K/V may have fewer heads (GQA).

    Raises ``AttentionFallback`` where SDPA could only run its math path, naming the cause.
    """
    device = query.device.type
    # under autocast SDPA runs in the autocast dtype, whatever q, k, v came in (RoPE may leave q, k in fp32)
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype
    n_rep = query.shape[1] // key.shape[1]
    grouped = n_rep > 1 and gqa_runs_fused(device, dtype, attn_mask is not None)
    if n_rep > 1 and not grouped:
        key, value = repeat_kv(key, n_rep), repeat_kv(value, n_rep)
    if not torch.compiler.is_compiling():  # eager: ask SDPA's dispatcher first, and explain a fallback
        q, k, v = (t.to(dtype) for t in (query, key, value))
        with warnings.catch_warnings():  # the dispatcher warns why each fused kernel declined
            warnings.simplefilter("ignore", UserWarning)
            backend = sdpa_backend(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa=grouped)
        if backend == SDPBackend.MATH:
            raise AttentionFallback(_fallback_message(q, v, attn_mask, dropout_p))
    with sdpa_kernel(FUSED_BACKENDS):  # compiled: the restriction alone makes a fallback fail (torch's message)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=grouped)


def _fallback_message(query: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None, dropout_p: float) -> str:
    mask = "none" if attn_mask is None else f"{attn_mask.dtype}, requires_grad={attn_mask.requires_grad}"
    return (f"no fused attention kernel runs these inputs (device {query.device.type}, {query.dtype}, head dim "
            f"{query.shape[-1]}/{value.shape[-1]}, dropout {dropout_p}, mask {mask}): SDPA would fall back to its math "
            "kernel and store the T×T probabilities for backward. Change what blocks the fused kernels (attention "
            "dropout 0, a mask that needs no gradient, equal head dims, fp16/bf16 or head dim <= 256 on GPUs), or "
            "choose the fallback knowingly with attn_implementation='sdpa'")


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
