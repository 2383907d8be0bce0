"""What a pipeline costs: its bubble and its bytes by formula, an order's makespan, bubble and activations in
flight simulated, and the same read from a timeline a run recorded.

- ``bubble_formula``: the idle share of a fill-drain pipeline of p stages and m micro-batches, (p-1)/(m+p-1) (GPipe's
  and 1F1B's); ``pp_bytes_per_rank``: what a stage sends per step, as ``CollectiveBytes`` counts it.
- ``schedule_makespan``: an order (``course_lib.parallel.pp``'s ``gpipe_order``, ``one_f_one_b_order``, torch's plans
  read by ``planned_orders``) simulated with unit costs: its makespan, its bubble, its activations in flight, or the
  deadlock it runs into; ``simulated_timeline`` gives its intervals as a recorded timeline.
- ``bubble_fraction`` and ``in_flight_peak`` read a timeline (a ``Recorder``'s, gathered from every rank, or the
  simulator's) and ``plot_timeline`` draws it: the costs measured, to hold the formula and the simulation to.

The schedules themselves, the executor by hand and the ``Recorder`` are ``course_lib.parallel.pp``; torch's
schedules run on the course's Llama in ``course_lib.parallel.pp_torch``.
"""

from __future__ import annotations

from course_lib.parallel.pp import Action


# ---------------------------------------------------------------- the formulas

def bubble_formula(p: int, m: int) -> float:
    """The idle share of a fill-drain pipeline of p equal stages and m micro-batches: (p-1)/(m+p-1)."""
    return (p - 1) / (m + p - 1)


def pp_bytes_per_rank(tokens: int, hidden: int, dtype_bytes: int = 4, micro_batches: int = 1) -> int:
    """Bytes a middle pipeline stage sends per step, as ``CollectiveBytes`` counts them: each micro-batch's
    activation to the next stage and its gradient back to the one before, ``tokens x hidden`` each (the first
    and the last stage send one of the two)."""
    return 2 * micro_batches * tokens * hidden * dtype_bytes


# ---------------------------------------------------------------- an order, simulated

def _needs(kind: str, mb: int, s: int, last_stage: int) -> list[tuple]:
    """What action (kind, mb, s) waits for. ("dx", mb, s) is the gradient of stage s's input, made by its I or B."""
    if kind == "F":
        return [("F", mb, s - 1)] if s > 0 else []
    if kind == "W":  # the weights' gradient reuses what I computed (the output's gradient, the saved inputs)
        return [("I", mb, s)]
    if kind in ("B", "I"):
        return [("F", mb, s)] + ([("dx", mb, s + 1)] if s < last_stage else [])
    raise ValueError(f"unknown action kind {kind!r}: use F, B, I or W")


