"""``gspo-kernels h100-report``: compile every Triton kernel of the library for sm_90a and report its resources.

No GPU is needed: ``triton.compile`` builds the cubin for ``GPUTarget("cuda", 90, 32)`` on the CPU and the
``cuobjdump`` bundled with triton reads registers, shared memory and local (spill) bytes from it.

Format followed by every op module of ``gspo_kernels.triton`` that defines Triton kernels: a module-level
``H100_CONFIGS`` list with one dict per launch configuration the library really uses::

    H100_CONFIGS = [
        {
            "name": "logprobs_fwd[bf16]",   # unique label shown in the report
            "fn": _logprobs_fwd_kernel,     # the @triton.jit function
            "signature": {...},             # every argument but the tl.constexpr parameters:
                                            #   "*bf16" / "*fp16" / "*fp32" / "*i64" / "*i32" / "*i1",
                                            #   "i32" / "i64" / "fp32", or "constexpr" for an argument the
                                            #   runtime specializes (an int equal to 1, e.g. a unit stride)
            "constexprs": {...},            # values of the tl.constexpr parameters (and "constexpr" args)
            "num_warps": 8,
            "num_stages": 3,
            "uses_dot": True,               # optional: the kernel calls tl.dot, so its SASS must use HGMMA
            "aligned": ["x_ptr", ...],      # optional: arguments the runtime sees as divisible by 16
                                            #   (default: every pointer argument)
            "vector_loads": True,           # optional: a bandwidth-bound kernel whose PTX must contain
                                            #   128-bit global loads (ld.global.v4 / ld.global.nc.v4)
        },
    ]

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
import pkgutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

TARGET = ("cuda", 90, 32)
_WORKER_FLAG = "GSPO_KERNELS_H100_REPORT_WORKER"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--only", default=None, help="report only the kernels whose name contains this text")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")


def collect_configs() -> List[dict]:
    """``H100_CONFIGS`` of every module of ``gspo_kernels.triton``, in module order."""
    import gspo_kernels.backends.triton as package

    configs = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        try:
            module = importlib.import_module(f"{package.__name__}.{info.name}")
        except Exception as exc:  # reported as a failed row
            configs.append({"name": f"{info.name} (import)", "module": info.name, "import_error": f"{type(exc).__name__}: {exc}"})
            continue
        for config in getattr(module, "H100_CONFIGS", []):
            configs.append(dict(config, module=info.name))
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
    fn = config["fn"]
    signature = config["signature"]
    aligned = config.get("aligned")
    if aligned is None:
        aligned = [name for name, kind in signature.items() if kind.startswith("*")]
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    start = time.perf_counter()
    try:
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


def build_report(only: Optional[str] = None) -> List[dict]:
    rows = []
    for config in collect_configs():
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
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    argv = [sys.executable, "-m", "gspo_kernels", "h100-report"]
    if args.only:
        argv += ["--only", args.only]
    if args.json:
        argv += ["--json", args.json]
    print("h100-report: the Triton interpreter is on in this process; compiling in a subprocess without it",
          flush=True)
    return subprocess.run(argv, env=env).returncode


def run(args: argparse.Namespace) -> int:
    if _interpreting() and not os.environ.get(_WORKER_FLAG):
        return _run_in_subprocess(args)
    import triton

    print(f"Static report for GPUTarget{TARGET} (H100, sm_90a); triton {triton.__version__}; no GPU needed")
    rows = build_report(args.only)
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
