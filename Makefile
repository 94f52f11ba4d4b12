# Set-up and the two entry points. Everything installs into .venv from the package registry.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: sim test test-long lint bench clean

# Without a GPU, torch's CPU build goes in before the package, so that pip finds torch (a base
# dependency) satisfied instead of pulling a CUDA build of several GB; Triton then runs the kernels in
# its interpreter. TORCH_INDEX=https://download.pytorch.org/whl/cpu adds PyTorch's CPU index, for a
# machine whose only index is PyPI (whose Linux torch is the CUDA build). With nvidia-smi, torch (CUDA)
# and the gpu extra come from the index.
TORCH_CPU   ?= torch==2.13.0 triton==3.6.0
TORCH_INDEX ?=

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then \
	  $(BIN)/python -m pip install --quiet -e '.[dev,gpu]'; \
	else \
	  $(BIN)/python -m pip install --quiet $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) $(TORCH_CPU) && \
	  $(BIN)/python -m pip install --quiet -e '.[dev]'; \
	fi
	touch $@

# The main job on its embedded default: replay a real gemma-4 decode trace (sim/data) through every
# policy and both oracles, and name the policy to choose at each slot count.
sim: $(BIN)/.installed
	$(BIN)/expertcache sim

# The test suite (GPU tests skip without CUDA).
test: $(BIN)/.installed
	$(BIN)/python -m pytest -q -n auto

# The long profile: every property search far longer, and the searches marked slow.
test-long: $(BIN)/.installed
	HYPOTHESIS_PROFILE=long $(BIN)/python -m pytest -q -n auto

# ruff's rules and the house's exceptions are in pyproject.toml ([tool.ruff]).
lint: $(BIN)/.installed
	$(BIN)/ruff check .

bench: $(BIN)/.installed
	$(BIN)/python benchmarks/bench_replay.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
