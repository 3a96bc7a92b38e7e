"""Plant plausible bugs in a copy of the code, one at a time, and report which tests catch each. Not part of CI.

    PYTHONPATH=$PWD python benchmarks/planted_bugs.py                       # every bug below, each its own tests
    python benchmarks/planted_bugs.py --bugs gmpo-idx-le-end,sapo-gate-flip --workers 2
    python benchmarks/planted_bugs.py --tests-ref HEAD~5                    # the same bugs against older tests/
    python benchmarks/planted_bugs.py --list

A test *catches* a bug when it fails on an assertion (``AssertionError``: a compared value, a checked property, or
the guarded interpreter's bounds check, ``gspo_kernels.testing.guard_interpreter_launches``; also a failed
``torch.autograd.gradcheck``, which raises its own ``GradcheckError``). A test that fails
with any other exception *crashed*: that is not a catch (the exception may be the bug's symptom or an accident of
it). Before the bugs, the same selection runs on the unmodified copy: a test failing there makes the row
meaningless, and the report says so.

Each run: the repository's files (tracked and untracked, not ignored: ``git ls-files``) copied to a temporary
directory (with ``--tests-ref``, ``tests/`` from that commit instead), the bug's snippets replaced (each must occur
exactly once in its file), then ``pytest`` on the bug's test files with ``-k`` its backend, in that copy
(``PYTHONPATH`` = the copy; a bug in ``csrc/`` builds its own C++ extension in a cache of its own), with a JUnit
report. Output: a Markdown table (``--out``; the last one is in docs/testing.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
# The test files the bugs run against (the parity matrix, the objectives, the one-pass plan, the peers).
CORE = ("tests/test_conformance.py", "tests/objectives/test_objectives.py", "tests/test_softcap.py", "tests/test_policy_loss.py",
        "tests/backends/triton/test_one_pass_plan.py", "tests/test_liger_and_cce_parity.py")


@dataclass(frozen=True)
class Bug:
    name: str
    what: str
    path: str
    edits: Tuple[Tuple[str, str], ...]  # (old snippet, new snippet), each old occurring once in ``path``
    k: str  # pytest -k: the tests of the backends the bug can reach
    files: Tuple[str, ...] = CORE
    extra_env: Dict[str, str] = field(default_factory=dict)


SEQ = "gspo_kernels/backends/triton/sequence_kernels.py"
BUGS = (
    Bug("triton-sequence-level-unclipped",
        "Triton sequence stage: the surrogate at the sequence level gets no clip band (GSPO's clip lost)",
        SEQ,
        (("    high_edge = 1.0 + eps_high\n    if not ADV_PER_TOKEN:",
          "    high_edge = 1.0 + eps_high\n    clip_lo = low_edge\n    clip_hi = high_edge\n"
          "    if LEVEL == LEVEL_SEQUENCE:\n        clip_lo = 0.0\n        clip_hi = float(\"inf\")\n"
          "    if not ADV_PER_TOKEN:"),
         ("            w, adv, lp, old_ptr, idx, inside, on, low_edge, high_edge, eps_low, eps_high, delta,",
          "            w, adv, lp, old_ptr, idx, inside, on, clip_lo, clip_hi, eps_low, eps_high, delta,")),
        k="triton"),
    Bug("one-pass-chunks-at-offset-0",
        "Triton one-pass hidden-state loss: every chunk's dZ rows stored at token offset 0 (dH of later chunks "
        "lands on the first rows)",
        "gspo_kernels/backends/triton/linear_loss.py",
        (("store.backward(z=z[:k], index=None if order is None else order[:k] + t0, t0=t0,",
          "store.backward(z=z[:k], index=None if order is None else order[:k], t0=0,"),),
        k="triton"),
    Bug("gmpo-idx-le-end",
        "GMPO's Triton gradient pass treats idx <= end as inside: one write past each response's end",
        "gspo_kernels/backends/triton/objectives/gmpo.py",
        (("        idx = t0 + offs\n        inside = idx < end\n        on = tl.load(mask_ptr + idx, mask=inside",
          "        idx = t0 + offs\n        inside = idx <= end\n        on = tl.load(mask_ptr + idx, mask=inside"),),
        k="triton and gmpo"),
    Bug("logits-backward-one-column-past-row",
        "Triton logits backward: the edge tile's store mask lets one column past the row through",
        "gspo_kernels/backends/triton/logits.py",
        (("grad.to(out_ty), mask=inside)", "grad.to(out_ty), mask=inside | (e0 + cols == n_edge))"),),
        k="triton"),
    Bug("sapo-gate-flip",
        "SAPO's Triton helper: the gate temperatures swapped (tau_pos for A < 0)",
        "gspo_kernels/backends/triton/objectives/sapo.py",
        (("tau = tl.where(adv > 0, tau_pos, tau_neg)", "tau = tl.where(adv < 0, tau_pos, tau_neg)"),),
        k="triton and sapo"),
    Bug("triton-masked-tokens-counted",
        "Triton sequence stage: a response's token count includes its masked tokens (the mean log-ratio, the token "
        "means)",
        SEQ,
        (("        tok_acc += token_mask\n", "        tok_acc += tl.where(inside, 1.0, 0.0)\n"),),
        k="triton"),
    Bug("triton-kl-bias-correction-unweighted",
        "Triton sequence stage: the bias-corrected KL added to the loss without its importance weight",
        SEQ,
        (("        return kl, _times(kl, w), _times(beta * (1.0 - ed), w)",
          "        return kl, kl, _times(beta * (1.0 - ed), w)"),),
        k="triton"),
    Bug("torch-online-entropy-rescale",
        "torch backend, hidden-state tiles: the running entropy sum rescaled without its shift term when a later "
        "vocabulary tile raises the max",
        "gspo_kernels/backends/torch/linear.py",
        (("self.a = scale * (self.a + shift * self.s) + a_tile", "self.a = scale * self.a + a_tile"),),
        k="(torch or liger) and not triton", files=CORE + ("tests/backends/torch/test_torch_backend.py",)),
    Bug("cpu-online-entropy-rescale",
        "C++ CPU kernels: the running entropy sum rescaled without its shift term when a later vocabulary tile "
        "raises the max",
        "csrc/gspo_cpu.h",
        (("a = c * (a + shift * s);", "a = c * a;"),),
        k="cpu and not triton", files=CORE + ("tests/backends/cpu/test_cpu_backend.py",)),
    Bug("dual-clip-wrong-sign",
        "PyTorch stage (torch and cpu backends): the dual clip tested on A > 0 (where it never binds) instead of A < 0",
        "gspo_kernels/objectives/clipped.py",
        (("per_token = torch.where(A_live < 0, torch.minimum(per_token, -config.clip_ratio_c * A_live), per_token)",
          "per_token = torch.where(A_live > 0, torch.minimum(per_token, -config.clip_ratio_c * A_live), per_token)"),),
        k="not triton and not cpu"),
    Bug("rollout-sequence-ratio-geometric-mean",
        "PyTorch stage: the sequence rollout modes take the geometric mean of the token ratios (verl's convention) "
        "instead of their product (TRL's)",
        "gspo_kernels/objectives/stage.py",
        (("        stat = torch.exp(segment_sum(d, seq, S))\n",
          "        stat = torch.exp(segment_sum(d, seq, S) / lengths.clamp(min=1))\n"),),
        k="not triton"),
)


def copy_tree(dest: Path, tests_ref: Optional[str]) -> None:
    """The repository's tracked and untracked, not ignored files under ``dest`` (``tests/`` from ``tests_ref``)."""
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-co", "--exclude-standard"], check=True,
                            capture_output=True, text=True).stdout.split("\n")
    for rel in filter(None, listed):
        src = ROOT / rel
        if not src.is_file() or (tests_ref and rel.startswith("tests/")):
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)
    if tests_ref:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", tests_ref, "tests"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)


