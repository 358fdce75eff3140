#!/usr/bin/env bash
# One GPU session on the H200, in one call: build, test, benchmark, sanitizer.
#
#   tools/gpu_session.sh                         # all stages: info build extras test parity flashinfer bench sanitize workload probe
#   tools/gpu_session.sh build bench             # only these stages, in this order
#   tools/gpu_session.sh variants                # kernel variants by kbench (not in the default run)
#   tools/gpu_session.sh build extras quantized  # the quantized pools' tests and benchmark rows alone
#   tools/gpu_session.sh pack_variants           # on a CPU machine: build the variants to carry
#
# Every stage runs even when an earlier one failed (a failed build makes the later ones fail
# too, loudly); each stage's output is tee'd to $OUT/<stage>.log, and a summary of exit codes
# and durations ends the run (also in $OUT/summary.txt). Exit status: 0 when every stage passed.
#
# Environment: OUT (where logs and results go; default /tmp/gpu_session_out), PYTHON (python3),
# BENCH_ARGS (extra arguments for the benchmark, e.g. "--shapes decode_b64 --quick"), CUDA_KNOBS
# (the build's CUDA kernel knobs, e.g. "-DDFLASH_WIDE_BY_ROWS=0 -DDFLASH_BRACKETED_CODES=0"),
# <STAGE>_TIMEOUT in seconds (BUILD_TIMEOUT=300, TEST_TIMEOUT=240, FLASHINFER_TIMEOUT=240,
# BENCH_TIMEOUT=540, SANITIZE_TIMEOUT=240, PROBE_TIMEOUT=240, WORKLOAD_TIMEOUT=300,
# VARIANTS_TIMEOUT=420, QUANTIZED_TIMEOUT=300). A whole benchmark run (every contender, 12
# shapes) takes more than 330 s: give it a device call of its own.
# The bench stage writes kv_update_gpu.{json,png} into $OUT/bench_results (never into the
# repository) and its printed tables and targets into $OUT/bench.log.
# Carry to the GPU machine: .whl/ (the FlashInfer sdist, and the nvidia-cuda-sanitizer-api wheel
# used when the image has no compute-sanitizer) and .deps/ (TensorRT headers), both ignored by
# git. Nothing here needs the network.
set -u -o pipefail
export PYTHONUNBUFFERED=1

cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/gpu_session_out}
PY=${PYTHON:-python3}
FI_SDIST=.whl/flashinfer_python-0.2.8.tar.gz
FI_DIR=/tmp/fi
mkdir -p "$OUT"
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
if [ -d "$FI_DIR/flashinfer" ]; then export PYTHONPATH="$FI_DIR${PYTHONPATH:+:$PYTHONPATH}"; fi
if [ -d /tmp/extras ]; then export PYTHONPATH="/tmp/extras${PYTHONPATH:+:$PYTHONPATH}"; fi

stage_info() {
  nvidia-smi || true
  nvcc --version | tail -2 || true
  "$PY" -c 'import sys, jax, numpy; print(sys.version); print("jax", jax.__version__, jax.devices())'
  "$PY" -c 'import torch; print("torch", torch.__version__, torch.cuda.is_available())' || true
  if [ -f .deps/tensorrt/include/NvInferRuntime.h ]; then
    echo "TensorRT headers: .deps/tensorrt/include (the plugin will be built)"
  else
    echo "TensorRT headers: missing (.deps not carried?): the TensorRT plugin will be skipped"
  fi
  if [ -f "$FI_SDIST" ]; then echo "FlashInfer sdist: $FI_SDIST"; else echo "FlashInfer sdist: missing"; fi
}

stage_build() {
  local knobs=()
  if [ -n "${CUDA_KNOBS:-}" ]; then
    echo "CUDA kernel knobs: $CUDA_KNOBS"
    knobs=(-C "cmake.define.CMAKE_CUDA_FLAGS=$CUDA_KNOBS")
  fi
  "$PY" -m pip install --no-build-isolation --no-deps -e . "${knobs[@]}" &&
    "$PY" -c 'import jax_dflash._dflash_cuda as m; print("CUDA extension:", m.__file__)'
}

