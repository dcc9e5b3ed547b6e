"""Seeing and steering the fleet: Flower, status, control, metrics, generate_many, compose.

Flower runs as a subprocess against the test Redis with the shared
``gen_worker``, with the compose file's display flags; a real headless
Chromium (Debian's ``chromium``: ``make setup`` installs it where it can,
the tests that need it skip without it) loads its tasks page. Control commands that change a
worker's intake (pause/resume) and the Prometheus endpoint use a private
worker on its own queue and pool (``ops@tests``), so the shared worker is
never disturbed.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
import yaml

from rollout_queue.tasks import control, generate, generate_many, keys
from rollout_queue.tasks.errors import BatchIncomplete, ControlFailed, ControlTimeout, InvalidRequest, RolloutError
from rollout_queue.tasks.schemas import WorkerInfo
from tests.conftest import WorkerStarter, wait_for
from tests.procs import ROOT, Proc, free_port, python

TIMEOUT = 120.0
GREEDY = {"temperature": 0, "max_tokens": 8}
OPS = "ops@tests"
OPS_QUEUE = "ops"


def http_json(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def registry_info(client: redis_lib.Redis, node: str) -> WorkerInfo:
    raw = client.get(keys.worker_key(node))
    assert raw is not None, f"{node} is not in the registry"
    return WorkerInfo.model_validate_json(raw)


# --------------------------------------------------------------- fixtures


def compose_flower_columns() -> str:
    """The ``--tasks_columns=...`` flag of the compose-started Flower (what its task list shows)."""
    command = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["flower"]["command"]
    (flag,) = [word for word in command if word.startswith("--tasks_columns=")]
    return str(flag)


@pytest.fixture(scope="module")
def flower(redis_url: str) -> Iterator[str]:
    """Flower (``celery -A tasks.app:app flower``, compose's columns) on a free port; yields its base URL."""
    port = free_port()
    proc = Proc(
        "flower",
        [python(), "-m", "celery", "-A", "rollout_queue.tasks.app:app", "flower",
         f"--port={port}", "--address=127.0.0.1", compose_flower_columns()],
        env={"REDIS_URL": redis_url, "FLOWER_UNAUTHENTICATED_API": "true"},
    )
    base = f"http://127.0.0.1:{port}"
    try:
        proc.wait_until(
            lambda: urllib.request.urlopen(f"{base}/healthcheck", timeout=2).status == 200,
            60, "Flower to answer /healthcheck",
        )
        yield base
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def flower_task(gen_worker: Proc, flower: str) -> dict[str, Any]:
    """One generate task sent once Flower hears the worker's events; its id and result."""
    # Celery events travel over Redis PUB/SUB: wait until Flower receives the
    # worker's heartbeats, so it cannot miss the task's events.
    wait_for(
        lambda: http_json(f"{flower}/api/workers?status=true").get("gen@tests") is True,
        60, "Flower to receive gen@tests heartbeats",
    )
    async_result = generate.delay(["Flower shows this prompt"], GREEDY)
    result = async_result.get(timeout=TIMEOUT)
    summary = ("1 text prompt · n=1 · max_tokens=8 · T=0.0 · min_version=0 · "
               f"signature={result['signature']}")
    return {"id": async_result.id, "result": result, "summary": summary}


@pytest.fixture(scope="session")
def chromium() -> str:
    """Debian's headless Chromium. ``make setup`` installs it (as root, with apt-get);
    a test run never installs system packages itself."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip("chromium is not installed: `make setup` as root installs it "
                    "(`apt-get install -y --no-install-recommends chromium`)")
    return found


def headless(chromium: str, profile: str, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [
        chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={profile}", "--window-size=1600,900",
        # Let Flower's scripts fill the table from /tasks/datatable before the dump.
        "--virtual-time-budget=10000", *args,
    ]
    return subprocess.run(argv, check=False, capture_output=True, text=True, encoding="utf-8",
                          errors="replace", timeout=120)


# ops@tests beats every 0.5 s (default 2 s): the KV-cache test needs a
# heartbeat while its task generates, which can take under 2 s on a fast machine.
OPS_HEARTBEAT_S = 0.5


@pytest.fixture(scope="module")
def ops_worker(start_worker: WorkerStarter, model_a: Path) -> dict[str, Any]:
    """A private worker (own queue and pool) with Prometheus /metrics on a free port,
    and a vLLM engine flag the worker itself does not know: ``--max-logprobs 2``."""
    port = free_port()
    proc = start_worker(model_a, OPS, queue=OPS_QUEUE, pool=OPS_QUEUE,
                        extra=["--metrics-port", str(port), "--heartbeat-s", str(OPS_HEARTBEAT_S),
                               "--max-logprobs", "2"])
    return {"proc": proc, "metrics": f"http://127.0.0.1:{port}/metrics"}


# ------------------------------------------------------------------ Flower


def test_flower_api_lists_the_worker_and_the_task_succeeded_with_its_signature(
    flower: str, flower_task: dict[str, Any]
) -> None:
    wait_for(lambda: "gen@tests" in http_json(f"{flower}/api/workers?refresh=1", timeout=30),
             60, "Flower's /api/workers to list gen@tests")
    task_id = flower_task["id"]

    def succeeded() -> bool:
        return http_json(f"{flower}/api/tasks").get(task_id, {}).get("state") == "SUCCESS"

    wait_for(succeeded, 30, f"Flower to show task {task_id} as SUCCESS")
    task = http_json(f"{flower}/api/tasks")[task_id]
    assert task["name"] == keys.GENERATE_TASK
    assert task["worker"] == "gen@tests"
    assert task["runtime"] > 0
    assert task["args"] == flower_task["summary"]  # argsrepr: the summary, not the prompts
    signature = flower_task["result"]["signature"]
    assert signature in task["kwargs"], task["kwargs"]
    info = http_json(f"{flower}/api/task/info/{task_id}")
    assert info["state"] == "SUCCESS" and signature in info["kwargs"]


def test_chromium_shows_the_task_summary_in_flowers_task_list_and_saves_a_screenshot(
    flower: str, flower_task: dict[str, Any], chromium: str, artifacts: Path
) -> None:
    task_id = flower_task["id"]
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        dom = headless(chromium, profile, "--dump-dom", f"{flower}/tasks")
        assert dom.returncode == 0, dom.stderr[-2000:]
        assert task_id in dom.stdout, dom.stdout[-3000:]
        # The args and kwargs columns (compose's --tasks_columns) and, in the
        # task's row, its summary and signature as Flower's scripts filled them.
        headers = re.findall(r'<th[^>]*data-column="(\w+)"', dom.stdout)
        assert {"args", "kwargs"} <= set(headers), headers
        row = next(r for r in re.findall(r"<tr[^>]*>.*?</tr>", dom.stdout, re.DOTALL) if task_id in r)
        assert flower_task["summary"] in row, row
        assert f"'signature': '{flower_task['result']['signature']}'" in row.replace("&#39;", "'"), row
        shot = artifacts / "flower-tasks.png"
        shot.unlink(missing_ok=True)
        done = headless(chromium, profile, f"--screenshot={shot}", f"{flower}/tasks")
        assert done.returncode == 0, done.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert shot.stat().st_size > 10_000  # a rendered page, not an empty canvas


def test_chromium_task_page_shows_the_signature(
    flower: str, flower_task: dict[str, Any], chromium: str, artifacts: Path
) -> None:
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        url = f"{flower}/task/{flower_task['id']}"
        dom = headless(chromium, profile, "--dump-dom", url)
        headless(chromium, profile, f"--screenshot={artifacts / 'flower-task.png'}", url)
    # The whole summary: Celery's default argsrepr cut a 64-prompt task's args
    # off before the sampling params.
    assert flower_task["summary"] in dom.stdout
    assert "gen@tests" in dom.stdout


def test_a_task_refused_on_the_worker_fails_at_once_with_what_was_wrong(gen_worker: Proc) -> None:
    """Sent around the producer's checks (``send_task``): once failed after two
    engine retries with ``OverflowError``; then stored pydantic's error, which
    came back as a bare ``Exception`` with an empty ``exc_message``."""
    from rollout_queue.tasks.app import app

    sent = app.send_task(keys.GENERATE_TASK, args=(["hi"], {"max_tokens": 2**70}))
    with pytest.raises(InvalidRequest) as caught:
        sent.get(timeout=TIMEOUT)
    assert "params.max_tokens: Input should be less than or equal to 2147483647" in str(caught.value)
    # What the result backend keeps (what Flower and other readers see).
    stored = app.backend.decode(app.backend.get(app.backend.get_key_for_task(sent.id)))
    assert stored["status"] == "FAILURE"
    assert stored["result"]["exc_type"] == "InvalidRequest"
    assert str(caught.value) in stored["result"]["exc_message"]
    # Refused, not retried as an engine failure (results are not extended, so
    # the stored meta has no retry count: the worker's log says it).
    assert f"[{sent.id}] retry" not in gen_worker.log_path.read_text(errors="replace")


# ------------------------------------------------------------------ status


def status_rows(output: str) -> dict[str, list[str]]:
    """The worker table's rows, node → cells, from rich's box drawing."""
    rows = {}
    for line in output.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) == 12:
            rows[cells[0]] = cells
    return rows


def test_status_shows_the_live_worker_with_its_weight_version_and_state(
    gen_worker: Proc, redis_url: str, redis_client: redis_lib.Redis
) -> None:
    done = subprocess.run(
        [python(), "-m", "rollout_queue.cli", "status", "--redis-url", redis_url],
        check=False, capture_output=True, text=True, timeout=60, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    row = status_rows(done.stdout)["gen@tests"]
    info = registry_info(redis_client, "gen@tests")
    header = ["node", "pool", "model", "device", "TP", "weight_version", "state"]
    assert dict(zip(header, row)) == {
        "node": "gen@tests", "pool": "default", "model": ".models/tiny-llama-seed1",
        "device": "cpu", "TP": "1", "weight_version": str(info.weight_version), "state": "serving",
    }
    assert re.fullmatch(r"\d+\.\ds", row[11]), row[11]  # heartbeat age
    assert "generate" in done.stdout and "fleet weight_version" in done.stdout


def test_status_node_check_exits_0_for_a_live_worker_and_1_for_an_unknown_one(
    gen_worker: Proc, redis_url: str
) -> None:
    argv = [python(), "-m", "rollout_queue.cli", "status", "--redis-url", redis_url, "--node"]
    options: dict[str, Any] = {"capture_output": True, "text": True, "timeout": 60, "cwd": ROOT}
    live = subprocess.run(argv + ["gen@tests"], check=False, **options)
    gone = subprocess.run(argv + ["nobody@tests"], check=False, **options)
    assert (live.returncode, gone.returncode) == (0, 1)
    assert "nobody@tests is not live" in gone.stdout


def test_a_worker_is_live_for_three_heartbeat_intervals_after_its_last_heartbeat() -> None:
    info = WorkerInfo(node="w@h", model="m", device="cpu", dtype="float32", heartbeat_at=100.0, heartbeat_s=2.0)
    assert info.dead_after_s == 6.0
    assert info.live_at(100.0) and info.live_at(106.0)
    assert not info.live_at(106.01)


def test_status_reports_a_worker_dead_once_its_heartbeats_stop_while_its_key_lingers(
    redis_url: str, redis_client: redis_lib.Redis
) -> None:
    """What a ``kill -9`` leaves: a registry key still within its TTL whose
    ``heartbeat_at`` stopped moving. Written here, in a pool of its own."""
    node, now = "stale@tests", time.time()
    argv = [python(), "-m", "rollout_queue.cli", "status", "--redis-url", redis_url]
    options: dict[str, Any] = {"capture_output": True, "text": True, "timeout": 60, "cwd": ROOT}
    silent = WorkerInfo(node=node, pool="stale", queues=["stale"], model="m", device="cpu",
                        dtype="float32", state="serving", heartbeat_at=now - 7.0, heartbeat_s=2.0)
    redis_client.set(keys.worker_key(node), silent.model_dump_json(), ex=120)
    redis_client.sadd(keys.WORKERS, node)
    try:
        dead = subprocess.run(argv + ["--node", node], check=False, **options)
        table = subprocess.run(argv, check=False, **options)
        # The bound follows the worker's own interval: 3 missed beats of 30 s.
        slow = silent.model_copy(update={"heartbeat_s": 30.0})
        redis_client.set(keys.worker_key(node), slow.model_dump_json(), ex=120)
        beating = subprocess.run(argv + ["--node", node], check=False, **options)
    finally:
        redis_client.delete(keys.worker_key(node))
        redis_client.srem(keys.WORKERS, node)
    assert dead.returncode == 1, dead.stdout
    assert re.search(rf"{node} is not live: its last heartbeat is \d+\.\ds old \(dead after 6s", dead.stdout)
    assert status_rows(table.stdout)[node][6] == "dead"
    assert re.search(r"workers \(\d+ live, 1 dead\)", table.stdout), table.stdout
    assert beating.returncode == 0, beating.stdout
    assert status_rows(beating.stdout)[node][6] == "serving"


def test_status_without_redis_fails_with_exit_2_naming_the_url() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    done = subprocess.run([python(), "-m", "rollout_queue.cli", "status", "--redis-url", url],
                          check=False, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2
    assert url in done.stdout and "could not read" in done.stdout


# ----------------------------------------------------------------- control


def test_world_size_sums_engine_ranks_and_prefix_cache_reset_answers_per_worker(
    gen_worker: Proc, ops_worker: dict[str, Any]
) -> None:
    both = ["gen@tests", OPS]
    assert control.world_size(workers=both) == 2
    assert control.world_size(pool=OPS_QUEUE) == 1
    assert control.reset_prefix_cache(workers=both) == {"gen@tests": True, OPS: True}


def test_engine_stats_answer_with_the_registry_fields(gen_worker: Proc, redis_client: redis_lib.Redis) -> None:
    stats = control.engine_stats(workers=["gen@tests"])["gen@tests"]
    info = registry_info(redis_client, "gen@tests")
    assert stats["state"] == "serving" and stats["weight_version"] == info.weight_version
    for field in ("kv_cache_usage", "waiting_requests", "running_requests", "tokens_per_s", "completed_tasks"):
        assert field in stats


def test_control_names_the_workers_that_did_not_answer(ops_worker: dict[str, Any]) -> None:
    # The call always lasts its whole deadline (the ghost never answers); the
    # live worker must answer within it: 2 s was tight on a loaded machine.
    deadline = 6.0
    started = time.monotonic()
    with pytest.raises(ControlTimeout) as caught:
        control.engine_stats(workers=[OPS, "ghost@tests"], timeout=deadline)
    assert caught.value.missing == ["ghost@tests"]
    assert "ghost@tests" in str(caught.value)
    # Its own deadline, not a hang (margin: a loaded machine).
    assert time.monotonic() - started < deadline + 15


def test_pause_stops_intake_and_resume_serves_the_waiting_task(
    ops_worker: dict[str, Any], redis_client: redis_lib.Redis
) -> None:
    from rollout_queue.tasks.app import app

    assert control.pause(workers=[OPS]) == {OPS: "paused"}
    try:
        assert registry_info(redis_client, OPS).state == "paused"

        def not_consuming() -> bool:
            queues = app.control.inspect(destination=[OPS], timeout=2).active_queues() or {}
            return OPS in queues and not queues[OPS]

        wait_for(not_consuming, 30, f"{OPS} to stop consuming its queue")
        pending = generate.apply_async((["held while paused"], GREEDY), queue=OPS_QUEUE)
        sent_at = time.time()
        # A fetch already in flight when the queue was cancelled may pop the
        # message; kombu puts it back ("no consumers"). Either way it ends up
        # waiting in Redis, and stays there while the worker lives on.
        wait_for(lambda: redis_client.llen(OPS_QUEUE) == 1, 30, "the task to wait in the ops queue")
        wait_for(lambda: registry_info(redis_client, OPS).heartbeat_at > sent_at + 2.5, 30,
                 f"a heartbeat of {OPS} 2.5 s after the send")
        assert redis_client.llen(OPS_QUEUE) == 1 and pending.state == "PENDING"
    finally:
        assert control.resume(workers=[OPS]) == {OPS: "serving"}
    result = pending.get(timeout=TIMEOUT)
    assert result["worker"] == OPS
    assert registry_info(redis_client, OPS).state == "serving"


def test_a_vllm_engine_flag_on_the_worker_command_line_reaches_the_engine(ops_worker: dict[str, Any]) -> None:
    def ask(logprobs: int) -> dict[str, Any]:
        params = {**GREEDY, "max_tokens": 2, "logprobs": logprobs}
        return dict(generate.apply_async((["Hello"], params), queue=OPS_QUEUE).get(timeout=TIMEOUT))

    assert ask(2)["outputs"][0]["samples"][0]["logprobs"]
    with pytest.raises(RolloutError, match="max_logprobs|logprobs"):
        ask(3)  # past the engine's --max-logprobs 2 (vLLM's default: 20)


def test_sleep_and_wake_up_on_a_cpu_worker_fail_clearly_and_it_keeps_serving(
    ops_worker: dict[str, Any], redis_client: redis_lib.Redis
) -> None:
    # vLLM's CPU platform has no sleep mode (platforms.CpuPlatform:
    # is_sleep_mode_available() is False); the worker must say so, not crash.
    for call in (lambda: control.sleep(level=1, workers=[OPS]),
                 lambda: control.wake_up(workers=[OPS])):
        with pytest.raises(ControlFailed) as caught:
            call()
        assert list(caught.value.errors) == [OPS]
        assert "sleep mode is not supported on this backend" in str(caught.value)
        assert "cpu" in str(caught.value)
    assert registry_info(redis_client, OPS).state == "serving"
    result = generate.apply_async((["still awake"], GREEDY), queue=OPS_QUEUE).get(timeout=TIMEOUT)
    assert result["worker"] == OPS


def test_cpu_worker_asked_for_sleep_mode_exits_with_a_clear_error(
    start_worker: WorkerStarter, model_a: Path
) -> None:
    proc = start_worker(model_a, "sleepy@tests", queue="sleepy", pool="sleepy",
                        extra=["--enable-sleep-mode"], wait=False)
    code = proc.popen.wait(timeout=180)
    assert code == 3, proc.tail()
    assert "sleep mode is not supported on this backend" in proc.tail()


# ----------------------------------------------------------------- metrics


def scrape(url: str) -> dict[str, float]:
    """``name{labels}`` → value for every sample of our metrics (and vLLM's KV gauge)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())
                              if k not in ("node", "pool", "engine", "model_name"))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def test_metrics_count_requests_tokens_latency_and_report_weight_version_and_kv(
    ops_worker: dict[str, Any], redis_client: redis_lib.Redis
) -> None:
    url = ops_worker["metrics"]
    before = scrape(url)
    prompts = ["one", "two", "three"]
    result = generate.apply_async((prompts, GREEDY), queue=OPS_QUEUE).get(timeout=TIMEOUT)

    def counted() -> bool:
        now = scrape(url)
        return now["rollout_queue_requests_total{}"] - before.get("rollout_queue_requests_total{}", 0) == 3

    wait_for(counted, 60, "the finished task to be counted")
    after = scrape(url)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert delta("rollout_queue_generated_tokens_total{}") == result["usage"]["completion_tokens"]
    assert delta("rollout_queue_prompt_tokens_total{}") == result["usage"]["prompt_tokens"]
    assert delta("rollout_queue_task_seconds_count{}") == 1
    assert delta("rollout_queue_tasks_total{outcome=success}") == 1
    assert after["rollout_queue_weight_version{}"] == registry_info(redis_client, OPS).weight_version
    assert after["rollout_queue_state{state=serving}"] == 1
    assert after["rollout_queue_weight_sync_seconds_count{}"] == 0
    assert 0.0 <= after["rollout_queue_kv_cache_usage_ratio{}"] <= 1.0
    info = [name for name in after if name.startswith("rollout_queue_worker_info{")]
    assert len(info) == 1 and after[info[0]] == 1 and "device=cpu" in info[0] and "vllm_version=0." in info[0]
    assert not any("per_second" in name for name in after if name.startswith("rollout_queue_"))
    assert "vllm:kv_cache_usage_perc{}" in after  # vLLM's own metrics come along


def listening_addresses(port: int) -> set[str]:
    """IPv4 addresses a socket listens on at ``port``, from ``/proc/net/tcp``."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, port_hex = local.split(":")
        if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
            found.add(".".join(str(b) for b in reversed(bytes.fromhex(address))))
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc/net/tcp")
def test_metrics_listen_on_loopback_unless_metrics_host_says_otherwise(ops_worker: dict[str, Any]) -> None:
    from rollout_queue.cli.command import parser

    port = int(ops_worker["metrics"].rsplit(":", 1)[1].split("/")[0])
    assert listening_addresses(port) == {"127.0.0.1"}
    args = parser().parse_args(["worker", "--model", "m", "--metrics-port", "9400", "--metrics-host", "0.0.0.0"])
    assert args.metrics_host == "0.0.0.0"


def test_kv_cache_usage_and_requests_are_reported_while_generating(
    ops_worker: dict[str, Any], redis_client: redis_lib.Redis
) -> None:
    busy = {"temperature": 1.0, "max_tokens": 400, "ignore_eos": True, "seed": 0}
    pending = generate.apply_async(([f"long story {i}" for i in range(32)], busy), queue=OPS_QUEUE)
    seen: dict[str, Any] = {}
    beats: list[float] = []

    def reported_by_both() -> bool:
        # Each needs one look while the task runs, in any order: the task
        # lasts tens of seconds here and a few on a fast machine, heartbeats
        # come every OPS_HEARTBEAT_S.
        if not (seen.get("kv_cache_usage", 0) > 0 and seen.get("inflight_requests", 0) > 0):
            seen.update(control.engine_stats(workers=[OPS])[OPS])
        if not (beats and beats[-1] > 0):
            beats.append(registry_info(redis_client, OPS).kv_cache_usage)
        both = seen["kv_cache_usage"] > 0 and seen["inflight_requests"] > 0 and beats[-1] > 0
        return both or pending.ready()

    try:
        wait_for(reported_by_both, 300, f"{OPS} to report KV-cache usage while generating")
        assert seen["kv_cache_usage"] > 0 and seen["inflight_requests"] > 0, (
            f"the task ended before engine_stats showed it: {seen}")
        assert beats[-1] > 0, f"the task ended before a heartbeat carried its KV-cache usage: {beats}"
    finally:
        pending.get(timeout=600)
    assert seen["running_requests"] + seen["waiting_requests"] > 0


# --------------------------------------------------------- generate_many


def test_generate_many_yields_every_prompt_once_with_the_single_task_result(
    gen_worker: Proc, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = [f"{i}+{i}=" for i in range(10)]
    got = dict(generate_many(prompts, GREEDY, chunk_size=3, progress=True, timeout=TIMEOUT))
    assert "10/10 prompts" in capsys.readouterr().out  # the progress bar's last frame
    assert sorted(got) == list(range(10))
    single = generate.delay(prompts[7:8], GREEDY).get(timeout=TIMEOUT)
    assert got[7]["outputs"] == single["outputs"]
    assert got[7]["signature"] == single["signature"]
    assert got[7]["usage"] == single["usage"]
    assert all(r["worker"] == "gen@tests" and len(r["outputs"]) == 1 for r in got.values())


def test_generate_many_finishes_the_others_and_raises_with_the_failed_task_ids(gen_worker: Proc) -> None:
    too_long = "x" * 2000  # the byte-level tokenizer: 2000 tokens > max_model_len 512
    prompts = ["fine", too_long, "also fine"]
    got: dict[int, Any] = {}
    with pytest.raises(BatchIncomplete) as caught:
        for index, result in generate_many(prompts, GREEDY, chunk_size=1, progress=False, timeout=TIMEOUT):
            got[index] = result
    assert sorted(got) == [0, 2]
    assert caught.value.indices == [1] and not caught.value.unfinished
    (task_id, error), = caught.value.failed.items()
    assert "PromptTooLong" in error and task_id in str(caught.value)


# ----------------------------------------------------------------- compose


def console_scripts() -> dict[str, str]:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def resolve(argv: list[str]) -> str:
    """Check one command line resolves to an entry point that exists; say which."""
    import importlib
    from importlib import metadata

    from celery.bin.celery import celery as celery_cli

    from rollout_queue.cli.command import parser

    program, args = argv[0], argv[1:]
    if program == "rollout-queue":
        assert "rollout-queue" in console_scripts()
        try:
            parser().parse_args(args)
        except SystemExit as exc:  # argparse exits on an unknown subcommand or flag
            raise AssertionError(f"rollout-queue refuses {args}: exit {exc.code}") from exc
        return f"rollout-queue {args[0]}"
    if program == "celery":
        assert args[0] == "-A"
        module, _, attr = args[1].partition(":")
        assert hasattr(importlib.import_module(module), attr or "app")
        sub = args[2]
        plugins = {ep.name for ep in metadata.entry_points(group="celery.commands")}
        assert sub in set(celery_cli.commands) | plugins, f"celery has no {sub!r} command"
        return f"celery {sub}"
    if program in ("python", "python3") and args[:1] == ["-c"]:
        compile(args[1], "<healthcheck>", "exec")
        return "python -c"
    if program in ("valkey-server", "valkey-cli"):
        return program  # the valkey image's own binaries
    raise AssertionError(f"unknown program {program!r} in {argv}")


def placeholder(word: str) -> str:
    """Compose/shell variables → their default (``${GPU_COUNT:-1}`` → ``1``), else ``X``
    (``${MODEL}``, ``$model``, ``$(hostname)``)."""
    word = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", word.replace("$$", "$"))
    return re.sub(r"\$\{[^}]*\}|\$\([^)]*\)|\$\w+", "X", word)


def shell_commands(script: str) -> list[list[str]]:
    """Simple commands of a ``sh -c`` script that run one of our programs."""
    found = []
    for segment in re.split(r";|&&|\|\||\bthen\b|\belse\b", script):
        words = [placeholder(w) for w in shlex.split(segment.replace("$$", "$"))]
        while words and words[0] in ("exec", "if", "fi", "!"):
            words = words[1:]
        if words and words[0] in ("rollout-queue", "celery", "python", "python3"):
            found.append(words)
    return found


def test_compose_file_parses_and_every_service_command_resolves_to_an_entry_point() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"redis", "worker", "worker-cpu", "api", "flower"} <= set(services)
    dockerfile = (ROOT / "Dockerfile").read_text()
    resolved = {}
    for name, service in services.items():
        assert service.get("restart") == "unless-stopped", name
        assert "healthcheck" in service, name
        target = service.get("build", {}).get("target")
        if target:
            assert re.search(rf"^FROM \S+ AS {target}$", dockerfile, re.MULTILINE), f"{name}: no target {target}"
        command = service.get("command")
        assert command, f"{name} has no command"
        argv = command if isinstance(command, list) else shlex.split(command)
        if argv[:2] == ["sh", "-c"]:
            commands = shell_commands(argv[2])
        else:
            commands = [[placeholder(w) for w in argv]]
        assert commands, f"{name}: no command of ours in {argv}"
        resolved[name] = [resolve(c) for c in commands]
        test = service["healthcheck"]["test"]
        checks = [test[1:]] if test[0] == "CMD" else shell_commands(test[1])
        assert checks, f"{name}: healthcheck runs nothing we can check: {test}"
        for check in checks:
            resolve(check)
    assert resolved["worker"] == ["rollout-queue worker"]
    assert resolved["worker-cpu"] == ["rollout-queue make-tiny-model", "rollout-queue worker"]
    assert resolved["api"] == ["rollout-queue api"]
    assert resolved["flower"] == ["celery flower"]
    # Flower shows the args and kwargs columns, as compose starts it and as the docs say.
    columns = compose_flower_columns()
    assert {"args", "kwargs"} <= set(columns.split("=", 1)[1].split(","))
    for doc in ("README.md", "docs/DEPLOYMENT.md"):
        assert columns in (ROOT / doc).read_text(), f"{doc} does not document {columns}"
    for worker in ("worker", "worker-cpu"):
        assert "--metrics-host" in str(services[worker]["command"]), worker
    gpu = services["worker"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    assert services["worker"]["profiles"] == ["gpu"] and services["worker-cpu"]["profiles"] == ["cpu"]
    assert services["redis"]["healthcheck"]["test"] == ["CMD", "valkey-cli", "ping"]
    # The GPU image installs the gpu extra; the CPU image the lock of the CPU worker (.[cpu]).
    assert '".[gpu' in dockerfile and "-r constraints/quickstart.txt" in dockerfile


def test_the_registry_is_read_from_its_set_of_names_and_a_sweep_prunes_only_names_whose_entry_expired(
    redis_client: redis_lib.Redis,
) -> None:
    """``live_workers`` reads ``rq:workers`` and the entries it names, never a SCAN of the keyspace
    (which grows with every task result); an entry gone leaves its name behind
    until ``prune_workers`` (a reaper's sweep) drops it, and only it."""
    from rollout_queue.tasks.registry import live_workers, prune_workers, remove_entry, write_entry

    pool, nodes = "index", ["index-a@tests", "index-b@tests", "index-c@tests"]
    for node in nodes:
        info = WorkerInfo(node=node, pool=pool, queues=["index"], model="m", device="cpu", dtype="float32",
                          state="serving", heartbeat_at=time.time())
        write_entry(redis_client, node, info.model_dump_json(), 60_000 if node != nodes[1] else 200)
    # Entries nobody named in the set (a SCAN found these): not workers.
    redis_client.set(keys.worker_key("unlisted@tests"), "{}", ex=60)
    try:
        assert sorted(w.node for w in live_workers(redis_client, pool)) == nodes
        wait_for(lambda: not redis_client.exists(keys.worker_key(nodes[1])), 10, "b's entry to expire")
        assert sorted(w.node for w in live_workers(redis_client, pool)) == [nodes[0], nodes[2]]
        assert redis_client.sismember(keys.WORKERS, nodes[1])  # left until a sweep
        assert prune_workers(redis_client) >= 1
        members = redis_client.smembers(keys.WORKERS)
        assert nodes[1] not in members and {nodes[0], nodes[2]} <= members
        remove_entry(redis_client, nodes[2])  # a worker leaving
        assert [w.node for w in live_workers(redis_client, pool)] == [nodes[0]]
        assert nodes[2] not in redis_client.smembers(keys.WORKERS)
    finally:
        for node in nodes:
            remove_entry(redis_client, node)
        redis_client.delete(keys.worker_key("unlisted@tests"))


def test_the_registry_reads_a_fleet_larger_than_one_batch_in_name_order(redis_client: redis_lib.Redis) -> None:
    """The registry is read in one script whose MGETs take 1,000 names each: a fleet of
    2,345 comes back whole, by name, each entry its own; an expired one left out."""
    from rollout_queue.tasks.registry import live_workers

    pool = "fleet"
    nodes = [f"fleet-{i:04d}@tests" for i in range(2345)]
    pipe = redis_client.pipeline(transaction=False)
    for i, node in enumerate(reversed(nodes)):
        info = WorkerInfo(node=node, pool=pool, queues=["fleet"], model="m", device="cpu", dtype="float32",
                          state="serving", heartbeat_at=time.time(), weight_version=i)
        pipe.set(keys.worker_key(node), info.model_dump_json(), px=60_000)
        pipe.sadd(keys.WORKERS, node)
    pipe.execute()
    redis_client.delete(keys.worker_key(nodes[1000]))  # expired: its name stays in the set
    try:
        read = live_workers(redis_client, pool)
        assert [w.node for w in read] == nodes[:1000] + nodes[1001:]
        assert all(w.weight_version == len(nodes) - 1 - nodes.index(w.node) for w in read)
    finally:
        pipe = redis_client.pipeline(transaction=False)
        for node in nodes:
            pipe.delete(keys.worker_key(node))
            pipe.srem(keys.WORKERS, node)
        pipe.execute()
