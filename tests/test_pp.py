"""course_lib.parallel.pp, pp_cost and pp_torch: pipeline parallelism on real gloo ranks.

The schedules' losses equal one process on the same global batch; the naive split keeps one rank
busy at a time; GPipe keeps m micro-batches of activations in flight, 1F1B at most p; the order
functions match what torch's schedules plan and run; the measured GPipe bubble matches
(p-1)/(m+p-1) with stage work simulated by sleep (see ``test_measured_gpipe_bubble``); the hand-written
executor ``run_1f1b`` equals one process under any runnable order and holds what the order says. The zero-bubble
schedules split each backward into I (the input's gradient) and W (the weights'): simulated, their bubble is below
1F1B's for no more activations; run, they equal one process and run the order torch planned.
"""

import matplotlib

matplotlib.use("Agg")

import pytest
import torch
import torch.distributed as dist
from torch import nn

from course_lib.parallel import pp, pp_cost, pp_torch
from course_lib.distributed import CollectiveBytes
from course_lib.memory import SavedTensorMeter
from course_lib.launch import launch, run_forked

STEPS, LAYERS = 5, 4  # 4 decoder layers: one per stage for interleaved (2 ranks x 2 stages)


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_order_functions_simulate_to_the_formula(p, m):
    for order in (pp.gpipe_order(p, m), pp.one_f_one_b_order(p, m)):
        assert all(sorted(o) == sorted(order[0]) for o in order)  # every rank runs each F and B once
        assert pp_cost.schedule_makespan(order)["bubble"] == pytest.approx(pp_cost.bubble_formula(p, m))
    assert pp_cost.schedule_makespan(pp.gpipe_order(p, m), 1.0, 1.0)["makespan"] == 2 * (m + p - 1)


def test_simulator_refuses_a_deadlock():
    with pytest.raises(ValueError, match="deadlock"):
        pp_cost.schedule_makespan([[("B", 0), ("F", 0)], [("F", 0), ("B", 0)]])
    with pytest.raises(ValueError, match="deadlock"):  # W reuses what I computed: it cannot come first
        pp_cost.schedule_makespan([[("F", 0), ("W", 0), ("I", 0)]])
    with pytest.raises(ValueError, match="unknown action kind"):
        pp_cost.schedule_makespan([[("F", 0), ("X", 0)]])


def test_split_backward_simulated_by_hand():
    """2 ranks, 2 micro-batches, F = I = W = 1, every W deferred to the end. Rank 1 runs F0 [1, 2], I0 [2, 3],
    F1 [3, 4], I1 [4, 5], W0, W1; rank 0 starts I0 when rank 1's I0 has ended (3), not its W0 (5), and I1 at 5."""
    order = [[("F", 0), ("F", 1), ("I", 0), ("I", 1), ("W", 0), ("W", 1)],
             [("F", 0), ("I", 0), ("F", 1), ("I", 1), ("W", 0), ("W", 1)]]
    sim = pp_cost.schedule_makespan(order, t_f=1.0, t_b=2.0, t_w=1.0)
    starts = [{(kind, mb): start for kind, mb, _, start, _ in rank} for rank in sim["intervals"]]
    assert starts[1] == {("F", 0): 1, ("I", 0): 2, ("F", 1): 3, ("I", 1): 4, ("W", 0): 5, ("W", 1): 6}
    assert starts[0] == {("F", 0): 0, ("F", 1): 1, ("I", 0): 3, ("I", 1): 5, ("W", 0): 6, ("W", 1): 7}
    assert sim["makespan"] == 8 and sim["bubble"] == pytest.approx(1 - 12 / 16)
    # I frees nothing (W still needs the saved inputs): rank 1 holds F0 and F1 at once, where B0 would have freed F0
    assert sim["in_flight"] == [2, 2]
    full = [[(k, i) for k, i in rank if k != "W"] for rank in order]
    full = [[("B" if k == "I" else k, i) for k, i in rank] for rank in full]
    assert pp_cost.schedule_makespan(full)["in_flight"] == [2, 1]
    # the costs: I is t_b - t_w, W is t_w, B both
    uneven = pp_cost.schedule_makespan([[("F", 0), ("I", 0), ("W", 0)]], t_f=1.0, t_b=3.0, t_w=0.5)
    assert [(k, e - s) for k, _, _, s, e in uneven["intervals"][0]] == [("F", 1.0), ("I", 2.5), ("W", 0.5)]


