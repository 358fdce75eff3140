#!/usr/bin/env bash
# Builds the CPU extension and the TensorRT plugin's contract harness with UndefinedBehaviorSanitizer
# (every report fatal) in a build directory of its own, then runs the hostile cases through them:
#   - tools/ubsan_cases.py with the sanitized _dflash_cpu loaded in place of the installed one
#     (the hand-written FFI calls, the raw entries' bad arguments, the fuzz seeds, the bad-shapes
#     table), one process per group so that one report cannot hide another group's;
#   - the harness's CPU mode (both contracts' call sequences and every bad-input path) and its
#     --check-shapes mode on the bad-shapes table.
# Prints one summary line: cases run, UBSan reports. Exits 0 only with no report and no failure.
#
#   tools/ubsan_check.sh [BUILD_DIR]        (default /tmp/dflash-ubsan; never the shared build/)
#   DFLASH_SANITIZE=undefined,address       also AddressSanitizer (the Python process then needs
#                                           libasan preloaded, which the script does)
#   DFLASH_UBSAN_SKIP_BUILD=1               reuse BUILD_DIR as it is
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${1:-/tmp/dflash-ubsan}"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
SANITIZE="${DFLASH_SANITIZE:-undefined}"
JOBS="${JOBS:-2}"
LOGS="$BUILD/logs"

case "$(realpath -m "$BUILD")" in
  "$REPO"/build|"$REPO"/build/*) echo "ubsan_check: $BUILD is the shared build directory; use another" >&2; exit 2 ;;
esac
[ -x "$PYTHON" ] || { echo "ubsan_check: no Python at $PYTHON (set PYTHON)" >&2; exit 2; }

FLAGS="-fsanitize=$SANITIZE -fno-sanitize-recover=all -fno-omit-frame-pointer -g -O1"
mkdir -p "$LOGS"

if [ -z "${DFLASH_UBSAN_SKIP_BUILD:-}" ]; then
  echo "ubsan_check: configuring $BUILD ($FLAGS)"
  cmake -S "$REPO" -B "$BUILD" -G Ninja -DPython_EXECUTABLE="$PYTHON" \
    -DCMAKE_CXX_FLAGS="$FLAGS" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=$SANITIZE" \
    -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=$SANITIZE" -DCMAKE_MODULE_LINKER_FLAGS="-fsanitize=$SANITIZE" \
    >"$LOGS/configure.log" 2>&1 || { tail -30 "$LOGS/configure.log"; echo "ubsan_check: configure failed" >&2; exit 2; }
  targets="_dflash_cpu"
  if grep -q "dflash_trt_contract_harness" "$BUILD/build.ninja" 2>/dev/null; then
    targets="$targets dflash_trt_contract_harness"
  fi
  echo "ubsan_check: building $targets"
  # shellcheck disable=SC2086
  cmake --build "$BUILD" --target $targets -j "$JOBS" >"$LOGS/build.log" 2>&1 ||
    { tail -40 "$LOGS/build.log"; echo "ubsan_check: build failed" >&2; exit 2; }
fi

EXT="$(ls "$BUILD"/_dflash_cpu*.so 2>/dev/null | head -1)"
[ -n "$EXT" ] || { echo "ubsan_check: no _dflash_cpu*.so in $BUILD" >&2; exit 2; }
HARNESS="$BUILD/trt_plugin/dflash_trt_contract_harness"

# The builds must be instrumented, and the sanitizer must fire here: a signed overflow, built with
# the same flags, has to abort with a report.
for binary in "$EXT" ${HARNESS:+$([ -x "$HARNESS" ] && echo "$HARNESS")}; do
  [ "$(nm -D --undefined-only "$binary" | grep -c __ubsan_handle)" -gt 0 ] ||
    { echo "ubsan_check: $binary is not instrumented (no __ubsan_handle_* references)" >&2; exit 2; }
done
printf 'int main(int argc, char**) { int x = 0x7fffffff; return (x + argc) == 0; }\n' >"$BUILD/ub_self_check.cc"
g++ $FLAGS "$BUILD/ub_self_check.cc" -o "$BUILD/ub_self_check" 2>"$LOGS/self_check.log" &&
  ! "$BUILD/ub_self_check" 2>>"$LOGS/self_check.log" && grep -q "runtime error:" "$LOGS/self_check.log" ||
  { echo "ubsan_check: the sanitizer did not report a known signed overflow" >&2; cat "$LOGS/self_check.log" >&2; exit 2; }

export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:abort_on_error=0:exitcode=86"
PRELOAD=""
if [[ "$SANITIZE" == *address* ]]; then
  # libstdc++ too: else ASan cannot find the real __cxa_throw under a Python that does not link it.
  PRELOAD="$(g++ -print-file-name=libasan.so) $(g++ -print-file-name=libstdc++.so)"
  export ASAN_OPTIONS="detect_leaks=0:exitcode=87"
fi

reports=0
failures=0
cases=0
mismatches=0
summary_parts=()

count_reports() {  # file -> number of sanitizer reports in it
  grep -cE "runtime error:|ERROR: AddressSanitizer" "$1" || true
}

run_group() {  # name, command...
  local name="$1"; shift
  local log="$LOGS/$name.log"
  "$@" >"$log" 2>&1
  local rc=$?
  local n_reports; n_reports="$(count_reports "$log")"
  local n_cases; n_cases="$(sed -n 's/^CASES \([0-9]*\).*/\1/p' "$log" | tail -1)"
  n_cases="${n_cases:-0}"
  local n_mismatches; n_mismatches="$(sed -n 's/^MISMATCHES \([0-9]*\).*/\1/p' "$log" | tail -1)"
  mismatches=$((mismatches + ${n_mismatches:-0}))
  reports=$((reports + n_reports))
  cases=$((cases + n_cases))
  if [ "$rc" -ne 0 ] || [ "$n_reports" -ne 0 ]; then
    failures=$((failures + 1))
    echo "ubsan_check: $name: exit $rc, $n_reports UBSan report(s); log $log" >&2
    grep -E -A12 "runtime error:|ERROR: AddressSanitizer|Traceback|FAIL" "$log" | head -60 >&2
  fi
  summary_parts+=("$name=$n_cases")
}

