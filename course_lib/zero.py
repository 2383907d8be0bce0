"""DeepSpeed ZeRO: shard optimizer states (stage 1), gradients (2) and weights (3), or offload them.

The config is derived, not typed: ``ds_config`` takes the global batch and solves DeepSpeed's
rule ``train_batch = micro_batch × accum_steps × world_size`` for the micro-batch, refusing a
split that does not come out whole, and combinations DeepSpeed would reject later (or silently
run differently). ``train`` is the worker entry point the notebook
launches: the same model, data shards and AdamW as a DDP reference (``engine="ddp"``), so
every stage can be compared with it loss for loss, and it saves and resumes DeepSpeed
checkpoints. ``ShardedOptimizer`` is stage 1 by hand, as DeepSpeed and the ZeRO paper do it: no DDP, one
reduce-scatter of the flat gradients, each rank stepping its 1/N slice with any torch optimizer, one all-gather
(``engine="zero1"``); ``step_traffic`` counts that it sends what DDP sends.
It is notebook 09's exercise: the student edition holds a stub in its place, and
``train(engine="zero1", make_optimizer=...)`` runs the student's own optimizer.

On every device ``torch_adam`` keeps DeepSpeed from JIT-compiling its fused Adam, and with
optimizer offload ``zero_force_ds_cpu_optimizer: false`` lets torch's AdamW run on the
offloaded states: nothing compiles at run time. ``cpu_adam=True`` asks for DeepSpeed's CPU Adam
instead (``make setup`` prebuilds its op). Offloading the states to the host or NVMe is ``course_lib.offload``.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from course_lib.data import synthetic_images, to_device
from course_lib.distributed import CollectiveBytes, param_digest, rank_device, step_batches
from course_lib.loss import forward_loss
from course_lib.memory import optimizer_state_bytes, tensor_bytes
from course_lib.models import SmallCNN
from course_lib.train import Dims, fit, rank_and_world, split_batch, train_step, worker_result

# torch 2.13 renamed the flat collectives (the old names warn, deprecated): the new names where torch has them
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def check_batch_arithmetic(train_batch: int, micro_batch: int, accum_steps: int, world_size: int) -> None:
    """DeepSpeed's rule for a config someone wrote, with the fix in the message: train_batch = micro × accumulation × world."""
    if train_batch != micro_batch * accum_steps * world_size:
        raise ValueError(
            f"train_batch_size={train_batch} but micro_batch {micro_batch} x accum_steps {accum_steps} x world_size "
            f"{world_size} = {micro_batch * accum_steps * world_size}: set train_batch_size to that product, or "
            f"micro_batch to {train_batch / (accum_steps * world_size):g} (it must come out a whole number)")


