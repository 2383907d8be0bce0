"""course_lib's utilities, each against an independent computation or a real failure mode."""

import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from course_grader.grading import grads, max_abs_diff, twin
from course_lib import checkpointing, data, memory, models, precision, results, throughput, train
from course_lib.device import pick_tier, system_report
from course_lib.loss import forward_loss


# --- bad input stops early, naming the parameter and the fix ------------------------------------

def test_batch_that_does_not_divide_names_both_parameters():
    x, y = torch.zeros(30, 3, 32, 32), torch.zeros(30, dtype=torch.long)
    with pytest.raises(ValueError, match=r"batch_size=30.*accum_steps=4"):
        train.split_batch((x, y), 4)


def test_gpu_tier_on_a_cpu_machine_is_refused():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")  # the refusal only exists without one
    with pytest.raises(ValueError, match="tier='gpu'.*tier='cpu'"):
        pick_tier("gpu")
    with pytest.raises(ValueError, match="not one of"):
        pick_tier("laptop")


def test_dims_checks_the_batch_once_and_names_what_to_change():
    d = train.Dims.for_world(64, 8, accum_steps=2, tp=2)
    assert (d.dp, d.tp, d.world, d.local_batch, d.micro_batch) == (4, 2, 8, 16, 8)
    with pytest.raises(ValueError, match=r"global_batch=100 does not divide by accum_steps 4 x dp 8 = 32.*e\.g\. 96"):
        train.Dims(100, 4, dp=8)
    with pytest.raises(ValueError, match=r"global_batch=10 does not divide by the data-parallel size dp=4"):
        train.Dims(10, dp=4)
    with pytest.raises(ValueError, match=r"world=6 does not divide into tp=4 x pp=1"):
        train.Dims.for_world(8, 6, tp=4)
    rows = {"input_ids": torch.arange(12).view(6, 2), "labels": torch.arange(6)}
    parts = [train.Dims(6, dp=3).local(rows, r) for r in range(3)]
    assert torch.equal(torch.cat([p["labels"] for p in parts]), rows["labels"])
    assert torch.equal(parts[1]["input_ids"], rows["input_ids"][2:4])


def _mesh_of(dims: dict, names=None) -> dict:
    """A worker: the mesh ``Dims(**dims).mesh`` lays out on this rank, as names, shape and this rank's coordinates."""
    mesh = train.Dims(**dims).mesh("cpu", names)
    return {"names": list(mesh.mesh_dim_names), "shape": list(mesh.shape), "coordinate": list(mesh.get_coordinate())}


def test_dims_lay_out_one_mesh_tensor_parallel_ranks_neighbours():
    """pp, dp, cp, tp in that order, dimensions of 1 left out: on 4 gloo ranks dp 2 x tp 2 puts ranks 0 and 1 in one
    tensor-parallel group; a layout the group does not have stops with the fix."""
    from course_lib.launch import run_forked
    out = run_forked(_mesh_of, 4, {"dims": {"global_batch": 4, "dp": 2, "tp": 2}})
    assert [r["names"] for r in out] == [["dp", "tp"]] * 4 and out[0]["shape"] == [2, 2]
    assert [r["coordinate"] for r in out] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert train.Dims.for_world(8, 8, tp=2, cp=2).dp == 2
    with pytest.raises(Exception, match=r"lay out pp 1 x dp 2 x cp 1 x tp 2 = 4 ranks but the process group has 2"):
        run_forked(_mesh_of, 2, {"dims": {"global_batch": 4, "dp": 2, "tp": 2}})
    with pytest.raises(Exception, match=r"leaves out a dimension above 1"):
        run_forked(_mesh_of, 4, {"dims": {"global_batch": 4, "dp": 2, "tp": 2}, "names": ("tp",)})


