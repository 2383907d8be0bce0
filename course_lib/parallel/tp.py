"""Tensor parallelism by hand (Megatron-LM), in the spirit of picotron: one layer's weights split across N ranks.

A linear layer ``y = x W^T`` splits two ways. **Column-parallel**: rank r keeps out/N rows of W and
computes its out/N slice of y from the whole x. **Row-parallel**: rank r keeps in/N columns of W,
takes its in/N slice of x and computes a partial y; the sum over ranks is y. A column-parallel
layer feeding a row-parallel one needs no communication in between (the slice one makes is the
slice the other takes): a gated MLP or an attention block costs one all-reduce forward and one
backward, Megatron's conjugate pair:

- ``copy_to_tp`` ("f"): identity forward, all-reduce of the gradient backward (each rank's slice of
  the layer contributed a part of d loss / d x);
- ``reduce_from_tp`` ("g"): all-reduce forward (the partial sums), identity backward;
- ``gather_from_tp``: all-gather along the last dim forward, this rank's slice of the gradient backward.

``naive_gather`` is seed 002's trap: ``dist.all_gather`` into a list has no backward, so nothing before
it gets a gradient. ``parallelize_mlp`` / ``parallelize_attention`` split a transformers Llama block
by hand (attention by heads); ``parallelize_llama_by_hand`` splits every block of the model. torch's
DTensor plan for the same Llama (``apply_tp``), DP×TP on a 2-D mesh and the worker that trains and counts each
split live in ``course_lib.parallel.tp_torch``, the bytes the split moves in ``course_lib.parallel.tp_cost``; this
module is the mechanism alone, what notebook 14 asks to write.

The pair and its autograd functions are notebook 14's exercise: the student edition holds stubs in their
place, and the by-hand split takes the student's layers (``layers=(ColumnParallelLinear, RowParallelLinear)``
of the notebook, run on ranks forked from it: ``launch.run_forked``).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


# graded: 14_tensor_parallelism tensor_parallel_pair
class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if _world(ctx.group) == 1:
            return grad, None
        # autograd may hand the same tensor to another branch: never reduce it in place
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


# graded: 14_tensor_parallelism tensor_parallel_pair
class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        if _world(group) == 1:
            return x.view_as(x)
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# graded: 14_tensor_parallelism tensor_parallel_pair
class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group, world = group, _world(group)
        if world == 1:
            return x.view_as(x)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        world = _world(ctx.group)
        if world == 1:
            return grad, None
        return grad.chunk(world, dim=-1)[dist.get_rank(ctx.group)].contiguous(), None


# graded: 14_tensor_parallelism tensor_parallel_pair
def copy_to_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's f: ``x`` as it is forward; backward, the gradient all-reduced over ``group`` (default WORLD)."""
    return _CopyToTP.apply(x, group)


# graded: 14_tensor_parallelism tensor_parallel_pair
def reduce_from_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's g: the sum of ``x`` over ``group``'s ranks forward; backward, the gradient as it is."""
    return _ReduceFromTP.apply(x, group)


# graded: 14_tensor_parallelism tensor_parallel_pair
def gather_from_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    """The ranks' slices of ``x`` concatenated along the last dim; backward, this rank's slice of the gradient."""
    return _GatherFromTP.apply(x, group)


def naive_gather(x: torch.Tensor, group=None) -> torch.Tensor:
    """Seed 002's gather, WRONG on purpose: ``dist.all_gather`` into a list and ``torch.cat``.

    The collective writes into fresh tensors that autograd knows nothing of: the result does not
    require grad, and every weight before it gets no gradient (``.grad`` stays None).
    """
    parts = [torch.empty_like(x) for _ in range(_world(group))]
    dist.all_gather(parts, x.detach().contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def split_size(n: int, world: int, what: str) -> int:
    """``n // world``, or a ValueError that says what to change when ``world`` does not divide ``n``."""
    if n % world:
        sizes = [w for w in range(1, world + 1) if n % w == 0]
        raise ValueError(f"{what}={n} does not divide by the tensor-parallel size {world}: make {what} a multiple "
                         f"of {world} (e.g. {(n // world + 1) * world}) or use a TP size that divides it ({sizes})")
    return n // world


