"""Notebook 06's hidden tests (instructor edition only): 3 ranks, a data set that does not divide and later epochs
against DistributedSampler; average_gradients on 3 ranks with a frozen parameter."""

from __future__ import annotations

from torch.utils.data import DistributedSampler

from course_grader.checks import case_seed, register
from course_grader.checks.nb06 import average_probe, batches_per_rank, judge_average


# ---------------------------------------------------------------- rank_batches
def probe_batches(ns: dict) -> dict:
    return {"padded": batches_per_rank(ns, 3, 22, 4, (0,)),  # 22 = 3 x 7 + 1: a padding sampler hands out 8 per rank
            "seeded": batches_per_rank(ns, 3, 50, 5, (0, 1, 4), case_seed("sampler"))}  # a seed new to each grading


def sampler_batches(n: int, rank: int, batch_size: int, epoch: int, seed: int) -> list:
    """Rank ``rank`` of 3's full batches in ``epoch``, as DistributedSampler (drop_last=True) orders the samples."""
    s = DistributedSampler(range(n), num_replicas=3, rank=rank, shuffle=True, seed=seed, drop_last=True)
    s.set_epoch(epoch)
    idx = list(s)
    return [idx[i:i + batch_size] for i in range(0, len(idx) - batch_size + 1, batch_size)]


def judge_batches(got: dict) -> str:
    assert len(got["padded"]) == 3 and len(got["seeded"]) == 3, \
        f"{len(got['padded'])} and {len(got['seeded'])} ranks' batches, expected 3"
    flat = [i for b in got["padded"] for x in b[0] for i in x]
    assert len(flat) == len(set(flat)), ("22 samples on 3 ranks: a sample was read twice in one epoch; the sampler "
                                         "pads the shards unless it has drop_last=True")
    for r in range(3):
        assert got["padded"][r][0] == sampler_batches(22, r, 4, 0, 0), \
            f"22 samples, batches of 4, rank {r}: not the sampler's batches"
        for e in (0, 1, 4):
            assert got["seeded"][r][e] == sampler_batches(50, r, 5, e, case_seed("sampler")), \
                f"rank {r}, epoch {e}: not the sampler's batches"
    return "3 ranks, an uneven data set, a seed and later epochs: the sampler's batches"


register("test_rank_batches_hidden", probe_batches, judge_batches)


# ---------------------------------------------------------------- average_gradients
def judge_average_3(got: list) -> str:
    judge_average(got, 3, 24, True, "3 ranks, ")
    return "3 ranks and a frozen parameter: DDP's gradients"


register("test_average_gradients_hidden", lambda ns: average_probe(ns, 3, 24, True), judge_average_3)