def ds_config(*, train_batch: int, accum_steps: int, world_size: int, stage: int, lr: float = 1e-3,
              offload_optimizer: bool = False, offload_param: bool = False, mixed_precision: str | None = None,
              nvme_path: str | None = None, clip_norm: float = 1.0, cpu_adam: bool = False) -> dict:
    """A DeepSpeed config for ZeRO ``stage``: the global batch ``train_batch`` split into ``accum_steps``
    micro-batches on each of ``world_size`` ranks.

    ``clip_norm`` is written out because DeepSpeed's default is not "off": it clips the
    gradient norm at 1.0 unless told otherwise, where plain PyTorch and DDP never clip.
    ``cpu_adam=True`` (with ``offload_optimizer``) lets DeepSpeed step the offloaded states with its
    own CPU Adam, the optimizer ZeRO-Offload's speed rests on, instead of torch's AdamW.
    """
    micro = Dims(train_batch, accum_steps, dp=world_size).micro_batch  # refused, with the fix, if not whole
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage}: ZeRO stages are 0 (plain data parallel), 1, 2 and 3")
    if offload_param and stage != 3:
        raise ValueError(f"offload_param=True needs stage=3 (only stage 3 shards the weights), not stage={stage}")
    if offload_optimizer and stage == 0:
        raise ValueError("offload_optimizer=True needs stage >= 1: stage 0 has no sharded optimizer to offload")
    if cpu_adam and not offload_optimizer:
        raise ValueError("cpu_adam=True needs offload_optimizer=True: DeepSpeed's CPU Adam steps states on the CPU")
    zero: dict = {"stage": stage}
    target = {"device": "nvme", "nvme_path": nvme_path} if nvme_path else {"device": "cpu"}
    if offload_optimizer:
        zero["offload_optimizer"] = dict(target)
    if offload_param:
        zero["offload_param"] = dict(target)
    config = {
        "train_batch_size": train_batch,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum_steps,
        # torch's AdamW on every device unless cpu_adam: DeepSpeed's fused and CPU Adam are JIT-compiled C++/CUDA
        # ops, and their build can fail where torch's own arch list is newer than DeepSpeed's parser (sm_90a, 0.19.8)
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01, "torch_adam": not cpu_adam}},
        "zero_optimization": zero,
        "gradient_clipping": clip_norm,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if offload_optimizer and not cpu_adam:  # the offloaded step then runs torch's AdamW on the CPU copy of the states
        config["zero_force_ds_cpu_optimizer"] = False
    if mixed_precision == "bfloat16":
        config["bf16"] = {"enabled": True}
    elif mixed_precision == "float16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    elif mixed_precision not in (None, "float32"):
        raise ValueError(f"mixed_precision={mixed_precision!r}: use None, 'bfloat16' or 'float16'")
    return config


def deepspeed_step(net, batch, accum_steps: int) -> float:
    """One global step of a DeepSpeed engine on this rank's batch: the course's ``split_batch`` and
    ``forward_loss``, DeepSpeed's own backward and step. Returns the step's mean loss."""
    total = 0.0
    for micro in split_batch(batch, accum_steps):
        loss = forward_loss(net, micro)  # DeepSpeed divides by the accumulation steps itself
        net.backward(loss)
        net.step()  # an optimizer step only at the accumulation boundary
        total += loss.item() / accum_steps
    return total


