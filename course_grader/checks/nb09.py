"""Notebook 09's visible tests: ZeRO-1 by hand (``ShardedOptimizer``, no DDP: it reduce-scatters the gradients
itself) on 2 forked ranks, in two parameter groups under StepLR, against DDP with a whole AdamW, the optimizer-state
share each rank holds, and the DeepSpeed config (DeepSpeed trains with it on 2 processes).

The probes fork real CPU ranks (gloo) that run the student's code and send back plain data (the weights after each
step, the bytes of optimizer state, the config); the references that need ranks (DDP
with a whole optimizer, DeepSpeed's engine) are run by the judges, with course_lib's own code.
"""

from __future__ import annotations

import copy
import functools
import io
import json
import math
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from course_grader.checks import number, outcome, packed, register, student, unpacked
from course_grader.grading import forbid, max_rel_diff, params
from course_grader.peer import join_ranks
from course_lib.data import class_templates, synthetic_images
from course_lib.distributed import CollectiveBytes
from course_lib.launch import on_ranks, run_forked
from course_lib.models import SmallCNN
from course_lib.parallel import zero, zero_deepspeed

SHARDED = (zero.ShardedOptimizer, ZeroRedundancyOptimizer)  # course_lib's and torch's answers, out of reach
CONFIGS = (zero_deepspeed.ds_config,)  # course_lib's config builder, out of reach
STATE_KEYS = ("exp_avg", "exp_avg_sq", "momentum_buffer")
ADAMW = ("AdamW", dict(lr=1e-2, weight_decay=0.01))
SGD = ("SGD", dict(lr=0.1, momentum=0.9))
OPTIMIZERS = {"AdamW": torch.optim.AdamW, "SGD": torch.optim.SGD}


