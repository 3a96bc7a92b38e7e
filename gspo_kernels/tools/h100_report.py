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
            "loop_elements": 4096,          # optional: elements the block handles per main-loop iteration
                                            #   (instructions per element = per iteration / (this / threads))
        },
    ]

The launch signature is always derived from the kernel's own parameter list (:func:`derive_signature`): only
what the names cannot say is written down, so a renamed or added kernel argument cannot go unreported.

The command prints a table (pipeline depth, registers, dynamic shared memory, local bytes, HGMMA, 128-bit loads,
and the main loop's SASS instructions per element and load/store widths: :func:`main_loop_stats`) and returns
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
import re
import subprocess
import sys
import tempfile
import time
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from gspo_kernels.tools.table import Column, text_header, text_row

TARGET = ("cuda", 90, 32)
_WORKER_FLAG = "GSPO_KERNELS_H100_REPORT_WORKER"
# The directory holding the gspo_kernels package: put first on the subprocesses' PYTHONPATH so that they
# import this copy of the library.
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--only", default=None, help="report only the kernels whose name contains this text")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    parser.add_argument("--modules", default=None,
                        help="comma-separated kernel modules to report (e.g. logits,linear_invariant_kernels,linear_loss,sequence_kernels)")


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
    constexprs = config.get("constexprs", {})
    if isinstance(constexprs.get("HELPERS"), str):  # the sequence kernel's objective, named in configs.py: its helpers
        from gspo_kernels.backends.triton.objectives import HELPERS

        config["constexprs"] = {**constexprs, "HELPERS": HELPERS[constexprs["HELPERS"]]}
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
            # 128-bit loads: four 32-bit (or two 64-bit: fp64 logits) elements per instruction
            loads_128=any(op in kernel.asm["ptx"] for op in ("ld.global.v4", "ld.global.nc.v4", "ld.global.v2.b64",
                                                             "ld.global.nc.v2.b64", "ld.global.v2.f64")),
            **main_loop_stats(sass, elements_per_thread(config)),
        )
    except Exception as exc:  # a kernel that does not compile is a failed row, not a crashed report
        row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
    row["compile_s"] = round(time.perf_counter() - start, 2)
    return row


# ---------------------------------------------------------------------------------------------------------
# The main loop's instruction count, read from the SASS (no GPU: the cubin's disassembly).
_SASS_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_TARGET = re.compile(r"0x([0-9a-f]+)")


def parse_sass(text: str) -> List[tuple]:
    """``(address, predicate, opcode, operands)`` for each instruction of ``cuobjdump --dump-sass`` output
    (one kernel per cubin here)."""
    out = []
    for line in text.splitlines():
        match = _SASS_LINE.match(line)
        if not match:
            continue
        body = match.group(2).strip()
        pred = ""
        if body.startswith("@"):
            pred, _, body = body.partition(" ")
        op, _, rest = body.strip().partition(" ")
        out.append((int(match.group(1), 16), pred, op, rest.strip()))
    return out


def access_width(op: str) -> int:
    """Bits moved per thread by a global load/store opcode (``LDG.E.128`` -> 128, ``LDG.E.U16`` -> 16, ``LDG.E``
    -> 32)."""
    parts = op.split(".")
    for part in parts[1:]:
        if part in ("128", "64", "256"):
            return int(part)
        if part in ("U16", "S16"):
            return 16
        if part in ("U8", "S8"):
            return 8
    return 32


def _successors(instrs: List[tuple], index: Dict[int, int], i: int) -> List[int]:
    _, pred, op, rest = instrs[i]
    always = pred in ("", "@PT")
    base = op.split(".")[0]
    nxt = [i + 1] if i + 1 < len(instrs) else []
    if base == "EXIT":
        return [] if always else nxt
    if base == "BRA":
        match = _TARGET.search(rest)
        target = [index[int(match.group(1), 16)]] if match and int(match.group(1), 16) in index else []
        return target if always else nxt + target
    return nxt


