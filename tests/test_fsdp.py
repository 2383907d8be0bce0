"""course_lib.parallel.fsdp and fsdp_torch beyond what notebook 08 measures: accumulation under FSDP2, local byte
counting of DTensors, the mesh's refusals, and batches that are a function of the step (2 forked gloo ranks).

The strategies against one process, bytes per rank, the mixed-precision and offload policies,
meta-device init and the DCP resume are measured by notebook 08 and tested in test_notebook_08.py.
"""

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from course_lib.data import lm_batch
from course_lib.launch import run_forked
from course_lib.models import llama_config, llama_num_parameters
from course_lib.parallel import fsdp, fsdp_torch
from course_lib.parallel.fsdp_torch import FSDPRun


def _accumulate_and_count():
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.device_mesh import init_device_mesh

    from course_lib.memory import tensor_bytes

    world = dist.get_world_size()
    # what FSDP2 calls to reduce-scatter gradients: reduce_scatter_single (torch 2.13), reduce_scatter_tensor (2.7-2.11)
    name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    calls, reduce_scatter = [], getattr(dist, name)

    def counting(*args, **kwargs):
        calls.append(1)
        return reduce_scatter(*args, **kwargs)

    setattr(dist, name, counting)
    once = fsdp_torch.train(FSDPRun(strategy="full", steps=3, batch=8, seq=16, accum_steps=1, device="cpu"))
    counts = [len(calls)]
    accumulated = fsdp_torch.train(FSDPRun(strategy="full", steps=3, batch=8, seq=16, accum_steps=4, device="cpu"))
    counts.append(len(calls) - counts[0])
    mesh = init_device_mesh("cpu", (world,))
    sharded = distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)])
    return {"once": once["losses"], "accumulated": accumulated["losses"], "reduce_scatters": counts,
            "digests": [once["digest"], accumulated["digest"]],
            "dtensor_bytes": tensor_bytes([sharded, sharded]), "weights": once["bytes"]["weights"]}


# First of this module's tests: on torch 2.7 a rank forked after this process has built and torn down gloo groups of
# its own (the in-process tests below), after the pipeline and tensor-parallel modules ran, can hang in fully_shard's
# sharding propagation (every test passes alone); forked first, it does not.
@pytest.mark.parametrize("world", [2, 3])
def test_sharding_by_hand_gives_one_process_and_fully_shard_gradients_with_a_slice_per_rank(world):
    total = sum(p.numel() for p in _mlp().parameters())
    for gaps, held in run_forked(_hand_sharded_against_one_process_and_fully_shard, world, timeout=120):
        assert max(gaps) < 1e-6
        assert total / world <= held <= total / world + 4  # 4 parameters: at most one padding value each


def _traced_step_read(trace_dir):
    """fsdp_torch.trace_step, and its traces read on the rank: pandas stays out of this process, which forks later
    tests."""
    from course_lib import profiling

    out = fsdp_torch.trace_step(trace_dir)
    for how, path in out["paths"].items():
        frame = fsdp_torch.label_step(profiling.read_trace(path))
        out[how] = {"collectives": fsdp_torch.step_collectives(frame).to_dict("records"),
                    **{behind: profiling.hidden(frame, behind=behind, named="all_gather")["share"]
                       for behind in ("compute", "gather_wait")}}
    return out


def test_a_traced_fsdp_step_gathers_each_unit_per_pass_and_prefetch_only_moves_the_issue(tmp_path):
    """On 2 gloo ranks: one all-gather per unit in forward and again in backward for every unit forward resharded,
    one gradient reduction per unit (gloo runs FSDP's reduce-scatter as an all-reduce), backward prefetching by
    default and forward only when asked; the all-gathers block the rank, so none of them runs under a matmul."""
    chain = ["model.embed_tokens", "model.layers.0", "model.layers.1", "lm_head"]
    for r in run_forked(_traced_step_read, 2, dict(trace_dir=str(tmp_path)), timeout=240):
        assert r["units"] == ["root", *chain]
        assert set(chain) <= set(r["resharded"])  # the root too where torch honours reshard_after_forward=True
        for how in ("default", "prefetch"):
            rows = r[how]["collectives"]
            gathers = {p: [c for c in rows if c["name"] == "gloo:all_gather" and c["phase"] == p]
                       for p in ("forward", "backward")}
            assert [c["unit"] for c in gathers["forward"]] == r["units"], how
            assert sorted(c["unit"] for c in gathers["backward"]) == sorted(r["resharded"]), how
            assert [c["unit"] for c in gathers["backward"] if c["unit"] != "root"] == chain[::-1], how
            reductions = [c for c in rows if c["name"] != "gloo:all_gather"]
            assert {c["name"] for c in reductions} == {"gloo:all_reduce"}, how
            assert sorted(c["unit"] for c in reductions) == sorted(r["units"]), how
            assert all(c["phase"] == "backward" for c in reductions), how
            # the gathers whose previous unit computes: layers.1 and lm_head in forward, the 3 below lm_head in backward
            forward, backward = ([c for c in gathers[p] if not math.isnan(c["previous_first_mm_ms"])]
                                 for p in ("forward", "backward"))
            assert [c["unit"] for c in forward] == chain[2:] and [c["unit"] for c in backward] == chain[:-1][::-1]
            if how == "prefetch":  # issued by the previous unit's pre-forward hook, before its first matmul
                assert all(c["prefetch"] and c["issued_ms"] < c["previous_first_mm_ms"] for c in forward), forward
            else:  # issued by the unit's own pre-forward hook, after the previous unit's last matmul
                assert all(not c["prefetch"] and c["issued_ms"] > c["previous_last_mm_ms"] for c in forward), forward
            assert all(c["prefetch"] and c["issued_ms"] < c["previous_first_mm_ms"] for c in backward), backward
            assert r[how]["compute"] < 0.01 and r[how]["gather_wait"] > 0.99, r[how]


