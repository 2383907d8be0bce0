"""The workshop host's preflight, run for real on this machine: `python -m course_lib.apps.preflight`.

On a CPU machine its CPU rows run (versions, attention kernels, FP8 matmul, bitsandbytes, two gloo ranks,
DeepSpeed's CPU ops) and its GPU rows say "no GPU"; a needed path that fails makes it exit 1. The version
floors' comparison, which vendor pre-release torch builds make subtle, is tested as the pure function it is.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from course_lib.apps import preflight

ROOT = Path(__file__).resolve().parent.parent
TORCHAO_FOR_TESTS = ROOT / ".venv" / "torchao-for-tests"  # where `make test` puts torchao (pyproject.toml says why)
CPU_ROWS = ["version: python", "version: torch", "version: transformers", "version: accelerate", "version: deepspeed",
            "transformers sees torch", "attention: course_sdpa fp32 on cpu",
            "attention: course_sdpa fp32 + document mask on cpu",
            "attention: course_sdpa bf16 on cpu", "attention: course_sdpa bf16 + document mask on cpu",
            "collectives: gloo, 2 CPU ranks", "DeepSpeed ops for CPU ranks (comm op, CPU Adam)"]
GPU_ROWS = ["GPUs", "GPU stack", "collectives: nccl, GPU ranks", "DeepSpeed ops for GPU ranks (CPU Adam)",
            "DeepSpeed ops for GPU ranks (fused Adam)", "context parallelism: torch's, one GPU step",
            "GPU allocator: reserve, cache, release"]
OPTIONAL_ROWS = ["FP8 matmul: torch._scaled_mm float8_e4m3fn on cpu", "FP8 training: torchao on cpu",
                 "4-bit: bitsandbytes NF4 matmul on cpu"]
cpu_only = pytest.mark.skipif(torch.cuda.is_available(),
                              reason="this machine has GPUs: these rows are the CPU machine's")


def run_preflight(tmp_path: Path, *args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    """`python -m course_lib.apps.preflight --json ... *args`: the finished process and its rows by check."""
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, "-m", "course_lib.apps.preflight", "--json", str(out), *args], cwd=ROOT,
                          env=env or dict(os.environ), capture_output=True, text=True, timeout=600)
    rows = {r["check"]: r for r in json.loads(out.read_text())} if out.exists() else {}
    return proc, rows


@cpu_only
def test_on_a_cpu_machine_the_cpu_rows_pass_and_the_gpu_rows_say_no_gpu(tmp_path):
    env = dict(os.environ)
    with_torchao = importlib.util.find_spec("torchao") is not None or (TORCHAO_FOR_TESTS / "torchao").is_dir()
    if importlib.util.find_spec("torchao") is None and with_torchao:  # torchao's real op runs too
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TORCHAO_FOR_TESTS), env.get("PYTHONPATH")]))
    proc, rows = run_preflight(tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert set(rows) == set(CPU_ROWS + GPU_ROWS + OPTIONAL_ROWS + ["NUMA auto-balancing"]), sorted(rows)
    assert {r["status"] for r in rows.values()} <= set(preflight.STATUSES)
    not_passed = {c: rows[c]["detail"] for c in CPU_ROWS if rows[c]["status"] != "pass"}
    assert not not_passed, not_passed
    assert {c: rows[c]["status"] for c in GPU_ROWS} == {c: "no GPU" for c in GPU_ROWS}
    assert all("math" not in rows[c]["detail"] for c in CPU_ROWS if c.startswith("attention"))
    # the optional packages: each ran one real op here, or is reported absent with how to install it
    assert rows["4-bit: bitsandbytes NF4 matmul on cpu"]["status"] == (
        "pass" if importlib.util.find_spec("bitsandbytes") else "absent")
    assert rows["FP8 training: torchao on cpu"]["status"] == ("pass" if with_torchao else "absent"), rows
    assert all(r["fix"] for r in rows.values() if r["status"] == "absent")
    # one markdown table on stdout, with the verdict after it
    assert "| check" in proc.stdout and "every path the course needs works here" in proc.stdout


def test_a_floor_above_the_installed_version_fails_the_preflight(tmp_path):
    proc, rows = run_preflight(tmp_path, "--quick", "--floor", "torch>=99")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert rows["version: torch"]["status"] == "FAIL" and ">=99" in rows["version: torch"]["detail"]
    assert "never pip-install torch" in rows["version: torch"]["fix"]
    assert [c for c, r in rows.items() if r["status"] == "FAIL"] == ["version: torch"]
    assert "FAIL" in proc.stdout and "fix them before class" in proc.stdout
    # and the same floor at the installed version passes (--floor replaces the course's own)
    ok, rows = run_preflight(tmp_path, "--quick", "--floor", f"torch>={torch.__version__.split('+')[0]}")
    assert ok.returncode == 0 and rows["version: torch"]["status"] == "pass", ok.stdout[-3000:]


@pytest.mark.parametrize("installed, specifier, ok", [
    ("2.6.0a0", ">=2.7", False),                        # NGC 25.01's torch is below a 2.7 floor
    ("2.6.0a0+ecf3bae40a.nv25.01", ">=2.7", False),
    ("2.7.0a0+git79aa17489c", ">=2.7", True),            # rocm/pytorch-training v25.3's torch meets 2.7
    ("2.7.0a0", ">=2.7.0", True),
    ("2.7.0", ">=2.7", True),
    ("2.7.1+rocm6.3", ">=2.7", True),
    ("2.13.0+cpu", ">=2.7", True),
    ("2.6.0", ">=2.7", False),
    ("2.8.0.dev20250601+cu128", ">=2.7", True),
    ("0.9.4", ">=0.9.3,<0.10", True),
    ("0.10.0rc1", ">=0.9.3,<0.10", False),
    ("3.10.12", ">=3.10", True),
    ("3.9.18", ">=3.10", False),
    ("2.6.0a0", ">=2.7.0a0", False),                    # the floor as pyproject.toml writes it, for pip's sake
    ("2.7.0a0+git637433", ">=2.7.0a0", True),
    ("2.13.0+cpu", ">=2.7.0a0", True),
    ("4.0", "", True),                                  # no floor declared
])
def test_a_pre_release_counts_as_its_release_against_a_floor(installed, specifier, ok):
    assert preflight.meets(installed, specifier) is ok


def test_packaging_alone_puts_the_vendor_pre_release_below_its_release():
    """Why ``meets`` exists: a strict comparison refuses AMD's 2.7.0a0 for a 2.7 floor; the note says so."""
    assert not SpecifierSet(">=2.7").contains("2.7.0a0", prereleases=True)
    assert "pre-release of 2.7.0" in preflight.prerelease_note("2.7.0a0+git79aa17489c")
    assert preflight.prerelease_note("2.7.0+rocm6.3") == ""


