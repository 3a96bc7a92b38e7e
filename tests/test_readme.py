"""The README's API example runs as written."""

import pathlib
import re

import torch


def test_readme_example_runs():
    readme = pathlib.Path(__file__).resolve().parents[1] / "README.md"
    blocks = re.findall(r"```python\n(.*?)```", readme.read_text(), re.S)
    assert blocks, "README has no python example"
    scope: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), scope)
    assert torch.isfinite(scope["loss"])
    assert scope["hidden"].grad is not None and torch.isfinite(scope["hidden"].grad).all()
    assert "clip_ratio/region_mean" in scope["metrics"]