def schedule_makespan(order: list[list[Action]], t_f: float = 1.0, t_b: float = 2.0, t_w: float | None = None) -> dict:
    """Simulate the timeline of ``order`` (per rank, its actions) with forward cost ``t_f``, backward ``t_b``.

    An action ("F", i) runs stage = rank; ("F", i, s) names its stage. A backward is B (whole) or split:
    I (the input's gradient, ``t_b - t_w``) then W (the weights' gradient, ``t_w``; half of ``t_b`` unless
    told). F of micro-batch i on stage s waits for F i on s-1; B or I of i on s for F i on s and for B or
    I of i on s+1 (not its W: the stage before needs only the input's gradient); W for I of i on the same
    stage. A rank runs its actions in order, each as soon as it is free and the inputs are there;
    communication is free. Returns per rank its (kind, mb, stage, start, end) intervals, the makespan,
    bubble = 1 - busy / (p × makespan), and ``in_flight``: per rank the most micro-batch-stages whose
    activations were held at once (``in_flight_peak``: from F until W or B).
    """
    p = len(order)
    t_w = t_b / 2 if t_w is None else t_w
    cost = {"F": t_f, "B": t_b, "I": t_b - t_w, "W": t_w}
    acts = [[(a[0], a[1], a[2] if len(a) > 2 else r) for a in actions] for r, actions in enumerate(order)]
    last_stage = max(s for actions in acts for _, _, s in actions)
    done: dict[tuple, float] = {}  # (kind, mb, stage) -> end time
    free, nxt = [0.0] * p, [0] * p
    intervals: list[list[tuple]] = [[] for _ in range(p)]
    while any(nxt[r] < len(acts[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while nxt[r] < len(acts[r]):
                kind, mb, s = acts[r][nxt[r]]
                deps = _needs(kind, mb, s, last_stage)
                if any(d not in done for d in deps):
                    break
                start = max([free[r]] + [done[d] for d in deps])
                free[r] = done[(kind, mb, s)] = start + cost[kind]
                if kind in ("B", "I"):
                    done[("dx", mb, s)] = free[r]
                intervals[r].append((kind, mb, s, start, free[r]))
                nxt[r], progressed = nxt[r] + 1, True
        if not progressed:
            raise ValueError(f"the order deadlocks: next actions {[acts[r][nxt[r]:nxt[r] + 1] for r in range(p)]}")
    makespan = max(free)
    busy = sum(e - s for rank in intervals for *_, s, e in rank)
    return {"intervals": intervals, "makespan": makespan, "bubble": 1 - busy / (p * makespan),
            "in_flight": in_flight_peak(simulated_timeline(intervals))}


def simulated_timeline(intervals: list[list[tuple]]) -> list[dict]:
    """``schedule_makespan``'s intervals as a ``Recorder`` timeline (one dict per action, times in the simulator's
    units), so that ``bubble_fraction``, ``in_flight_peak``, ``rank_orders`` and ``plot_timeline`` read it."""
    return [dict(rank=r, kind=kind, mb=mb, stage=s, start=start, end=end)
            for r, rank in enumerate(intervals) for kind, mb, s, start, end in rank]


# ---------------------------------------------------------------- a timeline, read

def bubble_fraction(timeline: list[dict]) -> float:
    """Measured idle share: 1 - busy / (p × makespan), p the ranks in ``timeline``, the makespan from the
    first start to the last end on any rank."""
    p = len({e["rank"] for e in timeline})
    makespan = max(e["end"] for e in timeline) - min(e["start"] for e in timeline)
    busy = sum(e["end"] - e["start"] for e in timeline)
    return 1 - busy / (p * makespan)


def in_flight_peak(timeline: list[dict]) -> list[int]:
    """Per rank, the most micro-batches whose activations were alive at once: forwards done minus backwards
    done, at its maximum (several stages on one rank count together: micro-batch-stages). A split backward
    frees them at its W, not its I: the weights' gradient needs the inputs each layer saved."""
    peaks = []
    for r in sorted({e["rank"] for e in timeline}):
        alive = peak = 0
        for e in sorted((e for e in timeline if e["rank"] == r), key=lambda e: e["start"]):
            alive += {"F": 1, "B": -1, "W": -1}.get(e["kind"], 0)
            peak = max(peak, alive)
        peaks.append(peak)
    return peaks


def plot_timeline(timeline: list[dict], ax=None, title: str | None = None, scale: float = 1e3,
                  xlabel: str = "ms since the step began"):
    """One row per rank, a box per forward (light), backward (dark: B whole, I the input's gradient) and weight
    gradient (W, hatched), coloured per micro-batch and labelled F0, B0, I0, W0, ...; the title gives the measured
    bubble. ``scale`` turns the timeline's times into the x axis' (seconds to ms; 1 for ``simulated_timeline``).
    Returns the figure."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.6 + 0.5 * len({e["rank"] for e in timeline})))
    colours, t0 = plt.get_cmap("tab10"), min(e["start"] for e in timeline)
    for e in timeline:
        start, width = (e["start"] - t0) * scale, (e["end"] - e["start"]) * scale
        colour = colours(e["mb"] % 10)
        ax.broken_barh([(start, width)], (e["rank"] - 0.4, 0.8), facecolors=colour, edgecolor="black", linewidth=0.5,
                       alpha=0.55 if e["kind"] == "F" else 1.0, hatch="///" if e["kind"] == "W" else None)
        ax.text(start + width / 2, e["rank"], f"{e['kind']}{e['mb']}", ha="center", va="center", fontsize=7)
    ranks = sorted({e["rank"] for e in timeline})
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title or f"measured bubble {bubble_fraction(timeline):.1%}")
    ax.figure.tight_layout()
    return ax.figure
