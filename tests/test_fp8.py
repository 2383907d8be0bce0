"""course_lib.fp8: the formats' facts, per-tensor and delayed scaling against torch's own float8 casts;
course_lib.fp8_compute: the FP8 matmul (torch._scaled_mm where it runs) against its float32 emulation, the GPU
path's refusals on a CPU, and torchao's float8 training, which runs on a CPU too."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from recorded import ROOT
from course_lib import fp8, fp8_compute

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def torch_cast(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """The independent reference: torch's cast of x·scale, clamped to the format's max first."""
    fmax = torch.finfo(dtype).max
    return (x * scale).clamp(-fmax, fmax).to(dtype)


def test_format_facts_are_the_formats_bits():
    rows = {r["type"]: r for r in fp8.format_table()}
    e4, e5 = rows["fp8 e4m3"], rows["fp8 e5m2"]
    assert (e4["exponent bits"], e4["mantissa bits"], e4["max"]) == (4, 3, 448.0)
    assert (e5["exponent bits"], e5["mantissa bits"], e5["max"]) == (5, 2, 57344.0)
    assert e4["smallest normal"] == 2.0**-6 and e4["smallest subnormal"] == 2.0**-9
    assert e5["smallest normal"] == 2.0**-14 and e5["smallest subnormal"] == 2.0**-16
    assert (rows["fp16"]["mantissa bits"], rows["bf16"]["mantissa bits"], rows["fp32"]["mantissa bits"]) == (10, 7, 23)
    assert rows["bf16"]["exponent bits"] == rows["fp32"]["exponent bits"] == 8
    # the smallest subnormal is representable and half of it rounds (to even) to zero, in every format
    for name, dt in fp8.TABLE_DTYPES.items():
        tiny = rows[name]["smallest subnormal"]
        assert torch.tensor(tiny).to(dt).float().item() == tiny and torch.tensor(tiny / 2).to(dt).float().item() == 0.0


def test_the_table_reads_max_from_finfo_and_measures_the_fnuz_formats():
    rows = {r["type"]: r for r in fp8.format_table()}
    assert {name: r["max"] for name, r in rows.items()} == {n: float(torch.finfo(dt).max)
                                                            for n, dt in fp8.TABLE_DTYPES.items()}
    e4, e5 = rows["fp8 e4m3fnuz"], rows["fp8 e5m2fnuz"]
    assert (e4["max"], e4["smallest normal"], e4["smallest subnormal"]) == (240.0, 2.0**-7, 2.0**-10)
    assert (e5["max"], e5["smallest normal"], e5["smallest subnormal"]) == (57344.0, 2.0**-15, 2.0**-17)
    assert (e4["mantissa bits"], e5["mantissa bits"]) == (3, 2)  # measured: torch's finfo gives e5m2fnuz eps 0.125
    for r in (e4, e5):  # "fnuz": one NaN (the pattern -0 would have), no inf, no negative zero
        assert (r["NaN patterns"], r["inf"], r["-0"], r["cast of 2*max"]) == (1, False, False, "nan")
    assert (rows["fp8 e4m3"]["NaN patterns"], rows["fp8 e4m3"]["inf"], rows["fp8 e4m3"]["-0"]) == (2, False, True)
    assert (rows["fp8 e5m2"]["NaN patterns"], rows["fp8 e5m2"]["inf"]) == (6, True)
    assert (rows["fp16"]["NaN patterns"], rows["bf16"]["NaN patterns"], rows["fp32"]["NaN patterns"]) == \
        (2046, 254, 2**24 - 2)
    assert math.isnan(torch.tensor(480.0).to(torch.float8_e4m3fnuz).float())  # why clamping first is mandatory there
    assert fp8.quantize(torch.tensor([480.0, -1e6]), 1.0, torch.float8_e4m3fnuz).float().tolist() == [240.0, -240.0]


def test_step_after_one_is_measured_by_casting():
    assert [fp8.step_after_one(dt) for dt in (torch.float32, torch.float16, torch.bfloat16, E4M3, E5M2)] == \
        [2.0**-23, 2.0**-10, 2.0**-7, 2.0**-3, 2.0**-2]
    assert fp8.step_after_one(torch.float8_e5m2fnuz) == 0.25
    assert torch.tensor(1.125).to(torch.float8_e5m2fnuz).float() == 1.0  # 1 + 2^-3 is not an e5m2fnuz value


def test_flushed_fraction_counts_what_the_cast_stores():
    # e4m3fn: 2^-6 the smallest normal, 2^-7 and 2^-9 subnormal, 2^-10 half the smallest subnormal: ties to even, 0;
    # just above 2^-10 rounds up to 2^-9; 1.0 normal; 500 past 464 saturates at 448
    x = torch.tensor([2.0**-6, 2.0**-7, 2.0**-9, 2.0**-10, 2.0**-10 * 1.01, 1.0, 500.0])
    assert fp8.quantize(x, 1.0, E4M3).float().tolist() == [2.0**-6, 2.0**-7, 2.0**-9, 0.0, 2.0**-9, 1.0, 448.0]
    assert fp8.flushed_fraction(x, E4M3) == {"zero": 1 / 7, "subnormal": 3 / 7, "saturated": 1 / 7}
    # e4m3fnuz's exponent bias is one higher: 2^-7 is normal there, 2^-10 its smallest subnormal
    assert fp8.flushed_fraction(x, torch.float8_e4m3fnuz) == {"zero": 0.0, "subnormal": 3 / 7, "saturated": 1 / 7}
    assert fp8.flushed_fraction(torch.tensor([0.0, 0.02, -0.02]), E4M3) == {"zero": 0.0, "subnormal": 0.0,
                                                                           "saturated": 0.0}


def test_about_half_of_normal_weights_of_std_002_are_subnormal_in_e4m3():
    w = torch.randn(2**20, generator=torch.Generator().manual_seed(0)) * 0.02
    fate = fp8.flushed_fraction(w, E4M3)
    # N(0, 0.02): |w| up to 2^-10 rounds to 0; up to 2^-6 minus half a subnormal step (2^-10) stays subnormal
    p = lambda t: math.erf(t / 0.02 / math.sqrt(2))  # noqa: E731 (P(|w| < t))
    assert fate["zero"] == pytest.approx(p(2.0**-10), abs=0.002) and 0.035 < fate["zero"] < 0.045
    assert fate["subnormal"] == pytest.approx(p(2.0**-6 - 2.0**-10) - p(2.0**-10), abs=0.003)
    assert 0.45 < fate["subnormal"] < 0.55


def test_what_a_cast_past_max_gives_is_what_torch_does():
    assert fp8.cast_past_max(E5M2) == {"2*max": math.inf, "inf": math.inf}
    assert fp8.overflow_threshold(E4M3) == 464.0 and fp8.overflow_threshold(E5M2) == 61440.0
    for dt in (E4M3, E5M2):  # just below the threshold a value rounds down to max like any other
        assert torch.tensor(fp8.overflow_threshold(dt) * (1 - 1e-6)).to(dt).float() == torch.finfo(dt).max
    assert torch.tensor(fp8.overflow_threshold(E5M2)).to(E5M2).float() == math.inf  # at it, e5m2 overflows
    past = fp8.cast_past_max(E4M3)["2*max"]  # e4m3fn has no inf: torch saturates (2.13) or gives nan (older)
    assert past == 448.0 or math.isnan(past)
    assert fp8.format_facts(E4M3)["cast of 2*max"] == ("saturates to 448" if past == 448.0 else "nan")
    assert fp8.format_facts(E5M2)["cast of 2*max"] == "inf"


def test_round_trip_shows_what_flushes_and_what_saturates():
    rows = {r["value"]: r for r in fp8.round_trip([2.0**-10, 2.0**-9, 1e5, 1.0 + 2.0**-4])}
    assert rows[2.0**-10]["fp8 e4m3"] == 0.0 and rows[2.0**-10]["fp8 e5m2"] == 2.0**-10
    assert rows[2.0**-9]["fp8 e4m3"] == 2.0**-9
    assert rows[1e5]["fp8 e5m2"] == math.inf and rows[1e5]["fp16"] == math.inf and rows[1e5]["bf16"] > 9e4
    assert rows[1.0 + 2.0**-4]["fp8 e4m3"] == 1.0  # halfway to 1 + 2^-3 rounds to even


def test_quantize_clamps_then_casts_and_dequantize_undoes_the_scale():
    x = torch.tensor([0.5, -3.0, 1000.0, -1e6, 2.0**-12])
    for dt in (E4M3, E5M2):
        fmax = torch.finfo(dt).max
        q = fp8.quantize(x, 4.0, dt)
        assert q.dtype == dt and torch.isfinite(q.float()).all(), "saturate, never inf or nan"
        assert torch.equal(q.float(), torch_cast(x, 4.0, dt).float())
        assert q.float().abs().max().item() == fmax
        assert torch.equal(fp8.dequantize(q, 4.0), q.float() / 4.0)
    assert fp8.quantize(x, 4.0, E4M3).float()[0].item() == 2.0  # exact values stay exact
    with pytest.raises(ValueError, match="not an FP8 dtype"):
        fp8.quantize(x, 1.0, torch.float16)


def test_scale_for_maps_amax_to_max_and_keeps_the_old_scale_on_zero_or_inf():
    assert fp8.scale_for(4.0, E4M3) == 112.0 and fp8.scale_for(4.0, E5M2) == 14336.0
    assert fp8.scale_for(4.0, E4M3, margin=2) == 28.0
    assert fp8.scale_for(0.0, E4M3, fallback=3.0) == 3.0 and fp8.scale_for(math.inf, E4M3) == 1.0


def test_delayed_scaler_takes_its_scale_from_the_previous_amaxes():
    torch.manual_seed(0)
    stream = [torch.randn(32, 32) * m for m in (4.0, 1.0, 0.25, 16.0, 2.0, 0.0, 1.0)]
    for dt, hist, margin in ((E4M3, 2, 0), (E5M2, 3, 1), (E4M3, 1, 0)):
        mine, fmax = fp8.DelayedScaler(dt, history_len=hist, margin=margin), torch.finfo(dt).max
        amaxes, scale = [], 1.0
        for x in stream:
            q, used = mine(x)
            assert used == scale, "the scale of a step comes from earlier steps only (1.0 at the first)"
            assert torch.equal(q.float(), torch_cast(x, scale, dt).float())
            assert torch.isfinite(q.float()).all()
            amaxes = (amaxes + [x.abs().max().item()])[-hist:]
            if max(amaxes) > 0:
                scale = fmax / max(amaxes) / 2**margin
            assert mine.amax_history == amaxes and mine.scale == pytest.approx(scale, rel=1e-12)
    with pytest.raises(ValueError, match="history_len"):
        fp8.DelayedScaler(E4M3, history_len=0)


def test_delayed_scaling_saturates_on_an_amax_jump_where_current_scaling_does_not():
    stream = fp8.drifting_stream(12, 32, spike_at=6)
    delayed = fp8.scaling_trace(fp8.DelayedScaler(E4M3, history_len=4), stream, E4M3)
    current = fp8.scaling_trace(fp8.current_scaler(E4M3), stream, E4M3)
    assert delayed["saturated"][6] > 0.3 and delayed["error"][6] > 10 * current["error"][6]
    assert max(current["saturated"]) == 0 and current["fill"] == pytest.approx([1.0] * 12)
    assert all(delayed["finite"]) and all(current["finite"])
    assert delayed["scale"][0] == 1.0 and delayed["fill"][7] < 0.5, "after the spike the history keeps the scale low"


def test_fp8_matmul_kernel_and_emulation_agree():
    torch.manual_seed(0)
    a, b = torch.randn(64, 48), torch.randn(48, 32) * 0.02
    res = fp8_compute.fp8_matmul(a, b)
    assert res.path == (fp8_compute.SCALED_MM if fp8_compute.scaled_mm_runs("cpu", E4M3, E4M3) is None
                        else fp8_compute.EMULATED)
    sa, sb = 448 / a.abs().max().item(), 448 / b.abs().max().item()
    emulated = (torch_cast(a, sa, E4M3).float() / sa) @ (torch_cast(b, sb, E4M3).float() / sb)
    assert torch.allclose(res.out, emulated, rtol=1e-4, atol=1e-6)
    odd = fp8_compute.fp8_matmul(a[:, :40], b[:40])  # 40 is no multiple of 16: _scaled_mm is not asked
    assert odd.path == fp8_compute.EMULATED and fp8.relative_error(odd.out, a[:, :40] @ b[:40]) < 0.1
    with pytest.raises(ValueError, match="matrices"):
        fp8_compute.fp8_matmul(a, a)


def test_a_pair_of_formats_the_kernel_refuses_falls_back_to_emulation(monkeypatch):
    """An H200 under torch 2.11 refused e5m2 x e5m2 with a ValueError (not a RuntimeError), which escaped the
    probe and stopped notebook 02's magnitude sweep. Here the CPU kernel is made to refuse that pair the same way."""
    real = torch._scaled_mm

    def refuses_e5m2_pairs(a, b, **kw):
        if a.dtype == b.dtype == torch.float8_e5m2:
            raise ValueError("Multiplication of two Float8_e5m2 matrices is not supported")
        return real(a, b, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", refuses_e5m2_pairs)
    fp8_compute.scaled_mm_runs.cache_clear()
    try:
        why = fp8_compute.scaled_mm_runs("cpu", torch.float8_e5m2, torch.float8_e5m2)
        assert why == "ValueError: Multiplication of two Float8_e5m2 matrices is not supported"
        torch.manual_seed(0)
        a, b = torch.randn(64, 48), torch.randn(48, 32) * 0.02
        res = fp8_compute.fp8_matmul(a, b, torch.float8_e5m2)
        assert res.path == fp8_compute.EMULATED and fp8.relative_error(res.out, a @ b) < 0.1
        sweep = fp8_compute.magnitude_sweep(a, b, [-4, 0, 4])  # every format of the sweep, e5m2 x e5m2 among them
        assert all(len(errs) == 3 and all(e == e for e in errs) for errs in sweep.values())
    finally:
        fp8_compute.scaled_mm_runs.cache_clear()  # the next test asks the real kernel again


def test_matmul_errors_order_the_formats_by_their_mantissa():
    x, w = fp8_compute.outlier_operands(128)
    err = {k: v["error"] for k, v in fp8_compute.matmul_errors(x, w).items()}
    assert err["fp16"] < err["bf16"] < 0.01 < err["e4m3_scaled"] < err["e5m2_e4m3_scaled"] < 0.1
    assert err["e4m3_unscaled"] > err["e4m3_scaled"]
    low = fp8.flushed_fraction(w, E4M3)
    assert low["zero"] > 0.01 and low["subnormal"] > 0.3, "weights of std 0.02 sit at e4m3's bottom without a scale"
    assert fp8.flushed_fraction(w, E4M3, fp8.scale_for(fp8.amax(w), E4M3))["zero"] == 0.0


def test_magnitude_sweep_unscaled_fp8_fails_at_both_ends_scaled_does_not():
    x, w = fp8_compute.outlier_operands(64)
    sweep = fp8_compute.magnitude_sweep(x, w, [-20, -6, 12])
    assert sweep["e4m3, no scaling"][0] > 0.9 and sweep["e4m3, no scaling"][2] > 0.9  # flushed; saturated
    assert sweep["e4m3, no scaling"][1] < 0.1
    assert max(sweep["e4m3, per-tensor scale"]) < 1.01 * min(sweep["e4m3, per-tensor scale"])
    assert max(sweep["bf16"]) < 0.01


def test_matmul_speed_says_which_kernel_ran():
    out = fp8_compute.matmul_speed(32, "cpu", repeat=1)
    assert out["bf16_s"] > 0 and out["fp8_s"] > 0
    assert out["path"] == fp8_compute.SCALED_MM or out["path"].startswith(fp8_compute.EMULATED)


def test_gpu_training_path_refuses_a_cpu_with_what_it_needs():
    why = fp8_compute.fp8_training_support("cpu")
    assert "H100" in why and "MI300X" in why
    with pytest.raises(RuntimeError, match="H100"):
        fp8_compute.compare_training("tiny", steps=4, batch=1, seq=16, device="cpu")
    with pytest.raises(ValueError, match="warmup"):
        fp8_compute.train_llama("tiny", fp8=False, steps=2, batch=1, seq=16, device="cpu")


def test_without_torchao_the_error_names_the_install(monkeypatch):
    # what a machine without torchao sees: the import fails (both names: a test before may have imported torchao.float8)
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ImportError, match="pip install torchao"):
        fp8_compute.convert_to_fp8_training(torch.nn.Linear(16, 16))



