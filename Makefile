# Scaling PyTorch training: set up, run the course, test, release, grade.
#   make course   set up .venv and execute every notebook on this machine's tier (runs/summary.md)
#   make test     set up .venv and run the tests the change can break (the gate: what CI runs)
#   make test-full  the whole suite
#   make lab      start JupyterLab on notebooks/
#   make hub      setup plus JupyterHub's proxy, for docker/hub/start.sh (a class on one GPU node)
#   make ops      (re)build DeepSpeed's CPU ops (comm, CPU Adam) into TORCH_EXTENSIONS_DIR (setup does it once)
#   make preflight  check this machine's GPU paths before class (one table; exit 1 when a path the course needs fails)
#   make floor    the course on its lowest supported torch (2.7) in .venv-floor: notebooks (smoke tier), version-sensitive tests
#   make node-emulation  the node tier's layout (8 ranks, meshes, stages) on CPU ranks, for the notebooks that launch ranks
#   make student-path  the student edition validated as a student's Validate does (every notebook, a correct student's answers)
#   make student-edition  what a student receives: build/student-edition/ and build/student-edition.tar.gz (no solutions, tests or references)
# PYTHON picks the interpreter; TORCH_SPEC the torch to install when none is present.
# TORCH_EXTENSIONS_DIR is where DeepSpeed's JIT-built ops live (default .venv/torch_extensions): every
# target exports it, so the kernels of `lab`, `course` and `grade` find the op that setup built.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
ASSIGNMENT ?= 03_gradient_accumulation
TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions
export TORCH_EXTENSIONS_DIR

.PHONY: setup hub ops preflight node-emulation floor course test test-full lab release release-check grade clean docker-rocm docker-cuda student-edition student-path images-check

# An existing torch (a ROCm or CUDA build, as in the workshop images) is kept: the venv sees the
# interpreter's packages and a constraints file pins torch to the version found, so pip never
# replaces it. The pin is the installed distribution's version, which pip compares against (NGC images'
# torch.__version__ can differ from it, e.g. ".nv26.08" against ".nv26.8.63802676"). With no torch at all, TORCH_SPEC is
# installed first (by pip, which finds a wheel on this disk or on the index pip is configured with), then the course
# by uv, which downloads in parallel (about 15 s where pip took two minutes on a fresh machine); where uv cannot be had
# or cannot reach the index (it reads no pip.conf), pip installs the course. Beside an existing torch, pip only: it
# sees the interpreter's torch behind the venv and keeps it.
$(VENV)/.installed: pyproject.toml
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
	  echo "keeping the torch already installed: $$($(PYTHON) -c 'import torch; print(torch.__version__)')"; \
	  $(PYTHON) -m venv --system-site-packages $(VENV); \
	  $(PYTHON) -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" > $(VENV)/constraints.txt; \
	  $(PY) -m pip install -q -c $(VENV)/constraints.txt -e ".[test]"; \
	else \
	  $(PYTHON) -m venv $(VENV); \
	  echo "$(TORCH_SPEC)" > $(VENV)/constraints.txt; \
	  $(PY) -m pip install -q "$(TORCH_SPEC)"; \
	  $(PY) -m pip install -q uv || true; \
	  { [ -x $(VENV)/bin/uv ] && $(VENV)/bin/uv pip install -q --python $(PY) -c $(VENV)/constraints.txt -e ".[test]"; } \
	    || $(PY) -m pip install -q -c $(VENV)/constraints.txt -e ".[test]"; \
	fi
	@touch $@

# DeepSpeed JIT-compiles its shared-memory comm op (deepspeed_shm_comm) in the first CPU launch: about a
# minute on 2 cores, past nbgrader's 60 s cell limit in notebook 09's first graded launch. Built here once,
# with the CPU accelerator that course_lib.launch gives CPU ranks; a later load only checks it (ninja).
# Its CPU Adam (cpu_adam, about 50 s more) is what ZeRO-Offload steps the offloaded optimizer with, and what
# notebook 10 times against torch's AdamW: built by the same command.
SHM_OP := $(TORCH_EXTENSIONS_DIR)/deepspeed_shm_comm/deepspeed_shm_comm.so
CPU_ADAM_OP := $(TORCH_EXTENSIONS_DIR)/cpu_adam/cpu_adam.so
BUILD_OPS = DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES= HIP_VISIBLE_DEVICES= \
	$(PY) -c "from course_lib.parallel.zero_deepspeed import build_deepspeed_ops; build_deepspeed_ops()"

$(SHM_OP): $(VENV)/.installed
	$(BUILD_OPS)

$(CPU_ADAM_OP): $(SHM_OP)  # built with it; this rule only runs where the comm op was built without it
	$(BUILD_OPS)

setup: $(VENV)/.installed $(SHM_OP) $(CPU_ADAM_OP)

# JupyterHub's proxy for docker/hub and tests/test_hub.py: configurable-http-proxy from npm (node >= 20), into .venv.
# Not part of setup: the workshop images run setup and need no proxy (the hub runs on the host).
HUB_PROXY := $(VENV)/node_modules/.bin/configurable-http-proxy
$(HUB_PROXY): $(VENV)/.installed
	npm install --prefix $(VENV) --no-audit --no-fund --silent configurable-http-proxy@5

hub: setup $(HUB_PROXY)

ops: $(VENV)/.installed
	$(BUILD_OPS)

course: setup
	$(PY) -m course_lib.apps.run_all

# The workshop host's first command: every GPU path the course uses (GPUs, NCCL/RCCL and gloo ranks, SDPA kernels,
# DeepSpeed's ops, FP8, bitsandbytes, seed 001's checks, version floors) run once at tiny size; one table of
# pass/FAIL with the reason and the fix, exit 1 if a path the course needs fails. PREFLIGHT_ARGS: e.g. --json FILE.
preflight: setup
	$(PY) -m course_lib.apps.preflight $(PREFLIGHT_ARGS)

