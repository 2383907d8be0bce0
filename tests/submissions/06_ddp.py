"""Known submissions of 06_ddp and the scores nbgrader's autograde must give them.

Each case replaces the named solution cells of the solution notebook; every other solution cell
keeps the reference solution. ``scores`` gives the expected points of every graded cell. The
mistakes are edits of today's solution cells (tests/solved.py), never copies of them.
"""

from solved import edit, solution

RANK_BATCHES = solution("06_ddp", "rank_batches")
AVERAGE = solution("06_ddp", "average_gradients")

NO_SET_EPOCH = edit(RANK_BATCHES, (  # every epoch replays epoch 0's order
    "    sampler.set_epoch(epoch)\n", "    # forgot: sampler.set_epoch(epoch)\n"))

NO_SAMPLER = '''
def rank_batches(n_samples, rank, world_size, epoch, batch_size, seed=0):
    # no DistributedSampler: every rank shuffles and reads the whole data set
    g = torch.Generator().manual_seed(seed + epoch)
    loader = DataLoader(range(n_samples), batch_size=batch_size, shuffle=True, generator=g, drop_last=True)
    return [[int(i) for i in batch] for batch in loader]
'''

# forgot: / world size (an N x learning rate)
SUM_NOT_DIVIDED = edit(AVERAGE, ("\n            p.grad /= world_size", ""))

REDUCE_TO_RANK_0 = edit(AVERAGE, (  # only rank 0 gets the sum: replicas drift apart
    "dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)", "dist.reduce(p.grad, dst=0, op=dist.ReduceOp.SUM)"))

DIVIDED_BY_TWO = edit(AVERAGE, ("p.grad /= world_size", "p.grad /= 2"))  # hard-coded world size: right on 2 ranks only

# the sampler pads (repeats indices to even out the shards); drop_last on the DataLoader drops a short batch only
SAMPLER_PADS = edit(RANK_BATCHES, ("shuffle=True, seed=seed, drop_last=True)", "shuffle=True, seed=seed)"))

CALLS_LIBRARY_RANK_BATCHES = '''
def rank_batches(n_samples, rank, world_size, epoch, batch_size, seed=0):
    from course_lib.distributed import sharded_loader
    loader, sampler = sharded_loader(range(n_samples), batch_size * world_size, seed)   # course_lib's loader
    sampler.set_epoch(epoch)
    return [[int(i) for i in batch] for batch in loader]
'''

CALLS_LIBRARY_AVERAGE = '''
def average_gradients(model):
    from course_lib.parallel.ddp import all_reduce_gradients
    all_reduce_gradients(model)   # course_lib's all-reduce
'''

EX1_FULL = {"test_rank_batches": 2, "test_rank_batches_epochs": 1, "test_rank_batches_hidden": 2}
EX2_FULL = {"test_average_gradients": 2, "test_average_gradients_hidden": 2}
FULL = {**EX1_FULL, **EX2_FULL}


def scores(**changed):
    """Every test cell's points: full marks, but for ``changed``."""
    return {**FULL, **changed}


CASES = {
    "no_set_epoch": {  # shards fine, but the same order every epoch
        "cells": {"rank_batches": NO_SET_EPOCH},
        "scores": scores(test_rank_batches_epochs=0, test_rank_batches_hidden=0)},
    "no_sampler": {  # reshuffles per epoch, but the ranks read the same samples
        "cells": {"rank_batches": NO_SAMPLER}, "scores": scores(test_rank_batches=0, test_rank_batches_hidden=0)},
    "sum_not_divided": {
        "cells": {"average_gradients": SUM_NOT_DIVIDED},
        "scores": scores(test_average_gradients=0, test_average_gradients_hidden=0)},
    "reduce_to_rank_0": {
        "cells": {"average_gradients": REDUCE_TO_RANK_0},
        "scores": scores(test_average_gradients=0, test_average_gradients_hidden=0)},
    "divided_by_two": {  # passes on 2 ranks, fails on 3
        "cells": {"average_gradients": DIVIDED_BY_TWO}, "scores": scores(test_average_gradients_hidden=0)},
    "calls_library_rank_batches": {
        "cells": {"rank_batches": CALLS_LIBRARY_RANK_BATCHES}, "scores": scores(**{k: 0 for k in EX1_FULL})},
    "calls_library_average_gradients": {
        "cells": {"average_gradients": CALLS_LIBRARY_AVERAGE}, "scores": scores(**{k: 0 for k in EX2_FULL})},
    "sampler_pads": {  # drop_last on the DataLoader only: the sampler repeats indices to even out the shards
        "cells": {"rank_batches": SAMPLER_PADS}, "scores": scores(test_rank_batches_hidden=0)},
}
