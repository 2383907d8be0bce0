"""Known submissions of 11_llama_finetune and the scores nbgrader's autograde must give them.

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

# --- Exercise 2, LoRALinear: the reference, and the mistakes students make, each a small edit of it

LORA_LINEAR = '''
import math

class LoRALinear(torch.nn.Module):
    def __init__(self, base, r, alpha, dropout=0.0):
        super().__init__()
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        self.lora_A = torch.nn.Linear(base.in_features, r, bias=False)
        self.lora_B = torch.nn.Linear(r, base.out_features, bias=False)
        torch.nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        torch.nn.init.zeros_(self.lora_B.weight)
        self.scaling = alpha / r
        self.dropout = torch.nn.Dropout(dropout)
        self.merged = False

    def forward(self, x):
        if self.merged:
            return self.base(x)
        return self.base(x) + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling

    def merge(self):
        if not self.merged:
            self.base.weight.data += (self.scaling * self.lora_B.weight @ self.lora_A.weight).to(self.base.weight.dtype)
            self.merged = True

    def unmerge(self):
        if self.merged:
            self.base.weight.data -= (self.scaling * self.lora_B.weight @ self.lora_A.weight).to(self.base.weight.dtype)
            self.merged = False
'''


def _lora_edit(old: str, new: str, count: int = 1) -> str:
    assert LORA_LINEAR.count(old) == count, old
    return LORA_LINEAR.replace(old, new)


LORA_B_NOT_ZERO = _lora_edit("        torch.nn.init.zeros_(self.lora_B.weight)\n", "")  # nn.Linear's own init stays
LORA_ALPHA_NOT_DIVIDED = _lora_edit("        self.scaling = alpha / r\n", "        self.scaling = alpha\n")
LORA_BASE_NOT_FROZEN = _lora_edit("        for p in base.parameters():\n            p.requires_grad_(False)\n", "")
LORA_MERGE_UNSCALED = _lora_edit("(self.scaling * self.lora_B.weight @ self.lora_A.weight)",
                                 "(self.lora_B.weight @ self.lora_A.weight)", count=2)
LORA_MERGE_ADDS_TWICE = _lora_edit("        if not self.merged:\n            self.base.weight.data +=",
                                   "        if True:\n            self.base.weight.data +=")
LORA_DROPOUT_ON_THE_OUTPUT = _lora_edit("self.lora_B(self.lora_A(self.dropout(x))) * self.scaling",
                                        "self.dropout(self.lora_B(self.lora_A(x))) * self.scaling")

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
