"""LoRA (`trainer.lora`): adapters trained on a frozen base, only adapters pushed, engines that apply them.

The engine's logprobs after a push equal the trainer's on the same tokens; the base never changes;
every version is merged from the base (no drift); the folder is peft's; a resumed trainer continues
bitwise; `streamrl serve` takes adapters through SGLang's and vLLM's endpoints; runs on the local pool
and on launched `streamrl serve` servers learn with partial rollouts across adapter versions.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from aiohttp import web
from helpers import REPO, STREAMRL
from test_run import read_groups, read_metrics, small_cfg
from test_trainer import fake_groups

from streamrl.config import ConfigError, TrainerConfig, config_from_dict
from streamrl.config.schema import LoraConfig
from streamrl.engine import TorchEngine
from streamrl.engine.http import SGLangClient, SGLangHTTPError, build_app
from streamrl.run import run
from streamrl.trainer.logprobs import token_logprobs
from streamrl.trainer.trainer import Trainer
from streamrl.weights import Adapter, load_adapter, load_folder, save_adapter

QUIET = {"show_progress": False, "log": lambda *_: None}
PROMPT = [1, 5, 6, 7, 8]


def lora_trainer(model_dir: Path, **lora) -> Trainer:
    return Trainer(TrainerConfig(lr=1e-3, lora=LoraConfig(rank=lora.pop("rank", 8), **lora)), str(model_dir))


def moved(t: Trainer, seed: int = 0) -> Adapter:
    """The trainer's adapters after a few steps (lora_B starts at zero: an adapter that changes nothing)."""
    for i in range(3):
        t.train_step(fake_groups(seed + i))
    return t.state_dict_for_engines()


def trainer_logprobs(t: Trainer, prompt: list[int], ids: list[int]) -> torch.Tensor:
    x = torch.tensor([prompt + ids])
    t.model.eval()
    with torch.no_grad():
        return token_logprobs(t.model, x, torch.ones_like(x), 1.0)[0, len(prompt):len(prompt) + len(ids)]


def engine_logprobs(r: dict) -> torch.Tensor:
    return torch.tensor([x[0] for x in r["meta_info"]["output_token_logprobs"]])


async def test_the_engines_logprobs_after_a_push_equal_the_trainers(tiny_model_dir: Path) -> None:
    t = lora_trainer(tiny_model_dir)
    base = load_folder(tiny_model_dir)
    adapter = moved(t)
    assert adapter.modules() and all(k.startswith("model.layers.") for k in adapter.tensors)
    assert any(float(v.abs().max()) > 0 for k, v in adapter.tensors.items() if "lora_B" in k)
    for k, v in t.model.base_model.model.state_dict().items():  # the trainer's base never moves
        if "lora_" not in k and k in base:
            assert torch.equal(v, base[k]), k
    async with TorchEngine(str(tiny_model_dir), max_running_requests=4) as e:
        r0 = await e.generate(PROMPT, {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 1})
        await e.load_lora_adapter(adapter, "3")
        r = await e.generate(PROMPT, {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 1})
        assert r["meta_info"]["weight_version"] == "3"
        diff = (trainer_logprobs(t, PROMPT, r["output_ids"]) - engine_logprobs(r)).abs().max()
        assert float(diff) <= 1e-5
        # The base's logprobs differ: the adapter did change the model the engine samples from.
        with t.model.disable_adapter():
            off = trainer_logprobs(t, PROMPT, r["output_ids"])
        assert float((off - engine_logprobs(r)).abs().max()) > 1e-3
        # Each version is merged from the base, never on top of the last: push v4, then v3 again.
        t.model.train()
        v4 = Adapter({k: v.clone() for k, v in moved(t, seed=7).tensors.items()}, adapter.rank, adapter.alpha)
        await e.load_lora_adapter(v4, "4")
        await e.load_lora_adapter(Adapter(adapter.tensors, adapter.rank, adapter.alpha), "5")
        # An adapter that adapts nothing puts the base back: the same tokens as before any push.
        await e.load_lora_adapter(Adapter({}, 1, 1.0), "6")
        again = await e.generate(PROMPT, {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 1})
        assert again["output_ids"] == r0["output_ids"]
        assert torch.equal(engine_logprobs(again), engine_logprobs(r0))
        bad = Adapter({"model.layers.0.nope.lora_A.weight": torch.zeros(8, 4),
                       "model.layers.0.nope.lora_B.weight": torch.zeros(4, 8)}, 8, 16.0)
        with pytest.raises(Exception, match="no module 'model.layers.0.nope'"):
            await e.load_lora_adapter(bad, "7")


