"""Notebook 05's visible tests (the input pipeline): the Prefetcher's every item on every pass, its overlap with the
step, its copies on a side stream under a faked ``torch.cuda``, and a loop that leaves early (no thread, no worker
left).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import tempfile
import threading
from time import perf_counter, sleep  # bound here: a solution cell that rebinds time.sleep cannot reach the probes

import torch
from torch.utils.data import DataLoader, TensorDataset

import course_lib.data as course_data
import course_lib.dataloader as feeding
from course_grader.checks import outcome, register
from course_grader.grading import forbid


def as_data(x, depth: int = 0):
    """The student's batches as data: lists and tuples kept as such, ints and floats kept, anything else its repr
    (which no judge takes for an int)."""
    if isinstance(x, (list, tuple)) and depth < 4:
        return type(x)(as_data(v, depth + 1) for v in x) if type(x) in (list, tuple) else repr(x)[:200]
    if isinstance(x, (bool, int, float)) and type(x) in (bool, int, float):
        return x
    if isinstance(x, torch.Tensor) and x.dim() == 1:  # its length kept, its items not taken for ints
        return [repr(v)[:200] for v in x[:1000]]
    return repr(x)[:200]


# ---------------------------------------------------------------- Prefetcher
def guarded(fn, timeout: float = 5.0):
    """fn() in a thread, so that a loop that never ends fails the test instead of hanging."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as err:
            box["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), (f"the loop still waits after {timeout:.0f} s: does it end when the iterable ends, "
                                   "and when reading it fails?")
    if "error" in box:
        raise box["error"]
    return box["value"]


def yours(ns: dict, fn, timeout: float = 5.0):
    """fn() guarded, course_lib's Prefetcher out of reach while the student's class runs."""
    with forbid(feeding.Prefetcher, namespace=ns):
        return guarded(fn, timeout)


def writable_tempdir() -> None:
    """Where the grading process's inherited temporary folder is not writable, the one its environment names:
    a loader's worker shares its batches through a socket made there."""
    try:
        os.rmdir(tempfile.mkdtemp())
    except OSError:
        tempfile.tempdir = None


def small_loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.arange(24.0).view(12, 2), torch.arange(12)), batch_size=4, num_workers=1)


def batch_data(batch):
    """A batch that came through the student's Prefetcher, as data: its tensors (detached) or its repr."""
    if isinstance(batch, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in batch):
        return [t.detach().cpu().clone() for t in batch]
    return repr(batch)[:200]


def probe_prefetcher(ns: dict) -> dict:
    Prefetcher = ns["Prefetcher"]

    def two_passes():
        p = Prefetcher(range(20), depth=3)
        return list(p), list(p)

    first, second = yours(ns, two_passes)
    writable_tempdir()
    got = yours(ns, lambda: list(Prefetcher(small_loader(), depth=2, device="cpu")))
    return {"first": as_data(list(first)), "second": as_data(list(second)), "batches": [batch_data(b) for b in got]}


def judge_prefetcher(got: dict) -> str:
    assert got["first"] == list(range(20)), f"expected the items 0..19 in order, got {got['first']}"
    assert got["second"] == list(range(20)), \
        f"a second pass gave {got['second']}: each iter() starts a new pass over the iterable"
    want = list(small_loader())
    mine = got["batches"]
    assert len(mine) == len(want) and all(isinstance(g, list) and len(g) == 2 and torch.equal(g[0], w[0])
                                          and torch.equal(g[1], w[1]) for g, w in zip(mine, want)), \
        "the DataLoader's batches changed on the way"
    return "every item in order, every pass; a DataLoader's batches come through unchanged"


register("test_Prefetcher", probe_prefetcher, judge_prefetcher)

N_ITEMS, T_ITEM = 10, 0.04  # 10 items that take 40 ms each to load, a 40 ms step


def probe_overlap(ns: dict) -> dict:
    Prefetcher = ns["Prefetcher"]

    def slow_items(n, seconds):
        for i in range(n):
            sleep(seconds)  # loading (sleep releases the GIL, as torch's decoding kernels do)
            yield i

    def timed_loop(n, t_load, t_step, depth):
        t0, seen = perf_counter(), []
        for item in Prefetcher(slow_items(n, t_load), depth=depth):
            sleep(t_step)  # the step: the GPU busy, the host free
            seen.append(item)
        return seen, perf_counter() - t0

    for _attempt in range(2):  # a second try, in case the machine was busy during the first
        seen, took = yours(ns, lambda: timed_loop(N_ITEMS, T_ITEM, T_ITEM, 2))
        if took < 0.75 * 2 * N_ITEMS * T_ITEM:
            break
    return {"seen": as_data(list(seen)), "took": float(took)}


