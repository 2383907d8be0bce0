"""What ZeRO-Offload and ZeRO-Infinity cost: where each model state lives, the bytes it takes there and the bytes
that cross the GPU-host link (and the NVMe drive) per step (notebook 10).

``offload_plan`` says where each model state lives and how many bytes per parameter it takes there, and
``link_bytes_per_step`` what crosses the GPU-host link per step; ``tokens_to_hide`` how many tokens a step must
compute for the link and the CPU optimizer to hide behind it. ``OFFLOAD_STRATEGIES`` names the strategies (plain
PyTorch, ZeRO-2 with the optimizer offloaded, ZeRO-3 with the weights too, ZeRO-Infinity on NVMe) and
``STRATEGY_NAMES`` their labels. Where a real DeepSpeed engine holds each state is
``zero_deepspeed.engine_placement``'s reading; the optimizer by hand and the CPU Adam timed are
``course_lib.parallel.offload``'s.
"""

from __future__ import annotations

# Where each model state lives on one GPU (world_size 1) with bf16 mixed precision, in bytes per parameter, as
# DeepSpeed 0.19.8 keeps it. "pytorch" is plain PyTorch: fp32 weights and gradients under bf16 autocast, AdamW's m, v.
# ZeRO-2 with the optimizer offloaded keeps only the bf16 weights on the GPU: each gradient bucket is reduced,
# copied into an fp32 buffer on the CPU and freed during the backward (the ZeRO-Offload paper's design).
OFFLOAD_STRATEGIES = {
    "pytorch": {"fp32 weights": "GPU", "fp32 gradients": "GPU", "Adam m and v": "GPU"},
    "zero2_offload": {"16-bit weights": "GPU", "fp32 gradients": "CPU", "fp32 master weights": "CPU",
                      "Adam m and v": "CPU"},
    "zero3_offload": {"16-bit weights": "CPU", "fp32 gradients": "CPU", "fp32 master weights": "CPU",
                      "Adam m and v": "CPU"},
    "zero3_nvme": {"16-bit weights": "NVMe", "fp32 gradients": "NVMe", "fp32 master weights": "NVMe",
                   "Adam m and v": "NVMe"},
}
STRATEGY_NAMES = {"pytorch": "PyTorch (AdamW, bf16 autocast)", "zero2_offload": "ZeRO-2 + optimizer offload",
                  "zero3_offload": "ZeRO-3 + parameter offload", "zero3_nvme": "ZeRO-Infinity (NVMe)"}
_STATE_BYTES = {"16-bit weights": 2, "fp32 weights": 4, "fp32 gradients": 4, "fp32 master weights": 4,
                "Adam m and v": 8}


def check_strategy(strategy: str) -> None:
    """Refuse a strategy name that is not one of ``OFFLOAD_STRATEGIES``, listing those that are."""
    if strategy not in OFFLOAD_STRATEGIES:
        raise ValueError(f"strategy={strategy!r}: use one of {sorted(OFFLOAD_STRATEGIES)}")


def offload_plan(strategy: str, n_params: int, world_size: int = 1, low_bytes: int = 2) -> list[dict]:
    """Each model state of ``strategy``: where it lives and the bytes one rank holds between steps.

    ``low_bytes`` is the size of DeepSpeed's "16-bit" copy (2 for bf16; 4 when it runs in fp32, as the
    notebook's CPU runs do). The ZeRO strategies shard everything but ZeRO-2's weights over ``world_size``;
    the gradients they keep are the fp32 partition the optimizer steps (the 16-bit ones are transient).
    """
    check_strategy(strategy)
    rows = []
    for state, where in OFFLOAD_STRATEGIES[strategy].items():
        per = low_bytes if state == "16-bit weights" else _STATE_BYTES[state]
        whole = strategy == "pytorch" or (strategy == "zero2_offload" and state == "16-bit weights")
        rows.append({"state": state, "lives on": where, "bytes per parameter": per,
                     "bytes on this rank": per * n_params // (1 if whole else world_size)})
    return rows


def link_bytes_per_step(strategy: str, n_params: int) -> dict[str, int]:
    """Bytes of model state that cross the GPU-host link (and the NVMe drive) in one optimizer step, one GPU.

    ZeRO-2 offload: each gradient goes down once, converted to fp32 on the GPU before the copy (DeepSpeed
    copies into its fp32 CPU buffer; the ZeRO-Offload paper sends 16-bit: 2 bytes), and the updated bf16
    weights come up once. ZeRO-3 offload: the bf16 weights come up twice (forward and backward each gather
    them), the gradients go down in fp32, and the update stays on the CPU. ZeRO-Infinity adds the NVMe
    drive: fp32 master weights, m and v read and written back, bf16 weights read twice and written once.
    Activations and the batch are not counted.
    """
    check_strategy(strategy)
    up, down, nvme_read, nvme_write = {"pytorch": (0, 0, 0, 0), "zero2_offload": (2, 4, 0, 0),
                                       "zero3_offload": (4, 4, 0, 0), "zero3_nvme": (4, 4, 12 + 4, 12 + 2)}[strategy]
    return {"host to GPU": up * n_params, "GPU to host": down * n_params, "NVMe read": nvme_read * n_params,
            "NVMe write": nvme_write * n_params}


def tokens_to_hide(bytes_per_param: float, link_bytes_per_s: float, optimizer_params_per_s: float,
                   gpu_flops: float) -> dict[str, float]:
    """Tokens per step at which the GPU's compute (6 FLOPs per parameter and token) takes as long as the
    offload's link traffic, and as long as the CPU's optimizer step.

    Both costs grow with the parameters N, as the compute does, so N cancels: below these batch sizes
    offload is bound by the link or the CPU, above them by the GPU. This is why offload needs the large
    batch that the memory it frees makes possible (seed 004: "by enabling larger batch sizes").
    """
    return {"link": bytes_per_param / link_bytes_per_s * gpu_flops / 6,
            "CPU optimizer": gpu_flops / (6 * optimizer_params_per_s)}
