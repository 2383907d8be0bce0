"""Context parallelism by hand: the sequence split across ranks, attention computed as a ring of K/V blocks.

Tensor and pipeline parallelism split the weights; a long sequence is a different problem: attention's
activations grow with the sequence, and one rank holding all of it runs out. Context parallelism gives
rank r one block of the sequence (its queries, keys and values). Every token still needs every earlier
key, so the K/V blocks travel round a ring: at each of N steps a rank attends its queries to the block it
holds and passes that block on, N-1 passes in all. Each step gives a partial attention result over one
block of keys; the online softmax (FlashAttention's rescaling) merges the partial results exactly, so the
ring gives the same numbers as attention over the whole sequence in one process.

- ``block_attention``: attention of queries over one block of keys, returning the output *and* the
  log-sum-exp of the scores (the softmax's denominator), which is what the merge needs; K/V may have fewer heads
  than the queries (grouped-query attention, GQA), and then so do the blocks that travel.
- ``online_softmax_merge``: two partial results over disjoint key blocks -> the result over their union.
- ``ring_attention``: the ring itself (``ring_pass`` one step of it, ``ring_forward`` / ``ring_backward`` its two
  halves), an autograd Function whose backward runs the ring again; ``tile_mask`` says what each tile sees.
  Behind a ring given as ``forward`` (notebook 16's, written by the student) the backward is ``gathered_backward``:
  every K/V block gathered, one all-reduce of their gradients, no ring loop of its own. ``RingLog`` records a
  rank's ring in order (passes posted, blocks attended, works waited on): whether each pass overlaps a compute.
  ``gathered_forward`` is the forward's other design (torch's ``context_parallel``'s default): every K/V block
  gathered at once, no ring. Both forwards take grouped K/V heads; ``ring_attention``'s backward takes equal ones.
- ``split_sequence`` / ``merge_sequence`` (``zigzag_split`` / ``zigzag_merge``): each rank's block; with a
  causal mask the plain split leaves rank 0 one block of work and rank N-1 N blocks; the zig-zag split
  gives rank r chunks r and 2N-1-r of 2N, an early and a late one, and every rank the same work.

- ``ring_llama``: the course's Llama with its attention on the ring (``ring_llama_attention``, registered with
  transformers; ``no_mask``: it gets no mask), ``ring_llama_loss`` one rank's share of its loss and ``sum_gradients``
  the sum of the ranks' gradients: what ``cp_torch.train`` trains by hand (its design "hand").

What the ring costs per rank (work, bytes, memory) is ``cp_cost``'s; the one training worker, by hand or with torch's
``context_parallel``, is ``cp_torch``'s.

Tensors are laid out as SDPA's: (batch, heads, sequence, head_dim); the sequence is dim -2.
A length that does not divide by the world (or 2 x world for zig-zag) is padded at the end; the padded
keys are masked, so their values never reach a real token, and ``merge_sequence`` drops the padded rows.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib.attention import repeat_kv
from course_lib.distributed import Timeline
from course_lib.loss import IGNORE_INDEX
from course_lib.models import build_llama

SEQ_DIM = -2  # (batch, heads, sequence, head_dim)


def _rank_world(group=None) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    """Accumulate in float32 at least: bf16 scores and sums lose the small terms the merge adds up."""
    return torch.promote_types(t.dtype, torch.float32)


# ---------------------------------------------------------------------------------------------------------
# One block, and the merge


def _probabilities(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """softmax(scores) given its log-sum-exp; a row that sees no key (lse = -inf) gets zeros, not NaN."""
    seen = torch.isfinite(lse).unsqueeze(-1)
    return torch.where(seen, torch.exp(scores - torch.where(seen, lse.unsqueeze(-1), 0.0)), 0.0)


def _scores(q, k, mask, scale):
    acc = _acc_dtype(q)
    s = (q.to(acc) @ k.to(acc).transpose(-2, -1)) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                    scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over one block of keys: (out, lse), both in float32 (at least).

    ``mask`` (q_len, k_len), True where a query may see a key (SDPA's convention), None for all.
    ``out`` is normalised over this block's keys only; ``lse`` = log sum_j exp(score_j) over them
    (-inf for a row that sees none) is the weight the merge needs to combine it with other blocks.
    Grouped-query attention: ``k`` and ``v`` (batch, kv_heads, k_len, head_dim) with ``kv_heads`` a divisor of ``q``'s
    heads; query head h attends with K/V head h // (heads / kv_heads), as ``attention.repeat_kv`` pairs them.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    shape, groups = q.shape, 1
    if q.dim() == k.dim() == 4 and k.shape[1] != q.shape[1]:
        if q.shape[1] % k.shape[1]:
            raise ValueError(f"{q.shape[1]} query heads do not group onto {k.shape[1]} K/V heads: give K/V heads "
                             "that divide the query's")
        # the query heads that share a K/V head become that head's rows: K/V are never repeated
        groups = q.shape[1] // k.shape[1]
        q = q.reshape(shape[0], k.shape[1], groups * shape[2], shape[3])
        mask = None if mask is None else mask.repeat(groups, 1)
    s = _scores(q, k, mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    out = _probabilities(s, lse) @ v.to(s.dtype)
    return (out, lse) if groups == 1 else (out.reshape(*shape[:-1], out.shape[-1]), lse.reshape(shape[:-1]))


# graded: 16_context_parallelism ring_attention
def online_softmax_merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                         lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention results over disjoint key blocks into the result over both, exactly.

    Each ``out`` is a softmax-weighted mean over its own keys, with softmax sum exp(lse). Over the union the
    sum is exp(lse_a) + exp(lse_b), and each part's mean is reweighted by its share of that sum. The sums are
    rescaled to the larger of the two maxima first (FlashAttention's trick), so nothing overflows.
    """
    top = torch.maximum(lse_a, lse_b)
    top = torch.where(torch.isfinite(top), top, 0.0)  # both parts empty (-inf): keep zeros, not NaN
    sum_a, sum_b = torch.exp(lse_a - top), torch.exp(lse_b - top)  # each part's softmax sum, rescaled
    total = sum_a + sum_b
    out = (sum_a.unsqueeze(-1) * out_a + sum_b.unsqueeze(-1) * out_b) / total.clamp_min(1e-30).unsqueeze(-1)
    return out, top + torch.log(total)


