"""Notebook 08's visible tests: the bytes per rank against a measured FSDP run, the block-by-block wrap on 2 ranks,
and FSDP by hand (``ShardedModule``) on 2 ranks against one process and against ``fully_shard``.

The probes fork real CPU ranks (gloo) that run the student's code and send back plain data; the references that
need ranks (the measured bytes, ``fully_shard``'s gradients) are forked by the judges, from course_lib's own code.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard

import course_lib.distributed as toolkit
from course_grader.checks import number, packed, register, student, unpacked
from course_grader.grading import forbid, worst
from course_lib import memory
from course_lib.data import lm_batch
from course_lib.launch import on_ranks, run_forked
from course_lib.loss import forward_loss
from course_lib.models import build_llama, llama_config, llama_num_parameters
from course_lib.parallel import fsdp

# course_lib's and torch's answers, out of reach while the student's code runs
ESTIMATES = (memory.estimate_model_state, memory.training_bytes_per_param)
HAND = (fsdp.ShardedModule, fsdp.GatherParameter, toolkit.rank_slice, toolkit.gather_slices, fully_shard)


# ---------------------------------------------------------------- shard_state_bytes
def probe_bytes(ns: dict) -> dict:
    """The student's prediction for the tiny Llama on 2 ranks, full and grad_op."""
    n, out = llama_num_parameters(llama_config("tiny")), {}
    for strategy in ("full", "grad_op"):
        with forbid(*ESTIMATES, namespace=ns):
            pred = ns["shard_state_bytes"](n, 2, strategy)
        out[strategy] = ({k: number(v) for k, v in pred.items() if isinstance(k, str)} if isinstance(pred, dict)
                         else repr(pred)[:200])
    return out


@functools.lru_cache(maxsize=None)
def measured_bytes() -> dict:
    """The bytes each part takes on rank 0 of 2 real ranks training the tiny Llama, full and grad_op."""
    runs = on_ranks(fsdp.sweep, 2, "cpu", runs=[dict(strategy=s, steps=1, batch=2, seq=8, device="cpu")
                                                for s in ("full", "grad_op")], timeout=120)
    return {r["strategy"]: dict(r["bytes"]) for r in runs[0]["runs"]}


def judge_bytes(got: dict) -> str:
    for strategy, measured in measured_bytes().items():
        pred = got[strategy]
        assert isinstance(pred, dict), f"{strategy}: return a dict of bytes, not {pred}"
        for k, v in measured.items():
            assert k in pred, f"{strategy}: your dict has no {k!r} (it has {sorted(pred)})"
            assert isinstance(pred[k], (int, float)), f"{strategy}: {k} should be a number, not {pred[k]}"
            assert abs(pred[k] - v) <= 0.01 * v, f"{strategy}: predicted {k}={pred[k]:.0f}, measured {v}"
    return "predictions match the measured bytes for full and grad_op"


register("test_shard_state_bytes", probe_bytes, judge_bytes)

BAD_ARGS = ((dict(strategy="zero3"), "strategy"), (dict(strategy="hybrid"), "shard_size"),
            (dict(strategy="hybrid", shard_size=3), "shard_size"))


def probe_errors(ns: dict) -> list:
    """The message of the ValueError each bad call raised (None where it raised none); another error fails."""
    out = []
    for args, _ in BAD_ARGS:
        try:
            with forbid(*ESTIMATES, namespace=ns):
                ns["shard_state_bytes"](1000, 8, **args)
        except ValueError as err:
            out.append(str(err)[:1000])
        else:
            out.append(None)
    return out


def judge_errors(got: list) -> str:
    for (args, name), message in zip(BAD_ARGS, got, strict=True):
        assert message is not None, f"{args} with world_size=8: expected ValueError"
        assert name in message, f"{args}: the message should name {name}"
    return "bad strategies refused"


register("test_shard_state_bytes_errors", probe_errors, judge_errors)


# ---------------------------------------------------------------- apply_fsdp
def tokens() -> torch.Tensor:
    return lm_batch(0, 4, 16, 512)


