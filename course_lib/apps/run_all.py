"""The course's main job: execute every notebook with papermill and write one summary.

    python -m course_lib.apps.run_all                 # every notebook, tier picked from the hardware
    python -m course_lib.apps.run_all --tier cpu 00 02 # some notebooks, a given tier
    python -m course_lib.apps.run_all --tier node --emulate   # the node's layout on CPU ranks (notebooks with ranks)
    python -m course_lib.apps.run_all --tier smoke --jobs 2   # two notebooks at a time: that they run, not timings

Executed notebooks go to ``runs/executed/``, each notebook's recorded values and figures
to ``runs/results/`` and ``runs/figures/``, and ``runs/summary.md`` gathers them: a table
of what each notebook measured, each seed claim and whether it held here, and the plots.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm.auto import tqdm

from course_lib import results
from course_lib.device import EMULATE_NODE_ENV, pick_tier, system_report

ROOT = Path(__file__).resolve().parents[2]  # course_lib/apps/ -> the repository
# One notebook's wall-clock budget per tier, in seconds: the cpu tier on 2 cores, the gpu tier on one H100 and the
# node tier on an 8-GPU node must each fit a workshop slot with time to read. The measurements that cannot (10's
# size sweep, 13's 8B benchmark) sit behind the notebooks' long_runs parameter (--long-runs), which has no budget.
# (The smoke tier is nbgrader's: its limit is per cell, COURSE_CELL_TIMEOUT.)
BUDGET_S = {"cpu": 180, "gpu": 600, "node": 900}
# One notebook is one slot of 60-90 minutes: one question, at most this many words of prose and this many graded
# mechanisms (a student builds two things in a slot, not three).
SLOT_WORDS = 2500
SLOT_MECHANISMS = 2
# The graded exercises that are not a mechanism, and so not counted against SLOT_MECHANISMS: a count or a formula
# from a config's numbers, or one choice between pieces the notebook gives.
NOT_MECHANISMS = {
    "llama_param_count": "a count: the Llama's parameters from its config",
    "training_memory": "a formula: bytes per value times the parameters, per state",
    "micro_step_context": "a choice: DDP's no_sync on every micro-step but the last",
    "shard_state_bytes": "a formula: each state's bytes over the ranks a strategy shards it across",
    "lora_params": "a count: the adapters' parameters from the config, r and the target modules",
}


def notebooks(source: str = "solutions") -> list[Path]:
    """The course notebooks in order: ``solutions/NN_x/NN_x.ipynb`` or ``notebooks/NN_x.ipynb``."""
    base = ROOT / source
    pattern = "[0-9][0-9]_*/[0-9][0-9]_*.ipynb" if source == "solutions" else "[0-9][0-9]_*.ipynb"
    return sorted(p for p in base.glob(pattern) if ".ipynb_checkpoints" not in p.parts)


def markdown_words(notebook: Path) -> int:
    """Words of prose in ``notebook`` (its markdown cells): how long it reads, for the README's table."""
    cells = json.loads(notebook.read_text())["cells"]
    return sum(len("".join(c["source"]).split()) for c in cells if c["cell_type"] == "markdown")


def code_lines(notebook: Path) -> int:
    """Non-blank lines of code in ``notebook`` (its code cells, solutions included): how much a student reads and
    runs, for the README's table."""
    cells = json.loads(notebook.read_text())["cells"]
    return sum(1 for c in cells if c["cell_type"] == "code" for line in "".join(c["source"]).splitlines()
               if line.strip())


def exercises(notebook: Path) -> list[str]:
    """The graded exercises of ``notebook``: the ids of its solution cells, in order."""
    cells = json.loads(notebook.read_text())["cells"]
    meta = [c.get("metadata", {}).get("nbgrader", {}) for c in cells]
    return [m["grade_id"] for m in meta if m.get("solution") and not m.get("grade")]


