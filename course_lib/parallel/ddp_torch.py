"""Data parallelism with torch's API applied to the course's model: ``DistributedDataParallel`` over SmallCNN.

``apply_ddp`` wraps a model in torch's ``DistributedDataParallel`` (DDP's reducer: buckets of gradients all-reduced
while backward runs). ``train``, the parallelism's one worker, runs one ``DDPRun`` through the course's one loop,
``fit``: torch's DDP, or the mechanisms written out by hand in ``ddp`` (``BucketedDDP``, ``all_reduce_gradients``), or
the student's own, and returns the losses, so they (and a single process on the whole batch) can be compared.
``throughput`` times steps of any of them, and ``size_throughput`` finds, from this machine's own steps and
``ddp_cost``'s step-time model, the global batch on which N ranks should be most of N times faster than one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from course_lib.data import synthetic_images
from course_lib.distributed import param_digest, rank_device, step_batches
from course_lib.launch import on_ranks
from course_lib.memory import tensor_bytes
from course_lib.models import SmallCNN
from course_lib.parallel.ddp import BucketedDDP, all_reduce_gradients
from course_lib.parallel.ddp_cost import batch_for_speedup, predicted_speedup, step_time_model
from course_lib.throughput import time_step
from course_lib.train import Dims, RunSpec, fit, rank_and_world, train_step, worker_result


@dataclass(frozen=True)
class DDPRun(RunSpec):
    """One data-parallel training run of SmallCNN (``train``): ``steps`` SGD steps at ``lr`` on global batches of
    ``global_batch`` samples from ``n_samples`` synthetic images, each rank's share cut into ``accum_steps``
    micro-batches. ``mode``: ``"ddp"`` (torch's DistributedDataParallel, ``apply_ddp``), ``"bucketed"``
    (``ddp.BucketedDDP``), ``"manual"`` (plain model and ``ddp.all_reduce_gradients`` after backward); a label only
    where ``train`` is given a wrapper or a sync of its own. ``bucket_cap_mb``: torch DDP's bucket size (None: torch's
    default, 25 MiB with a first bucket of 1 MiB). ``report_env``: ``train`` also returns what the launcher told this
    process (``launch_report``)."""

    steps: int = 5
    global_batch: int = 32
    width: int = 8
    mode: str = "ddp"
    lr: float = 0.05
    accum_steps: int = 1
    seed: int = 0
    n_samples: int = 512
    bucket_cap_mb: float | None = None
    report_env: bool = False


def apply_ddp(model: nn.Module, mesh=None, cfg: DDPRun | dict | None = None) -> nn.Module:
    """``model`` wrapped in torch's ``DistributedDataParallel`` over ``mesh`` (a 1-D DeviceMesh; None: the whole
    world), with ``cfg``'s ``bucket_cap_mb``. Wrapping broadcasts rank 0's weights and buffers; backward all-reduces
    the gradients bucket by bucket as they arrive, averaged over the ranks. A model on a GPU is DDP's one device."""
    cfg = DDPRun.of(cfg)
    device = next(model.parameters()).device
    device_ids = [device.index] if device.type == "cuda" else None
    return DDP(model, device_ids=device_ids, bucket_cap_mb=cfg.bucket_cap_mb, device_mesh=mesh)