@pytest.mark.parametrize("arch,formats", [
    ("gfx942", (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)),  # MI300X, MI325X: CDNA 3 computes in fnuz
    ("gfx942:sramecc+:xnack-", (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)),  # gcnArchName as ROCm reports it
    ("gfx950", (E4M3, E5M2)),  # MI350X/MI355X: OCP's formats, as NVIDIA's
    ("sm_90", (E4M3, E5M2)),
    ("sm_89", (E4M3, E5M2)),
    ("cpu", (E4M3, E5M2)),
])
def test_the_fp8_formats_are_the_ones_the_architecture_computes_in(arch, formats):
    assert fp8.fp8_formats(arch) == formats
    if "gfx942" in arch:
        assert fp8.fp8_max(formats[0]) == 240.0  # e4m3fnuz: a scale must map amax to 240 there, not 448


def test_this_machines_formats_and_architecture():
    assert fp8.device_arch("cpu") == "cpu" and fp8.device_fp8_dtypes("cpu") == (E4M3, E5M2)
    if torch.cuda.is_available():
        assert fp8.device_fp8_dtypes("cuda") == fp8.fp8_formats(fp8.device_arch("cuda"))


def test_the_matmul_errors_run_in_the_formats_an_mi300x_computes_in():
    """On an MI300X the OCP e4m3fn operands are refused by its FP8 GEMM: the products would only be emulated. In
    its own fnuz formats (here emulated on the CPU, the same numbers) the table names them and the errors keep
    their order: e4m3fnuz has e4m3fn's 3 mantissa bits."""
    x, w = fp8_compute.outlier_operands(128)
    mi300 = fp8_compute.matmul_errors(x, w, formats=fp8.fp8_formats("gfx942"))
    assert mi300["e4m3_scaled"]["format"] == "e4m3fnuz × e4m3fnuz, per-tensor scales"
    assert mi300["e5m2_e4m3_scaled"]["format"] == "e5m2fnuz × e4m3fnuz, per-tensor scales"
    ocp = fp8_compute.matmul_errors(x, w)  # this CPU's default: OCP's formats, labelled as the notebook names them
    assert ocp["e4m3_scaled"]["format"] == "e4m3 × e4m3, per-tensor scales"
    err = {k: v["error"] for k, v in mi300.items()}
    assert 0.01 < err["e4m3_scaled"] < err["e5m2_e4m3_scaled"] < 0.1 and err["e4m3_unscaled"] > err["e4m3_scaled"]
    assert err["e4m3_scaled"] == pytest.approx(ocp["e4m3_scaled"]["error"], rel=0.3)


