"""The wire both sides of a weight sync share: buckets, pieces, process groups.

``plan_buckets`` lays the tensors out in buckets (the manifest);
``iter_buckets`` is the one walk over them that both ends make, bucket by
bucket with its tensors and the pieces it travels in; ``broadcast_bucket``
starts a bucket's broadcasts the same way on both ends.

Pure planning (``plan_buckets``, ``iter_buckets``) needs no torch. The rest imports torch
lazily, so producers that never sync never import it. Process groups are
built straight from a ``TCPStore`` (no ``init_process_group``), so they
neither need nor disturb the default group of the process they live in (the
trainer's, or vLLM's own inside its worker processes).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollout_queue.weight_sync.protocol import Manifest, TensorSpec

if TYPE_CHECKING:
    import torch

ALIGN = 64  # bytes; every tensor starts aligned so a view of any dtype is legal

# One piece of a bucket: its [start, end) bytes, and the tensor it is sent
# straight from (None: packed).
Piece = tuple[int, int, str | None]

DTYPE_SIZES = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4,
    "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_buckets(
    specs: Iterable[tuple[str, str, Sequence[int]]], bucket_bytes: int, chunk_bytes: int = 0,
    direct_bytes: int = 0,
) -> Manifest:
    """Pack (name, dtype, shape) in order into buckets of at most ``bucket_bytes``.

    A tensor larger than a bucket travels alone in a bucket of its own size.
    ``chunk_bytes``: the pieces each bucket travels in (0: the whole bucket);
    ``direct_bytes``: tensors this large travel as pieces of their own (see
    ``piece_ranges``).
    """
    tensors: list[TensorSpec] = []
    sizes: list[int] = []
    used = 0
    seen: set[str] = set()
    for name, dtype, shape in specs:
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice in the weights")
        seen.add(name)
        if dtype not in DTYPE_SIZES:
            raise ValueError(f"tensor {name!r} has dtype {dtype}, which cannot be synced")
        numel = 1
        for dim in shape:
            numel *= int(dim)
        nbytes = numel * DTYPE_SIZES[dtype]
        if not sizes or (used and used + nbytes > bucket_bytes):
            sizes.append(0)
            used = 0
        offset = used
        used = _align(offset + nbytes)
        sizes[-1] = offset + nbytes
        tensors.append(
            TensorSpec(name=name, dtype=dtype, shape=list(shape), bucket=len(sizes) - 1,
                       offset=offset, nbytes=nbytes)
        )
    return Manifest(tensors=tensors, bucket_sizes=sizes, chunk_bytes=chunk_bytes, direct_bytes=direct_bytes)


def chunk_ranges(size: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """The ``[start, end)`` byte ranges a bucket of ``size`` travels in."""
    step = chunk_bytes or size
    return [(start, min(start + step, size)) for start in range(0, size, step)]


def piece_ranges(manifest: Manifest, size: int, specs: Sequence[TensorSpec]) -> list[Piece]:
    """The pieces one bucket travels in, in order: ``(start, end, direct)``.

    ``direct`` names the tensor a piece is sent straight from (a tensor of at
    least ``manifest.direct_bytes``); the tensors between such pieces are packed
    and travel in ``chunk_bytes`` pieces. Both ends compute the same list from
    the manifest. ``specs``: the bucket's tensors in offset order. Bytes that
    hold no tensor (alignment between two direct pieces) do not travel.
    """
    pieces: list[Piece] = []
    cursor = 0
    following = 0  # index of the first tensor at or after the cursor

    def packed(upto: int) -> None:
        if following < len(specs) and specs[following].offset < upto:
            pieces.extend((cursor + a, cursor + b, None) for a, b in chunk_ranges(upto - cursor, manifest.chunk_bytes))

    for index, spec in enumerate(specs):
        if manifest.direct_bytes and spec.nbytes >= manifest.direct_bytes:
            packed(spec.offset)
            pieces.append((spec.offset, spec.offset + spec.nbytes, spec.name))
            cursor, following = spec.offset + spec.nbytes, index + 1
    packed(size)
    return pieces


@dataclass(frozen=True)
class Bucket:
    """One bucket of a manifest as it travels: its tensors and its pieces."""

    index: int
    size: int  # bytes
    specs: list[TensorSpec]  # its tensors, in offset order
    pieces: list[Piece]  # ``piece_ranges``, in send order


def iter_buckets(manifest: Manifest) -> Iterator[Bucket]:
    """The manifest's buckets in send order: the one walk both ends make."""
    by_bucket: dict[int, list[TensorSpec]] = {}
    for spec in manifest.tensors:
        by_bucket.setdefault(spec.bucket, []).append(spec)
    for index, size in enumerate(manifest.bucket_sizes):
        specs = by_bucket.get(index, [])
        yield Bucket(index, size, specs, piece_ranges(manifest, size, specs))


