"""DeepSpeed's ZeRO applied to the course's model: shard optimizer states (stage 1), gradients (2) and weights (3),
or offload them, and the one worker that trains with it (the API practitioners use).

The config is derived, not typed: ``ds_config`` takes the global batch and solves DeepSpeed's
rule ``train_batch = micro_batch × accum_steps × world_size`` for the micro-batch, refusing a
split that does not come out whole, and combinations DeepSpeed would reject later (or silently
run differently); ``check_batch_arithmetic`` checks that rule for a config someone wrote, with the fix in its
message. ``apply_zero(model, mesh, cfg)`` builds DeepSpeed's engine from a run's spec (``ZeroRun``): DeepSpeed
takes no device mesh here, it shards over the whole world. ``train(spec)`` is the worker entry point the
notebooks launch: the same model, data shards and AdamW as a DDP reference (``engine="ddp"``), so
every stage can be compared with it loss for loss, and it saves and resumes DeepSpeed
checkpoints; ``engine="zero1"`` runs ``course_lib.parallel.zero``'s ZeRO-1 by hand on the same batches.
``run_config`` trains with a config someone wrote, as DeepSpeed takes it. ``engine_placement`` reads what the
engine holds where, from its tensors.

On every device ``torch_adam`` keeps DeepSpeed from JIT-compiling its fused Adam, and with
optimizer offload ``zero_force_ds_cpu_optimizer: false`` lets torch's AdamW run on the
offloaded states: nothing compiles at run time. ``cpu_adam=True`` asks for DeepSpeed's CPU Adam
instead (``make setup`` prebuilds its op, ``build_deepspeed_ops``). DeepSpeed's offload is a ZeRO config, this
module's; what it costs (where each state lives, the bytes over the link) is ``course_lib.parallel.offload_cost``,
and offload's optimizer by hand ``course_lib.parallel.offload``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn

from course_lib.data import synthetic_images, to_device
from course_lib.distributed import each_run, param_digest, rank_device, step_batches
from course_lib.launch import use_extensions_dir
from course_lib.loss import forward_loss
from course_lib.memory import optimizer_state_bytes, tensor_bytes
from course_lib.models import SmallCNN
from course_lib.train import Dims, RunSpec, fit, rank_and_world, split_batch, train_step, worker_result
from course_lib.parallel.zero import data_parallel


@dataclass(frozen=True)
class ZeroRun(RunSpec):
    """One run of ``train``: SmallCNN of ``width`` on ``n_samples`` synthetic images, ``steps`` steps of
    ``global_batch`` (``accum_steps`` micro-batches per rank), AdamW at ``lr``, clipped at ``clip_norm`` (0.0: not).

    ``engine`` is ``"deepspeed"`` (ZeRO ``stage`` 0 to 3, ``offload_optimizer`` and ``offload_param`` to the host,
    or to ``nvme_path``), ``"ddp"`` (the reference) or ``"zero1"`` (ZeRO-1 by hand). ``stop_after=k`` saves a
    DeepSpeed checkpoint to ``checkpoint_dir`` after step k and stops; ``resume=True`` loads it and runs the
    remaining steps."""

    engine: str = "deepspeed"
    stage: int = 2
    steps: int = 5
    global_batch: int = 32
    accum_steps: int = 1
    offload_optimizer: bool = False
    offload_param: bool = False
    width: int = 8
    lr: float = 1e-3
    seed: int = 0
    n_samples: int = 512
    clip_norm: float = 1.0
    nvme_path: str | None = None
    checkpoint_dir: str | None = None
    stop_after: int | None = None
    resume: bool = False


def check_batch_arithmetic(train_batch: int, micro_batch: int, accum_steps: int, world_size: int) -> None:
    """DeepSpeed's rule for a config someone wrote, with the fix in the message: train_batch = micro × accumulation
    × world."""
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


def apply_zero(model: nn.Module, mesh, cfg: ZeroRun | dict) -> object:
    """DeepSpeed's engine around ``model``: ``deepspeed.initialize`` with the config ``ds_config`` derives from the
    run ``cfg`` (its stage, global batch over this world, accumulation steps, learning rate, offloads, clipping and
    NVMe folder). Returns the engine; its optimizer is ``engine.optimizer``.

    DeepSpeed takes no device mesh here: ZeRO shards over the whole world (every rank of the process group), so
    ``mesh`` is None, and a mesh is refused rather than ignored."""
    if mesh is not None:
        raise ValueError("DeepSpeed's ZeRO takes no device mesh: it shards over the whole world; pass mesh=None")
    import deepspeed  # heavy: only when it is the engine

    cfg = ZeroRun.of(cfg)
    config = ds_config(train_batch=cfg.global_batch, accum_steps=cfg.accum_steps, world_size=rank_and_world()[1],
                       stage=cfg.stage, lr=cfg.lr, offload_optimizer=cfg.offload_optimizer,
                       offload_param=cfg.offload_param, clip_norm=cfg.clip_norm, nvme_path=cfg.nvme_path)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def train(spec: ZeroRun | dict | None = None,
          make_optimizer: Callable[[Iterable[nn.Parameter]], object] | None = None) -> dict:
    """Train SmallCNN as ``spec`` (a ``ZeroRun``, or a dict of its fields) says: with DeepSpeed ZeRO
    (``engine="deepspeed"``), the DDP reference (``engine="ddp"``), or ZeRO-1 by hand (``engine="zero1"``): no DDP,
    ``ShardedOptimizer`` reduce-scatters the gradients itself (a stub in the student edition, where
    ``ZeroRun(engine="zero1")`` with ``make_optimizer=...`` runs your own).

    All see the same weights, batches and AdamW; ``make_optimizer(params)`` replaces the optimizer of ``"ddp"``
    (any torch optimizer) or ``"zero1"`` (one that averages the gradients over the ranks itself). Clipping under
    ``"zero1"`` is the optimizer's ``clip_grad_norm_`` (its gradients are sharded); one without it needs
    ``clip_norm=0.0``. Checkpoints (``stop_after``, ``resume``) are DeepSpeed's. Returns the global-batch losses, a
    digest of the final weights, the optimizer-state bytes this rank held and, for DeepSpeed, what its engine held
    where (``engine_placement``).
    """
    s = ZeroRun.of(spec)
    if s.engine not in ("deepspeed", "ddp", "zero1"):
        raise ValueError(f"engine={s.engine!r}: use 'deepspeed', 'ddp' or 'zero1'")
    if s.engine != "deepspeed" and (s.resume or s.stop_after):
        raise ValueError("checkpoints here are DeepSpeed's: use engine='deepspeed' with stop_after or resume")
    device = rank_device()
    torch.manual_seed(s.seed)
    model = SmallCNN(width=s.width)
    batches = list(step_batches(synthetic_images(s.n_samples, seed=s.seed), s.global_batch, s.steps, s.seed))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if s.engine != "deepspeed":
        net, optimizer = data_parallel(model.to(device), s.engine, make_optimizer, s.lr)
        clip = getattr(optimizer, "clip_grad_norm_", None) if s.engine == "zero1" else nn.utils.clip_grad_norm_
        if s.clip_norm and clip is None:
            raise ValueError("clip_norm needs the optimizer's own clip_grad_norm_ under engine='zero1' (each rank "
                             "holds a slice of the averaged gradients): give it one, or pass clip_norm=0.0")
        step_fn = lambda b: train_step(net, optimizer, b, accum_steps=s.accum_steps, clip_norm=s.clip_norm,  # noqa: E731
                                       clip_grad_norm=lambda ps, c: clip(c) if s.engine == "zero1" else clip(ps, c))
    else:
        net = apply_zero(model, None, s)
        optimizer = net.optimizer
        step_fn = lambda b: {"loss": deepspeed_step(net, b, s.accum_steps)}  # noqa: E731 (the engine steps itself)
    start = net.load_checkpoint(s.checkpoint_dir)[1]["step"] if s.resume else 0  # the tag in the "latest" file

    def stop_here(step: int, record: dict) -> bool:  # save after step ``stop_after`` and stop there
        if s.stop_after is not None and step + 1 == s.stop_after:
            net.save_checkpoint(s.checkpoint_dir, tag=f"step{step + 1}", client_state={"step": step + 1})
            return True
        return False

    history = fit(net, optimizer, lambda step: to_device(batches[step], device), s.steps, start=start, step=step_fn,
                  after_step=stop_here, progress=False)
    module = getattr(net, "module", net)
    return worker_result([r["loss"] for r in history], start_step=start,
                         digest=_full_digest(module, s.stage if s.engine == "deepspeed" else 0),
                         optimizer_state_bytes=optimizer_state_bytes(optimizer), device=str(device),
                         placement=engine_placement(net) if s.engine == "deepspeed" else None,
                         n_params=sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters()),
                         peak_device_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None)


def run_config(config: dict, steps: int = 4, width: int = 8, seed: int = 0, n_samples: int = 256) -> dict:
    """SmallCNN trained for ``steps`` with DeepSpeed and a config someone wrote (a worker for ``on_ranks``): does
    DeepSpeed accept it, and does it learn? ``train`` derives its config from a ``ZeroRun`` instead."""
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

    use_extensions_dir()  # the folder and the ninja every later load uses
    build_shm_op()
    CPUAdamBuilder().load()


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


def sweep(runs: list[ZeroRun | dict] = ()) -> dict:
    """Several ``train`` runs in one process group, a worker for ``launch.on_ranks(sweep, n, device, runs=[...])``
    (torchrun on GPUs, forked CPU ranks elsewhere): starting ranks is most of a small run's time on a CPU. Each run
    is a ``ZeroRun`` or a dict of its fields. Runs go in order, so a ``resume`` run reads the checkpoint a
    ``stop_after`` run before it wrote."""
    return each_run(train, [{"spec": run} for run in runs])
