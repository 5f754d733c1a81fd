"""The benchmark's own arithmetic: per-round speedups, the medians it reports, its worst-case figures.

The benchmark runs take minutes (bench/, not tests); what is checked here is that the numbers it
reports are computed from its rounds the way docs/async.md says.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("async_vs_sync")
    finally:
        sys.path.remove(str(BENCH))


def row(mode: str, wall: float, *, discarded: int = 0, staleness: float = 0.0, settings: dict | None = None) -> dict:
    return {"mode": mode, "wall_s": wall, "tokens_discarded": discarded, "dropped_stale": 0,
            "staleness_max": staleness, "settings": settings or {}}


def test_speedups_are_per_round_and_the_report_takes_their_median(bench) -> None:
    rounds = [
        [row("sync", 40.0), row("sync-trainer2threads", 44.0), row("eta4", 20.0, staleness=4)],
        [row("sync", 30.0), row("sync-trainer2threads", 27.0), row("eta4", 20.0, staleness=3)],
        [row("sync", 36.0), row("sync-trainer2threads", 40.0), row("eta4", 16.0, discarded=5, staleness=4)],
    ]
    for r in rounds:
        bench.add_speedups(r)
    # Each against its own round's sync: 2.0, 1.5, 2.25; and against that round's faster sync.
    assert [r[2]["speedup_vs_sync"] for r in rounds] == [2.0, 1.5, 2.25]
    assert rounds[1][2]["speedup_vs_best_sync"] == 1.35  # sync-trainer2threads ran 27 s in that round
    out = {r["mode"]: r for r in bench.summarize(rounds)}
    eta4 = out["eta4"]
    assert eta4["speedup_vs_sync"] == 2.0  # the median of the rounds' ratios, not a ratio of medians
    assert eta4["speedup_vs_sync_rounds"] == [2.0, 1.5, 2.25]
    assert eta4["wall_s_rounds"] == [20.0, 20.0, 16.0]
    assert eta4["tokens_discarded"] == 5 and eta4["staleness_max"] == 4  # the worst round's
    assert out["sync"]["wall_s"] == 36.0  # the median round's own figures


def test_another_run_seed_is_not_a_faster_sync_variant(bench) -> None:
    rows = [row("sync", 40.0), row("sync-seed1", 30.0, settings={"seed": 1}), row("eta4", 20.0)]
    bench.add_speedups(rows)
    assert rows[2]["speedup_vs_best_sync"] == 2.0


def test_unknown_modes_are_a_usage_error(bench, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        bench.main(["--modes", "sync,eta5"])
    assert e.value.code == 2
    assert "unknown mode(s) eta5" in capsys.readouterr().err


def test_every_default_mode_exists(bench) -> None:
    assert set(bench.DEFAULT_MODES) <= set(bench.MODES)
    assert "sync" in bench.DEFAULT_MODES
