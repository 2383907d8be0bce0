"""What ZeRO costs: the model-state bytes per parameter each rank holds at each stage (the ZeRO paper's accounting).

``zero_bytes_per_param`` is the paper's arithmetic for mixed-precision Adam: stage 1 shards the optimizer state,
stage 2 the gradients too, stage 3 the weights too. FSDP is stage 3, so its bytes are these. What ZeRO-1 sends per
step, measured, is ``zero.step_traffic``; what DeepSpeed's engine holds, read from its tensors,
``zero_deepspeed.engine_placement``.
"""

from __future__ import annotations


def zero_bytes_per_param(stage: int, world_size: int, k: int = 12) -> float:
    """Model-state bytes per parameter on each rank, mixed-precision Adam (the ZeRO paper's accounting).

    2 bytes of fp16/bf16 weights, 2 of gradients, and K = 12 of optimizer state (fp32 master
    weights, Adam m and v). Stage 1 shards the optimizer state over N ranks, stage 2 also the
    gradients, stage 3 also the weights.
    """
    n = world_size
    weights, grads, states = 2.0, 2.0, float(k)
    if stage >= 1:
        states /= n
    if stage >= 2:
        grads /= n
    if stage >= 3:
        weights /= n
    return weights + grads + states