def train(spec: DDPRun | dict | None = None, wrap: Callable[[nn.Module], nn.Module] | None = None,
          sync_grads: Callable[[nn.Module], None] | None = None) -> dict:
    """Train SmallCNN with data parallelism on this process group: data parallelism's one worker, one ``DDPRun``
    (a dict of its fields as launch's JSON brings it; None: the defaults).

    ``spec.mode`` picks the mechanism (see ``DDPRun``). With a world of one it is single-process training.
    ``wrap`` and ``sync_grads`` replace the mode's wrapper and its after-backward call, as in ``throughput``
    (notebooks 06 and 07 pass your own, through ``run_forked``; ``mode`` then only labels the run).
    Returns this rank's per-step global-batch losses and a digest of the final weights (and, with ``report_env``,
    ``launch_report``'s).
    """
    spec = DDPRun.of(spec)
    # one thread, however the rank was started (torchrun, fork, spawn): a CPU kernel's sums run in an
    # order that depends on its thread count, and runs compared to 1e-7 must round alike
    torch.set_num_threads(1)
    torch.manual_seed(spec.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)
    model = SmallCNN(width=spec.width)
    sync = sync_grads  # once per step, after the last micro-batch
    if wrap is not None or sync_grads is not None:
        model = wrap(model) if wrap is not None else model
    elif spec.mode == "ddp":
        model = apply_ddp(model, None, spec)
    elif spec.mode == "bucketed":
        model, sync = BucketedDDP(model), BucketedDDP.finish_gradient_synchronization
    elif spec.mode == "manual":
        sync = all_reduce_gradients
    else:
        raise ValueError(f"mode={spec.mode!r}: use 'ddp', 'bucketed' or 'manual'")
    opt = torch.optim.SGD(model.parameters(), lr=spec.lr)
    dims = Dims(spec.global_batch, spec.accum_steps, dp=rank_and_world()[1])
    # this rank's shard of each step's global batch
    batches = step_batches(synthetic_images(spec.n_samples, seed=spec.seed), spec.global_batch, spec.steps, spec.seed)
    history = fit(model, opt, batches, spec.steps, dims=dims, sync_grads=sync, progress=False)
    return worker_result([r["loss"] for r in history], digest=param_digest(model),
                         **(launch_report() if spec.report_env else {}))


def launch_report() -> dict:
    """What the launcher told this process: torchrun's environment variables (``env``) and the backend."""
    return {"env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                                   "MASTER_ADDR", "MASTER_PORT")},
            "backend": dist.get_backend()}


def fail_on_rank(rank_to_fail: int = 1, message: str = "this rank fails on purpose") -> dict:
    """A worker that raises on one rank while the others wait in a collective (tests a launch never hangs)."""
    if dist.get_rank() == rank_to_fail:
        raise RuntimeError(message)
    dist.barrier()  # the other ranks block here until the launcher stops them
    return {}


