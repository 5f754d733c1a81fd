"""Checkpoints of a run, taken between two steps, and continuing a run from one (`schedule.resume_from`).

A checkpoint folder (`RUN_DIR/checkpoints/step-N/`) holds everything the run loop needs to go on as
if it had not stopped:

- the policy as a Hugging Face folder (engines and the trainer load it), or with LoRA its adapters in
  peft's format (on the run's base model, `state.json`'s base_model), and `optimizer.pt` (AdamW's
  moments and step counts);
- `rollout_state.msgpack`: the buffer's snapshot (queued groups);
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

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from .buffer import RolloutBuffer, StalenessController
from .config import Config, ConfigError
from .trainer.trainer import OPTIMIZER_FILE
from .weights.lora import ADAPTER_CONFIG

if TYPE_CHECKING:
    from .rollout import RolloutManager
    from .trainer import TrainerProcess, TrainerThread


class RunParts(Protocol):
    """What a checkpoint holds of a run (`run.Run` has these)."""

    cfg: Config
    trainer: TrainerProcess | TrainerThread
    buffer: RolloutBuffer
    manager: RolloutManager
    base_model: str

# 1: policy, rollout_state and state.json only (no optimizer, no generating groups). 2 wrote the
# interrupted samples twice (in the buffer's snapshot too); a format-3 run reads them from
# generating.msgpack only, so format 2 loads as it is.
FORMAT = 3
ROLLOUT_FILE, GENERATING_FILE, STATE_FILE = "rollout_state.msgpack", "generating.msgpack", "state.json"
KEY = "schedule.resume_from"


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


async def save_checkpoint(r: RunParts, step: int) -> Path:
    """Write `RUN_DIR/checkpoints/step-N` between two steps. The rollout side is snapshotted here, on
    the event loop, so buffer and manager agree; the model is written by the trainer (idle between
    steps), so generation goes on meanwhile."""
    out = Path(r.cfg.run_dir) / "checkpoints" / f"step-{step}"
    async with r.manager.tool_gate.shut():  # every tool call in the snapshot is whole, or not started
        rollout_state = r.buffer.state_dict()
        generating, counters = r.manager.snapshot()
    state = RunState(
        format=FORMAT, step=step, version=r.trainer.version, samples=r.trainer.samples, queued_groups=len(r.buffer),
        partials=counters["partials"], generating_groups=counters["generating_groups"],
        prompts_drawn=counters["prompts_drawn"], next_seed=counters["next_seed"],
        batch_groups=r.cfg.schedule.batch_groups, group_size=r.cfg.rollout.group_size,
        base_model=str(Path(r.base_model).resolve()),  # a resumed run may start from another folder
    )
    await r.trainer.save(out, optimizer=True)
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

    @property
    def lora(self) -> bool:
        return (self.path / ADAPTER_CONFIG).is_file()

    @property
    def model_dir(self) -> str:
        """What engines and trainer load: the checkpoint's policy, or with LoRA the base its adapters fit."""
        return self.state.base_model if self.lora else str(self.path)

    def trainer_state(self) -> dict[str, Any]:
        """Where the trainer goes on from: its version, samples trained, AdamW's state (and adapters)."""
        return {"version": self.state.version, "samples": self.state.samples, "optimizer_state": self.optimizer,
                **({"adapter_path": str(self.path)} if self.lora else {})}

    def start(self, run_dir: Path, log: Any) -> tuple[str, str, dict[str, Any]]:
        """A run resumed from here: its outputs cut back to this step; (model folder, base model, summary)."""
        log(f"resuming from {self.path} (step {self.state.step})")
        continue_outputs(run_dir, self.state.step, self.state.batch_groups)
        return self.model_dir, self.state.base_model, {"run_dir": str(run_dir), "model_dir": str(self.path)}

    def restore(self, buffer: RolloutBuffer, controller: StalenessController, manager: RolloutManager) -> dict[str, Any]:
        """Put the rollout side back as it was; call before the manager runs. Returns counts to report."""
        buffer.load_state_dict((self.path / ROLLOUT_FILE).read_bytes())
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
    """Read `schedule.resume_from` (None when unset); a checkpoint that cannot continue this config is a
    ConfigError naming the key that disagrees."""
    where = cfg.schedule.resume_from
    if where is None:
        return None
    path = Path(where)
    hint = "a checkpoint is a folder RUN_DIR/checkpoints/step-N (written with schedule.save_every)"
    if not (path / STATE_FILE).is_file():
        raise ConfigError(KEY, f"'{where}' is not a checkpoint folder (no {STATE_FILE}); {hint}")
    try:
        raw = json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(KEY, f"cannot read '{path / STATE_FILE}': {e}") from None
    if raw.get("format", 1) < 2:
        raise ConfigError(KEY, f"'{where}' was written by an older streamrl without the optimizer state and the "
                               "groups being generated; it cannot be resumed (its policy loads as model.path)")
    try:
        state = msgspec.convert(raw, RunState)
    except msgspec.ValidationError as e:
        raise ConfigError(KEY, f"'{path / STATE_FILE}': {e}") from None
    lora = (path / ADAPTER_CONFIG).is_file()  # the trainer's adapters, written by a LoRA run
    if lora != bool(cfg.trainer.lora.rank):
        raise ConfigError("trainer.lora.rank", f"the checkpoint's run trained {'LoRA adapters' if lora else 'every weight'}"
                                               f"; a resumed run keeps it (set trainer.lora.rank {'> 0' if lora else '= 0'})")
    policy = ADAPTER_CONFIG if lora else "config.json"
    missing = [f for f in (OPTIMIZER_FILE, ROLLOUT_FILE, GENERATING_FILE, policy) if not (path / f).is_file()]
    if missing:
        raise ConfigError(KEY, f"'{where}' is incomplete: no {', '.join(missing)}")
    sched = cfg.schedule
    if state.step >= sched.steps:
        raise ConfigError("schedule.steps", f"the checkpoint is at step {state.step}; set schedule.steps above it "
                                            f"to train on (got {sched.steps})")
    if state.batch_groups != sched.batch_groups:
        raise ConfigError("schedule.batch_groups", f"the checkpoint's run used {state.batch_groups}; a resumed run "
                                                   f"keeps it (got {sched.batch_groups})")
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
