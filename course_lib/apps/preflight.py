"""Preflight: is this machine ready for the course? One table, one row per path, each with its reason and fix.

    python -m course_lib.apps.preflight                  # every check: under 5 minutes on a GPU node
    python -m course_lib.apps.preflight --json rows.json # also save the rows
    python -m course_lib.apps.preflight --quick          # skip what starts processes (ranks, DeepSpeed's ops, probes)
    python -m course_lib.apps.preflight --floor 'torch>=2.9'  # judge against a floor of your own

What a workshop host runs first: on the GPU node, inside either image, or on a laptop. Every GPU path
the course uses runs once at tiny size: the GPUs and their memory; an all-reduce and an all-gather on
real ranks (one per GPU over NCCL/RCCL, and two CPU ranks over gloo, as ``course_lib.launch`` starts
them); the attention kernels ``course_sdpa`` gets in fp32 and bf16, with and without a document mask;
DeepSpeed's ops; FP8 (``torch._scaled_mm``, torchao) and bitsandbytes' 4-bit matmul; seed 001's system
checks (``device.validate_rocm``); and the versions of torch, transformers, accelerate and DeepSpeed
against the floors the installed course declares (pyproject.toml, read back from the package's metadata).

A status is one of:
- ``pass``: the path ran here;
- ``FAIL``: the course needs this path and it does not work: the exit code is 1, and the fix says what to do;
- ``absent``: an optional package is missing or cannot run here (the notebook that uses it says so and goes on);
- ``no GPU``: a GPU path on a machine without GPUs (the cpu tier runs without it);
- ``skipped``: the check does not apply here, and the detail says why.

Checks that could crash or hang the interpreter (an optional package built for another GPU stack, a JIT
build) run in processes of their own with a time limit; one check failing never hides the others.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import time
import warnings
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version
from tabulate import tabulate
from torch import nn

from course_lib import fp8, fp8_compute, qlora
from course_lib.attention import AttentionFallback, attention_kernels, course_sdpa
from course_lib.parallel.zero_deepspeed import build_deepspeed_ops
from course_lib.device import (backend_for, default_device, gpu_architecture, gpu_vendor_stack, host_memory_bytes,
                               numa_balancing, pick_tier, rccl_version, validate_rocm)
from course_lib.distributed import rank_device
from course_lib.instruct import packed_attention_mask
from course_lib.launch import CPU_ONLY_ENV, WorkerError, extensions_dir, launch, on_ranks
from course_lib.parallel import cp_cost, cp_torch

PASS, FAIL, ABSENT, NO_GPU, SKIPPED = "pass", "FAIL", "absent", "no GPU", "skipped"
STATUSES = (PASS, FAIL, ABSENT, NO_GPU, SKIPPED)
DISTRIBUTION = "scaling-pytorch-course"  # the installed course, whose metadata holds pyproject.toml's floors
FLOOR_PACKAGES = ("torch", "transformers", "accelerate", "deepspeed")
GIB = 2**30
PROBE_MARK = "PREFLIGHT-RESULT "  # the line a probe process prints its JSON result on
SETUP_FIX = "run `make setup` in the course folder (or `pip install -e .` where torch is already installed)"


@dataclass
class Row:
    """One line of the table: what was checked, its status (one of ``STATUSES``), what was seen, what to do,
    and the seconds its check took (shared among the rows one check gives)."""

    check: str
    status: str
    detail: str
    fix: str = ""
    seconds: float = 0.0


# ------------------------------------------------------------------ versions against the course's floors

def course_floors(distribution: str = DISTRIBUTION) -> dict[str, str]:
    """``{"python": ">=3.10", "torch": ">=2.7", ...}``: what the installed course declares for Python and
    ``FLOOR_PACKAGES`` (pyproject.toml's requires-python and dependencies, from the distribution's metadata).

    Raises ``importlib.metadata.PackageNotFoundError`` where the course is not installed.
    """
    floors = {"python": importlib.metadata.metadata(distribution).get("Requires-Python") or ""}
    for line in importlib.metadata.requires(distribution) or []:
        req = Requirement(line)
        if req.marker is None and req.name.lower() in FLOOR_PACKAGES:  # not an extra's (test) requirement
            floors[req.name.lower()] = str(req.specifier)
    return floors


def meets(installed: str, specifier: str) -> bool:
    """Whether version ``installed`` satisfies ``specifier`` (such as ">=2.7"), a pre-release counting as its release.

    Vendor images ship pre-releases of torch (NGC's 2.6.0a0+..., AMD's 2.7.0a0+git...), built from the
    branch of that release: 2.7.0a0 meets ">=2.7" here and 2.6.0a0 does not. (packaging's own comparison
    puts 2.7.0a0 below 2.7, and libraries that check with it refuse such a torch: see the transformers row.)
    Raises ``packaging.version.InvalidVersion`` for a string that is no version.
    """
    return SpecifierSet(specifier).contains(Version(installed).base_version, prereleases=True)


def prerelease_note(installed: str) -> str:
    """A warning for a pre-release or development version (empty for a release)."""
    v = Version(installed)
    if not (v.is_prerelease or v.is_devrelease):
        return ""
    return (f"; {installed} is a pre-release of {v.base_version}, counted as {v.base_version} here, but libraries "
            f"that compare versions strictly see it below {v.base_version}")


def installed_version(name: str) -> str | None:
    """The installed version of ``name`` ("python" is this interpreter), or None where it is not installed."""
    if name == "python":
        return platform.python_version()
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def version_row(name: str, specifier: str, source: str) -> Row:
    """The row of one package against its floor."""
    check = f"version: {name}"
    found = installed_version(name)
    if found is None:
        return Row(check, FAIL, f"{name} is not installed (the course needs {name}{specifier})", SETUP_FIX)
    try:
        ok, note = meets(found, specifier), prerelease_note(found)
    except InvalidVersion:
        return Row(check, FAIL, f"{name} {found} is not a version packaging can read", f"install {name}{specifier}")
    detail = f"{found} (course floor {specifier or 'none'}, {source}){note}"
    if ok:
        return Row(check, PASS, detail)
    if name == "python":
        fix = f"use Python {specifier}: the workshop images have it (docker/README.md)"
    elif name == "torch":
        fix = (f"use an image or a vendor wheel whose torch is {specifier} (docker/README.md); never pip-install torch "
               "over a ROCm or CUDA build")
    else:
        fix = f"pip install '{name}{specifier}'"
    return Row(check, FAIL, detail, fix)


def check_versions(overrides: dict[str, str] | None = None) -> list[Row]:
    """Python, torch, transformers, accelerate and DeepSpeed against the course's floors (``overrides`` win),
    and whether transformers accepts this torch at all."""
    try:
        floors, source = course_floors(), f"from {DISTRIBUTION}'s requirements"
    except importlib.metadata.PackageNotFoundError:
        return [Row("version floors", FAIL, f"{DISTRIBUTION} is not installed here, so its floors are unknown",
                    SETUP_FIX)]
    rows = []
    for name in ("python", *FLOOR_PACKAGES, *sorted(set(overrides or {}) - {"python", *FLOOR_PACKAGES})):
        spec = (overrides or {}).get(name, floors.get(name, ""))
        rows.append(version_row(name, spec, "from --floor" if name in (overrides or {}) else source))
    return rows + [transformers_sees_torch()]


def transformers_sees_torch() -> Row:
    """transformers' own verdict on this torch: ``is_torch_available()`` is False for a torch it thinks too old
    (a pre-release such as 2.6.0a0 included), and then no model of the course can be built."""
    check = "transformers sees torch"
    try:
        import transformers
        from transformers.utils import is_torch_available
    except Exception as err:  # noqa: BLE001 (a broken install fails at import with any error)
        return Row(check, FAIL, f"transformers does not import: {type(err).__name__}: {err}", SETUP_FIX)
    if is_torch_available():
        return Row(check, PASS, f"transformers {transformers.__version__} accepts torch {torch.__version__}")
    return Row(check, FAIL, f"transformers {transformers.__version__} refuses torch {torch.__version__} "
               "(is_torch_available() is False): no model can be built",
               "use an image whose torch is a release transformers accepts (docker/README.md), "
               "or an older transformers that accepts this torch")


def parse_floor(text: str) -> tuple[str, str]:
    """``"torch>=2.9"`` → ``("torch", ">=2.9")``; a clear error for anything else."""
    try:
        req = Requirement(text)
    except Exception as err:  # noqa: BLE001 (packaging raises its own InvalidRequirement)
        raise argparse.ArgumentTypeError(f"--floor {text!r} is not a requirement like 'torch>=2.7' ({err})") from err
    if not str(req.specifier):
        raise argparse.ArgumentTypeError(f"--floor {text!r} names no version: write it like 'torch>=2.7'")
    return req.name.lower(), str(req.specifier)


# ------------------------------------------------------------------ the machine: GPUs and seed 001's checks

def check_devices() -> list[Row]:
    """How many GPUs, their memory (free and total), and a tiny matmul on each."""
    n = torch.cuda.device_count()
    if n == 0:
        detail = (f"no GPU visible; {os.cpu_count()} CPU cores, {host_memory_bytes() / GIB:.0f} GiB host memory: "
                  f"the course picks tier '{pick_tier('auto')}'")
        built_for = (f"CUDA {torch.version.cuda}" if torch.version.cuda else
                     f"ROCm {torch.version.hip}" if torch.version.hip else None)
        fix = "" if built_for is None else (
            f"this torch is a {built_for} build that sees no GPU: start the container with --gpus all (NVIDIA) or "
            "--device /dev/kfd --device /dev/dri (AMD), and check nvidia-smi or rocm-smi")
        return [Row("GPUs", NO_GPU, detail, fix)]
    seen, broken, busy = [], [], []
    for i in range(n):
        try:
            free, total = torch.cuda.mem_get_info(i)
            x = torch.ones(64, 64, device=f"cuda:{i}")
            if float((x @ x)[0, 0]) != 64.0:
                raise RuntimeError("a 64x64 matmul of ones gave a wrong result")
            seen.append(f"{i}: {torch.cuda.get_device_name(i)} {total / GIB:.0f} GiB ({free / GIB:.0f} free)")
            busy += [str(i)] if free < total / 2 else []
        except Exception as err:  # noqa: BLE001 (a GPU in a bad state raises any CUDA/HIP error)
            broken.append(f"{i}: {type(err).__name__}: {str(err).splitlines()[0][:120]}")
    detail = f"{n} GPU(s), tier '{pick_tier('auto')}': " + "; ".join(seen + broken)
    if broken:
        return [Row("GPUs", FAIL, detail, "a GPU does not compute: check nvidia-smi / rocm-smi, reset or drain it")]
    fix = f"GPU(s) {', '.join(busy)} have under half their memory free: see who holds it (nvidia-smi / rocm-smi)"
    return [Row("GPUs", PASS, detail, fix if busy else "")]


ROCM_FIXES = {
    "NUMA auto-balancing": "on the host: sudo sh -c 'echo 0 > /proc/sys/kernel/numa_balancing' (seed 001)",
    "ROCm": "use an image built on ROCm 6.3 or newer (docker/README.md)",
    "RCCL": "use a ROCm build of PyTorch (the course's ROCm image), whose 'nccl' backend is RCCL",
    "hipBLASLt": "use AMD's PyTorch image, which ships hipBLASLt (or install the hipblaslt package of your ROCm)",
    "GPU memory": "an MI300X shows about 192 GiB: check its partition mode (amd-smi / rocm-smi)",
}


def check_system() -> list[Row]:
    """The GPU stack, and seed 001's system validation (``device.validate_rocm``) where it applies: a ROCm GPU node."""
    stack = gpu_vendor_stack()
    if stack == "CPU only":
        rows = [Row("GPU stack", NO_GPU, f"torch {torch.__version__}: CPU only")]
    else:
        rows = [Row("GPU stack", PASS, f"{stack}, {rccl_version()}, {gpu_architecture()}, torch {torch.__version__}")]
    if torch.version.hip is None or not torch.cuda.is_available():
        return rows + [Row("NUMA auto-balancing", SKIPPED,
                           f"{numa_balancing()}; seed 001's check is for ROCm GPU nodes")]
    arch = gpu_architecture()
    for c in validate_rocm():
        if c["check"] in ("GPU", "GPUs"):  # the GPUs row has them
            continue
        detail = f"{c['value']} (MI300X expects {c['MI300X expects']})"
        not_mi300x = c["check"] in ("GPU architecture", "GPU memory") and not arch.startswith("gfx942")
        if c["ok"] is None or (c["ok"] is False and not_mi300x):  # seed 001's expectations are an MI300X's
            rows.append(Row(c["check"], SKIPPED, f"{detail}: not judged on {arch}"))
        elif c["ok"]:
            rows.append(Row(c["check"], PASS, detail))
        else:
            rows.append(Row(c["check"], FAIL, detail, ROCM_FIXES.get(c["check"], "")))
    return rows


