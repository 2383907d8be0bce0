"""The fine-tune recipe's memory plan and the recipe-vs-baseline benchmark, on the CPU shape."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from course_grader.grading import grads, max_abs_diff, twin
from course_lib import attention, recipe as rc
from course_lib.apps import benchmark as bm, finetune as ft
from course_lib.checkpointing import CheckpointedBlock
from course_lib.instruct import packed_attention_mask
from course_lib.lora import ALL_LINEAR, apply_lora
from course_lib.loss import forward_loss, lm_loss
from course_lib.memory import activation_bytes
from course_lib.models import build_llama, llama_config, llama_num_parameters
from course_lib.throughput import matmul_parameters, transformer_flops_per_token

GIB = 2**30


def test_the_recipes_checkpointing_is_notebook_03s_and_changes_only_memory():
    """The recipe checkpoints with course_lib.checkpointing (whole blocks, non-reentrant), on a LoRA model whose
    base is frozen: every adapter still gets its gradient and fewer bytes are saved for backward."""
    from dataclasses import replace

    model = apply_lora(build_llama("tiny", num_hidden_layers=4), r=4, target_modules=ALL_LINEAR)
    ref = twin(model)
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    plain = replace(rc.BASELINE, amp_dtype=None, frozen_weights_bf16=False)
    rc.prepare(model, replace(plain, checkpointing=True))
    assert sum(isinstance(m, CheckpointedBlock) for m in model.modules()) == 4
    plain_bytes, ckpt_bytes = (activation_bytes(m, lambda m=m: forward_loss(m, ids)) for m in (ref, model))
    forward_loss(ref, ids).backward()
    forward_loss(model, ids).backward()
    def strip(g):
        return {k.replace(".block", ""): v for k, v in g.items()}
    assert grads(ref) and max_abs_diff(strip(grads(model)), grads(ref)) < 1e-6
    assert ckpt_bytes < 0.5 * plain_bytes


def test_plan_micro_batch_checkpoints_only_when_memory_needs_it():
    c1, c8 = llama_config("1b"), llama_config("8b")
    cpu = rc.plan_micro_batch(c1, 2048, "cpu")
    assert cpu["checkpointing"] is False and cpu["estimated_bytes"] is None
    fits = rc.plan_micro_batch(c1, 2048, "cuda", micro_batch=4, memory_bytes=80 * GIB)
    assert fits["micro_batch"] == 4 and not fits["checkpointing"]
    # the fair baseline, 8B LoRA with its frozen base in bf16 and the plain loss, needs checkpointing on an 80 GB H100
    # (an H100 reports about 79 GiB), not on an H200's 141 GB; the recipe's chunked loss needs none on either
    for mem in (79 * GIB, 80 * GIB):
        base8 = rc.plan_micro_batch(c8, 2048, "cuda", micro_batch=4, lora=True, chunked_loss=False, frozen_bytes=2,
                                    memory_bytes=mem, lora_params=42_000_000)
        assert base8["checkpointing"]
        rec8 = rc.plan_micro_batch(c8, 2048, "cuda", micro_batch=4, lora=True, memory_bytes=mem, lora_params=42_000_000)
        assert not rec8["checkpointing"]
    assert not rc.plan_micro_batch(c8, 2048, "cuda", micro_batch=4, lora=True, chunked_loss=False,
                                   memory_bytes=141 * GIB)["checkpointing"]
    tight = rc.plan_micro_batch(c1, 2048, "cuda", micro_batch=16, memory_bytes=40 * GIB)
    assert tight["checkpointing"] and tight["micro_batch"] * tight["accum_steps"] >= 16
    auto = rc.plan_micro_batch(c1, 2048, "cuda", memory_bytes=192 * GIB)
    assert not auto["checkpointing"] and auto["micro_batch"] >= 8
    with pytest.raises(ValueError, match="shard"):
        rc.plan_micro_batch(llama_config("70b"), 2048, "cuda", micro_batch=1, memory_bytes=80 * GIB)
    # the estimate of the baseline 1B step is close to the 43.8 GiB measured on an H200
    est = rc.estimate_step_bytes(c1, 2048, 4, chunked_loss=False)["total"] / GIB
    assert 38 < est < 50


def test_plan_takes_what_the_gpu_holds_already_off_its_budget():
    """Notebook 12's benchmark ran out of memory on an H100: its plan counted the whole 80 GB while the notebook's
    own fine-tuned models held tens of GB. The baseline 1B step (~44 GiB) fits an empty 80 GB card, needs
    checkpointing beside 30 GiB held, and beside 60 GiB held nothing fits: the error says what to free."""
    c1 = llama_config("1b")
    baseline = dict(micro_batch=4, chunked_loss=False, frozen_bytes=4, memory_bytes=80 * GIB)
    empty = rc.plan_micro_batch(c1, 2048, "cuda", **baseline, held_bytes=0)
    assert not empty["checkpointing"] and empty["held_bytes"] == 0
    shared = rc.plan_micro_batch(c1, 2048, "cuda", **baseline, held_bytes=30 * GIB)
    assert shared["checkpointing"] and shared["budget_bytes"] == empty["budget_bytes"] - 30 * GIB
    with pytest.raises(ValueError, match="60.0 GiB held already .*free the models of earlier cells"):
        rc.plan_micro_batch(c1, 2048, "cuda", **baseline, held_bytes=60 * GIB)
    assert rc.plan_micro_batch(c1, 2048, "cuda", **baseline)["held_bytes"] == 0  # a card named by its size: empty


def test_estimate_counts_the_chunked_loss_lm_head_gradient_only_where_the_head_trains():
    c8 = llama_config("8b")
    full = rc.estimate_step_bytes(c8, 2048, 4)
    assert full["lm head gradient"] == 128256 * 4096 * 4  # fp32 V×d, 2 GiB at 8B
    assert full["total"] == full["model state"] + full["activations"] + full["logits"] + full["lm head gradient"]
    assert rc.estimate_step_bytes(c8, 2048, 4, chunked_loss=False)["lm head gradient"] == 0  # autograd's own, in state
    assert rc.estimate_step_bytes(c8, 2048, 4, lora=True)["lm head gradient"] == 0
    assert rc.estimate_step_bytes(c8, 2048, 4, lora=True, trainable_head=True)["lm head gradient"] == full[
        "lm head gradient"]
    # what LoRA does with the head: peft freezes it with the base (so no V×d gradient exists)
    model = apply_lora(ft.load_model(None, preset="tiny"), r=4, target_modules=ALL_LINEAR)
    assert not model.get_output_embeddings().weight.requires_grad


def test_the_lora_baseline_stores_its_frozen_base_in_bf16_and_its_adapters_in_fp32():
    model = apply_lora(ft.load_model(None, preset="tiny"), r=4, target_modules=ALL_LINEAR)
    rc.prepare(model, rc.BASELINE)
    frozen = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad]
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert frozen and all(w.dtype == torch.bfloat16 for w in frozen)  # every base linear, the LM head included
    assert trainable and all(p.dtype == torch.float32 for p in trainable)
    full = ft.load_model(None, preset="tiny")
    rc.prepare(full, rc.BASELINE)  # full fine-tune: nothing frozen, nothing converted
    assert all(p.dtype == torch.float32 for p in full.parameters())


def _two_documents(n1: int = 10, n2: int = 14, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randint(0, 512, (1, n1), generator=g), torch.randint(0, 512, (1, n2), generator=g)
    return {"input_ids": torch.cat([a, b], 1), "alone": b,
            "position_ids": torch.cat([torch.arange(n1), torch.arange(n2)])[None],
            "document_ids": torch.cat([torch.zeros(n1), torch.ones(n2)]).long()[None], "n1": n1}


@pytest.mark.parametrize("impl", ["sdpa", attention.IMPLEMENTATION])
def test_a_packed_document_computes_what_it_computes_alone(impl):
    """transformers 5 builds the block-causal mask from position_ids restarting at 0; the explicit mask
    (what the benchmark passes, in both runs) gives the same; a plain causal row does not."""
    model = ft.load_model(None, preset="tiny", attn_implementation=impl).eval()
    d, n1 = _two_documents(), 10
    mask = packed_attention_mask(d["document_ids"])
    with torch.no_grad():
        alone = model(input_ids=d["alone"]).logits
        by_positions = model(input_ids=d["input_ids"], position_ids=d["position_ids"]).logits[:, n1:]
        by_mask = model(input_ids=d["input_ids"], position_ids=d["position_ids"], attention_mask=mask).logits[:, n1:]
        plain = model(input_ids=d["input_ids"]).logits[:, n1:]
        kernels = attention.attention_kernels(lambda: model(input_ids=d["input_ids"], attention_mask=mask))
    torch.testing.assert_close(by_positions, alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(by_mask, alone, atol=1e-5, rtol=1e-5)
    assert (plain - alone).abs().max() > 1e-2  # the test can fail: no mask, no position reset, other numbers
    assert kernels == {"flash": 2}  # CPU: the flash kernel takes the mask (on CUDA a mask rules flash out)


def test_the_chunked_loss_forwards_position_ids_and_the_document_mask():
    model = ft.load_model(None, preset="tiny").eval()
    d = _two_documents(seed=1)
    labels = d["input_ids"].clone()
    labels[:, d["n1"]] = -100  # nothing in document 2 predicts its first token
    batch = {"input_ids": d["input_ids"], "labels": labels, "position_ids": d["position_ids"]}
    with torch.no_grad():
        plain, chunked = forward_loss(model, batch), lm_loss(model, batch, chunk_tokens=7)
        masked = lm_loss(model, {**batch, "document_ids": d["document_ids"]}, chunk_tokens=7)
        unpacked = lm_loss(model, {"input_ids": d["input_ids"], "labels": labels}, chunk_tokens=7)
    torch.testing.assert_close(chunked, plain)
    torch.testing.assert_close(masked, plain)
    assert abs(float(unpacked) - float(plain)) > 1e-3


def test_mfu_counts_every_parameter_but_the_input_embedding():
    untied = ft.load_model(None, preset="tiny")
    c = untied.config
    n = sum(p.numel() for p in untied.parameters())
    assert matmul_parameters(llama_num_parameters(c), c.vocab_size, c.hidden_size, False) == (
        n - untied.get_input_embeddings().weight.numel())
    tied = ft.load_model(None, preset="tiny", tie_word_embeddings=True)
    assert tied.get_output_embeddings().weight is tied.get_input_embeddings().weight
    ct = tied.config
    # parameters() yields the shared matrix once: as the LM head, a matmul, it stays counted
    assert matmul_parameters(llama_num_parameters(ct), ct.vocab_size, ct.hidden_size, True) == sum(
        p.numel() for p in tied.parameters())


@pytest.fixture(scope="module")
def cpu_result():
    return bm.benchmark("tiny", 32, 2, 3, 1, device="cpu", repeats=2)


def test_benchmark_same_start_same_batches_document_masked(cpu_result):
    res = cpu_result
    b, r = res["baseline"], res["recipe"]
    assert res["shape"]["repeats"] == 2 and len(b["tokens_per_s_runs"]) == 2 == len(r["tokens_per_s_runs"])
    for row in (b, r):
        s = row["tokens_per_s_spread"]
        assert s["min"] <= s["median"] == row["tokens_per_s"] <= s["max"]
        assert row["attention_kernels"] == {"flash": 4}  # 2 layers, forward and backward, with the document mask
        assert len(row["losses"]) == 4 and row["mfu"] is None
    assert (b["attn_implementation"], r["attn_implementation"]) == ("sdpa", attention.IMPLEMENTATION)
    assert res["step0_loss_rel_diff"] <= bm.STEP0_TOLERANCE  # same weights, same batch
    assert res["max_curve_rel_diff"] <= bm.CURVE_TOLERANCE  # the whole curve, not only the last step
    c = llama_config("tiny")
    n = matmul_parameters(sum(p.numel() for p in ft.load_model(None, preset="tiny").parameters()), c.vocab_size,
                          c.hidden_size, False)
    assert res["shape"]["mfu_parameters"] == n and r["flops_per_token"] == transformer_flops_per_token(n, 2, 64, 32)
    batch = bm.packed_batches(1, 2, 32, 512)[0]
    assert set(batch) == {"input_ids", "labels", "position_ids", "document_ids"}
    assert (batch["position_ids"][:, 1:] == 0).any()  # positions restart inside a row: documents are packed
    table = bm.format_table(res)
    assert "sdpa: flash ×4" in table and "input embedding excluded" in table and "n/a" in table
    assert "document-masked" in table and f"{res['max_curve_rel_diff']:.1e}" in table


def test_benchmark_cli_lora_fair_baseline_and_targets(tmp_path, capsys):
    out_json = tmp_path / "lora.json"
    bm.main(["--seq", "32", "--micro-batch", "2", "--steps", "2", "--warmup", "1", "--repeats", "1", "--lora",
             "--check-targets", "--json", str(out_json)])  # in process: a subprocess would pay the imports again
    stdout = capsys.readouterr().out
    lines = stdout.splitlines()
    assert any(line.startswith("| baseline | sdpa: flash") for line in lines)
    assert any(line.startswith("| recipe | course_sdpa: flash") for line in lines)
    assert "PASS  step-0 loss" in stdout and "n/a   speed targets" in stdout
    res = json.loads(out_json.read_text())
    b, r = res["baseline"], res["recipe"]
    assert b["weight_dtypes"] == r["weight_dtypes"]  # the same storage in both runs
    frozen = str(rc.amp_dtype_for("cpu")).removeprefix("torch.")  # bf16 where this CPU has bf16 kernels, else fp32
    assert b["weight_dtypes"]["frozen"][frozen] > 0 and set(b["weight_dtypes"]["trainable"]) == {"float32"}
    assert r["flops_per_token"] == transformer_flops_per_token(res["shape"]["mfu_parameters"], 2, 64, 32,
                                                               frozen_base=True)  # 4N, not 6N
    assert r["trainable_parameters"] < res["shape"]["mfu_parameters"]


def _as_gpu(res: dict, preset: str, lora: bool, name: str = "NVIDIA H100 80GB HBM3", mem: float = 79.1 * GIB,
            speedup: float = 1.5, mfu: float = 0.52, curve: float = 0.005, ckpt: bool = True) -> dict:
    out = copy.deepcopy(res)
    out["shape"].update(preset=preset, lora=lora, seq_len=2048, device_name=name, memory_bytes=mem)
    out["ratio"]["tokens_per_s"], out["recipe"]["mfu"], out["max_curve_rel_diff"] = speedup, mfu, curve
    out["baseline"]["checkpointing"] = ckpt
    return out


def test_check_targets_on_constructed_results(cpu_result, tmp_path):
    def verdict(res):
        return [c["passed"] for c in bm.check_targets(res)]
    assert verdict(cpu_result) == [True, True, None]  # the CPU shape has no speed target
    assert verdict(_as_gpu(cpu_result, "1b", False)) == [True, True, True, True]
    assert verdict(_as_gpu(cpu_result, "1b", False, speedup=1.3)) == [True, True, False, True]
    assert verdict(_as_gpu(cpu_result, "1b", False, mfu=0.45)) == [True, True, True, False]
    assert verdict(_as_gpu(cpu_result, "1b", False, curve=0.03)) == [True, False, True, True]
    assert verdict(_as_gpu(cpu_result, "8b", True)) == [True, True, True, True]
    assert verdict(_as_gpu(cpu_result, "8b", True, ckpt=False)) == [True, True, True, False]  # 80 GB: must checkpoint
    assert verdict(_as_gpu(cpu_result, "8b", True, name="NVIDIA H200", mem=139.8 * GIB, ckpt=False)) == [
        True, True, True]
    mi300 = bm.check_targets(_as_gpu(cpu_result, "1b", False, name="AMD Instinct MI300X", mfu=0.3))
    assert mi300[-1]["passed"] is None and "H100/H200" in mi300[-1]["value"]  # not applied unchanged
    failing = tmp_path / "failing.json"
    failing.write_text(json.dumps(_as_gpu(cpu_result, "1b", False, speedup=1.2)))
    with pytest.raises(SystemExit) as stop:
        bm.main(["--from-json", str(failing), "--check-targets"])
    assert stop.value.code == 1


def test_the_table_says_which_cards_peak_mfu_was_measured_against(cpu_result, tmp_path, capsys):
    """An H100 PCIe's MFU is against its own 756 TFLOP/s, not the SXM's 989, and the header says so and why."""
    from course_lib.throughput import peak_for_name

    assert "no bf16 peak known for CPU" in bm.format_table(cpu_result)  # a CPU claims no peak
    for name, card, figure in (("NVIDIA H100 PCIe", "H100 PCIe", "756 TFLOP/s"),
                               ("NVIDIA H100 80GB HBM3", "H100 SXM", "989 TFLOP/s"),
                               ("AMD Instinct MI300X", "MI300X", "1,307 TFLOP/s")):
        peak = peak_for_name(name)
        res = _as_gpu(cpu_result, "1b", False, name=name)
        res["shape"].update(peak_flops=peak.flops, peak_card=peak.card, peak_reason=peak.reason)
        path = tmp_path / f"{card}.json"
        path.write_text(json.dumps(res))
        bm.main(["--from-json", str(path)])  # what the CLI prints for a saved GPU result
        header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("MFU:"))
        assert f"against {figure} dense bf16 ({card}: " in header and f"'{name}'" in header, header
