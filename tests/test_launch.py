"""Launching worker processes from a notebook: real torchrun, real gloo, several processes.

What the launched techniques compute (DDP, FSDP and ZeRO against one process) is tested where the
notebooks measure it (tests/test_notebook_06.py to test_notebook_10.py): here, the launcher itself.
"""

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from course_lib.device import gpu_count, ranks_device
from course_lib.distributed import free_port
import course_lib.launch
from course_lib.launch import WorkerError, check_world, launch, on_ranks, run_forked
from course_lib.parallel import zero_deepspeed
from course_lib.parallel.ddp_torch import DDPRun


def test_a_failing_rank_ends_the_launch_at_once_with_its_traceback_streamed_with_rank_prefixes(capsys):
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"(?s)rank 1 .*this rank fails on purpose"):
        launch("course_lib.parallel.ddp_torch:fail_on_rank", nprocs=2, kwargs={"rank_to_fail": 1}, echo=True,
               timeout=120, device_type="cpu")
    assert time.monotonic() - start < 60, "rank 0 waited in its barrier instead of being stopped"
    assert "[rank1] RuntimeError: this rank fails on purpose" in capsys.readouterr().out


def test_a_worker_module_written_by_the_notebook_runs_and_times_out(tmp_path, monkeypatch):
    (tmp_path / "my_worker.py").write_text(textwrap.dedent("""
        import os
        import time
        import torch.distributed as dist

        def hello(greeting):
            return {"text": f"{greeting} from {dist.get_rank()}", "master": os.environ["MASTER_ADDR"]}

        def sleep_forever():
            time.sleep(3600)
    """))
    monkeypatch.chdir(tmp_path)  # like %%writefile in the notebook's folder
    results = launch("my_worker:hello", 2, {"greeting": "hi"}, echo=False, device_type="cpu")
    assert [r["text"] for r in results] == ["hi from 0", "hi from 1"]
    # on one machine the ranks meet on the loopback, never at a name torchrun made up (socket.getfqdn())
    assert [r["master"] for r in results] == ["127.0.0.1", "127.0.0.1"]
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="timeout=8"):
        launch("my_worker:sleep_forever", 2, echo=False, timeout=8, device_type="cpu")
    assert time.monotonic() - start < 30


