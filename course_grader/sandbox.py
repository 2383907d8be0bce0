"""Grading's sandbox: run a command that can reach only the folders it is given (Linux Landlock).

    python -m course_grader.sandbox --read /usr /opt/venv --write /tmp/scratch -- \
        python -m ipykernel_launcher -f k.json

Autograde runs a student's solution cells with the grader's rights. Without a fence a cell can read
solutions/, the hidden tests and the instructor's course_lib (every graded reference), or open the grader's
gradebook.db three folders up and write its own grades. nbgrader_config.py starts the grading kernel through
this module, so the kernel (and every process it starts: torchrun, its ranks, DeepSpeed's) opens nothing but
the read-only list and the read-write list; everything else fails with PermissionError, as if it were not there.

Landlock is the kernel's unprivileged sandbox (Linux >= 5.13): a process restricts itself, the ruleset is
inherited by every child and can never be lifted. Each ABI version handles more rights (2: moving files across
folders, 3: truncating, 5: ioctl on devices); we handle every right the running kernel knows, so none is left
open by default. From ABI 6 the kernel is also scoped: it cannot signal, or connect to the abstract unix sockets
of, processes outside the sandbox (nbgrader itself, the instructor's other processes).

Not fenced (say so when grading for credit): the network (TCP and UDP; gloo and the kernel's own sockets need
localhost) and connecting to named unix sockets; reading what the allowed folders hold (the Python installation,
/etc, /sys, and /proc, where the environment of the user's other processes can be read, though not their memory);
CPU time, memory and disk use; anything the user running the grader may do that is not a file (as root: much).
``/dev/shm`` is writable (DeepSpeed's shm comm and multiprocessing need it) but private where the kernel allows
(``private_shm``): the fenced process gets an empty one of its own, so nothing one grading leaves there is read by
the next.

Where Landlock is missing, ``restrict`` refuses, unless ``COURSE_GRADE_UNSANDBOXED=1``: then it warns and runs
the command unfenced, and the scores it produces are not class-safe (a submission can read the answers and
write the gradebook). This module uses the standard library only, so it can run before anything else loads.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import platform
import shutil
import stat
import sys
import tempfile

# landlock_create_ruleset, landlock_add_rule, landlock_restrict_self: the same numbers in the generic syscall
# table (aarch64) and x86_64's.
SYSCALLS = {"x86_64": (444, 445, 446), "aarch64": (444, 445, 446)}
PR_SET_NO_NEW_PRIVS = 38
CREATE_RULESET_VERSION = 1 << 0
RULE_PATH_BENEATH = 1

# Filesystem rights (linux/landlock.h): ABI 1 knows the first 13 bits.
EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
ABI1_RIGHTS = (1 << 13) - 1  # also remove dir/file, make char/dir/reg/sock/fifo/block/symlink
REFER, TRUNCATE, IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15  # ABI 2, 3, 5
FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV  # the only rights a rule on a file may hold
READ_RIGHTS = EXECUTE | READ_FILE | READ_DIR
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6
UNSANDBOXED = "COURSE_GRADE_UNSANDBOXED"


class SandboxUnavailable(RuntimeError):
    """Raised where Landlock is missing and grading was not explicitly allowed to run unfenced."""


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1  # the kernel's struct is packed: 12 bytes
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _syscall(which: int, *args) -> int:
    """Call one of the three Landlock syscalls; raise OSError with the kernel's errno if it fails."""
    result = _libc.syscall(ctypes.c_long(SYSCALLS[platform.machine()][which]), *args)
    if result < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"landlock syscall {which}: {os.strerror(errno)}")
    return result


def landlock_abi() -> int:
    """The Landlock ABI version of the running kernel: 0 where it has none (not Linux, too old, or disabled)."""
    if sys.platform != "linux" or platform.machine() not in SYSCALLS:
        return 0
    try:
        return _syscall(0, None, ctypes.c_size_t(0), ctypes.c_uint32(CREATE_RULESET_VERSION))
    except OSError:  # ENOSYS: before 5.13; EOPNOTSUPP: built but not enabled at boot
        return 0


