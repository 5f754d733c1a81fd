"""A live progress bar for training runs (rich), silent when disabled or not on a terminal."""

from __future__ import annotations

from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class RunProgress:
    def __init__(self, total: int, *, enabled: bool = True) -> None:
        self.total = total
        self.enabled = enabled
        self._progress: Progress | None = None
        self._task: Any = None
        self._reward_ema: float | None = None

    def __enter__(self) -> RunProgress:
        if self.enabled:
            self._progress = Progress(
                TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
                TextColumn("{task.description}"), TimeElapsedColumn(),
            )
            self._progress.__enter__()
            self._task = self._progress.add_task("", total=self.total)
        return self

    def update(self, step: int, row: dict[str, Any]) -> None:
        r = row["reward_mean"]
        # A smoothed reward: single steps of 64 samples are too noisy to read a trend from.
        self._reward_ema = r if self._reward_ema is None else 0.95 * self._reward_ema + 0.05 * r
        if self._progress is None:
            return
        sps = row["samples"] / row["wall_s"] if row["wall_s"] > 0 else 0.0
        self._progress.update(
            self._task, completed=step,
            description=f"reward {self._reward_ema:.3f}  samples {row['samples']}  {sps:.0f} samples/s",
        )

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.__exit__(None, None, None)