def test_two_nodes_rendezvous_on_localhost():
    endpoint, results = f"127.0.0.1:{free_port()}", {}

    def node(rank):
        results[rank] = launch("course_lib.parallel.ddp_torch:train", nprocs=1, kwargs={"spec": DDPRun(steps=3)},
                               nnodes=2, node_rank=rank, rdzv_endpoint=endpoint, echo=False, timeout=120,
                               device_type="cpu")

    threads = [threading.Thread(target=node, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=150)
    assert sorted(r[0]["rank"] for r in results.values()) == [0, 1]
    assert all(r[0]["world_size"] == 2 for r in results.values())
    assert results[0][0]["losses"] == results[1][0]["losses"]


@pytest.mark.parametrize("gpus,world,device,where", [
    (8, 8, "cuda", "cuda"),   # a node: one rank per GPU
    (1, 2, "cuda", "cpu"),    # the lent H100: 2 ranks do not fit 1 GPU, so they run on its CPU cores
    (4, 2, "cpu", "cpu"),     # a notebook on the CPU tier (or an emulated node) never takes the GPUs
    (0, 1, "cuda", "cpu"),
])
def test_ranks_go_to_gpus_only_when_there_is_one_per_rank(monkeypatch, gpus, world, device, where):
    """The course's one "GPU ranks or CPU ranks?" decision, taken with a GPU machine's count on any machine."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert gpu_count(device) == (gpus if device == "cuda" else 0)
    assert ranks_device(world, device) == where


def _sized(n: int) -> dict:  # a worker: keyword arguments in, a dict out
    import torch.distributed as dist

    return {"n": n, "seen": dist.get_world_size()}


def test_on_ranks_runs_one_worker_contract_on_cpu_ranks_and_picks_the_launcher_once(monkeypatch):
    # CPU ranks: launch's contract (kwargs in, a dict with rank and world size out) through run_forked
    assert on_ranks(_sized, 2, "cpu", n=3) == [{"rank": r, "world_size": 2, "n": 3, "seen": 2} for r in (0, 1)]
    # a machine with one GPU per rank: torchrun, the function named by module and name. What it would launch is
    # caught here, with no GPU to start it on (launch itself is what the other tests here run)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    launched = []
    monkeypatch.setattr(course_lib.launch, "launch", lambda target, nprocs, kwargs, **kw: launched.append(
        (target, nprocs, kwargs, kw["device_type"])) or [{}])
    on_ranks(_sized, 2, "cuda", n=3)
    assert launched == [(f"{__name__}:_sized", 2, {"n": 3}, "cuda")]
    with pytest.raises(ValueError, match="cannot run on GPU ranks: torchrun's workers import"):
        on_ranks(lambda n: {}, 2, "cuda", n=3)  # a notebook's lambda: no name to import it by
    on_ranks(_sized, 3, "cuda", n=1)  # 3 ranks, 2 GPUs: CPU ranks, as ranks_device decides
    assert len(launched) == 1


def test_world_sizes_the_hardware_lacks_are_refused():
    gpus = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"nprocs={gpus + 1} but this machine has {gpus} GPU"):
        check_world(gpus + 1, "cuda")
    with pytest.raises(ValueError, match="nprocs=1000"):
        check_world(1000, "cpu")
    with pytest.raises(ValueError, match="module:function"):
        launch("course_lib.parallel.ddp_torch.train", 2)


def test_run_forked_runs_a_function_defined_here_and_reports_failures():
    import torch.distributed as dist

    def rank_sum(offset):  # a closure: spawn could not pickle it, fork needs not
        t = torch.tensor([dist.get_rank() + offset], dtype=torch.float32)
        dist.all_reduce(t)
        return t.item()

    assert run_forked(rank_sum, 2, {"offset": 10}) == [21.0, 21.0]

    def broken():
        if dist.get_rank() == 1:
            raise ValueError("rank one is broken")
        return dist.get_rank()

    with pytest.raises(WorkerError, match="(?s)rank 1 failed.*rank one is broken") as raised:
        run_forked(broken, 2, timeout=30)
    assert raised.value.kind == "ValueError"  # what a caller tells apart without reading the traceback


def _host_rank_0(ports, world: int) -> None:
    """Rank 0 of a group of ``world``, hosting its rendezvous on a port of its own, as a grader's rank does."""
    from datetime import timedelta

    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    ports.put(store.port)
    dist.init_process_group("gloo", store=dist.PrefixStore("default_pg", store), rank=0, world_size=world)
    total = torch.tensor([100.0])
    dist.all_reduce(total)
    ports.put(float(total))
    dist.destroy_process_group()


def test_run_forked_joins_a_group_another_process_hosts():
    """join=(port, 1): the forked ranks are ranks 1 and 2 of a world of 3 whose rank 0, and its store, live in
    another process; their results come back in their order, and their collectives reach rank 0."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    ports = ctx.SimpleQueue()
    host = ctx.Process(target=_host_rank_0, args=(ports, 3), daemon=True)
    host.start()
    try:
        def rank():
            t = torch.tensor([float(dist.get_rank())])
            dist.all_reduce(t)
            return dist.get_rank(), dist.get_world_size(), float(t)

        got = run_forked(rank, 2, timeout=30, join=(ports.get(), 1))
        assert got == [(1, 3, 103.0), (2, 3, 103.0)]
        assert ports.get() == 103.0, "rank 0's all-reduce did not see the joined ranks' values"
    finally:
        host.join(10)
        if host.is_alive():
            host.kill()


def test_step_batches_shard_every_epoch_once_and_reshuffle_the_next():
    """ddp, zero and the fine-tune CLI read their data through step_batches: ranks split each epoch exactly."""
    from torch.utils.data import TensorDataset

    def read():
        from course_lib.distributed import step_batches

        ids = TensorDataset(torch.arange(64))
        seen = [b[0].tolist() for b in step_batches(ids, global_batch=16, steps=10, seed=3)]
        again = [b[0].tolist() for b in step_batches(ids, global_batch=16, steps=10, seed=3)]
        try:
            next(step_batches(TensorDataset(torch.arange(8)), global_batch=16, steps=1))
        except ValueError as err:
            refused = str(err)
        return {"seen": seen, "again": again, "refused": refused}

    ranks = run_forked(read, 2, timeout=60)
    for r in ranks:
        assert len(r["seen"]) == 10 and all(len(b) == 8 for b in r["seen"])  # 16 over 2 ranks, 10 steps
        assert r["again"] == r["seen"], "the same seed must give the same order (a resumed run relies on it)"
        assert "fewer than one global batch" in r["refused"]
    epochs = [sorted(sum((r["seen"][s] for r in ranks for s in range(e * 4, e * 4 + 4)), [])) for e in (0, 1)]
    assert epochs == [list(range(64))] * 2, "each epoch's 4 steps must cover every sample once across ranks"
    assert ranks[0]["seen"][:4] != ranks[0]["seen"][4:8], "a new epoch must be a new shuffle"


def test_run_forked_spawns_and_ships_the_function_by_value_where_fork_is_unsafe(monkeypatch):
    """On a GPU machine run_forked spawns: a closure defined here must still run, and failures still report."""
    import torch.distributed as dist

    import course_lib.launch as launch_mod

    monkeypatch.setattr(launch_mod, "fork_is_safe", lambda: False)
    offset = 10

    def rank_sum(scale):  # a closure over a local: only by-value pickling can ship it
        t = torch.tensor([scale(dist.get_rank() + offset)], dtype=torch.float32)
        torch.nn.Linear(2, 1)(t.expand(1, 2)).sum().backward()  # autograd runs in the child
        dist.all_reduce(t)
        return {"sum": t.item(), "pid": os.getpid()}

    # a function among the kwargs (a notebook's sync_grads=...) goes by value too
    got = run_forked(rank_sum, 2, {"scale": lambda x: 2 * x}, timeout=120)
    assert [g["sum"] for g in got] == [42.0, 42.0]
    assert os.getpid() not in {g["pid"] for g in got}
    with pytest.raises(WorkerError, match="(?s)rank [01] failed.*ZeroDivisionError"):
        run_forked(lambda: 1 / (dist.get_rank() - dist.get_rank()), 2, timeout=120)


def test_by_value_forks_the_ranks_but_ships_what_a_spawn_ships(monkeypatch):
    """COURSE_SPAWN_RANKS=by-value (the tests' cheap stand-in for the GPU machine's grading path): the ranks are forked,
    but they get the function by value, so what cannot be pickled fails as it would on the GPU machine, and a
    check's ranks get only the definitions it names."""
    import threading

    from course_grader import checks

    lock = threading.Lock()  # inherited by a forked rank, refused by cloudpickle

    def holds_the_lock():
        with lock:
            return os.getpid()

    ns = {"mine": 1, "helper": 2}
    assert run_forked(holds_the_lock, 2, timeout=60) and checks.student(ns, "mine") is ns  # forked: all inherited
    monkeypatch.setenv("COURSE_SPAWN_RANKS", "by-value")
    assert checks.student(ns, "mine", "missing") == {"mine": 1}
    with pytest.raises(TypeError, match="pickle"):
        run_forked(holds_the_lock, 2, timeout=60)
    pids = run_forked(os.getpid, 2, timeout=60)
    assert os.getpid() not in pids
    stage = types.SimpleNamespace(config=types.SimpleNamespace(layers=3))

    def reads_a_config():  # notebook 15's executor: `dist` and an attribute named config (stage.config)
        return dist.get_world_size() + stage.config.layers

    # cloudpickle ships torch.distributed.config with it where torch has one (2.13), a module pickle alone refuses
    assert run_forked(reads_a_config, 2, timeout=60) == [5, 5]


def test_an_interrupted_launch_stops_its_ranks(tmp_path, monkeypatch):
    """A student who interrupts the cell must not leave ranks running behind the kernel's back."""
    (tmp_path / "pid_worker.py").write_text(textwrap.dedent("""
        import os, time
        from pathlib import Path

        def sleep_forever(folder):
            Path(folder, f"{os.getpid()}.pid").write_text("")
            time.sleep(3600)
    """))
    monkeypatch.chdir(tmp_path)
    # Ctrl-C in a kernel raises KeyboardInterrupt; make sure it does here too, whatever an earlier test left behind
    # (an asyncio runner, such as Playwright's, that failed mid-test can leave its own SIGINT handler installed)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    launched = threading.Event()

    def interrupt_once_both_run():  # Ctrl-C once both ranks have said they run (their pid files)
        while not launched.is_set() and len(list(tmp_path.glob("*.pid"))) < 2:
            time.sleep(0.1)
        if not launched.is_set():
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    student = threading.Thread(target=interrupt_once_both_run, daemon=True)
    student.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            launch("pid_worker:sleep_forever", 2, {"folder": str(tmp_path)}, echo=False, timeout=300, device_type="cpu")
    finally:
        launched.set()
        signal.signal(signal.SIGINT, previous)
    pids = [int(p.stem) for p in tmp_path.glob("*.pid")]
    assert len(pids) == 2, "both ranks ran when the launch was interrupted"
    deadline = time.monotonic() + 60  # a bound on a hang, not a speed: the ranks were killed already
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids), "ranks kept running after the launch was interrupted"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"  # a zombie has ended


