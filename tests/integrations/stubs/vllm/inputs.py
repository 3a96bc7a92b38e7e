"""``vllm.inputs`` stand-in (tests only)."""

from vllm import _unavailable as TokensPrompt  # noqa: F401
