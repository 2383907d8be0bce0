"""Known submissions of 12_qlora and the scores nbgrader's autograde must give them.

Each case replaces the named solution cells of the solution notebook; every other solution cell
keeps the reference solution. ``scores`` gives the expected points of every graded cell.
"""

from solved import edit, solution

# --- Exercise 1, NF4: the reference's structure with the two mistakes students make, and the library's answer

NF4_ONE_ABSMAX = '''
def nf4_quantize(w, blocksize=64):
    flat = w.reshape(-1).float()
    absmax = flat.abs().max()                       # one scale for the whole tensor, not one per block
    scaled = flat / absmax if absmax > 0 else flat
    codes = (scaled[:, None] - NF4).abs().argmin(dim=1)
    return codes, absmax.reshape(1)


def nf4_dequantize(codes, absmax, shape, blocksize=64):
    return (NF4[codes.long()] * absmax).reshape(shape)
'''

NF4_REFERENCE = solution("12_qlora", "nf4_quantize")

NF4_UNIFORM_GRID = edit(  # blocks right, levels evenly spaced k/7: int4, not NF4
    NF4_REFERENCE,
    ("(scaled[..., None] - NF4.to(w.device)).abs().argmin(dim=-1)", "(torch.round(scaled * 7) + 7).long()"),
    ("NF4.to(codes.device)[codes.long()]", "(codes.float() - 7) / 7"))

# the reference with the table left on the CPU: right on every CPU tensor, and it stops on a GPU's weights
NF4_IGNORES_THE_DEVICE = edit(NF4_REFERENCE, ("NF4.to(w.device)", "NF4"), ("NF4.to(codes.device)", "NF4"))

CALLS_LIBRARY_NF4 = '''
def nf4_quantize(w, blocksize=64):
    from course_lib.nf4 import quantize_nf4, unpack_4bit
    packed, absmax = quantize_nf4(w, blocksize)                   # course_lib's quantiser, unpacked
    return unpack_4bit(packed, w.numel()), absmax


def nf4_dequantize(codes, absmax, shape, blocksize=64):
    from course_lib.nf4 import dequantize_nf4, pack_4bit
    return dequantize_nf4(pack_4bit(codes), absmax, shape, blocksize)
'''

# --- Exercise 2, QLoRALinear: the reference, and the mistakes students make

QLORA_LINEAR = solution("12_qlora", "QLoRALinear")  # today's solution cell: each mistake an edit of it


def _qlora_edit(*pairs: tuple[str, str]) -> str:
    return edit(QLORA_LINEAR, *pairs)


QLORA_KEEPS_THE_WEIGHT = _qlora_edit(  # the float weight kept beside the codes, and computed with
    ('        self.register_buffer("packed", pack_4bit(codes))\n',
     '        self.register_buffer("packed", pack_4bit(codes))\n        self.register_buffer("weight", base.weight.detach().clone())\n'),
    ("return nf4_dequantize(codes, absmax, self.shape).to(dtype)", "return self.weight.to(dtype)"))
QLORA_NO_DOUBLE_QUANT = _qlora_edit(  # the scales kept in float32: 4.5 bits per weight
    ('''        absmax_codes, absmax_scales, absmax_offset = compress_absmax(absmax)
        self.register_buffer("absmax_codes", absmax_codes)
        self.register_buffer("absmax_scales", absmax_scales)
        self.register_buffer("absmax_offset", absmax_offset)
''', '        self.register_buffer("absmax", absmax.float())\n'),
    ("absmax = decompress_absmax(self.absmax_codes, self.absmax_scales, self.absmax_offset)", "absmax = self.absmax"))
# in x in codes: enough while out <= in, as in the visible layer whose outputs are compared; the visible test's
# 512 x 256 layer (the saved bytes) has more outputs than inputs
QLORA_UNPACKS_SQUARE = _qlora_edit(
    ("unpack_4bit(self.packed, self.shape[0] * self.shape[1])", "unpack_4bit(self.packed, self.shape[1] ** 2)"),
    ("nf4_dequantize(codes, absmax, self.shape)", "nf4_dequantize(codes[:self.shape[0] * self.shape[1]], absmax, self.shape)"))
QLORA_BIAS_TRAINS = _qlora_edit(("torch.nn.Parameter(base.bias.detach().clone(), requires_grad=False)",
                                 "torch.nn.Parameter(base.bias.detach().clone())"))
# right outputs and gradients, but F.linear saves the dequantised weight for backward: a bf16 weight per layer alive
# until backward, QLoRA's memory saving gone at the peak
QLORA_SAVES_ITS_WEIGHT = _qlora_edit(("        y = DequantizedLinear.apply(x, self)\n",
                                      "        y = torch.nn.functional.linear(x, self.dequantized_weight(x.dtype))\n"))

CALLS_LIBRARY_QLORA = '''
class QLoRALinear(torch.nn.Module):   # course_lib's layer inside
    def __init__(self, base, r, alpha, dropout=0.0):
        super().__init__()
        from course_lib.qlora import QLoRALinear as LibraryQLoRA
        self.inner = LibraryQLoRA(base, r, alpha, dropout)
        self.lora_A, self.lora_B, self.bias = self.inner.lora_A, self.inner.lora_B, self.inner.bias

    def forward(self, x):
        return self.inner(x)
'''

FULL = {"test_nf4_quantize": 3, "test_nf4_quantize_hidden": 3, "test_QLoRALinear": 3, "test_QLoRALinear_hidden": 3}

CASES = {
    # The QLoRA layer is graded over a right quantiser (nb12.QUANTIZER_STAND_INS) and course_lib's given storage: a
    # wrong quantiser loses its own tests only
    "nf4_one_absmax": {"cells": {"nf4_quantize": NF4_ONE_ABSMAX},             # right on one block, wrong on many
                       "scores": {**FULL, "test_nf4_quantize_hidden": 0}},
    "nf4_uniform_grid": {"cells": {"nf4_quantize": NF4_UNIFORM_GRID},         # blocks right, levels int4's
                         "scores": {**FULL, "test_nf4_quantize": 0}},
    "nf4_ignores_the_device": {"cells": {"nf4_quantize": NF4_IGNORES_THE_DEVICE},  # right here, stops on a GPU
                               "scores": {**FULL, "test_nf4_quantize_hidden": 0}},
    "calls_library_nf4_quantize": {"cells": {"nf4_quantize": CALLS_LIBRARY_NF4},
                                   "scores": {**FULL, "test_nf4_quantize": 0, "test_nf4_quantize_hidden": 0}},
    **{name: {"cells": {"QLoRALinear": cell}, "scores": {**FULL, **{f"test_QLoRALinear{t}": 0 for t in lost}}}
       for name, cell, lost in [
           ("qlora_keeps_the_weight", QLORA_KEEPS_THE_WEIGHT, ["", "_hidden"]),
           ("qlora_no_double_quant", QLORA_NO_DOUBLE_QUANT, ["_hidden"]),  # exact weight: visible outputs agree
           ("qlora_bias_trains", QLORA_BIAS_TRAINS, ["", "_hidden"]),
           ("qlora_unpacks_square", QLORA_UNPACKS_SQUARE, ["", "_hidden"]),
           ("qlora_saves_its_weight", QLORA_SAVES_ITS_WEIGHT, [""]),  # the hidden tests read no bytes
           ("calls_library_QLoRALinear", CALLS_LIBRARY_QLORA, ["", "_hidden"]),
       ]},
}
