"""course_lib.nf4 and course_lib.qlora: NF4's code book, block-wise and double quantisation; the QLoRA layer,
memory table and fine-tune.

bitsandbytes is not a dependency of the course (the test extra installs it): its outputs for fixed inputs are
written here (computed with bitsandbytes 0.50.2's quantize_4bit / quantize_blockwise on CPU), the last tests
compare with it live as well, and QLoRA trains on the CPU through it.
"""

import importlib.util
import math

import pytest
import torch

from course_grader.checks import nb12
from course_lib import nf4, qlora
from course_lib.lora import ALL_LINEAR, lora_trainable_parameters
from course_lib.models import build_llama, llama_config, llama_num_parameters

# QLoRA's NF4 levels as published (bitsandbytes' get_4bit_type("nf4"), the paper's Appendix E).
PUBLISHED_NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                 -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                 0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                 0.7229568362236023, 1.0]
# bitsandbytes' quantize_4bit(W, blocksize=64, quant_type="nf4") of W below: the packed bytes, in hex.
W_GOLDEN = (torch.sin(torch.arange(150) * 0.37) * torch.linspace(0.5, 3, 150)).reshape(5, 30)
PACKED_GOLDEN = ("79abbbba86433234579bcddcb8642112347aceeedc9531101247bdeffec9521022357acdeddb8532111247bdeeedc85311"
                 "11247bdefeec9521001148cefffec9521001248befffec942100")
# bitsandbytes' quantize_blockwise(X - X.mean(), blocksize=256) of X below (its dynamic code book, the scales of
# double quantisation): the 8-bit codes in hex, the two blocks' scales, and the relative RMS error of X back.
ABSMAX_X = 1 + 0.5 * torch.sin(torch.arange(300) * 0.9)
ABSMAX_CODES = (
    "75effdd6270110a1f0fcd5260110a7f1fcd4250111adf1fcd2240012b3f2fbd1230013b9f3fbd0220014bef3fbcf210014c0f4face20"
    "0015c1f4facd1f0016c2f5f9cc1e0017c3f6f9cb1d0018c4f6f8c91c0019c6f7f8c81b001ac7f7f7c71a001bc8f8f7c619001cc9f8f6"
    "c518001dcaf9f6c417001ecbf9f5c216001fcdfaf5c1160020cefaf4c0150021cffbf3bf140022d0fbf3ba130023d1fbf2b412002"
    "4d2fcf1ae110125d3fcf1a8110126d4fcf0a2100127d5fdef940f0128d7fdee5f0e0229d8fdee590e022ad9fded530d022bdafdec4d"
    "0c032cdbfeeb470c032ddcfeeb410b032fddfeea3f0a0430defee93d0a0431dffee83c090432e0ffe73b080533e1ffe63a080534e2"
    "ffe539070635e3ffe437070637e4ffe336060738e5ffe335060739e6ffe2340508")
ABSMAX_SCALES = (0.5001640915870667, 0.49982547760009766)
ABSMAX_OFFSET = 1.0001736879348755
ABSMAX_ERROR = 0.0018220215867413845
# bitsandbytes' quantize_4bit of three values: the odd count's last low nibble holds 7 (its zero padding's level)
ODD_GOLDEN = (torch.tensor([0.3, -0.1, 0.2]), "f4e7")


def reference_round_trip(w: torch.Tensor, blocksize: int = 64) -> torch.Tensor:
    """Brute force, one block at a time: each value goes to the NF4 level nearest to value / block absmax."""
    levels = torch.tensor(PUBLISHED_NF4)
    flat, out = w.reshape(-1).float(), torch.empty(w.numel())
    for start in range(0, flat.numel(), blocksize):
        block = flat[start:start + blocksize]
        scale = block.abs().max()
        if scale == 0:
            out[start:start + blocksize] = 0
            continue
        nearest = (block[:, None] / scale - levels[None, :]).abs().argmin(dim=1)
        out[start:start + blocksize] = levels[nearest] * scale
    return out.reshape(w.shape)


