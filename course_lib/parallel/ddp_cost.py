"""What data parallelism costs: the bytes a rank's all-reduces take in per step, and the step-time model that says
when N ranks are N times faster (a fixed part every rank pays, a part per sample the ranks split, the exposed
sync), fitted to measured steps (``ddp_torch.size_throughput`` times them) and solved for the batch that reaches a
share of N."""

from __future__ import annotations


def ddp_bytes_per_rank(n_params: int, dtype_bytes: int = 4) -> int:
    """Bytes one rank's all-reduces take in per step, as ``CollectiveBytes`` counts them: every gradient once,
    whatever the number of ranks (a ring all-reduce sends 2(N-1)/N of it from each rank)."""
    return n_params * dtype_bytes


# ---------------------------------------------------------------- a workload where compute dominates
# N ranks beat one by N only where the step is compute: a step costs a fixed part (kernel launches, Python, the
# optimizer) that every rank pays whole, a part per sample that N ranks split, and the gradient all-reduce that
# backward does not hide. On the same global batch B: T_1 = fixed + per_sample * B and
# T_N = fixed + per_sample * B / N + sync, so the speedup T_1 / T_N nears N only once per_sample * B dwarfs
# N * (fixed + sync). A small model on a fast GPU needs a large B; the fit below says how large, from this machine.

def step_time_model(one_rank: list[tuple[int, float]], n_ranks: int, many: tuple[int, float]) -> dict:
    """The step-time model fitted to measured steps: ``one_rank``, (global batch, seconds) pairs of one rank at two
    or more batches (a least-squares line: ``fixed`` and ``per_sample``); ``many``, (global batch, seconds) of
    ``n_ranks`` ranks, whose excess over the line at B / N is the exposed ``sync`` (at least 0)."""
    if len({b for b, _ in one_rank}) < 2:
        raise ValueError(f"one_rank={one_rank}: time one rank at two or more different batches to fit a line")
    n = len(one_rank)
    mb, mt = sum(b for b, _ in one_rank) / n, sum(t for _, t in one_rank) / n
    per_sample = sum((b - mb) * (t - mt) for b, t in one_rank) / sum((b - mb) ** 2 for b, _ in one_rank)
    if per_sample <= 0:
        raise ValueError(f"one_rank={one_rank}: the larger batch was not slower, so the timings are noise: time "
                         "batches further apart, or more steps each")
    fixed = max(mt - per_sample * mb, 0.0)
    batch, seconds = many
    sync = max(seconds - fixed - per_sample * batch / n_ranks, 0.0)
    return {"fixed_s": fixed, "per_sample_s": per_sample, "sync_s": sync, "n_ranks": n_ranks}


def predicted_speedup(model: dict, global_batch: int) -> float:
    """``step_time_model``'s T_1 / T_N on ``global_batch``: one rank against ``model["n_ranks"]``."""
    a, c, s, n = model["fixed_s"], model["per_sample_s"], model["sync_s"], model["n_ranks"]
    return (a + c * global_batch) / (a + c * global_batch / n + s)


def batch_for_speedup(model: dict, share: float = 0.7) -> int:
    """The smallest global batch, a multiple of the ranks, whose predicted speedup reaches ``share`` x N. Solves
    fixed + c B >= share N (fixed + c B / N + sync) for B."""
    if not 0 < share < 1:
        raise ValueError(f"share={share}: the speedup N ranks reach tends to N, so ask for a share below 1")
    a, c, s, n = model["fixed_s"], model["per_sample_s"], model["sync_s"], model["n_ranks"]
    batch = -(-int(max((share * n * (a + s) - a) / ((1 - share) * c), n)) // n) * n
    while predicted_speedup(model, batch) < share * n:  # rounding: step up to the first multiple that reaches it
        batch += n
    return batch
