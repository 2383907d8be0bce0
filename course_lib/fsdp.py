"""Fully sharded data parallelism with FSDP2 (``fully_shard``), on a Llama, written once for the course.

Each rank keeps only a shard (a slice along dim 0) of every weight, gradient and Adam
state. A wrapped unit (here: the embedding, each decoder layer, the LM head, then the
root for what is left) all-gathers its full weights just before its forward and backward,
and reduce-scatters its gradients after backward, so each rank ends up with the *average*
gradient of its own shard only. The strategies of seed 003 in FSDP2 terms:

| seed 003 (FSDP1)  | FSDP2 here                                   | kept per rank between steps |
| ----------------- | -------------------------------------------- | --------------------------- |
| ``FULL_SHARD``    | 1-D mesh, ``reshard_after_forward=True``     | 1/N of everything            |
| ``SHARD_GRAD_OP`` | 1-D mesh, ``reshard_after_forward=False``    | 1/N; full weights from forward to backward |
| ``NO_SHARD``      | 2-D mesh (N, 1): replicate N, shard over 1   | everything (= DDP)           |
| ``HYBRID_SHARD``  | 2-D mesh (N/s, s): replicate, shard over s   | 1/s (s = GPUs of one node)   |

``train`` runs any of them (plus bf16 mixed precision, CPU offload, meta-device init with
weights broadcast from rank 0, and a sharded ``torch.distributed.checkpoint`` save/resume)
and returns the global-batch losses and the bytes this rank holds.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from course_lib.distributed import mean_over_ranks
from course_lib.memory import estimate_model_state
from course_lib.train import forward_loss, train_step

STRATEGIES = {"full": "FULL_SHARD", "grad_op": "SHARD_GRAD_OP", "no_shard": "NO_SHARD", "hybrid": "HYBRID_SHARD"}


def lm_batch(step: int, global_batch: int, seq: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """The global batch of step ``step``: learnable token rows (each token = previous + 7, mod vocab).

    A function of the step alone, so a resumed run sees exactly the batches it would have seen.
    """
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    start = torch.randint(0, vocab, (global_batch, 1), generator=g)
    return (start + 7 * torch.arange(seq)) % vocab


def make_mesh(strategy: str, shard_size: int | None = None, device_type: str | None = None):
    """The DeviceMesh of a strategy over the whole world (see the module's table)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    device_type = device_type or _device().type
    if strategy in ("full", "grad_op"):
        return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
    if strategy == "no_shard":
        shard_size = 1
    elif strategy == "hybrid":
        shard_size = shard_size or max(1, world // 2)  # two "nodes" unless told
        if world % shard_size:
            raise ValueError(f"shard_size={shard_size} must divide the world size {world}")
    else:
        raise ValueError(f"strategy={strategy!r}: use one of {sorted(STRATEGIES)}")
    return init_device_mesh(device_type, (world // shard_size, shard_size), mesh_dim_names=("replicate", "shard"))


def shard_model(model: nn.Module, mesh, *, reshard_after_forward: bool = True, mixed_precision: str | None = None,
                offload: bool = False) -> nn.Module:
    """Wrap a Llama with ``fully_shard``: the embedding, each decoder layer, the LM head, then the root.

    One unit per transformer block is accelerate's ``TRANSFORMER_BASED_WRAP`` with
    ``LlamaDecoderLayer``: only one block's full weights exist at a time. ``mixed_precision``
    ("bfloat16") computes in bf16 and reduces gradients in float32 over float32 shards;
    ``offload`` keeps shards, gradients and the optimizer step on the CPU.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kw = dict(mesh=mesh, reshard_after_forward=reshard_after_forward)
    if mixed_precision:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=getattr(torch, mixed_precision), reduce_dtype=torch.float32)
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    for unit in (model.model.embed_tokens, *model.model.layers, model.lm_head):
        fully_shard(unit, **kw)
    fully_shard(model, **kw)
    return model


def local_bytes(tensors) -> int:
    """Bytes this rank really holds for these tensors: a DTensor counts its local shard only."""
    from torch.distributed.tensor import DTensor

    total, seen = 0, set()
    for t in tensors:
        if t is None or id(t) in seen or t.dim() == 0:  # skip Adam's scalar step counters
            continue
        seen.add(id(t))
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def _device(device: str | None = None) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _build(preset: str, seed: int, meta_init: bool, shard, device: torch.device) -> tuple[nn.Module, int]:
    """Build and shard; with ``meta_init`` only rank 0 materialises weights, the others get them by broadcast.

    Returns the model and the bytes of full (unsharded) weights this rank built on the way.
    """
    from course_lib.models import build_llama, empty_llama

    if not meta_init:
        model = build_llama(preset, seed=seed, device=device)
        built = local_bytes(model.parameters())  # every rank holds a full copy before sharding
        return shard(model), built
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full = build_llama(preset, seed=seed, device=device).state_dict() if dist.get_rank() == 0 else {}  # one full copy, on rank 0
    model = shard(empty_llama(preset))  # shapes only: sharding a meta model allocates nothing
    model.to_empty(device=device)  # allocate this rank's shards, uninitialised
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    rot = model.model.rotary_emb  # non-persistent buffers are not in a state dict: recompute them
    with device:
        fresh = type(rot)(config=model.config)
    for name, buf in fresh.named_buffers():
        getattr(rot, name).copy_(buf)
    return model, sum(t.numel() * t.element_size() for t in full.values())


def _state_dicts(model, opt):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def train(preset: str = "tiny", steps: int = 5, strategy: str = "full", mixed_precision: str | None = None,
          offload: bool = False, meta_init: bool = False, checkpoint_dir: str | None = None, resume: bool = False,
          stop_after: int | None = None, shard_size: int | None = None, seed: int = 0, batch: int = 4,
          seq: int = 32, lr: float = 3e-3, device: str | None = None) -> dict:
    """Train a Llama preset with FSDP2 over this process group (or, ``strategy="single"``, one plain process).

    Each rank trains on its slice of every global batch; the reported loss is the global
    batch's. ``stop_after=k`` saves a DCP checkpoint to ``checkpoint_dir`` after step k and
    stops; ``resume=True`` loads it and continues to ``steps``. Bytes are this rank's local
    shards: weights at rest, weights present between forward and backward, gradients, Adam states.
    """
    from course_lib.models import llama_config, llama_num_parameters

    single = strategy == "single"
    dev = _device(device)  # None: this rank's GPU if there is one, else the CPU
    world, rank = (1, 0) if single else (dist.get_world_size(), dist.get_rank())
    if batch % world:
        raise ValueError(f"batch={batch} does not divide by the world size {world}")
    if single:
        model, built = _build(preset, seed, False, lambda m: m, dev)
        mesh_shape = [1]
    else:
        mesh = make_mesh(strategy, shard_size, dev.type)
        mesh_shape = list(mesh.shape)
        model, built = _build(preset, seed, meta_init, lambda m: shard_model(
            m, mesh, reshard_after_forward=strategy != "grad_op", mixed_precision=mixed_precision, offload=offload), dev)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    n_params = llama_num_parameters(llama_config(preset))
    measured: dict[str, int] = {}

    def loss_fn(m, x, y):  # forward, then note what weights are resident until backward
        loss = forward_loss(m, x, y)
        measured["weights_in_backward"] = local_bytes(m.parameters())
        return loss

    opt.register_step_pre_hook(lambda *a: measured.update(gradients=local_bytes(p.grad for p in model.parameters())))
    start = 0
    if resume:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = _state_dicts(model, opt)
        state["step"] = torch.zeros((), dtype=torch.long)
        dcp.load(state, checkpoint_id=checkpoint_dir)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = int(state["step"])
    losses = []
    local = batch // world
    for step in range(start, steps):
        tokens = lm_batch(step, batch, seq, model.config.vocab_size, seed)[rank * local:(rank + 1) * local]
        out = train_step(model, opt, tokens, tokens, loss_fn=loss_fn)
        losses.append(mean_over_ranks(out["loss"], dev))  # equal shards: the global batch's loss
        if stop_after is not None and step + 1 == stop_after:
            import torch.distributed.checkpoint as dcp

            state = _state_dicts(model, opt)
            state["step"] = torch.tensor(step + 1)
            dcp.save(state, checkpoint_id=checkpoint_dir)  # every rank writes its own shards
            break
    params = list(model.parameters())
    held = {"weights": local_bytes(params), "weights_in_backward": measured.get("weights_in_backward", 0),
            "gradients": measured.get("gradients", 0),
            "optimizer states": local_bytes(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v))}
    held["total"] = held["weights"] + held["gradients"] + held["optimizer states"]
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in params]  # a collective: all ranks
    layer = model.model.layers[0].mlp.gate_proj.weight
    return {"rank": rank, "world_size": world, "strategy": strategy, "mesh_shape": mesh_shape,
            "start_step": start, "losses": losses, "bytes": held, "full_bytes": estimate_model_state(n_params),
            "n_params": n_params, "full_weights_built": built, "digest": float(sum(p.detach().double().abs().sum() for p in full)),
            "layer_placements": [str(pl) for pl in getattr(layer, "placements", [])]}


def sweep(rank: int | None = None, world_size: int | None = None, runs: list[dict] = ()) -> dict:
    """Several ``train`` runs in one process group: for ``launch(..., kwargs={"runs": [...]})`` and
    ``run_forked(sweep, 2, runs)`` alike (process start-up is the slow part on a CPU)."""
    out = {"rank": dist.get_rank(), "runs": [train(**r) for r in runs]}
    dist.barrier()  # no rank tears the group down while another still uses it
    return out