# graded: 14_tensor_parallelism tensor_parallel_pair
class ColumnParallelLinear(nn.Module):
    """``nn.Linear`` split by output rows: this rank holds ``out_features / world`` rows (and their bias).

    The input goes through ``copy_to_tp`` (``copy_input=False`` where a block already did it once for
    several layers); the output is this rank's slice, or, with ``gather_output``, the whole output
    through ``gather`` (``gather_from_tp``; pass ``naive_gather`` to see the trap).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, rank: int = 0, world: int = 1,
                 group=None, gather_output: bool = False, copy_input: bool = True, gather=gather_from_tp):
        super().__init__()
        self.rank, self.world, self.group = rank, world, group
        self.gather_output, self.copy_input, self.gather = gather_output, copy_input, gather
        self.in_features, self.out_features = in_features, out_features
        local = split_size(out_features, world, "out_features")
        self.weight = nn.Parameter(torch.empty(local, in_features))
        self.bias = nn.Parameter(torch.zeros(local)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = copy_to_tp(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        return self.gather(y, self.group) if self.gather_output else y

    @classmethod
    def from_linear(cls, linear: nn.Linear, rank: int, world: int, group=None, **kwargs) -> ColumnParallelLinear:
        """This rank's shard of an existing ``nn.Linear``: its rows ``rank·out/N .. (rank+1)·out/N``."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, rank=rank, world=world,
                    group=group, **kwargs).to(linear.weight.device, linear.weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(linear.weight.chunk(world, dim=0)[rank])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias.chunk(world, dim=0)[rank])
        return layer


