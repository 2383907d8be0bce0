"""Process groups for the notebooks that run on one machine.

``free_port`` finds a port nobody uses (fixed MASTER_PORTs collide when tests run side by
side). ``single_process_group`` starts a world of one over gloo inside the notebook's own
kernel, enough to wrap a model in DDP and watch what it does; the multi-process launcher
comes with notebook 04.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist


def free_port() -> int:
    """A TCP port on localhost that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(fallback_rank: int = 0) -> torch.device:
    """This rank's GPU, ``cuda:LOCAL_RANK`` (torchrun sets it), where there are GPUs; else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", fallback_rank)))
    return torch.device("cpu")


def mean_over_ranks(value: float, device: torch.device | str | None = None) -> float:
    """The mean of ``value`` over all ranks (this value alone where there is no process group).

    With equal shards, the mean of the ranks' losses is the loss of the global batch. ``device``
    is where the number is reduced: NCCL reduces GPU tensors only.
    """
    t = torch.tensor(value, device=device)
    if not dist.is_initialized():
        return t.item()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def single_process_group(backend: str = "gloo") -> None:
    """Initialise a world of size 1 (once per process; later calls do nothing)."""
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group(backend, rank=0, world_size=1)


def _counting_allreduce_hook(counter: "AllReduceCounter", bucket):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    counter.calls += 1
    return allreduce_hook(dist.group.WORLD, bucket)


class AllReduceCounter:
    """Counts DDP's gradient all-reduces (one per bucket) and then does them as usual.

    ``counter = AllReduceCounter().attach(ddp_model)``; ``counter.calls`` is the number of
    gradient buckets all-reduced so far.
    """

    def __init__(self):
        self.calls = 0

    def attach(self, ddp_model) -> "AllReduceCounter":
        ddp_model.register_comm_hook(self, _counting_allreduce_hook)
        return self