# ------------------------------------------------------------------ attention: the kernels course_sdpa gets

def document_mask(batch: int, seq: int, documents: int = 2) -> torch.Tensor:
    """The (batch, 1, T, T) mask of ``documents`` packed documents that training uses (``packed_attention_mask``):
    causal, and no token sees another document."""
    return packed_attention_mask((torch.arange(seq) * documents // seq).expand(batch, seq))


def sdpa_kernels_used(device: torch.device, dtype: torch.dtype, masked: bool) -> Counter:
    """Run ``course_sdpa`` forward and backward once on tiny grouped-head (GQA) inputs, as the course's Llama
    calls it; the SDPA kernels that ran (``attention_kernels``). Raises ``AttentionFallback`` as the model would."""
    batch, heads, kv_heads, seq, head_dim = 2, 4, 2, 64, 64
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, h, seq, head_dim, generator=gen).to(device, dtype).requires_grad_()
               for h in (heads, kv_heads, kv_heads))
    mask = document_mask(batch, seq).to(device) if masked else None
    module = nn.Module()
    module.is_causal = True  # what transformers' attention layers carry

    def step() -> None:
        out, _ = course_sdpa(module, q, k, v, mask)
        out.float().sum().backward()

    with warnings.catch_warnings():  # SDPA's dispatcher warns why each kernel declined: the row says what ran
        warnings.simplefilter("ignore", UserWarning)
        return attention_kernels(step)


