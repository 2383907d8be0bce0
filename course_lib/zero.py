"""DeepSpeed ZeRO: shard optimizer states (stage 1), gradients (2) and weights (3), or offload them.

The config is derived, not typed: ``ds_config`` takes the global batch and solves DeepSpeed's
rule ``train_batch = micro_batch × accum_steps × world_size`` for the micro-batch, refusing a
split that does not come out whole, and combinations DeepSpeed would reject later (or silently
run differently). ``train`` is the worker entry point the notebook
launches: the same model, data shards and AdamW as a DDP reference (``engine="ddp"``), so
every stage can be compared with it loss for loss, and it saves and resumes DeepSpeed
checkpoints. ``ShardedOptimizer`` is stage 1 by hand, in one screen: any torch optimizer, each rank
stepping only its 1/N slice of every parameter and all-gathering the result (``engine="zero1"``).

On every device ``torch_adam`` keeps DeepSpeed from JIT-compiling its fused Adam, and with
optimizer offload ``zero_force_ds_cpu_optimizer: false`` lets torch's AdamW run on the
offloaded states: nothing compiles at run time (DeepSpeed's CPU Adam is faster on a big
model, and is one config line away).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from course_lib.data import synthetic_images, to_device
from course_lib.distributed import (gather_slices, mean_over_ranks, param_digest, rank_and_world, rank_device,
                                    rank_slice, step_batches, worker_result)
from course_lib.loss import forward_loss
from course_lib.memory import optimizer_state_bytes
from course_lib.models import SmallCNN
from course_lib.train import split_batch, train_step


def check_batch_arithmetic(train_batch: int, micro_batch: int, accum_steps: int, world_size: int) -> None:
    """DeepSpeed's rule for a config someone wrote, with the fix in the message: train_batch = micro × accumulation × world."""
    if train_batch != micro_batch * accum_steps * world_size:
        raise ValueError(
            f"train_batch_size={train_batch} but micro_batch {micro_batch} x accum_steps {accum_steps} x world_size "
            f"{world_size} = {micro_batch * accum_steps * world_size}: set train_batch_size to that product, or "
            f"micro_batch to {train_batch / (accum_steps * world_size):g} (it must come out a whole number)")


def micro_batch_for(train_batch: int, accum_steps: int, world_size: int) -> int:
    """The micro-batch per rank that DeepSpeed's rule gives; refused, with the fix, when it is not whole."""
    if accum_steps < 1 or world_size < 1 or train_batch % (accum_steps * world_size):
        step = accum_steps * world_size
        raise ValueError(f"train_batch={train_batch} does not divide by accum_steps {accum_steps} x world_size "
                         f"{world_size} = {step}: use a multiple of {step} (e.g. {max(step, train_batch // step * step)})")
    return train_batch // (accum_steps * world_size)


def ds_config(*, train_batch: int, accum_steps: int, world_size: int, stage: int, lr: float = 1e-3,
              offload_optimizer: bool = False, offload_param: bool = False, mixed_precision: str | None = None,
              nvme_path: str | None = None, clip_norm: float = 1.0) -> dict:
    """A DeepSpeed config for ZeRO ``stage``: the global batch ``train_batch`` split into ``accum_steps``
    micro-batches on each of ``world_size`` ranks.

    ``clip_norm`` is written out because DeepSpeed's default is not "off": it clips the
    gradient norm at 1.0 unless told otherwise, where plain PyTorch and DDP never clip.
    """
    micro = micro_batch_for(train_batch, accum_steps, world_size)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage}: ZeRO stages are 0 (plain data parallel), 1, 2 and 3")
    if offload_param and stage != 3:
        raise ValueError(f"offload_param=True needs stage=3 (only stage 3 shards the weights), not stage={stage}")
    if offload_optimizer and stage == 0:
        raise ValueError("offload_optimizer=True needs stage >= 1: stage 0 has no sharded optimizer to offload")
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
        # torch's AdamW on every device: DeepSpeed's fused and CPU Adam are JIT-compiled C++/CUDA ops, and
        # their build can fail where torch's own arch list is newer than DeepSpeed's parser (sm_90a, 0.19.8)
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": zero,
        "gradient_clipping": clip_norm,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if offload_optimizer:  # the offloaded step then runs torch's AdamW on the CPU copy of the states
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
    or DDP with ``ShardedOptimizer``, ZeRO-1 by hand (``engine="zero1"``).

    All see the same weights, batches and AdamW; ``make_optimizer(params)`` replaces the DDP
    engines' optimizer (a sharded optimizer of your own, say). ``stop_after=k`` saves a DeepSpeed checkpoint to
    ``checkpoint_dir`` after step k and stops; ``resume=True`` loads it and runs the remaining
    steps. Returns the global-batch losses, a digest of the final weights, and the optimizer-state
    bytes this rank held.
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
        net = DDP(model.to(device), device_ids=[device.index] if device.type == "cuda" else None)
        if make_optimizer is None and engine == "zero1":
            make_optimizer = lambda ps: ShardedOptimizer(ps, torch.optim.AdamW, lr=lr, weight_decay=0.01)  # noqa: E731
        optimizer = (make_optimizer or (lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.01)))(net.parameters())
        step_fn = lambda b: train_step(net, optimizer, b, accum_steps=accum_steps, clip_norm=clip_norm)["loss"]  # noqa: E731
    else:
        import deepspeed  # heavy: only when it is the engine

        config = ds_config(train_batch=global_batch, accum_steps=accum_steps, world_size=world, stage=stage, lr=lr,
                           offload_optimizer=offload_optimizer, offload_param=offload_param, clip_norm=clip_norm,
                           nvme_path=nvme_path)
        net, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        step_fn = lambda b: deepspeed_step(net, b, accum_steps)  # noqa: E731
    start = net.load_checkpoint(checkpoint_dir)[1]["step"] if resume else 0  # the tag in the "latest" file
    losses = []
    for step in range(start, steps):
        losses.append(mean_over_ranks(step_fn(to_device(batches[step], device)), device))
        if stop_after is not None and step + 1 == stop_after:
            net.save_checkpoint(checkpoint_dir, tag=f"step{step + 1}", client_state={"step": step + 1})
            break
    module = getattr(net, "module", net)
    return worker_result(losses, start_step=start, digest=_full_digest(module, stage if engine == "deepspeed" else 0),
                         optimizer_state_bytes=optimizer_state_bytes(optimizer), device=str(device),
                         n_params=sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters()),
                         peak_device_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None)


