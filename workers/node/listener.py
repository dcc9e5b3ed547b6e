"""The worker's listener for triggers written into a trainer's rendezvous store.

A colocated worker's sync is a decided round (one member, handed the weights:
``SyncPlan.decided``), and its trigger's usual way, a Celery broadcast, is the
longest step before the engine's first copy: the trainer's kombu publish, the
Redis fan-out, the worker consumer's wake-up and dispatch (~1 ms on a GPU host).

Once such a round has committed, the worker keeps a thread waiting on one key
of that trainer's store (``keys.sync_trigger``, a name fresh for each listener)
and names the key in its "done" ack (``SyncAck.listening``). The trainer writes
the next decided round's signed trigger there instead of broadcasting it; the
listener takes it (reads and deletes the key) and hands it to the same check a
broadcast trigger gets (signature, nonce, plan: ``SyncParticipant.accept_signed``).

The trainer uses a key once: the next "done" ack names it again. A key nobody
takes (the worker restarted, its listener ended) is deleted by the trainer after
``weight_sync.sender.TRIGGER_TAKEN_S`` and the trigger broadcast instead; a
trigger that came both ways is one command (its nonce is accepted once).
"""

from __future__ import annotations

import datetime
import json
import logging
import secrets
import threading
from collections.abc import Callable
from typing import Any

from rollout_queue.tasks import keys
from rollout_queue.weight_sync import wire

log = logging.getLogger(__name__)

# The listener's store client connects within this (the trainer's store answered
# the sync that started it moments ago).
CONNECT_S = 5.0
# One wait on the key. A wait that times out is cancelled cleanly and waited again,
# but torch logs each timeout: a long wait keeps an idle worker's log quiet.
WAIT_S = 24 * 3600.0
# Written to the key to end the listener's wait (``TriggerListener.stop``).
STOP = b"stop"


class TriggerListener:
    """A thread waiting on ``key`` in the trainer's store at ``host:port``; each
    trigger written there is passed to ``on_trigger`` (the signed control
    arguments, ``{"plan": ..., "auth": ...}``). It ends when the store goes
    (the trainer exited) or when stopped."""

    def __init__(self, node: str, host: str, port: int, on_trigger: Callable[[dict[str, Any]], Any]) -> None:
        self.key = keys.sync_trigger(node, secrets.token_hex(8))
        self.address = (host, port)
        self._on_trigger = on_trigger
        self._stopped = threading.Event()
        self._ended = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sync-trigger", daemon=True)
        self._thread.start()

    def waits_on(self, host: str, port: int) -> bool:
        """Whether this listener still waits on the store at ``host:port``."""
        return self.address == (host, port) and not self._ended.is_set() and not self._stopped.is_set()

    def stop(self) -> None:
        """End the listener: its wait is woken by writing ``STOP`` to its key, from a
        client of its own (the listener's is busy waiting), off the caller's thread."""
        if self._stopped.is_set() or self._ended.is_set():
            return
        self._stopped.set()

        def wake() -> None:
            try:
                wire.connect_store(*self.address, CONNECT_S).set(self.key, STOP)
            except Exception as exc:  # noqa: BLE001  the store is gone: so is the wait
                log.debug("trigger listener on %s:%s: could not wake it to stop: %s", *self.address, exc)

        threading.Thread(target=wake, name="sync-trigger-stop", daemon=True).start()

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the listener to end; whether it has."""
        return self._ended.wait(timeout)

    def _run(self) -> None:
        from torch.distributed import DistError

        try:
            store = wire.connect_store(*self.address, CONNECT_S)
            store.set_timeout(datetime.timedelta(seconds=WAIT_S))
            while not self._stopped.is_set():
                try:
                    store.wait([self.key])
                except DistError as exc:
                    if "timeout" in str(exc).split("\n", 1)[0]:
                        continue  # cancelled cleanly: the client is usable
                    raise
                raw = store.get(self.key)
                store.delete_key(self.key)
                if raw == STOP or self._stopped.is_set():
                    break
                self._hand_on(raw)
        except Exception as exc:  # noqa: BLE001  the store went (the trainer exited): broadcasts still come
            log.info("trigger listener on the trainer's store %s:%s ended: %s", *self.address,
                     str(exc).split("\n", 1)[0][:200])
        finally:
            self._ended.set()

    def _hand_on(self, raw: bytes) -> None:
        try:
            arguments = json.loads(raw)
            if not isinstance(arguments, dict):
                raise TypeError(f"a {type(arguments).__name__}, not the control command's arguments")
            self._on_trigger(arguments)
        except Exception:  # one bad trigger never ends the listener
            log.exception("trigger listener on %s:%s: the trigger written to %s could not be handled",
                          *self.address, self.key)
