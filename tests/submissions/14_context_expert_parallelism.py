"""Known submissions of 14_context_expert_parallelism and the scores nbgrader's autograde must give them.

Each case replaces the named solution cells of the solution notebook; every other solution cell
keeps the reference solution. ``scores`` gives the expected points of every graded cell. The ring's order
mistakes are edits of today's solution cell (tests/solved.py), never copies of it.
"""

from solved import edit, solution

# The reference merge and ring of the solution notebook; each mistake below changes it in one or two places.
RING_SOLUTION = '''
def merge(out_a, lse_a, out_b, lse_b):
    top = torch.maximum(lse_a, lse_b)
    top = torch.where(torch.isfinite(top), top, 0.0)  # both parts empty: keep zeros, not NaN
    sum_a, sum_b = torch.exp(lse_a - top), torch.exp(lse_b - top)  # each part's softmax sum, rescaled
    total = sum_a + sum_b
    out = (sum_a.unsqueeze(-1) * out_a + sum_b.unsqueeze(-1) * out_b) / total.clamp_min(1e-30).unsqueeze(-1)
    return out, top + torch.log(total)
def ring_forward(q, k, v, causal, seq_len, zigzag=False):
    rank, world = dist.get_rank(), dist.get_world_size()
    local = q.shape[-2]
    chunks = [slice(0, local // 2), slice(local // 2, local)] if zigzag else [slice(0, local)]
    q_pos = cp.local_positions(rank, world, local, zigzag)
    out = torch.zeros(*q.shape[:-1], v.shape[-1])
    lse = torch.full(q.shape[:-1], float("-inf"))
    kv = torch.stack([k, v])  # K and V travel as one message
    for step in range(world):
        incoming = torch.empty_like(kv)
        pending = cp.ring_pass(kv, incoming) if step < world - 1 else []  # the next block fills while we compute
        k_pos = cp.local_positions((rank - step) % world, world, local, zigzag)
        for qs in chunks:  # one tile per (query chunk, key chunk): the whole block where the split is plain
            for ks in chunks:
                mask = (k_pos[ks] < seq_len).expand(qs.stop - qs.start, -1)  # padding is never seen
                if causal:
                    mask = mask & (k_pos[ks][None, :] <= q_pos[qs][:, None])  # a key at or before the query
                if mask.any():  # a tile no query sees (a later block or chunk): skip it
                    o, l = cp.block_attention(q[..., qs, :], kv[0][..., ks, :], kv[1][..., ks, :],
                                              None if mask.all() else mask)
                    out[..., qs, :], lse[..., qs] = merge(out[..., qs, :], lse[..., qs], o, l)
        for p in pending:
            p.wait()
        kv = incoming
    return out, lse
'''

# The reference capacity rule, dispatch and combine; each mistake below changes them in one place.
EXPERT_SOLUTION = '''
def within_capacity(expert, n_experts, cap):
    onehot = F.one_hot(expert, n_experts)
    place = (onehot.cumsum(0) * onehot).sum(-1) - 1  # how many choices of this expert queued before this one
    return place < cap


def dispatch(tokens, routing, n_experts, group=None):
    world = dist.get_world_size(group)
    order = torch.argsort(routing.expert, stable=True)  # by expert, hence by the rank that owns it
    counts = torch.bincount(routing.expert, minlength=n_experts)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)  # the split sizes first: receive buffers need their sizes
    recv_counts = recv_counts.view(world, -1)
    send_splits = counts.view(world, -1).sum(1).tolist()
    recv_splits = recv_counts.sum(1).tolist()
    received = ep.all_to_all(tokens[routing.token[order]], send_splits, recv_splits, group)
    return received, ep.Plan(order, send_splits, recv_splits, recv_counts)


def combine(expert_out, routing, plan, n_tokens, group=None):
    back = ep.all_to_all(expert_out, plan.recv_splits, plan.send_splits, group)  # rows return in the order sent
    token, gate = routing.token[plan.order], routing.gate[plan.order]  # ... which is the order sorted by expert
    out = back.new_zeros(n_tokens, back.shape[-1])
    return out.index_add(0, token, (gate[:, None] * back).to(back.dtype))
'''


def changed(*edits: tuple[str, str], reference: str = RING_SOLUTION) -> str:
    """``reference`` with each (old, new) edit made (every old text found exactly once)."""
    out = reference
    for old, new in edits:
        assert out.count(old) == 1, old
        out = out.replace(old, new)
    return out


