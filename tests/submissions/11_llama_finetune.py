"""Known submissions of 11_llama_finetune and the scores nbgrader's autograde must give them.

Each case replaces the named solution cells of the solution notebook; every other solution cell
keeps the reference solution. ``scores`` gives the expected points of every graded cell. The
mistakes are edits of today's solution cells (tests/solved.py), never copies of them.
"""

from solved import edit, solution

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

LORA_PARAMS = solution("11_llama_finetune", "lora_params")

LORA_IGNORES_GQA = edit(LORA_PARAMS, (  # k, v are smaller under GQA
    '"k_proj": (d, kv), "v_proj": (d, kv)', '"k_proj": (d, d), "v_proj": (d, d)'))

LORA_ONE_LAYER = edit(LORA_PARAMS, (  # forgot: every layer
    "    return config.num_hidden_layers * sum(", "    return sum("))

# --- Exercise 2, LoRALinear: the reference, and the mistakes students make, each a small edit of it

LORA_LINEAR = solution("11_llama_finetune", "LoRALinear")

LORA_B_NOT_ZERO = edit(LORA_LINEAR, ("        torch.nn.init.zeros_(self.lora_B.weight)\n", ""))  # nn.Linear's init stays
LORA_ALPHA_NOT_DIVIDED = edit(LORA_LINEAR, ("        self.scaling = alpha / r\n", "        self.scaling = alpha\n"))
LORA_BASE_NOT_FROZEN = edit(LORA_LINEAR, ("        for p in base.parameters():\n            p.requires_grad_(False)\n", ""))
LORA_MERGE_UNSCALED = edit(LORA_LINEAR,
                           ("data += (self.scaling * self.lora_B.weight @ self.lora_A.weight)",
                            "data += (self.lora_B.weight @ self.lora_A.weight)"),
                           ("data -= (self.scaling * self.lora_B.weight @ self.lora_A.weight)",
                            "data -= (self.lora_B.weight @ self.lora_A.weight)"))
LORA_MERGE_ADDS_TWICE = edit(LORA_LINEAR, ("        if not self.merged:\n            self.base.weight.data +=",
                                           "        if True:\n            self.base.weight.data +="))
LORA_DROPOUT_ON_THE_OUTPUT = edit(LORA_LINEAR, ("self.lora_B(self.lora_A(self.dropout(x))) * self.scaling",
                                                "self.dropout(self.lora_B(self.lora_A(x))) * self.scaling"))

CALLS_LIBRARY_LORA_LINEAR = '''
class LoRALinear(torch.nn.Module):   # peft's layer, made by course_lib.lora.lora_linear
    def __init__(self, base, r, alpha, dropout=0.0):
        super().__init__()
        from course_lib.lora import lora_linear
        self.peft = lora_linear(base, r, alpha, dropout)
        self.base, self.lora_A, self.lora_B = base, self.peft.lora_A["default"], self.peft.lora_B["default"]
        self.scaling, self.merged = alpha / r, False

    def forward(self, x):
        return self.peft(x)

    def merge(self):
        self.peft.merge()
        self.merged = self.peft.merged

    def unmerge(self):
        self.peft.unmerge()
        self.merged = self.peft.merged
'''

CALLS_PEFT_LORA_LAYER = CALLS_LIBRARY_LORA_LINEAR.replace(
    "   # peft's layer, made by course_lib.lora.lora_linear", "   # peft's layer, made here").replace(
    "        from course_lib.lora import lora_linear\n        self.peft = lora_linear(base, r, alpha, dropout)\n",
    "        from peft import LoraConfig\n        from peft.tuners.lora import Linear\n"
    "        base.requires_grad_(False)\n"
    "        self.peft = Linear(base, 'default', LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout), r=r,\n"
    "                           lora_alpha=alpha, lora_dropout=dropout)\n")
assert "course_lib" not in CALLS_PEFT_LORA_LAYER

FULL = {"test_response_labels": 2, "test_response_labels_hidden": 2, "test_LoRALinear": 3, "test_LoRALinear_llama": 3,
        "test_LoRALinear_hidden": 4, "test_lora_params": 2, "test_lora_params_hidden": 2}

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

CASES = {
    "labels_keep_padding": {"cells": {"response_labels": LABELS_KEEP_PADDING},
                            "scores": {**FULL, "test_response_labels_hidden": 0}},
    "labels_in_place": {"cells": {"response_labels": LABELS_IN_PLACE},
                        "scores": {**FULL, "test_response_labels": 0}},
    "lora_ignores_gqa": {"cells": {"lora_params": LORA_IGNORES_GQA},
                         "scores": {**FULL, "test_lora_params_hidden": 0}},
    "lora_one_layer": {"cells": {"lora_params": LORA_ONE_LAYER},
                       "scores": {**FULL, "test_lora_params": 0, "test_lora_params_hidden": 0}},
    "calls_library_response_labels": {"cells": {"response_labels": CALLS_LIBRARY_LABELS},
                                      "scores": {**FULL, "test_response_labels": 0, "test_response_labels_hidden": 0}},
    "calls_library_lora_params": {"cells": {"lora_params": CALLS_LIBRARY_LORA},
                                  "scores": {**FULL, "test_lora_params": 0, "test_lora_params_hidden": 0}},
    **{name: {"cells": {"LoRALinear": cell}, "scores": {**FULL, **{f"test_LoRALinear{t}": 0 for t in lost}}}
       for name, cell, lost in [
           ("lora_b_not_zero", LORA_B_NOT_ZERO, [""]),  # the model does not start as the base model
           ("lora_alpha_not_divided_by_r", LORA_ALPHA_NOT_DIVIDED, ["", "_llama", "_hidden"]),
           ("lora_base_not_frozen", LORA_BASE_NOT_FROZEN, [""]),  # add_lora freezes the model; the layer alone does not
           ("lora_merge_unscaled", LORA_MERGE_UNSCALED, ["_hidden"]),
           ("lora_merge_adds_twice", LORA_MERGE_ADDS_TWICE, ["_hidden"]),
           ("lora_dropout_on_the_output", LORA_DROPOUT_ON_THE_OUTPUT, ["_hidden"]),
           ("calls_library_LoRALinear", CALLS_LIBRARY_LORA_LINEAR, ["", "_llama", "_hidden"]),
           ("calls_peft_lora_layer", CALLS_PEFT_LORA_LAYER, ["", "_llama", "_hidden"]),
       ]},
}
