"""Weight-sync benchmark: end-to-end sync vs raw broadcast vs one round trip per tensor.

In one run, against one real worker (vLLM engine with dummy weights of the
chosen shape) and one bare receiver process on the same device:

  a  ``sync_weights.broadcast`` end to end (first sync, then steady state)
  b  a raw broadcast of the same bucket sizes over the same transport, to a
     bare receiver process that posts its receives only when its round
     begins (and, as ``raw_into_worker_s``, into the worker's
     engine process over the sync group: all buckets posted at once, no loads)
  c  one tensor a round trip: for every tensor, one control round trip to
     the worker, which receives that tensor alone over the sync group and
     loads it with a bare ``load_weights``

The worker loads the receiver with the benchmarks' engine calls
(``weight_sync.bench_receiver``: ``receive_raw``, ``receive_one``,
``last_receive``).

Prints one JSON line with a/b and c/a. CPU (gloo): 0.5B-shaped float32.
CUDA (NCCL): 7B-shaped bf16, trainer on GPU 1, worker and receiver on GPU 0:

    python bench/weight_transfer.py --device cuda --shape qwen2-7b
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rollout_queue.tasks.settings import environment_redis_url, redact_url, redis_url_env  # after the path


def state_dict(shape: str, dtype: str, device: str) -> dict:
    import torch
    from transformers import Qwen2ForCausalLM

    from rollout_queue.cli.tiny_model import qwen2_config

    with torch.device("meta"):
        model = Qwen2ForCausalLM(qwen2_config(shape, dtype))
    out = {}
    gen = torch.Generator(device=device).manual_seed(0)
    for name, param in model.named_parameters():  # tied weights appear once
        tensor = torch.empty(param.shape, dtype=getattr(torch, dtype), device=device)
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
        else:
            tensor.normal_(0.0, 0.02, generator=gen)
        out[name] = tensor
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--shape", default=None, help="qwen2-0.5b (CPU default) or qwen2-7b (CUDA default)")
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--bucket-mib", type=int, default=1024)
    parser.add_argument("--chunk-mib", type=int, default=None,
                        help="pieces a bucket travels in (default: SyncSettings' choice for the transport)")
    parser.add_argument("--direct-mib", type=int, nargs="+", default=[None],
                        help="tensors this large are sent straight from their memory (0: all packed; "
                             "default: SyncSettings'); several values: one line each, against the same worker")
    parser.add_argument("--cpu-weights", choices=["packed", "plain"], default="packed",
                        help="CPU: the worker's --cpu-weights (plain: direct, in-place loads)")
    parser.add_argument("--trainer-gpu", type=int, default=1)
    parser.add_argument("--worker-gpu", type=int, default=0)
    parser.add_argument("--redis-url", default=environment_redis_url())
    args = parser.parse_args()
    cuda = args.device == "cuda"
    shape = args.shape or ("qwen2-7b" if cuda else "qwen2-0.5b")
    dtype = "bfloat16" if cuda else "float32"

    import torch

    from rollout_queue.cli.localstack import LocalStack, WorkerSpec
    from rollout_queue.cli.tiny_model import make_tiny_model

    run_dir = ROOT / ".artifacts" / "bench-weight-sync"
    run_dir.mkdir(parents=True, exist_ok=True)
    model_dir = make_tiny_model(ROOT / ".models" / f"{shape}-config", kind=shape, weights=False, dtype=dtype)
    trainer_device = f"cuda:{args.trainer_gpu}" if cuda else "cpu"
    peer_device = "cuda:0" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(args.trainer_gpu)

    with LocalStack(run_dir, prefix="bench-sync") as stack:
        url = stack.ensure_redis(args.redis_url)
        os.environ.update(redis_url_env(url))  # both names: RQ_REDIS_URL would win
        from rollout_queue.tasks import app, keys, sync_weights
        from rollout_queue.tasks.app import configure
        from rollout_queue.tasks.app import settings as client_settings
        from rollout_queue.tasks.auth import signed_arguments
        from rollout_queue.tasks.settings import ClientSettings
        from rollout_queue.weight_sync import wire
        from rollout_queue.weight_sync.bench_receiver import BENCH_EXTENSION
        from rollout_queue.weight_sync.settings import SyncSettings

        configure(ClientSettings())
        worker_env = {"CUDA_VISIBLE_DEVICES": str(args.worker_gpu)} if cuda else {}
        spec = WorkerSpec(
            model=model_dir, device=args.device, dtype=dtype,
            max_model_len=1024, gpu_memory_utilization=0.5 if cuda else 0.15,
            extra=["--load-format", "dummy", "--worker-extension-cls", BENCH_EXTENSION,
                   *(["--cpu-weights", args.cpu_weights] if not cuda else [])],
            env=worker_env,
        )
        # stderr: stdout carries the JSON line. A silent wait was 15 minutes of nothing once.
        print(f"waiting for {stack.worker_name(0)} to serve on {redact_url(url)} "
              f"(log {run_dir / 'worker-0.log'})", file=sys.stderr, flush=True)
        stack.start_worker(spec, timeout=900)
        worker = stack.worker_name(0)

        weights = state_dict(shape, dtype, trainer_device)
        total_bytes = sum(t.numel() * t.element_size() for t in weights.values())

        def settings(direct_mib: int | None) -> SyncSettings:
            chosen = {"bucket_bytes": args.bucket_mib << 20}
            if args.chunk_mib is not None:
                chosen["chunk_bytes"] = args.chunk_mib << 20
            if direct_mib is not None:
                chosen["direct_bytes"] = direct_mib << 20
            return SyncSettings(**chosen)

        sender = sync_weights.sender(stack.tag, settings(args.direct_mib[0]))
        backend = "nccl" if cuda else "gloo"
        manifest, _ = sender.manifest(list(weights.items()), sender.membership(), backend)
        sizes_b = manifest.bucket_sizes  # the same for every --direct-mib

        # b needs a bare receiver on the worker's device, joined before the first leg
        store_port = _free_port()
        store = wire.connect_store("127.0.0.1", store_port, 120.0, is_master=True)
        # Keep the caller's PYTHONPATH (the GPU machine's staged packages live there).
        peer_env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
        if cuda:
            peer_env["CUDA_VISIBLE_DEVICES"] = str(args.worker_gpu)
        peer = subprocess.Popen(
            [sys.executable, str(ROOT / "bench" / "_raw_peer.py"), "127.0.0.1", str(store_port),
             backend, peer_device, json.dumps(sizes_b), str(args.iters * len(args.direct_mib))],
            stdout=subprocess.PIPE, text=True, env=peer_env,
        )
        group = wire.new_group(store, "raw", 0, 2, backend, 120.0, torch.device(trainer_device))
        buffers = [torch.empty(size, dtype=torch.uint8, device=trainer_device) for size in sizes_b]

        def engine_op(op: str, op_args: dict, timeout: float) -> list:
            """One control round trip to the worker's engine; its results."""
            arguments = signed_arguments(keys.CONTROL_ENGINE, {"op": op, "args": op_args},
                                         client_settings().weight_sync_secret, destination=[worker])
            replies = app.control.broadcast(
                keys.CONTROL_ENGINE, arguments=arguments,
                destination=[worker], reply=True, timeout=timeout, limit=1,
            )
            bodies = [body for r in replies or [] for body in r.values()]
            if not bodies or not all(body["ok"] for body in bodies):
                raise RuntimeError(f"engine op {op} failed: {replies}")
            return [body["result"] for body in bodies]

        def raw_leg(over: object, receive: Callable[[], object] = lambda: None) -> tuple[float, object]:
            """Every bucket buffer broadcast at once over ``over``; ``receive`` starts
            the receiving side when it is not already waiting. Seconds, and what
            ``receive`` returned."""
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            works = [wire.broadcast(over, buf) for buf in buffers]
            received = receive()
            for work in works:
                wire.wait(work, 300.0)
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter() - t0, received

        rounds = iter(range(args.iters * len(args.direct_mib)))

        def raw_to_peer() -> float:
            """b: one round to the bare receiver, which posts only when told (so no
            receive of its waits on the worker's GPU during the sync legs)."""
            index = next(rounds)
            store.set(f"bench/go/{index}", "1")
            store.get(f"bench/posted/{index}")
            return raw_leg(group)[0]

        # a (end to end) and b (raw) alternate, so load on the machine hits both alike;
        # each --direct-mib value gets a sender of its own (a new group, a first sync)
        legs = []
        version = 0
        for direct_mib in args.direct_mib:
            sender = sync_weights.sender(stack.tag, settings(direct_mib))
            sync_times, raw_times = [], []
            for _ in range(args.iters):
                version += 1
                report = sender.sync(weights, version=version, timeout=600)
                sync_times.append(report.seconds)
                raw_times.append(raw_to_peer())
                benchlib_log(f"direct {direct_mib} sync {version}: {report.seconds:.4f}s raw "
                             f"{raw_times[-1]:.4f}s phases {report.phases} worker {report.worker_phases}")
            received = engine_op("last_receive", {}, 60)[0][0]
            legs.append((sender.settings.direct_bytes, sync_times, raw_times, report, received))

        peer.communicate(timeout=120)

        # b': the same raw broadcast into the worker's engine process, over the
        # sync group (all buckets posted at once, nothing loaded): tells the
        # receiving process's own cost apart from the sync pipeline's.
        raw_worker_times = []
        for _ in range(args.iters):
            seconds, worker_side = raw_leg(
                sender.transport(backend).group, lambda: engine_op("receive_raw", {"sizes": sizes_b}, 300))
            raw_worker_times.append(seconds)
            benchlib_log(f"raw into worker: {raw_worker_times[-1]:.4f}s (worker side {worker_side})")

        # c: per tensor, one control round trip; the worker receives and loads it
        t0 = time.perf_counter()
        for spec in manifest.tensors:
            flat = weights[spec.name].reshape(-1).view(torch.uint8)
            work = wire.broadcast(sender.transport(backend).group, flat)
            engine_op("receive_one", {"name": spec.name, "dtype": spec.dtype, "shape": spec.shape}, 120)
            wire.wait(work, 300.0)
        if cuda:
            torch.cuda.synchronize()
        per_tensor = time.perf_counter() - t0

        for direct_bytes, sync_times, raw_times, report, received in legs:
            first = sync_times[0]
            steady = statistics.median(sync_times[1:]) if len(sync_times) > 1 else first
            raw = statistics.median(raw_times[1:]) if len(raw_times) > 1 else raw_times[0]
            line = {
                "bench": "weight_sync",
                "device": args.device,
                "backend": backend,
                "shape": shape,
                "dtype": dtype,
                **({} if cuda else {"cpu_weights": args.cpu_weights}),
                "tensors": len(manifest.tensors),
                "bytes": total_bytes,
                "buckets": len(sizes_b),
                "direct_mib": direct_bytes / (1 << 20),
                "direct_tensors": sum(spec.nbytes >= direct_bytes > 0 for spec in manifest.tensors),
                "in_place_bytes": int(received.get("in_place_bytes", 0)),
                "first_sync_s": round(first, 4),
                "sync_s": round(steady, 4),
                "raw_broadcast_s": round(raw, 4),
                "raw_into_worker_s": round(statistics.median(raw_worker_times[1:] or raw_worker_times), 4),
                "per_tensor_rpc_s": round(per_tensor, 4),
                "a_over_b": round(steady / raw, 3),
                "c_over_a": round(per_tensor / steady, 2),
                "sync_gb_per_s": round(total_bytes / steady / 1e9, 2),
                "raw_gb_per_s": round(total_bytes / raw / 1e9, 2),
                "last_sync_phases_s": {k: round(v, 4) for k, v in report.phases.items()},
                "worker_phases_s": {k: round(v, 4) for k, v in report.worker_phases.items()},
            }
            print(json.dumps(line), flush=True)
        sync_weights.close()
    return 0


def benchlib_log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


if __name__ == "__main__":
    sys.exit(main())
