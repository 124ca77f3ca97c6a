"""Run the Triton kernels themselves: compiled on a GPU, in Triton's interpreter on CPU.

Triton fixes interpreter-or-compiler for its own language functions (tl.sum, tl.sigmoid...)
at its first import in the process. Without a GPU, `megalite.kernels` makes that first import
an interpreter-mode one and restores TRITON_INTERPRET right after, so other test directories
sharing the pytest process see their environment unchanged. If something imported triton
in compiled mode before megalite.kernels, the interpreter cannot work in this process: the
in-process kernel tests then skip and test_isolated_run.py runs this directory in a fresh one.

Each test also gets, through monkeypatch (undone after the test): MEGALITE_KERNEL_BACKEND=triton,
MEGALITE_KERNEL_POISON=1 (kernel outputs start as NaN, so an element a kernel forgets to write
fails the comparison) and, without a GPU, TRITON_INTERPRET=1.
"""
from __future__ import annotations

import pytest
import torch

ON_GPU = torch.cuda.is_available()

import megalite.kernels  # noqa: E402,F401 - without a GPU this imports triton in interpreter mode


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setenv("MEGALITE_KERNEL_BACKEND", "triton")
    monkeypatch.setenv("MEGALITE_KERNEL_POISON", "1")
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
