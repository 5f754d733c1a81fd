"""The run loop's handle on the trainer (`start_trainer`): as a child process (CPU), the same steps as
the in-process Trainer, weights shared with the parent, errors reported in one line, the child gone
after close, and a killed child a clear `TrainerFailed`."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from test_trainer import fake_groups

from streamrl.config import TrainerConfig
from streamrl.trainer import Trainer, TrainerFailed, TrainerProcess, TrainerThread, start_trainer


async def test_steps_match_the_in_process_trainer_and_weights_are_shared(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = TrainerConfig(lr=1e-3, loss="decoupled_ppo", device="cpu")
    local = Trainer(cfg, str(tiny_model_dir))
    remote = start_trainer(cfg, str(tiny_model_dir))
    assert isinstance(remote, TrainerProcess)  # a CPU trainer gets a process of its own
    try:
        shared = remote.weights()
        assert set(shared) == set(local.state_dict_for_engines())
        before = {k: v.clone() for k, v in shared.items()}
        for seed in (1, 2):
            s_local = local.train_step(fake_groups(seed))
            await remote.accumulate(fake_groups(seed))
            s_remote = await remote.finish_step()
            assert s_remote["loss"] == pytest.approx(s_local["loss"], abs=1e-6)
            assert s_remote["trained_tokens"] == s_local["trained_tokens"]
        # A batch in parts, as the run loop sends it while the rest of the batch still generates.
        local.train_step(fake_groups(3))
        first, *rest = fake_groups(3)
        await remote.accumulate([first])
        await remote.accumulate(rest)
        assert remote.version == 2  # no step before finish_step
        s_remote = await remote.finish_step()
        assert remote.version == local.version == s_remote["version"] == 3
        assert s_remote["trained_samples"] == 12 and s_remote["samples_total"] == 36 and s_remote["train_s"] > 0
        # The parent's tensors are the child's parameters: they moved without being sent again.
        assert remote.weights() is shared
        assert any(not torch.equal(before[k], shared[k]) for k in shared)
        for k, v in local.state_dict_for_engines().items():
            assert torch.allclose(shared[k], v, atol=1e-5), k
        out = await remote.save(tmp_path / "final")
        assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    finally:
        await remote.aclose()
    assert not remote._proc.is_alive()


async def test_a_failing_step_raises_the_child_error_and_the_child_keeps_serving(tiny_model_dir: Path) -> None:
    remote = TrainerProcess(TrainerConfig(loss="grpo"), str(tiny_model_dir))
    try:
        bad = fake_groups(3)
        bad[0].samples[0].logprobs.append(-1.0)  # one logprob more than tokens
        with pytest.raises(TrainerFailed, match="logprobs"):
            await remote.accumulate(bad)
        assert remote.version == 0
        await remote.accumulate(fake_groups(4))
        await remote.finish_step()
        assert remote.version == 1
    finally:
        await remote.aclose()


async def test_a_killed_trainer_is_one_clear_error(tiny_model_dir: Path) -> None:
    remote = TrainerProcess(TrainerConfig(loss="grpo"), str(tiny_model_dir))
    try:
        pid = remote._proc.pid
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(TrainerFailed) as info:
            await remote.accumulate(fake_groups(4))
        assert str(info.value) == f"the trainer process (pid {pid}) was killed by SIGKILL"
    finally:
        await remote.aclose()


def test_a_model_that_cannot_load_fails_at_start(tiny_model_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "no-weights"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "model.safetensors").unlink()  # the tokenizer loads in the parent; the model fails in the child
    with pytest.raises(TrainerFailed, match="trainer process"):
        TrainerProcess(TrainerConfig(), str(broken))


async def test_the_thread_layout_steps_like_the_process(tiny_model_dir: Path) -> None:
    """On a GPU the trainer computes in a thread of the driver, behind the same async handle."""
    cfg = TrainerConfig(lr=1e-3, loss="grpo", device="cpu")
    thread = TrainerThread(cfg, str(tiny_model_dir), samples=10)
    proc = TrainerProcess(cfg, str(tiny_model_dir), samples=10)
    try:
        for h in (thread, proc):
            await h.accumulate(fake_groups(5))
        a, b = await thread.finish_step(), await proc.finish_step()
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
        assert a["samples_total"] == b["samples_total"] == 22 and thread.version == proc.version == 1
    finally:
        await thread.aclose()
        await proc.aclose()
