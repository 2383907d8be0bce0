"""course_lib's shape, as the README's architecture paragraph states it: modules in layers, a module
imports only from its own layer or the ones below, a technique may build on another but never in a cycle, the
folders say the layers (the parallelisms in course_lib/parallel/, the applications in course_lib/apps/), the
course's own imports sit at the top of each file, and every function fits on a screen. And the grader's: it sits
apart, in course_grader/, which the library never imports, and its face (everything nbgrader loads) is torch-free."""

from __future__ import annotations

import ast
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "course_lib"
LAYERS = {
    "core": {"attention", "device", "precision", "data", "instruct", "models", "loss", "memory", "throughput",
             "profiling", "results", "plots", "dataloader"},
    "step": {"train"},
    "distributed": {"distributed", "launch", "workers"},
    "technique": {"checkpointing", "lora", "recipe", "fp8", "fp8_compute", "nf4", "qlora"},
    "application": {"notebook", "finetune", "benchmark", "size_sweep", "accelerate_configs", "cluster", "run_all",
                    "preflight", "__init__"},
}
# The folders say the layers: the applications (what a user runs: the course's main job, the preflight, the
# benchmarks) sit in course_lib/apps/, the library they use in course_lib/, and of the library's
# techniques the parallelisms (data, sharded, tensor, pipeline, context and expert parallelism, and ZeRO's offload)
# together in course_lib/parallel/. Two application modules stay at the top, because a notebook's first line imports
# them: the package itself and notebook (course_setup).
AT_THE_TOP = {"__init__", "notebook"}
# One shape per parallelism, as torchtitan and picotron give each theirs: parallelism p is at most three modules
# with fixed roles. "hand": the mechanism written out (p.py); "api": what practitioners use, applied to the course's
# model (p_torch.py, or p_deepspeed.py for ZeRO, whose API is DeepSpeed's), with ``apply_<p>(model, mesh, cfg)`` as
# torchtitan composes apply_tp, apply_fsdp, and the parallelism's one worker ``train(spec, ...)``, which runs one
# frozen run spec; "cost": what it costs (p_cost.py: bytes, memory, bubble, predicted and measured). A role a
# parallelism lacks is named in ABSENT_ROLES with the reason.
PARALLELISMS = {
    "ddp": {"hand": "ddp", "api": "ddp_torch", "cost": "ddp_cost"},
    "fsdp": {"hand": "fsdp", "api": "fsdp_torch"},
    "zero": {"hand": "zero", "api": "zero_deepspeed", "cost": "zero_cost"},
    "offload": {"hand": "offload", "cost": "offload_cost"},
    "tp": {"hand": "tp", "api": "tp_torch", "cost": "tp_cost"},
    "pp": {"hand": "pp", "api": "pp_torch", "cost": "pp_cost"},
    "cp": {"hand": "cp", "api": "cp_torch", "cost": "cp_cost"},
    "ep": {"hand": "ep", "cost": "ep_cost"},
}
ABSENT_ROLES = {
    ("fsdp", "cost"): "FSDP is ZeRO stage 3: its bytes per parameter are zero_cost's",
    ("offload", "api"): "DeepSpeed's offload is a ZeRO config: zero_deepspeed's",
    ("ep", "api"): "torch ships no expert-parallel API; the all-to-alls by hand are the mechanism",
}
ROLES = ("hand", "api", "cost")
MAX_WORKER_ARGS = 6  # a worker's arguments besides its spec: the student's code plugged in, a checkpoint's place
LAYERS["technique"] |= {m for roles in PARALLELISMS.values() for m in roles.values()}
FOLDERS = {"apps": LAYERS["application"] - AT_THE_TOP,
           "parallel": {m for roles in PARALLELISMS.values() for m in roles.values()}}
ORDER = list(LAYERS)
LAYER_OF = {m: ORDER.index(layer) for layer, mods in LAYERS.items() for m in mods}
MAX_FUNCTION_LINES = 60


@functools.cache  # read for every import statement of every module: list the folders once
def module_paths() -> dict[str, Path]:
    """Each module's file by its name: course_lib/*.py and those of each folder in FOLDERS (their __init__ aside)."""
    paths = {p.stem: p for p in sorted(PACKAGE.glob("*.py"))}
    for folder in FOLDERS:
        inside = {p.stem: p for p in sorted((PACKAGE / folder).glob("*.py")) if p.stem != "__init__"}
        clash = set(inside) & set(paths)
        assert not clash, f"{clash} in course_lib/ and course_lib/{folder}/: a module's name is unique in course_lib"
        paths.update(inside)
    return paths


