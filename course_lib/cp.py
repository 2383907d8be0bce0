"""Context parallelism: the sequence split across ranks, attention computed as a ring of K/V blocks.

Tensor and pipeline parallelism split the weights; a long sequence is a different problem: attention's
activations grow with the sequence, and one rank holding all of it runs out. Context parallelism gives
rank r one block of the sequence (its queries, keys and values). Every token still needs every earlier
key, so the K/V blocks travel round a ring: at each of N steps a rank attends its queries to the block it
holds and passes that block on, N-1 passes in all. Each step gives a partial attention result over one
block of keys; the online softmax (FlashAttention's rescaling) merges the partial results exactly, so the
ring gives the same numbers as attention over the whole sequence in one process.

- ``block_attention``: attention of queries over one block of keys, returning the output *and* the
  log-sum-exp of the scores (the softmax's denominator), which is what the merge needs.
- ``online_softmax_merge``: two partial results over disjoint key blocks -> the result over their union.
- ``ring_attention``: the ring itself (``ring_pass`` one step of it, ``ring_forward`` / ``ring_backward`` its two
  halves), an autograd Function whose backward runs the ring again; ``tile_mask`` says what each tile sees.
- ``split_sequence`` / ``merge_sequence`` (``zigzag_split`` / ``zigzag_merge``): each rank's block; with a
  causal mask the plain split leaves rank 0 one block of work and rank N-1 N blocks (``causal_work``); the
  zig-zag split gives rank r chunks r and 2N-1-r of 2N, an early and a late one, and every rank the same work.
- ``ring_bytes_per_rank``, ``attention_activation_bytes``, ``measure_ring_memory``: what it costs and buys;
  ``llama_activation_bytes_per_rank`` and ``longest_sequence``: the same for a whole Llama (predicted).
- ``train_ring_llama``: the course's Llama trained with the ring (by hand, any device), loss for loss with one
  process (``reference_llama_losses``).
- ``torch_cp_support``: whether torch's own ``context_parallel`` runs here (it needs a GPU: see there).

Tensors are laid out as SDPA's: (batch, heads, sequence, head_dim); the sequence is dim -2.
A length that does not divide by the world (or 2 x world for zig-zag) is padded at the end; the padded
keys are masked, so their values never reach a real token, and ``merge_sequence`` drops the padded rows.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib.attention import repeat_kv
from course_lib.data import lm_batch
from course_lib.loss import IGNORE_INDEX, next_token_loss
from course_lib.memory import SavedTensorMeter, llama_activation_bytes
from course_lib.models import build_llama
from course_lib.train import fit

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
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = _scores(q, k, mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    return _probabilities(s, lse) @ v.to(s.dtype), lse


# graded: 14_context_expert_parallelism ring_attention
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


def _tiles(q_pos, k_pos, causal, seq_len, zigzag):
    """(query rows, key rows, mask or None) of every tile that needs computing; fully masked tiles are left out."""
    for qs in _local_chunks(len(q_pos), zigzag):
        for ks in _local_chunks(len(k_pos), zigzag):
            mask = tile_mask(q_pos[qs], k_pos[ks], causal, seq_len)
            if mask.any():  # a tile no query may see is skipped: the causal ring's saving
                yield qs, ks, (None if mask.all() else mask)


def _check(q, k, v, world, seq_len, zigzag) -> int:
    """The global length, after checking the local blocks agree with it."""
    if not (q.dim() == 4 and q.shape == k.shape and k.shape[:-1] == v.shape[:-1]):
        raise ValueError(f"q, k, v must be (batch, heads, local_seq, head_dim) and match: got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)} (GQA: repeat the K/V heads first)")
    local = q.shape[SEQ_DIM]
    if zigzag and local % 2:
        raise ValueError(f"zig-zag blocks hold two equal chunks, so the local length must be even, got {local}: "
                         "split with zigzag_split, which pads")
    seq_len = world * local if seq_len is None else seq_len
    if not world * local - _chunks(world, zigzag) < seq_len <= world * local:
        raise ValueError(f"seq_len={seq_len} does not fit {world} ranks x {local} rows: split_sequence pads "
                         f"a length to the next multiple of {_chunks(world, zigzag)}, and no further")
    return seq_len


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
            o, l = block_attention(q[..., qs, :], kv[0][..., ks, :], kv[1][..., ks, :], mask, scale)
            out[..., qs, :], lse[..., qs] = merge(out[..., qs, :], lse[..., qs], o, l)
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


class RingAttention(torch.autograd.Function):
    """Ring attention with a backward that runs the ring again, recomputing each tile's scores.

    Why not let autograd differentiate the forward's ops? It would keep every K/V block that passed through
    and every tile's probabilities: (S/N) x S scores per rank, the very activation memory context
    parallelism is there to cut, and a comm op whose output a causal rank never uses would not run in
    backward, leaving its peer waiting. Saving only q, k, v, out and lse (O(S/N) per rank) and recomputing is
    what FlashAttention, picotron and torch's context parallel all do.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal, group, seq_len, zigzag, scale, merge):
        out, lse, _ = ring_forward(q, k, v, causal=causal, group=group, seq_len=seq_len, zigzag=zigzag,
                                   scale=scale, merge=merge)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = dict(causal=causal, group=group, seq_len=seq_len, zigzag=zigzag, scale=scale)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, **ctx.options)
        return dq, dk, dv, None, None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, group=None,
                   seq_len: int | None = None, zigzag: bool = False, scale: float | None = None,
                   merge=online_softmax_merge) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence, its K/V blocks passed round ``group``'s ring.

    q, k, v: this rank's block (``split_sequence(x, world, zigzag=zigzag)[rank]``), all ranks the same
    length; ``seq_len`` the true length when the split padded it (the padded keys are masked). Equals
    ``F.scaled_dot_product_attention`` on the whole sequence, output and gradients. ``merge``: the online
    softmax merge to use (the notebook passes the student's).
    """
    return RingAttention.apply(q, k, v, causal, group, seq_len, zigzag, scale, merge)


# ---------------------------------------------------------------------------------------------------------
# The course's Llama with ring attention: training by hand, loss for loss with one process

IMPLEMENTATION = "course_ring"
_RING: dict = {}  # the ring the Llama's attention runs on: seq_len, zigzag, group (set by ``ring_llama``)


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


def _no_mask(*args, **kwargs) -> None:
    return None


def ring_llama(seed: int = 0, preset: str = "tiny"):
    """The course's Llama (``models.build_llama``) with ``attn_implementation="course_ring"``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, ring_llama_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, _no_mask)
    return build_llama(preset, attn_implementation=IMPLEMENTATION, seed=seed)


def ring_llama_loss(model, tokens: torch.Tensor, *, group=None, zigzag: bool = False, merge=None) -> torch.Tensor:
    """This rank's share of the next-token loss of ``tokens`` (the whole batch, batch x S, on every rank).

    Each rank keeps its part of the sequence: input ids, their global positions (the rotary embedding needs
    them) and the targets, shifted *before* the split (the target of the last local token lives on the next
    rank). Its loss is its tokens' summed cross-entropy over the whole batch's count: the ranks' losses
    sum to the mean, and so do their gradients. ``merge``: the ring's online-softmax merge (the student's).
    """
    rank, world = _rank_world(group)
    seq = tokens.shape[-1]
    targets = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], IGNORE_INDEX)], dim=1)
    ids, labels = (split_sequence(t, world, dim=-1, zigzag=zigzag)[rank] for t in (tokens, targets))
    positions = local_positions(rank, world, ids.shape[1], zigzag, tokens.device)
    labels = torch.where(positions < seq, labels, IGNORE_INDEX)  # the padding scores nothing
    _RING.update(seq_len=seq, zigzag=zigzag, group=group, merge=merge or online_softmax_merge)
    logits = model(input_ids=ids, position_ids=positions.expand(len(ids), -1)).logits
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")
    return loss / (len(tokens) * (seq - 1))


