"""Known submissions of 07_llama_finetune and the scores nbgrader's autograde must give them.

Each case replaces the named solution cells of the solution notebook; every other solution cell
keeps the reference solution. ``scores`` gives the expected points of every graded cell.
"""

LABELS_KEEP_PADDING = '''
def response_labels(input_ids, prompt_lengths, lengths):
    labels = input_ids.clone()
    for i, p in enumerate(prompt_lengths):
        labels[i, :p] = IGNORE_INDEX   # forgot: the padding after lengths[i] is scored too
    return labels
'''

LABELS_IN_PLACE = '''
def response_labels(input_ids, prompt_lengths, lengths):
    labels = input_ids                 # not a copy: masking the labels overwrites the inputs
    for i, (p, n) in enumerate(zip(prompt_lengths, lengths)):
        labels[i, :p] = IGNORE_INDEX
        labels[i, n:] = IGNORE_INDEX
    return labels
'''

LORA_IGNORES_GQA = '''
def lora_params(config, r, target_modules):
    d, ffn = config.hidden_size, config.intermediate_size
    shapes = {"q_proj": (d, d), "k_proj": (d, d), "v_proj": (d, d), "o_proj": (d, d),   # k, v are smaller under GQA
              "gate_proj": (d, ffn), "up_proj": (d, ffn), "down_proj": (ffn, d)}
    return config.num_hidden_layers * sum(r * (i + o) for i, o in (shapes[m] for m in target_modules))
'''

LORA_ONE_LAYER = '''
def lora_params(config, r, target_modules):
    d, ffn = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * (d // config.num_attention_heads)
    shapes = {"q_proj": (d, d), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (d, d),
              "gate_proj": (d, ffn), "up_proj": (d, ffn), "down_proj": (ffn, d)}
    return sum(r * (i + o) for i, o in (shapes[m] for m in target_modules))   # forgot: every layer
'''

MFU_IGNORES_FROZEN = '''
def mfu_from_step(step_seconds, tokens_per_step, n_params, n_layers, d_model, seq_len, peak_flops, frozen_base=False):
    per_token = 6 * n_params + 12 * n_layers * d_model * seq_len   # LoRA computes no weight gradients: 4N
    return tokens_per_step / step_seconds * per_token / peak_flops
'''

FULL = {"test_response_labels": 2, "test_response_labels_hidden": 2, "test_lora_params": 2,
        "test_lora_params_hidden": 2, "test_mfu_from_step": 1, "test_mfu_from_step_hidden": 1}

CALLS_LIBRARY_LABELS = '''
def response_labels(input_ids, prompt_lengths, lengths):
    from course_lib.instruct import pad_batch
    rows = [{"input_ids": ids[:n].tolist(), "labels": [-100] * p + ids[p:n].tolist()}
            for ids, p, n in zip(input_ids, prompt_lengths, lengths)]
    return pad_batch(rows, pad_id=0, length=input_ids.shape[1])["labels"]   # course_lib's padding
'''

CALLS_LIBRARY_LORA = '''
def lora_params(config, r, target_modules):
    from course_lib.lora import lora_trainable_parameters
    return lora_trainable_parameters(config, r, target_modules)   # course_lib's count
'''

CALLS_LIBRARY_MFU = '''
def mfu_from_step(step_seconds, tokens_per_step, n_params, n_layers, d_model, seq_len, peak_flops, frozen_base=False):
    from course_lib.throughput import mfu, transformer_flops_per_token
    per_token = transformer_flops_per_token(n_params, n_layers, d_model, seq_len, frozen_base=frozen_base)
    return mfu(tokens_per_step / step_seconds, per_token, peak_flops)   # course_lib's arithmetic
'''

CASES = {
    "labels_keep_padding": {"cells": {"response_labels": LABELS_KEEP_PADDING},
                            "scores": {**FULL, "test_response_labels_hidden": 0}},
    "labels_in_place": {"cells": {"response_labels": LABELS_IN_PLACE},
                        "scores": {**FULL, "test_response_labels": 0}},
    "lora_ignores_gqa": {"cells": {"lora_params": LORA_IGNORES_GQA},
                         "scores": {**FULL, "test_lora_params_hidden": 0}},
    "lora_one_layer": {"cells": {"lora_params": LORA_ONE_LAYER},
                       "scores": {**FULL, "test_lora_params": 0, "test_lora_params_hidden": 0}},
    "mfu_ignores_frozen": {"cells": {"mfu_from_step": MFU_IGNORES_FROZEN},
                           "scores": {**FULL, "test_mfu_from_step_hidden": 0}},
    "calls_library_response_labels": {"cells": {"response_labels": CALLS_LIBRARY_LABELS},
                                      "scores": {**FULL, "test_response_labels": 0, "test_response_labels_hidden": 0}},
    "calls_library_lora_params": {"cells": {"lora_params": CALLS_LIBRARY_LORA},
                                  "scores": {**FULL, "test_lora_params": 0, "test_lora_params_hidden": 0}},
    "calls_library_mfu_from_step": {"cells": {"mfu_from_step": CALLS_LIBRARY_MFU},
                                    "scores": {**FULL, "test_mfu_from_step": 0, "test_mfu_from_step_hidden": 0}},
}

# The submission that loops forever in this solution cell loses only its own tests.
LOOP_CELL = "lora_params"
CELL_TIMEOUT = 40  # the fine-tune cells train small models: a few seconds, more on a busy machine
