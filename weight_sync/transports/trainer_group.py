"""The ``vllm`` transport: the trainer's own group, made with vLLM's
``StatelessProcessGroup``, carrying vLLM's packed layout.

A trainer written for ``vllm serve`` (TRL's ``VLLMClient``) opens rank 0 of a
group itself (``vllm.distributed.weight_transfer.nccl_common.trainer_init``:
a ``StatelessProcessGroup`` whose TCPStore it hosts at ``master_address:
master_port``, then a ``PyNcclCommunicator``) and broadcasts the tensors it
announced (names, dtype names, shapes) back to back, in chunks cut where
their running size first passes ``packed_buffer_size_bytes``
(``vllm.distributed.weight_transfer.packed_tensor``). Both ends here follow
that, so the trainer runs unchanged:

Engine (:class:`TrainerGroupReceiver`): joins the trainer's group once, at
``/init_weight_transfer_engine`` (``rq_transfer_join``, one engine rank each,
rank ``offset + rank``): a ``StatelessProcessGroup``, then NCCL
(``PyNcclCommunicator``, as vLLM's workers) on CUDA or gloo over the same
store on CPU (:func:`gloo_over_stateless`). The group lives on between
updates. Each update is an ordinary sync round (``weight_sync.receiver``):
the manifest is vLLM's packed layout (:func:`packed_manifest`: one bucket per
chunk, tensors unaligned), each chunk is received whole and loaded; a
tensor of another dtype than the engine's is converted first.

Relay: a worker outside the trainer's group (started or restarted since its
init) takes the same chunks in the same round from a member's engine, which
forwards each chunk it received over a group formed for the round in the
coordinator's store (``SyncDecision.relay``, ``keys.sync_relay``): the
source's first engine rank is rank 0 there and starts each forward as the
chunk arrives, while it loads it; a forward that fails or stalls past the
plan's ``group_join`` is given up and leaves the source's own update whole.

Trainer (:class:`TrainerGroupSender`): nothing to send, the trainer
broadcasts by itself; the coordinator (``weight_sync.vllm_transfer``) only
runs the rounds. For a trainer on CPU, which TRL does not provide (its
communicator is CUDA-only), :func:`gloo_trainer_init` and
:func:`gloo_packed_broadcast` are the gloo twins of TRL's two transport
functions.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollout_queue.tasks import keys
from rollout_queue.tasks.errors import RendezvousTimeout, WeightSyncError
from rollout_queue.weight_sync import wire
from rollout_queue.weight_sync.protocol import Manifest, SyncRound, TensorSpec, UpdateRequest
from rollout_queue.weight_sync.transports.base import BucketSink, SendJob, TransportReceiver, TransportSender

if TYPE_CHECKING:
    import torch

    from rollout_queue.weight_sync.settings import SyncSettings

# vLLM's DEFAULT_PACKED_BUFFER_SIZE_BYTES: the chunk size when the trainer names none.
DEFAULT_PACKED_BUFFER_BYTES = 1 << 30
# The gloo group's own prefix inside the StatelessProcessGroup's store.
GLOO_PREFIX = "rq-trainer-gloo"

log = logging.getLogger(__name__)


def packed_manifest(
    names: Sequence[str], dtype_names: Sequence[str], shapes: Sequence[Sequence[int]], buffer_bytes: int,
) -> Manifest:
    """vLLM's packed layout as a manifest: one bucket per chunk, tensors back to back.

    A chunk takes tensors until their running size first passes
    ``buffer_bytes`` (the tensor that passes it included), as
    ``packed_nccl_broadcast_consumer`` cuts them. ``ValueError`` names the
    first tensor the wire cannot carry.
    """
    if not (len(names) == len(dtype_names) == len(shapes)):
        raise ValueError(f"names, dtype_names and shapes differ in length: {len(names)}, "
                         f"{len(dtype_names)}, {len(shapes)}")
    if not names:
        raise ValueError("the update names no tensor")
    tensors: list[TensorSpec] = []
    sizes: list[int] = []
    used = 0
    closed = True
    seen: set[str] = set()
    for name, dtype, shape in zip(names, dtype_names, shapes):
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice in the update")
        seen.add(name)
        if dtype not in wire.DTYPE_SIZES:
            raise ValueError(f"tensor {name!r} has dtype {dtype!r}; the wire carries "
                             f"{', '.join(sorted(wire.DTYPE_SIZES))}")
        if any(int(dim) < 0 for dim in shape):
            raise ValueError(f"tensor {name!r} has a negative dimension in shape {list(shape)}")
        numel = 1
        for dim in shape:
            numel *= int(dim)
        nbytes = numel * wire.DTYPE_SIZES[dtype]
        if closed:
            sizes.append(0)
            used = 0
        tensors.append(TensorSpec(name=name, dtype=dtype, shape=[int(d) for d in shape],
                                  bucket=len(sizes) - 1, offset=used, nbytes=nbytes))
        used += nbytes
        sizes[-1] = used
        closed = used > buffer_bytes
    return Manifest(tensors=tensors, bucket_sizes=sizes)


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


# ------------------------------------------------------------------ groups


def gloo_over_stateless(stateless_group: Any, timeout_s: float) -> Any:
    """A gloo group of the ranks of a ``StatelessProcessGroup``, over its store:
    the CPU stand-in for the ``PyNcclCommunicator`` vLLM builds on it."""
    import torch.distributed as dist

    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # not in the stubs
    options._timeout = datetime.timedelta(seconds=timeout_s)
    options._devices = wire.gloo_devices(stateless_group.store.host)
    store = dist.PrefixStore(GLOO_PREFIX, stateless_group.store)
    return dist.ProcessGroupGloo(store, stateless_group.rank, stateless_group.world_size, options)


@dataclass
class GlooTrainerEndpoint:
    """The trainer's rank 0 on CPU: ``group`` is the ``StatelessProcessGroup`` (TRL's
    ``close_communicator`` clears its ``store``), ``gloo`` the group that carries bytes."""

    group: Any
    gloo: Any
    timeout_s: float

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        if src != 0:
            raise ValueError("the trainer broadcasts from rank 0")
        wire.wait(wire.broadcast(self.gloo, tensor), self.timeout_s)


def gloo_trainer_init(init_info: dict[str, Any], rank: int = 0, timeout_s: float = 300.0) -> GlooTrainerEndpoint:
    """The gloo twin of vLLM's ``nccl_common.trainer_init``: host the group's store
    at ``master_address:master_port`` and join it as rank 0."""
    from vllm.distributed.utils import StatelessProcessGroup

    group = StatelessProcessGroup.create(
        host=init_info["master_address"], port=int(init_info["master_port"]), rank=rank,
        world_size=int(init_info["world_size"]), store_timeout=int(timeout_s),
    )
    return GlooTrainerEndpoint(group, gloo_over_stateless(group, timeout_s), timeout_s)


def gloo_packed_broadcast(
    iterator: Iterator[tuple[str, torch.Tensor]], group: GlooTrainerEndpoint, src: int,
    post_iter_func: Callable[[tuple[str, torch.Tensor]], torch.Tensor],
    buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_BYTES, num_buffers: int = 2,
) -> None:
    """The gloo twin of vLLM's ``packed_nccl_broadcast_producer``: the same chunks
    (vLLM's ``pack_tensors``), broadcast one after the other."""
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    while (chunk := pack_tensors(iterator, post_iter_func, buffer_size_bytes)) is not None:
        group.broadcast(chunk.packed_tensor, src=src)


# ------------------------------------------------------------------ trainer


class TrainerGroupSender(TransportSender):
    """The coordinator's end: the trainer broadcasts by itself, so nothing is sent;
    ``group_round`` names the group its workers joined at init (the round that
    init opened)."""

    def __init__(self, name: str, settings: SyncSettings) -> None:
        super().__init__(name, settings)
        self.group_round: SyncRound | None = None

    def device(self) -> torch.device:
        import torch

        return torch.device("cpu")

    def group_for(self, sync_round: SyncRound, offsets: dict[str, int]) -> SyncRound | None:
        return self.group_round  # the group formed at init serves every update

    def send(self, job: SendJob) -> None:
        """The trainer's own broadcast is the transfer; the commit acks tell."""


# ------------------------------------------------------------------- engine


def join_relay(request: UpdateRequest, rank: int, device: Any) -> tuple[Any, Any]:
    """Join round ``request.plan.round``'s relay group as ``rank`` (blocks until every
    rank has joined); the store client and the group."""
    plan, relay = request.plan, request.decision.relay
    assert relay is not None
    if device.type == "cuda":
        import torch

        torch.cuda.set_device(device)
    store = wire.connect_store(plan.store_host, plan.store_port, plan.timeouts.store_connect)
    group = wire.new_group(store, keys.sync_relay(plan.round), rank, relay.world,
                           "nccl" if device.type == "cuda" else "gloo", timeout_s=plan.timeouts.group_join,
                           device=device)
    return store, group


class RelayForward:
    """The source's end of a round's relay: each chunk it received from the trainer,
    broadcast on to the catching-up workers while it loads it.

    The join runs on ``executor`` from ``begin`` on; each forward waits for the one
    before (at most ``stall_s``). A failure gives the relay up, logged: the
    targets' receives fail and fence them, this rank's own update goes on.
    """

    def __init__(self, executor: ThreadPoolExecutor, request: UpdateRequest, device: Any) -> None:
        self.round = request.plan.round
        self.stall_s = request.plan.timeouts.group_join
        self.joining: Future[tuple[Any, Any]] = executor.submit(join_relay, request, 0, device)
        self.group: Any = None
        self.pending: tuple[Any, Any] | None = None  # the last forward's work, and its chunk (kept alive)
        self.broken: str | None = None

    def forward(self, chunk: Any) -> None:
        if self.broken is not None:
            return
        try:
            self.settle()
            if self.group is None:
                self.group = self.joining.result(timeout=self.stall_s)[1]
            self.pending = (wire.broadcast(self.group, chunk), chunk)
        except Exception as exc:  # noqa: BLE001  the relay's failure is the targets', not this rank's
            self.give_up(exc)

    def settle(self) -> None:
        """Wait for the forward in flight (raises what broke it)."""
        if self.pending is not None:
            work, self.pending = self.pending[0], None
            wire.wait(work, self.stall_s)

    def finish(self) -> None:
        """Every chunk forwarded, or the relay given up."""
        if self.broken is None:
            try:
                self.settle()
            except Exception as exc:  # noqa: BLE001  as in forward
                self.give_up(exc)
        self.group = None

    def give_up(self, exc: BaseException) -> None:
        self.broken = f"{type(exc).__name__}: {exc}"
        log.warning("round %s: forwarding the trainer's chunks to the catching-up workers failed (%s); "
                    "they stay fenced, this worker's own update goes on", self.round, self.broken)
        if self.group is not None:
            wire.abort(self.group)
        self.group = None
        self.pending = None


class TrainerGroupReceiver(TransportReceiver):
    """One engine rank of the trainer's group (joined at init, kept between updates),
    or, for one round, of that round's relay (a source or a target)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.group_round: SyncRound | None = None
        self.stateless: Any = None
        self.communicator: Any = None  # PyNcclCommunicator (CUDA) or a gloo group (CPU)
        self.engine_dtype: Any = None
        self.buffer_bytes = DEFAULT_PACKED_BUFFER_BYTES
        # This round's relay: the group a catching-up rank receives from (with its
        # store client), or the source rank's forward.
        self.relay_in: tuple[Any, Any] | None = None
        self.relay_out: RelayForward | None = None
        # Two: a failed round's join may still be waiting out its timeout.
        self._relay_joins = ThreadPoolExecutor(max_workers=2, thread_name_prefix="relay-join")

    def join(self, init: dict[str, Any], rank: int, device: Any, engine_dtype: Any) -> int:
        """Join the trainer's group as ``rank`` (blocks until every rank has joined)."""
        from vllm.distributed.utils import StatelessProcessGroup

        self.leave()
        timeout_s = float(init.get("timeout_s", 120.0))
        try:
            if device.type == "cuda":  # exactly as vLLM's NCCL engine joins (nccl_common)
                from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group

                self.communicator = stateless_init_process_group(
                    init["master_address"], int(init["master_port"]), rank, int(init["world_size"]), device)
            else:
                self.stateless = StatelessProcessGroup.create(
                    host=init["master_address"], port=int(init["master_port"]), rank=rank,
                    world_size=int(init["world_size"]), store_timeout=int(timeout_s),
                )
                self.communicator = gloo_over_stateless(self.stateless, timeout_s)
        except Exception as exc:
            self.leave()
            raise RendezvousTimeout(
                f"engine rank {rank} could not join the trainer's group at {init['master_address']}:"
                f"{init['master_port']} ({type(exc).__name__}: {exc}); the trainer must open rank 0 "
                "while /init_weight_transfer_engine runs", phase="rendezvous",
            ) from exc
        self.group_round = SyncRound(str(init["group_round"]))
        self.engine_dtype = engine_dtype
        self.buffer_bytes = int(init.get("packed_buffer_size_bytes", DEFAULT_PACKED_BUFFER_BYTES))
        return rank

    def leave(self) -> None:
        if self.communicator is not None and hasattr(self.communicator, "destroy"):
            self.communicator.destroy()
        self.communicator = None
        self.stateless = None
        self.group_round = None
        self._drop_relay()

    def begin(self, request: UpdateRequest, rank: int, device: Any) -> None:
        decision, node = request.decision, request.node
        self._drop_relay()
        local_rank = rank - decision.offsets.get(node, 0)
        if decision.relay is not None and decision.relayed(node):
            # Outside the trainer's group: this round's chunks come from the source's engine.
            try:
                self.relay_in = join_relay(request, decision.relay.offsets[node] + local_rank, device)
            except Exception as exc:
                raise RendezvousTimeout(
                    f"engine rank {local_rank} of {node} could not join round {request.plan.round}'s relay from "
                    f"{decision.relay.source} ({type(exc).__name__}: {exc}); it stays fenced until a later "
                    "update reaches it", phase="rendezvous") from exc
            return
        if self.communicator is None or self.group_round != decision.group_round:
            raise WeightSyncError(
                f"this engine rank is not in the trainer's group {decision.group_round} (it joined "
                f"{self.group_round or 'none'}: started or restarted since); fenced until the trainer calls "
                "/init_weight_transfer_engine again", phase="rendezvous",
            )
        if decision.relay is not None and decision.relay.source == node and local_rank == 0:
            self.relay_out = RelayForward(self._relay_joins, request, device)

    def receive(self, sink: BucketSink, manifest: Manifest, device: Any, deadline: float) -> dict[str, float]:
        import torch

        wire_s = load_s = 0.0
        try:
            for bucket in wire.iter_buckets(manifest):
                t0 = time.monotonic()
                buffer = torch.empty(bucket.size, dtype=torch.uint8, device=device)
                self._broadcast(buffer, deadline)
                t1 = time.monotonic()
                if self.relay_out is not None:
                    self.relay_out.forward(buffer)  # goes on while this rank loads the chunk
                self._load(sink, buffer, bucket.specs)
                sink.arrived([spec.name for spec in bucket.specs])
                wire_s += t1 - t0
                load_s += time.monotonic() - t1
            if self.relay_out is not None:
                self.relay_out.finish()
        except Exception:
            if self.relay_in is not None:
                self._drop_relay()  # this rank holds no trainer's group to lose
            else:
                self.leave()  # a failed collective leaves the group unusable
            raise
        return {"wire_s": wire_s, "load_s": load_s}

    def finish(self) -> None:
        self._drop_relay()

    def _drop_relay(self) -> None:
        """Leave this round's relay (a forward still in flight is cut off)."""
        if self.relay_out is not None and self.relay_out.group is not None:
            wire.abort(self.relay_out.group)
        self.relay_in = None
        self.relay_out = None

    def _broadcast(self, buffer: Any, deadline: float) -> None:
        if self.relay_in is not None:
            wire.wait(wire.broadcast(self.relay_in[1], buffer), deadline - time.monotonic())
            return
        if buffer.device.type == "cuda":
            import torch

            self.communicator.broadcast(buffer, src=0)
            torch.cuda.current_stream().synchronize()
        else:
            wire.wait(wire.broadcast(self.communicator, buffer), deadline - time.monotonic())

    def _load(self, sink: BucketSink, buffer: Any, specs: list[TensorSpec]) -> None:
        """Load a chunk's tensors: in place where the layout allows a typed view,
        converted to the engine's dtype where the trainer sent another."""
        target = _dtype_name(self.engine_dtype) if self.engine_dtype is not None else None
        as_is: list[TensorSpec] = []
        for spec in specs:
            size = wire.DTYPE_SIZES[spec.dtype]
            floating = spec.dtype.startswith(("float", "bfloat"))
            if spec.offset % size == 0 and (target is None or not floating or spec.dtype == target):
                as_is.append(spec)
                continue
            view = buffer[spec.offset: spec.offset + spec.nbytes].clone()  # aligned
            tensor = view.view(wire.torch_dtype(spec.dtype))
            if floating and target is not None and spec.dtype != target:
                tensor = tensor.to(self.engine_dtype)
            flat = wire.flat_bytes(tensor)
            converted = spec.model_copy(update={"dtype": _dtype_name(tensor.dtype), "offset": 0,
                                                "nbytes": int(flat.numel())})
            sink.load(flat, [converted], [0])
        if as_is:
            sink.load(buffer, as_is, [spec.offset for spec in as_is])

    def abort(self) -> None:
        """The trainer's group stays: a failed load leaves it usable (a failed collective
        was dropped in receive); this round's relay goes."""
        self._drop_relay()


__all__ = [
    "DEFAULT_PACKED_BUFFER_BYTES", "GlooTrainerEndpoint", "RelayForward", "TrainerGroupReceiver",
    "TrainerGroupSender", "gloo_over_stateless", "gloo_packed_broadcast", "gloo_trainer_init", "join_relay",
    "packed_manifest",
]
