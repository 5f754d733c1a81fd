"""A short sloppy-teacher warm start learns, writes a loadable folder, and is cached by content."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from streamrl.tasks import addition
from streamrl.tasks import warm as sft
from streamrl.tasks.tiny_model import build_tiny_model

SHORT = dict(steps=50, batch_size=64, eval_samples=64)
TINY = dict(steps=2, batch_size=8, eval_samples=8)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("base"), seed=0)


@pytest.fixture(scope="module")
def short_run(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("warm")
    seen: list[int] = []
    metrics = addition.warm_start(base_dir, out, progress=lambda step, loss: seen.append(step), **SHORT)
    assert seen == list(range(SHORT["steps"]))
    return out, metrics


def test_short_warm_start_lowers_loss(short_run: tuple[Path, dict[str, Any]]) -> None:
    _, metrics = short_run
    assert metrics["loss_last"] < 0.8 * metrics["loss_first"]
    assert 0.0 <= metrics["greedy_accuracy"] <= 1.0
    assert 0.0 <= metrics["sampled_accuracy"] <= 1.0
    assert metrics["held_out_size"] == 64
    assert metrics["split_seed"] == 0  # follows `seed` unless given


def test_warm_start_folder_loads_and_differs_from_base(
    short_run: tuple[Path, dict[str, Any]], base_dir: Path
) -> None:
    out, metrics = short_run
    assert sft.load_warm_start_metrics(out) == metrics
    model = AutoModelForCausalLM.from_pretrained(out)
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.encode("37+48= 85", add_special_tokens=False) == [7, 11, 14, 8, 12, 17, 22, 12, 9]
    assert model.generation_config.eos_token_id == 2
    w, w0 = model.state_dict(), base.state_dict()
    assert w.keys() == w0.keys()
    assert not torch.equal(w["model.embed_tokens.weight"], w0["model.embed_tokens.weight"])
    # After 50 steps the model has at least learnt the answer format: digits, then eos.
    responses = addition.generate_responses(model, tok, ["37+48=", "10+10="], temperature=0.0)
    assert all(r.isdigit() and 2 <= len(r) <= 3 for r in responses), responses


def test_sampling_is_seeded(short_run: tuple[Path, dict[str, Any]]) -> None:
    out, _ = short_run
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    prompts = [f"{a}+{a}=" for a in range(10, 40)]
    one = addition.generate_responses(model, tok, prompts, temperature=1.0, seed=5)
    two = addition.generate_responses(model, tok, prompts, temperature=1.0, seed=5)
    assert one == two
    with pytest.raises(ValueError, match="answers"):
        addition.evaluate_accuracy(model, tok, prompts, ["1"], temperature=0.0)


RECIPE = addition.warm_start


def test_cache_reuses_finished_runs(base_dir: Path, tmp_path: Path) -> None:
    first = sft.cached_warm_start(RECIPE, base_dir, tmp_path, **TINY)
    assert (first / sft.MARKER).is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]

    def boom(*args: Any, **kwargs: Any) -> dict[str, Any]:
        raise AssertionError("a cached warm start must not retrain")

    boom.__module__, boom.__qualname__ = RECIPE.__module__, RECIPE.__qualname__  # the same recipe, by name and code
    boom.__signature__ = __import__("inspect").signature(RECIPE)  # type: ignore[attr-defined]
    assert sft.cached_warm_start(boom, base_dir, tmp_path, **TINY) == first
    # Defaults spelled out give the same key; a changed recipe gives a new one.
    assert sft.warm_start_key(RECIPE, base_dir, **TINY, lr=1e-3) == sft.warm_start_key(RECIPE, base_dir, **TINY)
    assert sft.warm_start_key(RECIPE, base_dir, **TINY, seed=1) != sft.warm_start_key(RECIPE, base_dir, **TINY)
    with pytest.raises(AssertionError, match="must not retrain"):
        sft.cached_warm_start(boom, base_dir, tmp_path, **TINY, seed=1)


def test_cache_ignores_unfinished_folder(base_dir: Path, tmp_path: Path) -> None:
    final = tmp_path / f"warm-{sft.warm_start_key(RECIPE, base_dir, **TINY)}"
    final.mkdir()
    (final / "config.json").write_text("{}")  # what a killed run might leave behind
    assert sft.cached_warm_start(RECIPE, base_dir, tmp_path, **TINY) == final
    assert (final / sft.MARKER).is_file()
    AutoModelForCausalLM.from_pretrained(final)


def test_cache_key_covers_the_base_folder_the_code_and_the_recipe(base_dir: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Anything that changes what a warm start trains changes its key: the base weights, its tokenizer,
    the source of the recipe's module or of the streamrl modules it uses, another recipe."""
    from streamrl.tasks import addition_judge, multiply

    key = sft.warm_start_key(RECIPE, base_dir, **TINY)
    other = build_tiny_model(tmp_path / "other", seed=1)
    assert sft.warm_start_key(RECIPE, other, **TINY) != key
    copy = tmp_path / "copy"
    __import__("shutil").copytree(base_dir, copy)
    assert sft.warm_start_key(RECIPE, copy, **TINY) == key  # the same content, another place
    (copy / "tokenizer_config.json").write_text((copy / "tokenizer_config.json").read_text() + " ")
    assert sft.warm_start_key(RECIPE, copy, **TINY) != key
    files = {f.name for f in sft._code_files(RECIPE)}
    assert {"addition.py", "warm.py"} <= files
    assert {"addition.py", "addition_judge.py", "tiny_model.py"} <= {f.name for f in sft._code_files(addition_judge.warm_start)}
    assert sft.warm_start_key(multiply.warm_start, base_dir, steps=2, batch_size=8) != sft.warm_start_key(
        RECIPE, base_dir, steps=2, batch_size=8)
    real = sft._hash_files

    def edited(h: Any, paths: list[Path]) -> None:  # as if addition.py had one more line
        real(h, paths)
        if any(p.name == "addition.py" for p in paths):
            h.update(b"# an edit")

    monkeypatch.setattr(sft, "_hash_files", edited)
    assert sft.warm_start_key(RECIPE, base_dir, **TINY) != key
