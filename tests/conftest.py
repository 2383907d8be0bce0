"""Shared fixtures: execute a solutions notebook once per test session, read what it recorded.

``make test`` runs the suite on two pytest-xdist workers (``--dist loadgroup``): nearly every test process
works one core (a notebook's kernel, nbgrader's autograde), so two of them keep a 2-core machine busy. Each
test module runs whole on one worker, so its module- and session-scoped fixtures (a notebook executed once,
a running hub) are built once; test_grading's gradings, the largest part of the suite, go in two lanes.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Under xdist each worker, and every kernel and process it starts, computes on one OpenMP thread: two workers
# with a thread per core each put four spinning OpenMP threads on two cores, which ran notebook 11's CPU tier
# past papermill's 10-minute limit instead of its 2 minutes. (course_lib.launch keeps a value already set.)
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
# Grading refuses to run as root (course_grader.sandbox.refuse_root) unless told the root is a throwaway container:
# CI's is one, so the suite, as root, says so for every grader it starts.
if os.geteuid() == 0:
    os.environ.setdefault("COURSE_GRADE_AS_ROOT", "1")
# DeepSpeed's CPU op where `make setup` built it (make and .ci/run export this; plain `pytest` gets it here). Imported
# after the thread settings above: importing torch reads them.
from course_lib.launch import use_extensions_dir  # noqa: E402

import selection  # noqa: E402 (tests/selection.py: the gate's choice of tests)

use_extensions_dir()
TIMES: dict[str, float] = {}
# The items whose code can start DeepSpeed (selection.needs_deepspeed_ops): its ops are built before the first runs.
NEEDS_OPS: set[str] = set()
OPS_READY = False


@pytest.fixture(scope="session")
def course_run_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("course_run")


def build_deepspeed_ops() -> None:
    """DeepSpeed's CPU ops (comm, CPU Adam), compiled once into TORCH_EXTENSIONS_DIR, as `make ops` does, before a
    timed or graded cell would pay for them; a later call finds them built. Two workers asking at once: one compiles,
    the other waits on the lock."""
    global OPS_READY
    if OPS_READY:
        return
    lock = Path(os.environ["TORCH_EXTENSIONS_DIR"]) / ".course-ops.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""}
        subprocess.run([sys.executable, "-c", "from course_lib.parallel.zero_deepspeed import build_deepspeed_ops; "
                        "build_deepspeed_ops()"], env=env, check=True, cwd=ROOT)
    OPS_READY = True


@pytest.fixture(scope="session")
def deepspeed_ops():
    """DeepSpeed's CPU ops built (``build_deepspeed_ops``): for a fixture that needs them before its tests start."""
    build_deepspeed_ops()


@pytest.hookimpl(tryfirst=True)  # before the item's fixtures: a module's fixture may run notebook 09
def pytest_runtest_setup(item):
    if item.nodeid in NEEDS_OPS:
        build_deepspeed_ops()


@pytest.fixture(scope="session")
def student_edition(tmp_path_factory) -> Path:
    """The student edition (course_lib with every graded reference a stub, the release notebooks), built once."""
    from course_grader.edition import build_student_edition

    return build_student_edition(tmp_path_factory.mktemp("student") / "edition")


@pytest.fixture(scope="session")
def executed(course_run_dir, student_edition):
    """``executed("03_gradient_accumulation")`` → the results dict that notebook recorded on the CPU tier.

    The notebook is the student's: the student edition's release with a correct student's answers in its solution
    cells, run top to bottom (papermill, a real kernel) on the edition's stubbed course_lib, as a student on a laptop
    runs it. So one execution checks the notebook's measurements and the student's side: a failing cell fails the
    test with papermill's error naming the cell, and a test cell that Validate would fail (an error, or anything on
    stderr) fails it too. Each notebook runs once per session.
    """
    from course_lib import results
    from course_grader import student_path
    from course_lib.apps.run_all import execute

    cache: dict[str, dict] = {}

    def run(name: str, tier: str = "cpu") -> dict:
        if name not in cache:
            nb = student_path.write_answers(name, student_edition)
            with student_path.student_process(student_edition, course_run_dir):
                TIMES[name] = execute(nb, course_run_dir, {"tier": tier}, timeout=600)
            ran = json.loads((course_run_dir / "executed" / nb.name).read_text())
            noisy = student_path.failed_tests(ran)
            assert not noisy, f"{name}: test cells that Validate fails, with what they printed: {noisy}"
            cache[name] = results.load(name, course_run_dir)
            cache[name]["seconds"] = TIMES[name]
        return cache[name]

    return run


