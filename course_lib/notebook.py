"""What every notebook's first code cell does, in one call.

    SIZES = {"smoke": dict(width=8, batch=32), "cpu": dict(width=16, batch=256), "gpu": ..., "node": ...}
    tier, size, device, results = course_setup("03_gradient_accumulation", tier, SIZES, seed=seed)

``course_setup`` resolves the ``tier`` parameter (``device.pick_tier``: "auto" picks from the
hardware, and "smoke" while nbgrader grades), takes that tier's sizes (with any overrides the
notebook's parameters give), picks the device (the first GPU on the gpu and node tiers, else the
CPU), seeds torch, opens the notebook's results file, and prints one line that says all of it.
The sizes stay in the notebook: they are part of what it teaches (one code path, four sizes).

A notebook that launches ranks also gives ``emulate``: the widths (model preset, sequence, batch, ...)
that replace the node tier's when ``python -m course_lib.apps.run_all --tier node --emulate`` runs the
node's layout (its world sizes, meshes, micro-batch counts and pipeline stages) on CPU ranks over gloo.
Every other size keeps the node tier's value, so a layout that cannot run fails there, on a CPU.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from course_lib.device import TIERS, default_device, emulating_node, pick_tier
from course_lib.launch import use_extensions_dir
from course_lib.results import Results


class Setup(NamedTuple):
    """A notebook's tier, its sizes, its device and its results file."""

    tier: str
    size: dict
    device: torch.device
    results: Results


def course_setup(notebook: str, tier: str = "auto", sizes: dict[str, dict] | None = None, *, seed: int = 0,
                 emulate: dict | None = None, **overrides) -> Setup:
    """The set-up of notebook ``notebook`` (its file name without ``.ipynb``) on ``tier``.

    ``sizes`` maps each tier to a dict of sizes; ``overrides`` replace entries of it (a None
    override keeps the tier's value, so a notebook can pass its parameters straight through).
    ``emulate`` holds the widths that replace the node tier's while it is emulated on CPU ranks.
    """
    tier = pick_tier(tier)
    sizes = sizes or {}
    missing = [t for t in TIERS if t not in sizes]
    if sizes and missing:
        raise ValueError(f"sizes has no entry for the tiers {missing}: give every tier of {TIERS} its sizes")
    # One code path, four sizes: a size that one tier lacks fails there alone (11's gpu tier once lacked
    # cli_steps, found only on a GPU), so every tier is held to the same names here, on whichever tier runs.
    names = set().union(*sizes.values())
    lacking = {t: sorted(names.difference(s)) for t, s in sizes.items() if not names.issubset(s)}
    if lacking:
        raise ValueError(f"every tier needs the same sizes; {lacking} lacking: give each of them a value there")
    size = dict(sizes.get(tier, {}))
    emulated = tier == "node" and emulating_node()
    if emulated:
        size.update(_emulated_widths(notebook, size, emulate))
    unknown = sorted(set(overrides) - set(size))
    if unknown:
        raise ValueError(f"overrides {unknown} are not sizes of this notebook (it has {sorted(size)})")
    size.update({k: v for k, v in overrides.items() if v is not None})
    device = default_device() if tier in ("gpu", "node") and not emulated else torch.device("cpu")
    # DeepSpeed's ops where `make setup` built them, for this kernel and every process it starts (ranks, the
    # grader's child, which copies them): else each graded DeepSpeed check rebuilt them, about 50 s a time
    use_extensions_dir()
    torch.manual_seed(seed)
    results = Results(notebook)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else torch.backends.cpu.get_cpu_capability()
    shown = ", ".join(f"{k}={v}" for k, v in size.items())
    how = " (emulated: the node's layout on CPU ranks over gloo, tiny widths)" if emulated else ""
    print(f"{notebook}: tier={tier}{how}, device={device} ({where}); sizes: {shown or 'none'}")
    return Setup(tier, size, device, results)


def _emulated_widths(notebook: str, size: dict, emulate: dict | None) -> dict:
    """The widths that replace the node tier's sizes in an emulated run, checked against them."""
    if emulate is None:
        raise ValueError(f"{notebook} runs on one device, so there is no node layout to emulate on CPU ranks: "
                         f"run it with tier='cpu' here, or with tier='node' on a GPU node")
    unknown = sorted(set(emulate) - set(size))
    if unknown:
        raise ValueError(f"emulate names {unknown}, which are not node-tier sizes of {notebook} "
                         f"(it has {sorted(size)})")
    return emulate