# ---------------------------------------------------------------------------------------------------------
# Which global positions each rank holds: plain blocks, or zig-zag chunk pairs


def _chunks(world: int, zigzag: bool) -> int:
    return 2 * world if zigzag else world


def local_positions(rank: int, world: int, local_len: int, zigzag: bool = False, device=None) -> torch.Tensor:
    """The global token positions of rank ``rank``'s ``local_len`` rows (padding included)."""
    if not zigzag:
        return rank * local_len + torch.arange(local_len, device=device)
    half = local_len // 2  # rank r holds chunks r and 2N-1-r: an early and a late one
    run = torch.arange(half, device=device)
    return torch.cat([rank * half + run, (2 * world - 1 - rank) * half + run])


def _local_chunks(local_len: int, zigzag: bool) -> list[slice]:
    """The contiguous runs of positions in a rank's rows: one block, or zig-zag's two chunks."""
    if not zigzag:
        return [slice(0, local_len)]
    half = local_len // 2
    return [slice(0, half), slice(half, local_len)]


# The rows one rank holds once ``split_sequence`` has padded the sequence: the cost formulas in
# ``cp_cost`` count by it, so the padding rule lives next to the split that applies it.
def _local_len(seq: int, world: int, zigzag: bool) -> int:
    chunks = _chunks(world, zigzag)
    return math.ceil(seq / chunks) * chunks // world


def split_sequence(x: torch.Tensor, world: int, *, dim: int = SEQ_DIM, zigzag: bool = False) -> list[torch.Tensor]:
    """Every rank's part of ``x`` along ``dim``: padded with zeros at the end to a multiple of the chunks."""
    chunks = _chunks(world, zigzag)
    pad = (-x.shape[dim]) % chunks
    if pad:
        shape = list(x.shape)
        shape[dim] = pad
        x = torch.cat([x, x.new_zeros(shape)], dim=dim)
    parts = x.chunk(chunks, dim=dim)
    if zigzag:
        return [torch.cat([parts[r], parts[chunks - 1 - r]], dim=dim) for r in range(world)]
    return [p.contiguous() for p in parts]