def throughput(global_batch: int = 64, width: int = 16, steps: int = 5, warmup: int = 1, mode: str = "ddp",
               threads: int | None = None, seed: int = 0, bucket_cap_mb: float = 25.0,
               wrap: Callable[[nn.Module], nn.Module] | None = None,
               sync_grads: Callable[[nn.Module], None] | None = None) -> dict:
    """Samples per second of training steps on one global batch, data parallel over this process group.

    Each rank steps a replica on ``global_batch / world`` samples (on ``cuda:LOCAL_RANK`` when there
    are GPUs). ``mode``: ``"ddp"`` (DistributedDataParallel), ``"bucketed"`` (``BucketedDDP``),
    ``"manual"`` (one all-reduce per parameter after backward), or ``"dp"``: a world of one process
    driving ``nn.DataParallel`` over every visible GPU on the whole global batch. ``wrap`` and
    ``sync_grads`` replace the mode's wrapper and its after-backward call (a wrapper of your own;
    ``mode`` then only labels the result). The step time is the slowest rank's median.
    """
    if threads:
        torch.set_num_threads(threads)
    world, rank = dist.get_world_size(), dist.get_rank()
    device = rank_device()
    cuda = device.type == "cuda"
    torch.manual_seed(seed)
    model = SmallCNN(width=width).to(device)
    model, sync_grads, local = _data_parallel(model, mode, global_batch, bucket_cap_mb, wrap, sync_grads)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = synthetic_images(local, seed=seed + rank).tensors
    x, y = x.to(device), y.to(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    timing = time_step(lambda: train_step(model, opt, (x, y), sync_grads=sync_grads), device, warmup=warmup,
                       repeat=steps)
    seconds = torch.tensor([timing["median_s"]], dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    seconds = float(seconds.item())
    return {"rank": rank, "world_size": world, "mode": mode, "seconds_per_step": seconds,
            "samples_per_s": global_batch / seconds, "gpus": torch.cuda.device_count() if cuda else 0,
            "param_bytes": tensor_bytes(model.parameters()),
            "peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None}


def _data_parallel(model: nn.Module, mode: str, global_batch: int, bucket_cap_mb: float, wrap, sync_grads):
    """``throughput``'s replica for ``mode``: (model, its after-backward call, the local batch)."""
    world = dist.get_world_size()
    cuda = next(model.parameters()).device.type == "cuda"
    if mode == "dp":
        if world != 1 or not cuda:
            raise ValueError("mode='dp' (DataParallel) runs in one process (nprocs=1) and needs GPUs")
        return nn.DataParallel(model), None, global_batch
    local = Dims(global_batch, dp=world).local_batch
    if wrap is not None:
        return wrap(model), sync_grads, local
    if mode == "ddp":
        return apply_ddp(model, None, DDPRun(bucket_cap_mb=bucket_cap_mb)), None, local
    if mode == "bucketed":
        return BucketedDDP(model, bucket_cap_mb), BucketedDDP.finish_gradient_synchronization, local
    if mode == "manual":
        return model, all_reduce_gradients, local
    raise ValueError(f"mode={mode!r}: use 'ddp', 'bucketed', 'manual' or 'dp'")


SIZING_RUNS = 6  # one-rank runs at most while the batch grows 4x each time: 64 samples become 65,536
SIZING_MEMORY_SHARE = 0.6  # of one GPU's memory, the most the one-rank run may take at the batch chosen


def size_throughput(device: torch.device | str, n_ranks: int, width: int, steps: int = 5, seed: int = 0,
                    smallest: int = 64, share: float = 0.7) -> dict:
    """The global batch on which ``n_ranks`` ranks should show ``share`` x N over one, from this machine's own steps
    (``throughput``). One rank from ``smallest`` samples up, 4x each time, until a step takes twice the one before
    (compute shows) or ``SIZING_RUNS`` runs; the line through the last two; then ``n_ranks`` ranks on the last batch.
    On GPUs the one-rank run must fit: no batch past ``SIZING_MEMORY_SHARE`` of the card, by the fitted memory per
    sample. Returns the fitted model, the batch wanted, the batch given (capped where memory would not hold it), the
    speedup predicted there, and the runs timed."""

    def timed(nprocs: int, batch: int) -> dict:
        return on_ranks(throughput, nprocs, device, global_batch=batch, width=width, steps=steps, seed=seed)[0]

    runs, most = [(smallest, timed(1, smallest))], None
    for _ in range(SIZING_RUNS - 1):
        (b, before), after = runs[-1], 4 * runs[-1][0]
        if before["peak_bytes"] and len(runs) > 1:  # memory per sample, from the last two runs
            per_sample = (before["peak_bytes"] - runs[-2][1]["peak_bytes"]) / (b - runs[-2][0])
            card = torch.cuda.get_device_properties(torch.device(device)).total_memory
            most = int(b + (SIZING_MEMORY_SHARE * card - before["peak_bytes"]) / max(per_sample, 1.0))
            if after > most:
                break
        runs.append((after, timed(1, after)))
        if runs[-1][1]["seconds_per_step"] >= 2 * before["seconds_per_step"]:
            break
    (b1, r1), (b2, r2) = runs[-2:]  # two at least: memory is judged from two runs, so the first 4x always runs
    shared = max(b2 // n_ranks, 1) * n_ranks
    many = (shared, timed(n_ranks, shared)["seconds_per_step"])
    model = step_time_model([(b1, r1["seconds_per_step"]), (b2, r2["seconds_per_step"])], n_ranks, many)
    wanted = batch_for_speedup(model, share)
    batch = wanted if most is None else max(min(wanted, most // n_ranks * n_ranks), n_ranks)
    return {**model, "wanted": wanted, "global_batch": batch, "predicted_speedup": predicted_speedup(model, batch),
            "runs": [{"ranks": 1, "global_batch": b, "seconds_per_step": r["seconds_per_step"]} for b, r in runs]
            + [{"ranks": n_ranks, "global_batch": many[0], "seconds_per_step": many[1]}]}
