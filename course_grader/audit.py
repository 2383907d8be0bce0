"""The grading process's audit hook (PEP 578): what a submission's code may not do there, and what it is flagged for.

The probes run beside the student's code, in one interpreter, so a blacklist there cannot be complete; this hook
closes the ways found to reach the library's answers or the grader's own state, and reports the rest. It is added
in the grading fork before any of the student's code runs and cannot be removed (``sys.addaudithook``). Its
events go, as they happen, to a pipe the grading server reads (``course_grader.child``): a line written there
cannot be taken back by the code that caused it, and where the line cannot be written the operation is refused.

Refused (the operation raises ``GraderRefused``, which fails the cell or the probe that did it):

- walking the garbage collector's object graph (``gc.get_objects``, ``get_referrers``, ``get_referents``): the
  way to the grader's saved originals and to dictionaries that are otherwise read-only;
- rebinding the code or defaults of a function of the grader, course_lib, torch's top level or a forbidden answer
  (``fn.__code__ = ...``), except by ``course_grader.grading.forbid`` itself: the way to switch a forbidden answer
  back on, or a check's helper off;
- making a function out of the library's code, or any code object, from the student's own code
  (``types.FunctionType(answer.__code__, ...)``, ``code.replace``): a copy that ``forbid`` cannot know;
- running an already-loaded module's code again (``exec`` of its code object, ``importlib.reload``).

Flagged for the instructor (the operation runs): compiling source under the file name of a loaded module (running
its file again, ``runpy.run_path``) and foreign-memory access through ``ctypes``.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from typing import Callable

REFUSED_EVENTS = ("gc.get_objects", "gc.get_referrers", "gc.get_referents")
FUNCTION_STATE = ("__code__", "__defaults__", "__kwdefaults__")
COPIED = 0.8  # a compiled source that holds this share of a forbidden answer's lines is flagged as its copy
MAX_REPORTS = 50  # per kind: a loop that trips the hook a million times reports its first ones


class GraderRefused(PermissionError):
    """What the grading process does not let a submission's code do."""


def _student_frame(frame) -> bool:
    """A frame of the student's code: compiled from a notebook cell or a string, not from a file of a package."""
    name = frame.f_code.co_filename
    return name.startswith("<") and not name.startswith("<frozen")


