"""The hostile cases of the test suite, run through a sanitized build of the CPU extension.

tools/ubsan_check.sh builds ``_dflash_cpu`` with UBSan and runs each group here in its own
process. The sanitized module is loaded by path as ``jax_dflash._dflash_cpu`` before anything
imports the installed one, so the raw entries and the FFI handlers (through the JAX op and
hand-written ``ffi_call``s) are the sanitized code. The case tables are the suite's own
(tests/test_ffi_abi.py, test_raw_entries.py, test_fuzz.py, test_bad_shapes_everywhere.py).

    python tools/ubsan_cases.py --extension BUILD/_dflash_cpu....so --group ffi|raw|fuzz|bad_shapes
    python tools/ubsan_cases.py --write-plugin-cases FILE     (the bad-shapes table for the harness)

Prints ``CASES n`` and ``MISMATCHES k`` (cases whose outcome differs from the suite's
expectation: the suite reports those; a sanitizer report aborts the process instead).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"


def load_extension(path: Path):
    """``path`` as jax_dflash._dflash_cpu, in place of the installed module."""
    name = "jax_dflash._dflash_cpu"
    if name in sys.modules:
        raise RuntimeError(f"{name} was imported before the sanitized build could replace it")
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None:
        raise FileNotFoundError(f"--extension: expected a Python extension module, got {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    import jax_dflash
    from jax_dflash import _ext

    jax_dflash._dflash_cpu = module
    assert _ext.extension("cpu") is module, "the installed extension was loaded instead"
    return module


def load_tests(name: str):
    """tests/<name>.py as a module (the suite's case tables and checks)."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))  # the test modules import each other
    spec = importlib.util.spec_from_file_location(name, TESTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class Tally:
    def __init__(self):
        self.cases = 0
        self.mismatches = []

    def run(self, name, fn, *args):
        import pytest

        self.cases += 1
        try:
            fn(*args)
        except pytest.skip.Exception:
            self.cases -= 1
        except Exception as e:  # noqa: BLE001  (an outcome the suite did not expect)
            self.mismatches.append(name)
            print(f"MISMATCH {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)

    def report(self):
        print(f"CASES {self.cases}")
        print(
            f"MISMATCHES {len(self.mismatches)}"
            + (f": {', '.join(self.mismatches)}" if self.mismatches else "")
        )


def group_ffi(tally):
    import jax

    jax.config.update("jax_enable_x64", True)  # as the suite's children: int64 reaches the handler
    from jax_dflash import _ext

    _ext.ensure_registered("cpu")
    abi = load_tests("test_ffi_abi")
    for case in abi.CASES:
        tally.run(case.id, lambda c=case: abi.check_result(c, abi._run_case(c, "cpu")))


def group_raw(tally):
    raw = load_tests("test_raw_entries")
    for contract in raw.CONTRACTS:
        for variant in raw.VARIANTS:
            tally.run(
                f"in_place-{contract}-{variant}",
                raw.test_cpu_updates_the_callers_pool_in_place,
                contract,
                variant,
            )
        for layout in raw.BAD_LAYOUTS:
            for pool_dtype in (raw.F16, raw.E4M3):
                tally.run(
                    f"layout-{contract}-{pool_dtype}-{layout}",
                    raw.test_cpu_pool_that_is_not_updatable_in_place_raises,
                    contract,
                    pool_dtype,
                    layout,
                )
        tally.run(
            f"read_only_inputs-{contract}", raw.test_cpu_read_only_inputs_are_accepted, contract
        )
        for empty in raw.EMPTY[contract]:
            tally.run(
                f"empty-{contract}-{empty}", raw.test_cpu_empty_operands_are_valid, contract, empty
            )
        for bad in raw.BAD_CALLS:
            if contract in bad.contracts:
                tally.run(
                    f"bad-{contract}-{bad.name}",
                    raw.test_cpu_wrong_argument_names_it_and_leaves_the_pool,
                    contract,
                    bad,
                )
    tally.run("ring", raw.test_cpu_ring_paged_in_place)
    tally.run("empty_slices", raw.test_cpu_empty_slices_with_strides_are_contiguous)


def group_fuzz(tally):
    fuzz = load_tests("test_fuzz")
    for contract in ("slot", "paged"):
        for seed in fuzz.SEEDS:
            tally.run(
                f"fuzz-{contract}-{seed}",
                fuzz.test_fuzz_op_and_raw_entry_equal_the_reference,
                contract,
                seed,
            )


def group_bad_shapes(tally):
    import jax

    jax.config.update("jax_enable_x64", True)
    from jax_dflash import _ext

    _ext.ensure_registered("cpu")
    table = load_tests("test_bad_shapes_everywhere")

    def ffi(row):
        result = table._ffi_run(row)
        table._check(row, "ffi", None if result["status"] == "ok" else result["message"])

    for row in table.ROWS:
        if table._applies(row, "ffi"):
            tally.run(f"ffi-{row.id}", ffi, row)
        if table._applies(row, "op"):
            tally.run(f"op-{row.id}", lambda r=row: table._check(r, "op", table.op_verdict(r)))


GROUPS = {"ffi": group_ffi, "raw": group_raw, "fuzz": group_fuzz, "bad_shapes": group_bad_shapes}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--extension", type=Path, help="the sanitized _dflash_cpu*.so")
    parser.add_argument("--group", choices=sorted(GROUPS))
    parser.add_argument(
        "--write-plugin-cases",
        type=Path,
        metavar="FILE",
        help="write the bad-shapes table as --check-shapes lines and exit",
    )
    args = parser.parse_args(argv)
    if args.write_plugin_cases:
        table = load_tests("test_bad_shapes_everywhere")
        args.write_plugin_cases.write_text(
            "# name|fields|inputs (tests/test_bad_shapes_everywhere.py)\n"
            + "\n".join(table.plugin_line(r) for r in table.ROWS)
            + "\n"
        )
        return 0
    if not (args.extension and args.group):
        parser.error("--extension and --group are required (or --write-plugin-cases FILE)")
    if not args.extension.is_file():
        parser.error(f"--extension: expected a file, got {args.extension}")
    load_extension(args.extension.resolve())
    tally = Tally()
    try:
        GROUPS[args.group](tally)
    except Exception:  # noqa: BLE001  (a broken group is reported, with what ran before it)
        traceback.print_exc()
        tally.report()
        return 1
    tally.report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
