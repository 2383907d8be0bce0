"""course_lib.apps.size_sweep: the prediction of the largest model per strategy, the search (out-of-memory caught and
freed, other errors not), and real trials: a tiny Llama's step timed, DeepSpeed's offload engines with its CPU Adam.

The sweep itself needs a GPU (notebook 10 runs it there); here everything around it runs on the CPU.
"""

import gc
import weakref

import pytest
import torch

from course_lib.apps import size_sweep
from course_lib.launch import launch
from course_lib.models import llama_num_parameters


def test_prediction_grows_with_memory_and_names_what_stops_it():
    plain = [size_sweep.predict_largest("pytorch", m, 2**40)["n_params"] for m in (16e9, 32e9, 80e9, 192e9)]
    assert plain == sorted(plain) and plain[0] < plain[-1]
    host_bound = size_sweep.predict_largest("zero3_offload", 192e9, 64 * 2**30, checkpointing=True)
    assert host_bound["limited by"] == "CPU" and 18 * host_bound["n_params"] < 0.8 * 64 * 2**30
    assert size_sweep.predict_largest("zero3_nvme", 80e9, 2**40, 0)["n_params"] == 0  # no NVMe space: nothing fits
    offload, plain = (size_sweep.predict_largest(s, 32e9, 2**40)["n_params"] for s in ("zero2_offload", "pytorch"))
    assert offload > 4 * plain


def _fake_trial(max_params, max_tokens):
    """A trial that 'runs out of memory' like a GPU would: above a model size, or above a batch at that size."""
    def trial(shape, micro_batch):
        n = llama_num_parameters(size_sweep.sweep_config(*shape))
        if n > max_params or n * micro_batch > max_tokens:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {n * micro_batch} bytes")
        return {"n_params": n, "tokens_per_s": 100.0 * micro_batch}
    return trial


def test_search_grows_the_model_then_the_batch_and_stops_at_the_first_oom():
    shapes = size_sweep.SWEEP_SHAPES[:6]
    n = [llama_num_parameters(size_sweep.sweep_config(*s)) for s in shapes]
    found = size_sweep.search_largest(_fake_trial(n[3], 4 * n[3]), shapes, [1, 2, 4, 8], batch_shapes=[shapes[1]])
    assert found["largest"]["shape"] == shapes[3] and found["largest"]["micro_batch"] == 4
    tried = [(r["shape"], r["micro_batch"], r["fits"]) for r in found["rows"]]
    assert tried[:5] == [(s, 1, i < 4) for i, s in enumerate(shapes[:5])]  # stops growing at the first OOM
    assert (shapes[1], 8, True) in tried  # the batch of a smaller shape grows further
    assert (shapes[3], 8, False) in tried and "CUDA out of memory" in found["rows"][4]["error"]
    assert {r["shape"] for r in found["best_by_shape"].values()} == {shapes[1], shapes[3]}
    none = size_sweep.search_largest(_fake_trial(0, 0), shapes, [1, 2])
    assert none["largest"] is None and len(none["rows"]) == 1
    with pytest.raises(ValueError, match="batches ascending"):
        size_sweep.search_largest(_fake_trial(0, 0), shapes, [2, 1])


def test_out_of_memory_is_caught_and_its_memory_freed_but_other_errors_are_not():
    alive = []

    def trial(shape, micro_batch):
        held = {"activations": torch.empty(1 << 20)}
        held["self"] = held  # a reference cycle, as engines and tracebacks make: only gc frees it
        alive.append(weakref.ref(held["activations"]))
        raise torch.OutOfMemoryError("CUDA out of memory")

    gc.disable()  # the search itself must collect: no automatic collection in between
    try:
        row = size_sweep.attempt(trial, (1024, 16), 1)
        assert row["fits"] is False and alive[0]() is None
    finally:
        gc.enable()
    assert size_sweep.attempt(lambda s, m: (_ for _ in ()).throw(RuntimeError("CUDA error: out of memory")),
                              (1, 1), 1)["fits"] is False
    with pytest.raises(ValueError, match="a real bug"):
        size_sweep.attempt(lambda s, m: (_ for _ in ()).throw(ValueError("a real bug")), (1, 1), 1)


def test_a_real_trial_measures_a_tiny_llama_and_the_search_runs_on_it():
    config = size_sweep.sweep_config(128, 2, vocab_size=512, seq_len=32)
    row = size_sweep.train_trial("pytorch", config, 2, 32, steps=1, warmup=1)
    assert row["n_params"] == llama_num_parameters(config) and row["tokens_per_s"] > 0
    assert row["tflops"] == pytest.approx(
        row["tokens_per_s"] * (6 * (row["n_params"] - 512 * 128) + 12 * 2 * 128 * 32) / 1e12)

    def trial(shape, micro_batch):  # real steps, and the GPU's limit played by a token budget
        if shape[0] * micro_batch > 256:
            raise torch.OutOfMemoryError("out of memory (token budget)")
        return size_sweep.train_trial("pytorch", size_sweep.sweep_config(*shape, vocab_size=512, seq_len=16),
                                      micro_batch, 16, steps=1)

    found = size_sweep.search_largest(trial, [(128, 1), (256, 1), (384, 1)], [1, 2, 4])
    assert found["largest"]["shape"] == (256, 1) and found["largest"]["micro_batch"] == 1
    with pytest.raises(ValueError, match="needs nvme_path"):
        size_sweep.train_trial("zero3_nvme", config, 1, 32)


def test_offload_sweep_runs_deepspeeds_real_engines_with_cpu_adam():
    for strategy in ("zero2_offload", "zero3_offload"):  # on the GPU these run unverified here: at least the code runs
        out = launch("course_lib.apps.size_sweep:sweep", 1, {"strategy": strategy, "shapes": [[128, 2]],
                                                   "micro_batches": [1], "seq_len": 16, "steps": 1,
                                                   "vocab_size": 512},
                     echo=False, timeout=300, device_type="cpu")[0]
        assert [r["fits"] for r in out["rows"]] == [True] and out["largest"]["tokens_per_s"] > 0, out
        assert out["cpu_adam"] is True and out["largest"]["optimizer"] == "DeepSpeedCPUAdam"
