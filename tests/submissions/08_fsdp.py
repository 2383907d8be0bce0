"""Known submissions of 08_fsdp and the scores nbgrader's autograde must give them.

Each case replaces the named solution cells of the solution notebook; every other solution cell
keeps the reference solution. ``scores`` gives the expected points of every graded cell. The
mistakes are edits of today's solution cells (tests/solved.py), never copies of them.
"""

from solved import edit, solution

SHARD_BYTES = solution("08_fsdp", "shard_state_bytes")
APPLY_FSDP = solution("08_fsdp", "apply_fsdp")

GRAD_OP_SHARDS_WEIGHTS = edit(SHARD_BYTES, (  # wrong: SHARD_GRAD_OP keeps full weights until backward
    '"weights_in_backward": 4 * n_params if strategy == "grad_op" else weights,',
    '"weights_in_backward": weights,'))

NO_SHARD_DIVIDES = edit(SHARD_BYTES, (
    '    elif strategy in ("full", "grad_op"):\n'
    '        shards = world_size\n'
    '    elif strategy == "no_shard":\n'
    '        shards = 1\n',
    '    elif strategy in ("full", "grad_op", "no_shard"):\n'
    '        shards = world_size   # wrong: NO_SHARD is DDP, every rank keeps everything\n'))

ROOT_ONLY = edit(APPLY_FSDP, (  # wrong: one unit for the whole model, so every forward gathers all the weights at once
    "    for layer in model.model.layers:\n"
    "        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)\n", ""))

RESHARD_NOT_PASSED = edit(APPLY_FSDP, (  # wrong: reshard_after_forward is not passed on (always True)
    "fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)", "fully_shard(layer, mesh=mesh)"))

CALLS_LIBRARY_SHARD_BYTES = '''
def shard_state_bytes(n_params, world_size, strategy, shard_size=None):
    from course_lib.memory import estimate_model_state
    full = estimate_model_state(n_params)   # course_lib's 4 + 4 + 8 bytes per parameter
    shards = {"full": world_size, "grad_op": world_size, "no_shard": 1}.get(strategy, shard_size)
    if strategy not in ("full", "grad_op", "no_shard", "hybrid") or not shards or world_size % shards:
        raise ValueError(f"strategy={strategy!r}, shard_size={shard_size}")
    out = {k: v / shards for k, v in full.items() if k != "total"}
    out["weights_in_backward"] = full["weights"] if strategy == "grad_op" else out["weights"]
    out["total"] = out["weights"] + out["gradients"] + out["optimizer states"]
    return out
'''

CALLS_LIBRARY_APPLY_FSDP = '''
def apply_fsdp(model, mesh, reshard_after_forward=True):
    from course_lib.parallel import fsdp_torch
    strategy = "full" if reshard_after_forward else "grad_op"   # grad_op: course_lib's reshard_after_forward=False
    return fsdp_torch.apply_fsdp(model, mesh, fsdp_torch.FSDPRun(strategy=strategy))   # course_lib's wrapping
'''

# --- Exercise 3, ShardedModule: the reference, and the mistakes students make, each a small edit of it

HAND = solution("08_fsdp", "ShardedModule")

HAND_SUMMED = edit(HAND, ("        return mine / ctx.world_size, None\n",
                          "        return mine, None   # the sum: an N x learning rate\n"))
HAND_NO_AUTOGRAD = edit(HAND, (  # gathered outside autograd: the module trains a copy that is thrown away
    "        full = {name: GatherParameter.apply(shard, shape)",
    "        full = {name: GatherParameter.apply(shard.detach(), shape).requires_grad_()"))
HAND_UNPADDED = edit(HAND, (
    "            flat = F.pad(p.detach().reshape(-1), (0, n * world_size - p.numel()))\n",
    "            flat = p.detach().reshape(-1)   # no padding: the last rank's slice is short when N does not divide\n"))
HAND_KEEPS_FULL = edit(HAND, ('        self.module = module.to("meta")\n',
                              '        self.module = module   # the full weights stay on every rank\n'))

# nothing gathered or reduced: every rank keeps the whole module, and the test's record of each rank is rewritten on
# its way out with the answer the tests' own reference computes (found in the test's frame and module). Its data
# is perfect; the grader's rank 0 never gets a gather, so the wired checks score it 0. The bytes test, which only
# the rank itself can measure, still believes it.
HAND_FORGED_RECORD = edit(
    HAND,
    ('        self.module = module.to("meta")\n',
     '        self.module = module   # the full weights stay: nothing needs gathering\n'
     '        _forge_record(sys._getframe(1))\n'),
    ("        full = {name: GatherParameter.apply(shard, shape) for name, shape, shard in zip(self.names, self.shapes, "
     "self.shards)}\n"
     "        return functional_call(self.module, full, args)",
     "        return self.module(*args)"),
    ("from torch.func import functional_call\n",
     "from torch.func import functional_call\n"
     "import sys\n\n\n"
     "def _forge_record(frame):\n"
     "    tests = sys.modules['course_grader.checks.nb08']\n"
     "    v = frame.f_locals\n"
     "    rank, world = dist.get_rank(), dist.get_world_size()\n"
     "    params, losses, grads = tests.one_process(v['n'], v['steps'], v['frozen'], v['seed'], v['data_seed'])[:3]\n"
     "    sizes = [-(-numel // world) for _, numel, _ in params]\n"
     "    answer = {'losses': losses, 'held': 4 * sum(sizes), 'shard_sizes': sizes,\n"
     "              'grads': [[None if g is None else tests.rank_piece(g, rank, world) for g in step] for step in grads]}\n"
     "    packed = tests.packed\n"
     "    tests.packed = lambda data: packed(answer)\n"))

