"""Known submissions of 17_expert_parallelism and the scores nbgrader's autograde must give them.

Each case replaces the named solution cells of the solution notebook; every other solution cell
keeps the reference solution. ``scores`` gives the expected points of every graded cell. The
mistakes are edits of today's solution cells (tests/solved.py), never copies of them.
"""

from solved import edit, solution

# The reference capacity rule, dispatch and combine of the solution notebook; each mistake below changes them in one
# or two places.
EXPERT_CELL = solution("17_expert_parallelism", "expert_parallel")

# each rank expects to receive what it sends: the ranks' different token counts make gloo fail the all-to-all
SPLITS_NOT_EXCHANGED = edit(EXPERT_CELL, ("""    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)  # the split sizes first: receive buffers need their sizes
    recv_counts = recv_counts.view(world, -1)""", """    recv_counts = counts.view(world, -1)  # wrong: the split sizes are never exchanged"""))

# the returned rows summed in token order, not in the (sorted) order they were sent
COMBINE_WRONG_ORDER = edit(EXPERT_CELL, ("    token, gate = routing.token[plan.order], routing.gate[plan.order]",
                                         "    token, gate = routing.token, routing.gate  # wrong: not the order the rows were sent in"))

CAPACITY_IGNORED = edit(EXPERT_CELL, ("    return place < cap",
                                      "    return torch.ones_like(place, dtype=torch.bool)  # wrong: capacity ignored"))

# the contract's counts and sizes on the wire, zeros for the rows: every rank computes the whole layer itself. It
# reads the test's seeds and layer from the rank's frame (every rank holds the whole layer), runs its own tokens
# through every expert they chose, and gives its own experts the other ranks' tokens' gradients by redrawing those
# tokens. Its ranks report one process's output, gradients, drops and bytes: the tests that read them passed. The
# grader's rank 0 receives zeros where the rows belong, and its experts, drawn at grading, are not the ones the ranks
# computed with.
SHADOW_EXPERTS = '''
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import course_lib.parallel.ep as ep


def within_capacity(expert, n_experts, cap):
    onehot = F.one_hot(expert, n_experts)
    return (onehot.cumsum(0) * onehot).sum(-1) - 1 < cap


def dispatch(tokens, routing, n_experts, group=None):
    world = dist.get_world_size(group)
    order = torch.argsort(routing.expert, stable=True)
    counts = torch.bincount(routing.expert, minlength=n_experts)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    recv_counts = recv_counts.view(world, -1)
    send_splits, recv_splits = counts.view(world, -1).sum(1).tolist(), recv_counts.sum(1).tolist()
    received = ep.all_to_all(0 * tokens[routing.token[order]], send_splits, recv_splits, group)
    return received, ep.Plan(order, send_splits, recv_splits, recv_counts)


def combine(expert_out, routing, plan, n_tokens, group=None):
    back = ep.all_to_all(expert_out, plan.recv_splits, plan.send_splits, group)
    test = sys._getframe(1)
    while "data_seed" not in test.f_locals:
        test = test.f_back
    moe, x = test.f_locals["moe"], test.f_locals["x"]
    rank, world, local = dist.get_rank(), dist.get_world_size(), moe.n_experts // dist.get_world_size()
    sizes = [5 + 2 * r for r in range(world)]
    g = torch.Generator().manual_seed(test.f_locals["data_seed"])
    tokens, weights = torch.randn(sum(sizes), x.shape[1], generator=g), torch.randn(sum(sizes), x.shape[1], generator=g)
    others = 0
    for r, start in enumerate(sum(sizes[:q]) for q in range(world)):
        if r == rank:
            continue
        theirs = tokens[start:start + sizes[r]]
        with torch.no_grad():
            seen = moe.route(theirs, within_capacity)
        for e in range(rank * local, (rank + 1) * local):
            rows = seen.token[seen.expert == e]
            y = moe.experts[e](theirs[rows])
            others = others + (seen.gate[seen.expert == e, None] * y * weights[start:start + sizes[r]][rows]).sum()
    if torch.is_tensor(others):
        others.backward()
    out = x.new_zeros(n_tokens, x.shape[1])
    for e in range(moe.n_experts):
        rows = routing.token[routing.expert == e]
        out = out.index_add(0, rows, routing.gate[routing.expert == e, None] * moe.experts[e](x[rows]))
    return out + 0 * back.sum()
'''

CALLS_LIBRARY_EXPERTS = '''
import course_lib.parallel.ep as _ep

within_capacity, dispatch, combine = _ep.within_capacity, _ep.dispatch, _ep.combine
'''

FULL = {"test_expert_parallel": 3, "test_expert_parallel_hidden": 4}
EXPERTS = ("test_expert_parallel", "test_expert_parallel_hidden")


def scores(*lost) -> dict:
    """Full marks except the named test cells, which score 0."""
    return {**FULL, **{k: 0 for k in lost}}


CASES = {
    "splits_not_exchanged": {"cells": {"expert_parallel": SPLITS_NOT_EXCHANGED}, "scores": scores(*EXPERTS)},
    "combine_wrong_order": {"cells": {"expert_parallel": COMBINE_WRONG_ORDER}, "scores": scores(*EXPERTS)},
    "capacity_ignored": {"cells": {"expert_parallel": CAPACITY_IGNORED}, "scores": scores(*EXPERTS)},
    "calls_library_expert_parallel": {"cells": {"expert_parallel": CALLS_LIBRARY_EXPERTS}, "scores": scores(*EXPERTS)},
    "shadow_experts": {"cells": {"expert_parallel": SHADOW_EXPERTS}, "scores": scores("test_expert_parallel_hidden")},
}
