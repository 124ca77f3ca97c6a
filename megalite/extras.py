"""The optional dependencies, each behind the pip extra that installs it, imported in one place.

    SummaryWriter = require("tensorboard", "--tensorboard-dir").SummaryWriter

A flag that needs an optional package asks for it here; without the package the run stops with one
line naming the flag and the extra that installs it (`pip install 'megalite[tensorboard]'`), exit
code 2, instead of a traceback or a silent skip. setup.py's extras_require lists the same extras.
"""
from __future__ import annotations

import importlib
import re
from types import ModuleType

from megalite.errors import UsageError

# module to import -> (the extra that installs it, what pip would install)
EXTRAS: dict[str, tuple[str, str]] = {
    "transformers": ("hf", "transformers"),
    "tokenizers": ("hf", "tokenizers"),
    "safetensors": ("hf", "safetensors"),
    "safetensors.torch": ("hf", "safetensors"),
    "tensorboard": ("tensorboard", "tensorboard"),
    "torch.utils.tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "matplotlib": ("plot", "matplotlib"),
    "matplotlib.pyplot": ("plot", "matplotlib"),
    "pyarrow": ("parquet", "pyarrow"),
    "pyarrow.parquet": ("parquet", "pyarrow"),
    "sentencepiece": ("sentencepiece", "sentencepiece"),
    "tiktoken": ("tiktoken", "tiktoken"),
}


class MissingExtraError(UsageError, ImportError):
    """A flag needs an optional package that is not installed."""


def require(module: str, wanted_by: str) -> ModuleType:
    """`module` imported, or MissingExtraError (one line, exit 2) naming `wanted_by` (the flag or
    tool that needs it) and the pip extra that installs it."""
    extra, package = EXTRAS[module]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(
            f"{wanted_by} needs {package} ({exc.name or module} is not installed): "
            f"pip install 'megalite[{extra}]' (or pip install {package})") from None


def available(module: str) -> bool:
    """Whether `module` imports (for tests and tools that skip what they cannot draw)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def pyplot(wanted_by: str):
    """matplotlib.pyplot on the file-only Agg backend (no display needed), or MissingExtraError
    naming `wanted_by` and the [plot] extra. PNG or SVG follows the output file's suffix."""
    matplotlib = require("matplotlib", wanted_by)
    matplotlib.use("Agg")
    return require("matplotlib.pyplot", wanted_by)


_SKIPPED_IMPORT = re.compile(r"could not import '([\w.]+)'")  # pytest.importorskip's skip reason


def extras_behind_skips(reasons: list[str]) -> dict[str, set[str]]:
    """{extra: the modules of it} behind skip reasons of pytest.importorskip ("could not import
    'transformers': ..."), for the test suite's report of what a missing extra left untested;
    a module no extra installs is listed under "" (a plain dependency, or a typo in the test)."""
    found: dict[str, set[str]] = {}
    for reason in reasons:
        match = _SKIPPED_IMPORT.search(reason)
        if match:
            module = match.group(1)
            extra = EXTRAS.get(module, EXTRAS.get(module.split(".")[0], ("", module)))[0]
            found.setdefault(extra, set()).add(module)
    return found
