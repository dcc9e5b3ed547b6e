"""Build small random-weight models that vLLM loads, for tests and the quickstart.

``llama``: a tiny Llama (head_dim 64, float32) with a byte-level tokenizer of
256 byte tokens plus chat specials, so every string tokenizes and every
sampled id decodes. ``qwen2-0.5b``: a Qwen2 shaped like Qwen2-0.5B (bf16) with
a WordLevel tokenizer of 32,000 tokens ``t0 … t31999``, for GPU runs.
Weights are random (norms stay at 1.0, or logits collapse to ties); the same
seed gives the same weights, another seed other weights of the same shapes.
Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SPECIALS = ["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]
# ChatML, with tools and tool calls rendered the Hermes way (Qwen's): the
# function specs in a system turn, each call as <tool_call>{json}</tool_call>;
# enable_thinking=False closes an empty think block, as Qwen3's template does.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}<tool_call>\n"
    "{\"name\": {{ call['function']['name'] | tojson }}, \"arguments\": {{ call['function']['arguments'] | tojson }}}"
    "\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def _byte_level_tokenizer():  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return tok


def _word_level_tokenizer(vocab_size: int):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size - len(SPECIALS))}
    for i, special in enumerate(SPECIALS):
        vocab[special] = vocab_size - len(SPECIALS) + i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|eos|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(SPECIALS)
    return tok


def _save_tokenizer(tok, path: Path) -> None:  # type: ignore[no-untyped-def]
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|eos|>",
        unk_token="<|eos|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


QWEN2_SHAPES = {
    # Qwen2-0.5B and Qwen2-7B layer shapes, with a 32,000-token WordLevel vocabulary
    # for 0.5B (every sampled id decodes) and the real vocabulary size for 7B.
    "qwen2-0.5b": {"vocab_size": 32000, "hidden_size": 896, "intermediate_size": 4864,
                       "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
                       "tie_word_embeddings": True},
    # A small Qwen2 for measuring what a sync costs beyond its bytes (8.4 M parameters).
    "qwen2-tiny": {"vocab_size": 32000, "hidden_size": 256, "intermediate_size": 512,
                   "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "tie_word_embeddings": True},
    "qwen2-7b": {"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
                     "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                     "tie_word_embeddings": False},
}


# What the config files this writes have always said (transformers' stubs know only ``dtype``).
FLOAT32: dict[str, Any] = {"torch_dtype": "float32"}


def qwen2_config(kind: str, dtype: str = "bfloat16"):  # type: ignore[no-untyped-def]
    from transformers import Qwen2Config

    options: dict[str, Any] = {
        **QWEN2_SHAPES[kind], "max_position_embeddings": 4096, "initializer_range": 0.02,
        "bos_token_id": 31996, "eos_token_id": 31997, "torch_dtype": dtype,
    }
    return Qwen2Config(**options)


def make_tiny_model(
    path: str | Path, seed: int = 0, kind: str = "llama", *, weights: bool = True,
    dtype: str | None = None, device: str = "cpu",
) -> Path:
    """Write a random model and its tokenizer to ``path``; returns the path.

    ``weights=False`` writes only the config and tokenizer (for engines started
    with ``load_format="dummy"``, which draw random weights themselves).
    """
    import torch

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        tok = _byte_level_tokenizer()
        config = LlamaConfig(
            vocab_size=tok.get_vocab_size(),
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            max_position_embeddings=2048,
            initializer_range=0.2,
            # Tied, as in most small real models (Qwen2/2.5-0.5B, Llama-3.2-1B): the
            # weight-sync tests then cover the tied head (weight_sync.receiver).
            tie_word_embeddings=True,
            bos_token_id=tok.token_to_id("<|bos|>"),
            eos_token_id=tok.token_to_id("<|eos|>"),
            **FLOAT32,
        )
        model_cls: Any = LlamaForCausalLM
        torch_dtype = torch.float32
    elif kind in QWEN2_SHAPES:
        from transformers import Qwen2ForCausalLM

        tok = _word_level_tokenizer(32000)
        config = qwen2_config(kind, dtype or "bfloat16")
        model_cls, torch_dtype = Qwen2ForCausalLM, getattr(torch, dtype or "bfloat16")
    else:
        raise ValueError(f"unknown model kind {kind!r}; use 'llama', {', '.join(QWEN2_SHAPES)}")
    if weights:
        torch.manual_seed(seed)
        with torch.device(device):
            model = model_cls(config).to(torch_dtype)
        model.save_pretrained(str(path), safe_serialization=True)
    else:
        config.save_pretrained(str(path))
    _save_tokenizer(tok, path)
    (path / "rollout_queue.json").write_text(json.dumps({"kind": kind, "seed": seed}))
    return path
