"""Known submissions of 00_orientation and the scores nbgrader's autograde must give them.

Each case replaces the named solution cells of the solution notebook; every other solution cell
keeps the reference solution. ``scores`` gives the expected points of every graded cell. The
mistakes are edits of today's solution cells (tests/solved.py), never copies of them.
"""

from solved import edit, solution

PARAM_COUNT = solution("00_orientation", "llama_param_count")
TRAINING_MEMORY = solution("00_orientation", "training_memory")
METER = solution("00_orientation", "saved_activation_bytes")

COUNT_LM_HEAD_WHEN_TIED = edit(PARAM_COUNT, (
    "    if not config.tie_word_embeddings:\n        total += config.vocab_size * d\n",
    "    total += config.vocab_size * d  # forgot: a tied lm_head is the embedding matrix, counted once\n"))

NO_GQA = edit(PARAM_COUNT, (  # k and v taken as full d x d: grouped-query attention ignored
    "per_layer = 2 * d * d + 2 * d * kv_width + 3 * d * ffn", "per_layer = 4 * d * d + 3 * d * ffn"))

NO_NORMS = edit(PARAM_COUNT,  # forgot the two RMSNorm weights (and the final norm)
                ("3 * d * ffn + 2 * d\n", "3 * d * ffn\n"),
                ("config.vocab_size * d + d\n", "config.vocab_size * d\n"))

ONE_ADAM_STATE = edit(TRAINING_MEMORY, (  # forgot: AdamW keeps two states per parameter (exp_avg and exp_avg_sq)
    '"optimizer states": 2 * b * n_params}', '"optimizer states": b * n_params}'))

AUTOCAST_HALF_PRECISION_WEIGHTS = edit(TRAINING_MEMORY, (  # autocast taken to store 16-bit weights
    '"autocast": 4', '"autocast": 2'))

PURE_BF16_FP32_STATES = edit(TRAINING_MEMORY, (  # Adam states taken as float32 in every mode: torch's AdamW keeps
    '"optimizer states": 2 * b * n_params}', '"optimizer states": 8 * n_params}'))  # them in the parameter's dtype

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

METER_NO_DEDUPE = edit(METER, (  # a storage saved twice is counted twice
    "            sizes[storage.data_ptr()] = storage.nbytes()\n",
    "            sizes[len(sizes)] = storage.nbytes()\n"))

METER_EXCLUDES_PARAMETERS_BY_IDENTITY = edit(
    METER, ("    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}\n",
            "    params = list(model.parameters())\n"),
    ("        if storage.data_ptr() not in weights:\n",  # W.t() is a new tensor object over the weight's storage
     "        if not any(t is p for p in params):\n"))

METER_COUNTS_TENSORS_NOT_STORAGES = edit(METER, (  # the view's elements, not the storage it keeps
    "            sizes[storage.data_ptr()] = storage.nbytes()\n",
    "            sizes.setdefault(storage.data_ptr(), t.numel() * t.element_size())\n"))

# right counts, but pack hands autograd the saved tensor itself: a saved output then holds its own grad_fn, and every
# metered forward leaks its activations (the course's own meter did, until an H100 ran out of memory)
METER_KEEPS_THE_GRAPH_ALIVE = edit(METER, (
    "        return t.detach()  # not t: a saved output would hold its own grad_fn, a cycle never freed\n",
    "        return t\n"))

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