def test_only_adapters_train_and_the_kl_reference_is_the_base_without_them(tiny_model_dir: Path) -> None:
    t = Trainer(TrainerConfig(lr=1e-3, kl_coef=0.1, lora=LoraConfig(rank=4, target_modules=["q_proj", "v_proj"])),
                str(tiny_model_dir))
    assert t.ref_model is None  # no second model in memory
    names = [n for n, p in t.model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n and ("q_proj" in n or "v_proj" in n) for n in names)
    assert t.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2)  # 10 x trainer.lr by default
    first = t.train_step(fake_groups(0))
    assert first["kl"] == pytest.approx(0.0, abs=1e-7)  # lora_B starts at 0: the policy is the base
    t.train_step(fake_groups(1))
    assert t.train_step(fake_groups(2))["kl"] > 0  # the adapters moved the policy off its reference


def test_the_adapter_folder_is_peft_format_and_final_merges_on_request(tiny_model_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    t = lora_trainer(tiny_model_dir)
    adapter = moved(t)
    out = t.save(tmp_path / "final", merged=True)
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert not (out / "model.safetensors").exists()  # the adapters, not the model
    x = torch.tensor([PROMPT + [9, 10, 11]])
    with torch.no_grad():
        ours = t.model.eval()(x).logits
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), out).eval()(x).logits
        merged = AutoModelForCausalLM.from_pretrained(out / "merged").eval()(x).logits
    assert torch.allclose(ours, peft, atol=1e-6) and torch.allclose(ours, merged, atol=1e-5)
    back = load_adapter(out)
    assert back.rank == 8 and back.alpha == 16.0 and back.tensors.keys() == adapter.tensors.keys()
    assert all(torch.equal(back.tensors[k], adapter.tensors[k]) for k in adapter.tensors)
    again = load_adapter(save_adapter(back, tmp_path / "copy"))
    assert all(torch.equal(again.tensors[k], adapter.tensors[k]) for k in adapter.tensors)
    with pytest.raises(ValueError, match="not a LoRA adapter folder"):
        load_adapter(tiny_model_dir)


def test_a_resumed_lora_trainer_continues_bitwise(tiny_model_dir: Path, tmp_path: Path) -> None:
    a = lora_trainer(tiny_model_dir)
    a.train_step(fake_groups(0))
    ckpt = a.save(tmp_path / "ckpt", optimizer=True)
    a.train_step(fake_groups(1))
    b = Trainer(TrainerConfig(lr=1e-3, lora=LoraConfig(rank=8)), str(tiny_model_dir), adapter_path=ckpt,
                optimizer_state=ckpt / "optimizer.pt")
    b.train_step(fake_groups(1))
    ta, tb = a.state_dict_for_engines().tensors, b.state_dict_for_engines().tensors
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    assert any(float(v.abs().max()) > 0 for k, v in ta.items() if "lora_B" in k)


