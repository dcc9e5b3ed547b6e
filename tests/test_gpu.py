"""GPU proof (marked ``gpu``; skipped without a CUDA device and vLLM for CUDA).

On the lent two-H200 machine: workers on GPU 0 with a 0.5B-shaped Qwen2
(random bf16 weights, WordLevel tokenizer of 32,000 tokens), the test process
as trainer on GPU 1, Redis = the staged valkey-server. On one GPU the
generation and signed-control tests run and the NCCL sync tests are skipped
(NCCL refuses two ranks of one communicator on one GPU). Generation goes through
the queue; weight sync goes over NCCL into two workers, one loading with
vLLM's layerwise reload and one with direct ``load_weights``. Greedy tokens
are not compared in bf16 (not stable on random weights, docs/DEPLOYMENT.md): weight
checksums and prompt logprobs within a tolerance are.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import psutil
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("vllm")

from safetensors.torch import load_file

from rollout_queue.tasks import app, control, generate, keys, sync_weights
from rollout_queue.tasks.errors import ControlFailed
from rollout_queue.tasks.schemas import WorkerInfo
from rollout_queue.weight_sync.bench_receiver import BENCH_EXTENSION
from rollout_queue.weight_sync.settings import SyncSettings
from tests.conftest import CONTROL_SECRET, MODELS, WorkerStarter, wait_for
from tests.procs import Proc, engine_cores

pytestmark = pytest.mark.gpu
# NCCL refuses two ranks of one communicator on one GPU: each load mode gets
# its own pool (one worker on GPU 0, trainer on GPU 1) and its own sync.
MODES = ("direct", "layerwise")
# The GPU workers run vLLM's default process layout (tests.conftest.ENGINE_PROCESS_ENV
# trims it for the CPU suite's start-up time).
GPU_ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
# Token-id prompts: transformers 5 rebuilds a qwen2 model's WordLevel tokenizer
# with a byte-level pre-tokenizer, so text would not round-trip; ids always do.
PROMPTS = [[(i * 37 + j * 11) % 31000 + 1 for j in range(24)] for i in range(8)]
# The trainer's GPU: its own where there are two; GPU 0 (beside the workers) for building models.
TRAINER = "cuda:1" if torch.cuda.device_count() >= 2 else "cuda:0"
needs_two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="NCCL refuses two ranks of one communicator on one GPU: the trainer needs a GPU of its own",
)


def qwen(seed: int) -> Path:
    from rollout_queue.cli.tiny_model import make_tiny_model

    path = MODELS / f"qwen2-0.5b-seed{seed}"
    if not (path / "model.safetensors").exists():
        make_tiny_model(path, seed=seed, kind="qwen2-0.5b", device=TRAINER)
    return path


@pytest.fixture(scope="module")
def gpu_workers(start_worker: WorkerStarter, redis_client: Any) -> dict[str, str]:
    model = qwen(1)
    names = {}
    # One after the other: an engine profiling GPU memory while another one
    # starts on the same GPU finds no room for its KV cache.
    for mode in ("direct", "layerwise"):
        name = f"gpu-{mode}@tests"
        start_worker(
            model, name, queue=f"gpu-{mode}", pool=f"gpu-{mode}", timeout=600,
            extra=["--device", "cuda", "--dtype", "bfloat16", "--gpu-memory-utilization", "0.3",
                   "--max-model-len", "2048", "--weight-load-mode", mode,
                   # the receiver with the calls the checks below read (weight_checksum, last_receive)
                   "--worker-extension-cls", BENCH_EXTENSION],
            env={"CUDA_VISIBLE_DEVICES": "0", **GPU_ENGINE_ENV},
        )
        names[mode] = name
    return names


def checksums(names: list[str]) -> dict[str, float]:
    return {node: sum(rank["sum"] for rank in ranks)
            for node, ranks in control.engine_command("weight_checksum", workers=names, timeout=60).items()}


def last_receive(node: str) -> dict[str, float]:
    return control.engine_command("last_receive", workers=[node], timeout=60)[node][0]


def expected_sum(state: dict[str, Any]) -> float:
    return sum(float(t.double().sum()) for t in state.values())


def hf_prompt_logprobs(model_dir: Path, prompt_ids: list[list[int]]) -> list[list[float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16).to("cuda:1")
    out = []
    with torch.no_grad():
        for ids in prompt_ids:
            x = torch.tensor([ids], device="cuda:1")
            logits = model(x).logits.float().log_softmax(-1)[0]
            out.append([float(logits[i - 1, ids[i]]) for i in range(1, len(ids))])
    del model
    torch.cuda.empty_cache()
    return out


def worker_prompt_logprobs(queue: str) -> tuple[list[list[int]], list[list[float]], set[str]]:
    handles = [
        generate.apply_async((PROMPTS, {"temperature": 0.0, "max_tokens": 4, "prompt_logprobs": 0}), queue=queue)
        for _ in range(2)
    ]
    results = [h.get(timeout=300) for h in handles]
    ids = [o["prompt_token_ids"] for o in results[0]["outputs"]]
    lps = [[float(v) for v in o["prompt_logprobs"][1:]] for o in results[0]["outputs"]]
    return ids, lps, {r["worker"] for r in results}


def mean_abs(a: list[list[float]], b: list[list[float]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(abs(x - y) for x, y in pairs) / len(pairs)


def test_generation_through_the_queue_on_cuda(gpu_workers: dict[str, str]) -> None:
    results = [
        generate.apply_async((PROMPTS, {"temperature": 0.8, "max_tokens": 32, "n": 2, "seed": 3,
                                        "logprobs": 1}), queue=f"gpu-{mode}").get(timeout=300)
        for mode in MODES
    ]
    for result in results:
        assert result["weight_version"] == 0
        assert len(result["outputs"]) == len(PROMPTS)
        for output in result["outputs"]:
            assert len(output["samples"]) == 2
            for sample in output["samples"]:
                assert 1 <= len(sample["token_ids"]) <= 32
                assert len(sample["logprobs"]) == len(sample["token_ids"])
                assert all(math.isfinite(lp) and lp <= 0 for lp in sample["logprobs"])


def test_signed_control_reaches_cuda_engines_and_an_unsigned_pause_is_refused(
    gpu_workers: dict[str, str],
) -> None:
    nodes = sorted(gpu_workers.values())
    assert control.reset_prefix_cache(nodes) == {node: True for node in nodes}
    try:
        assert control.pause(nodes) == {node: "paused" for node in nodes}
    finally:
        assert control.resume(nodes) == {node: "serving" for node in nodes}
    replies = app.control.broadcast(keys.CONTROL_ENGINE, arguments={"op": "pause", "args": {}},
                                    destination=nodes, reply=True, timeout=30, limit=len(nodes))
    answers = {node: body for reply in replies for node, body in reply.items()}
    assert set(answers) == set(nodes), answers
    for answer in answers.values():
        assert answer["ok"] is False and answer["error"].startswith("ControlRefused:"), answer
        assert "unsigned" in answer["error"], answer
    for mode in MODES:  # still serving: the refused pause changed nothing
        result = generate.apply_async((PROMPTS[:2], {"temperature": 0.0, "max_tokens": 4}),
                                      queue=f"gpu-{mode}").get(timeout=120)
        assert result["worker"] == gpu_workers[mode]


@needs_two_gpus
@pytest.mark.parametrize("mode", MODES)
def test_nccl_sync_from_gpu1_into_a_worker_on_gpu0_changes_weights_and_logprobs(
    mode: str, gpu_workers: dict[str, str]
) -> None:
    node, pool = gpu_workers[mode], f"gpu-{mode}"
    state_a = load_file(str(qwen(1) / "model.safetensors"))
    state_b = load_file(str(qwen(2) / "model.safetensors"), device="cuda:1")
    before = checksums([node])
    assert before[node] == pytest.approx(expected_sum(state_a), rel=1e-6)
    ids, lps_a, _ = worker_prompt_logprobs(pool)

    torch.cuda.set_device(1)
    sender = sync_weights.sender(pool, SyncSettings(direct_bytes=1 << 20))
    # The first sync sends A again (the weights do not change), through load_weights:
    # the direct worker learns there which tensors it can receive in place. The
    # second sync sends B, in place where learnt.
    first = sender.sync({k: v.to("cuda:1") for k, v in state_a.items()}, version=1, timeout=300)
    assert first.backend == "nccl" and first.workers == [node]
    assert checksums([node])[node] == pytest.approx(expected_sum(state_a), rel=1e-6)
    again = sender.sync(state_b, version=2, timeout=300)
    assert again.reused_group
    received = last_receive(node)
    if mode == "direct":  # the tensors of at least 1 MiB: most of the bytes
        assert received["in_place_bytes"] > 0.5 * again.bytes, received
    else:
        assert received["in_place_bytes"] == 0, received

    after = checksums([node])
    assert after[node] == pytest.approx(expected_sum(state_b), rel=1e-6), node
    _, lps_b_worker, served = worker_prompt_logprobs(pool)
    assert served == {node}
    reference_b = hf_prompt_logprobs(qwen(2), ids)
    moved = mean_abs(lps_a, reference_b)
    error = mean_abs(lps_b_worker, reference_b)
    print(f"[{mode}] prompt-logprob distance A to B {moved:.4f}; worker after sync vs HF B {error:.4f}; "
          f"first sync {first.seconds:.3f}s, steady {again.seconds:.3f}s ({again.gb_per_s:.1f} GB/s), "
          f"worker phases {again.worker_phases}")
    assert error < 0.05 and error < moved / 5
    sync_weights.close(pool)


# ---------------------------------------------------------------------------
# A lost engine on the GPU: its task goes back, its memory is freed
# ---------------------------------------------------------------------------

LOST_QUEUE = "gpu-lost"


def lone_gpu_worker(start_worker: WorkerStarter, name: str) -> Proc:
    return start_worker(
        qwen(1), name, queue=LOST_QUEUE, pool=LOST_QUEUE, timeout=600,
        extra=["--device", "cuda", "--dtype", "bfloat16", "--gpu-memory-utilization", "0.15",
               "--max-model-len", "4096", "--engine-answer-s", "20"],
        env={"CUDA_VISIBLE_DEVICES": "0", **GPU_ENGINE_ENV},
    )


def gpu_compute_pids() -> set[int]:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    return {int(line) for line in out.split() if line.strip().isdigit()}


def test_a_cuda_worker_whose_engine_core_is_killed_hands_its_task_to_the_next_worker_and_frees_the_gpu(
    gpu_workers: dict[str, str], start_worker: WorkerStarter, redis_client: Any,
) -> None:
    first = lone_gpu_worker(start_worker, "gpu-lost-1@tests")
    handle = generate.apply_async(
        (PROMPTS, {"temperature": 0.8, "max_tokens": 3000, "ignore_eos": True, "n": 4}), queue=LOST_QUEUE)
    (core,) = engine_cores(first)
    wait_for(lambda: core.pid in gpu_compute_pids(), 60, "the engine core on the GPU")
    wait_for(lambda: WorkerInfo.model_validate_json(
        redis_client.get(keys.worker_key("gpu-lost-1@tests"))).inflight_requests > 0,
        60, "the task's requests in the engine (a heartbeat)")
    assert not handle.ready()  # mid-generation: 3,000 tokens x 32 samples
    core.kill()
    assert first.popen.wait(120) == 4, first.tail()
    assert "handing its tasks back to the queue and exiting (code 4)" in first.log_path.read_text(errors="replace")
    wait_for(lambda: core.pid not in gpu_compute_pids(), 60, "the killed core's GPU memory to be freed")
    second = lone_gpu_worker(start_worker, "gpu-lost-2@tests")  # the supervisor's restart
    result = handle.get(timeout=600)
    assert result["worker"] == "gpu-lost-2@tests"
    assert all(len(s["token_ids"]) == 3000 for o in result["outputs"] for s in o["samples"])
    second.stop()


def test_kill_9_of_a_cuda_worker_takes_its_engine_core_and_its_gpu_memory_with_it(
    gpu_workers: dict[str, str], start_worker: WorkerStarter,
) -> None:
    worker = lone_gpu_worker(start_worker, "gpu-lost-3@tests")
    (core,) = engine_cores(worker)
    wait_for(lambda: core.pid in gpu_compute_pids(), 60, "the engine core on the GPU")
    os.kill(worker.pid, signal.SIGKILL)  # the main process alone, as the OOM killer would
    gone, _ = psutil.wait_procs([core], timeout=60)
    assert gone, f"engine core {core.pid} outlived its worker"
    wait_for(lambda: core.pid not in gpu_compute_pids(), 60, "the core's GPU memory to be freed")


# ---------------------------------------------------------------------------
# Colocated: trainer and worker on GPU 0, the weights handed over by CUDA IPC
# ---------------------------------------------------------------------------

COLO = "gpu-colocated"


def gpu_worker(start_worker: WorkerStarter, model: Path, name: str, queue: str, extra: list[str]) -> Proc:
    return start_worker(
        model, name, queue=queue, pool=queue, timeout=600,
        # 0.1 each: the module's two workers hold 0.3 each, and vLLM refuses to start
        # an engine whose share is more than what is free.
        extra=["--device", "cuda", "--dtype", "bfloat16", "--gpu-memory-utilization", "0.1",
               "--max-model-len", "2048", *extra],
        env={"CUDA_VISIBLE_DEVICES": "0", **GPU_ENGINE_ENV},
    )


def test_colocated_cuda_ipc_handoff_matches_a_fresh_engine_and_survives_three_sleep_step_wake_cycles(
    start_worker: WorkerStarter, redis_client: Any,
) -> None:
    from rollout_queue.tasks.registry import live_workers
    from rollout_queue.weight_sync.transports.cuda_ipc import device_uuid

    torch.cuda.set_device(0)
    node = "gpu-colo@tests"
    gpu_worker(start_worker, qwen(1), node, COLO, ["--colocated", "--worker-extension-cls", BENCH_EXTENSION])
    (info,) = [w for w in live_workers(redis_client, COLO)]
    assert info.colocated and info.device_uuids == [device_uuid(0)]
    _, lps_a, _ = worker_prompt_logprobs(COLO)

    # The trainer's weights: model B, on the worker's GPU, as parameters an optimizer steps.
    params = {k: torch.nn.Parameter(v.to("cuda:0", torch.float32))
              for k, v in load_file(str(qwen(2) / "model.safetensors")).items()}
    sender = sync_weights.sender(COLO, SyncSettings(bucket_bytes=256 << 20, weight_sync_secret=CONTROL_SECRET))
    first = sender.sync(params, version=1, timeout=300)
    assert first.backend == "cuda_ipc" and first.workers == [node]
    as_bf16 = {k: p.detach().to(torch.bfloat16) for k, p in params.items()}
    assert checksums([node])[node] == pytest.approx(expected_sum(as_bf16), rel=1e-6)
    _, lps_worker, served = worker_prompt_logprobs(COLO)
    assert served == {node}

    # A fresh engine on model B, beside it on the same GPU.
    reference = gpu_worker(start_worker, qwen(2), "gpu-refb@tests", "gpu-refb", [])
    _, lps_fresh, _ = worker_prompt_logprobs("gpu-refb")
    reference.stop()
    moved, error = mean_abs(lps_a, lps_fresh), mean_abs(lps_worker, lps_fresh)
    print(f"[colocated] prompt-logprob distance A to B {moved:.4f}; worker after handoff vs fresh B {error:.4f}; "
          f"first handoff {first.seconds:.3f}s phases {first.phases}")
    assert error < 0.05 and error < moved / 5

    optimizer = torch.optim.SGD(params.values(), lr=1e-2)
    for cycle, level in enumerate([1, 2, 1], start=2):
        sync_weights.sleep(level, pool=COLO)
        waiting = generate.apply_async((PROMPTS[:2], {"temperature": 0.0, "max_tokens": 4}), queue=COLO)
        optimizer.zero_grad()
        loss = sum((p.float() * torch.randn_like(p)).mean() for p in params.values())
        loss.backward()
        optimizer.step()
        assert not waiting.ready(), "a task ran while the pool slept"
        report = sync_weights.wake(params, version=cycle, pool=COLO)
        assert report is not None and report.backend == "cuda_ipc" and report.version == cycle
        as_bf16 = {k: p.detach().to(torch.bfloat16) for k, p in params.items()}
        assert checksums([node])[node] == pytest.approx(expected_sum(as_bf16), rel=1e-6), f"cycle {cycle}"
        result = waiting.get(timeout=300)
        assert result["worker"] == node and result["weight_version"] == cycle
        assert all(len(o["samples"][0]["token_ids"]) == 4 for o in result["outputs"])
        print(f"[colocated] cycle {cycle} (sleep level {level}): handoff {report.seconds:.3f}s "
              f"phases {report.phases} worker {report.worker_phases}")

    # The trainer's tensors in the engine's dtype, its own (none cast for the sync):
    # the handoff names their storages, and from the second sync on the engine
    # copies them straight into its parameters.
    own = {k: p.detach().to(torch.bfloat16) for k, p in params.items()}
    for version in (5, 6):
        sent = expected_sum(own)
        report = sender.sync(own, version=version, timeout=300)
        # The next step's writes at once: the engine's copies may still run when the
        # sync returns, and the trainer's stream waits for them (its "released" event).
        for tensor in own.values():
            tensor.add_(torch.randn_like(tensor), alpha=1e-2)
        print(f"[colocated] own storages, sync {version}: {report.seconds:.4f}s phases {report.phases} "
              f"worker {report.worker_phases} receive {last_receive(node)}")
        assert checksums([node])[node] == pytest.approx(sent, rel=1e-6), f"sync {version}"
    assert last_receive(node)["in_place_bytes"] > 0
    # The trainer steps its tensors in place, and the pool sleeps (level 2: the
    # weights are dropped) and wakes with them: the copies into place carry the new values.
    for tensor in own.values():
        tensor.add_(torch.randn_like(tensor), alpha=1e-2)
    sync_weights.sleep(2, pool=COLO)
    # Woken without weights it would serve whatever that memory holds: refused, nothing woken.
    with pytest.raises(ControlFailed, match="dropped its weights"):
        sync_weights.wake(pool=COLO)
    with pytest.raises(ControlFailed, match="dropped its weights"):
        control.wake_up(["kv_cache"], pool=COLO)
    report = sync_weights.wake(own, version=7, pool=COLO)
    assert report is not None and last_receive(node)["in_place_bytes"] > 0
    assert checksums([node])[node] == pytest.approx(expected_sum(own), rel=1e-6)
    result = generate.apply_async((PROMPTS[:2], {"temperature": 0.0, "max_tokens": 4}), queue=COLO).get(timeout=300)
    assert result["worker"] == node and result["weight_version"] == 7
    sync_weights.close(COLO)
