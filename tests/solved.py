"""Known-wrong submissions as edits of today's solution cells.

A known-wrong submission is the reference solution with one mistake in it. Written as a copy of the solution, it
drifts: the solution's next change (a renamed attribute, a new rule of the contract) leaves the copy testing a
program nobody ships. Derived here, it is the solution cell as it stands in ``solutions/``, edited; where the
solution changes under an edit, the edit's text is no longer in it and loading the submissions fails, naming the
edit to redo.
"""

from __future__ import annotations

from nbgrading import load_solution, solution_cells, strip_markers


def solution(assignment: str, grade_id: str) -> str:
    """The reference solution of one exercise cell of ``assignment``, as the student would write it (no markers)."""
    cells = solution_cells(load_solution(assignment))
    if grade_id not in cells:
        raise KeyError(f"{assignment} has no solution cell {grade_id!r}: its solution cells are {sorted(cells)}")
    return strip_markers(cells[grade_id])


def edit(base: str, *changes: tuple[str, str]) -> str:
    """``base`` with each ``(old, new)`` of ``changes`` applied in turn; each ``old`` must occur exactly once in the
    text it applies to, so an edit never lands somewhere its author did not mean."""
    for old, new in changes:
        found = base.count(old)
        if found != 1:
            raise ValueError(f"an edit of a solution cell expects its text once and found it {found} time(s): the "
                             f"solution changed, redo this edit against it:\n{old}")
        base = base.replace(old, new)
    return base
