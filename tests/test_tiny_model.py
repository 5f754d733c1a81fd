"""The tiny model builder writes folders the stock Auto classes load, with a lossless character tokenizer."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from helpers import STREAMRL
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

from streamrl.tasks.tiny_model import (
    AGENT_TOKENS,
    BOS_ID,
    EOS_ID,
    PAD_ID,
    TOKENS,
    UNK_ID,
    build_tiny_model,
    char_tokenizer_ids,
    count_parameters,
    model_config,
)

ROUND_TRIP = ["37+48= 85", "+-", "  1 , 2 ;>:*", "12*3=36;4-1>2", "99+99=198"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def test_folder_loads_through_auto_classes(tiny_dir: Path) -> None:
    names = {p.name for p in tiny_dir.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert 0.9e6 < count_parameters(model) < 1.2e6
    assert model.config.vocab_size == len(TOKENS) == 23
    assert (model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id) == (0, 1, 2)
    gen = model.generation_config
    assert (gen.pad_token_id, gen.bos_token_id, gen.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    assert model.config.tie_word_embeddings
    assert next(model.parameters()).dtype == torch.float32
    logits = model(input_ids=torch.tensor([char_tokenizer_ids("<bos>37+48=")])).logits
    assert logits.shape == (1, 7, 23)


@pytest.mark.parametrize("loader", [AutoTokenizer, PreTrainedTokenizerFast, Qwen2Tokenizer])
def test_tokenizer_round_trip_matches_char_ids(tiny_dir: Path, loader: type) -> None:
    tok = loader.from_pretrained(tiny_dir)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert len(tok) == len(TOKENS)
    for text in ROUND_TRIP:
        ids = tok.encode(text, add_special_tokens=False)
        assert UNK_ID not in ids, text
        assert ids == char_tokenizer_ids(text) == [TOKENS.index(c) for c in text]
        assert tok.decode(ids) == text
    ids = tok.encode("<bos>37+48=85<eos>", add_special_tokens=False)
    assert ids == [1, 7, 11, 14, 8, 12, 17, 12, 9, 2]
    assert tok.decode(ids, skip_special_tokens=True) == "37+48=85"
    # No hidden post-processing: callers add <bos> themselves.
    assert tok("37+48=")["input_ids"] == char_tokenizer_ids("37+48=")


def test_char_tokenizer_ids_unknown_chars() -> None:
    assert char_tokenizer_ids("1A<eos>") == [5, UNK_ID, EOS_ID]


def test_an_agent_model_adds_chat_and_tool_tokens_to_the_same_weights(tiny_dir: Path, tmp_path: Path) -> None:
    """`agent=True`: chat and tool tags one token each (special: dropped by skip_special_tokens),
    letters for tool names, a chat template; every weight of the plain model the same, with rows added."""
    agent = build_tiny_model(tmp_path / "agent", preset="tiny", seed=0, agent=True)
    tok = AutoTokenizer.from_pretrained(agent)
    assert len(tok) == len(AGENT_TOKENS) == 57  # 4 special, 19 characters, 8 chat/tool tokens, 26 letters
    ids = tok.encode("<|user|>3*4<|end|><tool>calculator: 3*4</tool><result>12</result>", add_special_tokens=False)
    assert ids == char_tokenizer_ids(tok.decode(ids))
    assert tok.convert_ids_to_tokens(ids[:1] + ids[4:6]) == ["<|user|>", "<|end|>", "<tool>"]
    assert tok.decode(ids, skip_special_tokens=True) == "3*4calculator: 3*412"
    chat = tok.apply_chat_template([{"role": "user", "content": "3*4"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|user|>3*4<|end|><|assistant|>"
    plain = AutoModelForCausalLM.from_pretrained(tiny_dir).state_dict()
    grown = AutoModelForCausalLM.from_pretrained(agent).state_dict()
    for k, v in plain.items():
        assert torch.equal(grown[k][: v.shape[0]], v), k


def test_same_seed_same_weights(tmp_path: Path) -> None:
    a = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "a", seed=3)).state_dict()
    b = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "b", seed=3)).state_dict()
    c = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "c", seed=4)).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_seed_does_not_disturb_global_rng(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "m", seed=0)
    assert torch.equal(torch.rand(3), expected)


def test_llama_arch_and_overrides(tmp_path: Path) -> None:
    out = build_tiny_model(tmp_path / "llama", arch="llama", num_hidden_layers=2, dtype="bfloat16")
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_hidden_layers == 2
    assert next(model.parameters()).dtype == torch.bfloat16
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.encode("37+48= 85", add_special_tokens=False) == char_tokenizer_ids("37+48= 85")


@pytest.mark.parametrize(("preset", "low", "high"), [("small", 3e6, 5e6), ("bench100m", 50e6, 100e6)])
def test_preset_sizes(preset: str, low: float, high: float) -> None:
    # The meta device counts parameters without allocating or initialising them.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config(preset))
    assert low < count_parameters(model) < high


def test_unknown_preset_and_arch(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown preset"):
        build_tiny_model(tmp_path, preset="huge")
    with pytest.raises(ValueError, match="unknown arch"):
        build_tiny_model(tmp_path, arch="gpt2")


def test_a_tools_model_renders_tools_and_calls_in_the_hermes_form(tmp_path: Path) -> None:
    """`init-model --tools` (through the console script): the agent model's weights with rows added,
    a template that declares tools and writes calls as `<tool_call>{json}</tool_call>`, JSON's pieces
    merged (a call ~20 tokens), and text that re-tokenizes to the same ids."""
    out = tmp_path / "tools"
    p = subprocess.run([*STREAMRL, "init-model", str(out), "--tools"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    tok = AutoTokenizer.from_pretrained(out)
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}}}}]
    call = {"id": "c", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "3*4"}'}}
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "3*4"},
            {"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": "12"}]
    text = tok.apply_chat_template(chat, tools=tools, add_generation_prompt=True, tokenize=False)
    assert text == ('<|system|>be brief<tools>calculator(expression)</tools><|end|><|user|>3*4<|end|><|assistant|>'
                    '<tool_call>{"name": "calculator", "arguments": {"expression": "3*4"}}</tool_call><|end|>'
                    '<|user|><tool_response>12</tool_response><|end|><|assistant|>')
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=False) == text and tok.unk_token_id not in ids
    start, end = ids.index(tok.convert_tokens_to_ids("<tool_call>")), ids.index(tok.convert_tokens_to_ids("</tool_call>"))
    assert end - start - 1 == 18  # {" name ": Ġ" calculator ", Ġ" arguments ": Ġ {" expression ": Ġ" 3 * 4 "}}
    plain = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "agent", agent=True)).state_dict()
    grown = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert grown["model.embed_tokens.weight"].shape[0] == len(tok) > len(AGENT_TOKENS)
    for k, v in plain.items():
        assert torch.equal(grown[k][: v.shape[0]], v), k
