"""What expert parallelism costs: the bytes one rank's all-to-alls carry per step (``ep``'s dispatch and combine, and
the exchange of counts before them), as ``CollectiveBytes`` counts them.

- ``ep_bytes_per_rank``: forward and backward, from the rows a rank dispatched and received
  (``moe.traffic`` after ``ep.expert_parallel_forward``).
"""

from __future__ import annotations


def ep_bytes_per_rank(dispatched: int, received: int, d_model: int, dtype_bytes: int, n_experts: int) -> dict:
    """Bytes one rank's all-to-alls take in, per step, as ``CollectiveBytes`` counts them (each call's input).

    Forward: the counts (E int64), the dispatch (the rows this rank sends: its tokens x top_k, less the
    dropped) and the combine (the rows its experts received, sent back). Backward: the two all-to-alls
    again, reversed. On balanced routing received = dispatched = tokens x top_k, so a step moves about
    4 x tokens x top_k x d_model x dtype_bytes per rank, of which (N-1)/N leaves the rank.
    """
    rows = (dispatched + received) * d_model * dtype_bytes
    return {"counts": n_experts * 8, "dispatch": dispatched * d_model * dtype_bytes,
            "combine": received * d_model * dtype_bytes, "backward": rows, "step": n_experts * 8 + 2 * rows}
