"""The processes ``course_lib.launch.launch`` starts: torchrun itself, and each rank torchrun starts.

    python -m course_lib.workers torchrun ARGS... -m course_lib.workers MODULE:FUNCTION OUT_DIR

It prefixes every line this rank prints with ``[rankN]``, joins the process group on this
rank's device (``distributed.init_process_group``: NCCL, or RCCL on ROCm, when there are GPUs;
gloo on CPU), calls ``FUNCTION(**kwargs)`` with the kwargs in ``OUT_DIR/kwargs.json``, and
writes the returned dict, with ``rank`` and ``world_size`` added where it lacks them, to
``OUT_DIR/rankN.json``; or, if it raises, its traceback to ``OUT_DIR/rankN.error``.
Then it leaves at once, without Python's shutdown (``exit_now`` says why).

Nothing outlives the kernel that launched it: torchrun (``agent_main``) and every rank ask Linux
for SIGKILL when their parent ends (``die_with_parent``), and each rank writes its pid to
``OUT_DIR/rankN.pid`` so that ``launch`` can stop it by pid too. torchrun starts ranks in sessions
of their own and gives them 30 s after its SIGTERM; a rank slow to die (GPU teardown, a stuck
collective) would otherwise hold its GPU memory on. Both write every thread's Python stack to
``OUT_DIR/NAME.stacks`` on SIGUSR1 (``STACKS_SIGNAL``): a launch that times out asks for them, so its
error says where each process was waiting.
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

STACKS_SIGNAL = signal.SIGUSR1  # on this signal torchrun and the ranks write every thread's stack and carry on


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
    die_with_parent(os.environ.get("COURSE_AGENT_PID"))
    (out / f"rank{rank}.pid").write_text(str(os.getpid()))
    sys.stdout, sys.stderr = RankPrefixed(sys.__stdout__, rank), RankPrefixed(sys.__stderr__, rank)
    # a crash below Python (SIGABRT, SIGSEGV in a C++ op) still prints where Python was
    faulthandler.enable(file=sys.__stderr__, all_threads=True)
    stacks = open(out / f"rank{rank}.stacks", "w")  # open as long as this rank runs: faulthandler writes to its fd
    faulthandler.register(STACKS_SIGNAL, file=stacks, all_threads=True)
    try:
        if not (out / "kwargs.json").is_file():  # every rank reads the same file: all stop here, none waits
            raise FileNotFoundError(f"{out / 'kwargs.json'} is missing: it holds {target}'s keyword arguments as a "
                                    "JSON object ({} for its defaults); `python -m course_lib.apps.cluster ... "
                                    "--kwargs` writes it in the job script, course_lib.launch before it starts ranks")
        init_process_group()
        module, _, name = target.partition(":")
        sys.path.insert(0, os.getcwd())  # a module the notebook wrote with %%writefile
        fn = getattr(importlib.import_module(module), name)
        kwargs = json.loads((out / "kwargs.json").read_text())
        result = {"rank": rank, "world_size": dist.get_world_size(), **(fn(**kwargs) or {})}
        (out / f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()  # nobody leaves while a slower rank still talks to it
        return 0
    except BaseException:
        text = traceback.format_exc()
        (out / f"rank{rank}.error").write_text(text)
        print(text, file=sys.stderr)
        return 1
    # No destroy_process_group: exit_now ends this process next, and that closes every connection. torch 2.7's
    # destroy_process_group hung, now and then, in a gloo rank whose peer had already left (1 launch in 20-30 on the
    # floor; 06's first launch in CI), and torchrun waits for every rank: the launch hung until its timeout.


def agent_main(argv: list[str]) -> int:
    """torchrun, as ``launch`` starts it: dies with the launching kernel, writes its stacks on ``STACKS_SIGNAL``.

    The death signal is asked for here, after exec, and not in a ``preexec_fn`` between fork and exec:
    that runs Python in a forked copy of a kernel whose other threads may hold locks nobody will free.
    """
    die_with_parent(os.environ.get("COURSE_LAUNCH_PID"))
    folder = os.environ.get("COURSE_LAUNCH_DIR")
    stacks = open(os.path.join(folder, "torchrun.stacks"), "w") if folder else sys.__stderr__
    faulthandler.register(STACKS_SIGNAL, file=stacks, all_threads=True)
    os.environ["COURSE_AGENT_PID"] = str(os.getpid())  # the parent each rank checks it still has
    from torch.distributed.run import main as torchrun  # here: a rank needs none of torchrun's imports

    torchrun(argv)
    return 0


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def set_parent_death_signal(sig: int) -> bool:
    """Ask Linux to send ``sig`` to this process when the thread that started it ends; False where it cannot."""
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig)) == 0
    except (OSError, AttributeError):  # not Linux (no libc.so.6 or no prctl): the launcher's kill by pid remains
        return False


def die_with_parent(parent_pid: str | None = None) -> None:
    """Get SIGKILL when this process's parent (the kernel for torchrun, torchrun for a rank) ends; end now if it has.

    SIGKILL because a rank may ignore SIGTERM or be stuck in C++ where no handler runs. The
    parent may have died before the signal was asked for (this process imports torch first): then
    it was handed to init or a subreaper, which is not ``parent_pid`` (``launch`` passes the kernel's
    pid to torchrun, ``agent_main`` its own to the ranks). Without it (torchrun started by hand or by
    SLURM) that check is skipped: torchrun may itself be PID 1 in a container.
    """
    if set_parent_death_signal(signal.SIGKILL) and parent_pid and os.getppid() != int(parent_pid):
        exit_now(1)


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
    if sys.argv[1:2] == ["torchrun"]:  # torchrun itself (a target is always "module:function")
        sys.exit(agent_main(sys.argv[2:]))
    exit_now(main(sys.argv[1:]))
