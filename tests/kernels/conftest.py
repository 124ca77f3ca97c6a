"""Run the Triton kernels themselves: compiled on a GPU, in Triton's interpreter on CPU.

Triton fixes interpreter-or-compiler for its own language functions (tl.sum, tl.sigmoid...)
at its first import in the process. Without a GPU we therefore import triton here with
TRITON_INTERPRET=1 and restore the variable right after, so other test directories sharing
the pytest process see their environment unchanged. If something imported triton before this
file (e.g. a model test collected earlier), the interpreter cannot work in this process: the
in-process kernel tests then skip and test_isolated_run.py runs this directory in a fresh one.

Each test also gets, through monkeypatch (undone after the test): MEGALITE_KERNEL_BACKEND=triton,
MEGALITE_KERNEL_POISON=1 (kernel outputs start as NaN, so an element a kernel forgets to write
fails the comparison) and, without a GPU, TRITON_INTERPRET=1.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available()

if not ON_GPU and "triton" not in sys.modules:
    _previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401 - imported for its side effect: interpretable tl functions
    except Exception:  # noqa: BLE001 - no triton on this platform: the kernel tests skip
        pass
    finally:
        if _previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _previous


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setenv("MEGALITE_KERNEL_BACKEND", "triton")
    monkeypatch.setenv("MEGALITE_KERNEL_POISON", "1")
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
