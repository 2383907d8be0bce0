"""The node tier's layout on CPU ranks: ``python -m course_lib.apps.run_all --tier node --emulate``.

Every notebook that launches ranks runs the node tier's world sizes, meshes, micro-batch counts and pipeline
stages, as 8 CPU ranks over gloo at tiny widths, so a node-only shape fails here before it meets a GPU node
(notebook 08's pipeline with fewer micro-batches than its 8 stages did: torch's 1F1B refuses that).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from recorded import ROOT, claim, value
from course_lib import results
from course_lib.apps import run_all
from course_lib.device import EMULATE_NODE_ENV, pick_tier
from course_lib.launch import check_world
from course_lib.notebook import course_setup

SIZES = {"smoke": dict(ranks=2, seq=8), "cpu": dict(ranks=2, seq=16), "gpu": dict(ranks=None, seq=64),
         "node": dict(ranks=8, seq=1024)}


def emulate(notebook: str, out) -> dict:
    """Run one notebook through the CLI, in a process of its own (the CLI sets the emulation's variable)."""
    proc = subprocess.run([sys.executable, "-m", "course_lib.apps.run_all", "--tier", "node", "--emulate", notebook[:2],
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "node (emulated on CPU ranks)" in (out / "summary.md").read_text()
    return results.load(notebook, out)


def test_the_notebooks_that_launch_ranks_are_the_ones_emulated():
    emulated = [p.stem for p in run_all.notebooks() if run_all.emulates_node(p)]
    assert emulated == ["05_input_pipeline", "06_ddp", "08_fsdp", "09_deepspeed_zero", "10_zero_offload",
                        "14_tensor_parallelism", "15_pipeline_parallelism", "16_context_parallelism",
                        "17_expert_parallelism"]


def test_emulation_takes_the_node_layout_and_the_given_widths(monkeypatch):
    monkeypatch.setenv(EMULATE_NODE_ENV, "1")
    assert pick_tier("node") == "node"  # no GPU here: only the emulation lets the node tier through
    setup = course_setup("nb", "node", SIZES, emulate=dict(seq=8))
    assert setup.size == {"ranks": 8, "seq": 8} and setup.device == torch.device("cpu")
    check_world(8, "cpu")  # 8 CPU ranks on 2 cores: refused outside the emulation (below)


def test_emulation_refuses_what_it_cannot_emulate(monkeypatch):
    with pytest.raises(ValueError, match="would only thrash"):
        check_world(4 * (os.cpu_count() or 1), "cpu")
    with pytest.raises(ValueError, match="needs a GPU"):
        pick_tier("node")
    monkeypatch.setenv(EMULATE_NODE_ENV, "1")
    with pytest.raises(ValueError, match="runs on one device"):
        course_setup("00_orientation", "node", SIZES)
    with pytest.raises(ValueError, match=r"\['width'\], which are not node-tier sizes"):
        course_setup("nb", "node", SIZES, emulate=dict(width=8))
    with pytest.raises(SystemExit):
        run_all.main(["--emulate", "--tier", "cpu"])
    with pytest.raises(SystemExit):
        run_all.main(["--emulate", "--tier", "node", "00"])  # notebook 00 launches no ranks


def test_05_runs_8_ranks_loaders(tmp_path):
    res = emulate("05_input_pipeline", tmp_path)
    assert value(res, "rank_loaders_cover") and value(res, "rank_loaders_disjoint")


def test_06_runs_its_throughput_on_8_ranks(tmp_path):
    res = emulate("06_ddp", tmp_path)
    assert value(res, "samples_per_s_8_rank") > 0 and value(res, "ddp_weights_per_rank_ratio") == 1.0


def test_08_shards_over_8_ranks(tmp_path):
    res = emulate("08_fsdp", tmp_path)
    assert value(res, "mesh_shapes")[0] == [8]
    assert claim(res, "every strategy trains like one process")["held"]
    assert abs(value(res, "full_shard_ranks_sum_over_estimate") - 1) < 0.05


def test_09_runs_zero_2_and_3_on_8_ranks(tmp_path):
    res = emulate("09_deepspeed_zero", tmp_path)
    assert claim(res, "ZeRO stages 1-3 train the same model as DDP")["held"]
    assert "N=8" in claim(res, "ZeRO keeps 1/N of the optimizer state")["measured"]
    assert value(res, "your_zero1_max_rel_loss_diff_vs_ddp") < 1e-5
    # 2 (N-1)/N x 4 = 7 bytes per parameter on 8 ranks; ZeRO-1 pads 11274 parameters to 11280
    assert value(res, "ddp_sent_bytes_per_param") == 7.0
    assert value(res, "your_zero1_sent_bytes_per_param") == pytest.approx(7.0 * 11280 / 11274)


def test_10_runs_zero_3_with_offload_on_8_ranks(tmp_path):
    res = emulate("10_zero_offload", tmp_path)
    verdict = claim(res, "ZeRO with CPU offload trains the same model as DDP")
    assert verdict["held"] and "N=8" in verdict["measured"]
    assert abs(value(res, "optimizer_state_fraction ZeRO-3 + offload optimizer and params") - 1 / 8) < 0.0125


def test_14_runs_tp_8(tmp_path):
    res = emulate("14_tensor_parallelism", tmp_path)
    assert "8 ranks" in claim(res, "tensor parallelism trains the same model")["claim"]
    executed = json.loads((tmp_path / "executed" / "14_tensor_parallelism.ipynb").read_text())
    assert "tier=node (emulated" in "".join("".join(o.get("text", "")) for c in executed["cells"][:4]
                                            for o in c.get("outputs", []))


def test_15_runs_8_stages(tmp_path):
    res = emulate("15_pipeline_parallelism", tmp_path)
    assert claim(res, "every pipeline schedule trains the same model as one process")["held"]
    in_flight = value(res, "pp_in_flight")
    assert len(in_flight["1f1b"]) == 8 and max(in_flight["1f1b"]) <= 8 and in_flight["gpipe"] == [16] * 8


def test_16_runs_its_ring_on_8_ranks(tmp_path):
    """The node's ring of 8 (16 zig-zag chunks, 61 tokens padded to 64)."""
    res = emulate("16_context_parallelism", tmp_path)
    assert value(res, "ring_worlds") == [2, 4, 8] and value(res, "ring_bytes_match_formula") is True
    assert value(res, "ring_max_output_diff") < 1e-4 and value(res, "ring_max_grad_diff") < 1e-4
    assert value(res, "causal_work_plain") == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    assert value(res, "causal_work_zigzag") == [4.25] * 8
    memory = value(res, "ring_memory_bytes")
    assert sorted(memory, key=int) == ["1", "2", "4", "8"] and all(memory[n] * int(n) == memory["1"] for n in memory)
    assert claim(res, "the course's Llama trains with ring attention (8 ranks")["held"]


def test_17_runs_16_experts_on_8_ranks(tmp_path):
    res = emulate("17_expert_parallelism", tmp_path)
    assert value(res, "ep_bytes_match_formula") is True and value(res, "ep_max_diff") < 1e-4
    assert claim(res, "expert parallelism on 8 ranks")["held"]