def test_the_code_book_is_the_published_one_and_normal_quantiles_derive_it():
    code = nf4.nf4_code()
    assert torch.equal(code, torch.tensor(PUBLISHED_NF4)), "one table: the published values, exactly"
    assert torch.equal(nb12.NF4, code), "the checks quantise with the library's table"
    derived = nf4.derived_nf4_levels()
    assert derived.dtype == torch.float64 and float((derived - code.double()).abs().max()) < 3e-7
    assert code[7] == 0 and code[0] == -1 and code[15] == 1 and bool((code.diff() > 0).all())
    # 8 levels above zero and 7 below: the asymmetric split that makes room for an exact zero
    assert int((code > 0).sum()) == 8 and int((code < 0).sum()) == 7


def test_the_code_book_is_bitsandbytes_own():
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is optional; the published values are compared above")
    import bitsandbytes.functional as bnb

    assert torch.equal(nf4.nf4_code(), bnb.get_4bit_type("nf4", device="cpu").float())


def test_dynamic_code_is_bitsandbytes_double_quantisation_code():
    code = nf4.dynamic_code()
    assert code.shape == (256,) and bool((code.diff() >= 0).all())
    golden = {0: -0.992968738079071, 1: -0.9789062738418579, 100: -0.0074687497690320015, 126: -5.500000384017767e-07,
              127: 0.0, 128: 5.500000384017767e-07, 129: 3.250000190746505e-06, 200: 0.23359374701976776,
              254: 0.992968738079071, 255: 1.0}
    assert {i: float(code[i]) for i in golden} == golden


def test_packed_layout_and_scales_are_bitsandbytes():
    packed, absmax = nf4.quantize_nf4(W_GOLDEN)  # 150 values: blocks of 64, 64 and 22
    assert packed.dtype == torch.uint8 and bytes(packed.tolist()).hex() == PACKED_GOLDEN
    flat = W_GOLDEN.reshape(-1)
    assert torch.equal(absmax, torch.stack([flat[i:i + 64].abs().max() for i in (0, 64, 128)]))
    assert torch.equal(nf4.unpack_4bit(packed, 150), torch.tensor([int(c, 16) for c in PACKED_GOLDEN])[:150])


@pytest.mark.parametrize("shape,blocksize", [((7, 50), 64), ((96, 64), 64), ((3, 33), 32), ((1001,), 128)])
def test_round_trip_is_the_nearest_level_of_each_block(shape, blocksize):
    torch.manual_seed(sum(shape))
    w = torch.randn(shape) * 0.02
    packed, absmax = nf4.quantize_nf4(w, blocksize)
    assert packed.numel() == math.ceil(w.numel() / 2) and absmax.numel() == math.ceil(w.numel() / blocksize)
    out = nf4.dequantize_nf4(packed, absmax, w.shape, blocksize)
    assert out.shape == w.shape and torch.allclose(out, reference_round_trip(w, blocksize), atol=1e-9, rtol=1e-6)
    # what QLoRA computes with is the same up to the 8-bit scales of double quantisation
    assert torch.allclose(nf4.nf4_round_trip(w, blocksize), out, rtol=0.02, atol=0)


def test_zeros_stay_zero_and_an_all_zero_block_gives_no_nan():
    w = torch.randn(3, 64)
    w[1] = 0          # a whole block of zeros: absmax 0, which must not divide
    w[2, 5] = 0.0     # an exact zero among other values
    packed, absmax = nf4.quantize_nf4(w)
    idx = nf4.unpack_4bit(packed, w.numel()).view(3, 64)
    assert absmax[1] == 0 and bool((idx[1] == 7).all()) and idx[2, 5] == 7
    out = nf4.dequantize_nf4(packed, absmax, w.shape)
    assert torch.isfinite(out).all() and bool((out[1] == 0).all()) and out[2, 5] == 0


def test_an_outlier_spoils_only_its_own_block():
    torch.manual_seed(0)
    w = torch.randn(2, 64) * 1e-3
    w[0] *= 1e7       # block 0 holds values ten million times larger than block 1
    out = nf4.nf4_round_trip(w, double_quant=False)
    assert nf4.relative_rms_error(out[1], w[1]) < 0.15 and nf4.relative_rms_error(out[0], w[0]) < 0.15
    # one scale for the whole tensor would round every value of block 1 to zero
    assert torch.equal(nf4.dequantize_nf4(*nf4.quantize_nf4(w.reshape(1, -1), 128), (1, 128), 128)[0, 64:],
                       torch.zeros(64))
    # double quantisation stores each scale to 8 bits of the largest scale near it: a scale ten million times
    # smaller is lost (bitsandbytes does the same); trained weights' scales differ by a few times, not millions
    assert nf4.relative_rms_error(nf4.nf4_round_trip(w)[1], w[1]) > 1


