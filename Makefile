# Two commands for a new user: `make demo` and `make test`. Each creates .venv when it is
# missing and installs what it needs; a second run with nothing changed installs nothing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.automap-installed

.PHONY: demo test bench gpu-check clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install --quiet -e '.[hf,test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m automap demo

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m automap bench

# Every GPU code path in one run (benchmarks/gpu_check.py): `make gpu-check` on a GPU machine,
# `make gpu-check DRY=1` for the CPU equivalents (tests/e2e/test_gpu_check.py runs it in `make test`).
# Without a .venv (a GPU image with torch, transformers and accelerate installed) it runs the
# system python3 on this checkout: nothing to install. GPU_CHECK_FLAGS: e.g. --only h2d,load.
GPU_CHECK_OUT ?= benchmarks/out/gpu-check
GPU_PY := $(if $(wildcard $(PY)),$(PY),python3)
gpu-check: $(if $(DRY),$(STAMP))
	PYTHONPATH=$(CURDIR) $(GPU_PY) -m benchmarks.gpu_check $(if $(DRY),--dry-run) --out $(GPU_CHECK_OUT) $(GPU_CHECK_FLAGS)

clean:
	rm -rf $(VENV) build *.egg-info
