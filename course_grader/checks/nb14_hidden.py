"""Notebook 14's hidden tests (instructor edition only): the merge on scores large enough to overflow exp() without
rescaling; the ring on 3 and 4 ranks, plain and zig-zag, with lengths that do not divide (padded keys masked), each
pass in flight while its block is attended; expert parallelism on 3 and 4 ranks with unequal token counts, with and
without dropping."""

from __future__ import annotations

from course_grader.checks import register
from course_grader.checks.nb14 import blocks, ep_runs, judge_ep, judge_merged, merged, ring_runs
from course_grader.checks.nb14 import judge_ring as judge_ring_case

RING_CASES = ((3, 10, True, False), (3, 10, False, False), (4, 13, True, False),  # (ranks, tokens, causal, zig-zag)
              (3, 12, True, True), (4, 13, True, True))
EP_CASES = ((3, 6, None), (4, 8, 1.0))


def probe_ring(ns: dict) -> dict:
    a, b, _ = blocks(scale=60.0)  # scores of hundreds: exp(lse) overflows float32 unless rescaled by the max
    return {"large": merged(ns, a, b), "rings": [ring_runs(ns, *case) for case in RING_CASES]}


def judge_ring(got: dict) -> str:
    _, _, whole = blocks(scale=60.0)
    judge_merged(got["large"], whole, "scores of hundreds (exp overflows without the max)")
    assert len(got["rings"]) == len(RING_CASES), f"{len(got['rings'])} rings ran of the {len(RING_CASES)} cases"
    for runs, case in zip(got["rings"], RING_CASES):
        judge_ring_case(runs, *case)
    return ("large scores; 3 and 4 ranks, 10, 12 and 13 tokens (padded), causal and not, plain and zig-zag, each pass "
            "in flight while its block is attended")


register("test_ring_attention_hidden", probe_ring, judge_ring)


def probe_ep(ns: dict) -> list:
    return [ep_runs(ns, *case) for case in EP_CASES]


def judge_ep_hidden(got: list) -> str:
    assert len(got) == len(EP_CASES), f"{len(got)} layers ran of the {len(EP_CASES)} cases"
    for runs, case in zip(got, EP_CASES):
        judge_ep(runs, *case)
    return "3 ranks x 2 experts and 4 ranks x 2 experts, unequal tokens, with and without dropping"


register("test_expert_parallel_hidden", probe_ep, judge_ep_hidden)