# ---- streamrl serve: SGLang's and vLLM's adapter endpoints -----------------------------------------------
async def test_streamrl_serve_loads_adapters_through_sglangs_and_vllms_endpoints(tiny_model_dir: Path,
                                                                                tmp_path: Path) -> None:
    t = lora_trainer(tiny_model_dir)
    folder = save_adapter(moved(t), tmp_path / "v3")
    engine = TorchEngine(str(tiny_model_dir), max_running_requests=4, num_threads=1)
    async with engine:
        runner = web.AppRunner(build_app(engine, model_name="tiny"))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        try:
            async with SGLangClient(url) as c:
                params = {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 2}
                base = await c.generate(PROMPT, params)
                await c.load_lora_adapter(str(folder), "3")
                assert c.lora_name == "streamrl-v3"
                r = await c.generate(PROMPT, params)  # names the adapter: lora_path
                assert r["meta_info"]["weight_version"] == "3"
                diff = (trainer_logprobs(t, PROMPT, r["output_ids"]) - engine_logprobs(r)).abs().max()
                assert float(diff) <= 1e-5
                # Bad requests: a 4xx with a message, and the server goes on serving.
                with pytest.raises(SGLangHTTPError) as e:
                    await c.request("POST", "/generate", {"input_ids": PROMPT, "lora_path": "other"})
                assert e.value.status == 404 and "not loaded" in e.value.message
                with pytest.raises(SGLangHTTPError) as e:
                    await c.request("POST", "/load_lora_adapter", {"lora_name": "x", "lora_path": str(tiny_model_dir)})
                assert e.value.status == 400 and "not a LoRA adapter folder" in e.value.message
                with pytest.raises(SGLangHTTPError) as e:
                    await c.request("POST", "/v1/unload_lora_adapter", {"lora_name": "never"})
                assert e.value.status == 404
                # vLLM's routes: a new adapter replaces the active one, and the old name gets the new weights
                # (labelled with the version in force, as after any weight update) until it is unloaded.
                await c.request("POST", "/v1/load_lora_adapter", {"lora_name": "v4", "lora_path": str(folder)})
                with pytest.raises(SGLangHTTPError) as e:  # the same name again: only with load_inplace
                    await c.request("POST", "/load_lora_adapter", {"lora_name": "v4", "lora_path": str(folder)})
                assert e.value.status == 400 and "already loaded" in e.value.message
                await c.request("POST", "/v1/load_lora_adapter", {"lora_name": "v4", "lora_path": str(folder),
                                                                  "load_inplace": True})
                old = await c.request("POST", "/generate", {"input_ids": PROMPT, "lora_path": "streamrl-v3",
                                                            "sampling_params": params, "return_logprob": True})
                assert old["output_ids"] == r["output_ids"]  # the same adapter, loaded under another name
                await c.request("POST", "/unload_lora_adapter", {"lora_name": "streamrl-v3"})
                with pytest.raises(SGLangHTTPError) as e:
                    await c.request("POST", "/generate", {"input_ids": PROMPT, "lora_path": "streamrl-v3"})
                assert e.value.status == 404
                # Unloading the active adapter puts the base weights back.
                await c.request("POST", "/unload_lora_adapter", {"lora_name": "v4"})
                c.lora_name = None
                back = await c.generate(PROMPT, params)
                assert back["output_ids"] == base["output_ids"]
                assert torch.equal(engine_logprobs(back), engine_logprobs(base))
        finally:
            await runner.cleanup()


# ---- runs -----------------------------------------------------------------------------------------------
LONG = dict(controller={"max_staleness": 2}, rollout={"group_size": 4, "max_new_tokens": 40},
            engines={"max_running_requests": 2}, trainer={"lr": 1e-4, "lora": {"rank": 8, "merge_final": True}})


