# Quick start: `make demo` (the main job) and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The headers `make build` fetches (once) for the TensorRT plugin; see BUILD.md.
TRT_HEADERS := .deps/tensorrt/include
# Writes a list of pyproject.toml as a requirements file, e.g.
# $(call pyproject,build-system,requires,FILE) (one requirement a line: no shell quoting).
pyproject = $(PY) -c 'import tomllib; t = tomllib.load(open("pyproject.toml", "rb")); \
  print("\n".join(t["$(1)"]["$(2)"]))' > $(3)

.PHONY: venv build test lint demo clean oracle

$(VENV)/.deps-stamp: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The editable build runs without build isolation: its requirements go into the venv first.
	$(call pyproject,build-system,requires,$(VENV)/build-requires.txt)
	$(PIP) install -q -r $(VENV)/build-requires.txt cmake ninja
	# The package with its dependencies and extras, as pyproject.toml declares them; [oracle] is
	# torch (the CPU build on this project's machines) and transformers, for z-lab's dflash, which
	# is installed without its pinned extras (tests/test_zlab_oracle.py).
	$(PIP) install -q --no-build-isolation -e ".[test,onnx,export,dev,oracle]"
	$(PIP) install -q --no-deps "dflash==0.1.0"
	# jax2onnx without its declared dependencies (flax, orbax, onnxruntime, ...), which the export
	# never imports; the [export] extra holds the ones it does.
	$(PIP) install -q --no-deps "jax2onnx>=0.17.1,<0.18"
	# The TensorRT 11.4 lean runtime (no builder): the plugin-registry test loads our library into it.
	$(PIP) install -q --no-deps "tensorrt-lean-cu13-libs==11.4.0.106" "tensorrt-lean-cu13-bindings==11.4.0.106" \
	  || echo "TensorRT lean runtime not installable here: tests/test_trt_runtime.py will skip"
	touch $@

venv: $(VENV)/.deps-stamp

# Editable build: CMake compiles the CPU extension, and the CUDA extension and TensorRT plugin
# where a CUDA toolkit is found (see BUILD.md). The TensorRT headers are fetched into .deps once,
# so that later builds (and a GPU machine without network, given .deps) need no download.
build: venv
	$(PY) tools/fetch_trt_headers.py --dest $(TRT_HEADERS) \
	  || echo "no TensorRT headers: the TensorRT plugin will be left out"
	$(PIP) install -q --no-build-isolation --no-deps -e .
	@$(PY) -c 'import pathlib, jax_dflash; print(*{p.read_text() for d in jax_dflash.__path__ \
	  for p in pathlib.Path(d).glob("build_info.json")})' || true

# The C/C++/CUDA sources, formatted by the pinned clang-format of the [dev] extra.
CXX_SOURCES = $(shell git ls-files 'csrc/*' 'trt_plugin/*' 'tools/*' 'bench/*' | grep -E '\.(h|cc|cpp|cu|cuh)$$')

lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	@echo "clang-format --dry-run -Werror ($(words $(CXX_SOURCES)) files)"
	@$(VENV)/bin/clang-format --dry-run -Werror --style=file $(CXX_SOURCES)

test: build
	$(PY) -m pytest -q

# Parity with z-lab's DFlash reference alone (tests/test_zlab_oracle.py; make test runs it too):
# DFLASH_REQUIRE_ORACLE=1 makes a missing dependency an error rather than a skip.
oracle: build
	DFLASH_REQUIRE_ORACLE=1 $(PY) -m pytest -q tests/test_zlab_oracle.py

demo: build
	$(VENV)/bin/jax-dflash run

clean:
	rm -rf build $(VENV) .pytest_cache .hypothesis
