# Two commands do all the set-up: `make run` and `make test`. Each creates .venv if missing.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CONFIG ?= config/demo.toml
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: run test lint typecheck bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# The local extra builds llama-cpp-python from source the first time (5 to 10 minutes on
# two cores); pip caches the wheel, so later installs take seconds.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	@echo "==> Installing trading-agent into $(VENV)."
	@echo "    The first install compiles llama-cpp-python for the embedded model: 5 to 10"
	@echo "    minutes on two cores (pip caches the wheel; later installs take seconds)."
	$(BIN)/python -m pip install --progress-bar on -e '.[dev,local]'
	@touch $@

run: $(VENV)/.installed
	@echo "==> Starting the daemon on $(CONFIG) (Ctrl-C stops it). Once the model is loaded"
	@echo "    and the desks run, it prints how to watch and steer them."
	$(BIN)/trading-agent run --config $(CONFIG)

test: $(VENV)/.installed
	bash scripts/ensure-test-tools.sh
	$(BIN)/python -m pytest

lint: $(VENV)/.installed
	$(BIN)/ruff check src tests bench
	$(BIN)/mypy --strict src

bench: $(VENV)/.installed
	for b in bench/*.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
