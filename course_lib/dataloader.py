"""Feeding a rank: a data set whose samples cost real CPU time, and what a loader delivers against a step.

Every DDP rank has its own ``DataLoader`` and its own worker processes, and all the ranks of a node share
its CPU cores: 8 GPUs × ``num_workers=8`` is 64 decoding processes. ``DecodeDataset`` makes images whose
"decode and augment" is a fixed amount of real CPU work (inverse DCTs of 8×8 blocks, as a JPEG decoder
does, calibrated to a target milliseconds per sample), so workers compete for cores as real ones do; a
``time.sleep`` would not. ``loader_rate`` measures the samples/s one loader (or several ranks' loaders
at once) delivers, ``step_timeline`` what a training step waits for, ``first_batch_times`` what an epoch
boundary costs, and ``h2d_copy_times`` the host-to-device copy, pageable against pinned, alone and
overlapped with compute (GPU only). ``Prefetcher`` runs any iterable ahead in a background thread.
"""

from __future__ import annotations

import functools
import math
import os
import queue
import threading
import time
from typing import Callable, Iterable, Iterator

import matplotlib.pyplot as plt
import torch
from torch.utils.data import Dataset

from course_lib.data import batch_len, to_device

BLOCK = 8  # JPEG's block size: the image is coded as 8×8 blocks of DCT coefficients


def idct_matrix(n: int = BLOCK) -> torch.Tensor:
    """The orthonormal DCT-II matrix C of size n: ``C.T @ X @ C`` inverts the 2-D DCT of a block X."""
    k = torch.arange(n, dtype=torch.float32)
    c = torch.cos(math.pi * (2 * k[None, :] + 1) * k[:, None] / (2 * n)) * math.sqrt(2 / n)
    c[0] /= math.sqrt(2)
    return c


# C.T @ X @ C for every block at once, as one matmul of the flattened blocks (vec(C.T X C) = vec(X) (C ⊗ C)),
# in fixed point (scaled by 2**12) as libjpeg's integer IDCT does. Integer matmuls run on the calling thread:
# a float one would go to MKL, whose threads spin against every other process when the cores are busy.
# Built on first use, not at import: a float op at import starts OpenMP's thread pool, and a process that forks
# after that (the grader, run_forked) can hang in its children.
_FRACTION_BITS = 12


@functools.lru_cache(maxsize=1)
def _idct2() -> torch.Tensor:
    return torch.round(torch.kron(idct_matrix(), idct_matrix()) * 2**_FRACTION_BITS).to(torch.int32)


