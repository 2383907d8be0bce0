"""Known submissions of 06_deepspeed_zero and the scores nbgrader's autograde must give them."""

STAGE2_KEEPS_FULL_GRADIENTS = '''
def zero_model_state_gb(n_params, world_size, stage):
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage} must be 0-3")
    weights, grads, states = 2.0, 2.0, 12.0
    if stage >= 1:
        states /= world_size
    if stage >= 3:   # gradients only sharded at stage 3: wrong, stage 2 shards them
        grads /= world_size
        weights /= world_size
    return n_params * (weights + grads + states) / 1e9
'''

NO_STAGE_CHECK = '''
def zero_model_state_gb(n_params, world_size, stage):
    weights, grads, states = 2.0, 2.0, 12.0
    if stage >= 1:
        states /= world_size
    if stage >= 2:
        grads /= world_size
    if stage >= 3:
        weights /= world_size
    return n_params * (weights + grads + states) / 1e9
'''

ACCUMULATION_IGNORES_WORLD = '''
def make_ds_config(global_batch, micro_batch, world_size, stage, offload_optimizer=False):
    if global_batch % (micro_batch * world_size):
        raise ValueError(f"global_batch={global_batch} does not divide")
    zero = {"stage": stage}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": global_batch // micro_batch,   # forgot the world size
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,
    }
'''

OFFLOAD_AT_TOP_LEVEL = '''
def make_ds_config(global_batch, micro_batch, world_size, stage, offload_optimizer=False):
    if global_batch % (micro_batch * world_size):
        raise ValueError(f"global_batch={global_batch} does not divide")
    config = {
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": global_batch // (micro_batch * world_size),
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "zero_force_ds_cpu_optimizer": False,
    }
    if offload_optimizer:
        config["offload_optimizer"] = {"device": "cpu"}   # outside zero_optimization: DeepSpeed ignores it
    return config
'''

FULL = {"test_zero_model_state_gb": 2, "test_zero_model_state_gb_hidden": 2,
        "test_make_ds_config": 2, "test_make_ds_config_hidden": 2}

CALLS_LIBRARY_ZERO_GB = '''
def zero_model_state_gb(n_params, world_size, stage):
    from course_lib.zero import zero_bytes_per_param
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage}")
    return zero_bytes_per_param(stage, world_size) * n_params / 1e9   # course_lib's accounting
'''

CALLS_LIBRARY_DS_CONFIG = '''
def make_ds_config(global_batch, micro_batch, world_size, stage, offload_optimizer=False):
    from course_lib.zero import ds_config
    if global_batch % (micro_batch * world_size):
        raise ValueError(f"global_batch={global_batch}")
    return ds_config(train_batch=global_batch, accum_steps=global_batch // (micro_batch * world_size),
                     world_size=world_size, stage=stage, offload_optimizer=offload_optimizer)   # course_lib's builder
'''

CASES = {
    "stage2_keeps_full_gradients": {"cells": {"zero_model_state_gb": STAGE2_KEEPS_FULL_GRADIENTS},
                                    "scores": {**FULL, "test_zero_model_state_gb": 0, "test_zero_model_state_gb_hidden": 0}},
    "no_stage_check": {"cells": {"zero_model_state_gb": NO_STAGE_CHECK},
                       "scores": {**FULL, "test_zero_model_state_gb_hidden": 0}},
    "accumulation_ignores_world": {"cells": {"make_ds_config": ACCUMULATION_IGNORES_WORLD},
                                   "scores": {**FULL, "test_make_ds_config": 0, "test_make_ds_config_hidden": 0}},
    "offload_at_top_level": {"cells": {"make_ds_config": OFFLOAD_AT_TOP_LEVEL},
                             "scores": {**FULL, "test_make_ds_config_hidden": 0}},
    "calls_library_zero_model_state_gb": {"cells": {"zero_model_state_gb": CALLS_LIBRARY_ZERO_GB},
                                          "scores": {**FULL, "test_zero_model_state_gb": 0, "test_zero_model_state_gb_hidden": 0}},
    "calls_library_make_ds_config": {"cells": {"make_ds_config": CALLS_LIBRARY_DS_CONFIG},
                                     "scores": {**FULL, "test_make_ds_config": 0, "test_make_ds_config_hidden": 0}},
}

LOOP_CELL = "zero_model_state_gb"
CELL_TIMEOUT = 60  # test cells launch DeepSpeed on 2 processes: about 8 s each on 2 idle cores, more when busy
