"""What hardware is this, and which tier of the course fits it.

ROCm builds of PyTorch expose AMD GPUs through the ``torch.cuda`` API, so "cuda" below
means "a GPU" on both vendors; ``torch.version.hip`` tells them apart.
"""

from __future__ import annotations

import gc
import os
import platform
from pathlib import Path

import torch

TIERS = ("smoke", "cpu", "gpu", "node")
# Set (to 1) by ``python -m course_lib.apps.run_all --tier node --emulate``: the node tier's layout (world sizes,
# meshes, micro-batch counts, pipeline stages) runs on CPU ranks over gloo, at the widths the notebook gives
# for it, so that a node-only shape fails on a laptop or in CI before it meets a GPU node.
EMULATE_NODE_ENV = "COURSE_EMULATE_NODE"


def emulating_node() -> bool:
    """True while the node tier is emulated on CPU ranks (``EMULATE_NODE_ENV`` set to 1)."""
    return os.environ.get(EMULATE_NODE_ENV, "") == "1"


def default_device() -> torch.device:
    """The first GPU if there is one (CUDA or ROCm), else the CPU: the course's one "which device?" decision."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def compute_device(model: torch.nn.Module) -> torch.device:
    """Where ``model`` computes, and so where its batches go: its parameters' device, except under FSDP2's CPU
    offload, whose shards rest on the CPU between steps while every forward and backward runs on the device its
    mesh names (a batch left on the CPU there meets logits on the GPU in the loss)."""
    param = next(model.parameters())
    mesh = getattr(param, "device_mesh", None)  # a DTensor's: FSDP2's and tensor parallelism's shards
    if mesh is not None and mesh.device_type != param.device.type:
        return torch.device(mesh.device_type)  # no index: the current device, which each rank sets to its own
    return param.device


def gpu_count(device: torch.device | str) -> int:
    """The GPUs a notebook on ``device`` may give its ranks: none when it runs on the CPU (a CPU tier, an emulated
    node), else this machine's. ``device_count`` does not initialise CUDA, so CPU ranks can still be forked after it."""
    return torch.cuda.device_count() if torch.device(device).type == "cuda" else 0


def ranks_device(world: int, device: torch.device | str) -> str:
    """Where ``world`` ranks of a notebook on ``device`` run: "cuda", one rank per GPU, when there are that many GPUs;
    else "cpu", ranks over gloo (on a GPU machine spawned with the GPUs hidden). The course's one "GPU ranks or CPU
    ranks?" decision: a world larger than the machine's GPUs still runs, on its CPU cores."""
    return "cuda" if gpu_count(device) >= world else "cpu"


def bf16_is_native(device: torch.device | str) -> bool:
    """Whether ``device`` runs bf16 matmuls in hardware: a GPU (the course's, from the A100 and MI200 on), or a CPU
    whose oneDNN has bf16 kernels (AVX-512 or AMX). An AVX2 CPU only emulates them: bf16 autocast runs there, about
    six times slower than fp32 (a tiny Llama's training step, measured), and saves nothing a CPU run needs."""
    if torch.device(device).type != "cpu":
        return True
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN: no bf16 kernels either
        return False


