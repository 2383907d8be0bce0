"""Notebook 16's visible tests: the online-softmax merge (one process); the student's ring on 2 forked ranks, plain
and zig-zag, and on 3 (a block travels two hops), against attention over the whole sequence (output, log-sum-exp, the
bytes it sends, a causal ring's tiles) and by its order (each pass posted before the block's attention, waited on
after it)."""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

import course_lib.parallel.cp as cp
import course_lib.parallel.cp_cost as cp_cost
import functools

from course_grader.checks import (case_seed, error_text, in_ranks, number, packed, peer_port, plain, register, student,
                                  tensor_data)
from course_grader.grading import forbid
from course_grader.peer import Peer, Wire, join_ranks, rounds
from course_lib.distributed import CollectiveBytes

# What the exercise builds, out of reach while the student's code runs. (cp.block_attention and cp.ring_pass are the
# helpers it may use.)
CP_ANSWERS = (cp.online_softmax_merge, cp.ring_forward, cp.ring_backward, cp.RingAttention, cp.ring_attention,
              cp.tile_mask, cp._tiles, F.scaled_dot_product_attention)
RING = ("merge", "ring_forward")
B, H, D = 2, 2, 8
MAX_EVENTS = 1000  # of the order one rank's ring ran: a ring of 4 runs about 30


# ---------------------------------------------------------------- ring_attention: the merge
def blocks(seq: int = 10, cut: int = 3, scale: float = 1.0, seed: int = 0):
    """q over two disjoint key blocks: each block's (out, lse), and the whole sequence's (the reference)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, seq, D, generator=g) for _ in range(3))
    q = q * scale
    a = cp.block_attention(q, k[..., :cut, :], v[..., :cut, :])
    b = cp.block_attention(q, k[..., cut:, :], v[..., cut:, :])
    return a, b, cp.block_attention(q, k, v)


def merged(ns: dict, a, b) -> dict:
    try:
        with forbid(*CP_ANSWERS, namespace=ns):
            out, lse = ns["merge"](*a, *b)
        return {"out": tensor_data(out, torch.float32), "lse": tensor_data(lse, torch.float32)}
    except Exception as err:  # the student's error is data: the judge says which case raised
        return {"raised": error_text(err)[:300]}


def probe_merge(ns: dict) -> dict:
    a, b, _ = blocks()
    empty = cp.block_attention(a[0].new_zeros(B, H, 10, D), torch.zeros(B, H, 3, D), torch.zeros(B, H, 3, D),
                               mask=torch.zeros(10, 3, dtype=torch.bool))  # a block no row may see: lse = -inf
    return {"a, b": merged(ns, a, b), "b, a": merged(ns, b, a), "a, nothing": merged(ns, a, empty),
            "nothing, nothing": merged(ns, empty, empty)}


def judge_merged(got: dict, want, label: str) -> None:
    assert "raised" not in got, f"{label}: your merge raised {got.get('raised')}"
    for name, ref in zip(("out", "lse"), want):
        t = got[name]
        assert isinstance(t, torch.Tensor) and t.shape == ref.shape, (
            f"{label}: {name} is {t if not isinstance(t, torch.Tensor) else tuple(t.shape)}, expected shape "
            f"{tuple(ref.shape)}")
        assert not torch.isnan(t).any(), f"{label}: {name} has NaN (a row that sees no key must stay 0 / -inf)"
        ok = torch.allclose(t, ref, atol=1e-5, rtol=1e-5, equal_nan=False) if name == "out" else \
            bool(((t == ref) | torch.isclose(t, ref, atol=1e-5)).all())
        assert ok, (f"{label}: {name} differs from attention over both blocks by {float((t - ref).abs().max()):.1e}: "
                    "is each part's mean reweighted by exp(its lse - the larger lse) and divided by their sum?")


def judge_merge(got: dict) -> str:
    a, b, whole = blocks()
    judge_merged(got["a, b"], whole, "keys 0-2 then 3-9")
    judge_merged(got["b, a"], whole, "keys 3-9 then 0-2")
    judge_merged(got["a, nothing"], a, "a block merged with one no row sees (lse = -inf)")
    nothing = (torch.zeros_like(a[0]), torch.full_like(a[1], float("-inf")))
    judge_merged(got["nothing, nothing"], nothing, "two blocks no row sees")
    return "exact in either order; a block no row sees adds nothing, and no NaN"


register("test_online_softmax_merge", probe_merge, judge_merge)


# ---------------------------------------------------------------- ring_attention: the ring
def qkv(seq: int, seed: int = 0, shift: tuple[int, bool, int] | None = None) -> list[torch.Tensor]:
    """q, k and v of ``seq`` tokens; with ``shift=(world, zigzag, s)``, the keys and values at rank 0's positions of
    that split drawn from ``s`` instead: a ring whose rank 0 is the grader's, whose block reaches the student's ranks
    only by the ring's passes."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, seq, D, generator=g) for _ in range(3))
    if shift is not None:
        world, zigzag, secret = shift
        mine = cp.local_positions(0, world, cp._local_len(seq, world, zigzag), zigzag)
        mine, g = mine[mine < seq], torch.Generator().manual_seed(secret)
        for t in (k, v):
            t[:, :, mine] = torch.randn(B, H, len(mine), D, generator=g)
    return [q, k, v]


