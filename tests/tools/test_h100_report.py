"""The static H100 report: every Triton kernel of the library compiles for sm_90a without spilling.

No GPU is needed (``triton.compile`` targets ``GPUTarget("cuda", 90, 32)`` on the CPU). The report runs
in a subprocess with the interpreter off (``h100_report.static_report``), exactly as
``gspo-kernels h100-report`` does.
"""

from __future__ import annotations

import importlib
import os
import pkgutil

import pytest

triton = pytest.importorskip("triton")

from gspo_kernels.tools import h100_report  # noqa: E402


def _is_kernel(obj) -> bool:
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    return isinstance(obj, (JITFunction, InterpretedFunction))


def _kernel_modules():
    """``(module, names of its launched kernels)`` for every module of the backend that defines kernels."""
    import gspo_kernels.backends.triton as package

    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"gspo_kernels.backends.triton.{info.name}")
        kernels = {name for name, obj in vars(module).items()
                   if _is_kernel(obj) and obj.fn.__module__ == module.__name__}
        launched = {k for k in kernels if k.endswith("_kernel")}  # not the @jit helpers (launch.py's, ...)
        if launched:
            yield module, launched


def test_every_kernel_is_in_the_launch_configs():
    """``configs.H100_CONFIGS`` lists every launched kernel of every module of the backend, and each entry's
    signature is derived from that kernel's own arguments."""
    from gspo_kernels.backends.triton import configs

    covered = {config["kernel"] for config in configs.H100_CONFIGS}
    seen = set()
    for module, kernels in _kernel_modules():
        short = module.__name__.rsplit(".", 1)[1]
        names = {f"{short}.{k}" for k in kernels}
        assert names <= covered, f"{module.__name__}: kernels missing from configs.H100_CONFIGS: {names - covered}"
        seen |= names
    assert seen == covered  # and no entry names a kernel that does not exist
    assert {name.split(".")[0] for name in seen} == {"logits", "linear_loss", "linear_invariant_kernels", "sequence_kernels"}
    for config in configs.H100_CONFIGS:
        assert {"name", "kernel", "constexprs", "num_warps", "num_stages"} <= set(config)
        full = h100_report.normalize_config(config)  # the signature is derived from the arguments
        assert list(full["signature"]) == list(full["fn"].arg_names)
    assert len({config["name"] for config in configs.H100_CONFIGS}) == len(configs.H100_CONFIGS)


def test_failure_rules():
    ok = {"error": None, "local_bytes": 0, "uses_dot": True, "hgmma": True, "hmma": True, "vector_loads": True,
          "loads_128": True}
    assert h100_report.problems(ok) == []
    assert h100_report.problems(dict(ok, local_bytes=8))
    assert h100_report.problems(dict(ok, hgmma=False))
    assert h100_report.problems(dict(ok, loads_128=False))
    assert h100_report.problems(dict(ok, error="CompilationError: x"))
    usage = h100_report._resource_usage("Function k:\nREG:80 STACK:0 SHARED:1024 LOCAL:24 CONSTANT[0]:632\n")
    assert usage["REG"] == 80 and usage["LOCAL"] == 24


@pytest.fixture(scope="module")
def full_report():
    """Every configuration compiled once for this module (the same subprocess as `gspo-kernels h100-report`)."""
    if not os.path.exists(h100_report._cuobjdump()):
        pytest.skip("triton's bundled cuobjdump is missing")
    return h100_report.static_report()


def test_h100_report_compiles_every_kernel_without_spills(full_report):
    rows = full_report
    names = {row["name"] for row in rows}
    assert any(n.startswith("logprobs_fwd") for n in names) and any(n.startswith("logprobs_bwd") for n in names)
    assert any(n.startswith("gspo_sequence") for n in names) and any(n.startswith("gspo_reduce") for n in names)
    for row in rows:
        assert row["error"] is None, row
        assert h100_report.problems(row) == [], (row["name"], h100_report.problems(row))
        assert row["local_bytes"] == 0, f"{row['name']} spills {row['local_bytes']} bytes"
        assert row["stack_bytes"] == 0 and row["stl_count"] == 0, f"{row['name']} spills to the stack"
        assert 0 < row["registers"] <= 255
        assert row["shared_bytes"] <= 227 * 1024
        if row["uses_dot"]:
            assert row["hgmma"], f"{row['name']} has no HGMMA"
        if row["vector_loads"]:
            assert row["loads_128"], f"{row['name']} has no 128-bit loads"