def backend_for(device: torch.device | str) -> str:
    """The torch.distributed backend for ranks on ``device``: NCCL for GPUs (RCCL on ROCm, which PyTorch
    still calls "nccl"), gloo for CPUs. The course's one "which backend?" decision."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def gpu_vendor_stack() -> str:
    """'ROCm <version>', 'CUDA <version>', or 'CPU only'."""
    if torch.version.hip is not None and torch.cuda.is_available():
        return f"ROCm {torch.version.hip}"
    if torch.version.cuda is not None and torch.cuda.is_available():
        return f"CUDA {torch.version.cuda}"
    return "CPU only"


def collective_backend() -> str:
    """The torch.distributed backend the course uses here.

    On AMD GPUs the backend is still called "nccl" in PyTorch, but the library behind it
    is RCCL; the report says so because RCCL's version and settings are what to check.
    """
    backend = backend_for(default_device())
    return f"{backend} (RCCL)" if backend == "nccl" and torch.version.hip is not None else backend


def numa_balancing(path: str = "/proc/sys/kernel/numa_balancing") -> str:
    """The kernel's NUMA auto-balancing setting (seed 001 asks for it to be 0 on MI300X nodes)."""
    try:
        value = Path(path).read_text().strip()
    except OSError:
        return "unavailable (no /proc/sys/kernel/numa_balancing)"
    if value == "0":
        return "0 (disabled, as ROCm recommends)"
    return f"{value} (enabled: for GPU training run sudo sh -c 'echo 0 > {path}')"


def host_memory_bytes() -> int:
    """Total RAM of this machine, from /proc/meminfo (0 where it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def device_memory_bytes(device: torch.device | None = None) -> int:
    """Memory of the training device: the GPU's total memory, or host RAM for the CPU."""
    device = device or default_device()
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return host_memory_bytes()