# the partial outputs averaged, never reweighted by their softmax sums
MERGE_NO_RESCALE = changed(("""    top = torch.maximum(lse_a, lse_b)
    top = torch.where(torch.isfinite(top), top, 0.0)  # both parts empty: keep zeros, not NaN
    sum_a, sum_b = torch.exp(lse_a - top), torch.exp(lse_b - top)  # each part's softmax sum, rescaled
    total = sum_a + sum_b
    out = (sum_a.unsqueeze(-1) * out_a + sum_b.unsqueeze(-1) * out_b) / total.clamp_min(1e-30).unsqueeze(-1)
    return out, top + torch.log(total)""", """    return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)  # wrong: no reweighting"""))

# the right formula without FlashAttention's max: exp(lse) overflows float32 once scores pass ~88 (hidden test)
MERGE_OVERFLOWS = changed(("""    top = torch.where(torch.isfinite(top), top, 0.0)  # both parts empty: keep zeros, not NaN""",
                           """    top = torch.zeros_like(top)  # wrong: exp(lse) unscaled overflows on large scores"""))

# the causal mask on the wrong side: later keys seen, earlier ones hidden
CAUSAL_WRONG_BLOCKS = changed(("mask = mask & (k_pos[ks][None, :] <= q_pos[qs][:, None])",
                               "mask = mask & (k_pos[ks][None, :] >= q_pos[qs][:, None])"))

# the padded keys seen: right wherever the length divides (the visible test), wrong where it does not (hidden)
PADDING_SEEN = changed(("mask = (k_pos[ks] < seq_len).expand(qs.stop - qs.start, -1)  # padding is never seen",
                        "mask = torch.ones(qs.stop - qs.start, ks.stop - ks.start, dtype=torch.bool)  # wrong"))
# zig-zag's rows placed as the plain split's: right for a plain ring, wrong wherever the split is zig-zag
ZIGZAG_AS_PLAIN = changed(("q_pos = cp.local_positions(rank, world, local, zigzag)",
                           "q_pos = cp.local_positions(rank, world, local)"),
                          ("k_pos = cp.local_positions((rank - step) % world, world, local, zigzag)",
                           "k_pos = cp.local_positions((rank - step) % world, world, local)  # wrong: zig-zag ignored"))
# zig-zag's block attended whole, masked: the right output, but every rank computes N blocks (no balance, no saving)
ZIGZAG_WHOLE_BLOCKS = changed(("[slice(0, local // 2), slice(local // 2, local)] if zigzag else [slice(0, local)]",
                               "[slice(0, local)]  # wrong: zig-zag's tiles never skipped"))
# every block attended, those no query sees too (all masked): the right output, a causal ring's saving thrown away
NO_SKIP = changed(("                if mask.any():  # a tile no query sees (a later block or chunk): skip it",
                   "                if True:  # wrong: a tile no query sees is computed anyway"))

# every step sends the rank's own block again, not the one it holds: right on 2 ranks (one pass), wrong from 3, where
# rank r receives rank r-1's block at every step and never rank r-2's
RESENDS_OWN_BLOCK = changed(("pending = cp.ring_pass(kv, incoming) if step < world - 1 else []",
                             "pending = cp.ring_pass(torch.stack([k, v]), incoming) if step < world - 1 else []"))

# The ring's pass and its wait in the solution cell: the order mistakes below move one of them. Both give the right
# output and bytes; only the order the ring ran (cp.RingLog) shows the transfer and the compute taking turns.
RING_CELL = solution("14_context_expert_parallelism", "ring_attention")
OVERLAPS = "  # the next block fills while we compute"
POST = f"        pending = cp.ring_pass(kv, incoming) if step < world - 1 else []{OVERLAPS}\n"
WAIT = "        for p in pending:\n            p.wait()\n"
# each block attended first, its pass posted only after: the transfer waits for the compute
RING_COMPUTES_THEN_SENDS = edit(RING_CELL, (POST, ""),
                                (WAIT, POST.replace(OVERLAPS, "  # wrong: after the compute") + WAIT))
# the pass posted first, but waited on at once: the compute waits for the transfer
RING_WAITS_BEFORE_COMPUTING = edit(RING_CELL, (WAIT, ""),
                                   (POST, POST + WAIT.replace("()", "()  # wrong: before the compute")))

