"""Tensor parallelism (Megatron-LM), in the spirit of picotron: one layer's weights split across N ranks.

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
by hand (attention by heads); ``parallelize_llama`` does the same with torch's DTensor plan
(``parallelize_module``), sequence parallelism on the norms included; ``train`` runs either, or
DP×TP on a 2-D mesh with FSDP2, and counts the bytes of every collective (``CollectiveBytes``).

The pair and its autograd functions are notebook 13's exercise: the student edition holds stubs in their
place, and the by-hand split takes the student's layers (``layers=(ColumnParallelLinear, RowParallelLinear)``
of the notebook, run on ranks forked from it: ``launch.run_forked``).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)
from torch.distributed.tensor.parallel import loss_parallel as parallel_loss
from torch.nn.parallel import DistributedDataParallel

from course_lib.data import lm_batch
from course_lib.distributed import CollectiveBytes, rank_device
from course_lib.launch import launch
from course_lib.loss import forward_loss
from course_lib.memory import PeakMemory, tensor_bytes
from course_lib.models import build_llama
from course_lib.train import Dims, fit, rank_and_world, tokens_per_second, worker_result

MODES = ("single", "hand", "torch", "ddp", "dp", "dp_tp")


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


# graded: 13_model_parallelism tensor_parallel_pair
class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if _world(ctx.group) == 1:
            return grad, None
        grad = grad.contiguous().clone()  # autograd may hand the same tensor to another branch: never reduce it in place
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


# graded: 13_model_parallelism tensor_parallel_pair
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


# graded: 13_model_parallelism tensor_parallel_pair
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


# graded: 13_model_parallelism tensor_parallel_pair
def copy_to_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's f: ``x`` as it is forward; backward, the gradient all-reduced over ``group`` (default WORLD)."""
    return _CopyToTP.apply(x, group)


# graded: 13_model_parallelism tensor_parallel_pair
def reduce_from_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's g: the sum of ``x`` over ``group``'s ranks forward; backward, the gradient as it is."""
    return _ReduceFromTP.apply(x, group)


# graded: 13_model_parallelism tensor_parallel_pair
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


# graded: 13_model_parallelism tensor_parallel_pair
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


# graded: 13_model_parallelism tensor_parallel_pair
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


# graded: 13_model_parallelism tensor_parallel_pair
def _course_pair(rank: int, world: int, group=None) -> Layers:
    """course_lib's pair as (column, row) makers of one ``nn.Linear``; the column layers leave the copy of their
    input to the block (``_copy_input_hook``), so a block's q, k, v (or gate, up) share one all-reduce backward."""
    return (lambda linear: ColumnParallelLinear.from_linear(linear, rank, world, group, copy_input=False),
            lambda linear: RowParallelLinear.from_linear(linear, rank, world, group))


def _pair_for(layers: Layers | None, rank: int, world: int, group) -> tuple[Layers, bool]:
    """The (column, row) makers to split a block with, and whether the block copies its input once itself.

    ``layers`` given: a pair that splits over the default group, each column layer copying its own input
    (notebook 13's ``ColumnParallelLinear`` and ``RowParallelLinear``). None: course_lib's, over ``group``.
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
    splits with that pair (notebook 13's own layers) instead of course_lib's.
    """
    for layer in model.model.layers:
        parallelize_attention(layer.self_attn, rank, world, group, layers)
        parallelize_mlp(layer.mlp, rank, world, group, layers)
    return model