def ring_rank(seq: int, causal: bool, zigzag: bool, ns: dict, seed: int = 0, report: bool = False) -> bytes:
    """One rank: the student's ring_forward on its part of the sequence (``qkv(seq, seed)``, padded where seq does not
    divide), the bytes it moved, the scores its ``cp.block_attention`` calls computed (in blocks of local x local) and
    the order it ran (``cp.RingLog``'s events as one line: "send recv attend wait wait ..."). ``report``: then send
    its output and lse to rank 0 (the grader's, ``play_ring``), zeros where they are not tensors of their shape."""
    rank, world = dist.get_rank(), dist.get_world_size()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    q, k, v = (cp.split_sequence(t, world, zigzag=zigzag)[rank] for t in qkv(seq, seed))
    try:
        with cp_cost.counted_tiles(q.shape[-2]) as tally, forbid(*CP_ANSWERS, namespace=ns):
            with CollectiveBytes() as comm, cp.RingLog() as log:
                out, lse = ns["ring_forward"](q, k, v, causal, seq, *([True] if zigzag else []))
        got = {"out": tensor_data(out, torch.float32), "lse": tensor_data(lse, torch.float32),
               "bytes": {str(k): number(v) for k, v in comm.bytes_by_kind.items()}, "work": number(tally["tiles"]),
               "order": " ".join(event["what"] for event in log.events[:MAX_EVENTS])}
    except Exception as err:
        got = {"raised": error_text(err)[:300]}
    if report and "raised" not in got:  # the result goes to rank 0, which the judge reads; not into this data
        shapes = {"out": q.shape, "lse": q.shape[:-1]}
        wrong = [f"{key} {got[key]!r:.60}" for key, shape in shapes.items()
                 if not (isinstance(got[key], torch.Tensor) and got[key].shape == shape)]
        for key, shape in shapes.items():
            dist.send(torch.zeros(shape) if wrong else got.pop(key).float().contiguous(), dst=0)
        got["returned"] = (f"ring_forward must return (out, lse), tensors of shapes {tuple(shapes['out'])} and "
                           f"{tuple(shapes['lse'])}; it returned {', '.join(wrong)}") if wrong else None
        for key in shapes:
            got.pop(key, None)
    return packed(plain(got))


def ring_runs(ns: dict, world: int, seq: int, causal: bool, zigzag: bool = False, seed: int = 0,
              join: int | None = None) -> list:
    """``ring_rank`` on ``world`` forked ranks; with ``join`` (the port of the grader's rank 0, ``peer_port``) on ranks
    1 to ``world - 1`` of a ring whose rank 0 is the grader's (``play_ring``), each sending it its result."""
    if join is None:
        return in_ranks(ns, RING, ring_rank, world, seq=seq, causal=causal, zigzag=zigzag, seed=seed)
    rank = functools.partial(ring_rank, ns=student(ns, *RING))
    return join_ranks(rank, world - 1, dict(seq=seq, causal=causal, zigzag=zigzag, seed=seed, report=True),
                      port=join)