def test_h100_static_report_linear_kernels(full_report):
    """The batch-invariant hidden-state kernels (``linear_invariant_kernels``) in the report: every one compiles for sm_90a
    with no spill (local bytes, stack frame, STL), HGMMA in every kernel that calls ``tl.dot`` on half-precision
    operands (all the bf16 ones), and shared memory within an H100 block."""
    rows = [row for row in full_report if row["module"] == "linear_invariant_kernels"]
    assert len(rows) == 14  # forward: 3 bf16 (one soft-capped) + 1 fp32 + combine; backward: 5 bf16 + 4 fp32
    for row in rows:
        assert not row["error"], row
        assert row["local_bytes"] == 0 and row["stack_bytes"] == 0 and row["stl_count"] == 0, row
        assert row["shared_bytes"] <= 227 * 1024, row
        if "[bf16" in row["name"]:
            assert row["uses_dot"], row["name"]
        if row["uses_dot"]:
            assert row["hgmma"], row["name"]
        assert h100_report.problems(row) == [], (row["name"], h100_report.problems(row))


def test_signature_derived_from_the_kernel_arguments():
    """Pointers from ``*_ptr`` names (fp32 unless told), fp32 scalars when listed, i32 otherwise; constexprs
    from the annotation or the given values; a name the kernel does not have is an error."""
    from gspo_kernels.backends.triton import logits, sequence

    sig = h100_report.derive_signature(
        logits.logprobs_bwd_kernel,
        {"stride_v": 1, "dstride_v": 1, "BLOCK_V": 64, "VEC": 8, "DST_ALIGNED": True, "HAS_ACTIVE": True,
         "HAS_GRAD_LOGP": True, "HAS_GRAD_ENTROPY": False, "HAS_GRAD_SCALE": False, "HAS_SOFTCAP": False,
         "FAST_MATH": True},
        pointers={"logits_ptr": "bf16", "dlogits_ptr": "bf16", "labels_ptr": "i64", "active_ptr": "i1"},
        floats=["inv_temperature", "softcap"],
    )
    assert sig["logits_ptr"] == "*bf16" and sig["labels_ptr"] == "*i64" and sig["row_stats_ptr"] == "*fp32"
    assert sig["stride_b"] == "i32" and sig["inv_temperature"] == "fp32" and sig["softcap"] == "fp32"
    assert sig["stride_v"] == "constexpr" and sig["BLOCK_V"] == "constexpr"
    with pytest.raises(ValueError, match="no argument"):
        h100_report.derive_signature(sequence.gspo_reduce_kernel, {}, floats=["entropy_coeff"])
    with pytest.raises(ValueError, match="needs a value"):
        h100_report.derive_signature(sequence.gspo_reduce_kernel, {"LOSS_TYPE": 0, "HAS_NUM_ITEMS": True})
    # The sequence kernels' codes come from the config's tuples.
    from gspo_kernels.config import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES

    assert list(sequence.LEVEL_CODES) == list(IMPORTANCE_SAMPLING_LEVELS)
    assert list(sequence.LOSS_TYPE_CODES) == list(LOSS_TYPES)


def test_static_report_api_in_a_subprocess():
    """``static_report`` (the function the other kernel tests call) returns the rows of the named modules."""
    if not os.path.exists(h100_report._cuobjdump()):
        pytest.skip("triton's bundled cuobjdump is missing")
    rows = h100_report.static_report(modules=["sequence_kernels"], only="gspo_reduce")
    assert [row["name"] for row in rows] == ["gspo_reduce[dapo]"]
    assert h100_report.problems(rows[0]) == [] and rows[0]["registers"] > 0