async def test_an_async_lora_run_resumes_partials_across_adapter_versions(tmp_path: Path, tiny_model_dir: Path) -> None:
    """η = 2, long responses and few engine rows: adapter pushes land on samples in flight, which resume
    with the next adapter version and lose no token; final/ holds the adapter and the merged model."""
    cfg = config_from_dict(small_cfg(tmp_path, tiny_model_dir, **LONG, schedule={"steps": 6, "batch_groups": 2,
                                                                                  "save_every": 3}))
    summary = await run(cfg, **QUIET)
    rows = read_metrics(Path(summary["run_dir"]))
    assert len(rows) == 6 and sum(r["tokens_discarded"] for r in rows) == 0
    assert sum(r["partial_resumed"] for r in rows) > 0
    assert any(len(set(s.versions)) > 1 for g in read_groups(Path(summary["run_dir"])) for s in g.samples)
    final = Path(summary["final_model"])
    assert load_adapter(final).rank == 8 and (final / "merged" / "model.safetensors").is_file()
    ckpt = Path(summary["run_dir"]) / "checkpoints" / "step-3"
    assert (ckpt / "adapter_model.safetensors").is_file() and (ckpt / "optimizer.pt").is_file()
    # Resumed into the same folder: the trainer continues from the checkpoint's adapters.
    cfg2 = small_cfg(tmp_path, tiny_model_dir, **LONG, schedule={"steps": 6, "batch_groups": 2, "resume_from": str(ckpt)})
    second = await run(config_from_dict(cfg2), **QUIET)
    assert second["resumed_from"]["step"] == 3
    rows = read_metrics(Path(second["run_dir"]))
    assert [r["step"] for r in rows] == list(range(1, 7)) and sum(r["tokens_discarded"] for r in rows[3:]) == 0
    # Resuming a LoRA checkpoint as a full run is a config error naming the key.
    cfg3 = small_cfg(tmp_path, tiny_model_dir, schedule={"steps": 6, "batch_groups": 2, "resume_from": str(ckpt)})
    with pytest.raises(ConfigError, match="trainer.lora.rank: the checkpoint's run trained LoRA adapters"):
        await run(config_from_dict(cfg3), **QUIET)


@pytest.mark.slow
async def test_a_lora_run_on_launched_streamrl_serve_servers(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Two `streamrl serve` processes take every adapter through /load_lora_adapter (a peft folder)."""
    cfg = config_from_dict(small_cfg(tmp_path, tiny_model_dir, **{**LONG, "engines": {
        "pool": "http", "num_replicas": 2, "max_running_requests": 2}}))
    summary = await run(cfg, **QUIET)
    rows = read_metrics(Path(summary["run_dir"]))
    assert len(rows) == 6 and sum(r["tokens_discarded"] for r in rows) == 0
    assert sum(r["partial_resumed"] for r in rows) > 0
    # Every token the servers generated after the first push came from an adapter version they were given.
    versions = {v for g in read_groups(Path(summary["run_dir"])) for s in g.samples for v in s.versions}
    assert max(versions) >= 4


def run_cli(tmp_path: Path, *sets: str) -> subprocess.CompletedProcess:
    cmd = [*STREAMRL, "run", str(REPO / "configs" / "quickstart.yaml"), "--no-progress",
           "--set", f"run_dir={tmp_path / 'run'}", "--set", f"model.path={tmp_path / 'model'}",
           "--set", "warm_start.enabled=false", "--set", "trainer.lora.rank=8"]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)


@pytest.mark.parametrize(("sets", "line"), [
    (["trainer.lora.target_modules=[q_proj,nope]"],
     "config error: trainer.lora.target_modules: the model has no linear module 'nope'"),
    (["engines.pool=http", "engines.weight_sync=distributed"],
     "config error: trainer.lora.rank: LoRA pushes adapters through the servers' load_lora_adapter"),
    (["trainer.lora.target_modules=[all-linear,q_proj]"], "config error: trainer.lora.target_modules: all-linear"),
])
def test_lora_config_errors_are_one_line_before_any_work(tmp_path: Path, sets: list[str], line: str) -> None:
    p = run_cli(tmp_path, *sets)
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.strip().splitlines()[-1].startswith(line), p.stderr[-2000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_lora_settings_are_documented_keys() -> None:
    out = subprocess.run([*STREAMRL, "config"], capture_output=True, text=True, check=True).stdout
    for key in ("trainer.lora.rank", "trainer.lora.alpha", "trainer.lora.target_modules", "trainer.lora.merge_final"):
        assert key in out
    assert json.loads(json.dumps(LoraConfig().__struct_fields__))  # a plain section, as every other