def reference(seq: int, causal: bool, seed: int = 0,
              shift: tuple[int, bool, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the whole sequence (``qkv(seq, seed, shift)``) in one process, float64: output and
    log-sum-exp."""
    q, k, v = (t.double() for t in qkv(seq, seed, shift))
    s = (q @ k.transpose(-2, -1)) * D ** -0.5
    if causal:
        s = s.masked_fill(~torch.ones(seq, seq, dtype=torch.bool).tril(), float("-inf"))
    return (torch.softmax(s, -1) @ v).float(), torch.logsumexp(s, -1).float()


def ring_hint(world: int, seq: int, causal: bool, zigzag: bool) -> str:
    """What a ring whose output differs from full attention's most likely missed, for this case."""
    hints = (["a causal ring: a block from an earlier rank is whole, the rank's own block is the triangle, a later "
              "rank's block is skipped"] if causal and not zigzag else [])
    hints += (["with zig-zag your rows are chunks rank and 2N-1-rank (cp.local_positions), and so are the keys you "
               "receive"] if zigzag else [])
    hints += ["the padded keys (position >= seq_len) are never seen"] if seq % (2 * world if zigzag else world) else []
    hints += (["from 3 ranks on a block travels several hops: at each step pass on the block you hold (the one you "
               "received), so that at step s you hold rank (rank - s) mod N's"] if world > 2 else [])
    return "; ".join(hints) or "start from output 0 and lse -inf and merge every block's result into yours"


def judge_ring(runs: list, world: int, seq: int, causal: bool, zigzag: bool = False, seed: int = 0,
               wire: list | None = None, secret: int | None = None) -> None:
    """A ring of ``world`` ranks: the output and lse against attention over the whole sequence, the bytes, the causal
    tiles and the order. With ``wire`` (rank 0 the grader's, its keys and values drawn from ``secret``): the blocks
    and results that reached rank 0 (``check_ring_wire``), and ``runs`` are the student's ranks 1 to ``world - 1``."""
    label = f"{world} ranks, {seq} tokens, causal={causal}{', zig-zag' if zigzag else ''}"
    first = 0 if wire is None else 1
    assert not any("stopped" in run for run in runs), f"{label}: your ranks stopped after the grader's rank 0's ring"
    assert len(runs) == world - first, f"{label}: {len(runs)} ranks answered"
    for r, run in enumerate(runs, start=first):
        assert "raised" not in run, f"{label}, rank {r}: your ring raised {run.get('raised')}"
        if wire is not None:
            assert run["returned"] is None, f"{label}, rank {r}: {run['returned']}"
            continue
        assert isinstance(run["out"], torch.Tensor) and isinstance(run["lse"], torch.Tensor), \
            f"{label}, rank {r}: ring_forward must return (out, lse) tensors, got {run['out']}, {run['lse']}"
    if wire is not None:
        check_ring_wire(wire, label, world, seq, causal, zigzag, seed, secret)
    else:
        out, lse = reference(seq, causal, seed)
        got = cp.merge_sequence([run["out"] for run in runs], seq, zigzag=zigzag)
        assert got.shape == out.shape, \
            f"{label}: the ranks' outputs make {tuple(got.shape)}, expected {tuple(out.shape)}"
        gap = float((got - out).abs().max())
        assert gap < 1e-4, (f"{label}: the output differs from attention over the whole sequence by {gap:.1e} "
                            f"({ring_hint(world, seq, causal, zigzag)})")
        got_lse = cp.merge_sequence([run["lse"].unsqueeze(-1) for run in runs], seq, zigzag=zigzag).squeeze(-1)
        assert torch.allclose(got_lse, lse, atol=1e-4), f"{label}: the log-sum-exp differs by " \
            f"{float((got_lse - lse).abs().max()):.1e}: return the merged lse over every key the row sees"
    want = cp_cost.ring_bytes_per_rank(seq, H, D, world, 4, batch=B, zigzag=zigzag)
    for r, run in enumerate(runs, start=first):
        assert run["bytes"] == {"send": want, "recv": want}, (
            f"{label}, rank {r}: your ring moved {run['bytes']} (bytes by kind); a ring sends (and receives) its K and "
            f"V block N-1 times, and nothing else: {{'send': {want}, 'recv': {want}}}")
    for r, run in enumerate(runs, start=first):
        assert isinstance(run["work"], (int, float)) and math.isfinite(run["work"]) and run["work"] >= 0, \
            f"{label}, rank {r}: the blocks of scores your cp.block_attention calls computed: {run['work']!r:.60}"
    if causal and seq % (2 * world if zigzag else world) == 0:  # no padding: every tile has a real key
        work = cp_cost.causal_work(world, zigzag)
        for r, run in enumerate(runs, start=first):
            assert run["work"] == work[r], (
                f"{label}, rank {r}: your cp.block_attention calls computed {run['work']} blocks of scores, a causal "
                f"ring computes {work[r]} here: skip every {'tile (query chunk x key chunk)' if zigzag else 'block'} "
                "no query sees, and compute each other one once")
    for r, run in enumerate(runs, start=first):
        fault = order_fault(run["order"], busy_steps(r, world, seq, causal, zigzag))
        assert fault is None, f"{label}, rank {r}: {fault}"


# ---------------------------------------------------------------- the ring, as the grader's rank 0 sees it
# Rank 0 of a wired ring is the grader's: its keys and values are drawn at grading (``qkv``'s shift), so the student's
# ranks attend to them only once the ring has brought them. It passes the block it holds at each step, as the
# contract says (K and V stacked, one tensor; cp.ring_pass), records every block it receives, and, once the ring is
# done, receives each rank's output and lse (the probe sends them).
def ring_secret(name: str, round: int) -> int:
    """The seed of rank 0's keys and values in round ``round`` of check ``name``: new to every grading."""
    return case_seed("nb15", name, round, "rank 0's keys")


def play_ring(wire: Wire, seq: int, causal: bool, zigzag: bool, seed: int, secret: int) -> None:
    """Rank 0's side of ``ring_rank`` (the grader's)."""
    world = dist.get_world_size()
    _, k, v = qkv(seq, seed, (world, zigzag, secret))
    held = torch.stack([cp.split_sequence(k, world, zigzag=zigzag)[0], cp.split_sequence(v, world, zigzag=zigzag)[0]])
    for step in range(world - 1):
        incoming = torch.empty_like(held)
        for work in cp.ring_pass(held, incoming):
            work.wait()
        wire.record("received", step=step, values=incoming.clone())
        held = incoming
    local = held.shape[-2]
    for r in range(1, world):
        out, lse = torch.empty(B, H, local, D), torch.empty(B, H, local)
        dist.recv(out, src=r)
        dist.recv(lse, src=r)
        wire.record("result", rank=r, out=out, lse=lse)


def check_ring_wire(events: list, label: str, world: int, seq: int, causal: bool, zigzag: bool, seed: int,
                    secret: int) -> None:
    """What reached the grader's rank 0: at step s, rank (N-1-s)'s block (K and V stacked), passed on hop by hop;
    then every rank's output and lse, attention over the whole sequence's at its real rows (rank 0's keys and
    values included)."""
    shift = (world, zigzag, secret)
    _, k, v = qkv(seq, seed, shift)
    blocks = [torch.stack(kv) for kv in zip(cp.split_sequence(k, world, zigzag=zigzag),
                                            cp.split_sequence(v, world, zigzag=zigzag))]
    received = {e["step"]: e["values"] for e in events if e["what"] == "received"}
    for step in range(world - 1):
        holder = (world - 1 - step) % world
        if step not in received:
            raise AssertionError(
                f"{label}: at step {step} the grader's rank 0 passed the block it held to rank 1 and posted the "
                f"receive of rank {holder}'s from rank {world - 1}, K and V stacked in one tensor of shape "
                f"{tuple(blocks[0].shape)}, and your ranks' passes did not match: at each step post the send of the "
                "block you hold (torch.stack([k, v])) to the next rank and the receive from the previous one "
                "together (cp.ring_pass)")
        assert torch.equal(received[step], blocks[holder]), (
            f"{label}: at step {step} the grader's rank 0 received another block than rank {holder}'s K and V, "
            "stacked: at step s each rank holds rank (rank - s) mod N's block, and passes that one on")
    out, lse = reference(seq, causal, seed, shift)
    local = cp._local_len(seq, world, zigzag)
    outs, lses = cp.split_sequence(out, world, zigzag=zigzag), cp.split_sequence(lse, world, zigzag=zigzag, dim=-1)
    results = {e["rank"]: e for e in events if e["what"] == "result"}
    for r in range(1, world):
        assert r in results, f"{label}: rank {r}'s output never reached the grader's rank 0 after the ring"
        real = cp.local_positions(r, world, local, zigzag) < seq
        gap = float((results[r]["out"][..., real, :] - outs[r][..., real, :]).abs().max())
        assert gap < 1e-4, (f"{label}, rank {r}: the output differs from attention over the whole sequence by "
                            f"{gap:.1e} ({ring_hint(world, seq, causal, zigzag)})")
        gap = float((results[r]["lse"][..., real] - lses[r][..., real]).abs().max())
        assert gap < 1e-4, (f"{label}, rank {r}: the log-sum-exp differs by {gap:.1e}: return the merged lse over "
                            "every key the row sees")


def busy_steps(rank: int, world: int, seq: int, causal: bool, zigzag: bool) -> list[bool]:
    """Whether ``rank``'s queries see any key of the block it holds at each step that passes a block on (0 ... N-2)."""
    local = cp._local_len(seq, world, zigzag)
    rows = cp.local_positions(rank, world, local, zigzag)  # the positions of this rank's queries
    busy = []
    for step in range(world - 1):
        holder = (rank - step) % world  # the rank whose block this one holds at this step
        keys = cp.local_positions(holder, world, local, zigzag)
        busy.append(bool(cp.tile_mask(rows, keys, causal, seq).any()))
    return busy


OVERLAP = ("post the pass of the block you hold (cp.ring_pass(send, recv), or dist.isend and dist.irecv), attend "
           "to that block and merge, and only then wait on the works: the next block travels while this one is "
           "computed")
WAITED = f"your ring waited for a pass before attending to the block it holds (the compute waits): {OVERLAP}"
SENT_LATE = f"your ring attended to a block before posting its pass (the transfer waits): {OVERLAP}"


def order_fault(order, busy: list[bool]) -> str | None:
    """What is wrong with the order one rank's ring ran (``RingLog``'s events, one line), or None. A pass is in flight
    from a post to the next wait; each step that passes a block on and has keys to attend (``busy``) attends while its
    pass is in flight, and nothing is attended with no pass in flight until the last pass is waited on."""
    if not isinstance(order, str):
        return f"the order your ring ran is missing ({order!r:.60})"
    events = order.split()
    ran = f"(this rank ran: {' '.join(events[:14])}{' ...' if len(events) > 14 else ''})"
    if "attend" not in events:
        return f"no cp.block_attention call: attend your queries to each block with cp.block_attention {ran}"
    last_wait = max((i for i, what in enumerate(events) if what == "wait"), default=-1)
    passes, in_flight = [], False  # for each pass in flight, the blocks attended meanwhile
    for i, what in enumerate(events):
        if what in ("send", "recv"):
            if not in_flight:
                passes.append(0)
            in_flight = True
        elif what == "wait":
            in_flight = False
        elif what == "attend" and in_flight:
            passes[-1] += 1
        elif what == "attend" and i < last_wait:  # computed with nothing in flight, more passes to come
            return f"{WAITED if i > 0 and events[i - 1] == 'wait' else SENT_LATE} {ran}"
    if len(passes) != len(busy):
        return (f"your ring's passes were in flight over {len(passes)} spans (each from a post to the next wait), "
                f"where a ring of {len(busy) + 1} ranks makes {len(busy)} pass{'es' * (len(busy) != 1)}: post a step's "
                "send and receive together (cp.ring_pass, or dist.isend and dist.irecv, not the blocking dist.send and "
                f"dist.recv), and wait on them once its block is attended {ran}")
    for step, (attended, needed) in enumerate(zip(passes, busy)):
        if needed and not attended:
            return f"at step {step}, {WAITED} {ran}"
    return None


# (ranks, tokens, causal, zig-zag). 2 ranks make one pass; only a ring of 3 or more passes on a block it received,
# so a ring that sends its own block at every step is right on 2 and wrong from 3.
VISIBLE_RINGS = ((2, 8, True, False), (2, 8, False, False), (2, 8, True, True), (3, 6, False, False))


def play_ring_visible(wire: Wire, round: int) -> None:
    play_ring(wire, *VISIBLE_RINGS[round][1:], seed=0, secret=ring_secret("test_ring_attention", round))


def probe_ring(ns: dict) -> list:
    return [ring_runs(ns, *case, join=peer_port("test_ring_attention", i)) for i, case in enumerate(VISIBLE_RINGS)]


def judge_ring_visible(got: list, wire: list) -> str:
    assert len(got) == len(VISIBLE_RINGS), f"{len(got)} rings ran of the {len(VISIBLE_RINGS)} cases"
    for i, (runs, case, events) in enumerate(zip(got, VISIBLE_RINGS, rounds(wire, len(VISIBLE_RINGS)))):
        judge_ring(runs, *case, wire=events, secret=ring_secret("test_ring_attention", i))
    return ("2 ranks, causal and not, plain and zig-zag, and 3 ranks: full attention's output and lse, K/V sent N-1 "
            "times, the causal ring's tiles, and each pass in flight while its block is attended")


register("test_ring_attention", probe_ring, judge_ring_visible,
         Peer(world=tuple(case[0] for case in VISIBLE_RINGS), play=play_ring_visible, rounds=len(VISIBLE_RINGS)))
