"""Where a run's metrics rows go besides `RUN_DIR/metrics.jsonl` (`logging.*`): TensorBoard event files
and Weights & Biases, the curves researchers look at.

Each row's numeric fields become scalars at the row's `step`, named as in metrics.jsonl; a nested
mapping becomes `outer/inner` scalars, and strings, lists (the `controller` decisions) and nulls (a
step without an on-policy logprob check) are left out. The TensorBoard files are written with
tensorboard's own event writer (not `torch.utils.tensorboard`, which imports torch and more: 0.2 s
against 1.3 s here); wandb is imported only when `logging.wandb` is on (the config checks both are
installed before any work). This module only copies rows; metrics.jsonl stays the record.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec

from .config import LoggingConfig


def scalars(row: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """A row's numeric fields (bools as 0/1), nested mappings as `outer/inner`; the rest left out."""
    out: dict[str, float] = {}
    for key, value in row.items():
        if isinstance(value, dict):
            out |= scalars(value, f"{prefix}{key}/")
        elif isinstance(value, int | float):
            out[f"{prefix}{key}"] = float(value)
    return out


class TensorBoardSink:
    """Rows as TensorBoard scalars in `logdir` (`tensorboard --logdir` on it, or on a folder above it)."""

    def __init__(self, logdir: Path, *, flush_secs: float = 5.0) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.logdir = logdir
        self._event, self._summary, self._start = Event, Summary, SessionLog(status=SessionLog.START)
        logdir.mkdir(parents=True, exist_ok=True)
        self._writer = EventFileWriter(str(logdir), flush_secs=flush_secs)

    def write(self, step: int, values: dict[str, float]) -> None:
        if self._start is not None:  # a resumed run: TensorBoard drops the old files' points from this step on
            self._writer.add_event(self._event(wall_time=time.time(), step=step, session_log=self._start))
            self._start = None
        summary = self._summary(value=[self._summary.Value(tag=k, simple_value=v) for k, v in values.items()])
        self._writer.add_event(self._event(wall_time=time.time(), step=step, summary=summary))

    def close(self) -> None:
        self._writer.close()  # flushes


class WandbSink:
    """Rows as a wandb run's history (offline by default: files under `run_dir/wandb`, `wandb sync` later)."""

    def __init__(self, cfg: LoggingConfig, run_dir: Path, run_config: dict[str, Any] | None) -> None:
        import wandb

        run_dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=cfg.wandb_project, dir=str(run_dir), mode=cfg.wandb_mode,
                               name=run_dir.name, config=run_config or {})

    def write(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()


class MetricSinks:
    """The sinks `logging` turns on (none: every call is a no-op). `run_config`: the run's Config (or a
    plain dict), given to wandb as the run's config."""

    def __init__(self, cfg: LoggingConfig | None, run_dir: Path, run_config: Any = None) -> None:
        self.sinks: list[TensorBoardSink | WandbSink] = []
        if cfg is None:
            return
        if cfg.tensorboard:
            logdir = Path(cfg.tensorboard_dir) if cfg.tensorboard_dir is not None else run_dir / "tensorboard"
            self.sinks.append(TensorBoardSink(logdir))
        if cfg.wandb:
            if isinstance(run_config, msgspec.Struct):
                run_config = msgspec.to_builtins(run_config)
            self.sinks.append(WandbSink(cfg, run_dir, run_config))

    def write(self, row: dict[str, Any]) -> None:
        """One metrics row (its `step` is the x axis)."""
        if not self.sinks:
            return
        values = scalars({k: v for k, v in row.items() if k != "step"})
        for sink in self.sinks:
            sink.write(int(row["step"]), values)

    def close(self) -> None:
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close()
