"""What the OpenRLHF tests share: importing OpenRLHF on a CPU machine (the stand-ins of ``tests/integrations/stubs`` on
``sys.path`` for the test's duration only), a tiny causal LM built in the test, and a subprocess environment that
imports OpenRLHF the same way."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import torch

STUBS = str(Path(__file__).parent / "stubs")


@contextlib.contextmanager
def openrlhf_importable():
    """``tests/integrations/stubs`` at the end of ``sys.path`` (an installed flash-attn / vLLM comes first), and afterwards gone
    again, with the stand-in modules dropped from ``sys.modules`` so that no other test sees them."""
    added = STUBS not in sys.path
    if added:
        sys.path.append(STUBS)
    try:
        yield
    finally:
        if added:
            sys.path.remove(STUBS)
        for name, module in list(sys.modules.items()):
            if (getattr(module, "__file__", None) or "").startswith(STUBS):
                del sys.modules[name]


def subprocess_env() -> dict:
    """The environment of a subprocess that imports OpenRLHF: this tree first, the stand-ins last on its path."""
    root = str(Path(__file__).parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p], STUBS])
    return env


def tiny_causal_lm(vocab: int = 101, hidden: int = 32, layers: int = 2, dtype=torch.float32, **config):
    """A two-layer Qwen2 causal LM with random weights (untied lm_head unless asked), in ``dtype``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=config.pop("tie_word_embeddings", False), attn_implementation="sdpa",
                      **config)
    model = Qwen2ForCausalLM(cfg).to(dtype)
    with torch.no_grad():  # logits of a realistic spread (a few nats), not the near-uniform ones of a fresh init
        model.lm_head.weight.normal_(0.0, 2.0 / hidden ** 0.5)
    return model
