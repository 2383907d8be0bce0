"""course_lib.dataloader: a decode cost that is real CPU work, the loader probes, and the Prefetcher."""

from __future__ import annotations

import threading
import time

import matplotlib
import pytest
import torch
from torch.utils.data import DataLoader, Subset, TensorDataset

from course_grader.checks import nb05
from course_lib import dataloader as dl

matplotlib.use("Agg")


def test_a_sample_costs_about_the_cpu_time_asked_and_opening_is_paid_once_per_process():
    data = dl.DecodeDataset(64, cost_ms=2.0, open_ms=30.0)
    t0 = time.thread_time()
    data[0]  # opens the "archive" first
    first = time.thread_time() - t0
    t0 = time.thread_time()
    for i in range(1, 21):
        data[i]
    per_sample_ms = (time.thread_time() - t0) / 20 * 1e3
    # CPU time, not wall time: a busy machine does not move it much; calibration is within a factor 2
    assert 1.0 < per_sample_ms < 4.0, per_sample_ms
    assert first * 1e3 > per_sample_ms + 15, "open_ms is paid by the first sample a process reads"


def test_samples_are_the_same_whichever_process_decodes_them():
    data = dl.DecodeDataset(24, size=16, cost_ms=0.2)
    x, y = data[5]
    assert x.shape == (3, 16, 16) and x.dtype == torch.float32 and y.dtype == torch.int64 and int(y) == 5
    assert abs(float(x.mean())) < 1e-4 and abs(float(x.std()) - 1) < 1e-3  # normalised
    main = [b[0] for b in DataLoader(data, batch_size=8)]
    workers = [b[0] for b in DataLoader(data, batch_size=8, num_workers=2)]
    assert all(torch.equal(a, b) for a, b in zip(main, workers))
    assert not torch.equal(data[0][0], data[1][0])


@pytest.mark.parametrize("kwargs", [dict(n=0), dict(n=4, size=12), dict(n=4, cost_ms=0), dict(n=4, open_ms=-1)])
def test_bad_data_set_arguments_say_what_to_change(kwargs):
    with pytest.raises(ValueError, match="use"):
        dl.DecodeDataset(**kwargs)


def test_index_out_of_range():
    with pytest.raises(IndexError, match="outside"):
        dl.DecodeDataset(4, cost_ms=0.1)[4]


def test_loader_rate_of_one_and_of_several_loaders():
    data = dl.DecodeDataset(64, size=16, cost_ms=0.5)
    one = dl.loader_rate(DataLoader(data, batch_size=4), 6)
    assert one["samples_per_s"] > 0 and one["first_batch_s"] > 0 and one["batches"] == 6
    two = dl.loader_rate([DataLoader(data, batch_size=4), DataLoader(data, batch_size=4)], 4)
    assert two["per_loader_samples_per_s"] == pytest.approx(two["samples_per_s"] / 2)
    with pytest.raises(ValueError, match="at least 4"):
        dl.loader_rate(DataLoader(data, batch_size=4, num_workers=2), 3)


def _slow_items(n: int, seconds: float):
    for i in range(n):
        time.sleep(seconds)
        yield i


def test_timeline_splits_each_step_into_waiting_and_computing():
    events = dl.step_timeline(_slow_items(6, 0.03), dl.sleep_step(20), 6)
    assert len(events) == 6 and all(e["wait_s"] >= 0.029 and e["step_s"] >= 0.019 for e in events)
    assert all(b["start"] >= a["start"] + a["wait_s"] + a["step_s"] for a, b in zip(events, events[1:]))
    waited, stepped = sum(e["wait_s"] for e in events[1:]), sum(e["step_s"] for e in events[1:])
    assert dl.wait_fraction(events) == pytest.approx(waited / (waited + stepped))  # the first step's start-up aside
    fig = dl.timeline_figure({"slow": events, "slow again": events}, "test")
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["slow", "slow again"]
    with pytest.raises(ValueError, match="record more steps"):
        dl.wait_fraction(events[:1])
    with pytest.raises(ValueError, match="positive"):
        dl.sleep_step(0)


def test_workers_needed():
    assert dl.workers_needed(1000, 300) == 4
    assert dl.workers_needed(600, 300) == 2
    with pytest.raises(ValueError, match="positive"):
        dl.workers_needed(0, 300)


def test_persistent_workers_skip_the_start_up_of_epoch_two():
    data = Subset(dl.DecodeDataset(64, size=16, cost_ms=0.1, open_ms=150.0), range(16))
    fresh = dl.first_batch_times(DataLoader(data, batch_size=4, num_workers=2), 2)
    kept = dl.first_batch_times(DataLoader(data, batch_size=4, num_workers=2, persistent_workers=True), 2)
    assert fresh[1] > kept[1] + 0.05, (fresh, kept)  # epoch 2 starts (and opens) its workers again