def judge_overlap(got: dict) -> str:
    n, t, took = N_ITEMS, T_ITEM, got["took"]
    assert got["seen"] == list(range(n)), f"items missing or out of order: {got['seen']}"
    assert took < 0.75 * 2 * n * t, (f"{n} items that take {t * 1e3:.0f} ms to load and a {t * 1e3:.0f} ms step: "
                                     f"{took:.2f} s; without overlap that is {2 * n * t:.2f} s, with it about "
                                     f"{(n + 1) * t:.2f} s: read the next items in the thread while the loop works")
    return f"{n} steps in {took:.2f} s ({2 * n * t:.2f} s one after the other): loading overlaps with the step"


register("test_Prefetcher_overlap", probe_overlap, judge_overlap)


# ---------------------------------------------------------------- Prefetcher on a GPU, and its shutdown
class FakeCuda:
    """torch.cuda's streams and events, and the copy to a GPU, logged instead of run: what a CPU can check of a
    prefetcher's GPU branch. While the block runs, ``torch.cuda.Stream``, ``Event``, ``stream``, ``current_stream``,
    ``default_stream``, ``synchronize`` and ``is_available`` are stand-ins, ``Tensor.record_stream`` logs its call,
    and ``to_device`` (in course_lib.data and every namespace in ``spaces``) clones the batch as "the copy", logging
    the stream it was issued on. ``log`` lists, in order, plain dicts: ``what`` (copy, record_event, wait_event,
    wait_stream, record_stream, synchronize, received), ``thread`` ("loop": the thread that entered the block),
    ``stream`` (``default`` or ``side N``) and the item or event each names. ``received(item)`` logs an item the loop
    got.
    """

    def __init__(self, *spaces: dict):
        self.spaces, self.log, self.kept = [vars(course_data), *spaces], [], []
        self.copies: dict[int, int] = {}  # id(copied tensor) -> its item's number (self.kept keeps the ids unique)
        self.local, self.n_streams, self.n_events = threading.local(), 0, 0
        self.default = _FakeStream(self, "default")

    def note(self, what: str, **data) -> None:
        thread = "loop" if threading.get_ident() == self.loop else "thread"
        self.log.append({"what": what, "thread": thread, **data})

    def current(self) -> "_FakeStream":
        stack = getattr(self.local, "stack", [])
        return stack[-1] if stack else self.default

    @contextlib.contextmanager
    def stream(self, stream):
        if stream is None:  # torch.cuda.stream(None) changes nothing
            yield
            return
        self.local.stack = getattr(self.local, "stack", []) + [stream]
        try:
            yield
        finally:
            self.local.stack = self.local.stack[:-1]

    def new_stream(self, device=None, priority: int = 0, **kwargs) -> "_FakeStream":
        self.n_streams += 1
        return _FakeStream(self, f"side {self.n_streams}")

    def to_device(self, batch, device, non_blocking: bool = False):
        tensors = ([batch] if torch.is_tensor(batch) else list(batch.values()) if isinstance(batch, dict)
                   else list(batch))
        number = int(tensors[0].reshape(-1)[0])  # the probes' items carry their number in their first tensor
        copies = [t.clone() for t in tensors]
        self.kept += copies
        self.copies.update({id(c): number for c in copies})
        self.note("copy", item=number, stream=self.current().name, tensors=len(copies), non_blocking=bool(non_blocking))
        if torch.is_tensor(batch):
            return copies[0]
        return dict(zip(batch, copies)) if isinstance(batch, dict) else tuple(copies)

    def received(self, item) -> None:
        tensors = [item] if torch.is_tensor(item) else list(item.values()) if isinstance(item, dict) else list(item)
        number = int(tensors[0].reshape(-1)[0]) if tensors and torch.is_tensor(tensors[0]) else -1
        self.note("received", item=number, copy=all(id(t) in self.copies for t in tensors))

    def __enter__(self) -> "FakeCuda":
        fake = self

        def record_stream(tensor, stream):
            fake.note("record_stream", item=fake.copies.get(id(tensor), -1),
                      stream=getattr(stream, "name", repr(stream)))

        self.loop = threading.get_ident()
        self.saved = [(torch.cuda, k, getattr(torch.cuda, k)) for k in
                      ("Stream", "Event", "stream", "current_stream", "default_stream", "synchronize", "is_available")]
        self.saved += [(torch.Tensor, "record_stream", torch.Tensor.__dict__.get("record_stream"))]
        self.saved_spaces = [(space, space.get("to_device")) for space in self.spaces]
        torch.cuda.Stream, torch.cuda.Event, torch.cuda.stream = (self.new_stream, lambda *a, **k: _FakeEvent(self),
                                                                   self.stream)
        torch.cuda.current_stream = lambda device=None: self.current()
        torch.cuda.default_stream = lambda device=None: self.default
        torch.cuda.synchronize = lambda device=None: self.note("synchronize", stream="all")
        torch.cuda.is_available = lambda: True
        torch.Tensor.record_stream = record_stream
        for space, _ in self.saved_spaces:
            space["to_device"] = self.to_device
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, value in self.saved:
            if value is None:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        for space, value in self.saved_spaces:
            space["to_device"] = value