def plant(dest: Path, bug: Bug) -> None:
    path = dest / bug.path
    text = path.read_text()
    for old, new in bug.edits:
        count = text.count(old)
        if count != 1:
            raise SystemExit(f"{bug.name}: the snippet occurs {count} times in {bug.path} (must be once): {old!r}")
        text = text.replace(old, new)
    path.write_text(text)


def classify(junit: Path) -> Dict[str, List[str]]:
    """``{"passed", "caught", "bounds", "crashed", "skipped"}`` -> test ids, from a JUnit report (``bounds``: the
    catches by the guarded interpreter's bounds check, also in ``caught``)."""
    out: Dict[str, List[str]] = {"passed": [], "caught": [], "bounds": [], "crashed": [], "skipped": []}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        failure = case.find("failure")
        error = case.find("error")
        if failure is not None:
            message = (failure.get("message") or "").lstrip()
            # an assertion, or a failed torch.autograd.gradcheck (a check that raises its own error type)
            assertion = message.startswith(("AssertionError", "assert ")) or "GradcheckError" in message[:60]
            out["caught" if assertion else "crashed"].append(name + ("" if assertion else f"  [{message[:80]}]"))
            if assertion and "outside every tensor argument" in message:
                out["bounds"].append(name)
        elif error is not None:
            out["crashed"].append(f"{name}  [{(error.get('message') or '')[:80]}]")
        elif case.find("skipped") is not None:
            out["skipped"].append(name)
        else:
            out["passed"].append(name)
    return out


def run_tests(dest: Path, files: Sequence[str], k: str, workers: int, env_extra: Dict[str, str],
              timeout_s: int) -> Tuple[Dict[str, List[str]], float]:
    junit = dest / "junit.xml"
    files = [f for f in files if (dest / f).exists()]  # an older tests/ may lack some
    cmd = [sys.executable, "-m", "pytest", *files, "-k", k, "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
           "-o", "junit_family=xunit1"]
    if workers > 1:
        cmd += ["-n", str(workers)]
    env = {**os.environ, **env_extra}
    # the copy on the path (after any PYTHONPATH given with --env, e.g. another triton's install directory)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (env_extra.get("PYTHONPATH"), str(dest))))
    start = time.monotonic()
    subprocess.run(cmd, cwd=dest, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout_s)
    return classify(junit), time.monotonic() - start


