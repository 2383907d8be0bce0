"""The process torchrun starts for ``course_lib.launch.launch``.

    python -m torch.distributed.run ... -m course_lib.workers MODULE:FUNCTION OUT_DIR

It prefixes every line this rank prints with ``[rankN]``, joins the process group on this
rank's device (``distributed.init_process_group``: NCCL, or RCCL on ROCm, when there are GPUs;
gloo on CPU), calls ``FUNCTION(**kwargs)`` with the kwargs in ``OUT_DIR/kwargs.json``, and
writes the returned dict, with ``rank`` and ``world_size`` added where it lacks them, to
``OUT_DIR/rankN.json``; or, if it raises, its traceback to ``OUT_DIR/rankN.error``.
Then it leaves at once, without Python's shutdown (``exit_now`` says why).
"""

from __future__ import annotations

import faulthandler
import importlib
import io
import json
import os
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
