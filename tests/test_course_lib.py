"""course_lib's utilities, each against an independent computation or a real failure mode."""

import math

import pytest
import torch
import torch.nn.functional as F

from course_lib import checkpointing, data, memory, models, precision, results, throughput, train
from course_lib.device import pick_tier, system_report
from course_lib.grading import grads, max_abs_diff, max_rel_diff, twin


# --- bad input stops early, naming the parameter and the fix ------------------------------------

def test_batch_that_does_not_divide_names_both_parameters():
    x, y = torch.zeros(30, 3, 32, 32), torch.zeros(30, dtype=torch.long)
    with pytest.raises(ValueError, match=r"batch_size=30.*accum_steps=4"):
        train.split_batch(x, y, 4)


def test_gpu_tier_on_a_cpu_machine_is_refused():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")  # the refusal only exists without one
    with pytest.raises(ValueError, match="tier='gpu'.*tier='cpu'"):
        pick_tier("gpu")
    with pytest.raises(ValueError, match="not one of"):
        pick_tier("laptop")


def test_grading_runs_pick_the_smoke_tier(monkeypatch):
    monkeypatch.setenv("NBGRADER_EXECUTION", "autograde")
    assert pick_tier("auto") == "smoke"
    monkeypatch.delenv("NBGRADER_EXECUTION")
    assert pick_tier("auto") in ("cpu", "gpu", "node")


def test_preset_too_big_for_the_device_is_refused_before_allocating():
    with pytest.raises(ValueError, match="pick a smaller preset"):
        models.build_llama("70b", device="cpu")  # 280 GB of fp32 weights


def test_unknown_preset_and_amp_dtype_say_what_exists():
    with pytest.raises(ValueError, match="choose one of"):
        models.llama_config("13b")
    with pytest.raises(ValueError, match="amp_dtype"):
        precision.check_amp_dtype("cpu", "float8")


# --- models and memory -------------------------------------------------------------------------

@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": True}, {"num_key_value_heads": 4}])
def test_llama_parameter_formula_matches_a_built_model(overrides):
    model = models.build_llama("tiny", **overrides)
    assert models.llama_num_parameters(model.config) == models.count_parameters(model)


def test_built_llama_trains_without_a_kv_cache():
    model = models.build_llama("tiny")
    ids = data.random_tokens(1, 8, 512)
    assert model(input_ids=ids).past_key_values is None


def test_seed003_bert_table_reproduced_exactly():
    fp32, fp16 = memory.seed003_table(models.bert_base_cased_config())
    mib = 2**20
    assert round(fp32["Model"] / mib, 2) == 413.18
    assert round(fp32["Highest"] / 2**30, 2) == 1.61
    assert round(fp16["Gradients"] / mib, 2) == 619.77
    assert round(fp16["Highest"] / mib, 2) == 826.36


def test_model_state_measurement_matches_the_adam_estimate():
    model = models.SmallCNN(width=8)
    opt = torch.optim.AdamW(model.parameters())
    x, y = data.synthetic_images(8).tensors
    train.train_step(model, opt, x, y)
    for p in model.parameters():  # train_step cleared them; recreate to measure gradient bytes
        p.grad = torch.zeros_like(p)
    measured = memory.model_state_bytes(model, opt)
    estimated = memory.estimate_model_state(models.count_parameters(model), "float32", "adamw")
    assert measured == estimated


def test_saved_tensor_meter_sees_activations_not_parameters():
    lin = torch.nn.Linear(256, 256)
    x = torch.randn(64, 256)
    saved = memory.activation_bytes(lin, lambda: torch.relu(lin(x)).sum())
    # relu saves its output (64x256 fp32); the matmul saves x; the weight is a parameter: excluded
    assert saved == 2 * 64 * 256 * 4


def test_saved_slice_counts_its_span_not_the_whole_data_set():
    lin = torch.nn.Linear(16, 16)
    dataset = torch.randn(10_000, 16)
    saved = memory.activation_bytes(lin, lambda: lin(dataset[:32]).sum())
    assert saved == 32 * 16 * 4


# --- the training step ---------------------------------------------------------------------------

def test_train_step_with_accumulation_equals_the_big_batch():
    torch.manual_seed(0)
    a = models.SmallCNN(width=8)
    b = twin(a)
    x, y = data.synthetic_images(32).tensors
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    ra = train.train_step(a, opt_a, x, y, accum_steps=1)
    rb = train.train_step(b, opt_b, x, y, accum_steps=4)
    assert abs(ra["loss"] - rb["loss"]) < 1e-5
    pa = {n: p.detach() for n, p in a.named_parameters()}
    pb = {n: p.detach() for n, p in b.named_parameters()}
    assert max_abs_diff(pa, pb) < 1e-6


