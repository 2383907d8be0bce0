"""Known submissions of 09_deepspeed_zero and the scores nbgrader's autograde must give them."""

# --- Exercise 1, ShardedOptimizer (ZeRO-1 by hand): the reference, and the mistakes students make

SHARDED = '''
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

# torch 2.13 renamed the flat collectives (reduce_scatter_tensor and all_gather_into_tensor warn, deprecated)
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

class ShardedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, optimizer_cls, **defaults):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.optimizer_cls, self.optimizer, self.shards = optimizer_cls, None, []
        super().__init__(params, defaults)  # torch builds self.param_groups, calling add_param_group for each group

    def add_param_group(self, param_group):
        super().add_param_group(param_group)  # torch fills in the defaults
        group = self.param_groups[-1]
        group["params"] = [p for p in group["params"] if p.requires_grad]  # a frozen parameter takes no part
        flat = torch.cat([p.detach().reshape(-1) for p in group["params"]])
        n = math.ceil(flat.numel() / self.world_size)  # one slice per rank
        flat = F.pad(flat, (0, n * self.world_size - flat.numel()))  # zeros at the end
        shard = flat[self.rank * n:(self.rank + 1) * n].float().clone()  # this rank's fp32 slice
        self.shards.append(shard)
        inner = {**{k: v for k, v in group.items() if k != "params"}, "params": [shard]}
        if self.optimizer is None:
            self.optimizer = self.optimizer_cls([inner], **self.defaults)
        else:
            self.optimizer.add_param_group(inner)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, inner, shard in zip(self.param_groups, self.optimizer.param_groups, self.shards):
            inner.update({k: v for k, v in group.items() if k != "params"})  # a scheduler changed group["lr"]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in group["params"]]
            flat = torch.cat([g.reshape(-1) for g in grads])
            flat = F.pad(flat, (0, shard.numel() * self.world_size - flat.numel()))
            mine = flat.new_empty(shard.numel())
            reduce_scatter(mine, flat)  # the sum over the ranks of slice `rank`
            shard.grad = (mine / self.world_size).float()  # the average
        self.optimizer.step()
        for group, shard in zip(self.param_groups, self.shards):
            params = group["params"]
            full = params[0].new_empty(shard.numel() * self.world_size)
            all_gather(full, shard.to(full.dtype))  # rank r's slice lands at r * n
            offset = 0
            for p in params:
                p.copy_(full[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        return loss

    def zero_grad(self, set_to_none=True):
        for group, shard in zip(self.param_groups, self.shards):
            for p in group["params"]:
                p.grad = None
            shard.grad = None

    def state_dict(self):  # this rank's checkpoint (DeepSpeed saves a file per rank): its slices, its optimizer's state
        return {"rank": self.rank, "shards": [s.clone() for s in self.shards], "optimizer": self.optimizer.state_dict(),
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]}

    def load_state_dict(self, state_dict):
        assert state_dict["rank"] == self.rank, "load each rank's own state"
        for shard, saved in zip(self.shards, state_dict["shards"]):
            shard.copy_(saved)
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update(saved)
        self.optimizer.load_state_dict(state_dict["optimizer"])
'''


def _edit(old: str, new: str) -> str:
    assert SHARDED.count(old) == 1, old
    return SHARDED.replace(old, new)


SHARDED_KEEPS_ALL_STATES = '''
import torch
import torch.distributed as dist

class ShardedOptimizer(torch.optim.Optimizer):   # every rank steps the whole model: right weights, no memory saved
    def __init__(self, params, optimizer_cls, **defaults):
        super().__init__(params, defaults)
        self.optimizer = optimizer_cls(self.param_groups)   # the same group dicts: a scheduler reaches it

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= dist.get_world_size()
        self.optimizer.step()

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=True)
'''

SHARDED_STEPS_FROZEN = _edit(  # a frozen parameter sharded too, with a zero gradient: SGD leaves it, AdamW decays it
    "        group[\"params\"] = [p for p in group[\"params\"] if p.requires_grad]  # a frozen parameter takes no part\n",
    "")
SHARDED_SUMMED = _edit(  # the reduce-scatter sums: each step uses N times the gradient
    "            shard.grad = (mine / self.world_size).float()  # the average\n",
    "            shard.grad = mine.float()\n")
SHARDED_NO_ALL_GATHER = _edit(  # each rank writes back only its own slice: the replicas drift apart
    "            full = params[0].new_empty(shard.numel() * self.world_size)\n"
    "            all_gather(full, shard.to(full.dtype))  # rank r's slice lands at r * n\n",
    "            full = torch.cat([p.detach().reshape(-1) for p in params])\n"
    "            full = F.pad(full, (0, shard.numel() * self.world_size - full.numel()))\n"
    "            full[self.rank * shard.numel():(self.rank + 1) * shard.numel()] = shard\n")