def probe_wrap(ns: dict) -> dict:
    """On 2 forked ranks: what the student's wrapping made of the tiny Llama, and its gathered gradients (rank 0's)."""
    space, batch = student(ns, "apply_fsdp"), tokens()

    def wrap():
        rank, world = dist.get_rank(), dist.get_world_size()
        mesh = init_device_mesh("cpu", (world,))
        with forbid(fsdp.shard_model, namespace=space):  # course_lib's wrapping, out of reach
            m = space["apply_fsdp"](build_llama("tiny", seed=0), mesh)
        facts = {"root": isinstance(m, FSDPModule),
                 "layers": all(isinstance(layer, FSDPModule) for layer in m.model.layers),
                 "sharded": all(isinstance(p, DTensor) and p.placements == (Shard(0),)
                                for layer in m.model.layers for p in layer.parameters())}
        forward_loss(m, batch[rank * 2:(rank + 1) * 2]).backward()
        facts["grads"] = {n: p.grad.full_tensor().detach().clone() for n, p in m.named_parameters()}
        dist.barrier()
        return packed(facts)

    return unpacked(run_forked(wrap, 2, timeout=15)[0])


@functools.lru_cache(maxsize=None)
def one_process_grads() -> dict:
    """The tiny Llama's gradients of one process on the whole batch."""
    ref = build_llama("tiny", seed=0)
    forward_loss(ref, tokens()).backward()
    return {n: p.grad.clone() for n, p in ref.named_parameters()}


def judge_wrap(facts: dict) -> str:
    assert facts["root"], "the root model should be an FSDPModule (call fully_shard on it last)"
    assert facts["layers"], "every decoder layer should be its own FSDP unit (call fully_shard on each)"
    assert facts["sharded"], "each layer's parameters should be DTensors sharded (Shard(0)) over the mesh"
    ref, got = one_process_grads(), facts["grads"]
    missing = sorted(set(ref) - set(got))
    assert not missing, f"no gradient for {missing[:5]}: the wrapped model should keep the Llama's parameters"
    for n in ref:
        assert isinstance(got[n], torch.Tensor) and got[n].shape == ref[n].shape, \
            f"{n}: a gradient of shape {tuple(getattr(got[n], 'shape', ()))}, the parameter's is {tuple(ref[n].shape)}"
    gap = worst(float((got[n] - ref[n]).abs().max() / (ref[n].abs().max() + 1e-12)) for n in ref)
    assert gap < 1e-4, f"gradients differ from one process on the global batch by {gap:.1e}"
    return "every block sharded; gradients match one process"


register("test_apply_fsdp", probe_wrap, judge_wrap)


# ---------------------------------------------------------------- ShardedModule
def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def frozen_mlp(frozen: bool, seed: int = 0) -> torch.nn.Module:
    model = mlp(seed)
    if frozen:
        model[0].bias.requires_grad_(False)
    return model


def batches(n: int, steps: int, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n * steps, 6, generator=g), torch.randn(n * steps, 4, generator=g)


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in params if p.requires_grad], lr=0.2, momentum=0.9)


def hand_probe(ns: dict, nprocs: int, n: int, steps: int, frozen: bool = False, seed: int = 0,
               data_seed: int = 5) -> list:
    """The student's ShardedModule around the small MLP (the weights of ``seed``) on ``nprocs`` forked ranks, ``steps``
    SGD steps of a global batch of ``n`` (the data of ``data_seed``): per rank, each step's global loss and shard
    gradients, then the bytes held and the shard sizes."""
    space = student(ns, "ShardedModule", "GatherParameter")

    def hand():
        rank, world = dist.get_rank(), dist.get_world_size()
        warnings.filterwarnings("ignore", category=FutureWarning)
        torch.set_num_threads(1)
        with forbid(*HAND, namespace=space):
            mine = space["ShardedModule"](frozen_mlp(frozen, seed))
        opt = sgd(list(mine.shards))
        x, y = batches(n, steps, data_seed)
        out = {"losses": [], "grads": []}
        for s in range(steps):
            xg, yg = x[s * n:(s + 1) * n], y[s * n:(s + 1) * n]
            local = slice(rank * n // world, (rank + 1) * n // world)
            with forbid(*HAND, namespace=space):
                loss = F.mse_loss(mine(xg[local]), yg[local])
                loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total)
            out["losses"].append(float(total) / world)
            out["grads"].append([None if sh.grad is None else sh.grad.detach().clone() if type(sh.grad) is torch.Tensor
                                 else f"a {type(sh.grad).__name__}" for sh in mine.shards])
            opt.step()
            opt.zero_grad()
        out["held"] = int(sum(t.numel() * t.element_size() for t in list(mine.parameters()) + list(mine.buffers())
                              if not t.is_meta))
        out["shard_sizes"] = [int(t.numel()) for t in mine.shards]
        return packed(out)

    return [unpacked(run) for run in run_forked(hand, nprocs, timeout=30)]