CALLS_LIBRARY_RING = '''
import course_lib.parallel.cp as _cp

merge = _cp.online_softmax_merge


def ring_forward(q, k, v, causal, seq_len, zigzag=False):
    return _cp.ring_forward(q, k, v, causal=causal, seq_len=seq_len, zigzag=zigzag, merge=merge)[:2]
'''

# each rank expects to receive what it sends: the ranks' different token counts make gloo fail the all-to-all
SPLITS_NOT_EXCHANGED = changed(("""    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)  # the split sizes first: receive buffers need their sizes
    recv_counts = recv_counts.view(world, -1)""", """    recv_counts = counts.view(world, -1)  # wrong: the split sizes are never exchanged"""), reference=EXPERT_SOLUTION)

# the returned rows summed in token order, not in the (sorted) order they were sent
COMBINE_WRONG_ORDER = changed(("    token, gate = routing.token[plan.order], routing.gate[plan.order]",
                               "    token, gate = routing.token, routing.gate  # wrong: not the order the rows were sent in"),
                              reference=EXPERT_SOLUTION)

CAPACITY_IGNORED = changed(("    return place < cap",
                            "    return torch.ones_like(place, dtype=torch.bool)  # wrong: capacity ignored"),
                           reference=EXPERT_SOLUTION)

CALLS_LIBRARY_EXPERTS = '''
import course_lib.parallel.ep as _ep

within_capacity, dispatch, combine = _ep.within_capacity, _ep.dispatch, _ep.combine
'''

FULL = {"test_online_softmax_merge": 2, "test_ring_attention": 3, "test_ring_attention_hidden": 4,
        "test_expert_parallel": 3, "test_expert_parallel_hidden": 4}
RING = ("test_online_softmax_merge", "test_ring_attention", "test_ring_attention_hidden")
EXPERTS = ("test_expert_parallel", "test_expert_parallel_hidden")


def scores(*lost) -> dict:
    """Full marks except the named test cells, which score 0."""
    return {**FULL, **{k: 0 for k in lost}}


CASES = {
    "merge_no_rescale": {"cells": {"ring_attention": MERGE_NO_RESCALE}, "scores": scores(*RING)},
    "merge_overflows": {"cells": {"ring_attention": MERGE_OVERFLOWS}, "scores": scores("test_ring_attention_hidden")},
    "causal_wrong_blocks": {"cells": {"ring_attention": CAUSAL_WRONG_BLOCKS},
                            "scores": scores("test_ring_attention", "test_ring_attention_hidden")},
    "padding_seen": {"cells": {"ring_attention": PADDING_SEEN}, "scores": scores("test_ring_attention_hidden")},
    "zigzag_as_plain": {"cells": {"ring_attention": ZIGZAG_AS_PLAIN},
                        "scores": scores("test_ring_attention", "test_ring_attention_hidden")},
    "zigzag_whole_blocks": {"cells": {"ring_attention": ZIGZAG_WHOLE_BLOCKS},
                            "scores": scores("test_ring_attention", "test_ring_attention_hidden")},
    "no_skip": {"cells": {"ring_attention": NO_SKIP},
                "scores": scores("test_ring_attention", "test_ring_attention_hidden")},
    "resends_own_block": {"cells": {"ring_attention": RESENDS_OWN_BLOCK},
                          "scores": scores("test_ring_attention", "test_ring_attention_hidden")},
    "ring_computes_then_sends": {"cells": {"ring_attention": RING_COMPUTES_THEN_SENDS},
                                 "scores": scores("test_ring_attention", "test_ring_attention_hidden")},
    "ring_waits_before_computing": {"cells": {"ring_attention": RING_WAITS_BEFORE_COMPUTING},
                                    "scores": scores("test_ring_attention", "test_ring_attention_hidden")},
    "calls_library_ring_attention": {"cells": {"ring_attention": CALLS_LIBRARY_RING}, "scores": scores(*RING)},
    "splits_not_exchanged": {"cells": {"expert_parallel": SPLITS_NOT_EXCHANGED}, "scores": scores(*EXPERTS)},
    "combine_wrong_order": {"cells": {"expert_parallel": COMBINE_WRONG_ORDER}, "scores": scores(*EXPERTS)},
    "capacity_ignored": {"cells": {"expert_parallel": CAPACITY_IGNORED}, "scores": scores(*EXPERTS)},
    "calls_library_expert_parallel": {"cells": {"expert_parallel": CALLS_LIBRARY_EXPERTS}, "scores": scores(*EXPERTS)},
}
