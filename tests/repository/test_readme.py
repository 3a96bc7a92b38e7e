"""Every ```python block of README.md, docs/trainer.md and docs/trl.md runs as written, on a CPU.

Each block runs on its own (a fresh namespace, as a reader pastes it into a new file) in a temporary working
directory, so nothing it writes lands in the checkout. Its line numbers are the document's, so a traceback points
at the document. A block that needs a GPU says so on its first line (``# needs a CUDA GPU``): it carries the
``gpu`` marker, so it is skipped with the reason on a machine without CUDA and runs where CUDA exists
(``gspo-kernels gpu-check --steps suite``). A block that imports a test peer (TRL, ``datasets``) is skipped with the
reason where the peer is missing (a GPU machine without it; ``make test`` installs every peer, so never there).
What is not code to run as written (a fragment that needs a process
group or a Ray worker) is a plain fenced block, not a ```python one. Some blocks get a few checks of what they
promise on top (:data:`PROMISES`).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = ("README.md", "docs/trainer.md", "docs/trl.md")
NEEDS_GPU = "# needs a CUDA GPU"
# The test peers a block may need: the module, and the imports that need it (the TRL drop-in imports trl).
PEERS = {"trl": ("trl", "gspo_kernels.integrations.trl"), "datasets": ("datasets",)}
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(document: str) -> List[Tuple[int, str]]:
    """``(line of the block's first code line, code)`` of each ```python block of ``document``."""
    text = (ROOT / document).read_text()
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in BLOCK.finditer(text)]


def _cases():
    for document in DOCUMENTS:
        for line, code in python_blocks(document):
            marks = [pytest.mark.gpu] if code.lstrip().startswith(NEEDS_GPU) else []
            yield pytest.param(document, line, code, id=f"{document}:{line}", marks=marks)


def _api_example(scope: Dict) -> None:
    assert torch.isfinite(scope["loss"])
    assert scope["hidden"].grad is not None and torch.isfinite(scope["hidden"].grad).all()
    assert scope["weight"].grad is not None and torch.isfinite(scope["weight"].grad).all()
    assert "clip_ratio/region_mean" in scope["metrics"]


def _gspo_trainer_snippet(scope: Dict) -> None:
    """The usual GSPO snippet with its import line changed: one step that moved the weights."""
    from gspo_kernels.train.tasks import ToyTokenizer
    from gspo_kernels.train.toy_trainer import build_policy

    assert scope["trainer"].step == 1
    assert scope["config"].loss_config().epsilon_low == 0.002 and scope["config"].group_size == 4
    start = build_policy("dense", ToyTokenizer(), hidden_size=64)  # the block's model before its step
    assert any(not torch.equal(a, b) for a, b in zip(start.parameters(), scope["model"].parameters()))


def _own_model(scope: Dict) -> None:
    """The model came from the folder, and a step ran on it."""
    assert scope["model"].name_or_path == scope["model_dir"]
    assert scope["trainer"].step == 1 and math.isfinite(scope["metrics"]["loss"])


def _trl_drop_in(scope: Dict) -> None:
    assert scope["trainer"].state.global_step == scope["args"].max_steps


# A block holding the key gets the check, on top of running without an error.
PROMISES: Dict[str, Callable[[Dict], None]] = {
    "gk.fused_linear_gspo_loss(hidden, weight, labels, advantages, old": _api_example,
    "GSPOTrainerConfig as GSPOConfig  # the only changed line": _gspo_trainer_snippet,
    "AutoModelForCausalLM.from_pretrained(model_dir": _own_model,
    "from gspo_kernels.integrations.trl import GRPOTrainer  # the only change": _trl_drop_in,
}


def test_every_document_has_python_blocks_and_the_promised_ones_are_there():
    blocks = {document: python_blocks(document) for document in DOCUMENTS}
    assert all(blocks.values()), {d: len(b) for d, b in blocks.items()}
    codes = [code for found in blocks.values() for _, code in found]
    for key in PROMISES:
        assert any(key in code for code in codes), f"no python block holds {key!r}"
    readme = blocks["README.md"]
    assert readme[0][0] <= 60, "the quick start's example is not within the README's first 60 lines"
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 350, f"README.md has {lines} lines: move detail to docs/ (a newcomer scans it top to bottom)"


@pytest.mark.parametrize("document, line, code", list(_cases()))
def test_python_block_runs_as_written(document, line, code, tmp_path, monkeypatch):
    for peer, modules in PEERS.items():
        if any(re.search(rf"^\s*(from|import) {re.escape(m)}\b", code, re.M) for m in modules):
            pytest.importorskip(peer, reason=f"the block imports {peer}, a test peer not installed here")
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is several times faster on a busy machine, same results
    scope: Dict = {"__name__": "__main__"}
    try:
        exec(compile("\n" * (line - 1) + code, str(ROOT / document), "exec"), scope)
    finally:
        torch.set_num_threads(threads)
    for key, check in PROMISES.items():
        if key in code:
            check(scope)