def mechanisms(notebook: Path) -> list[str]:
    """The graded exercises of ``notebook`` that build a mechanism: all but the counts and choices
    (``NOT_MECHANISMS``)."""
    return [e for e in exercises(notebook) if e not in NOT_MECHANISMS]


def emulates_node(notebook: Path) -> bool:
    """Whether ``notebook`` launches ranks and so gives ``course_setup`` the widths of an emulated node run."""
    cells = json.loads(notebook.read_text())["cells"]
    return any("course_setup(" in src and "emulate=" in src
               for src in ("".join(c["source"]) for c in cells if c["cell_type"] == "code"))


def execute(notebook: Path, run_dir: Path, parameters: dict | None = None, progress: bool = False,
            timeout: int | None = None) -> float:
    """Execute one notebook with papermill into ``run_dir/executed``; returns its wall time in seconds.

    The notebook records its results under ``run_dir`` (``COURSE_RUN_DIR`` is set for its
    kernel). A failing cell raises ``papermill.PapermillExecutionError`` naming the cell.
    """
    import papermill as pm

    run_dir = Path(run_dir).resolve()
    (run_dir / "executed").mkdir(parents=True, exist_ok=True)
    os.environ["COURSE_RUN_DIR"] = str(run_dir)  # inherited by the kernel papermill starts
    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    start = time.perf_counter()
    pm.execute_notebook(str(notebook), str(run_dir / "executed" / notebook.name), parameters=parameters or {},
                        kernel_name="python3", progress_bar=progress, cwd=str(notebook.parent),
                        execution_timeout=timeout)
    return time.perf_counter() - start


def over_budget(timings: dict[str, float], budget_s: float | None) -> dict[str, float]:
    """The notebooks of ``timings`` that ran past ``budget_s`` seconds (none when there is no budget)."""
    return {name: s for name, s in timings.items() if budget_s is not None and s == s and s > budget_s}