def train_with_config(config: dict, steps: int = 4, width: int = 8, seed: int = 0, n_samples: int = 256) -> dict:
    """Train SmallCNN for ``steps`` with DeepSpeed and a given config: does DeepSpeed accept it, and does it learn?"""
    import deepspeed

    global_batch = config["train_batch_size"]
    torch.manual_seed(seed)
    model = SmallCNN(width=width)
    net, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    losses, device = [], rank_device()
    for batch in step_batches(synthetic_images(max(n_samples, global_batch), seed=seed), global_batch, steps, seed):
        losses.append(mean_over_ranks(deepspeed_step(net, to_device(batch, device),
                                                     config.get("gradient_accumulation_steps", 1)), device))
    return worker_result(losses, micro_batch=config["train_micro_batch_size_per_gpu"], global_steps=net.global_steps)


class ShardedOptimizer:
    """ZeRO stage 1 by hand: each rank keeps the optimizer state of its 1/N slice of every parameter.

    Every parameter is flattened, padded with zeros to a multiple of the world size, and cut in N
    equal slices; rank r owns slice r, and ``optimizer_cls`` is built over the owned slices only
    (``self.optimizer``), so its states (Adam's m and v) take 1/N of the memory. ``step()`` runs
    after the gradients are averaged over the ranks (DDP did it): each rank copies its slice of
    every gradient, steps its slices, and an all-gather puts the full updated parameters back on
    every rank. A parameter without a gradient in a step is left as it is.
    """

    def __init__(self, params: Iterable[nn.Parameter], optimizer_cls: type[torch.optim.Optimizer], **optimizer_kwargs):
        self.params = [p for p in params if p.requires_grad]
        self.shards = [rank_slice(p.detach()).clone() for p in self.params]
        self.optimizer = optimizer_cls(self.shards, **optimizer_kwargs)

    def step(self) -> None:
        """Step this rank's slices with their slice of the (already averaged) gradients, then all-gather."""
        for p, shard in zip(self.params, self.shards):
            shard.grad = None if p.grad is None else rank_slice(p.grad)
        self.optimizer.step()
        for p, shard in zip(self.params, self.shards):
            if p.grad is not None:
                p.data.copy_(gather_slices(shard, p.numel()).view_as(p))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the model's gradients (and the slices' copies)."""
        for p in self.params:
            p.grad = None
        self.optimizer.zero_grad(set_to_none=True)


def _full_digest(module, stage: int) -> float:
    """Digest of the full weights; under ZeRO-3 each rank holds a shard, so gather them first."""
    if stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return param_digest(module)
    return param_digest(module)


def build_deepspeed_ops() -> None:
    """Compile DeepSpeed's shared-memory comm op now (about a minute on a CPU, once per machine).

    DeepSpeed builds it inside its first ``deepspeed.initialize``; doing it up front keeps that
    minute out of any cell or test that is timed. ``TORCH_EXTENSIONS_DIR`` says where it is kept.
    """
    from deepspeed.comm.torch import build_shm_op

    build_shm_op()


def nvme_offload_available() -> bool:
    """Whether DeepSpeed can build its async I/O op here (ZeRO-Infinity to NVMe needs libaio)."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        return bool(AsyncIOBuilder().is_compatible(verbose=False))
    except Exception:
        return False


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
