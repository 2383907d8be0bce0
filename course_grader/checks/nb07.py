"""Notebook 07's visible tests (DDP's reducer): ``BucketedDDP`` on 2 forked ranks: DDP's gradients step by step,
the buckets and their async all-reduces, the error for a parameter that the forward skipped.

The probes fork real CPU ranks (gloo) that run the student's code and send back plain data; the references that
need ranks (DDP's gradients) are forked by the judges, from torch's and course_lib's own code.
"""

from __future__ import annotations

import functools
import math
import secrets

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from course_grader.checks import outcome, packed, peer_port, register, student, unpacked
from course_grader.peer import Peer, Wire, join_ranks
from course_grader.checks.nb06 import cnn
from course_grader.grading import forbid, grads, max_rel_diff, params
from course_lib.data import synthetic_images
from course_lib.distributed import CollectiveLog
from course_lib.launch import run_forked
from course_lib.models import SmallCNN
from course_lib.parallel import ddp

# course_lib's and torch's answers, out of reach while the student's code runs
BUCKETED_INIT = (ddp.BucketedDDP, ddp.bucket_parameters, ddp.all_reduce_gradients, DDP)
BUCKETED_STEP = (ddp.BucketedDDP, ddp.all_reduce_gradients, DDP)


# ---------------------------------------------------------------- BucketedDDP
CAP = 0.004  # MiB: SmallCNN(width=8) fills 4 buckets under torch's rule, 7 under "close before the cap"
KEEP = ("what", "async_op", "waited")  # what the judges read of an event


def bucketed_probe(ns: dict, nprocs: int, n: int, steps: int, cap: float, seed: int | None = None,
                   frozen: bool = False, data_seed: int = 3, join: int | None = None, gate: bool = False) -> list:
    """Per rank, the student's BucketedDDP trained ``steps`` SGD steps on its part of a global batch of ``n`` (the
    images of ``data_seed``): its buckets (by name), each step's gradients after finish_gradient_synchronization and
    collectives, the weights. ``seed``: rank r starts from the weights of ``seed + r``; None: each from cnn()'s.
    ``join``: the port of the grader's rank 0 (``peer_port``), whose group these ranks join as ranks 1 to ``nprocs``;
    ``gate``: the model's first block waits on rank 0 in backward (``Gate``)."""
    space = student(ns, "BucketedDDP")

    def rank():
        r, world = dist.get_rank(), dist.get_world_size()
        torch.set_num_threads(1)
        x, y = synthetic_images(n * steps, seed=data_seed).tensors
        logs = []
        model = cnn(frozen) if seed is None else seeded(seed + r, frozen)
        if gate:
            model.features[0].register_forward_hook(lambda module, args, out: Gate.apply(out))
        with forbid(*BUCKETED_INIT, namespace=space):
            mine = space["BucketedDDP"](model, bucket_cap_mb=cap)
        names = {id(p): k for k, p in mine.module.named_parameters()}
        for p in mine.module.parameters():  # registered after the student's: marks the moment a gradient is in
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda q: logs[-1].mark("grad"))
        opt = torch.optim.SGD(mine.parameters(), lr=0.1)
        out = {"grads": [], "events": [], "n_buckets": len(mine.buckets),
               "buckets": [[names[id(p)] for p in b] for b in mine.buckets]}
        for s in range(steps):
            xg, yg = x[s * n:(s + 1) * n], y[s * n:(s + 1) * n]
            xs, ys = xg.chunk(world)[r], yg.chunk(world)[r]
            with forbid(*BUCKETED_STEP, namespace=space), CollectiveLog() as log:
                logs.append(log)
                F.cross_entropy(mine(xs), ys).backward()
                mine.finish_gradient_synchronization()
            out["grads"].append(grads(mine.module))
            out["events"].append([{k: e[k] for k in KEEP if k in e} for e in log.events])
            opt.step()
            opt.zero_grad()
        out["weights"] = params(mine.module)
        return packed(out)

    if join is None:
        return [unpacked(run) for run in run_forked(rank, nprocs, timeout=15)]
    return join_ranks(rank, nprocs, port=join)


def seeded(seed: int, frozen: bool) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = SmallCNN(width=8)
    if frozen:
        m.head.bias.requires_grad_(False)
    return m