def test_floor_arguments_are_requirements_or_a_clear_error():
    assert preflight.parse_floor("torch>=2.9") == ("torch", ">=2.9")
    assert preflight.parse_floor("DeepSpeed>=0.16") == ("deepspeed", ">=0.16")
    for bad in ("torch", "torch>>2", ">=2.7"):
        with pytest.raises(argparse.ArgumentTypeError, match="like 'torch>=2.7'"):
            preflight.parse_floor(bad)


def test_the_floors_come_from_the_installed_course_which_is_pyproject():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {Requirement(r).name: str(Requirement(r).specifier) for r in project["dependencies"]}
    floors = preflight.course_floors()
    assert floors["python"] == project["requires-python"]
    assert floors == {"python": project["requires-python"], **{n: declared[n] for n in preflight.FLOOR_PACKAGES}}, (
        "the installed metadata differs from pyproject.toml: reinstall the course (make setup)")


def test_the_document_mask_is_causal_within_each_document_only():
    mask = preflight.document_mask(batch=2, seq=8, documents=2)[0, 0]
    assert mask.shape == (8, 8) and mask.dtype == torch.bool
    assert mask[5, 4] and mask[5, 5] and not mask[5, 6]   # causal inside the second document
    assert not mask[5, 3] and mask[3, 0]                  # the second document never sees the first