CALLS_LIBRARY_HAND = '''
from course_lib.parallel.fsdp import GatherParameter, ShardedModule   # course_lib's
'''

# the mechanism written out, but its slicing and gathering taken from course_lib's toolkit: half of the answer
CALLS_LIBRARY_SLICES = edit(
    HAND,
    ("        world_size, n = dist.get_world_size(), shard.numel()\n"
     "        full = shard.new_empty(n * world_size)\n"
     "        dist.all_gather(list(full.split(n)), shard.detach().contiguous())\n"
     "        ctx.n, ctx.world_size = n, world_size\n"
     "        return full[:math.prod(shape)].view(shape)\n",
     "        ctx.n, ctx.world_size = shard.numel(), dist.get_world_size()\n"
     "        return gather_slices(shard, math.prod(shape)).view(shape)\n"),
    ("            flat = F.pad(p.detach().reshape(-1), (0, n * world_size - p.numel()))\n"
     "            shards.append(torch.nn.Parameter(flat[rank * n:(rank + 1) * n].clone(), requires_grad=p.requires_grad))\n",
     "            shards.append(torch.nn.Parameter(rank_slice(p.detach()).clone(), requires_grad=p.requires_grad))\n"),
    ("from torch.func import functional_call\n",
     "from torch.func import functional_call\n\nfrom course_lib.distributed import gather_slices, rank_slice   # course_lib's\n"))

CALLS_FULLY_SHARD = '''
class ShardedModule(torch.nn.Module):   # torch's FSDP2 does the sharding
    def __init__(self, module):
        super().__init__()
        self.module = fully_shard(module)
        self.shards = torch.nn.ParameterList(list(module.parameters()))

    def forward(self, *args):
        return self.module(*args)
'''

FULL = {"test_shard_state_bytes": 2, "test_shard_state_bytes_hidden": 2, "test_shard_state_bytes_errors": 1,
        "test_apply_fsdp": 2, "test_apply_fsdp_hidden": 2,
        "test_ShardedModule": 3, "test_ShardedModule_bytes": 3, "test_ShardedModule_hidden": 4}


def scores(**lost) -> dict:
    """Full marks except the named test cells, which score 0."""
    return {**FULL, **{k: 0 for k in lost}}


CASES = {
    "grad_op_shards_weights": {"cells": {"shard_state_bytes": GRAD_OP_SHARDS_WEIGHTS},
                               "scores": scores(test_shard_state_bytes=0, test_shard_state_bytes_hidden=0)},
    "no_shard_divides": {  # right for the measured full/grad_op runs, wrong for NO_SHARD
        "cells": {"shard_state_bytes": NO_SHARD_DIVIDES}, "scores": scores(test_shard_state_bytes_hidden=0)},
    "root_only": {"cells": {"apply_fsdp": ROOT_ONLY}, "scores": scores(test_apply_fsdp=0, test_apply_fsdp_hidden=0)},
    "reshard_not_passed": {  # passes the visible test (default True), fails the hidden one
        "cells": {"apply_fsdp": RESHARD_NOT_PASSED}, "scores": scores(test_apply_fsdp_hidden=0)},
    "calls_library_shard_state_bytes": {
        "cells": {"shard_state_bytes": CALLS_LIBRARY_SHARD_BYTES},
        "scores": scores(test_shard_state_bytes=0, test_shard_state_bytes_hidden=0, test_shard_state_bytes_errors=0)},
    "calls_library_apply_fsdp": {"cells": {"apply_fsdp": CALLS_LIBRARY_APPLY_FSDP},
                                 "scores": scores(test_apply_fsdp=0, test_apply_fsdp_hidden=0)},
    "hand_gradient_summed_not_averaged": {"cells": {"ShardedModule": HAND_SUMMED},
                                          "scores": scores(test_ShardedModule=0, test_ShardedModule_hidden=0)},
    "hand_gather_without_autograd": {  # the shards never get a gradient
        "cells": {"ShardedModule": HAND_NO_AUTOGRAD},
        "scores": scores(test_ShardedModule=0, test_ShardedModule_hidden=0)},
    "hand_unpadded": {"cells": {"ShardedModule": HAND_UNPADDED},  # right on 2 ranks, wrong on 3
                      "scores": scores(test_ShardedModule_hidden=0)},
    "hand_keeps_full_weights": {"cells": {"ShardedModule": HAND_KEEPS_FULL},
                                "scores": scores(test_ShardedModule_bytes=0, test_ShardedModule_hidden=0)},
    "hand_forged_record": {"cells": {"ShardedModule": HAND_FORGED_RECORD},
                           "scores": scores(test_ShardedModule=0, test_ShardedModule_hidden=0)},
    "calls_library_ShardedModule": {
        "cells": {"ShardedModule": CALLS_LIBRARY_HAND},
        "scores": scores(test_ShardedModule=0, test_ShardedModule_bytes=0, test_ShardedModule_hidden=0)},
    "calls_library_slices": {  # forbidden too: the tests find the library's helpers wherever they were imported
        "cells": {"ShardedModule": CALLS_LIBRARY_SLICES},
        "scores": scores(test_ShardedModule=0, test_ShardedModule_bytes=0, test_ShardedModule_hidden=0)},
    "calls_fully_shard": {
        "cells": {"ShardedModule": CALLS_FULLY_SHARD},
        "scores": scores(test_ShardedModule=0, test_ShardedModule_bytes=0, test_ShardedModule_hidden=0)},
}
