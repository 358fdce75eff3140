# Quick start: `make demo` (the main job) and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: venv build test demo clean

$(VENV)/.deps-stamp: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "jax>=0.5" "jaxlib>=0.5" numpy "nanobind>=2.4" "scikit-build-core>=0.10" cmake ninja \
	  "pytest>=8" "hypothesis>=6" "onnx>=1.20.1" "onnx-ir>=0.2.1"
	# jax2onnx without its declared extras (flax, orbax, onnxruntime, ...), which the export never imports.
	$(PIP) install -q --no-deps "jax2onnx>=0.17.1,<0.18; python_version >= '3.11'"
	# The TensorRT 11.4 lean runtime (no builder): the plugin-registry test loads our library into it.
	$(PIP) install -q --no-deps "tensorrt-lean-cu13-libs==11.4.0.106" "tensorrt-lean-cu13-bindings==11.4.0.106" \
	  || echo "TensorRT lean runtime not installable here: tests/test_trt_runtime.py will skip"
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