def test_a_probe_that_crashes_or_hangs_loses_only_its_own_row():
    returned, result, out = preflight.run_probe("os._exit(3)")
    assert not returned and result is None and "exited with 3" in out
    start = time.monotonic()
    returned, _, out = preflight.run_probe("time.sleep(120)", timeout=5)
    assert not returned and "timed out after 5 s" in out and time.monotonic() - start < 20


def test_ranks_that_cannot_connect_fail_the_collectives_row_with_their_error(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuch0")  # a network interface this machine lacks: gloo cannot start
    row = preflight.collective_row("cpu", 2)
    assert row.status == "FAIL" and "nosuch0" in row.detail, row
    assert "GLOO_SOCKET_IFNAME" in row.fix


@pytest.mark.parametrize("nprocs", [1, 3])
def test_the_collectives_row_runs_every_collective_the_course_runs(nprocs):
    """All-reduce, all-gather, reduce-scatter, all-to-all and (with a peer) a send/recv round the ring, each checked
    by arithmetic on every rank and timed: an odd world too, and one rank alone, as one GPU is."""
    row = preflight.collective_row("cpu", nprocs)
    assert row.status == "pass", row
    ran = ["all-reduce", "all-gather", "reduce-scatter", "all-to-all"] + (["send-recv"] if nprocs > 1 else [])
    assert all(f"{op} " in row.detail and " ms" in row.detail for op in ran), row.detail
    assert ("send-recv" in row.detail) == (nprocs > 1) and ("needs two ranks" in row.detail) == (nprocs == 1)


CP_HELD = {"gap": 3e-7, "zigzag": True, "seconds": 4.2}


@pytest.mark.parametrize("gate, returned, result, status", [
    (None, True, CP_HELD, "pass"),  # a CUDA machine, or ROCm with a fixed torch: it runs, and held
    (None, True, {**CP_HELD, "gap": 0.2}, "FAIL"),  # runs, but not loss for loss: notebook 16 would record a miss
    (None, False, None, "FAIL"),  # the kernel faulted with the gate open: 14 would lose its ranks
    ("torch 2.14 on ROCm 7.1: ...", False, None, "absent"),  # gated off, and the probe faulted: the gate is right
    ("torch 2.14 on ROCm 7.1: ...", True, CP_HELD, "pass"),  # gated off, yet it ran here: the row says how to open it
])
def test_the_context_parallel_row_reads_the_gate_and_the_one_gpu_step(gate, returned, result, status):
    row = preflight.cp_row(gate, returned, result, "Memory access fault by GPU node-2")
    assert row.status == status, row
    assert ("Memory access fault" in row.detail) == (not returned)
    assert (preflight.cp_torch.ROCM_CP_ENV in row.fix) == (gate is not None and status == "pass")
    assert status == "pass" and gate is None or row.fix, row


@pytest.mark.parametrize("returned_mib, status", [(0, "pass"), (256, "FAIL")])
def test_the_allocator_row_passes_when_freed_blocks_are_cached_then_released(returned_mib, status):
    mib = 1 << 20
    got = {"allocated": 256 * mib, "reserved": 256 * mib, "cached_after_free": 256 * mib,
           "returned": returned_mib * mib, "allocate_ms": 0.3, "empty_cache_ms": 0.1,
           "conf": "PYTORCH_CUDA_ALLOC_CONF='expandable_segments:True'"}
    row = preflight.allocator_row(got)
    assert row.status == status and "expandable_segments" in row.detail, row