STUBBORN = textwrap.dedent("""
    import os, signal, time
    from pathlib import Path

    def stubborn(folder):  # a rank slow to die: it ignores SIGTERM, as one stuck in C++ or in GPU teardown would
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        Path(folder, f"{os.getpid()}.pid").write_text("")
        time.sleep(3600)
""")


def _wait_for_pids(folder: Path, n: int, process: subprocess.Popen | None = None) -> list[int]:
    """The pids of ``n`` ranks, once each has written its pid file (their handshake); the launching ``process``
    ending first fails (pytest-timeout bounds a hang)."""
    while len(list(folder.glob("*.pid"))) < n:
        assert process is None or process.poll() is None, "the launching process ended before its ranks started"
        time.sleep(0.1)
    return [int(p.stem) for p in folder.glob("*.pid")]


def _gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(_alive(pid) for pid in pids)


def test_a_timed_out_launch_says_where_each_process_waited_and_leaves_no_rank_alive_and_no_folder(tmp_path,
                                                                                                   monkeypatch):
    """torchrun gives SIGTERM-deaf ranks 30 s; launch stops them by pid before it raises, and cleans up. Its error
    holds the stacks of torchrun and of both ranks, so a hang seen once in CI says where it was."""
    import tempfile

    (tmp_path / "stubborn_worker.py").write_text(STUBBORN)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # where launch makes its folder
    (tmp_path / "tmp").mkdir()
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    # the timeout counts from the ranks' handshake (every rank's pid file), not from torchrun's start
    with pytest.raises(TimeoutError, match=r"timeout=5 s \(after its ranks started\)") as err:
        launch("stubborn_worker:stubborn", 2, {"folder": str(pids_dir)}, echo=False, timeout=5, device_type="cpu")
    pids = [int(p.stem) for p in pids_dir.glob("*.pid")]
    assert len(pids) == 2, "both ranks started before the timeout began"
    message = str(err.value)
    assert "ranks started: rank0, rank1 of this launch" in message
    stacks = dict(re.findall(r"--- (\w+)'s stack ---\n(.*?)(?=\n--- |\Z)", message, re.S))
    assert sorted(stacks) == ["rank0", "rank1", "torchrun"], message
    assert all(" in stubborn\n" in stacks[rank] for rank in ("rank0", "rank1")), \
        f"each rank waits in the worker: {message}"
    assert "torch/distributed/elastic/agent" in stacks["torchrun"], f"torchrun waits in its agent: {message}"
    assert not [pid for pid in pids if _alive(pid)], "a rank outlived its timed-out launch"
    assert not list((tmp_path / "tmp").iterdir()), "launch left its temporary folder behind"


