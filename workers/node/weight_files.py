"""What the worker's checkpoint holds: names, dtypes and shapes from safetensors headers.

A sync manifest is checked against this before any weight changes, so a
wrong name or shape is refused up front, not half-way through a load; and a
worker catching up through a relay takes the new version only once an update
brought every tensor a whole model needs (:func:`whole_model`).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}


def model_dir(model: str) -> Path | None:
    path = Path(model)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True))
    except Exception:  # noqa: BLE001  not cached locally: nothing to check against
        return None


def checkpoint_shapes(model: str) -> dict[str, list[int]] | None:
    """Tensor name → shape for every tensor in the checkpoint, or None if unknown."""
    folder = model_dir(model)
    if folder is None:
        return None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    shapes: dict[str, list[int]] = {}
    for file in files:
        with file.open("rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
        for name, meta in header.items():
            if name != "__metadata__":
                shapes[name] = list(meta["shape"])
    return shapes


def whole_model(model: str, shapes: dict[str, list[int]]) -> set[str]:
    """The tensors of checkpoint ``shapes`` that an update must bring for the whole
    model to change: all of them, less ``lm_head.weight`` where the model ties it to
    the embeddings (vLLM's models skip it then, and a trainer sends the tied tensor once)."""
    required = set(shapes)
    folder = model_dir(model)
    config = folder / "config.json" if folder is not None else None
    if config is not None and config.is_file():
        text = json.loads(config.read_text())
        tied = text.get("tie_word_embeddings", text.get("text_config", {}).get("tie_word_embeddings", False))
        if tied:
            required.discard("lm_head.weight")
    return required