# --- Prefetcher: the library's counterpart of notebook 04's exercise


def test_prefetcher_yields_every_item_in_order_each_pass():
    p = dl.Prefetcher(range(50), depth=3)
    assert list(p) == list(range(50)) and list(p) == list(range(50))
    batches = list(dl.Prefetcher(DataLoader(TensorDataset(torch.arange(10.0), torch.arange(10)), batch_size=4,
                                            num_workers=1), device="cpu"))
    assert [b[1].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [b["x"].tolist() for b in dl.Prefetcher([{"x": torch.ones(2)}], device="cpu")] == [[1.0, 1.0]]


def _logged_items(n: int, log: list):
    for i in range(n):
        log.append(("load", i))
        time.sleep(0.02)
        yield i


def test_prefetcher_overlaps_loading_with_the_loop():
    """The next item is loaded while the loop works on this one: an order of events, not a duration."""
    n, plain, prefetched = 8, [], []
    for log, items in ((plain, _logged_items(n, plain)), (prefetched, dl.Prefetcher(_logged_items(n, prefetched), 2))):
        for i in items:
            log.append(("use", i))
            time.sleep(0.02)
            log.append(("used", i))
    def overlapped(log):  # items whose successor's load began before the loop was done with them
        return sum(log.index(("load", i + 1)) < log.index(("used", i)) for i in range(n - 1))
    assert overlapped(plain) == 0 and overlapped(prefetched) >= (n - 1) // 2, prefetched


@pytest.mark.parametrize("depth", [1, 3])
def test_prefetcher_runs_ahead_by_its_depth_and_no_more(depth):
    produced = []

    def counting(n):
        for i in range(n):
            produced.append(i)
            yield i

    ahead = []
    for k, _ in enumerate(dl.Prefetcher(counting(12), depth=depth), start=1):
        time.sleep(0.01)
        ahead.append(len(produced) - k)
    # depth batches in the queue and the one the thread holds while it waits for a free slot
    assert max(ahead) == depth + 1, ahead


def test_prefetcher_raises_the_loading_error_in_the_loop():
    def failing():
        yield 0
        yield 1
        raise KeyError("sample 2 is corrupt")

    got = []
    with pytest.raises(KeyError, match="corrupt"):
        for item in dl.Prefetcher(failing()):
            got.append(item)
    assert got == [0, 1]
    with pytest.raises(ValueError, match="depth"):
        dl.Prefetcher(range(3), depth=0)


@pytest.mark.parametrize("how", ["break", "raise"])
def test_a_loop_that_leaves_early_stops_the_thread_and_the_loaders_workers(how):
    """The thread waits on a full queue when the loop leaves: the drain wakes it, the join waits for it, and the
    DataLoader's iterator goes with it (its 2 workers exit); a generator is closed (its finally runs)."""
    for kind in ("generator", "DataLoader"):
        run = nb05.leave_early(dl.Prefetcher, kind, how)
        assert run["threads"] == [] and run["workers"] == 0, (kind, run)
        assert kind == "DataLoader" or run["closed"], run
    assert not [t for t in threading.enumerate() if t.name == "prefetcher"]


def test_the_copies_run_on_a_side_stream_that_the_steps_stream_waits_for():
    """The CUDA branch on a CPU: torch.cuda's streams and events faked (nb05.FakeCuda), the order of the calls judged
    as the notebook's test judges the student's; on the CPU no stream is involved."""
    def run(device):
        with nb05.FakeCuda(vars(dl)) as cuda:
            for item in dl.Prefetcher(nb05.streamed_items(), depth=2, device=device):
                cuda.received(item)
        return {"log": cuda.log}

    got = {"cuda": run("cuda"), "cpu": run("cpu")}
    assert "side stream" in nb05.judge_stream(got)
    assert {e["stream"] for e in got["cuda"]["log"] if e["what"] == "copy"} == {"side 1"}  # one stream per pass
    assert torch.cuda.Stream is not nb05._FakeStream and "record_stream" not in torch.Tensor.__dict__  # restored
    streamless = {"cuda": got["cuda"], "cpu": got["cpu"]}
    streamless["cuda"] = {"log": [{**e, "stream": "default"} if e["what"] == "copy" else e for e in got["cuda"]["log"]]}
    with pytest.raises(AssertionError, match="default stream"):
        nb05.judge_stream(streamless)


def test_host_to_device_copies_need_a_gpu():
    if torch.cuda.is_available():
        a = torch.randn(1024, 1024, device="cuda")
        out = dl.h2d_copy_times(torch.randn(4, 2**20), "cuda", lambda: a @ a, repeat=3)
        assert out["copy_pinned_ms"] > 0 and out["overlap_pinned_ms"] > 0
    else:
        with pytest.raises(ValueError, match="need a GPU"):
            dl.h2d_copy_times(torch.randn(4), "cpu", lambda: None)
