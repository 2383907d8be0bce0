"""Known submissions of 06_deepspeed_zero and the scores nbgrader's autograde must give them."""

# --- Exercise 1, ShardedOptimizer (ZeRO-1 by hand): the reference, and the mistakes students make

SHARDED = '''
import math

import torch.distributed as dist
import torch.nn.functional as F

class ShardedOptimizer:
    def __init__(self, params, optimizer_cls, **optimizer_kwargs):
        self.params = [p for p in params if p.requires_grad]
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.sizes = [math.ceil(p.numel() / self.world_size) for p in self.params]
        self.shards = []
        for p, n in zip(self.params, self.sizes):
            padded = F.pad(p.detach().reshape(-1), (0, n * self.world_size - p.numel()))
            self.shards.append(padded[self.rank * n:(self.rank + 1) * n].clone())
        self.optimizer = optimizer_cls(self.shards, **optimizer_kwargs)

    def step(self):
        for p, n, shard in zip(self.params, self.sizes, self.shards):
            if p.grad is None:
                shard.grad = None
            else:
                padded = F.pad(p.grad.reshape(-1), (0, n * self.world_size - p.numel()))
                shard.grad = padded[self.rank * n:(self.rank + 1) * n]
        self.optimizer.step()
        for p, n, shard in zip(self.params, self.sizes, self.shards):
            if p.grad is not None:
                full = p.new_empty(n * self.world_size)
                dist.all_gather(list(full.split(n)), shard.detach())  # slice r lands at r * n
                p.data.copy_(full[:p.numel()].view_as(p))

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None
'''


def _edit(old: str, new: str) -> str:
    assert SHARDED.count(old) == 1, old
    return SHARDED.replace(old, new)


SHARDED_KEEPS_ALL_STATES = '''
class ShardedOptimizer:   # every rank steps every parameter: right weights, no memory saved
    def __init__(self, params, optimizer_cls, **optimizer_kwargs):
        self.params = [p for p in params if p.requires_grad]
        self.optimizer = optimizer_cls(self.params, **optimizer_kwargs)

    def step(self):
        self.optimizer.step()

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=True)
'''

SHARDED_NO_ALL_GATHER = _edit(  # each rank updates only its own slice of the weights: the replicas drift apart
    "                full = p.new_empty(n * self.world_size)\n"
    "                dist.all_gather(list(full.split(n)), shard.detach())  # slice r lands at r * n\n"
    "                p.data.copy_(full[:p.numel()].view_as(p))\n",
    "                flat = p.data.reshape(-1)\n"
    "                start = self.rank * n\n"
    "                flat[start:start + n] = shard.detach()[:max(0, min(n, p.numel() - start))]\n")
SHARDED_UNPADDED = SHARDED.replace(  # chunk() without padding: uneven slices when the size does not divide
    "padded = F.pad(p.detach().reshape(-1), (0, n * self.world_size - p.numel()))",
    "padded = p.detach().reshape(-1)").replace(
    "padded = F.pad(p.grad.reshape(-1), (0, n * self.world_size - p.numel()))", "padded = p.grad.reshape(-1)")
SHARDED_STEPS_FROZEN = _edit(  # a parameter without a gradient crashes the step
    "            if p.grad is None:\n                shard.grad = None\n            else:\n"
    "                padded = F.pad(p.grad.reshape(-1), (0, n * self.world_size - p.numel()))\n"
    "                shard.grad = padded[self.rank * n:(self.rank + 1) * n]\n",
    "            padded = F.pad(p.grad.reshape(-1), (0, n * self.world_size - p.numel()))\n"
    "            shard.grad = padded[self.rank * n:(self.rank + 1) * n]\n").replace(
    "        self.params = [p for p in params if p.requires_grad]\n", "        self.params = list(params)\n")

CALLS_LIBRARY_SHARDED = '''
from course_lib.zero import ShardedOptimizer   # course_lib's ZeRO-1
'''

CALLS_TORCH_ZERO = '''
from torch.distributed.optim import ZeroRedundancyOptimizer

class ShardedOptimizer(ZeroRedundancyOptimizer):   # torch's ZeRO-1
    def __init__(self, params, optimizer_cls, **optimizer_kwargs):
        super().__init__(list(params), optimizer_class=optimizer_cls, **optimizer_kwargs)
        self.optimizer = self.optim
'''

# --- Exercise 2, make_ds_config

DS_CONFIG = '''
def make_ds_config(global_batch, micro_batch, world_size, stage, offload_optimizer=False):
    if global_batch % (micro_batch * world_size):
        raise ValueError(f"global_batch={global_batch} does not divide")
    zero = {"stage": stage}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": global_batch // (micro_batch * world_size),
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,
        "gradient_clipping": 1.0,
    }
'''


def _ds_edit(old: str, new: str) -> str:
    assert DS_CONFIG.count(old) == 1, old
    return DS_CONFIG.replace(old, new)