def reference_rank(n: int, steps: int, frozen: bool, seed: int, data_seed: int) -> bytes:
    """torch's DDP and one process on the global batch, step by step on the same data: each step's gradients. Both
    start from the weights of ``seed`` (rank 0's: DDP broadcasts them)."""
    r, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    theirs, one = DDP(seeded(seed, frozen)), seeded(seed, frozen)
    x, y = synthetic_images(n * steps, seed=data_seed).tensors
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (theirs, one)]
    out = {"ddp": [], "one": []}
    for s in range(steps):
        xg, yg = x[s * n:(s + 1) * n], y[s * n:(s + 1) * n]
        F.cross_entropy(theirs(xg.chunk(world)[r]), yg.chunk(world)[r]).backward()
        F.cross_entropy(one(xg), yg).backward()
        out["ddp"].append(grads(theirs.module))
        out["one"].append(grads(one))
        for o in opts:
            o.step()
            o.zero_grad()
    return packed(out)


@functools.lru_cache(maxsize=8)  # bounded: the hidden cases' seeds are new to every grading
def reference_runs(nprocs: int, n: int, steps: int, frozen: bool, seed: int = 0, data_seed: int = 3) -> list:
    runs = run_forked(reference_rank, nprocs, dict(n=n, steps=steps, frozen=frozen, seed=seed, data_seed=data_seed),
                      timeout=15)
    return [unpacked(run) for run in runs]


def needs_grad(frozen: bool = False) -> list[str]:
    """The names of the parameters of ``cnn(frozen)`` that need a gradient, in the model's order."""
    return [k for k, p in cnn(frozen).named_parameters() if p.requires_grad]


def check_bucketed(runs: list, label: str, nprocs: int, n: int, steps: int, frozen: bool = False, seed: int = 0,
                   data_seed: int = 3, first: int = 0) -> None:
    """The student's ranks ``first`` to ``nprocs - 1`` (``runs``) against torch's DDP on ``nprocs`` ranks."""
    refs = reference_runs(nprocs, n, steps, frozen, seed, data_seed)
    names = needs_grad(frozen)
    assert len(runs) == nprocs - first, f"{label}: results from {len(runs)} ranks, expected {nprocs - first}"
    for r, (run, ref) in enumerate(zip(runs, refs[first:]), start=first):
        flat = [k for bucket in run["buckets"] for k in bucket]
        assert set(flat) <= set(names), (f"{label}, rank {r}: {sorted(set(flat) - set(names))} in your buckets need "
                                         "no gradient: a frozen parameter has no gradient to bucket")
        assert sorted(flat) == sorted(names) and all(run["buckets"]), (
            f"{label}, rank {r}: your buckets hold {flat}: every parameter that needs a gradient goes in one "
            "bucket, once, and no bucket is empty")
        assert len(run["grads"]) == len(run["events"]) == steps, \
            f"{label}, rank {r}: {len(run['grads'])} steps' gradients, expected {steps}"
        for s, (mine, ev) in enumerate(zip(run["grads"], run["events"])):
            a, b = max_rel_diff(mine, ref["ddp"][s]), max_rel_diff(mine, ref["one"][s])
            arrived = sum(e.get("what") == "grad" for e in ev)
            assert arrived == len(names), (f"{label}, rank {r}, step {s}: {arrived} gradients arrived in the "
                                           f"backward, the model has {len(names)} parameters that need one")
            launched = [e for e in ev if e.get("what") == "all_reduce"]
            assert len(launched) == len(run["buckets"]), (f"{label}, rank {r}, step {s}: {len(launched)} "
                                                          f"all-reduce(s) for {len(run['buckets'])} buckets: one "
                                                          "per bucket")
            unwaited = [e for e in launched if not e.get("waited")]
            waits = sum(e.get("what") == "wait" for e in ev)
            assert not unwaited and waits == sum(bool(e.get("async_op")) for e in launched), (
                f"{label}, rank {r}, step {s}: {len(unwaited)} all-reduce(s) never waited on ({waits} waits for "
                f"{len(launched)} launches): call wait() on every handle in finish_gradient_synchronization before "
                "reading it")
            assert a < 1e-5, f"{label}, rank {r}, step {s}: your gradients differ from DDP's (max rel. diff {a:.1e})"
            assert b < 1e-5, f"{label}, rank {r}, step {s}: not one process's gradient on the whole batch ({b:.1e})"
        assert run["weights"].keys() == ref["one"][0].keys(), f"{label}: rank {r}'s weights are not the model's"
        for k, v in run["weights"].items():
            assert (v == runs[0]["weights"][k]).all(), f"{label}: rank {r}'s {k} differs from rank 0's"


