"""Notebook 16's hidden tests (instructor edition only): the merge on scores large enough to overflow exp() without
rescaling; the ring on 3 and 4 ranks (rank 0 the grader's), plain and zig-zag, with lengths that do not divide
(padded keys masked), each pass in flight while its block is attended."""

from __future__ import annotations

import random


from course_grader.checks import case_seed, peer_port, register
from course_grader.checks.nb16 import (blocks, judge_merged, merged,
                                    play_ring, ring_runs, ring_secret)
from course_grader.checks.nb16 import judge_ring as judge_ring_case
from course_grader.peer import Peer, Wire, rounds

# (ranks, causal, zig-zag) and the token counts a case draws from: no plain ring's count divides its ranks (padded
# keys masked), the zig-zag ring of 3's divides 2 x 3 (its causal tiles are counted), the zig-zag ring of 4's does not
# divide 2 x 4; in every count each rank holds a real token
RING_CASES = (((3, True, False), (7, 8, 10, 11, 13, 14)), ((3, False, False), (7, 8, 10, 11, 13, 14)),
              ((4, True, False), (10, 11, 13, 14, 15)), ((3, True, True), (6, 12, 18)),
              ((4, True, True), (9, 11, 13, 15)))


def rings() -> list[tuple]:
    """Each ring's (ranks, tokens, causal, zig-zag) and the seed of its q, k and v: new to every grading."""
    rng = random.Random(case_seed("nb15", "ring tokens"))
    return [((world, rng.choice(tokens), causal, zigzag), case_seed("nb15", "ring", i))
            for i, ((world, causal, zigzag), tokens) in enumerate(RING_CASES)]


def large() -> tuple:
    """Scores of hundreds (q scaled by 60), new to every grading: exp(lse) overflows float32 (past 88) unless rescaled
    by the max, whatever the seed (the largest lse of 3,000 seeds tried was 118 at the least)."""
    return blocks(scale=60.0, seed=case_seed("nb15", "large scores"))


def play_rings(wire: Wire, round: int) -> None:
    """The grader's rank 0 of each ring."""
    (_, seq, causal, zigzag), seed = rings()[round]
    play_ring(wire, seq, causal, zigzag, seed, ring_secret("test_ring_attention_hidden", round))


def probe_ring(ns: dict) -> dict:
    a, b, _ = large()
    return {"large": merged(ns, a, b),
            "rings": [ring_runs(ns, *case, seed=seed, join=peer_port("test_ring_attention_hidden", i))
                      for i, (case, seed) in enumerate(rings())]}


def judge_ring(got: dict, wire: list) -> str:
    _, _, whole = large()
    judge_merged(got["large"], whole, "scores of hundreds (exp overflows without the max)")
    assert len(got["rings"]) == len(RING_CASES), f"{len(got['rings'])} rings ran of the {len(RING_CASES)} cases"
    for i, (runs, (case, seed), events) in enumerate(zip(got["rings"], rings(), rounds(wire, len(RING_CASES)))):
        judge_ring_case(runs, *case, seed=seed, wire=events, secret=ring_secret("test_ring_attention_hidden", i))
    return ("large scores; 3 and 4 ranks, token counts that do not divide (padded) and one that does, causal and not, "
            "plain and zig-zag, each pass in flight while its block is attended")


register("test_ring_attention_hidden", probe_ring, judge_ring,
         Peer(world=tuple(world for (world, _, _), _ in RING_CASES), play=play_rings, rounds=len(RING_CASES)))
