# The two commands of the README:  `make run` (generate with the bundled m3-tiny)  and  `make test`.
# Both set up .venv on first use: torch first, the build that fits the machine (scripts/install_torch.py: the CPU
# wheel from TORCH_INDEX without an NVIDIA GPU, the CUDA build from pip's index with one), then the package.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
# Where torch comes from without an NVIDIA GPU: PyTorch's CPU wheels (plain PyPI has the multi-GB CUDA build on
# Linux). Set it to a mirror of that index, to a ROCm index on AMD, or empty for pip's configured index.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
PROMPT ?= Once upon a time

$(BIN)/m3sdk: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python scripts/install_torch.py "$(TORCH)" --index "$(TORCH_INDEX)"
	$(BIN)/python -m pip install -e ".[test,ucx]"
	touch $(BIN)/m3sdk

setup: $(BIN)/m3sdk

run: setup
	$(BIN)/m3sdk generate "$(PROMPT)" --max-tokens 80 --temperature 0.7 --seed 0 --stream

test: setup
	$(BIN)/ruff check src tests examples benchmarks scripts
	$(BIN)/python -m pytest -q -x --timeout 900

.PHONY: setup run test
