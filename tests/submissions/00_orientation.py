"""Known submissions of 00_orientation and the scores nbgrader's autograde must give them.

Each case replaces the named solution cells of the solution notebook; every other solution cell
keeps the reference solution. ``scores`` gives the expected points of every graded cell.
"""

COUNT_LM_HEAD_WHEN_TIED = '''
def llama_param_count(config):
    d, ffn = config.hidden_size, config.intermediate_size
    kv_width = d * config.num_key_value_heads // config.num_attention_heads
    per_layer = 2 * d * d + 2 * d * kv_width + 3 * d * ffn + 2 * d
    # forgot: a tied lm_head is the embedding matrix, counted once
    return config.num_hidden_layers * per_layer + 2 * config.vocab_size * d + d
'''

NO_GQA = '''
def llama_param_count(config):
    d, ffn = config.hidden_size, config.intermediate_size
    per_layer = 4 * d * d + 3 * d * ffn + 2 * d   # k and v taken as full d x d: grouped-query attention ignored
    total = config.num_hidden_layers * per_layer + config.vocab_size * d + d
    if not config.tie_word_embeddings:
        total += config.vocab_size * d
    return total
'''

NO_NORMS = '''
def llama_param_count(config):
    d, ffn = config.hidden_size, config.intermediate_size
    kv_width = d * config.num_key_value_heads // config.num_attention_heads
    per_layer = 2 * d * d + 2 * d * kv_width + 3 * d * ffn   # forgot the two RMSNorm weights (and the final norm)
    total = config.num_hidden_layers * per_layer + config.vocab_size * d
    if not config.tie_word_embeddings:
        total += config.vocab_size * d
    return total
'''

ONE_ADAM_STATE = '''
def training_memory(n_params, mode):
    b = {"fp32": 4, "autocast": 4, "pure_bf16": 2}
    if mode not in b:
        raise ValueError(f"unknown mode {mode!r}")
    # forgot: AdamW keeps two states per parameter (exp_avg and exp_avg_sq)
    return {"weights": b[mode] * n_params, "gradients": b[mode] * n_params, "optimizer states": b[mode] * n_params}
'''

AUTOCAST_HALF_PRECISION_WEIGHTS = '''
def training_memory(n_params, mode):
    b = {"fp32": 4, "autocast": 2, "pure_bf16": 2}   # autocast taken to store 16-bit weights
    if mode not in b:
        raise ValueError(f"unknown mode {mode!r}")
    return {"weights": b[mode] * n_params, "gradients": b[mode] * n_params, "optimizer states": 2 * b[mode] * n_params}
'''

PURE_BF16_FP32_STATES = '''
def training_memory(n_params, mode):
    b = {"fp32": 4, "autocast": 4, "pure_bf16": 2}
    if mode not in b:
        raise ValueError(f"unknown mode {mode!r}")
    # Adam states taken as float32 in every mode: torch's AdamW keeps them in the parameter's dtype
    return {"weights": b[mode] * n_params, "gradients": b[mode] * n_params, "optimizer states": 8 * n_params}
'''

CASES = {
    "lm_head_counted_when_tied": {  # passes the visible test (untied presets), fails the hidden one
        "cells": {"llama_param_count": COUNT_LM_HEAD_WHEN_TIED},
        "scores": {"test_llama_param_count": 2, "test_llama_param_count_hidden": 0,
                   "test_training_memory": 2, "test_training_memory_hidden": 2},
    },
    "gqa_ignored": {
        "cells": {"llama_param_count": NO_GQA},
        "scores": {"test_llama_param_count": 0, "test_llama_param_count_hidden": 0,
                   "test_training_memory": 2, "test_training_memory_hidden": 2},
    },
    "norms_forgotten": {
        "cells": {"llama_param_count": NO_NORMS},
        "scores": {"test_llama_param_count": 0, "test_llama_param_count_hidden": 0,
                   "test_training_memory": 2, "test_training_memory_hidden": 2},
    },
    "one_adam_state": {
        "cells": {"training_memory": ONE_ADAM_STATE},
        "scores": {"test_llama_param_count": 2, "test_llama_param_count_hidden": 2,
                   "test_training_memory": 0, "test_training_memory_hidden": 0},
    },
    "autocast_16bit_weights": {  # passes the visible test (fp32, pure bf16), fails the hidden autocast one
        "cells": {"training_memory": AUTOCAST_HALF_PRECISION_WEIGHTS},
        "scores": {"test_llama_param_count": 2, "test_llama_param_count_hidden": 2,
                   "test_training_memory": 2, "test_training_memory_hidden": 0},
    },
    "pure_bf16_fp32_adam_states": {  # fails the visible pure-bf16 check, passes the hidden ones
        "cells": {"training_memory": PURE_BF16_FP32_STATES},
        "scores": {"test_llama_param_count": 2, "test_llama_param_count_hidden": 2,
                   "test_training_memory": 0, "test_training_memory_hidden": 2},
    },
}

# The submission that loops forever in one exercise, and the one that edits a test cell.
LOOP_CELL = "llama_param_count"