ZB_SHAPES = [(2, 4), (2, 8), (3, 6), (4, 8)]  # DualPipeV needs m >= 2p micro-batches


@pytest.mark.parametrize("p, m", ZB_SHAPES)
def test_zero_bubble_plans_shrink_the_bubble_not_the_memory(p, m):
    """torch's plans, read without a process group: every stage of every rank runs each micro-batch's F once and its
    backward once (B, or I and W); simulated with F = I = W, the zero-bubble plans idle less than 1F1B and than
    interleaved 1F1B, and hold no more micro-batch-stages than 1F1B's rank 0 holds micro-batches, per stage of the
    rank (2 stages per rank, each half the layers)."""
    orders = pp.planned_orders(p, m)
    split = {"ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble"} | ({"ScheduleDualPipeV"} & set(orders))
    assert {"ScheduleInterleaved1F1B"} | split == set(orders)
    orders["1F1B"] = pp.one_f_one_b_order(p, m)
    sims = {name: pp_cost.schedule_makespan(order) for name, order in orders.items()}
    for name in split:
        kinds = {k for rank in orders[name] for k, *_ in rank}
        assert {"F", "I", "W"} <= kinds <= {"F", "I", "W", "B"}, (name, kinds)
        for r, rank in enumerate(orders[name]):
            for mb, s in {(mb, s) for _, mb, s in rank}:
                done = sorted(k for k, i, t in rank if (i, t) == (mb, s))
                assert done in (["B", "F"], ["F", "I", "W"]), (name, r, mb, s, done)
        assert sims[name]["bubble"] < sims["ScheduleInterleaved1F1B"]["bubble"] < sims["1F1B"]["bubble"], name
    for name in split - {"ScheduleDualPipeV"}:  # DualPipeV holds one micro-batch-stage more
        assert max(sims[name]["in_flight"]) <= 2 * p == 2 * max(sims["1F1B"]["in_flight"]), name
    # what is left is the fill: rank r waits r forwards of a stage before its first input arrives
    assert sims["ScheduleZBVZeroBubble"]["bubble"] == pytest.approx((p - 1) / (p - 1 + 3 * 2 * m))


@pytest.mark.parametrize("p, m", ZB_SHAPES)
def test_an_input_gradient_never_waits_for_a_weight_gradient(p, m):
    """In every simulated plan, I (or B) of micro-batch i on stage s starts once I or B of i on s + 1 has ended,
    and W once its own I has: deferring W never makes the stage before wait longer; and W does wait in some plan."""
    deferred = False
    for name, order in pp.planned_orders(p, m).items():
        intervals = [e for rank in pp_cost.schedule_makespan(order)["intervals"] for e in rank]
        end = {(k, mb, s): e for k, mb, s, _, e in intervals}
        last = max(s for _, _, s, _, _ in intervals)
        for kind, mb, s, start, _ in intervals:
            if kind in ("I", "B") and s < last:
                assert start >= end.get(("I", mb, s + 1), end.get(("B", mb, s + 1))), (name, kind, mb, s)
            if kind == "W":
                assert start >= end[("I", mb, s)], (name, mb, s)
                deferred |= start > end[("I", mb, s)]
    assert deferred


