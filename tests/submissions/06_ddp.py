"""Known submissions of 06_ddp and the scores nbgrader's autograde must give them.

Each case replaces the named solution cells of the solution notebook; every other solution cell
keeps the reference solution. ``scores`` gives the expected points of every graded cell.
"""

NO_SET_EPOCH = '''
def rank_batches(n_samples, rank, world_size, epoch, batch_size, seed=0):
    data = range(n_samples)
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True)
    # forgot: sampler.set_epoch(epoch) -- every epoch replays epoch 0's order
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler, drop_last=True)
    return [[int(i) for i in batch] for batch in loader]
'''

NO_SAMPLER = '''
def rank_batches(n_samples, rank, world_size, epoch, batch_size, seed=0):
    # no DistributedSampler: every rank shuffles and reads the whole data set
    g = torch.Generator().manual_seed(seed + epoch)
    loader = DataLoader(range(n_samples), batch_size=batch_size, shuffle=True, generator=g, drop_last=True)
    return [[int(i) for i in batch] for batch in loader]
'''

SUM_NOT_DIVIDED = '''
def average_gradients(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)   # forgot: / world size (an N x learning rate)
'''

REDUCE_TO_RANK_0 = '''
def average_gradients(model):
    world_size = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            dist.reduce(p.grad, dst=0, op=dist.ReduceOp.SUM)   # only rank 0 gets the sum: replicas drift apart
            p.grad /= world_size
'''

DIVIDED_BY_TWO = '''
def average_gradients(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad /= 2   # hard-coded world size: right on 2 ranks only
'''

SAMPLER_PADS = '''
def rank_batches(n_samples, rank, world_size, epoch, batch_size, seed=0):
    data = range(n_samples)
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)  # pads: repeats
    sampler.set_epoch(epoch)
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler, drop_last=True)   # drops a short batch only
    return [[int(i) for i in batch] for batch in loader]
'''

# --- Exercise 4, BucketedDDP: the reference, and the mistakes students make, each a small edit of it

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


def _edit(old: str, new: str) -> str:
    assert BUCKETED.count(old) == 1, old
    return BUCKETED.replace(old, new)


BUCKETED_SUM_NOT_AVERAGED = _edit("            flat /= world_size\n", "")
BUCKETED_WAITS_FOR_THE_LAST_ONLY = _edit(  # a bucket never waited on: its sum may not be there yet
    "            work.wait()\n", "            if i == self.in_flight[-1][0]:\n                work.wait()\n")
BUCKETED_AFTER_BACKWARD = _edit(  # right gradients, no overlap: every bucket leaves after backward has ended
    "                if len(self.arrived[i]) == len(self.buckets[i]):\n"
    "                    flat = torch.cat([q.grad.reshape(-1) for q in self.buckets[i]])\n"
    "                    self.in_flight.append((i, flat, dist.all_reduce(flat, async_op=True)))\n", "").replace(
    "        world_size = dist.get_world_size()\n",
    "        world_size = dist.get_world_size()\n"
    "        for i, bucket in enumerate(self.buckets):\n"
    "            if len(self.arrived[i]) == len(bucket):\n"
    "                flat = torch.cat([q.grad.reshape(-1) for q in bucket])\n"
    "                self.in_flight.append((i, flat, dist.all_reduce(flat, async_op=True)))\n")
BUCKETED_COUNTS_NOT_RESET = _edit("        self.in_flight = []\n        self.arrived = [set() for _ in self.buckets]\n",
                                  "        self.in_flight = []\n")
# the course's BucketedDDP before issue 23: a parameter the forward skips leaves its bucket unsent, without a word,
# and the ranks' gradients differ from then on
BUCKETED_SILENT = _edit(
    "        unused = [f\"{self.names[id(p)]} (bucket {i})\" for i, bucket in enumerate(self.buckets)\n"
    "                  for p in bucket if id(p) not in self.arrived[i]]\n", "").replace(
    "        if unused:\n"
    "            raise RuntimeError(f\"no gradient for {', '.join(unused)}: use every parameter in forward, \"\n"
    "                               \"or set requires_grad=False on the unused ones\")\n", "")
# the error, but raised before the reset: the next step starts from the failed step's bookkeeping
BUCKETED_RAISES_BEFORE_RESET = _edit(
    "        self.in_flight = []\n        self.arrived = [set() for _ in self.buckets]\n"
    "        if unused:\n"
    "            raise RuntimeError(f\"no gradient for {', '.join(unused)}: use every parameter in forward, \"\n"
    "                               \"or set requires_grad=False on the unused ones\")\n",
    "        if unused:\n"
    "            raise RuntimeError(f\"no gradient for {', '.join(unused)}: use every parameter in forward, \"\n"
    "                               \"or set requires_grad=False on the unused ones\")\n"
    "        self.in_flight = []\n        self.arrived = [set() for _ in self.buckets]\n")
