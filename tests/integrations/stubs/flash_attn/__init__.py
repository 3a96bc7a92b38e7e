"""A CPU stand-in for the parts of flash-attn that OpenRLHF imports (tests only; see the README.md above)."""

__version__ = "0.0.0+gspo-kernels-test-stub"
