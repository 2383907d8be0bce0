"""Helpers the graded test cells call: comparing gradients and models by behaviour, and keeping the
library's own answers out of reach while a student's code runs.

An exercise asks for a mechanism that course_lib (or torch) already holds: the activation meter,
the loss scaler, checkpointing by recomputation. A test computes its reference first, then runs the
student's code inside ``forbid(...)``, where every reference to those answers raises
``LibraryAnswer``. A submission that only calls the library then fails every test of the exercise.
"""

from __future__ import annotations

import copy
import math
import sys

import torch
from torch import nn


class LibraryAnswer(RuntimeError):
    """Raised when code under test calls what the exercise asks it to build."""


def _message(answer) -> str:
    where = f"{getattr(answer, '__module__', '?')}.{getattr(answer, '__qualname__', repr(answer))}"
    return f"{where} is what this exercise asks you to build: write it yourself with torch, without calling {where}"


def _refusing_code(message: str, freevars: tuple[str, ...] = ()):
    """A function whose code raises ``LibraryAnswer(message)``. It needs no globals of its own, and it closes over
    ``freevars`` (a method that calls ``super()`` closes over ``__class__``), so its code can replace the code of any
    function with those free variables, in any module."""
    scope: dict = {}
    body = (f"        {', '.join(freevars)}\n" if freevars else "")
    exec("def outer():\n" + "".join(f"    {v} = None\n" for v in freevars)
         + "    def refused(*args, **kwargs):\n" + body
         + "        raise __import__('course_grader.grading', fromlist=['LibraryAnswer']).LibraryAnswer("
         + f"{message!r})\n    return refused\n", scope)
    return scope["outer"]()


def answer_functions(answer) -> list:
    """The Python functions whose code an answer runs: the function itself, or a class's methods (its
    ``__init__`` and every public one, staticmethods and classmethods unwrapped)."""
    members = [answer] if not isinstance(answer, type) else [
        m for name, m in vars(answer).items() if name == "__init__" or not name.startswith("__")]
    out = []
    for member in members:
        fn = getattr(member, "__func__", member)  # staticmethod, classmethod
        if hasattr(fn, "__code__"):
            out.append(fn)
    return out


def _swap_in(fn, message: str) -> tuple | None:
    """Give ``fn`` the code of a stand-in that refuses; returns what to put back, or None where it cannot be swapped."""
    stand_in = _refusing_code(message, fn.__code__.co_freevars)
    if stand_in.__code__.co_freevars != fn.__code__.co_freevars:  # the compiler ordered them otherwise: leave it
        return None
    saved = (fn, fn.__code__)
    fn.__code__ = stand_in.__code__
    return saved


class forbid:
    """While the block runs, ``answers`` (functions or classes) raise ``LibraryAnswer`` however they are reached.

        with forbid(memory.activation_bytes, torch.amp.GradScaler, namespace=globals()):
            student_code()

    Every loaded module that names one of them (its home and every module that imported it, torch's included)
    and ``namespace`` (a notebook passes ``globals()``) get a stand-in; the code of a Python function, and of
    every method of a class, is swapped in place, so a reference kept anywhere (a default argument, a subclass,
    an instance made before, a copy of the class's dict) reaches the stand-in. All are restored on exit.

    A plain class, not a ``contextlib`` generator: what it runs is course_lib's own code, which the grading
    process puts back before every probe (``course_grader.child``).
    """

    def __init__(self, *answers, namespace: dict | None = None):
        self.answers, self.namespace = answers, namespace
        self.patched: list = []
        self.swapped: list = []

    def __enter__(self) -> "forbid":
        wanted = {id(a): a for a in self.answers}
        stand_ins = {key: _refusing_code(_message(a)) for key, a in wanted.items()}
        spaces = [vars(m) for m in list(sys.modules.values()) if isinstance(getattr(m, "__dict__", None), dict)]
        spaces += [self.namespace] if self.namespace is not None else []
        try:
            for space in spaces:
                for name, value in list(space.items()):
                    if id(value) in wanted and value is wanted[id(value)]:
                        self.patched.append((space, name, value))
                        space[name] = stand_ins[id(value)]
            for key, answer in wanted.items():
                for fn in answer_functions(answer):
                    saved = _swap_in(fn, _message(answer))
                    if saved is not None:
                        self.swapped.append(saved)
                if isinstance(answer, type):  # a builtin method (a C slot) cannot be swapped: replace it on the class
                    for name, member in list(vars(answer).items()):
                        if callable(member) and not hasattr(getattr(member, "__func__", member), "__code__") \
                                and (name == "__init__" or not name.startswith("__")):
                            self.patched.append((answer, name, member))
                            setattr(answer, name, stand_ins[key])
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for fn, code in reversed(self.swapped):
            fn.__code__ = code
        for owner, name, value in reversed(self.patched):
            if isinstance(owner, dict):
                owner[name] = value
            else:
                setattr(owner, name, value)
        self.swapped, self.patched = [], []


def code_rebinders() -> tuple:
    """The functions that rebind an answer's code, ``forbid``'s swap and its way out: a grading process's audit hook
    lets these alone rebind the code of a function it protects."""
    return _swap_in, forbid.__exit__


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter's gradient, by name (zeros where a gradient is missing)."""
    return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in model.named_parameters()}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between the student's name -> tensor dict ``a`` and the reference ``b``:
    the same names and shapes are required, and a NaN anywhere makes it NaN, which no ``diff < tol`` passes (Python's
    ``max`` over the tensors would pass over a NaN after the first)."""
    assert isinstance(a, dict) and a.keys() == b.keys(), \
        f"different parameters: {sorted(set(a) ^ set(b)) if isinstance(a, dict) else type(a).__name__}"
    for k in a:
        got = f"shape {tuple(a[k].shape)}" if isinstance(a[k], torch.Tensor) else repr(a[k])[:80]
        assert isinstance(a[k], torch.Tensor) and a[k].shape == b[k].shape, \
            f"{k}: {got}, expected a tensor of shape {tuple(b[k].shape)}"
    return worst(float((a[k].float() - b[k].float()).abs().max()) if b[k].numel() else 0.0 for k in a)


def worst(gaps) -> float:
    """The largest of ``gaps``, NaN where any is NaN (Python's ``max`` passes over a NaN after the first item)."""
    gaps = [float(g) for g in gaps]
    return math.nan if any(math.isnan(g) for g in gaps) else max(gaps, default=0.0)


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """``max_abs_diff`` relative to the largest magnitude in the reference ``b``: NaN where any difference is NaN."""
    scale = max((float(v.float().abs().max()) for v in b.values() if v.numel()), default=0.0) or 1.0
    return max_abs_diff(a, b) / scale


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the parameters, by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def twin(model: nn.Module) -> nn.Module:
    """An independent deep copy, to run a reference computation beside the student's."""
    return copy.deepcopy(model)
