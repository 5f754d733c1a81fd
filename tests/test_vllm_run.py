"""`streamrl run` with real vLLM servers: the quickstart learns on a server streamrl launches; an
async run resumes partial samples across weight updates on a server the user gives (URL) and
discards nothing; Ctrl-C/SIGTERM leaves no vLLM process behind; config mistakes are one line."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from helpers import (
    REPO,
    STREAMRL,
    processes_mentioning,
    quickstart_until_first_step,
    run_quickstart_cli,
    running_vllm_server,
    sigterm_and_expect_interrupted,
)
from test_run import read_groups, read_metrics, small_cfg

from streamrl.config import ConfigError, config_from_dict
from streamrl.engine import EngineError
from streamrl.engine.vllm import find_vllm_python
from streamrl.run import run

PYTHON = find_vllm_python()
needs_vllm = pytest.mark.skipif(PYTHON is None, reason="vLLM is not installed here: run bash scripts/setup_vllm.sh")
VLLM = [b"vllm.entrypoints.openai.api_server"]


def vllm_processes_for(model: Path) -> list[bytes]:
    return [c for c in processes_mentioning(VLLM[0]) if str(model).encode() in c]


def process_tree(needle: bytes) -> set[int]:
    """PIDs of the processes whose command line has `needle`, and all their descendants (vLLM's
    engine core runs as a child named VLLM::EngineCore)."""
    parents: dict[int, int] = {}
    roots = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            if needle in (proc / "cmdline").read_bytes():
                roots.add(int(proc.name))
        except OSError:
            continue
        parents[int(proc.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, grew = set(roots), True
    while grew:
        kids = {pid for pid, ppid in parents.items() if ppid in tree} - tree
        tree |= kids
        grew = bool(kids)
    return tree


def alive(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # gone (or going) between the listing and the read
            continue
        if state not in ("Z", "X"):
            out.add(pid)
    return out


def alive_after(pids: set[int], seconds: float) -> set[int]:
    """The processes of `pids` still alive `seconds` from now (returns early once none is).

    Why wait at all: Python's multiprocessing resource tracker, a child of the run that holds the run's
    stderr, exits only once the run has exited, and communicate() returns as soon as it closes that
    stderr, i.e. while the tracker is still in the middle of its own exit (seen in CI on a loaded
    machine). A process that outlives the run for real (an orphaned vLLM engine core) is still there
    when the wait is over."""
    deadline = time.monotonic() + seconds
    while (left := alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@pytest.mark.parametrize(("sets", "key"), [
    ({"engines": {"backend": "vllm"}}, "engines.backend"),  # pool local
    ({"engines": {"pool": "http", "backend": "vllm", "router": "launch"}}, "engines.router"),
    ({"engines": {"pool": "http", "backend": "vllm", "weight_sync": "distributed"}}, "engines.weight_sync"),
    ({"engines": {"pool": "http", "backend": "vllm"}, "rollout": {"temperature": 0.005}}, "rollout.temperature"),
])
def test_vllm_config_mistakes_name_the_key(tmp_path: Path, sets: dict, key: str) -> None:
    with pytest.raises(ConfigError) as e:
        config_from_dict(small_cfg(tmp_path, tmp_path, model={"path": str(tmp_path), "init": "tiny"}, **sets))
    assert e.value.key == key


def test_missing_vllm_install_is_one_line_before_any_work(tmp_path: Path) -> None:
    t0 = time.monotonic()
    p = subprocess.run([*STREAMRL, "run", str(REPO / "configs" / "quickstart.yaml"), "--no-progress",
                        "--set", f"run_dir={tmp_path / 'run'}", "--set", "engines.pool=http",
                        "--set", "engines.backend=vllm", "--set", f"engines.vllm_python={tmp_path / 'nope'}"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [
        f"config error: engines.vllm_python: '{tmp_path / 'nope'}' does not exist; run `bash scripts/setup_vllm.sh` "
        "(builds .venv-vllm) or point engines.vllm_python at a Python that has vllm"]
    assert time.monotonic() - t0 < 60  # no warm start, no server


@needs_vllm
@pytest.mark.slow
def test_quickstart_learns_on_a_vllm_server_streamrl_launches(tmp_path: Path) -> None:
    """The README's quickstart, shortened, with `engines.pool: http` + `backend: vllm`: streamrl starts
    one real vLLM server, trains asynchronously (η = 1, partial resume, decoupled PPO) and stops it."""
    run_dir = tmp_path / "qs"
    p = run_quickstart_cli(run_dir, "schedule.steps=200", "engines.pool=http", "engines.backend=vllm", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = read_metrics(run_dir)
    first = sum(r["reward_mean"] for r in rows[:40]) / 40
    last = sum(r["reward_mean"] for r in rows[-40:]) / 40
    assert last > first + 0.1, (first, last)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval_after"]["sampled"] > summary["eval_before"]["sampled"] + 0.1
    # vLLM's behaviour logprobs are the trainer's: on-policy tokens agree (the run's own check).
    assert max(r["logprob_mismatch"] for r in rows if r["logprob_mismatch"] is not None) < 1e-3
    assert sum(r["partial_resumed"] for r in rows) > 0
    assert sum(r["tokens_discarded"] for r in rows) == 0
    assert max(r["staleness_max"] for r in rows) <= 1
    assert (run_dir / "logs" / "vllm-0.log").is_file()
    # Nothing of the server is left: neither the API server nor its engine core (VLLM::EngineCore,
    # which renames itself; no other vLLM runs while this module's first test does).
    assert not vllm_processes_for(Path(summary["model_dir"]))
    assert not processes_mentioning(b"VLLM::")


@needs_vllm
@pytest.mark.slow
def test_quickstart_with_lora_learns_on_vllm_through_its_adapter_loading(tmp_path: Path) -> None:
    """`--set trainer.lora.rank=8` on a launched vLLM server: every push is a peft folder loaded through
    vLLM's /v1/load_lora_adapter (a new name per version, which requests name as their model), and
    vLLM's logprobs with the adapter are the trainer's."""
    run_dir = tmp_path / "qs"
    p = run_quickstart_cli(run_dir, "schedule.steps=200", "engines.pool=http", "engines.backend=vllm",
                           "trainer.lora.rank=8", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = read_metrics(run_dir)
    first = sum(r["reward_mean"] for r in rows[:40]) / 40
    last = sum(r["reward_mean"] for r in rows[-40:]) / 40
    assert last > first + 0.1, (first, last)
    assert max(r["logprob_mismatch"] for r in rows if r["logprob_mismatch"] is not None) < 1e-3
    assert sum(r["partial_resumed"] for r in rows) > 0 and sum(r["tokens_discarded"] for r in rows) == 0
    # The mismatch check above is what shows vLLM served the adapters: had it sampled from the base, the
    # tokens of the current version would differ by the adapters' whole effect.
    assert (run_dir / "final" / "adapter_config.json").is_file()


@pytest.fixture(scope="module")
def user_server(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """A vLLM server the "user" started (streamrl connects by URL), on the tests' tiny model."""
    if PYTHON is None:
        pytest.skip("vLLM is not installed here: run bash scripts/setup_vllm.sh")
    from safetensors.torch import load_file, save_file

    from streamrl.tasks.tiny_model import EOS_ID, build_tiny_model

    d = tmp_path_factory.mktemp("vllm-run")
    model = build_tiny_model(d / "tiny", preset="tiny", seed=0, initializer_range=0.5, max_position_embeddings=256)
    # A model that (almost) never says <eos>, served one sequence at a time: every sample runs its whole
    # budget, generation is the bottleneck by a wide margin, and weight updates find samples in flight.
    weights = load_file(model / "model.safetensors")
    weights["model.embed_tokens.weight"][EOS_ID] = 0.0  # tied head: the <eos> logit is 0, others are large
    save_file(weights, model / "model.safetensors")
    with running_vllm_server(PYTHON, model, d / "vllm.log", max_num_seqs=1) as url:
        yield url, model


