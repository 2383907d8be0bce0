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

CALLS_LIBRARY_PARAM_COUNT = '''
def llama_param_count(config):
    from course_lib.models import llama_num_parameters
    return llama_num_parameters(config)   # course_lib's answer, not the student's
'''

CALLS_LIBRARY_TRAINING_MEMORY = '''
def training_memory(n_params, mode):
    from course_lib.memory import estimate_model_state
    dtype = {"fp32": "float32", "autocast": "float32", "pure_bf16": "bfloat16"}[mode]
    return estimate_model_state(n_params, dtype)   # course_lib's answer
'''

METER_NO_DEDUPE = '''
def saved_activation_bytes(model, forward):
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    total = 0
    def pack(t):
        nonlocal total
        if t.untyped_storage().data_ptr() not in weights:
            total += t.untyped_storage().nbytes()   # a storage saved twice is counted twice
        return t.detach()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return total
'''

METER_EXCLUDES_PARAMETERS_BY_IDENTITY = '''
def saved_activation_bytes(model, forward):
    params = list(model.parameters())
    sizes = {}
    def pack(t):
        if not any(t is p for p in params):   # W.t() is a new tensor object over the weight's storage
            sizes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t.detach()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(sizes.values())
'''

METER_COUNTS_TENSORS_NOT_STORAGES = '''
def saved_activation_bytes(model, forward):
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    sizes = {}
    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights:
            sizes.setdefault(ptr, t.numel() * t.element_size())   # the view's elements, not the storage it keeps
        return t.detach()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(sizes.values())
'''

# right counts, but pack hands autograd the saved tensor itself: a saved output then holds its own grad_fn, and every
# metered forward leaks its activations (the course's own meter did, until an H100 ran out of memory)
METER_KEEPS_THE_GRAPH_ALIVE = '''
def saved_activation_bytes(model, forward):
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    sizes = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            sizes[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    del out
    return int(sum(sizes.values()))
'''

CALLS_LIBRARY_METER = '''
def saved_activation_bytes(model, forward):
    from course_lib.memory import activation_bytes
    return activation_bytes(model, forward)   # course_lib's meter
'''

FULL = {"test_llama_param_count": 1, "test_llama_param_count_hidden": 1, "test_training_memory": 1,
        "test_training_memory_hidden": 1, "test_saved_activation_bytes": 3, "test_saved_activation_bytes_hidden": 3}


def scores(**changed):
    return {**FULL, **changed}


CASES = {
    "lm_head_counted_when_tied": {  # passes the visible test (untied presets), fails the hidden one
        "cells": {"llama_param_count": COUNT_LM_HEAD_WHEN_TIED},
        "scores": scores(test_llama_param_count_hidden=0),
    },
    "gqa_ignored": {
        "cells": {"llama_param_count": NO_GQA},
        "scores": scores(test_llama_param_count=0, test_llama_param_count_hidden=0),
    },
    "norms_forgotten": {
        "cells": {"llama_param_count": NO_NORMS},
        "scores": scores(test_llama_param_count=0, test_llama_param_count_hidden=0),
    },
    "calls_library_llama_param_count": {
        "cells": {"llama_param_count": CALLS_LIBRARY_PARAM_COUNT},
        "scores": scores(test_llama_param_count=0, test_llama_param_count_hidden=0),
    },
    "one_adam_state": {
        "cells": {"training_memory": ONE_ADAM_STATE},
        "scores": scores(test_training_memory=0, test_training_memory_hidden=0),
    },
    "autocast_16bit_weights": {  # passes the visible test (fp32, pure bf16), fails the hidden autocast one
        "cells": {"training_memory": AUTOCAST_HALF_PRECISION_WEIGHTS},
        "scores": scores(test_training_memory_hidden=0),
    },
    "pure_bf16_fp32_adam_states": {  # fails the visible pure-bf16 check, passes the hidden ones
        "cells": {"training_memory": PURE_BF16_FP32_STATES},
        "scores": scores(test_training_memory=0),
    },
    "calls_library_training_memory": {
        "cells": {"training_memory": CALLS_LIBRARY_TRAINING_MEMORY},
        "scores": scores(test_training_memory=0, test_training_memory_hidden=0),
    },
    "meter_counts_a_storage_each_time_it_is_saved": {
        "cells": {"saved_activation_bytes": METER_NO_DEDUPE},
        "scores": scores(test_saved_activation_bytes=0, test_saved_activation_bytes_hidden=0),
    },
    "meter_counts_weights_saved_as_views": {
        "cells": {"saved_activation_bytes": METER_EXCLUDES_PARAMETERS_BY_IDENTITY},
        "scores": scores(test_saved_activation_bytes=0, test_saved_activation_bytes_hidden=0),
    },
    "meter_counts_tensors_not_storages": {  # right on whole tensors; a saved slice keeps its whole storage alive
        "cells": {"saved_activation_bytes": METER_COUNTS_TENSORS_NOT_STORAGES},
        "scores": scores(test_saved_activation_bytes_hidden=0),
    },
    "meter_keeps_the_graph_alive": {  # counts right, leaks every forward it meters
        "cells": {"saved_activation_bytes": METER_KEEPS_THE_GRAPH_ALIVE},
        "scores": scores(test_saved_activation_bytes_hidden=0),
    },
    "calls_library_saved_activation_bytes": {
        "cells": {"saved_activation_bytes": CALLS_LIBRARY_METER},
        "scores": scores(test_saved_activation_bytes=0, test_saved_activation_bytes_hidden=0),
    },
}