def rank_piece(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s slice of ``t``, flattened and zero-padded to a multiple of ``world`` (ceil(numel / world))."""
    n = -(-t.numel() // world)
    return F.pad(t.reshape(-1), (0, n * world - t.numel()))[rank * n:(rank + 1) * n]


@functools.lru_cache(maxsize=8)  # bounded: the hidden cases' seeds are new to every grading
def one_process(n: int, steps: int, frozen: bool, seed: int = 0, data_seed: int = 5) -> tuple[list, list, list]:
    """The MLP trained by one process on the whole batch: its parameters (name, numel, requires_grad), each step's
    loss, and each step's gradients (None where frozen)."""
    ref = frozen_mlp(frozen, seed)
    opt, (x, y), losses, grads = sgd(ref.parameters()), batches(n, steps, data_seed), [], []
    for s in range(steps):
        loss = F.mse_loss(ref(x[s * n:(s + 1) * n]), y[s * n:(s + 1) * n])
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append([None if p.grad is None else p.grad.detach().clone() for p in ref.parameters()])
        opt.step()
        opt.zero_grad()
    return [(name, p.numel(), p.requires_grad) for name, p in ref.named_parameters()], losses, grads


def fully_shard_run(n: int, steps: int, frozen: bool, seed: int, data_seed: int) -> list:
    """fully_shard's gradients of the same training, this rank's slice of each (None where frozen), per step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    theirs = frozen_mlp(frozen, seed)
    fully_shard(theirs)
    opt, (x, y), out = sgd(theirs.parameters()), batches(n, steps, data_seed), []
    for s in range(steps):
        local = slice(rank * n // world, (rank + 1) * n // world)
        F.mse_loss(theirs(x[s * n:(s + 1) * n][local]), y[s * n:(s + 1) * n][local]).backward()
        out.append([None if q.grad is None else toolkit.rank_slice(q.grad.full_tensor()).clone()
                    for q in theirs.parameters()])
        opt.step()
        opt.zero_grad()
    return packed(out)


@functools.lru_cache(maxsize=8)  # bounded: the hidden cases' seeds are new to every grading
def fsdp_reference(nprocs: int, n: int, steps: int, frozen: bool, seed: int = 0, data_seed: int = 5) -> list:
    runs = run_forked(fully_shard_run, nprocs, dict(n=n, steps=steps, frozen=frozen, seed=seed, data_seed=data_seed),
                      timeout=120)
    return [unpacked(run) for run in runs]


def judge_hand(runs: list, label: str, nprocs: int, n: int, steps: int, frozen: bool = False, seed: int = 0,
               data_seed: int = 5) -> None:
    """Each rank's shard gradients against its slice of one process's and of fully_shard's, and its losses."""
    params, ref_losses, ref_grads = one_process(n, steps, frozen, seed, data_seed)
    theirs = fsdp_reference(nprocs, n, steps, frozen, seed, data_seed)
    assert len(runs) == nprocs, f"{label}: results from {len(runs)} ranks, expected {nprocs}"
    for r, run in enumerate(runs):
        no_grad, bad_size, gaps = False, None, {"one": [], "fsdp": [], "loss": []}
        assert len(run["grads"]) == len(run["losses"]) == steps, \
            f"{label}, rank {r}: {len(run['grads'])} steps' gradients and {len(run['losses'])} losses, expected {steps}"
        for s in range(steps):
            assert len(run["grads"][s]) == len(params), (f"{label}, rank {r}, step {s}: {len(run['grads'][s])} shards, "
                                                         f"the model has {len(params)} parameters: one shard each")
            mine_g, one_g, fsdp_g = [], [], []
            for i, (g, (name, numel, trained)) in enumerate(zip(run["grads"][s], params)):
                if not trained:
                    assert g is None, f"{label}, rank {r}: {name} is frozen: its shard must get no gradient"
                    continue
                if g is None:
                    no_grad = True
                    continue
                assert isinstance(g, torch.Tensor), f"{label}, rank {r}: {name}'s shard gradient is {g}, not a tensor"
                want = rank_piece(ref_grads[s][i], r, nprocs)
                if g.shape != want.shape:
                    size = run["shard_sizes"][i] if i < len(run["shard_sizes"]) else "?"
                    bad_size = (f"{name}: this rank's shard has {size} values, expected ceil({numel} / {nprocs}) = "
                                f"{want.numel()} (pad, then cut in equal slices)")
                    continue
                mine_g.append(g)
                one_g.append(want)
                fsdp_g.append(theirs[r][s][i])
            scale = max([float(t.abs().max()) for t in one_g] + [1e-12])
            gaps["one"].append(worst(float((a - b).abs().max()) for a, b in zip(mine_g, one_g)) / scale)
            gaps["fsdp"].append(worst(float((a - b).abs().max()) for a, b in zip(mine_g, fsdp_g)) / scale)
            gaps["loss"].append(abs(run["losses"][s] - ref_losses[s]) / ref_losses[s])
        assert not no_grad, (f"{label}, rank {r}: a shard got no gradient; gather it with "
                             "GatherParameter.apply(shard, shape) so that backward reaches the shard")
        assert not bad_size, f"{label}, rank {r}: {bad_size}"
        sizes = [-(-numel // nprocs) for _, numel, _ in params]
        assert run["shard_sizes"] == sizes, \
            f"{label}, rank {r}: shard sizes {run['shard_sizes']}, expected ceil(numel / {nprocs}) each: {sizes}"
        for s in range(steps):
            assert gaps["one"][s] < 1e-5, (f"{label}, rank {r}, step {s}: your shard's gradient is not this "
                                           f"rank's slice of one process's ({gaps['one'][s]:.1e})")
            assert gaps["fsdp"][s] < 1e-5, f"{label}, rank {r}, step {s}: not fully_shard's gradient"
            assert gaps["loss"][s] < 1e-5, f"{label}, rank {r}, step {s}: the loss left one process's"


def judge_hand_2(runs: list) -> str:
    judge_hand(runs, "2 ranks", 2, 8, 3)
    return "2 ranks: one process's gradients and losses, and fully_shard's gradients"


register("test_ShardedModule", lambda ns: hand_probe(ns, 2, 8, 3), judge_hand_2)


def full_bytes() -> int:
    return sum(p.numel() * 4 for p in mlp().parameters())


def probe_held(ns: dict) -> list:
    return [{"held": run["held"], "shard_sizes": run["shard_sizes"]} for run in hand_probe(ns, 2, 8, 1)]


def judge_held(runs: list) -> str:
    total, sizes = full_bytes(), [-(-p.numel() // 2) for p in mlp().parameters()]
    assert len(runs) == 2, f"results from {len(runs)} ranks, expected 2"
    for r, run in enumerate(runs):
        assert run["shard_sizes"] == sizes, \
            f"rank {r}: shard sizes {run['shard_sizes']}: each is ceil(numel / world size)"
        assert run["held"] <= total / 2 + 4 * 4, (f"rank {r} holds {run['held']} bytes of a {total}-byte model: keep "
                                                  "only this rank's slices, and move the module to the meta device")
    return f"each rank holds {run['held']} of {total} bytes"


register("test_ShardedModule_bytes", probe_held, judge_held)
