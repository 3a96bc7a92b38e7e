"""``gspo-kernels bench``'s compiled rows: an implementation's step under ``torch.compile``, beside its eager row.

``<name>-compiled`` is ``bench``'s implementation ``<name>`` (ours on each backend, and plain PyTorch) with its
step (forward; the backward through AOTAutograd) compiled by :data:`COMPILE_BACKEND` (Inductor), whole
(``fullgraph=True``) and for the case's shape (``dynamic=False``). The warm-up step compiles; the timed steps run
the compiled code. :func:`print_compiled` sets each compiled row beside its eager one and plain PyTorch's compiled
row: ``compiled / eager`` and ``x plain compiled``.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

SUFFIX = "-compiled"
# the implementations bench runs compiled, per path (each is bench's implementation without the suffix)
COMPILED: Dict[str, Tuple[str, ...]] = {
    "linear": ("gspo-cpu", "gspo-torch", "gspo-triton", "plain-torch"),
    "logits": ("gspo-cpu", "gspo-torch", "gspo-triton", "plain-torch"),
}
PLAIN = "plain-torch"
COMPILE_BACKEND = "inductor"  # torch.compile's default; the tests put a cheaper one here


def with_compiled(impls: Dict[str, Tuple[str, ...]]) -> Dict[str, Tuple[str, ...]]:
    """``bench``'s implementations per path followed by the compiled ones."""
    return {path: names + tuple(n + SUFFIX for n in COMPILED.get(path, ())) for path, names in impls.items()}


def compiled_step(name: str, case: Dict, inputs: Dict, build: Callable) -> Tuple[Callable, List]:
    """``(step, leaves)`` of ``name`` (``<impl>-compiled``): ``build(<impl>, case, inputs)``'s step compiled.

    Raises ``ValueError`` for a name that is not a compiled implementation of the case's path; ``build``'s ``Skip``
    passes through (an unavailable backend is skipped compiled as eager)."""
    import torch

    base = name[: -len(SUFFIX)] if name.endswith(SUFFIX) else None
    if base not in COMPILED.get(case["path"], ()):
        raise ValueError(f"{name!r} is not a compiled implementation of the {case['path']} path "
                         f"(known: {[n + SUFFIX for n in COMPILED.get(case['path'], ())]})")
    step, leaves = build(base, case, inputs)
    if base.startswith("gspo-"):  # a backend is loaded at its first use, which Dynamo cannot trace: load it first
        import gspo_kernels

        gspo_kernels.available_backends(inputs["labels"].device)
    return torch.compile(step, backend=COMPILE_BACKEND, fullgraph=True, dynamic=False), leaves


def compiled_ratios(results: List[Dict]) -> List[Dict]:
    """One record per compiled row that ran: ``case``, ``impl``, ``eager_ms`` / ``compiled_ms`` (median totals),
    ``compiled_over_eager``, ``over_plain_compiled`` and ``eager_over_plain_compiled`` (the eager row against plain
    PyTorch compiled; None where a row it needs did not run)."""
    ok = {(r["case"], r["impl"]): r for r in results if r.get("status") == "ok"}
    out = []
    for r in results:
        if r.get("status") != "ok" or not r["impl"].endswith(SUFFIX):
            continue
        eager = ok.get((r["case"], r["impl"][: -len(SUFFIX)]))
        plain = ok.get((r["case"], PLAIN + SUFFIX))
        out.append(dict(case=r["case"], impl=r["impl"], compiled_ms=r["total_ms"],
                        eager_ms=eager["total_ms"] if eager else None,
                        compiled_over_eager=r["total_ms"] / eager["total_ms"] if eager else None,
                        over_plain_compiled=r["total_ms"] / plain["total_ms"] if plain else None,
                        eager_over_plain_compiled=eager["total_ms"] / plain["total_ms"] if eager and plain else None))
    return out


def print_compiled(results: List[Dict]) -> None:
    """The compiled rows beside their eager ones and plain PyTorch compiled (nothing when none ran)."""
    rows = compiled_ratios(results)
    if not rows:
        return
    print(f"\ncompiled (torch.compile backend={COMPILE_BACKEND!r}, fullgraph, static shapes; the warm-up compiles): "
          f"median total ms")
    print(f"  {'case':<22} {'implementation':<22} {'eager':>8} {'compiled':>9} {'comp/eager':>10} {'x plain comp':>12} "
          f"{'eager x plain comp':>18}")

    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    for r in rows:
        print(f"  {r['case']:<22} {r['impl']:<22} {fmt(r['eager_ms'], '8.0f'):>8} {r['compiled_ms']:9.0f} "
              f"{fmt(r['compiled_over_eager'], '.2f'):>10} {fmt(r['over_plain_compiled'], '.2f'):>12} "
              f"{fmt(r['eager_over_plain_compiled'], '.2f'):>18}")
