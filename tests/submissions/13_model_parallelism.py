"""Known submissions of 13_model_parallelism and the scores nbgrader's autograde must give them.

Each case replaces the named solution cells of the solution notebook; every other solution cell
keeps the reference solution. ``scores`` gives the expected points of every graded cell. The
mistakes are edits of today's solution cells (tests/solved.py), never copies of them.
"""

from solved import edit, solution

# The reference pair of the solution notebook; each mistake below changes it in one or two places.
PAIR_SOLUTION = solution("13_model_parallelism", "tensor_parallel_pair")

BIAS_EVERY_RANK = edit(PAIR_SOLUTION, ('''        out = ReduceFromTP.apply(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias  # once, after the sum: not once per rank''',
                                       '''        return ReduceFromTP.apply(F.linear(x, self.weight, self.bias))  # wrong: every rank adds the bias'''))

NO_F_BACKWARD = edit(PAIR_SOLUTION, ('''        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        return grad''', '''        return grad  # wrong: each rank keeps only its part of the input's gradient'''))

F_BACKWARD_IN_PLACE = edit(PAIR_SOLUTION, ('''        grad = grad.contiguous().clone()
        dist.all_reduce(grad)''', '''        grad = grad.contiguous()
        dist.all_reduce(grad)  # wrong: the gradient itself, which autograd may hand to another branch too'''))

ALL_REDUCE_BOTH = edit(PAIR_SOLUTION, ('''    def forward(ctx, x):
        return x.view_as(x)''', '''    def forward(ctx, x):
        out = x.contiguous().clone()
        dist.all_reduce(out)  # wrong: f all-reduces in forward too
        return out'''))

NO_SIZE_CHECK = edit(PAIR_SOLUTION, ('''        if linear.out_features % world:
            raise ValueError(f"out_features={linear.out_features} does not divide by the {world} ranks")
''', ''), ('''        if linear.in_features % world:
            raise ValueError(f"in_features={linear.in_features} does not divide by the {world} ranks")
''', ''))

# seed 002's layer: the column layer gathers its output with a plain all_gather, the row layer slices it again
GATHER_NO_BACKWARD = edit(PAIR_SOLUTION, ('''        return F.linear(CopyToTP.apply(x), self.weight, self.bias)''',
                                          '''        local = F.linear(CopyToTP.apply(x), self.weight, self.bias)
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local.contiguous())  # wrong: no backward, as in seed 002
        return torch.cat(parts, -1)'''), ('''        out = ReduceFromTP.apply(F.linear(x, self.weight))''',
                                          '''        n = x.shape[-1] // dist.get_world_size()
        x = x[..., dist.get_rank() * n:(dist.get_rank() + 1) * n]
        out = ReduceFromTP.apply(F.linear(x, self.weight))'''))

# right numbers, a needless collective: a gather with a backward, and the row layer slices again
GATHER_TP = '''
class GatherTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local):
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local.contiguous())
        return torch.cat(parts, -1)

    @staticmethod
    def backward(ctx, grad):
        n = grad.shape[-1] // dist.get_world_size()
        return grad[..., dist.get_rank() * n:(dist.get_rank() + 1) * n].contiguous()


'''
GATHER_THEN_SLICE = GATHER_TP + edit(
    PAIR_SOLUTION,
    ('''        return F.linear(CopyToTP.apply(x), self.weight, self.bias)''',
     '''        return GatherTP.apply(F.linear(CopyToTP.apply(x), self.weight, self.bias))  # right numbers, a needless gather'''),
    ('''        out = ReduceFromTP.apply(F.linear(x, self.weight))''',
     '''        n = x.shape[-1] // dist.get_world_size()
        out = ReduceFromTP.apply(F.linear(x[..., dist.get_rank() * n:(dist.get_rank() + 1) * n], self.weight))'''))