def _coefficients(index: int, size: int, seed: int) -> torch.Tensor:
    """The "compressed" sample: quantised DCT coefficients of the 8×8 blocks of a 3×size×size image, one row each."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    return torch.randint(-32, 33, (3 * (size // BLOCK) ** 2, BLOCK * BLOCK), generator=g, dtype=torch.int32)


def _decode_rounds(coeffs: torch.Tensor, rounds: int) -> torch.Tensor:
    """``rounds`` inverse DCTs of every block: a fixed amount of CPU work (not of wall time, so that
    processes sharing a core take longer, as real decoders do)."""
    x = torch.zeros_like(coeffs)
    for _ in range(rounds):  # each round feeds a little of the last one back, so none can be skipped
        x = ((coeffs + (x >> 6)) @ _idct2()) >> _FRACTION_BITS
    return x


def round_ms(size: int = 32, trials: int = 5, rounds: int = 40) -> float:
    """Milliseconds of one decode round on one core here: the CPU time of this thread, so that a busy
    machine (which slows the wall clock, not the work) does not skew it; the best of ``trials``."""
    coeffs = _coefficients(0, size, 0)
    _decode_rounds(coeffs, 2)  # warm-up
    best = math.inf
    for _ in range(trials):
        t0 = time.thread_time()
        _decode_rounds(coeffs, rounds)
        best = min(best, (time.thread_time() - t0) * 1e3 / rounds)
    return best


class DecodeDataset(Dataset):
    """``n`` JPEG-like images: each ``__getitem__`` decodes 8×8 DCT blocks and augments (random crop, flip).

    The decode costs about ``cost_ms`` of one core per sample (calibrated here, once); ``open_ms`` is
    work each process does before its first sample (opening an archive, reading its index), which a
    worker pays every time it starts. Sample ``i`` is the same whichever process decodes it.
    Returns ``(image float32 3×size×size, label int64)``.
    """

    def __init__(self, n: int, size: int = 32, cost_ms: float = 2.0, open_ms: float = 0.0, num_classes: int = 10,
                 seed: int = 0):
        if n < 1 or size < BLOCK or size % BLOCK:
            raise ValueError(f"n={n}, size={size}: use n >= 1 and a size that is a multiple of {BLOCK}")
        if cost_ms <= 0 or open_ms < 0:
            raise ValueError(f"cost_ms={cost_ms}, open_ms={open_ms}: use cost_ms > 0 and open_ms >= 0")
        self.n, self.size, self.cost_ms, self.num_classes, self.seed = n, size, cost_ms, num_classes, seed
        self.round_ms = round_ms(size)
        self.rounds = max(1, round(cost_ms / self.round_ms))
        self.open_rounds = round(open_ms / self.round_ms)
        self._opened_in: int | None = None  # the process that has paid open_ms

    def __len__(self) -> int:
        return self.n

    def _open(self) -> None:
        pid = os.getpid()
        if self._opened_in != pid:  # a fresh worker (or the main process): open the "archive" once
            _decode_rounds(_coefficients(-1, self.size, self.seed), self.open_rounds)
            self._opened_in = pid

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.n:
            raise IndexError(f"index {index} is outside this data set of {self.n} samples")
        self._open()
        blocks = _decode_rounds(_coefficients(index, self.size, self.seed), self.rounds)
        side = self.size // BLOCK  # blocks back into the image: channel, block row, row, block column, column
        image = blocks.float().reshape(3, side, side, BLOCK, BLOCK).permute(0, 1, 3, 2, 4)
        image = image.reshape(3, self.size, self.size)
        g = torch.Generator().manual_seed(self.seed * 7_919 + index)  # the augmentation, fixed per sample
        dy, dx = torch.randint(0, 9, (2,), generator=g).tolist()
        image = torch.nn.functional.pad(image[None], (4, 4, 4, 4), mode="reflect")[0, :, dy:dy + self.size,
                                                                                     dx:dx + self.size]
        if torch.rand((), generator=g) < 0.5:
            image = image.flip(-1)
        image = (image - image.mean()) / (image.std() + 1e-6)
        return image.contiguous(), torch.tensor(index % self.num_classes)


def loader_rate(loaders, batches: int) -> dict:
    """Samples/s that a DataLoader (or a list of them, one per rank, read in turn) delivers after start-up.

    Reads ``batches`` rounds (one batch from each loader per round). A loader with w workers delivers
    its first w batches together (every worker starts at once), so the rate is timed from the end of
    that first wave: (rounds after it) / (time after it). ``first_batch_s`` is the time to the first
    round: worker start-up plus one batch.
    """
    loaders = loaders if isinstance(loaders, (list, tuple)) else [loaders]
    wave = max(1, max(loader.num_workers for loader in loaders))
    if batches < 2 * wave:
        raise ValueError(f"batches={batches} is too few for {wave} workers: read at least {2 * wave} so that the rate "
                         "is timed after the first wave of batches")
    its = [iter(loader) for loader in loaders]
    t0 = time.perf_counter()
    ends, samples = [], 0
    for r in range(batches):
        got = sum(batch_len(next(it)) for it in its)
        ends.append(time.perf_counter())
        samples += got if r >= wave else 0
    del its  # stops the workers now, not at the next garbage collection
    return {"samples_per_s": samples / (ends[-1] - ends[wave - 1]), "per_loader_samples_per_s":
            samples / (ends[-1] - ends[wave - 1]) / len(loaders), "first_batch_s": ends[0] - t0, "batches": batches}


def sleep_step(step_ms: float) -> Callable[[object], None]:
    """A stand-in for a GPU's training step on a machine without one: the host waits ``step_ms`` and its
    cores stay free, as they do while a GPU computes (the host only launches kernels and waits)."""
    if step_ms <= 0:
        raise ValueError(f"step_ms={step_ms}: a step takes a positive time")

    def step(batch) -> None:
        time.sleep(step_ms / 1e3)

    return step


def step_timeline(batches: Iterable, step: Callable[[object], object], steps: int) -> list[dict]:
    """Run ``step`` on ``steps`` batches of ``batches``; per step, when it began waiting for data, how long
    it waited (``wait_s``: inside ``next``) and how long the step took (``step_s``), in seconds from the start."""
    it, events, t_start = iter(batches), [], time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        batch = next(it)
        t1 = time.perf_counter()
        step(batch)
        t2 = time.perf_counter()
        events.append({"start": t0 - t_start, "wait_s": t1 - t0, "step_s": t2 - t1})
    del it
    return events


def wait_fraction(events: list[dict], skip: int = 1) -> float:
    """The share of the time spent waiting for data, leaving out the first ``skip`` steps (start-up)."""
    kept = events[skip:]
    if not kept:
        raise ValueError(f"{len(events)} steps and skip={skip}: nothing left to measure; record more steps")
    wait = sum(e["wait_s"] for e in kept)
    return wait / (wait + sum(e["step_s"] for e in kept))


def workers_needed(consumed_per_s: float, per_worker_per_s: float) -> int:
    """How many workers (each delivering ``per_worker_per_s`` samples/s) a step eating ``consumed_per_s`` needs."""
    if consumed_per_s <= 0 or per_worker_per_s <= 0:
        raise ValueError(f"rates {consumed_per_s}, {per_worker_per_s}: both must be positive samples/s")
    return math.ceil(consumed_per_s / per_worker_per_s)


def timeline_figure(timelines: dict[str, list[dict]], title: str):
    """One row per run: each step's wait for data (red) and its compute (blue) on a time axis."""
    fig, ax = plt.subplots(figsize=(9, 0.9 + 0.6 * len(timelines)))
    for row, events in enumerate(timelines.values()):
        ax.broken_barh([(e["start"], e["wait_s"]) for e in events], (row - 0.35, 0.7), color="#d62728")
        ax.broken_barh([(e["start"] + e["wait_s"], e["step_s"]) for e in events], (row - 0.35, 0.7),
                       color="#4c72b0", edgecolor="white", linewidth=0.5)
    ax.set_yticks(range(len(timelines)), list(timelines))
    ax.set_xlabel("seconds (red: waiting for the next batch, blue: the step)")
    ax.set_title(title)
    fig.tight_layout()
    return fig