def test_a_run_spec_comes_back_from_json_and_refuses_a_field_it_lacks():
    """A worker's spec survives launch's JSON (a dict of its fields) and names its fields when given another."""
    import dataclasses
    import json

    from course_lib.launch import _as_json

    @dataclasses.dataclass(frozen=True)
    class Run(train.RunSpec):
        steps: int = 5
        schedule: str = "gpipe"

    sent = json.loads(json.dumps({"spec": Run(steps=3)}, default=_as_json))["spec"]
    assert Run.of(sent) == Run(steps=3) and Run.of(None, schedule="1f1b") == Run(schedule="1f1b")
    with pytest.raises(ValueError, match="Run has no field stepz: its fields are steps, schedule"):
        Run.of({"stepz": 3})
    with pytest.raises(TypeError, match="not JSON-able"):
        json.dumps({"x": object()}, default=_as_json)


def test_fit_resumes_at_a_step_stops_when_asked_and_times_each_step():
    """The one loop: a resumed run asks for the batches from its start step on, a hook stops it, every step is
    timed, and the per-step context wraps the step it names."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    asked, wrapped = [], []

    def batch_for(step):
        asked.append(step)
        return torch.randn(8, 4), torch.randint(0, 2, (8,))

    class Mark:
        def __init__(self, step):
            self.step = step

        def __enter__(self):
            wrapped.append(self.step)

        def __exit__(self, *exc):
            return False

    history = train.fit(model, opt, batch_for, 10, start=3, dims=train.Dims(8, accum_steps=2),
                        step_context=Mark, after_step=lambda step, rec: step == 5, progress=False)
    assert asked == [3, 4, 5] == [r["step"] for r in history] == wrapped
    assert all(r["seconds"] > 0 and math.isfinite(r["loss"]) for r in history)
    assert train.tokens_per_second(history, 8) > 0
    with pytest.raises(ValueError, match=r"dims \(accumulation 2\) and accum_steps=4: give the accumulation once"):
        train.fit(model, opt, batch_for, 1, dims=train.Dims(8, accum_steps=2), accum_steps=4, progress=False)


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


def test_synthetic_images_are_their_class_template_plus_noise():
    x, y = data.synthetic_images(400, noise=0.5, seed=3).tensors
    residual = x - data.class_templates(seed=3)[y]
    assert abs(float(residual.std()) - 0.5) < 0.01 and abs(float(residual.mean())) < 0.01
    assert not torch.equal(data.class_templates(seed=3), data.class_templates(seed=4))


def test_model_state_measurement_matches_the_adam_estimate():
    model = models.SmallCNN(width=8)
    opt = torch.optim.AdamW(model.parameters())
    x, y = data.synthetic_images(8).tensors
    train.train_step(model, opt, (x, y))
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
    ra = train.train_step(a, opt_a, (x, y), accum_steps=1)
    rb = train.train_step(b, opt_b, (x, y), accum_steps=4)
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
    out = train.train_step(model, opt, (x, y), amp_dtype="float16", scaler=scaler)
    assert out["skipped"] and scaler.get_scale() < 2.0**40
    assert max_abs_diff({n: p.detach() for n, p in model.named_parameters()}, before) == 0


def test_fit_learns_the_synthetic_images():
    torch.manual_seed(0)
    model = models.SmallCNN(width=8)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    hist = train.fit(model, opt, train.batches_from(data.synthetic_images(512), 64), 30, progress=False)
    assert hist[-1]["loss"] < 0.5 * hist[0]["loss"]


def test_lm_loss_shifts_labels_in_every_batch_form():
    model = models.build_llama("tiny")
    ids = data.random_tokens(2, 16, 512)
    theirs = model(input_ids=ids, labels=ids).loss
    for batch in (ids, (ids, ids), {"input_ids": ids, "labels": ids}):
        assert torch.allclose(forward_loss(model, batch), theirs, atol=1e-5), type(batch)
    masked = ids.clone()
    masked[:, :8] = -100  # a dict batch scores only its labelled positions
    want = F.cross_entropy(model(ids).logits[:, 7:-1].flatten(0, 1), ids[:, 8:].flatten())
    assert torch.allclose(forward_loss(model, {"input_ids": ids, "labels": masked}), want, atol=1e-5)


def test_split_batch_keeps_the_form_of_the_batch():
    x, y = torch.arange(12.).reshape(6, 2), torch.arange(6)
    parts = train.split_batch((x, y), 3)
    assert len(parts) == 3 and all(isinstance(p, tuple) and p[0].shape == (2, 2) for p in parts)
    assert torch.equal(torch.cat([p[1] for p in parts]), y)
    dparts = train.split_batch({"input_ids": x, "labels": y}, 2)
    assert [sorted(p) for p in dparts] == [["input_ids", "labels"]] * 2 and torch.equal(dparts[1]["labels"], y[3:])
    assert [p.shape[0] for p in train.split_batch(x, 6)] == [1] * 6
    with pytest.raises(ValueError, match="batch_size=6 does not divide by accum_steps=4"):
        train.split_batch({"input_ids": x}, 4)


def test_sync_grads_runs_once_after_the_last_backward_and_before_the_step():
    torch.manual_seed(0)
    model = models.SmallCNN(width=8)
    ref = twin(model)
    x, y = data.synthetic_images(16).tensors
    events = []
    model.head.weight.register_hook(lambda g: events.append("backward"))

    def sync(m):  # a stand-in for an all-reduce: halve every gradient, once
        events.append("sync")
        for p in m.parameters():
            p.grad /= 2

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.register_step_pre_hook(lambda *a: events.append("step"))
    out = train.train_step(model, opt, (x, y), accum_steps=4, sync_grads=sync, clip_norm=1e9)
    assert events == ["backward"] * 4 + ["sync", "step"]
    forward_loss(ref, (x, y)).backward()
    halved = {n: p.grad / 2 for n, p in ref.named_parameters()}
    want_norm = torch.sqrt(sum((g ** 2).sum() for g in halved.values())).item()
    assert out["grad_norm"] == pytest.approx(want_norm, rel=1e-5)  # the norm is taken after the sync
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for p in ref.parameters():
        p.grad = p.grad / 2
    ref_opt.step()
    assert max_abs_diff({n: p.detach() for n, p in model.named_parameters()},
                        {n: p.detach() for n, p in ref.named_parameters()}) < 1e-6


def _step_grads(model, batch, **kw):
    """The gradients train_step leaves just before its optimizer step (lr 0: the weights stay)."""
    opt, seen = torch.optim.SGD(model.parameters(), lr=0.0), {}
    opt.register_step_pre_hook(lambda *a: seen.update(grads(model)))
    out = train.train_step(model, opt, batch, **kw)
    return seen, out["loss"]


def test_token_weighted_accumulation_equals_the_whole_batch_and_the_mean_of_means_does_not():
    model = models.build_llama("tiny")
    ids = data.random_tokens(8, 16, 512)
    labels = ids.clone()
    labels[:4, :12] = -100  # the first micro-batch scores far fewer tokens than the second
    labels[4:, :3] = -100
    batch = {"input_ids": ids, "labels": labels}
    ref = twin(model)
    whole = forward_loss(ref, batch)
    whole.backward()
    weighted, loss = _step_grads(twin(model), batch, accum_steps=2, token_weighted=True)
    assert max_abs_diff(weighted, grads(ref)) < 1e-5 * max(float(g.abs().max()) for g in grads(ref).values())
    assert loss == pytest.approx(whole.item(), rel=1e-5)
    means, _ = _step_grads(twin(model), batch, accum_steps=2)
    assert max_abs_diff(means, grads(ref)) > 0.1 * max(float(g.abs().max()) for g in grads(ref).values())
    labels[:4] = -100  # a micro-batch that scores nothing is skipped, not a nan
    skipped, loss = _step_grads(twin(model), batch, accum_steps=2, token_weighted=True)
    assert math.isfinite(loss) and all(torch.isfinite(g).all() for g in skipped.values())
    labels[:] = -100
    with pytest.raises(ValueError, match="scores no token"):
        train.train_step(twin(model), torch.optim.SGD(model.parameters(), lr=0.0), batch, token_weighted=True)


def test_tensor_bytes_counts_each_tensor_once():
    w = torch.zeros(10, 4)
    assert memory.tensor_bytes([w, w, w.view(40), None, torch.zeros(())]) == 10 * 4 * 4 + 40 * 4
    assert memory.tensor_bytes([w[:5], w[5:]]) == 10 * 4 * 4  # two halves: both count
    model = models.build_llama("tiny", tie_word_embeddings=True)
    assert memory.tensor_bytes(model.parameters()) == 4 * models.count_parameters(model)


def test_one_meter_splits_the_same_bytes_by_dtype_and_by_part():
    model = models.build_llama("tiny", num_hidden_layers=2)
    ids = data.random_tokens(2, 32, 512)
    parts = ([("mlp", layer.mlp) for layer in model.model.layers]
             + [("attention", layer.self_attn) for layer in model.model.layers])
    with memory.SavedTensorMeter(exclude=model, parts=parts) as meter:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = forward_loss(model, ids)
    assert sum(meter.by_dtype.values()) == meter.bytes == sum(meter.by_part.values())
    assert {"bfloat16", "float32"} <= set(meter.by_dtype)
    assert meter.by_part["mlp"] > meter.by_part["attention"] > 0 and meter.by_part["other"] > 0
    assert memory.saved_bytes_by_part(model, lambda: forward_loss(model, ids), parts)["mlp"] > 0
    del loss


def test_the_meter_follows_what_autograd_holds_until_backward_frees_it():
    model = models.build_llama("tiny", num_hidden_layers=2)
    ids = data.random_tokens(2, 32, 512)
    meter = memory.SavedTensorMeter(exclude=model)
    with meter:
        loss = forward_loss(model, ids)
    held = meter.live
    assert held >= meter.bytes > 0 and meter.peak == held  # whole storages, at least the spans they cover
    # backward frees the graph and with it every saved tensor (the ids this test holds are not autograd's)
    loss.backward()
    assert meter.live == 0 and meter.peak == held
    with meter:  # a second, half-size step: the peak stays the first one's
        forward_loss(model, ids[:1]).backward()
    assert meter.live == 0 and meter.peak == held
    with meter:  # a forward dropped without backward, as activation_bytes does: what it saved goes with it
        loss = forward_loss(model, ids)
    del loss
    # had the meter handed autograd the saved tensors themselves, a saved output would hold its own grad_fn (a cycle
    # in C++ that no collector frees) and every metered forward would leak: notebook 04 ran an H100 out of memory
    assert meter.live == 0


def test_course_setup_picks_sizes_device_and_results(tmp_path, monkeypatch, capsys):
    from course_lib import course_setup

    monkeypatch.setenv("COURSE_RUN_DIR", str(tmp_path))
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)  # a plain `jupyter lab`, without make or the images
    sizes = {t: dict(width=8 * (i + 1), batch=16) for i, t in enumerate(("smoke", "cpu", "gpu", "node"))}
    tier, size, device, res = course_setup("99_setup", "smoke", sizes, seed=3, batch=None)
    # the kernel, and every process it starts, finds DeepSpeed's ops where `make setup` built them (this venv's)
    assert os.environ["TORCH_EXTENSIONS_DIR"] == os.path.join(sys.prefix, "torch_extensions")
    assert (tier, size, device.type) == ("smoke", {"width": 8, "batch": 16}, "cpu")
    assert (tmp_path / "results" / "99_setup.json").exists() and res.notebook == "99_setup"
    assert "99_setup: tier=smoke, device=cpu" in capsys.readouterr().out
    assert course_setup("99_setup", "cpu", sizes, batch=64).size == {"width": 16, "batch": 64}
    with pytest.raises(ValueError, match=r"overrides \['bacth'\]"):
        course_setup("99_setup", "cpu", sizes, bacth=64)
    with pytest.raises(ValueError, match="no entry for the tiers"):
        course_setup("99_setup", "cpu", {"cpu": {}})
    # a size one tier lacks fails on every tier, the CPU's too (notebook 11's gpu tier once lacked cli_steps)
    lacking = {**sizes, "gpu": dict(width=64)}
    with pytest.raises(ValueError, match=r"\{'gpu': \['batch'\]\} lacking"):
        course_setup("99_setup", "cpu", lacking)


def test_one_dtype_table_names_the_argument():
    assert precision.dtype_bytes("bf16") == 2 and precision.dtype_bytes(torch.float32) == 4
    with pytest.raises(ValueError, match="weight_dtype='fp8'"):
        memory.estimate_model_state(10, "fp8")


# --- checkpointing -------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [{"every": 1}, {"every": 2}, {"part": "mlp"}])
def test_checkpointing_keeps_gradients_and_cuts_saved_bytes(kwargs):
    model = models.build_llama("tiny", num_hidden_layers=4)
    ids = data.random_tokens(2, 64, 512)
    ref = twin(model)
    def loss(m):
        return forward_loss(m, ids)
    loss(ref).backward()
    full = memory.activation_bytes(ref, lambda: loss(ref))
    checkpointing.checkpoint_layers(checkpointing.transformer_layers(model), **kwargs)
    less = memory.activation_bytes(model, lambda: loss(model))
    loss(model).backward()
    def strip(g):
        return {k.replace(".block", ""): v for k, v in g.items()}
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
    assert r.claim("two is more than one", "2 > 1", 2 > 1, "arithmetic") is True
    loaded = results.load("99_test")
    assert loaded["values"]["ratio"] == {"value": 2.5, "unit": "x"}
    assert loaded["values"]["nan"]["value"] is None
    assert loaded["claims"][0]["held"] is True and loaded["claims"][0]["kind"] == "measured"


def test_conclusions_give_each_claim_the_verdict_of_its_kind(tmp_path, monkeypatch):
    """A notebook's closing list: a predicted, simulated or unmeasured claim never reads as held, a failed one fails."""
    monkeypatch.setenv("COURSE_RUN_DIR", str(tmp_path))
    r = results.Results("99_test")
    assert r.conclusions() == "No claim was recorded in this run."
    r.claim("fits in 48 GB", "46 GB by arithmetic", True, kind="predicted")
    r.claim("8 workers keep up", "with a calibrated loader", True, kind="simulated")
    r.claim("offload frees the GPU", "no GPU here", kind="not measured here")
    r.claim("loss matches", "1e-7", True)
    r.claim("bf16 is 2x faster", "1.1x", False)
    lines = r.conclusions().splitlines()
    assert lines == ["- **predicted: agrees**: fits in 48 GB (46 GB by arithmetic)",
                     "- **simulated: agrees**: 8 workers keep up (with a calibrated loader)",
                     "- **not measured here**: offload frees the GPU (no GPU here)",
                     "- **held**: loss matches (1e-7)",
                     "- **did not hold**: bf16 is 2x faster (1.1x)"]


