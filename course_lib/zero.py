"""DeepSpeed ZeRO: shard optimizer states (stage 1), gradients (2) and weights (3), or offload them.

The config is derived, not typed: ``ds_config`` computes ``train_batch_size`` from
``micro_batch × accum_steps × world_size`` and refuses combinations DeepSpeed would reject
later (or silently run differently). ``train`` is the worker entry point the notebook
launches: the same model, data shards and AdamW as a DDP reference (``engine="ddp"``), so
every stage can be compared with it loss for loss, and it saves and resumes DeepSpeed
checkpoints.

On every device ``torch_adam`` keeps DeepSpeed from JIT-compiling its fused Adam, and with
optimizer offload ``zero_force_ds_cpu_optimizer: false`` lets torch's AdamW run on the
offloaded states: nothing compiles at run time (DeepSpeed's CPU Adam is faster on a big
model, and is one config line away).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.data import synthetic_images
from course_lib.ddp import param_digest, step_batches
from course_lib.distributed import mean_over_ranks, rank_device
from course_lib.models import SmallCNN


def check_batch_arithmetic(train_batch: int, micro_batch: int, accum_steps: int, world_size: int) -> None:
    """DeepSpeed's rule, with the fix in the message: train_batch = micro × accumulation × world."""
    if train_batch != micro_batch * accum_steps * world_size:
        raise ValueError(
            f"train_batch_size={train_batch} but micro_batch {micro_batch} x accum_steps {accum_steps} x world_size "
            f"{world_size} = {micro_batch * accum_steps * world_size}: set train_batch_size to that product, or "
            f"micro_batch to {train_batch / (accum_steps * world_size):g} (it must come out a whole number)")


def ds_config(*, micro_batch: int, accum_steps: int, world_size: int, stage: int, lr: float = 1e-3,
              offload_optimizer: bool = False, offload_param: bool = False, mixed_precision: str | None = None,
              nvme_path: str | None = None, clip_norm: float = 1.0) -> dict:
    """A DeepSpeed config for ZeRO ``stage`` whose batch sizes multiply out.

    ``clip_norm`` is written out because DeepSpeed's default is not "off": it clips the
    gradient norm at 1.0 unless told otherwise, where plain PyTorch and DDP never clip.
    """
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
        "train_batch_size": micro_batch * accum_steps * world_size,
        "train_micro_batch_size_per_gpu": micro_batch,
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
    check_batch_arithmetic(config["train_batch_size"], micro_batch, accum_steps, world_size)
    return config


def train(engine: str = "deepspeed", stage: int = 2, steps: int = 5, global_batch: int = 32, accum_steps: int = 1,
          offload_optimizer: bool = False, offload_param: bool = False, width: int = 8, lr: float = 1e-3,
          seed: int = 0, n_samples: int = 512, clip_norm: float = 1.0, nvme_path: str | None = None,
          checkpoint_dir: str | None = None, stop_after: int | None = None, resume: bool = False) -> dict:
    """Train SmallCNN with DeepSpeed ZeRO (``engine="deepspeed"``) or the DDP reference (``engine="ddp"``).

    ``stop_after=k`` saves a checkpoint to ``checkpoint_dir`` after step k and stops;
    ``resume=True`` loads it and runs the remaining steps. Returns this rank's global-batch
    losses (by step number), a digest of the final weights, and the model-state bytes it held.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if global_batch % (world * accum_steps):
        raise ValueError(f"global_batch={global_batch} must divide by world_size x accum_steps = {world * accum_steps}")
    micro = global_batch // (world * accum_steps)
    device = rank_device()
    torch.manual_seed(seed)
    model = SmallCNN(width=width)
    batches = list(step_batches(synthetic_images(n_samples, seed=seed), global_batch, steps, seed))
    start = 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        from course_lib.train import train_step

        model = DDP(model.to(device), device_ids=[device.index] if device.type == "cuda" else None)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        step_fn = lambda x, y: train_step(model, opt, x, y, accum_steps=accum_steps, clip_norm=clip_norm)["loss"]
        net = model
    elif engine == "deepspeed":
        import deepspeed

        config = ds_config(micro_batch=micro, accum_steps=accum_steps, world_size=world, stage=stage, lr=lr,
                           offload_optimizer=offload_optimizer, offload_param=offload_param, clip_norm=clip_norm,
                           nvme_path=nvme_path)
        net, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        if resume:
            _, client = net.load_checkpoint(checkpoint_dir)  # the tag in the "latest" file
            start = client["step"]

        step_fn = lambda x, y: deepspeed_step(net, x, y, accum_steps)
    else:
        raise ValueError(f"engine={engine!r}: use 'deepspeed' or 'ddp'")

    losses = {}
    for step in range(start, steps):
        x, y = batches[step]
        losses[step] = mean_over_ranks(step_fn(x.to(device), y.to(device)), device)
        if stop_after is not None and step + 1 == stop_after:
            net.save_checkpoint(checkpoint_dir, tag=f"step{step + 1}", client_state={"step": step + 1})
            break
    module = getattr(net, "module", net)
    return {"rank": rank, "world_size": world, "losses": losses, "digest": _full_digest(net, module, stage, engine),
            "optimizer_state_bytes": optimizer_state_bytes(net.optimizer if engine == "deepspeed" else opt),
            "device": str(device), "n_params": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                                                   for p in module.parameters()),
            "peak_device_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}


def deepspeed_step(net, x: torch.Tensor, y: torch.Tensor, accum_steps: int) -> float:
    """One global step of a DeepSpeed engine on this rank's batch, in ``accum_steps`` micro-batches; its mean loss."""
    total = 0.0
    for xm, ym in zip(x.chunk(accum_steps), y.chunk(accum_steps)):
        loss = F.cross_entropy(net(xm), ym)  # DeepSpeed divides by accumulation steps itself
        net.backward(loss)
        net.step()  # an optimizer step only at the accumulation boundary
        total += loss.item() / accum_steps
    return total


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of optimizer state (Adam's m and v) this rank holds: all of it under DDP, a 1/N slice under ZeRO."""
    from course_lib.memory import tensor_bytes

    inner = getattr(optimizer, "optimizer", optimizer)  # ZeRO wraps the torch optimizer around flat partitions
    return tensor_bytes(v for st in inner.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0)


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


def train_with_config(config: dict, steps: int = 4, width: int = 8, seed: int = 0, n_samples: int = 256) -> dict:
    """Train SmallCNN for ``steps`` with DeepSpeed and a given config: does DeepSpeed accept it, and does it learn?"""
    import deepspeed

    accum = config.get("gradient_accumulation_steps", 1)
    global_batch = config["train_batch_size"]
    torch.manual_seed(seed)
    model = SmallCNN(width=width)
    net, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    losses, device = [], rank_device()
    for x, y in step_batches(synthetic_images(max(n_samples, global_batch), seed=seed), global_batch, steps, seed):
        losses.append(mean_over_ranks(deepspeed_step(net, x.to(device), y.to(device), accum), device))
    return {"rank": dist.get_rank(), "losses": losses, "micro_batch": config["train_micro_batch_size_per_gpu"],
            "global_steps": net.global_steps}


def _full_digest(net, module, stage: int, engine: str) -> float:
    """Digest of the full weights; under ZeRO-3 each rank holds a shard, so gather them first."""
    if engine == "deepspeed" and stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return param_digest(module)
    return param_digest(module)
