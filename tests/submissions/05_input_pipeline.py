"""Known submissions of 05_input_pipeline and the scores nbgrader's autograde must give them.

Each case replaces the named solution cells of the solution notebook; every other solution cell
keeps the reference solution. ``scores`` gives the expected points of every graded cell.
"""

# --- the prefetcher: the reference, and the mistakes students make, each a small edit of it

PREFETCHER = '''
class Prefetcher:
    def __init__(self, iterable, depth=2, device=None):
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth={depth!r}: keep at least one item ahead (an int >= 1)")
        self.iterable, self.depth = iterable, depth
        self.device = torch.device(device) if device is not None else None

    def __iter__(self):
        q, end, stop = queue.Queue(maxsize=self.depth), object(), threading.Event()
        cuda = self.device is not None and self.device.type == "cuda"

        def produce():
            it = None
            try:
                it = iter(self.iterable)
                side = torch.cuda.Stream(self.device) if cuda else None
                for item in it:
                    ready = None
                    if cuda:
                        with torch.cuda.stream(side):  # the copy runs beside the step's kernels
                            item = to_device(item, self.device, non_blocking=True)
                            ready = side.record_event()
                    elif self.device is not None:
                        item = to_device(item, self.device, non_blocking=True)
                    q.put((item, ready, None))
                    if stop.is_set():  # the loop has left
                        return
                q.put((end, None, None))
            except Exception as err:  # raised in the loop, not lost with the thread
                q.put((end, None, err))
            finally:
                if hasattr(it, "close"):  # a generator's own finally runs; a DataLoader's workers stop when `it` goes
                    it.close()

        thread = threading.Thread(target=produce, daemon=True)
        thread.start()
        try:
            while True:
                item, ready, err = q.get()
                if err is not None:
                    raise err
                if item is end:
                    return
                if ready is not None:  # the step's stream waits for the copy, and owns its memory from now on
                    step = torch.cuda.current_stream(self.device)
                    step.wait_event(ready)
                    for t in [item] if torch.is_tensor(item) else item.values() if isinstance(item, dict) else item:
                        t.record_stream(step)
                yield item
        finally:  # the loop ended, broke off or raised: stop the thread, free its put, wait for it
            stop.set()
            while not q.empty():
                q.get_nowait()
            thread.join()
'''


def mistake(old: str, new: str) -> str:
    """The reference Prefetcher with one mistake: ``old`` (which must be in it once) replaced by ``new``."""
    assert PREFETCHER.count(old) == 1, old
    return PREFETCHER.replace(old, new)


# no maxsize: the thread reads the whole iterable ahead (every batch in host memory at once)
PREFETCHER_UNBOUNDED = mistake("queue.Queue(maxsize=self.depth)", "queue.Queue()")
# no try/except in the thread: the exception ends the thread, and the loop waits for an item that never comes
PREFETCHER_LOSES_THE_ERROR = mistake(
    "            except Exception as err:  # raised in the loop, not lost with the thread\n"
    "                q.put((end, None, err))\n", "")
# the generator without its finally: a loop that breaks leaves the thread blocked on a
# full queue for good, holding the iterable's iterator (a DataLoader's workers run on)
PREFETCHER_NO_FINALLY = mistake(
    "        try:\n            while True:\n", "        if True:\n            while True:\n").replace(
    "        finally:  # the loop ended, broke off or raised: stop the thread, free its put, wait for it\n"
    "            stop.set()\n            while not q.empty():\n                q.get_nowait()\n            thread.join()\n", "")
# the stop event, but neither a drain nor a join: a thread blocked on put never sees it
PREFETCHER_STOP_WITHOUT_DRAIN = mistake(
    "            stop.set()\n            while not q.empty():\n                q.get_nowait()\n            thread.join()\n",
    "            stop.set()\n")
# the copy on the default stream: the GPU runs it between the step's kernels
PREFETCHER_DEFAULT_STREAM = mistake(
    "                        with torch.cuda.stream(side):  # the copy runs beside the step's kernels\n"
    "                            item = to_device(item, self.device, non_blocking=True)\n"
    "                            ready = side.record_event()\n",
    "                        item = to_device(item, self.device, non_blocking=True)\n"
    "                        ready = torch.cuda.current_stream(self.device).record_event()\n")
# the side stream, but the step's stream never waits for the copy: the step may read a batch still in flight
PREFETCHER_NO_WAIT = mistake("                    step.wait_event(ready)\n", "")
# no record_stream: the allocator may hand the batch's memory to the side stream's next copy while the step reads it
PREFETCHER_NO_RECORD_STREAM = mistake(
    "                    for t in [item] if torch.is_tensor(item) else item.values() if isinstance(item, dict) else item:\n"
    "                        t.record_stream(step)\n", "")

CALLS_LIBRARY_PREFETCHER = '''
from course_lib.dataloader import Prefetcher as _Theirs

class Prefetcher(_Theirs):   # course_lib's answer
    pass
'''

FULL = {"test_Prefetcher": 1, "test_Prefetcher_overlap": 2, "test_Prefetcher_depth": 2, "test_Prefetcher_errors": 1,
        "test_Prefetcher_stream": 2, "test_Prefetcher_shutdown": 2}


def scores(**changed):
    """Every test cell's points: full marks, but for ``changed``."""
    return {**FULL, **changed}


CASES = {
    "prefetcher_unbounded": {  # overlaps, but runs the whole iterable ahead
        "cells": {"Prefetcher": PREFETCHER_UNBOUNDED}, "scores": scores(test_Prefetcher_depth=0)},
    "prefetcher_loses_the_error": {  # the thread dies with the exception; the loop would wait forever
        "cells": {"Prefetcher": PREFETCHER_LOSES_THE_ERROR}, "scores": scores(test_Prefetcher_errors=0)},
    **{name: {"cells": {"Prefetcher": cell}, "scores": scores(**lost)} for name, cell, lost in [
        ("prefetcher_no_finally", PREFETCHER_NO_FINALLY, dict(test_Prefetcher_shutdown=0)),
        ("prefetcher_stop_without_drain", PREFETCHER_STOP_WITHOUT_DRAIN, dict(test_Prefetcher_shutdown=0)),
        ("prefetcher_default_stream", PREFETCHER_DEFAULT_STREAM, dict(test_Prefetcher_stream=0)),
        ("prefetcher_no_wait", PREFETCHER_NO_WAIT, dict(test_Prefetcher_stream=0)),
        ("prefetcher_no_record_stream", PREFETCHER_NO_RECORD_STREAM, dict(test_Prefetcher_stream=0)),
    ]},
    "calls_library_Prefetcher": {"cells": {"Prefetcher": CALLS_LIBRARY_PREFETCHER},
                                 "scores": scores(**{k: 0 for k in FULL})},
}