# ---------------------------------------------------------------- ShardedOptimizer
def cnn(frozen: bool, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = SmallCNN(width=8)
    if frozen:
        model.head.bias.requires_grad_(False)
    return model


def groups(model: torch.nn.Module, kw: dict) -> list[dict]:
    """Two parameter groups, the head's at half the learning rate (its bias may be frozen: the optimizer leaves it)."""
    return [{"params": list(model.features.parameters())},
            {"params": list(model.head.parameters()), "lr": kw["lr"] / 2}]


def halving(optimizer) -> torch.optim.lr_scheduler.StepLR:
    """Every probe's scheduler: each step halves every group's learning rate (a sharded optimizer must see it)."""
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def images(n: int, steps: int, seed: int = 2, secret: tuple[int, int] | None = None):
    """``steps`` global batches of ``n`` images, one after the other; with ``secret=(world, s)``, rank 0's part of
    each (its first n / world) drawn from ``s`` instead: the batch of a group whose rank 0 is the grader's, whose
    gradients reach the student's ranks only through the reduce-scatter."""
    x, y = synthetic_images(n * steps, seed=seed).tensors
    if secret is not None:  # the same classes, other draws
        world, g = secret[0], torch.Generator().manual_seed(secret[1])
        templates = class_templates(seed=seed)
        for step in range(steps):
            part = slice(step * n, step * n + n // world)
            y[part] = torch.randint(0, 10, (n // world,), generator=g)
            x[part] = templates[y[part]] + torch.randn(n // world, 3, 32, 32, generator=g)
    return x, y


def state_bytes(optimizer) -> int:
    return int(sum(v.numel() * v.element_size() for st in optimizer.state.values() for k, v in st.items()
                   if k in STATE_KEYS))


def checkpoint(*states) -> bytes:
    """The states as a checkpoint file holds them: written with ``torch.save`` (and read back with ``torch.load``)."""
    buffer = io.BytesIO()
    torch.save(states, buffer)
    return buffer.getvalue()


def sharded_probe(ns: dict, nprocs: int, n: int, steps: int, opt_name: str, kw: dict, frozen: bool = False,
                  resume_at: int | None = None, seed: int = 0, data_seed: int = 2, join: int | None = None) -> list:
    """The student's ShardedOptimizer over a SmallCNN (the weights of ``seed``; no DDP) in two groups with StepLR, on
    ``nprocs`` forked ranks (with ``join``, ranks 1 to ``nprocs`` of the grader's rank 0's group: ``peer_port``),
    ``steps`` steps of a global batch of ``n`` (the images of ``data_seed``): per rank, the weights after each step,
    the bytes of optimizer state, whether .grad was cleared and what the first step sent. ``resume_at=k``: a fresh
    model and optimizer load step k's checkpoint (through a file's bytes) and take the remaining steps: their final
    weights, or what the optimizer's load_state_dict raised and whether its shards require grad."""
    space = student(ns, "ShardedOptimizer")

    def build(model):
        with forbid(*SHARDED, namespace=space):
            opt = space["ShardedOptimizer"](groups(model, kw), OPTIMIZERS[opt_name], **kw)
        return opt, halving(opt)

    def train(model, opt, sched, rank, world_size, todo, record=None):
        x, y = images(n, steps, data_seed)
        for s in todo:
            xg, yg = x[s * n:(s + 1) * n], y[s * n:(s + 1) * n]
            F.cross_entropy(model(xg.chunk(world_size)[rank]), yg.chunk(world_size)[rank]).backward()
            with forbid(*SHARDED, namespace=space), CollectiveBytes() as sent:
                opt.step()
                opt.zero_grad(set_to_none=True)
            sched.step()
            if record is not None:
                record["weights"].append(params(model))
                record.setdefault("calls", sent.calls_by_kind)
                record.setdefault("sent", sent.sent_bytes_by_kind)
                if s == resume_at:
                    record["saved"] = checkpoint(model.state_dict(), opt.state_dict(), sched.state_dict())

    def run():
        rank, world_size = dist.get_rank(), dist.get_world_size()
        warnings.filterwarnings("ignore", category=FutureWarning)  # this rank only: torch deprecates some collectives
        torch.set_num_threads(1)
        model = cnn(frozen, seed)
        opt, sched = build(model)
        record = {"weights": []}
        train(model, opt, sched, rank, world_size, range(steps), record)
        out = {"weights": record["weights"], "state_bytes": state_bytes(opt.optimizer), "calls": record["calls"],
               "sent": record["sent"], "param_grads_cleared": all(p.grad is None for p in model.parameters())}
        if resume_at is not None:
            model_state, opt_state, sched_state = torch.load(io.BytesIO(record["saved"]), weights_only=False)
            again = cnn(frozen, seed)
            again.load_state_dict(model_state)
            opt2, sched2 = build(again)
            with forbid(*SHARDED, namespace=space):
                loaded = outcome(opt2.load_state_dict, opt_state)
            out["load_error"] = None if "value" in loaded else f"{loaded['raised']}: {loaded['message']}"[:500]
            out["shards_require_grad"] = any(getattr(s, "requires_grad", False) for s in getattr(opt2, "shards", []))
            failed = torch.tensor(float(out["load_error"] is not None))
            dist.all_reduce(failed)  # every rank resumes or none does: the steps' collectives need all of them
            if not failed:
                sched2.load_state_dict(sched_state)
                train(again, opt2, sched2, rank, world_size, range(resume_at + 1, steps))
                out["resumed"] = params(again)
        return packed(out)

    return ([unpacked(r) for r in run_forked(run, nprocs, timeout=30)] if join is None
            else join_ranks(run, nprocs, port=join, timeout=15))


@functools.lru_cache(maxsize=8)  # bounded: the hidden cases' seeds are new to every grading
def one_process(n: int, steps: int, opt_name: str, kw: tuple, frozen: bool, seed: int = 0,
                data_seed: int = 2, secret: tuple[int, int] | None = None) -> tuple[list, int, int]:
    """One process on the whole batch, on one thread as a rank runs: the weights after each step, its optimizer's
    state bytes, its trainable count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return one_process_run(n, steps, opt_name, dict(kw), frozen, seed, data_seed, secret)
    finally:
        torch.set_num_threads(threads)


def one_process_run(n: int, steps: int, opt_name: str, kw: dict, frozen: bool, seed: int,
                    data_seed: int, secret: tuple[int, int] | None = None) -> tuple[list, int, int]:
    model = cnn(frozen, seed)
    opt = OPTIMIZERS[opt_name](groups(model, kw), **kw)
    sched = halving(opt)
    (x, y), weights = images(n, steps, data_seed, secret), []
    for s in range(steps):
        F.cross_entropy(model(x[s * n:(s + 1) * n]), y[s * n:(s + 1) * n]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        weights.append(params(model))
    return weights, state_bytes(opt), sum(1 for p in model.parameters() if p.requires_grad)


def whole_run(n, steps, opt_name, kw, frozen, seed, data_seed, secret=None):
    """DDP with a whole optimizer on every rank: this rank's weights after each step."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    model = cnn(frozen, seed)
    net = DDP(model)
    opt = OPTIMIZERS[opt_name](groups(model, kw), **kw)
    sched = halving(opt)
    (x, y), weights = images(n, steps, data_seed, secret), []
    for s in range(steps):
        xg, yg = x[s * n:(s + 1) * n], y[s * n:(s + 1) * n]
        F.cross_entropy(net(xg.chunk(world_size)[rank]), yg.chunk(world_size)[rank]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        weights.append(params(model))
    return packed(weights)


@functools.lru_cache(maxsize=8)  # bounded: the hidden cases' seeds are new to every grading
def ddp_whole(nprocs: int, n: int, steps: int, opt_name: str, kw: tuple, frozen: bool, seed: int = 0,
              data_seed: int = 2, secret: tuple[int, int] | None = None) -> list:
    runs = run_forked(whole_run, nprocs, dict(n=n, steps=steps, opt_name=opt_name, kw=dict(kw), frozen=frozen,
                                              seed=seed, data_seed=data_seed, secret=secret), timeout=120)
    return [unpacked(r) for r in runs]


def judge_sharded(runs: list, label: str, against: str, nprocs: int, n: int, steps: int, opt_name: str, kw: dict,
                  frozen: bool = False, seed: int = 0, data_seed: int = 2, secret: tuple[int, int] | None = None,
                  first: int = 0) -> None:
    """The student's ranks ``first`` to ``nprocs - 1`` (rank 0 the grader's where ``first`` is 1): their weights after
    every step against ``against``'s ("one process" or DDP with a whole optimizer)."""
    key = tuple(sorted(kw.items()))
    if against == "one process":
        refs = [one_process(n, steps, opt_name, key, frozen, seed, data_seed, secret)[0]] * nprocs
    else:
        refs = ddp_whole(nprocs, n, steps, opt_name, key, frozen, seed, data_seed, secret)
    assert not any("stopped" in run for run in runs), f"{label}: your ranks stopped after the grader's rank 0's steps"
    assert len(runs) == nprocs - first, f"{label}: results from {len(runs)} ranks, expected {nprocs - first}"
    for r, run in enumerate(runs, start=first):
        for s in range(steps):
            g = max_rel_diff(run["weights"][s], refs[r][s])
            assert g < 1e-6, (f"{label}, rank {r}, step {s}: the weights differ from {against}'s by {g:.1e} (average "
                              "the gradients over the ranks, and step with the groups' current learning rates)")
        for k, v in run["weights"][-1].items():
            assert (v == runs[0]["weights"][-1][k]).all(), f"{label}: rank {r}'s {k} differs from rank {first}'s"
        assert run["param_grads_cleared"], "zero_grad(set_to_none=True) sets every parameter's .grad to None"


def judge_resumed(runs: list, label: str, saved_after: int, nprocs: int) -> None:
    """Each rank's fresh model and optimizer, resumed from the checkpoint of step ``saved_after``, end where the run
    that never stopped ended; where the given load_state_dict failed, say why."""
    assert len(runs) == nprocs, f"{label}: results from {len(runs)} ranks, expected {nprocs}"
    for r, run in enumerate(runs):
        if run["load_error"] is not None:
            why = (" Your shards require grad (requires_grad_()): autograd refuses to copy into a leaf tensor that "
                   "requires grad in place. A shard needs no autograd: step() gives it its .grad and the wrapped "
                   "optimizer steps it under no_grad, so leave it a plain fp32 tensor."
                   if run["shards_require_grad"] else "")
            raise AssertionError(f"{label}, rank {r}: a fresh optimizer could not load this rank's checkpoint: the "
                                 f"given load_state_dict raised {run['load_error']} (it copies the saved slices into "
                                 f"self.shards in place).{why}")
        gap = max_rel_diff(run["resumed"], run["weights"][-1])
        assert gap < 1e-6, (f"{label}, rank {r}: a fresh model and optimizer that loaded step {saved_after + 1}'s "
                            f"checkpoint (state_dict of this rank's shard) end {gap:.1e} from the run that never "
                            "stopped")


def judge_traffic(runs: list, nprocs: int, frozen: bool) -> float:
    """What a step sent from each rank, against DDP's all-reduce of every gradient: 2 (N-1)/N x 4 bytes per parameter
    (a reduce-scatter and an all-gather send that much together; padding adds a few values)."""
    ddp = 2 * (nprocs - 1) / nprocs * 4 * sum(p.numel() for p in cnn(frozen).parameters() if p.requires_grad)
    for r, run in enumerate(runs):
        sent = sum(run["sent"].values())
        assert run["sent"].get("reduce_scatter"), f"rank {r}'s step ran no reduce-scatter: it sent {run['sent']}"
        assert sent <= 1.01 * ddp, (f"rank {r}'s step sent {sent / ddp:.2f}x what DDP's all-reduce sends "
                                    f"({run['sent']}): one reduce-scatter of the gradients and one all-gather of the "
                                    "weights, nothing more")
    return sent / ddp


def judge_adamw_2(runs: list) -> str:
    judge_sharded(runs, "2 ranks, AdamW in two groups, StepLR", "DDP with a whole optimizer", 2, 16, 3, *ADAMW)
    return "2 ranks: the weights of DDP with a whole AdamW, step after step, learning rates halved by StepLR"


register("test_ShardedOptimizer", lambda ns: sharded_probe(ns, 2, 16, 3, *ADAMW), judge_adamw_2)


def probe_state_2(ns: dict) -> dict:
    """2 ranks, 2 steps: the bytes of optimizer state each rank holds, and the checkpoint of step 1 resumed."""
    runs = sharded_probe(ns, 2, 16, 2, *ADAMW, resume_at=0)
    resume = ("load_error", "shards_require_grad", "resumed")  # what judge_resumed reads, and the last weights
    return {"state": [number(run["state_bytes"]) for run in runs],
            "runs": [{**{k: run[k] for k in resume if k in run}, "weights": run["weights"][-1:]} for run in runs]}


def judge_state_2(got: dict) -> str:
    _, full, n_params = one_process(16, 1, ADAMW[0], tuple(sorted(ADAMW[1].items())), False)
    assert len(got["state"]) == 2, f"the state bytes of {len(got['state'])} ranks, expected 2"
    for r, held in enumerate(got["state"]):
        share = held / full
        slack = 2 * 4 * n_params / full  # padding: a value of m and v per parameter (one per group if flat)
        assert abs(share - 1 / 2) <= slack, (f"rank {r} holds {share:.3f} of AdamW's states on 2 ranks: "
                                             "build the optimizer over this rank's shards only")
    judge_resumed(got["runs"], "2 ranks, AdamW in two groups", saved_after=0, nprocs=2)
    return f"each rank holds {share:.3f} of the optimizer state, and its checkpoint resumes the run"


register("test_ShardedOptimizer_state", probe_state_2, judge_state_2)


# ---------------------------------------------------------------- make_ds_config
def datafied(x):
    """The student's config as plain data: dicts, lists, numbers, strings, bools, None (anything else its repr)."""
    if isinstance(x, dict):
        return {str(k) if not isinstance(k, str) else k: datafied(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [datafied(v) for v in x]
    if x is None or type(x) in (bool, int, float, str):
        return x
    return repr(x)[:200]


def finite_numbers(config, where: str = "the config") -> None:
    """Every number in a config is finite: DeepSpeed takes a NaN or an infinity where a number goes, and trains on."""
    if isinstance(config, dict):
        for k, v in config.items():
            finite_numbers(v, f"{where}[{k!r}]")
    elif isinstance(config, list):
        for i, v in enumerate(config):
            finite_numbers(v, f"{where}[{i}]")
    elif isinstance(config, float):
        assert math.isfinite(config), f"{where} is {config}: every number in a DeepSpeed config is finite"


def my_config(ns: dict, *args, **kwargs):
    with forbid(*CONFIGS, namespace=ns):
        return datafied(ns["make_ds_config"](*args, **kwargs))


def trains(config: dict, steps: int) -> dict:
    """DeepSpeed's engine built from ``config`` on 2 CPU processes, ``steps`` steps (course_lib's loop)."""
    return copy.deepcopy(launched(json.dumps(config, sort_keys=True), steps))


@functools.lru_cache(maxsize=None)
def launched(config: str, steps: int) -> dict:
    return on_ranks(zero_deepspeed.run_config, 2, "cpu", timeout=300, config=json.loads(config),
                    steps=steps)[0]


def judge_config(cfg) -> str:
    assert isinstance(cfg, dict), f"return the config as a dict, not {cfg!r}"
    finite_numbers(cfg)
    assert cfg.get("train_batch_size") == 32 and cfg.get("train_micro_batch_size_per_gpu") == 4
    assert cfg["gradient_accumulation_steps"] == 4, "32 = 4 per rank x 2 ranks x 4 accumulation steps"
    assert type(cfg["gradient_accumulation_steps"]) is int, "gradient_accumulation_steps is a count: an int (use //)"
    assert cfg.get("gradient_clipping") == 1.0, "write the clipping out: \"gradient_clipping\": 1.0"
    optimizer = cfg.get("optimizer")
    assert isinstance(optimizer, dict) and optimizer.get("type") == "AdamW" and \
        isinstance(optimizer.get("params"), dict) and optimizer["params"].get("lr") == 1e-3, \
        f"the optimizer is {optimizer!r:.200}: AdamW at lr 1e-3, as the exercise gives it (torch_adam: True)"
    run = trains(cfg, 3)
    assert run["micro_batch"] == 4 and run["global_steps"] == 3, run
    assert run["losses"][-1] < run["losses"][0] + 0.5, "training with this config went wrong"
    return f"DeepSpeed accepted the config and trained: {[round(loss, 3) for loss in run['losses']]}"


register("test_make_ds_config",
         lambda ns: my_config(ns, global_batch=32, micro_batch=4, world_size=2, stage=2), judge_config)
