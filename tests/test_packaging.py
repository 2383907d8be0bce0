"""The package's set-up files agree with each other and with the README."""

import json
import re
import subprocess
import sys
import tomllib

import yaml
from packaging.requirements import Requirement

from course_grader.release import ROOT

CONDA_TO_PIP = {"pytorch": "torch"}


def pyproject_requirements() -> dict[str, str]:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in meta["dependencies"] + meta["optional-dependencies"]["test"]]
    return {r.name.lower(): str(r.specifier) for r in reqs}


def conda_requirements() -> dict[str, str]:
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    out = {}
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    for dep in env["dependencies"] + [d for d in pip_section if not d.startswith("-")]:
        if isinstance(dep, dict) or dep == "pip" or dep.startswith("python="):
            continue  # the interpreter, pip itself; the pip section's packages come in the list above
        name = re.match(r"[A-Za-z0-9_.\-]+", dep).group(0)
        req = Requirement(CONDA_TO_PIP.get(name, name) + dep[len(name):])
        out[req.name.lower()] = str(req.specifier)
    return out


def test_environment_yml_matches_pyproject():
    assert conda_requirements() == pyproject_requirements()


def test_environment_yml_installs_the_course_itself():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert "-e ." in pip_section


def test_torch_is_a_loose_range_never_a_pin():
    spec = pyproject_requirements()["torch"]
    assert spec.startswith(">=") and "==" not in spec, "a pin would replace a user's ROCm or CUDA build"


def test_readme_commands_exist_and_ci_runs_the_test_command():
    readme = (ROOT / "README.md").read_text()
    makefile = (ROOT / "Makefile").read_text()
    for target in ("course", "test"):
        assert f"make {target}" in readme, f"README must give `make {target}`"
        assert re.search(rf"^{target}:", makefile, re.M), f"Makefile lacks the {target} target"
    ci = (ROOT / ".ci" / "run").read_text()  # the README's command by default, the whole suite when asked
    assert re.search(r"^ +make test$", ci, re.M) and re.search(r"^ +make test-full$", ci, re.M)


def test_make_tests_workers_keep_each_module_whole():
    """`make test`'s parallel part runs a module's tests on one worker, so a notebook executes once per module.

    conftest marks every test with its module's xdist_group; pytest-xdist must honour the mark (with pytest 9.2 it
    silently did not, and every notebook ran twice). This module's other tests, on two workers, show it.
    """
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider",
         "-o", "addopts=", "-v", "-k", "not keep_each_module_whole", __file__],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    ).stdout
    ran = re.findall(r"^\[(gw\d+)\] .*PASSED (\S+)", out, re.M)
    assert len(ran) >= 4, out
    assert {worker for worker, _ in ran} == {ran[0][0]}, f"one module's tests went to several workers:\n{out}"
    assert all(test.endswith("@test_packaging") for _, test in ran), out


def test_the_hubs_labs_get_their_packages_from_make_setup():
    """What a lab started by docker/hub runs (the single-user extension, batchspawner's wrapper, nbgrader's
    Assignment List) comes with `make setup`, which builds the images' and a cluster's .venv: the course's
    dependencies and the test extra, as the Makefile installs them."""
    assert '-e ".[test]"' in (ROOT / "Makefile").read_text(), "make setup installs the test extra"
    names = set(pyproject_requirements())
    assert {"jupyterhub", "batchspawner", "nbgrader", "jupyterlab"} <= names, names
    extensions = json.loads((ROOT / "docker" / "hub" / "student" / "jupyter_server_config.json").read_text())
    assert extensions["ServerApp"]["jpserver_extensions"]["jupyterhub"] is True  # the lab speaks to the hub


def test_every_package_folder_is_installed():
    """``pip install`` ships the folders pyproject.toml lists, no others: a package folder it misses (the grader's
    checks, say) imports from a checkout and is absent from an installed course."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join(p.parent.relative_to(ROOT).parts) for top in ("course_lib", "course_grader")
               for p in (ROOT / top).rglob("__init__.py")}
    assert {"course_lib", "course_grader", "course_grader.checks"} <= folders
    assert listed == folders, f"pyproject.toml's packages miss {folders - listed} and list {listed - folders}"
