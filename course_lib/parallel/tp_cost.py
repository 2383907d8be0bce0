"""What tensor parallelism costs: the bytes one rank's all-reduces move per step of a Llama split by hand.

``course_lib.parallel.tp`` is the split itself (Megatron's pair, by hand), ``course_lib.parallel.tp_torch`` torch's
DTensor plan and the worker that trains either and counts every collective (``CollectiveBytes``): its "hand" mode
counts what this formula says.
"""

from __future__ import annotations


def tp_bytes_per_rank(layers: int, tokens: int, hidden: int, dtype_bytes: int = 4) -> int:
    """Bytes one rank's all-reduces take in per step of a Llama split by hand (``parallelize_llama_by_hand``), as
    ``CollectiveBytes`` counts them: the attention and the MLP of every layer each all-reduce a ``tokens x hidden``
    activation forward (``reduce_from_tp``) and its gradient backward (``copy_to_tp``), 4 per layer."""
    return 4 * layers * tokens * hidden * dtype_bytes
