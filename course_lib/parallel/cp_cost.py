"""What context parallelism costs: the ring's work, bytes and memory per rank, predicted and measured, and the ring
beside the all-gather design.

``cp`` holds the ring by hand (block attention, the online-softmax merge, the splits, the ring and its autograd, the
Llama on it); this module accounts for it, so that cp reads as the mechanism alone.

- ``causal_work``: the scores each rank computes in a causal ring, plain split or zig-zag; ``counted_tiles``
  counts them on a running ring.
- ``ring_bytes_per_rank``, ``ring_backward_bytes_per_rank``, ``attention_activation_bytes``, ``measure_ring_memory``:
  what it costs and buys; ``llama_activation_bytes_per_rank`` and ``longest_sequence``: the same for a whole
  Llama (predicted); ``llama_activations_by_length``: a whole Llama's, measured at several lengths;
  ``measure_longest_sequence``: where one GPU really runs out (``longest_from_peaks``: the arithmetic).
- ``compare_designs``: the ring and the all-gather design (``cp.gathered_forward``) side by side on one
  ``AttentionSpec`` (grouped K/V heads or not): the bytes each rank sends, the largest K/V tensor it builds
  (``LargestKV``; ``largest_kv_bytes`` predicts it) and its time per forward.

The Llama trained on the ring, by hand or with torch's own context parallelism, is ``cp_torch``'s.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

# _rank_world and _local_len are the ring's own rank lookup and padded block length: one definition, in cp
from course_lib.parallel import cp
from course_lib.parallel.cp import _local_len, _rank_world, ring_attention, split_sequence
from course_lib.data import lm_batch
from course_lib.distributed import CollectiveBytes
from course_lib.loss import next_token_loss
from course_lib.memory import LargestTensor, SavedTensorMeter, activation_bytes, llama_activation_bytes
from course_lib.models import build_llama


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
    it must hide behind the attention of one block, which shrinks as (S/N)^2. ``heads``: the K/V heads (grouped-query
    attention sends fewer than the query has). The all-gather design (``cp.gathered_forward``) sends the same.
    """
    return (world - 1) * 2 * batch * heads * _local_len(seq, world, zigzag) * head_dim * dtype_bytes


def largest_kv_bytes(seq: int, kv_heads: int, head_dim: int, world: int, dtype_bytes: int = 4, *, batch: int = 1,
                     zigzag: bool = False, gathered: bool = False) -> int:
    """Bytes of the largest K/V tensor (K and V stacked) one rank builds in one forward (predicted).

    The ring's is one (padded) block, 2 x batch x kv_heads x S/N x head_dim values (it holds two at once: the block it
    attends and the one arriving); the all-gather design's (``gathered=True``) is the whole padded sequence's, N
    blocks in one tensor. Both scale with the K/V heads: grouped-query attention shrinks them by heads / kv_heads.
    """
    block = 2 * batch * kv_heads * _local_len(seq, world, zigzag) * head_dim * dtype_bytes
    return block * world if gathered else block


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


def llama_activations_by_length(seqs: list[int], *, preset: str = "tiny", batch: int = 1,
                                seed: int = 0) -> dict[int, int]:
    """The bytes the course's Llama keeps for backward at each length of ``seqs``, one rank holding the whole
    sequence, measured with ``SavedTensorMeter`` (the weights left out). Linear in S, as ``llama_activation_bytes``
    predicts, because its attention (a fused kernel, or the ring) keeps no S x S probabilities."""
    model = build_llama(preset, seed=seed)
    measured = {}
    for seq in seqs:
        tokens = lm_batch(0, batch, seq, model.config.vocab_size, seed)
        measured[seq] = activation_bytes(model, lambda: next_token_loss(model(input_ids=tokens).logits, tokens))
    return measured