def loops(instrs: List[tuple]) -> List[dict]:
    """Every loop of the kernel: for each backward branch (latch ``i`` -> header ``j``), its natural loop (the
    instructions that reach the latch without passing the header) and the fewest and most instructions one
    iteration can execute (paths header -> latch inside the loop, inner loops' back edges cut)."""
    index = {addr: k for k, (addr, *_rest) in enumerate(instrs)}
    succ = [_successors(instrs, index, k) for k in range(len(instrs))]
    pred: List[List[int]] = [[] for _ in instrs]
    for k, targets in enumerate(succ):
        for t in targets:
            pred[t].append(k)
    found = []
    for latch, targets in enumerate(succ):
        for header in targets:
            if header >= latch or instrs[latch][2].split(".")[0] != "BRA":
                continue  # (a branch to itself: the trap ptxas puts after the last EXIT)
            body, stack = {header, latch}, [latch]
            while stack:
                node = stack.pop()
                if node == header:
                    continue
                for p in pred[node]:
                    if p not in body:
                        body.add(p)
                        stack.append(p)
            shortest, longest = _path_lengths(succ, body, header, latch)
            found.append({"header": header, "latch": latch, "body": body, "min": shortest, "max": longest})
    return found


def _path_lengths(succ: List[List[int]], body: set, header: int, latch: int) -> Tuple[int, int]:
    """Fewest and most instructions on a path header -> latch (both counted) inside ``body``, cycles cut."""
    order, state, stack = [], {header: 1}, [(header, iter(succ[header]))]
    dag: Dict[int, List[int]] = {header: []}
    while stack:  # iterative DFS: keep the edges that do not close a cycle, record the post-order
        node, it = stack[-1]
        nxt = next(it, None)
        if nxt is None:
            state[node] = 2
            order.append(node)
            stack.pop()
            continue
        if nxt not in body or nxt == header or state.get(nxt) == 1:
            continue
        dag[node].append(nxt)
        if nxt not in state:
            state[nxt] = 1
            dag[nxt] = []
            stack.append((nxt, iter(succ[nxt])))
    inf = float("inf")
    low = {n: inf for n in order}
    high = {n: -inf for n in order}
    low[latch] = high[latch] = 1
    for node in order:  # post-order: successors first
        if node == latch:
            continue
        for t in dag[node]:
            low[node] = min(low[node], 1 + low[t])
            high[node] = max(high[node], 1 + high[t])
    if header not in low or low[header] == inf:
        return 0, 0
    return int(low[header]), int(high[header])


def main_loop_stats(sass: str, elements_per_thread: Optional[float]) -> dict:
    """The kernel's main loop and what one iteration costs. Main loop: among the innermost loops, the one whose
    global loads are widest (then whose stores are), i.e. the streaming body of a bandwidth-bound kernel
    (a loop without loads when none has any). ``loop_instr_min`` / ``loop_instr_max``: instructions on the
    shortest / longest path through one iteration (e.g. without / with the logits forward's rescale when the
    running max moves); per element: divided by the elements a thread handles per iteration. Ties: unpredicated
    (unmasked) loads, then stores, then the first loop in the code."""
    instrs = parse_sass(sass)
    found = loops(instrs)
    if not found:
        return {"loop_instr_min": None, "loop_instr_max": None, "instr_per_elem": None,
                "instr_per_elem_max": None, "load_bits": [], "store_bits": []}
    innermost = [lp for lp in found if not any(o is not lp and o["body"] < lp["body"] for o in found)]

    def widths(lp, prefix):
        return sorted({access_width(instrs[k][2]) for k in lp["body"] if instrs[k][2].startswith(prefix)})

    def unmasked(lp, prefix):  # the streaming body reads (writes) without a predicate; masked edges do not
        return any(instrs[k][2].startswith(prefix) and instrs[k][1] in ("", "@PT") for k in lp["body"])

    def key(lp):
        loads, stores = widths(lp, "LDG"), widths(lp, "STG")
        return (bool(loads), max(loads, default=0), unmasked(lp, "LDG"), max(stores, default=0),
                unmasked(lp, "STG"), -lp["header"])

    best = max(innermost, key=key)
    row = {"loop_instr_min": best["min"], "loop_instr_max": best["max"], "load_bits": widths(best, "LDG"),
           "store_bits": widths(best, "STG"), "instr_per_elem": None, "instr_per_elem_max": None}
    if elements_per_thread:
        row["instr_per_elem"] = round(best["min"] / elements_per_thread, 2)
        row["instr_per_elem_max"] = round(best["max"] / elements_per_thread, 2)
    return row