def train(engine: str = "deepspeed", stage: int = 2, steps: int = 5, global_batch: int = 32, accum_steps: int = 1,
          offload_optimizer: bool = False, offload_param: bool = False, width: int = 8, lr: float = 1e-3,
          seed: int = 0, n_samples: int = 512, clip_norm: float = 1.0, nvme_path: str | None = None,
          checkpoint_dir: str | None = None, stop_after: int | None = None, resume: bool = False,
          make_optimizer: Callable[[Iterable[nn.Parameter]], object] | None = None) -> dict:
    """Train SmallCNN with DeepSpeed ZeRO (``engine="deepspeed"``), the DDP reference (``engine="ddp"``),
    or ZeRO-1 by hand (``engine="zero1"``): no DDP, ``ShardedOptimizer`` reduce-scatters the gradients itself (a
    stub in the student edition, where ``engine="zero1", make_optimizer=...`` runs your own).

    All see the same weights, batches and AdamW; ``make_optimizer(params)`` replaces the optimizer of ``"ddp"``
    (any torch optimizer) or ``"zero1"`` (one that averages the gradients over the ranks itself). Clipping under
    ``"zero1"`` is the optimizer's ``clip_grad_norm_`` (its gradients are sharded); one without it needs
    ``clip_norm=0.0``. ``stop_after=k`` saves a DeepSpeed checkpoint to
    ``checkpoint_dir`` after step k and stops; ``resume=True`` loads it and runs the remaining
    steps. Returns the global-batch losses, a digest of the final weights, the optimizer-state bytes this
    rank held and, for DeepSpeed, what its engine held where (``engine_placement``).
    """
    if engine not in ("deepspeed", "ddp", "zero1"):
        raise ValueError(f"engine={engine!r}: use 'deepspeed', 'ddp' or 'zero1'")
    if engine != "deepspeed" and (resume or stop_after):
        raise ValueError("checkpoints here are DeepSpeed's: use engine='deepspeed' with stop_after or resume")
    world, device = rank_and_world()[1], rank_device()
    torch.manual_seed(seed)
    model = SmallCNN(width=width)
    batches = list(step_batches(synthetic_images(n_samples, seed=seed), global_batch, steps, seed))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if engine != "deepspeed":
        net, optimizer = data_parallel(model.to(device), engine, make_optimizer, lr)
        clip = getattr(optimizer, "clip_grad_norm_", None) if engine == "zero1" else nn.utils.clip_grad_norm_
        if clip_norm and clip is None:
            raise ValueError("clip_norm needs the optimizer's own clip_grad_norm_ under engine='zero1' (each rank "
                             "holds a slice of the averaged gradients): give it one, or pass clip_norm=0.0")
        step_fn = lambda b: train_step(net, optimizer, b, accum_steps=accum_steps, clip_norm=clip_norm,  # noqa: E731
                                       clip_grad_norm=lambda ps, c: clip(c) if engine == "zero1" else clip(ps, c))
    else:
        import deepspeed  # heavy: only when it is the engine

        config = ds_config(train_batch=global_batch, accum_steps=accum_steps, world_size=world, stage=stage, lr=lr,
                           offload_optimizer=offload_optimizer, offload_param=offload_param, clip_norm=clip_norm,
                           nvme_path=nvme_path)
        net, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        step_fn = lambda b: {"loss": deepspeed_step(net, b, accum_steps)}  # noqa: E731 (the engine steps itself)
    start = net.load_checkpoint(checkpoint_dir)[1]["step"] if resume else 0  # the tag in the "latest" file

    def stop_here(step: int, record: dict) -> bool:  # save after step ``stop_after`` and stop there
        if stop_after is not None and step + 1 == stop_after:
            net.save_checkpoint(checkpoint_dir, tag=f"step{step + 1}", client_state={"step": step + 1})
            return True
        return False

    history = fit(net, optimizer, lambda step: to_device(batches[step], device), steps, start=start, step=step_fn,
                  after_step=stop_here, progress=False)
    module = getattr(net, "module", net)
    return worker_result([r["loss"] for r in history], start_step=start, digest=_full_digest(module, stage if engine == "deepspeed" else 0),
                         optimizer_state_bytes=optimizer_state_bytes(optimizer), device=str(device),
                         placement=engine_placement(net) if engine == "deepspeed" else None,
                         n_params=sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters()),
                         peak_device_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None)


def data_parallel(model: nn.Module, engine: str, make_optimizer=None, lr: float = 1e-3):
    """The model and optimizer of a data-parallel engine that is not DeepSpeed's: DDP with AdamW (``"ddp"``), or the
    model alone with ZeRO-1's ``ShardedOptimizer`` (``"zero1"``), which averages the gradients itself;
    ``make_optimizer(params)`` builds another optimizer in its place."""
    device = next(model.parameters()).device
    if engine == "ddp":
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    default = torch.optim.AdamW if engine == "ddp" else functools.partial(ShardedOptimizer, optimizer_cls=torch.optim.AdamW)
    return model, (make_optimizer or (lambda ps: default(ps, lr=lr, weight_decay=0.01)))(model.parameters())


def step_traffic(engine: str = "ddp", make_optimizer=None, width: int = 8, global_batch: int = 16, seed: int = 0) -> dict:
    """What one training step of SmallCNN sends from this rank, per collective, counted by ``CollectiveBytes``: DDP's
    all-reduce (``"ddp"``) or ZeRO-1's reduce-scatter and all-gather (``"zero1"``; ``make_optimizer`` as in ``train``).

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
            "sent_bytes": counted.sent_bytes_by_kind, "sent_bytes_per_param": sum(counted.sent_bytes_by_kind.values()) / n}


def train_with_config(config: dict, steps: int = 4, width: int = 8, seed: int = 0, n_samples: int = 256) -> dict:
    """Train SmallCNN for ``steps`` with DeepSpeed and a given config: does DeepSpeed accept it, and does it learn?"""
    import deepspeed

    global_batch = config["train_batch_size"]
    torch.manual_seed(seed)
    model = SmallCNN(width=width)
    net, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    device, accum_steps = rank_device(), config.get("gradient_accumulation_steps", 1)
    batches = step_batches(synthetic_images(max(n_samples, global_batch), seed=seed), global_batch, steps, seed)
    history = fit(net, None, (to_device(b, device) for b in batches), steps, progress=False,
                  step=lambda b: {"loss": deepspeed_step(net, b, accum_steps)})  # the engine steps itself
    return worker_result([r["loss"] for r in history], micro_batch=config["train_micro_batch_size_per_gpu"],
                         global_steps=net.global_steps)


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
        """Each group's gradients reduce-scattered: this rank's slice of their average lands in its shard's ``.grad``."""
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