def test_only_a_measured_claim_holds_or_fails(tmp_path, monkeypatch):
    monkeypatch.setenv("COURSE_RUN_DIR", str(tmp_path))
    r = results.Results("99_test")
    assert r.claim("fits in 80 GB", "141 GB by arithmetic", False, kind="predicted") is False
    assert r.claim("8 workers keep up", "with a calibrated loader", True, kind="simulated") is True
    assert r.claim("offload frees the GPU", "no GPU here", kind="not measured here") is None
    r.claim("loss matches", "1e-7", True)
    claims = results.load("99_test")["claims"]
    assert [c["held"] for c in claims] == [None, None, None, True]
    assert [c["agrees"] for c in claims] == [False, True, None, None]
    assert [results.verdict(c) for c in claims] == ["predicted: disagrees", "simulated: agrees", "not measured here",
                                                    "held"]
    assert results.kind_counts(claims) == {"held": 1, "predicted": 1, "simulated": 1, "not measured here": 1}
    with pytest.raises(ValueError, match="use one of"):
        r.claim("x", "y", True, kind="guessed")
    with pytest.raises(ValueError, match="needs a held"):
        r.claim("x", "y")  # a measured claim without its verdict
    with pytest.raises(ValueError, match="takes no held"):
        r.claim("x", "y", True, kind="not measured here")