@functools.cache  # parsed once per process: ~250 tests read the same trees (each parse of the package took ~2 s)
def modules() -> dict[str, ast.Module]:
    return {name: ast.parse(path.read_text()) for name, path in module_paths().items()}


def course_module(dotted: str) -> str | None:
    """The module name of ``course_lib.X`` or ``course_lib.<folder>.X`` (None for a package: course_lib.apps itself)."""
    parts = dotted.split(".")[1:]
    parts = parts[1:] if parts and parts[0] in FOLDERS else parts
    return parts[0] if parts else None


def course_imports(node: ast.AST) -> list[tuple[str, int]]:
    """(course_lib module, line) of every import of course_lib inside ``node``."""
    out = []
    for n in ast.walk(node):
        if isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] == "course_lib":
            # from course_lib import results, plots / from course_lib.apps import ...
            if course_module(n.module) is None:
                known = [a.name for a in n.names if a.name in module_paths()]
                out += [(name, n.lineno) for name in known]
                out += [("__init__", n.lineno)] * (n.module == "course_lib" and len(known) < len(n.names))
            else:
                out.append((course_module(n.module), n.lineno))
        elif isinstance(n, ast.Import):
            out += [(course_module(a.name), n.lineno) for a in n.names if a.name.startswith("course_lib.")
                    and course_module(a.name)]
    return out


def test_every_module_has_a_layer():
    assert set(modules()) == set(LAYER_OF), f"place {set(modules()) ^ set(LAYER_OF)} in LAYERS (and the README)"


def test_each_folder_holds_one_layer():
    for folder, names in FOLDERS.items():
        layers = {ORDER[LAYER_OF[n]] for n in names}
        assert len(layers) == 1, f"course_lib/{folder}/ would mix the layers {layers}"


@pytest.mark.parametrize("name", sorted(LAYER_OF))
def test_the_folder_says_the_layer(name):
    want = next((folder for folder, names in FOLDERS.items() if name in names), ".")
    got = module_paths()[name].parent.relative_to(PACKAGE).as_posix()
    assert got == want, f"{name}.py is a {ORDER[LAYER_OF[name]]} module: move it to course_lib/{want}"


@pytest.mark.parametrize("name", sorted(LAYER_OF))
def test_imports_go_down_the_layers(name):
    tree = modules()[name]
    for target, line in course_imports(tree):
        assert LAYER_OF[target] <= LAYER_OF[name], f"{name}.py:{line} imports {target}, a higher layer"


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (module -> modules it imports) as a path, or None when it has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [node, nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := visit(nxt, path + [node])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [])):
            return found
    return None


def test_import_cycle_finds_a_cycle_and_only_a_cycle():
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) is not None
    assert import_cycle({"lora": set(), "nf4": {"lora"}, "tp": {"fsdp", "ddp"}, "fsdp": set(), "ddp": set()}) is None


def test_mechanisms_may_compose_mechanisms_but_never_in_a_cycle():
    """A technique may build on another (QLoRA is nf4 over lora; DP x TP is tp then fsdp), as torchtitan's
    apply_tp -> apply_ac -> apply_fsdp do; what stays forbidden is a cycle, within the layer or across."""
    graph = {name: {t for t, _ in course_imports(tree) if t != name} for name, tree in modules().items()}
    cycle = import_cycle(graph)
    assert cycle is None, f"course_lib imports in a cycle: {' -> '.join(cycle)}; move the shared part one layer down"


@pytest.mark.parametrize("name", sorted(LAYER_OF))
def test_course_lib_imports_sit_at_the_top(name):
    tree = modules()[name]
    nested = [(t, line) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for t, line in course_imports(f)]
    assert not nested, f"{name}.py imports course_lib modules inside functions: {nested}"


