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
    assert {name.split(".")[0] for name in seen} == {"logits", "linear", "sequence"}
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


def test_h100_report_compiles_every_kernel_without_spills():
    if not os.path.exists(h100_report._cuobjdump()):
        pytest.skip("triton's bundled cuobjdump is missing")
    rows = h100_report.static_report()  # the same subprocess as `gspo-kernels h100-report`
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


def test_signature_derived_from_the_kernel_arguments():
    """Pointers from ``*_ptr`` names (fp32 unless told), fp32 scalars when listed, i32 otherwise; constexprs
    from the annotation or the given values; a name the kernel does not have is an error."""
    from gspo_kernels.backends.triton import logits, sequence

    sig = h100_report.derive_signature(
        logits.logprobs_bwd_kernel,
        {"stride_v": 1, "dstride_v": 1, "BLOCK_V": 64, "HAS_ACTIVE": True, "HAS_GRAD_LOGP": True,
         "HAS_GRAD_ENTROPY": False},
        pointers={"logits_ptr": "bf16", "dlogits_ptr": "bf16", "labels_ptr": "i64", "active_ptr": "i1"},
        floats=["inv_temperature"],
    )
    assert sig["logits_ptr"] == "*bf16" and sig["labels_ptr"] == "*i64" and sig["row_stats_ptr"] == "*fp32"
    assert sig["stride_b"] == "i32" and sig["inv_temperature"] == "fp32"
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
    rows = h100_report.static_report(modules=["sequence"], only="gspo_reduce")
    assert [row["name"] for row in rows] == ["gspo_reduce[dapo]"]
    assert h100_report.problems(rows[0]) == [] and rows[0]["registers"] > 0
