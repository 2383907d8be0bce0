"""Data parallelism, written out: shard the data, all-reduce the gradients, step in lockstep.

Every rank holds a full copy of the model and trains on its own shard of each global batch
(``DistributedSampler``). After backward, the gradients are averaged over ranks with an
all-reduce, so every rank takes the same optimizer step and the copies stay identical.
``all_reduce_gradients`` is that average by hand; ``DistributedDataParallel`` does the same
bucket by bucket, overlapped with the backward pass; ``BucketedDDP`` is that mechanism in one
screen (gradient hooks, buckets in reverse order, an async all-reduce per full bucket, one wait
before the optimizer step). ``train`` runs any of them through the course's one loop, ``fit``,
and returns the losses, so they (and a single process on the whole batch) can be compared.
``all_reduce_gradients`` and ``BucketedDDP`` are notebooks 06's and 07's exercises: the student edition holds
stubs in their place, and ``train`` and ``throughput`` take the student's own through ``wrap`` and
``sync_grads``.
"""

from __future__ import annotations

import contextlib
import functools
import os
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
from course_lib.throughput import time_step
from course_lib.train import Dims, fit, rank_and_world, train_step, worker_result


# graded: 06_ddp average_gradients
def all_reduce_gradients(model: nn.Module) -> None:
    """Average every parameter's gradient over all ranks, in place (sum, then divide by world size)."""
    world = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad /= world


# graded: 07_ddp_reducer BucketedDDP
def bucket_parameters(parameters, bucket_cap_mb: float) -> list[list[nn.Parameter]]:
    """Group parameters into buckets of about ``bucket_cap_mb`` MiB of gradient, in reverse order.

    Backward produces the last layer's gradients first, so buckets are filled from the end of
    ``parameters``. A bucket closes once its bytes reach the cap, so the parameter that reaches it stays
    inside and a bucket may pass the cap by its last parameter: the rule of torch's reducer
    (``torch.distributed._compute_bucket_assignment_by_size``), which also keeps a smaller first bucket,
    left out here. Parameters that need no gradient are left out.
    """
    cap = bucket_cap_mb * 2**20
    buckets: list[list[nn.Parameter]] = []
    size = cap  # a full bucket: the first parameter opens one
    for p in reversed([p for p in parameters if p.requires_grad]):
        if size >= cap:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.numel() * p.element_size()
    return buckets


# graded: 07_ddp_reducer BucketedDDP
class BucketedDDP(nn.Module):
    """DDP's overlap, by hand: each bucket of gradients is all-reduced as soon as backward has filled it.

    Wrapping broadcasts rank 0's weights and buffers. A ``register_post_accumulate_grad_hook`` on
    every parameter counts the gradients that have arrived in its bucket; the last one launches one
    async all-reduce of the bucket, flattened, while backward goes on with earlier layers.
    ``finish_gradient_synchronization()`` (after backward, before the optimizer step) waits for all of
    them, divides by the world size and writes the averages back into ``.grad``. One collective per
    bucket per backward; every parameter that requires a gradient must get one in each backward: a
    parameter that the forward skipped leaves its bucket unlaunched, and ``finish_gradient_synchronization``
    raises ``RuntimeError`` naming it, where silence would let the ranks' gradients drift apart (torch's
    DDP raises too, at the next forward, unless ``find_unused_parameters=True``).
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0):
        super().__init__()
        self.module = module
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src=0)
        self.buckets = bucket_parameters(module.parameters(), bucket_cap_mb)
        self._names = {id(p): name for name, p in module.named_parameters()}  # for the unused-parameter error
        self._arrived: list[set[int]] = [set() for _ in self.buckets]  # per bucket, the ids of gradients in
        self._in_flight: list[tuple[int, torch.Tensor, object]] = []
        self._sync = True
        for i, bucket in enumerate(self.buckets):
            for p in bucket:
                p.register_post_accumulate_grad_hook(functools.partial(self._gradient_arrived, i))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside this block only accumulates (DDP's ``no_sync``): for all micro-batches but the last."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def _gradient_arrived(self, i: int, param: torch.Tensor) -> None:
        if not self._sync:
            return
        self._arrived[i].add(id(param))  # which one, not just how many: the error names the missing ones
        if len(self._arrived[i]) == len(self.buckets[i]):
            flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[i]])
            self._in_flight.append((i, flat, dist.all_reduce(flat, async_op=True)))

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket's all-reduce and write the averaged gradients back; ready for the next backward.

        Raises ``RuntimeError`` naming the parameters that got no gradient where a bucket never filled (a
        parameter the forward did not use), after waiting for the buckets that did leave and resetting, so
        the next step starts clean. A backward that counted nothing (all of it under ``no_sync``) has nothing
        to synchronise.
        """
        world = dist.get_world_size()
        for i, flat, work in self._in_flight:
            work.wait()  # even when we raise below: nothing may stay in flight into the next step
            flat /= world
            for p, g in zip(self.buckets[i], flat.split([p.numel() for p in self.buckets[i]])):
                p.grad.copy_(g.view_as(p.grad))
        counted = any(self._arrived)
        unused = [(i, self._names[id(p)]) for i, bucket in enumerate(self.buckets) for p in bucket
                  if counted and id(p) not in self._arrived[i]]
        self._in_flight.clear()
        self._arrived = [set() for _ in self.buckets]
        if unused:
            raise RuntimeError(_unused_parameters_message(unused))


