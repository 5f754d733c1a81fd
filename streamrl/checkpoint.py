"""Checkpoints of a run, taken between two steps, and continuing a run from one (`trainer.resume_from`).

A checkpoint folder (`RUN_DIR/checkpoints/step-N/`) holds everything the run loop needs to go on as
if it had not stopped:

- the policy as a Hugging Face folder (engines and the trainer load it) and `optimizer.pt` (AdamW's
  moments and step counts);
- `rollout_state.msgpack`: the buffer's snapshot (queued groups, parked partial samples);
- `generating.msgpack`: the groups still being generated, every sample as of its last returned
  round: finished, partial (its tokens, behaviour logprobs and per-token versions so far) or not
  started;
- `state.json` (`RunState`): step, version, trained samples, how many prompts were drawn, the next
  sampling seed, and the shape of the run (batch and group size) that a resumed run must keep.

Resuming restores the buffer, the controller's counts (every restored group keeps its admission
version, so its staleness deadline is unchanged) and the manager's prompt stream, then resubmits
the unfinished samples with prompt + tokens so far. What the engines decoded after the checkpoint
is lost with the process that held it; nothing in the checkpoint is.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from .buffer import RolloutBuffer
from .buffer.controller import StalenessController
from .config import Config, ConfigError
from .trainer.trainer import OPTIMIZER_FILE

if TYPE_CHECKING:
    from .rollout.manager import RolloutManager
    from .trainer.process import TrainerProcess
    from .trainer.trainer import Trainer

FORMAT = 2  # 1: policy, rollout_state and state.json only (no optimizer, no generating groups)
ROLLOUT_FILE, GENERATING_FILE, STATE_FILE = "rollout_state.msgpack", "generating.msgpack", "state.json"
KEY = "trainer.resume_from"


class RunState(msgspec.Struct, kw_only=True):
    format: int
    step: int
    version: int
    samples: int  # samples trained so far
    queued_groups: int
    partials: int
    generating_groups: int
    prompts_drawn: int
    next_seed: int
    batch_groups: int
    group_size: int
    base_model: str  # the policy RL started from: the KL reference of a resumed run


async def save_checkpoint(out: Path, *, trainer: Trainer | TrainerProcess, buffer: RolloutBuffer,
                          manager: RolloutManager, step: int, samples: int, base_model: str,
                          executor: ThreadPoolExecutor) -> Path:
    """Write a checkpoint. The rollout side is snapshotted here, on the event loop, so buffer and
    manager agree; the model is written from the trainer's thread (idle between steps), so
    generation goes on meanwhile."""
    rollout_state = buffer.state_dict()
    generating, counters = manager.snapshot()
    state = RunState(
        format=FORMAT, step=step, version=trainer.version, samples=samples, queued_groups=len(buffer),
        partials=buffer.num_partials, generating_groups=counters["generating_groups"],
        prompts_drawn=counters["prompts_drawn"], next_seed=counters["next_seed"],
        batch_groups=manager.controller.batch_groups, group_size=manager.settings.group_size,
        base_model=str(Path(base_model).resolve()),  # a resumed run may start from another folder
    )
    await asyncio.get_running_loop().run_in_executor(executor, lambda: trainer.save(out, optimizer=True))
    (out / ROLLOUT_FILE).write_bytes(rollout_state)
    (out / GENERATING_FILE).write_bytes(generating)
    (out / STATE_FILE).write_text(json.dumps(msgspec.to_builtins(state), indent=1))
    return out


@dataclass
class Resume:
    """A checkpoint read back and checked against the config that continues it."""

    path: Path
    state: RunState

    @property
    def optimizer(self) -> Path:
        return self.path / OPTIMIZER_FILE

    def restore(self, buffer: RolloutBuffer, controller: StalenessController, manager: RolloutManager) -> dict[str, Any]:
        """Put the rollout side back as it was; call before the manager runs. Returns counts to report."""
        buffer.load_state_dict((self.path / ROLLOUT_FILE).read_bytes())
        buffer.take_partials()  # the generating groups hold these samples; the manager parks them again
        s = self.state
        generating = manager.restore((self.path / GENERATING_FILE).read_bytes(), prompts_drawn=s.prompts_drawn,
                                     next_seed=s.next_seed)
        controller.restore(version=s.version, trained_groups=s.step * s.batch_groups, queued=buffer.peek(),
                           generating=generating)
        partial = [x for g in generating for x in g.samples if x.status == "partial"]
        return {"path": str(self.path), "step": s.step, "queued_groups": len(buffer),
                "generating_groups": len(generating), "partial_samples": len(partial),
                "partial_tokens": sum(x.num_tokens for x in partial)}


def load_resume(cfg: Config) -> Resume | None:
    """Read `trainer.resume_from` (None when unset); a checkpoint that cannot continue this config is a
    ConfigError naming the key that disagrees."""
    where = cfg.trainer.resume_from
    if where is None:
        return None
    path = Path(where)
    hint = "a checkpoint is a folder RUN_DIR/checkpoints/step-N (written with trainer.save_every)"
    if not (path / STATE_FILE).is_file():
        raise ConfigError(KEY, f"'{where}' is not a checkpoint folder (no {STATE_FILE}); {hint}")
    try:
        raw = json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(KEY, f"cannot read '{path / STATE_FILE}': {e}") from None
    if raw.get("format", 1) < FORMAT:
        raise ConfigError(KEY, f"'{where}' was written by an older streamrl without the optimizer state and the "
                               "groups being generated; it cannot be resumed (its policy loads as model.path)")
    try:
        state = msgspec.convert(raw, RunState)
    except msgspec.ValidationError as e:
        raise ConfigError(KEY, f"'{path / STATE_FILE}': {e}") from None
    missing = [f for f in (OPTIMIZER_FILE, ROLLOUT_FILE, GENERATING_FILE, "config.json") if not (path / f).is_file()]
    if missing:
        raise ConfigError(KEY, f"'{where}' is incomplete: no {', '.join(missing)}")
    if state.step >= cfg.trainer.steps:
        raise ConfigError("trainer.steps", f"the checkpoint is at step {state.step}; set trainer.steps above it "
                                           f"to train on (got {cfg.trainer.steps})")
    if state.batch_groups != cfg.trainer.batch_groups:
        raise ConfigError("trainer.batch_groups", f"the checkpoint's run used {state.batch_groups}; a resumed run "
                                                  f"keeps it (got {cfg.trainer.batch_groups})")
    if state.group_size != cfg.rollout.group_size:
        raise ConfigError("rollout.group_size", f"the checkpoint's run used {state.group_size}; a resumed run "
                                                f"keeps it (got {cfg.rollout.group_size})")
    return Resume(path=path, state=state)


def continue_outputs(run_dir: Path, step: int, batch_groups: int) -> None:
    """A run resumed into its own folder: keep metrics.jsonl's rows and samples.jsonl's groups up to the
    checkpoint's step (a crashed run may have gone further), so the files read as one run."""
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        kept = []
        for line in metrics.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # blank, or the torn last line of a killed run
            if row["step"] <= step:
                kept.append(line + "\n")
        metrics.write_text("".join(kept))
    samples = run_dir / "samples.jsonl"
    if samples.is_file():
        lines = samples.read_bytes().splitlines(keepends=True)
        samples.write_bytes(b"".join(lines[: step * batch_groups]))