BUCKETED_FROZEN_IN_A_BUCKET = _edit("reversed([p for p in module.parameters() if p.requires_grad])",
                                    "reversed(list(module.parameters()))")
BUCKETED_NO_BROADCAST = _edit("        for t in list(module.parameters()) + list(module.buffers()):\n"
                              "            dist.broadcast(t.data, src=0)\n", "")

CALLS_LIBRARY_BUCKETED = '''
from course_lib.ddp import BucketedDDP as _Theirs

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

_EX1_FULL = {"test_rank_batches": 2, "test_rank_batches_epochs": 1, "test_rank_batches_hidden": 2}
_EX2_FULL = {"test_average_gradients": 2, "test_average_gradients_hidden": 2}
_EX3_FULL = {"test_BucketedDDP": 3, "test_BucketedDDP_buckets": 3, "test_BucketedDDP_unused": 2,
             "test_BucketedDDP_hidden": 4}

CALLS_LIBRARY_RANK_BATCHES = '''
def rank_batches(n_samples, rank, world_size, epoch, batch_size, seed=0):
    from course_lib.distributed import sharded_loader
    loader, sampler = sharded_loader(range(n_samples), batch_size * world_size, seed)   # course_lib's loader
    sampler.set_epoch(epoch)
    return [[int(i) for i in batch] for batch in loader]
'''

CALLS_LIBRARY_AVERAGE = '''
def average_gradients(model):
    from course_lib.ddp import all_reduce_gradients
    all_reduce_gradients(model)   # course_lib's all-reduce
'''

# --- Exercise 2, Prefetcher: the reference, and the mistakes students make, each a small edit of it

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


def _edit_prefetcher(old: str, new: str) -> str:
    assert PREFETCHER.count(old) == 1, old
    return PREFETCHER.replace(old, new)


# no maxsize: the thread reads the whole iterable ahead (every batch in host memory at once)
PREFETCHER_UNBOUNDED = _edit_prefetcher("queue.Queue(maxsize=self.depth)", "queue.Queue()")
# no try/except in the thread: the exception ends the thread, and the loop waits for an item that never comes
PREFETCHER_LOSES_THE_ERROR = _edit_prefetcher(
    "            except Exception as err:  # raised in the loop, not lost with the thread\n"
    "                q.put((end, None, err))\n", "")
# the generator without its finally (the course's before issue 23): a loop that breaks leaves the thread blocked on a
# full queue for good, holding the iterable's iterator (a DataLoader's workers run on)
PREFETCHER_NO_FINALLY = _edit_prefetcher(
    "        try:\n            while True:\n", "        if True:\n            while True:\n").replace(
    "        finally:  # the loop ended, broke off or raised: stop the thread, free its put, wait for it\n"
    "            stop.set()\n            while not q.empty():\n                q.get_nowait()\n            thread.join()\n", "")
# the stop event, but neither a drain nor a join: a thread blocked on put never sees it
PREFETCHER_STOP_WITHOUT_DRAIN = _edit_prefetcher(
    "            stop.set()\n            while not q.empty():\n                q.get_nowait()\n            thread.join()\n",
    "            stop.set()\n")
# the copy on the default stream (the course's before issue 23): the GPU runs it between the step's kernels
PREFETCHER_DEFAULT_STREAM = _edit_prefetcher(
    "                        with torch.cuda.stream(side):  # the copy runs beside the step's kernels\n"
    "                            item = to_device(item, self.device, non_blocking=True)\n"
    "                            ready = side.record_event()\n",
    "                        item = to_device(item, self.device, non_blocking=True)\n"
    "                        ready = torch.cuda.current_stream(self.device).record_event()\n")
# the side stream, but the step's stream never waits for the copy: the step may read a batch still in flight
PREFETCHER_NO_WAIT = _edit_prefetcher("                    step.wait_event(ready)\n", "")
# no record_stream: the allocator may hand the batch's memory to the side stream's next copy while the step reads it
PREFETCHER_NO_RECORD_STREAM = _edit_prefetcher(
    "                    for t in [item] if torch.is_tensor(item) else item.values() if isinstance(item, dict) else item:\n"
    "                        t.record_stream(step)\n", "")

CALLS_LIBRARY_PREFETCHER = '''
from course_lib.dataloader import Prefetcher as _Theirs

class Prefetcher(_Theirs):   # course_lib's answer
    pass