def merge_sequence(parts: list[torch.Tensor], seq_len: int | None = None, *, dim: int = SEQ_DIM,
                   zigzag: bool = False) -> torch.Tensor:
    """The inverse of ``split_sequence``: the ranks' parts back in sequence order, padding dropped."""
    if zigzag:
        halves = [p.chunk(2, dim=dim) for p in parts]
        parts = [h[0] for h in halves] + [h[1] for h in reversed(halves)]
    full = torch.cat(parts, dim=dim)
    return full if seq_len is None else full.narrow(dim, 0, seq_len)


def zigzag_split(x: torch.Tensor, world: int, dim: int = SEQ_DIM) -> list[torch.Tensor]:
    """``split_sequence`` with the load-balanced layout: rank r gets chunks r and 2N-1-r of 2N."""
    return split_sequence(x, world, dim=dim, zigzag=True)


def zigzag_merge(parts: list[torch.Tensor], seq_len: int | None = None, dim: int = SEQ_DIM) -> torch.Tensor:
    """The inverse of ``zigzag_split``."""
    return merge_sequence(parts, seq_len, dim=dim, zigzag=True)


def tile_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, seq_len: int) -> torch.Tensor:
    """(q, k) True where a query may see a key: the key is real (not padding) and, if causal, not later.

    By block, for the plain causal ring: a block from an earlier rank is all True (full), the rank's own
    block is the triangle (the diagonal), a block from a later rank is all False and is skipped.
    """
    mask = (k_pos < seq_len).expand(len(q_pos), -1)
    return mask & (k_pos[None, :] <= q_pos[:, None]) if causal else mask


# ---------------------------------------------------------------------------------------------------------
# The ring


def ring_pass(send: torch.Tensor, recv: torch.Tensor, group=None) -> list:
    """Post one ring step: ``send`` to the next rank, ``recv`` filled from the previous one; returns the works.

    Both are posted together (``batch_isend_irecv``) before anyone waits: on gloo plain ``isend`` and ``irecv``
    would do, but NCCL runs a rank's p2p kernels in order, and a ring where every rank sends before it
    receives would wait forever on a GPU.
    """
    rank, world = _rank_world(group)
    ops = [dist.P2POp(dist.isend, send, group=group, group_peer=(rank + 1) % world),
           dist.P2POp(dist.irecv, recv, group=group, group_peer=(rank - 1) % world)]
    return dist.batch_isend_irecv(ops)


class RingLog(Timeline):
    """The order of a rank's ring: every pass posted, every wait on a work and every ``block_attention`` call, in turn.

    ``with RingLog() as log: ring(...)``; ``log.events`` as ``Timeline``'s, ``what`` one of "send" or "recv" (a pass
    posted), "wait" (a work waited on) and "attend" (a ``block_attention`` call). Every way to pass a block
    (``ring_pass``, ``batch_isend_irecv``, ``isend`` / ``irecv``, the blocking ``send`` / ``recv``) posts through the
    process group's ``send`` and ``recv`` and waits through ``Work.wait``: those methods and this module's
    ``block_attention`` are wrapped for the whole process until the block ends (one rank's process, as
    ``cp_cost.counted_tiles``). An overlapped step reads send, recv, attend, ..., wait: the next block travels while
    this one is computed.
    """

    def __enter__(self) -> "RingLog":
        self._swapped = [(dist.ProcessGroup, "send", "send"), (dist.ProcessGroup, "recv", "recv"),
                         (dist.Work, "wait", "wait"), (sys.modules[__name__], "block_attention", "attend")]
        self._saved = [vars(owner)[name] for owner, name, _ in self._swapped]  # as stored: a method stays a method
        for owner, name, what in self._swapped:
            setattr(owner, name, self._logged(what, getattr(owner, name)))
        return self

    def _logged(self, what: str, original):
        def logged(*args, **kwargs):
            self.mark(what)
            return original(*args, **kwargs)
        return logged

    def __exit__(self, *exc) -> None:
        for (owner, name, _), saved in zip(self._swapped, self._saved):
            setattr(owner, name, saved)