def handled_rights(abi: int) -> int:
    """Every filesystem right the kernel of this ABI can check: all of them are denied unless a rule allows them."""
    rights = ABI1_RIGHTS
    rights |= REFER if abi >= 2 else 0
    rights |= TRUNCATE if abi >= 3 else 0
    rights |= IOCTL_DEV if abi >= 5 else 0
    return rights


def _allow(ruleset: int, path: str, rights: int) -> None:
    """Allow ``rights`` beneath ``path`` (a folder and everything in it, or one file); a missing path is skipped."""
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            rights &= FILE_RIGHTS  # the kernel refuses folder rights (list, create, remove) on a file
        rule = _PathBeneathAttr(rights, fd)
        _syscall(1, ctypes.c_int(ruleset), ctypes.c_int(RULE_PATH_BENEATH), ctypes.byref(rule), ctypes.c_uint32(0))
    finally:
        os.close(fd)


def _unavailable() -> None:
    """Refuse to run unfenced, unless the grader said so; then say loudly that the scores are not class-safe."""
    if os.environ.get(UNSANDBOXED) == "1":
        print(f"WARNING: {UNSANDBOXED}=1 and this kernel has no Landlock: the grading kernel runs UNSANDBOXED. "
              "A submission can read solutions/ and the instructor's course_lib and write gradebook.db: "
              "these scores are NOT safe to give for credit.", file=sys.stderr, flush=True)
        return
    raise SandboxUnavailable(
        "grading runs each submission in a Landlock sandbox, and this system has none: the grader needs Linux >= 5.13 "
        "with Landlock enabled ('landlock' in /sys/kernel/security/lsm; add it to the kernel's lsm= boot parameter). "
        f"To grade anyway, for practice only, set {UNSANDBOXED}=1 (the scores are then not class-safe).")


def restrict(read: list[str], write: list[str]) -> None:
    """Fence this process and every child it starts from now on, irrevocably: ``read`` paths can be read and
    executed, ``write`` paths read and changed in every way, and nothing else on the filesystem can be opened."""
    abi = landlock_abi()
    if abi == 0:
        return _unavailable()
    handled = handled_rights(abi)
    attr = _RulesetAttr(handled, 0, SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0)
    ruleset = _syscall(0, ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)), ctypes.c_uint32(0))
    try:
        for path in read:
            _allow(ruleset, path, READ_RIGHTS)
        for path in write:
            _allow(ruleset, path, handled)
        # Landlock requires it of an unprivileged process, and it keeps a setuid program from shedding the fence
        if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
        _syscall(2, ctypes.c_int(ruleset), ctypes.c_uint32(0))
    finally:
        os.close(ruleset)


# ---------------------------------------------------------------- a /dev/shm of its own
CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x4000, 0x40000
PR_GET_DUMPABLE, PR_SET_DUMPABLE = 3, 4
SHM_SIZE = 1 << 30  # bytes: DeepSpeed's shm comm and torch's shared tensors need megabytes at the course's sizes


