"""What a judge costs and whether RL learns from it: the judged quickstart (`configs/judge.yaml`,
every sample scored by the tiny judge on its own engine) beside the same run scored by the exact-match
rule, interleaved round by round in one process run.

    python bench/judge.py [--rounds 1] [--steps N] [--config CONFIG] [--sides judge,rule] [--out F.json]

Both sides run the config (configs/judge.yaml, or another with a judge) through the console script
(one subprocess each, in the repository, so its caches are .cache/streamrl), on the same policy warm
start and seed; the `rule` side sets `judge.enabled=false data.reward=null`, and the `colocated` side
(on a GPU: `--sides judge,rule,colocated`) keeps the judge and sets `engines.colocate=true`, the
policy's engines freeing their memory around each step while the judge's engine keeps its share.
Reported per side: RL wall time, samples/s, held-out accuracy (exact match) before and after, sampled
and greedy, the judge's agreement with exact match on held-out samples, and for the judge its calls,
failures, judgments/s, mean latency and `judge_s` (per trained group, its wait for the judge), with
its warm start's own held-out agreement and the device memory its engine holds. Writes
bench/results/judge.json, its `cpu` or `gpu` part.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _table import print_table, write_results

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
SIDES = {"judge": [], "rule": ["judge.enabled=false", "data.reward=null"], "colocated": ["engines.colocate=true"]}


def one_run(config: Path, run_dir: Path, steps: int | None, sets: list[str]) -> dict:
    script = Path(sys.executable).with_name("streamrl")  # the console script; on a bare GPU machine, the module
    cli = [str(script)] if script.exists() else [sys.executable, "-m", "streamrl.cli"]
    cmd = [*cli, "run", str(config), "--no-progress", "--set", f"run_dir={run_dir}"]
    for s in [*sets, *([f"schedule.steps={steps}"] if steps else [])]:
        cmd += ["--set", s]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if p.returncode != 0:
        raise RuntimeError(f"exit {p.returncode}: {p.stderr[-2000:]}")
    s = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tail = rows[-max(1, len(rows) // 10):]
    before, after = s["eval_before"], s["eval_after"]
    out = {"train_wall_s": round(s["train_wall_s"], 2), "samples": rows[-1]["samples"],
           "samples_per_s": round(rows[-1]["samples"] / s["train_wall_s"], 1),
           "final_reward": round(sum(r["reward_mean"] for r in tail) / len(tail), 4),
           "sampled_before": before["sampled"], "sampled_after": after["sampled"],
           "greedy_before": before["greedy"], "greedy_after": after["greedy"]}
    if "judge" in s:
        j, warm = s["judge"], s["judge"].get("warm_start", {})
        out |= {"agreement_sampled_before": before["agreement_sampled"], "agreement_sampled_after": after["agreement_sampled"],
                "agreement_greedy_after": after["agreement_greedy"], "judge_calls": j["calls"],
                "judge_failures": j["failures"], "judge_calls_per_s": round(j["calls_per_s"], 1),
                "judge_latency_ms": round(1000 * j["latency_mean_s"], 1),
                "judge_s_mean": round(statistics.mean(r["judge_s"] for r in rows), 4),
                "judge_weight_versions": j["weight_versions"], "judge_kv_mib": round(j["kv_cache_bytes"] / 2**20, 1),
                "judge_memory_mib": round((j.get("memory_bytes") or 0) / 2**20, 1), "judge_devices": j.get("devices"),
                "judge_warm_start_agreement": warm.get("held_out_agreement"),
                "judge_warm_start_s": warm.get("train_seconds")}
    if "engine_release_s" in rows[0]:  # colocated: what the policy's engines gave up around each step
        out |= {"policy_release_s": round(statistics.mean(r["engine_release_s"] for r in rows), 4),
                "policy_restore_s": round(statistics.mean(r["engine_restore_s"] for r in rows), 4),
                "policy_mib_during_step": round(rows[-1]["engine_bytes_during_step"] / 2**20, 1)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=None, help="trainer steps per run (default: the config's)")
    ap.add_argument("--config", type=Path, default=REPO / "configs" / "judge.yaml")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--sides", default="judge,rule", help=f"comma-separated, of {', '.join(SIDES)}; rule is the baseline")
    ap.add_argument("--out", default=str(RESULTS / "judge.json"))
    args = ap.parse_args(argv)
    sides = args.sides.split(",")
    if "rule" not in sides or not set(sides) <= set(SIDES):
        ap.error(f"--sides: names of {', '.join(SIDES)}, rule among them; got {args.sides!r}")
    per: dict[str, list[dict]] = {m: [] for m in sides}
    with tempfile.TemporaryDirectory(prefix="streamrl-judge-") as tmp:
        for k in range(args.rounds):
            for m in sides:
                per[m].append(one_run(args.config.resolve(), Path(tmp) / f"{m}-{k}", args.steps, SIDES[m]))
                print(f"round {k} {m}: {per[m][-1]}", flush=True)
    med = {m: statistics.median(r["train_wall_s"] for r in rs) for m, rs in per.items()}
    rows = [{"side": m, "settings": SIDES[m], **rs[-1], "train_wall_s": med[m],
             "wall_vs_rule": round(med[m] / med["rule"], 3)} for m, rs in per.items()]
    print_table(f"{args.config.name}, {rows[0]['samples']} samples a run (median of {args.rounds} round(s))",
                ["side", "RL wall s", "vs rule", "samples/s", "sampled before → after", "greedy after",
                 "judge agrees (sampled, after)", "judgments/s", "judge_s"],
                [[r["side"], r["train_wall_s"], f"{r['wall_vs_rule']:.2f}×", r["samples_per_s"],
                  f"{r['sampled_before']:.3f} → {r['sampled_after']:.3f}", r["greedy_after"],
                  r.get("agreement_sampled_after", ""), r.get("judge_calls_per_s", ""), r.get("judge_s_mean", "")]
                 for r in rows])
    import torch

    gpu = torch.cuda.is_available()
    write_results(args.out, {"config": args.config.name, "steps": args.steps, "rounds": args.rounds,
                             "device": torch.cuda.get_device_name() if gpu else "2-core CPU"}, rows,
                  section="gpu" if gpu else "cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
