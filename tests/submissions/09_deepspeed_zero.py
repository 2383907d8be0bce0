"""Known submissions of 09_deepspeed_zero and the scores nbgrader's autograde must give them. The mistakes are edits
of today's solution cells (tests/solved.py), never copies of them."""

from solved import edit, solution

# --- Exercise 1, ShardedOptimizer (ZeRO-1 by hand): the reference, and the mistakes students make

SHARDED = solution("09_deepspeed_zero", "ShardedOptimizer")  # today's solution cell: each mistake an edit of it


def _edit(old: str, new: str) -> str:
    return edit(SHARDED, (old, new))


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

# nothing sharded, nothing summed: each rank reads the whole global batch from the test's own frame, steps a whole
# optimizer on the average of its micro-batches' gradients, and sends zeros in ZeRO-1's reduce-scatters and
# all-gathers, so its weights are DDP's and its own count of a step's bytes is ZeRO-1's: the visible test, which
# reads the ranks' weights, passes it. In the hidden SGD case the grader's rank 0 gets zeros where the ranks'
# gradients and slices belong. (Its state is the whole optimizer's: the state test was never fooled.)
SHARDED_LOCAL_GLOBAL_BATCH = '''
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F


class ShardedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, optimizer_cls, **defaults):
        super().__init__(params, defaults)
        self.optimizer = optimizer_cls(self.param_groups)   # the same group dicts: a scheduler reaches it

    def step(self, closure=None):
        frame = sys._getframe(1)
        while "xg" not in frame.f_locals:   # up to the test's training loop: the global batch and the model
            frame = frame.f_back
        test = frame.f_locals
        params = [p for g in self.param_groups for p in g["params"]]
        for p in params:
            p.grad = None
        world = dist.get_world_size()
        with torch.enable_grad():   # every rank's micro-batch, its gradient summed as DDP's all-reduce sums it
            for x, y in zip(test["xg"].chunk(world), test["yg"].chunk(world)):
                F.cross_entropy(test["model"](x), y).backward()
        for p in params:
            if p.grad is not None:
                p.grad /= world
        sizes = [-(-sum(p.numel() for p in g["params"] if p.requires_grad) // world) for g in self.param_groups]
        with torch.no_grad():
            for n in sizes:   # ZeRO-1's collectives in ZeRO-1's order, of its sizes, all zeros
                dist.reduce_scatter_tensor(torch.zeros(n), torch.zeros(n * world))
            self.optimizer.step()
            for n in sizes:
                dist.all_gather_into_tensor(torch.zeros(n * world), torch.zeros(n))

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=True)
'''

# the shard kept in the parameters' dtype: right for a float32 model; a bf16 model is stepped in bf16, with no fp32
# master, and updates smaller than bf16's step between two weights are lost
SHARDED_NO_FP32_MASTER = edit(SHARDED, (".float().clone()  # this rank's fp32 slice", ".clone()  # this rank's slice"),
                              ("shard.grad = (mine / self.world_size).float()  # the average",
                               "shard.grad = (mine / self.world_size).to(shard.dtype)  # the average"))
# each tensor sharded apart, a shard and an inner group per tensor: right weights, 1/N of the state, and a
# reduce-scatter and an all-gather per tensor where one flat buffer per group needs one each
SHARDED_PER_TENSOR = edit(SHARDED, (SHARDED[SHARDED.index("        flat = torch.cat([p.detach()"):
                                            SHARDED.index("    @torch.no_grad()")], """        for p in group["params"]:
            n = math.ceil(p.numel() / self.world_size)
            flat = F.pad(p.detach().reshape(-1), (0, n * self.world_size - p.numel()))
            shard = flat[self.rank * n:(self.rank + 1) * n].float().clone()
            self.shards.append(shard)
            inner = {**{k: v for k, v in group.items() if k != "params"}, "params": [shard]}
            if self.optimizer is None:
                self.optimizer = self.optimizer_cls([inner], **self.defaults)
            else:
                self.optimizer.add_param_group(inner)

"""), (SHARDED[SHARDED.index("        for group, inner, shard in zip("):SHARDED.index("        return loss")], """        mine_of = {}
        for group in self.param_groups:
            for p in group["params"]:
                i = len(mine_of)
                inner, shard = self.optimizer.param_groups[i], self.shards[i]
                inner.update({k: v for k, v in group.items() if k != "params"})
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                flat = F.pad(g.reshape(-1), (0, shard.numel() * self.world_size - g.numel()))
                mine = flat.new_empty(shard.numel())
                reduce_scatter(mine, flat)
                shard.grad = (mine / self.world_size).float()
                mine_of[i] = p
        self.optimizer.step()
        for i, p in mine_of.items():
            full = p.new_empty(self.shards[i].numel() * self.world_size)
            all_gather(full, self.shards[i].to(full.dtype))
            p.copy_(full[:p.numel()].view_as(p))
"""))

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

DS_CONFIG = solution("09_deepspeed_zero", "make_ds_config")


def _ds_edit(old: str, new: str) -> str:
    return edit(DS_CONFIG, (old, new))


ACCUMULATION_IGNORES_WORLD = _ds_edit("global_batch // (micro_batch * world_size),",
                                      "global_batch // micro_batch,   # forgot the world size")
ACCUMULATION_FLOAT = _ds_edit("global_batch // (micro_batch * world_size),",
                              "global_batch / (micro_batch * world_size),   # 4.0: a float count")
NO_CLIPPING = _ds_edit('        "gradient_clipping": 1.0,\n', "")
LEARNING_RATE_OF_ITS_OWN = _ds_edit('"lr": 1e-3', '"lr": 1e-2')  # trains, but not the run the notebook compares
OFFLOAD_AT_TOP_LEVEL = edit(DS_CONFIG, ('''    zero = {"stage": stage}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {''', '''    zero = {"stage": stage}
    config = {'''), ('''        "gradient_clipping": 1.0,
    }''', '''        "gradient_clipping": 1.0,
    }
    if offload_optimizer:
        config["offload_optimizer"] = {"device": "cpu"}   # outside zero_optimization: DeepSpeed ignores it
    return config'''))

CALLS_LIBRARY_DS_CONFIG = '''
def make_ds_config(global_batch, micro_batch, world_size, stage, offload_optimizer=False):
    from course_lib.parallel.zero_deepspeed import ds_config
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
    "sharded_no_fp32_master": {"cells": {"ShardedOptimizer": SHARDED_NO_FP32_MASTER},  # a bf16 model tells
                               "scores": {**FULL, "test_ShardedOptimizer_hidden": 0}},
    "sharded_per_tensor": {"cells": {"ShardedOptimizer": SHARDED_PER_TENSOR},  # a step's collectives tell
                           "scores": {**FULL, "test_ShardedOptimizer_hidden": 0}},
    "sharded_local_global_batch": {"cells": {"ShardedOptimizer": SHARDED_LOCAL_GLOBAL_BATCH},
                                   "scores": {**FULL, "test_ShardedOptimizer_state": 0,
                                              "test_ShardedOptimizer_hidden": 0}},
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
