"""The GPU runner's kernels and forward (tests/gpu_kernel_cases.py): here on a GPU, or under Triton's
interpreter in a child process.

Why a child process: Triton's interpreter must be on before `triton.language` is first imported (its
standard library, `tl.sum` and the like, is built compiled or interpreted at that import), and other
test modules import it earlier through transformers. Setting TRITON_INTERPRET for the whole test
session instead would reach every server and trainer process the suite starts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CASES = Path(__file__).with_name("gpu_kernel_cases.py")

if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.importorskip("triton", reason="Triton is not installed: the GPU runner's kernels")
    from gpu_kernel_cases import *  # noqa: F403 - the cases, collected in this process
else:

    def test_the_gpu_kernels_under_tritons_interpreter() -> None:
        pytest.importorskip("triton", reason="Triton is not installed (pip install triton): the GPU runner's kernels")
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)], env=env,
                           cwd=CASES.parents[1], capture_output=True, text=True, timeout=1200)
        summary = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
        assert r.returncode == 0 and " passed" in summary and "failed" not in summary, r.stdout[-6000:] + r.stderr[-2000:]
