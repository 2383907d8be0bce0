"""Fully sharded data parallelism written out by hand: ``ShardedModule``, FSDP in miniature.

Each rank keeps a padded 1/N slice of every flattened parameter; ``GatherParameter`` all-gathers the full weight for
the forward and reduce-scatters (and averages) its gradient in backward, so each rank ends up with the *average*
gradient of its own slice only, and an optimizer over the slices holds 1/N of the state. It keeps each gathered
weight until backward has used it, as ``reshard_after_forward=False`` does; torch's ``fully_shard`` (``fsdp_torch``)
frees it after forward and gathers it again for backward, prefetches the next unit's weights, and switches the
gradient reduction off for accumulation (``set_requires_gradient_sync(False)``). Both are notebook 08's exercise: the
student edition holds stubs in their place (``fsdp_torch.train`` and ``fsdp_torch.sweep`` run on ``fully_shard``).
What FSDP keeps per rank is ZeRO stage 3's.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from course_lib.distributed import gather_slices, rank_slice


# graded: 08_fsdp ShardedModule
class GatherParameter(torch.autograd.Function):
    """Forward: all-gather the ranks' slices into the full parameter. Backward: reduce-scatter its
    gradient, so each rank gets the average over the ranks of its own slice."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        ctx.n, ctx.world = shard.numel(), dist.get_world_size()
        return gather_slices(shard, math.prod(shape)).view(shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        flat = nn.functional.pad(grad.reshape(-1), (0, ctx.n * ctx.world - grad.numel()))
        mine = grad.new_empty(ctx.n)
        # the sum over ranks of this rank's slice, in the one-tensor form: torch 2.7's gloo (CPU ranks) lacks the
        # list form, dist.reduce_scatter(mine, list(flat.split(ctx.n))), that later torch has. torch 2.13 names it
        # reduce_scatter_single and deprecates reduce_scatter_tensor (a warning on every call)
        (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(mine, flat)
        return mine / ctx.world, None


# graded: 08_fsdp ShardedModule
class ShardedModule(nn.Module):
    """FSDP in miniature: ``module``'s parameters sharded 1/N per rank, gathered for each forward.

    Every parameter is flattened, padded with zeros to a multiple of the world size and cut in N;
    rank r keeps slice r as a parameter of its own (``self.shards``), and ``module`` moves to the
    meta device (its shapes stay, its memory goes). ``forward`` gathers every weight through
    ``GatherParameter`` and runs ``module`` on them with ``torch.func.functional_call``; backward
    leaves each shard the rank-averaged gradient of its slice, so an optimizer over ``self.shards``
    steps 1/N of the model, like ZeRO-3 (``parameters()`` also lists the meta module's, which hold
    no memory and get no gradient).
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        named = list(module.named_parameters())
        self.names, self.shapes = [name for name, _ in named], [p.shape for _, p in named]
        self.shards = nn.ParameterList([nn.Parameter(rank_slice(p.detach()).clone(), requires_grad=p.requires_grad)
                                        for _, p in named])
        self.module = module.to("meta")

    def forward(self, *args, **kwargs):
        full = {name: GatherParameter.apply(shard, shape)
                for name, shape, shard in zip(self.names, self.shapes, self.shards)}
        return functional_call(self.module, full, args, kwargs)