def elements_per_thread(config: dict) -> Optional[float]:
    """Elements one thread handles per main-loop iteration: ``loop_elements`` (per block) over the threads, or,
    for the 1-D streaming kernels that do not set it, their tile (``BLOCK_T``, ``BLOCK_S``, ``BLOCK``); None
    otherwise (GEMM loops: see their HGMMA column instead)."""
    per_block = config.get("loop_elements")
    if per_block is None and "loop_elements" not in config:
        constexprs = config.get("constexprs", {})
        per_block = next((constexprs[k] for k in ("BLOCK_T", "BLOCK_S", "BLOCK") if k in constexprs), None)
    if not per_block:
        return None
    return per_block / (32 * max(int(config.get("num_warps", 4)), 1))


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


def _bits(widths) -> str:
    return "/".join(str(w) for w in widths) if widths else "-"


def _per_elem(row: dict) -> str:
    low, high = row.get("instr_per_elem"), row.get("instr_per_elem_max")
    if low is None:
        loop = row.get("loop_instr_min")
        return "-" if loop is None else f"({loop}/it)"
    return f"{low:g}" if high == low else f"{low:g}-{high:g}"


COLUMNS = (Column("kernel", 54, "<"), Column("warps", 5), Column("stages", 6), Column("regs", 5), Column("smem B", 7),
           Column("local B", 7), Column("HGMMA", 6), Column("ld128", 5), Column("instr/elem", 11),
           Column("ld bits", 8), Column("st bits", 8))


def format_table(rows: List[dict]) -> str:
    """One line per configuration: warps, pipeline depth (``num_stages``), registers, shared and local (spill)
    bytes, HGMMA, 128-bit loads in the PTX, then the main loop (:func:`main_loop_stats`): SASS instructions per
    element (fewest-most per iteration; ``(n/it)`` where the elements per iteration are not defined) and the
    widths of its global loads and stores in bits."""
    header = text_header(COLUMNS, tail="status")
    lines = [header, "-" * len(header)]
    for row in rows:
        issues = problems(row)
        status = "ok" if not issues else "FAIL: " + "; ".join(issues)
        if row["error"]:
            lines.append(text_row(COLUMNS, [row["name"], row["num_warps"], row["num_stages"], *["-"] * 8], tail=status))
            continue
        hgmma = "yes" if row["hgmma"] else ("HMMA" if row["hmma"] else "no")
        loads = "yes" if row["loads_128"] else "no"
        lines.append(text_row(COLUMNS, [row["name"], row["num_warps"], row["num_stages"], row["registers"],
                                        row["shared_bytes"], row["local_bytes"], hgmma, loads, _per_elem(row),
                                        _bits(row.get("load_bits")), _bits(row.get("store_bits"))], tail=status))
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

    from gspo_kernels.versions import triton_problem

    problem = triton_problem(triton.__version__)
    if problem is not None:  # the kernels are not built on a triton older than the floor
        print(f"gspo-kernels h100-report: {problem}", file=sys.stderr)
        return 2
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
    report to those modules of ``gspo_kernels.backends.triton`` (e.g. ``["linear_invariant_kernels"]``), ``only`` to the kernels whose name contains that text. Each row holds ``name``,
    ``registers``, ``shared_bytes``, ``local_bytes``, ``stack_bytes``, ``stl_count``, ``hgmma``, ``loads_128``,
    ``num_stages``, the main loop's ``loop_instr_min`` / ``loop_instr_max``, ``instr_per_elem`` /
    ``instr_per_elem_max`` (None without ``loop_elements``), ``load_bits``, ``store_bits``, and ``error``; :func:`problems` says why a row fails. Raises ``RuntimeError`` when the subprocess wrote
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