# graded: 16_context_parallelism ring_attention
def _tiles(q_pos, k_pos, causal, seq_len, zigzag):
    """(query rows, key rows, mask or None) of every tile that needs computing; fully masked tiles are left out."""
    for qs in _local_chunks(len(q_pos), zigzag):
        for ks in _local_chunks(len(k_pos), zigzag):
            mask = tile_mask(q_pos[qs], k_pos[ks], causal, seq_len)
            if mask.any():  # a tile no query may see is skipped: the causal ring's saving
                yield qs, ks, (None if mask.all() else mask)


def _check(q, k, v, world, seq_len, zigzag) -> int:
    """The global length, after checking the local blocks agree with it (K/V heads may group the query's: GQA)."""
    grouped = q.dim() == k.dim() == 4 and k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0
    if not (grouped and (q.shape[0], *q.shape[2:]) == (k.shape[0], *k.shape[2:]) and k.shape[:-1] == v.shape[:-1]):
        raise ValueError(f"q, k, v must be (batch, heads, local_seq, head_dim) and match, the K/V heads a divisor of "
                         f"the query's: got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    local = q.shape[SEQ_DIM]
    if zigzag and local % 2:
        raise ValueError(f"zig-zag blocks hold two equal chunks, so the local length must be even, got {local}: "
                         "split with zigzag_split, which pads")
    seq_len = world * local if seq_len is None else seq_len
    if not world * local - _chunks(world, zigzag) < seq_len <= world * local:
        raise ValueError(f"seq_len={seq_len} does not fit {world} ranks x {local} rows: split_sequence pads "
                         f"a length to the next multiple of {_chunks(world, zigzag)}, and no further")
    return seq_len


# graded: 16_context_parallelism ring_attention
@torch.no_grad()
def ring_forward(q, k, v, *, causal: bool, group=None, seq_len: int | None = None, zigzag: bool = False,
                 scale: float | None = None, merge=online_softmax_merge):
    """The ring's forward on this rank's blocks: (out, lse, work), out and lse in float32 (at least).

    At step s this rank holds the K/V block of rank r-s; it posts that block's pass to rank r+1 (and the
    receive of the next one into the second buffer) *before* computing on it, so the transfer overlaps the
    compute, and waits only once the step's tiles are merged. ``work``: the tiles computed, in units of one
    (local_seq x local_seq) block of scores (a masked tile counts whole: it is computed, then masked).
    """
    rank, world = _rank_world(group)
    seq_len, local = _check(q, k, v, world, seq_len, zigzag), q.shape[SEQ_DIM]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q_pos = local_positions(rank, world, local, zigzag, q.device)
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=_acc_dtype(q), device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=out.dtype, device=q.device)
    kv = torch.stack([k, v])  # K and V travel as one message
    buffers = [kv, torch.empty_like(kv)]  # two buffers: compute on one while the next block fills the other
    work = 0.0
    for step in range(world):
        kv = buffers[step % 2]
        pending = ring_pass(kv, buffers[(step + 1) % 2], group) if step < world - 1 else []
        k_pos = local_positions((rank - step) % world, world, local, zigzag, q.device)
        for qs, ks, mask in _tiles(q_pos, k_pos, causal, seq_len, zigzag):
            o, o_lse = block_attention(q[..., qs, :], kv[0][..., ks, :], kv[1][..., ks, :], mask, scale)
            out[..., qs, :], lse[..., qs] = merge(out[..., qs, :], lse[..., qs], o, o_lse)
            work += (qs.stop - qs.start) * (ks.stop - ks.start) / local ** 2
        for p in pending:
            p.wait()
    return out, lse, work


def block_attention_backward(q, k, v, dout, lse, delta, mask, scale):
    """One tile's share of dq, dk, dv, from the *merged* lse (FlashAttention's backward, recomputing the scores).

    p = exp(s - lse) is the tile's column of the global softmax; dS = p * (dO V^T - delta), with
    delta = rowsum(dO * O) the softmax's backward term, the same for every tile of a query row.
    """
    p = _probabilities(_scores(q, k, mask, scale), lse)
    acc = p.dtype
    dv = p.transpose(-2, -1) @ dout
    ds = p * (dout @ v.to(acc).transpose(-2, -1) - delta.unsqueeze(-1))
    return (ds @ k.to(acc)) * scale, (ds.transpose(-2, -1) @ q.to(acc)) * scale, dv


