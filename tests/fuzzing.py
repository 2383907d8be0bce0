"""Mutations of a probe's data: the fuzz of every judge (tests/test_grading.py, ``test_judges_refuse_mutated_data``).

A probe's data comes from the student's process, so a student can rewrite it before the grader reads it. The fuzz
takes the data of the reference solution, which passes, and rewrites it the ways a student could: each judge must
refuse every rewrite that changes the data (``accepted`` lists those it takes).

    for what, family, data in mutants(reference_data):   # what: "empty at ['grads', *] (every of 2)"
        assert not grade.judge(name, {"data": data}, []).passed

A mutation is a ``Family`` of edits of one kind of node (a list, a float, a tensor): ``FAMILIES``, and ``GATED``
where grade.py validates the data before any judge reads it. Each family edits, in turn, every group of nodes that
sit at the same place in the data (a path whose list indices are ``*``: every rank's ``grads``, every step's loss):
all of the group at once, then the group's first node alone (one rank's list emptied), and for NaN its last alone
too (``max`` over Python floats passes over a NaN after the first item). A mutation that leaves the data equal (an
empty list emptied) is skipped. Adding one to every int is no family: many judges rightly take a count within a
slack (the bytes a rank holds, the micro-batches in flight).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

Path = tuple  # of ("i", index) for a list's or tuple's item, ("k", key) for a dict's


@dataclass(frozen=True)
class Family:
    """One kind of rewrite: ``applies(node)`` says where, ``edit(node)`` gives the rewritten node. ``refused``: every
    judge must refuse the rewritten data; else the grader's gate must hand the judge the original data back (a
    rewrite of the layout alone, which a judge must never see)."""

    name: str
    applies: Callable[[Any], bool]
    edit: Callable[[Any], Any]
    refused: bool = True


def _is_seq(x) -> bool:
    return isinstance(x, (list, tuple))


def _floating(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel() > 0


def _nan(x):
    return float("nan") if isinstance(x, float) else torch.full_like(x, float("nan"))


def _huge(x: torch.Tensor) -> torch.Tensor:
    """``x``'s first element, as a stride-0 view of 2**27 elements: 4 bytes of storage that read as 512 MiB."""
    return x.reshape(-1)[:1].clone().expand(2**27)


def _strided(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values in a tensor that is not contiguous: a transposed copy read through its transpose, or where
    that is contiguous still (a vector, a column) every other element of a copy twice as long."""
    out = x.transpose(-1, -2).contiguous().transpose(-1, -2) if x.dim() >= 2 else x
    return out if not out.is_contiguous() else torch.stack([x, x], dim=-1)[..., 0]


FAMILIES: list[Family] = [
    Family("empty", lambda x: _is_seq(x) and len(x) > 0, lambda x: type(x)()),  # (a) a list or tuple emptied
    Family("short", lambda x: _is_seq(x) and len(x) >= 2, lambda x: x[:-1]),  # (b) its last item dropped
    Family("nan", lambda x: isinstance(x, float) or _floating(x), _nan),  # (c) a float, a float tensor: NaN
]
# Families of the grader's gate (``grade.validated``, which reads the data before any judge does), where it has one:
# (e) a float tensor replaced by a stride-0 view of 2**27 elements: refused; (f) a tensor made non-contiguous, its
# values kept: the gate gives the judge a contiguous copy, the original's data (a student's transposed output is
# a right answer).
GATED: list[Family] = [
    Family("huge", _floating, _huge),
    Family("strided", lambda x: isinstance(x, torch.Tensor) and x.numel() > 1, _strided, refused=False),
]


def families() -> list[Family]:
    """The families this grader must stand: (a)-(c) always, (e)-(f) where grade.py validates the data first."""
    from course_grader import grade

    return FAMILIES + (GATED if hasattr(grade, "validated") else [])


def nodes(data: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """Every node of ``data`` with its path, the containers before what they hold."""
    yield path, data
    if isinstance(data, dict):
        for k, v in data.items():
            yield from nodes(v, path + (("k", k),))
    elif _is_seq(data):
        for i, v in enumerate(data):
            yield from nodes(v, path + (("i", i),))


def place(path: Path) -> Path:
    """Where ``path`` sits in the data, whichever list item: its list indices replaced by ``*``."""
    return tuple(("i", "*") if kind == "i" else (kind, key) for kind, key in path)


def shown(path: Path) -> str:
    return "[" + ", ".join("*" if key == "*" else repr(key) for _, key in path) + "]"


def rewritten(data: Any, paths: set, edit: Callable[[Any], Any], path: Path = ()) -> Any:
    """A copy of ``data`` (its containers and tensors fresh: a judge that writes into its data spoils no other
    mutant) with the nodes at ``paths`` edited."""
    if path in paths:
        return edit(data)
    if isinstance(data, dict):
        return {k: rewritten(v, paths, edit, path + (("k", k),)) for k, v in data.items()}
    if _is_seq(data):
        return type(data)(rewritten(v, paths, edit, path + (("i", i),)) for i, v in enumerate(data))
    return data.clone() if isinstance(data, torch.Tensor) else data


def same(a: Any, b: Any) -> bool:
    """Whether two data are equal, NaN equal to NaN, a tensor equal to one of the same dtype, shape, strides and
    values (so a stride-0 or transposed copy is not the same data)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if _is_seq(a):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape or a.stride() != b.stride():
            return False
        if a.is_floating_point() or a.is_complex():
            return bool(((a == b) | (a.isnan() & b.isnan())).all())
        return torch.equal(a, b)
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b


def mutants(data: Any, kinds: list[Family] | None = None) -> Iterator[tuple[str, Family, Any]]:
    """``(what, family, mutated data)`` for every family and every place in ``data`` where the family applies: every
    node at that place edited at once, then (where the place holds several) the first alone, and for NaN the last
    alone. Mutations that leave the data equal are skipped."""
    for family in kinds if kinds is not None else families():
        at: dict[Path, list[Path]] = {}
        for path, node in nodes(data):
            if family.applies(node):
                at.setdefault(place(path), []).append(path)
        for where, paths in at.items():
            choices = [(paths, "every")] + ([(paths[:1], "first"), (paths[-1:], "last")] if len(paths) > 1 else [])
            for chosen, which in choices[:2] if family.name != "nan" else choices:
                mutated = rewritten(data, set(chosen), family.edit)
                if not same(mutated, data):
                    yield f"{family.name} at {shown(where)} ({which} of {len(paths)})", family, mutated


def contiguous(data: Any) -> bool:
    return all(node.is_contiguous() for _, node in nodes(data) if isinstance(node, torch.Tensor))


def accepted(name: str, data: Any, wire: list | None = None) -> list[str]:
    """The mutants of check ``name``'s passing ``data`` that the grader takes: a refused family's that its judge
    passes, a layout rewrite that reaches the judge other than as the original's data. ``wire``: what the check's
    peer recorded in the same grading (the grader's own, never rewritten)."""
    from course_grader import grade

    out = []
    for what, family, mutated in mutants(data):
        if family.refused:
            if grade.judge(name, {"data": mutated, "wire": wire}, []).passed:
                out.append(what)
            continue
        try:
            seen = grade.validated(mutated)
        except Exception:  # the gate refuses it: the judge never runs
            continue
        if not contiguous(seen) or not same(seen, grade.validated(data)):
            out.append(what)
    return out
