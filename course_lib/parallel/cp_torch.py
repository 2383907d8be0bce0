"""Context parallelism's one worker on the course's Llama: the ring by hand (``cp``), or torch's API applied to the
Llama, on GPU ranks: notebook 16's ring, as torch ships it.

``train(spec)`` runs one ``CPRun``: design "hand" trains ``cp.ring_llama`` (the Llama's attention on ``cp``'s ring,
any device), design "torch" the Llama under torch's context parallelism (``apply_cp``); both loss for loss with one
process (``reference_llama_losses``).

``torch.distributed.tensor.experimental.context_parallel(mesh, buffers=..., buffer_seq_dims=...)`` does two things
inside its ``with`` block:

- it shards the buffers it is given (here the input ids, the targets and the positions) along the sequence, in
  place, with its head-tail load balancer: rank r keeps chunks r and 2N-1-r of 2N, notebook 16's zig-zag split
  (``cp.local_positions(..., zigzag=True)``; ``train`` checks that on every rank);
- it swaps ``F.scaled_dot_product_attention`` for one whose q, k and v are DTensors sharded on the sequence, which
  DTensor runs as a ring of SDPA's fused GPU kernels (flash, memory-efficient, cuDNN), merging the partial results
  by their log-sum-exp as ``cp.merge`` does; the K/V shards travel by all-gather (torch's default).

The course's Llama keeps its attention (``attention.course_sdpa``, which calls ``F.scaled_dot_product_attention``, the
call the context swaps), with its K/V heads repeated to the query's (``ring_sdpa``), but gets no mask from
transformers (``apply_cp``; ``llama`` says why: a rank's zig-zag positions would read as packed sequences); causality is
the ring's, from ``is_causal``. Backward runs inside the context too (the ring's backward is the DTensor handler of the
kernel's backward). The kernels are GPU kernels, so this runs on GPU ranks, one per GPU (``launch.on_ranks``);
``support`` says why not elsewhere (and on ROCm below the release that fixed its fused backward, why not there).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.experimental import context_parallel  # torch 2.5 on: the floor's 2.7 has it

from course_lib.attention import course_sdpa, repeat_kv
from course_lib.data import lm_batch
from course_lib.distributed import rank_device
from course_lib.loss import IGNORE_INDEX, next_token_loss
from course_lib.models import build_llama
from course_lib.parallel.cp import local_positions, no_mask, ring_llama, ring_llama_loss, sum_gradients
from course_lib.train import Dims, RunSpec, fit, train_step, worker_result

SEQ = 32  # tokens, at least: torch's load balancer cuts 2N equal chunks (seq_for rounds up to them)
RING_SEQ = 30  # tokens by hand, by default: the ring pads a length that does not cut into its chunks
DESIGNS = ("hand", "torch")
IMPLEMENTATION = "course_torch_cp"
# ROCm: below 2.15, AOTriton's fused attention backward can fault inside context parallelism, and its memory-efficient
# kernel in fp32 misses torch's own tolerance. Below that release the course does not run it, unless the preflight's
# "context parallelism" row ran it on this machine and the host says so in ROCM_CP_ENV.
ROCM_CP_TORCH = (2, 15)
ROCM_CP_ENV = "COURSE_ROCM_TORCH_CP"


def seq_for(world: int, at_least: int = SEQ) -> int:
    """The shortest sequence of at least ``at_least`` tokens that torch's load balancer cuts into 2·``world`` equal
    chunks: 32 for 1, 2, 4, 8 or 16 ranks, 36 for 3, 40 for 5, 36 for 6, 42 for 7."""
    step = 2 * world
    return -(-at_least // step) * step


def support(device: torch.device | str) -> str | None:
    """None where torch's ``context_parallel`` can run on ``device``, else the reason it cannot.

    torch's context parallel swaps SDPA's fused kernels (flash, memory-efficient, cuDNN: CUDA and ROCm only) for
    ring versions of them. On a CPU SDPA runs ``_scaled_dot_product_flash_attention_for_cpu``, which has no
    context-parallel handler: inside ``context_parallel`` on gloo it raises "Operator
    aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy registered"
    (tests/test_cp.py runs ``train``'s design "torch" on two CPU ranks into exactly that), and with the math backend
    forced it fails on "aten.add.Tensor got mixed torch.Tensor and DTensor" (torch 2.13.0+cpu). So it needs GPUs.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return (f"torch's context_parallel rings only the fused GPU SDPA kernels (flash, memory-efficient, cuDNN); "
                f"on {device.type} SDPA runs a kernel it cannot shard: it needs GPUs, one per rank")
    if not torch.cuda.is_available():
        return "no GPU is visible to this process"
    return rocm_gate(torch.__version__, torch.version.hip, os.environ.get(ROCM_CP_ENV) == "1")


def rocm_gate(torch_version: str, hip: str | None, host_checked: bool = False) -> str | None:
    """Why torch ``torch_version`` (``hip``: its ROCm, None on CUDA) must not run context parallelism, or None."""
    release = tuple(int(p) for p in torch_version.split("+")[0].split(".")[:2])
    if hip is None or release >= ROCM_CP_TORCH or host_checked:
        return None
    return (f"torch {torch_version} on ROCm {hip}: AOTriton's fused attention backward can fault inside context "
            f"parallelism (fixed in torch {'.'.join(map(str, ROCM_CP_TORCH))}); `make preflight` tries one step on "
            f"this GPU, and where its row passes, {ROCM_CP_ENV}=1 runs it")


def ring_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args,
              **kwargs) -> tuple[torch.Tensor, None]:
    """``course_sdpa`` with K/V repeated to the query's heads: grouped heads (``enable_gqa``, which the fused GPU
    kernels take since torch 2.5) would travel into torch's context-parallel ring, whose sharding rules and tests
    cover equal heads only. Repeated, the ring runs the path torch tests; each rank sends n_rep× the K/V bytes."""
    n_rep = query.shape[1] // key.shape[1]
    return course_sdpa(module, query, repeat_kv(key, n_rep), repeat_kv(value, n_rep), *args, **kwargs)