class _FakeStream:
    def __init__(self, cuda: FakeCuda, name: str):
        self.cuda, self.name = cuda, name

    def record_event(self, event=None) -> "_FakeEvent":
        event = event or _FakeEvent(self.cuda)
        event.record(self)
        return event

    def wait_event(self, event) -> None:
        self.cuda.note("wait_event", stream=self.name, event=getattr(event, "number", -1))

    def wait_stream(self, other) -> None:
        self.cuda.note("wait_stream", stream=self.name, on=getattr(other, "name", repr(other)))

    def synchronize(self) -> None:
        self.cuda.note("synchronize", stream=self.name)

    def query(self) -> bool:
        return True

    def __enter__(self):  # `with stream:` as torch.Stream allows
        self._context = self.cuda.stream(self)
        return self._context.__enter__()

    def __exit__(self, *exc):
        return self._context.__exit__(*exc)


class _FakeEvent:
    def __init__(self, cuda: FakeCuda):
        cuda.n_events += 1
        self.cuda, self.number = cuda, cuda.n_events

    def record(self, stream=None) -> None:
        self.cuda.note("record_event", stream=(stream or self.cuda.current()).name, event=self.number)

    def wait(self, stream=None) -> None:
        (stream or self.cuda.current()).wait_event(self)

    def synchronize(self) -> None:
        self.cuda.note("synchronize", stream=f"event {self.number}")

    def query(self) -> bool:
        return True


N_STREAMED = 6  # items through the faked GPU branch


def streamed_items() -> list:
    """Batches that carry their number: ``(x filled with i, tensor(i))``."""
    return [(torch.full((2, 3), float(i)), torch.tensor(i)) for i in range(N_STREAMED)]


def probe_stream(ns: dict) -> dict:
    """The student's Prefetcher to a faked CUDA device and to the CPU, torch.cuda's calls logged."""
    Prefetcher = ns["Prefetcher"]

    def run(device):
        with FakeCuda(ns) as cuda:
            got = outcome(lambda: [cuda.received(item)
                                   for item in Prefetcher(streamed_items(), depth=2, device=device)])
        return {"log": cuda.log, **{k: v for k, v in got.items() if k != "value"}}

    return {"cuda": yours(ns, lambda: run("cuda")), "cpu": yours(ns, lambda: run("cpu"))}


STREAM_CALLS = ("record_event", "wait_event", "wait_stream", "record_stream", "synchronize")


