"""Data parallelism, written out by hand: shard the data, all-reduce the gradients, step in lockstep.

Every rank holds a full copy of the model and trains on its own shard of each global batch
(``DistributedSampler``). After backward, the gradients are averaged over ranks with an
all-reduce, so every rank takes the same optimizer step and the copies stay identical.
``all_reduce_gradients`` is that average by hand; torch's ``DistributedDataParallel`` does the same
bucket by bucket, overlapped with the backward pass; ``BucketedDDP`` is that mechanism in one
screen (gradient hooks, buckets in reverse order, an async all-reduce per full bucket, one wait
before the optimizer step). ``ddp_torch.train`` runs any of them (and torch's own) through the course's one loop,
``fit``; ``ddp_cost`` prices them.
``all_reduce_gradients`` and ``BucketedDDP`` are notebooks 06's and 07's exercises: the student edition holds
stubs in their place, and ``ddp_torch.train`` and ``ddp_torch.throughput`` take the student's own through ``wrap``
and ``sync_grads``.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from torch import nn


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