# no tensor parallelism at all: every rank computes the whole pair from its own copy of the weights (the gradient
# reaching only its own part), and all-reduces zeros where the pair's two all-reduces go. Its numbers are right and
# its collectives are the contract's in number and size (the collectives test, which grades the pattern, passes);
# the grader's rank 0, whose part of the weights differs from the copy's, sees its sums come back without the
# others' parts.
PAIR_LOCAL_COPY = '''
class CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        dist.all_reduce(torch.zeros_like(grad))   # counted, sums nothing
        return grad


class ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, whole):
        dist.all_reduce(torch.zeros_like(whole))   # counted, sums nothing
        return whole.view_as(whole)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _whole(part, copy, index, dim):
    pieces = list(copy.detach().split(part.shape[dim], dim))   # the other ranks' parts, from this rank's copy
    pieces[index] = part
    return torch.cat(pieces, dim)


class ColumnParallelLinear(nn.Module):
    def __init__(self, linear):
        super().__init__()
        self.rank, n = dist.get_rank(), linear.out_features // dist.get_world_size()
        self.copy = linear
        self.weight = nn.Parameter(linear.weight.detach()[self.rank * n:(self.rank + 1) * n].clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach()[self.rank * n:(self.rank + 1) * n].clone())

    def forward(self, x):
        bias = None if self.bias is None else _whole(self.bias, self.copy.bias, self.rank, 0)
        return F.linear(CopyToTP.apply(x), _whole(self.weight, self.copy.weight, self.rank, 0), bias)


class RowParallelLinear(nn.Module):
    def __init__(self, linear):
        super().__init__()
        self.rank, n = dist.get_rank(), linear.in_features // dist.get_world_size()
        self.copy = linear
        self.weight = nn.Parameter(linear.weight.detach()[:, self.rank * n:(self.rank + 1) * n].clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x):
        out = ReduceFromTP.apply(F.linear(x, _whole(self.weight, self.copy.weight, self.rank, 1)))
        return out if self.bias is None else out + self.bias
'''

CALLS_LIBRARY_PAIR = '''''
from course_lib.parallel import tp as _tp

CopyToTP, ReduceFromTP = None, None


class ColumnParallelLinear(nn.Module):
    def __init__(self, linear):
        super().__init__()
        self.inner = _tp.ColumnParallelLinear.from_linear(linear, dist.get_rank(), dist.get_world_size())
        self.weight, self.bias = self.inner.weight, self.inner.bias

    def forward(self, x):
        return self.inner(x)


class RowParallelLinear(nn.Module):
    def __init__(self, linear):
        super().__init__()
        self.inner = _tp.RowParallelLinear.from_linear(linear, dist.get_rank(), dist.get_world_size())
        self.weight, self.bias = self.inner.weight, self.inner.bias

    def forward(self, x):
        return self.inner(x)
'''

GPIPE_ORDER = '''
def one_f_one_b_order(p, m):
    # wrong: GPipe's order, every forward then every backward: m micro-batches in flight
    return [[("F", i) for i in range(m)] + [("B", i) for i in range(m)] for _ in range(p)]
'''

# The reference 1F1B order of the solution notebook; each mistake below changes its warm-up.
ORDER_SOLUTION = solution("13_model_parallelism", "one_f_one_b_order")
WARMUP = "        warmup = min(m, p - r)  # the forwards a rank runs before the first backward reaches it"

BACKWARD_TOO_SOON = edit(ORDER_SOLUTION, (WARMUP, "        warmup = min(m, p - r - 1)  # wrong: one forward too few, so the last rank "
                                     "starts with a backward"))

SAME_WARMUP_EVERY_RANK = edit(ORDER_SOLUTION, (WARMUP, "        warmup = min(m, p)  # wrong: rank 0's warm-up on every rank keeps later "
                                          "ranks too full"))

WARMUP_PAST_M = edit(ORDER_SOLUTION, (WARMUP, "        warmup = p - r  # wrong when m < p - r: forwards of micro-batches that do not exist"),
                                     ('''        order += [("B", i) for i in range(m - warmup, m)]  # drain''',
                                      '''        order += [("B", i) for i in range(max(m - warmup, 0), m)]'''))

CALLS_LIBRARY_ORDER = '''
def one_f_one_b_order(p, m):
    from course_lib.parallel.schedules import one_f_one_b_order as order
    return order(p, m)
'''

