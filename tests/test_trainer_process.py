"""TrainerProcess: the same steps as the in-process Trainer, weights shared with the parent, errors
reported with the child's message, and the child gone after close."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from test_trainer import fake_groups

from streamrl.trainer.losses import LossConfig
from streamrl.trainer.process import TrainerProcess
from streamrl.trainer.trainer import Trainer, TrainerSettings


def test_steps_match_the_in_process_trainer_and_weights_are_shared(tiny_model_dir: Path, tmp_path: Path) -> None:
    settings = TrainerSettings(lr=1e-3, loss=LossConfig(kind="decoupled_ppo"))
    local = Trainer(str(tiny_model_dir), settings)
    remote = TrainerProcess(str(tiny_model_dir), settings)
    try:
        shared = remote.state_dict_for_engines()
        assert set(shared) == set(local.state_dict_for_engines())
        before = {k: v.clone() for k, v in shared.items()}
        for seed in (1, 2):
            s_local = local.train_step(fake_groups(seed))
            s_remote = remote.train_step(fake_groups(seed))
            assert s_remote["loss"] == pytest.approx(s_local["loss"], abs=1e-6)
            assert s_remote["trained_tokens"] == s_local["trained_tokens"]
        # A batch in parts, as the run loop sends it while the rest of the batch still generates.
        local.train_step(fake_groups(3))
        first, *rest = fake_groups(3)
        remote.accumulate([first])
        remote.accumulate(rest)
        assert remote.version == 2  # no step before finish_step
        s_remote = remote.finish_step()
        assert remote.version == local.version == 3
        assert s_remote["trained_samples"] == 12
        # The parent's tensors are the child's parameters: they moved without being sent again.
        assert remote.state_dict_for_engines() is shared
        assert any(not torch.equal(before[k], shared[k]) for k in shared)
        for k, v in local.state_dict_for_engines().items():
            assert torch.allclose(shared[k], v, atol=1e-5), k
        out = remote.save(tmp_path / "final")
        assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    finally:
        remote.close()
    assert not remote._proc.is_alive()


def test_a_failing_step_raises_the_child_error_and_the_child_keeps_serving(tiny_model_dir: Path) -> None:
    remote = TrainerProcess(str(tiny_model_dir), TrainerSettings(loss=LossConfig(kind="grpo")))
    try:
        bad = fake_groups(3)
        bad[0].samples[0].logprobs.append(-1.0)  # one logprob more than tokens
        with pytest.raises(RuntimeError, match="logprobs"):
            remote.train_step(bad)
        assert remote.version == 0
        remote.train_step(fake_groups(4))
        assert remote.version == 1
    finally:
        remote.close()


def test_a_model_that_cannot_load_fails_at_start(tiny_model_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "no-weights"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "model.safetensors").unlink()  # the tokenizer loads in the parent; the model fails in the child
    with pytest.raises(RuntimeError, match="trainer process"):
        TrainerProcess(str(broken), TrainerSettings(loss=LossConfig()))
