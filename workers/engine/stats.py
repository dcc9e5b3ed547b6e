"""What the engine's scheduler reports each step: KV-cache usage, waiting requests.

vLLM hands scheduler stats to its stat loggers after every engine step.
:func:`stat_logger_factory` builds one such logger (a
``vllm.v1.metrics.loggers.StatLoggerBase``, passed to
``AsyncLLM.from_engine_args(..., stat_loggers=[...])``; same interface in
vLLM 0.24 and 0.32) that copies the figures into an :class:`EngineStats`,
which the registry heartbeat, the ``stats`` control command and ``/metrics``
read from other threads. ``EngineStats`` itself imports no vLLM.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StatsSnapshot:
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    running_requests: int = 0
    waiting_requests: int = 0
    prompt_tokens: int = 0  # totals since the engine started
    generation_tokens: int = 0
    # Prompt tokens looked up in the prefix cache, and those found (totals).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    updated_at: float = 0.0  # time.time() of the last engine step reported


class EngineStats:
    """Thread-safe latest scheduler figures of one engine (summed over its DP engines)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._per_engine: dict[int, tuple[float, int, int]] = {}
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._updated_at = 0.0

    def record(self, engine_index: int, scheduler: Any, iteration: Any) -> None:
        with self._lock:
            if scheduler is not None:
                self._per_engine[engine_index] = (
                    float(scheduler.kv_cache_usage),
                    int(scheduler.num_running_reqs),
                    int(scheduler.num_waiting_reqs),
                )
                prefix = getattr(scheduler, "prefix_cache_stats", None)
                if prefix is not None:
                    self._prefix_queries += int(prefix.queries)
                    self._prefix_hits += int(prefix.hits)
            if iteration is not None:
                self._prompt_tokens += int(iteration.num_prompt_tokens)
                self._generation_tokens += int(iteration.num_generation_tokens)
            self._updated_at = time.time()

    def snapshot(self) -> StatsSnapshot:
        with self._lock:
            engines = list(self._per_engine.values())
            return StatsSnapshot(
                kv_cache_usage=max((kv for kv, _, _ in engines), default=0.0),
                running_requests=sum(running for _, running, _ in engines),
                waiting_requests=sum(waiting for _, _, waiting in engines),
                prompt_tokens=self._prompt_tokens,
                generation_tokens=self._generation_tokens,
                prefix_cache_queries=self._prefix_queries,
                prefix_cache_hits=self._prefix_hits,
                updated_at=self._updated_at,
            )


def stat_logger_factory(stats: EngineStats) -> Callable[[Any, int], Any]:
    """A per-engine stat-logger factory for ``AsyncLLM`` that feeds ``stats``.

    The ``StatLoggerBase`` subclass is defined here, not at module level, so
    that importing this module (and ``workers.engine.host``) does not import vLLM.
    """
    from vllm.v1.metrics.loggers import StatLoggerBase

    class EngineStatsLogger(StatLoggerBase):  # type: ignore[misc]
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            stats.record(engine_idx, scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            pass

    return EngineStatsLogger