# The carried wheels the tests use where present: TensorRT 11.4 lean runtime (plugin registry
# test), jax2onnx + onnx-ir (export tests), z-lab's dflash (the oracle test). Installed --no-deps
# into /tmp/extras.
stage_extras() {
  local wheels
  wheels=$(ls .whl/tensorrt_lean_cu13_*.whl .whl/jax2onnx-*.whl .whl/onnx_ir-*.whl .whl/dflash-*.whl 2>/dev/null)
  if [ -z "$wheels" ]; then echo "no extra wheels carried"; return 0; fi
  # shellcheck disable=SC2086
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/extras $wheels || return 1
  # What each carried wheel gives, importable from /tmp/extras.
  local wheel module status=0
  for wheel in $wheels; do
    case "$wheel" in
      *tensorrt_lean_cu13_bindings*) module=tensorrt_lean_bindings ;;
      *jax2onnx*) module=jax2onnx ;;
      *onnx_ir*) module=onnx_ir ;;
      *dflash-*) module=dflash ;;
      *) continue ;;
    esac
    PYTHONPATH="/tmp/extras${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c "import $module; print('$module', getattr($module, '__version__', '(no version)'))" || status=1
  done
  return $status
}

stage_test() {
  # Several workers when pytest-xdist is there; JAX must not preallocate the GPU in each of them.
  local workers=()
  if "$PY" -c 'import xdist' 2>/dev/null; then workers=(-n "${TEST_WORKERS:-4}"); fi
  XLA_PYTHON_CLIENT_PREALLOCATE=false "$PY" -m pytest -q -ra -p no:cacheprovider "${workers[@]}"
}

# The CUDA kernel against the CPU kernel over random cases of every path, the FP8 conversion
# and the two-code 16-bit stores over all 2^32 inputs, the k-norm's packed weight product over all
# 2^32 input pairs, the divided stores' reciprocal bound and the row scale's shortcuts over all
# 2^32 inputs, and a quick timing (tools/kernel_parity.py, tools/fp8_cvt_check.cu,
# tools/half_pack_check.cu, tools/packed_mul_check.cu, tools/rcp_bound_check.cu,
# tools/scale_check.cu).
stage_parity() {
  nvcc -std=c++17 -O3 -arch=sm_90 -Icsrc tools/fp8_cvt_check.cu -o /tmp/fp8_cvt_check && /tmp/fp8_cvt_check &&
    nvcc -std=c++17 -O3 -arch=sm_90 -Icsrc tools/half_pack_check.cu -o /tmp/half_pack_check && /tmp/half_pack_check &&
    nvcc -std=c++17 -O3 --fmad=false -arch=sm_90 -Icsrc tools/packed_mul_check.cu -o /tmp/packed_mul_check &&
    /tmp/packed_mul_check &&
    nvcc -std=c++17 -O3 -arch=sm_90 -Icsrc tools/rcp_bound_check.cu -o /tmp/rcp_bound_check && /tmp/rcp_bound_check &&
    nvcc -std=c++17 -O3 --fmad=false -arch=sm_90 -Icsrc tools/scale_check.cu -o /tmp/scale_check && /tmp/scale_check &&
    "$PY" tools/kernel_parity.py --cases "${PARITY_CASES:-800}"
}

# The main job on the GPU: the preset table of BENCHMARKS.md (pool memory and steps/s per pool
# dtype, fused norm against the unfused pipeline), each run checked against the reference.
stage_workload() {
  local preset=${WORKLOAD_PRESET:-qwen3-8b-b16} status=0
  for args in "--kv-dtype fp16" "--kv-dtype e4m3" "--kv-dtype fp16 --compare" \
              "--kv-dtype fp16 --contract paged" "--kv-dtype e4m3 --contract paged"; do
    # shellcheck disable=SC2086 # args is a list of words on purpose
    "$PY" -m jax_dflash run --preset "$preset" --backend gpu --no-progress --steps "${WORKLOAD_STEPS:-100}" $args \
      --json "$OUT/workload_$(echo "$args" | tr -c 'a-z0-9' '_').json" || status=1
  done
  return $status
}

