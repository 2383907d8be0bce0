"""Notebook 08's visible tests: the bytes per rank against a measured FSDP run, the block-by-block wrap on 2 ranks,
and FSDP by hand (``ShardedModule``) against one process and against ``fully_shard``, graded by what reaches the
grader's own rank 0 (``play_hand``) beside the student's rank.

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
from course_grader.checks import case_seed, number, packed, peer_port, register, student, unpacked
from course_grader.grading import forbid, worst
from course_grader.peer import Peer, Wire, join_ranks
from course_lib import memory
from course_lib.data import lm_batch
from course_lib.launch import on_ranks, run_forked
from course_lib.loss import forward_loss
from course_lib.models import build_llama, llama_config, llama_num_parameters
from course_lib.parallel import fsdp, fsdp_torch

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
    runs = [fsdp_torch.FSDPRun(strategy=s, steps=1, batch=2, seq=8, device="cpu") for s in ("full", "grad_op")]
    runs = on_ranks(fsdp_torch.sweep, 2, "cpu", runs=runs, timeout=120)
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
        with forbid(fsdp_torch.apply_fsdp, namespace=space):  # course_lib's wrapping, out of reach
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


def hand_mlp(frozen: bool, seed: int = 0, shift: tuple[int, int] | None = None) -> torch.nn.Module:
    """``frozen_mlp(frozen, seed)``; with ``shift=(world, s)``, rank 0's slice of every parameter (its first
    ceil(numel / world) values) moved by noise drawn from ``s``: the weights of a group whose rank 0 is the
    grader's, which the student's ranks can learn only by gathering them."""
    model = frozen_mlp(frozen, seed)
    if shift is not None:
        world, g = shift[0], torch.Generator().manual_seed(shift[1])
        with torch.no_grad():
            for p in model.parameters():
                n = -(-p.numel() // world)
                p.view(-1)[:n] += 0.5 * torch.randn(n, generator=g)
    return model


def batches(n: int, steps: int, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n * steps, 6, generator=g), torch.randn(n * steps, 4, generator=g)


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in params if p.requires_grad], lr=0.2, momentum=0.9)


def hand_probe(ns: dict, nprocs: int, n: int, steps: int, frozen: bool = False, seed: int = 0,
               data_seed: int = 5, join: int | None = None) -> list:
    """The student's ShardedModule around the small MLP (the weights of ``seed``) on ``nprocs`` forked ranks, ``steps``
    SGD steps of a global batch of ``n`` (the data of ``data_seed``): per rank, each step's global loss and shard
    gradients, then the bytes held and the shard sizes. ``join``: the port of the grader's rank 0 (``peer_port``),
    whose group these ranks join as ranks 1 to ``nprocs`` (``play_hand`` is its side)."""
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

    if join is None:
        return [unpacked(run) for run in run_forked(hand, nprocs, timeout=30)]
    return join_ranks(hand, nprocs, port=join)


def rank_piece(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s slice of ``t``, flattened and zero-padded to a multiple of ``world`` (ceil(numel / world))."""
    n = -(-t.numel() // world)
    return F.pad(t.reshape(-1), (0, n * world - t.numel()))[rank * n:(rank + 1) * n]


@functools.lru_cache(maxsize=8)  # bounded: the hidden cases' seeds are new to every grading
def one_process(n: int, steps: int, frozen: bool, seed: int = 0, data_seed: int = 5,
                shift: tuple[int, int] | None = None) -> tuple[list, list, list, list]:
    """The MLP (``hand_mlp``) trained by one process on the whole batch: its parameters (name, numel,
    requires_grad), each step's loss, each step's gradients (None where frozen), and each step's weights before
    it."""
    ref = hand_mlp(frozen, seed, shift)
    opt, (x, y), losses, grads = sgd(ref.parameters()), batches(n, steps, data_seed), [], []
    weights = []
    for s in range(steps):
        weights.append([p.detach().clone() for p in ref.parameters()])
        loss = F.mse_loss(ref(x[s * n:(s + 1) * n]), y[s * n:(s + 1) * n])
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append([None if p.grad is None else p.grad.detach().clone() for p in ref.parameters()])
        opt.step()
        opt.zero_grad()
    return [(name, p.numel(), p.requires_grad) for name, p in ref.named_parameters()], losses, grads, weights


def fully_shard_run(n: int, steps: int, frozen: bool, seed: int, data_seed: int, shift: tuple | None) -> list:
    """fully_shard's gradients of the same training, this rank's slice of each (None where frozen), per step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    theirs = hand_mlp(frozen, seed, shift)
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
def fsdp_reference(nprocs: int, n: int, steps: int, frozen: bool, seed: int = 0, data_seed: int = 5,
                   shift: tuple[int, int] | None = None) -> list:
    runs = run_forked(fully_shard_run, nprocs, dict(n=n, steps=steps, frozen=frozen, seed=seed, data_seed=data_seed,
                                                    shift=shift), timeout=120)
    return [unpacked(run) for run in runs]


def judge_hand(runs: list, label: str, nprocs: int, n: int, steps: int, frozen: bool = False, seed: int = 0,
               data_seed: int = 5, shift: tuple[int, int] | None = None, first: int = 0) -> None:
    """Each of the student's ranks (``first`` to ``nprocs - 1``; rank 0 is the grader's where ``first`` is 1): its
    shard gradients against its slice of one process's and of fully_shard's, and its losses."""
    params, ref_losses, ref_grads, _ = one_process(n, steps, frozen, seed, data_seed, shift)
    theirs = fsdp_reference(nprocs, n, steps, frozen, seed, data_seed, shift)
    assert len(runs) == nprocs - first, f"{label}: results from {len(runs)} ranks, expected {nprocs - first}"
    assert not any("stopped" in run for run in runs), f"{label}: your ranks stopped after rank 0 had its gradients"
    for r, run in enumerate(runs, start=first):
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


# ---------------------------------------------------------------- ShardedModule, as the grader's rank 0 sees it
# Rank 0 of a wired group is the grader's: it holds its slice of every parameter, moved by noise drawn at grading
# (``hand_mlp``'s shift), so the student's ranks compute the right gradients only from the weights they gathered.
# It plays the contract's collectives in the contract's order (per step: one all-gather per parameter, in
# module.named_parameters() order; one reduce-scatter per trained parameter, in the order autograd reaches their
# gathers; the test's all-reduce of the loss) and records what arrives: the student's ranks' slices of each
# weight, the sum of their gradients' first slice, their losses. (On gloo a reduce-scatter is an all-reduce on the
# wire: which of the two a rank called, the wire cannot tell.)
class Reached(torch.autograd.Function):
    """Identity; backward appends ``index`` to ``order``: where autograd reaches a parameter's gather."""

    @staticmethod
    def forward(ctx, x, index, order):
        ctx.index, ctx.order = index, order
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.order.append(ctx.index)
        return grad, None, None