def judge_bucketed(runs: list) -> str:
    check_bucketed(runs, "2 ranks", 2, 16, 2)
    return "DDP's gradients on every rank, two steps running"


register("test_BucketedDDP", lambda ns: bucketed_probe(ns, 2, 16, 2, CAP), judge_bucketed)

# ---------------------------------------------------------------- what reaches the grader's rank 0
# The buckets' checks run the student's ranks beside the grader's own rank 0 (``course_grader.peer``), which plays
# the contract's side: DDP's broadcast, then each step torch's buckets, in torch's order, each one all-reduce of its
# gradients flattened. What arrives there is the evidence: a bucket of another size stops gloo, other gradients
# give another sum. ``Gate`` makes overlap evidence too: backward cannot finish the first block until rank 0 has
# the first bucket's sum, and rank 0 all-reduces it only once backward has reached the first block.
FIRST_BLOCK = "features.0."  # the parameters whose gradients come last in backward: after the gate


class Gate(torch.autograd.Function):
    """Identity forward. Backward, where the first block's gradient is about to be computed: tells rank 0 that
    backward got here (a send), waits for its token (a receive, sent once the first bucket's sum has arrived there)
    and scales the gradient by it, so the first block's gradients are right only after the first bucket has left."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        dist.send(torch.ones(1), dst=0)
        token = torch.zeros(1)
        dist.recv(token, src=0)
        return grad * token


def play_ddp(wire: Wire, model: torch.nn.Module, n: int, steps: int, cap: float, data_seed: int, gate: bool) -> None:
    """Rank 0's side of ``bucketed_probe`` (the grader's): broadcast its weights and buffers, then per step its
    gradients on its part of the batch in torch's buckets (``torch_buckets``), one all-reduce each, in order, each
    sum recorded as it arrives; with ``gate``, the first block's gradients times a token drawn now, sent to the
    other ranks once the first bucket's sum is in, after every rank's backward has reached the gate."""
    world = dist.get_world_size()
    for t in [*model.parameters(), *model.buffers()]:
        dist.broadcast(t.data, src=0)
    wire.record("broadcast")
    x, y = synthetic_images(n * steps, seed=data_seed).tensors
    named, buckets = dict(model.named_parameters()), torch_buckets(model, cap)
    arrival: list[str] = []  # the gradients in the order backward gives them: the order the buckets fill in
    for k, p in named.items():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda q, k=k: arrival.append(k))
    if gate:  # the student's graph has a node here: so has this one (autograd's order follows the graph)
        model.features[0].register_forward_hook(lambda module, args, out: out.view_as(out))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(steps):
        arrival.clear()
        F.cross_entropy(model(x[s * n:(s + 1) * n].chunk(world)[0]), y[s * n:(s + 1) * n].chunk(world)[0]).backward()
        if gate:
            token = torch.tensor([1.5 + secrets.randbelow(1000) / 1000])
            for other in range(1, world):
                dist.recv(torch.zeros(1), src=other)
            wire.record("reached", step=s)
            for k, p in named.items():
                if k.startswith(FIRST_BLOCK):
                    p.grad *= token
        filled = sorted(range(len(buckets)), key=lambda i: max(arrival.index(k) for k in buckets[i]))
        for i in filled:
            names = buckets[i]
            flat = torch.cat([named[k].grad.reshape(-1) for k in names])
            wire.record("issued", step=s, bucket=i, numel=flat.numel())
            dist.all_reduce(flat)
            wire.record("arrived", step=s, bucket=i, sum=flat.clone())
            if gate and i == filled[0]:
                for other in range(1, world):
                    dist.send(token, dst=other)
                wire.record("token", step=s, value=float(token))
            for k, g in zip(names, flat.split([named[k].numel() for k in names])):
                named[k].grad.copy_(g.view_as(named[k].grad) / world)
        opt.step()
        opt.zero_grad()


def check_wire(events: list, want: list[dict], buckets: list[list[str]], label: str, gate: bool = False) -> None:
    """What reached rank 0 is the contract's: per step s, torch's ``buckets`` in order, bucket i's sum over the ranks
    = ``want[s]`` (name -> the world's summed gradient) flattened, the first block's gradients times the step's
    token where the gate ran."""
    arrived = {(e["step"], e["bucket"]): e["sum"] for e in events if e["what"] == "arrived"}
    tokens = {e["step"]: e["value"] for e in events if e["what"] == "token"}
    for s, grads_s in enumerate(want):
        for i, names in enumerate(buckets):
            if (s, i) not in arrived:
                raise AssertionError(f"{label}, step {s}: {stopped(events, s, buckets, gate)}")
            scale = {k: tokens.get(s, 1.0) if gate and k.startswith(FIRST_BLOCK) else 1.0 for k in names}
            expected = torch.cat([grads_s[k].reshape(-1) * scale[k] for k in names])
            got = arrived[(s, i)]
            diff = max_rel_diff({"b": got}, {"b": expected}) if got.shape == expected.shape else math.inf
            assert diff < 1e-4, (f"{label}, step {s}: torch's bucket {i} ({names[0]} to {names[-1]}) arrived at the "
                                 "grader's rank 0 as another sum than the ranks' gradients of those parameters, "
                                 f"flattened in that order (max rel. diff {diff:.1e})")


def stopped(events: list, s: int, buckets: list[list[str]], gate: bool) -> str:
    """Why a bucket of step ``s`` never arrived at rank 0, from the last thing rank 0 did."""
    if not any(e["what"] == "broadcast" for e in events):
        return ("the grader's rank 0 broadcast its weights and buffers, as wrapping does, and your rank's collectives "
                "did not match: broadcast every parameter, then every buffer, from rank 0 in __init__")
    if gate and not any(e["what"] == "reached" and e["step"] == s for e in events):
        return ("backward never reached the first block while rank 0 waited: your rank waited on an all-reduce "
                "during backward (rank 0 all-reduces the first bucket only once backward is past it). Keep the "
                "handles; wait in finish_gradient_synchronization")
    issued = [e["bucket"] for e in events if e["what"] == "issued" and e["step"] == s]
    arrived = {e["bucket"] for e in events if e["what"] == "arrived" and e["step"] == s}
    stuck = next((i for i in issued if i not in arrived), issued[-1] if issued else 0)
    names = buckets[stuck]
    if gate and not arrived:
        return (f"torch's first bucket to fill ({names[0]} to {names[-1]}) never reached rank 0 while backward went "
                "on: the first block's gradients wait for it, so a bucket launched after backward never leaves. Fill "
                "buckets in reverse order of module.parameters() and launch each one with dist.all_reduce(..., "
                "async_op=True) from the hook that completes it")
    return (f"rank 0 all-reduced torch's bucket {stuck} ({len(names)} parameters, {names[0]} to {names[-1]}) as it "
            "filled, and your rank's collective there did not match it: another size, another collective, or none")


def play_buckets(wire: Wire, round: int) -> None:
    """Rank 0 of ``test_BucketedDDP_buckets``: cnn()'s weights, one step of 16 images, the cap ``CAP``, gated."""
    play_ddp(wire, cnn(), 16, 1, CAP, 3, gate=True)


def assigned_buckets(ns: dict, cap: float) -> list[list[str]]:
    """The student's buckets of cnn() by name, built on a rank alone: the plainer message where the wire's differs."""
    space = student(ns, "BucketedDDP")

    def rank():
        model = cnn()
        names = {id(p): k for k, p in model.named_parameters()}
        with forbid(*BUCKETED_INIT, namespace=space):
            mine = space["BucketedDDP"](model, bucket_cap_mb=cap)
        return [[names[id(p)] for p in bucket] for bucket in mine.buckets]

    return run_forked(rank, 1, timeout=15)[0]


def probe_buckets(ns: dict) -> dict:
    runs = bucketed_probe(ns, 1, 16, 1, CAP, join=peer_port("test_BucketedDDP_buckets"), gate=True)
    return {"assigned": assigned_buckets(ns, CAP),
            "runs": [run if "stopped" in run else {"events": run["events"]} for run in runs]}


def torch_buckets(model: torch.nn.Module, cap_mb: float) -> list[list[str]]:
    """The contract's buckets of ``model``, by name: torch's reducer's assignment
    (``dist._compute_bucket_assignment_by_size``) over the parameters that need a gradient, in reverse order."""
    named = [(k, p) for k, p in reversed(list(model.named_parameters())) if p.requires_grad]
    # sizes are whole bytes: "reaches cap_mb MiB" is "reaches its ceiling"
    indices, _ = dist._compute_bucket_assignment_by_size([p for _, p in named], [math.ceil(cap_mb * 2**20)])
    return [[named[i][0] for i in bucket] for bucket in indices]


def check_bucket_rule(buckets: list, model: torch.nn.Module, cap_mb: float, label: str) -> None:
    """``buckets`` (parameter names) are torch's (``torch_buckets``): the parameters that need a gradient, in reverse
    order, each bucket closed once its bytes reach the cap. A message says where the first difference is, never the
    whole assignment."""
    nbytes = {k: p.numel() * p.element_size() for k, p in model.named_parameters() if p.requires_grad}
    cap, names = cap_mb * 2**20, list(reversed(nbytes))
    flat = [k for bucket in buckets for k in bucket]
    for i, (mine, want) in enumerate(zip(flat + [None] * len(names), names)):
        assert mine == want, (f"{label}: parameter {i + 1} of your buckets, in order, is {mine or 'missing'}; the "
                              "parameters that need a gradient, in reverse order of module.parameters(), have "
                              f"{want} there")
    assert len(flat) == len(names), f"{label}: your buckets hold {flat[len(names):]} after every parameter"
    assert all(buckets), f"{label}: bucket {[len(b) for b in buckets].index(0)} is empty"
    limit = f"the cap of {cap_mb} MiB ({cap:g} bytes)"
    for i, (mine, want) in enumerate(zip(buckets, torch_buckets(model, cap_mb))):
        if len(mine) < len(want):
            size = sum(nbytes[k] for k in mine)
            raise AssertionError(
                f"{label}: your bucket {i} closes after {mine[-1]} at {size} bytes, below {limit}: a bucket takes "
                f"the next parameter, {want[len(mine)]}, while its bytes are under the cap, even where that "
                "parameter takes it past the cap (torch's rule)")
        if len(mine) > len(want):
            size = sum(nbytes[k] for k in want)
            raise AssertionError(
                f"{label}: your bucket {i} reached {limit} at {want[-1]} ({size} bytes) and took more: a bucket "
                "closes once its bytes reach the cap, with the parameter that reached it inside")
    assert len(buckets) == len(torch_buckets(model, cap_mb)), f"{label}: not torch's buckets"


def judge_buckets(got: dict, wire: list) -> str:
    """The student's buckets by name (its own account: the plainer message), then the wire (rank 0's record, the
    evidence: torch's buckets, their sums, the first one during backward), then its rank's log, for what the wire
    cannot tell: every launch async, no wait before the last one."""
    check_bucket_rule(got["assigned"], cnn(), CAP, f"cap {CAP} MiB")
    ref = reference_runs(2, 16, 1, False)[0]["ddp"][0]
    check_wire(wire, [{k: 2 * g for k, g in ref.items()}], torch_buckets(cnn(), CAP), f"cap {CAP} MiB", gate=True)
    runs = got["runs"]
    assert len(runs) == 1, f"results from {len(runs)} ranks, expected 1"
    assert "stopped" not in runs[0], f"your rank stopped after its buckets had left: {runs[0]['stopped']}"
    for r, run in enumerate(runs, start=1):
        n_buckets = len(got["assigned"])
        assert len(run["events"]) == 1, f"rank {r}: {len(run['events'])} steps' collectives, expected 1"
        ev = run["events"][0]
        launches = [i for i, e in enumerate(ev) if e["what"] == "all_reduce"]
        grads_in = [i for i, e in enumerate(ev) if e["what"] == "grad"]
        waits = [i for i, e in enumerate(ev) if e["what"] == "wait"]
        assert len(grads_in) == len(needs_grad()), (f"rank {r}: {len(grads_in)} gradients arrived in one backward, "
                                                    f"the model has {len(needs_grad())} parameters that need one")
        assert len(launches) == n_buckets, (f"rank {r}: {len(launches)} dist.all_reduce calls in one backward for "
                                            f"{n_buckets} buckets: one per bucket")
        assert all(ev[i]["async_op"] for i in launches), "launch each bucket with dist.all_reduce(..., async_op=True)"
        assert launches[0] < grads_in[-1], ("your first all-reduce started after the last gradient had arrived: "
                                            "launch each bucket from the hook, when its last gradient is in")
        assert len(waits) == n_buckets, (f"rank {r}: {len(waits)} wait(s) for {n_buckets} buckets' all-reduces: wait "
                                         "on every handle once, in finish_gradient_synchronization")
        early = [i for i in waits if i < launches[-1]]
        assert not early, (f"rank {r}: {len(early)} all-reduce(s) waited on before the last bucket was launched: "
                           "a wait during backward holds it up until that sum is back, so communication and "
                           "backward take turns instead of overlapping. Keep the handles; wait in "
                           "finish_gradient_synchronization")
    return ("torch's buckets, one async all-reduce each, the first one during backward, no wait before the last "
            "one has left")


register("test_BucketedDDP_buckets", probe_buckets, judge_buckets, Peer(world=2, play=play_buckets))


class Detour(torch.nn.Module):
    """``cnn()`` and a layer ``spare`` that the forward uses only while ``use_spare`` is set."""

    def __init__(self):
        super().__init__()
        self.body, self.spare, self.use_spare = cnn(), torch.nn.Linear(10, 10), True

    def forward(self, x):
        out = self.body(x)
        return self.spare(out) if self.use_spare else out


def unused_step(mine, space: dict, xs, ys) -> dict:
    """One step of the student's wrapper under the fence: what backward and finish_gradient_synchronization gave,
    as data, and the all-reduces it launched."""
    def step():
        F.cross_entropy(mine(xs), ys).backward()
        mine.finish_gradient_synchronization()

    with forbid(*BUCKETED_STEP, namespace=space), CollectiveLog() as log:
        got = outcome(step)
    got.pop("value", None)  # None, or whatever the student returned: not data the judge reads
    got["launched"] = sum(e["what"] == "all_reduce" for e in log.events)
    return got


def probe_unused(ns: dict) -> list:
    """Per rank and cap (one bucket, many): a step whose forward skips ``spare`` (an error expected), then, on the
    same wrapper, a step that uses every parameter (the all-reduces it launched)."""
    space = student(ns, "BucketedDDP")

    def rank():
        r, world = dist.get_rank(), dist.get_world_size()
        torch.set_num_threads(1)
        x, y = synthetic_images(16, seed=3).tensors
        xs, ys = x.chunk(world)[r], y.chunk(world)[r]
        runs = []
        for cap in (100.0, CAP):
            with forbid(*BUCKETED_INIT, namespace=space):
                made = outcome(space["BucketedDDP"], Detour(), bucket_cap_mb=cap)
            if "raised" in made:
                runs.append({"init": made})
                continue
            mine = made["value"]
            mine.module.use_spare = False
            skipped = unused_step(mine, space, xs, ys)
            mine.module.zero_grad()
            mine.module.use_spare = True
            after = unused_step(mine, space, xs, ys)
            runs.append({"skipped": skipped, "after": after, "n_buckets": len(mine.buckets)})
        return packed(runs)

    return [unpacked(run) for run in run_forked(rank, 2, timeout=15)]


def judge_unused(got: list) -> str:
    # the gradients' values are test_BucketedDDP's: here, the error, and that the next step launches every bucket
    assert len(got) == 2, f"results from {len(got)} ranks, expected 2"
    for r, runs in enumerate(got):
        for cap, run in zip((100.0, CAP), runs, strict=True):
            label = f"rank {r}, bucket_cap_mb={cap}"
            assert "init" not in run, f"{label}: BucketedDDP(...) raised {run.get('init')}"
            skipped, after = run["skipped"], run["after"]
            assert skipped.get("raised") == "RuntimeError", (
                f"{label}: the forward skipped the layer `spare`, so its bucket never filled and was never "
                f"all-reduced, and finish_gradient_synchronization {_said(skipped)}: raise RuntimeError instead")
            for name in ("spare.weight", "spare.bias"):
                assert name in skipped["message"], (f"{label}: the error must name each parameter that got no "
                                                     f"gradient ({name}); it said: {skipped['message'][:300]}")
            assert "body." not in skipped["message"], f"{label}: name only the parameters that got no gradient"
            assert "raised" not in after, (f"{label}: after the error, a step that uses every parameter "
                                           f"{_said(after)}: reset what the hooks recorded before raising")
            assert after["launched"] == run["n_buckets"], (
                f"{label}: after the error, a step that uses every parameter launched {after['launched']} "
                f"all-reduce(s) for {run['n_buckets']} buckets: reset what the hooks recorded before raising")
    return "a skipped parameter is named in a RuntimeError; the next step launches every bucket again"


def _said(got: dict) -> str:
    return f"raised {got['raised']}: {got['message'][:200]}" if "raised" in got else "returned without an error"


register("test_BucketedDDP_unused", probe_unused, judge_unused)
