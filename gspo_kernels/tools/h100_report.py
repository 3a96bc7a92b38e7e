"""``gspo-kernels h100-report``: compile every Triton kernel of the library for sm_90a and report its resources.

No GPU is needed: ``triton.compile`` builds the cubin for ``GPUTarget("cuda", 90, 32)`` on the CPU and the
``cuobjdump`` bundled with triton reads registers, shared memory and local (spill) bytes from it.

Format of ``gspo_kernels.backends.triton.configs.H100_CONFIGS``, one dict per launch configuration the
library really uses::

    H100_CONFIGS = [
        {
            "name": "logprobs_fwd[bf16]",   # unique label shown in the report
            "kernel": "logits.logprobs_fwd_kernel",  # the @triton.jit function, as "module.function"
                                            #   inside gspo_kernels.backends.triton (resolve_kernel)
            "constexprs": {...},            # values of the tl.constexpr parameters, and of the arguments the
                                            #   runtime specializes (an int equal to 1, e.g. a unit stride)
            "pointers": {"x_ptr": "bf16"},  # element types of the pointer arguments (``*_ptr``) that are
                                            #   not fp32
            "floats": ["inv_temperature"],  # the scalar arguments that are fp32 (the others are i32)
            "num_warps": 8,
            "num_stages": 3,
            "uses_dot": True,               # optional: the kernel calls tl.dot, so its SASS must use HGMMA
            "aligned_ints": ["stride_t"],   # optional: int arguments the runtime sees as divisible by 16
                                            #   (every pointer is taken as 16-byte aligned)
            "vector_loads": True,           # optional: a bandwidth-bound kernel whose PTX must contain
                                            #   128-bit global loads (ld.global.v4 / ld.global.nc.v4)
        },
    ]

The launch signature is always derived from the kernel's own parameter list (:func:`derive_signature`): only
what the names cannot say is written down, so a renamed or added kernel argument cannot go unreported.

The command prints a table (registers, dynamic shared memory, local bytes, HGMMA, 128-bit loads) and returns
nonzero on any compile error (or a module that fails to import), any spill (local bytes > 0), a ``uses_dot``
kernel without HGMMA, or a ``vector_loads`` kernel without 128-bit loads. Under the Triton
interpreter (``TRITON_INTERPRET=1``) the kernels are not compilable in-process, so it re-runs itself in a
subprocess with the interpreter off.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, Iterable, List, Mapping, Optional, Sequence

TARGET = ("cuda", 90, 32)
_WORKER_FLAG = "GSPO_KERNELS_H100_REPORT_WORKER"
# The directory holding the gspo_kernels package: put first on the subprocesses' PYTHONPATH so that they
# import this copy of the library.
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--only", default=None, help="report only the kernels whose name contains this text")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    parser.add_argument("--modules", default=None,
                        help="comma-separated kernel modules to report (e.g. logits,linear,sequence)")


def kernel_parameters(fn) -> List[tuple]:
    """``(name, is_constexpr)`` for each parameter of a ``@triton.jit`` function (compiled or interpreted)."""
    import inspect

    import triton.language as tl

    out = []
    for name, param in inspect.signature(fn.fn).parameters.items():
        annotation = param.annotation
        is_constexpr = annotation is tl.constexpr or (isinstance(annotation, str) and "constexpr" in annotation)
        out.append((name, is_constexpr))
    return out


def derive_signature(
    fn,
    constexprs: Mapping[str, object],
    *,
    pointers: Optional[Mapping[str, str]] = None,
    floats: Iterable[str] = (),
    default_pointer: str = "fp32",
    default_scalar: str = "i32",
) -> Dict[str, str]:
    """The ``triton.compile`` signature of ``fn`` from its parameter names.

    ``tl.constexpr`` parameters and every name in ``constexprs`` -> ``"constexpr"``; ``*_ptr`` ->
    ``"*" + pointers.get(name, default_pointer)``; names in ``floats`` -> ``"fp32"``; other scalars ->
    ``default_scalar``. Raises ``ValueError`` when ``pointers`` / ``floats`` / ``constexprs`` name an argument
    the kernel does not have (a renamed argument must not go unnoticed), or a constexpr has no value.
    """
    params = kernel_parameters(fn)
    names = {name for name, _ in params}
    pointers = dict(pointers or {})
    floats = set(floats)
    unknown = (set(pointers) | floats | set(constexprs)) - names
    if unknown:
        raise ValueError(f"{fn.fn.__name__} has no argument(s) {sorted(unknown)}")
    signature = {}
    for name, is_constexpr in params:
        if is_constexpr or name in constexprs:
            if name not in constexprs:
                raise ValueError(f"{fn.fn.__name__}: constexpr {name!r} needs a value in constexprs")
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*" + pointers.get(name, default_pointer)
        elif name in floats:
            signature[name] = "fp32"
        else:
            signature[name] = default_scalar
    return signature


def normalize_config(config: dict) -> dict:
    """A config with its ``"fn"`` (:func:`resolve_kernel`), ``"signature"`` (:func:`derive_signature`) and
    ``"aligned"`` (every pointer, then the ``aligned_ints``) filled in."""
    config = dict(config)
    if "fn" not in config:
        config["fn"] = resolve_kernel(config["kernel"])
    config["signature"] = derive_signature(config["fn"], config.get("constexprs", {}),
                                           pointers=config.get("pointers"), floats=config.get("floats", ()))
    pointers = [name for name, kind in config["signature"].items() if kind.startswith("*")]
    config["aligned"] = pointers + list(config.get("aligned_ints", ()))
    return config


PACKAGE = "gspo_kernels.backends.triton"


def resolve_kernel(name: str):
    """The ``@triton.jit`` function named ``"module.function"`` inside ``gspo_kernels.backends.triton``."""
    module, _, function = name.rpartition(".")
    return getattr(importlib.import_module(f"{PACKAGE}.{module}"), function)


def collect_configs(modules: Optional[Sequence[str]] = None) -> List[dict]:
    """``configs.H100_CONFIGS`` (only the kernels of ``modules`` when given), each with its resolved ``"fn"``
    and its ``"module"``; a kernel module that fails to import gives one row with ``import_error``."""
    configs = []
    try:
        table = importlib.import_module(f"{PACKAGE}.configs").H100_CONFIGS
    except Exception as exc:  # reported as a failed row
        return [{"name": "configs (import)", "module": "configs", "import_error": f"{type(exc).__name__}: {exc}"}]
    failed = set()
    for config in table:
        module = config["kernel"].rpartition(".")[0]
        if (modules is not None and module not in modules) or module in failed:
            continue
        try:
            fn = resolve_kernel(config["kernel"])
        except Exception as exc:  # reported as a failed row
            failed.add(module)
            configs.append({"name": f"{module} (import)", "module": module,
                            "import_error": f"{type(exc).__name__}: {exc}"})
            continue
        configs.append(dict(config, fn=fn, module=module))
    return configs


def _cuobjdump() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def _resource_usage(text: str) -> Dict[str, int]:
    """Parse ``REG:80 STACK:0 SHARED:1024 LOCAL:0 ...`` from ``cuobjdump --dump-resource-usage``."""
    for line in text.splitlines():
        if "REG:" in line:
            fields = dict(item.split(":", 1) for item in line.split() if ":" in item)
            return {k: int(v) for k, v in fields.items() if v.isdigit()}
    raise RuntimeError(f"no resource line in cuobjdump output:\n{text}")


def compile_config(config: dict) -> dict:
    """Compile one configuration for sm_90a; returns a report row (``error`` set when it failed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    row = {"name": config["name"], "module": config.get("module", ""), "num_warps": config.get("num_warps", 0),
           "num_stages": config.get("num_stages", 0), "uses_dot": bool(config.get("uses_dot", False)),
           "vector_loads": bool(config.get("vector_loads", False)), "error": config.get("import_error")}
    if row["error"]:
        return row
    start = time.perf_counter()
    try:
        config = normalize_config(config)
        fn = config["fn"]
        signature = config["signature"]
        attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in config["aligned"]}
        kernel = triton.compile(
            ASTSource(fn, signature, config.get("constexprs", {}), attrs),
            target=GPUTarget(*TARGET),
            options={"num_warps": config["num_warps"], "num_stages": config["num_stages"]},
        )
        with tempfile.TemporaryDirectory() as tmp:
            cubin = os.path.join(tmp, "kernel.cubin")
            with open(cubin, "wb") as f:
                f.write(kernel.asm["cubin"])
            usage = _resource_usage(
                subprocess.run([_cuobjdump(), "--dump-resource-usage", cubin], check=True, capture_output=True,
                               text=True).stdout
            )
            sass = subprocess.run([_cuobjdump(), "--dump-sass", cubin], check=True, capture_output=True, text=True).stdout
        row.update(
            registers=usage.get("REG", -1),
            shared_bytes=int(kernel.metadata.shared),
            static_shared_bytes=usage.get("SHARED", 0),
            local_bytes=usage.get("LOCAL", 0),
            stack_bytes=usage.get("STACK", 0),
            stl_count=sass.count("STL"),
            hgmma="HGMMA" in sass,
            hmma="HMMA" in sass,
            loads_128=any(op in kernel.asm["ptx"] for op in ("ld.global.v4", "ld.global.nc.v4")),
        )
    except Exception as exc:  # a kernel that does not compile is a failed row, not a crashed report
        row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
    row["compile_s"] = round(time.perf_counter() - start, 2)
    return row


