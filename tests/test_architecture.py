"""course_lib's shape, as the README's architecture paragraph states it: modules in layers, a module
imports only from its own layer or the ones below, a technique never imports another technique, the
course's own imports sit at the top of each file, and every function fits on a screen."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "course_lib"
LAYERS = {
    "core": {"attention", "device", "precision", "data", "instruct", "models", "loss", "memory", "throughput", "results", "plots",
             "grading", "dataloader"},
    "step": {"train"},
    "distributed": {"distributed", "launch", "workers"},
    "technique": {"checkpointing", "lora", "recipe", "ddp", "fsdp", "zero", "tp", "pp", "fp8", "nf4"},
    "application": {"notebook", "finetune", "benchmark", "size_sweep", "accelerate_configs", "cluster", "run_all", "release",
                    "preflight", "edition", "sandbox", "__init__"},
}
ORDER = list(LAYERS)
LAYER_OF = {m: ORDER.index(layer) for layer, mods in LAYERS.items() for m in mods}
MAX_FUNCTION_LINES = 60


def modules() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text()) for p in sorted(PACKAGE.glob("*.py"))}


def course_imports(node: ast.AST) -> list[tuple[str, int]]:
    """(course_lib module, line) of every import of course_lib inside ``node``."""
    out = []
    for n in ast.walk(node):
        if isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] == "course_lib":
            if n.module == "course_lib":  # from course_lib import results, plots, ...
                out += [(a.name, n.lineno) for a in n.names if (PACKAGE / f"{a.name}.py").exists()]
                out += [("__init__", n.lineno) for a in n.names if not (PACKAGE / f"{a.name}.py").exists()]
            else:
                out.append((n.module.split(".")[1], n.lineno))
        elif isinstance(n, ast.Import):
            out += [(a.name.split(".")[1], n.lineno) for a in n.names if a.name.startswith("course_lib.")]
    return out


def test_every_module_has_a_layer():
    assert set(modules()) == set(LAYER_OF), f"place {set(modules()) ^ set(LAYER_OF)} in LAYERS (and the README)"


@pytest.mark.parametrize("name", sorted(LAYER_OF))
def test_imports_go_down_the_layers_and_never_across_techniques(name):
    tree = modules()[name]
    for target, line in course_imports(tree):
        assert LAYER_OF[target] <= LAYER_OF[name], f"{name}.py:{line} imports {target}, a higher layer"
        if LAYERS["technique"] >= {name, target} and name != target:
            raise AssertionError(f"{name}.py:{line} imports {target}: a technique never imports another technique")


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