def test_int4_and_fp4_code_books():
    int4, fp4 = nf4.int4_code(), nf4.fp4_code()
    assert int4.numel() == 16 and torch.equal(int4 * 8, torch.arange(-8, 8).float())  # two's complement k/8
    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert (fp4 * 6).tolist() == pytest.approx([-v for v in reversed(e2m1[1:])] + e2m1)  # 15 values: +0 = -0
    assert torch.all(fp4[1:] > fp4[:-1]) and fp4.abs().max() == 1.0
    # a block [-1, 1, 0.3, -0.06]: int4 puts +absmax on 7/8 and 0.3 on 0.25 (0.3*8 = 2.4 -> 2); FP4 scales by
    # absmax/6: 0.3*6 = 1.8 -> 2 (1/3), -0.06*6 = -0.36 -> -0.5 (-1/12)
    w = torch.tensor([-1.0, 1.0, 0.3, -0.06])
    assert nf4.int4_round_trip(w, blocksize=4).tolist() == [-1.0, 0.875, 0.25, 0.0]
    assert nf4.fp4_round_trip(w, blocksize=4).tolist() == pytest.approx([-1.0, 1.0, 1 / 3, -1 / 12])


def test_nf4_beats_uniform_int4_and_fp4_on_normal_weights_and_not_on_uniform_ones():
    torch.manual_seed(0)
    normal, uniform = torch.randn(256, 256) * 0.02, torch.rand(256, 256) * 0.04 - 0.02
    err = {name: {f: nf4.relative_rms_error(rt(w), w) for f, rt in
                  (("nf4", nf4.nf4_round_trip), ("int4", nf4.int4_round_trip), ("fp4", nf4.fp4_round_trip),
                   ("bf16", nf4.bf16_round_trip))}
           for name, w in (("normal", normal), ("uniform", uniform))}
    # about 0.092 against int4's 0.099 (16 levels k/8; 15 levels k/7 gave 0.107) and FP4's 0.106
    assert err["normal"]["nf4"] < 0.95 * err["normal"]["int4"] < 0.95 * err["normal"]["fp4"]
    assert err["uniform"]["int4"] < err["uniform"]["nf4"] < err["uniform"]["fp4"]  # levels fit what they assume
    assert err["normal"]["bf16"] < 0.05 * err["normal"]["nf4"]


def test_double_quantisation_matches_bitsandbytes_and_costs_a_quarter_bit():
    c = nf4.compress_absmax(ABSMAX_X)
    assert bytes(c.codes.tolist()).hex() == ABSMAX_CODES
    assert c.scales.tolist() == list(ABSMAX_SCALES) and float(c.offset) == ABSMAX_OFFSET
    assert nf4.relative_rms_error(nf4.decompress_absmax(*c), ABSMAX_X) == pytest.approx(ABSMAX_ERROR, rel=1e-6)
    assert nf4.bits_per_parameter(double_quant=False) == 4.5
    assert nf4.bits_per_parameter() == pytest.approx(4.127, abs=1e-3)
    # measured on the stored tensors: 2 blocks of 256 scales, 32768 weights (+ one float32 offset)
    w = torch.randn(128, 256)
    assert nf4.stored_bytes(w, double_quant=False) == w.numel() * 4.5 / 8
    assert nf4.stored_bytes(w) == w.numel() * nf4.bits_per_parameter() / 8 + 4


def test_an_odd_count_is_padded_with_the_zero_level_as_bitsandbytes_pads():
    w, golden = ODD_GOLDEN
    packed, _ = nf4.quantize_nf4(w)
    assert bytes(packed.tolist()).hex() == golden
    assert nf4.pack_4bit(torch.tensor([1, 2, 3])).tolist() == [0x12, 0x37]
    assert nf4.unpack_4bit(nf4.pack_4bit(torch.tensor([[1, 2, 3]])), 3).tolist() == [1, 2, 3]