def parallelize_llama(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = True,
                      loss_parallel: bool = False) -> nn.Module:
    """transformers' ``LlamaForCausalLM`` split with torch's DTensor plan over ``tp_mesh`` (1-D), in place.

    q, k, v, gate, up: ``ColwiseParallel``; o, down: ``RowwiseParallel``; the embedding row-wise
    (split by vocabulary); the LM head column-wise, its logits gathered (or, ``loss_parallel``, left
    split by vocabulary for ``torch.distributed.tensor.parallel.loss_parallel``). With
    ``sequence_parallel`` the norms and residuals run on 1/N of the tokens (``Shard(1)``): each block's
    all-reduce becomes an all-gather before it and a reduce-scatter after it, same bytes, 1/N activations.
    Between modules the hidden states stay DTensors (``use_local_output=False``): transformers adds the
    residual to them and reads their (global) sequence length for positions.
    """
    if model.lm_head.weight is model.model.embed_tokens.weight:  # measured: trains, silently wrong, from step 2
        raise ValueError("the LM head shares its weight with the embedding (tie_word_embeddings=True), which this "
                         "plan splits two ways: build the model with tie_word_embeddings=False")
    check_heads(model.config.num_attention_heads, model.config.num_key_value_heads, tp_mesh.size())
    seq, local = (Shard(1), False) if sequence_parallel else (Replicate(), True)  # without SP: plain tensors between
    layer_plan = {
        "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": seq},
                                        desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=seq, use_local_output=local),
        "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=seq, use_local_output=local),
    }
    if sequence_parallel:
        layer_plan.update({"input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel()})
    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, layer_plan)
    top_plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq, use_local_output=local),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                   use_local_output=not loss_parallel),
    }
    if sequence_parallel:
        top_plan["model.norm"] = SequenceParallel()
    return parallelize_module(model, tp_mesh, top_plan)


