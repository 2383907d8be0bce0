"""Known submissions of 07_ddp_reducer and the scores nbgrader's autograde must give them.

Each case replaces the named solution cells of the solution notebook; every other solution cell
keeps the reference solution. ``scores`` gives the expected points of every graded cell. The
mistakes are edits of today's solution cell (tests/solved.py), never copies of it.
"""

from solved import edit, solution

BUCKETED = solution("07_ddp_reducer", "BucketedDDP")
HOOK_LAUNCH = (
    "                if len(self.arrived[i]) == len(self.buckets[i]):  # the bucket is full: send it now\n"
    "                    flat = torch.cat([q.grad.reshape(-1) for q in self.buckets[i]])\n"
    "                    self.in_flight.append((i, flat, dist.all_reduce(flat, async_op=True)))\n")
RESET = ("        self.in_flight = []\n"
         "        self.arrived = [set() for _ in self.buckets]  # reset before raising: the next step starts clean\n")
RAISE = ("        if unused:\n"
         "            raise RuntimeError(f\"parameters that got no gradient in this backward: {', '.join(unused)}. \"\n"
         "                               \"Use every parameter in forward, or set requires_grad=False on the unused ones \"\n"
         "                               \"(torch's DDP: find_unused_parameters=True)\")")  # the cell's last line
NEEDS_GRAD = "reversed([p for p in module.parameters() if p.requires_grad])"

BUCKETED_SUM_NOT_AVERAGED = edit(BUCKETED, ("            flat /= world_size\n", ""))
BUCKETED_WAITS_FOR_THE_LAST_ONLY = edit(BUCKETED, (  # a bucket never waited on: its sum may not be there yet
    "            work.wait()\n", "            if i == self.in_flight[-1][0]:\n                work.wait()\n"))
BUCKETED_AFTER_BACKWARD = edit(BUCKETED, (HOOK_LAUNCH, ""), (  # right gradients, no overlap: all leave after backward
    "        world_size = dist.get_world_size()\n",
    "        world_size = dist.get_world_size()\n"
    "        for i, bucket in enumerate(self.buckets):\n"
    "            if len(self.arrived[i]) == len(bucket):\n"
    "                flat = torch.cat([q.grad.reshape(-1) for q in bucket])\n"
    "                self.in_flight.append((i, flat, dist.all_reduce(flat, async_op=True)))\n"))
# the same, and the rank's own log of its collectives rewritten so the first launch comes before the last gradient
# (the log is the closure of the patched dist.all_reduce): the grader's rank 0 never gets the first bucket in time
BUCKETED_AFTER_BACKWARD_FORGED = edit(BUCKETED_AFTER_BACKWARD, (
    "                self.in_flight.append((i, flat, dist.all_reduce(flat, async_op=True)))\n",
    "                self.in_flight.append((i, flat, dist.all_reduce(flat, async_op=True)))\n"
    "        cells = [c.cell_contents for c in dist.all_reduce.__closure__ or ()]\n"
    "        for log in [c for c in cells if hasattr(c, 'events')]:\n"
    "            launches = [e for e in log.events if e['what'] == 'all_reduce']\n"
    "            log.events[:] = launches[:1] + [e for e in log.events if e['what'] != 'all_reduce'] + launches[1:]\n"))
# each bucket launched from its hook, and waited on right there: right gradients, backward held up at every bucket
BUCKETED_WAITS_IN_THE_HOOK = edit(BUCKETED, (
    "                    self.in_flight.append((i, flat, dist.all_reduce(flat, async_op=True)))\n",
    "                    work = dist.all_reduce(flat, async_op=True)\n"
    "                    work.wait()\n"
    "                    self.in_flight.append((i, flat, work))\n"))