def test_torch_order_reads_split_and_composite_actions():
    """``torch_order`` turns torch's BACKWARD_INPUT and BACKWARD_WEIGHT into I and W, and DualPipeV's OVERLAP_F_B (a
    forward and a backward issued together) into its two parts, in order."""
    from torch.distributed.pipelining import schedules as torch_schedules

    zbv = pp.planned_orders(2, 4)["ScheduleZBVZeroBubble"]
    assert zbv[0][:4] == [("F", 0, 0), ("F", 1, 0), ("F", 2, 0), ("F", 0, 3)]  # the V: rank 0 holds stages 0 and 3
    assert ("I", 0, 3) in zbv[0] and ("W", 0, 3) in zbv[0] and zbv[0].index(("I", 0, 3)) < zbv[0].index(("W", 0, 3))
    if not hasattr(torch_schedules, "ScheduleDualPipeV"):
        return
    A, kind = torch_schedules._Action, torch_schedules._ComputationType
    overlap = A(-1, kind.OVERLAP_F_B, None, (A(0, kind.FORWARD, 3), A(3, kind.FULL_BACKWARD, 1)))
    plan = {0: [A(0, kind.FORWARD, 2), None, overlap], 1: [A(1, kind.BACKWARD_INPUT, 0), A(1, kind.BACKWARD_WEIGHT, 0)]}
    assert pp.torch_order(type("Planned", (), {"pipeline_order": plan})()) == \
        [[("F", 2, 0), ("F", 3, 0), ("B", 1, 3)], [("I", 0, 1), ("W", 0, 1)]]


def test_unsupported_says_why():
    from torch.distributed import pipelining
    from torch.distributed.pipelining import schedules as torch_schedules

    assert all(pp_torch.unsupported(s) is None for s in ("naive", "gpipe", "1f1b", "interleaved", "zb"))
    assert "no schedule" in pp_torch.unsupported("zb1p")
    if hasattr(pipelining, "ScheduleDualPipeV"):
        assert pp_torch.unsupported("dualpipev") is None
    else:
        assert "has no ScheduleDualPipeV" in pp_torch.unsupported("dualpipev")
    # a V runs where torch hands the adjacent stages' tensors over in place (its runtime), not over gloo to itself
    in_place = issubclass(pipelining.ScheduleZBVZeroBubble, torch_schedules._PipelineScheduleRuntime)
    assert (pp_torch.unsupported("zbv") is None) == in_place


def _every_schedule():
    runs = {s: pp_torch.train(pp_torch.PPRun(schedule=s, microbatches=4, steps=STEPS, layers=LAYERS))
            for s in pp_torch.SCHEDULES if not pp_torch.unsupported(s)}
    # fewer micro-batches than stages: GPipe runs it (m = 1 is the naive split's bubble), 1F1B refuses it
    runs["gpipe m=1"] = pp_torch.train(pp_torch.PPRun(schedule="gpipe", microbatches=1, steps=STEPS, layers=LAYERS))
    try:
        pp_torch.train(pp_torch.PPRun(schedule="1f1b", microbatches=1, steps=1, layers=LAYERS))
    except ValueError as e:
        runs["1f1b m=1"] = str(e)
    return runs


@pytest.fixture(scope="module")
def runs():
    """Every schedule on 2 forked gloo ranks (real compute, tiny Llama), and the one-process losses."""
    return run_forked(_every_schedule, 2, timeout=240), pp_torch.reference_losses(steps=STEPS, layers=LAYERS)


@pytest.mark.parametrize("schedule", [*pp_torch.SCHEDULES, "gpipe m=1"])
def test_schedules_equal_one_process(runs, schedule):
    if why := pp_torch.unsupported(schedule.split()[0]):
        pytest.skip(why)
    ranks, reference = runs
    for r in ranks:  # every rank reports the global batch's loss
        assert r[schedule]["losses"] == pytest.approx(reference, rel=1e-5)


