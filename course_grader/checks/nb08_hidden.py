"""Notebook 08's hidden tests (instructor edition only): other strategies and world sizes, resharding and a 2-D
mesh, and the hand-made sharding on 3 ranks with a frozen parameter, rank 0 the grader's."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from course_grader.checks import case_seed, number, peer_port, register
from course_grader.checks.nb08 import (ESTIMATES, check_hand_wire, full_bytes, hand_probe, judge_hand as judge_ranks,
                                       play_hand as hand_play, shift_seed, student)
from course_grader.grading import forbid
from course_grader.peer import Peer, Wire
from course_lib.data import lm_batch
from course_lib.launch import run_forked
from course_lib.loss import forward_loss
from course_lib.models import build_llama
from course_lib.parallel import fsdp_torch

# ---------------------------------------------------------------- shard_state_bytes
# (strategy, world size, shard size): the bytes per parameter of each part, on each rank
EXPECT = {("full", 8, None): (0.5, 0.5, 0.5, 1), ("grad_op", 8, None): (0.5, 4, 0.5, 1),
          ("no_shard", 8, None): (4, 4, 4, 8), ("hybrid", 8, 4): (1, 1, 1, 2),
          ("hybrid", 8, 8): (0.5, 0.5, 0.5, 1), ("full", 1, None): (4, 4, 4, 8)}
KEYS = ("weights", "weights_in_backward", "gradients", "optimizer states")


def n_params() -> int:
    """The model's parameter count, new to every grading (``case_seed``): a multiple of 8, so every share is whole."""
    return 8 * (100_000 + case_seed("nb08", "parameter count") % 1_000_000)


def probe_bytes(ns: dict) -> list:
    out, p = [], n_params()
    for s, w, ss in EXPECT:
        with forbid(*ESTIMATES, namespace=ns):
            got = ns["shard_state_bytes"](p, w, s, shard_size=ss)
        out.append({k: number(got[k]) for k in (*KEYS, "total")})
    return out


def judge_bytes(got: list) -> str:
    p = n_params()
    for ((s, w, ss), per_param), mine in zip(EXPECT.items(), got, strict=True):
        wt, wb, g, o = (b * p for b in per_param)
        for k, v in zip(KEYS, (wt, wb, g, o)):
            assert isinstance(mine[k], (int, float)), \
                f"{s}, world {w}, shard_size {ss}: {k} should be a number, not {mine[k]}"
            assert abs(mine[k] - v) < 1e-6 * v, f"{s}, world {w}, shard_size {ss}: {k}={mine[k]}, expected {v}"
        assert isinstance(mine["total"], (int, float)), f"{s}: total should be a number, not {mine['total']}"
        assert abs(mine["total"] - (wt + g + o)) < 1e-6 * mine["total"], \
            f"{s}: total is weights + gradients + optimizer states"
    return "no_shard, hybrid, other world sizes and the totals"


register("test_shard_state_bytes_hidden", probe_bytes, judge_bytes)


# ---------------------------------------------------------------- apply_fsdp
def reshard_seed() -> int:
    """The Llama's weights and the batch: new to every grading (``case_seed``)."""
    return case_seed("nb08", "reshard")


def probe_reshard(ns: dict) -> dict:
    """On 2 forked ranks (rank 0's view): how many blocks held full weights at once, whether each block's weights
    are sharded between forward and backward with and without resharding, and the placements on a 2-D mesh."""
    space, seed = student(ns, "apply_fsdp"), reshard_seed()
    batch = lm_batch(0, 4, 16, 512, seed=seed)

    def reshard():
        world = dist.get_world_size()
        out = {"gathered": []}
        for flag in (True, False):
            with forbid(fsdp_torch.apply_fsdp, namespace=space):
                m = space["apply_fsdp"](build_llama("tiny", seed=seed), init_device_mesh("cpu", (world,)),
                                        reshard_after_forward=flag)
            def count(*a):
                out["gathered"].append(sum(not isinstance(layer.self_attn.q_proj.weight, DTensor)
                                           for layer in m.model.layers))
            hooks = [layer.mlp.register_forward_hook(count) for layer in m.model.layers] if flag else []
            loss = forward_loss(m, batch[:2])
            # between forward and backward: sharded DTensors if resharded, full plain tensors if not
            out[str(flag)] = [isinstance(p, DTensor) for layer in m.model.layers for p in layer.parameters()]
            loss.backward()
            for h in hooks:
                h.remove()
        with forbid(fsdp_torch.apply_fsdp, namespace=space):
            m2 = space["apply_fsdp"](build_llama("tiny", seed=seed),
                                     init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard")))
        out["2d"] = all(p.placements == (Replicate(), Shard(0))
                        for layer in m2.model.layers for p in layer.parameters())
        dist.barrier()  # no rank leaves while another still sets up its groups
        return out

    return run_forked(reshard, 2, timeout=15)[0]


def judge_reshard(o: dict) -> str:
    layers = build_llama("tiny", seed=reshard_seed()).model.layers
    n_params = sum(1 for layer in layers for _ in layer.parameters())
    assert o["gathered"], "no block's forward ran"
    assert len(o["gathered"]) == len(layers), \
        f"{len(o['gathered'])} blocks' forwards ran in one forward of the {len(layers)}-block model"
    assert max(o["gathered"]) == 1, f"{max(o['gathered'])} blocks held full weights at once: wrap each block on its own"
    assert len(o["True"]) == len(o["False"]) == n_params, \
        f"the blocks hold {len(o['True'])} and {len(o['False'])} parameters, the model's blocks {n_params}"
    assert all(o["True"]), "reshard_after_forward=True: the blocks' weights should be sharded again after forward"
    assert not any(o["False"]), "reshard_after_forward=False: the blocks should keep their full weights until backward"
    assert o["2d"], "on a (replicate, shard) mesh the placements should be (Replicate(), Shard(0))"
    return "one block gathered at a time, reshard_after_forward passed on, and a 2-D mesh"


register("test_apply_fsdp_hidden", probe_reshard, judge_reshard)


# ---------------------------------------------------------------- ShardedModule
def hand_case() -> dict:
    """The MLP's weights' and the batches' seeds, new to every grading (``case_seed``)."""
    return {"seed": case_seed("nb08", "hand weights"), "data_seed": case_seed("nb08", "hand data")}


def play_hand(wire: Wire, round: int) -> None:
    """The grader's rank 0 of the 3-rank group: the MLP with a frozen bias, 4 steps of 12 samples."""
    hand_play(wire, 12, 4, True, shift=shift_seed("test_ShardedModule_hidden"), **hand_case())


def judge_hand(runs: list, wire: list) -> str:
    shift = shift_seed("test_ShardedModule_hidden")
    check_hand_wire(wire, "3 ranks, a frozen bias", 3, 12, 4, True, shift=shift, **hand_case())
    judge_ranks(runs, "3 ranks, a frozen bias", 3, 12, 4, True, shift=(3, shift), first=1, **hand_case())
    total = full_bytes()
    for run in runs:
        assert run["held"] <= total / 3 + 4 * 4, f"3 ranks: a rank holds {run['held']} bytes of a {total}-byte model"
    return "3 ranks (rank 0 the grader's), padding, a frozen bias, 4 steps, and 1/3 of the bytes"


register("test_ShardedModule_hidden",
         lambda ns: hand_probe(ns, 2, 12, 4, True, join=peer_port("test_ShardedModule_hidden"), **hand_case()),
         judge_hand, Peer(world=3, play=play_hand))