stage_flashinfer() {
  if [ -d "$FI_DIR/flashinfer" ]; then echo "FlashInfer already in $FI_DIR"; flashinfer_warm_up; return; fi
  if [ ! -f "$FI_SDIST" ]; then
    echo "no $FI_SDIST: carry .whl/ (pip download --no-deps --no-binary :all: flashinfer-python==0.2.8)"
    return 1
  fi
  "$PY" -m pip install --no-deps --no-build-isolation --target "$FI_DIR" "$FI_SDIST" &&
    export PYTHONPATH="$FI_DIR${PYTHONPATH:+:$PYTHONPATH}" &&
    "$PY" -c 'import flashinfer; print("flashinfer", flashinfer.__version__, flashinfer.__file__)' &&
    flashinfer_warm_up
}

# FlashInfer JIT-compiles its rope and append modules on first use (about a minute): do it here,
# through the benchmark's own calls (fp16 and bf16), so that the bench stage's budget is timing.
flashinfer_warm_up() {
  "$PY" bench/bench_kv_update.py --backend gpu --quick --repeats 1 --contenders flashinfer \
    --shapes decode_b1,decode_b64_bf16 --out /tmp/flashinfer_warm_up
}

# The decode-size probe (bench/kernel_variants/decode_probe.cu, built from the shipped sources
# by make_probe.py): cold inputs, then positions in L2.
stage_probe() {
  "$PY" bench/kernel_variants/make_probe.py /tmp/probe &&
    echo "== cold: every input rotated beyond 2x L2" && /tmp/probe/decode_probe &&
    echo "== positions L2-resident (2 sets), K/V rotated" && /tmp/probe/decode_probe 2 0
}

# The quantized pools alone: their GPU tests (int8, scale pools, int4, the quotient boundaries),
# then their benchmark rows beside the fp16 pool's and the copy floors (the scale-pool table of
# BENCHMARKS.md), into $OUT/bench_results_quantized.
stage_quantized() {
  local workers=() status=0
  if "$PY" -c 'import xdist' 2>/dev/null; then workers=(-n "${TEST_WORKERS:-8}"); fi
  XLA_PYTHON_CLIENT_PREALLOCATE=false "$PY" -m pytest -q -ra -p no:cacheprovider "${workers[@]}" \
    tests/test_int8_pool.py tests/test_dynamic_scales.py tests/test_int4_pool.py tests/test_quotient_boundaries.py ||
    status=1
  "$PY" bench/bench_kv_update.py --backend gpu --repeats 5 --contenders ours_jax,copy \
    --shapes decode_b64,prefill_b8_l2048,decode_b64_int8,prefill_b8_l2048_int8,decode_b64_int8_dynamic,prefill_b8_l2048_int8_dynamic,decode_b64_fp8,prefill_b8_l2048_fp8,decode_b64_fp8_dynamic,prefill_b8_l2048_fp8_dynamic,decode_b64_int4,prefill_b8_l2048_int4 \
    --out "$OUT/bench_results_quantized" || status=1
  return $status
}

# The sources the kernel-variant binaries are built from, as one digest.
variant_sources_digest() {
  find csrc bench/kernel_variants -type f \( -name '*.cu' -o -name '*.cuh' -o -name '*.h' -o -name '*.cc' \) |
    LC_ALL=C sort | xargs sha256sum | sha256sum | cut -d' ' -f1
}

