# Two commands for a new user: `make demo` and `make test`. Each creates .venv when it is
# missing and installs what it needs (`make install` alone does just that); a second run with
# nothing changed installs nothing. The install prints one line per step with its time; pip's
# own output (warnings included) goes to .venv/install.log, whose tail is shown if a step fails.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.automap-installed
LOG := $(VENV)/install.log
PIP := $(PY) -m pip install --disable-pip-version-check
EXTRAS := .[hf,test]
TORCH := torch==2.14.1 torchvision==0.29.1

.PHONY: install demo test bench gpu-check clean

# $(call step,WHAT,COMMAND): run COMMAND with its output in $(LOG); print WHAT and the seconds it
# took, or FAILED, the log's last 25 lines and the log's name (and stop).
define step
	@printf '  %-60s' '$(1)'; start=$$(date +%s); \
	if $(2) >>$(LOG) 2>&1; then echo "$$(( $$(date +%s) - start )) s"; \
	else echo "FAILED"; echo "---- the last 25 lines of $(LOG):"; tail -n 25 $(LOG); \
	     echo "---- the whole output is in $(LOG)"; exit 1; fi
endef

$(STAMP): pyproject.toml Makefile
	@mkdir -p $(VENV) && : > $(LOG) && date +%s > $(VENV)/.install-start
	@echo "automap: installing into $(VENV) (a few minutes the first time; pip's output: $(LOG))"
	$(call step,Python virtual environment ($(VENV)),sh -c 'test -x $(PY) || $(PYTHON) -m venv $(VENV)')
	$(call step,pip (upgrade),$(PIP) --upgrade pip)
	$(call step,torch 2.14.1 + torchvision 0.29.1 (about 5 GB with CUDA),$(PIP) $(TORCH))
	$(call step,automap (editable) with its hf and test extras,$(PIP) -e '$(EXTRAS)')
	@touch $(STAMP)
	@echo "automap: installed in $$(( $$(date +%s) - $$(cat $(VENV)/.install-start) )) s; $(VENV) takes\
	 $$(du -sh $(VENV) | cut -f1); $$($(PY) -m automap --version)"

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m automap demo

# CI runs `make test`: the linter and the formatter's check (pyproject.toml's [tool.ruff]), then the suite.
test: $(STAMP)
	$(PY) -m ruff check --quiet .
	$(PY) -m ruff format --check --quiet .
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