def longest_from_peaks(peaks: dict[int, int], capacity: int) -> int:
    """The longest sequence whose step fits ``capacity`` bytes, on the line through the shortest and longest of the
    measured ``peaks`` (sequence length -> peak bytes): a fixed part (weights, gradients, workspaces) plus bytes per
    token times S."""
    (short, low), (long, high) = min(peaks.items()), max(peaks.items())
    if long == short or high <= low:
        raise ValueError(f"peaks {peaks} give no growth per token: measure two lengths, the second longer")
    per_token = (high - low) / (long - short)
    return int((capacity - (low - per_token * short)) // per_token)


def measure_longest_sequence(preset: str = "1b", *, budget_gb: float = 16.0, probes: tuple[int, int] = (1024, 2048),
                             checks: tuple[float, float] = (0.8, 1.25), device: torch.device | str | None = None,
                             seed: int = 0) -> dict:
    """One GPU, one rank: the longest sequence a bf16 training step (forward and backward, batch 1) of the Llama
    ``preset`` fits in ``budget_gb`` of this GPU, measured.

    The allocator's reserved memory is held to the budget (``torch.cuda.set_per_process_memory_fraction``; less where
    less is free), so neither the GPU's size nor other processes on it move the answer; the peaks are reserved bytes
    too. Two short steps (``probes``) give the step's
    fixed part and its bytes per token (the peak is linear in S), hence the longest sequence
    (``longest_from_peaks``), which is then checked by running ``checks`` times it: the first must fit and the
    second run out. Returns the budget, the probes' peaks, the bytes per token and the fixed part, the longest
    sequence, and for each check whether it ran out.
    """
    device = torch.device(device or "cuda")
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"measure_longest_sequence needs a GPU (got {device}): a CPU has no allocator budget to run "
                         "into; llama_activations_by_length measures the bytes per token on any device")
    model = build_llama(preset, dtype=torch.bfloat16, device=device, seed=seed)
    free, total = torch.cuda.mem_get_info(device)
    budget = min(int(budget_gb * 2**30), int(0.9 * free) + torch.cuda.memory_allocated(device))
    torch.cuda.set_per_process_memory_fraction(budget / total, device)
    try:
        peaks = {seq: _step_peak(model, seq, seed) for seq in probes}
        if None in peaks.values():
            raise RuntimeError(f"a probe of {probes} tokens ran out of the {budget / 2**30:.1f} GiB budget already: "
                               "give shorter probes or a larger budget_gb")
        longest = longest_from_peaks(peaks, budget)
        ran_out = {}
        for factor in checks:
            peak = _step_peak(model, int(factor * longest), seed)
            if peak is not None and peak > budget:  # it fit only because the allocator went past the budget
                raise RuntimeError(f"a step of {int(factor * longest)} tokens peaked at {peak / 2**30:.1f} GiB, past "
                                   f"the {budget / 2**30:.1f} GiB budget: this allocator does not hold "
                                   f"set_per_process_memory_fraction ({alloc_conf()}); run without "
                                   "expandable_segments")
            ran_out[factor] = peak is None
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.empty_cache()
    per_token = (peaks[max(probes)] - peaks[min(probes)]) / (max(probes) - min(probes))
    return {"budget": budget, "peaks": peaks, "bytes_per_token": per_token,
            "fixed": peaks[min(probes)] - per_token * min(probes), "longest": longest, "ran_out": ran_out}


def alloc_conf() -> str:
    """The GPU allocator's settings this process was given, under the names torch reads here (ROCm reads
    PYTORCH_HIP_ALLOC_CONF before PYTORCH_CUDA_ALLOC_CONF; PYTORCH_ALLOC_CONF serves both)."""
    names = ["PYTORCH_HIP_ALLOC_CONF"] if torch.version.hip else []
    names += ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"]
    return ", ".join(f"{n}={os.environ.get(n)!r}" for n in names)


