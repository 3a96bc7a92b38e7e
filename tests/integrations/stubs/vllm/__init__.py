"""A stand-in for the names OpenRLHF's trainer modules import from vLLM at module level (tests only; see
tests/integrations/stubs/README.md). Using any of them fails: the tests never generate."""

__version__ = "0.0.0+gspo-kernels-test-stub"


def _unavailable(*args, **kwargs):
    raise RuntimeError("vLLM is a test stand-in here (tests/integrations/stubs/vllm): it cannot generate")
