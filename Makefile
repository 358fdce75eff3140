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
	$(PIP) install -q "onnx>=1.20.1" "onnx-ir>=0.2.1" && $(PIP) install -q --no-deps "jax2onnx>=0.17.1,<0.18; python_version >= '3.11'"
	touch $@

venv: $(VENV)/.deps-stamp

# Editable build: CMake compiles the CPU extension, and the CUDA extension and TensorRT plugin
# where a CUDA toolkit is found (see BUILD.md).
build: venv
	$(PY) tools/fetch_trt_headers.py
	$(PIP) install -q --no-build-isolation --no-deps -e .

test: build
	$(PY) -m pytest -q

demo: build
	$(VENV)/bin/jax-dflash run

clean:
	rm -rf build $(VENV) .pytest_cache .hypothesis
