"""megalite: a Megatron-style 3D-parallel training framework in PyTorch and Triton.

`kernels/` sits at the top of the repository (one Triton op per file) but is installed as
`megalite.kernels`: a top-level module called `kernels` would clash with another package
that `transformers` imports.
"""
from setuptools import find_packages, setup

# megalite and every subpackage found under it, plus the top-level kernels/ mapped into it.
PACKAGES = ["megalite"] + [f"megalite.{p}" for p in find_packages("megalite")] + ["megalite.kernels"]

setup(
    name="megalite",
    version="0.1.0",
    description="Megatron-style tensor x pipeline x data parallel training in PyTorch and Triton",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=PACKAGES,
    package_dir={"megalite.kernels": "kernels"},
    install_requires=[
        "torch>=2.4",
        "triton; platform_system == 'Linux'",
        "einops",
        "numpy",
    ],
    extras_require={"dev": ["pytest", "transformers"]},
)