def test_naive_split_keeps_one_rank_busy_at_a_time(runs):
    timeline = runs[0][0]["naive"]["timeline"]
    assert [(e["rank"], e["kind"]) for e in sorted(timeline, key=lambda e: e["start"])] == \
        [(0, "F"), (1, "F"), (1, "B"), (0, "B")]
    spans = sorted((e["start"], e["end"]) for e in timeline)
    # the ranks' clocks share a base through a barrier, which leaves up to a millisecond or two of skew
    assert all(a_end <= b_start + 2e-3 for (_, a_end), (b_start, _) in zip(spans, spans[1:])), spans
    assert pp_cost.bubble_fraction(timeline) >= 0.49  # (p-1)/p at best


def test_in_flight_activations(runs):
    ranks = runs[0]
    assert ranks[0]["gpipe"]["in_flight_peak"] == [4, 4]  # m
    assert max(ranks[0]["1f1b"]["in_flight_peak"]) <= 2  # p
    # the saved-tensor bytes follow: rank 0 holds 4 micro-batches' activations under GPipe, 2 under 1F1B
    assert ranks[0]["gpipe"]["saved_bytes_peak"] > 1.6 * ranks[0]["1f1b"]["saved_bytes_peak"]


def test_fewer_microbatches_than_stages(runs):
    r = runs[0][0]
    assert pp.rank_orders(r["gpipe m=1"]["timeline"]) == pp.gpipe_order(2, 1)
    assert r["gpipe m=1"]["in_flight_peak"] == [1, 1]
    assert "microbatches (1)" in r["1f1b m=1"] and "number of stages (2)" in r["1f1b m=1"]  # torch's own words


def test_order_functions_match_what_torch_plans_and_runs(runs):
    from torch.distributed.pipelining import ScheduleGPipe

    r = runs[0][0]
    assert pp.rank_orders(r["gpipe"]["timeline"]) == pp.gpipe_order(2, 4)
    assert pp.rank_orders(r["1f1b"]["timeline"]) == pp.one_f_one_b_order(2, 4)
    if hasattr(ScheduleGPipe, "_get_pipeline_order"):  # torch >= 2.8 plans the one-stage schedules too
        assert _tuples(r["gpipe"]["planned_order"]) == pp.gpipe_order(2, 4)
        assert _tuples(r["gpipe m=1"]["planned_order"]) == pp.gpipe_order(2, 1)
        # torch's Schedule1F1B.pipeline_order is off by one on the last rank (it plans F1..F4 for m=4);
        # what that rank runs is our order, checked just above
        assert _tuples(r["1f1b"]["planned_order"])[:-1] == pp.one_f_one_b_order(2, 4)[:-1]
    else:  # torch 2.7: only the multi-stage schedules have a plan
        assert r["gpipe"]["planned_order"] is None and r["1f1b"]["planned_order"] is None
    interleaved = _tuples(r["interleaved"]["planned_order"])
    assert len(interleaved) == 2 and all(len(rank) == 2 * 2 * 4 for rank in interleaved)  # F and B, 2 stages, m=4
    assert pp.rank_orders(r["interleaved"]["timeline"]) == interleaved
    # two stages per rank: the simulated bubble shrinks below GPipe's (p-1)/(m+p-1)
    assert pp_cost.schedule_makespan(interleaved)["bubble"] < pp_cost.bubble_formula(2, 4)


def test_zero_bubble_schedules_run_their_plan(runs):
    """On the ranks, each zero-bubble schedule runs the F, I and W torch planned, in that order, the same plan
    ``planned_orders`` reads without ranks; each rank holds the micro-batch-stages the simulation of it says."""
    r = runs[0][0]
    ran = [s for s in ("zb", "zbv", "dualpipev") if not pp_torch.unsupported(s)]
    assert "zb" in ran
    without_ranks = pp.planned_orders(2, 4)
    for s in ran:
        planned = _tuples(r[s]["planned_order"])
        assert planned == without_ranks[pp_torch.MULTI_STAGE[s][0]], s
        assert pp.rank_orders(r[s]["timeline"]) == planned, s
        assert {e["kind"] for e in r[s]["timeline"]} >= {"F", "I", "W"}, s
        assert r[s]["in_flight_peak"] == pp_cost.schedule_makespan(planned)["in_flight"], s
    assert r["zb"]["in_flight_peak"] == [4, 4]  # 2 stages per rank, 2 micro-batches of each: 1F1B's rank 0 (p)