def first_batch_times(loader, epochs: int = 2) -> list[float]:
    """Seconds to the first batch of each epoch, from the end of the previous epoch (from the start for the
    first): with ``persistent_workers=False`` every epoch starts its workers again."""
    times, t0 = [], time.perf_counter()
    for _ in range(epochs):
        it = iter(loader)
        next(it)
        times.append(time.perf_counter() - t0)
        for _ in it:
            pass
        del it
        t0 = time.perf_counter()
    return times


# graded: 05_input_pipeline Prefetcher
class Prefetcher:
    """Iterate ``iterable`` with a background thread running ahead by at most ``depth`` batches.

    The thread puts each item (moved to ``device`` with ``non_blocking=True`` when one is given) into
    a queue of ``depth`` slots, so loading overlaps with whatever the loop does with the previous item;
    items come out in order, the end of the iterable ends the loop, and an exception raised while
    loading is raised in the loop. On a CUDA device the copies run on a side stream, so they also
    overlap with the kernels of the step: the loop's stream waits for each item's copy (an event), and
    takes its memory over (``record_stream``). A loop that ends early (``break``, an exception) stops
    the thread, waits for it, and lets go of the iterable's iterator (a DataLoader's workers exit).
    Each ``iter()`` starts a new pass over ``iterable``.
    """

    _END = object()

    def __init__(self, iterable: Iterable, depth: int = 2, device: torch.device | str | None = None):
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth={depth!r}: the prefetcher keeps at least 1 batch ahead; use an int >= 1")
        self.iterable, self.depth = iterable, depth
        self.device = torch.device(device) if device is not None else None

    def _produce(self, q: queue.Queue, stop: threading.Event) -> None:
        it = None
        try:  # iter() too: a DataLoader whose workers fail to start raises there
            it = iter(self.iterable)
            side = torch.cuda.Stream(self.device) if _is_cuda(self.device) else None
            for item in it:
                ready = None
                if side is not None:  # the copy goes on the side stream, beside the step's kernels
                    with torch.cuda.stream(side):
                        item = to_device(item, self.device, non_blocking=True)
                        ready = side.record_event()  # the copy's end, for the loop's stream to wait on
                elif self.device is not None:
                    item = to_device(item, self.device, non_blocking=True)
                q.put((item, ready, None))
                if stop.is_set():  # the loop has left: its drain let this put through
                    return
            q.put((self._END, None, None))
        except Exception as err:  # the loop raises it; the thread itself ends quietly
            q.put((self._END, None, err))
        finally:
            _release(it)

    def __iter__(self) -> Iterator:
        q, stop = queue.Queue(maxsize=self.depth), threading.Event()
        thread = threading.Thread(target=self._produce, args=(q, stop), daemon=True, name="prefetcher")
        thread.start()
        try:
            while True:
                item, ready, err = q.get()
                if err is not None:
                    raise err
                if item is self._END:
                    return
                if ready is not None:  # the step's stream waits for the copy (the host does not), and owns its memory
                    step_stream = torch.cuda.current_stream(self.device)
                    step_stream.wait_event(ready)
                    _record_stream(item, step_stream)
                yield item
        finally:  # the end, a break or an exception: stop the thread, wake it if it waits on a full queue, join it
            stop.set()
            _drain(q)
            thread.join()