@needs_vllm
@pytest.mark.slow
async def test_async_run_on_vllm_resumes_partials_and_discards_nothing(tmp_path: Path, user_server) -> None:  # noqa: ANN001
    url, model = user_server
    cfg = config_from_dict(small_cfg(
        tmp_path, model, controller={"max_staleness": 2}, data={"eval_size": 2},
        # Every sample runs out its budget with the same reward (advantage 0): skipping their compute keeps
        # each train step far shorter than generating a batch, so every update finds samples in flight.
        # With the full computation the trainer, sharing 2 cores with vLLM, could take as long as the
        # engine and find the buffer full and nothing in flight at an update.
        schedule={"steps": 8, "batch_groups": 2},
        rollout={"group_size": 4, "max_new_tokens": 200}, engines={"pool": "http", "backend": "vllm", "urls": [url]},
    ))
    await run(cfg, show_progress=False, log=lambda *_: None)
    rows = read_metrics(Path(cfg.run_dir))
    assert sum(r["skipped_samples"] for r in rows) > 0
    assert sum(r["partial_resumed"] for r in rows) > 0
    assert sum(r["tokens_discarded"] for r in rows) == 0
    assert max(r["staleness_max"] for r in rows) <= 2
    groups = read_groups(Path(cfg.run_dir))
    for step, g in enumerate(groups):
        for s in g.samples:
            assert len(s.response_ids) == len(s.logprobs) == len(s.versions)
            assert s.versions == sorted(s.versions)
            assert step // 2 - min(s.versions) <= 2  # trained within η of every token's version
    assert any(len(set(s.versions)) > 1 for g in groups for s in g.samples)  # resumed across versions


@needs_vllm
async def test_lora_against_a_vllm_server_without_lora_is_one_clear_error(tmp_path: Path, user_server) -> None:  # noqa: ANN001
    """The user's server was started without --enable-lora: the first adapter push says how to start it."""
    url, model = user_server
    cfg = config_from_dict(small_cfg(tmp_path, model, data={"eval_size": 2}, trainer={"lora": {"rank": 8}},
                                     engines={"pool": "http", "backend": "vllm", "urls": [url]}))
    with pytest.raises(EngineError, match="has no /v1/load_lora_adapter: start it with --enable-lora"):
        await run(cfg, show_progress=False, log=lambda *_: None)


@needs_vllm
@pytest.mark.slow
def test_sigterm_stops_a_vllm_run_and_its_servers(tmp_path: Path) -> None:
    p, _, model = quickstart_until_first_step(tmp_path, "engines.pool=http", "engines.backend=vllm", timeout=600)
    tree = process_tree(str(model).encode())
    assert vllm_processes_for(model) and len(tree) >= 2, "the run's vLLM server and engine core should be up"
    assert processes_mentioning(b"VLLM::"), "vLLM's engine core names itself VLLM::... (the quickstart test relies on it)"
    sigterm_and_expect_interrupted(p)
    assert not alive_after(tree, 10)
