"""Notebook 09's hidden tests (instructor edition only): ZeRO-1 by hand on 3 ranks (rank 0 the grader's; padding),
with SGD and momentum in two groups under StepLR and a frozen parameter, a checkpoint of each rank's shard resumed,
the bytes a step sends (DDP's), the state bytes on 3 ranks and DeepSpeed's stage 1 on the same batches; more
configs, offload and a batch that does not divide."""

from __future__ import annotations

import copy
import functools
import random
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_grader.checks import case_seed, number, packed, peer_port, register, student, unpacked
from course_lib.parallel import zero_deepspeed
from course_grader.checks.nb09 import (ADAMW, OPTIMIZERS, SGD, SHARDED, cnn, ddp_whole, finite_numbers, groups,
                                    halving, images, judge_resumed, judge_sharded, judge_traffic, my_config,
                                    one_process, sharded_probe, trains)
from course_grader.grading import forbid, max_abs_diff, params, worst
from course_grader.peer import Peer, Wire
from course_lib.distributed import CollectiveBytes
from course_lib.launch import on_ranks, run_forked
from course_lib.parallel.zero_deepspeed import ZeroRun, check_batch_arithmetic

# no clipping: a contract of its own
ZERO_KW = dict(steps=2, global_batch=16, accum_steps=1, width=8, clip_norm=0.0)


def zero_seed() -> int:
    """The weights and batches of the run beside DeepSpeed's stage 1: new to every grading (``case_seed``)."""
    return case_seed("nb09", "zero train")


def sharded_case(name: str) -> dict:
    """The SmallCNN's weights' and the images' seeds of a case, new to every grading (``case_seed``)."""
    return {"seed": case_seed("nb09", name, "weights"), "data_seed": case_seed("nb09", name, "data")}


# ---------------------------------------------------------------- ShardedOptimizer, as the grader's rank 0 sees it
# Rank 0 of a wired group is the grader's: its part of every global batch is drawn at grading (``images``' secret),
# so the student's ranks step their slices right only with the gradients the reduce-scatter brought. It plays the
# contract's collectives (per step: one reduce-scatter per group, its own slice stepped, one all-gather per group;
# where the probe resumes a checkpoint, the all-reduce of "did a rank fail to load" and the remaining steps again)
# and records each all-gather's flat buffer: every rank's slice of the updated weights.
def secret_seed(name: str) -> int:
    """The seed of rank 0's images in check ``name``: new to every grading (``case_seed``)."""
    return case_seed("nb09", name, "rank 0's images")


def trainable(model: torch.nn.Module, kw: dict) -> list[list[torch.nn.Parameter]]:
    """Each of ``groups``' parameters that need a gradient: what one flat buffer of a group holds."""
    return [[p for p in g["params"] if p.requires_grad] for g in groups(model, kw)]


