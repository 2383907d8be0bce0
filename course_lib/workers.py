"""The process torchrun starts for ``course_lib.launch.launch``.

    python -m torch.distributed.run ... -m course_lib.workers MODULE:FUNCTION OUT_DIR

It prefixes every line this rank prints with ``[rankN]``, joins the process group on this
rank's device (``distributed.init_process_group``: NCCL, or RCCL on ROCm, when there are GPUs;
gloo on CPU), calls ``FUNCTION(**kwargs)`` with the kwargs in ``OUT_DIR/kwargs.json``, and
writes the returned dict, with ``rank`` and ``world_size`` added where it lacks them, to
``OUT_DIR/rankN.json``; or, if it raises, its traceback to ``OUT_DIR/rankN.error``.
Then it leaves at once, without Python's shutdown (``exit_now`` says why).

A rank never outlives torchrun: it asks the kernel for SIGKILL when its parent ends
(``die_with_parent``), and writes its pid to ``OUT_DIR/rankN.pid`` so that ``launch`` can stop it
by pid too. torchrun starts ranks in sessions of their own and gives them 30 s after its SIGTERM;
a rank slow to die (GPU teardown, a stuck collective) would otherwise hold its GPU memory on.
"""

from __future__ import annotations

import faulthandler
import importlib
import io
import json
import os
import signal
import sys
import traceback
from pathlib import Path

import torch.distributed as dist

from course_lib.distributed import init_process_group


class RankPrefixed(io.TextIOBase):
    """A text stream that writes ``[rankN] `` at the start of every line."""

    def __init__(self, stream, rank: int):
        self.stream, self.prefix, self.at_line_start = stream, f"[rank{rank}] ", True

    def write(self, text: str) -> int:
        out = []
        for piece in text.splitlines(keepends=True):
            out.append((self.prefix if self.at_line_start else "") + piece)
            self.at_line_start = piece.endswith("\n")
        self.stream.write("".join(out))
        self.stream.flush()
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def main(argv: list[str]) -> int:
    """One rank: join the group, run ``MODULE:FUNCTION(**kwargs)``, write its result or its traceback; the exit code."""
    target, out = argv[0], Path(argv[1])
    rank = int(os.environ["RANK"])
    die_with_parent(os.environ.get("COURSE_LAUNCH_PID"))
    (out / f"rank{rank}.pid").write_text(str(os.getpid()))
    sys.stdout, sys.stderr = RankPrefixed(sys.__stdout__, rank), RankPrefixed(sys.__stderr__, rank)
    # a crash below Python (SIGABRT, SIGSEGV in a C++ op) still prints where Python was
    faulthandler.enable(file=sys.__stderr__, all_threads=True)
    try:
        init_process_group()
        module, _, name = target.partition(":")
        sys.path.insert(0, os.getcwd())  # a module the notebook wrote with %%writefile
        fn = getattr(importlib.import_module(module), name)
        kwargs = json.loads((out / "kwargs.json").read_text())
        result = {"rank": rank, "world_size": dist.get_world_size(), **(fn(**kwargs) or {})}
        (out / f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()  # nobody tears down the store while a slower rank still talks to it
        return 0
    except BaseException:
        text = traceback.format_exc()
        (out / f"rank{rank}.error").write_text(text)
        print(text, file=sys.stderr)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def set_parent_death_signal(sig: int) -> bool:
    """Ask Linux to send ``sig`` to this process when the thread that started it ends; False where it cannot."""
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig)) == 0
    except (OSError, AttributeError):  # not Linux (no libc.so.6 or no prctl): the launcher's kill by pid remains
        return False


def die_with_parent(launcher_pid: str | None = None) -> None:
    """Get SIGKILL when torchrun, this rank's parent, ends; end now if it already has.

    SIGKILL because a rank may ignore SIGTERM or be stuck in C++ where no handler runs. The
    parent may have died before the signal was asked for (the rank imports torch first): then
    this process was handed to init or a subreaper, whose parent is not the launching process
    (``launcher_pid``, which ``launch`` passes). Without it (torchrun started by hand or by SLURM)
    that check is skipped: torchrun may itself be PID 1 in a container.
    """
    if set_parent_death_signal(signal.SIGKILL) and launcher_pid and _parent_of(os.getppid()) != int(launcher_pid):
        exit_now(1)


def _parent_of(pid: int) -> int:
    try:  # /proc/PID/stat: "pid (comm) state ppid ...", and comm may hold spaces or parentheses
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def exit_now(code: int) -> None:
    """End this rank without Python's shutdown: its results are on disk, and shutdown can crash it.

    A collective started with ``async_op=True`` (DeepSpeed ZeRO starts many) is finished on one of
    gloo's worker threads, and that thread frees the work's tensors, which needs the GIL. If this
    happens while the interpreter shuts down, the thread cannot take the GIL, is unwound by force,
    and the process aborts ("terminate called without an active exception", SIGABRT) after it has
    already done its work: 3 of 140 two-rank ZeRO launches on CPU did. ``os._exit`` skips that
    shutdown; the streams are flushed first so no output is lost.
    """
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
