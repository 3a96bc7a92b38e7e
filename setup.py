"""Build and install gspo_kernels; compiles the C++ CPU backend in csrc/ as a torch extension."""

import glob
import os
import sys

from setuptools import find_packages, setup


# No -ffast-math: its reciprocal approximations and reassociation change results (a logit scaled by
# 1/temperature = 1e6 must round the same way everywhere). -ffp-contract=off: no implicit FMA, so
# one expression gives the same bits wherever it is written (the code uses std::fma explicitly
# where it wants one). -fno-math-errno / -fno-trapping-math let GCC vectorize floor and selects.
CXX_FLAGS = ["-O3", "-g0", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"]


def _extensions():
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    if not sources or os.environ.get("GSPO_KERNELS_NO_EXT") == "1":
        return [], {}
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    openmp = [] if sys.platform == "darwin" else ["-fopenmp"]
    ext = CppExtension(
        name="gspo_kernels.backends._C",
        sources=sources,
        extra_compile_args={"cxx": [*CXX_FLAGS, *openmp]},
        extra_link_args=openmp,
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=False)}


ext_modules, cmdclass = _extensions()

setup(
    name="gspo_kernels",
    version="0.2.0",
    description="Fused kernels for the GSPO / GRPO reinforcement-learning loss",
    long_description=open("README.md").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["gspo_kernels", "gspo_kernels.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "numpy",
        "transformers",
        "triton; platform_system == 'Linux'",
    ],
    extras_require={
        "test": ["pytest", "pytest-benchmark", "ruff"],
        "peers": ["trl", "liger-kernel", "cut-cross-entropy"],
        "plot": ["matplotlib"],
        "gpu": ["flash-attn"],
    },
    entry_points={"console_scripts": ["gspo-kernels=gspo_kernels.tools.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