def play_zero(wire: Wire, n: int, steps: int, opt_name: str, kw: dict, frozen: bool, seed: int, data_seed: int,
              secret: int, resume_at: int | None = None) -> None:
    """Rank 0's side of ``sharded_probe`` (the grader's): its micro-batch of ``images(..., (world, secret))``, its
    slice of each group's flat buffer stepped by ``opt_name``, every collective of the contract in turn."""
    world = dist.get_world_size()
    model = cnn(frozen, seed)
    per_group = trainable(model, kw)
    flats = [torch.cat([p.detach().reshape(-1) for p in ps]) for ps in per_group]
    sizes = [-(-f.numel() // world) for f in flats]
    shards = [F.pad(f, (0, k * world - f.numel()))[:k].float().clone() for f, k in zip(flats, sizes)]
    opt = OPTIMIZERS[opt_name]([{**{k: v for k, v in g.items() if k != "params"}, "params": [shard]}
                                for g, shard in zip(groups(model, kw), shards)], **kw)
    sched = halving(opt)
    x, y = images(n, steps, data_seed, (world, secret))
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def step(s: int, phase: str) -> None:
        F.cross_entropy(model(x[s * n:(s + 1) * n][:n // world]), y[s * n:(s + 1) * n][:n // world]).backward()
        for g, (ps, shard) in enumerate(zip(per_group, shards)):
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in ps])
            mine = flat.new_empty(shard.numel())
            scatter(mine, F.pad(flat, (0, shard.numel() * world - flat.numel())))
            shard.grad = mine / world
        opt.step()
        with torch.no_grad():
            for g, (ps, shard) in enumerate(zip(per_group, shards)):
                full = shard.new_empty(shard.numel() * world)
                gather(full, shard)
                wire.record("gathered", phase=phase, step=s, group=g, values=full.clone())
                offset = 0
                for p in ps:
                    p.copy_(full[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
        model.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        sched.step()

    saved = None
    for s in range(steps):
        step(s, "train")
        if s == resume_at:
            saved = copy.deepcopy((model.state_dict(), [t.clone() for t in shards], opt.state_dict(),
                                   sched.state_dict()))
    if saved is None:
        return
    failed = torch.zeros(1)
    dist.all_reduce(failed)
    wire.record("resume", failed=float(failed))
    if failed.item() == 0:
        model.load_state_dict(saved[0])
        for shard, kept in zip(shards, saved[1]):
            shard.copy_(kept)
        opt.load_state_dict(saved[2])
        sched.load_state_dict(saved[3])
        for s in range(resume_at + 1, steps):
            step(s, "resumed")


def check_zero_wire(events: list, label: str, world: int, n: int, steps: int, opt_name: str, kw: dict,
                    frozen: bool, seed: int, data_seed: int, secret: int, resume_at: int | None = None) -> None:
    """What reached the grader's rank 0 in each all-gather is every rank's slice of the weights that DDP with a whole
    optimizer has after that step, on the same batches (rank 0's part of them drawn at grading); after a resume, the
    same weights again."""
    ref = ddp_whole(world, n, steps, opt_name, tuple(sorted(kw.items())), frozen, seed, data_seed, (world, secret))[0]
    model = cnn(frozen, seed)
    names = {id(p): k for k, p in model.named_parameters()}
    per_group = [[names[id(p)] for p in ps] for ps in trainable(model, kw)]
    got = {(e["phase"], e["step"], e["group"]): e["values"] for e in events if e["what"] == "gathered"}
    start = next((e for e in events if e["what"] == "resume"), None)
    phases = [("train", range(steps))] + ([] if resume_at is None else [("resumed", range(resume_at + 1, steps))])
    for phase, todo in phases:
        for s in todo:
            for g, keys in enumerate(per_group):
                if (phase, s, g) not in got:
                    raise AssertionError(f"{label}, {phase} step {s}: {zero_stopped(per_group, world, g)}")
                want = torch.cat([ref[s][k].reshape(-1) for k in keys])
                k = -(-want.numel() // world)
                values = got[phase, s, g][:want.numel()]
                scale = float(want.abs().max()) + 1e-12
                gaps = [float((values[r * k:(r + 1) * k] - want[r * k:(r + 1) * k]).abs().max()) / scale
                        for r in range(world)]
                worst_rank = max(range(world), key=lambda r: gaps[r])
                assert gaps[worst_rank] < 1e-5, (
                    f"{label}, {phase} step {s}: group {g}'s weights, as the grader's rank 0 gathered them, differ "
                    f"from DDP's with a whole {opt_name} in rank {worst_rank}'s slice (max rel. diff "
                    f"{gaps[worst_rank]:.1e}): " + (
                        "rank 0's own slice is stepped with the gradients your ranks reduce-scattered: average the "
                        "whole flat buffer of the group's gradients" if worst_rank == 0 else
                        "step your slice with the average of the ranks' gradients, with the group's current "
                        "hyperparameters"))
        if phase == "train" and resume_at is not None:
            assert start is not None and start["failed"] == 0, \
                f"{label}: a rank could not load its checkpoint, so no rank resumed"


def zero_stopped(per_group: list, world: int, g: int) -> str:
    """Why rank 0 never gathered group ``g``'s weights: where a collective stopped, the contract's order."""
    return (f"the grader's rank 0 reduce-scattered each group's flat gradients, stepped its slice and all-gathered "
            f"group {g}'s weights ({len(per_group[g])} parameters in one flat buffer, padded to a multiple of "
            f"{world}), and your rank's collectives did not match: after backward, one reduce-scatter per group, in "
            "order, then the wrapped optimizer's step, then one all-gather per group")


# ---------------------------------------------------------------- ShardedOptimizer
# SGD's round has the grader's rank 0 (3 ranks). AdamW's runs the student's 3 ranks alone: its update of a near-zero
# gradient is that gradient's sign, so two orders of the same sum can step a weight two ways, and its weights are
# compared with no reference (its frozen bias and its state's bytes are).
def play_sharded(wire: Wire, round: int) -> None:
    play_zero(wire, 24, 3, *SGD, True, secret=secret_seed("hidden sgd"), resume_at=0, **sharded_case("sgd"))


def probe_sharded(ns: dict) -> dict:
    space, seed = student(ns, "ShardedOptimizer"), zero_seed()  # an int here: a spawned rank has no grading seed

    def yours_in_zero_train():
        warnings.filterwarnings("ignore", category=FutureWarning)
        torch.set_num_threads(1)
        with forbid(*SHARDED, namespace=space):
            run = zero_deepspeed.train(ZeroRun(engine="zero1", **ZERO_KW, seed=seed), make_optimizer=lambda ps: space[
                "ShardedOptimizer"](ps, torch.optim.AdamW, lr=1e-3, weight_decay=0.01))
        return packed([number(v) for v in run["losses"]])

    return {"sgd": sharded_probe(ns, 2, 24, 3, *SGD, True, resume_at=0, join=peer_port("test_ShardedOptimizer_hidden"),
                                 **sharded_case("sgd")),
            "adamw": sharded_probe(ns, 3, 24, 3, *ADAMW, True, **sharded_case("adamw")),
            "zero_train": unpacked(run_forked(yours_in_zero_train, 2, timeout=30)[0]),
            "bf16": probe_bf16(space)}


# A bf16 model: the shard is its fp32 master, and one reduce-scatter and one all-gather move a step's group
BF16 = dict(steps=6, lr=1e-3, rows=4)


def bf16_seeds() -> dict:
    """The bf16 layer's weights' seed and its batches' (rank r's: ``data_seed + r``), new to every grading."""
    return {"seed": case_seed("nb09", "bf16 weights"), "data_seed": case_seed("nb09", "bf16 data")}


def bf16_case(rank: int, seed: int, data_seed: int) -> tuple[torch.nn.Linear, torch.Tensor]:
    """A bf16 linear layer, the same on every rank, and rank's batch: multiples of 1/8 up to 1, 4 rows, so every
    gradient of ``layer(x).sum()`` is exact in bf16 (sums of x's rows; the row count) and the same at every step,
    whatever the seeds."""
    torch.manual_seed(seed)
    layer = torch.nn.Linear(16, 8).to(torch.bfloat16)
    g = torch.Generator().manual_seed(data_seed + rank)
    return layer, torch.randint(0, 9, (BF16["rows"], 16), generator=g).to(torch.bfloat16) / 8


def probe_bf16(space: dict) -> list:
    seeds = bf16_seeds()  # ints here: a spawned rank has no grading seed

    def run():
        torch.set_num_threads(1)
        layer, x = bf16_case(dist.get_rank(), **seeds)
        with forbid(*SHARDED, namespace=space):
            opt = space["ShardedOptimizer"](layer.parameters(), torch.optim.SGD, lr=BF16["lr"])
        calls = []
        for _ in range(BF16["steps"]):
            layer(x).sum().backward()
            with forbid(*SHARDED, namespace=space), CollectiveBytes() as sent:
                opt.step()
                opt.zero_grad(set_to_none=True)
            calls.append(dict(sent.calls_by_kind))
        return packed({"weights": params(layer), "calls": calls})

    return [unpacked(r) for r in run_forked(run, 2, timeout=30)]


def bf16_reference() -> dict:
    """What ZeRO with fp32 masters gives: each step the master (the bf16 start, in fp32) moves by lr times the two
    ranks' average gradient; the bf16 weights are its rounding."""
    grads, seeds = [], bf16_seeds()
    for rank in range(2):
        layer, x = bf16_case(rank, **seeds)
        layer(x).sum().backward()
        grads.append({k: p.grad for k, p in layer.named_parameters()})
    layer, _ = bf16_case(0, **seeds)
    out = {}
    for k, p in layer.named_parameters():
        master, average = p.detach().float(), ((grads[0][k] + grads[1][k]) / 2).float()
        for _ in range(BF16["steps"]):
            master.add_(average, alpha=-BF16["lr"])
        out[k] = master.to(torch.bfloat16)
    return out


def judge_bf16(runs: list) -> None:
    ref = bf16_reference()
    assert len(runs) == 2, f"{len(runs)} ranks' runs of the bf16 model, expected 2"
    for r, run in enumerate(runs):
        assert len(run["calls"]) == BF16["steps"], \
            f"rank {r}: the collectives of {len(run['calls'])} steps of the bf16 model, expected {BF16['steps']}"
        for s, calls in enumerate(run["calls"]):
            assert calls == {"reduce_scatter": 1, "all_gather": 1}, (
                f"a bf16 model in one group, rank {r}, step {s}: your step ran {calls}. One flat buffer per group: "
                "one reduce-scatter of its gradients, one all-gather of its weights, whatever the number of tensors")
        weights = run["weights"]
        assert set(weights) == set(ref), f"rank {r}: the weights of {sorted(weights)}, expected {sorted(ref)}"
        for k, want in ref.items():
            got = weights[k]
            assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16 and got.shape == want.shape, \
                f"rank {r}: {k} is no longer the model's bf16 tensor of shape {tuple(want.shape)}"
            off = (got != want).float().mean().item()
            assert off <= 0.05, (
                f"a bf16 model, SGD at lr {BF16['lr']}, {BF16['steps']} steps, rank {r}: {off:.0%} of {k} differ from "
                "the bf16 rounding of an fp32 master. Each update is smaller than bf16 can add to a weight; the shard "
                "must be a float32 copy (the master), stepped in float32, and the model's weights its rounding")


@functools.lru_cache(maxsize=4)  # bounded: the seed is new to every grading
def deepspeed_stage1(seed: int) -> dict:
    return on_ranks(zero_deepspeed.train, 2, "cpu", timeout=300, spec=ZeroRun(**ZERO_KW, seed=seed, stage=1))[0]


def judge_sharded_hidden(got: dict, wire: list) -> str:
    label, secret = "3 ranks, SGD with momentum in two groups, StepLR, a frozen bias", (3, secret_seed("hidden sgd"))
    check_zero_wire(wire, label, 3, 24, 3, *SGD, True, secret=secret[1], resume_at=0, **sharded_case("sgd"))
    judge_sharded(got["sgd"], label, "one process", 3, 24, 3, *SGD, True, secret=secret, first=1,
                  **sharded_case("sgd"))
    judge_sharded(got["sgd"], label, "DDP with a whole optimizer", 3, 24, 3, *SGD, True, secret=secret, first=1,
                  **sharded_case("sgd"))
    judge_resumed(got["sgd"], label, saved_after=0, nprocs=2)
    ratio = judge_traffic(got["sgd"], 3, True)
    # AdamW decays every weight it steps: a frozen one sharded and stepped (with a zero gradient) moves. (Adam's
    # update of a near-zero gradient is its sign, so the other weights are compared under SGD, above.)
    start = cnn(True, sharded_case("adamw")["seed"]).head.bias.detach()
    # the state's bytes and the trainable count are the model's shapes': any weights' run tells them
    _, full, n_params = one_process(24, 3, ADAMW[0], tuple(sorted(ADAMW[1].items())), True)
    assert len(got["adamw"]) == 3, f"{len(got['adamw'])} ranks' runs with AdamW, expected 3"
    for r, run in enumerate(got["adamw"]):
        assert len(run["weights"]) == 3, f"rank {r}'s weights after {len(run['weights'])} AdamW steps, expected 3"
        for s, weights in enumerate(run["weights"]):
            assert all(torch.isfinite(w).all() for w in weights.values()), f"rank {r}, step {s}: weights not finite"
            moved = max_abs_diff({"head.bias": weights["head.bias"]}, {"head.bias": start})
            assert moved == 0, (f"3 ranks, AdamW with weight decay, rank {r}, step {s}: the frozen bias moved by "
                                f"{moved:.1e}: a parameter that does not require grad takes no part in the shards")
        held = run["state_bytes"]
        assert abs(held / full - 1 / 3) <= 8 * 2 * n_params / full, \
            f"a rank holds {held / full:.3f} of the state on 3 ranks, of a model with a frozen bias"
    judge_bf16(got["bf16"])
    ds = deepspeed_stage1(zero_seed())
    assert len(got["zero_train"]) == len(ds["losses"]), \
        f"zero_train ran {len(got['zero_train'])} steps with your optimizer, expected {len(ds['losses'])}"
    assert worst(abs(a - b) / b for a, b in zip(got["zero_train"], ds["losses"])) < 1e-5, \
        "not DeepSpeed stage 1's losses"
    return (f"3 ranks with SGD, groups, StepLR and a frozen bias, resumed from a checkpoint, {ratio:.3f}x DDP's bytes, "
            "AdamW with a frozen bias and its state's bytes on 3 ranks, DeepSpeed stage 1's losses, and a bf16 model: "
            "fp32 masters, one reduce-scatter and one all-gather per step")


register("test_ShardedOptimizer_hidden", probe_sharded, judge_sharded_hidden, Peer(world=3, play=play_sharded))


# ---------------------------------------------------------------- make_ds_config
def splits() -> tuple[list, tuple]:
    """Three (global batch, micro batch, world size) that divide, one step without accumulation and two with, and
    one global batch that is not a multiple of micro batch x world size: new to every grading (``case_seed``). Every
    world size is 2 or more: a count that leaves the world out is wrong on each."""
    rng = random.Random(case_seed("nb09", "config splits"))
    out = []
    for accum in (1, rng.randint(2, 8), rng.randint(2, 8)):
        micro, world = rng.randint(1, 16), rng.randint(2, 8)
        out.append((micro * accum * world, micro, world))
    micro, world = rng.randint(1, 16), rng.randint(2, 8)
    return out, (micro * world * rng.randint(1, 8) + rng.randint(1, micro * world - 1), micro, world)


def probe_configs(ns: dict) -> dict:
    divides, indivisible = splits()
    made = [my_config(ns, g, m, w, stage=1) for g, m, w in divides]
    # DeepSpeed trains on the offload config on 2 processes: its sizes are the ones that run here, fixed
    offload = my_config(ns, 16, 4, 2, stage=3, offload_optimizer=True)
    try:
        my_config(ns, *indivisible, stage=2)
    except ValueError as err:
        refused = {"raised": "ValueError", "message": str(err)}
    else:
        refused = None
    return {"splits": made, "offload": offload, "refused": refused}


def judge_configs(got: dict) -> str:
    divides, indivisible = splits()
    assert len(got["splits"]) == len(divides), f"{len(got['splits'])} configs for the {len(divides)} splits"
    for (g, m, w), c in zip(divides, got["splits"]):
        finite_numbers(c, f"the config of global_batch={g}, micro_batch={m}, world_size={w}")
        assert (c["train_batch_size"], c["train_micro_batch_size_per_gpu"]) == (g, m), \
            (f"global_batch={g}, micro_batch={m}, world_size={w}: train_batch_size {c['train_batch_size']} and "
             f"train_micro_batch_size_per_gpu {c['train_micro_batch_size_per_gpu']}, expected {g} and {m}")
        check_batch_arithmetic(c["train_batch_size"], c["train_micro_batch_size_per_gpu"],
                               c["gradient_accumulation_steps"], w)
    c = got["offload"]
    finite_numbers(c, "the offload config")
    assert c["zero_optimization"]["stage"] == 3
    assert c["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert trains(c, 2)["global_steps"] == 2
    g, m, w = indivisible
    assert got["refused"] is not None, f"{g} is not a multiple of {m} x {w}: expected ValueError"
    assert "global_batch" in got["refused"]["message"]
    return "other splits, offload, and a batch that does not divide"


register("test_make_ds_config_hidden", probe_configs, judge_configs)