for group in ffi raw fuzz bad_shapes; do
  run_group "cpu_$group" env ${PRELOAD:+LD_PRELOAD="$PRELOAD"} JAX_PLATFORMS=cpu \
    "$PYTHON" "$REPO/tools/ubsan_cases.py" --extension "$EXT" --group "$group"
done

if [ -x "$HARNESS" ]; then
  run_group harness_cpu_mode "$HARNESS" --report "$LOGS/harness_report.json"
  # The harness prints one PASS/FAIL line per check.
  checks="$(grep -cE '^(PASS|FAIL)' "$LOGS/harness_cpu_mode.log" || true)"
  cases=$((cases + checks)); summary_parts[${#summary_parts[@]}-1]="harness_cpu_mode=$checks"
  shapes="$BUILD/bad_shapes_plugin.txt"
  "$PYTHON" "$REPO/tools/ubsan_cases.py" --write-plugin-cases "$shapes" >"$LOGS/write_cases.log" 2>&1 ||
    { cat "$LOGS/write_cases.log" >&2; failures=$((failures + 1)); }
  run_group harness_check_shapes "$HARNESS" --check-shapes "$shapes" --report "$LOGS/shapes_report.json"
  rows="$(grep -cvE '^(#|$)' "$shapes" || true)"
  cases=$((cases + rows)); summary_parts[${#summary_parts[@]}-1]="harness_check_shapes=$rows"
  harness_note=""
else
  harness_note=" (contract harness not built: no CUDA toolkit or TensorRT headers; CPU extension only)"
fi

echo "ubsan_check: ${cases} cases run (${summary_parts[*]}), $([[ "$SANITIZE" == *address* ]] && echo "UBSan/ASan" || echo "UBSan") reports: ${reports}, failed groups: ${failures}, outcomes differing from the suite's expectations: ${mismatches} (the suite reports those; logs in $LOGS)${harness_note}"
[ "$reports" -eq 0 ] && [ "$failures" -eq 0 ]
