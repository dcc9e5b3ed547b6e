"""Signed remote-control commands: one HMAC helper for the senders and the workers.

Every command that changes a worker's state (weight sync, pause/resume,
sleep/wake, prefix-cache reset, the bench's raw receives) carries an ``auth``
argument, a :class:`~tasks.schemas.ControlAuth`::

    hmac = HMAC-SHA256(RQ_WEIGHT_SYNC_SECRET,
                       canonical JSON of {command, arguments, issued_at, nonce, destination})

Senders (``tasks.control``, ``weight_sync.sync_weights``) build it with
:func:`signed_arguments`; each worker checks it with its
:class:`CommandVerifier`, which refuses a command that is unsigned, signed
with another key, issued outside ``max_age_s`` of the worker's clock, carrying
a nonce it has already accepted (a replay inside the window), or addressed to
other workers. Accepted nonces are kept in the process and, given a Redis
client, in Redis (``SET NX`` expiring with the window: ``keys.control_nonce``),
so a replay after the worker restarts is refused too. The canonical JSON is the one both sides see: the arguments as
they travel (Celery's JSON), keys sorted.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import redis
from pydantic import SecretStr, ValidationError

from rollout_queue.tasks import keys
from rollout_queue.tasks.errors import ControlRefused
from rollout_queue.tasks.schemas import ControlAuth

log = logging.getLogger(__name__)

__all__ = ["AUTH_ARGUMENT", "CommandVerifier", "sign_command", "signed_arguments", "signing_payload"]

# The argument name the signature travels under, next to the command's own.
AUTH_ARGUMENT = "auth"


def signing_payload(
    command: str, arguments: Mapping[str, Any], issued_at: float, nonce: str,
    destination: Sequence[str] | None,
) -> bytes:
    body = {
        "command": command,
        "arguments": {k: v for k, v in arguments.items() if k != AUTH_ARGUMENT},
        "issued_at": issued_at,
        "nonce": nonce,
        "destination": sorted(destination) if destination is not None else None,
    }
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _mac(secret: str, payload: bytes) -> str:
    return hmac.new(secret.encode(), payload, hashlib.sha256).hexdigest()


def sign_command(
    command: str, arguments: Mapping[str, Any], secret: str, *,
    destination: Sequence[str] | None = None, issued_at: float | None = None, nonce: str | None = None,
) -> ControlAuth:
    """The ``auth`` of ``command(**arguments)``, valid only for ``destination`` (None: anyone)."""
    issued_at = time.time() if issued_at is None else issued_at
    nonce = nonce or secrets.token_hex(16)
    dest = sorted(destination) if destination is not None else None
    mac = _mac(secret, signing_payload(command, arguments, issued_at, nonce, dest))
    return ControlAuth(issued_at=issued_at, nonce=nonce, destination=dest, hmac=mac)


def signed_arguments(
    command: str, arguments: Mapping[str, Any], secret: SecretStr | str | None, *,
    destination: Sequence[str] | None = None,
) -> dict[str, Any]:
    """``arguments`` plus their ``auth``, ready for ``app.control.broadcast``.

    Without a secret they go unsigned: only workers started with
    ``--insecure-control`` accept them, and the others answer saying so.
    """
    out = dict(arguments)
    if isinstance(secret, SecretStr):
        secret = secret.get_secret_value()
    if secret:
        out[AUTH_ARGUMENT] = sign_command(command, arguments, secret, destination=destination).model_dump()
    return out


class CommandVerifier:
    """A worker's check of signed commands; remembers accepted nonces while they are valid.

    ``secret=None`` (a worker started with ``--insecure-control``) accepts
    every command, signed or not. ``client``: where accepted nonces outlive the
    process (None: in the process only).
    """

    def __init__(
        self, node: str, secret: str | None, max_age_s: float = 30.0,
        clock: Callable[[], float] = time.time, max_nonces: int = 100_000,
        client: redis.Redis | None = None,
    ) -> None:
        self.node = node
        self._client = client
        self._secret = secret
        self.max_age_s = max_age_s
        self._clock = clock
        self._max_nonces = max_nonces
        self._seen: dict[str, float] = {}  # nonce → when it stops being valid
        self._lock = threading.Lock()

    def verify(self, command: str, arguments: Mapping[str, Any], auth: Any, what: str | None = None) -> None:
        """Return if ``command(**arguments)`` with ``auth`` may run here; else raise
        :class:`ControlRefused` saying why and what to do (naming ``what``, default
        the command)."""
        if self._secret is None:
            return
        label = what or command
        if auth is None:
            raise ControlRefused(
                f"{label} is unsigned; this worker accepts state-changing commands only when "
                "signed with its RQ_WEIGHT_SYNC_SECRET: set the same RQ_WEIGHT_SYNC_SECRET where the "
                "command is sent from (tasks.control / sync_weights sign with it)"
            )
        try:
            parsed = ControlAuth.model_validate(auth)
        except ValidationError as exc:
            raise ControlRefused(f"{label} carries a malformed signature: {exc.errors()[0]['msg']}") from exc
        expected = _mac(self._secret, signing_payload(
            command, arguments, parsed.issued_at, parsed.nonce, parsed.destination))
        if not hmac.compare_digest(parsed.hmac, expected):
            raise ControlRefused(
                f"{label} is wrongly signed (another key, or altered on the way); the sender "
                "must use the same RQ_WEIGHT_SYNC_SECRET as the workers"
            )
        if parsed.destination is not None and self.node not in parsed.destination:
            raise ControlRefused(f"{label} was signed for {', '.join(parsed.destination)}, not {self.node}")
        now = self._clock()
        age = now - parsed.issued_at
        if abs(age) > self.max_age_s:
            when = f"{age:.1f} s ago" if age > 0 else f"{-age:.1f} s ahead of this worker's clock"
            raise ControlRefused(
                f"{label} was signed {when}, outside the {self.max_age_s:g} s window "
                "(a replay, or clocks out of step: sync them with NTP)"
            )
        with self._lock:
            for nonce in [n for n, until in self._seen.items() if until < now]:
                del self._seen[nonce]
            if parsed.nonce in self._seen:
                raise ControlRefused(f"{label} replayed: its nonce was already accepted")
            if len(self._seen) >= self._max_nonces:
                raise ControlRefused(
                    f"{label} refused: {len(self._seen)} signed commands within "
                    f"{self.max_age_s:g} s; retry shortly")
            until = parsed.issued_at + self.max_age_s
            if not self._first_use(parsed.nonce, until - now):
                raise ControlRefused(f"{label} replayed: its nonce was already accepted (before a restart)")
            self._seen[parsed.nonce] = until

    def _first_use(self, nonce: str, valid_s: float) -> bool:
        """Record ``nonce`` in Redis for as long as its signature is valid; False if it was
        there already. Redis unreachable or refusing: the process's memory alone decides."""
        if self._client is None:
            return True
        try:
            return bool(self._client.set(keys.control_nonce(self.node, nonce), "1", nx=True,
                                         px=max(1, math.ceil(valid_s * 1000))))
        except redis.RedisError as exc:
            log.warning("could not record a control command's nonce in Redis (%s): a replay after a "
                        "restart of this worker would not be seen", exc)
            return True
