"""The ``check`` command: the environment (JAX, its backends, the CUDA extension, the TensorRT
plugin and runtime) and the parity self-test (:mod:`jax_dflash.cli.parity`)."""

from __future__ import annotations

import ctypes
import importlib
import textwrap

from jax_dflash.cli.common import EXIT_CHECK_FAILED, EXIT_OK, PROG, HelpFormatter, seed, version
from jax_dflash.contract import PLUGIN_NAME, PLUGIN_VERSION

NAME = "check"
SUMMARY = (
    "report the JAX backends, the CUDA extension and the TensorRT plugin, and test the op "
    "against the NumPy reference on every backend"
)
HELP = "report backends, extensions, the TensorRT plugin, and run a parity self-test"
DESCRIPTION = textwrap.dedent("""\
    Reports the JAX version, backends and devices; whether the CUDA extension
    (jax_dflash._dflash_cuda) loads and whether its launches use programmatic
    dependent launch (DFLASH_PDL=1 turns it on); the TensorRT plugin library's path
    and whether a TensorRT runtime (tensorrt or tensorrt_lean) is installed and can
    load it. Then
    a parity self-test: the op against the NumPy reference, bit for bit, on every
    available backend (cpu, and gpu when JAX has one) for float16, bfloat16 and
    float32 deltas, on small random shapes of every addressing form: hostile positions
    (negative, past the slot, near INT32_MAX and INT32_MIN), padding, lengths past L,
    per-sequence RoPE, per-layer positions; paged tokens with hostile owners, positions
    and page ids, ring pages; hostile flat slots; FP8 and int8 pools with per-head
    scales, per-token-head scale pools (int8, e4m3, int4; the scale pool compared
    too) and the fused norms. Exits 1 if any case differs.""")
TENSORRT_MODULES = ("tensorrt", "tensorrt_lean", "tensorrt_lean_bindings")


def add_parser(commands) -> None:
    parser = commands.add_parser(
        NAME, formatter_class=HelpFormatter, help=HELP, description=DESCRIPTION
    )
    parser.add_argument(
        "--seed", type=seed, default=0, metavar="S", help="seed of the random cases (default: 0)"
    )
    parser.set_defaults(execute=execute)


def available_backends() -> list[str]:
    import jax

    backends = ["cpu"]
    try:
        if jax.devices("gpu"):
            backends.append("gpu")
    except RuntimeError:
        pass
    return backends


def _plugin_library() -> tuple[str, str | None]:
    """(the plugin library's line, its path when it was built)."""
    from jax_dflash.interop import trt

    try:
        path = trt.trt_plugin_library_path()
    except FileNotFoundError as e:
        return f"not built ({e})", None
    except Exception as e:  # noqa: BLE001 - a report, not a crash
        return f"unavailable ({type(e).__name__}: {e})", None
    try:
        ctypes.CDLL(path)
    except OSError as e:
        return f"{path} (dlopen FAILED: {e})", path
    return f"{path} (dlopen: ok)", path


def _tensorrt_runtime():
    """(the first TensorRT runtime module that imports, or None; why the others did not)."""
    errors = []
    for name in TENSORRT_MODULES:
        try:
            return importlib.import_module(name), ""
        except ImportError:
            pass
        except Exception as e:  # noqa: BLE001 - a missing CUDA library raises OSError too
            errors.append(f"{name}: {type(e).__name__}")
    return None, "; ".join(errors)


def _tensorrt_report() -> tuple[str, str]:
    """(plugin library line, runtime line)."""
    from jax_dflash.interop import trt

    library, path = _plugin_library()
    module, errors = _tensorrt_runtime()
    if module is None:
        return library, (
            f"not installed (none of {', '.join(TENSORRT_MODULES)} imports"
            + (f"; {errors})" if errors else ")")
        )
    runtime = f"{module.__name__} {getattr(module, '__version__', '?')}"
    if path is None:
        return library, f"{runtime} installed; no plugin library to load"
    try:
        registry = module.get_plugin_registry()
        trt.load_plugin(registry)
    except ImportError:  # load_plugin imports the full tensorrt package, whatever the registry
        return library, (
            f"{runtime} installed; not loaded: jax_dflash.interop.trt.load_plugin needs the "
            f"tensorrt package"
        )
    except Exception as e:  # noqa: BLE001 - a report, not a crash
        return library, f"{runtime} could not load it: {type(e).__name__}: {e}"
    try:
        creator = registry.get_creator(PLUGIN_NAME, PLUGIN_VERSION, "")
    except Exception:  # noqa: BLE001 - not found, said below
        creator = None
    found = "found" if creator is not None else "NOT found"
    return library, (
        f"{runtime} loaded the plugin library; creator {PLUGIN_NAME} v{PLUGIN_VERSION} {found}"
    )


PDL_SWITCH = "DFLASH_PDL"