def _unused_parameters_message(unused: list[tuple[int, str]]) -> str:
    """``BucketedDDP``'s error for the ``(bucket, name)`` of parameters that got no gradient in a backward."""
    which = ", ".join(f"{name} (bucket {i})" for i, name in unused)
    return (f"BucketedDDP: {len(unused)} parameter(s) that require a gradient got none in this backward: {which}. "
            "Their buckets were never all-reduced, so the ranks' gradients would differ. Use every parameter in "
            "forward, or set requires_grad=False on the ones you do not train (torch's DistributedDataParallel "
            "raises at the next forward, \"Expected to have finished reduction in the prior iteration ...\", "
            "unless it is given find_unused_parameters=True, which searches the graph for them after every forward).")


def ddp_bytes_per_rank(n_params: int, dtype_bytes: int = 4) -> int:
    """Bytes one rank's all-reduces take in per step, as ``CollectiveBytes`` counts them: every gradient once,
    whatever the number of ranks (a ring all-reduce sends 2(N-1)/N of it from each rank)."""
    return n_params * dtype_bytes


def train(steps: int = 5, global_batch: int = 32, width: int = 8, mode: str = "ddp", lr: float = 0.05,
          accum_steps: int = 1, seed: int = 0, n_samples: int = 512,
          wrap: Callable[[nn.Module], nn.Module] | None = None,
          sync_grads: Callable[[nn.Module], None] | None = None) -> dict:
    """Train SmallCNN with data parallelism on this process group; one worker entry point of the course.

    ``mode``: ``"ddp"`` (DistributedDataParallel), ``"bucketed"`` (``BucketedDDP``), ``"manual"``
    (plain model and ``all_reduce_gradients`` after backward). With a world of one it is single-process training.
    ``wrap`` and ``sync_grads`` replace the mode's wrapper and its after-backward call, as in ``throughput``
    (notebooks 06 and 07 pass your own, through ``run_forked``; ``mode`` then only labels the run).
    Returns this rank's per-step global-batch losses and a digest of the final weights.
    """
    # one thread, however the rank was started (torchrun, fork, spawn): a CPU kernel's sums run in an
    # order that depends on its thread count, and runs compared to 1e-7 must round alike
    torch.set_num_threads(1)
    torch.manual_seed(seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)
    model = SmallCNN(width=width)
    sync = sync_grads  # once per step, after the last micro-batch
    if wrap is not None or sync_grads is not None:
        model = wrap(model) if wrap is not None else model
    elif mode == "ddp":
        model = DDP(model)
    elif mode == "bucketed":
        model, sync = BucketedDDP(model), BucketedDDP.finish_gradient_synchronization
    elif mode == "manual":
        sync = all_reduce_gradients
    else:
        raise ValueError(f"mode={mode!r}: use 'ddp', 'bucketed' or 'manual'")
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    dims = Dims(global_batch, accum_steps, dp=rank_and_world()[1])
    batches = step_batches(synthetic_images(n_samples, seed=seed), global_batch, steps, seed)  # this rank's shard
    history = fit(model, opt, batches, steps, dims=dims, sync_grads=sync, progress=False)
    return worker_result([r["loss"] for r in history], digest=param_digest(model))


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
        device_ids = [next(model.parameters()).device.index] if cuda else None
        return DDP(model, device_ids=device_ids, bucket_cap_mb=bucket_cap_mb), None, local
    if mode == "bucketed":
        return BucketedDDP(model, bucket_cap_mb), BucketedDDP.finish_gradient_synchronization, local
    if mode == "manual":
        return model, all_reduce_gradients, local
    raise ValueError(f"mode={mode!r}: use 'ddp', 'bucketed', 'manual' or 'dp'")


