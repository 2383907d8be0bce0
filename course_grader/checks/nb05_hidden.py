"""Notebook 05's hidden tests (instructor edition only): how far the Prefetcher runs ahead, its depth checks and an
error in the iterable."""

from __future__ import annotations

import random
from time import sleep

from course_grader.checks import case_seed, register
from course_grader.checks.nb05 import as_data, yours


# ---------------------------------------------------------------- Prefetcher
def depth_case() -> dict:
    """The depth test's sizes, new to every grading (``case_seed``): the iterable's items (8 to 12: past the deepest
    queue's reach, so an unbounded queue shows), the depths (1, and 2 to 4) and a fractional depth to refuse."""
    rng = random.Random(case_seed("nb05", "depth"))
    return {"items": rng.randint(8, 12), "depths": (1, rng.randint(2, 4)), "fraction": rng.randint(1, 4) + 0.5}


def probe_depth(ns: dict) -> dict:
    Prefetcher, case = ns["Prefetcher"], depth_case()

    def how_far_ahead(depth, n=case["items"]):
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
    for depth in case["depths"]:
        out["ahead"][depth] = as_data(yours(ns, lambda: how_far_ahead(depth)))
    out["rejects"] = bool(yours(ns, lambda: rejects(0))) and bool(yours(ns, lambda: rejects(case["fraction"])))
    return out


def judge_depth(got: dict) -> str:
    case = depth_case()
    for depth in case["depths"]:
        ahead, items = got["ahead"][depth], case["items"]
        assert len(ahead) == items, f"depth={depth}: the loop got {len(ahead)} items of the iterable's {items}"
        assert max(ahead) <= depth + 1, (f"depth={depth}: the thread read {max(ahead)} items ahead of the loop; a "
                                         f"queue of {depth} slots allows {depth + 1} "
                                         "(a full queue and the item it holds)")
        assert max(ahead) >= depth, f"depth={depth}: the thread was never more than {max(ahead)} item(s) ahead"
    assert got["rejects"], f"depth=0 and depth={case['fraction']} must raise ValueError"
    return "the thread runs depth items ahead and no further; a bad depth is refused"


register("test_Prefetcher_depth", probe_depth, judge_depth)


class CorruptSample(Exception):
    pass


def failure() -> dict:
    """Where the iterable fails (after 1 to 5 items), with which message, and the queue's depth: new to every grading
    (``case_seed``)."""
    rng = random.Random(case_seed("nb05", "errors"))
    at = rng.randint(1, 5)
    return {"at": at, "message": f"sample {at} is corrupt (checksum {rng.getrandbits(32):08x})",
            "depth": rng.randint(1, 3)}


def probe_errors(ns: dict) -> dict:
    Prefetcher, case = ns["Prefetcher"], failure()

    def failing():
        yield from range(case["at"])
        raise CorruptSample(case["message"])

    def read_until_error():
        got = []
        try:
            for item in Prefetcher(failing(), depth=case["depth"]):
                got.append(item)
        except CorruptSample as err:
            return got, str(err)
        return got, None

    got, err = yours(ns, read_until_error, timeout=3.0)
    return {"got": as_data(list(got)), "error": err}


def judge_errors(got: dict) -> str:
    case = failure()
    assert got["got"] == list(range(case["at"])), \
        f"the items before the failure come first: {list(range(case['at']))}, got {got['got']}"
    assert got["error"] == case["message"], "the iterable's exception must be raised in the loop"
    return "the iterable's error reaches the loop, after the items before it"


register("test_Prefetcher_errors", probe_errors, judge_errors)
