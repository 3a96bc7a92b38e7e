"""The build's one addition to ``pyproject.toml`` (which holds all the metadata): the C++ sources live in the
checkout's top-level ``csrc/`` and travel in the wheel as ``gspo_kernels/csrc`` (package data; the wheel stays
pure Python, the kernels are compiled on the user's machine at first use: docs/install.md)."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["gspo_kernels", "gspo_kernels.*"]) + ["gspo_kernels.csrc"],
    package_dir={"gspo_kernels.csrc": "csrc"},
    package_data={"gspo_kernels.csrc": ["*.cpp", "*.h"]},
)