def _ranks_die_with_a_killed_kernel(script: str, folder) -> bool:
    """Run ``script`` (a kernel that starts 2 ranks writing their pids to ``folder``) in a process, SIGKILL that
    process once both ranks run, and say whether the ranks were gone (SIGKILL, at once; a minute bounds a hang)."""
    kernel = subprocess.Popen([sys.executable, "-c", script], cwd=folder)
    try:
        pids = _wait_for_pids(folder, 2, kernel)
    finally:
        kernel.kill()
        kernel.wait()
    return _gone_within(pids, 60)  # a bound on a hang: a killed kernel's ranks get SIGKILL at once


def test_ranks_die_with_the_kernel_that_launched_them(tmp_path):
    """Kill the launching process outright (a kernel that died or was killed): its ranks must not live on,
    even ranks that ignore SIGTERM (torchrun would wait 30 s for them)."""
    (tmp_path / "stubborn_worker.py").write_text(STUBBORN)
    script = (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); from course_lib.launch import launch; "
              f"launch('stubborn_worker:stubborn', 2, {{'folder': {str(tmp_path)!r}}}, echo=False, timeout=300, "
              f"device_type='cpu')")
    assert _ranks_die_with_a_killed_kernel(script, tmp_path), "ranks outlived the process that launched them"