class Hook:
    """The audit hook of one grading fork (``install`` adds it). ``report_fd``: where each event's line goes;
    ``protected``: the ids of the functions whose code only ``allowed_code`` (``forbid``'s, ``restore``'s) may
    rebind (the caller keeps them alive); ``loaded_files``: the source files of the modules loaded before the
    student's code ran; ``copies``: each forbidden answer's source lines (``sources``)."""

    def __init__(self, report_fd: int, protected: set[int], allowed_code: set, loaded_files: set[str],
                 copies: dict[str, frozenset]):
        self.fd, self.protected, self.allowed, self.loaded, self.copies = (report_fd, protected, allowed_code,
                                                                           loaded_files, copies)
        self.counts: dict[str, int] = {}
        self.busy = False
        self.write, self.getframe, self.dumps = os.write, sys._getframe, json.dumps  # bound now: a cell may rebind

    def __call__(self, event: str, args: tuple) -> None:
        if self.busy:  # an event raised by this hook's own work
            return
        self.busy = True
        try:
            self.check(event, args)
        finally:
            self.busy = False

    def report(self, kind: str, detail: str, refuse: bool) -> None:
        """Write the event's line (its first ``MAX_REPORTS`` of a kind); raise ``GraderRefused`` if ``refuse``, or
        if the line cannot be written."""
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if self.counts[kind] <= MAX_REPORTS:
            line = self.dumps({"kind": kind, "detail": detail[:300], "refused": refuse}) + "\n"
            try:
                self.write(self.fd, line.encode())
            except OSError:  # the report cannot be made: then the operation cannot be made either
                raise GraderRefused(f"the grader could not record {kind}, so it is refused") from None
        if refuse:
            raise GraderRefused(f"grading does not allow {kind} ({detail[:200]}) while your code runs: "
                                "write the exercise with torch, without reaching into the grader or the library")

    def caller(self):
        """The frame that raised the event: the first outside this file."""
        frame = self.getframe(1)
        while frame is not None and frame.f_code.co_filename == __file__:
            frame = frame.f_back
        return frame

    def from_student(self) -> bool:
        frame = self.caller()
        return frame is not None and _student_frame(frame)

    def check(self, event: str, args: tuple) -> None:
        if event in REFUSED_EVENTS:
            self.report(event, "a walk of the object graph", refuse=True)
        elif event == "object.__setattr__" and args[1] in FUNCTION_STATE and id(args[0]) in self.protected:
            frame = self.caller()
            if frame is None or frame.f_code not in self.allowed:
                self.report("rebinding a library function's code",
                            f"{getattr(args[0], '__module__', '?')}.{getattr(args[0], '__qualname__', '?')}.{args[1]}",
                            refuse=True)
        elif event == "function.__new__":
            if args[0].co_filename in self.loaded and self.from_student():
                self.report("a copy of the library's code", f"{event} from {args[0].co_filename}", refuse=True)
        elif event == "code.__new__":  # a code object made by hand (a renamed copy, say): torch.compile's are its own
            if self.from_student():
                self.report("a copy of the library's code", f"{event} named {args[1]}", refuse=True)
        elif event == "exec":
            code = args[0]
            if getattr(code, "co_filename", None) in self.loaded and code.co_name == "<module>":
                self.report("running a loaded module again", code.co_filename, refuse=True)
        elif event == "compile":
            self.compiled(*(args + (None, None))[:2])
        elif event.startswith("ctypes.") and self.from_student():
            self.report("memory access through ctypes", event, refuse=False)

    def compiled(self, source, filename) -> None:
        """Flag a loaded module's file compiled again, and a source that holds most lines of a forbidden answer."""
        if isinstance(filename, str) and filename in self.loaded:
            self.report("compiling a loaded module's file", filename, refuse=False)
        if isinstance(source, (str, bytes)) and len(source) > 200:
            text = source.decode(errors="replace") if isinstance(source, bytes) else source
            lines = {line.strip() for line in text.splitlines() if line.strip()}
            for name, theirs in self.copies.items():
                if len(theirs & lines) >= COPIED * len(theirs):
                    self.report("the source of a forbidden answer", f"{name} (compiled as {filename})", refuse=False)


def install(report_fd: int, protected: set[int], allowed_code: set, loaded_files: set[str],
            copies: dict[str, frozenset]) -> None:
    """Add a ``Hook`` to this process for good (an audit hook cannot be removed)."""
    sys.addaudithook(Hook(report_fd, protected, allowed_code, loaded_files, copies))


def loaded_files() -> set[str]:
    """The source files of every module loaded now."""
    return {f for m in list(sys.modules.values()) if isinstance(f := getattr(m, "__file__", None), str)}


def sources(answers: list) -> dict[str, frozenset]:
    """The stripped source lines of each answer, and of each method of a class, of at least five lines (shorter
    ones match too much by chance), by name: what a compiled source is compared with. A stub of the student edition
    is no answer, so it is left out."""
    out = {}
    methods = [m for a in answers if isinstance(a, type) for m in vars(a).values() if inspect.isfunction(m)]
    for answer in [*answers, *methods]:  # a class's source, and each of its methods': a copy may take one
        try:
            text = inspect.getsource(answer)
        except (OSError, TypeError):  # a builtin, or a class or function with no file
            continue
        lines = frozenset(line.strip() for line in text.splitlines() if line.strip() and line.strip()[0] != "#")
        if len(lines) >= 5 and "NotImplementedError" not in text:
            out[f"{getattr(answer, '__module__', '?')}.{getattr(answer, '__qualname__', '?')}"] = lines
    return out


def read_reports(text: str) -> list[dict]:
    """The events a grading fork reported, from what the server read of its pipe (a torn last line is dropped)."""
    out = []
    for line in text.splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if isinstance(item, dict) and {"kind", "detail", "refused"} <= set(item):
            out.append({"kind": str(item["kind"])[:100], "detail": str(item["detail"])[:300],
                        "refused": bool(item["refused"])})
    return out


def allowed(*functions: Callable) -> set:
    """The code objects of ``functions``: those that may rebind a library function's code."""
    return {fn.__code__ for fn in functions}
