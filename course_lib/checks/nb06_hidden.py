"""Notebook 04's hidden tests (instructor edition only): 3 ranks, a data set that does not divide and later epochs
against DistributedSampler; how far the Prefetcher runs ahead, its depth checks and an error in the iterable;
average_gradients and BucketedDDP on 3 ranks with a frozen parameter (and ranks that start from different weights)."""

from __future__ import annotations

from time import sleep

from torch.utils.data import DistributedSampler

from course_lib.checks import register
from course_lib.checks.nb06 import as_data, average_probe, batches_per_rank, bucketed_probe, check_bucketed, \
    judge_average, yours


# ---------------------------------------------------------------- rank_batches
def probe_batches(ns: dict) -> dict:
    return {"padded": batches_per_rank(ns, 3, 22, 4, (0,)),  # 22 = 3 x 7 + 1: a padding sampler hands out 8 per rank
            "seeded": batches_per_rank(ns, 3, 50, 5, (0, 1, 4), 7)}


def judge_batches(got: dict) -> str:
    flat = [i for b in got["padded"] for x in b[0] for i in x]
    assert len(flat) == len(set(flat)), ("22 samples on 3 ranks: a sample was read twice in one epoch; the sampler "
                                         "pads the shards unless it has drop_last=True")
    for r in range(3):
        for e in (0, 1, 4):
            s = DistributedSampler(range(50), num_replicas=3, rank=r, shuffle=True, seed=7, drop_last=True)
            s.set_epoch(e)
            idx = list(s)
            want = [idx[i:i + 5] for i in range(0, len(idx) - 4, 5)]
            assert got["seeded"][r][e] == want, f"rank {r}, epoch {e}: not the sampler's batches"
    return "3 ranks, an uneven data set, a seed and later epochs: the sampler's batches"


register("test_rank_batches_hidden", probe_batches, judge_batches)


# ---------------------------------------------------------------- Prefetcher
def probe_depth(ns: dict) -> dict:
    Prefetcher = ns["Prefetcher"]

    def how_far_ahead(depth, n=8):
        produced, ahead = [], []

        def counting():
            for i in range(n):
                produced.append(i)  # the thread has read item i
                yield i
        for k, item in enumerate(Prefetcher(counting(), depth=depth), start=1):
            sleep(0.01)  # a slow step: the thread has time to fill the queue
            ahead.append(len(produced) - k)
        return ahead

    def rejects(depth):
        try:
            Prefetcher(range(3), depth=depth)
        except ValueError:
            return True
        return False

    out = {"ahead": {}}
    for depth in (1, 3):
        out["ahead"][depth] = as_data(yours(ns, lambda: how_far_ahead(depth)))
    out["rejects"] = bool(yours(ns, lambda: rejects(0))) and bool(yours(ns, lambda: rejects(1.5)))
    return out


def judge_depth(got: dict) -> str:
    for depth in (1, 3):
        ahead = got["ahead"][depth]
        assert max(ahead) <= depth + 1, (f"depth={depth}: the thread read {max(ahead)} items ahead of the loop; a "
                                         f"queue of {depth} slots allows {depth + 1} (a full queue and the item it holds)")
        assert max(ahead) >= depth, f"depth={depth}: the thread was never more than {max(ahead)} item(s) ahead"
    assert got["rejects"], "depth=0 and depth=1.5 must raise ValueError"
    return "the thread runs depth items ahead and no further; a bad depth is refused"


register("test_Prefetcher_depth", probe_depth, judge_depth)


class CorruptSample(Exception):
    pass


def probe_errors(ns: dict) -> dict:
    Prefetcher = ns["Prefetcher"]

    def failing():
        yield 0
        yield 1
        raise CorruptSample("sample 2 is corrupt")

    def read_until_error():
        got = []
        try:
            for item in Prefetcher(failing(), depth=2):
                got.append(item)
        except CorruptSample as err:
            return got, str(err)
        return got, None

    got, err = yours(ns, read_until_error, timeout=3.0)
    return {"got": as_data(list(got)), "error": err}


def judge_errors(got: dict) -> str:
    assert got["got"] == [0, 1], f"the items before the failure come first, got {got['got']}"
    assert got["error"] == "sample 2 is corrupt", "the iterable's exception must be raised in the loop"
    return "the iterable's error reaches the loop, after the items before it"


register("test_Prefetcher_errors", probe_errors, judge_errors)


# ---------------------------------------------------------------- average_gradients
def judge_average_3(got: list) -> str:
    judge_average(got, 3, 24, True, "3 ranks, ")
    return "3 ranks and a frozen parameter: DDP's gradients"


register("test_average_gradients_hidden", lambda ns: average_probe(ns, 3, 24, True), judge_average_3)

# ---------------------------------------------------------------- BucketedDDP
CAPS = ((100.0, "3 ranks, one bucket"), (0.0001, "3 ranks, tiny buckets"))


def probe_bucketed(ns: dict) -> list:
    return [bucketed_probe(ns, 3, 24, 3, cap, True, True) for cap, _ in CAPS]


def judge_bucketed(got: list) -> str:
    for (cap, label), runs in zip(CAPS, got, strict=True):
        check_bucketed(runs, label, 24, 3, True)
        for run in runs:
            assert all(sum(e["what"] == "all_reduce" for e in ev) == run["n_buckets"] for ev in run["events"]), \
                f"{label}: not one all-reduce per bucket in every step"
            assert "head.bias" not in sum(run["buckets"], []), f"{label}: a frozen parameter has no gradient to bucket"
            assert cap < 1 or run["n_buckets"] == 1, f"{label}: a cap above the model's size makes one bucket"
    return "3 ranks from different weights, a frozen parameter, one bucket and many"


register("test_BucketedDDP_hidden", probe_bucketed, judge_bucketed)
