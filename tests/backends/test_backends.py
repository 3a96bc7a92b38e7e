"""Backend selection: "auto" picks a backend for the device and says which one, once."""

import logging

import torch

import gspo_kernels as gk
from gspo_kernels import backends


def test_auto_logs_its_choice_once(caplog):
    backends._announced.clear()
    logits, labels = torch.randn(3, 9), torch.randint(0, 9, (3,))
    with caplog.at_level(logging.DEBUG, logger="gspo_kernels"):
        gk.token_logprobs(logits, labels)
        gk.token_logprobs(logits, labels)
    lines = [r.getMessage() for r in caplog.records if "backend 'auto'" in r.getMessage()]
    assert len(lines) == 1
    chosen = backends.resolve("auto", torch.device("cpu")).name
    assert f"runs {chosen!r}" in lines[0]
    assert chosen in backends.available("cpu")


def test_unavailable_backend_says_why():
    for name in backends.BACKENDS:
        if backends.load(name) is None:
            assert backends.unavailable_reason(name)
    assert "torch" in backends.available("cpu")


def test_a_backend_refusing_the_tensors_device_names_what_to_pass_instead(monkeypatch):
    """backend="triton" on CPU tensors (no interpreter): the error names the backends that do run there, a CUDA
    device and TRITON_INTERPRET=1 for debugging."""
    import pytest

    triton = backends.load("triton")
    if triton is None:
        pytest.skip(f"triton backend unavailable: {backends.unavailable_reason('triton')}")
    monkeypatch.setattr(triton, "_supports", lambda device: device.type == "cuda")  # as without the interpreter
    logits, labels = torch.randn(3, 9), torch.randint(0, 9, (3,))
    with pytest.raises(ValueError) as info:
        gk.token_logprobs(logits, labels, backend="triton")
    message = str(info.value)
    assert "backend 'triton' does not run on cpu tensors" in message
    for alternative in ["'auto'", *(f"'{name}'" for name in backends.available("cpu") if name != "triton"),
                        "CUDA device", "TRITON_INTERPRET=1"]:
        assert alternative in message, (alternative, message)
    assert "'torch'" in message  # the portable backend runs everywhere


def test_backends_are_registered_once():
    """One registration per backend (``backends.REGISTRY``): the names, "auto"'s order per device and the trainers'
    and the CLI's choices derive from it, and no other module of the package lists the backends' names."""
    import ast
    from pathlib import Path

    from gspo_kernels.train import hf_trainer, toy_trainer

    assert backends.BACKENDS == tuple(r.name for r in backends.REGISTRY)
    assert backends._AUTO_ORDER == {"cpu": ("cpu", "torch"), "cuda": ("triton", "torch")}
    assert set(hf_trainer.BACKENDS) == {"auto", "reference", *backends.BACKENDS}
    assert set(toy_trainer.LOSSES) == {"auto", "reference", *backends.BACKENDS}
    package = Path(gk.__file__).parent
    listed = []
    for path in package.rglob("*.py"):
        if path == package / "backends" / "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                strings = {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
                # a list of backends: two or more of their names and nothing but backend choices
                if len(strings & set(backends.BACKENDS)) >= 2 and strings <= {"auto", "reference", *backends.BACKENDS}:
                    listed.append(f"{path.relative_to(package)}:{node.lineno}")
    assert not listed, f"the backends' names listed outside backends/__init__.py: {listed}"