@pytest.mark.parametrize("name", sorted(LAYER_OF))
def test_functions_fit_on_a_screen_and_public_ones_say_what_they_do(name):
    tree = modules()[name]
    for f in ast.walk(tree):
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = f.end_lineno - f.lineno + 1
            assert length <= MAX_FUNCTION_LINES, f"{name}.{f.name} is {length} lines (at most {MAX_FUNCTION_LINES})"
    public = [f for f in tree.body if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")]
    public += [c for c in tree.body if isinstance(c, ast.ClassDef) and not c.name.startswith("_")]
    undocumented = [f.name for f in public if not ast.get_docstring(f)]
    assert not undocumented, f"{name}.py: public {undocumented} have no docstring"


def test_every_parallelism_has_its_roles_and_no_module_is_outside_them():
    """course_lib/parallel/ holds exactly the modules of PARALLELISMS, and each parallelism has every role but those
    ABSENT_ROLES names with a reason."""
    present = {p.stem for p in (PACKAGE / "parallel").glob("*.py")} - {"__init__"}
    assert present == FOLDERS["parallel"], (f"course_lib/parallel/ has {sorted(present - FOLDERS['parallel'])} "
                                            f"beyond PARALLELISMS and lacks {sorted(FOLDERS['parallel'] - present)}")
    for p, roles in PARALLELISMS.items():
        missing = [r for r in ROLES if r not in roles and (p, r) not in ABSENT_ROLES]
        assert not missing, f"{p} has no {missing} module: write it, or name the reason in ABSENT_ROLES"
        assert not [r for r in roles if (p, r) in ABSENT_ROLES], f"{p}: a role is both present and absent"
        assert roles["hand"] == p and roles.get("cost", f"{p}_cost") == f"{p}_cost"
        assert roles.get("api", f"{p}_torch") in (f"{p}_torch", f"{p}_deepspeed")


def _parameters(fn: ast.FunctionDef) -> list[str]:
    return [a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)]


@pytest.mark.parametrize("p", sorted(p for p, roles in PARALLELISMS.items() if "api" in roles))
def test_the_api_module_applies_the_parallelism_and_runs_one_spec(p):
    """``apply_<p>(model, mesh, cfg)`` (torchtitan's shape), and one worker, ``train(spec, ...)``, whose arguments
    besides the spec are at most MAX_WORKER_ARGS; no other ``train*`` function in the parallelism's modules."""
    api = PARALLELISMS[p]["api"]
    functions = {f.name: f for f in modules()[api].body if isinstance(f, ast.FunctionDef)}
    assert f"apply_{p}" in functions, f"{api}.py has no apply_{p}(model, mesh, cfg)"
    assert _parameters(functions[f"apply_{p}"])[:3] == ["model", "mesh", "cfg"], \
        f"{api}.apply_{p} takes {_parameters(functions[f'apply_{p}'])}: make it apply_{p}(model, mesh, cfg)"
    assert "train" in functions, f"{api}.py has no worker train(spec, ...)"
    params = _parameters(functions["train"])
    assert params[:1] == ["spec"] and len(params) - 1 <= MAX_WORKER_ARGS, \
        f"{api}.train takes {params}: its run goes in one frozen spec, besides it at most {MAX_WORKER_ARGS} arguments"
    others = [f"{m}.{f.name}" for m in PARALLELISMS[p].values() for f in modules()[m].body
              if isinstance(f, ast.FunctionDef) and f.name.startswith("train") and (m, f.name) != (api, "train")]
    assert not others, f"{others}: {p}'s one worker is {api}.train(spec, ...); fold these into its spec"


@pytest.mark.parametrize("p", sorted(p for p, roles in PARALLELISMS.items() if "cost" in roles))
def test_roles_import_one_way_hand_then_cost_then_api(p):
    """The mechanism by hand imports neither its cost nor its API module, and the cost module not the API one: a
    formula never depends on the library that runs the thing it prices."""
    roles = PARALLELISMS[p]
    order = [roles["hand"], roles["cost"]] + ([roles["api"]] if "api" in roles else [])
    for i, module in enumerate(order):
        later = {m for m, _ in course_imports(modules()[module])} & set(order[i + 1:])
        assert not later, f"{module} imports {sorted(later)}: {p}'s roles import one way, {' -> '.join(order)}"