# graded: 16_context_parallelism ring_attention
@torch.no_grad()
def ring_backward(dout, q, k, v, out, lse, *, causal: bool, group=None, seq_len: int | None = None,
                  zigzag: bool = False, scale: float | None = None):
    """dq, dk, dv of this rank's blocks: the ring again, each K/V block travelling with its gradient.

    At step s this rank holds rank r-s's K/V and the dK/dV every rank before it added for that block; it adds
    its own queries' share and passes both on. After N passes of the gradient (one more than of K/V) each
    block's dK/dV is back on its owner, summed over every rank's queries.
    """
    rank, world = _rank_world(group)
    seq_len, local = _check(q, k, v, world, seq_len, zigzag), q.shape[SEQ_DIM]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q_pos, dout = local_positions(rank, world, local, zigzag, q.device), dout.to(out.dtype)
    delta = (dout * out).sum(-1)
    dq = torch.zeros_like(q, dtype=out.dtype)
    kv, dkv = torch.stack([k, v]), torch.zeros(2, *k.shape, dtype=out.dtype, device=k.device)
    for step in range(world):
        next_kv = torch.empty_like(kv)
        pending = ring_pass(kv, next_kv, group) if step < world - 1 else []  # prefetch the next K/V block
        k_pos = local_positions((rank - step) % world, world, local, zigzag, q.device)
        for qs, ks, mask in _tiles(q_pos, k_pos, causal, seq_len, zigzag):
            dq_t, dk_t, dv_t = block_attention_backward(q[..., qs, :], kv[0][..., ks, :], kv[1][..., ks, :],
                                                        dout[..., qs, :], lse[..., qs], delta[..., qs], mask, scale)
            dq[..., qs, :] += dq_t
            dkv[0][..., ks, :] += dk_t
            dkv[1][..., ks, :] += dv_t
        next_dkv = torch.empty_like(dkv)
        for p in pending + (ring_pass(dkv, next_dkv, group) if world > 1 else []):
            p.wait()
        kv, dkv = next_kv, (next_dkv if world > 1 else dkv)
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


def _gathered_kv(k: torch.Tensor, v: torch.Tensor, group, world: int, local: int, zigzag: bool) -> torch.Tensor:
    """Every rank's K/V block, gathered (one all-gather), in sequence order: (2, batch, kv_heads, world x local,
    head_dim), row i the key at global position i (the padding last)."""
    kv = torch.stack([k, v]).contiguous()
    if world == 1:  # one rank's block, zig-zag's two chunks included, is the sequence in order
        return kv
    blocks = [torch.empty_like(kv) for _ in range(world)]
    dist.all_gather(blocks, kv, group=group)
    return merge_sequence(blocks, zigzag=zigzag)


@torch.no_grad()
def gathered_forward(q, k, v, *, causal: bool, group=None, seq_len: int | None = None, zigzag: bool = False,
                     scale: float | None = None):
    """Context parallelism's other design, (out, lse) of this rank's queries: every K/V block gathered at once (one
    all-gather), then each of the rank's chunks of queries (one block, or zig-zag's two) attended to the keys it
    may see: causal, a prefix of the sequence, so it computes the scores the ring computes, no more.

    torch's ``context_parallel`` does this by default, and Llama 3's long-context training did. It sends what the
    ring sends, (N-1)/N of the sequence's K/V per rank, in one collective before any compute instead of N-1 passes
    that hide behind it, and holds all N blocks where the ring holds two: simpler, and small where K/V are a few
    grouped heads (GQA: ``k`` and ``v`` may have fewer heads than ``q``); a document mask needs every key anyway.
    """
    rank, world = _rank_world(group)
    seq_len, local = _check(q, k, v, world, seq_len, zigzag), q.shape[SEQ_DIM]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    every_kv = _gathered_kv(k, v, group, world, local, zigzag)
    q_pos = local_positions(rank, world, local, zigzag, q.device)
    outs, lses = [], []
    for qs in _local_chunks(local, zigzag):
        seen = min(int(q_pos[qs].max()) + 1, seq_len) if causal else seq_len  # keys past it: later, or padding
        mask = tile_mask(q_pos[qs], torch.arange(seen, device=q.device), causal, seq_len)
        out, lse = block_attention(q[..., qs, :], every_kv[0][..., :seen, :], every_kv[1][..., :seen, :],
                                   None if mask.all() else mask, scale)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=SEQ_DIM), torch.cat(lses, dim=-1)


