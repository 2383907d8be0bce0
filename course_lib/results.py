"""Named results a notebook records, for the tests and the course summary to read back.

A notebook makes ``results = Results("01_mixed_precision")`` and calls
``results.record("bf16_speedup", 1.7)``, ``results.claim(...)`` and ``results.figure(fig,
"speed")``. Values go to ``<run dir>/results/<notebook>.json`` and figures to
``<run dir>/figures/``; the run dir is ``$COURSE_RUN_DIR``, or ``runs/`` where the course
is run from.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path


# How a claim's finding was reached. Only a measured one is a verdict on this machine.
KINDS = {
    "measured": "measured on this device",
    "predicted": "arithmetic from a formula or a config: nothing ran",
    "simulated": "ran here, but padded, emulated or calibrated so that it shows the effect",
    "not measured here": "needs hardware this run did not have (a GPU)",
}


def verdict(claim: dict) -> str:
    """What the summary shows for a claim: held / did not hold for a measured one, else its kind's finding."""
    kind = claim.get("kind", "measured")  # results written before claims had kinds were all measurements
    if kind == "measured":
        return "held" if claim["held"] else "did not hold"
    if kind == "not measured here":
        return "not measured here"
    return f"{kind}: {'agrees' if claim['agrees'] else 'disagrees'}"


def kind_counts(claims: list[dict]) -> dict[str, int]:
    """``{"held": n, "did not hold": n, "predicted": n, "simulated": n, "not measured here": n}`` (zeros left out)."""
    out: dict[str, int] = {}
    for c in claims:
        key = verdict(c) if c.get("kind", "measured") == "measured" else c["kind"]
        out[key] = out.get(key, 0) + 1
    order = ["held", "did not hold", "predicted", "simulated", "not measured here"]
    return {k: out[k] for k in order if k in out}


def run_dir() -> Path:
    """Where executed notebooks, results and figures go (created on first use)."""
    d = Path(os.environ.get("COURSE_RUN_DIR", "runs")).resolve()
    d.mkdir(parents=True, exist_ok=True)
    return d


def _plain(value):
    """JSON-safe: tensors and numpy scalars become floats, NaN stays as None."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


class Results:
    """The results file of one notebook."""

    def __init__(self, notebook: str):
        self.notebook = notebook
        self.path = run_dir() / "results" / f"{notebook}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.data = {"notebook": notebook, "values": {}, "claims": [], "figures": []}
        self._save()

    def _save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        tmp.replace(self.path)

    def record(self, name: str, value, unit: str = "") -> object:
        """Store a measured value under ``name``; returns the value."""
        self.data["values"][name] = {"value": _plain(value), "unit": unit}
        self._save()
        return value

    def claim(self, claim: str, measured: str, held: bool | None = None, source: str = "",
              kind: str = "measured") -> bool | None:
        """A claim from the seeds and what this run found; ``kind`` says how (``KINDS``).

        Only a ``measured`` claim holds or fails: ``held`` is its verdict. A ``predicted`` or ``simulated`` one
        records in ``agrees`` whether the arithmetic or the simulation agrees with it (``held`` is None: nothing on
        this machine decided it); one ``not measured here`` records neither. Returns the verdict or the agreement.
        """
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r}: use one of {list(KINDS)}")
        if (held is None) != (kind == "not measured here"):
            raise ValueError(f"a {kind} claim {'takes no' if held is not None else 'needs a'} held=True/False: "
                             f"{claim!r}")
        entry = {"claim": claim, "measured": measured, "kind": kind, "source": source,
                 "held": bool(held) if kind == "measured" else None,
                 "agrees": bool(held) if kind in ("predicted", "simulated") else None}
        self.data["claims"].append(entry)
        self._save()
        return entry["held"] if kind == "measured" else entry["agrees"]

    def conclusions(self) -> str:
        """This run's claims as a markdown list, each with its verdict (``verdict``) and what was found: a notebook's
        closing section shows this, so a claim that was predicted, simulated, not measured or failed here never
        reads as held."""
        return "\n".join(f"- **{verdict(c)}**: {c['claim']} ({c['measured']})" for c in self.data["claims"]) \
            or "No claim was recorded in this run."

    def figure(self, fig, name: str) -> Path:
        """Save a matplotlib figure as a PNG beside the results."""
        path = run_dir() / "figures" / f"{self.notebook}_{name}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100, bbox_inches="tight")
        self.data["figures"].append(str(path.relative_to(run_dir())))
        self._save()
        return path


def load(notebook: str, directory: Path | str | None = None) -> dict:
    """The results a notebook recorded, as saved by ``Results``."""
    base = Path(directory) if directory else run_dir()
    return json.loads((base / "results" / f"{notebook}.json").read_text())


def value(notebook: str, name: str, directory: Path | str | None = None):
    """One recorded value."""
    return load(notebook, directory)["values"][name]["value"]
