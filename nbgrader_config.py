"""nbgrader configuration of the course: run nbgrader's commands from the project root.

solutions/<assignment>/<assignment>.ipynb is the source (one notebook per assignment);
``nbgrader generate_assignment`` writes release/, and ``python -m course_lib.release``
copies that into notebooks/ (committed, so a clone opens and runs with no instructor step).
Collected work goes to submitted/<student>/<assignment>/; ``nbgrader autograde``,
``generate_feedback`` and ``export`` do the rest (see README, "Grading").
"""

import glob
import importlib.util
import os
import shutil
import sys
import tempfile

from jupyter_client.manager import AsyncKernelManager
from nbgrader.converters.autograde import Autograde
from nbgrader.preprocessors import Execute

c = get_config()  # noqa: F821 (nbgrader provides it)

c.CourseDirectory.course_id = "scaling-pytorch-training"
c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "release"
c.CourseDirectory.submitted_directory = "submitted"
c.CourseDirectory.autograded_directory = "autograded"
c.CourseDirectory.feedback_directory = "feedback"
c.CourseDirectory.db_url = "sqlite:///" + os.path.join(os.path.dirname(os.path.abspath(__file__)), "gradebook.db")
c.CourseDirectory.ignore = [".ipynb_checkpoints", "*.pyc", "__pycache__", "runs"]

c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
c.ClearSolutions.text_stub = "YOUR ANSWER HERE"

# A cell that runs longer than this is interrupted and the notebook goes on: a submission that
# loops forever loses that exercise's points, not the whole notebook. Under nbgrader the
# notebooks pick the 'smoke' tier (tiny sizes), so no honest cell comes near it.
CELL_TIMEOUT = int(os.environ.get("COURSE_CELL_TIMEOUT", "60"))
# A solution cell only defines the student's functions and classes (the test cells after it run
# them), so it gets a shorter limit: a loop written at its top level costs 20 s, not the full limit.
SOLUTION_CELL_TIMEOUT = min(20, CELL_TIMEOUT)


def cell_timeout(cell) -> int:
    """Seconds a cell may run under autograde: the solution cells' limit or the general one."""
    return SOLUTION_CELL_TIMEOUT if cell.metadata.get("nbgrader", {}).get("solution") else CELL_TIMEOUT


c.Execute.timeout = CELL_TIMEOUT
c.Execute.timeout_func = cell_timeout
c.Execute.interrupt_on_timeout = True
c.Execute.allow_errors = True

# The grading kernel inherits this process's environment (jupyter_client copies os.environ). DeepSpeed
# JIT-builds its CPU comm op on first use, about a minute, past the cell limit above in notebook 06's
# first graded launch: point the kernel at the op `make setup` built (.venv/torch_extensions, next to the
# Python that runs nbgrader), unless the caller chose a folder (make, the images and .ci/run do).
if sys.prefix != sys.base_prefix:  # in the course's venv
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))


# ---------------------------------------------------------------- the grading kernel runs in a sandbox
# Autograde runs each submission's cells in a kernel. Unfenced, that kernel has the grader's rights: a solution
# cell could read solutions/, the hidden tests and the instructor's course_lib (every graded reference), or open
# gradebook.db and write its own grades. So the kernel starts through course_lib.sandbox (Landlock): it reads the
# Python installation, the system folders, the student edition of course_lib (first on PYTHONPATH, so `import
# course_lib` finds the student's, stubbed one) and its own submission; it writes a fresh scratch folder (HOME,
# TMPDIR, caches, COURSE_RUN_DIR) and its own autograded folder. Nothing else of the course can be opened.
# nbgrader's own processes (outside the kernel) are unchanged. COURSE_GRADE_UNSANDBOXED=1 grades without Landlock
# (practice only: the scores are then not class-safe).
SYSTEM_READ = ["/usr", "/lib", "/lib64", "/bin", "/etc", "/proc", "/sys",
               "/dev/urandom", "/dev/random", "/dev/zero", "/dev/full", "/dev/fd"]
# Writable devices: /dev/null, shared memory (DeepSpeed's shm comm, multiprocessing), and the GPUs where they exist
# (CUDA and ROCm open their device files read-write and drive them with ioctls).
DEVICES_WRITE = ["/dev/null", "/dev/shm", "/dev/kfd", "/dev/dri", *glob.glob("/dev/nvidia*")]


def course_lib_file(name: str) -> str:
    """The instructor's course_lib/<name>.py (beside this file, or the installed one), found without importing the
    package (that would load torch into every nbgrader command)."""
    beside = os.path.join(os.path.dirname(os.path.abspath(__file__)), "course_lib")
    spec = None if os.path.isdir(beside) else importlib.util.find_spec("course_lib")
    if not os.path.isdir(beside) and spec is None:
        raise RuntimeError("nbgrader cannot find course_lib: run it from the course folder, or install the course "
                           "(make setup, or pip install -e .) into the Python that runs nbgrader")
    return os.path.join(beside if spec is None else spec.submodule_search_locations[0], f"{name}.py")


