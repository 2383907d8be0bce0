"""The committed student notebooks are exactly what nbgrader generates from solutions/."""

import json

import shutil

import pytest

from course_grader.release import ROOT, assignments, check_cell_ids, make_course, released


def test_release_in_sync_with_solutions(tmp_path):
    fresh = released(make_course(tmp_path / "course"))
    committed = {p.stem: json.loads(p.read_text()) for p in (ROOT / "notebooks").glob("*.ipynb")}
    assert set(committed) == set(fresh), "notebooks/ and solutions/ hold different notebooks"
    for aid, nb in fresh.items():
        assert committed[aid] == nb, f"notebooks/{aid}.ipynb is stale: run python -m course_grader.release"


def test_a_solution_cell_without_an_id_is_refused(tmp_path):
    """nbgrader gives a cell without an id a new random one on every release: notebooks/ could never be in sync."""
    check_cell_ids()  # the course's own solutions pass
    aid = assignments()[0]
    (tmp_path / "solutions").mkdir()
    shutil.copytree(ROOT / "solutions" / aid, tmp_path / "solutions" / aid)
    path = tmp_path / "solutions" / aid / f"{aid}.ipynb"
    nb = json.loads(path.read_text())
    del nb["cells"][2]["id"]
    nb["cells"][4]["id"] = nb["cells"][3]["id"]
    path.write_text(json.dumps(nb))
    with pytest.raises(ValueError, match=r"cells \[2\] have no id; ids \['.*'\] repeat"):
        make_course(tmp_path / "course", root=tmp_path)


def test_release_hides_solutions_and_hidden_tests():
    for aid in assignments():
        text = (ROOT / "notebooks" / f"{aid}.ipynb").read_text()
        assert "BEGIN SOLUTION" not in text and "BEGIN HIDDEN TESTS" not in text, aid
        assert "raise NotImplementedError()" in text, aid


def test_notebooks_stored_without_outputs():
    for path in list((ROOT / "notebooks").glob("*.ipynb")) + list((ROOT / "solutions").glob("*/*.ipynb")):
        nb = json.loads(path.read_text())
        assert not any(c.get("outputs") for c in nb["cells"] if c["cell_type"] == "code"), path


def test_every_notebook_has_a_parameters_cell_and_exercises_with_visible_and_hidden_tests():
    for aid in assignments():
        nb = json.loads((ROOT / "solutions" / aid / f"{aid}.ipynb").read_text())
        tags = [c["metadata"].get("tags", []) for c in nb["cells"]]
        assert any("parameters" in t for t in tags), f"{aid}: no papermill parameters cell"
        src = "".join(next(c["source"] for c, t in zip(nb["cells"], tags) if "parameters" in t))
        assert 'tier = "auto"' in src, f"{aid}: the parameters cell must default to tier = \"auto\""
        tests, exercise = {}, None  # exercise -> the sources of the test cells that follow it
        for c in nb["cells"]:
            md = c["metadata"].get("nbgrader", {})
            if md.get("solution"):
                exercise = md["grade_id"]
                tests[exercise] = []
            elif md.get("grade") and exercise:
                tests[exercise].append("".join(c["source"]))
        assert tests, f"{aid}: no graded exercise"
        for exercise, sources in tests.items():
            hidden = [s for s in sources if "BEGIN HIDDEN TESTS" in s]
            assert hidden and len(hidden) < len(sources), f"{aid}/{exercise}: needs visible and hidden test cells"
