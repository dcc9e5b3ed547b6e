"""A trainer or producer on a host of its own (a network namespace), driven by tests.

Started inside a namespace (``ip netns exec``), it reads one JSON command a
line on stdin and answers one JSON line on stdout, so a test drives a process
that lives on another host than pytest's: it produces tasks, waits for their
results, reads the registry, and syncs weights as the trainer (its process
group and store live on between syncs, as a trainer's do)::

    python -m tests.multihost_agent REDIS_URL SECRET            # serve commands
    python -m tests.multihost_agent REDIS_URL SECRET --once CMD  # one command, then exit

(``-m`` from the repository root, so this checkout's packages are imported).

Each answer is ``{"ok": value}`` or ``{"error": class name, "message": ...,
"workers": [...], "seconds": s}``.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from pydantic import SecretStr


class Agent:
    def __init__(self, redis_url: str, secret: str) -> None:
        self.redis_url = redis_url
        self.secret = secret
        self.senders: dict[str, Any] = {}
        self.configure({})

    def configure(self, args: dict[str, Any]) -> None:
        from rollout_queue.tasks.app import configure
        from rollout_queue.tasks.settings import ClientSettings

        configure(ClientSettings(redis_url=SecretStr(self.redis_url),
                                 weight_sync_secret=SecretStr(self.secret), **args))

    # ---------------------------------------------------------------- commands

    def ping(self, timeout: float) -> bool:
        import redis

        deadline = time.monotonic() + timeout
        while True:
            try:
                return bool(redis.Redis.from_url(self.redis_url, socket_connect_timeout=1).ping())
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def registry(self) -> dict[str, Any]:
        from rollout_queue.tasks.app import settings
        from rollout_queue.tasks.registry import connect, live_workers

        return {w.node: w.model_dump(mode="json") for w in live_workers(connect(settings()), None)}

    def send(self, tasks: list[dict[str, Any]]) -> list[str]:
        """Enqueue tasks (``{"prompts", "params", "queue"}``); their ids."""
        from rollout_queue.tasks import generate

        return [generate.apply_async((t["prompts"], t["params"]), queue=t["queue"]).id for t in tasks]

    def results(self, ids: list[str], timeout: float) -> dict[str, Any]:
        """Each task's backend meta once all are final; polls through outages."""
        import redis

        from rollout_queue.tasks import app
        from tests.whereabouts import whereabouts

        done: dict[str, Any] = {}
        deadline = time.monotonic() + timeout
        while len(done) < len(ids):
            if time.monotonic() > deadline:
                missing = [task_id for task_id in ids if task_id not in done]
                raise TimeoutError(f"{len(missing)} of {len(ids)} tasks not done in {timeout:.0f}s: "
                                   + "; ".join(whereabouts(self.redis_url, task_id) for task_id in missing))
            try:
                for task_id in ids:
                    if task_id not in done:
                        meta = app.backend.get_task_meta(task_id, cache=False)
                        if meta["status"] in ("SUCCESS", "FAILURE"):
                            done[task_id] = {"status": meta["status"], "result": _jsonable(meta["result"])}
            except (redis.RedisError, OSError):
                pass
            time.sleep(0.2)
        return done

    def generate(self, tasks: list[dict[str, Any]], timeout: float) -> list[Any]:
        ids = self.send(tasks)
        metas = self.results(ids, timeout)
        return [metas[i]["result"] for i in ids]

    def sync(self, model: str, version: int, rendezvous_host: str, timeouts: dict[str, Any],
             timeout: float, pool: str, catch_up: bool = False,
             cut_before_send: list[str] | None = None,
             cut_before_decide: list[str] | None = None) -> dict[str, Any]:
        """``cut_before_send``: a command run once the process group is formed,
        just before the first bucket leaves (e.g. ``ip link set ... down``);
        ``cut_before_decide``: one run once every worker is ready (paused), just
        before the trainer writes its decision to go ahead."""
        from safetensors.torch import load_file

        from rollout_queue.weight_sync.settings import SyncSettings, SyncTimeouts

        key = f"{pool}/{rendezvous_host}/{sorted(timeouts.items())}"
        if key not in self.senders:
            settings = SyncSettings(rendezvous_host=rendezvous_host, weight_sync_secret=SecretStr(self.secret),
                                    timeouts=SyncTimeouts(**timeouts))
            self.senders[key] = _sender_class()(settings, pool)
        sender = self.senders[key]
        sender.cut_before_send = cut_before_send
        sender.cut_before_decide = cut_before_decide
        weights = load_file(f"{model}/model.safetensors")
        if catch_up:
            report = sender.catch_up(weights, timeout=timeout)
            return report.model_dump(mode="json") if report is not None else {}
        return sender.sync(weights, version=version, timeout=timeout).model_dump(mode="json")

    def http(self, url: str, timeout: float) -> Any:
        """GET ``url`` from this host (e.g. Flower's REST API on another host); its JSON."""
        import urllib.request

        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return json.loads(answer.read())

    def scard(self, key: str) -> int:
        import redis

        return int(redis.Redis.from_url(self.redis_url).scard(key))

    def produce(self, prompts: list[str], settings: dict[str, Any]) -> str:
        """Enqueue one task with these client settings (e.g. broker_connect_timeout); its id."""
        self.configure(settings)
        from rollout_queue.tasks import generate

        return str(generate.delay(prompts, {"max_tokens": 2}).id)

    # ------------------------------------------------------------------ wire

    def answer(self, line: str) -> dict[str, Any]:
        command = json.loads(line)
        op = command.pop("op")
        started = time.monotonic()
        try:
            return {"ok": getattr(self, op)(**command), "seconds": time.monotonic() - started}
        except Exception as exc:  # noqa: BLE001  every failure goes back to the test, named
            return {"error": type(exc).__name__, "message": str(exc),
                    "workers": list(getattr(exc, "workers", []) or []),
                    "seconds": time.monotonic() - started}


