"""``TokenNamer``: how logprob tokens are spelled in responses.

OpenAI responses name each token by a string (and, in chat, its UTF-8
bytes). Without a tokenizer the gateway spells token ``N`` as
``"token_id:N"``, vLLM's ``--return-tokens-as-token-ids`` format: exact,
free, and parsed back by RL tooling. With ``RQ_API_TOKENIZER`` set, tokens are
decoded with that Hugging Face tokenizer (``transformers`` only, never vLLM),
and for byte-level BPE vocabularies the bytes are the token's real bytes, so
a character split across tokens can be put back together.
"""

from __future__ import annotations

import functools
from typing import Any


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-character alphabet for the 256 byte values, inverted."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, codes)}


class TokenNamer:
    """Token id → display string and UTF-8 bytes, cached per id."""

    def __init__(self, tokenizer: Any | None = None, *, as_ids: bool = False) -> None:
        """``as_ids``: spell every token ``"token_id:N"`` though a tokenizer is loaded
        (a request's ``return_tokens_as_token_ids``); the tokenizer still decodes echoes."""
        self._tokenizer = tokenizer
        self._as_ids = as_ids
        self._names: dict[int, tuple[str, list[int] | None]] = {}
        self._byte_level = tokenizer is not None and _is_byte_level(tokenizer)

    @classmethod
    def load(cls, name: str | None) -> TokenNamer:
        """Load ``name`` with ``transformers.AutoTokenizer`` (None: token ids)."""
        if name is None:
            return cls(None)
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(name))

    @property
    def tokenizer(self) -> Any | None:
        """The loaded tokenizer (``RQ_API_TOKENIZER``), or None."""
        return self._tokenizer

    @property
    def vocab_size(self) -> int | None:
        """Ids below this are tokens of the tokenizer (None: no tokenizer loaded)."""
        return None if self._tokenizer is None else len(self._tokenizer)

    def name(self, token_id: int) -> str:
        return self._entry(token_id)[0]

    def bytes_of(self, token_id: int) -> list[int] | None:
        return self._entry(token_id)[1]

    def _entry(self, token_id: int) -> tuple[str, list[int] | None]:
        entry = self._names.get(token_id)
        if entry is None:
            entry = self._names[token_id] = self._spell(token_id)
        return entry

    def _spell(self, token_id: int) -> tuple[str, list[int] | None]:
        if self._tokenizer is None or self._as_ids:
            return f"token_id:{token_id}", None  # bytes unknown without the vocabulary
        text = self._tokenizer.decode([token_id])
        if self._byte_level and token_id not in self._tokenizer.all_special_ids:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            decoder = _byte_decoder()
            if isinstance(piece, str) and all(ch in decoder for ch in piece):
                return text, [decoder[ch] for ch in piece]
        return text, list(text.encode("utf-8", errors="replace"))


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return type(decoder).__name__ == "ByteLevel"