def test_forked_ranks_die_with_a_killed_kernel_and_a_timeout(tmp_path):
    """run_forked's ranks are daemon children: that stops them at a normal exit only, not at a SIGKILL."""
    sys.path.insert(0, str(tmp_path))
    (tmp_path / "stubborn_forked.py").write_text(STUBBORN)
    try:
        import stubborn_forked

        (tmp_path / "a").mkdir()
        with pytest.raises(TimeoutError):
            run_forked(stubborn_forked.stubborn, 2, {"folder": str(tmp_path / "a")}, timeout=3)
        assert not [pid for pid in _wait_for_pids(tmp_path / "a", 2) if _alive(pid)], "a rank outlived the timeout"
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("stubborn_forked", None)
    script = (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); from course_lib.launch import run_forked; "
              f"from stubborn_forked import stubborn; run_forked(stubborn, 2, {{'folder': {str(tmp_path)!r}}})")
    assert _ranks_die_with_a_killed_kernel(script, tmp_path), "forked ranks outlived the process that forked them"


def test_a_launch_whose_port_was_taken_meanwhile_retries_on_a_new_one(tmp_path, monkeypatch, capsys):
    """free_port's port is free when it looks; another process may listen there before torchrun binds it."""
    import socket

    import course_lib.launch as launch_mod

    taker = socket.socket()
    taker.bind(("127.0.0.1", 0))
    taker.listen()
    ports = [taker.getsockname()[1]]
    monkeypatch.setattr(launch_mod, "free_port", lambda: ports.pop() if ports else free_port())
    (tmp_path / "hello_worker.py").write_text("def hello():\n    print('hello')\n    return {'ok': True}\n")
    monkeypatch.chdir(tmp_path)
    try:
        start = time.monotonic()
        results = launch("hello_worker:hello", 2, echo=True, timeout=120, device_type="cpu")
    finally:
        taker.close()
    assert not ports, "the taken port was never tried"
    assert [r["ok"] for r in results] == [True, True]
    out = capsys.readouterr().out
    assert "[rank0] hello" in out and "EADDRINUSE" not in out, "the failed attempt's output must not show"
    print(f"launch with one retry: {time.monotonic() - start:.1f} s")