BUCKETED_COUNTS_NOT_RESET = edit(BUCKETED, (RESET, "        self.in_flight = []\n"))
# a BucketedDDP that never checks for a parameter without a gradient: a parameter the forward skips leaves its bucket
# unsent, without a word, and the ranks' gradients differ from then on
BUCKETED_SILENT = edit(BUCKETED, (RAISE, ""))
# the error, but raised before the reset: the next step starts from the failed step's bookkeeping
BUCKETED_RAISES_BEFORE_RESET = edit(BUCKETED, (RESET + RAISE, RAISE + "\n" + RESET))
BUCKETED_FROZEN_IN_A_BUCKET = edit(BUCKETED, (NEEDS_GRAD, "reversed(list(module.parameters()))"))
# buckets filled in the order of module.parameters(): the first layers' bucket, whose gradients come last, goes first
BUCKETED_FORWARD_ORDER = edit(BUCKETED, (NEEDS_GRAD, "[p for p in module.parameters() if p.requires_grad]"))
# the cap as a hard limit: a parameter that would take the bucket past it opens the next one (not torch's rule)
BUCKETED_BEFORE_THE_CAP = edit(BUCKETED, ("            if size >= cap:", "            if size + p.numel() * p.element_size() > cap:"))
BUCKETED_NO_BROADCAST = edit(BUCKETED, ("        for t in list(module.parameters()) + list(module.buffers()):\n"
                                        "            dist.broadcast(t.data, src=0)\n", ""))

CALLS_LIBRARY_BUCKETED = '''
from course_lib.parallel.ddp import BucketedDDP as _Theirs

class BucketedDDP(_Theirs):   # course_lib's answer
    pass
'''

CALLS_TORCH_DDP = '''
class BucketedDDP(torch.nn.Module):   # torch's DDP does the work; nothing to finish
    def __init__(self, module, bucket_cap_mb=25.0):
        super().__init__()
        self.ddp = torch.nn.parallel.DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb)
        self.module = module
        self.buckets = [[p] for p in reversed(list(module.parameters())) if p.requires_grad]

    def forward(self, *args, **kwargs):
        return self.ddp(*args, **kwargs)

    def finish_gradient_synchronization(self):
        pass
'''

FULL = {"test_BucketedDDP": 3, "test_BucketedDDP_buckets": 3, "test_BucketedDDP_unused": 2,
        "test_BucketedDDP_hidden": 4}


def scores(**changed):
    """Every test cell's points: full marks, but for ``changed``."""
    return {**FULL, **changed}


CASES = {
    **{name: {"cells": {"BucketedDDP": cell}, "scores": scores(**lost)} for name, cell, lost in [
        ("bucketed_sum_not_averaged", BUCKETED_SUM_NOT_AVERAGED, dict(test_BucketedDDP=0, test_BucketedDDP_hidden=0)),
        ("bucketed_waits_for_the_last_only", BUCKETED_WAITS_FOR_THE_LAST_ONLY,
         dict(test_BucketedDDP=0, test_BucketedDDP_buckets=0, test_BucketedDDP_hidden=0)),
        ("bucketed_after_backward", BUCKETED_AFTER_BACKWARD, dict(test_BucketedDDP_buckets=0)),
        ("bucketed_waits_in_the_hook", BUCKETED_WAITS_IN_THE_HOOK, dict(test_BucketedDDP_buckets=0)),
        ("bucketed_after_backward_forged_log", BUCKETED_AFTER_BACKWARD_FORGED, dict(test_BucketedDDP_buckets=0)),
        # not reset after any step, so not after the error either: the unused test's next step fails too
        ("bucketed_counts_not_reset", BUCKETED_COUNTS_NOT_RESET,
         dict(test_BucketedDDP=0, test_BucketedDDP_unused=0, test_BucketedDDP_hidden=0)),
        ("bucketed_silent_on_unused", BUCKETED_SILENT, dict(test_BucketedDDP_unused=0)),
        ("bucketed_raises_before_reset", BUCKETED_RAISES_BEFORE_RESET, dict(test_BucketedDDP_unused=0)),
        ("bucketed_frozen_in_a_bucket", BUCKETED_FROZEN_IN_A_BUCKET, dict(test_BucketedDDP_hidden=0)),
        ("bucketed_forward_order", BUCKETED_FORWARD_ORDER,
         dict(test_BucketedDDP_buckets=0, test_BucketedDDP_hidden=0)),
        ("bucketed_before_the_cap", BUCKETED_BEFORE_THE_CAP,
         dict(test_BucketedDDP_buckets=0, test_BucketedDDP_hidden=0)),
        # rank 0 (the grader's, in the buckets' checks) broadcasts as wrapping does: a rank that does not cannot match
        ("bucketed_no_broadcast", BUCKETED_NO_BROADCAST, dict(test_BucketedDDP_buckets=0, test_BucketedDDP_hidden=0)),
        ("calls_library_BucketedDDP", CALLS_LIBRARY_BUCKETED, {k: 0 for k in FULL}),
        ("calls_torch_ddp", CALLS_TORCH_DDP, {k: 0 for k in FULL}),
    ]},
}