@pytest.mark.parametrize("arch,ok", [("sm_90", True), ("sm_89", True), ("sm_100", True), ("sm_120", True),
                                     ("sm_80", False), ("sm_86", False), ("gfx942", True), ("gfx950", True),
                                     ("gfx90a", False), ("gfx1100", False), ("cpu", False), ("", False)])
def test_which_architectures_have_fp8_matrix_units(arch, ok):
    why = fp8_compute.fp8_hardware_error(arch)
    assert (why is None) == ok, why
    if not ok:
        assert "FP8 training needs" in why


def test_torchao_is_chosen_for_training_only_after_one_real_step():
    """FP8 training chose torchao as soon as it was installed; now its probe runs one converted linear forward and
    backward first. In this process torchao is absent (it lives beside the venv): the probe names the install,
    and so does the decision for an FP8 GPU (the subprocess below runs the probe with torchao present)."""
    why = fp8_compute.torchao_fp8_runs("cpu")
    if importlib.util.find_spec("torchao") is None:
        assert "pip install torchao" in why
        assert "pip install torchao" in fp8_compute.fp8_training_support_for("sm_90", "cuda", "NVIDIA H100 80GB HBM3")
    else:
        assert why is None, why
    # an architecture without FP8 units is refused without a probe
    assert "not 8.0" in fp8_compute.fp8_training_support_for("sm_80", "cuda", "NVIDIA A100-SXM4-80GB")

