"""The quickstart as a user runs it (`streamrl run configs/quickstart.yaml`), timed; optionally against
another git revision of streamrl, interleaved round by round in one process run.

    python bench/quickstart.py [--rounds 2] [--against REV] [--set KEY=VALUE ...]

`--against REV` checks REV out into a temporary git worktree and runs its own CLI and its own
quickstart config beside this tree's (same Python environment, same warm-start cache, alternating),
so a change to the loop can be held against the code before it. Reported per side and round: RL
wall time (`train_wall_s`), the final reward (mean of the last tenth of the steps), held-out accuracy
before and after (sampled at T = 1, and greedy). Writes bench/results/quickstart.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _table import print_table

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def one_run(tree: Path, run_dir: Path, sets: list[str]) -> dict:
    """The quickstart of the streamrl in `tree`, with that tree's config and code."""
    cmd = [sys.executable, "-m", "streamrl.cli", "run", str(tree / "configs" / "quickstart.yaml"), "--no-progress",
           "--set", f"run_dir={run_dir}", "--set", f"warm_start.cache_dir={REPO / '.cache' / 'streamrl'}",
           "--set", f"model.path={REPO / '.cache' / 'streamrl' / 'tiny-model'}"]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(tree)}  # that tree's package, not the installed one
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree)
    if p.returncode != 0:
        raise RuntimeError(f"{tree}: exit {p.returncode}: {p.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tail = rows[-max(1, len(rows) // 10):]
    return {"train_wall_s": round(summary["train_wall_s"], 1), "process_s": round(time.perf_counter() - t0, 1),
            "final_reward": round(sum(r["reward_mean"] for r in tail) / len(tail), 4),
            "sampled_before": summary["eval_before"]["sampled"], "sampled_after": summary["eval_after"]["sampled"],
            "greedy_before": summary["eval_before"]["greedy"], "greedy_after": summary["eval_after"]["greedy"],
            "steps": len(rows)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--against", default=None, help="a git revision to run beside this tree")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="for this tree's runs only")
    ap.add_argument("--out", default=str(RESULTS / "quickstart.json"))
    args = ap.parse_args(argv)
    sides: dict[str, Path] = {"this tree": REPO}
    with tempfile.TemporaryDirectory() as tmp:
        if args.against:
            worktree = Path(tmp) / "against"
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(worktree), args.against],
                           check=True, capture_output=True)
            sides = {args.against: worktree, **sides}
        rounds: dict[str, list[dict]] = {name: [] for name in sides}
        try:
            for k in range(args.rounds):
                for name, tree in sides.items():
                    row = one_run(tree, Path(tmp) / f"{k}-{len(rounds[name])}-{name.replace(' ', '_')}",
                                  args.set if tree == REPO else [])
                    rounds[name].append(row)
                    print(f"round {k + 1}: {name}: {row}", flush=True)
        finally:
            if args.against:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(worktree)],
                               capture_output=True)
    cols = ["side", "RL wall s (median)", "per round", "final reward", "held-out sampled", "held-out greedy"]
    table = []
    for name, rs in rounds.items():
        table.append([name, round(statistics.median(r["train_wall_s"] for r in rs), 1), ", ".join(str(r["train_wall_s"]) for r in rs),
                      ", ".join(f"{r['final_reward']:.3f}" for r in rs),
                      ", ".join(f"{r['sampled_before']:.3f}→{r['sampled_after']:.3f}" for r in rs),
                      ", ".join(f"{r['greedy_before']:.3f}→{r['greedy_after']:.3f}" for r in rs)])
    print_table("the quickstart, 1000 steps x 64 samples (2-core CPU)", cols, table)
    meta = {"against": args.against, "sets": args.set, "rounds": args.rounds, "date": time.strftime("%Y-%m-%d %H:%M"),
            "python": sys.version.split()[0]}
    Path(args.out).write_text(json.dumps({"meta": meta, "results": rounds}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
