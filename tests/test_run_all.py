"""The course's main job: the summary it writes, and its command line."""

import pytest

from course_lib import run_all


def test_summary_gathers_values_claims_and_figures(executed, course_run_dir):
    res = executed("02_gradient_accumulation")
    path = run_all.write_summary(course_run_dir, {"02_gradient_accumulation": res["seconds"]}, "cpu")
    text = path.read_text()
    assert "| accum_vs_big_max_rel_diff |" in text
    assert "| claim | source | measured here | held? |" in text
    for fig in res["figures"]:
        assert f"]({fig})" in text and (course_run_dir / fig).stat().st_size > 1000


def test_every_solution_notebook_is_found_in_order():
    names = [p.stem for p in run_all.notebooks("solutions")]
    assert names == sorted(names) and "02_gradient_accumulation" in names
    assert [p.stem for p in run_all.notebooks("notebooks")] == names


def test_unknown_notebook_number_is_an_error(capsys):
    with pytest.raises(SystemExit):
        run_all.main(["99", "--out", "/tmp/unused"])
    assert "available" in capsys.readouterr().err