def apply_cp(model: nn.Module, mesh: DeviceMesh | None, cfg: "CPRun | None" = None) -> nn.Module:
    """Make the course's Llama run under torch's ``context_parallel`` on ``mesh``, the 1-D "cp" mesh its context
    shards the batch over: its attention ``ring_sdpa`` (the course's, K/V heads repeated) with no mask from
    transformers (``cp.no_mask``; ``llama`` says why), both registered with transformers. With a mesh and ``cfg``,
    ``cfg``'s sequence must cut into 2·N equal chunks over the mesh's N ranks, as torch's load balancer needs.
    Returns the model."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, ring_sdpa)
    AttentionMaskInterface.register(IMPLEMENTATION, no_mask)
    model.config._attn_implementation = IMPLEMENTATION
    if mesh is not None and cfg is not None:
        world, seq = mesh.size(), cfg.length(mesh.size())
        if seq % (2 * world):
            raise ValueError(f"seq={seq} tokens do not cut into 2·{world} equal chunks, which torch's load balancer "
                             f"needs: use a multiple of {2 * world}")
    return model


def llama(seed: int = 0, device: torch.device | str = "cpu"):
    """The course's tiny Llama for torch's context parallel: the course's attention, heads repeated (``ring_sdpa``),
    no mask (``apply_cp``).

    A rank's positions under the zig-zag split jump (chunk r, then chunk 2N-1-r), and transformers reads a jump in
    ``position_ids`` as the start of a packed sequence: it would build a block mask that cuts attention at the jump
    (and torch's context would shard that mask as if it were q, k or v). No mask, and ``is_causal``: the ring masks
    by global position itself. The weights are ``build_llama("tiny", seed=seed)``'s: built on the CPU, where
    ``reference_llama_losses`` builds the model it is compared with, then moved to ``device`` (a GPU's generator
    draws other weights from the same seed).
    """
    return apply_cp(build_llama("tiny", seed=seed), None).to(device)


def sharded_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor,
                 seq: int) -> torch.Tensor:
    """This rank's share of the next-token loss, its tokens, targets and positions already cut by torch's context.

    The rotary embedding needs each token's global position, hence ``positions``. The targets were shifted before
    the split (the last local token's target may live on another rank), so each rank sums its tokens' cross-entropy
    over the whole batch's count: the ranks' losses sum to the batch's mean.
    """
    logits = model(input_ids=tokens, position_ids=positions).logits
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return loss / (len(tokens) * (seq - 1))


@dataclass(frozen=True)
class CPRun(RunSpec):
    """One training run of the course's tiny Llama under context parallelism, over every rank of the group.

    ``design``: "hand", the ring by hand (``cp.ring_llama``, any device: forked CPU ranks), or "torch", torch's
    ``context_parallel`` (GPU ranks, one per GPU). ``zigzag``: the hand ring's split (torch's is always the zig-zag:
    its head-tail load balancer). ``seq``: tokens per sequence, None for the design's default (``length``: RING_SEQ by
    hand, ``seq_for`` the world with torch); the reference must be given the same. ``force``: torch's run goes on
    past ``support``'s refusal (on CPU ranks up to the attention kernel, where torch raises)."""

    design: str = "hand"
    steps: int = 3
    zigzag: bool = False
    seq: int | None = None
    batch: int = 2
    lr: float = 1e-3
    seed: int = 0
    force: bool = False

    def __post_init__(self):
        if self.design not in DESIGNS:
            raise ValueError(f"design={self.design!r}: use one of {', '.join(DESIGNS)}")

    def length(self, world: int) -> int:
        """Tokens per sequence on a ring of ``world``: ``seq``, or the design's default."""
        if self.seq is not None:
            return self.seq
        return RING_SEQ if self.design == "hand" else seq_for(world)