def check_attention() -> list[Row]:
    """The kernels ``course_sdpa`` gets here in fp32 and bf16, with and without a document mask: none may be math."""
    device, rows = default_device(), []
    for dname, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for masked in (False, True):
            check = f"attention: course_sdpa {dname}{' + document mask' if masked else ''} on {device.type}"
            if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
                rows.append(Row(check, SKIPPED, "this GPU has no bf16: the course uses fp16 with a GradScaler here"))
                continue
            try:
                kernels = sdpa_kernels_used(device, dtype, masked)
            except AttentionFallback as err:
                rows.append(Row(check, FAIL, str(err)[:300], "use the workshop image's torch (docker/README.md); "
                                "attn_implementation='sdpa' runs the math fallback knowingly"))
                continue
            ran = ", ".join(f"{name} x{count}" for name, count in sorted(kernels.items())) or "no SDPA kernel"
            bad = "math" in kernels or not kernels
            rows.append(Row(check, FAIL if bad else PASS, f"kernels (forward and backward): {ran}",
                            "course_sdpa let a call reach the math kernel: report it with this row" if bad else ""))
    return rows


# ------------------------------------------------------------------ collectives on real ranks

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


def _collective_calls(device: torch.device, rank: int, world: int, numel: int) -> dict[str, Callable[[], bool]]:
    """Each collective the course's notebooks run, as a call that runs it once and says whether the arithmetic
    held: all-reduce (DDP), all-gather and reduce-scatter (FSDP, ZeRO), all-to-all (expert parallelism, the
    context-parallel backward) and a send/recv round the ring (pipeline and ring attention; needs two ranks)."""
    full = lambda value: torch.full((numel,), float(value), device=device)  # noqa: E731
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # torch 2.13's name

    def all_reduce() -> bool:
        x = full(rank + 1)
        dist.all_reduce(x)
        return bool((x == world * (world + 1) / 2).all())

    def all_gather() -> bool:
        parts = [torch.empty(numel, device=device) for _ in range(world)]
        dist.all_gather(parts, full(rank))
        return all(bool((p == r).all()) for r, p in enumerate(parts))

    def reduce_scatter_() -> bool:
        out = torch.empty(numel, device=device)
        reduce_scatter(out, torch.cat([full(rank + r) for r in range(world)]))  # slice r of rank q holds q + r
        return bool((out == sum(q + rank for q in range(world))).all())

    def all_to_all() -> bool:
        out = torch.empty(numel * world, device=device)
        dist.all_to_all_single(out, torch.cat([full(rank * world + r) for r in range(world)]))  # to r: rank*N + r
        return all(bool((chunk == q * world + rank).all()) for q, chunk in enumerate(out.chunk(world)))

    def send_recv() -> bool:
        got = torch.empty(numel, device=device)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, full(rank), (rank + 1) % world),
                                        dist.P2POp(dist.irecv, got, (rank - 1) % world)])
        for work in works:
            work.wait()
        return bool((got == (rank - 1) % world).all())

    calls = {"all_reduce": all_reduce, "all_gather": all_gather, "reduce_scatter": reduce_scatter_,
             "all_to_all": all_to_all, "send_recv": send_recv}
    return calls if world > 1 else {k: v for k, v in calls.items() if k != "send_recv"}