# The course on its floor, torch 2.7, in a second environment (.ci/floor: what it installs, runs and why); CI runs it.
floor:
	bash .ci/floor

# What a GPU node would run (8 ranks, its meshes, micro-batch counts and pipeline stages), on CPU ranks over gloo at
# tiny widths: a node-only shape fails here first. Summary in runs-node-emulated/summary.md.
node-emulation: setup
	$(PY) -m course_lib.apps.run_all --tier node --emulate --out runs-node-emulated

# torchao, for tests/test_fp8.py's run of notebook 02's FP8 training path (torchao's Float8Linear trains on a CPU
# too): beside the venv, not in it, because transformers imports torchao whenever it can, and on a CPU that import
# prints failed CUDA-kernel loads on stderr, which nbgrader scores as a failed cell. The test puts it on PYTHONPATH
# of the process it starts. 0.18 is the torchao built against TORCH_SPEC's torch.
TORCHAO_FOR_TESTS := $(VENV)/torchao-for-tests/.installed
$(TORCHAO_FOR_TESTS): $(VENV)/.installed
	$(PY) -m pip install -q --no-deps --target $(dir $@) -c $(VENV)/constraints.txt "torchao>=0.18,<0.19"
	@touch $@

# The gate, the README's test command and CI's: the tests that the change since the last whole-suite pass (the commit
# in .ci/full-pass) can break, chosen from what each test reaches (tests/selection.py prints the choice; a change to
# the build, the test harness or the grader's core selects everything). `make test-full` runs everything.
# Two pytest-xdist workers (tests/conftest.py says how the tests are shared out): a 2-core machine runs the
# suite in about two thirds of the time of one process. Then the tests marked `alone` (conftest's ALONE: fixed
# time limits, measured timings) run by themselves, with no other worker taking the cores they wait on.
# TEST_WORKERS=0 runs the first part in this process. pytest exits 5 when the gate selected nothing there.
# Before all of it, ruff checks the code ([tool.ruff] in pyproject.toml): a finding stops the run.
# DeepSpeed's CPU ops are built by the first selected test whose code can start DeepSpeed (tests/conftest.py), not
# here: most changes select none (setup builds them for the course).
TEST_WORKERS ?= 2
TEST_SCOPE ?= --gate
test: $(VENV)/.installed $(HUB_PROXY) $(TORCHAO_FOR_TESTS)
	$(PY) -m ruff check
	@[ -z "$(TEST_SCOPE)" ] || $(PY) tests/selection.py
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder -m "not alone" $(TEST_SCOPE); \
	first=$$?; [ $$first -ne 5 ] || first=0; \
	$(PY) -m pytest -m alone $(TEST_SCOPE); second=$$?; [ $$second -ne 5 ] || second=0; \
	[ $$first -eq 0 ] && [ $$second -eq 0 ]

test-full:
	$(MAKE) test TEST_SCOPE=

lab: setup
	JUPYTER_CONFIG_PATH="$${JUPYTER_CONFIG_PATH:+$$JUPYTER_CONFIG_PATH:}$(CURDIR)/docker/student-lab" \
	  $(VENV)/bin/jupyter lab notebooks/

release: setup
	$(PY) -m course_grader.release

release-check: setup
	$(PY) -m course_grader.release --check

# The student edition (course_grader/edition.py): release notebooks, course_lib with every graded reference stubbed,
# and what a student needs to set up; no solutions/, tests/ or runs/. Standard library only: needs no setup.
STUDENT_EDITION ?= build/student-edition
student-edition:
	$(PYTHON) course_grader/edition.py student $(STUDENT_EDITION) --archive

# The student's path (course_grader/student_path.py): the student edition, a correct student's answers written into
# each release notebook, nbgrader's Validator configured as the student's lab configures it (docker/student-lab/).
# Every notebook must say "Success". STUDENT_PATH_ARGS: notebooks by number, or --blank (the untouched release must
# fail at every exercise). CI runs it on the floor (.ci/floor).
student-path: setup
	$(PY) -m course_grader.student_path $(STUDENT_PATH_ARGS)

# Grade one assignment of the submissions in submitted/<student>/$(ASSIGNMENT)/, then export grades.csv.
grade: setup
	PATH=$(VENV)/bin:$$PATH $(VENV)/bin/nbgrader autograde $(ASSIGNMENT)
	PATH=$(VENV)/bin:$$PATH $(VENV)/bin/nbgrader generate_feedback $(ASSIGNMENT)
	PATH=$(VENV)/bin:$$PATH $(VENV)/bin/nbgrader export

# The workshop images (docker/README.md): build context is the repository root.
docker-rocm:
	docker build -f docker/Dockerfile.rocm --target student -t scaling-pytorch-course:rocm .
	docker build -f docker/Dockerfile.rocm --target grader -t scaling-pytorch-course:rocm-grader .

docker-cuda:
	docker build -f docker/Dockerfile.cuda --target student -t scaling-pytorch-course:cuda .
	docker build -f docker/Dockerfile.cuda --target grader -t scaling-pytorch-course:cuda-grader .

# Both targets of both Dockerfiles built FROM stand-ins for the vendor bases (a CPU torch where each vendor keeps its
# torch), with podman, and run: the student image's lab validates a notebook in headless Chromium, the grader image
# grades a submission (docker/images_check.sh says what; docker/README.md how long). Root on Debian: it installs podman.
images-check: $(VENV)/.installed
	bash docker/images_check.sh

clean:
	rm -rf runs release autograded feedback gradebook.db grades.csv build
