"""The surfaces of ``EngineHost`` that other code uses, named as ``Protocol``s.

Each user of the engine host depends on the part it calls, so a fake of that
part (tests, benchmarks) type-checks without an engine:

- :class:`GenerationHost` — the generation service (``workers.node.service``);
- :class:`SyncHost` — the weight-sync participant (``workers.node.sync``);
- ``RunHost`` — a generation run (``workers.engine.run``);
- ``Probed`` — the liveness watch (``workers.engine.liveness``);
- ``Engine`` — the intake (``workers.queue.intake``: the queue room imports
  nothing of the engine's, so it names its own).
"""

from __future__ import annotations

from typing import Any, Protocol

from rollout_queue.tasks.schemas import GenerateRequest, PauseMode, PromptOutput
from rollout_queue.workers.engine.liveness import Probed
from rollout_queue.workers.engine.run import RunHost, RunOptions
from rollout_queue.workers.engine.tools import ToolCalls
from rollout_queue.workers.state import NodeState

__all__ = ["GenerationHost", "Probed", "RunHost", "SyncHost"]


class GenerationHost(Protocol):
    """What the generation service uses of the engine host."""

    weight_version: int
    vocab_size: int
    tool_calls: ToolCalls

    @property
    def state(self) -> NodeState: ...

    def wait_for_intake(self, deadline: float) -> None: ...

    def spans_of(self, rid: str, index: int, length: int) -> list[tuple[int, int]]: ...

    def generate(self, request: GenerateRequest, options: RunOptions) -> tuple[list[PromptOutput], int]: ...


class SyncHost(Protocol):
    """What a weight sync uses of the engine host."""

    weight_version: int

    @property
    def settings(self) -> Any: ...  # its ``model``: the checkpoint the manifest is checked against

    @property
    def dtype(self) -> str: ...

    def weights_asleep(self) -> bool: ...

    def inflight_requests(self) -> int: ...

    def wake_up(self, tags: list[str] | None = None) -> None: ...

    def weights_dropped(self) -> bool: ...

    def weights_restored(self) -> None: ...

    def weights_loading(self) -> None: ...

    def pause(self, mode: PauseMode, timeout: float) -> None: ...

    def resume(self, new_version: int | None, timeout: float) -> None: ...

    def collective_rpc(self, method: str, timeout: float, *args: Any) -> list[Any]: ...

    def update_engine(self, request: dict[str, Any], timeout: float) -> tuple[list[Any], str]: ...