def test_system_report_names_the_stack():
    rep = system_report()
    assert rep["collective backend"] in ("gloo", "nccl", "nccl (RCCL)")
    assert "NUMA auto-balancing" in rep and rep["tier picked"] in ("cpu", "gpu", "node")


# --- grading: the library's answers out of reach -----------------------------------------------------

def test_forbid_blocks_every_way_to_reach_an_answer_and_restores_them():
    from course_grader.grading import LibraryAnswer, forbid
    from course_lib.memory import activation_bytes

    kept = activation_bytes
    before = torch.amp.GradScaler("cpu")

    class Wrapped(torch.amp.GradScaler):
        pass

    def student(model, forward, meter=activation_bytes):  # a reference captured at definition time
        return meter(model, forward)

    copied = type("Copied", (), {k: v for k, v in vars(torch.amp.GradScaler).items()  # its methods, not the class
                                 if k == "__init__" or not k.startswith("__")})
    namespace = {"activation_bytes": activation_bytes}
    lin = torch.nn.Linear(2, 2)
    with forbid(memory.activation_bytes, torch.amp.GradScaler, namespace=namespace):
        attempts = {"by name": lambda: namespace["activation_bytes"](lin, lambda: lin(torch.ones(1, 2))),
                    "module attribute": lambda: memory.activation_bytes(lin, lambda: None),
                    "kept reference": lambda: kept(lin, lambda: None),
                    "default argument": lambda: student(lin, lambda: None),
                    "torch's class": lambda: torch.amp.GradScaler("cpu"),
                    "a subclass": lambda: Wrapped("cpu"),
                    "an instance made before": lambda: before.scale(torch.ones(())),
                    "a class made of its methods": lambda: copied("cpu")}
        for how, attempt in attempts.items():
            with pytest.raises(LibraryAnswer, match="write it yourself"):
                attempt()
                pytest.fail(f"{how}: reached the answer")
        assert memory.tensor_bytes([torch.zeros(3)]) == 12  # what is not forbidden still works
    x = torch.ones(4, 2, requires_grad=True)
    assert namespace["activation_bytes"] is activation_bytes and memory.activation_bytes is activation_bytes
    assert kept(lin, lambda: lin(x).sum()) == 4 * 2 * 4 and Wrapped("cpu").get_scale() == 2.0**16
    assert float(before.scale(torch.ones(()))) == 2.0**16 and copied("cpu").get_scale() == 2.0**16


