"""Every tier's sizes work on every world size the tier can meet.

The gpu tier runs one rank per GPU on whatever the machine has, 1 to 7 GPUs (``docker/run.sh --gpus 0,1,2`` hands
out such subsets), the node tier 8. A size chosen before the world is known (a global batch of 8 or 512, a sequence
of 32 tokens) is rounded to what the world divides where it is used: ``Dims.rounded`` for a batch,
``cp_torch.seq_for`` for torch's context-parallel sequence, ``fsdp_torch.hybrid_shard_size`` for HYBRID_SHARD's mesh.
The odd worlds run here on CPU ranks: 3 ranks through notebook 06's throughput and notebook 08's strategies.
"""

from __future__ import annotations

import json

import pytest

import nbgrading as g
from course_lib.launch import on_ranks
from course_lib.parallel import cp_torch, ddp_torch, fsdp_torch
from course_lib.train import Dims

WORLDS = range(1, 9)


@pytest.mark.parametrize("dp", WORLDS)
def test_a_global_batch_rounds_to_the_nearest_one_the_world_divides(dp):
    for batch in (1, 4, 8, 16, 64, 512, 2048):
        for accum in (1, 2, 4):
            step = dp * accum
            dims = Dims.rounded(batch, dp, accum)
            assert dims.global_batch % step == 0 and (dims.dp, dims.accum_steps) == (dp, accum)
            assert dims.global_batch == (step if batch < step else batch - batch % step), (batch, dp, accum)


@pytest.mark.parametrize("world", WORLDS)
def test_hybrid_meshes_and_torch_cp_sequences_fit_every_world(world):
    shard = fsdp_torch.hybrid_shard_size(world)
    assert world % shard == 0 and (shard == world // 2 if world % 2 == 0 else shard <= max(world // 2, 1))
    seq = cp_torch.seq_for(world)
    assert seq % (2 * world) == 0 and cp_torch.SEQ <= seq < cp_torch.SEQ + 2 * world


@pytest.mark.parametrize("assignment, rounded", [
    ("06_ddp", 'Dims.rounded(size["tp_batch"], n_ranks)'),
    ("08_fsdp", 'Dims.rounded(size["batch"], world)'),
    ("16_context_parallelism", "seq=cp_torch.seq_for(n_torch)"),
])
def test_the_notebooks_round_their_sizes_to_the_world(assignment, rounded):
    """The notebooks whose rank count is the machine's GPUs take their sizes through the rounding, not raw."""
    code = "".join("".join(c["source"]) for c in g.load_solution(assignment)["cells"] if c["cell_type"] == "code")
    assert rounded in code


def test_notebook_06s_throughput_runs_on_an_odd_world():
    batch = Dims.rounded(512, 3).global_batch  # the gpu tier's tp_batch on 3 GPUs
    runs = on_ranks(ddp_torch.throughput, 3, "cpu", timeout=180, global_batch=batch, width=8, steps=1, warmup=0)
    assert len(runs) == 3 and all(r["samples_per_s"] > 0 for r in runs)


def test_notebook_08s_strategies_train_on_an_odd_world():
    batch = Dims.rounded(8, 3).global_batch  # the gpu tier's batch on 3 GPUs
    common = dict(preset="tiny", steps=1, batch=batch, seq=8, seed=0)
    runs = [dict(strategy=s, **common) for s in ("full", "hybrid", "single")]
    ranks = on_ranks(fsdp_torch.sweep, 3, "cpu", timeout=300, runs=runs)
    full, hybrid, single = ranks[0]["runs"]
    assert hybrid["mesh_shape"] == [3, 1], json.dumps(hybrid)[:300]
    assert full["losses"] == pytest.approx(single["losses"], rel=1e-5)
    assert hybrid["losses"] == pytest.approx(single["losses"], rel=1e-5)