def test_a_stale_extension_lock_is_cleared_and_a_held_one_kept(tmp_path):
    """A rank killed while loading a JIT op leaves <build>/lock behind; torch would wait on it forever."""
    from course_lib.launch import clear_stale_extension_locks

    stale, held = tmp_path / "deepspeed_shm_comm" / "lock", tmp_path / "cpu_adam" / "lock"
    for lock in (stale, held):
        lock.parent.mkdir()
        lock.write_text("")
    with open(held):  # a live build holds its lock open
        assert clear_stale_extension_locks(str(tmp_path)) == [stale]
    assert not stale.exists() and held.exists()


def test_a_rank_that_crashes_below_python_shows_where(tmp_path, monkeypatch):
    """A rank killed by a signal leaves no traceback file: the error still shows its Python stack."""
    (tmp_path / "crash_worker.py").write_text(textwrap.dedent("""
        import os, signal, time
        import torch.distributed as dist

        def crash_in_c():
            if dist.get_rank() == 1:
                os.abort()  # what an uncaught C++ exception in an op does
            time.sleep(60)
    """))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(WorkerError, match="(?s)torchrun exited.*crash_worker.py.*crash_in_c"):
        launch("crash_worker:crash_in_c", 2, echo=False, timeout=120, device_type="cpu")


def test_a_rank_that_would_crash_in_python_shutdown_still_reports_its_result(tmp_path, monkeypatch):
    """Ranks leave without Python's shutdown, where a finished rank could still be aborted.

    DeepSpeed leaves async gloo collectives whose last reference a gloo thread drops; during
    shutdown that thread cannot take the GIL and the process aborts (SIGABRT) after its work is
    done: 3 of 140 ZeRO launches on CPU did. The atexit abort stands in for it, every time.
    """
    (tmp_path / "exit_worker.py").write_text(textwrap.dedent("""
        import atexit, os
        import torch.distributed as dist

        def abort_at_shutdown():
            atexit.register(os.abort)
            return {"rank": dist.get_rank()}
    """))
    monkeypatch.chdir(tmp_path)
    results = launch("exit_worker:abort_at_shutdown", 2, echo=False, timeout=120, device_type="cpu")
    assert results == [{"rank": 0, "world_size": 2}, {"rank": 1, "world_size": 2}]


def test_run_forked_refuses_a_process_that_already_has_a_group():
    import torch.distributed as dist

    from course_lib.distributed import single_process_group

    single_process_group()
    try:
        with pytest.raises(RuntimeError, match="destroy_process_group"):
            run_forked(dist.get_rank, 2)
    finally:
        dist.destroy_process_group()