MAX_SHARED_BYTES = 227 * 1024  # per block on H100, after opt-in


def problems(row: dict) -> List[str]:
    """Why a row fails the report (empty when it passes)."""
    if row["error"]:
        return [row["error"]]
    out = []
    if row["local_bytes"] > 0:
        out.append(f"spills: {row['local_bytes']} local bytes")
    if row.get("stack_bytes", 0) > 0 or row.get("stl_count", 0) > 0:
        out.append(f"spills to the stack: {row.get('stack_bytes', 0)} stack bytes, {row.get('stl_count', 0)} STL")
    if row.get("shared_bytes", 0) > MAX_SHARED_BYTES:
        out.append(f"needs {row['shared_bytes']} B of shared memory, over the {MAX_SHARED_BYTES} B an H100 block gets")
    if row["uses_dot"] and not row["hgmma"]:
        out.append("calls tl.dot but its SASS has no HGMMA" + (" (HMMA only)" if row["hmma"] else ""))
    if row["vector_loads"] and not row["loads_128"]:
        out.append("no 128-bit global loads in its PTX")
    return out


def build_report(only: Optional[str] = None, modules: Optional[Sequence[str]] = None) -> List[dict]:
    """Compile in this process (the interpreter must be off): one row per configuration."""
    rows = []
    for config in collect_configs(modules):
        if only and only not in config["name"]:
            continue
        rows.append(compile_config(config))
    return rows