def _tuples(order):
    return [[tuple(a) for a in rank] for rank in order]


def test_plot_timeline(runs):
    fig = pp_cost.plot_timeline(runs[0][0]["1f1b"]["timeline"])
    assert len(fig.axes[0].get_yticks()) == 2


def test_measured_gpipe_bubble_matches_the_formula():
    """p=2 ranks launched as ``course_lib.parallel.pp_torch`` workers; each stage's forward padded with sleep to 40 ms
    and its backward to 80 ms (``simulate_ms``: simulated work, which needs no core, so two ranks on two busy
    cores still show the schedule). ``bubble`` is the least over steps 1-3 (other processes only add idle
    time). The schedule's idle time is the floor: no bubble falls more than 5% below (p-1)/(m+p-1). What
    torch's runtime and gloo spend between two actions (~0.4 ms on an idle machine, a few ms on CI's two
    busy cores: +13% at m = 4 there) only adds to it, at most 0.04 (0.5, 0.33, 0.2, 0.11 for m = 1, 2, 4,
    8 stay apart and in order)."""
    runs = [dict(schedule="gpipe", microbatches=m, steps=4, layers=2, batch=8, seq=16, simulate_ms=[40, 80])
            for m in (1, 2, 4, 8)]
    results = launch("course_lib.parallel.pp_torch:sweep", 2, {"runs": runs}, echo=False, timeout=120)[0]["runs"]
    for res in results:
        assert 0.95 * res["formula"] <= res["bubble"] <= res["formula"] + 0.04, (res["microbatches"], res["bubbles"])
    assert [r["bubble"] for r in results] == sorted((r["bubble"] for r in results), reverse=True)
    assert [r["in_flight_peak"] for r in results] == [[m, m] for m in (1, 2, 4, 8)]


def _mlp_stages(p):
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(p)]


def _micro_batches(m):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g)) for _ in range(m)]


def _mse(out, target):
    return (out - target).pow(2).mean()


def _executor(rank, world, m):
    """The hand-written executor on this rank's stage, in 1F1B's order and then GPipe's (fresh stages each); plain
    lists back, not tensors (a tensor through the ranks' queue is shared by a file descriptor that can go first)."""
    out = {}
    for name, orders in (("1f1b", pp.one_f_one_b_order), ("gpipe", pp.gpipe_order)):
        stage, data = _mlp_stages(world)[rank], _micro_batches(m)
        meter = SavedTensorMeter(exclude=stage)
        meter.exclude |= {t.untyped_storage().data_ptr() for xy in data for t in xy}
        with meter:  # the data stays alive all step: weights and data are not activations
            losses, peak = pp.run_1f1b(stage, rank, world, data, orders(world, m)[rank], _mse, (3, 8))
        out[name] = {"losses": losses, "peak": peak, "saved": meter.peak,
                     "grads": [q.grad.tolist() for q in stage.parameters()]}
    return out


def _executors():
    rank, world = dist.get_rank(), dist.get_world_size()
    return {m: _executor(rank, world, m) for m in (5, 2)}


def _sent_by_1f1b(m):
    """The bytes this rank's ``run_1f1b`` sends over one step of m micro-batches, counted."""
    rank, world = dist.get_rank(), dist.get_world_size()
    stage, data = _mlp_stages(world)[rank], _micro_batches(m)
    with CollectiveBytes() as sent:
        pp.run_1f1b(stage, rank, world, data, pp.one_f_one_b_order(world, m)[rank], _mse, (3, 8))
    return sent.bytes_by_kind.get("send", 0)


