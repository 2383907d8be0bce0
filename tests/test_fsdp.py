"""course_lib.fsdp beyond what notebook 05 measures: accumulation under FSDP2, local byte counting of
DTensors, the mesh's refusals, and batches that are a function of the step (2 forked gloo ranks).

The strategies against one process, bytes per rank, the mixed-precision and offload policies,
meta-device init and the DCP resume are measured by notebook 05 and tested in test_notebook_05.py.
"""

import pytest
import torch
import torch.distributed as dist

from course_lib import fsdp
from course_lib.data import lm_batch
from course_lib.launch import run_forked


def _accumulate_and_count(rank, world):
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.device_mesh import init_device_mesh

    from course_lib.memory import tensor_bytes

    calls, reduce_scatter = [], dist.reduce_scatter_single  # what FSDP2 calls to reduce-scatter gradients

    def counting(*args, **kwargs):
        calls.append(1)
        return reduce_scatter(*args, **kwargs)

    dist.reduce_scatter_single = counting
    once = fsdp.train(strategy="full", steps=3, batch=8, seq=16, accum_steps=1, device="cpu")
    counts = [len(calls)]
    accumulated = fsdp.train(strategy="full", steps=3, batch=8, seq=16, accum_steps=4, device="cpu")
    counts.append(len(calls) - counts[0])
    mesh = init_device_mesh("cpu", (world,))
    sharded = distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)])
    return {"once": once["losses"], "accumulated": accumulated["losses"], "reduce_scatters": counts,
            "digests": [once["digest"], accumulated["digest"]],
            "dtensor_bytes": tensor_bytes([sharded, sharded]), "weights": once["bytes"]["weights"]}


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
    assert ranks[0]["weights"] + ranks[1]["weights"] == 4 * fsdp.llama_num_parameters(fsdp.llama_config("tiny"))


def test_shard_size_must_divide_the_world():
    from course_lib.distributed import single_process_group

    single_process_group()
    try:
        with pytest.raises(ValueError, match="shard_size=2"):
            fsdp.make_mesh("hybrid", shard_size=2, device_type="cpu")
        with pytest.raises(ValueError, match="strategy='zero3'"):
            fsdp.make_mesh("zero3", device_type="cpu")
    finally:
        dist.destroy_process_group()  # later tests fork ranks from this process


def test_batches_are_a_function_of_the_step():
    a, b = lm_batch(3, 4, 16, 512), lm_batch(3, 4, 16, 512)
    assert a.equal(b) and not a.equal(lm_batch(4, 4, 16, 512))
    assert ((a[:, 1:] - a[:, :-1]) % 512 == 7).all()