def _sender_class() -> type:
    import subprocess

    from rollout_queue.weight_sync.sync_weights import WeightSender

    class CuttingSender(WeightSender):
        """The real sender, with a fault where a test puts it: between ready and
        the decision (``_decide``), or just before the first bucket leaves (every
        transport's ``before_bucket`` seam)."""

        cut_before_decide: list[str] | None = None
        cut_before_send: list[str] | None = None

        def _decide(self, plan: Any, decision: Any) -> None:
            if self.cut_before_decide and decision.go:
                subprocess.run(self.cut_before_decide, check=True, timeout=30)
                self.cut_before_decide = None
            super()._decide(plan, decision)

        def transport(self, name: str) -> Any:
            end = super().transport(name)
            end.before_bucket = self._before_bucket
            return end

        def _before_bucket(self, bucket: int) -> None:
            if self.cut_before_send:
                cut, self.cut_before_send = self.cut_before_send, None
                subprocess.run(cut, check=True, timeout=30)

    return CuttingSender


def _jsonable(value: Any) -> Any:
    if isinstance(value, BaseException):
        return {"exc_type": type(value).__name__, "exc_message": str(value)}
    return value


def main(argv: list[str]) -> None:
    agent = Agent(argv[0], argv[1])
    # Imported before any command, so an answer times the work alone.
    import rollout_queue.tasks.generate

    if len(argv) > 3 and argv[2] == "--once":
        print(json.dumps(agent.answer(argv[3])), flush=True)
        return
    import safetensors.torch  # noqa: F401  imported before any command, so answers time the work alone

    import rollout_queue.weight_sync.sync_weights  # noqa: F401
    print(json.dumps({"ok": "ready"}), flush=True)
    for line in sys.stdin:
        print(json.dumps(agent.answer(line)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