def device_held_bytes(device: torch.device | None = None) -> int:
    """GPU memory this process's live tensors hold now (the models and optimizers of earlier notebook cells): what a
    new model cannot have. The CUDA context and the allocator's slack are what a plan's headroom is for; other
    processes on the same GPU are not counted (one GPU per learner is the course's layout). 0 on a CPU."""
    device = device or default_device()
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def free_memory(device: torch.device | None = None) -> None:
    """Give back what dropped models and optimizers held: collect their reference cycles, then return the
    allocator's cached blocks to the GPU (for another process, or a measurement of what is free)."""
    gc.collect()
    device = device or default_device()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def system_report() -> dict[str, str]:
    """One row per fact a training run depends on, for the first cell of a notebook."""
    gib = 2**30
    report = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "accelerator stack": gpu_vendor_stack(),
        "GPUs": str(torch.cuda.device_count()),
        "CPU cores": str(os.cpu_count()),
        "host memory": f"{host_memory_bytes() / gib:.1f} GiB",
        "NUMA auto-balancing": numa_balancing(),
        "collective backend": collective_backend(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        report["GPU 0"] = props.name
        report["GPU 0 memory"] = f"{props.total_memory / gib:.1f} GiB"
        arch = getattr(props, "gcnArchName", None)
        if arch:  # ROCm only: gfx942 is MI300X / MI325X
            report["GPU 0 architecture"] = arch
        report["bf16 supported"] = str(torch.cuda.is_bf16_supported())
    else:
        report["CPU capability"] = torch.backends.cpu.get_cpu_capability()
        report["bf16 supported"] = ("yes (oneDNN's bf16 kernels)" if bf16_is_native("cpu") else
                                    "emulated (autocast runs, several times slower than fp32: no AVX-512 or AMX)")
    report["tier picked"] = pick_tier("auto")
    return report


def pick_tier(tier: str = "auto") -> str:
    """Resolve a notebook's ``tier`` parameter.

    "auto" picks from the hardware: 8 or more GPUs is a ``node``, one or more a ``gpu``,
    none the ``cpu`` tier. While nbgrader grades a notebook (it sets NBGRADER_EXECUTION)
    "auto" becomes ``smoke``: the same code on the smallest sizes, so that grading a
    class costs seconds per student. An explicit tier is checked against the hardware, except
    the node tier while it is emulated on CPU ranks (``emulating_node``).
    """
    if tier == "auto":
        if os.environ.get("NBGRADER_EXECUTION"):
            return "smoke"
        n = torch.cuda.device_count()
        return "node" if n >= 8 else "gpu" if n >= 1 else "cpu"
    if tier not in TIERS:
        raise ValueError(f"tier={tier!r} is not one of {TIERS + ('auto',)}; set tier='auto' to pick from the hardware")
    if tier == "node" and emulating_node():
        return tier  # CPU ranks stand in for the node's GPUs
    if tier in ("gpu", "node") and not torch.cuda.is_available():
        raise ValueError(f"tier={tier!r} needs a GPU and this machine has none: use tier='cpu' (or 'auto')")
    if tier == "node" and torch.cuda.device_count() < 8:
        raise ValueError(
            f"tier='node' expects 8 GPUs and this machine has {torch.cuda.device_count()}: use tier='gpu' (or 'auto')"
        )
    return tier


# Why each row of ``system_report`` matters for the course (shown beside the values in notebook 00).
REPORT_NOTES: dict[str, str] = {
    "python": "the interpreter the kernel runs; the course needs 3.10 or newer",
    "torch": "the build decides the GPU stack: '+rocm' and '+cu' builds use GPUs, '+cpu' only the CPU; "
             "never pip-install torch over a ROCm or CUDA build",
    "accelerator stack": "ROCm builds reach AMD GPUs through the torch.cuda API, so the same code runs on MI300X "
                         "and NVIDIA; 'CPU only' means the small cpu tier",
    "GPUs": "how many processes DDP, FSDP and DeepSpeed start on this machine (notebooks 06-10), and the tier",
    "CPU cores": "data-loader workers, and the gloo processes the cpu tier starts instead of GPUs",
    "host memory": "where CPU offload (FSDP, ZeRO-Offload) keeps optimizer states and weights (notebooks 08-10)",
    "NUMA auto-balancing": "the kernel moving memory pages between CPU sockets while GPUs read them; seed 001 "
                           "asks for 0 on MI300X nodes: sudo sh -c 'echo 0 > /proc/sys/kernel/numa_balancing'",
    "collective backend": "the library that all-reduces gradients: NCCL on NVIDIA, RCCL (still called 'nccl' "
                          "in PyTorch) on AMD, gloo on CPUs",
    "CPU capability": "the widest vector instructions PyTorch's CPU kernels use here (DEFAULT, AVX2, AVX512): "
                      "how fast the cpu tier runs",
    "bf16 supported": "whether bf16 autocast runs here (notebook 01); without it use fp16 with a GradScaler",
    "GPU 0": "the accelerator the gpu tier trains on",
    "GPU 0 memory": "the budget every table of this course is compared against",
    "GPU 0 architecture": "gfx942 is MI300X / MI325X (ROCm's name for the chip)",
    "tier picked": "the sizes the notebooks pick with tier='auto' (smoke while nbgrader grades)",
}


def system_report_rows(report: dict[str, str] | None = None) -> list[dict[str, str]]:
    """``system_report()`` as rows of fact, value and why it matters, for a table."""
    report = system_report() if report is None else report
    return [{"fact": k, "value": v, "why it matters": REPORT_NOTES.get(k, "")} for k, v in report.items()]


# ------------------------------------------------------------------ ROCm system validation (seed 001)
# What seed 001 asks an MI300X node to show before training, gathered so that the same code runs on
# CUDA and CPU machines (where the ROCm-only facts read "n/a"). ``rocm_facts`` reads the machine;
# ``validate_rocm`` judges a facts dict, so tests can feed it the facts of an MI300X node.

def gpu_architecture(index: int = 0) -> str:
    """``gcnArchName`` on ROCm (gfx942 is MI300X/MI325X), the compute capability on CUDA, else n/a."""
    if not torch.cuda.is_available():
        return "n/a (no GPU)"
    props = torch.cuda.get_device_properties(index)
    arch = getattr(props, "gcnArchName", None)
    if arch and torch.version.hip is not None:
        return arch
    return f"sm_{props.major}{props.minor} (CUDA compute capability {props.major}.{props.minor})"


def rocm_version() -> str:
    """The HIP/ROCm version PyTorch was built against, or n/a on a CUDA or CPU build."""
    return torch.version.hip or "n/a (not a ROCm build of PyTorch)"


def rccl_version() -> str:
    """RCCL's version on ROCm (PyTorch reports it through ``torch.cuda.nccl``), NCCL's on CUDA, else n/a."""
    if not torch.cuda.is_available():
        return "n/a (no GPU)"
    try:
        v = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 (a build without NCCL/RCCL)
        return "n/a (built without NCCL/RCCL)"
    text = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return f"RCCL {text}" if torch.version.hip is not None else f"NCCL {text} (not RCCL: a CUDA build)"


def hipblaslt_status() -> str:
    """Whether PyTorch's GEMMs can use hipBLASLt (ROCm's tuned GEMM library), or n/a off ROCm."""
    if torch.version.hip is None:
        return "n/a (not a ROCm build of PyTorch)"
    lib = Path(torch.__file__).parent / "lib"
    found = sorted(p.name for folder in (lib, Path("/opt/rocm/lib")) if folder.is_dir()
                   for p in folder.glob("libhipblaslt*"))
    try:
        backend = str(torch.backends.cuda.preferred_blas_library())
    except Exception:  # noqa: BLE001
        backend = "unknown"
    prefer = os.environ.get("TORCH_BLAS_PREFER_HIPBLASLT", "unset")
    if not found:
        return f"not found (preferred BLAS: {backend})"
    return f"available ({found[0]}; preferred BLAS: {backend}; TORCH_BLAS_PREFER_HIPBLASLT={prefer})"


def rocm_facts() -> dict[str, str]:
    """The facts seed 001's system validation checks, read from this machine."""
    gib = 2**30
    mem = (f"{torch.cuda.get_device_properties(0).total_memory / gib:.1f} GiB" if torch.cuda.is_available()
           else "n/a (no GPU)")
    return {"NUMA auto-balancing": numa_balancing(), "GPU": torch.cuda.get_device_name(0) if torch.cuda.is_available()
            else "n/a (no GPU)", "GPUs": str(torch.cuda.device_count()), "GPU architecture": gpu_architecture(),
            "GPU memory": mem, "ROCm": rocm_version(), "RCCL": rccl_version(), "hipBLASLt": hipblaslt_status()}


# What an MI300X node should show (seed 001 and AMD's system-optimization guide).
MI300X_EXPECTS = {"NUMA auto-balancing": "0 (disabled)", "GPU": "AMD Instinct MI300X", "GPUs": "8",
                  "GPU architecture": "gfx942", "GPU memory": "about 192 GiB",
                  "ROCm": "6.3 or newer (image v25.3: 6.3.0)", "RCCL": "RCCL 2.x", "hipBLASLt": "available"}


def validate_rocm(facts: dict[str, str] | None = None) -> list[dict]:
    """Rows of check, value, what an MI300X node expects, and ok (True, False, or None where the
    check does not apply to this machine, e.g. ROCm facts on a CUDA or CPU machine)."""
    facts = rocm_facts() if facts is None else facts

    def ok(key: str, value: str):
        if value.startswith("n/a") or value.startswith("unavailable"):
            return None
        if key == "NUMA auto-balancing":
            return value.startswith("0")
        if key == "GPU architecture":
            return value.startswith("gfx942") if value.startswith("gfx") else None
        if key == "ROCm":
            try:
                major, minor = (int(x) for x in value.split(".")[:2])
            except ValueError:
                return None
            return (major, minor) >= (6, 3)
        if key == "RCCL":
            return value.startswith("RCCL")
        if key == "hipBLASLt":
            return value.startswith("available")
        if key == "GPU memory":
            return float(value.split()[0]) >= 180 if "gfx942" in facts.get("GPU architecture", "") else None
        return None

    return [{"check": k, "value": v, "MI300X expects": MI300X_EXPECTS.get(k, ""), "ok": ok(k, v)}
            for k, v in facts.items()]
