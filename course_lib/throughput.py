"""How fast: wall time per step, samples or tokens per second, and MFU.

GPUs run asynchronously, so every timing synchronises first; the first calls pay for
kernel selection and allocation, so they are warm-up and not counted.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, NamedTuple

import torch

# Dense (no 2:4 sparsity) bf16 tensor-core peaks, in FLOP/s, by the words of ``torch.cuda.get_device_name``.
# The first entry whose words all appear in the name wins, so the specific cards come before the general
# ones: "H100" is also in "NVIDIA H100 PCIe" and "NVIDIA H100 NVL", "H200" in "NVIDIA GH200 480GB". The H100
# SXM names itself "NVIDIA H100 80GB HBM3", the H200 SXM "NVIDIA H200". NVIDIA lists Hopper's bf16 peaks
# "with sparsity"; the dense peak is half of that.
# - H100 SXM 1,979 / PCIe 1,513 with sparsity: H100 datasheet, https://www.nvidia.com/en-us/data-center/h100/
# - H100 NVL 1,671 with sparsity: H100 NVL product brief PB-11773-001 and the H100 page above
# - H200 SXM 1,979 / H200 NVL 1,671 with sparsity: https://www.nvidia.com/en-us/data-center/h200/
# - GH200 1,979 with sparsity (its GPU is an H100 SXM's):
#   https://www.nvidia.com/en-us/data-center/grace-hopper-superchip/
# - A100 (SXM4 and PCIe, 40 and 80 GB) 312 dense: A100 datasheet, https://www.nvidia.com/en-us/data-center/a100/
# - L40S 362.05 dense (733 with sparsity): L40S datasheet, https://www.nvidia.com/en-us/data-center/l40s/
# - AMD CDNA 3 does 2048 dense bf16 FLOP per CU per clock: MI300X and MI325X 304 CUs at 2.1 GHz = 1307.4,
#   MI300A 228 CUs = 980.6; CDNA 2's MI250X 383.0 (220 CUs at 1.7 GHz). AMD's data sheets,
#   https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html (and the mi325x, mi300a, mi250x pages)
PEAK_BF16_CARDS: tuple[tuple[str, str, float], ...] = (  # (words to find in the name, card, dense bf16 FLOP/s)
    ("GH200", "GH200", 989.4e12),
    ("H200 NVL", "H200 NVL", 835.5e12),
    ("H200", "H200 SXM", 989.4e12),
    ("H100 NVL", "H100 NVL", 835.5e12),
    ("H100 PCIe", "H100 PCIe", 756.5e12),
    ("H100", "H100 SXM", 989.4e12),
    ("A100", "A100", 312e12),
    ("L40S", "L40S", 362.05e12),
    ("MI325X", "MI325X", 1307.4e12),
    ("MI300X", "MI300X", 1307.4e12),
    ("MI300A", "MI300A", 980.6e12),
    ("MI250X", "MI250X", 383.0e12),
)
PEAK_BF16_FLOPS = {card: flops for _, card, flops in PEAK_BF16_CARDS}  # card -> dense bf16 FLOP/s


class Peak(NamedTuple):
    """The bf16 peak MFU is measured against: the ``card`` it is the peak of, ``flops`` (FLOP/s, dense) and
    ``reason``, how the card was told from the device (which words of which name matched)."""

    card: str
    flops: float
    reason: str

    def describe(self) -> str:
        """E.g. "756 TFLOP/s dense bf16 (H100 PCIe: 'H100 PCIe' in the name 'NVIDIA H100 PCIe')"."""
        return f"{self.flops / 1e12:,.0f} TFLOP/s dense bf16 ({self.card}: {self.reason})"


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


def peak_for_name(name: str, arch: str = "") -> Peak | None:
    """The dense bf16 peak of the GPU called ``name`` (``torch.cuda.get_device_name``), or None if unknown.

    ``arch`` is ROCm's ``gcnArchName`` (e.g. "gfx942:sramecc+:xnack-"): some ROCm versions report a
    bare name ("AMD Radeon Graphics"), and a gfx942 with no card in its name is taken for an MI300X
    (an MI325X has the same peak; an MI300A, 980.6 TFLOP/s, would name itself). A pure function of
    the strings, so every card's decision can be checked without the card.
    """
    words = name.lower().split()
    for key, card, flops in PEAK_BF16_CARDS:
        # every word of the key inside some word of the name: "H100 PCIe" matches "NVIDIA H100 80GB PCIe" too
        if all(any(k in w for w in words) for k in key.lower().split()):
            return Peak(card, flops, f"'{key}' in the name '{name}'")
    if arch.split(":")[0] == "gfx942":
        return Peak("MI300X", PEAK_BF16_FLOPS["MI300X"],
                    f"assumed from the architecture gfx942: the name '{name}' names no card")
    return None


def device_peak(device: torch.device | str | None = None) -> Peak | None:
    """``peak_for_name`` of the GPU ``device``; None for a CPU (no peak is claimed for one) or an unknown GPU."""
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda":
        return None
    arch = getattr(torch.cuda.get_device_properties(device), "gcnArchName", "") or ""
    return peak_for_name(torch.cuda.get_device_name(device), arch)


def peak_bf16_flops(device: torch.device | str | None = None) -> float | None:
    """The dense bf16 peak (FLOP/s) of the GPU ``device`` by its name, or None (CPU, or a GPU not in the table).

    ``device_peak`` says which card's peak it is and why: print that wherever an MFU is printed."""
    peak = device_peak(device)
    return peak.flops if peak else None


def matmul_parameters(n_params: int, vocab_size: int, d_model: int, tied_head: bool) -> int:
    """The parameter count N that MFU's 6·N uses: every parameter but the input embedding.

    The embedding is a lookup (a gather, no FLOPs); the LM head is a V×d matmul. A tied head
    shares the embedding's matrix, which ``n_params`` (each shared tensor once) counts once:
    as the head, so nothing is subtracted. Norm weights stay in (d per norm: negligible).
    """
    return n_params if tied_head else n_params - vocab_size * d_model


def transformer_flops_per_token(n_params: int, n_layers: int, d_model: int, seq_len: int,
                                frozen_base: bool = False) -> float:
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
