"""The default policy: a small Qwen2-architecture model with a byte-level tokenizer and a
Qwen2.5-style chat template with tool calls, saved as an ordinary Hugging Face checkpoint.

No model can be downloaded (ARCHITECTURE.md "CPU machines and vLLM"), so the project makes its own.
The tokenizer is byte-level BPE, as Qwen2.5's: every byte is a token, so any text can be spelled,
and merges learned from the environments' own oracle episodes (`corpus`) make those episodes ~4x
shorter than bytes (the tool schemas alone were 1.4k byte tokens of every prompt): shorter
sequences for SFT, rollouts and the learner, and fewer sampled tokens that can go wrong.
`vocab_size=256` keeps bytes only (no merges, no corpus needed). The seven control tokens are
added tokens, as in Qwen2.5. head_dim is 64 because vLLM's CPU attention refuses smaller heads;
float32 because bf16 crashed vLLM on CPU.

Example:

    from pipeline.policy.model_init import PolicyModelSettings, init_model
    init_model(PolicyModelSettings(vocab_size=256), Path("/tmp/policy"))   # bytes only
    init_model(PolicyModelSettings(), Path("/tmp/policy"), corpus=texts)    # merges learned from texts
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, model_validator
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

IM_START, IM_END, END_OF_TEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOL_RESPONSE, TOOL_RESPONSE_END = "<tool_response>", "</tool_response>"
# (token, special): like Qwen2.5, the tool tags are added tokens that survive skip_special_tokens.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    (END_OF_TEXT, True), (IM_START, True), (IM_END, True),
    (TOOL_CALL, False), (TOOL_CALL_END, False), (TOOL_RESPONSE, False), (TOOL_RESPONSE_END, False),
)
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
BYTE_VOCAB = 256  # a vocabulary of bytes alone: no merges
# transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX, restated so the saved file is explicit.
QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen2.5-Instruct's template, with two changes: a neutral default system prompt, and tool-call
# arguments given as a JSON string (OpenAI style) are written verbatim instead of re-quoted.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- '" + DEFAULT_SYSTEM_PROMPT + "' }}{%- endif %}"
    "{{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\\\"name\\\": <function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}"
    "{%- else %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class PolicyModelSettings(BaseModel):
    """Shape of the default policy: a few million parameters, small enough for two CPU cores."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hidden_size: int = 256
    """Model width (no paper default: the paper trains Qwen2.5 7B/14B; this is a CPU stand-in)."""
    num_layers: int = 4
    """Transformer blocks."""
    num_heads: int = 4
    """Query heads; hidden_size / num_heads must be 64 (vLLM CPU attention needs head_dim 64)."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention, as in Qwen2.5)."""
    intermediate_size: int = 512
    """SwiGLU width."""
    max_position_embeddings: int = 8192
    """Context length: the paper's max_total_len 8192."""
    rope_theta: float = 10_000.0
    """RoPE base. Qwen2.5 uses 1e6 for its long context; at 1e6 most of a 64-dim head's rotations barely
    turn over a few hundred tokens, and our from-scratch model trained on calc demonstrations never
    read the question (same constant tool calls for every task); at 1e4 (Llama's, GPT-NeoX's) the
    same data taught it to pick the operation and copy operands."""
    seed: int = 0
    """Seed of the random initialization: the same seed gives byte-identical weights."""
    vocab_size: int = 2048
    """Byte-level BPE vocabulary before the added tokens, merges learned from the environments' oracle
    episodes (Qwen2.5 has 151k learned from the web; 2048 is where merges on our episodes saturate,
    ~4x shorter than bytes); 256 = bytes only, no corpus needed."""

    @model_validator(mode="after")
    def _head_dim_is_64(self) -> PolicyModelSettings:
        if self.hidden_size % self.num_heads or self.hidden_size // self.num_heads != 64:
            raise ValueError(f"hidden_size / num_heads must be 64, got {self.hidden_size}/{self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.vocab_size < BYTE_VOCAB:
            raise ValueError(f"vocab_size must be at least {BYTE_VOCAB} (every byte is a token), got {self.vocab_size}")
        return self


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character of each byte (what the ByteLevel pre-tokenizer emits)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _byte_model() -> models.BPE:
    """Bytes alone: token id == byte value for ids 0..255."""
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    return models.BPE(vocab=vocab, merges=[], continuing_subword_prefix="", end_of_word_suffix="",
                      fuse_unk=False, byte_fallback=False)


def build_tokenizer(corpus: Sequence[str] = (), vocab_size: int = BYTE_VOCAB) -> PreTrainedTokenizerFast:
    """The byte-level BPE tokenizer: bytes alone, or with merges learned from `corpus` up to `vocab_size`.

    transformers' AutoTokenizer loads every `qwen2` checkpoint as Qwen2Tokenizer, which keeps the
    vocabulary and merges of tokenizer.json but rebuilds the rest of the pipeline (NFC, Qwen's
    split regex, ByteLevel). The pipeline here is that one, so the tokenizer we save is the one
    every loader (ours, the learner's, vLLM's) gets back. NFC means a non-NFC string does not
    survive decode -> encode (the agent loop checks for that). Training is deterministic: the same
    corpus gives the same merges.
    """
    if vocab_size < BYTE_VOCAB:
        raise ValueError(f"vocab_size must be at least {BYTE_VOCAB}, got {vocab_size}")
    if vocab_size > BYTE_VOCAB and not corpus:
        raise ValueError(f"a vocabulary of {vocab_size} needs a corpus to learn its merges from")
    backend = Tokenizer(_byte_model() if vocab_size == BYTE_VOCAB else models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = _pre_tokenizer()
    backend.decoder = decoders.ByteLevel()
    if vocab_size > BYTE_VOCAB:
        # The whole byte alphabet first, whether the corpus has every byte or not: any text stays spellable.
        backend.train_from_iterator(list(corpus), trainers.BpeTrainer(
            vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
        # As Qwen2Tokenizer rebuilds them on load, so the saved file is exactly what loaders get back.
        backend.model.continuing_subword_prefix = ""
        backend.model.end_of_word_suffix = ""
    backend.add_tokens([AddedToken(text, special=special, normalized=False) for text, special in ADDED_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        chat_template=CHAT_TEMPLATE,
        model_max_length=PolicyModelSettings().max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )


def build_config(settings: PolicyModelSettings, tokenizer: PreTrainedTokenizerFast) -> Qwen2Config:
    """Qwen2 config sized for the tokenizer (no padded vocabulary: an id the tokenizer lacks could be sampled)."""
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=settings.hidden_size,
        intermediate_size=settings.intermediate_size,
        num_hidden_layers=settings.num_layers,
        num_attention_heads=settings.num_heads,
        num_key_value_heads=settings.num_kv_heads,
        max_position_embeddings=settings.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": settings.rope_theta},
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(END_OF_TEXT),
        dtype="float32",
    )


def init_model(settings: PolicyModelSettings, out: Path, corpus: Sequence[str] | None = None) -> dict[str, object]:
    """Writes config, weights (safetensors), tokenizer and generation config to `out`; returns a summary.

    `corpus`: the texts the tokenizer's merges are learned from; None = the environments' oracle
    episodes (pipeline.policy.tokenizer_corpus.default_corpus), unused when settings.vocab_size is 256.
    """
    if corpus is None and settings.vocab_size > BYTE_VOCAB:
        from pipeline.policy.tokenizer_corpus import default_corpus  # runs the environments: only when merges are learned

        corpus = default_corpus()
    tokenizer = build_tokenizer(corpus or (), settings.vocab_size)
    config = build_config(settings, tokenizer)
    torch.manual_seed(settings.seed)
    model = Qwen2ForCausalLM(config).to(torch.float32).eval()
    # Only eos: sampling settings come with each request, so the served defaults cannot drift.
    model.generation_config = GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, bos_token_id=None
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    # save_jinja_files=False keeps the template inside tokenizer_config.json, where every loader looks.
    tokenizer.save_pretrained(out, save_jinja_files=False)
    return {
        "out": str(out),
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": config.vocab_size,
        "merges": settings.vocab_size - BYTE_VOCAB,
        "hidden_size": settings.hidden_size,
        "num_layers": settings.num_layers,
        "head_dim": settings.hidden_size // settings.num_heads,
        "seed": settings.seed,
    }
