"""Triton kernels of ``backend="triton"``, one module per op (kernel, then launcher).

Kept light on purpose: importing this package imports neither triton nor any kernel module, so that
``TRITON_INTERPRET`` can still be set first. Every op module that defines kernels exposes
``H100_CONFIGS`` (see ``gspo_kernels/h100_report.py``).
"""