def table(rows: List[Tuple[Bug, Dict[str, List[str]], float]], baseline: Dict[Tuple, Dict[str, List[str]]],
          tests_ref: Optional[str], env: Dict[str, str]) -> str:
    env_note = "".join(f"; `{k}={v}`" for k, v in env.items())
    lines = [f"Tests: {'tests/ of ' + tests_ref if tests_ref else 'this tree'}; each bug runs its `-k` selection of "
             f"{', '.join(f'`{f}`' for f in CORE)} (and of its backend's own test file where the row names one)"
             f"{env_note}.", "",
             "| bug | what | `-k` | tests run | caught (assertion) | of which the bounds check | crashed | first catches |",
             "|---|---|---|---|---|---|---|---|"]
    for bug, result, seconds in rows:
        what = bug.what.replace("|", "\\|")
        ran = sum(len(result[key]) for key in ("passed", "caught", "crashed"))
        first = "<br>".join(f"`{t}`" for t in result["caught"][:3]) or "**none**"
        clean = baseline.get((bug.files, bug.k), {})
        broken = clean.get("caught", []) + clean.get("crashed", [])
        note = f" (baseline failures: {len(broken)})" if broken else ""
        own = "".join(f" + `{f.split('/')[-1]}`" for f in bug.files if f not in CORE)
        lines.append(f"| `{bug.name}` | {what} | `{bug.k}`{own} | {ran} ({seconds:.0f} s) | {len(result['caught'])}"
                     f"{note} | {len(result['bounds'])} | {len(result['crashed'])} | {first} |")
    crashes = [(bug.name, t) for bug, result, _ in rows for t in result["crashed"]]
    if crashes:
        lines += ["", "Crashed (not counted as catches):", ""] + [f"- `{name}`: `{test}`" for name, test in crashes]
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bugs", default=None, help="comma-separated names (default: all; --list shows them)")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--tests-ref", default=None, help="take tests/ from this git commit instead of the tree")
    parser.add_argument("--workers", type=int, default=1, help="pytest-xdist workers per run")
    parser.add_argument("--timeout-s", type=int, default=3600, help="per pytest run")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmodified runs")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="set in the tests' environment, e.g. GSPO_TEST_OUT_OF_BOUNDS=ignore (what the values "
                             "alone catch) or GSPO_TEST_PROGRAM_ORDER=forward (the plain interpreter's order)")
    parser.add_argument("--out", default=None, help="write the Markdown table here (default: stdout)")
    parser.add_argument("--verbose", action="store_true", help="print every catching test (stderr)")
    args = parser.parse_args(argv)
    if args.list:
        for bug in BUGS:
            print(f"{bug.name:40s} {bug.path}: {bug.what}")
        return 0
    chosen = [b for b in BUGS if args.bugs is None or b.name in args.bugs.split(",")]
    unknown = set(args.bugs.split(",")) - {b.name for b in BUGS} if args.bugs else set()
    if unknown:
        raise SystemExit(f"unknown bugs: {sorted(unknown)} (--list)")
    extra = dict(item.split("=", 1) for item in args.env)
    baseline: Dict[Tuple, Dict[str, List[str]]] = {}
    rows = []
    with tempfile.TemporaryDirectory(prefix="planted_bugs_") as tmp:
        if not args.no_baseline:
            clean = Path(tmp) / "clean"
            copy_tree(clean, args.tests_ref)
            for files, k in dict.fromkeys((b.files, b.k) for b in chosen):
                result, seconds = run_tests(clean, files, k, args.workers, extra, args.timeout_s)
                baseline[(files, k)] = result
                print(f"baseline -k {k!r} ({len(files)} files): {len(result['passed'])} passed, "
                      f"{len(result['caught'])} failed on an assertion, {len(result['crashed'])} crashed "
                      f"({seconds:.0f} s)", file=sys.stderr)
        for bug in chosen:
            dest = Path(tmp) / bug.name
            copy_tree(dest, args.tests_ref)
            plant(dest, bug)
            env = {**extra, **bug.extra_env}
            if bug.path.startswith("csrc/"):
                env["GSPO_KERNELS_CACHE"] = str(Path(tmp) / "cache")  # its own build, not the user's cache
            result, seconds = run_tests(dest, bug.files, bug.k, args.workers, env, args.timeout_s)
            print(f"{bug.name}: {len(result['caught'])} caught, {len(result['crashed'])} crashed ({seconds:.0f} s)",
                  file=sys.stderr)
            if args.verbose:
                print("\n".join(f"  {t}" for t in result["caught"]), file=sys.stderr)
            rows.append((bug, result, seconds))
            shutil.rmtree(dest, ignore_errors=True)
    text = table(rows, baseline, args.tests_ref, extra)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
