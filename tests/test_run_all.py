"""The course's main job: the summary it writes, and its command line."""

import pytest

from course_lib import results
from course_lib.apps import run_all


def test_summary_gathers_values_claims_and_figures(executed, course_run_dir):
    res = executed("03_gradient_accumulation")
    path = run_all.write_summary(course_run_dir, {"03_gradient_accumulation": res["seconds"]}, "cpu")
    text = path.read_text()
    assert "| accum_vs_big_max_rel_diff |" in text
    assert "| claim | source | what this run found | kind | verdict |" in text
    held = sum(c["held"] for c in res["claims"])
    assert f"| measured | {results.KINDS['measured']} | {held} held," in text  # the whole run's count, by kind
    assert f"Claims: {held} held" in text
    for fig in res["figures"]:
        assert f"]({fig})" in text and (course_run_dir / fig).stat().st_size > 1000


def test_summary_counts_and_shows_each_kind_apart(tmp_path, monkeypatch):
    monkeypatch.setenv("COURSE_RUN_DIR", str(tmp_path))
    r = results.Results("09_deepspeed_zero")
    r.claim("ZeRO matches DDP", "1e-7", True)
    r.claim("ZeRO matches DDP again", "1e-2", False)
    r.claim("10x larger models", "9.8x from memory arithmetic", True, kind="predicted")
    r.claim("offload frees the GPU", "no GPU here", kind="not measured here")
    text = run_all.write_summary(tmp_path, {"09_deepspeed_zero": 1.0}, "cpu").read_text()
    assert "Claims: 1 held, 1 did not hold, 1 predicted, 1 not measured here." in text
    assert "| 10x larger models |  | 9.8x from memory arithmetic | predicted | predicted: agrees |" in text
    assert "| offload frees the GPU |  | no GPU here | not measured here | not measured here |" in text
    assert f"| predicted | {results.KINDS['predicted']} | 1 |" in text and "| 1 held, 1 did not |" in text


def test_every_solution_notebook_is_found_in_order():
    names = [p.stem for p in run_all.notebooks("solutions")]
    assert names == sorted(names) and "03_gradient_accumulation" in names
    assert [p.stem for p in run_all.notebooks("notebooks")] == names


def test_unknown_notebook_number_is_an_error(capsys):
    with pytest.raises(SystemExit):
        run_all.main(["99", "--out", "/tmp/unused"])
    assert "available" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one known, one not: an error that names the unknown one, not a partial run
        run_all.main(["03", "06_dpp", "--out", "/tmp/unused"])
    assert "matches ['06_dpp']" in capsys.readouterr().err


def test_summary_marks_the_notebooks_over_their_tiers_budget(tmp_path):
    timings = {"00_orientation": 30.0, "09_deepspeed_zero": 700.0, "11_llama_finetune": float("nan")}
    assert run_all.over_budget(timings, run_all.BUDGET_S["gpu"]) == {"09_deepspeed_zero": 700.0}
    assert run_all.over_budget(timings, None) == {}  # --long-runs and the emulation have no budget
    text = run_all.write_summary(tmp_path, timings, "gpu", run_all.BUDGET_S["gpu"]).read_text()
    assert "Executed in 700.0 s (budget 600 s: OVER)." in text and "Executed in 30.0 s (budget 600 s)." in text
    assert "## 11_llama_finetune\n\nFailed." in text


def test_the_long_measurements_wait_for_long_runs():
    """--long-runs sets each notebook's long_runs parameter; the notebooks with measurements past a slot have one."""
    import json

    for name in ("10_zero_offload", "13_fast_recipe"):
        nb = json.loads((run_all.ROOT / "solutions" / name / f"{name}.ipynb").read_text())
        params = next(c for c in nb["cells"] if "parameters" in c["metadata"].get("tags", []))
        assert "long_runs = False" in "".join(params["source"]), name


def test_a_notebook_that_cannot_start_is_reported_with_its_cause(tmp_path, monkeypatch, capsys):
    """On a GPU machine without papermill every notebook failed before its first cell, and run_all then crashed
    writing the summary into a folder nothing had made, hiding the cause. Now: a summary, the cause, exit 1."""
    import sys

    monkeypatch.setitem(sys.modules, "papermill", None)  # `import papermill` raises ImportError, as it did there
    out = tmp_path / "not" / "made" / "yet"
    assert run_all.main(["--tier", "cpu", "--out", str(out), "00"]) == 1
    assert "## 00_orientation" in (out / "summary.md").read_text() and "Failed." in (out / "summary.md").read_text()
    err = capsys.readouterr().err
    assert "import papermill" in err and "FAILED 00_orientation" in err