# Modules that read another module's executed notebook run on its worker (the session cache is per worker).
SAME_WORKER = {"test_run_all": "test_notebook_03", "test_notebook_12": "test_notebook_11"}
# Modules that `make test` runs after the workers, by themselves: Chromium, a lab or a hub and their kernels
# on fixed time limits, and the measured pipeline bubbles of notebook 15 and test_pp (sleep-padded stages, held
# to 10%), which a second worker on the same two cores pushed past their limits.
ALONE = {"test_browser", "test_hub", "test_notebook_15", "test_pp"}
# The grading tests (the checks on every notebook's known submissions, and nbgrader's whole autograde on 00) run
# first, in two lanes: the assignments whose tests start several ranks on one worker, those that run in one process
# (and the instructor's flow, which grades notebook 00) on the other. Two multi-rank gradings side by side put four
# ranks on two cores, and every collective then waits for a rank the scheduler put aside: each ran about
# 15% slower than beside a one-process test. The other modules follow, the longest first, shared out as the
# workers free up.
MULTI_RANK_GRADING = {"06_ddp", "07_ddp_reducer", "08_fsdp", "09_deepspeed_zero", "14_tensor_parallelism",
                      "15_pipeline_parallelism", "16_context_parallelism", "17_expert_parallelism"}
LANES = ["grading with ranks", "grading in one process"]
# node emulation: 12 min of a worker; the untouched release through Validate: 4
LONGEST_FIRST = ["test_node_emulation", "test_student_path", "test_notebook_09", "test_notebook_11"]


def group_of(item) -> str:
    """The xdist group (the unit one worker runs whole) of a test: its module, or its grading lane."""
    module = item.path.stem
    if module == "test_grading":
        return LANES[0] if item.callspec.params["assignment"] in MULTI_RANK_GRADING else LANES[1]
    if module == "test_instructor_flow":
        return LANES[1]
    return SAME_WORKER.get(module, module)


def pytest_addoption(parser):
    parser.addoption("--gate", action="store_true",
                     help="run only what the change since the last whole-suite pass can break (tests/selection.py)")


GATE: selection.Selection | None = None  # the gate's selection in this process, under --gate


def pytest_report_header(config):
    if config.getoption("gate"):
        return selection.Selection(selection.base()).describe()


@pytest.fixture(scope="session")
def gate() -> selection.Selection | None:
    """The gate's selection when the suite runs as the gate (``make test``), None for the whole suite."""
    return GATE


def _where(item) -> tuple[str, str, str]:
    """(module path, parameters, function name) of an item: what tests/selection.py reads of it."""
    return (item.path.resolve().relative_to(ROOT).as_posix(), getattr(getattr(item, "callspec", None), "id", ""),
            getattr(item, "originalname", ""))


def _gate(config, items) -> None:
    """Under --gate, deselect every item the change cannot reach (tests/selection.py)."""
    global GATE
    GATE = selection.Selection(selection.base())
    kept = [item for item in items if GATE.keeps(*_where(item))]
    if len(kept) < len(items):
        ids = {id(item) for item in kept}
        config.hook.pytest_deselected(items=[item for item in items if id(item) not in ids])
        items[:] = kept


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by these marks
def pytest_collection_modifyitems(config, items):
    if config.getoption("gate"):
        _gate(config, items)
    NEEDS_OPS.update(item.nodeid for item in items if selection.needs_deepspeed_ops(*_where(item)))
    first = LANES + LONGEST_FIRST  # `make test` passes --no-loadscope-reorder: the workers take units in this order
    items.sort(key=lambda item: first.index(group_of(item)) if group_of(item) in first else len(first))  # stable
    for item in items:
        if item.path.stem in ALONE:
            item.add_marker(pytest.mark.alone)
        item.add_marker(pytest.mark.xdist_group(group_of(item)))


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # an xdist worker: hand the notebook times to the controller
        session.config.workeroutput["notebook_times"] = json.dumps(TIMES)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    TIMES.update(json.loads(getattr(node, "workeroutput", {}).get("notebook_times", "{}")))


def pytest_terminal_summary(terminalreporter):
    if TIMES:
        terminalreporter.section("notebook execution times (CPU tier, papermill)")
        for name, seconds in TIMES.items():
            terminalreporter.write_line(f"{name}: {seconds:.1f} s")