def load_module(name: str):
    """course_lib/<name>.py loaded on its own: sandbox and edition use the standard library only."""
    spec = importlib.util.spec_from_file_location(f"_course_{name}", course_lib_file(name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def installation(edition) -> list[str]:
    """The Python installation the kernel runs (the venv and the Python it was made from), less the folder of
    student-edition builds when it lies inside the venv: an older build may predate a graded reference's stub."""
    read, cache = [], os.path.realpath(edition.grading_cache())
    for prefix in sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}):
        if os.path.dirname(cache) == prefix:
            read += [os.path.join(prefix, e) for e in os.listdir(prefix) if os.path.join(prefix, e) != cache]
        else:
            read.append(prefix)
    return read


def allow_lists(submission: str, scratch: str, connection_file: str, edition,
                edition_path: str) -> tuple[list[str], list[str]]:
    """What the grading kernel may read, and what it may write; refuses if the instructor's course_lib is readable."""
    read = [*installation(edition), *SYSTEM_READ, edition_path, os.path.realpath(connection_file)]
    write = [scratch, submission, *DEVICES_WRITE]
    instructor = os.path.dirname(os.path.realpath(course_lib_file("sandbox")))
    exposed = [p for p in read + write if instructor == p or instructor.startswith(p.rstrip("/") + "/")]
    if exposed:
        raise RuntimeError(f"the instructor's course_lib ({instructor}) lies inside {exposed}, which the grading kernel "
                           "can read: install the course editable (pip install -e .) so that it stays outside")
    return read, write


def scratch_folder() -> str:
    """A fresh folder for one execution: HOME, TMPDIR and the caches, with copies of what the grader has built
    (DeepSpeed's ops: a minute to rebuild, and loading them takes a lock file in their folder; matplotlib's font
    list: seconds). Copies, not links: a kernel that wrote into a shared op would run in the next student's kernel."""
    scratch = tempfile.mkdtemp(prefix="course-grade-")
    for sub in ("tmp", "cache", "runs", "matplotlib"):
        os.mkdir(os.path.join(scratch, sub))
    ops = os.environ.get("TORCH_EXTENSIONS_DIR")
    if ops and os.path.isdir(ops):
        shutil.copytree(ops, os.path.join(scratch, "torch_extensions"), symlinks=True,
                        ignore=shutil.ignore_patterns("lock"))
    fonts = os.environ.get("MPLCONFIGDIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "matplotlib")
    for font_list in glob.glob(os.path.join(fonts, "fontlist-*.json")):
        shutil.copy2(font_list, os.path.join(scratch, "matplotlib"))
    return scratch


def kernel_env(env: dict, scratch: str, edition_path: str) -> dict:
    """The kernel's environment: the student edition first on PYTHONPATH, every home and cache in the scratch."""
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in (edition_path, env.get("PYTHONPATH")) if p),
            "HOME": scratch, "TMPDIR": os.path.join(scratch, "tmp"), "XDG_CACHE_HOME": os.path.join(scratch, "cache"),
            "MPLCONFIGDIR": os.path.join(scratch, "matplotlib"), "COURSE_RUN_DIR": os.path.join(scratch, "runs"),
            "TORCH_EXTENSIONS_DIR": os.path.join(scratch, "torch_extensions")}


class SandboxedKernelManager(AsyncKernelManager):
    """A kernel started through course_lib.sandbox, with its own scratch folder (removed when the kernel is)."""

    scratch = None

    async def _async_pre_start_kernel(self, **kw):
        sandbox = load_module("sandbox")
        if sandbox.landlock_abi() == 0:
            sandbox.restrict([], [])  # raises the clear error, or warns under COURSE_GRADE_UNSANDBOXED=1
        self.scratch = self.scratch or scratch_folder()
        kw["cwd"] = kw.get("cwd") or self.scratch  # never nbgrader's own folder (the course root) by default
        submission = os.path.realpath(kw["cwd"])
        edition = load_module("edition")
        edition_path = str(edition.for_grading())
        kw["env"] = kernel_env(dict(kw.get("env") or os.environ), self.scratch, edition_path)
        cmd, kw = await super()._async_pre_start_kernel(**kw)
        read, write = allow_lists(submission, self.scratch, self.connection_file, edition, edition_path)
        return [sys.executable, "-I", course_lib_file("sandbox"), "--read", *read, "--write", *write, "--", *cmd], kw

    async def _async_cleanup_resources(self, restart: bool = False) -> None:
        await super()._async_cleanup_resources(restart=restart)
        if not restart and self.scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None


class SandboxedExecute(Execute):
    """nbgrader's Execute with the sandboxed kernel (Execute's constructor picks the kernel manager itself,
    over any c.Execute.kernel_manager_class, so the class is chosen here)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("kernel_manager_class", SandboxedKernelManager)
        super().__init__(*args, **kwargs)


c.Autograde.autograde_preprocessors = [SandboxedExecute if p is Execute else p
                                       for p in Autograde.autograde_preprocessors.default()]