def _full_digest(module, stage: int) -> float:
    """Digest of the full weights; under ZeRO-3 each rank holds a shard, so gather them first."""
    if stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return param_digest(module)
    return param_digest(module)


def build_deepspeed_ops() -> None:
    """Compile DeepSpeed's shared-memory comm op and its CPU Adam now (about a minute each on a CPU, once per machine).

    DeepSpeed builds the first inside its first ``deepspeed.initialize`` and the second when an offloaded
    optimizer (or ``time_cpu_adam``) first needs it; doing it up front keeps those minutes out of any cell
    or test that is timed. ``TORCH_EXTENSIONS_DIR`` says where they are kept.
    """
    from deepspeed.comm.torch import build_shm_op
    from deepspeed.ops.op_builder import CPUAdamBuilder

    build_shm_op()
    CPUAdamBuilder().load()


def zero_bytes_per_param(stage: int, world_size: int, k: int = 12) -> float:
    """Model-state bytes per parameter on each rank, mixed-precision Adam (the ZeRO paper's accounting).

    2 bytes of fp16/bf16 weights, 2 of gradients, and K = 12 of optimizer state (fp32 master
    weights, Adam m and v). Stage 1 shards the optimizer state over N ranks, stage 2 also the
    gradients, stage 3 also the weights.
    """
    n = world_size
    weights, grads, states = 2.0, 2.0, float(k)
    if stage >= 1:
        states /= n
    if stage >= 2:
        grads /= n
    if stage >= 3:
        weights /= n
    return weights + grads + states


def engine_placement(engine) -> list[dict]:
    """What a DeepSpeed engine holds between steps on this rank, read from its tensors: state, device, dtype, bytes.

    ZeRO-1/2 (``DeepSpeedZeroOptimizer``) keep the whole 16-bit model and flat fp32 partitions; ZeRO-3 keeps
    each weight's partition (``ds_tensor``), and whole weights only while they are gathered for a forward or
    backward (between steps, none: empty tensors are not counted). The gradients are the fp32 partition
    the optimizer steps (kept between steps only with offload). Adam's states come from the wrapped optimizer.
    """
    opt, module = engine.optimizer, engine.module
    params = list(module.parameters())
    if hasattr(opt, "fp32_partitioned_groups_flat"):  # stage 3
        groups = {"16-bit weights": [p.ds_tensor for p in params],  # this rank's partition of each
                  "16-bit weights gathered whole": [p.data for p in params],
                  "fp32 master weights": list(opt.fp32_partitioned_groups_flat)}
    else:
        groups = {"16-bit weights": [p.data for p in params],
                  "fp32 master weights": list(getattr(opt, "single_partition_of_fp32_groups", []))}
    groups["fp32 gradients"] = [t.grad for t in groups["fp32 master weights"] if t.grad is not None]
    inner = getattr(opt, "optimizer", opt)
    groups["Adam m and v"] = [v for s in inner.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    rows = []
    for state, tensors in groups.items():
        tensors = [t for t in tensors if t is not None and t.numel()]
        rows.append({"state": state, "device": sorted({t.device.type for t in tensors}),
                     "dtype": sorted({str(t.dtype).replace("torch.", "") for t in tensors}),
                     "bytes": tensor_bytes(tensors), "optimizer": type(inner).__name__})
    return rows
