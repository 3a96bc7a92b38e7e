"""Importing the library, or its Megatron integration, never imports megatron-core (it is imported when a function
of the integration runs)."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_integration_does_not_import_megatron():
    code = ("import sys, gspo_kernels, gspo_kernels.integrations.megatron as gm; "
            "assert callable(gm.linear_logprobs) and callable(gm.enable); "
            "print(sorted(m for m in sys.modules if m == 'megatron' or m.startswith('megatron.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
