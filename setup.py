"""megalite: a Megatron-style 3D-parallel training framework in PyTorch and Triton.

`kernels/` (one Triton op per file) and `tools/` sit at the top of the repository but are installed
as `megalite.kernels` and `megalite.tools`: a top-level module called `kernels` would clash with
another package that `transformers` imports, and `tools` is a name many packages use.
"""
from setuptools import find_packages, setup

# megalite and every subpackage found under it, plus the top-level kernels/ and tools/ mapped into it
# (tools/ as megalite.tools, so the console scripts below can import them once installed).
PACKAGES = ["megalite"] + [f"megalite.{p}" for p in find_packages("megalite")] + ["megalite.kernels", "megalite.tools"]

# each optional dependency behind the extra named in megalite/extras.py's one-line refusals
EXTRAS = {
    "hf": ["transformers", "tokenizers", "safetensors"],  # --tokenizer FILE, from_hf, convert_checkpoint
    "tensorboard": ["tensorboard"],  # --tensorboard-dir
    "wandb": ["wandb"],  # --wandb-project
    "plot": ["matplotlib"],  # tools/plot_*.py, plan.py --plot
    "parquet": ["pyarrow"],  # preprocess_data.py on .parquet files
    "liger": ["liger-kernel"],  # tools/bench_kernels.py's optional Liger-Kernel column
    "sentencepiece": ["sentencepiece"],  # --tokenizer-type SentencePieceTokenizer (a .model file)
    "tiktoken": ["tiktoken"],  # --tokenizer-type TikTokenizer
}
# dev: what the tests use (Liger-Kernel only benchmarks on a GPU: not installed for them)
EXTRAS["dev"] = sorted({"pytest", *[p for name, extra in EXTRAS.items() if name != "liger" for p in extra]})

setup(
    name="megalite",
    version="0.1.0",
    description="Megatron-style tensor x pipeline x data parallel training in PyTorch and Triton",
    license="Apache-2.0",
    python_requires=">=3.11",  # tomllib and enum.StrEnum
    packages=PACKAGES,
    package_dir={"megalite.kernels": "kernels", "megalite.tools": "tools"},
    install_requires=[
        "torch>=2.4",
        "triton; platform_system == 'Linux'",
        "numpy",
    ],
    extras_require=EXTRAS,
    entry_points={"console_scripts": [
        "megalite-train = megalite.commands:main",
        "megalite-plan = megalite.tools.plan:main",
        "megalite-convert = megalite.tools.convert_checkpoint:main",
        "megalite-preprocess = megalite.tools.preprocess_data:main",
        "megalite-generate = megalite.tools.generate:main",
    ]},
)
