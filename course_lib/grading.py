"""Helpers the graded test cells call: comparing gradients and models by behaviour, and keeping the
library's own answers out of reach while a student's code runs.

An exercise asks for a mechanism that course_lib (or torch) already holds: the activation meter,
the loss scaler, checkpointing by recomputation. A test computes its reference first, then runs the
student's code inside ``forbid(...)``, where every reference to those answers raises
``LibraryAnswer``. A submission that only calls the library then fails every test of the exercise.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from typing import Iterator

import torch
from torch import nn


class LibraryAnswer(RuntimeError):
    """Raised when code under test calls what the exercise asks it to build."""


def _message(answer) -> str:
    where = f"{getattr(answer, '__module__', '?')}.{getattr(answer, '__qualname__', repr(answer))}"
    return f"{where} is what this exercise asks you to build: write it yourself with torch, without calling {where}"


def _refusing_code(message: str):
    """A code object that raises ``LibraryAnswer(message)``; it needs no globals of its own, so it can
    replace the code of a function from any module."""
    scope: dict = {}
    exec(f"def refused(*args, **kwargs):\n"
         f"    raise __import__('course_lib.grading', fromlist=['LibraryAnswer']).LibraryAnswer({message!r})", scope)
    return scope["refused"]


@contextlib.contextmanager
def forbid(*answers, namespace: dict | None = None) -> Iterator[None]:
    """While the block runs, ``answers`` (functions or classes) raise ``LibraryAnswer`` however they are reached.

    Every loaded module that names one of them (its home and every module that imported it, torch's
    included) and ``namespace`` (a notebook passes ``globals()``) get a stand-in; a Python function's
    own code is swapped too (a reference kept elsewhere reaches it), and so are a class's methods and
    ``__init__`` (a subclass or an instance made earlier reaches those). All are restored after.
    """
    wanted = {id(a): a for a in answers}
    stand_ins = {key: _refusing_code(_message(a)) for key, a in wanted.items()}
    spaces = [vars(m) for m in list(sys.modules.values()) if isinstance(getattr(m, "__dict__", None), dict)]
    spaces += [namespace] if namespace is not None else []
    patched, swapped = [], []
    try:
        for space in spaces:
            for name, value in list(space.items()):
                if id(value) in wanted and value is wanted[id(value)]:
                    patched.append((space, name, value))
                    space[name] = stand_ins[id(value)]
        for key, answer in wanted.items():
            if isinstance(answer, type):
                for name, member in list(vars(answer).items()):
                    if callable(member) and (name == "__init__" or not name.startswith("__")):
                        swapped.append((answer, name, member))
                        setattr(answer, name, stand_ins[key])
            elif hasattr(answer, "__code__") and not answer.__code__.co_freevars:
                swapped.append((answer, "__code__", answer.__code__))
                answer.__code__ = stand_ins[key].__code__
        yield
    finally:
        for owner, name, value in reversed(swapped):
            setattr(owner, name, value)
        for space, name, value in reversed(patched):
            space[name] = value


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter's gradient, by name (zeros where a gradient is missing)."""
    return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in model.named_parameters()}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference between two name → tensor dicts with the same keys."""
    assert a.keys() == b.keys(), f"different parameters: {sorted(set(a) ^ set(b))}"
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest difference relative to the largest magnitude in ``b``, over all tensors."""
    scale = max(float(v.float().abs().max()) for v in b.values()) or 1.0
    return max_abs_diff(a, b) / scale


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the parameters, by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def twin(model: nn.Module) -> nn.Module:
    """An independent deep copy, to run a reference computation beside the student's."""
    return copy.deepcopy(model)
