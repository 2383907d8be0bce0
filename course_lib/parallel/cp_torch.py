"""torch's own context parallelism on the course's Llama, on GPU ranks: notebook 16's ring, as torch ships it.

``torch.distributed.tensor.experimental.context_parallel(mesh, buffers=..., buffer_seq_dims=...)`` does two things
inside its ``with`` block:

- it shards the buffers it is given (here the input ids, the targets and the positions) along the sequence, in
  place, with its head-tail load balancer: rank r keeps chunks r and 2N-1-r of 2N, notebook 16's zig-zag split
  (``cp.local_positions(..., zigzag=True)``; ``train_llama`` checks that on every rank);
- it swaps ``F.scaled_dot_product_attention`` for one whose q, k and v are DTensors sharded on the sequence, which
  DTensor runs as a ring of SDPA's fused GPU kernels (flash, memory-efficient, cuDNN), merging the partial results
  by their log-sum-exp as ``cp.merge`` does; the K/V shards travel by all-gather (torch's default).

The course's Llama keeps its attention (``attention.course_sdpa``, which calls ``F.scaled_dot_product_attention``, the
call the context swaps), with its K/V heads repeated to the query's (``ring_sdpa``), but gets no mask from
transformers (``llama``: a rank's zig-zag positions would read as packed sequences); causality is the ring's, from
``is_causal``. Backward runs inside the context too (the ring's backward is the DTensor handler of the kernel's
backward). The kernels are GPU kernels, so this runs on GPU ranks, one per GPU (``launch.on_ranks``); ``support``
says why not elsewhere (and on ROCm below the release that fixed its fused backward, why not there).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel  # torch 2.5 on: the floor's 2.7 has it

from course_lib.attention import course_sdpa, repeat_kv
from course_lib.data import lm_batch
from course_lib.distributed import rank_device
from course_lib.loss import IGNORE_INDEX
from course_lib.models import build_llama
from course_lib.parallel.cp import local_positions
from course_lib.parallel.cp_train import no_mask, sum_gradients
from course_lib.train import fit, train_step, worker_result

SEQ = 32  # tokens, at least: torch's load balancer cuts 2N equal chunks (seq_for rounds up to them)
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
    (tests/test_cp.py runs ``train_llama`` on two CPU ranks into exactly that), and with the math backend forced
    it fails on "aten.add.Tensor got mixed torch.Tensor and DTensor" (torch 2.13.0+cpu). So it needs GPUs.
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


def llama(seed: int = 0, device: torch.device | str = "cpu"):
    """The course's tiny Llama for torch's context parallel: the course's attention, heads repeated (``ring_sdpa``),
    no mask.

    A rank's positions under the zig-zag split jump (chunk r, then chunk 2N-1-r), and transformers reads a jump in
    ``position_ids`` as the start of a packed sequence: it would build a block mask that cuts attention at the jump
    (and torch's context would shard that mask as if it were q, k or v). No mask, and ``is_causal``: the ring masks
    by global position itself. The weights are ``build_llama("tiny", seed=seed)``'s: built on the CPU, where
    ``cp_train.reference_llama_losses`` builds the model it is compared with, then moved to ``device`` (a GPU's
    generator draws other weights from the same seed).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, ring_sdpa)
    AttentionMaskInterface.register(IMPLEMENTATION, no_mask)
    return build_llama("tiny", attn_implementation=IMPLEMENTATION, seed=seed).to(device)


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


def train_llama(steps: int = 3, *, seq: int | None = None, batch: int = 2, lr: float = 1e-3, seed: int = 0,
                force: bool = False) -> dict:
    """A worker (``launch.on_ranks``, GPU ranks): the course's tiny Llama trained with torch's ``context_parallel``
    over every rank of the group, the same batches and optimizer as ``cp_train.reference_llama_losses``; ``seq``
    tokens, by default ``seq_for`` the world (the reference must be given the same).

    Returns ``worker_result``'s losses (the sum of the ranks' shares: the batch's loss) and ``zigzag``: whether
    torch's split of the positions on this rank was ``cp.local_positions(rank, world, seq // world, zigzag=True)``.
    ``force`` runs past ``support``'s refusal: on CPU ranks the run then goes the GPU's way up to the attention
    kernel, where torch raises (tests/test_cp.py holds it to that, so the path is checked without a GPU).
    """
    device, world = rank_device(), dist.get_world_size()
    reason = support(device)
    if reason is not None and not force:
        raise RuntimeError(f"torch's context parallel cannot run on this rank: {reason}")
    seq = seq_for(world) if seq is None else seq
    if seq % (2 * world):
        raise ValueError(f"seq={seq} tokens do not cut into 2·{world} equal chunks, which torch's load balancer "
                         f"needs: use a multiple of {2 * world}")
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("cp",))
    model = llama(seed, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
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

    history = fit(model, optimizer, lambda i: lm_batch(i, batch, seq, model.config.vocab_size, seed), steps,
                  step=step, progress=False)
    # fit records the mean over ranks of each rank's share of the loss; the batch's loss is their sum
    return worker_result([r["loss"] * world for r in history], zigzag=all(zigzag))