def _write_proc(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def private_shm(size: int = SHM_SIZE) -> bool:
    """Give this process, and every process it starts from now on, a ``/dev/shm`` of its own: an empty tmpfs of
    ``size`` bytes in a mount namespace of its own (for an ordinary user, inside a user namespace that maps the user
    to itself). What a grading leaves in shared memory then goes with its last process, and no grading reads another's.
    Call it single-threaded (a fork's child, or before any thread starts) and before ``restrict`` (a fenced process
    cannot mount). False where the kernel or a container's seccomp profile refuses the namespaces (Docker's default
    profile does): ``/dev/shm`` then stays the machine's, and the caller must clear what a grading leaves there."""
    uid, gid = os.geteuid(), os.getegid()
    if _libc.unshare(CLONE_NEWNS | (0 if uid == 0 else CLONE_NEWUSER)) != 0:
        return False
    if uid != 0:
        dumpable = _libc.prctl(PR_GET_DUMPABLE, 0, 0, 0, 0)
        _libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # a non-dumpable process's /proc/self is root's: it could not map
        try:
            _write_proc("/proc/self/setgroups", "deny")
            _write_proc("/proc/self/uid_map", f"{uid} {uid} 1")
            _write_proc("/proc/self/gid_map", f"{gid} {gid} 1")
        except OSError:
            return False
        finally:
            _libc.prctl(PR_SET_DUMPABLE, dumpable, 0, 0, 0)
    # mounts from here on stay in this namespace; then the fresh tmpfs over the machine's /dev/shm
    if _libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return False
    options = f"size={size},mode=1777".encode()
    return _libc.mount(b"shm", b"/dev/shm", b"tmpfs", MS_NOSUID | MS_NODEV, options) == 0


def shm_can_be_private() -> bool:
    """Whether ``private_shm`` works on this machine: tried in a child process that exits at once."""
    pid = os.fork()
    if pid == 0:
        os._exit(0 if private_shm() else 1)
    return os.waitpid(pid, 0)[1] == 0


def clear_shm(before: set[str], root: str = "/dev/shm") -> list[str]:
    """Where ``private_shm`` could not be had: remove what this user created in ``root`` since ``before`` (its names
    then), so that the next grading does not read it. Returns the names removed."""
    removed = []
    for name in sorted(set(os.listdir(root)) - before):
        path = os.path.join(root, name)
        try:
            if os.lstat(path).st_uid != os.geteuid():
                continue
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
            removed.append(name)
        except FileNotFoundError:
            continue
    return removed


# ---------------------------------------------------------------- what a grading process may reach
# The grading kernel (nbgrader_config.py) and the process that runs a submission's code for the checks
# (course_grader.grade) are fenced alike: they read the Python installation, the system folders and the
# student edition of course_lib (first on PYTHONPATH); they write one fresh scratch folder.
SYSTEM_READ = ["/usr", "/lib", "/lib64", "/bin", "/etc", "/proc", "/sys",
               "/dev/urandom", "/dev/random", "/dev/zero", "/dev/full", "/dev/fd"]
# Writable devices: /dev/null, shared memory (DeepSpeed's shm comm, multiprocessing), and the GPUs where they exist
# (CUDA and ROCm open their device files read-write and drive them with ioctls).
DEVICES_WRITE = ["/dev/null", "/dev/shm", "/dev/kfd", "/dev/dri", *glob.glob("/dev/nvidia*")]


def installation(edition_cache: str) -> list[str]:
    """The Python installation a grading process runs (the venv and the Python it was made from), less the folder
    of student-edition builds when it lies inside the venv: an older build may predate a graded reference's stub.
    Also every site-packages on ``sys.path`` outside those prefixes (a venv made by a Python that is itself a venv
    sees its maker's packages through a .pth: rocm/primus keeps torch in /opt/venv) and ROCm's installation, which
    a ROCm torch loads its libraries and kernels from as it runs (/opt/rocm*)."""
    read, cache = [], os.path.realpath(edition_cache)
    prefixes = sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)})
    for prefix in prefixes:
        if os.path.dirname(cache) == prefix:
            read += [os.path.join(prefix, e) for e in os.listdir(prefix) if os.path.join(prefix, e) != cache]
        else:
            read.append(prefix)
    inside = lambda path: any(path == p or path.startswith(p.rstrip("/") + "/") for p in prefixes)  # noqa: E731
    for entry in map(os.path.realpath, sys.path):
        if os.path.basename(entry) in ("site-packages", "dist-packages") and not inside(entry) and entry not in read:
            read.append(entry)
    return read + sorted(os.path.realpath(p) for p in glob.glob("/opt/rocm*") if os.path.isdir(p))


def allow_lists(writable: list[str], scratch: str, readable: list[str], edition_cache: str, edition_path: str,
                instructor: list[str]) -> tuple[list[str], list[str]]:
    """What a grading process may read, and what it may write: refuses if the instructor's course_lib or
    course_grader (the folders ``instructor``: graded references, hidden checks) would be readable through any."""
    read = [*installation(edition_cache), *SYSTEM_READ, edition_path, *(os.path.realpath(p) for p in readable)]
    write = [scratch, *writable, *DEVICES_WRITE]
    for folder in map(os.path.realpath, instructor):
        exposed = [p for p in read + write if folder == p or folder.startswith(p.rstrip("/") + "/")]
        if exposed:
            raise RuntimeError(f"the instructor's {folder} lies inside {exposed}, which a grading process can read: "
                               "install the course editable (pip install -e .) so that it stays outside")
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