def groups_buckets(manifest: Manifest) -> bool:
    """Whether a bucket's pieces travel as one group (``broadcast_group``): when
    its bytes are not loaded piece by piece (``chunk_bytes`` 0). Both ends ask."""
    return not manifest.chunk_bytes


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as one flat uint8 tensor (a view when contiguous)."""
    import torch

    return tensor.contiguous().view(-1).view(torch.uint8)


def dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


def bucket_views(
    buffer: torch.Tensor, specs: Sequence[TensorSpec], offsets: Sequence[int] | None = None
) -> list[tuple[str, torch.Tensor]]:
    """Typed, shaped views of a received bucket (no copies); ``offsets``: where each
    tensor starts in ``buffer`` when not at its bucket offset."""
    starts = offsets if offsets is not None else [spec.offset for spec in specs]
    return [
        (spec.name, buffer[at : at + spec.nbytes].view(torch_dtype(spec.dtype)).view(spec.shape))
        for spec, at in zip(specs, starts)
    ]


def pack(buffer: torch.Tensor, specs: Iterable[TensorSpec], tensors: dict[str, torch.Tensor]) -> None:
    """Copy each tensor's bytes into its place in ``buffer``."""
    for spec in specs:
        src = tensors[spec.name]
        if src.device != buffer.device:
            src = src.to(buffer.device, non_blocking=True)
        buffer[spec.offset : spec.offset + spec.nbytes].copy_(flat_bytes(src), non_blocking=True)


def connect_store(host: str, port: int, timeout_s: float, *, is_master: bool = False) -> Any:
    """A ``TCPStore`` client, or (``is_master``) the server, listening on ``host`` only.

    torch's own server listens on every interface whatever ``host`` says; the
    master gets a socket bound here to ``host`` instead (``master_listen_fd``).
    """
    from torch.distributed import TCPStore

    listen_fd = None
    if is_master:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
        port = sock.getsockname()[1]
        listen_fd = sock.detach()  # the store owns the descriptor from here on
    return TCPStore(
        host, port, is_master=is_master, timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False, use_libuv=True, master_listen_fd=listen_fd,
    )


