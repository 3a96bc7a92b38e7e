"""A CPU stand-in for the parts of flash-attn that OpenRLHF imports (tests only; see tests/stubs/README.md)."""

__version__ = "0.0.0+gspo-kernels-test-stub"