ACCUMULATION_IGNORES_WORLD = _ds_edit("global_batch // (micro_batch * world_size),",
                                      "global_batch // micro_batch,   # forgot the world size")
ACCUMULATION_FLOAT = _ds_edit("global_batch // (micro_batch * world_size),",
                              "global_batch / (micro_batch * world_size),   # 4.0: a float count")
NO_CLIPPING = _ds_edit('        "gradient_clipping": 1.0,\n', "")
OFFLOAD_AT_TOP_LEVEL = _ds_edit('''    zero = {"stage": stage}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {''', '''    zero = {"stage": stage}
    config = {''').replace('''        "gradient_clipping": 1.0,
    }
''', '''        "gradient_clipping": 1.0,
    }
    if offload_optimizer:
        config["offload_optimizer"] = {"device": "cpu"}   # outside zero_optimization: DeepSpeed ignores it
    return config
''')

CALLS_LIBRARY_DS_CONFIG = '''
def make_ds_config(global_batch, micro_batch, world_size, stage, offload_optimizer=False):
    from course_lib.zero import ds_config
    return ds_config(train_batch=global_batch, accum_steps=global_batch // (micro_batch * world_size),
                     world_size=world_size, stage=stage, offload_optimizer=offload_optimizer)   # course_lib's config
'''

# --- Exercise 3, OffloadedAdamW (ZeRO-Offload's step by hand): the reference, and the mistakes students make

_OFFLOAD_INIT = '''
class OffloadedAdamW:
    def __init__(self, params, lr=1e-3, weight_decay=0.01, offload_device="cpu"):
        self.params = [p for p in params if p.requires_grad]
        self.master = [p.detach().to(offload_device, torch.float32, copy=True) for p in self.params]
        self.optimizer = torch.optim.AdamW(self.master, lr=lr, weight_decay=weight_decay)
'''

OFFLOADED = _OFFLOAD_INIT + '''        for p, m in zip(self.params, self.master):
            p.register_post_accumulate_grad_hook(lambda p, m=m: self._send_down(p, m))

    def _send_down(self, p, m):
        if m.grad is None:
            m.grad = p.grad.detach().to(m.device, torch.float32)
        else:
            m.grad += p.grad.detach().to(m.device, torch.float32)
        p.grad = None

    def step(self):
        self.optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                if m.grad is not None:
                    p.copy_(m)
                    m.grad = None

    def zero_grad(self, set_to_none=True):
        for p, m in zip(self.params, self.master):
            p.grad = None
            m.grad = None
'''

# the contract before gradients left during backward: every gradient stays on the model until step() sends it down
OFFLOAD_AT_STEP = _OFFLOAD_INIT + '''
    def step(self):
        for p, m in zip(self.params, self.master):
            m.grad = None if p.grad is None else p.grad.detach().to(m.device, torch.float32)
        self.optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                if m.grad is not None:
                    p.copy_(m)
                    p.grad = None

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None
'''


def _offload_edit(old: str, new: str) -> str:
    assert OFFLOADED.count(old) == 1, old
    return OFFLOADED.replace(old, new)


OFFLOAD_MASTER_IN_MODEL_DTYPE = _offload_edit(  # the "master" keeps the model's bf16: the small updates are lost
    "p.detach().to(offload_device, torch.float32, copy=True)", "p.detach().to(offload_device, copy=True)").replace(
    "p.grad.detach().to(m.device, torch.float32)", "p.grad.detach().to(m.device)")
OFFLOAD_ZERO_GRAD_FOR_MISSING = _offload_edit(  # a parameter without a gradient gets a zero one: weight decay moves it
    "    def step(self):\n        self.optimizer.step()",
    "    def step(self):\n        for m in self.master:\n            if m.grad is None:\n"
    "                m.grad = torch.zeros_like(m)\n        self.optimizer.step()")
OFFLOAD_OVERWRITES_MICRO_BATCHES = _offload_edit(  # each micro-batch replaces the last: accumulation loses all but one
    "        if m.grad is None:\n            m.grad = p.grad.detach().to(m.device, torch.float32)\n        else:\n"
    "            m.grad += p.grad.detach().to(m.device, torch.float32)\n",
    "        m.grad = p.grad.detach().to(m.device, torch.float32)\n")
OFFLOAD_KEEPS_MASTER_GRAD = _offload_edit(  # step() leaves the masters' gradients: the next step adds to the last one's
    "                    p.copy_(m)\n                    m.grad = None\n", "                    p.copy_(m)\n")
OFFLOAD_GRAD_LEFT_ON_MODEL = _offload_edit(  # copied down, but never freed: the device still holds every gradient
    "            m.grad += p.grad.detach().to(m.device, torch.float32)\n        p.grad = None\n",
    "            m.grad += p.grad.detach().to(m.device, torch.float32)\n")

CALLS_LIBRARY_OFFLOADED = '''
from course_lib.zero import OffloadedAdamW   # course_lib's
'''