def _parallelize(model: nn.Module, mode: str, dp: int, device: torch.device, layers: Layers | None = None,
                 **plan) -> tuple[nn.Module, dict, int, int]:
    """Split ``model`` for ``mode``; returns it, its process groups by name, and this rank's (dp index, dp size)."""
    rank, world = rank_and_world()
    if mode == "single":
        return model, {}, 0, 1
    if mode == "hand":
        return parallelize_llama_by_hand(model, rank, world, layers=layers), {"tp": dist.group.WORLD}, 0, 1
    if mode == "torch":
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))
        return parallelize_llama(model, mesh["tp"], **plan), {"tp": mesh.get_group("tp")}, 0, 1
    if mode == "ddp":
        return DistributedDataParallel(model), {"dp": dist.group.WORLD}, rank, world
    if mode not in ("dp", "dp_tp"):
        raise ValueError(f"mode={mode!r}: use one of {MODES}")
    dp = world if mode == "dp" else dp
    if world % dp:
        raise ValueError(f"dp={dp} does not divide the world size {world}: use a divisor of {world}")
    mesh = init_device_mesh(device.type, (dp, world // dp), mesh_dim_names=("dp", "tp"))
    if mode == "dp_tp":  # TP inside the "tp" dim first, then FSDP2 shards the (already split) weights over "dp"
        parallelize_llama(model, mesh["tp"], **plan)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    groups = {"dp": mesh.get_group("dp"), "tp": mesh.get_group("tp")}
    return model, groups, mesh.get_local_rank("dp"), dp


def _quiet() -> None:
    """Keep torch's deprecation and DTensor notes off stderr (nbgrader scores 0 a test cell that writes there)."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\..*")


def reduce_partial_grads(model: nn.Module) -> None:
    """All-reduce, once, every gradient DTensor left as a ``Partial`` sum (the sequence-parallel norms' weights).

    Left alone, each optimizer op that reads such a gradient reduces it again: AdamW does 3
    all-reduces per norm weight per step. Pass it to ``train_step`` as ``sync_grads``.
    """
    for p in model.parameters():
        if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements):
            p.grad = p.grad.redistribute(placements=[Replicate() if pl.is_partial() else pl for pl in p.grad.placements])


def _loss_fn(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    loss = forward_loss(model, tokens)
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss  # loss parallel: a replicated DTensor


def train(mode: str = "torch", steps: int = 5, preset: str = "tiny", batch: int = 4, seq: int = 32, lr: float = 3e-3,
          seed: int = 0, dp: int = 1, sequence_parallel: bool = True, loss_parallel: bool = False,
          device: str | None = None, layers: Layers | None = None, **overrides) -> dict:
    """Train a Llama preset with tensor parallelism over this process group; the worker of ``launch``.

    ``mode``: "single" (the whole model in this process: the reference), "hand" (``parallelize_llama_by_hand``
    over the world), "torch" (``parallelize_llama`` on a 1-D mesh), "ddp" (torch's DDP over the world), "dp"
    (FSDP2 over the world, no TP) or "dp_tp" (a (dp, world/dp) mesh: TP inside "tp", FSDP2 over "dp"). TP
    ranks see the same tokens; DP ranks their slice of the global batch. ``overrides`` go to the model config (``num_key_value_heads=4``).
    ``layers=(column, row)`` gives "hand" another pair (notebook 13's, in ranks forked from it: ``run_forked``).
    Returns the global batch's losses, tokens/s, peak GPU memory, and the last step's collectives.
    """
    if steps < 1:
        raise ValueError(f"steps={steps} must be at least 1")
    _quiet()
    dev = torch.device(device) if device else rank_device()
    model = build_llama(preset, seed=seed, device=dev, **overrides)
    vocab = model.config.vocab_size
    model, groups, dp_rank, dp_size = _parallelize(model, mode, dp, dev, layers, sequence_parallel=sequence_parallel,
                                                   loss_parallel=loss_parallel)
    dims = Dims(batch, dp=dp_size)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    counter = CollectiveBytes(groups)

    @contextlib.contextmanager
    def step_context(step: int):  # count the last step's collectives only: counting is slow
        with (counter if step == steps - 1 else contextlib.nullcontext(),
              parallel_loss() if loss_parallel else contextlib.nullcontext()):
            yield

    with PeakMemory(dev) as peak:  # TP ranks agree on the loss; fit's mean over DP ranks is the global batch's
        history = fit(model, opt, lambda step: dims.local(lm_batch(step, batch, seq, vocab, seed), dp_rank), steps,
                      dims=dims, step_context=step_context, loss_fn=_loss_fn, sync_grads=reduce_partial_grads,
                      progress=False)
    timed = history[1:-1] or history  # not the warm-up step, not the counted one
    return worker_result([r["loss"] for r in history], mode=mode, tokens_per_s=tokens_per_second(timed, batch * seq),
                         peak_memory=peak.peak, weight_bytes=tensor_bytes(model.parameters()),
                         calls_by_kind=counter.calls_by_kind, bytes_by_kind=counter.bytes_by_kind,
                         sent_bytes_by_kind=counter.sent_bytes_by_kind, bytes_by_group=counter.bytes_by_group)


def bytes_per_dimension(preset: str = "tiny", dp: int = 2, batch: int = 4, seq: int = 32, steps: int = 2,
                        **overrides) -> dict:
    """The bytes one training step sends, counted, for DP (DDP, and FSDP2, over the world), TP (torch's, over
    the world) and DP×TP (``dp`` × world/dp), in one process group: a worker for ``launch``. Counts per mode."""
    out = {}
    for name, mode in (("ddp", "ddp"), ("dp", "dp"), ("tp", "torch"), ("dp_tp", "dp_tp")):
        r = train(mode=mode, steps=steps, preset=preset, batch=batch, seq=seq, dp=dp, **overrides)
        out[name] = {k: r[k] for k in ("bytes_by_kind", "sent_bytes_by_kind", "calls_by_kind", "bytes_by_group", "losses")}
    dist.barrier()
    return out


def comm_bytes(preset: str = "tiny", nprocs: int = 4, dp: int = 2, **kwargs) -> dict:
    """``bytes_per_dimension`` on ``nprocs`` fresh ranks (``launch``): {"ddp"|"dp"|"tp"|"dp_tp": counts} of rank 0."""
    return launch("course_lib.tp:bytes_per_dimension", nprocs, {"preset": preset, "dp": dp, **kwargs}, echo=False)[0]


def compare(modes: list[str] = ("single", "hand", "torch", "dp_tp"), **kwargs) -> dict:
    """``train`` in each of ``modes``, one after the other, in this process group: one launch for a notebook's
    whole comparison (starting ranks costs more than a few tiny steps). {mode: train's result}."""
    out = {mode: train(mode=mode, **kwargs) for mode in modes}
    dist.barrier()
    return out
