# Scaling PyTorch training: set up, run the course, test, release, grade.
#   make course   set up .venv and execute every notebook on this machine's tier (runs/summary.md)
#   make test     set up .venv and run the test suite (what CI runs)
#   make lab      start JupyterLab on notebooks/
# PYTHON picks the interpreter; TORCH_SPEC the torch to install when none is present.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
ASSIGNMENT ?= 02_gradient_accumulation

.PHONY: setup course test lab release release-check grade clean docker-rocm docker-cuda

# An existing torch (a ROCm or CUDA build, as in the workshop images) is kept: the venv sees the
# interpreter's packages and a constraints file pins torch to the version found, so pip never
# replaces it. With no torch at all, TORCH_SPEC is installed first.
$(VENV)/.installed: pyproject.toml
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
	  echo "keeping the torch already installed: $$($(PYTHON) -c 'import torch; print(torch.__version__)')"; \
	  $(PYTHON) -m venv --system-site-packages $(VENV); \
	  $(PYTHON) -c "import torch; print('torch==' + torch.__version__)" > $(VENV)/constraints.txt; \
	else \
	  $(PYTHON) -m venv $(VENV); \
	  echo "$(TORCH_SPEC)" > $(VENV)/constraints.txt; \
	  $(PY) -m pip install -q "$(TORCH_SPEC)"; \
	fi
	$(PY) -m pip install -q -c $(VENV)/constraints.txt -e ".[test]"
	@touch $@

setup: $(VENV)/.installed

course: setup
	$(PY) -m course_lib.run_all

test: setup
	$(PY) -m pytest

lab: setup
	$(VENV)/bin/jupyter lab notebooks/

release: setup
	$(PY) -m course_lib.release

release-check: setup
	$(PY) -m course_lib.release --check

# Grade one assignment of the submissions in submitted/<student>/$(ASSIGNMENT)/, then export grades.csv.
grade: setup
	PATH=$(VENV)/bin:$$PATH $(VENV)/bin/nbgrader autograde $(ASSIGNMENT)
	PATH=$(VENV)/bin:$$PATH $(VENV)/bin/nbgrader generate_feedback $(ASSIGNMENT)
	PATH=$(VENV)/bin:$$PATH $(VENV)/bin/nbgrader export

# The workshop images (docker/README.md): build context is the repository root.
docker-rocm:
	docker build -f docker/Dockerfile.rocm -t scaling-pytorch-course:rocm .

docker-cuda:
	docker build -f docker/Dockerfile.cuda -t scaling-pytorch-course:cuda .

clean:
	rm -rf runs release autograded feedback gradebook.db grades.csv