def test_after_make_ops_a_deepspeed_cpu_launch_loads_the_op_without_compiling(monkeypatch):
    """Notebook 09's first graded launch has nbgrader's 60 s: `make ops` (part of `make setup`) must have built
    exactly the op a CPU launch loads, with the flags and the ninja it loads it with, so the launch only checks it.
    `make ops` runs from a shell without the venv on PATH (the machine's ninja first, where it has one), the launch
    from one with it first, as a kernel of the venv's Jupyter has it."""
    from course_lib.launch import extensions_dir

    root = Path(__file__).resolve().parent.parent
    folder = Path(extensions_dir())
    venv_bin = os.path.dirname(sys.executable)
    shell_path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p != venv_bin)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(folder), "PATH": shell_path}
    monkeypatch.setenv("PATH", venv_bin + os.pathsep + shell_path)
    # -o: never reinstall the venv from here, only run the op build as `make setup` does
    subprocess.run(["make", "-s", "-o", ".venv/.installed", "ops", f"PY={sys.executable}"], cwd=root, env=env,
                   check=True, capture_output=True, timeout=600)
    built = {p: p.stat().st_mtime_ns for p in (folder / "deepspeed_shm_comm").glob("*.[os]*")}
    assert any(p.suffix == ".so" for p in built), f"make ops built nothing in {folder}"
    ops, start = {p.name for p in folder.iterdir()}, time.monotonic()
    results = launch("course_lib.parallel.zero_deepspeed:train", 2, {"spec": {"stage": 2, "steps": 1}},
                     device_type="cpu", echo=False, timeout=120)
    seconds = time.monotonic() - start
    assert results[0]["losses"] == results[1]["losses"]
    assert {p: p.stat().st_mtime_ns for p in built} == built, "the launch recompiled DeepSpeed's op"
    assert {p.name for p in folder.iterdir()} == ops, "the launch built another op"
    print(f"DeepSpeed CPU launch with the prebuilt op: {seconds:.1f} s")  # no compile: the folder is untouched


def _unwaited_send():
    rank, world = dist.get_rank(), dist.get_world_size()
    ahead, behind = torch.ones(1000), torch.empty(1000)
    try:  # a ring step that raises after posting its pass, as a student's ring may: nothing waits on the ops
        dist.isend(ahead, (rank + 1) % world), dist.irecv(behind, (rank - 1) % world)
        raise RuntimeError(f"rank {rank} raised midway")
    except RuntimeError as err:
        return str(err)


def test_ranks_that_leave_a_send_unwaited_still_answer_at_once():
    """gloo's barrier after an isend nobody waited on waits for ever (measured: every run hung until the timeout;
    notebook 16's checks waited 45 s per case on a ring that raised). The ranks answer before their teardown."""
    start = time.monotonic()
    assert run_forked(_unwaited_send, 3, timeout=60) == [f"rank {r} raised midway" for r in range(3)]
    assert time.monotonic() - start < 30


def _all_reduce_one():
    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t)


def _one_rank_raises():
    if dist.get_rank() == 1:
        raise ValueError("rank 1 raises")
    return _all_reduce_one()


def test_ranks_stopped_mid_teardown_print_nothing(capfd):
    """run_forked stops the ranks once all have answered (or one has failed), maybe while another is still in its
    barrier: that rank's 'Connection reset by peer' must not reach the notebook's output (it did, in 14's cells,
    5 tracebacks in 30 runs like these)."""
    for _ in range(10):
        assert run_forked(_all_reduce_one, 3) == [3.0, 3.0, 3.0]
        with pytest.raises(WorkerError, match="rank 1 raises"):
            run_forked(_one_rank_raises, 3)
    err = capfd.readouterr().err  # the forked ranks write to this process's descriptors
    assert "Traceback" not in err, err[-2000:]


def _noisy():
    print("FutureWarning: all_gather_into_tensor is deprecated", file=sys.stderr)  # what Python's warnings write
    os.write(2, b"ld: cannot find -laio\n")  # what a compiler DeepSpeed probes with writes, below Python
    subprocess.run(["sh", "-c", "echo from a child >&2"], check=True)
    return _all_reduce_one()