FULL = {"test_ShardedOptimizer": 3, "test_ShardedOptimizer_state": 3, "test_ShardedOptimizer_hidden": 4,
        "test_make_ds_config": 2, "test_make_ds_config_hidden": 2, "test_OffloadedAdamW": 3, "test_OffloadedAdamW_hidden": 3}
NO_SHARDED = dict(test_ShardedOptimizer=0, test_ShardedOptimizer_state=0, test_ShardedOptimizer_hidden=0)

CASES = {
    "sharded_keeps_all_states": {"cells": {"ShardedOptimizer": SHARDED_KEEPS_ALL_STATES},
                                 "scores": {**FULL, "test_ShardedOptimizer_state": 0, "test_ShardedOptimizer_hidden": 0}},
    "sharded_no_all_gather": {"cells": {"ShardedOptimizer": SHARDED_NO_ALL_GATHER},
                              "scores": {**FULL, "test_ShardedOptimizer": 0, "test_ShardedOptimizer_hidden": 0}},
    "sharded_unpadded": {"cells": {"ShardedOptimizer": SHARDED_UNPADDED},  # right on 2 ranks, wrong on 3
                         "scores": {**FULL, "test_ShardedOptimizer_hidden": 0}},
    "sharded_steps_frozen": {"cells": {"ShardedOptimizer": SHARDED_STEPS_FROZEN},
                             "scores": {**FULL, "test_ShardedOptimizer_hidden": 0}},
    "calls_library_ShardedOptimizer": {"cells": {"ShardedOptimizer": CALLS_LIBRARY_SHARDED},
                                       "scores": {**FULL, **NO_SHARDED}},
    "calls_torch_zero_redundancy_optimizer": {"cells": {"ShardedOptimizer": CALLS_TORCH_ZERO},
                                              "scores": {**FULL, **NO_SHARDED}},
    "accumulation_ignores_world": {"cells": {"make_ds_config": ACCUMULATION_IGNORES_WORLD},
                                   "scores": {**FULL, "test_make_ds_config": 0, "test_make_ds_config_hidden": 0}},
    "accumulation_float": {  # DeepSpeed takes 2.0; the training loop's micro-batch split then cannot
        "cells": {"make_ds_config": ACCUMULATION_FLOAT},
        "scores": {**FULL, "test_make_ds_config": 0, "test_make_ds_config_hidden": 0}},
    "no_clipping": {"cells": {"make_ds_config": NO_CLIPPING}, "scores": {**FULL, "test_make_ds_config": 0}},
    "offload_at_top_level": {"cells": {"make_ds_config": OFFLOAD_AT_TOP_LEVEL},
                             "scores": {**FULL, "test_make_ds_config_hidden": 0}},
    "offload_master_in_model_dtype": {"cells": {"OffloadedAdamW": OFFLOAD_MASTER_IN_MODEL_DTYPE},
                                      "scores": {**FULL, "test_OffloadedAdamW": 0, "test_OffloadedAdamW_hidden": 0}},
    "offload_zero_grad_for_missing": {"cells": {"OffloadedAdamW": OFFLOAD_ZERO_GRAD_FOR_MISSING},  # right until a
                                      "scores": {**FULL, "test_OffloadedAdamW_hidden": 0}},          # layer gets none
    "offload_at_step": {"cells": {"OffloadedAdamW": OFFLOAD_AT_STEP},
                        "scores": {**FULL, "test_OffloadedAdamW": 0, "test_OffloadedAdamW_hidden": 0}},
    "offload_overwrites_micro_batches": {"cells": {"OffloadedAdamW": OFFLOAD_OVERWRITES_MICRO_BATCHES},
                                         "scores": {**FULL, "test_OffloadedAdamW_hidden": 0}},
    "offload_keeps_master_grad": {"cells": {"OffloadedAdamW": OFFLOAD_KEEPS_MASTER_GRAD},  # zero_grad hides it
                                  "scores": {**FULL, "test_OffloadedAdamW_hidden": 0}},         # in the visible test
    "offload_grad_left_on_model": {"cells": {"OffloadedAdamW": OFFLOAD_GRAD_LEFT_ON_MODEL},
                                   "scores": {**FULL, "test_OffloadedAdamW": 0, "test_OffloadedAdamW_hidden": 0}},
    "calls_library_OffloadedAdamW": {"cells": {"OffloadedAdamW": CALLS_LIBRARY_OFFLOADED},
                                     "scores": {**FULL, "test_OffloadedAdamW": 0, "test_OffloadedAdamW_hidden": 0}},
    "calls_library_make_ds_config": {"cells": {"make_ds_config": CALLS_LIBRARY_DS_CONFIG},
                                     "scores": {**FULL, "test_make_ds_config": 0, "test_make_ds_config_hidden": 0}},
}

# The submission that loops forever in one exercise, and the one that edits a test cell.
LOOP_CELL = "make_ds_config"
CELL_TIMEOUT = 150  # test cells launch 2 processes: about 8 s each on 2 idle cores, 60 s and more beside another test worker
