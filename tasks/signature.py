"""The sampling signature: a stable hash of canonical sampling params."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from rollout_queue.tasks.schemas import SamplingParams


def signature(params: SamplingParams | Mapping[str, Any]) -> str:
    """Same params in any key order (defaults spelled out or not) → same signature."""
    if not isinstance(params, SamplingParams):
        params = SamplingParams.model_validate(dict(params))
    blob = json.dumps(params.canonical(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