def judge_stream(got: dict) -> str:
    for device in ("cpu", "cuda"):
        run = got[device]
        assert "raised" not in run, (f"device={device!r} (torch.cuda's streams faked here, to_device a clone): your "
                                     f"Prefetcher raised {run.get('raised')}: {str(run.get('message'))[:300]}")
        items = [e["item"] for e in run["log"] if e["what"] == "received"]
        assert items == list(range(N_STREAMED)), f"device={device!r}: the loop got items {items}"
    calls = [e["what"] for e in got["cpu"]["log"] if e["what"] in STREAM_CALLS]
    assert not calls, f"device='cpu': no CUDA stream is involved on a CPU, but your Prefetcher called {calls[:4]}"
    log = got["cuda"]["log"]
    for k, got_item in ((k, e) for k, e in enumerate(log) if e["what"] == "received"):
        i = got_item["item"]
        copies = [(j, e) for j, e in enumerate(log[:k]) if e["what"] == "copy" and e["item"] == i]
        assert copies and got_item["copy"], f"item {i}: the loop must get what to_device returned"
        j, copy = copies[-1]
        assert copy["thread"] == "thread", f"item {i}: issue the copy in the thread, not in the loop"
        assert copy["stream"] != "default", (f"item {i} was copied on the default stream, the stream of the step's "
                                             "kernels, so the GPU runs it between them: issue the copy under "
                                             "`with torch.cuda.stream(side):`, side = torch.cuda.Stream(device)")
        side, after = copy["stream"], log[j:k]
        recorded = {e["event"] for e in after if e["what"] == "record_event" and e["stream"] == side}
        assert any(e["thread"] == "loop" and e.get("stream") == "default" and
                   (e["what"] == "wait_event" and e["event"] in recorded
                    or e["what"] == "wait_stream" and e["on"] == side)
                   for e in after), (f"item {i}: the step's stream never waited for its copy, so the step can read the "
                                     "batch before it has arrived: record an event on the side stream after the copy, "
                                     "and in the loop, before yielding, "
                                     "torch.cuda.current_stream(device).wait_event(it)")
        taken = [e for e in after if e["what"] == "record_stream" and e["item"] == i and e.get("stream") == "default"]
        assert len(taken) >= copy["tensors"], (
            f"item {i}: {len(taken)} of its {copy['tensors']} tensors recorded on the step's stream: call "
            "t.record_stream(torch.cuda.current_stream(device)) on each, so that the caching allocator does not reuse "
            "their memory (allocated on the side stream) while the step still reads them")
    return (f"{N_STREAMED} items copied on a side stream in the thread; the step's stream waits for each copy and owns "
            "its tensors; the CPU path uses no stream")


register("test_Prefetcher_stream", probe_stream, judge_stream)


class LoopLeft(Exception):
    pass


def leave_early(Prefetcher, kind: str, how: str) -> dict:
    """Take two items from a Prefetcher over a generator or a 2-worker DataLoader, then break or raise; poll for up
    to 2 s: the threads started since (still alive), the worker processes left, whether the generator was closed."""
    threads, children, closed = set(threading.enumerate()), set(multiprocessing.active_children()), []

    def numbers():
        try:
            yield from range(1000)
        finally:
            closed.append(True)

    source = numbers() if kind == "generator" else DataLoader(TensorDataset(torch.arange(400.0)), batch_size=4,
                                                                num_workers=2)
    try:
        for k, _ in enumerate(Prefetcher(source, depth=2)):
            if k < 1:
                continue
            sleep(0.1)  # a slow step: the thread fills the queue and waits on a put
            if how == "break":
                break
            raise LoopLeft
    except LoopLeft:
        pass
    deadline = perf_counter() + 2.0
    while True:
        alive = [t.name for t in threading.enumerate() if t not in threads and t is not threading.current_thread()]
        workers = [p for p in multiprocessing.active_children() if p not in children]
        if (not alive and not workers) or perf_counter() > deadline:
            break
        sleep(0.02)
    return {"threads": alive, "workers": len(workers), "closed": bool(closed)}


SHUTDOWNS = (("generator", "break"), ("generator", "raise"), ("DataLoader", "break"), ("DataLoader", "raise"))


def probe_shutdown(ns: dict) -> list:
    writable_tempdir()
    runs = []
    for kind, how in SHUTDOWNS:
        runs.append(yours(ns, lambda: leave_early(ns["Prefetcher"], kind, how), timeout=8.0))
        if runs[-1]["threads"] or runs[-1]["workers"] or (kind == "generator" and not runs[-1]["closed"]):
            break  # the judge reports this one; the next would wait 2 s more
    return runs


def judge_shutdown(got: list) -> str:
    for (kind, how), run in zip(SHUTDOWNS, got):
        label = f"a loop over a {kind} that {'breaks' if how == 'break' else 'raises'} after two items"
        assert not run["threads"], (f"{label}: 2 s later these threads still run: {run['threads']}. When the loop "
                                    "leaves (a finally around it), set a stop event, drain the queue so that a "
                                    "put in progress returns, and join the thread, which sees the event and ends")
        assert not run["workers"], (f"{label}: 2 s later {run['workers']} DataLoader worker(s) still run: the "
                                    "thread must let go of the iterable's iterator when it ends")
        assert kind != "generator" or run["closed"], (f"{label}: the generator was never closed: the thread must end, "
                                                      "and call close() on the iterator if it has one")
    assert len(got) == len(SHUTDOWNS), f"{len(got)} of {len(SHUTDOWNS)} ways to leave the loop were tried"
    return "a loop that breaks or raises stops the thread, closes the iterator and the DataLoader's workers exit"


register("test_Prefetcher_shutdown", probe_shutdown, judge_shutdown)
