"""course_lib.profiling: a step traced by torch's profiler into a file Perfetto opens, read back as a table, and the
share of the collectives' time that backward hid, on real gloo ranks."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from course_lib import profiling
from course_lib.data import synthetic_images
from course_lib.launch import run_forked
from course_lib.models import SmallCNN


def test_a_traced_step_is_a_chrome_trace_whose_backward_and_optimizer_read_back(tmp_path):
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()

    path = profiling.trace(step, tmp_path / "deep" / "step.json")
    assert "traceEvents" in json.loads(path.read_text())  # what ui.perfetto.dev and chrome://tracing open
    frame = profiling.read_trace(path)
    assert {"backward", "optimizer", "op"} <= set(frame.kind)
    assert frame.start_ms.is_monotonic_increasing and frame.start_ms.iloc[0] == 0.0
    assert (frame.duration_ms >= 0).all()


def test_a_file_with_no_complete_event_is_refused_with_what_it_expected(tmp_path):
    (tmp_path / "empty.json").write_text(json.dumps({"traceEvents": [{"ph": "M", "name": "process_name"}]}))
    with pytest.raises(ValueError, match="no complete events.*torch.profiler"):
        profiling.read_trace(tmp_path / "empty.json")


def test_hidden_counts_only_the_time_a_covering_event_ran():
    """Two overlapping backward spans (0-4 and 3-6 ms: one cover, 0-6) and two collectives: 5-9 ms (1 ms hidden)
    and 10-12 ms (none), so 1 of 6 ms is hidden, and one collective began before backward's end."""
    frame = pd.DataFrame({"name": ["b1", "b2", "c1", "c2"], "thread": [1, 1, 2, 2],
                          "kind": ["backward", "backward", "collective", "collective"],
                          "start_ms": [0.0, 3.0, 5.0, 10.0], "duration_ms": [4.0, 3.0, 4.0, 2.0]})
    got = profiling.hidden(frame)
    assert got == {"total_ms": 6.0, "hidden_ms": 1.0, "share": pytest.approx(1 / 6), "began_before_end": 1}
    assert profiling.hidden(frame[frame.kind == "backward"])["share"] == 0.0  # no collective: nothing to hide


def _traced_ddp_step(folder: str) -> str:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(SmallCNN(width=16), bucket_cap_mb=0.01)  # many small buckets: the first leave mid-backward
    x, y = synthetic_images(32, seed=rank).tensors
    return str(profiling.trace(lambda: F.cross_entropy(model(x), y).backward(), f"{folder}/rank{rank}.json"))


def test_ddp_s_all_reduces_show_in_the_trace_on_gloo_s_thread_while_backward_runs(tmp_path):
    """On 2 gloo ranks, torch's DDP: every bucket's all-reduce is in the trace as gloo's work, on a thread other than
    autograd's, and at least one began before backward's last op ended (the overlap DDP is built for). (DDP's
    broadcasts in forward are collectives too: ``named`` leaves them out.)"""
    for path in run_forked(_traced_ddp_step, 2, {"folder": str(tmp_path)}, timeout=120):
        frame = profiling.read_trace(path)
        all_reduces = frame[(frame.kind == "collective") & frame.name.str.startswith("gloo:all_reduce")]
        assert len(all_reduces) >= 3
        assert not set(all_reduces.thread) & set(frame.thread[frame.kind == "backward"])
        got = profiling.hidden(frame, named="all_reduce")
        assert got["began_before_end"] >= 1 and 0 < got["total_ms"] and 0 <= got["share"] <= 1


def test_memory_snapshot_needs_a_gpu_and_says_what_measures_on_a_cpu(tmp_path):
    if torch.cuda.is_available():
        path = profiling.memory_snapshot(lambda: torch.ones(1024, device="cuda").sum(), tmp_path / "snap.pickle")
        assert profiling.snapshot_peak(path)["peak_bytes"] >= 4096
    else:
        with pytest.raises(RuntimeError, match="needs a GPU.*course_lib.memory"):
            profiling.memory_snapshot(lambda: None, tmp_path / "snap.pickle")


def test_snapshot_peak_replays_the_trace_from_what_was_alive_before_it():
    """A snapshot in torch's documented layout (torch.cuda.memory._snapshot): 1,000 bytes alive before the recording
    (one old gradient of 400 among them, freed in it), then a 300-byte activation and a 500-byte one, the first
    freed: the peak is 1,000 + 800 = 1,800 bytes, with the two activations live at it, named by their frames."""
    def frames(line):
        return [{"filename": "/site-packages/torch/nn/modules/linear.py", "line": 1, "name": "forward"},
                {"filename": "/course/course_lib/models.py", "line": line, "name": "forward"}]
    trace = [{"action": "alloc", "addr": 10, "size": 300, "frames": frames(7)},
             {"action": "alloc", "addr": 20, "size": 500, "frames": frames(9)},
             {"action": "free_requested", "addr": 10, "size": 300, "frames": []},
             {"action": "free_completed", "addr": 10, "size": 300, "frames": []},
             {"action": "free_completed", "addr": 99, "size": 400, "frames": []}]  # the old gradient
    snapshot = {"segments": [{"device": 0, "allocated_size": 1000 - 400 + 500}], "device_traces": [trace]}
    peak = profiling.snapshot_peak(snapshot)
    assert (peak["start_bytes"], peak["peak_bytes"], peak["end_bytes"]) == (1000, 1800, 1100)
    assert peak["at_peak"] == [(500, "models.py:9 forward"), (300, "models.py:7 forward")]
