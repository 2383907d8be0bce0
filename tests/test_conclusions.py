"""Every notebook closes on what its run found, then on take-aways that do not depend on it.

A notebook's claims are measured, predicted, simulated or not measured here (course_lib.results.KINDS), and a
measured one can fail. So the closing section is in two parts: "## What this run found", whose next code cell
renders ``results.conclusions()`` (each claim with its verdict, from this run), and "## What to take away", the
mechanisms, which point to that list instead of stating a run's result as held. The old single heading
"What held, and what to take away" stated as held what a run had only predicted or could not measure.

Static: no notebook is executed here.
"""

from __future__ import annotations

import ast
import re

import IPython.display
import pytest

import nbgrading as g
from course_grader.release import assignments
from course_lib import results as results_mod

FOUND = "## What this run found"
TAKE_AWAY = "## What to take away"
CONCLUSIONS = "results.conclusions()"


def source(cell: dict) -> str:
    return "".join(cell["source"])


def headings(cell: dict) -> list[str]:
    return [line.rstrip() for line in source(cell).splitlines() if line.startswith("#")]


def python(cell: dict) -> ast.Module | None:
    """A code cell's syntax tree, IPython's magics and shell lines left out; None if it still does not parse."""
    lines = ["" if line.lstrip().startswith(("%", "!")) else line for line in source(cell).splitlines()]
    try:
        return ast.parse("\n".join(lines))
    except SyntaxError:
        return None


def calls_results(cell: dict, method: str) -> bool:
    """Whether a code cell calls ``results.<method>(...)``."""
    tree = python(cell)
    if tree is None:  # fall back to the text
        return re.search(rf"\bresults\.{method}\(", source(cell)) is not None
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == method
               and isinstance(n.func.value, ast.Name) and n.func.value.id == "results" for n in ast.walk(tree))


def binds_results(cell: dict) -> bool:
    """Whether a code cell assigns the name ``results`` (the setup's ``..., results = course_setup(...)``)."""
    tree = python(cell)
    if tree is None:
        return False
    return any(isinstance(n, ast.Name) and n.id == "results" and isinstance(n.ctx, ast.Store) for n in ast.walk(tree))


def closing(nb: dict) -> tuple[int, int, int]:
    """Indices of the "What this run found" heading, its conclusions cell and the "What to take away" heading."""
    cells = nb["cells"]
    found = [i for i, c in enumerate(cells) if c["cell_type"] == "markdown" and FOUND in headings(c)]
    assert len(found) == 1, f"{len(found)} markdown cells headed {FOUND!r}"
    f = found[0]
    code = next((i for i in range(f + 1, len(cells)) if cells[i]["cell_type"] == "code"), None)
    assert code is not None, f"no code cell after {FOUND!r}"
    assert CONCLUSIONS in source(cells[code]), f"the code cell after {FOUND!r} does not render {CONCLUSIONS}"
    assert all(c["cell_type"] == "markdown" for c in cells[f + 1:code])
    take = [i for i, c in enumerate(cells) if c["cell_type"] == "markdown" and TAKE_AWAY in headings(c)]
    assert len(take) == 1, f"{len(take)} markdown cells headed {TAKE_AWAY!r}"
    return f, code, take[0]


@pytest.fixture(params=assignments())
def nb(request) -> dict:
    return g.load_solution(request.param)


def test_no_notebook_says_what_held_in_its_prose(nb):
    assert not [source(c)[:80] for c in nb["cells"] if c["cell_type"] == "markdown" and "What held" in source(c)]


def test_the_run_s_findings_come_before_the_take_aways(nb):
    found, code, take = closing(nb)
    assert found < code < take


def test_the_findings_list_every_claim_of_the_run(nb):
    """Every ``results.claim`` runs before the list renders, so the list is the run's whole set of claims."""
    _, code, _ = closing(nb)
    cells = nb["cells"]
    later = [source(c)[:80] for c in cells[code:] if c["cell_type"] == "code" and calls_results(c, "claim")]
    assert not later, f"claims recorded after {CONCLUSIONS} renders: {later}"
    assert any(c["cell_type"] == "code" and calls_results(c, "claim") for c in cells[:code]), "no claim recorded"
    assert any(c["cell_type"] == "code" and binds_results(c) for c in cells[:code]), \
        "no cell before the list binds `results`"


def test_the_findings_cell_renders_the_run_s_verdicts(nb, tmp_path, monkeypatch):
    """Run the notebook's own conclusions cell on a Results with a claim of every kind: it shows their verdicts."""
    monkeypatch.setenv("COURSE_RUN_DIR", str(tmp_path))
    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda *objs, **kw: shown.extend(objs))
    run = results_mod.Results("99_conclusions")
    run.claim("measured and held", "1e-7", True)
    run.claim("measured and failed", "1.1x", False)
    run.claim("arithmetic", "48 GB", True, kind="predicted")
    run.claim("emulated", "padded stages", False, kind="simulated")
    run.claim("needs a GPU", "no GPU here", kind="not measured here")
    _, code, _ = closing(nb)
    exec(source(nb["cells"][code]), {"results": run})  # the cell may use `results` and nothing else of the notebook
    assert [getattr(o, "data", o) for o in shown] == [run.conclusions()]
    assert [line.split("**")[1] for line in run.conclusions().splitlines()] == [
        "held", "did not hold", "predicted: agrees", "simulated: disagrees", "not measured here"]
