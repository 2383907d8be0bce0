"""Notebook 06's visible tests (DDP): each rank's batches on 2 forked ranks (disjoint shards, set_epoch), and
``average_gradients`` on 2 ranks against DDP and one process.

The probes fork real CPU ranks (gloo) that run the student's code and send back plain data; the references that
need ranks (DDP's gradients) are forked by the judges, from torch's and course_lib's own code.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import course_lib.distributed as toolkit
from course_grader.checks import packed, register, student, unpacked
from course_grader.checks.nb05 import as_data
from course_grader.grading import forbid, grads, max_rel_diff
from course_lib.data import synthetic_images
from course_lib.launch import run_forked
from course_lib.models import SmallCNN
from course_lib.parallel import ddp

# course_lib's and torch's answers, out of reach while the student's code runs
LOADERS = (toolkit.sharded_loader, toolkit.step_batches)
AVERAGE = (ddp.all_reduce_gradients,)


# ---------------------------------------------------------------- rank_batches
def batches_per_rank(ns: dict, nprocs: int, n: int, batch_size: int, epochs: tuple, seed: int = 0) -> list:
    """Per rank, ``{epoch: the student's rank_batches(...)}`` on ``nprocs`` forked ranks, course_lib's loaders
    forbidden."""
    space = student(ns, "rank_batches")

    def rank():
        with forbid(*LOADERS, namespace=space):
            return {e: as_data(space["rank_batches"](n, dist.get_rank(), dist.get_world_size(), e, batch_size, seed))
                    for e in epochs}

    return run_forked(rank, nprocs, timeout=15)


def judge_shards(got: list) -> str:
    assert len(got) == 2, f"{len(got)} ranks' batches, expected 2"
    seen = []
    for r, b in enumerate(got):
        assert isinstance(b[0], list) and len(b[0]) == 5 and all(isinstance(x, (list, tuple)) and len(x) == 4
                                                                  for x in b[0]), \
            f"rank {r}: expected 5 batches of 4, got {b[0]}"
        assert all(isinstance(i, int) for x in b[0] for i in x), "return Python ints"
        seen += [i for x in b[0] for i in x]
    assert len(seen) == len(set(seen)), "two ranks read the same sample in one epoch: the shards must be disjoint"
    assert set(seen) == set(range(40)), "together the ranks must read every sample once"
    return "disjoint shards that cover the data set"


register("test_rank_batches", lambda ns: batches_per_rank(ns, 2, 40, 4, (0,)), judge_shards)


def probe_epochs(ns: dict) -> dict:
    return {"a": batches_per_rank(ns, 2, 40, 4, (0, 1)), "b": batches_per_rank(ns, 2, 40, 4, (0,))}


def judge_epochs(got: dict) -> str:
    a, b = got["a"], got["b"]
    assert len(a) == len(b) == 2, f"{len(a)} and {len(b)} ranks' batches, expected 2"
    for r in range(2):
        for epoch in (0, 1):  # a rank's shard of 40 samples is 5 batches of 4 (which ones: test_rank_batches)
            batches = a[r][epoch]
            assert isinstance(batches, list) and len(batches) >= 5 and all(
                isinstance(x, (list, tuple)) and len(x) == 4 for x in batches), \
                f"rank {r}, epoch {epoch}: expected batches of 4, at least 5 of them, got {batches}"
        assert len(a[r][1]) == len(a[r][0]), \
            f"rank {r}: {len(a[r][0])} batches in epoch 0, {len(a[r][1])} in epoch 1: every epoch reads the same count"
    for r in range(2):
        assert a[r][0] == b[r][0], f"rank {r}: epoch 0 gave different batches in two calls"
        assert a[r][0] != a[r][1], f"rank {r}: epoch 1 replays epoch 0's order: call set_epoch(epoch)"
    return "a new order every epoch, the same order for the same epoch"


register("test_rank_batches_epochs", probe_epochs, judge_epochs)


# ---------------------------------------------------------------- average_gradients
def cnn(frozen_bias: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    m = SmallCNN(width=8)
    if frozen_bias:
        m.head.bias.requires_grad_(False)
    return m


def average_probe(ns: dict, nprocs: int, n: int, frozen_bias: bool = False) -> list:
    """Per rank, the gradients after the student's ``average_gradients``, each rank on its part of a batch of ``n``."""
    space = student(ns, "average_gradients")

    def rank():
        r, world = dist.get_rank(), dist.get_world_size()
        m = cnn(frozen_bias)
        x, y = synthetic_images(n, seed=3).tensors
        F.cross_entropy(m(x.chunk(world)[r]), y.chunk(world)[r]).backward()
        with forbid(*AVERAGE, namespace=space):  # course_lib's answer, out of reach
            space["average_gradients"](m)
        return packed(grads(m))

    return [unpacked(g) for g in run_forked(rank, nprocs, timeout=15)]


def ddp_rank_grads(n: int, frozen_bias: bool) -> bytes:
    """torch's DDP on this rank's part of the batch: its gradients."""
    r, world = dist.get_rank(), dist.get_world_size()
    d = DDP(cnn(frozen_bias))
    x, y = synthetic_images(n, seed=3).tensors
    F.cross_entropy(d(x.chunk(world)[r]), y.chunk(world)[r]).backward()
    return packed(grads(d.module))


@functools.lru_cache(maxsize=None)
def ddp_grads(nprocs: int, n: int, frozen_bias: bool = False) -> list:
    return [unpacked(g) for g in run_forked(ddp_rank_grads, nprocs, dict(n=n, frozen_bias=frozen_bias), timeout=15)]


def one_process_grads(n: int, frozen_bias: bool = False) -> dict:
    m = cnn(frozen_bias)
    x, y = synthetic_images(n, seed=3).tensors
    F.cross_entropy(m(x), y).backward()
    return grads(m)


def judge_average(got: list, nprocs: int, n: int, frozen_bias: bool, label: str = "") -> None:
    ref, theirs = one_process_grads(n, frozen_bias), ddp_grads(nprocs, n, frozen_bias)
    assert len(got) == nprocs
    for r, (mine, d) in enumerate(zip(got, theirs)):
        assert max_rel_diff(mine, d) < 1e-5, f"{label}rank {r}: your gradients differ from DDP's"
        assert max_rel_diff(mine, ref) < 1e-5, (f"{label}rank {r}: not the whole batch's gradient" if label else
                                                f"rank {r}: not the gradient of one process on the whole batch")


def judge_average_2(got: list) -> str:
    judge_average(got, 2, 16, False)
    return "every rank holds DDP's gradients"


register("test_average_gradients", lambda ns: average_probe(ns, 2, 16), judge_average_2)