SHARDED_SLICES_FLOOR = _edit(  # no padding: floor division drops the last values when N does not divide (3 ranks)
    "        n = math.ceil(flat.numel() / self.world_size)  # one slice per rank\n",
    "        n = flat.numel() // self.world_size\n")
SHARDED_IGNORES_SCHEDULER = _edit(  # the inner optimizer keeps the learning rate it was built with
    "            inner.update({k: v for k, v in group.items() if k != \"params\"})  # a scheduler changed group[\"lr\"]\n",
    "")
SHARDED_SHARD_REQUIRES_GRAD = _edit(  # trains right; the given load_state_dict cannot copy into the shard in place
    "        shard = flat[self.rank * n:(self.rank + 1) * n].float().clone()  # this rank's fp32 slice\n",
    "        shard = flat[self.rank * n:(self.rank + 1) * n].float().clone().requires_grad_()  # it is stepped\n")
SHARDED_ALL_REDUCE_THEN_SLICE = _edit(  # right weights, but an all-reduce and an all-gather: 1.5x DDP's bytes
    "            mine = flat.new_empty(shard.numel())\n"
    "            reduce_scatter(mine, flat)  # the sum over the ranks of slice `rank`\n",
    "            dist.all_reduce(flat)\n"
    "            mine = flat[self.rank * shard.numel():(self.rank + 1) * shard.numel()]\n")

CALLS_LIBRARY_SHARDED = '''
from course_lib.parallel.zero import ShardedOptimizer   # course_lib's ZeRO-1
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
LEARNING_RATE_OF_ITS_OWN = _ds_edit('"lr": 1e-3', '"lr": 1e-2')  # trains, but not the run the notebook compares
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
    from course_lib.parallel.deepspeed_engine import ds_config
    return ds_config(train_batch=global_batch, accum_steps=global_batch // (micro_batch * world_size),
                     world_size=world_size, stage=stage, offload_optimizer=offload_optimizer)   # course_lib's config
'''


FULL = {"test_ShardedOptimizer": 3, "test_ShardedOptimizer_state": 3, "test_ShardedOptimizer_hidden": 4,
        "test_make_ds_config": 2, "test_make_ds_config_hidden": 2}
NO_SHARDED = dict(test_ShardedOptimizer=0, test_ShardedOptimizer_state=0, test_ShardedOptimizer_hidden=0)

CASES = {
    "sharded_keeps_all_states": {"cells": {"ShardedOptimizer": SHARDED_KEEPS_ALL_STATES},
                                 "scores": {**FULL, "test_ShardedOptimizer_state": 0,
                                            "test_ShardedOptimizer_hidden": 0}},
    "sharded_steps_frozen": {"cells": {"ShardedOptimizer": SHARDED_STEPS_FROZEN},
                             "scores": {**FULL, "test_ShardedOptimizer_hidden": 0}},
    "sharded_summed_not_averaged": {"cells": {"ShardedOptimizer": SHARDED_SUMMED},
                                    "scores": {**FULL, "test_ShardedOptimizer": 0, "test_ShardedOptimizer_hidden": 0}},
    "sharded_no_all_gather": {"cells": {"ShardedOptimizer": SHARDED_NO_ALL_GATHER},
                              "scores": {**FULL, "test_ShardedOptimizer": 0, "test_ShardedOptimizer_hidden": 0}},
    "sharded_slices_floor": {"cells": {"ShardedOptimizer": SHARDED_SLICES_FLOOR},  # right on 2 ranks, wrong on 3
                             "scores": {**FULL, "test_ShardedOptimizer_hidden": 0}},
    "sharded_ignores_scheduler": {"cells": {"ShardedOptimizer": SHARDED_IGNORES_SCHEDULER},
                                  "scores": {**FULL, "test_ShardedOptimizer": 0, "test_ShardedOptimizer_hidden": 0}},
    "sharded_shard_requires_grad": {
        "cells": {"ShardedOptimizer": SHARDED_SHARD_REQUIRES_GRAD},
        "scores": {**FULL, "test_ShardedOptimizer_state": 0, "test_ShardedOptimizer_hidden": 0}},
    "sharded_all_reduce_then_slice": {"cells": {"ShardedOptimizer": SHARDED_ALL_REDUCE_THEN_SLICE},
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
    "learning_rate_of_its_own": {"cells": {"make_ds_config": LEARNING_RATE_OF_ITS_OWN},
                                 "scores": {**FULL, "test_make_ds_config": 0}},
    "offload_at_top_level": {"cells": {"make_ds_config": OFFLOAD_AT_TOP_LEVEL},
                             "scores": {**FULL, "test_make_ds_config_hidden": 0}},
    "calls_library_make_ds_config": {"cells": {"make_ds_config": CALLS_LIBRARY_DS_CONFIG},
                                     "scores": {**FULL, "test_make_ds_config": 0, "test_make_ds_config_hidden": 0}},
}