# graded: 14_tensor_parallelism tensor_parallel_pair
class RowParallelLinear(nn.Module):
    """``nn.Linear`` split by input columns: this rank holds ``in_features / world`` columns of the weight.

    The input is already split (the output of a ``ColumnParallelLinear``); the partial outputs are
    summed by ``reduce_from_tp``, and the bias, kept whole on every rank, is added once, after the sum
    (added before it, the sum would count it ``world`` times).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, rank: int = 0, world: int = 1,
                 group=None):
        super().__init__()
        self.rank, self.world, self.group = rank, world, group
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, split_size(in_features, world, "in_features")))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y

    @classmethod
    def from_linear(cls, linear: nn.Linear, rank: int, world: int, group=None) -> RowParallelLinear:
        """This rank's shard of an existing ``nn.Linear``: its columns ``rank·in/N .. (rank+1)·in/N``, all the bias."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, rank=rank, world=world,
                    group=group).to(linear.weight.device, linear.weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(linear.weight.chunk(world, dim=1)[rank])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer


Layers = tuple[Callable[[nn.Linear], nn.Module], Callable[[nn.Linear], nn.Module]]  # (column, row): one nn.Linear each


# graded: 14_tensor_parallelism tensor_parallel_pair
def _course_pair(rank: int, world: int, group=None) -> Layers:
    """course_lib's pair as (column, row) makers of one ``nn.Linear``; the column layers leave the copy of their
    input to the block (``_copy_input_hook``), so a block's q, k, v (or gate, up) share one all-reduce backward."""
    return (lambda linear: ColumnParallelLinear.from_linear(linear, rank, world, group, copy_input=False),
            lambda linear: RowParallelLinear.from_linear(linear, rank, world, group))


def _pair_for(layers: Layers | None, rank: int, world: int, group) -> tuple[Layers, bool]:
    """The (column, row) makers to split a block with, and whether the block copies its input once itself.

    ``layers`` given: a pair that splits over the default group, each column layer copying its own input
    (notebook 14's ``ColumnParallelLinear`` and ``RowParallelLinear``). None: course_lib's, over ``group``.
    """
    if layers is None:
        return _course_pair(rank, world, group), True
    if group not in (None, dist.group.WORLD):
        raise ValueError("layers=(column, row) split over the default process group: pass group=None with them")
    return layers, False


def _copy_input_hook(group):
    """A forward pre-hook that sends a block's input (positional or ``hidden_states=``) through ``copy_to_tp`` once."""
    def hook(module, args, kwargs):
        if args:
            return (copy_to_tp(args[0], group), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": copy_to_tp(kwargs["hidden_states"], group)}
    return hook


def parallelize_mlp(mlp: nn.Module, rank: int, world: int, group=None, layers: Layers | None = None) -> nn.Module:
    """Split a Llama MLP in place: gate and up column-parallel, down row-parallel. Returns ``mlp``.

    With course_lib's pair its input passes ``copy_to_tp`` once for both column layers: one all-reduce forward
    (down's ``reduce_from_tp``) and one backward, of batch × tokens × hidden values each. ``layers=(column, row)``
    splits with another pair (``_pair_for``), whose column layers each all-reduce their input's gradient.
    """
    split_size(mlp.gate_proj.out_features, world, "intermediate_size")
    (column, row), copy_once = _pair_for(layers, rank, world, group)
    mlp.gate_proj, mlp.up_proj, mlp.down_proj = column(mlp.gate_proj), column(mlp.up_proj), row(mlp.down_proj)
    mlp.intermediate_size = mlp.gate_proj.weight.shape[0]
    if copy_once:
        mlp.register_forward_pre_hook(_copy_input_hook(group), with_kwargs=True)
    return mlp


def check_heads(num_heads: int, num_kv_heads: int, world: int) -> None:
    """Stop with what to change when the query or K/V heads do not split evenly over ``world`` ranks."""
    if num_heads % world:
        raise ValueError(f"num_attention_heads={num_heads} does not divide by the tensor-parallel size {world}: "
                         f"use a TP size that divides it, or a config with a multiple of {world} heads")
    if num_kv_heads % world:
        raise ValueError(f"num_key_value_heads={num_kv_heads} does not divide by the tensor-parallel size {world}: "
                         f"each rank needs whole K/V heads; build the model with num_key_value_heads={world} "
                         f"(e.g. build_llama('tiny', num_key_value_heads={world})) or use TP <= {num_kv_heads}")


def parallelize_attention(attn: nn.Module, rank: int, world: int, group=None,
                          layers: Layers | None = None) -> nn.Module:
    """Split a Llama attention in place by heads: q, k, v column-parallel, o row-parallel. Returns ``attn``.

    Rank r keeps query heads ``r·H/N ..`` and K/V heads ``r·KV/N ..``: each query head's K/V head
    stays on its rank (GQA groups are contiguous). transformers reshapes to ``(*shape, -1, head_dim)``,
    so the local head count follows from the weight's rows; the group size H/KV is unchanged.
    ``layers=(column, row)``: split with another pair, as in ``parallelize_mlp``.
    """
    heads, kv = attn.q_proj.out_features // attn.head_dim, attn.k_proj.out_features // attn.head_dim
    check_heads(heads, kv, world)
    (column, row), copy_once = _pair_for(layers, rank, world, group)
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attn, name, column(getattr(attn, name)))
    attn.o_proj = row(attn.o_proj)
    attn.num_heads, attn.num_key_value_heads = heads // world, kv // world  # for whoever reads them; forward does not
    attn.num_key_value_groups = heads // kv
    if copy_once:
        attn.register_forward_pre_hook(_copy_input_hook(group), with_kwargs=True)
    return attn


def parallelize_llama_by_hand(model: nn.Module, rank: int, world: int, group=None,
                              layers: Layers | None = None) -> nn.Module:
    """Every decoder layer's attention and MLP split by hand; embedding, norms and LM head replicated.

    The replicated weights need no gradient sync: the column layers' copy of their input (Megatron's f)
    already gives every rank the whole gradient of the activations that reach them. ``layers=(column, row)``
    splits with that pair (notebook 14's own layers) instead of course_lib's.
    """
    for layer in model.model.layers:
        parallelize_attention(layer.self_attn, rank, world, group, layers)
        parallelize_mlp(layer.mlp, rank, world, group, layers)
    return model
