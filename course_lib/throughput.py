"""How fast: wall time per step, samples or tokens per second, and MFU.

GPUs run asynchronously, so every timing synchronises first; the first calls pay for
kernel selection and allocation, so they are warm-up and not counted.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

# Dense bf16 peak of the GPUs the course names, in FLOP/s (vendor data sheets, no sparsity).
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "MI300X": 1307.4e12, "MI325X": 1307.4e12,
                   "MI250X": 383e12, "L40S": 362e12}


def synchronize(device: torch.device) -> None:
    """Wait for the GPU's queued work (a no-op on a CPU): what every timer here does before reading the clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(fn: Callable[[], object], device: torch.device | str = "cpu", warmup: int = 1, repeat: int = 5) -> dict:
    """Median, min and max seconds of ``fn()`` over ``repeat`` calls after ``warmup`` calls."""
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "times": times}


def peak_bf16_flops(device: torch.device | str | None = None) -> float | None:
    """The bf16 peak of the GPU ``device`` by its name, or None (CPU, or a GPU not in the table)."""
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    arch = getattr(torch.cuda.get_device_properties(device), "gcnArchName", "")
    if "gfx942" in arch and "MI3" not in name:  # ROCm may report a bare marketing name
        name += " MI300X"
    for key, flops in PEAK_BF16_FLOPS.items():
        if key in name:
            return flops
    return None


def matmul_parameters(n_params: int, vocab_size: int, d_model: int, tied_head: bool) -> int:
    """The parameter count N that MFU's 6·N uses: every parameter but the input embedding.

    The embedding is a lookup (a gather, no FLOPs); the LM head is a V×d matmul. A tied head
    shares the embedding's matrix, which ``n_params`` (each shared tensor once) counts once:
    as the head, so nothing is subtracted. Norm weights stay in (d per norm: negligible).
    """
    return n_params if tied_head else n_params - vocab_size * d_model


def transformer_flops_per_token(n_params: int, n_layers: int, d_model: int, seq_len: int, frozen_base: bool = False) -> float:
    """Training FLOPs per token: 6·N (forward 2N, backward 4N) plus 12·L·d·T for attention.

    N is the matmul parameter count (``matmul_parameters``). With frozen base weights (LoRA) the
    weight gradients are not computed: 4·N (the adapters' own FLOPs are left out, under 1%).
    12·L·d·T counts every query-key pair, as PaLM's MFU does, though causal and document masks
    skip some: the same convention for every run compared.
    """
    return (4 if frozen_base else 6) * n_params + 12 * n_layers * d_model * seq_len


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the hardware's peak."""
    return tokens_per_s * flops_per_token / peak_flops


def time_interleaved(fns: dict[str, Callable[[], object]], device: torch.device | str = "cpu", warmup: int = 1,
                     repeat: int = 5) -> dict[str, dict]:
    """``time_step`` for several candidates, taking turns: one call of each per round.

    On a shared or throttling machine the speed drifts over seconds; timing candidates one
    after the other would charge that drift to whichever ran last. Taking turns spreads it
    evenly, so the ratios between candidates stay meaningful. Returns name → ``time_step``'s dict.
    """
    device = torch.device(device)
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            synchronize(device)
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            times[name].append(time.perf_counter() - t0)
    return {name: {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t), "times": t}
            for name, t in times.items()}


def spread(values: list[float]) -> dict[str, float]:
    """min, median and max of repeated measurements (of tokens/s, say): how far one figure can be trusted."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}