def collective_worker(numel: int = 4096, repeats: int = 5) -> dict:
    """What each rank runs (``course_lib.launch``): every collective of ``_collective_calls`` on this rank's device,
    checked against the arithmetic, then timed (the median of ``repeats`` runs, in ms). Returns which held."""
    device, rank, world = rank_device(), dist.get_rank(), dist.get_world_size()
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    out: dict = {"device": str(device), "backend": dist.get_backend(), "ms": {}}
    for name, call in _collective_calls(device, rank, world, numel).items():
        out[name] = call()
        times = []
        for _ in range(repeats):
            sync()
            start = time.perf_counter()
            call()
            sync()
            times.append((time.perf_counter() - start) * 1e3)
        out["ms"][name] = sorted(times)[len(times) // 2]
    return out


def collective_row(device_type: str, nprocs: int) -> Row:
    """Launch ``nprocs`` ranks on ``device_type`` as the course does and judge every collective the course runs."""
    backend = backend_for(device_type)
    backend += " (RCCL)" if backend == "nccl" and torch.version.hip else ""
    check = f"collectives: {backend}, {nprocs} {'GPU' if device_type == 'cuda' else 'CPU'} ranks"
    fix = ("run again with NCCL_DEBUG=INFO to see why; in a container give it --ipc=host (or --shm-size 16g), and on "
           "ROCm --device /dev/kfd --device /dev/dri" if device_type == "cuda" else
           "gloo connects ranks over 127.0.0.1: check that localhost resolves "
           "and that GLOO_SOCKET_IFNAME is unset or lo")
    try:
        results = launch("course_lib.apps.preflight:collective_worker", nprocs=nprocs, timeout=180,
                         device_type=device_type,
                         echo=False)
    except (WorkerError, TimeoutError, ValueError) as err:
        return Row(check, FAIL, " ".join(str(err).split())[-400:], fix)
    ran = [op for op in COLLECTIVES if op in results[0]] if results else []
    wrong = [f"rank {r['rank']}: {op}" for r in results for op in ran if not r[op]]
    if len(results) != nprocs or wrong:
        return Row(check, FAIL, f"{len(results)} of {nprocs} ranks answered; wrong results: {wrong}", fix)
    devices = sorted({r["device"] for r in results})
    slowest = {op: max(r["ms"][op] for r in results) for op in ran}
    timed = ", ".join(f"{op.replace('_', '-')} {ms:.2f} ms" for op, ms in slowest.items())
    alone = "" if "send_recv" in ran else "; send/recv needs two ranks"
    return Row(check, PASS, f"correct on every rank ({', '.join(devices)}), 16 KB each: {timed}{alone}")


def check_collectives(quick: bool = False) -> list[Row]:
    """One rank per GPU over NCCL/RCCL, and two CPU ranks over gloo (the course's CPU comparisons)."""
    n = torch.cuda.device_count()
    if quick:
        return [Row("collectives", SKIPPED, "--quick starts no ranks")]
    gpu = collective_row("cuda", n) if n else Row("collectives: nccl, GPU ranks", NO_GPU, "no GPU to start ranks on")
    return [gpu, collective_row("cpu", 2)]


# ------------------------------------------------------------------ torch's context parallelism and the allocator

def cp_probe(steps: int = 2) -> dict:
    """torch's ``context_parallel`` on one GPU rank (a ring of one: the swapped fused kernels, forward and backward,
    and the split), past ``cp_torch.support``'s version gate, against the one-process reference."""
    start = time.perf_counter()
    spec = cp_torch.CPRun(design="torch", steps=steps, force=True)
    run = on_ranks(cp_torch.train, 1, "cuda", timeout=240, spec=spec)[0]
    reference = cp_torch.reference_llama_losses(steps, seq=cp_torch.seq_for(1))
    gap = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], reference))
    return {"gap": gap, "zigzag": run["zigzag"], "seconds": time.perf_counter() - start}