def test_a_middle_stage_sends_an_activation_and_a_gradient_per_micro_batch():
    """Notebook 17's PP row: 3 forked stages, 5 micro-batches of 3 x 8 floats; the middle stage sends each one's
    activation up and its gradient down, the first and the last stage one of the two."""
    m = 5
    sent = run_forked(_sent_by_1f1b, 3, dict(m=m), timeout=60)
    assert sent[1] == pp_cost.pp_bytes_per_rank(3, 8, 4, micro_batches=m) == 2 * m * 3 * 8 * 4
    assert sent[0] == sent[2] == sent[1] // 2


def test_run_1f1b_equals_one_process_and_holds_what_the_order_says():
    """3 forked ranks (a middle one receives from both sides), 5 micro-batches: the losses and every stage's
    gradients equal the stages run in sequence in one process (the mean over micro-batches), in either order;
    the count is the order's in-flight peak, p - r for 1F1B and m for GPipe, and the bytes saved for backward
    follow. With 2 micro-batches, fewer than the stages, 1F1B's warm-up is min(m, p - r)."""
    p, m = 3, 5
    runs = run_forked(_executors, p, timeout=60)
    ranks = [r[m] for r in runs]
    stages, losses = _mlp_stages(p), []
    for x, y in _micro_batches(m):
        for stage in stages:
            x = stage(x)
        loss = _mse(x, y)
        (loss / m).backward()
        losses.append(loss.item())
    for name, peaks in (("1f1b", [3, 2, 1]), ("gpipe", [m] * p)):
        assert ranks[-1][name]["losses"] == pytest.approx(losses, rel=1e-6)
        assert all(r[name]["losses"] == [] for r in ranks[:-1])
        for r, stage in zip(ranks, stages):
            for g, q in zip(r[name]["grads"], stage.parameters()):
                torch.testing.assert_close(torch.tensor(g), q.grad, rtol=1e-5, atol=1e-7)
        assert [r[name]["peak"] for r in ranks] == peaks
    # the same bytes per micro-batch under both orders: rank r's ratio is m / (p - r)
    ratios = [r["gpipe"]["saved"] / r["1f1b"]["saved"] for r in ranks]
    assert ratios == pytest.approx([m / 3, m / 2, m / 1], rel=0.01)
    few = [r[2] for r in runs]
    assert [r["1f1b"]["peak"] for r in few] == [2, 2, 1]  # min(m, p - r)
    assert few[-1]["1f1b"]["losses"] == pytest.approx(few[-1]["gpipe"]["losses"], rel=1e-6)


def _traced_counts(schedule: str, trace_dir: str) -> dict:
    """A rank's ``trace_step`` trace read back where it was made (pandas stays out of the test's own process)."""
    spans = pp_torch.pipeline_spans(pp_torch.trace_step(schedule, trace_dir)["path"])
    return {"kinds": spans.kind.value_counts().to_dict(),
            "forwards": sorted(spans.mb[spans.kind == "F"].astype(int).tolist())}


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_a_traced_step_names_every_action_and_transfer(schedule, tmp_path):
    """Under torch.profiler the Recorder names every F, B, I and W (torch names only GPipe's), and gloo every send
    and receive: 2 ranks, 4 micro-batches, one stage per rank (1F1B) or two in a loop (interleaved zero bubble)."""
    counts = run_forked(_traced_counts, 2, dict(schedule=schedule, trace_dir=str(tmp_path)), timeout=240)
    v = 2 if schedule == "zb" else 1
    for rank, c in enumerate(counts):
        kinds = c["kinds"]
        assert c["forwards"] == sorted(list(range(4)) * v), (rank, c)
        if schedule == "1f1b":
            assert kinds == {"F": 4, "B": 4, "send": 4, "recv": 4}, (rank, kinds)
        else:  # the backward split: an I and a W per micro-batch and stage, never a whole B
            assert kinds["I"] == kinds["W"] == 4 * v and "B" not in kinds, (rank, kinds)
            assert kinds["send"] == kinds["recv"] > 0, (rank, kinds)
    assert (tmp_path / f"15_pp_{schedule}_rank1.json").exists()