def _step_peak(model: nn.Module, seq: int, seed: int) -> int | None:
    """The allocator's peak over one forward and backward of ``seq`` tokens, or None where it ran out of memory.
    Reserved, not allocated, memory: what ``set_per_process_memory_fraction`` caps, so the fit and the budget count
    the same bytes (the cache's blocks and fragmentation included)."""
    device = next(model.parameters()).device
    tokens = lm_batch(0, 1, seq, model.config.vocab_size, seed).to(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    try:
        next_token_loss(model(input_ids=tokens).logits, tokens).backward()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_reserved(device)
    except torch.cuda.OutOfMemoryError:
        return None
    except RuntimeError as err:  # a library's own allocation failing (cuBLAS, a kernel's workspace) says it so
        if "out of memory" in str(err).lower() or "ALLOC_FAILED" in str(err):
            return None
        raise
    finally:
        model.zero_grad(set_to_none=True)


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
    out.sum().backward()  # every rank runs the backward and its collectives, so no peer is left waiting
    return meter.bytes


# ---------------------------------------------------------------------------------------------------------
# The ring beside the all-gather design, grouped K/V heads or not


@dataclass(frozen=True)
class AttentionSpec:
    """One context-parallel attention forward's shape, JSON-able (``dataclasses.asdict``): ``seq`` tokens in all,
    ``heads`` query heads and ``kv_heads`` K/V heads (None: as many, multi-head attention; fewer, a divisor:
    grouped-query attention), split plainly or zig-zag across the ranks."""

    seq: int
    heads: int
    head_dim: int
    kv_heads: int | None = None
    batch: int = 1
    causal: bool = True
    zigzag: bool = True

    def __post_init__(self):
        if self.kv_heads is not None and (self.kv_heads < 1 or self.heads % self.kv_heads):
            raise ValueError(f"kv_heads={self.kv_heads} must divide heads={self.heads}: each K/V head serves "
                             "heads / kv_heads query heads")

    @property
    def kv(self) -> int:
        """The K/V heads: ``kv_heads``, or ``heads`` where that is None."""
        return self.kv_heads or self.heads


class LargestKV(LargestTensor):
    """``LargestTensor`` counting K/V tensors only: K and V stacked, (2, batch, kv_heads, rows, head_dim) with the
    batch, heads and head_dim of ``k``, as the ring passes them and the all-gather gathers them. ``bytes`` of the
    largest: one block for a ring, the whole sequence's for the all-gather design (``largest_kv_bytes``)."""

    def __init__(self, k: torch.Tensor):
        super().__init__()
        self.bytes, self._kv = 0, (2, k.shape[0], k.shape[1], k.shape[-1])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if (isinstance(t, torch.Tensor) and t.dim() == 5 and (*t.shape[:3], t.shape[-1]) == self._kv
                    and t.numel() > self.numel):
                self.numel, self.shape, self.bytes = t.numel(), tuple(t.shape), t.numel() * t.element_size()
        return out


def _library_ring(q, k, v, causal, seq_len, zigzag):
    """``cp.ring_forward`` in notebook 16's contract ``forward(q, k, v, causal, seq_len, zigzag) -> (out, lse)``."""
    return cp.ring_forward(q, k, v, causal=causal, seq_len=seq_len, zigzag=zigzag)[:2]


def compare_designs(spec: AttentionSpec | dict, *, forward=None, repeats: int = 3, seed: int = 0) -> dict:
    """A worker (``launch.run_forked``; call on every rank): this rank's attention forward on ``spec``'s blocks by the
    ring and by the all-gather design (``cp.gathered_forward``), what each sent, built and took.

    ``forward``: the ring, in notebook 16's contract (the student's ``ring_forward``; course_lib's by default).
    Returns ``gap``, the largest |difference| of the two outputs, and for "ring" and "all-gather": ``sent`` the bytes
    this rank sent (``CollectiveBytes``: the ring's sends, a recv being its peer's send; the all-gather's (N-1)/N
    share), ``kv_bytes`` the largest K/V tensor it built (``LargestKV``), ``seconds`` its wall time per forward (the
    median of ``repeats``, the ranks starting each one together; the first run, counted, is not timed).
    """
    spec = AttentionSpec(**spec) if isinstance(spec, dict) else spec
    rank, world = _rank_world()
    torch.manual_seed(seed)  # the same whole sequence on every rank; each keeps its part
    q = torch.randn(spec.batch, spec.heads, spec.seq, spec.head_dim)
    k, v = torch.randn(2, spec.batch, spec.kv, spec.seq, spec.head_dim)
    q, k, v = (split_sequence(t, world, zigzag=spec.zigzag)[rank] for t in (q, k, v))
    ring = forward or _library_ring
    designs = {"ring": lambda: ring(q, k, v, spec.causal, spec.seq, spec.zigzag)[0],
               "all-gather": lambda: cp.gathered_forward(q, k, v, causal=spec.causal, seq_len=spec.seq,
                                                         zigzag=spec.zigzag)[0]}
    measured, outs = {}, {}
    for name, run in designs.items():
        with CollectiveBytes() as comm, LargestKV(k) as held:
            outs[name] = run()
        times = []
        for _ in range(repeats):
            if world > 1:
                dist.barrier()
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        measured[name] = {"sent": sum(b for kind, b in comm.sent_bytes_by_kind.items() if kind != "recv"),
                          "kv_bytes": held.bytes, "seconds": statistics.median(times) if times else float("nan")}
    return {"spec": asdict(spec), "gap": float((outs["ring"] - outs["all-gather"]).abs().max()), **measured}
