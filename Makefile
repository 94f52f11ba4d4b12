# Set-up and the two entry points. Everything installs into .venv from the package registry.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: sim test bench clean

# torch's CPU build where there is no GPU (a bare `torch` would pull the CUDA build);
# Triton runs its kernels in its interpreter there.
TORCH_CPU ?= torch==2.13.0 triton==3.6.0

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	if command -v nvidia-smi >/dev/null 2>&1; then \
	  $(BIN)/python -m pip install --quiet -e '.[dev,gpu]'; \
	else \
	  $(BIN)/python -m pip install --quiet $(TORCH_CPU); \
	fi
	touch $@

# The main job on its embedded default: replay a Qwen3-Next-like trace through every policy.
sim: $(BIN)/.installed
	$(BIN)/expertcache sim

# The test suite (GPU tests skip without CUDA). HYPOTHESIS_PROFILE=long for a longer search.
test: $(BIN)/.installed
	$(BIN)/python -m pytest -q -n auto

bench: $(BIN)/.installed
	$(BIN)/python benchmarks/bench_replay.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