@torch.no_grad()
def gathered_backward(dout, q, k, v, out, lse, *, causal: bool, group=None, seq_len: int | None = None,
                      zigzag: bool = False, scale: float | None = None):
    """dq, dk, dv of this rank's blocks without a ring: every rank's K/V block gathered, their gradients all-reduced.

    This rank's queries against the whole sequence's keys as one tile, masked by ``tile_mask`` (padding never
    seen; causal: a key at or before its query) and differentiated from the merged lse by
    ``block_attention_backward``; what its queries add to every block's dK/dV is summed over the ranks by one
    all-reduce, and each rank keeps its own block's. The same gradients as ``ring_backward``, with S keys held during
    backward instead of S/N and every block's gradient all-reduced where the ring passes one: the backward
    ``ring_attention`` runs behind a ring given as ``forward`` (notebook 16's), where ``ring_backward``'s loop would be
    the ring exercise's answer once more.
    """
    rank, world = _rank_world(group)
    seq_len, local = _check(q, k, v, world, seq_len, zigzag), q.shape[SEQ_DIM]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    every_kv = _gathered_kv(k, v, group, world, local, zigzag)
    q_pos = local_positions(rank, world, local, zigzag, q.device)
    mask = tile_mask(q_pos, torch.arange(every_kv.shape[SEQ_DIM], device=q.device), causal, seq_len)
    dout = dout.to(out.dtype)
    dq, dk, dv = block_attention_backward(q, every_kv[0], every_kv[1], dout, lse, (dout * out).sum(-1), mask, scale)
    dkv = torch.stack([dk, dv])
    if world > 1:
        dist.all_reduce(dkv, group=group)  # every rank's queries' share of every block
    mine = dkv[..., q_pos, :]  # this rank's rows: its block's positions in the sequence
    return dq.to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype)


class RingAttention(torch.autograd.Function):
    """Ring attention with a backward that recomputes each tile's scores: the ring again (``ring_backward``), or,
    behind a ring given as ``forward``, every K/V block gathered (``gathered_backward``).

    Why not let autograd differentiate the forward's ops? It would keep every K/V block that passed through
    and every tile's probabilities: (S/N) x S scores per rank, the very activation memory context
    parallelism is there to cut, and a comm op whose output a causal rank never uses would not run in
    backward, leaving its peer waiting. Saving only q, k, v, out and lse (O(S/N) per rank) and recomputing is
    what FlashAttention, picotron and torch's context parallel all do.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal, group, seq_len, zigzag, scale, merge, forward):
        # both backwards accumulate dK/dV in the query's heads: grouped K/V heads would need each group summed
        if q.dim() == k.dim() == 4 and k.shape[1] != q.shape[1]:
            raise ValueError(f"ring_attention's backward takes as many K/V heads as query heads, got {k.shape[1]} "
                             f"for {q.shape[1]}: repeat them first (attention.repeat_kv); ring_forward and "
                             "gathered_forward take grouped heads")
        if forward is None:
            out, lse, _ = ring_forward(q, k, v, causal=causal, group=group, seq_len=seq_len, zigzag=zigzag,
                                       scale=scale, merge=merge)
        else:  # a ring of the notebook's contract: the default group and scale, the true length given
            out, lse = forward(q, k, v, causal, _check(q, k, v, _rank_world()[1], seq_len, zigzag), zigzag)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = dict(causal=causal, group=group, seq_len=seq_len, zigzag=zigzag, scale=scale)
        ctx.gradients = ring_backward if forward is None else gathered_backward
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.gradients(dout, q, k, v, out, lse, **ctx.options)
        return dq, dk, dv, None, None, None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, group=None,
                   seq_len: int | None = None, zigzag: bool = False, scale: float | None = None,
                   merge=online_softmax_merge, forward=None) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence, its K/V blocks passed round ``group``'s ring.

    q, k, v: this rank's block (``split_sequence(x, world, zigzag=zigzag)[rank]``), all ranks the same
    length; ``seq_len`` the true length when the split padded it (the padded keys are masked). Equals
    ``F.scaled_dot_product_attention`` on the whole sequence, output and gradients. ``merge``: the online
    softmax merge ``ring_forward`` uses. ``forward``: another ring forward to run instead, notebook 16's
    contract ``forward(q, k, v, causal, seq_len, zigzag) -> (out, lse)`` on the default group with the default
    scale (the notebook passes the student's ring), whose backward is then ``gathered_backward``.
    """
    if forward is not None and (group is not None or scale not in (None, q.shape[-1] ** -0.5)):
        raise ValueError("a ring given as forward= runs on the default process group with scale 1/sqrt(head_dim): "
                         "pass group=None and scale=None, or leave forward=None for course_lib's ring_forward")
    return RingAttention.apply(q, k, v, causal, group, seq_len, zigzag, scale, merge, forward)


