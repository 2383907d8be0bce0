"""Known submissions of 05_fsdp and the scores nbgrader's autograde must give them.

Each case replaces the named solution cells of the solution notebook; every other solution cell
keeps the reference solution. ``scores`` gives the expected points of every graded cell.
"""

GRAD_OP_SHARDS_WEIGHTS = '''
def shard_state_bytes(n_params, world_size, strategy, shard_size=None):
    if strategy == "hybrid":
        if not shard_size or world_size % shard_size:
            raise ValueError(f"shard_size={shard_size} must divide world_size={world_size}")
        shards = shard_size
    elif strategy in ("full", "grad_op"):
        shards = world_size
    elif strategy == "no_shard":
        shards = 1
    else:
        raise ValueError(f"unknown strategy={strategy!r}")
    out = {"weights": 4 * n_params / shards,
           "weights_in_backward": 4 * n_params / shards,   # wrong: SHARD_GRAD_OP keeps full weights until backward
           "gradients": 4 * n_params / shards, "optimizer states": 8 * n_params / shards}
    out["total"] = out["weights"] + out["gradients"] + out["optimizer states"]
    return out
'''

NO_SHARD_DIVIDES = '''
def shard_state_bytes(n_params, world_size, strategy, shard_size=None):
    if strategy == "hybrid":
        if not shard_size or world_size % shard_size:
            raise ValueError(f"shard_size={shard_size} must divide world_size={world_size}")
        shards = shard_size
    elif strategy in ("full", "grad_op", "no_shard"):
        shards = world_size   # wrong: NO_SHARD is DDP, every rank keeps everything
    else:
        raise ValueError(f"unknown strategy={strategy!r}")
    weights = 4 * n_params / shards
    out = {"weights": weights, "weights_in_backward": 4 * n_params if strategy == "grad_op" else weights,
           "gradients": 4 * n_params / shards, "optimizer states": 8 * n_params / shards}
    out["total"] = out["weights"] + out["gradients"] + out["optimizer states"]
    return out
'''

ROOT_ONLY = '''
def apply_fsdp(model, mesh, reshard_after_forward=True):
    # wrong: one unit for the whole model, so every forward gathers all the weights at once
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model
'''

RESHARD_NOT_PASSED = '''
def apply_fsdp(model, mesh, reshard_after_forward=True):
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)   # wrong: reshard_after_forward is not passed on (always True)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model
'''

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
    from course_lib.fsdp import shard_model
    return shard_model(model, mesh, reshard_after_forward=reshard_after_forward)   # course_lib's wrapping
'''

CASES = {
    "grad_op_shards_weights": {
        "cells": {"shard_state_bytes": GRAD_OP_SHARDS_WEIGHTS},
        "scores": {"test_shard_state_bytes": 0, "test_shard_state_bytes_hidden": 0,
                   "test_shard_state_bytes_errors": 1, "test_apply_fsdp": 2, "test_apply_fsdp_hidden": 2},
    },
    "no_shard_divides": {  # right for the measured full/grad_op runs, wrong for NO_SHARD
        "cells": {"shard_state_bytes": NO_SHARD_DIVIDES},
        "scores": {"test_shard_state_bytes": 2, "test_shard_state_bytes_hidden": 0,
                   "test_shard_state_bytes_errors": 1, "test_apply_fsdp": 2, "test_apply_fsdp_hidden": 2},
    },
    "root_only": {
        "cells": {"apply_fsdp": ROOT_ONLY},
        "scores": {"test_shard_state_bytes": 2, "test_shard_state_bytes_hidden": 2,
                   "test_shard_state_bytes_errors": 1, "test_apply_fsdp": 0, "test_apply_fsdp_hidden": 0},
    },
    "reshard_not_passed": {  # passes the visible test (default True), fails the hidden one
        "cells": {"apply_fsdp": RESHARD_NOT_PASSED},
        "scores": {"test_shard_state_bytes": 2, "test_shard_state_bytes_hidden": 2,
                   "test_shard_state_bytes_errors": 1, "test_apply_fsdp": 2, "test_apply_fsdp_hidden": 0},
    },
    "calls_library_shard_state_bytes": {
        "cells": {"shard_state_bytes": CALLS_LIBRARY_SHARD_BYTES},
        "scores": {"test_shard_state_bytes": 0, "test_shard_state_bytes_hidden": 0,
                   "test_shard_state_bytes_errors": 0, "test_apply_fsdp": 2, "test_apply_fsdp_hidden": 2},
    },
    "calls_library_apply_fsdp": {
        "cells": {"apply_fsdp": CALLS_LIBRARY_APPLY_FSDP},
        "scores": {"test_shard_state_bytes": 2, "test_shard_state_bytes_hidden": 2,
                   "test_shard_state_bytes_errors": 1, "test_apply_fsdp": 0, "test_apply_fsdp_hidden": 0},
    },
}

# The submission that loops forever in one exercise, and the one that edits a test cell.
LOOP_CELL = "apply_fsdp"