def test_accumulation_under_fsdp2_syncs_once_and_equals_the_whole_batch():
    """train_step holds FSDP2's reduce-scatter back (set_requires_gradient_sync) on all but the last micro-batch."""
    ranks = run_forked(_accumulate_and_count, 2, timeout=240)
    for r in ranks:
        # 5 FSDP units (embedding, 2 blocks, LM head, root), 3 steps: without the switch, 4 micro-batches
        # would reduce-scatter 4 times as often
        assert r["reduce_scatters"] == [15, 15], r["reduce_scatters"]
        assert r["accumulated"] == pytest.approx(r["once"], rel=1e-5)
        assert r["digests"][1] == pytest.approx(r["digests"][0], rel=1e-5)
        assert r["dtensor_bytes"] == 4 * 4 * 4  # this rank's 4 of 8 rows, counted once
    assert ranks[0]["weights"] + ranks[1]["weights"] == 4 * llama_num_parameters(llama_config("tiny"))


def test_shard_size_must_divide_the_world():
    from course_lib.distributed import single_process_group

    single_process_group()
    try:
        with pytest.raises(ValueError, match="shard_size=2"):
            fsdp_torch.make_mesh("hybrid", shard_size=2, device_type="cpu")
        with pytest.raises(ValueError, match="strategy='zero3'"):
            fsdp_torch.make_mesh("zero3", device_type="cpu")
    finally:
        dist.destroy_process_group()  # later tests fork ranks from this process


def test_an_offloaded_model_computes_where_its_mesh_says(monkeypatch):
    # FSDP2's CPU offload keeps the shards on the CPU between steps and computes on the mesh's device: on an H200,
    # train_step sent notebook 08's batch to the shards' CPU and the loss met GPU logits. Here the real offloaded
    # shards on a CPU mesh, then the one attribute a GPU rank's mesh has that this one lacks.
    from course_lib.device import compute_device
    from course_lib.distributed import single_process_group
    from course_lib.models import build_llama

    single_process_group()
    try:
        mesh = fsdp_torch.make_mesh("full", device_type="cpu")
        model = fsdp_torch.apply_fsdp(build_llama("tiny"), mesh, FSDPRun(offload=True))
        shard = next(model.parameters())
        assert shard.device.type == "cpu" and shard.device_mesh.device_type == "cpu"
        assert compute_device(model) == torch.device("cpu")
        # what a GPU rank's mesh names while its shards rest on the CPU (a property in newer torch, an attribute in 2.7)
        mesh = shard.device_mesh
        if isinstance(getattr(type(mesh), "device_type", None), property):
            monkeypatch.setattr(type(mesh), "device_type", property(lambda m: "cuda"))
        else:
            monkeypatch.setattr(mesh, "device_type", "cuda")
        assert compute_device(model) == torch.device("cuda")
        assert compute_device(torch.nn.Linear(2, 2)) == torch.device("cpu")
    finally:
        dist.destroy_process_group()


def test_batches_are_a_function_of_the_step():
    a, b = lm_batch(3, 4, 16, 512), lm_batch(3, 4, 16, 512)
    assert a.equal(b) and not a.equal(lm_batch(4, 4, 16, 512))
    assert ((a[:, 1:] - a[:, :-1]) % 512 == 7).all()


def _mlp(seed=0):
    torch.manual_seed(seed)
    # sizes 3 does not divide
    return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5))


def _hand_sharded_against_one_process_and_fully_shard():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mine, ref, theirs = fsdp.ShardedModule(_mlp()), _mlp(), _mlp()
    fully_shard(theirs)
    opts = [torch.optim.SGD(ps, lr=0.1, momentum=0.9) for ps in (mine.shards, ref.parameters(), theirs.parameters())]
    x, y = torch.randn(3 * 6, 7, generator=torch.Generator().manual_seed(1)), torch.randn(3 * 6, 5)
    gaps = []
    for step in range(3):
        xs, ys = x[step * 6:(step + 1) * 6], y[step * 6:(step + 1) * 6]
        local = slice(rank * 6 // world_size, (rank + 1) * 6 // world_size)
        for m in (mine, theirs):
            torch.nn.functional.mse_loss(m(xs[local]), ys[local]).backward()
        torch.nn.functional.mse_loss(ref(xs), ys).backward()
        full = [fsdp.GatherParameter.apply(s.grad, shape) for s, shape in zip(mine.shards, mine.shapes)]
        want = [p.grad for p in ref.parameters()]
        fully = [p.grad.full_tensor() for p in theirs.parameters()]
        gaps.append(max(max(float((a - b).abs().max()) for a, b in zip(full, want)),
                        max(float((a - b).abs().max()) for a, b in zip(full, fully))))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    held = sum(t.numel() for t in mine.parameters() if not t.is_meta)  # the module itself sits on the meta device
    return gaps, held
