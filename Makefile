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

# The local extra compiles llama-cpp-python (llama.cpp) from source the first time. Only what
# the embedded server loads is built: the llama and ggml libraries, with Ninja
# (scikit-build-core's default; it fetches the ninja package when the system has none) on
# every core. Left out: the multimodal library (LLAVA_BUILD=OFF), llama.cpp's examples, tests,
# tools and server, and its "common" library, which llama-cpp-python 0.3.36 forces on although
# its bindings never load it (a one-line CMake include, run inside llama.cpp's project,
# switches it off). 83 build steps instead of 193 and 150 s of compiler time instead of 400:
# on two cores (AMD EPYC, gcc 12) a cold `make run` reached its first answer in 2.5 minutes
# instead of 4.4. Your own CMAKE_ARGS (such as -DGGML_CUDA=on) go last and win.
# The build is not tuned to this CPU (GGML_NATIVE=OFF: AVX2, FMA and F16C on x86), because
# pip caches the wheel it builds, keyed by the source's URL and hash, not by these options or
# the CPU: a native build made on one machine was reused on the next and died there (AMX
# instructions its kernel does not allow). After installing, scripts/check-local-model.py has
# the packaged model write one token; when the build cannot run here, the cached wheel is
# dropped and llama-cpp-python is built again, once.
# `$(BIN)/python -m pip cache remove llama_cpp_python` forgets the cached wheel by hand.
NPROC := $(shell nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2)
LLAMA_CMAKE_INCLUDE := $(abspath $(VENV))/llama-cpp-lean.cmake
LLAMA_REQUIREMENT := $(shell grep -o '"llama-cpp-python[^"]*"' pyproject.toml | tr -d '"')
LLAMA_BUILD_ENV = CMAKE_ARGS="$(LLAMA_CMAKE_ARGS) $$CMAKE_ARGS" \
	CMAKE_BUILD_PARALLEL_LEVEL="$${CMAKE_BUILD_PARALLEL_LEVEL:-$(NPROC)}"
LLAMA_CMAKE_ARGS := -DLLAVA_BUILD=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF \
	-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_NATIVE=OFF \
	-DCMAKE_PROJECT_llama.cpp_INCLUDE=$(LLAMA_CMAKE_INCLUDE)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	@echo "==> Installing trading-agent into $(VENV)."
	@echo "    The first install compiles llama-cpp-python for the embedded model: about 2"
	@echo "    minutes on two cores (pip caches the wheel; later installs take seconds)."
	@printf 'set(LLAMA_BUILD_COMMON OFF)  # llama-cpp-python never loads libllama-common\n' \
		> $(LLAMA_CMAKE_INCLUDE)
	$(LLAMA_BUILD_ENV) $(BIN)/python -m pip install --progress-bar on -e '.[dev,local]'
	@$(BIN)/python scripts/check-local-model.py $(VENV)/local-model-check || { \
		echo "==> The cached llama-cpp-python build does not run on this CPU: building it again."; \
		$(BIN)/python -m pip cache remove llama_cpp_python; \
		$(LLAMA_BUILD_ENV) $(BIN)/python -m pip install --progress-bar on --force-reinstall \
			--no-deps '$(LLAMA_REQUIREMENT)' && \
		$(BIN)/python scripts/check-local-model.py $(VENV)/local-model-check; }
	@touch $@

run: $(VENV)/.installed
	@echo "==> Starting the daemon on $(CONFIG) (Ctrl-C stops it). Once the model is loaded"
	@echo "    and the desks run, it prints how to watch and steer them."
	$(BIN)/trading-agent run --config $(CONFIG)

# Three workers on two cores: the tests spend about a third of their time waiting on their
# servers, subprocesses and browsers, so a third worker fills that (on an AMD EPYC with two
# cores: 366 to 373 s of pytest against 405 to 425 s with two). Each is handed one test at a
# time, longest first (tests/conftest.py orders them): a long end-to-end test never starts
# last while the others have run out of work. The slowest twenty are listed at the end, to
# keep an eye on the suite's time.
test: $(VENV)/.installed
	bash scripts/ensure-test-tools.sh
	$(BIN)/python -m pytest -n 3 --dist load --maxschedchunk 1 --durations=20

lint: $(VENV)/.installed
	$(BIN)/ruff check src tests bench
	$(BIN)/mypy --strict src

bench: $(VENV)/.installed
	for b in bench/*.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