def test_forbid_swaps_a_method_that_calls_super_and_puts_its_code_back():
    """A method that calls ``super()`` closes over ``__class__``: its stand-in closes over the same name, so the
    swap is made in place like any other, and undone."""
    from course_grader.grading import LibraryAnswer, forbid

    ddp = torch.nn.parallel.DistributedDataParallel
    original = ddp.__init__.__code__
    assert original.co_freevars == ("__class__",)
    with forbid(ddp):
        assert ddp.__init__.__code__ is not original
        with pytest.raises(LibraryAnswer, match="write it yourself"):
            ddp.__init__(None, None)
    assert ddp.__init__.__code__ is original


def test_the_activation_formula_has_one_home():
    """10·d + 4·ffn values per layer and token (memory.layer_activation_values); checkpointing keeps d per layer,
    and its backward peak holds one layer's activations again (the recipe and the offload sweep predict with it)."""
    config = models.llama_config("tiny")
    per_layer = memory.layer_activation_values(config)
    assert per_layer == 10 * config.hidden_size + 4 * config.intermediate_size
    full = memory.llama_activation_bytes(config, 2, 16, dtype_bytes=2, logits_bytes=0)
    kept = memory.llama_activation_bytes(config, 2, 16, dtype_bytes=2, logits_bytes=0, checkpointed=True)
    peak = memory.llama_activation_bytes(config, 2, 16, dtype_bytes=2, logits_bytes=0, checkpointed=True,
                                         recomputing=True)
    assert full == 32 * config.num_hidden_layers * per_layer * 2
    assert kept == 32 * config.num_hidden_layers * config.hidden_size * 2
    assert peak - kept == 32 * per_layer * 2
    assert memory.llama_activation_bytes(config, 2, 16, recomputing=True) == \
        memory.llama_activation_bytes(config, 2, 16)
