"""Known submissions of 05_input_pipeline and the scores nbgrader's autograde must give them.

Each case replaces the named solution cells of the solution notebook; every other solution cell
keeps the reference solution. ``scores`` gives the expected points of every graded cell. The
mistakes are edits of today's solution cell (tests/solved.py), never copies of it.
"""

from solved import edit, solution

# --- the prefetcher: the reference, and the mistakes students make, each a small edit of it

PREFETCHER = solution("05_input_pipeline", "Prefetcher")

# no maxsize: the thread reads the whole iterable ahead (every batch in host memory at once)
PREFETCHER_UNBOUNDED = edit(PREFETCHER, ("queue.Queue(maxsize=self.depth)", "queue.Queue()"))
# no try/except in the thread: the exception ends the thread, and the loop waits for an item that never comes
PREFETCHER_LOSES_THE_ERROR = edit(PREFETCHER, (
    "            except Exception as err:  # raised in the loop, not lost with the thread\n"
    "                q.put((end, None, err))\n", ""))
# the generator without its finally: a loop that breaks leaves the thread blocked on a
# full queue for good, holding the iterable's iterator (a DataLoader's workers run on)
PREFETCHER_NO_FINALLY = edit(PREFETCHER, (
    "        try:\n            while True:\n", "        if True:\n            while True:\n"), (
    "        finally:  # the loop ended, broke off or raised: stop the thread, free its put, wait for it\n"
    "            stop.set()\n            while not q.empty():\n                q.get_nowait()\n            thread.join()", ""))
# the stop event, but neither a drain nor a join: a thread blocked on put never sees it
PREFETCHER_STOP_WITHOUT_DRAIN = edit(PREFETCHER, (  # the cell's last lines
    "            stop.set()\n            while not q.empty():\n                q.get_nowait()\n            thread.join()",
    "            stop.set()"))
# the copy on the default stream: the GPU runs it between the step's kernels
PREFETCHER_DEFAULT_STREAM = edit(PREFETCHER, (
    "                        with torch.cuda.stream(side):  # the copy runs beside the step's kernels\n"
    "                            item = to_device(item, self.device, non_blocking=True)\n"
    "                            ready = side.record_event()\n",
    "                        item = to_device(item, self.device, non_blocking=True)\n"
    "                        ready = torch.cuda.current_stream(self.device).record_event()\n"))
# the side stream, but the step's stream never waits for the copy: the step may read a batch still in flight
PREFETCHER_NO_WAIT = edit(PREFETCHER, ("                    step.wait_event(ready)\n", ""))
# no record_stream: the allocator may hand the batch's memory to the side stream's next copy while the step reads it
PREFETCHER_NO_RECORD_STREAM = edit(PREFETCHER, (
    "                    for t in [item] if torch.is_tensor(item) else item.values() if isinstance(item, dict) else item:\n"
    "                        t.record_stream(step)\n", ""))

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