# Kernel variants (bench/kernel_variants/make_variants.py's NAMED, or VARIANTS="a,b"), each timed by
# kbench at KB_SHAPES (default the decode and the large benchmark shape), KB_ROUNDS times (1), then
# KB_L2_ROUNDS times (0) with its inputs in L2. Binaries already in $VARIANT_DIR are not built
# again; nor are those built on a CPU machine with nvcc and carried as .whl/kv_variants.tar.xz
# (`tools/gpu_session.sh pack_variants` there), when built from these sources.
stage_variants() {
  local dir=${VARIANT_DIR:-/tmp/kv} names=${VARIANTS:-shipped,previous,unbracketed,coordinate_offsets,four_chunks} name missing=() status=0
  if [ -f .whl/kv_variants.tar.xz ] && [ ! -d "$dir" ]; then
    mkdir -p "$dir" && tar -xJf .whl/kv_variants.tar.xz -C "$dir"
    if [ "$(cat "$dir/SOURCES.sha256" 2>/dev/null)" != "$(variant_sources_digest)" ]; then
      echo "carried variants were built from other sources: building them again"
      rm -f "$dir"/kb_*
    fi
  fi
  for name in ${names//,/ }; do [ -x "$dir/kb_$name" ] || missing+=("$name"); done
  if [ ${#missing[@]} -gt 0 ]; then
    local IFS=,
    "$PY" bench/kernel_variants/make_variants.py "$dir" --only "${missing[*]}" || return 1
  fi
  # KB_ROUNDS passes over the variants, interleaved so that a drift of the card's clocks falls on
  # all of them alike; then KB_L2_ROUNDS passes with one input set at B=2 L=2048, small enough to
  # stay in L2 (where the kernel's issue rate, not DRAM, bounds it).
  local round
  for ((round = 1; round <= ${KB_ROUNDS:-1}; ++round)); do
    for name in ${names//,/ }; do
      echo "== kb_$name round $round"
      KB_SHAPES=${KB_SHAPES:-64x16,8x2048} "$dir/kb_$name" || status=1
    done
  done
  for ((round = 1; round <= ${KB_L2_ROUNDS:-0}; ++round)); do
    for name in ${names//,/ }; do
      echo "== kb_$name in L2 round $round"
      KB_SETS=1 KB_SHAPES=2x2048 "$dir/kb_$name" || status=1
    done
  done
  return $status
}

# On a CPU machine with nvcc: builds the variants (VARIANTS, as above) into $VARIANT_DIR and packs
# them, with the digest of their sources, into .whl/kv_variants.tar.xz for the variants stage.
stage_pack_variants() {
  local dir=${VARIANT_DIR:-/tmp/kv} names=${VARIANTS:-shipped,previous,unbracketed,coordinate_offsets,four_chunks}
  "$PY" bench/kernel_variants/make_variants.py "$dir" --only "$names" || return 1
  variant_sources_digest > "$dir/SOURCES.sha256"
  local binaries=() name
  for name in ${names//,/ }; do binaries+=("kb_$name"); done
  mkdir -p .whl && tar -C "$dir" -cf - SOURCES.sha256 "${binaries[@]}" | xz -T0 -9 > .whl/kv_variants.tar.xz &&
    ls -l .whl/kv_variants.tar.xz
}

stage_bench() {
  # GPU clocks and power every 200 ms while the benchmark runs (read-only queries).
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu,pstate \
    --format=csv -lms 200 > "$OUT/bench_clocks.csv" 2>&1 &
  local logger=$! status
  # shellcheck disable=SC2086 # BENCH_ARGS is a list of words on purpose
  "$PY" bench/bench_kv_update.py --backend gpu --out "$OUT/bench_results" ${BENCH_ARGS:-}
  status=$?
  kill "$logger" 2>/dev/null
  return $status
}

find_sanitizer() {
  local c
  for c in "$(command -v compute-sanitizer || true)" /usr/local/cuda/bin/compute-sanitizer \
           /usr/local/cuda/compute-sanitizer/compute-sanitizer /tmp/sanitizer/nvidia/cu13/bin/compute-sanitizer; do
    if [ -n "$c" ] && [ -x "$c" ]; then echo "$c"; return 0; fi
  done
  # Not in this CUDA image: the carried PyPI wheel nvidia-cuda-sanitizer-api (it holds the tool).
  local wheel
  wheel=$(ls .whl/nvidia_cuda_sanitizer_api-*.whl 2>/dev/null | head -1)
  if [ -n "$wheel" ]; then
    rm -rf /tmp/sanitizer && mkdir -p /tmp/sanitizer &&
      "$PY" -m zipfile -e "$wheel" /tmp/sanitizer &&
      chmod +x /tmp/sanitizer/nvidia/cu13/bin/compute-sanitizer &&
      echo /tmp/sanitizer/nvidia/cu13/bin/compute-sanitizer && return 0
  fi
  return 1
}

stage_sanitize() {
  local sanitizer
  if ! sanitizer=$(find_sanitizer); then
    echo "compute-sanitizer not found, and no .whl/nvidia_cuda_sanitizer_api-*.whl to unpack"
    return 1
  fi
  "$sanitizer" --version | tail -1
  "$sanitizer" --tool memcheck --error-exitcode 9 --print-limit 50 \
    "$PY" bench/sanitize_hostile.py
}

declare -A RC SECONDS_TAKEN
declare -a ORDER
run_stage() {
  local name=$1 limit_var start status
  limit_var="$(echo "$name" | tr '[:lower:]' '[:upper:]')_TIMEOUT"
  local -A defaults=([info]=60 [build]=300 [extras]=60 [test]=240 [parity]=90 [flashinfer]=240 [bench]=540 [sanitize]=240 [probe]=240 [workload]=300 [variants]=420 [quantized]=300 [pack_variants]=3600)
  local limit=${!limit_var:-${defaults[$name]}}
  echo "=================== $name (limit ${limit} s) ==================="
  start=$(date +%s)
  # A subshell per stage, so that `timeout` can run it; exports it makes (PYTHONPATH) are
  # repeated at the top of this script for later stages.
  export -f "stage_$name" find_sanitizer flashinfer_warm_up variant_sources_digest
  export PY FI_SDIST FI_DIR
  timeout --kill-after=10 "$limit" bash -c "set -o pipefail; stage_$name" 2>&1 | tee "$OUT/$name.log"
  status=$?
  if [ "$status" -eq 124 ]; then echo "$name: TIMED OUT after ${limit} s" | tee -a "$OUT/$name.log"; fi
  if [ "$name" = extras ] && [ -d /tmp/extras ]; then
    case ":${PYTHONPATH:-}:" in *":/tmp/extras:"*) ;; *) export PYTHONPATH="/tmp/extras${PYTHONPATH:+:$PYTHONPATH}";; esac
  fi
  if [ "$name" = flashinfer ] && [ -d "$FI_DIR/flashinfer" ]; then
    case ":${PYTHONPATH:-}:" in *":$FI_DIR:"*) ;; *) export PYTHONPATH="$FI_DIR${PYTHONPATH:+:$PYTHONPATH}";; esac
  fi
  RC[$name]=$status
  SECONDS_TAKEN[$name]=$(( $(date +%s) - start ))
  ORDER+=("$name")
  echo "=================== $name: exit $status, ${SECONDS_TAKEN[$name]} s ==================="
}

stages=("$@")
if [ ${#stages[@]} -eq 0 ]; then stages=(info build extras test parity flashinfer bench sanitize workload probe); fi
for s in "${stages[@]}"; do
  case "$s" in
    info|build|extras|test|parity|flashinfer|bench|sanitize|workload|probe|variants|quantized|pack_variants) run_stage "$s" ;;
    *) echo "unknown stage '$s': expected info, build, extras, test, parity, flashinfer, bench, sanitize, workload, probe, variants, quantized or pack_variants"; RC[$s]=2; ORDER+=("$s"); SECONDS_TAKEN[$s]=0 ;;
  esac
done

failed=0
{
  echo "summary ($(date -u +%FT%TZ)):"
  for s in "${ORDER[@]}"; do
    printf '  %-11s exit %-3s %5s s\n' "$s" "${RC[$s]}" "${SECONDS_TAKEN[$s]}"
    [ "${RC[$s]}" -eq 0 ] || failed=1
  done
  echo "logs and results in $OUT"
} | tee "$OUT/summary.txt"
# The pipe above runs in a subshell: recompute the status here.
for s in "${ORDER[@]}"; do [ "${RC[$s]}" -eq 0 ] || failed=1; done
exit $failed