def cp_row(gate: str | None, returned: bool, result: dict | None, out: str) -> Row:
    """The context-parallelism row from the gate's verdict (``cp_torch.support``) and the probe's outcome."""
    check = "context parallelism: torch's, one GPU step"
    held = returned and result["gap"] < 1e-4 and result["zigzag"]
    ran = (f"a step forward and backward held loss for loss (gap {result['gap']:.1e}), {result['seconds']:.1f} s"
           if returned else f"the step did not finish: {out[-300:]}")
    if gate is None:
        return Row(check, PASS if held else FAIL, ran, "" if held else
                   "notebook 16's torch context parallel would stop its ranks here: run "
                   "`python -m pytest tests/test_cp.py` on this machine and report the row")
    if held:
        return Row(check, PASS, f"{ran}, though the version gate says: {gate}",
                   f"set {cp_torch.ROCM_CP_ENV}=1 in the workshop's environment to run it in notebook 16")
    return Row(check, ABSENT, f"gated off ({gate}), and rightly: {ran}",
               "notebook 16 records torch's context parallel as not measured here; a newer torch fixes it")


def check_context_parallel(quick: bool = False) -> list[Row]:
    """torch's context parallelism, one GPU step in a process of its own (a kernel fault loses only this row)."""
    if quick:
        return [Row("context parallelism: torch's, one GPU step", SKIPPED, "--quick starts no ranks")]
    if not torch.cuda.is_available():
        return [Row("context parallelism: torch's, one GPU step", NO_GPU, "torch's context parallel runs on GPUs")]
    gate = cp_torch.support("cuda")
    return [cp_row(gate, *run_probe("cp_probe()", timeout=300))]