# graded: 05_input_pipeline Prefetcher
def _is_cuda(device: torch.device | None) -> bool:
    """Whether copies to ``device`` go through a side stream (a CUDA device; the tests fake one on a CPU)."""
    return device is not None and device.type == "cuda"


# graded: 05_input_pipeline Prefetcher
def _drain(q: queue.Queue) -> None:
    """Empty ``q`` without waiting: a producer blocked on ``put`` gets its slot and sees that the loop has left."""
    while True:
        try:
            q.get_nowait()
        except queue.Empty:
            return


# graded: 05_input_pipeline Prefetcher
def _release(it) -> None:
    """Let go of an iterator now (None: there was none): a generator runs its ``finally`` blocks; a DataLoader's
    iterator stops its workers when its last reference goes (the producer's frame, which ends next)."""
    close = getattr(it, "close", None)
    if callable(close):
        close()


# graded: 05_input_pipeline Prefetcher
def _record_stream(batch, stream) -> None:
    """Tell the caching allocator that ``stream`` uses every CUDA tensor of ``batch`` (a tensor, tuple, list or dict):
    its memory is not handed out again before the work queued there when it is freed has run."""
    for t in [batch] if torch.is_tensor(batch) else batch.values() if isinstance(batch, dict) else batch:
        if torch.is_tensor(t):
            t.record_stream(stream)


def h2d_copy_times(batch: torch.Tensor, device: torch.device | str, compute: Callable[[], object],
                   repeat: int = 10) -> dict:
    """Milliseconds (median of ``repeat``) of copying ``batch`` to a GPU from pageable and from pinned
    memory, of ``compute()`` alone, and of the two together: one after the other on one stream, and
    the copy on a side stream while ``compute()`` runs, from pageable and from pinned memory."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device={device}: host-to-device copies need a GPU; on a CPU there is nothing to copy to")
    pageable, pinned, side = batch.clone(), batch.pin_memory(), torch.cuda.Stream(device)

    def overlapped(src):
        def run():
            compute()  # queued on the default stream; the copy goes on the side stream meanwhile
            with torch.cuda.stream(side):
                src.to(device, non_blocking=True)
        return run

    cases = {"copy_pageable": lambda: pageable.to(device, non_blocking=True),
             "copy_pinned": lambda: pinned.to(device, non_blocking=True), "compute": compute,
             "serial_pinned": lambda: (compute(), pinned.to(device, non_blocking=True)),
             "overlap_pageable": overlapped(pageable), "overlap_pinned": overlapped(pinned)}
    out = {}
    for name, fn in cases.items():
        out[f"{name}_ms"] = 1e3 * _median_time(fn, device, repeat)
    out["batch_mb"] = batch.numel() * batch.element_size() / 2**20
    return out


def _median_time(fn: Callable[[], object], device: torch.device, repeat: int) -> float:
    fn()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]
