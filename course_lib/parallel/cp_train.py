"""Context parallelism at work: the course's Llama trained on the ring, and what the ring costs per rank.

``cp`` holds the ring by hand (block attention, the online-softmax merge, the splits, the ring and its
autograd); this module uses it and accounts for it, so that cp reads as the mechanism alone.

- ``train_ring_llama``: the course's Llama trained with the ring (by hand, any device), loss for loss with one
  process (``reference_llama_losses``); ``ring_llama`` is that Llama, its attention registered with transformers
  as ``ring_llama_attention``, and ``ring_llama_loss`` one rank's share of its loss.
- ``causal_work``: the scores each rank computes in a causal ring, plain split or zig-zag.
- ``ring_bytes_per_rank``, ``ring_backward_bytes_per_rank``, ``attention_activation_bytes``, ``measure_ring_memory``:
  what it costs and buys; ``llama_activation_bytes_per_rank`` and ``longest_sequence``: the same for a whole
  Llama (predicted).

torch's own context parallelism, on the same Llama, is ``cp_torch``'s.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib.attention import repeat_kv
# _rank_world and _local_len are the ring's own rank lookup and padded block length: one definition, in cp
from course_lib.parallel import cp
from course_lib.parallel.cp import _local_len, _rank_world, local_positions, ring_attention, split_sequence
from course_lib.data import lm_batch
from course_lib.loss import IGNORE_INDEX, next_token_loss
from course_lib.memory import SavedTensorMeter, llama_activation_bytes
from course_lib.models import build_llama
from course_lib.train import fit


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


def ring_llama_loss(model, tokens: torch.Tensor, *, group=None, zigzag: bool = False, forward=None) -> torch.Tensor:
    """This rank's share of the next-token loss of ``tokens`` (the whole batch, batch x S, on every rank).

    Each rank keeps its part of the sequence: input ids, their global positions (the rotary embedding needs
    them) and the targets, shifted *before* the split (the target of the last local token lives on the next
    rank). Its loss is its tokens' summed cross-entropy over the whole batch's count: the ranks' losses
    sum to the mean, and so do their gradients. ``forward``: the ring forward (``cp.ring_attention``'s; the student's).
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


def train_ring_llama(steps: int = 3, zigzag: bool = False, *, seq: int = 30, batch: int = 2, lr: float = 1e-3,
                     seed: int = 0, forward=None) -> list[float]:
    """Train the tiny Llama with context parallelism by hand on this process group's ranks: the losses per step.

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
                  loss_fn=lambda m, tokens: ring_llama_loss(m, tokens, zigzag=zigzag, forward=forward),
                  sync_grads=sum_gradients, progress=False)
    return [r["loss"] * dist.get_world_size() for r in history]


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


@contextlib.contextmanager
def counted_tiles(local: int) -> Iterator[dict]:
    """Inside, every ``cp.block_attention`` call of this process (any ring's, the student's too) adds its tile to
    ``tally["tiles"]``, in blocks of (local x local) scores as ``causal_work`` counts them, and the CPU seconds it
    took to ``tally["seconds"]`` (this process's own: ranks that share cores do not count each other's). Meant for
    one rank's process: it swaps the module's function, which the whole process sees until the block ends."""
    tally, inner = {"tiles": 0.0, "seconds": 0.0}, cp.block_attention

    def counted(q_tile, k_tile, *args, **kwargs):
        start = time.process_time()
        out = inner(q_tile, k_tile, *args, **kwargs)
        tally["seconds"] += time.process_time() - start
        tally["tiles"] += q_tile.shape[-2] * k_tile.shape[-2] / local ** 2
        return out

    cp.block_attention = counted
    try:
        yield tally
    finally:
        cp.block_attention = inner


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
                        device: torch.device | str = "cpu", forward=None) -> int:
    """Bytes this rank's ring attention keeps for backward, measured with ``SavedTensorMeter`` (call on every rank);
    ``forward``: the ring forward it runs (``cp.ring_attention``'s; the notebook passes the student's ring)."""
    rank, world = _rank_world(group)
    torch.manual_seed(seed)
    full = torch.randn(3, batch, heads, seq, head_dim, dtype=dtype, device=device)  # the same q, k, v on every rank
    q, k, v = (split_sequence(t, world, zigzag=zigzag)[rank].requires_grad_() for t in full)
    with SavedTensorMeter() as meter:
        out = ring_attention(q, k, v, causal=causal, group=group, seq_len=seq, zigzag=zigzag, forward=forward)
    out.sum().backward()  # every rank runs the backward ring, so no peer is left waiting
    return meter.bytes