def new_group(
    store: Any, namespace: str, rank: int, world: int, backend: str, timeout_s: float,
    device: torch.device | None = None,
) -> Any:
    """A process group of ``world`` ranks over ``store``, its keys under ``namespace``
    (a sync's group: ``keys.sync_group`` of the round that forms it).

    Blocks until every rank has joined (or the timeout passes). NCCL sets its
    communicator up on the first collective, so there every rank enters one
    small broadcast on ``device`` (its CUDA device; required for NCCL) here.
    """
    import torch
    import torch.distributed as dist

    prefixed = dist.PrefixStore(namespace, store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # not in the stubs
        options._timeout = timeout
        options._devices = gloo_devices(store.host)
        return dist.ProcessGroupGloo(prefixed, rank, world, options)
    if device is None or device.type != "cuda":
        raise ValueError(f"an NCCL group needs the CUDA device of this rank, got {device}")
    source = local_address_towards(store.host)
    if not os.environ.get("NCCL_SOCKET_IFNAME") and not ipaddress.ip_address(source).is_loopback:
        # Across hosts, NCCL's sockets leave by the interface that reaches the
        # trainer (it reads this when the communicator is built, below).
        interface = interface_of(source)
        if interface is not None:
            os.environ["NCCL_SOCKET_IFNAME"] = f"={interface}"
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    group = dist.ProcessGroupNCCL(prefixed, rank, world, options)
    wait(broadcast(group, torch.zeros(1, dtype=torch.uint8, device=device)), timeout_s)
    return group


def local_address_towards(host: str) -> str:
    """The address of this machine that its routes use to reach ``host``.

    A UDP ``connect`` sends nothing: the kernel only picks the route and the
    source address. On the trainer, ``host`` is its own ``RQ_RENDEZVOUS_HOST``,
    so the answer is that address.
    """
    family, _, _, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return str(probe.getsockname()[0])


def interface_of(address: str) -> str | None:
    """The name of the interface that holds ``address``, if any."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(entry.address.split("%")[0] == address for entry in addresses):
            return name
    return None


def gloo_devices(store_host: str) -> list[Any]:
    """Where this rank's gloo sockets listen: the interfaces ``GLOO_SOCKET_IFNAME``
    names, else the address the route to the rendezvous host leaves from.

    Gloo's own default resolves the hostname, which is often 127.0.0.1 (or an
    address of another network): every peer on another host would then be told
    to connect to its own loopback, and the group would hang until its timeout.
    """
    import torch.distributed as dist

    names = [name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name]
    if names:
        return [dist.ProcessGroupGloo.create_device(interface=name) for name in names]
    return [dist.ProcessGroupGloo.create_device(hostname=local_address_towards(store_host))]


def check_reachable(host: str, port: int, timeout_s: float) -> None:
    """Open and close one TCP connection to ``host:port``; ``OSError`` when it fails."""
    socket.create_connection((host, port), timeout=timeout_s).close()


def broadcast(group: Any, tensor: torch.Tensor) -> Any:
    """Start a broadcast from rank 0; returns the work handle."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    return group.broadcast([tensor], opts)


def broadcast_group(group: Any, tensors: Sequence[torch.Tensor]) -> list[Any]:
    """Start broadcasts of several tensors from rank 0, in order.

    Where the backend can (NCCL), they are launched as one group: one kernel
    launch and one work handle for all of them instead of a launch, events and
    a handle each (a 7B sync sends ~160 pieces). Every rank must group the
    same tensors. Returns one work per tensor, or the group's single work.
    """
    if len(tensors) < 2 or not getattr(group, "supports_coalescing", False):
        return [broadcast(group, tensor) for tensor in tensors]
    group._start_coalescing()  # the backend's own (no device argument; the tensors' is used)
    try:
        for tensor in tensors:
            broadcast(group, tensor)
    finally:
        work = group._end_coalescing()
    return [work]


def broadcast_bucket(group: Any, manifest: Manifest, pieces: Iterable[torch.Tensor]) -> list[Any]:
    """Start the broadcasts of one bucket's pieces: one work per piece, or one for
    the bucket where it travels as one group (``groups_buckets``; NCCL).

    ``pieces`` may be a generator: outside a group each piece's broadcast starts
    before the next piece is asked for (the sender packs it meanwhile).
    """
    if groups_buckets(manifest):
        return broadcast_group(group, list(pieces))
    return [broadcast(group, piece) for piece in pieces]


def abort(group: Any) -> None:
    """Close a group's connections and fail its pending operations (where the
    backend can); errors are not raised: the group is being dropped."""
    try:
        group.abort()
    except Exception:  # noqa: BLE001, S110  best effort on a broken group
        pass


def wait(work: Any, timeout_s: float) -> None:
    work.wait(datetime.timedelta(seconds=max(timeout_s, 0.001)))