def train_ring_llama(rank: int, world: int, steps: int = 3, zigzag: bool = False, *, seq: int = 30, batch: int = 2,
                     lr: float = 1e-3, seed: int = 0, merge=None) -> list[float]:
    """Train the tiny Llama with context parallelism by hand (for ``launch.run_forked``): the losses per step.

    Every rank holds the whole model and its part of every sequence (``train.fit``, the course's loop); its loss
    is its tokens' share of the sequence's mean, so the gradients are summed over the ring's ranks after backward,
    and the loss of a step is the sum of the shares (``fit`` records their mean). Equals ``reference_llama_losses``.
    """
    model = ring_llama(seed)

    def sum_gradients(model: nn.Module) -> None:
        for p in model.parameters():
            dist.all_reduce(p.grad)

    history = fit(model, torch.optim.AdamW(model.parameters(), lr=lr),
                  lambda step: lm_batch(step, batch, seq, model.config.vocab_size, seed), steps,
                  loss_fn=lambda m, tokens: ring_llama_loss(m, tokens, zigzag=zigzag, merge=merge),
                  sync_grads=sum_gradients, progress=False)
    return [r["loss"] * world for r in history]


def reference_llama_losses(steps: int = 3, *, seq: int = 30, batch: int = 2, lr: float = 1e-3,
                           seed: int = 0) -> list[float]:
    """One process, the same model, batches and optimizer, attention over the whole sequence (SDPA)."""
    model = build_llama("tiny", seed=seed)
    history = fit(model, torch.optim.AdamW(model.parameters(), lr=lr),
                  lambda step: lm_batch(step, batch, seq, model.config.vocab_size, seed), steps,
                  loss_fn=lambda m, tokens: next_token_loss(m(input_ids=tokens).logits, tokens), progress=False)
    return [r["loss"] for r in history]