# The reference 1F1B executor of the solution notebook; each mistake below changes it in one or two places.
EXECUTOR_SOLUTION = solution("13_model_parallelism", "run_1f1b")

# dist.send waits for the peer's receive: rank 0 sends micro-batch 1's activation while rank 1 sends micro-batch 0's
# gradient, and neither receives: every run stops at the checks' 10 s timeout
BLOCKING_SENDS = edit(EXECUTOR_SOLUTION, ("""            else:  # not waited here: rank + 1 may be sending us a gradient right now, waiting for our receive
                send = dist.isend(out.detach(), rank + 1)""", """            else:
                dist.send(out.detach(), rank + 1)  # wrong: blocks until rank + 1 receives"""),
                                         ("""                send.wait()  # done already: rank + 1 ran B i, so it had received F i's output
""", ""), ("""                sends.append(dist.isend(x.grad, rank - 1))""",
                                          """                dist.send(x.grad, rank - 1)  # wrong: blocks until rank - 1 receives"""))

# right gradients, right count, but every micro-batch's input and output stay referenced until the step ends
KEEPS_EVERY_MICRO_BATCH = edit(EXECUTOR_SOLUTION, ("""            x, out, send = held.pop(i)  # the last references to micro-batch i: backward frees its graph""",
                                                   """            x, out, send = held[i]  # wrong: kept till the step ends, all m micro-batches' tensors"""),
                                                  ("""            del x, out  # micro-batch i's tensors go now, not when the next forward rebinds the names
""", ""))

NO_MEAN = edit(EXECUTOR_SOLUTION, ("""                (out / m).backward()  # the mean over micro-batches: every gradient upstream carries the 1/m""",
                                   """                out.backward()  # wrong: the sum of the m losses' gradients, m times the mean's"""))

# every forward, then every backward, whatever the order says: GPipe, m micro-batches held (and counted); the
# grader's rank 0 follows the order, and waits for micro-batch 0's gradient while rank 1 waits for micro-batch 3
IGNORES_THE_ORDER = edit(EXECUTOR_SOLUTION, ("""    for kind, i in order:""",
                                             """    for kind, i in sorted(order, key=lambda a: a[0] == "B"):  # wrong: all forwards first"""))

# nothing on the wire: every rank rebuilds the visible tests' stages (seed 0, one Linear per stage, drawn as the
# checks draw them), runs the whole pipeline in one process and keeps its own stage's gradients, and counts its
# order's peak. The ranks' data was one process's, so the visible tests that read it passed; the grader's rank 0,
# whose stage is drawn at grading, waits for a receive that never comes. (The hidden seeds were never known.)
EXECUTOR_LOCAL_COPY = '''
import torch
from torch import nn


def run_1f1b(stage, rank, p, micro_batches, order, loss_fn, shape):
    torch.manual_seed(0)
    linears = [nn.Linear(shape[1], shape[1]) for _ in range(p)]
    losses, m = [], len(micro_batches)
    for x, y in micro_batches:
        h = x
        for linear in linears:
            h = torch.tanh(linear(h))
        loss = loss_fn(h, y)
        (loss / m).backward()
        losses.append(loss.item())
    stage.linear.weight.grad, stage.linear.bias.grad = linears[rank].weight.grad, linears[rank].bias.grad
    alive = peak = 0
    for kind, _ in order:
        alive += 1 if kind == "F" else -1
        peak = max(peak, alive)
    return (losses if rank == p - 1 else []), peak
'''

CALLS_LIBRARY_EXECUTOR = '''
def run_1f1b(stage, rank, p, micro_batches, order, loss_fn, shape):
    from course_lib.parallel.schedules import run_1f1b as run
    return run(stage, rank, p, micro_batches, order, loss_fn, shape)
'''

FULL = {"test_tensor_parallel_pair": 3, "test_tensor_parallel_pair_collectives": 2,
        "test_tensor_parallel_pair_hidden": 4,
        "test_one_f_one_b_order": 3, "test_one_f_one_b_order_measured": 3, "test_one_f_one_b_order_hidden": 4,
        "test_run_1f1b": 3, "test_run_1f1b_activations": 3, "test_run_1f1b_hidden": 4}