def format_table(rows: List[dict]) -> str:
    header = (f"{'kernel':<56} {'warps':>5} {'stages':>6} {'regs':>5} {'smem B':>8} {'local B':>7} {'HGMMA':>6} "
              f"{'ld128':>6}  status")
    lines = [header, "-" * len(header)]
    for row in rows:
        issues = problems(row)
        status = "ok" if not issues else "FAIL: " + "; ".join(issues)
        if row["error"]:
            lines.append(f"{row['name']:<56} {row['num_warps']:>5} {row['num_stages']:>6} {'-':>5} {'-':>8} {'-':>7} "
                         f"{'-':>6} {'-':>6}  {status}")
            continue
        hgmma = "yes" if row["hgmma"] else ("HMMA" if row["hmma"] else "no")
        loads = "yes" if row["loads_128"] else "no"
        lines.append(
            f"{row['name']:<56} {row['num_warps']:>5} {row['num_stages']:>6} {row['registers']:>5} "
            f"{row['shared_bytes']:>8} {row['local_bytes']:>7} {hgmma:>6} {loads:>6}  {status}"
        )
    return "\n".join(lines)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _run_in_subprocess(args: argparse.Namespace) -> int:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env[_WORKER_FLAG] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
    argv = [sys.executable, "-m", "gspo_kernels", "h100-report"]
    if args.only:
        argv += ["--only", args.only]
    if args.json:
        argv += ["--json", args.json]
    if getattr(args, "modules", None):
        argv += ["--modules", args.modules]
    print("h100-report: the Triton interpreter is on in this process; compiling in a subprocess without it",
          flush=True)
    return subprocess.run(argv, env=env).returncode


def run(args: argparse.Namespace) -> int:
    if _interpreting() and not os.environ.get(_WORKER_FLAG):
        return _run_in_subprocess(args)
    import triton

    print(f"Static report for GPUTarget{TARGET} (H100, sm_90a); triton {triton.__version__}; no GPU needed")
    modules = args.modules.split(",") if getattr(args, "modules", None) else None
    rows = build_report(args.only, modules)
    print(format_table(rows))
    failed = [row for row in rows if problems(row)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in row.items()} for row in rows], f, indent=1)
    if not rows:
        print("no kernel configuration matched")
        return 1
    print(f"{len(rows)} configurations, {len(failed)} failing")
    return 1 if failed else 0


def static_report(
    modules: Optional[Sequence[str]] = None, only: Optional[str] = None, timeout: float = 600.0
) -> List[dict]:
    """Compile the kernels for sm_90a in a fresh subprocess (interpreter off) and return the report rows.

    The API for tests: works whether or not this process runs the Triton interpreter. ``modules`` limits the
    report to those modules of ``gspo_kernels.backends.triton`` (e.g. ``["linear"]``), ``only`` to the kernels whose name contains that text. Each row holds ``name``,
    ``registers``, ``shared_bytes``, ``local_bytes``, ``stack_bytes``, ``stl_count``, ``hgmma``, ``loads_128``
    and ``error``; :func:`problems` says why a row fails. Raises ``RuntimeError`` when the subprocess wrote
    no report.
    """
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env[_WORKER_FLAG] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "report.json")
        argv = [sys.executable, "-m", "gspo_kernels", "h100-report", "--json", path]
        if modules:
            argv += ["--modules", ",".join(modules)]
        if only:
            argv += ["--only", only]
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
        if not os.path.exists(path):
            raise RuntimeError(f"h100-report wrote no report (exit {proc.returncode}):\n"
                               f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        with open(path) as f:
            return json.load(f)
