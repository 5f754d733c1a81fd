"""Synchronous vs asynchronous training on a long-tail response-length task, one process run.

Task "repeat": `"37*2="` -> `"37,37"`. With `--tail think` (default) ~4 % of samples, of any prompt,
first think for 60-280 tokens (`":37;37;...;37>37,37"`) while the rest answer in ~5: most answers
short, a few 50x longer, the shape of reasoning rollouts, where synchronous RL waits for the slowest
sample of every batch. `--tail heavy` / `mild` make some *prompts* long instead (all 8 samples).

Every mode uses the same model (a tiny model warm-started on the task with sloppy labels), seed, task
and sample budget, through the same `streamrl.run.run` code path; only the controller / rollout
settings differ. Reported per mode: wall time to the sample budget, samples/s, engine idle fraction,
tokens discarded, final reward, max staleness, and the speedup over sync.

    python bench/async_vs_sync.py [--tail think|heavy|mild] [--steps 100] [--modes sync,eta1,eta4,...] [--rounds 3]

Timings on these machines drift by 20-40 % within an hour: `--rounds N` runs the mode list N times,
interleaved, and reports per mode the median of the per-round speedups (each against the same
round's sync run) and the worst correctness figures of any round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _table import print_table, write_results

from streamrl.config import config_from_dict
from streamrl.run import run
from streamrl.tasks import build_tiny_model

RESULTS = Path(__file__).parent / "results"

MODES: dict[str, dict] = {
    "sync": {"controller": {"max_staleness": 0}},
    "eta1": {"controller": {"max_staleness": 1}},
    "eta2": {"controller": {"max_staleness": 2}},
    "eta4": {"controller": {"max_staleness": 4}},
    "eta8": {"controller": {"max_staleness": 8}},
    "eta4-discard": {"controller": {"max_staleness": 4}, "rollout": {"partial": "discard"}},
    # In-flight samples stay in the engine at an update: KV recomputed there (exact, no round trip
    # through the manager), or kept from the old weights (SGLang's in_place, PipelineRL's in-flight updates).
    "eta4-retract": {"controller": {"max_staleness": 4}, "rollout": {"partial": "retract"}},
    "eta4-inplace": {"controller": {"max_staleness": 4}, "rollout": {"partial": "in_place"}},
    # The weights go to the engines every 2nd / 4th step only: fewer interruptions and recomputations.
    "eta4-push2": {"controller": {"max_staleness": 4}, "schedule": {"push_every": 2}},
    "eta8-push4": {"controller": {"max_staleness": 8}, "schedule": {"push_every": 4}},
    # The same task and warm start, another seed for the RL run only (sampling, prompt order): how
    # much of a difference between modes is one run's luck.
    "sync-seed1": {"controller": {"max_staleness": 0}, "seed": 1},
    "eta4-seed1": {"controller": {"max_staleness": 4}, "seed": 1},
    # The other losses: truncated importance sampling, and PPO against the behaviour policy.
    "eta4-tis": {"controller": {"max_staleness": 4}, "trainer": {"loss": "tis"}},
    "eta4-grpo": {"controller": {"max_staleness": 4}, "trainer": {"loss": "grpo"}},
    "eta8-push4-grpo": {"controller": {"max_staleness": 8}, "trainer": {"loss": "grpo"}, "schedule": {"push_every": 4}},
    # AReaL's cap on the behaviour weight pi_prox/pi_behav (tokens above it leave the loss).
    "eta4-cap2": {"controller": {"max_staleness": 4}, "trainer": {"behav_imp_weight_cap": 2.0}},
    # Four optimizer steps per batch (`trainer.ppo_minibatches: 4`, AReaL's ppo_n_minibatches): the
    # ratio to pi_prox moves from the second step on, so decoupled PPO's clip can bind.
    "sync-mb4": {"controller": {"max_staleness": 0}, "trainer": {"ppo_minibatches": 4}},
    "eta4-mb4": {"controller": {"max_staleness": 4}, "trainer": {"ppo_minibatches": 4}},
    # Two torch threads for the trainer (the engine keeps one).
    "sync-trainer2threads": {"controller": {"max_staleness": 0}, "trainer": {"threads": 2}},
    "eta4-trainer2threads": {"controller": {"max_staleness": 4}, "trainer": {"threads": 2}},
}
# What a plain run compares: sync, η = 1, 2, 4, 8 with exact resume, η = 8 pushing every 4th step
# (with the decoupled loss, and with grpo), and η = 4 restarting interrupted samples (`discard`).
# The rest are for A/B experiments (docs/benchmarks.md).
DEFAULT_MODES = ("sync", "eta1", "eta2", "eta4", "eta8", "eta8-push4", "eta8-push4-grpo", "eta4-discard")


# Tail shapes: (fraction of long answers, repeat range of long answers, model context, max_new_tokens).
# "mild" and "heavy" make some *prompts* long (all 8 samples of such a group are long); "think" makes
# some *samples* long, as in reasoning RL where any prompt's sample may think at length: the warm
# start teaches the model to open ~4 % of its answers with a thought ":37;37;...;37>" (the repeat
# range is the thought's length) before the answer, which the reward reads after the last ">".
TAILS = {
    "mild": (0.10, (16, 28), 128, 96),  # long answers 47-83 tokens
    "heavy": (0.04, (60, 90), 320, 280),  # long answers 179-269 tokens
    "think": (0.0, (60, 90), 320, 280),  # no long prompts; the warm start's weight makes ~4 % of samples think
}


def make_records(n: int, seed: int, tail: str) -> list[dict]:
    frac, (lo, hi), _, _ = TAILS[tail]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a = rng.randint(10, 99)
        long_prompt = tail != "think" and rng.random() < frac
        k = rng.randint(lo, hi) if long_prompt else rng.randint(1, 2)
        out.append({"prompt": f"{a}*{k}=", "answer": ",".join([str(a)] * k)})
    return out


def reward(response_text: str, answer: str) -> float:
    """1 iff the answer (after a thought's last ">", if any) equals the reference."""
    return 1.0 if response_text.rsplit(">", 1)[-1].strip() == answer.strip() else 0.0


def warm_start(model_dir: Path, records: list[dict], steps: int, seed: int, tail: str) -> None:
    """Supervised start with sloppy labels (30% repeat one time too many or too few)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    enc = lambda t: tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    short = [r for r in records if r["answer"].count(",") < 2]
    long_ = [r for r in records if r["answer"].count(",") >= 2] or short
    think = TAILS[tail][1] if tail == "think" else None
    for _ in range(steps):
        # Short and long examples in separate micro-batches: padding a batch to the longest answer
        # would make the warm start ~20x more expensive. Half the loss each, so the rare long
        # answers are learnt at all (with a share by count, the model learns to stop early).
        _sft_step(model, tok, rng.sample(short, 128), rng, enc, scale=0.5)
        # A thought is opened at the first answer token: 2.5x the weight makes ~4 % of samples think.
        _sft_step(model, tok, rng.sample(long_, 8), rng, enc, scale=1.25 if think else 0.5, think=think)
        opt.step()
        sched.step()
        opt.zero_grad()
    model.save_pretrained(model_dir)


def _sft_step(model, tok, batch: list[dict], rng: random.Random, enc, scale: float,  # noqa: ANN001
              think: tuple[int, int] | None = None) -> None:
    seqs, starts = [], []
    for r in batch:
        a, k = r["prompt"][:-1].split("*")
        k = max(1, int(k) + (rng.choice([-1, 1]) if rng.random() < 0.3 else 0))
        p = [tok.bos_token_id, *enc(r["prompt"])]
        thought = ":" + ";".join([a] * rng.randint(*think)) + ">" if think else ""
        seqs.append(p + enc(thought + ",".join([a] * k)) + [tok.eos_token_id])
        starts.append(len(p))
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    pos = torch.arange(width - 1)
    lens, first = torch.tensor([len(s) for s in seqs]), torch.tensor(starts)
    mask = (pos >= first[:, None] - 1) & (pos < lens[:, None] - 1)
    logits = model(input_ids=ids[:, :-1]).logits
    loss = F.cross_entropy(logits[mask], ids[:, 1:][mask])
    (loss * scale).backward()


def run_mode(name: str, overrides: dict, base: dict) -> dict:
    cfg = json.loads(json.dumps(base))
    for sec, vals in overrides.items():
        if isinstance(vals, dict):
            cfg.setdefault(sec, {}).update(vals)
        else:  # a top-level key, e.g. the run's seed
            cfg[sec] = vals
    cfg["run_dir"] = str(Path(base["run_dir"]) / name)
    t0 = time.perf_counter()
    summary = asyncio.run(run(config_from_dict(cfg), show_progress=False, log=lambda *_: None))
    rows = [json.loads(x) for x in (Path(cfg["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    train_wall = rows[-1]["wall_s"]
    tail = rows[-max(1, len(rows) // 5):]
    n = len(rows)
    return {
        "mode": name, "wall_s": round(train_wall, 2), "samples": rows[-1]["samples"],
        "samples_per_s": round(rows[-1]["samples"] / train_wall, 1),
        "final_reward": round(sum(r["reward_mean"] for r in tail) / len(tail), 4),
        "eval_sampled_after": summary["eval_after"]["sampled"],
        "tokens_generated": sum(r["tokens_generated"] for r in rows),
        "tokens_discarded": sum(r["tokens_discarded"] for r in rows),
        "partial_resumed": sum(r["partial_resumed"] for r in rows),
        "dropped_stale": sum(r["dropped_stale"] for r in rows),
        "staleness_max": max(r["staleness_max"] for r in rows),
        "engine_idle_frac": round(sum(r["engine_idle_frac"] for r in rows) / n, 3),
        "engine_prefill_s": round(sum(r.get("engine_prefill_s", 0.0) for r in rows), 2),
        "train_s": round(sum(r["train_s"] for r in rows), 2),
        "skipped_samples": sum(r.get("skipped_samples", 0) for r in rows),
        "trainer_wait_frac": round(sum(r["trainer_wait_s"] for r in rows) / train_wall, 3),
        "batch_parts_mean": round(sum(r.get("batch_parts", 1) for r in rows) / n, 2),
        "process_wall_s": round(time.perf_counter() - t0, 1),
        "settings": overrides,
    }


def add_speedups(rows: list[dict]) -> None:
    """Speedups within one round: against that round's sync run, and its fastest sync variant (another
    loop or thread count; not another run seed, which is another experiment)."""
    sync = next((r for r in rows if r["mode"] == "sync"), None)
    variants = [r for r in rows if r["mode"].startswith("sync") and "seed" not in r.get("settings", {})]
    best_sync = min(variants, key=lambda r: r["wall_s"], default=None)
    for r in rows:
        r["speedup_vs_sync"] = round(sync["wall_s"] / r["wall_s"], 2) if sync else None
        r["speedup_vs_best_sync"] = round(best_sync["wall_s"] / r["wall_s"], 2) if best_sync else None


def summarize(rounds: list[list[dict]]) -> list[dict]:
    """One entry per mode: the round with the median wall time, with the median of the per-round
    speedups, every round's wall time and speedup, and the worst correctness figures of any round."""
    out = []
    for i in range(len(rounds[0])):
        runs = [rows[i] for rows in rounds]
        row = dict(sorted(runs, key=lambda r: r["wall_s"])[(len(runs) - 1) // 2])
        speedups = [r["speedup_vs_sync"] for r in runs]
        if None not in speedups:
            row["speedup_vs_sync"] = round(statistics.median(speedups), 2)
        if len(runs) > 1:
            row["wall_s_rounds"] = [r["wall_s"] for r in runs]
            row["speedup_vs_sync_rounds"] = speedups
            for k in ("tokens_discarded", "dropped_stale", "staleness_max"):
                row[k] = max(r[k] for r in runs)
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100, help="trainer steps per mode (budget = steps*8*8 samples)")
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"any of {', '.join(MODES)}")
    ap.add_argument("--warm-steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pool", default="http", choices=["http", "local"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="engines and trainer (cuda: use --pool local; the engine's paged runner, bf16)")
    ap.add_argument("--tail", default="think", choices=sorted(TAILS))
    ap.add_argument("--max-running", type=int, default=128, help="engines.max_running_requests")
    ap.add_argument("--replicas", type=int, default=1,
                    help="engine replicas (processes) in every mode; on 2 cores a second one only takes CPU from the trainer")
    ap.add_argument("--work-dir", default=None, help="keep model and runs here instead of a temp dir")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the mode list this many times, interleaved; report medians (machines here drift)")
    ap.add_argument("--out", default=str(RESULTS / "async_vs_sync.json"))
    args = ap.parse_args(argv)
    if unknown := [m for m in args.modes.split(",") if m not in MODES]:
        ap.error(f"--modes: unknown mode(s) {', '.join(unknown)}; known: {', '.join(MODES)}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = args.work_dir or tmp
        Path(tmp).mkdir(parents=True, exist_ok=True)
        _, _, context, max_new = TAILS[args.tail]
        records = make_records(4000, args.seed, args.tail)
        data = Path(tmp) / "repeat.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in records))
        # The warm start is deterministic in (tail, seed, steps): a --work-dir keeps it for the next run.
        model_dir = Path(tmp) / f"model-{args.tail}-{args.seed}-{args.warm_steps}"
        if not (model_dir / "warm.done").exists():
            build_tiny_model(model_dir, preset="tiny", seed=args.seed, max_position_embeddings=context)
            t0 = time.perf_counter()
            torch.set_num_threads(2)
            warm_start(model_dir, records[200:], args.warm_steps, args.seed, args.tail)
            (model_dir / "warm.done").touch()
            print(f"warm start: {time.perf_counter() - t0:.0f} s", flush=True)
        base = {
            "run_dir": str(Path(tmp) / "runs"), "seed": args.seed,
            "model": {"path": str(model_dir), "init": "none"},
            "data": {"task": None, "path": str(data), "eval_size": 64, "reward": f"{Path(__file__).resolve()}:reward"},
            # Engines in their own processes (`streamrl serve`), as in production: no GIL shared with the
            # trainer. `--pool local` keeps them in-process for comparison.
            "engines": {"max_running_requests": args.max_running, "pool": args.pool, "num_replicas": args.replicas,
                        "device": args.device, "dtype": "bfloat16" if args.device == "cuda" else "float32"},
            "rollout": {"group_size": 8, "max_new_tokens": max_new, "temperature": 1.0},
            "trainer": {"lr": 3e-5, "loss": "decoupled_ppo", "device": args.device},
            "schedule": {"steps": args.steps, "batch_groups": 8},
        }
        rounds = []
        for k in range(args.rounds):
            rows = []
            for name in args.modes.split(","):
                rows.append(run_mode(name, MODES[name], base))
                print(f"round {k + 1}/{args.rounds}:", rows[-1], flush=True)
            add_speedups(rows)
            rounds.append(rows)
    rows = summarize(rounds)

    cols = ["mode", "wall_s", "samples_per_s", "speedup_vs_sync", "speedup_vs_best_sync", "engine_idle_frac",
            "tokens_discarded", "partial_resumed", "staleness_max", "final_reward"]
    where = "GPU" if args.device == "cuda" else "2-core CPU"
    print_table(f"async vs sync, long-tail task, {rows[0]['samples']} samples per mode ({where})", cols,
                ([r[c] for c in cols] for r in rows))
    meta = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "2-core CPU", "replicas": args.replicas, "max_running_requests": args.max_running, "tail": args.tail,
            "tail_shape": TAILS[args.tail], "pool": args.pool, "steps": args.steps, "warm_steps": args.warm_steps,
            "rounds": args.rounds}
    write_results(args.out, meta, rows, section="gpu" if args.device == "cuda" else "cpu",
                  **({"rounds": rounds} if args.rounds > 1 else {}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