# ---------------------------------------------------------------------------------------------------------
# What it costs, what it buys


def causal_work(world: int, zigzag: bool = False) -> list[float]:
    """Scores each rank computes in a causal ring, in (S/N x S/N) blocks, as ``ring_forward`` counts them.

    Plain split: rank r's queries see r earlier blocks and its own (masked, computed whole): r + 1 blocks,
    so rank N-1 works N times as long as rank 0 and the ring waits for it. Zig-zag: rank r's chunks r and
    2N-1-r see r + 1 and 2N - r chunks, 2N + 1 chunk tiles of a quarter block each, the same on every rank.
    """
    if zigzag:
        return [(2 * world + 1) / 4] * world
    return [float(r + 1) for r in range(world)]


def _local_len(seq: int, world: int, zigzag: bool) -> int:
    chunks = _chunks(world, zigzag)
    return math.ceil(seq / chunks) * chunks // world


def ring_bytes_per_rank(seq: int, heads: int, head_dim: int, world: int, dtype_bytes: int = 4, *, batch: int = 1,
                        zigzag: bool = False) -> int:
    """Bytes of K and V one rank sends in one forward: N-1 passes of its (padded) block, K and V each.

    It does not fall with N: a rank sends (N-1)/N of the sequence's K/V whatever N is, and the time to send
    it must hide behind the attention of one block, which shrinks as (S/N)^2.
    """
    return (world - 1) * 2 * batch * heads * _local_len(seq, world, zigzag) * head_dim * dtype_bytes


def ring_backward_bytes_per_rank(seq: int, heads: int, head_dim: int, world: int, dtype_bytes: int = 4, *,
                                 batch: int = 1, zigzag: bool = False) -> int:
    """Bytes one rank sends in one backward: K/V again (N-1 passes) and their float32 gradients (N passes)."""
    block = 2 * batch * heads * _local_len(seq, world, zigzag) * head_dim
    return (world - 1) * block * dtype_bytes + (world if world > 1 else 0) * block * max(dtype_bytes, 4)