'''

_PREFETCHER_FULL = {"test_Prefetcher": 1, "test_Prefetcher_overlap": 2, "test_Prefetcher_depth": 2,
                    "test_Prefetcher_errors": 1, "test_Prefetcher_stream": 2, "test_Prefetcher_shutdown": 2}

CASES = {
    "no_set_epoch": {  # shards fine, but the same order every epoch
        "cells": {"rank_batches": NO_SET_EPOCH},
        "scores": {"test_rank_batches": 2, "test_rank_batches_epochs": 0, "test_rank_batches_hidden": 0, **_EX2_FULL, **_EX3_FULL},
    },
    "no_sampler": {  # reshuffles per epoch, but the ranks read the same samples
        "cells": {"rank_batches": NO_SAMPLER},
        "scores": {"test_rank_batches": 0, "test_rank_batches_epochs": 1, "test_rank_batches_hidden": 0, **_EX2_FULL, **_EX3_FULL},
    },
    "sum_not_divided": {
        "cells": {"average_gradients": SUM_NOT_DIVIDED},
        "scores": {**_EX1_FULL, "test_average_gradients": 0, "test_average_gradients_hidden": 0, **_EX3_FULL},
    },
    "reduce_to_rank_0": {
        "cells": {"average_gradients": REDUCE_TO_RANK_0},
        "scores": {**_EX1_FULL, "test_average_gradients": 0, "test_average_gradients_hidden": 0, **_EX3_FULL},
    },
    "divided_by_two": {  # passes on 2 ranks, fails on 3
        "cells": {"average_gradients": DIVIDED_BY_TWO},
        "scores": {**_EX1_FULL, "test_average_gradients": 2, "test_average_gradients_hidden": 0, **_EX3_FULL},
    },
    "calls_library_rank_batches": {
        "cells": {"rank_batches": CALLS_LIBRARY_RANK_BATCHES},
        "scores": {"test_rank_batches": 0, "test_rank_batches_epochs": 0, "test_rank_batches_hidden": 0, **_EX2_FULL, **_EX3_FULL},
    },
    "calls_library_average_gradients": {
        "cells": {"average_gradients": CALLS_LIBRARY_AVERAGE},
        "scores": {**_EX1_FULL, "test_average_gradients": 0, "test_average_gradients_hidden": 0, **_EX3_FULL},
    },
    "sampler_pads": {  # drop_last on the DataLoader only: the sampler repeats indices to even out the shards
        "cells": {"rank_batches": SAMPLER_PADS},
        "scores": {**_EX1_FULL, "test_rank_batches_hidden": 0, **_EX2_FULL, **_EX3_FULL},
    },
    **{name: {"cells": {"BucketedDDP": cell}, "scores": {**_EX1_FULL, **_EX2_FULL, **_EX3_FULL, **lost}} for name, cell, lost in [
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
        ("bucketed_no_broadcast", BUCKETED_NO_BROADCAST, dict(test_BucketedDDP_hidden=0)),
        ("calls_library_BucketedDDP", CALLS_LIBRARY_BUCKETED, {k: 0 for k in _EX3_FULL}),
        ("calls_torch_ddp", CALLS_TORCH_DDP, {k: 0 for k in _EX3_FULL}),
    ]},
    "prefetcher_unbounded": {  # overlaps, but runs the whole iterable ahead
        "cells": {"Prefetcher": PREFETCHER_UNBOUNDED},
        "scores": {**_EX1_FULL, **_EX2_FULL, **_EX3_FULL, **_PREFETCHER_FULL, "test_Prefetcher_depth": 0},
    },
    "prefetcher_loses_the_error": {  # the thread dies with the exception; the loop would wait forever
        "cells": {"Prefetcher": PREFETCHER_LOSES_THE_ERROR},
        "scores": {**_EX1_FULL, **_EX2_FULL, **_EX3_FULL, **_PREFETCHER_FULL, "test_Prefetcher_errors": 0},
    },
    **{name: {"cells": {"Prefetcher": cell}, "scores": {**_EX1_FULL, **_EX2_FULL, **_EX3_FULL, **_PREFETCHER_FULL, **lost}}
       for name, cell, lost in [
        ("prefetcher_no_finally", PREFETCHER_NO_FINALLY, dict(test_Prefetcher_shutdown=0)),
        ("prefetcher_stop_without_drain", PREFETCHER_STOP_WITHOUT_DRAIN, dict(test_Prefetcher_shutdown=0)),
        ("prefetcher_default_stream", PREFETCHER_DEFAULT_STREAM, dict(test_Prefetcher_stream=0)),
        ("prefetcher_no_wait", PREFETCHER_NO_WAIT, dict(test_Prefetcher_stream=0)),
        ("prefetcher_no_record_stream", PREFETCHER_NO_RECORD_STREAM, dict(test_Prefetcher_stream=0)),
    ]},
    "calls_library_Prefetcher": {
        "cells": {"Prefetcher": CALLS_LIBRARY_PREFETCHER},
        "scores": {**_EX1_FULL, **_EX2_FULL, **_EX3_FULL, **{k: 0 for k in _PREFETCHER_FULL}},
    },
}
# every other case leaves the Prefetcher exercise alone: full marks there
for _case in CASES.values():
    _case["scores"] = {**_PREFETCHER_FULL, **_case["scores"]}

# The submission that loops forever in one exercise, and the one that edits a test cell.
LOOP_CELL = "average_gradients"