def allocator_probe(mib: int = 256) -> dict:
    """The caching allocator on GPU 0: ``mib`` MiB allocated, freed (kept in the cache), then handed back by
    ``empty_cache``; the times of each, and the settings this process was given."""
    device, times = torch.device("cuda", 0), {}
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved(device)
    start = time.perf_counter()
    x = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    torch.cuda.synchronize(device)
    times["allocate_ms"] = (time.perf_counter() - start) * 1e3
    held, allocated = torch.cuda.memory_reserved(device) - base, x.numel()
    del x
    cached = torch.cuda.memory_reserved(device) - base
    start = time.perf_counter()
    torch.cuda.empty_cache()
    times["empty_cache_ms"] = (time.perf_counter() - start) * 1e3
    return {"allocated": allocated, "reserved": held, "cached_after_free": cached,
            "returned": torch.cuda.memory_reserved(device) - base, "conf": cp_cost.alloc_conf(), **times}


def allocator_row(got: dict) -> Row:
    """Whether the allocator holds what it allocated, keeps freed blocks and returns them on ``empty_cache``: the
    behaviour the course's memory meters (allocated peaks, reserved peaks) assume."""
    check = "GPU allocator: reserve, cache, release"
    mib = got["allocated"] >> 20
    n = got["allocated"]
    ok = got["reserved"] >= n and got["cached_after_free"] >= n and got["returned"] < n
    detail = (f"{mib} MiB: reserved {got['reserved'] >> 20} MiB, cached after free {got['cached_after_free'] >> 20} "
              f"MiB, after empty_cache {got['returned'] >> 20} MiB; allocate {got['allocate_ms']:.1f} ms, empty_cache "
              f"{got['empty_cache_ms']:.1f} ms; {got['conf']}")
    return Row(check, PASS if ok else FAIL, detail, "" if ok else
               "the allocator settings above change what the course's memory tables measure: unset them, or "
               "read notebook 04's meter with them in mind")


def check_allocator() -> list[Row]:
    """The GPU's caching allocator, in a process of its own (a fresh allocator: nothing cached before)."""
    if not torch.cuda.is_available():
        return [Row("GPU allocator: reserve, cache, release", NO_GPU, "the caching allocator serves GPUs")]
    returned, got, out = run_probe("allocator_probe()", timeout=120)
    if not returned:
        return [Row("GPU allocator: reserve, cache, release", FAIL, out[-400:],
                    "check the GPU (nvidia-smi / rocm-smi)")]
    return [allocator_row(got)]


# ------------------------------------------------------------------ probes in processes of their own

