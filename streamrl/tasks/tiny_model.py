"""Builds tiny, randomly initialised Hugging Face causal LMs offline, for tests, the quickstart and benchmarks.

This module owns the character-level vocabulary (`TOKENS`) and the model presets. It writes a plain
HF folder (config, generation config, safetensors weights, tokenizer files) that the stock Auto
classes load, so nothing downstream needs to know the model is home-made. It knows nothing about
tasks or training.

Tokenizer design (why it is a byte-level BPE with zero merges): transformers 5 loads the tokenizer of
any ``model_type="qwen2"`` folder through ``Qwen2Tokenizer``, whatever tokenizer_config.json says, and
that class rebuilds the pipeline from the vocabulary (NFC normaliser, Qwen's split regex, byte-level
pre-tokenizer and decoder). A plain per-character vocabulary then silently maps a space, or a run such
as ``+-``, to ``<unk>``. Writing the vocabulary in the byte-level alphabet (space is ``Ġ``) with the
same pipeline and no merges gives every character its own id under both ``Qwen2Tokenizer`` and
``PreTrainedTokenizerFast``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARS: tuple[str, ...] = (*"0123456789", "+", "-", "*", "=", ",", ":", ">", ";", " ")
TOKENS: tuple[str, ...] = SPECIAL_TOKENS + CHARS
# An agent model (`agent=True`, `model.init: tiny_agent`) has more, after these: chat roles (the chat
# template below) and tool-call tags (`tools.*`' defaults), one token each, and lowercase letters
# (tool names, chat text). The ids of every token before them, and the weights of their rows, are
# the plain model's. (Kept out of the plain model: the quickstart learns less well with 34 more
# tokens to sample from.)
CHAT_TOKENS: tuple[str, ...] = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
TOOL_TOKENS: tuple[str, ...] = ("<tool>", "</tool>", "<result>", "</result>")
ADDED_TOKENS: tuple[str, ...] = CHAT_TOKENS + TOOL_TOKENS
LETTERS: tuple[str, ...] = tuple("abcdefghijklmnopqrstuvwxyz")
AGENT_TOKENS: tuple[str, ...] = TOKENS + ADDED_TOKENS + LETTERS
# A tool-calling model (`tools=True`, `model.init: tiny_tools`, `init-model --tools`) has more again:
# the tags of the Hermes / Qwen tool-call form, one token each, and the characters of JSON and of
# tool signatures; its chat template (TOOLS_CHAT_TEMPLATE) renders tools and tool calls in that form.
HERMES_TOKENS: tuple[str, ...] = ("<tools>", "</tools>", "<tool_call>", "</tool_call>", "<tool_response>",
                                  "</tool_response>")
JSON_CHARS: tuple[str, ...] = tuple('{}"_().?!/')
# ... and, as a real byte-level BPE has, merges for the pieces of JSON tool calls (Qwen's split regex
# cuts `{"name": "calculator"` into `{"` `name` `":` ` "` `calculator` ...), so a call is ~20 tokens
# rather than ~60: each piece one token (digits stay one character each, as in Qwen's tokenizer).
JSON_PIECES: tuple[str, ...] = ('{"', '":', ' "', '",', ' {"', '"}', '"}}', "name", "arguments", "calculator",
                                "expression")
TOOLS_TOKENS: tuple[str, ...] = AGENT_TOKENS + HERMES_TOKENS + JSON_CHARS
# A text model (`text=True`, `model.init: tiny_text`) has, after the plain model's tokens, every other
# printable ASCII character and the newline, one token each: the questions of reasoning-gym's tasks are
# English text. No chat template, no added tokens; the plain model's ids and their rows' weights stay.
TEXT_TOKENS: tuple[str, ...] = TOKENS + tuple(c for c in map(chr, range(33, 127)) if c not in CHARS) + ("\n",)
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
TOKEN_TO_ID: dict[str, int] = {tok: i for i, tok in enumerate(TOOLS_TOKENS)}
# A minimal chat template (jinja, as transformers renders it): <|role|>content<|end|> per message.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

# The tool-calling template: as above, and (Hermes / Qwen form) the tools declared in the system turn as
# `<tools>name(arg,arg)...</tools>` (signatures, not whole JSON schemas: every character is a token
# here), an assistant's tool calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` after its
# text, and a tool's result as a user turn `<tool_response>...</tool_response>`.
TOOLS_CHAT_TEMPLATE = (
    "{%- if tools %}{{ '<|system|>' }}{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% endif %}"
    "{{ '<tools>' }}{% for t in tools %}{% set f = t['function'] if t['function'] is defined else t %}"
    "{{ f['name'] + '(' }}{% if f['parameters'] is defined and f['parameters']['properties'] is defined %}"
    "{{ f['parameters']['properties'] | list | join(',') }}{% endif %}{{ ')' }}{% endfor %}{{ '</tools><|end|>' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' %}{% if not tools %}{{ '<|system|>' + m['content'] + '<|end|>' }}{% endif %}"
    "{%- elif m['role'] == 'assistant' %}{{ '<|assistant|>' }}{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% if m['tool_calls'] is defined and m['tool_calls'] %}{% for c in m['tool_calls'] %}"
    "{% set f = c['function'] if c['function'] is defined else c %}"
    "{{ '<tool_call>{\"name\": \"' + f['name'] + '\", \"arguments\": ' }}"
    "{% if f['arguments'] is string %}{{ f['arguments'] }}{% else %}{{ f['arguments'] | tojson }}{% endif %}"
    "{{ '}</tool_call>' }}{% endfor %}{% endif %}{{ '<|end|>' }}"
    "{%- elif m['role'] == 'tool' %}{{ '<|user|><tool_response>' + m['content'] + '</tool_response><|end|>' }}"
    "{%- else %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

# Same regex as transformers' Qwen2Tokenizer, so tokenizer.json matches what that class rebuilds.
_QWEN_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_SPECIAL_RE = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS + ADDED_TOKENS + HERMES_TOKENS) + ")")

PRESETS: dict[str, dict[str, Any]] = {
    # ~1.05 M parameters: the model measured to learn 2-digit addition under RL on a 2-core CPU.
    "tiny": dict(
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
    ),
    # ~4.2 M parameters.
    "small": dict(
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
    ),
    # ~85 M parameters: big enough that engine benchmarks are not pure host overhead.
    "bench100m": dict(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=12,
        max_position_embeddings=512,
    ),
    # ~0.1 B, Qwen2-shaped (grouped KV heads: 12 query, 2 KV, of 64): configs/gpu.yaml's policy.
    "qwen2-0.1b": dict(
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=512,
    ),
    # Qwen2.5-0.5B's layers (24 of them, 14 query / 2 KV heads of 64, SwiGLU 4864, 32k positions); with
    # `vocab_size=151936` its vocabulary too: the GPU engine benchmark's model (random weights).
    "qwen2.5-0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
    ),
}


def _byte_level(char: str) -> str:
    """The GPT-2 byte-to-unicode image of one of our characters (only space is remapped)."""
    code = ord(char)
    if 33 <= code <= 126:
        return char
    if char == " ":
        return "Ġ"  # byte 0x20 -> U+0120 in the GPT-2 byte-level alphabet
    if char == "\n":
        return "Ċ"  # byte 0x0A -> U+010A
    raise ValueError(f"character {char!r} is outside the tiny vocabulary's byte-level mapping")


def char_tokenizer_ids(text: str) -> list[int]:
    """Token ids of ``text`` by direct per-character lookup; special tokens written literally count as one.

    This is the reference the HF tokenizer is checked against; unknown characters map to ``<unk>``.
    """
    ids: list[int] = []
    for part in _SPECIAL_RE.split(text):
        if part in TOKEN_TO_ID and (part in SPECIAL_TOKENS or part in ADDED_TOKENS or part in HERMES_TOKENS):
            ids.append(TOKEN_TO_ID[part])
        else:
            ids.extend(TOKEN_TO_ID.get(ch, UNK_ID) for ch in part)
    return ids


def json_merges() -> tuple[list[str], list[tuple[str, str]]]:
    """The tool model's merged tokens (byte-level, after TOOLS_TOKENS) and the merges that make them:
    each piece built left to right, one character at a time."""
    tokens: list[str] = []
    merges: list[tuple[str, str]] = []
    for piece in JSON_PIECES:
        chars = [_byte_level(c) for c in piece]
        prefix = chars[0]
        for c in chars[1:]:
            if (prefix, c) not in merges:
                merges.append((prefix, c))
                tokens.append(prefix + c)
            prefix += c
    return tokens, merges


def tools_vocab_size() -> int:
    return len(TOOLS_TOKENS) + len(json_merges()[0])


def build_tokenizer(agent: bool = False, tools: bool = False, text: bool = False) -> Tokenizer:
    """The character-level tokenizer as a `tokenizers.Tokenizer` (byte-level BPE, zero merges; the
    tool model's has merges for JSON's pieces)."""
    tokens = TOOLS_TOKENS if tools else AGENT_TOKENS if agent else TEXT_TOKENS if text else TOKENS
    added = ADDED_TOKENS + HERMES_TOKENS if tools else ADDED_TOKENS if agent else ()
    vocab = {tok if tok in SPECIAL_TOKENS or tok in added else _byte_level(tok): i
             for i, tok in enumerate(tokens)}
    merged, merges = json_merges() if tools else ([], [])
    vocab |= {t: len(vocab) + i for i, t in enumerate(merged)}
    tok = Tokenizer(
        BPE(vocab=vocab, merges=merges, unk_token="<unk>", continuing_subword_prefix="", end_of_word_suffix="")
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS + added])
    return tok


def _write_tokenizer(out: Path, agent: bool = False, tools: bool = False, text: bool = False) -> None:
    tok = build_tokenizer(agent, tools, text)
    tok.save(str(out / "tokenizer.json"))
    # vocab.json + merges.txt let loaders that rebuild from files (Qwen2Tokenizer's slow path) agree too.
    vocab = tok.get_vocab(with_added_tokens=True)
    (out / "vocab.json").write_text(json.dumps(dict(sorted(vocab.items(), key=lambda kv: kv[1]))))
    merges = json_merges()[1] if tools else []
    (out / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    special = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>"}
    config = {
        **special,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1_000_000,
        "add_bos_token": False,  # callers prepend <bos> explicitly; no hidden post-processing
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
    }
    if tools:
        config |= {"chat_template": TOOLS_CHAT_TEMPLATE, "extra_special_tokens": list(ADDED_TOKENS + HERMES_TOKENS)}
    elif agent:
        config |= {"chat_template": CHAT_TEMPLATE, "extra_special_tokens": list(ADDED_TOKENS)}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2))


def model_config(preset: str = "tiny", *, arch: str = "qwen2", **overrides: Any) -> Any:
    """The transformers config for a preset; ``overrides`` replace any config field."""
    from transformers import LlamaConfig, Qwen2Config

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
    fields: dict[str, Any] = dict(
        vocab_size=len(TOKENS),
        tie_word_embeddings=True,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        use_cache=True,
        **PRESETS[preset],
    )
    fields.update(overrides)
    if arch == "qwen2":
        return Qwen2Config(**fields)
    if arch == "llama":
        return LlamaConfig(**fields)
    raise ValueError(f"unknown arch {arch!r}; expected 'qwen2' or 'llama'")


def build_tiny_model(
    out_dir: str | Path,
    *,
    preset: str = "tiny",
    seed: int = 0,
    arch: str = "qwen2",
    agent: bool = False,
    tools: bool = False,
    text: bool = False,
    **overrides: Any,
) -> Path:
    """Write a randomly initialised HF model folder for ``preset`` to ``out_dir`` and return its path.

    Same (preset, arch, agent, overrides, seed) gives bit-identical weights. ``agent``: the chat and
    tool tokens, letters and a chat template too (the plain model's weights, with rows for them);
    ``tools``: an agent model with the Hermes tool-call tags, JSON's characters, a template that
    renders tools and tool calls, and 256 positions; ``text`` (not with those): the plain model with
    rows for the rest of printable ASCII and the newline (TEXT_TOKENS), and 128 positions.
    Pass ``dtype="bfloat16"`` to store the weights in another dtype (default float32); other
    overrides are config fields.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    dtype_name = str(overrides.pop("dtype", "float32"))
    dtype = getattr(torch, dtype_name.removeprefix("torch."))
    agent = agent or tools
    if tools:
        overrides.setdefault("max_position_embeddings", 256)
    if text and agent:
        raise ValueError("text is a vocabulary of its own: not with agent or tools")
    if text:
        overrides.setdefault("max_position_embeddings", 128)
    config = model_config(preset, arch=arch, **overrides)  # the plain vocabulary unless overridden
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # fork_rng: seeding must not disturb the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if agent:  # rows for the added tokens from their own generator: the plain model's weights stay
            n = tools_vocab_size() if tools else len(AGENT_TOKENS)
            _add_token_rows(model, n - len(TOKENS), seed, config.initializer_range)
        if text:
            _add_token_rows(model, len(TEXT_TOKENS) - len(TOKENS), seed, config.initializer_range)
    model = model.to(dtype)
    # An agent model's chat turns end with <|end|>, the token its template writes after an answer.
    eos = [EOS_ID, TOKEN_TO_ID["<|end|>"]] if agent else EOS_ID
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=eos, pad_token_id=PAD_ID,
                                               max_new_tokens=16)
    model.save_pretrained(out)
    _write_tokenizer(out, agent, tools, text)
    return out


def _add_token_rows(model: Any, n: int, seed: int, std: float) -> None:
    """`n` more embedding rows (the head is tied), drawn like the others but from their own stream."""
    old = model.get_input_embeddings().weight.data
    gen = torch.Generator().manual_seed(seed + 1)
    rows = torch.randn(n, old.shape[1], generator=gen) * std
    model.resize_token_embeddings(old.shape[0] + n, mean_resizing=False)
    model.get_input_embeddings().weight.data[-n:] = rows
    model.config.vocab_size = old.shape[0] + n


def count_parameters(model: torch.nn.Module) -> int:
    """Unique parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())
