"""Known submissions of 14_tensor_parallelism and the scores nbgrader's autograde must give them.

Each case replaces the named solution cells of the solution notebook; every other solution cell
keeps the reference solution. ``scores`` gives the expected points of every graded cell. The
mistakes are edits of today's solution cells (tests/solved.py), never copies of them.
"""

from solved import edit, solution

# The reference pair of the solution notebook; each mistake below changes it in one or two places.
PAIR_SOLUTION = solution("14_tensor_parallelism", "tensor_parallel_pair")

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

FULL = {"test_tensor_parallel_pair": 3, "test_tensor_parallel_pair_collectives": 2, "test_tensor_parallel_pair_hidden": 4}
PAIR = ("test_tensor_parallel_pair", "test_tensor_parallel_pair_collectives", "test_tensor_parallel_pair_hidden")


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
}
