"""Traces from torch's profiler: record one step, write it where Perfetto opens it, read it back as a table.

The course's own instruments (``CollectiveLog``, the saved-tensor meter, ``time_step``) each answer one question;
a real job is read in a trace. ``trace`` runs a function under ``torch.profiler`` (CPU, and CUDA where there is a
GPU) and exports Chrome's trace format, which https://ui.perfetto.dev and chrome://tracing open. ``read_trace``
turns the file into a table with one row per event: every op with its thread, start and duration, each labelled
by what it is (a collective's work, the call that launched it, a backward op, the optimizer), so a notebook can ask
the trace what it shows, e.g. whether the all-reduces ran while backward still computed (``hidden``).

On a GPU the caching allocator keeps its own record: ``memory_snapshot`` runs a function with it recording every
allocation and its stack, and writes the snapshot https://pytorch.org/memory_viz draws; ``snapshot_peak`` replays it
to the peak and the tensors alive there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:  # pandas starts a thread when imported, and nothing the grader forks may import one
    import pandas as pd

# A collective's work, by the name the profiler gives it: gloo's and NCCL's own spans on the CPU, NCCL's kernels
# on the GPU. The c10d ops (c10d::allreduce_) are the calls that launch them, on the thread that called.
COLLECTIVE_PREFIXES = ("gloo:", "nccl:", "ncclDevKernel", "ncclKernel", "record_param_comms")


def kind_of(name: str) -> str:
    """What a trace event named ``name`` is: "collective" (the work), "launch" (the c10d call), "backward" (an
    autograd node), "optimizer" (a step), or "op"."""
    if name.startswith(COLLECTIVE_PREFIXES):
        return "collective"
    if name.startswith("c10d::"):
        return "launch"
    if name.startswith("autograd::engine::evaluate_function"):
        return "backward"
    if name.startswith("Optimizer.step"):
        return "optimizer"
    return "op"


def trace(fn: Callable[[], object], path: Path | str, warmup: int = 1) -> Path:
    """``fn()`` ``warmup`` times, then once under ``torch.profiler`` (CPU, and CUDA where available); the trace
    exported to ``path`` (Chrome's JSON, for Perfetto). Returns the path."""
    for _ in range(warmup):
        fn()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))
    return path


def read_trace(path: Path | str) -> pd.DataFrame:
    """A Chrome trace's complete events (``"ph": "X"``) as a table sorted by start: name, kind (``kind_of``),
    thread, start_ms (from the first event) and duration_ms."""
    import pandas as pd

    events = json.loads(Path(path).read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    rows = [(e["name"], kind_of(e["name"]), e.get("tid"), float(e["ts"]), float(e.get("dur", 0.0)))
            for e in events if e.get("ph") == "X" and "ts" in e and "name" in e]
    if not rows:
        raise ValueError(f"{path} holds no complete events: is it a trace that torch.profiler exported?")
    frame = pd.DataFrame(rows, columns=["name", "kind", "thread", "start_us", "duration_us"])
    frame["start_ms"] = (frame["start_us"] - frame["start_us"].min()) / 1e3
    frame["duration_ms"] = frame["duration_us"] / 1e3
    return frame.drop(columns=["start_us", "duration_us"]).sort_values("start_ms", ignore_index=True)


def hidden(frame: pd.DataFrame, kind: str = "collective", behind: str = "backward", named: str = "") -> dict:
    """How much of the ``kind`` events' time (those whose name holds ``named``: "all_reduce" leaves DDP's
    broadcasts out) ran while a ``behind`` event did, on any thread: the total and hidden milliseconds, the share
    hidden, and how many of them began before the last ``behind`` event ended."""
    spans = sorted(zip(frame.start_ms[frame.kind == behind], frame.start_ms[frame.kind == behind]
                       + frame.duration_ms[frame.kind == behind]))
    merged: list[list[float]] = []
    for start, end in spans:  # the union of the covering intervals
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    last = merged[-1][1] if merged else float("-inf")
    total = covered = 0.0
    early, mine = 0, (frame.kind == kind) & frame.name.str.contains(named, regex=False)
    for start, duration in zip(frame.start_ms[mine], frame.duration_ms[mine]):
        total += duration
        covered += sum(max(0.0, min(start + duration, b) - max(start, a)) for a, b in merged)
        early += start < last
    # min: sums of floats can pass 1 by an ulp where every collective ran under backward
    return {"total_ms": total, "hidden_ms": covered, "share": min(covered / total, 1.0) if total else 0.0,
            "began_before_end": early}


# ---------------------------------------------------------------- the allocator's memory snapshot (GPU)

def memory_snapshot(fn: Callable[[], object], path: Path | str, max_entries: int = 200_000) -> Path:
    """``fn()`` once with the CUDA caching allocator recording every allocation and free (with its Python stack),
    then its snapshot pickled to ``path``, which https://pytorch.org/memory_viz opens (ROCm's allocator too).

    The CPU has no caching allocator to record: there the course's meters (``course_lib.memory``) measure instead.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("memory_snapshot records the CUDA caching allocator: it needs a GPU (CUDA or ROCm). On a "
                           "CPU, measure with course_lib.memory (SavedTensorMeter, model_state_bytes)")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=max_entries)
    try:
        fn()
        torch.cuda.synchronize()
        torch.cuda.memory._dump_snapshot(str(path))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return path


def snapshot_peak(snapshot: dict | Path | str, device: int = 0) -> dict:
    """The allocated bytes over a snapshot's trace (``memory_snapshot``'s file, or ``torch.cuda.memory._snapshot()``):
    ``peak_bytes`` and ``end_bytes`` (allocated, everything alive before the recording included), ``start_bytes``,
    and ``at_peak``: the live allocations at the peak that the recording saw made, largest first, as
    (bytes, where: the innermost stack frame outside torch).

    The start is what the segments hold at the end minus what the trace added (a block made before the recording
    may be freed in it): the whole trace is needed, so ``max_entries`` must hold every event of the step.
    """
    import pickle

    if not isinstance(snapshot, dict):
        snapshot = pickle.loads(Path(snapshot).read_bytes())
    trace = snapshot["device_traces"][device]
    end = sum(seg["allocated_size"] for seg in snapshot["segments"] if seg.get("device", device) == device)
    live: dict[int, tuple[int, str]] = {}
    now = peak = 0
    peak_live: dict[int, tuple[int, str]] = {}
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], _where(event.get("frames", [])))
            now += event["size"]
            if now > peak:
                peak, peak_live = now, dict(live)
        elif event["action"] == "free_completed":  # a block made before the recording may go too (old grads)
            live.pop(event["addr"], None)
            now -= event["size"]
    start = end - now
    return {"start_bytes": start, "peak_bytes": start + peak, "end_bytes": end,
            "at_peak": sorted(peak_live.values(), reverse=True)}


def _where(frames: list[dict]) -> str:
    """The innermost frame of an allocation's stack that is not torch's own (the course's or the user's line)."""
    for frame in frames:
        if "/torch/" not in frame.get("filename", "") and frame.get("filename", "").endswith(".py"):
            return f"{Path(frame['filename']).name}:{frame['line']} {frame['name']}"
    return "(no Python frame)"