def test_a_rank_s_stderr_goes_to_the_rank_log_not_the_cell(capfd, tmp_path, monkeypatch):
    """nbgrader's Validate fails a graded cell that wrote anything to stderr, and DeepSpeed's ranks write dozens of
    lines there on a correct run: a rank's warnings, its C library's and its children's messages go to
    <run dir>/logs/ranks.log; the cell gets one line on stdout that says where, and a failing rank's traceback still."""
    monkeypatch.setenv("COURSE_RUN_DIR", str(tmp_path))
    assert run_forked(_noisy, 2) == [2.0, 2.0]
    out, err = capfd.readouterr()
    assert err == "" and f"(the ranks' warnings and messages are in {tmp_path / 'logs' / 'ranks.log'})" in out
    log = (tmp_path / "logs" / "ranks.log").read_text()
    for text in ("FutureWarning: all_gather_into_tensor", "ld: cannot find -laio", "from a child", "== rank 1 of 2"):
        assert log.count(text) == 2 - (text == "== rank 1 of 2"), (text, log)
    with pytest.raises(WorkerError, match="rank 1 raises"):
        run_forked(_one_rank_raises, 2)


TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _torchrun_env():
    return {k: os.environ.get(k) for k in TORCHRUN_VARS}


def test_forked_ranks_get_torchruns_environment_and_run_deepspeeds_engine_as_torchrun_does():
    """Notebooks 09 and 10 start DeepSpeed on forked CPU ranks (``on_ranks``), which refuses to build its engine
    without LOCAL_RANK: each forked rank gets what torchrun gives its workers, and the same worker with the same kwargs
    trains as a torchrun rank does."""
    before = {k: os.environ.get(k) for k in TORCHRUN_VARS}
    ranks = run_forked(_torchrun_env, 2, timeout=120)
    for rank, env in enumerate(ranks):
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank) and env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == ranks[0]["MASTER_PORT"]
    assert {k: os.environ.get(k) for k in TORCHRUN_VARS} == before, "the launching process keeps its environment"
    kw = dict(spec=zero_deepspeed.ZeroRun(stage=2, steps=2, global_batch=16, accum_steps=2))  # pickled, or JSON
    forked = run_forked(zero_deepspeed.train, 2, kw, timeout=120)  # one worker contract: the same call as launch's
    launched = launch("course_lib.parallel.zero_deepspeed:train", 2, kw, device_type="cpu", echo=False, timeout=120)
    for f, t in zip(forked, launched):
        assert (f["losses"], f["digest"], f["placement"]) == (t["losses"], t["digest"], t["placement"])


def _what_a_rank_sees():
    import os

    import torch

    from course_lib.device import default_device

    return {"env": {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
                                                   "ROCR_VISIBLE_DEVICES", "DS_ACCELERATOR")},
            "device": default_device().type, "gpus": torch.cuda.device_count(), "pid": os.getpid()}


def test_run_forked_hides_the_gpus_from_the_ranks_it_spawns_on_a_gpu_machine(monkeypatch):
    """Notebook 09's DDP comparison on a GPU machine: run_forked spawns (fork is unsafe there), and its CPU ranks
    must not see the GPUs, or each puts its model on cuda:0 and they all share one GPU over gloo. Forced here:
    the spawn path that a GPU machine takes, with GPUs made visible to this process as a GPU machine has them."""
    import course_lib.launch as launch_mod

    monkeypatch.setattr(launch_mod, "fork_is_safe", lambda: False)  # the GPU machine's decision
    for var in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
        monkeypatch.setenv(var, "0,1")
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    ranks = run_forked(_what_a_rank_sees, 2, timeout=120)
    assert os.getpid() not in {r["pid"] for r in ranks}, "the ranks must be fresh processes (spawned)"
    for r in ranks:
        assert r["env"] == {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": "", "ROCR_VISIBLE_DEVICES": "",
                            "DS_ACCELERATOR": "cpu"}, r["env"]
        assert r["device"] == "cpu" and r["gpus"] == 0
    # the notebook's own process keeps its GPUs
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1" and "DS_ACCELERATOR" not in os.environ
    # launch(device_type="cpu") hides them the same way, ROCm's runtime below HIP included
    assert {k: launch_mod._launch_env(2, "cpu", Path("out"))[k] for k in ranks[0]["env"]} == ranks[0]["env"]