# ---------------------------------------------------------------- a workload where compute dominates
# N ranks beat one by N only where the step is compute: a step costs a fixed part (kernel launches, Python, the
# optimizer) that every rank pays whole, a part per sample that N ranks split, and the gradient all-reduce that
# backward does not hide. On the same global batch B: T_1 = fixed + per_sample * B and
# T_N = fixed + per_sample * B / N + sync, so the speedup T_1 / T_N nears N only once per_sample * B dwarfs
# N * (fixed + sync). A small model on a fast GPU needs a large B; the fit below says how large, from this machine.

def step_time_model(one_rank: list[tuple[int, float]], n_ranks: int, many: tuple[int, float]) -> dict:
    """The step-time model fitted to measured steps: ``one_rank``, (global batch, seconds) pairs of one rank at two
    or more batches (a least-squares line: ``fixed`` and ``per_sample``); ``many``, (global batch, seconds) of
    ``n_ranks`` ranks, whose excess over the line at B / N is the exposed ``sync`` (at least 0)."""
    if len({b for b, _ in one_rank}) < 2:
        raise ValueError(f"one_rank={one_rank}: time one rank at two or more different batches to fit a line")
    n = len(one_rank)
    mb, mt = sum(b for b, _ in one_rank) / n, sum(t for _, t in one_rank) / n
    per_sample = sum((b - mb) * (t - mt) for b, t in one_rank) / sum((b - mb) ** 2 for b, _ in one_rank)
    if per_sample <= 0:
        raise ValueError(f"one_rank={one_rank}: the larger batch was not slower, so the timings are noise: time "
                         "batches further apart, or more steps each")
    fixed = max(mt - per_sample * mb, 0.0)
    batch, seconds = many
    sync = max(seconds - fixed - per_sample * batch / n_ranks, 0.0)
    return {"fixed_s": fixed, "per_sample_s": per_sample, "sync_s": sync, "n_ranks": n_ranks}


def predicted_speedup(model: dict, global_batch: int) -> float:
    """``step_time_model``'s T_1 / T_N on ``global_batch``: one rank against ``model["n_ranks"]``."""
    a, c, s, n = model["fixed_s"], model["per_sample_s"], model["sync_s"], model["n_ranks"]
    return (a + c * global_batch) / (a + c * global_batch / n + s)


def batch_for_speedup(model: dict, share: float = 0.7) -> int:
    """The smallest global batch, a multiple of the ranks, whose predicted speedup reaches ``share`` x N. Solves
    fixed + c B >= share N (fixed + c B / N + sync) for B."""
    if not 0 < share < 1:
        raise ValueError(f"share={share}: the speedup N ranks reach tends to N, so ask for a share below 1")
    a, c, s, n = model["fixed_s"], model["per_sample_s"], model["sync_s"], model["n_ranks"]
    batch = -(-int(max((share * n * (a + s) - a) / ((1 - share) * c), n)) // n) * n
    while predicted_speedup(model, batch) < share * n:  # rounding: step up to the first multiple that reaches it
        batch += n
    return batch


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