PAIR = ("test_tensor_parallel_pair", "test_tensor_parallel_pair_collectives", "test_tensor_parallel_pair_hidden")
ORDER = ("test_one_f_one_b_order", "test_one_f_one_b_order_measured", "test_one_f_one_b_order_hidden")
EXECUTOR = ("test_run_1f1b", "test_run_1f1b_activations", "test_run_1f1b_hidden")


def scores(*lost) -> dict:
    """Full marks except the named test cells, which score 0."""
    return {**FULL, **{k: 0 for k in lost}}


CASES = {
    "bias_every_rank": {"cells": {"tensor_parallel_pair": BIAS_EVERY_RANK},  # the collectives are right
                        "scores": scores("test_tensor_parallel_pair", "test_tensor_parallel_pair_hidden")},
    "no_f_backward": {"cells": {"tensor_parallel_pair": NO_F_BACKWARD}, "scores": scores(*PAIR)},
    "f_backward_in_place": {"cells": {"tensor_parallel_pair": F_BACKWARD_IN_PLACE},  # no branch in the pair
                            "scores": scores("test_tensor_parallel_pair_hidden")},
    "all_reduce_both": {"cells": {"tensor_parallel_pair": ALL_REDUCE_BOTH}, "scores": scores(*PAIR)},
    "no_size_check": {"cells": {"tensor_parallel_pair": NO_SIZE_CHECK},
                      "scores": scores("test_tensor_parallel_pair_hidden")},
    "gather_without_backward": {"cells": {"tensor_parallel_pair": GATHER_NO_BACKWARD}, "scores": scores(*PAIR)},
    "gather_then_slice": {  # right numbers, one collective too many: the grader's rank 0 meets a gather
        "cells": {"tensor_parallel_pair": GATHER_THEN_SLICE}, "scores": scores(*PAIR)},
    "pair_local_copy": {"cells": {"tensor_parallel_pair": PAIR_LOCAL_COPY},
                        "scores": scores("test_tensor_parallel_pair", "test_tensor_parallel_pair_hidden")},
    "calls_library_tensor_parallel_pair": {"cells": {"tensor_parallel_pair": CALLS_LIBRARY_PAIR},
                                           "scores": scores(*PAIR)},
    "gpipe_order": {"cells": {"one_f_one_b_order": GPIPE_ORDER}, "scores": scores(*ORDER)},
    "backward_too_soon": {"cells": {"one_f_one_b_order": BACKWARD_TOO_SOON}, "scores": scores(*ORDER)},
    "same_warmup_every_rank": {"cells": {"one_f_one_b_order": SAME_WARMUP_EVERY_RANK}, "scores": scores(*ORDER)},
    "warmup_past_m": {"cells": {"one_f_one_b_order": WARMUP_PAST_M}, "scores": scores("test_one_f_one_b_order_hidden")},
    "calls_library_one_f_one_b_order": {"cells": {"one_f_one_b_order": CALLS_LIBRARY_ORDER}, "scores": scores(*ORDER)},
    "blocking_sends": {"cells": {"run_1f1b": BLOCKING_SENDS}, "scores": scores(*EXECUTOR)},  # a deadlock: timeouts
    "keeps_every_micro_batch": {"cells": {"run_1f1b": KEEPS_EVERY_MICRO_BATCH},
                                "scores": scores("test_run_1f1b_activations", "test_run_1f1b_hidden")},
    "no_mean_over_micro_batches": {"cells": {"run_1f1b": NO_MEAN},
                                   "scores": scores("test_run_1f1b", "test_run_1f1b_hidden")},
    "ignores_the_order": {"cells": {"run_1f1b": IGNORES_THE_ORDER}, "scores": scores(*EXECUTOR)},
    "executor_local_copy": {"cells": {"run_1f1b": EXECUTOR_LOCAL_COPY}, "scores": scores(*EXECUTOR)},
    "calls_library_run_1f1b": {"cells": {"run_1f1b": CALLS_LIBRARY_EXECUTOR}, "scores": scores(*EXECUTOR)},
}