# What of the grader's environment a grading process keeps: the names a Python, torch, its devices and its
# launchers read. Anything else (the instructor's tokens and keys among it) stays out of reach of the student's
# code, which could print it into the notebook that goes back as feedback.
ENV_KEPT = ("PATH", "LANG", "LANGUAGE", "TZ", "TERM", "LD_LIBRARY_PATH", "CC", "CXX", "VIRTUAL_ENV", "MPLBACKEND",
            "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
ENV_KEPT_PREFIXES = ("LC_", "PYTHON", "CUDA_", "NVIDIA_", "HIP_", "ROCM_", "ROCR_", "HSA_", "PYTORCH_", "TORCH_",
                     "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "NCCL_", "GLOO_", "DS_", "HF_", "TRANSFORMERS_",
                     "TOKENIZERS_", "TRITON_", "COURSE_", "NBGRADER_", "JUPYTER_", "JPY_", "CONDA_")
ENV_SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "_KEY", "AUTH")
AS_ROOT = "COURSE_GRADE_AS_ROOT"


def scrubbed(env: dict) -> dict:
    """The part of ``env`` a grading process keeps (``ENV_KEPT``, ``ENV_KEPT_PREFIXES``), less any name that reads
    like a secret (``ENV_SECRET_WORDS``: HF_TOKEN, say)."""
    return {k: v for k, v in env.items()
            if (k in ENV_KEPT or k.startswith(ENV_KEPT_PREFIXES)) and not any(w in k.upper() for w in ENV_SECRET_WORDS)}


def refuse_root() -> None:
    """Grading runs a student's code; as root, the fence leaves much open (every process's memory maps and
    environment under /proc, devices, signals to anything). Refuse, unless ``COURSE_GRADE_AS_ROOT=1`` says this root
    is itself a throwaway sandbox (a CI container); then say so. Either way this process becomes non-dumpable, so a
    grading process of another user cannot read its environment or memory through /proc."""
    _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    if os.geteuid() != 0:
        return
    if os.environ.get(AS_ROOT) == "1":
        print(f"WARNING: grading as root ({AS_ROOT}=1): only in a throwaway container", file=sys.stderr, flush=True)
        return
    raise SandboxUnavailable(f"grading runs students' code and refuses to run as root: run nbgrader as an ordinary "
                             f"user (the course's images do), or set {AS_ROOT}=1 inside a throwaway container")


def grading_env(env: dict, scratch: str, edition_path: str) -> dict:
    """A grading process's environment: the grader's ``scrubbed``, the student edition first on PYTHONPATH, every
    home and cache in the scratch folder."""
    env = scrubbed(env)
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in (edition_path, env.get("PYTHONPATH")) if p),
            "HOME": scratch, "TMPDIR": os.path.join(scratch, "tmp"), "XDG_CACHE_HOME": os.path.join(scratch, "cache"),
            "MPLCONFIGDIR": os.path.join(scratch, "matplotlib"), "COURSE_RUN_DIR": os.path.join(scratch, "runs"),
            "TORCH_EXTENSIONS_DIR": os.path.join(scratch, "torch_extensions")}


def fenced(command: list[str], read: list[str], write: list[str]) -> list[str]:
    """``command`` started through this module: it runs with only ``read`` and ``write`` reachable."""
    return [sys.executable, "-I", os.path.abspath(__file__), "--read", *read, "--write", *write, "--", *command]


def main(argv: list[str] | None = None) -> None:
    """``python -m course_grader.sandbox --read P... --write P... -- CMD ARGS...``: restrict, then exec CMD."""
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        sys.exit("usage: python -m course_grader.sandbox [--read PATH...] [--write PATH...] -- COMMAND [ARGS...]")
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m course_grader.sandbox", description=__doc__.splitlines()[0])
    parser.add_argument("--read", nargs="*", default=[], help="paths the command may read and execute")
    parser.add_argument("--write", nargs="*", default=[], help="paths the command may read and change")
    args = parser.parse_args(argv[:split])
    command = argv[split + 1:]
    try:
        private_shm()  # before the fence: a fenced process cannot mount
        restrict(args.read, args.write)
    except SandboxUnavailable as e:
        sys.exit(f"course_grader.sandbox: {e}")
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