def run_probe(call: str, env: dict[str, str] | None = None, timeout: float = 240) -> tuple[bool, object, str]:
    """Run ``course_lib.apps.preflight.<call>`` in a fresh interpreter: (whether it returned, its JSON result, its
    output).

    A probe that crashes the interpreter (a binary built for another GPU stack) or hangs only loses its own row.
    """
    code = (f"import json, course_lib.apps.preflight as p; r = p.{call}; "
            f"print({PROBE_MARK!r} + json.dumps(r), flush=True)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the probe and whatever it started (a compiler)
        out, _ = proc.communicate()
        return False, None, f"timed out after {timeout:.0f} s: " + " ".join(out.split())[-300:]
    for line in reversed(out.splitlines()):
        if line.startswith(PROBE_MARK):
            return True, json.loads(line[len(PROBE_MARK):]), out
    return False, None, f"the probe exited with {proc.returncode}: " + " ".join(out.split())[-300:]


def _attempt(fn: Callable[[], object]) -> str | None:
    """None if ``fn()`` ran, else its error in one line."""
    try:
        fn()
    except Exception as err:  # noqa: BLE001 (op builds and loads raise anything)
        return f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
    return None


def _adam_step(optimizer_cls: type, device: str) -> None:
    """One step of a DeepSpeed Adam on a tiny parameter; raise if the weights did not move."""
    p = nn.Parameter(torch.ones(64, device=device))
    p.grad = torch.ones_like(p)
    optimizer_cls([p], lr=0.1).step()
    if not bool((p.detach() < 1).all()):
        raise RuntimeError(f"{optimizer_cls.__name__} stepped but the weights did not move")


def deepspeed_ops_probe(device_type: str) -> dict[str, str | None]:
    """In a process of its own: load the DeepSpeed ops the course uses with ``device_type`` ranks and run each once.

    CPU ranks (``DS_ACCELERATOR=cpu``): the shared-memory comm op and CPU Adam, built as ``make ops`` builds them
    (``zero_deepspeed.build_deepspeed_ops``). GPU ranks: CPU Adam (ZeRO-Offload's ``cpu_adam=True``) and fused Adam.
    Returns {op: None if it ran, else why not}.
    """
    if device_type == "cpu":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        built = _attempt(build_deepspeed_ops)
        return {"comm op and CPU Adam build": built,
                "CPU Adam step": built or _attempt(lambda: _adam_step(DeepSpeedCPUAdam, "cpu"))}
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    return {"CPU Adam": _attempt(lambda: _adam_step(DeepSpeedCPUAdam, "cpu")),
            "fused Adam": _attempt(lambda: _adam_step(FusedAdam, "cuda"))}


def ops_env(device_type: str) -> dict[str, str]:
    """The environment DeepSpeed's ops are loaded with: CPU ranks hide the GPUs as ``launch`` does; both look for the
    ops where the notebooks do (TORCH_EXTENSIONS_DIR, which make and the images set, else the venv's folder)."""
    env = {"TORCH_EXTENSIONS_DIR": extensions_dir()}
    if device_type == "cpu":
        env.update(CPU_ONLY_ENV)
    return env


def check_deepspeed_ops(quick: bool = False) -> list[Row]:
    """DeepSpeed's ops for CPU ranks (comm op, CPU Adam) and, on a GPU machine, for GPU ranks (CPU Adam, fused Adam)."""
    if quick:
        return [Row("DeepSpeed ops", SKIPPED, "--quick loads no ops")]
    env = ops_env("cpu")
    folder = Path(env["TORCH_EXTENSIONS_DIR"])
    prebuilt = all((folder / op / f"{op}.so").exists() for op in ("deepspeed_shm_comm", "cpu_adam"))
    start = time.perf_counter()
    _, result, out = run_probe("deepspeed_ops_probe('cpu')", env)
    took = time.perf_counter() - start
    build_fix = f"make ops (it needs a C++ compiler and ninja; TORCH_EXTENSIONS_DIR={folder})"
    if result is None or any(result.values()):
        why = out if result is None else "; ".join(f"{k}: {v}" for k, v in result.items() if v)
        rows = [Row("DeepSpeed ops for CPU ranks (comm op, CPU Adam)", FAIL, why[-400:], build_fix)]
    else:
        detail = f"loaded and stepped in {took:.0f} s from {folder}"
        rows = [Row("DeepSpeed ops for CPU ranks (comm op, CPU Adam)", PASS, detail if prebuilt else
                    detail + ", built just now", "" if prebuilt else f"build them once before class: {build_fix}")]
    if not torch.cuda.is_available():
        return rows + [Row(f"DeepSpeed ops for GPU ranks ({op})", NO_GPU, "no GPU")
                       for op in ("CPU Adam", "fused Adam")]
    _, result, out = run_probe("deepspeed_ops_probe('cuda')", ops_env("cuda"))
    result = result or {"CPU Adam": out, "fused Adam": out}
    rows.append(Row("DeepSpeed ops for GPU ranks (CPU Adam)", PASS if result["CPU Adam"] is None else FAIL,
                    result["CPU Adam"] or "loaded and stepped", "" if result["CPU Adam"] is None else build_fix))
    fused = result["fused Adam"]
    rows.append(Row("DeepSpeed ops for GPU ranks (fused Adam)", PASS if fused is None else ABSENT,
                    "loaded and stepped" if fused is None else f"{fused[-300:]}; the course steps with torch's AdamW "
                    "(torch_adam) and does not need it", "" if fused is None else "needs nvcc or hipcc to build"))
    return rows


# ------------------------------------------------------------------ optional packages: FP8 and bitsandbytes

def torchao_probe(device: str) -> str | None:
    """In a process of its own (torchao's import prints kernel-load failures):
    ``fp8_compute.torchao_fp8_runs(device)``."""
    return fp8_compute.torchao_fp8_runs(device)


def bitsandbytes_probe(device: str) -> str | None:
    """In a process of its own: ``qlora.bitsandbytes_4bit_runs(device)``, the probe QLoRA decides from."""
    return qlora.bitsandbytes_4bit_runs(device)


def optional_row(check: str, package: str, probe: str, install: str, quick: bool, use: str) -> Row:
    """An optional package's row: absent when it is not installed or cannot run, pass when its op ran."""
    if importlib.util.find_spec(package) is None:
        return Row(check, ABSENT, f"{package} is not installed: {use} is not available here", install)
    if quick:
        return Row(check, SKIPPED, f"{package} is installed; --quick does not run it")
    returned, result, out = run_probe(probe, timeout=180)
    why = result if returned else out
    if why is None:
        return Row(check, PASS, f"{package} {installed_version(package)} ran one real op")
    return Row(check, ABSENT, f"{package} {installed_version(package)} is installed but cannot run here "
               f"({str(why)[-300:]}): {use} is not available", install)


def check_fp8_and_4bit(quick: bool = False) -> list[Row]:
    """FP8 matmuls (``torch._scaled_mm``, in the formats this device computes in), torchao's FP8 training and
    bitsandbytes' 4-bit matmul, each run once on the default device, or reported absent."""
    device = default_device()
    e4m3, _ = fp8.device_fp8_dtypes(device)
    name = str(e4m3).removeprefix("torch.")
    why = fp8_compute.scaled_mm_runs(device.type, e4m3, e4m3)
    rows = [Row(f"FP8 matmul: torch._scaled_mm {name} on {device.type}", PASS if why is None else ABSENT,
                "ran" if why is None else f"{why}: notebook 02 emulates FP8 matmuls here",
                "" if why is None else "FP8 GEMMs need an H100/H200/L40S-class NVIDIA GPU or an MI300X")]
    dev = repr(device.type)
    rows.append(optional_row(f"FP8 training: torchao on {device.type}", "torchao", f"torchao_probe({dev})",
                             fp8_compute.INSTALL_TORCHAO, quick, "notebook 02's FP8 training"))
    rows.append(optional_row(f"4-bit: bitsandbytes NF4 matmul on {device.type}", "bitsandbytes",
                             f"bitsandbytes_probe({dev})", qlora.INSTALL_BITSANDBYTES, quick, "notebook 12's QLoRA"))
    return rows


# ------------------------------------------------------------------ the table

def run_checks(quick: bool = False, floors: dict[str, str] | None = None,
               progress: Callable[[str], None] | None = None) -> list[Row]:
    """Every check, in order; a check that raises becomes one FAIL row with its error (the others still run)."""
    checks: list[tuple[str, Callable[[], list[Row]]]] = [
        ("versions", lambda: check_versions(floors)), ("GPUs", check_devices), ("system", check_system),
        ("attention", check_attention), ("FP8 and 4-bit", lambda: check_fp8_and_4bit(quick)),
        ("collectives", lambda: check_collectives(quick)), ("DeepSpeed ops", lambda: check_deepspeed_ops(quick)),
        ("context parallelism", lambda: check_context_parallel(quick)), ("allocator", check_allocator),
    ]
    rows: list[Row] = []
    for name, check in checks:
        start = time.perf_counter()
        try:
            got = check()
        except Exception as err:  # noqa: BLE001 (the preflight's own check broke: say so, go on)
            got = [Row(name, FAIL, f"the check itself raised {type(err).__name__}: {err}",
                       "report this row with the course's version")]
        seconds = time.perf_counter() - start
        for row in got:
            row.seconds = round(seconds / len(got), 2)
        rows += got
        if progress:
            progress(f"preflight: {name}: {', '.join(r.status for r in got)} ({seconds:.1f} s)")
    return rows


def failed(rows: list[Row]) -> list[Row]:
    """The rows whose path the course needs and that failed: any of them makes the exit code 1."""
    return [r for r in rows if r.status == FAIL]


def table(rows: list[Row]) -> str:
    """The rows as a markdown table of check, status, detail and fix."""
    return tabulate([[r.check, r.status, r.detail, r.fix] for r in rows], headers=["check", "status", "detail", "fix"],
                    tablefmt="github")


def main(argv: list[str] | None = None) -> int:
    """Run the preflight, print the table (and save it as JSON with --json); 1 if a needed path failed, else 0."""
    parser = argparse.ArgumentParser(prog="python -m course_lib.apps.preflight", description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="also save the rows as a JSON list")
    parser.add_argument("--quick", action="store_true", help="skip the checks that start processes")
    parser.add_argument("--floor", metavar="REQ", action="append", type=parse_floor, default=[],
                        help="judge a package against this floor instead of the course's, e.g. 'torch>=2.9'")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rows = run_checks(args.quick, dict(args.floor), progress=lambda line: print(line, file=sys.stderr, flush=True))
    seconds = time.perf_counter() - start
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    bad = failed(rows)
    print(table(rows))
    verdict = (f"{len(bad)} needed path(s) FAIL: fix them before class" if bad
               else "every path the course needs works here")
    print(f"\npreflight: {verdict} ({len(rows)} checks, {seconds:.0f} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