# ---------------------------------------------------------------------------------------------------------
# The course's Llama with its attention on the ring

IMPLEMENTATION = "course_ring"
_RING: dict = {}  # the ring the Llama's attention runs on: seq_len, zigzag, group (set by ``ring_llama_loss``)


def ring_llama_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                         scaling: float | None = None, **kwargs):
    """transformers' attention interface on ``ring_attention``: (batch, local T, heads, d) out, no weights.

    Causal by position, as the ring masks it: transformers builds no mask for this implementation (a mask
    over the local rows would mean nothing: the keys a row sees live on every rank).
    """
    if dropout:
        raise ValueError("ring_attention has no attention dropout: build the Llama with attention_dropout=0")
    groups = query.shape[1] // key.shape[1]  # GQA: every query head gets its K/V head
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    out = ring_attention(query, key, value, causal=True, scale=scaling, **_RING)
    return out.transpose(1, 2).contiguous(), None


def no_mask(*args, **kwargs) -> None:
    """transformers' mask function for a ring's Llama: none (a mask over one rank's rows means nothing)."""
    return None


def sum_gradients(model: nn.Module) -> None:
    """Sum every gradient over the ranks: each rank's loss is its tokens' share of the sequence's mean."""
    for p in model.parameters():
        dist.all_reduce(p.grad)


def ring_llama(seed: int = 0, preset: str = "tiny"):
    """The course's Llama (``models.build_llama``) with ``attn_implementation="course_ring"``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, ring_llama_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, no_mask)
    return build_llama(preset, attn_implementation=IMPLEMENTATION, seed=seed)


def ring_llama_loss(model, tokens: torch.Tensor, *, group=None, zigzag: bool = False, forward=None) -> torch.Tensor:
    """This rank's share of the next-token loss of ``tokens`` (the whole batch, batch x S, on every rank).

    Each rank keeps its part of the sequence: input ids, their global positions (the rotary embedding needs
    them) and the targets, shifted *before* the split (the target of the last local token lives on the next
    rank). Its loss is its tokens' summed cross-entropy over the whole batch's count: the ranks' losses
    sum to the mean, and so do their gradients. ``forward``: the ring forward (``ring_attention``'s; the student's).
    """
    rank, world = _rank_world(group)
    seq = tokens.shape[-1]
    targets = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], IGNORE_INDEX)], dim=1)
    ids, labels = (split_sequence(t, world, dim=-1, zigzag=zigzag)[rank] for t in (tokens, targets))
    positions = local_positions(rank, world, ids.shape[1], zigzag, tokens.device)
    labels = torch.where(positions < seq, labels, IGNORE_INDEX)  # the padding scores nothing
    _RING.update(seq_len=seq, zigzag=zigzag, group=group, forward=forward)
    logits = model(input_ids=ids, position_ids=positions.expand(len(ids), -1)).logits
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")
    return loss / (len(tokens) * (seq - 1))