# Notebook 02's GPU path, torchao's float8 training, run on this CPU in a process of its own with the torchao that
# `make test` installs beside the venv (pyproject.toml says why not in it), or the one installed where it can be
# imported (an FP8 GPU machine): the linears but the head become Float8Linear, and training tracks bf16 autocast
# closely without equalling it (the forward really is quantised). Speed and memory need an FP8 GPU.
TORCHAO_FOR_TESTS = ROOT / ".venv" / "torchao-for-tests"
FP8_RUN = """
import json
from course_lib import fp8_compute
from course_lib.models import build_llama
model = fp8_compute.convert_to_fp8_training(build_llama("tiny"))
kinds = sorted({type(m).__name__ for name, m in model.named_modules() if name.endswith("_proj")})
kw = dict(steps=6, batch=2, seq=32, device="cpu", compile=False, warmup=1)
runs = {k: fp8_compute.train_llama("tiny", fp8=k == "fp8", **kw) for k in ("bf16", "fp8")}
import torch
probe = {"cpu": fp8_compute.torchao_fp8_runs("cpu"),  # torchao's float8 training runs here: the probe says so
         # a GPU-class architecture whose device this torch cannot reach: torchao imports, and cannot run there
         "h100": None if torch.cuda.is_available() else fp8_compute.fp8_training_support_for("sm_90", "cuda", "H100")}
print(json.dumps({"kinds": kinds, "head": type(model.lm_head).__name__, "probe": probe,
                  **{k: run["losses"] for k, run in runs.items()}, "fp8_tokens_per_s": runs["fp8"]["tokens_per_s"]}))
"""