def attention_activation_bytes(seq: int, heads: int, head_dim: int, world: int = 1, dtype_bytes: int = 4, *,
                               batch: int = 1, zigzag: bool = False) -> int:
    """Bytes one rank's ring attention keeps for backward (predicted): q, k, v, out and lse of its block.

    q, k, v in the input's dtype, out and lse in float32 (the accumulation type): per rank
    batch x heads x S/N x (head_dim x (3 x dtype_bytes + 4) + 4), so it falls as 1/N. One rank holding the
    whole sequence is ``world=1``. (Attention that materialises its probabilities keeps S^2 more per head.)
    """
    rows = batch * heads * _local_len(seq, world, zigzag)
    acc = max(dtype_bytes, 4)
    return rows * (head_dim * (3 * dtype_bytes + acc) + acc)


def llama_activation_bytes_per_rank(config, seq: int, world: int = 1, *, batch: int = 1, dtype_bytes: int = 2,
                                    **options) -> int:
    """A Llama's activation bytes on one rank of a context-parallel ring of ``world`` (predicted).

    Every activation a Llama layer keeps is per token once attention keeps no S x S probabilities (the
    ring, like flash attention, keeps q, k, v, out and lse), so a rank holding S/N tokens keeps 1/N of
    them: ``memory.llama_activation_bytes`` at the local length. ``options``: its other arguments.
    """
    return llama_activation_bytes(config, batch, _local_len(seq, world, False), dtype_bytes, **options)


def longest_sequence(config, budget_bytes: int, world: int = 1, *, batch: int = 1, dtype_bytes: int = 2,
                     **options) -> int:
    """The longest sequence whose activations fit ``budget_bytes`` per rank (what is left after the model
    state), one rank (``world=1``) or a ring of ``world``: N times one rank's (predicted)."""
    per_token = llama_activation_bytes(config, batch, 1, dtype_bytes, **options)
    return budget_bytes // per_token * world


def measure_ring_memory(seq: int, heads: int, head_dim: int, *, causal: bool = True, batch: int = 1, group=None,
                        dtype: torch.dtype = torch.float32, zigzag: bool = False, seed: int = 0,
                        device: torch.device | str = "cpu", merge=None) -> int:
    """Bytes this rank's ring attention keeps for backward, measured with ``SavedTensorMeter`` (call on every rank);
    ``merge``: the online-softmax merge the ring uses (the notebook passes the student's)."""
    rank, world = _rank_world(group)
    torch.manual_seed(seed)
    full = torch.randn(3, batch, heads, seq, head_dim, dtype=dtype, device=device)  # the same q, k, v on every rank
    q, k, v = (split_sequence(t, world, zigzag=zigzag)[rank].requires_grad_() for t in full)
    with SavedTensorMeter() as meter:
        out = ring_attention(q, k, v, causal=causal, group=group, seq_len=seq, zigzag=zigzag,
                             merge=merge or online_softmax_merge)
    out.sum().backward()  # every rank runs the backward ring, so no peer is left waiting
    return meter.bytes


def torch_cp_support(device: torch.device | str) -> str | None:
    """None where torch's ``context_parallel`` can run on ``device``, else the reason it cannot.

    torch 2.13's context parallel swaps SDPA's fused kernels (flash, memory-efficient, cuDNN: CUDA and ROCm
    only) for ring versions of them. On a CPU SDPA runs ``_scaled_dot_product_flash_attention_for_cpu``,
    which has no context-parallel handler: inside ``context_parallel`` on gloo it raises
    "Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
    registered", and with the math backend forced it fails on "aten.add.Tensor got mixed torch.Tensor and
    DTensor" (both tried on 2 gloo ranks, torch 2.13.0+cpu). So it needs GPUs, one per rank.
    """
    device = torch.device(device)
    try:
        from torch.distributed.tensor.experimental import context_parallel  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no torch.distributed.tensor.experimental.context_parallel"
    if device.type != "cuda":
        return (f"torch's context_parallel rings only the fused GPU SDPA kernels (flash, memory-efficient, cuDNN); "
                f"on {device.type} SDPA runs a kernel it cannot shard: it needs GPUs, one per rank")
    if not torch.cuda.is_available():
        return "no GPU is visible to this process"
    return None
