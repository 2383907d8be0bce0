"""ZeRO by hand: stage 1 written out as DeepSpeed runs it, and the bytes it sends, measured.

``ShardedOptimizer`` is stage 1 by hand, as DeepSpeed and the ZeRO paper do it: no DDP, one reduce-scatter of the
flat gradients, each rank stepping its 1/N slice with any torch optimizer, one all-gather; ``data_parallel`` builds
it (or DDP) around a model, and ``step_traffic`` counts that it sends what DDP sends.
It is notebook 09's exercise: the student edition holds a stub in its place, and
``zero_deepspeed.train(ZeroRun(engine="zero1"), make_optimizer=...)`` runs the student's own optimizer.
What each stage costs (the ZeRO paper's bytes per parameter) is ``course_lib.parallel.zero_cost``; DeepSpeed's
engine, its configs and batch rule, and the worker that trains with each engine are
``course_lib.parallel.zero_deepspeed``.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from course_lib.data import synthetic_images, to_device
from course_lib.distributed import CollectiveBytes, rank_device, step_batches
from course_lib.models import SmallCNN
from course_lib.train import rank_and_world, train_step

# torch 2.13 renamed the flat collectives (the old names warn, deprecated): the new names where torch has them
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def data_parallel(model: nn.Module, engine: str, make_optimizer=None, lr: float = 1e-3):
    """The model and optimizer of a data-parallel engine that is not DeepSpeed's: DDP with AdamW (``"ddp"``), or the
    model alone with ZeRO-1's ``ShardedOptimizer`` (``"zero1"``), which averages the gradients itself;
    ``make_optimizer(params)`` builds another optimizer in its place."""
    device = next(model.parameters()).device
    if engine == "ddp":
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    default = (torch.optim.AdamW if engine == "ddp"
               else functools.partial(ShardedOptimizer, optimizer_cls=torch.optim.AdamW))
    return model, (make_optimizer or (lambda ps: default(ps, lr=lr, weight_decay=0.01)))(model.parameters())


def step_traffic(engine: str = "ddp", make_optimizer=None, width: int = 8, global_batch: int = 16,
                 seed: int = 0) -> dict:
    """What one training step of SmallCNN sends from this rank, per collective, counted by ``CollectiveBytes``: DDP's
    all-reduce (``"ddp"``) or ZeRO-1's reduce-scatter and all-gather (``"zero1"``; ``make_optimizer`` as in
    ``data_parallel``).

    The first step, without clipping: DDP's second step also broadcasts its rebuilt bucket layout, and clipping
    sharded gradients adds an all-reduce of one number. ``sent_bytes`` is what a ring algorithm sends from each rank.
    """
    rank, world = rank_and_world()
    torch.manual_seed(seed)
    model = SmallCNN(width=width).to(rank_device())
    net, optimizer = data_parallel(model, engine, make_optimizer)
    batch = next(iter(step_batches(synthetic_images(4 * global_batch, seed=seed), global_batch, 1, seed)))
    with CollectiveBytes() as counted:
        train_step(net, optimizer, to_device(batch, rank_device()))
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"rank": rank, "world_size": world, "n_params": n, "calls": counted.calls_by_kind,
            "sent_bytes": counted.sent_bytes_by_kind,
            "sent_bytes_per_param": sum(counted.sent_bytes_by_kind.values()) / n}


# graded: 09_deepspeed_zero ShardedOptimizer
class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1 as DeepSpeed runs it (and the ZeRO paper describes it): each rank keeps the optimizer state,
    and an fp32 copy of the weights, for 1/N of every parameter group, and no DDP runs underneath.

    Each group is laid out flat, as DeepSpeed does: its parameters end to end, zero-padded to a multiple of the
    world size N, and cut into N equal slices; rank r owns slice r (``self.shards``, in fp32), and the wrapped
    ``self.optimizer`` (any torch optimizer) steps the owned slices only, so its states take 1/N of the memory.
    Backward leaves every rank its own gradients. ``step`` puts them in the group's flat buffer (zeros for a
    parameter without one), reduce-scatters it (a sum divided by N: rank r receives the average of slice r),
    steps, and all-gathers the updated slices back into every rank's parameters. A reduce-scatter and an
    all-gather each send (N-1)/N of the buffer from every rank: together what DDP's all-reduce sends.

    It is a real ``torch.optim.Optimizer``: ``param_groups`` hold the model's parameters and the
    hyperparameters (copied into the wrapped optimizer's groups at every step, so an LR scheduler works),
    ``add_param_group`` shards a new group, ``step(closure)`` takes a closure, and ``state_dict`` is this rank's
    shard (its slices and its optimizer's state: one checkpoint file per rank, as DeepSpeed saves them).
    ``clip_grad_norm_`` clips the sharded gradients by the norm of the whole (DeepSpeed's ``gradient_clipping``).
    """

    def __init__(self, params, optimizer_cls: type[torch.optim.Optimizer], **defaults):
        self.rank, self.world_size = rank_and_world()
        self.optimizer_cls, self.optimizer, self.shards = optimizer_cls, None, []
        self.reduced = False  # whether this step's gradients have been reduce-scattered into the shards yet
        super().__init__(params, defaults)  # calls add_param_group for each group

    def add_param_group(self, param_group: dict) -> None:
        """Shard one group: its fp32 slice on this rank, and a group of the wrapped optimizer over that slice."""
        super().add_param_group(param_group)  # the defaults filled in
        group = self.param_groups[-1]
        group["params"] = [p for p in group["params"] if p.requires_grad]  # a frozen parameter takes no part
        if len({p.dtype for p in group["params"]}) > 1:
            raise ValueError("one flat buffer per group: give parameters of different dtypes groups of their own")
        flat = self._flat([p.detach() for p in group["params"]])
        n = flat.numel() // self.world_size
        shard = flat[self.rank * n:(self.rank + 1) * n].float().clone()  # this rank's fp32 master slice
        self.shards.append(shard)
        inner = {**{k: v for k, v in group.items() if k != "params"}, "params": [shard]}
        if self.optimizer is None:
            self.optimizer = self.optimizer_cls([inner], **self.defaults)
        else:
            self.optimizer.add_param_group(inner)
        for k, v in self.optimizer.param_groups[-1].items():  # show the wrapped optimizer's own defaults too
            group.setdefault(k, v)

    def _flat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """``tensors`` end to end in one flat buffer, zero-padded to a multiple of the world size."""
        numel = sum(t.numel() for t in tensors)
        pad = -numel % self.world_size
        ref = tensors[0] if tensors else torch.empty(0)
        return torch.cat([t.reshape(-1) for t in tensors] + [ref.new_zeros(pad)])

    def reduce_gradients(self) -> None:
        """Each group's gradients reduce-scattered: this rank's slice of their average lands in its shard's
        ``.grad``."""
        for group, shard in zip(self.param_groups, self.shards):
            ps = group["params"]
            flat = self._flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in ps])
            mine = flat.new_empty(shard.numel())
            if self.world_size > 1 and shard.numel():  # a group of frozen parameters only: nothing to send
                _reduce_scatter(mine, flat)  # summed: gloo's average differs across torch versions
                mine.div_(self.world_size)
            else:
                mine.copy_(flat)
            shard.grad = mine.float()
        self.reduced = True

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the (reduced) gradients to ``max_norm`` by the norm of the whole model: each rank sums the
        squares of its slices (the padding adds zeros) and an all-reduce adds the ranks'. Returns the norm."""
        if not self.reduced:
            self.reduce_gradients()
        squares = torch.zeros((), dtype=torch.float64, device=self.shards[0].device if self.shards else None)
        for s in self.shards:
            squares += s.grad.double().pow(2).sum()
        if self.world_size > 1:
            dist.all_reduce(squares)
        norm = squares.sqrt().float()
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # torch's clip_grad_norm_ formula
        for s in self.shards:
            s.grad.mul_(scale)
        return norm

    @torch.no_grad()
    def step(self, closure=None):
        """Reduce-scatter the gradients, step this rank's slices with the groups' current hyperparameters, and
        all-gather the slices back into every rank's parameters. Returns the closure's loss, if given one."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self.reduced:
            self.reduce_gradients()
        for group, inner in zip(self.param_groups, self.optimizer.param_groups):
            inner.update({k: v for k, v in group.items() if k != "params"})  # a scheduler changed group["lr"]
        self.optimizer.step()
        for group, shard in zip(self.param_groups, self.shards):
            ps = group["params"]
            if not ps:
                continue
            full = ps[0].new_empty(shard.numel() * self.world_size)
            if self.world_size > 1:
                _all_gather(full, shard.to(full.dtype))  # rank r's slice lands at r * n
            else:
                full.copy_(shard)
            offset = 0
            for p in ps:
                p.copy_(full[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        self.reduced = False
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the model's gradients and the shards' (always to None: the next step starts from none)."""
        for group, shard in zip(self.param_groups, self.shards):
            for p in group["params"]:
                p.grad = None
            shard.grad = None
        self.reduced = False

    def state_dict(self) -> dict:
        """This rank's part of a checkpoint: its fp32 slices, its optimizer's state and the hyperparameters."""
        return {"rank": self.rank, "world_size": self.world_size, "shards": [s.detach().clone() for s in self.shards],
                "optimizer": self.optimizer.state_dict(),
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what ``state_dict`` saved on this rank, from a run with the same world size and groups."""
        if (state_dict["rank"], state_dict["world_size"]) != (self.rank, self.world_size):
            raise ValueError(f"this is rank {self.rank} of {self.world_size}; the state is rank {state_dict['rank']}'s "
                             f"of {state_dict['world_size']}: load each rank's own file into the same world size")
        for shard, saved in zip(self.shards, state_dict["shards"], strict=True):
            shard.copy_(saved)
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            group.update(saved)
        self.optimizer.load_state_dict(state_dict["optimizer"])