# The one training loop is train.fit over train.train_step (the runner; an engine's step plugs into fit's step=). A
# backward or an optimizer step anywhere else in the library is a loop of its own, unless the function owns it for
# a reason fit cannot serve: each such owner is named here with that reason. (The checks are the judges' reference
# runs, above the library: not counted.)
OWNS_BACKWARD_OR_STEP = {
    "train.train_step": "the step itself: backward, clipping, the optimizer step",
    "zero_deepspeed.deepspeed_step":
        "DeepSpeed's engine owns backward and step (engine.backward, engine.step): fit's step=",
    "pp.run_1f1b": "a pipeline stage backwards its piece with the gradient its successor sent",
    "pp_torch.naive_step": "a pipeline stage backwards its piece with the gradient its successor sent",
    "pp_torch._step": "torch's pipeline schedule runs every stage's forward and backward itself (schedule.step)",
    "pp_torch._train": "the optimizer step after the schedule's: pipelined, fit's step=",
    "zero.ShardedOptimizer.step": "a sharded optimizer: its step is the inner optimizer's step on this rank's shard",
    "offload.OffloadedAdamW.step": "an offloaded optimizer: its step is the inner optimizer's step on the CPU masters",
    "finetune.node_step": "the learning-rate schedule's step after train_step (scheduler.step), not an optimizer's",
    "memory.measure_training_step": "one step split into forward, backward and optimizer step, to measure each",
    "checkpointing.activation_memory": "a probe: one backward to measure what checkpointing keeps, no optimizer",
    "fsdp_torch.trace_step": "a probe: one forward and backward under the profiler, to trace FSDP's collectives",
    "ep.balancing_runs": "the router alone, stepped on the Switch balancing loss (no model, no task loss) to set "
                         "beside the bias that balances without a gradient",
    "precision.activation_gradients": "a probe: one backward to read the activations' gradients, no optimizer",
    "cp_cost.measure_ring_memory": "a probe: the ring's backward, to measure its memory, no optimizer",
    "cp_cost._step_peak": "a probe: one forward and backward to read the GPU allocator's peak (or its running out), "
                           "no optimizer",
    "fp8_compute.torchao_fp8_runs": "a probe: whether float8 matmuls run forward and backward here",
    "qlora.bitsandbytes_4bit_runs": "a probe: whether bitsandbytes' 4-bit layers run forward and backward here",
    "preflight.sdpa_kernels_used": "a probe: which attention kernels a backward dispatches to",
    "preflight._adam_step": "a probe: whether the optimizer's implementation runs on the device",
}


def backward_and_step_calls(tree: ast.Module) -> dict[str, list[int]]:
    """``{function: [lines]}`` of every ``.backward(...)`` and ``.step(...)`` call, by the module-level function or
    the class's method it sits in (a lambda or a nested function counts for the function around it)."""
    out: dict[str, list[int]] = {}

    def visit(node: ast.AST, owner: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            inner = owner
            if owner is None and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = child.name
            elif isinstance(node, ast.ClassDef) and owner == node.name and isinstance(child, ast.FunctionDef):
                inner = f"{owner}.{child.name}"  # a method
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute) \
                    and child.func.attr in ("backward", "step"):
                out.setdefault(owner or "<module>", []).append(child.lineno)
            visit(child, inner)
    visit(tree, None)
    return out


def test_no_training_loop_outside_the_runner():
    """Counted: every call of ``.backward(`` or ``.step(`` (optimizers, schedulers, engines, torch.autograd) in the
    library, by the top-level function it sits in; outside train.py each must be an owner named above."""
    found = {f"{name}.{fn}": lines for name, tree in modules().items()
             for fn, lines in backward_and_step_calls(tree).items()}
    unowned = {k: v for k, v in found.items() if k not in OWNS_BACKWARD_OR_STEP}
    assert not unowned, (f"backward or step outside the runner: {unowned}; run the loop through train.fit (an "
                         "engine's step through fit's step=), or name the owner and its reason in "
                         "OWNS_BACKWARD_OR_STEP")
    stale = set(OWNS_BACKWARD_OR_STEP) - set(found)
    assert not stale, f"OWNS_BACKWARD_OR_STEP names {stale}, which no longer call backward or step: remove them"


# course_grader/: the graded tests (a probe and a judge per test cell, in checks/) and the grader that runs them. They
# sit above the whole library, which they test: they may import any of it, and nothing in the library imports them.
GRADER = ROOT / "course_grader"
CHECKS = GRADER / "checks"
# What nbgrader, the notebooks and an instructor call: documented like the library.
GRADER_API = {"checks.__init__", "child", "grade", "sandbox", "edition", "release", "student_path", "nbgrader_plugins",
              "audit", "grading"}
# The grader's torch-free face: what every nbgrader command loads (the configuration and its plugins) and the
# instructor's tools that build the student edition and the release.
TORCH_FREE = ("course_grader", "course_grader.nbgrader_plugins", "course_grader.sandbox", "course_grader.edition",
              "course_grader.release", "course_grader.student_path")


@functools.cache
def grader_modules() -> dict[str, ast.Module]:
    """Every module of course_grader/ by its name below the package (``grade``, ``checks.nb07``)."""
    return {".".join(p.relative_to(GRADER).with_suffix("").parts): ast.parse(p.read_text())
            for p in sorted(GRADER.rglob("*.py"))}


def checks_modules() -> dict[str, ast.Module]:
    return {name.split(".", 1)[1]: tree for name, tree in grader_modules().items() if name.startswith("checks.")}


