"""Known submissions of 07_ddp_reducer and the scores nbgrader's autograde must give them.

Each case replaces the named solution cells of the solution notebook; every other solution cell
keeps the reference solution. ``scores`` gives the expected points of every graded cell.
"""

BUCKETED = '''
class BucketedDDP(torch.nn.Module):
    def __init__(self, module, bucket_cap_mb=25.0):
        super().__init__()
        self.module = module
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src=0)
        cap = bucket_cap_mb * 2**20
        self.buckets, size = [], cap + 1
        for p in reversed([p for p in module.parameters() if p.requires_grad]):
            nbytes = p.numel() * p.element_size()
            if size + nbytes > cap:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += nbytes
        self.names = {id(p): name for name, p in module.named_parameters()}
        self.arrived = [set() for _ in self.buckets]
        self.in_flight = []

        def hook_for(i):
            def hook(param):
                self.arrived[i].add(id(param))
                if len(self.arrived[i]) == len(self.buckets[i]):
                    flat = torch.cat([q.grad.reshape(-1) for q in self.buckets[i]])
                    self.in_flight.append((i, flat, dist.all_reduce(flat, async_op=True)))
            return hook

        for i, bucket in enumerate(self.buckets):
            for p in bucket:
                p.register_post_accumulate_grad_hook(hook_for(i))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        world_size = dist.get_world_size()
        for i, flat, work in self.in_flight:
            work.wait()
            flat /= world_size
            offset = 0
            for p in self.buckets[i]:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        unused = [f"{self.names[id(p)]} (bucket {i})" for i, bucket in enumerate(self.buckets)
                  for p in bucket if id(p) not in self.arrived[i]]
        self.in_flight = []
        self.arrived = [set() for _ in self.buckets]
        if unused:
            raise RuntimeError(f"no gradient for {', '.join(unused)}: use every parameter in forward, "
                               "or set requires_grad=False on the unused ones")
'''


def mistake(old: str, new: str) -> str:
    """The reference BucketedDDP with one mistake: ``old`` (which must be in it once) replaced by ``new``."""
    assert BUCKETED.count(old) == 1, old
    return BUCKETED.replace(old, new)


BUCKETED_SUM_NOT_AVERAGED = mistake("            flat /= world_size\n", "")
BUCKETED_WAITS_FOR_THE_LAST_ONLY = mistake(  # a bucket never waited on: its sum may not be there yet
    "            work.wait()\n", "            if i == self.in_flight[-1][0]:\n                work.wait()\n")
BUCKETED_AFTER_BACKWARD = mistake(  # right gradients, no overlap: every bucket leaves after backward has ended
    "                if len(self.arrived[i]) == len(self.buckets[i]):\n"
    "                    flat = torch.cat([q.grad.reshape(-1) for q in self.buckets[i]])\n"
    "                    self.in_flight.append((i, flat, dist.all_reduce(flat, async_op=True)))\n", "").replace(
    "        world_size = dist.get_world_size()\n",
    "        world_size = dist.get_world_size()\n"
    "        for i, bucket in enumerate(self.buckets):\n"
    "            if len(self.arrived[i]) == len(bucket):\n"
    "                flat = torch.cat([q.grad.reshape(-1) for q in bucket])\n"
    "                self.in_flight.append((i, flat, dist.all_reduce(flat, async_op=True)))\n")
BUCKETED_COUNTS_NOT_RESET = mistake("        self.in_flight = []\n        self.arrived = [set() for _ in self.buckets]\n",
                                  "        self.in_flight = []\n")
# a BucketedDDP that never checks for a parameter without a gradient: a parameter the forward skips leaves its bucket
# unsent, without a word, and the ranks' gradients differ from then on
BUCKETED_SILENT = mistake(
    "        unused = [f\"{self.names[id(p)]} (bucket {i})\" for i, bucket in enumerate(self.buckets)\n"
    "                  for p in bucket if id(p) not in self.arrived[i]]\n", "").replace(
    "        if unused:\n"
    "            raise RuntimeError(f\"no gradient for {', '.join(unused)}: use every parameter in forward, \"\n"
    "                               \"or set requires_grad=False on the unused ones\")\n", "")
# the error, but raised before the reset: the next step starts from the failed step's bookkeeping
BUCKETED_RAISES_BEFORE_RESET = mistake(
    "        self.in_flight = []\n        self.arrived = [set() for _ in self.buckets]\n"
    "        if unused:\n"
    "            raise RuntimeError(f\"no gradient for {', '.join(unused)}: use every parameter in forward, \"\n"
    "                               \"or set requires_grad=False on the unused ones\")\n",
    "        if unused:\n"
    "            raise RuntimeError(f\"no gradient for {', '.join(unused)}: use every parameter in forward, \"\n"
    "                               \"or set requires_grad=False on the unused ones\")\n"
    "        self.in_flight = []\n        self.arrived = [set() for _ in self.buckets]\n")
BUCKETED_FROZEN_IN_A_BUCKET = mistake("reversed([p for p in module.parameters() if p.requires_grad])",
                                    "reversed(list(module.parameters()))")
# buckets filled in the order of module.parameters(): the first layers' bucket, whose gradients come last, goes first
BUCKETED_FORWARD_ORDER = mistake("reversed([p for p in module.parameters() if p.requires_grad])",
                                 "[p for p in module.parameters() if p.requires_grad]")
# a bucket closed only once it is past the cap, the parameter that crossed it inside (torch's reducer's rule)
BUCKETED_PAST_THE_CAP = mistake("            if size + nbytes > cap:\n", "            if size > cap:\n")
BUCKETED_NO_BROADCAST = mistake("        for t in list(module.parameters()) + list(module.buffers()):\n"
                              "            dist.broadcast(t.data, src=0)\n", "")

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
         dict(test_BucketedDDP=0, test_BucketedDDP_hidden=0)),
        ("bucketed_after_backward", BUCKETED_AFTER_BACKWARD, dict(test_BucketedDDP_buckets=0)),
        # not reset after any step, so not after the error either: the unused test's next step fails too
        ("bucketed_counts_not_reset", BUCKETED_COUNTS_NOT_RESET,
         dict(test_BucketedDDP=0, test_BucketedDDP_unused=0, test_BucketedDDP_hidden=0)),
        ("bucketed_silent_on_unused", BUCKETED_SILENT, dict(test_BucketedDDP_unused=0)),
        ("bucketed_raises_before_reset", BUCKETED_RAISES_BEFORE_RESET, dict(test_BucketedDDP_unused=0)),
        ("bucketed_frozen_in_a_bucket", BUCKETED_FROZEN_IN_A_BUCKET, dict(test_BucketedDDP_hidden=0)),
        ("bucketed_forward_order", BUCKETED_FORWARD_ORDER, dict(test_BucketedDDP_buckets=0)),
        ("bucketed_past_the_cap", BUCKETED_PAST_THE_CAP, dict(test_BucketedDDP_buckets=0)),
        ("bucketed_no_broadcast", BUCKETED_NO_BROADCAST, dict(test_BucketedDDP_hidden=0)),
        ("calls_library_BucketedDDP", CALLS_LIBRARY_BUCKETED, {k: 0 for k in FULL}),
        ("calls_torch_ddp", CALLS_TORCH_DDP, {k: 0 for k in FULL}),
    ]},
}
