"""The GPU runner's kernels and forward (tests/gpu_kernel_cases.py): here on a GPU, or under Triton's
interpreter in a child process.

Why a child process: Triton's interpreter must be on before `triton.language` is first imported (its
standard library, `tl.sum` and the like, is built compiled or interpreted at that import), and torch
imports it early wherever it is importable. Setting TRITON_INTERPRET for the whole test session
instead would reach every server and trainer process the suite starts. Without a GPU, Triton lives
in `.venv-triton` beside `.venv` (scripts/test.sh installs it there), which only this child sees.
"""

from __future__ import annotations

import importlib.util
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
        site = CASES.parents[1] / ".venv-triton"
        if not (site / "triton").is_dir() and importlib.util.find_spec("triton") is None:
            pytest.skip("Triton is not installed (scripts/test.sh puts it in .venv-triton): the GPU runner's kernels")
        path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)], env=env,
                           cwd=CASES.parents[1], capture_output=True, text=True, timeout=1200)
        summary = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
        assert r.returncode == 0 and " passed" in summary and "failed" not in summary, r.stdout[-6000:] + r.stderr[-2000:]