def train(spec: CPRun | dict | None = None, forward=None) -> dict:
    """A worker (``launch.run_forked`` by hand, ``launch.on_ranks`` with torch): the course's tiny Llama trained with
    context parallelism over every rank of the group, the same batches and optimizer as ``reference_llama_losses``.

    Every rank holds the whole model and its part of every sequence (``train.fit``, the course's loop); its loss is
    its tokens' share of the sequence's mean, so the gradients are summed over the ranks after backward
    (``cp.sum_gradients``), and the loss of a step is the sum of the shares (``fit`` records their mean). Design
    "hand": the Llama's attention is ``cp``'s ring, ``forward`` the ring forward it runs (the student's; default
    ``cp.ring_attention``'s). Design "torch": each step inside ``context_parallel`` (``apply_cp``), which cuts the
    batch and swaps SDPA for its ring. Returns ``worker_result``'s losses (the batch's loss per step) and, with torch,
    ``zigzag``: whether torch's split of the positions on this rank was ``cp.local_positions(..., zigzag=True)``.
    """
    spec = CPRun.of(spec)
    world = dist.get_world_size()
    seq = spec.length(world)
    if spec.design == "hand":
        model = ring_llama(spec.seed)
        history = fit(model, torch.optim.AdamW(model.parameters(), lr=spec.lr),
                      lambda step: lm_batch(step, spec.batch, seq, model.config.vocab_size, spec.seed), spec.steps,
                      loss_fn=lambda m, tokens: ring_llama_loss(m, tokens, zigzag=spec.zigzag, forward=forward),
                      sync_grads=sum_gradients, progress=False)
        return worker_result([r["loss"] * world for r in history])
    if forward is not None:
        raise ValueError("forward= is the hand ring's forward: torch's context_parallel rings its own kernels")
    device = rank_device()
    reason = support(device)
    if reason is not None and not spec.force:
        raise RuntimeError(f"torch's context parallel cannot run on this rank: {reason}")
    mesh = Dims(spec.batch, cp=world).mesh(device.type, ("cp",))
    model = apply_cp(build_llama("tiny", seed=spec.seed), mesh, spec).to(device)  # drawn on the CPU: see llama
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr)
    zigzag = []

    def step(tokens: torch.Tensor) -> dict:
        tokens = tokens.to(device)
        targets = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], IGNORE_INDEX)], dim=1)
        positions = torch.arange(seq, device=device).expand(len(tokens), -1).contiguous()
        cut = [tokens, targets, positions]
        with context_parallel(mesh, buffers=cut, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(cut)):
            want = local_positions(dist.get_rank(), world, seq // world, True, device)
            zigzag.append(bool(torch.equal(positions[0], want)))
            return train_step(model, optimizer, cut, loss_fn=lambda m, b: sharded_loss(m, *b, seq),
                              sync_grads=sum_gradients)

    history = fit(model, optimizer, lambda i: lm_batch(i, spec.batch, seq, model.config.vocab_size, spec.seed),
                  spec.steps, step=step, progress=False)
    # fit records the mean over ranks of each rank's share of the loss; the batch's loss is their sum
    return worker_result([r["loss"] * world for r in history], zigzag=all(zigzag))


def reference_llama_losses(steps: int = 3, *, seq: int = RING_SEQ, batch: int = 2, lr: float = 1e-3,
                           seed: int = 0) -> list[float]:
    """One process, the same model, batches and optimizer, attention over the whole sequence (SDPA)."""
    model = build_llama("tiny", seed=seed)
    history = fit(model, torch.optim.AdamW(model.parameters(), lr=lr),
                  lambda step: lm_batch(step, batch, seq, model.config.vocab_size, seed), steps,
                  loss_fn=lambda m, tokens: next_token_loss(m(input_ids=tokens).logits, tokens), progress=False)
    return [r["loss"] for r in history]