def shift_seed(name: str) -> int:
    """The seed of rank 0's shifted slices in check ``name``: new to every grading (``case_seed``)."""
    return case_seed("nb08", name, "rank 0's weights")


def play_hand(wire: Wire, n: int, steps: int, frozen: bool, seed: int, data_seed: int, shift: int) -> None:
    """Rank 0's side of ``hand_probe``'s training (the grader's), its weights ``hand_mlp(frozen, seed, (world,
    shift))``: each collective of the contract in turn, and what arrived."""
    world = dist.get_world_size()
    model = hand_mlp(frozen, seed, (world, shift))
    named = [(name, p.shape, p.requires_grad) for name, p in model.named_parameters()]
    shards = [rank_piece(p.detach(), 0, world).clone().requires_grad_(p.requires_grad) for p in model.parameters()]
    module, opt, (x, y) = model.to("meta"), sgd(shards), batches(n, steps, data_seed)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    for s in range(steps):
        leaves, full, order = [], {}, []
        for i, ((name, shape, trained), shard) in enumerate(zip(named, shards)):
            got = shard.new_empty(shard.numel() * world)
            dist.all_gather(list(got.split(shard.numel())), shard.detach())
            wire.record("gathered", step=s, index=i, values=got.clone())
            leaves.append(got[:shape.numel()].view(shape).clone().requires_grad_(trained))
            full[name] = Reached.apply(leaves[-1], i, order) if trained else leaves[-1]
        loss = F.mse_loss(torch.func.functional_call(module, full, (x[s * n:(s + 1) * n][:n // world],)),
                          y[s * n:(s + 1) * n][:n // world])
        loss.backward()
        for i in order:
            flat = F.pad(leaves[i].grad.reshape(-1), (0, shards[i].numel() * world - leaves[i].numel()))
            mine = flat.new_empty(shards[i].numel())
            scatter(mine, flat)
            wire.record("reduced", step=s, index=i, values=mine.clone())
            shards[i].grad = mine / world
        total = loss.detach().clone()
        dist.all_reduce(total)
        wire.record("loss", step=s, sum=float(total))
        opt.step()
        opt.zero_grad()


def check_hand_wire(events: list, label: str, world: int, n: int, steps: int, frozen: bool, seed: int,
                    data_seed: int, shift: int) -> None:
    """What reached the grader's rank 0 is one process's training from the same weights: per step, the other ranks'
    slices of every weight (their shards, stepped), the sum over the ranks of the first slice of every trained
    parameter's gradient (world x one process's), the losses' sum."""
    params, losses, grads, weights = one_process(n, steps, frozen, seed, data_seed, (world, shift))
    got = {(e["what"], e["step"], e.get("index")): e for e in events if e["what"] in ("gathered", "reduced", "loss")}
    for s in range(steps):
        for i, (name, numel, trained) in enumerate(params):
            per = -(-numel // world)
            if ("gathered", s, i) not in got:
                raise AssertionError(f"{label}, step {s}: {hand_stopped(events, params, world, s, i)}")
            want = F.pad(weights[s][i].reshape(-1), (0, per * world - numel))
            values, scale = got["gathered", s, i]["values"], float(want.abs().max()) + 1e-12
            assert values.shape == want.shape, f"{label}, step {s}: {name} gathered as {values.numel()} values"
            for r in range(1, world):
                gap = float((values[r * per:(r + 1) * per] - want[r * per:(r + 1) * per]).abs().max()) / scale
                assert gap < 1e-5, (
                    f"{label}, step {s}: rank {r}'s slice of {name}, as the grader's rank 0 gathered it, is not slice "
                    f"{r} of the weights one process has there (max rel. diff {gap:.1e}): "
                    + ("keep slice r of the flattened parameter, zero-padded to a multiple of the world size" if s == 0
                       else "the shard's optimizer step went wrong: its gradient was not the average slice"))
        for i, (name, numel, trained) in enumerate(params):
            if not trained:
                continue
            if ("reduced", s, i) not in got:
                raise AssertionError(f"{label}, step {s}: {hand_stopped(events, params, world, s, i)}")
            want, values = world * rank_piece(grads[s][i], 0, world), got["reduced", s, i]["values"]
            gap = (float((values - want).abs().max()) / (float(want.abs().max()) + 1e-12)
                   if values.shape == want.shape else float("inf"))
            assert gap < 1e-4, (
                f"{label}, step {s}: the sum over the ranks of slice 0 of {name}'s gradient reached the grader's "
                f"rank 0 as another sum than one process's gradient there (max rel. diff {gap:.1e}): each rank's "
                "gradient comes from the gathered weights, rank 0's slice included, on its own part of the batch")
        if ("loss", s, None) not in got:
            raise AssertionError(f"{label}, step {s}: {hand_stopped(events, params, world, s, None)}")
        loss_sum = got["loss", s, None]["sum"]
        assert abs(loss_sum - world * losses[s]) <= 1e-5 * world * losses[s], \
            f"{label}, step {s}: the ranks' losses sum to {loss_sum:.6g}, not {world} x one process's loss"


def hand_stopped(events: list, params: list, world: int, s: int, i: int | None) -> str:
    """Why rank 0 never saw step ``s``'s collective of parameter ``i`` (None: the loss's), from what it saw last."""
    gathered = {e["index"] for e in events if e["what"] == "gathered" and e["step"] == s}
    name, numel = (params[i][0], params[i][1]) if i is not None else ("the loss", 1)
    per = -(-numel // world)
    if i is not None and i not in gathered:
        return (f"the grader's rank 0 all-gathered {name}'s slices ({per} values from each of {world} ranks), "
                f"parameter {i + 1} of module.named_parameters(), and your rank's collective there did not match: "
                "gather every parameter, in that order, with GatherParameter.apply before running the module")
    if i is not None:
        return (f"the grader's rank 0 reduce-scattered {name}'s gradient ({per * world} values, zero-padded; {per} to "
                "each rank) where backward reached its gather, and your rank's collective there did not match: in "
                "GatherParameter.backward, reduce-scatter the padded, flattened gradient")
    return ("the test all-reduces each step's loss after backward, and rank 0's all-reduce met another collective of "
            "your rank's: one beyond one all-gather per parameter and one reduce-scatter per trained parameter")


def play_hand_2(wire: Wire, round: int) -> None:
    """Rank 0 of ``test_ShardedModule``: the MLP of seed 0, 3 steps of 8 samples."""
    play_hand(wire, 8, 3, False, 0, 5, shift_seed("test_ShardedModule"))


def judge_hand_2(runs: list, wire: list) -> str:
    shift = shift_seed("test_ShardedModule")
    check_hand_wire(wire, "2 ranks", 2, 8, 3, False, 0, 5, shift)
    judge_hand(runs, "2 ranks", 2, 8, 3, shift=(2, shift), first=1)
    return ("2 ranks, rank 0 the grader's: what reached it, and your rank's shard gradients, are one process's and "
            "fully_shard's, step after step")


register("test_ShardedModule", lambda ns: hand_probe(ns, 1, 8, 3, join=peer_port("test_ShardedModule")),
         judge_hand_2, Peer(world=2, play=play_hand_2))


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