def grader_imports(tree: ast.AST) -> list[tuple[str, int]]:
    """(module, line) of every import of ``course_grader`` or a module of it in ``tree``."""
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom):
            names = [n.module or ""] + [f"{n.module}.{a.name}" for a in n.names if n.module == "course_grader"]
        else:
            names = [a.name for a in n.names] if isinstance(n, ast.Import) else []
        out += [(name, n.lineno) for name in names if name.split(".")[0] == "course_grader"]
    return out


def checks_imports(tree: ast.AST) -> list[tuple[str, int]]:
    """(checks module, line) of every import of ``course_grader.checks.X`` in ``tree`` ("__init__" for the package)."""
    return [(name.split(".")[2] if name.count(".") >= 2 else "__init__", line) for name, line in grader_imports(tree)
            if name == "course_grader.checks" or name.startswith("course_grader.checks.")]


def test_the_library_never_imports_the_grader():
    importers = {name: grader_imports(tree) for name, tree in modules().items() if grader_imports(tree)}
    assert not importers, f"the library imports the grader (which sits above it, apart): {importers}"


def test_grader_imports_finds_each_way_of_importing_the_grader():
    tree = ast.parse("import course_grader.grade\nfrom course_grader import checks\nfrom course_grader.checks.nb07 "
                     "import cnn\nimport course_lib\nfrom course_lib.checkpointing import CheckpointedBlock\n")
    assert [name for name, _ in grader_imports(tree)] == ["course_grader.grade", "course_grader",
                                                           "course_grader.checks", "course_grader.checks.nb07"]
    assert [name for name, _ in checks_imports(tree)] == ["__init__", "nb07"]


def test_the_graders_face_and_nbgrader_config_load_no_torch():
    """Every nbgrader command reads nbgrader_config.py: it and the modules it loads import nbgrader and the standard
    library, never torch or course_lib (seconds and gigabytes on every command, and a GPU runtime's start)."""
    code = ("import sys\n"
            f"for m in {TORCH_FREE!r}: __import__(m)\n"
            "from traitlets.config.loader import PyFileConfigLoader\n"
            f"config = PyFileConfigLoader('nbgrader_config.py', path={str(ROOT)!r}).load_config()\n"
            "assert config.Autograde.autograde_preprocessors, 'no preprocessors configured'\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'course_lib')))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"loaded by nbgrader's configuration: {out.stdout.strip()}"


def test_nbgrader_config_is_settings_and_one_import_of_the_grader():
    """nbgrader_config.py sets values; the classes it selects live in course_grader.nbgrader_plugins."""
    tree = ast.parse((ROOT / "nbgrader_config.py").read_text())
    defined = [n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    assert not defined, f"nbgrader_config.py defines {defined}: move them to course_grader/nbgrader_plugins.py"
    course = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    plain = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert course == ["course_grader"] and set(plain) <= {"os", "sys"}, (course, plain)


@pytest.mark.parametrize("name", sorted(checks_modules()))
def test_a_visible_check_never_imports_a_hidden_one_and_imports_sit_at_the_top(name):
    """The student edition ships nbNN.py without nbNN_hidden.py: an import of a hidden module from a visible one
    would break the student's own notebook."""
    tree = checks_modules()[name]
    hidden = [(t, line) for t, line in checks_imports(tree) if t.endswith("_hidden")]
    assert name.endswith("_hidden") or not hidden, f"checks/{name}.py imports hidden checks: {hidden}"
    nested = [(t, line) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for t, line in course_imports(f) + grader_imports(f)]
    assert not nested, f"checks/{name}.py imports course modules inside functions: {nested}"
    for t, line in course_imports(tree):
        assert t in LAYER_OF, f"checks/{name}.py:{line} imports course_lib.{t}, which has no layer"


@pytest.mark.parametrize("name", sorted(grader_modules()))
def test_grader_functions_fit_on_a_screen_and_the_grader_says_what_it_does(name):
    tree = grader_modules()[name]
    long = [(f.name, f.end_lineno - f.lineno + 1) for f in ast.walk(tree)
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            and f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"course_grader/{name}: {long} are longer than {MAX_FUNCTION_LINES} lines"
    if name in GRADER_API:
        public = [f.name for f in tree.body
                  if isinstance(f, (ast.FunctionDef, ast.ClassDef)) and not f.name.startswith("_")]
        undocumented = [f for f in public
                        if not ast.get_docstring(next(n for n in tree.body if getattr(n, "name", "") == f))]
        assert not undocumented, f"course_grader/{name}: public {undocumented} have no docstring"
