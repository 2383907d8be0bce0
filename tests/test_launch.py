"""Launching worker processes from a notebook: real torchrun, real gloo, several processes."""

import textwrap
import threading
import time

import pytest
import torch

from course_lib.distributed import free_port
from course_lib.launch import WorkerError, check_world, launch, run_forked


def rel_diff(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_ddp_on_two_ranks_matches_one_process_on_the_global_batch():
    two = launch("course_lib.ddp:train", nprocs=2, kwargs={"steps": 6, "global_batch": 32}, echo=False)
    one = launch("course_lib.ddp:train", nprocs=1, kwargs={"steps": 6, "global_batch": 32}, echo=False)
    assert [r["rank"] for r in two] == [0, 1] and two[0]["world_size"] == 2
    assert two[0]["losses"] == two[1]["losses"]  # the reported loss is already the global mean
    assert two[0]["digest"] == two[1]["digest"]  # replicas stay identical
    assert len(one[0]["losses"]) == 6
    assert rel_diff(two[0]["losses"], one[0]["losses"]) < 1e-5


def test_hand_written_all_reduce_matches_ddp_with_accumulation():
    ddp = launch("course_lib.ddp:train", nprocs=2, kwargs={"steps": 5, "accum_steps": 2}, echo=False)
    manual = launch("course_lib.ddp:train", nprocs=2, kwargs={"steps": 5, "accum_steps": 2, "mode": "manual"},
                    echo=False)
    assert rel_diff(manual[0]["losses"], ddp[0]["losses"]) < 1e-5
    assert abs(manual[0]["digest"] - ddp[0]["digest"]) / ddp[0]["digest"] < 1e-5


def test_a_failing_rank_ends_the_launch_at_once_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"(?s)rank 1 .*this rank fails on purpose"):
        launch("course_lib.ddp:fail_on_rank", nprocs=2, kwargs={"rank_to_fail": 1}, echo=False, timeout=120)
    assert time.monotonic() - start < 60, "rank 0 waited in its barrier instead of being stopped"


def test_output_is_streamed_with_rank_prefixes(capsys):
    launch("course_lib.ddp:train", nprocs=2, kwargs={"steps": 1}, echo=True)
    out = capsys.readouterr().out
    with pytest.raises(WorkerError):
        launch("course_lib.ddp:fail_on_rank", nprocs=2, kwargs={"rank_to_fail": 0, "message": "boom"}, echo=True)
    out += capsys.readouterr().out
    assert "[rank0] RuntimeError: boom" in out


def test_a_worker_module_written_by_the_notebook_runs_and_times_out(tmp_path, monkeypatch):
    (tmp_path / "my_worker.py").write_text(textwrap.dedent("""
        import time
        import torch.distributed as dist

        def hello(greeting):
            return {"text": f"{greeting} from {dist.get_rank()}"}

        def sleep_forever():
            time.sleep(3600)
    """))
    monkeypatch.chdir(tmp_path)  # like %%writefile in the notebook's folder
    assert [r["text"] for r in launch("my_worker:hello", 2, {"greeting": "hi"}, echo=False)] == ["hi from 0", "hi from 1"]
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="timeout=8"):
        launch("my_worker:sleep_forever", 2, echo=False, timeout=8)
    assert time.monotonic() - start < 30


def test_two_nodes_rendezvous_on_localhost():
    endpoint, results = f"127.0.0.1:{free_port()}", {}

    def node(rank):
        results[rank] = launch("course_lib.ddp:train", nprocs=1, kwargs={"steps": 3}, nnodes=2, node_rank=rank,
                               rdzv_endpoint=endpoint, echo=False, timeout=120)

    threads = [threading.Thread(target=node, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=150)
    assert sorted(r[0]["rank"] for r in results.values()) == [0, 1]
    assert all(r[0]["world_size"] == 2 for r in results.values())
    assert results[0][0]["losses"] == results[1][0]["losses"]


def test_world_sizes_the_hardware_lacks_are_refused():
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="nprocs=2 but this machine has 0 GPU"):
            check_world(2, "cuda")
    with pytest.raises(ValueError, match="nprocs=1000"):
        check_world(1000, "cpu")
    with pytest.raises(ValueError, match="module:function"):
        launch("course_lib.ddp.train", 2)


def test_run_forked_runs_a_function_defined_here_and_reports_failures():
    import torch.distributed as dist

    def rank_sum(rank, world, offset):  # a closure: spawn could not pickle it, fork needs not
        t = torch.tensor([rank + offset], dtype=torch.float32)
        dist.all_reduce(t)
        return t.item()

    assert run_forked(rank_sum, 2, 10) == [21.0, 21.0]

    def broken(rank, world):
        if rank == 1:
            raise ValueError("rank one is broken")
        return rank

    with pytest.raises(WorkerError, match="(?s)rank 1 failed.*rank one is broken"):
        run_forked(broken, 2, timeout=30)


def test_run_forked_refuses_a_process_that_already_has_a_group():
    import torch.distributed as dist

    from course_lib.distributed import single_process_group

    single_process_group()
    try:
        with pytest.raises(RuntimeError, match="destroy_process_group"):
            run_forked(lambda rank, world: rank, 2)
    finally:
        dist.destroy_process_group()
