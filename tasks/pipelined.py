"""A Redis pipeline written now and read later: the caller works while Redis answers.

``pipeline.execute()`` writes the commands and waits for the replies; a caller
with work of its own to do meanwhile (the trainer lists its tensors while the
registry is read: ``weight_sync.sender``) hides the round trip behind it with
:class:`SentPipeline`. No thread: the bytes go out on the caller's thread, and
the replies wait in the socket until it reads them (a thread doing the round
trip would wait for the interpreter lock until that work ends).

Only for pipelines that may run twice: when the connection breaks between the
write and the read, the commands are run again through ``execute()`` (with
redis-py's own retries), as Redis may or may not have run them the first time.
"""

from __future__ import annotations

from typing import Any

import redis
from redis.client import Pipeline


class SentPipeline:
    """``pipe``'s commands, written on a connection of its pool at once (or, when
    that fails, run by :meth:`answers`)."""

    def __init__(self, pipe: Pipeline) -> None:
        self._pipe = pipe
        self._connection: Any = None
        commands = [args for args, _ in pipe.command_stack]
        try:
            connection = pipe.connection_pool.get_connection()
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            return  # answers() runs them the usual way (and says why they could not run)
        try:
            connection.send_packed_command(connection.pack_commands(commands))
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            self._give_back(connection, broken=True)
            return
        self._connection = connection

    def answers(self) -> list[Any]:
        """The replies, in the commands' order; the first error reply raised, as
        ``execute()`` does (and redis-py's errors where the commands could not run)."""
        connection, self._connection = self._connection, None
        if connection is None:
            return list(self._pipe.execute())
        replies: list[Any] = []
        try:
            for args, options in self._pipe.command_stack:
                try:
                    replies.append(self._pipe.parse_response(connection, args[0], **options))
                except redis.ResponseError as exc:
                    replies.append(exc)
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            self._give_back(connection, broken=True)
            return list(self._pipe.execute())
        self._give_back(connection, broken=False)
        for reply in replies:
            if isinstance(reply, redis.ResponseError):
                raise reply
        return replies

    def drop(self) -> None:
        """The replies are not wanted (the caller failed meanwhile): the connection,
        with replies still in it, is closed rather than reused."""
        connection, self._connection = self._connection, None
        if connection is not None:
            self._give_back(connection, broken=True)

    def _give_back(self, connection: Any, broken: bool) -> None:
        if broken:
            connection.disconnect()
        self._pipe.connection_pool.release(connection)


__all__ = ["SentPipeline"]
