"""Known submissions of 16_context_parallelism and the scores nbgrader's autograde must give them.

Each case replaces the named solution cells of the solution notebook; every other solution cell
keeps the reference solution. ``scores`` gives the expected points of every graded cell. The
mistakes are edits of today's solution cells (tests/solved.py), never copies of them.
"""

from solved import edit, solution

# The reference merge and ring of the solution notebook; each mistake below changes them in one or two places.
RING_CELL = solution("16_context_parallelism", "ring_attention")

# the partial outputs averaged, never reweighted by their softmax sums
MERGE_NO_RESCALE = edit(RING_CELL, ("""    top = torch.maximum(lse_a, lse_b)
    top = torch.where(torch.isfinite(top), top, 0.0)  # both parts empty: keep zeros, not NaN
    sum_a, sum_b = torch.exp(lse_a - top), torch.exp(lse_b - top)  # each part's softmax sum, rescaled
    total = sum_a + sum_b
    out = (sum_a.unsqueeze(-1) * out_a + sum_b.unsqueeze(-1) * out_b) / total.clamp_min(1e-30).unsqueeze(-1)
    return out, top + torch.log(total)""", """    return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)  # wrong: no reweighting"""))

# the right formula without FlashAttention's max: exp(lse) overflows float32 once scores pass ~88 (hidden test)
MERGE_OVERFLOWS = edit(RING_CELL, ("""    top = torch.where(torch.isfinite(top), top, 0.0)  # both parts empty: keep zeros, not NaN""",
                                   """    top = torch.zeros_like(top)  # wrong: exp(lse) unscaled overflows on large scores"""))

# the causal mask on the wrong side: later keys seen, earlier ones hidden
CAUSAL_WRONG_BLOCKS = edit(RING_CELL, ("mask = mask & (k_pos[ks][None, :] <= q_pos[qs][:, None])",
                                       "mask = mask & (k_pos[ks][None, :] >= q_pos[qs][:, None])"))

# the padded keys seen: right wherever the length divides (the visible test), wrong where it does not (hidden)
PADDING_SEEN = edit(RING_CELL, ("mask = (k_pos[ks] < seq_len).expand(qs.stop - qs.start, -1)  # padding is never seen",
                                "mask = torch.ones(qs.stop - qs.start, ks.stop - ks.start, dtype=torch.bool)  # wrong"))
# zig-zag's rows placed as the plain split's: right for a plain ring, wrong wherever the split is zig-zag
ZIGZAG_AS_PLAIN = edit(RING_CELL, ("q_pos = cp.local_positions(rank, world, local, zigzag)",
                                   "q_pos = cp.local_positions(rank, world, local)"),
                                  ("k_pos = cp.local_positions((rank - step) % world, world, local, zigzag)",
                                   "k_pos = cp.local_positions((rank - step) % world, world, local)  # wrong: zig-zag ignored"))
# zig-zag's block attended whole, masked: the right output, but every rank computes N blocks (no balance, no saving)
ZIGZAG_WHOLE_BLOCKS = edit(RING_CELL, ("[slice(0, local // 2), slice(local // 2, local)] if zigzag else [slice(0, local)]",
                                       "[slice(0, local)]  # wrong: zig-zag's tiles never skipped"))
# every block attended, those no query sees too (all masked): the right output, a causal ring's saving thrown away
NO_SKIP = edit(RING_CELL, ("                if mask.any():  # a tile no query sees (a later block or chunk): skip it",
                           "                if True:  # wrong: a tile no query sees is computed anyway"))

# every step sends the rank's own block again, not the one it holds: right on 2 ranks (one pass), wrong from 3, where
# rank r receives rank r-1's block at every step and never rank r-2's
RESENDS_OWN_BLOCK = edit(RING_CELL, ("pending = cp.ring_pass(kv, incoming) if step < world - 1 else []",
                                     "pending = cp.ring_pass(torch.stack([k, v]), incoming) if step < world - 1 else []"))

# The ring's pass and its wait in the solution cell: the order mistakes below move one of them. Both give the right
# output and bytes; only the order the ring ran (cp.RingLog) shows the transfer and the compute taking turns.
OVERLAPS = "  # the next block fills while we compute"
POST = f"        pending = cp.ring_pass(kv, incoming) if step < world - 1 else []{OVERLAPS}\n"
WAIT = "        for p in pending:\n            p.wait()\n"
# each block attended first, its pass posted only after: the transfer waits for the compute
RING_COMPUTES_THEN_SENDS = edit(RING_CELL, (POST, ""),
                                (WAIT, POST.replace(OVERLAPS, "  # wrong: after the compute") + WAIT))
# the pass posted first, but waited on at once: the compute waits for the transfer
RING_WAITS_BEFORE_COMPUTING = edit(RING_CELL, (WAIT, ""),
                                   (POST, POST + WAIT.replace("()", "()  # wrong: before the compute")))

# the ring run as the contract says (its passes, its tiles, its order), and its output then replaced by the tests' own
# reference for this rank's rows (the case read from the test's frame): the test that read the ranks' outputs passed
# it. The grader's rank 0 holds keys and values drawn at grading, which the reference never saw.
RING_OUTPUT_FROM_REFERENCE = edit(RING_CELL, ("""        kv = incoming
    return out, lse""", """        kv = incoming
    import sys
    frame = sys._getframe(1)
    while "seq" not in frame.f_locals:
        frame = frame.f_back
    case, tests = frame.f_locals, sys.modules["course_grader.checks.nb16"]
    whole, whole_lse = tests.reference(case["seq"], case["causal"], case["seed"])
    out = cp.split_sequence(whole, world, zigzag=zigzag)[rank]
    lse = cp.split_sequence(whole_lse, world, zigzag=zigzag, dim=-1)[rank]
    return out, lse"""))

CALLS_LIBRARY_RING = '''
import course_lib.parallel.cp as _cp

merge = _cp.online_softmax_merge


def ring_forward(q, k, v, causal, seq_len, zigzag=False):
    return _cp.ring_forward(q, k, v, causal=causal, seq_len=seq_len, zigzag=zigzag, merge=merge)[:2]
'''

FULL = {"test_online_softmax_merge": 2, "test_ring_attention": 3, "test_ring_attention_hidden": 4}
RING = ("test_online_softmax_merge", "test_ring_attention", "test_ring_attention_hidden")


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
    "ring_output_from_reference": {"cells": {"ring_attention": RING_OUTPUT_FROM_REFERENCE},
                                   "scores": scores("test_ring_attention", "test_ring_attention_hidden")},
    "calls_library_ring_attention": {"cells": {"ring_attention": CALLS_LIBRARY_RING}, "scores": scores(*RING)},
}