def write_summary(run_dir: Path, timings: dict[str, float], tier: str, budget_s: float | None = None) -> Path:
    """``run_dir/summary.md``: per notebook, its time (against ``budget_s``), values, claims and figures."""
    lines = ["# Course run summary", "", f"Tier: **{tier}**", "", "| system | |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in system_report().items()]
    over = over_budget(timings, budget_s)
    claims = [c for name in timings if (run_dir / "results" / f"{name}.json").exists()
              for c in results.load(name, run_dir)["claims"]]
    if claims:
        total = results.kind_counts(claims)
        lines += ["", "Claims of the whole run, by how each was reached (only a measured claim holds or fails):", "",
                  "| kind | what it means | claims |", "| --- | --- | --- |"]
        lines += [f"| measured | {results.KINDS['measured']} | {total.get('held', 0)} held, "
                  f"{total.get('did not hold', 0)} did not |"]
        lines += [f"| {k} | {meaning} | {total.get(k, 0)} |" for k, meaning in results.KINDS.items() if k != "measured"]
    for name, seconds in timings.items():
        budget = "" if budget_s is None else f" (budget {budget_s:.0f} s{': OVER' if name in over else ''})"
        lines += ["", f"## {name}", "", f"Executed in {seconds:.1f} s{budget}." if seconds == seconds else "Failed."]
        try:
            data = results.load(name, run_dir)
        except FileNotFoundError:
            lines += ["", "(no results recorded)"]
            continue
        if data["values"]:
            lines += ["", "| measured | value | unit |", "| --- | --- | --- |"]
            for key, v in data["values"].items():
                val = v["value"]
                shown = f"{val:.4g}" if isinstance(val, float) else str(val)
                lines.append(f"| {key} | {shown} | {v['unit']} |")
        if data["claims"]:
            counts = ", ".join(f"{n} {k}" for k, n in results.kind_counts(data["claims"]).items())
            lines += ["", f"Claims: {counts}. Only a measured claim holds or fails here.", "",
                      "| claim | source | what this run found | kind | verdict |", "| --- | --- | --- | --- | --- |"]
            for c in data["claims"]:
                lines.append(f"| {c['claim']} | {c['source']} | {c['measured']} | {c.get('kind', 'measured')} | "
                             f"{results.verdict(c)} |")
        for fig in data["figures"]:
            lines += ["", f"![{Path(fig).stem}]({fig})"]
    path = run_dir / "summary.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _parser() -> argparse.ArgumentParser:
    """run_all's command line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("only", nargs="*",
                        help="notebooks to run (default: all), by number or name, e.g. 00 03_gradient_accumulation")
    parser.add_argument("--tier", default="auto", help="auto (default), cpu, gpu or node")
    parser.add_argument("--out", default=str(ROOT / "runs"), help="run folder (default: runs/)")
    parser.add_argument("--source", default="solutions", choices=["solutions", "notebooks"],
                        help="execute the complete solutions (default) or the student release")
    parser.add_argument("--long-runs", action="store_true",
                        help="also the measurements past a workshop slot (06's size sweep, 07's 8B benchmark on a GPU)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="notebooks executed at once (default 1: each one's time is then its own; more shares the "
                             "cores, for a run that checks the notebooks, not their timings)")
    parser.add_argument("--emulate", action="store_true",
                        help="with --tier node: the node's layout on CPU ranks at tiny widths, for the notebooks that "
                             "launch ranks (what a GPU node would run, checked on any machine)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m course_lib.apps.run_all``: execute the notebooks on this machine's tier,
    write ``runs/summary.md``."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: give 1 or more notebooks at a time")
    if args.emulate:
        if args.tier != "node":
            parser.error("--emulate runs the node tier's layout on CPU ranks: give it with --tier node")
        os.environ[EMULATE_NODE_ENV] = "1"  # read by pick_tier and course_setup in each notebook's kernel

    tier = pick_tier(args.tier)
    available = [p for p in notebooks(args.source) if not args.emulate or emulates_node(p)]
    missed = [o for o in args.only if not any(o in (p.name[:2], p.stem) for p in available)]
    chosen = [p for p in available if not args.only or {p.name[:2], p.stem} & set(args.only)]
    if missed or not chosen:
        parser.error(f"no notebook{' that launches ranks' if args.emulate else ''} matches {missed or args.only}; "
                     f"available, by number or name: {[p.stem for p in available]}")
    run_dir = Path(args.out).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)  # the summary is written even when the first notebook cannot start
    params = {"tier": tier, **({"long_runs": True} if args.long_runs else {})}

    def run(nb: Path) -> tuple[float, Exception | None]:
        try:
            return execute(nb, run_dir, params, progress=args.jobs == 1), None
        except Exception as err:  # keep going: the summary says which notebook failed and why
            if type(err).__name__ != "PapermillExecutionError":  # it never reached a cell: say why in full
                traceback.print_exc()
            return float("nan"), err

    timings, failed = {}, []
    bar = tqdm(total=len(chosen), desc="course", unit="notebook")
    # each notebook's kernel is its own process: threads only wait on them (ranks take free ports, so two notebooks
    # that launch ranks side by side do not collide); the order of the summary stays the course's
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for nb, (seconds, err) in zip(chosen, pool.map(run, chosen)):
            timings[nb.stem] = seconds
            if err is not None:
                failed.append((nb.stem, err))
            bar.update(1)
            bar.set_postfix_str(nb.stem)
            tqdm.write(f"{nb.stem}: {seconds:.1f} s")
    bar.close()
    budget = None if args.long_runs or args.emulate or args.jobs > 1 else BUDGET_S.get(tier)
    summary = write_summary(run_dir, timings, f"{tier} (emulated on CPU ranks)" if args.emulate else tier, budget)
    print(f"\nexecuted notebooks: {run_dir / 'executed'}\nsummary: {summary}")
    for name, seconds in over_budget(timings, budget).items():
        print(f"OVER BUDGET {name}: {seconds:.0f} s, the {tier} tier's budget is {budget:.0f} s", file=sys.stderr)
    for name, err in failed:
        print(f"FAILED {name}: {str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__}",
              file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