# SASS instructions per element on the main loop's shortest path (the running max unchanged), per thread, from
# the static sm_90a report: the budget of each logits kernel, its measured count + ~10%. The kernels before
# these budgets measured, with the same method (h100_report.main_loop_stats): forward bf16 + entropy 19.88, bf16 no
# entropy 14.31, fp16 19.38, fp32 22.5; unaligned V = 50257 bf16 23.94 with 16-bit loads; backward bf16 dlogp
# 17.69, bf16 dlogp + dH 24.06 (28.75 and 16-bit loads and stores at V = 50257), fp16 17.19, fp32 22.5: every one
# of them fails its budget below.
LOGITS_BUDGETS = {
    "logprobs_fwd[bf16,active,H]": 12.0,
    "logprobs_fwd[bf16,all,noH]": 10.5,
    "logprobs_fwd[fp16,active,H]": 11.5,
    "logprobs_fwd[fp32,active,H]": 14.5,
    "logprobs_fwd[bf16,active,H,V=50257]": 12.0,
    "logprobs_fwd[fp32,active,H,V=50257]": 14.5,
    "logprobs_bwd[bf16,dlogp]": 7.5,
    "logprobs_bwd[bf16,dlogp+dH]": 9.75,
    "logprobs_bwd[fp16,dlogp]": 7.0,
    "logprobs_bwd[fp32,dlogp+dH]": 8.5,
    "logprobs_bwd[bf16,dlogp+dH,V=50257]": 9.75,
    "logprobs_bwd[fp32,dlogp+dH,V=50257]": 8.5,
    # the soft cap's tanh (a series near 0, exp2 and a division elsewhere) costs ~20-25 more
    "logprobs_fwd[bf16,active,H,softcap]": 34.5,
    "logprobs_fwd[fp32,active,H,softcap]": 35.5,
    "logprobs_bwd[bf16,dlogp+dH,softcap]": 37.5,
}


def test_logits_kernels_instruction_budget_and_vector_width(full_report):
    """The logits kernels' main loops stay within their instruction budgets, and stream with
    128-bit loads (and stores) whatever the vocabulary's alignment (V = 50257 included); the pipeline depth and
    register use are reported for every kernel."""
    rows = {row["name"]: row for row in full_report}
    assert set(LOGITS_BUDGETS) <= set(rows), set(LOGITS_BUDGETS) - set(rows)
    for name, budget in LOGITS_BUDGETS.items():
        row = rows[name]
        assert row["instr_per_elem"] is not None and 0 < row["instr_per_elem"] <= budget, (name, row["instr_per_elem"])
        assert row["load_bits"] == [128], (name, row["load_bits"])
        if name.startswith("logprobs_bwd"):
            assert row["store_bits"] == [128], (name, row["store_bits"])
    for name in ("logprobs_fwd[bf16,active,H,V=1]", "logprobs_bwd[bf16,dlogp+dH,V=1]"):
        assert h100_report.problems(rows[name]) == [] and rows[name]["loop_instr_min"]  # V = 1 compiles and runs
    for row in full_report:
        assert row["num_stages"] >= 1 and row["registers"] > 0 and "loop_instr_min" in row, row["name"]


def test_main_loop_analysis_on_a_known_listing():
    """The SASS analysis on a hand-written listing: a loop whose body has a skippable block (shortest and longest
    path), a nested trap loop after EXIT ignored, and the load / store widths of the streaming loop."""
    sass = "\n".join([
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        "        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;",  # header of the loop
        "        /*0020*/                   FADD R5, R5, R6 ;",
        "        /*0030*/              @!P0 BRA 0x60 ;",  # skips the next two (the rare rescale)
        "        /*0040*/                   FMUL R5, R5, R7 ;",
        "        /*0050*/                   FMUL R6, R6, R7 ;",
        "        /*0060*/                   STG.E.U16 desc[UR4][R8.64], R5 ;",
        "        /*0070*/               @P1 BRA 0x10 ;",  # back edge
        "        /*0080*/                   EXIT ;",
        "        /*0090*/                   BRA 0x90;",
    ])
    stats = h100_report.main_loop_stats(sass, elements_per_thread=2)
    assert (stats["loop_instr_min"], stats["loop_instr_max"]) == (5, 7)
    assert stats["instr_per_elem"] == 2.5 and stats["instr_per_elem_max"] == 3.5
    assert stats["load_bits"] == [128] and stats["store_bits"] == [16]
    assert h100_report.access_width("LDG.E.64") == 64 and h100_report.access_width("LDG.E") == 32
