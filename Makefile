# The two commands of the README:  `make run` (generate with the bundled m3-tiny)  and  `make test`.
# Both set up .venv on first use. torch is pinned to the CPU wheel on purpose: an open range would pull a
# multi-GB CUDA build. On a GPU machine, install your torch first and run `pip install -e .[test]`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
PROMPT ?= Once upon a time

$(BIN)/m3sdk: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test,ucx]"
	touch $(BIN)/m3sdk

setup: $(BIN)/m3sdk

run: setup
	$(BIN)/m3sdk generate "$(PROMPT)" --max-tokens 80 --temperature 0.7 --seed 0 --stream

test: setup
	$(BIN)/ruff check src tests examples benchmarks scripts
	$(BIN)/python -m pytest -q -x --timeout 900

.PHONY: setup run test