def test_the_readme_table_gives_every_notebook_its_words_code_exercises_and_cpu_time():
    """README's table: one row per notebook, in order, with its markdown word count and code lines (each within 10%
    of what the notebook holds now), its exercises and how many of them build a mechanism (exact), and its CPU-tier
    time in seconds, within the 3-minute workshop budget."""
    import re

    rows = {}
    for line in (run_all.ROOT / "README.md").read_text().splitlines():
        m = re.match(r"\| (\d\d) \| .* \| ([\d,]+) \| (\d+) \| (\d+) \((\d+)\) \| (\d+) s \|$", line)
        if m:
            rows[m.group(1)] = (int(m.group(2).replace(",", "")), *map(int, m.group(3, 4, 5, 6)))
    notebooks = run_all.notebooks()
    assert list(rows) == [nb.stem[:2] for nb in notebooks], \
        "README's table lists the notebooks in order, with words, code lines, exercises (mechanisms) and time"
    for nb in notebooks:
        words, code, exercises, mechanisms, seconds = rows[nb.stem[:2]]
        assert abs(words - run_all.markdown_words(nb)) <= 0.1 * words, (
            f"{nb.stem} has {run_all.markdown_words(nb)} words of prose; README says {words}: update the table")
        assert abs(code - run_all.code_lines(nb)) <= 0.1 * code, (
            f"{nb.stem} has {run_all.code_lines(nb)} lines of code; README says {code}: update the table")
        assert (exercises, mechanisms) == (len(run_all.exercises(nb)), len(run_all.mechanisms(nb))), (
            f"{nb.stem} has {len(run_all.exercises(nb))} exercises, {len(run_all.mechanisms(nb))} of them "
            f"mechanisms; README says {exercises} ({mechanisms}): update the table")
        assert seconds <= run_all.BUDGET_S["cpu"], f"{nb.stem}: {seconds} s on the CPU tier is past the slot's budget"


@pytest.mark.parametrize("nb", run_all.notebooks(), ids=lambda p: p.stem)
def test_every_notebook_fits_one_slot(nb):
    """One slot of 60-90 minutes: the notebook opens on one question, reads in at most SLOT_WORDS words, and asks
    the student to build at most SLOT_MECHANISMS mechanisms (a count or a choice is not one: NOT_MECHANISMS)."""
    import json

    opening = "".join(json.loads(nb.read_text())["cells"][0]["source"])
    assert opening.count("**The question.**") == 1, f"{nb.stem}: its first cell states one question, **The question.**"
    words = run_all.markdown_words(nb)
    assert words <= run_all.SLOT_WORDS, f"{nb.stem}: {words} words of prose, past the slot's {run_all.SLOT_WORDS}"
    built = run_all.mechanisms(nb)
    assert len(built) <= run_all.SLOT_MECHANISMS, \
        f"{nb.stem}: {len(built)} graded mechanisms ({built}), past the slot's {run_all.SLOT_MECHANISMS}"


def test_not_mechanisms_names_graded_exercises():
    """NOT_MECHANISMS names graded exercises that exist, so a renamed or removed one cannot leave a mechanism
    uncounted under an old name."""
    graded = {e for nb in run_all.notebooks() for e in run_all.exercises(nb)}
    assert set(run_all.NOT_MECHANISMS) <= graded, set(run_all.NOT_MECHANISMS) - graded


def test_jobs_runs_notebooks_side_by_side_and_keeps_the_course_order(tmp_path, monkeypatch):
    """--jobs 2 (CI's floor runs the smoke tier so): two kernels at once, each notebook executed, the summary in the
    course's order, and no budget verdict (a shared machine times nothing alone)."""
    import json

    stamps = tmp_path / "stamps"
    stamps.mkdir()
    made = []
    for name in ("00_first", "01_second"):
        cells = [{"cell_type": "code", "metadata": {"tags": ["parameters"]}, "source": 'tier = "auto"',
                  "outputs": [], "execution_count": None},
                 {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
                  "source": f"import time, pathlib\nstart = time.time()\ntime.sleep(4)\n"
                            f"pathlib.Path({str(stamps / name)!r}).write_text(f'{{start}} {{time.time()}}')"}]
        nb = {"cells": cells, "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                          "language": "python"}}, "nbformat": 4, "nbformat_minor": 5}
        path = tmp_path / name / f"{name}.ipynb"
        path.parent.mkdir()
        path.write_text(json.dumps(nb))
        made.append(path)
    monkeypatch.setattr(run_all, "notebooks", lambda source="solutions": made)
    out = tmp_path / "run"
    assert run_all.main(["--tier", "cpu", "--jobs", "2", "--out", str(out)]) == 0
    (a0, a1), (b0, b1) = ([float(x) for x in (stamps / n).read_text().split()] for n in ("00_first", "01_second"))
    assert a0 < b1 and b0 < a1, "the two notebooks did not run at the same time"
    text = (out / "summary.md").read_text()
    assert text.index("## 00_first") < text.index("## 01_second") and "budget" not in text
    assert (out / "executed" / "01_second.ipynb").exists()
    # a notebook named by its whole name, as the README's table writes it, runs alone
    only = tmp_path / "only"
    assert run_all.main(["--tier", "cpu", "--out", str(only), "01_second"]) == 0
    assert [p.name for p in (only / "executed").iterdir()] == ["01_second.ipynb"]
    with pytest.raises(SystemExit):
        run_all.main(["--tier", "cpu", "--jobs", "0", "--out", str(out)])