def test_the_visible_checks_stored_numbers_are_course_libs_and_bitsandbytes():
    # notebook 12's visible test holds numbers instead of a quantiser (the student edition has none to run):
    # bitsandbytes' (stored) and course_lib's (tested equal to bitsandbytes above and live below) must agree
    for (w, bs, hexes), error in zip(nb12.single_blocks(), nb12.SINGLE_BLOCK_ERRORS):
        packed, absmax = nf4.quantize_nf4(w, bs)
        assert bytes(packed.tolist()).hex() == hexes
        assert nf4.relative_rms_error(nf4.dequantize_nf4(packed, absmax, w.shape, bs), w) == \
            pytest.approx(error, rel=1e-6)


def test_qlora_linear_is_lora_on_the_nf4_weight_stores_4_bits_and_trains_only_adapters():
    from course_lib.lora import lora_linear

    torch.manual_seed(0)
    base = torch.nn.Linear(96, 40)
    base.weight.data.normal_(0, 0.02)
    layer = qlora.QLoRALinear(base, r=4, alpha=8)
    assert {n for n, p in layer.named_parameters() if p.requires_grad} == {"lora_A.weight", "lora_B.weight"}
    assert bool((layer.lora_B.weight == 0).all()) and "weight" not in layer.state_dict()
    assert sum(b.numel() * b.element_size() for b in layer.buffers()) == nf4.stored_bytes(base.weight)
    frozen = torch.nn.Linear(96, 40)
    frozen.load_state_dict({"weight": nf4.nf4_round_trip(base.weight), "bias": base.bias.detach()})
    theirs = lora_linear(frozen, r=4, alpha=8)
    layer.lora_B.weight.data.normal_(0, 0.01)
    theirs.lora_A["default"].weight.data.copy_(layer.lora_A.weight)
    theirs.lora_B["default"].weight.data.copy_(layer.lora_B.weight)
    x = torch.randn(2, 3, 96, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    x_grad, x.grad = x.grad, None
    theirs(x).sum().backward()
    assert torch.allclose(y, theirs(x), atol=1e-6) and torch.allclose(x_grad, x.grad, atol=1e-6)
    assert torch.allclose(layer.lora_A.weight.grad, theirs.lora_A["default"].weight.grad, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # QLoRA's compute dtype: the weight dequantised to bf16
        assert layer(x.detach().bfloat16()).dtype == torch.bfloat16
    with torch.no_grad():
        layer.packed.fill_(0x77)  # every code the level 0: the forward dequantises from the buffer every time
        assert torch.allclose(layer(x), base.bias + layer.lora_B(layer.lora_A(x)) * 2, atol=1e-6)


def test_bad_input_says_what_to_change():
    with pytest.raises(ValueError, match="positive even integer"):
        nf4.quantize_nf4(torch.randn(10), blocksize=63)
    packed, absmax = nf4.quantize_nf4(torch.randn(4, 64))
    with pytest.raises(ValueError, match="pass the shape and blocksize"):
        nf4.dequantize_nf4(packed, absmax, (4, 64), blocksize=128)
    with pytest.raises(ValueError, match="not linear layers"):
        qlora.memory_table(llama_config("8b"), targets=("embed_tokens",))


def test_memory_table_of_the_llama_shapes():
    for preset in ("1b", "8b", "70b"):
        cfg = llama_config(preset)
        table = qlora.memory_table(cfg)
        bf16, qlora_row = table["bf16 LoRA"], table["QLoRA (NF4)"]
        assert bf16["base weights"] == 2 * llama_num_parameters(cfg)
        assert bf16["adapters (fp32)"] == qlora_row["adapters (fp32)"] == \
            4 * lora_trainable_parameters(cfg, 16, ALL_LINEAR)
        # read from transformers' modules, the count agrees with the formula on every target set
        for targets in (ALL_LINEAR, ("k_proj", "v_proj"), ("down_proj",)):
            assert qlora.adapter_parameters(cfg, 8, targets) == lora_trainable_parameters(cfg, 8, targets)
        assert qlora_row["base weights"] < 0.45 * bf16["base weights"]
        assert bf16["total"] == pytest.approx(sum(v for k, v in bf16.items() if k != "total"))
    with pytest.raises(ValueError, match="not linear layers of a Llama"):
        qlora.adapter_parameters(llama_config("tiny"), 8, ("qkv_proj",))
    eight, seventy = qlora.memory_table(llama_config("8b")), qlora.memory_table(llama_config("70b"))
    assert 5.5e9 < eight["QLoRA (NF4)"]["base weights"] < 6e9   # the embeddings and LM head stay in bf16 (2.1 GB)
    assert seventy["bf16 LoRA"]["total"] > 140e9 and seventy["QLoRA (NF4)"]["total"] < 48e9


def test_a_tiny_llama_in_nf4_matches_its_table_and_still_computes():
    cfg = llama_config("tiny")
    model = build_llama(cfg, seed=0)
    linears = nf4.quantized_linears(model)
    assert len(linears) == 7 * cfg.num_hidden_layers and "lm_head" not in linears
    measured = sum(nf4.stored_bytes(m.weight) for m in linears.values())
    others = sum(p.numel() for p in model.parameters()) - sum(m.weight.numel() for m in linears.values())
    predicted = qlora.memory_table(cfg)["QLoRA (NF4)"]["base weights"] - 2 * others
    assert measured == pytest.approx(predicted, rel=0.01)   # per-tensor offsets and partial scale blocks: < 1%
    quantized = nf4.round_trip_model(model)
    assert torch.equal(quantized.lm_head.weight, model.lm_head.weight)
    assert torch.equal(quantized.model.embed_tokens.weight, model.model.embed_tokens.weight)
    rows = nf4.layer_errors(model, {"nf4": nf4.nf4_round_trip})
    assert all(0.05 < r["nf4"] < 0.15 for r in rows), rows
    for name, layer in nf4.quantized_linears(quantized).items():
        assert nf4.relative_rms_error(layer.weight, linears[name].weight) == pytest.approx(
            next(r["nf4"] for r in rows if r["layer"] == name))
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, quantized(input_ids=ids).logits
    assert 0 < nf4.relative_rms_error(b, a) < 0.2


def test_qlora_trains_here_on_the_base_that_course_libs_nf4_computes(tmp_path):
    # The GPU comparison's two halves, run on this CPU (bitsandbytes has CPU kernels): save, reload through
    # from_pretrained (with BitsAndBytesConfig for QLoRA), peft, train. Every linear's 4-bit base holds exactly
    # course_lib's NF4 round trip of the saved weights, and QLoRA's loss follows bf16 LoRA's without equalling it.
    # The MLP is 256 wide, not the tiny preset's 176: bitsandbytes 0.50's CPU dequantize (which its Linear4bit
    # forward runs) is wrong for 2-D weights whose last dimension is a multiple of 16 but not of the block size
    # (down_proj 64x176: 26% error against 9% for the same bytes and scales dequantised by course_lib).
    from bitsandbytes import functional as F

    path = qlora.save_random_llama("tiny", str(tmp_path / "tiny"), seed=0, intermediate_size=256)
    kw = dict(steps=4, batch=2, seq=16, device="cpu", warmup=1, r=4, alpha=8)
    runs = {q: qlora.lora_run(path, quantize=q, **kw) for q in (False, True)}
    for run in runs.values():
        assert len(run["losses"]) == 4 and all(math.isfinite(x) for x in run["losses"]), run["losses"]
        assert run["tokens_per_s"] > 0 and run["peak_bytes"] is None and run["weights_bytes"] is None
    bf16, q4 = runs[False]["losses"], runs[True]["losses"]
    assert bf16[0] != q4[0] and max(abs(a - b) / a for a, b in zip(bf16, q4)) < 0.02, (bf16, q4)
    saved = qlora.load_lora_model(path, quantize=False, device="cpu", r=4, alpha=8)
    model = qlora.load_lora_model(path, quantize=True, device="cpu", r=4, alpha=8)
    bases = {name: m for name, m in model.named_modules() if name.endswith(".base_layer")}
    assert len(bases) == 2 * len(qlora.QLORA_TARGETS) and all(type(m).__name__ == "Linear4bit" for m in bases.values())
    for name, base in bases.items():
        exact = saved.get_submodule(name).weight.float()
        dequantised = F.dequantize_4bit(base.weight.data, base.weight.quant_state).float()
        assert torch.allclose(dequantised, nf4.nf4_round_trip(exact), rtol=0.02, atol=1e-6), name


def test_qlora_says_it_needs_a_gpu_with_bitsandbytes():
    assert "needs a GPU" in qlora.qlora_support("cpu")
    with pytest.raises(RuntimeError, match="needs a GPU"):
        qlora.compare_qlora(preset="tiny", steps=3, batch=2, seq=16, device="cpu")
    if importlib.util.find_spec("bitsandbytes") is None:
        assert "pip install bitsandbytes" in qlora.bitsandbytes_error()
        with pytest.raises(ImportError, match="pip install bitsandbytes"):
            qlora.bnb_config()


def test_the_same_as_bitsandbytes_live():
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is optional; the golden values above stand in for it")
    from bitsandbytes import functional as F

    torch.manual_seed(0)
    for shape in ((96, 64), (1000, 70), (3,)):
        w = torch.randn(shape)
        packed, absmax = nf4.quantize_nf4(w)
        q, state = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False)
        assert torch.equal(packed, q.reshape(-1)) and torch.equal(absmax, state.absmax)
        assert torch.allclose(nf4.dequantize_nf4(packed, absmax, w.shape), F.dequantize_4bit(q, state), atol=1e-6)
        q2, state2 = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
        c = nf4.compress_absmax(absmax)
        assert torch.equal(c.scales, state2.state2.absmax) and torch.equal(c.offset, state2.offset)
        assert torch.allclose(nf4.nf4_round_trip(w), F.dequantize_4bit(q2, state2), rtol=0.02, atol=1e-6)
        if absmax.numel() > 1:  # (one scale is its own mean: any code stands for 0 times a zero scale)
            # bitsandbytes' C kernel breaks near-ties of the 8-bit code differently: a neighbouring code, rarely
            diff = (c.codes.int() - state2.absmax.int()).abs()
            assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 0.01


def test_qlora_is_chosen_only_where_bitsandbytes_4bit_really_runs():
    """bitsandbytes that imports but has no kernels for the GPU stack failed mid-cell in from_pretrained: the probe
    runs its 4-bit path once on the device first. Here a GPU is asked for on a CPU-only torch: bitsandbytes imports,
    and cannot run there, so QLoRA is not chosen; on the CPU its kernels run and compute course_lib's NF4."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is optional; without it the probe says to install it")
    assert qlora.bitsandbytes_error() is None  # it imports ...
    assert qlora.bitsandbytes_4bit_runs("cpu") is None  # ... its CPU kernels run, to NF4's values ...
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the probe's verdict on it is the preflight's to show")
    why = qlora.bitsandbytes_4bit_runs("cuda")  # ... and on a GPU this torch does not have, they cannot
    assert why is not None and "do not run on cuda" in why and "pip install bitsandbytes" in why
    assert qlora.qlora_support("cuda") == why, "the QLoRA decision must rest on the probe, not on the import"
    with pytest.raises(RuntimeError, match="do not run on cuda"):
        qlora.compare_qlora(preset="tiny", steps=3, batch=2, seq=16, device="cuda")


def test_the_probe_catches_kernels_that_run_but_compute_wrong_values():
    torch.manual_seed(0)
    w, x = torch.randn(64, 64), torch.randn(4, 64)
    back = nf4.nf4_round_trip(w)
    right = (x @ back.t(), torch.ones(4, 64) @ back)
    assert qlora._probe_mismatch("cpu", w, x, back, *right) is None
    wrong = qlora._probe_mismatch("cpu", w, x, back.flip(0), *right)  # rows of the weight out of place
    assert wrong is not None and "compute wrong values" in wrong and "dequantised weight" in wrong
    assert "matmul_4bit output" in qlora._probe_mismatch("cpu", w, x, back, right[0] * float("nan"), right[1])