def test_fp16_overflow_is_skipped_and_the_scale_backs_off():
    torch.manual_seed(0)
    model = models.SmallCNN(width=8)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = precision.make_scaler("cpu", "float16", init_scale=2.0**40)
    x, y = data.synthetic_images(8).tensors
    out = train.train_step(model, opt, x, y, amp_dtype="float16", scaler=scaler)
    assert out["skipped"] and scaler.get_scale() < 2.0**40
    assert max_abs_diff({n: p.detach() for n, p in model.named_parameters()}, before) == 0


def test_fit_learns_the_synthetic_images():
    torch.manual_seed(0)
    model = models.SmallCNN(width=8)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    hist = train.fit(model, opt, train.batches_from(data.synthetic_images(512), 64), 30, progress=False)
    assert hist[-1]["loss"] < 0.5 * hist[0]["loss"]


def test_lm_loss_shifts_labels():
    model = models.build_llama("tiny")
    ids = data.random_tokens(2, 16, 512)
    ours = train.forward_loss(model, ids, ids)
    theirs = model(input_ids=ids, labels=ids).loss
    assert torch.allclose(ours, theirs, atol=1e-5)


# --- checkpointing -------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [{"every": 1}, {"every": 2}, {"part": "mlp"}])
def test_checkpointing_keeps_gradients_and_cuts_saved_bytes(kwargs):
    model = models.build_llama("tiny", num_hidden_layers=4)
    ids = data.random_tokens(2, 64, 512)
    ref = twin(model)
    loss = lambda m: train.forward_loss(m, ids, ids)
    loss(ref).backward()
    full = memory.activation_bytes(ref, lambda: loss(ref))
    checkpointing.checkpoint_layers(checkpointing.transformer_layers(model), **kwargs)
    less = memory.activation_bytes(model, lambda: loss(model))
    loss(model).backward()
    strip = lambda g: {k.replace(".block", ""): v for k, v in g.items()}
    assert max_abs_diff(strip(grads(model)), grads(ref)) < 1e-6
    assert less < 0.85 * full
    checkpointing.remove_checkpointing(checkpointing.transformer_layers(model))
    assert not any(isinstance(m, checkpointing.CheckpointedBlock) for m in model.modules())


def test_checkpoint_layers_rejects_unknown_part():
    model = models.build_llama("tiny")
    with pytest.raises(ValueError, match="part='ffn'"):
        checkpointing.checkpoint_layers(checkpointing.transformer_layers(model), part="ffn")


# --- data, throughput, results ---------------------------------------------------------------------

def test_tokenizer_round_trips_the_corpus():
    text = data.text_corpus(300)
    tok = data.train_tokenizer(text, vocab_size=600)
    line = text.splitlines()[0]
    assert tok.decode(tok(line)["input_ids"]) == line
    assert len(tok(line)["input_ids"]) < len(line) / 2  # BPE merges actually compress


def test_mfu_arithmetic():
    n, layers, d, seq = 1_000_000_000, 16, 2048, 2048
    per_tok = throughput.transformer_flops_per_token(n, layers, d, seq)
    assert per_tok == 6 * n + 12 * layers * d * seq
    assert throughput.transformer_flops_per_token(n, layers, d, seq, frozen_base=True) == 4 * n + 12 * layers * d * seq
    assert math.isclose(throughput.mfu(40_300, per_tok, 989e12), 40_300 * per_tok / 989e12)


def test_results_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("COURSE_RUN_DIR", str(tmp_path))
    r = results.Results("99_test")
    r.record("ratio", torch.tensor(2.5), unit="x")
    r.record("nan", float("nan"))
    r.claim("two is more than one", "2 > 1", 2 > 1, "arithmetic")
    loaded = results.load("99_test")
    assert loaded["values"]["ratio"] == {"value": 2.5, "unit": "x"}
    assert loaded["values"]["nan"]["value"] is None
    assert loaded["claims"][0]["held"] is True


def test_system_report_names_the_stack():
    rep = system_report()
    assert rep["collective backend"] in ("gloo", "nccl", "nccl (RCCL)")
    assert "NUMA auto-balancing" in rep and rep["tier picked"] in ("cpu", "gpu", "node")
