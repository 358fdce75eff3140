# Quick start: `make demo` (the main job) and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: venv build test demo clean

$(VENV)/.deps-stamp: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "jax>=0.5" "jaxlib>=0.5" numpy "nanobind>=2.4" "scikit-build-core>=0.10" cmake ninja "pytest>=8" "hypothesis>=6" onnx
	touch $@

venv: $(VENV)/.deps-stamp

# Editable build: CMake compiles the CPU extension, and the CUDA extension and TensorRT plugin
# where a CUDA toolkit is found (see BUILD.md).
build: venv
	$(PIP) install -q --no-build-isolation --no-deps -e .

test: build
	$(PY) -m pytest -q

demo: build
	$(VENV)/bin/jax-dflash run

clean:
	rm -rf build $(VENV) .pytest_cache .hypothesis
