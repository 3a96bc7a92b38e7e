"""``vllm.utils`` stand-in (tests only)."""

from vllm import _unavailable as random_uuid  # noqa: F401