def _pdl_report(cuda_loaded: bool, backends: list[str]) -> str:
    """Whether the CUDA launches use programmatic dependent launch, and how to switch it."""
    import os

    from jax_dflash import _ext

    if not cuda_loaded:
        return "not applicable: the CUDA path is not present (no CUDA extension)"
    if "gpu" not in backends:
        return "not applicable: the CUDA path is not present (no GPU)"
    value = os.environ.get(PDL_SWITCH)
    # The extension reads the switch once per process, so it answers for this run.
    if _ext.extension("cuda").pdl_enabled():
        return (
            f"on ({PDL_SWITCH}=1): the update kernel's launch overlaps the tail of the kernel "
            f"before it, and the kernel waits for that kernel's writes; unset it to turn it off"
        )
    if value != "1":
        note = "" if value in (None, "0") else f"; {PDL_SWITCH}={value!r} is not 0 or 1"
        return f"off (the default; {PDL_SWITCH}=1 turns it on{note})"
    return (
        f"off although {PDL_SWITCH}=1: the GPU's compute capability, or the one this build's "
        "kernels were compiled for, is below 9.0"
    )


def _jax_path_report(cuda_loaded: bool, backends: list[str]) -> str:
    """How the CUDA FFI targets reach XLA's command buffers: the record stage (with or without
    programmatic dependent launch) or the execute stage captured on a stream."""
    import os

    from jax_dflash import _ext

    if not cuda_loaded:
        return "not applicable: the CUDA path is not present (no CUDA extension)"
    cuda = _ext.extension("cuda")
    if not cuda.ffi_record_stage():
        return (
            "execute stage (XLA captures it on a stream into command buffers); this build has no "
            "record stage: its XLA FFI headers have no record API (jaxlib before 0.11)"
        )
    if not _ext.record_stage_registered():
        return (
            "execute stage (XLA captures it on a stream into command buffers); this build's record "
            f"stage is registered with {_ext.RECORD_STAGE_SWITCH}=1 only (unverified: XLA did not "
            f"call it on the H200; {_ext.RECORD_STAGE_SWITCH}="
            f"{os.environ.get(_ext.RECORD_STAGE_SWITCH)!r})"
        )
    if "gpu" not in backends:
        return "record stage built, not applicable here: no GPU"
    if cuda.record_pdl_enabled():
        return (
            "record stage with PDL (XLA launches the kernel in its command buffers, overlapping "
            f"the kernel before it; {PDL_SWITCH}=0 turns PDL off)"
        )
    return f"record stage without PDL ({PDL_SWITCH}=0; unset it to turn PDL on)"


def _report_environment() -> list[str]:
    """Prints the environment's lines; returns the backends the parity test runs on."""
    import jax

    from jax_dflash import _ext

    print(f"{PROG} {version()}, JAX {jax.__version__}")
    print(f"default backend: {jax.default_backend()}")
    backends = available_backends()
    for backend in backends:
        devices = ", ".join(f"{d.platform}:{d.id} ({d.device_kind})" for d in jax.devices(backend))
        print(f"  {backend}: {devices}")
    if "gpu" not in backends:
        print("  gpu: none (this JAX has no GPU backend or sees no GPU)")
    if _ext.cuda_extension_available():
        cuda = "loaded (jax_dflash._dflash_cuda)"
    else:
        try:
            _ext.extension("cuda")
        except ImportError as e:
            cuda = f"not available: {str(e).splitlines()[0]}"
        else:  # pragma: no cover - available after all
            cuda = "loaded"
    print(f"CUDA extension: {cuda}")
    pdl = _pdl_report(_ext.cuda_extension_available(), backends)
    print(f"CUDA launches, programmatic dependent launch: {pdl}")
    jax_path = _jax_path_report(_ext.cuda_extension_available(), backends)
    print(f"JAX path on CUDA: {jax_path}")
    library, runtime = _tensorrt_report()
    print(f"TensorRT plugin library: {library}")
    print(f"TensorRT runtime: {runtime}")
    return backends


def execute(args) -> int:
    from jax_dflash.cli.parity import run_parity
    from jax_dflash.cli.presets import DTYPE_NAMES, dtype_from_name

    backends = _report_environment()
    print("parity self-test (op vs NumPy reference, bit for bit):")
    all_passed = True
    for backend in backends:
        for name in DTYPE_NAMES:
            passed, failures = run_parity(backend, dtype_from_name(name), args.seed)
            total = passed + len(failures)
            verdict = "bit-exact" if not failures else "FAILED"
            print(f"  {backend:<4} {name:<9} {passed}/{total} cases {verdict}")
            for failure in failures:
                print(f"      {failure}")
            all_passed &= not failures
    print("parity: all cases bit-exact" if all_passed else "parity: FAILED")
    return EXIT_OK if all_passed else EXIT_CHECK_FAILED
