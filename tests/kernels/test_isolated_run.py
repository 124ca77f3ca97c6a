"""Fallback: when triton was imported earlier in this pytest process without the interpreter
(so the in-process kernel tests skip), run tests/kernels in a fresh process instead."""
import os
import subprocess
import sys

import pytest

from kernel_testing import KERNELS_RUNNABLE_HERE
from megalite.kernels import HAVE_TRITON


@pytest.mark.skipif(KERNELS_RUNNABLE_HERE or not HAVE_TRITON,
                    reason="the kernel tests run in this process (or triton is missing)")
def test_kernel_tests_pass_in_a_fresh_process():
    here = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if k not in ("MEGALITE_KERNEL_BACKEND", "PYTEST_ADDOPTS")}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", here],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout
