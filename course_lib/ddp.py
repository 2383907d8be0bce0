"""Data parallelism, written out: shard the data, all-reduce the gradients, step in lockstep.

Every rank holds a full copy of the model and trains on its own shard of each global batch
(``DistributedSampler``). After backward, the gradients are averaged over ranks with an
all-reduce, so every rank takes the same optimizer step and the copies stay identical.
``all_reduce_gradients`` is that average by hand; ``DistributedDataParallel`` does the same
bucket by bucket, overlapped with the backward pass. ``train`` runs either through the course's
one ``train_step`` (the hand-written average as its ``sync_grads``) and returns the losses, so
the two (and a single process on the whole batch) can be compared.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from course_lib.data import synthetic_images
from course_lib.distributed import mean_over_ranks, param_digest, rank_device, step_batches, worker_result
from course_lib.memory import tensor_bytes
from course_lib.models import SmallCNN
from course_lib.throughput import time_step
from course_lib.train import train_step


def all_reduce_gradients(model: nn.Module) -> None:
    """Average every parameter's gradient over all ranks, in place (sum, then divide by world size)."""
    world = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad /= world


def train(steps: int = 5, global_batch: int = 32, width: int = 8, mode: str = "ddp", lr: float = 0.05,
          accum_steps: int = 1, seed: int = 0, n_samples: int = 512) -> dict:
    """Train SmallCNN with data parallelism on this process group; one worker entry point of the course.

    ``mode``: ``"ddp"`` (DistributedDataParallel), ``"manual"`` (plain model and
    ``all_reduce_gradients`` after backward). With a world of one it is single-process training.
    Returns this rank's per-step global-batch losses and a digest of the final weights.
    """
    # one thread, however the rank was started (torchrun, fork, spawn): a CPU kernel's sums run in an
    # order that depends on its thread count, and runs compared to 1e-7 must round alike
    torch.set_num_threads(1)
    torch.manual_seed(seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)
    model = SmallCNN(width=width)
    if mode == "ddp":
        model = DDP(model)
    elif mode != "manual":
        raise ValueError(f"mode={mode!r}: use 'ddp' or 'manual'")
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    sync = all_reduce_gradients if mode == "manual" else None  # once per step, after the last micro-batch
    losses = []
    for batch in step_batches(synthetic_images(n_samples, seed=seed), global_batch, steps, seed):
        out = train_step(model, opt, batch, accum_steps=accum_steps, sync_grads=sync)
        losses.append(mean_over_ranks(out["loss"]))  # the ranks' local batches make the global batch
    return worker_result(losses, digest=param_digest(model))


def fail_on_rank(rank_to_fail: int = 1, message: str = "this rank fails on purpose") -> dict:
    """A worker that raises on one rank while the others wait in a collective (tests a launch never hangs)."""
    if dist.get_rank() == rank_to_fail:
        raise RuntimeError(message)
    dist.barrier()  # the other ranks block here until the launcher stops them
    return {}


def train_and_report(**train_kwargs) -> dict:
    """``train`` plus what the launcher told this process: torchrun's environment variables and the backend."""
    out = train(**train_kwargs)
    out["env"] = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                                 "MASTER_ADDR", "MASTER_PORT")}
    out["backend"] = dist.get_backend()
    return out


def throughput(global_batch: int = 64, width: int = 16, steps: int = 5, warmup: int = 1, mode: str = "ddp",
               threads: int | None = None, seed: int = 0) -> dict:
    """Samples per second of training steps on one global batch: DDP over this process group, or DataParallel.

    ``mode="ddp"``: each rank steps a DDP replica on ``global_batch / world`` samples (on
    ``cuda:LOCAL_RANK`` when there are GPUs). ``mode="dp"``: a world of one process drives
    ``nn.DataParallel`` over every visible GPU on the whole global batch. The step time is the
    slowest rank's median (the ranks wait for each other in the all-reduce).
    """
    if threads:
        torch.set_num_threads(threads)
    world, rank = dist.get_world_size(), dist.get_rank()
    device = rank_device()
    cuda = device.type == "cuda"
    torch.manual_seed(seed)
    model = SmallCNN(width=width).to(device)
    if mode == "ddp":
        if global_batch % world:
            raise ValueError(f"global_batch={global_batch} does not divide by the world size {world}")
        model, local = DDP(model, device_ids=[device.index] if cuda else None), global_batch // world
    elif mode == "dp":
        if world != 1 or not cuda:
            raise ValueError("mode='dp' (DataParallel) runs in one process (nprocs=1) and needs GPUs")
        model, local = nn.DataParallel(model), global_batch
    else:
        raise ValueError(f"mode={mode!r}: use 'ddp' or 'dp'")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = synthetic_images(local, seed=seed + rank).tensors
    x, y = x.to(device), y.to(device)
    timing = time_step(lambda: train_step(model, opt, (x, y)), device, warmup=warmup, repeat=steps)
    seconds = torch.tensor([timing["median_s"]], dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    seconds = float(seconds.item())
    return {"rank": rank, "world_size": world, "mode": mode, "seconds_per_step": seconds,
            "samples_per_s": global_batch / seconds, "gpus": torch.cuda.device_count() if cuda else 0,
            "param_bytes": tensor_bytes(model.parameters())}
