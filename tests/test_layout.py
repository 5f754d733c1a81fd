"""What the layout promises: the rollout side loads no torch, and the loop's module stays short."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).parents[1] / "streamrl"


def test_buffer_controller_and_manager_import_no_torch() -> None:
    code = ("import streamrl.buffer, streamrl.rollout.manager, streamrl.rollout, sys; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:3]")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr


def test_the_loop_reads_in_one_sitting() -> None:
    """run.py: at most 150 lines, no function over 60."""
    text = (SRC / "run.py").read_text()
    assert len(text.splitlines()) <= 150
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            assert node.end_lineno - node.lineno + 1 <= 60, node.name
