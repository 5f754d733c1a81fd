"""Shared fixtures: a tiny model folder built once per test session (offline, ~1 s)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from streamrl.tasks.tiny_model import build_tiny_model

torch.set_num_threads(1)  # several torch thread teams in one process spin against each other on 2 cores


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", preset="tiny", seed=0)


@pytest.fixture(scope="session")
def engine_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model with a wide initialisation: peaked, varied next-token distributions, so greedy
    comparisons are not decided by float noise between near-equal logits."""
    return build_tiny_model(
        tmp_path_factory.mktemp("models") / "engine", preset="tiny", seed=0, initializer_range=0.5
    )


@pytest.fixture(scope="session")
def tiny_model_dir_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture, other weights: for weight-update tests."""
    return build_tiny_model(
        tmp_path_factory.mktemp("models") / "engine_b", preset="tiny", seed=1, initializer_range=0.5
    )


@pytest.fixture(scope="session")
def agent_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with chat and tool-call tokens (`agent=True`), wide init as `engine_model_dir`."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "agent", preset="tiny", seed=0, agent=True,
                            initializer_range=0.5)


@pytest.fixture(scope="session")
def tools_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a chat template that renders tools and tool calls (Hermes form)."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tools", tools=True, initializer_range=0.5)
