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
