"""The progress of a run (``tools/progress.py``, ``gspo-kernels bench``): a tqdm bar on a terminal, one plain line
per step in a log or a pipe, never carriage-return frames there."""

from __future__ import annotations

import io
import sys

from gspo_kernels.tools import bench, cli
from gspo_kernels.tools.progress import track


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_captured_output_gets_one_line_per_step_and_no_carriage_return():
    stream = io.StringIO()  # not a terminal
    items = ["a", "b", "c"]
    seen = list(track(items, lambda x: f"step {x}", stream=stream))
    assert seen == items
    text = stream.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == len(items) + 1, lines  # one as each step starts, one when the last has ended
    assert [line.split()[0] for line in lines[:-1]] == ["[1/3]", "[2/3]", "[3/3]"]
    assert [line.endswith(f"step {x}") for x, line in zip(items, lines)] == [True] * 3
    assert lines[-1].startswith("done: 3 steps in ")


def test_a_terminal_gets_tqdm_bar():
    import tqdm  # noqa: F401  (installed with the tests: the Makefile's install step)

    stream = _Terminal()
    assert list(track([1, 2], lambda x: f"step {x}", stream=stream)) == [1, 2]
    text = stream.getvalue()
    assert "\r" in text and "2/2" in text and "step 2" in text


def test_a_terminal_without_tqdm_gets_plain_lines(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm raises ImportError
    stream = _Terminal()
    assert list(track([1, 2], str, stream=stream)) == [1, 2]
    text = stream.getvalue()
    assert "\r" not in text and len(text.splitlines()) == 3


def test_bench_progress_in_a_log_is_one_line_per_implementation(tmp_path, monkeypatch, capsys):
    """``bench`` with its stderr captured (as in a CI log): a line per (case, implementation) run, no frames."""
    monkeypatch.setattr(bench, "run_one", lambda impl, *a, **k: dict(status="skipped", reason=f"{impl} not run"))
    impls = ["plain-torch", "gspo-torch"]
    rc = cli.main(["bench", "--quick", "--device", "cpu", "--cases", "logits", "linear", "--impls", *impls,
                   "--out", str(tmp_path / "b")])
    assert rc == 0
    err = capsys.readouterr().err
    assert "\r" not in err
    steps = [line for line in err.splitlines() if line.startswith("[")]
    expected = ["linear / gspo-torch", "linear / plain-torch", "logits / gspo-torch", "logits / plain-torch"]
    assert len(steps) == len(expected) and all(line.endswith(job) for line, job in zip(steps, expected)), steps
    assert err.splitlines()[-1].startswith("done: 4 steps")