def torchao_env() -> dict:
    """This process's environment, with torchao importable: installed, or `make test`'s copy on PYTHONPATH."""
    env = dict(os.environ)
    if importlib.util.find_spec("torchao") is None:
        assert (TORCHAO_FOR_TESTS / "torchao").is_dir(), (
            f"torchao is neither installed nor in {TORCHAO_FOR_TESTS}: `make test` puts it there "
            f"(make {TORCHAO_FOR_TESTS.relative_to(ROOT)}/.installed)")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TORCHAO_FOR_TESTS), env.get("PYTHONPATH")]))
    return env


def test_torchao_converts_the_llama_but_its_head_and_trains_like_bf16():
    proc = subprocess.run([sys.executable, "-c", FP8_RUN], env=torchao_env(), cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["kinds"] == ["Float8Linear"] and out["head"] == "Linear", out
    assert out["probe"]["cpu"] is None, out["probe"]
    if out["probe"]["h100"] is not None:  # (None where the subprocess has a GPU)
        assert "torchao imports but its float8 training does not run on cuda" in out["probe"]["h100"], out["probe"]
    bf16, f8 = out["bf16"], out["fp8"]
    assert all(math.isfinite(v) for v in bf16 + f8) and out["fp8_tokens_per_s"] > 0
    assert bf16[0] != f8[0]  # same weights, same batch: only the FP8 casts of the forward tell them apart
    assert max(abs(a - b) / a for a, b in zip(bf16, f8)) < 1e-2, (bf16, f8)


QUIET_RUN = """
import sys
from course_lib import fp8_compute
from course_lib.models import build_llama, empty_llama
empty_llama("tiny")
fp8_compute.convert_to_fp8_training(build_llama("tiny"))
print("torchao" in sys.modules)
"""


def test_building_a_llama_where_torchao_is_installed_writes_nothing_to_stderr():
    """transformers imports torchao (the workshop images install it) when it builds its first model, and torchao's
    import logs the CUDA kernels a CPU build of torch cannot load and a deprecation inside torch: lines that would
    reach every notebook's output, which nbgrader's Validate reports. Building a Llama and converting it to FP8
    training imports torchao and writes nothing there."""
    proc = subprocess.run([sys.executable, "-c", QUIET_RUN], env=torchao_env(), cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["True"], f"torchao was not imported, so this shows nothing: {proc.stdout}"
    assert proc.stderr == "", proc.stderr[-2000:]
