#!/usr/bin/env python3
"""Check that this Python environment can run the course; print one line per check, exit 1 if any fails.

Both workshop images run it at the end of their build (docker/Dockerfile.rocm, docker/Dockerfile.cuda), so a
base image whose torch the course's libraries refuse fails the build, not the workshop's first notebook:

- Python and torch meet the floors that pyproject.toml declares (``requires-python``, the ``torch>=`` requirement);
- transformers sees torch (``transformers.utils.is_torch_available()``: transformers 5 switches torch off below
  2.6.0 and reads a pre-release such as NGC 25.01's ``2.6.0a0`` as older than 2.6.0, so it cannot build a model);
- accelerate allows FSDP2 (``FullyShardedDataParallelPlugin(fsdp_version=2)`` raises below accelerate's minimum);
- DeepSpeed's ops load (``--deepspeed-ops``); with ``--prebuilt`` they must be the ones compiled into the install
  for the accelerator in use (DeepSpeed records it), not a JIT build on the first GPU that needs them;
- torch is built for the GPU stack that ``--gpu`` names (rocm or cuda);
- the optional packages that ``--packages`` names (torchao, bitsandbytes) import and run: the course's own probes,
  the ones its preflight and notebooks decide from (``course_lib.fp8_compute.torchao_fp8_runs``: one step of torchao's
  float8 training; ``course_lib.qlora.bitsandbytes_4bit_runs``: NF4 quantise, dequantise, ``matmul_4bit`` forward and
  backward), on ``--device`` (default: the GPU where torch sees one, else the CPU, as at build time).

``--torch-version V`` decides as if the installed torch distribution reported version V. transformers and
accelerate read torch's version from its distribution metadata (``importlib.metadata``), not from
``torch.__version__``; the script puts a ``torch-V.dist-info`` first on ``sys.path``, so the libraries' own
code decides about V (tests/test_docker.py feeds it the images' torch versions, which this machine lacks).

    python docker/check_image.py [--gpu rocm|cuda] [--deepspeed-ops cpu_adam,fused_adam] [--prebuilt]
                                 [--packages torchao,bitsandbytes] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import re
import sys
import tempfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

try:  # Python >= 3.11; the floor (3.10) reads pyproject.toml with the fallback in read_floors
    import tomllib
except ImportError:
    tomllib = None

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def read_floors(pyproject: Path) -> tuple[SpecifierSet, SpecifierSet]:
    """(requires-python, torch's specifier) as pyproject.toml declares them."""
    text = pyproject.read_text()
    if tomllib is not None:
        project = tomllib.loads(text)["project"]
        python, deps = project["requires-python"], project["dependencies"]
    else:
        python = re.search(r'^requires-python\s*=\s*"([^"]+)"', text, re.M).group(1)
        deps = re.findall(r'^\s*"(torch\b[^"]*)"', text, re.M)
    torch = next(Requirement(d) for d in deps if Requirement(d).name == "torch")
    return SpecifierSet(python), torch.specifier


def pretend_torch_version(version: str) -> None:
    """Make importlib.metadata report torch ``version`` (a dist-info placed first on sys.path)."""
    Version(version)  # a clear error for a version that is not PEP 440
    folder = Path(tempfile.mkdtemp(prefix="check-image-")) / f"torch-{version}.dist-info"
    folder.mkdir()
    (folder / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    sys.path.insert(0, str(folder.parent))
    importlib.invalidate_caches()


def check_python(floor: SpecifierSet) -> tuple[bool, str]:
    """Whether this interpreter meets requires-python."""
    here = ".".join(map(str, sys.version_info[:3]))
    if floor.contains(here):
        return True, f"Python {here} meets requires-python {floor}"
    return False, (f"Python {here} is below the course's requires-python {floor} (pyproject.toml): "
                   "use a base image with a newer Python")


def check_torch_floor(floor: SpecifierSet) -> tuple[bool, str]:
    """Whether the torch distribution meets the course's torch requirement (pre-releases count, as pip sees them)."""
    found = importlib.metadata.version("torch")
    if floor.contains(found, prereleases=True):
        return True, f"torch {found} meets the course's floor torch{floor}"
    return False, (f"torch {found} is below the course's floor torch{floor} (pyproject.toml): base the image on a "
                   "tag whose torch meets it (docker/README.md lists the tags and their torch)")


def check_transformers_sees_torch() -> tuple[bool, str]:
    """Whether transformers enables torch (it cannot build a model otherwise)."""
    # imported here, not at the top: --torch-version must be in place before transformers reads torch's version
    import transformers
    from transformers.utils import is_torch_available

    found = importlib.metadata.version("torch")
    if is_torch_available():
        return True, f"transformers {transformers.__version__} sees torch {found}"
    return False, (f"transformers {transformers.__version__} does not see torch {found} (is_torch_available() is "
                   "False): transformers 5 switches torch off below 2.6.0 and reads a pre-release such as 2.6.0a0 "
                   "as older than 2.6.0. Base the image on a tag whose torch meets the course's floor")


def check_fsdp2() -> tuple[bool, str]:
    """Whether accelerate allows FSDP2, the FSDP the course's accelerate configs use (fsdp_version: 2)."""
    import accelerate  # after --torch-version, like transformers: accelerate reads torch's version on import
    from accelerate.utils import FullyShardedDataParallelPlugin

    try:
        FullyShardedDataParallelPlugin(fsdp_version=2)
    except ImportError as e:
        return False, (f"accelerate {accelerate.__version__} refuses FSDP2 with torch "
                       f"{importlib.metadata.version('torch')}: {e}. Base the image on a tag whose torch meets it")
    return True, f"accelerate {accelerate.__version__} allows FSDP2"


def check_deepspeed_ops(names: list[str], prebuilt: bool) -> tuple[bool, str]:
    """Whether DeepSpeed's ops ``names`` load for its accelerator (with ``prebuilt``: from the compiled install)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import accelerator_name, installed_ops
    from deepspeed.ops.op_builder.all_ops import ALL_OPS

    accel = get_accelerator()._name
    for name in names:
        if name not in ALL_OPS:
            return False, (f"DeepSpeed {deepspeed.__version__} has no op {name!r} for accelerator {accel!r}: "
                           f"{sorted(ALL_OPS)}")
        if prebuilt and not (installed_ops.get(name) and accelerator_name == accel):
            return False, (f"DeepSpeed's {name} op was not compiled into the install for accelerator {accel!r} "
                           f"(built for {accelerator_name!r}, prebuilt: {installed_ops.get(name, False)}): reinstall "
                           f"DeepSpeed with DS_ACCELERATOR={accel} DS_BUILD_{name.upper()}=1 --no-build-isolation")
        try:
            ALL_OPS[name].load()
        except Exception as e:  # a failed build or import: say which op, and why
            return False, f"DeepSpeed's {name} op does not load for accelerator {accel!r}: {type(e).__name__}: {e}"
    how = "prebuilt" if prebuilt else "loaded"
    return True, f"DeepSpeed {deepspeed.__version__}: {', '.join(names)} {how} for accelerator {accel!r}"


def check_gpu_build(gpu: str) -> tuple[bool, str]:
    """Whether torch is built for ROCm (``torch.version.hip``) or CUDA (``torch.version.cuda``)."""
    import torch

    found = torch.version.hip if gpu == "rocm" else torch.version.cuda
    if found:
        return True, f"torch {torch.__version__} is built for {gpu} {found}"
    return False, f"torch {torch.__version__} is not a {gpu} build: the base image's torch was replaced or is CPU-only"


# the optional packages --packages can name: (module, probe, what of the course needs it). Each probe returns None
# when the package runs on the device, else why not with the install command; the course's preflight calls the same.
PACKAGE_PROBES = {
    "torchao": ("course_lib.fp8_compute", "torchao_fp8_runs", "notebook 02's FP8 training"),
    "bitsandbytes": ("course_lib.qlora", "bitsandbytes_4bit_runs", "notebook 12's QLoRA comparison"),
}


def default_device() -> str:
    """The GPU where torch sees one (ROCm's too is "cuda"), else the CPU (an image's build has no GPU)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_package(name: str, device: str) -> tuple[bool, str]:
    """Whether the optional package ``name`` imports and runs on ``device`` (the course's own probe of it)."""
    module, probe, needed_by = PACKAGE_PROBES[name]
    why = getattr(importlib.import_module(module), probe)(device)
    if why:
        return False, f"{why} ({needed_by} shows it 'absent')"
    return True, f"{name} {importlib.metadata.version(name)} imports and runs on {device} ({needed_by})"


def run_checks(args: argparse.Namespace) -> list[tuple[str, bool, str]]:
    """Every check, in order: (name, passed, what it found or what to change)."""
    python_floor, torch_floor = read_floors(args.pyproject)
    checks = [("python", lambda: check_python(python_floor)), ("torch", lambda: check_torch_floor(torch_floor)),
              ("transformers", check_transformers_sees_torch), ("fsdp2", check_fsdp2)]
    ops = [o for o in args.deepspeed_ops.split(",") if o]
    if ops:
        checks.append(("deepspeed", lambda: check_deepspeed_ops(ops, args.prebuilt)))
    if args.gpu:
        checks.append((args.gpu, lambda: check_gpu_build(args.gpu)))
    for name in (p for p in args.packages.split(",") if p):
        checks.append((name, lambda name=name: check_package(name, args.device or default_device())))
    results = []
    for name, check in checks:
        try:
            results.append((name, *check()))
        except Exception as e:  # a check that cannot even run is a failed check, reported like the others
            results.append((name, False, f"{type(e).__name__}: {e}"))
    return results


def _packages(value: str) -> str:
    unknown = [p for p in value.split(",") if p and p not in PACKAGE_PROBES]
    if unknown:
        raise argparse.ArgumentTypeError(f"no check for {', '.join(unknown)}: choose from {', '.join(PACKAGE_PROBES)}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pyproject", type=Path, default=PYPROJECT, help="where the floors are declared")
    parser.add_argument("--torch-version", help="decide as if the installed torch distribution reported this version")
    parser.add_argument("--deepspeed-ops", default="cpu_adam",
                        help="comma-separated DeepSpeed ops that must load ('' skips)")
    parser.add_argument("--prebuilt", action="store_true", help="the ops must be compiled into DeepSpeed's install")
    parser.add_argument("--gpu", choices=("rocm", "cuda"), help="torch must be built for this GPU stack")
    parser.add_argument("--packages", default="", type=_packages,
                        help="comma-separated optional packages that must import and run "
                             f"({', '.join(PACKAGE_PROBES)})")
    parser.add_argument("--device", help="where --packages run (default: cuda where torch sees a GPU, else cpu)")
    args = parser.parse_args(argv)
    if args.torch_version:
        pretend_torch_version(args.torch_version)
    results = run_checks(args)
    for name, ok, detail in results:
        print(f"{'ok  ' if ok else 'FAIL'} {name:<12} {detail}", flush=True)
    failed = [name for name, ok, _ in results if not ok]
    if failed:
        print(f"check_image: {len(failed)} check(s) failed ({', '.join(failed)}): the course cannot run here",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
