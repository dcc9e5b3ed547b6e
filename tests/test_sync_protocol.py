"""Weight-sync protocol pieces: bucket planning, tensor collection, phase order,
signing, errors as kinds, and the gloo wire between two real processes (no engine)."""

from __future__ import annotations

import itertools
import json
import socket
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
import torch

from rollout_queue.tasks import keys
from rollout_queue.tasks.auth import CommandVerifier, signed_arguments
from rollout_queue.tasks.errors import ControlRefused, WeightSyncError
from rollout_queue.weight_sync import wire
from rollout_queue.weight_sync.protocol import Manifest, SyncAck, SyncPlan, SyncRound, WorkerTimeouts
from rollout_queue.weight_sync.sender import named_tensors
from tests.conftest import wait_for
from tests.procs import ROOT, free_port


def test_buckets_pack_tensors_in_order_and_never_exceed_the_bucket_size() -> None:
    specs = [(f"w{i}", "float32", [100]) for i in range(10)]  # 400 bytes each
    manifest = wire.plan_buckets(specs, bucket_bytes=1024)
    assert [t.name for t in manifest.tensors] == [f"w{i}" for i in range(10)]
    assert all(size <= 1024 for size in manifest.bucket_sizes)
    per_bucket: dict[int, list[str]] = {}
    for spec in manifest.tensors:
        per_bucket.setdefault(spec.bucket, []).append(spec.name)
        assert spec.offset % wire.ALIGN == 0
        assert spec.offset + spec.nbytes <= manifest.bucket_sizes[spec.bucket]
    assert len(per_bucket) == len(manifest.bucket_sizes) == 5


def test_buckets_travel_in_pieces_that_cover_them_exactly() -> None:
    assert wire.chunk_ranges(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert wire.chunk_ranges(10, 0) == [(0, 10)]
    assert wire.chunk_ranges(8, 16) == [(0, 8)]
    manifest = wire.plan_buckets([("w", "float32", [100])], bucket_bytes=1024, chunk_bytes=128)
    assert manifest.chunk_bytes == 128


def test_large_tensors_travel_as_pieces_of_their_own_and_the_rest_packed() -> None:
    specs = [("a", "float32", [10]), ("big1", "float32", [60]), ("big2", "float32", [64]),
             ("b", "float32", [20]), ("c", "float32", [20]), ("big3", "float32", [100])]
    manifest = wire.plan_buckets(specs, bucket_bytes=4096, chunk_bytes=64, direct_bytes=240)
    assert manifest.direct_bytes == 240
    at = {t.name: t for t in manifest.tensors}
    pieces = wire.piece_ranges(manifest, manifest.bucket_sizes[0], manifest.tensors)
    direct = {name: (start, end) for start, end, name in pieces if name is not None}
    assert direct == {n: (at[n].offset, at[n].offset + at[n].nbytes) for n in ("big1", "big2", "big3")}
    # In order, never overlapping, every tensor byte covered once.
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(pieces))
    for t in manifest.tensors:
        assert sum(max(0, min(end, t.offset + t.nbytes) - max(start, t.offset)) for start, end, _ in pieces) == t.nbytes
    packed = [(start, end) for start, end, name in pieces if name is None]
    assert packed[0] == (0, 64)  # "a" and the alignment up to big1
    assert all(end - start <= 64 for start, end in packed)  # b and c: in 64-byte pieces
    assert sum(end - start for start, end in packed) == 64 + (at["big3"].offset - at["b"].offset)
    assert at["big2"].offset > at["big1"].offset + at["big1"].nbytes  # the gap that does not travel
    # direct_bytes 0: every byte packed, in chunk_bytes pieces
    plain = wire.plan_buckets(specs, bucket_bytes=4096, chunk_bytes=64)
    assert [(s, e) for s, e, _ in wire.piece_ranges(plain, plain.bucket_sizes[0], plain.tensors)] == \
        wire.chunk_ranges(plain.bucket_sizes[0], 64)


def test_a_tensor_larger_than_a_bucket_travels_alone() -> None:
    manifest = wire.plan_buckets(
        [("small", "bfloat16", [4]), ("huge", "float32", [1000]), ("tail", "int64", [2])], 256
    )
    buckets = {t.name: t.bucket for t in manifest.tensors}
    assert buckets == {"small": 0, "huge": 1, "tail": 2}
    assert manifest.bucket_sizes[1] == 4000


def test_bucket_planning_refuses_duplicate_names_and_unknown_dtypes() -> None:
    with pytest.raises(ValueError, match="twice"):
        wire.plan_buckets([("a", "float32", [1]), ("a", "float32", [1])], 1024)
    with pytest.raises(ValueError, match="complex64"):
        wire.plan_buckets([("a", "complex64", [1])], 1024)


def test_packed_bucket_views_give_back_every_tensor_bit_for_bit() -> None:
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.randn(7).to(torch.bfloat16),
        "c": torch.arange(6, dtype=torch.int64).reshape(2, 3),
    }
    manifest = wire.plan_buckets(
        ((n, wire.dtype_name(t), list(t.shape)) for n, t in tensors.items()), 1 << 20
    )
    buffer = torch.empty(manifest.bucket_sizes[0], dtype=torch.uint8)
    wire.pack(buffer, manifest.tensors, tensors)
    for name, view in wire.bucket_views(buffer, manifest.tensors):
        assert torch.equal(view, tensors[name])


def test_named_tensors_send_tied_weights_once_and_keep_checkpoint_names() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # tied, as lm_head = embed_tokens
    names = [n for n, _ in named_tensors(model)]
    assert names == ["0.weight"]
    state = {"x": torch.ones(2), "y": torch.zeros(3)}
    assert [n for n, _ in named_tensors(state)] == ["x", "y"]
    assert [n for n, _ in named_tensors(iter(state.items()))] == ["x", "y"]
    with pytest.raises(TypeError, match="not a tensor"):
        named_tensors({"x": [1.0]})


def test_a_sync_of_the_tensors_the_last_one_sent_reuses_its_plan_and_anything_moved_plans_anew() -> None:
    from rollout_queue.weight_sync.sender import WeightSender, list_tensors
    from rollout_queue.weight_sync.settings import SyncSettings

    sender = WeightSender(SyncSettings(bucket_bytes=1 << 20), "p")
    members = [_member("w@h", colocated=True, host="h")]
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    first, _, own = sender.plan_manifest(list_tensors(model), members, "gloo")
    assert own == list_tensors(model).layout  # the caller's own tensors: no copy made
    with torch.no_grad():
        model[0].weight.mul_(2)  # an optimizer step: in place, same memory
    again, by_name, own = sender.plan_manifest(list_tensors(model), members, "gloo")
    assert again is first and own is not None
    assert by_name["0.weight"].data_ptr() == model[0].weight.data_ptr()
    assert torch.equal(by_name["0.weight"], model[0].weight)

    before = own
    model[1].weight = torch.nn.Parameter(torch.zeros(8, 2).t())  # new memory, not contiguous
    moved, by_name, own = sender.plan_manifest(list_tensors(model), members, "gloo")
    assert own is not None and own != before  # walked again: the new tensor as it lies
    assert not {entry[0]: entry[4] for entry in own}["1.weight"]  # (name, ..., contiguous, ...)
    assert moved.wire() == first.wire()  # same names, dtypes and shapes: the same manifest

    half = {name: t.half() for name, t in model.state_dict().items()}  # cast to the workers' float32 here
    _, by_name, own = sender.plan_manifest(list_tensors(half), members, "gloo")
    assert own is None and by_name["0.weight"].dtype == torch.float32
    _, _, own = sender.plan_manifest(list_tensors(half), members, "gloo")
    assert own is None  # copies again: never reused as the caller's own


def test_the_tensors_of_the_last_sync_listed_again_keep_their_layout_until_one_moves_and_are_held_weakly() -> None:
    import gc
    import weakref

    from rollout_queue.weight_sync.sender import list_tensors

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    model[1].weight = model[0].weight  # tied: sent once
    first = list_tensors(model)
    last = first.skeleton()
    assert last.pairs == [] and [n for n, _ in first.pairs] == ["0.weight", "0.bias", "1.bias"]
    with torch.no_grad():
        model[0].weight.mul_(2)  # an optimizer step: in place
    again = list_tensors(model, last)
    assert again.layout is first.layout and [n for n, _ in again.pairs] == ["0.weight", "0.bias", "1.bias"]
    assert torch.equal(again.pairs[0][1], model[0].weight) and not again.pairs[0][1].requires_grad

    # Anything that moved or changed form is listed anew: new memory, another dtype
    # over the same bytes, other names for the same tensors.
    model[0].bias.data = torch.zeros(8)
    assert list_tensors(model, last).layout != first.layout
    state = {"a": torch.zeros(4, 4), "b": torch.ones(3)}
    kept = list_tensors(state).skeleton()
    assert list_tensors(dict(state), kept).layout is kept.layout
    assert list_tensors({**state, "a": state["a"].view(torch.int32)}, kept).layout != kept.layout
    assert list_tensors({"A": state["a"], "b": state["b"]}, kept).layout != kept.layout
    assert list_tensors({**state, "a": state["a"].t()}, kept).layout != kept.layout  # same address, other strides

    # Between syncs the sender holds the tensors weakly: a model the trainer drops is freed.
    dropped = torch.nn.Linear(64, 64)
    gone = weakref.ref(dropped.weight)
    skeleton = list_tensors(dropped).skeleton()
    del dropped
    gc.collect()
    assert gone() is None and skeleton.layout


def _plan(**updates: object) -> SyncPlan:
    plan = SyncPlan(
        round=SyncRound("1-abc"), weight_version=3, pause="wait", store_host="127.0.0.1", store_port=1234,
        members={"w@h": 1}, backend="gloo", manifest_digest=Manifest(tensors=[], bucket_sizes=[]).wire()[1],
        issued_at=0.0,
    )
    return plan.model_copy(update=updates)


def test_sync_trigger_signature_detects_any_change_to_the_plan_and_a_wrong_secret() -> None:
    plan = _plan(issued_at=time.time()).model_dump(mode="json")

    def check(secret: str, arguments: dict[str, Any]) -> None:
        verifier = CommandVerifier("w@h", secret)
        verifier.verify(keys.CONTROL_SYNC, {"plan": arguments["plan"]}, arguments.get("auth"))

    signed = signed_arguments(keys.CONTROL_SYNC, {"plan": plan}, "s3cret", destination=["w@h"])
    check("s3cret", signed)
    with pytest.raises(ControlRefused, match="wrongly signed"):
        check("other", signed)
    with pytest.raises(ControlRefused, match="unsigned"):
        check("s3cret", {"plan": plan})
    for change in ({"weight_version": 4}, {"round": "1-abd"}, {"manifest_digest": "0" * 64}, {"pause": "abort"},
                   {"members": {"x@h": 1}}):
        with pytest.raises(ControlRefused, match="wrongly signed"):
            check("s3cret", {**signed, "plan": {**plan, **change}})


def test_the_manifest_travels_by_digest_and_a_changed_one_is_refused() -> None:
    manifest = wire.plan_buckets([("a", "float32", (4, 4)), ("b", "bfloat16", (8,))], 1 << 20)
    text, digest = manifest.wire()
    assert Manifest.from_wire(text, digest) == manifest
    assert Manifest.from_wire(text.encode(), digest) == manifest  # as Redis returns it
    with pytest.raises(ValueError, match="does not hash"):
        Manifest.from_wire(text.replace('"a"', '"c"'), digest)
    plan = _plan(manifest_digest=digest, manifest=manifest)
    sent = plan.model_dump(mode="json")
    assert "manifest" not in sent and sent["manifest_digest"] == digest  # never inline
    assert SyncPlan.model_validate(sent).manifest is None


def test_both_ends_walk_the_same_buckets_with_their_tensors_in_offset_order_and_their_pieces() -> None:
    specs = [(f"w{i}", "float32", [60 * (i % 4 + 1)]) for i in range(12)]
    manifest = wire.plan_buckets(specs, bucket_bytes=1024, chunk_bytes=256, direct_bytes=700)
    buckets = list(wire.iter_buckets(manifest))
    assert [b.index for b in buckets] == list(range(len(manifest.bucket_sizes)))
    assert [b.size for b in buckets] == manifest.bucket_sizes
    assert [s.name for b in buckets for s in b.specs] == [s.name for s in manifest.tensors]
    for bucket in buckets:
        assert all(s.bucket == bucket.index for s in bucket.specs)
        assert [s.offset for s in bucket.specs] == sorted(s.offset for s in bucket.specs)
        assert bucket.pieces == wire.piece_ranges(manifest, bucket.size, bucket.specs)
    assert any(name for b in buckets for _, _, name in b.pieces)  # some tensors travel direct


def test_a_sync_failure_crosses_processes_as_a_kind_and_comes_back_as_its_class() -> None:
    from rollout_queue.tasks import errors
    from rollout_queue.weight_sync.protocol import SyncFailure

    for kind, cls in errors.SYNC_ERRORS.items():
        sent = SyncFailure.of(cls("what happened; what to do"))
        assert sent.kind == kind and sent.message == "what happened; what to do"
        back = SyncFailure.model_validate_json(sent.model_dump_json()).error(phase="ready", workers=["w@h"])
        assert type(back) is cls and str(back) == "what happened; what to do"
        assert back.phase == "ready" and back.workers == ["w@h"]
    # The nearest class wins; an error from outside the tree keeps its name in the message.
    assert SyncFailure.of(errors.RendezvousUnreachable("x")).kind == "rendezvous_unreachable"
    foreign = SyncFailure.of(TimeoutError("the engine did not pause in time"))
    assert foreign.kind == "failed" and foreign.message == "TimeoutError: the engine did not pause in time"
    assert type(foreign.error()) is WeightSyncError
    with pytest.raises(ValueError, match="kind"):
        SyncFailure.model_validate({"kind": "Manifest", "message": "no substring matching"})


def test_the_engine_request_travels_as_json_with_the_workers_deadlines_and_no_inline_manifest() -> None:
    from rollout_queue.weight_sync.protocol import SyncDecision, UpdateRequest, WorkerTimeouts

    manifest = wire.plan_buckets([("a", "float32", (4, 4))], 1 << 20)
    text, digest = manifest.wire()
    plan = _plan(manifest_digest=digest, manifest=manifest, timeouts=WorkerTimeouts(receive=5.0))
    request = UpdateRequest(plan=plan, decision=SyncDecision(go=True, offsets={"w@h": 1}, world=2),
                            node="w@h", manifest=text)
    sent = json.loads(json.dumps(request.model_dump(mode="json")))  # what collective_rpc carries
    assert "manifest" not in sent["plan"] and sent["manifest"] == text
    received = UpdateRequest.model_validate(sent)
    assert received.plan.timeouts.receive == 5.0 and received.plan.manifest is None
    assert Manifest.from_wire(received.manifest or "", received.plan.manifest_digest) == manifest
    # The defaults are the deadlines workers used before they travelled in the plan.
    assert WorkerTimeouts().model_dump() == {
        "probe": 5.0, "pause": 120.0, "store_connect": 30.0, "decision": 180.0, "group_join": 60.0,
        "receive": 600.0, "update": 900.0, "resume": 60.0, "abort": 120.0, "outcome": 300.0,
    }


def test_receiver_refuses_phases_out_of_order_and_says_what_to_call_first() -> None:
    from rollout_queue.weight_sync.receiver import WeightReceiver

    receiver = WeightReceiver()
    with pytest.raises(WeightSyncError, match="rq_attach"):
        receiver.rq_finish_update()
    receiver.rq_attach("layerwise")
    with pytest.raises(WeightSyncError, match="call rq_begin_update first"):
        receiver.rq_receive_buckets()
    with pytest.raises(WeightSyncError, match="call rq_begin_update first"):
        receiver.rq_finish_update()
    assert receiver.rq_abort_update() is False  # nothing had arrived


PEER = textwrap.dedent(
    """
    import json, sys, torch
    from rollout_queue.weight_sync import wire
    from rollout_queue.weight_sync.protocol import Manifest
    host, port, manifest = sys.argv[1], int(sys.argv[2]), Manifest.model_validate_json(sys.argv[3])
    store = wire.connect_store(host, port, 30.0)
    group = wire.new_group(store, "g1", 1, 2, "gloo", 30.0)
    sums = {}
    for index, size in enumerate(manifest.bucket_sizes):
        buf = torch.empty(size, dtype=torch.uint8)
        wire.wait(wire.broadcast(group, buf), 30.0)
        specs = [s for s in manifest.tensors if s.bucket == index]
        for name, view in wire.bucket_views(buf, specs):
            sums[name] = float(view.double().sum())
    del group, store
    print(json.dumps(sums))
    """
)


def test_two_processes_exchange_packed_buckets_over_gloo() -> None:
    tensors = {f"layer{i}.weight": torch.randn(64, 64) for i in range(6)}
    manifest = wire.plan_buckets(
        ((n, "float32", list(t.shape)) for n, t in tensors.items()), bucket_bytes=40_000
    )
    assert len(manifest.bucket_sizes) > 2  # exercises both send buffers
    port = free_port()
    store = wire.connect_store("127.0.0.1", port, 30.0, is_master=True)
    peer = subprocess.Popen(
        [sys.executable, "-c", PEER, "127.0.0.1", str(port), manifest.model_dump_json()],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=str(ROOT), text=True,
    )
    try:
        group = wire.new_group(store, "g1", 0, 2, "gloo", 30.0)
        buffers = [torch.empty(max(manifest.bucket_sizes), dtype=torch.uint8) for _ in range(2)]
        works = []
        for index, size in enumerate(manifest.bucket_sizes):
            if len(works) >= 2:
                wire.wait(works[-2], 30.0)
            buf = buffers[index % 2][:size]
            wire.pack(buf, [s for s in manifest.tensors if s.bucket == index], tensors)
            works.append(wire.broadcast(group, buf))
        for work in works:
            wire.wait(work, 30.0)
        out, err = peer.communicate(timeout=60)
    finally:
        peer.kill()
    assert peer.returncode == 0, err
    received = json.loads(out)
    for name, tensor in tensors.items():
        assert received[name] == pytest.approx(float(tensor.double().sum()), rel=1e-9, abs=1e-9)


def test_version_spans_drop_empty_spans_and_record_each_change() -> None:
    from rollout_queue.workers.engine.host import version_spans

    assert version_spans(1, [], 5) == [(0, 1)]
    assert version_spans(1, [(0, 2)], 5) == [(0, 2)]  # nothing generated before the sync
    assert version_spans(1, [(3, 2)], 5) == [(0, 1), (3, 2)]
    assert version_spans(1, [(5, 2)], 5) == [(0, 1)]  # nothing generated after it
    assert version_spans(1, [(3, 2), (4, 3)], 6) == [(0, 1), (3, 2), (4, 3)]


def test_receive_buffers_are_reused_only_once_no_pending_layer_holds_them() -> None:
    import inspect

    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    from rollout_queue.weight_sync.transports.groups import _BufferPool

    pool = _BufferPool(keep=2)
    cpu = torch.device("cpu")
    a = pool.take(1000, cpu)
    b = pool.take(600, cpu)
    assert a.data_ptr() != b.data_ptr()
    # Layerwise: a layer that is not complete yet keeps a view of bucket a.
    layer = torch.nn.Linear(2, 2)
    info = get_layerwise_info(layer)
    bound = inspect.signature(lambda param, loaded_weight: None).bind(layer.weight, a[8:16].view(torch.float32))
    info.loaded_weights.append(("weight", bound))
    pool.loaded_into_model(a, still_referenced=True)
    c = pool.take(1000, cpu)
    assert c.data_ptr() != a.data_ptr(), "a buffer a pending layer holds was handed out again"
    # The layer completes (vLLM resets its info): bucket a can carry the next one.
    info.loaded_weights.clear()
    pool.loaded_into_model(b, still_referenced=True)
    d = pool.take(900, cpu)
    assert d.data_ptr() in {a.data_ptr(), b.data_ptr()}
    # End of the sync: every buffer is free, the two largest are kept for the next.
    pool.loaded_into_model(c, still_referenced=False)
    pool.loaded_into_model(d, still_referenced=False)
    pool.settle()
    assert sorted(buf.numel() for buf in pool.free) == [1000, 1000]
    again = pool.take(1000, cpu)
    assert again.data_ptr() in {a.data_ptr(), c.data_ptr()}


class _LoaderModel(torch.nn.Module):
    """``load_weights`` in the ways vLLM's loaders treat a checkpoint tensor."""

    def __init__(self) -> None:
        super().__init__()
        zeros = lambda *shape, dtype=torch.float32: torch.nn.Parameter(torch.zeros(*shape, dtype=dtype))
        self.qkv = zeros(6, 4)  # q: rows 0-3, k: row 4, v: row 5 (a stacked parameter)
        self.o = zeros(4, 4)
        self.converted = zeros(4, 4, dtype=torch.float16)
        self.shard = zeros(2, 4)
        self.twice = zeros(4)
        self.scaled = zeros(4)
        self.scale = zeros(1)

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            if name in ("q", "k", "v"):
                self.qkv.data.narrow(0, {"q": 0, "k": 4, "v": 5}[name], w.shape[0]).copy_(w)
            elif name == "o":
                self.o.data.copy_(w.view(4, 4))
            elif name == "converted":  # converted on the way in
                self.converted.data.copy_(w)
            elif name == "shard":  # a tensor-parallel rank's share
                self.shard.data.copy_(w.narrow(0, 0, 2))
            elif name == "twice":
                self.twice.data.copy_(w)
                self.twice.data.copy_(w)
            elif name == "scaled":  # a value computed from it
                self.scaled.data.copy_(w)
                self.scale.data.fill_(w.abs().max())


def _checkpoint(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"q": (4, 4), "k": (1, 4), "v": (1, 4), "o": (16,), "converted": (4, 4), "shard": (4, 4),
              "twice": (4,), "scaled": (4,)}
    return {name: torch.randn(*shape, generator=gen) for name, shape in shapes.items()}


def _received(state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list]:
    manifest = wire.plan_buckets(
        [(n, wire.dtype_name(t), list(t.shape)) for n, t in state.items()], bucket_bytes=1 << 20)
    buffer = torch.empty(manifest.bucket_sizes[0], dtype=torch.uint8)
    wire.pack(buffer, manifest.tensors, state)
    return buffer, manifest.tensors


def test_only_tensors_loaded_by_one_whole_copy_into_a_parameter_are_received_in_place() -> None:
    from rollout_queue.weight_sync.inplace import InPlaceMap

    model, places = _LoaderModel(), InPlaceMap()
    buffer, specs = _received(_checkpoint(1))
    with places.watch(model, buffer, specs, [s.offset for s in specs]):
        model.load_weights(wire.bucket_views(buffer, specs))
    assert set(places.places) == {"q", "k", "v", "o"}
    assert places.refused == {"converted", "shard", "twice", "scaled"}
    assert places.places["k"] == ("qkv", 4 * 4 * 4) and places.places["o"] == ("o", 0)

    # The next sync: the mapped tensors land straight in their parameters, the
    # others go through load_weights; the model ends as load_weights alone leaves it.
    new = _checkpoint(2)
    buffer, specs = _received(new)
    targets = places.targets(model, specs)
    assert set(targets) == set(places.places)
    for name, target in targets.items():
        target.copy_(wire.flat_bytes(new[name]))
    model.load_weights(wire.bucket_views(buffer, [s for s in specs if s.name not in targets]))
    reference = _LoaderModel()
    reference.load_weights(wire.bucket_views(buffer, specs))
    for (name, got), (_, want) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(got, want), name

    # Views are kept between syncs while their parameter stays where it is; a
    # parameter given new storage gets views into that.
    again = places.targets(model, specs)
    assert all(again[name] is targets[name] for name in targets)
    qkv = dict(model.named_parameters())["qkv"]
    qkv.data = torch.zeros_like(qkv.data)
    moved = places.targets(model, specs)
    assert moved["k"] is not targets["k"] and moved["k"].data_ptr() == qkv.data_ptr() + places.places["k"][1]
    assert moved["o"] is targets["o"]


def test_a_bucket_buffer_holds_only_the_pieces_not_received_in_place() -> None:
    from rollout_queue.weight_sync.transports.groups import buffer_layout as _buffer_layout
    from rollout_queue.weight_sync.transports.groups import buffer_offsets as _buffer_offsets

    gen = torch.Generator().manual_seed(3)
    sizes = {"a": 40, "big1": 300, "b": 90, "c": 50, "big2": 260, "d": 30}  # float32 elements
    state = {name: torch.randn(n, generator=gen) for name, n in sizes.items()}
    manifest = wire.plan_buckets(
        [(n, "float32", [t.numel()]) for n, t in state.items()], bucket_bytes=1 << 20,
        chunk_bytes=256, direct_bytes=1000,
    )
    size = manifest.bucket_sizes[0]
    sent = torch.zeros(size, dtype=torch.uint8)
    wire.pack(sent, manifest.tensors, state)
    pieces = wire.piece_ranges(manifest, size, manifest.tensors)
    in_place = {"big1": object()}  # big2 travels direct but into the buffer
    at, need = _buffer_layout(pieces, in_place)
    assert need == sum(end - start for (start, end, _), where in zip(pieces, at) if where is not None)
    assert need <= size - state["big1"].numel() * 4

    buffer = torch.zeros(need, dtype=torch.uint8)  # what the receiver's broadcasts fill
    for (start, end, _), where in zip(pieces, at):
        if where is not None:
            buffer[where : where + end - start] = sent[start:end]
    loaded = [spec for spec in manifest.tensors if spec.name not in in_place]
    assert any(s.offset < start < s.offset + s.nbytes for start, _, _ in pieces for s in loaded), \
        "some tensor should straddle a piece edge"
    views = dict(wire.bucket_views(buffer, loaded, _buffer_offsets(loaded, pieces, at)))
    assert set(views) == set(state) - {"big1"}
    for name, view in views.items():
        assert torch.equal(view, state[name]), name


class EngineHostFake:
    """The engine host's surface a sync uses (``SyncHost``) that these tests do not
    drive: no engine, no checkpoint to compare with, awake."""

    weight_version = 0
    settings: Any = None
    dtype = "float32"

    def weights_asleep(self) -> bool:
        return False

    def inflight_requests(self) -> int:
        return 0

    def wake_up(self, tags: list[str] | None = None) -> None:
        raise AssertionError("a sync of an awake engine wakes nothing")

    def weights_dropped(self) -> bool:
        return False

    def weights_restored(self) -> None:
        pass

    def weights_loading(self) -> None:
        pass

    def collective_rpc(self, method: str, timeout: float, *args: Any) -> list[Any]:
        raise AssertionError(f"no engine to call {method}")

    def update_engine(self, request: dict[str, Any], timeout: float) -> tuple[list[Any], str]:
        return self.collective_rpc("rq_update", timeout, request), "call"


class RecordingHost(EngineHostFake):
    """An engine host whose pause and resume only record that they were called."""

    def __init__(self) -> None:
        self.calls: list[Any] = []

    def pause(self, mode: str, timeout: float) -> None:
        self.calls.append(("pause", mode))

    def resume(self, version: int | None, timeout: float) -> None:
        self.calls.append(("resume", version))


class AckLists:
    """The Redis surface a sync participant pushes its acks through, as lists in memory."""

    def __init__(self) -> None:
        self.lists: dict[str, list[str]] = {}

    def pipeline(self, transaction: bool = True) -> AckLists:
        return self

    def rpush(self, name: str, value: str) -> None:
        self.lists.setdefault(name, []).append(value)

    def expire(self, name: str, seconds: int) -> None:
        pass

    def execute(self) -> None:
        pass

    def acks(self, name: str) -> list[SyncAck]:
        return [SyncAck.model_validate_json(text) for text in self.lists.get(name, [])]


def test_an_update_into_weights_a_level_2_sleep_dropped_must_bring_the_whole_model(model_a: Any) -> None:
    """What such an update leaves out would be whatever that memory holds: the worker
    stays fenced, naming what is missing; a whole model restores the weights. A worker
    with no local checkpoint to tell a whole model by takes the trainer's word."""
    from types import SimpleNamespace

    from rollout_queue.weight_sync.protocol import SyncDecision
    from rollout_queue.workers.node.sync import SyncParticipant
    from rollout_queue.workers.node.weight_files import checkpoint_shapes
    from rollout_queue.workers.state import NodeState

    class Dropped(EngineHostFake):
        settings = SimpleNamespace(model=str(model_a))

        def weights_dropped(self) -> bool:
            return True

    shapes = checkpoint_shapes(str(model_a))
    assert shapes is not None
    participant = SyncParticipant(Dropped(), "w@h", AckLists(), NodeState())  # type: ignore[arg-type]
    participant._shapes = shapes
    decided = SyncDecision.handed("w@h")

    def plan(names: list[str], version: int) -> SyncPlan:
        manifest = wire.plan_buckets([(n, "float32", shapes[n]) for n in names], 1 << 30)
        return _plan(weight_version=version, manifest=manifest)

    names = sorted(shapes)
    missing = participant._incomplete(plan(names[1:], 4), decided)
    assert missing is not None and missing.startswith("slept at level 2 (its weights dropped)")
    assert names[0] in missing and f"of its checkpoint's {len(names)} tensors" in missing
    assert participant._incomplete(plan(names[:1], 4), decided) is None  # the rest came with version 4 before
    assert participant._incomplete(plan(names, 5), decided) is None
    participant._shapes = None
    assert participant._incomplete(plan(names[:1], 6), decided) is None


def test_a_pause_that_fails_half_way_still_reopens_the_worker() -> None:
    """The engine host closes intake before it pauses the engine; if the pause then
    fails, the sync must resume (reopen intake) and fence, not leave it shut."""
    from rollout_queue.workers.node.sync import SyncParticipant
    from rollout_queue.workers.state import FenceReason, NodeState

    class Host(EngineHostFake):  # the engine host's surface a sync uses; its pause fails after closing intake
        def __init__(self) -> None:
            self.calls: list[Any] = []
            self.state = NodeState()

        def pause(self, mode: str, timeout: float) -> None:
            self.calls.append(("pause", mode))
            self.state.hold_intake()
            raise TimeoutError("the engine did not pause in time")

        def resume(self, version: int | None, timeout: float) -> None:
            self.calls.append(("resume", version))
            self.state.release_intake()

    host, acks = Host(), AckLists()
    host.state.ready()
    participant = SyncParticipant(host, "w@h", acks, host.state)  # type: ignore[arg-type]  # acks: a fake Redis
    with socket.create_server(("127.0.0.1", 0)) as store:  # the trainer's store answers
        plan = _plan(round=SyncRound(f"1-pause-fails-{time.time()}"), store_port=store.getsockname()[1])
        participant.sync(plan)
    assert host.calls == [("pause", "wait"), ("resume", None)]
    (done,) = acks.acks(keys.sync_acks(plan.round, "done"))
    assert not done.ok and done.error is not None and "did not pause" in done.error.message
    assert host.state.intake_open
    assert host.state.fence_reason is FenceReason.MISSED_SYNC
    assert host.state.refusal() == "missed sync to version 3" and host.state.current == "fenced"
    # The trainer lives and the others may commit: the heartbeat may not lift it
    # before the round is marked over.
    assert host.state.held_for == plan.round


def test_a_worker_whose_trainer_never_decides_resumes_fenced_for_the_next_heartbeat_to_lift() -> None:
    """Paused and ready, the decision never comes (the trainer gone or cut off):
    nobody can commit that round, so its missed-version fence is not held."""
    from rollout_queue.workers.node.sync import SyncParticipant
    from rollout_queue.workers.state import CAUGHT_UP, NodeState

    host, acks, state = RecordingHost(), AckLists(), NodeState()
    state.ready()
    participant = SyncParticipant(host, "w@h", acks, state)  # type: ignore[arg-type]  # acks: a fake Redis
    port = free_port()
    store = wire.connect_store("127.0.0.1", port, 30.0, is_master=True)  # it never holds a decision
    try:
        plan = _plan(round=SyncRound(f"1-no-decision-{time.time()}"), store_port=port,
                     timeouts=WorkerTimeouts(decision=1.0))
        participant.sync(plan)
    finally:
        del store
    assert host.calls == [("pause", "wait"), ("resume", None)]
    (done,) = acks.acks(keys.sync_acks(plan.round, "done"))
    assert not done.ok
    assert state.refusal() == "missed sync to version 3" and state.held_for is None
    state.lift(*CAUGHT_UP)  # the heartbeat, the pool's version unmoved
    assert state.current == "serving"


def test_in_a_decided_round_the_first_decision_written_stands_and_a_called_off_worker_loads_nothing() -> None:
    """A round of one handed member: the worker claims the go, the trainer giving up
    claims its no-go, in the trainer's real store; whoever writes first decides."""
    from rollout_queue.weight_sync.protocol import SyncDecision
    from rollout_queue.workers.node.sync import SyncParticipant
    from rollout_queue.workers.state import NodeState

    port = free_port()
    store = wire.connect_store("127.0.0.1", port, 30.0, is_master=True)
    worker_end = wire.connect_store("127.0.0.1", port, 30.0)
    try:
        claimed = SyncRound(f"1-claimed-{time.time()}")
        assert SyncDecision.handed("w@h").claim(worker_end, claimed) == SyncDecision.handed("w@h")
        stood = SyncDecision(go=False, reason="given up").claim(store, claimed)
        assert stood.go and stood.handoff == ["w@h"]  # too late to give up: the worker is loading

        # The trainer gave the round up first: the worker pauses, finds the no-go,
        # resumes on its old weights without calling the engine, and says why.
        host, acks, state = RecordingHost(), AckLists(), NodeState()
        state.ready()
        participant = SyncParticipant(host, "w@h", acks, state)  # type: ignore[arg-type]  # acks: a fake Redis
        plan = _plan(round=SyncRound(f"2-called-off-{time.time()}"), store_port=port, decided=True,
                     handoffs={"w@h": "shm"})
        assert not SyncDecision(go=False, reason="did not answer the trigger").claim(store, plan.round).go
        participant.sync(plan)
    finally:
        del worker_end, store
    assert host.calls == [("pause", "wait"), ("resume", None)]  # EngineHostFake: no engine call
    assert acks.acks(keys.sync_acks(plan.round, "ready")) == []  # a decided round has no ready ack
    (done,) = acks.acks(keys.sync_acks(plan.round, "done"))
    assert not done.ok and done.error is not None and "called off" in done.error.message
    assert "did not answer the trigger" in done.error.message
    assert state.refusal() == "missed sync to version 3"


def _kept_store_participant(host: Any, acks: Any, port: int, name: str) -> tuple[Any, SyncPlan]:
    """A worker's sync participant with the trainer's store client an earlier sync
    left connected (to the store on ``port``), and a decided round's plan for it."""
    from rollout_queue.workers.node.sync import SyncParticipant
    from rollout_queue.workers.state import NodeState

    state = NodeState()
    state.ready()
    participant = SyncParticipant(host, "w@h", acks, state)  # acks: a fake Redis
    plan = _plan(round=SyncRound(name), store_port=port, decided=True, handoffs={"w@h": "shm"},
                 issued_at=time.time())
    participant._manifests[plan.manifest_digest] = Manifest(tensors=[], bucket_sizes=[])
    participant._shapes_loaded = True  # no checkpoint to check the (empty) manifest against
    participant._store = wire.connect_store("127.0.0.1", port, 30.0)
    participant._store_address = ("127.0.0.1", port)
    return participant, plan


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
def test_an_idle_worker_claims_a_decided_round_as_it_accepts_the_trigger_a_busy_one_after_pausing(
    busy: bool,
) -> None:
    """Nothing between an idle engine and its engine call: the claim goes out with the
    trigger's acceptance (the trainer giving up then finds the go standing) and the
    "accepted" ack follows a few ms later, off that way. An engine with requests
    in it claims only once paused: a trainer that gave up on the pause meanwhile
    wins, and the worker loads nothing."""
    import threading

    from rollout_queue.weight_sync.protocol import SyncDecision
    from rollout_queue.workers.node.sync import ACCEPTED_AFTER_S

    paused = threading.Event()
    release = threading.Event()

    class Host(RecordingHost):  # its pause waits for the test; a request in it when busy
        def inflight_requests(self) -> int:
            return int(busy)

        def pause(self, mode: str, timeout: float) -> None:
            super().pause(mode, timeout)
            paused.set()
            assert release.wait(30)

        def collective_rpc(self, method: str, timeout: float, *args: Any) -> list[Any]:
            self.calls.append(("engine", method))
            raise RuntimeError("no engine here")

    class StampedAcks(AckLists):  # when each ack was pushed
        def __init__(self) -> None:
            super().__init__()
            self.pushed: dict[str, float] = {}

        def rpush(self, name: str, value: str) -> None:
            super().rpush(name, value)
            self.pushed[SyncAck.model_validate_json(value).phase] = time.monotonic()

    port = free_port()
    store = wire.connect_store("127.0.0.1", port, 30.0, is_master=True)
    host, acks = Host(), StampedAcks()
    participant, plan = _kept_store_participant(host, acks, port, f"1-early-{busy}-{time.time()}")
    try:
        accepted_at = time.monotonic()
        assert participant.accept(plan.model_dump(mode="json")) == {"ok": True, "node": "w@h"}
        assert paused.wait(30)
        # The trainer gives the round up while the worker is still pausing.
        stood = SyncDecision(go=False, reason="given up").claim(store, plan.round)
        release.set()
        assert participant._current is not None
        participant._current.result(30)
    finally:
        release.set()
        del store
    participant._courier.shutdown(wait=True)  # the "accepted" ack, pushed a few ms later
    (accepted,) = acks.acks(keys.sync_acks(plan.round, "accepted"))
    assert accepted.ok and accepted.phase == "accepted"
    (done,) = acks.acks(keys.sync_acks(plan.round, "done"))
    assert not done.ok and done.error is not None
    if busy:
        assert not stood.go  # claimed only after the pause: the trainer's no-go stands
        assert host.calls == [("pause", "wait"), ("resume", None)]  # no engine call
        assert "called off" in done.error.message
    else:
        assert stood == SyncDecision.handed("w@h")  # claimed as the trigger was accepted
        assert ("engine", "rq_update") in host.calls
    assert acks.pushed["accepted"] - accepted_at >= ACCEPTED_AFTER_S


STORE_HOST = """
import sys, time
from rollout_queue.weight_sync import wire
store = wire.connect_store("127.0.0.1", int(sys.argv[1]), 30.0, is_master=True)
print("up", flush=True)
time.sleep(120)
"""


def test_an_early_claim_the_trainers_store_does_not_answer_holds_the_trigger_briefly_and_the_sync_thread_claims(
) -> None:
    """The early claim runs on the consumer's thread: a trainer's store that does not
    answer (its process stopped) holds it ``EARLY_CLAIM_S`` at most, and the sync
    thread claims the round once the store answers again."""
    import signal
    import subprocess
    import sys

    from rollout_queue.workers.node.sync import EARLY_CLAIM_S

    class Host(RecordingHost):
        def collective_rpc(self, method: str, timeout: float, *args: Any) -> list[Any]:
            self.calls.append(("engine", method))
            raise RuntimeError("no engine here")

    port = free_port()
    trainer = subprocess.Popen([sys.executable, "-c", STORE_HOST, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout is not None and trainer.stdout.readline() == "up\n"
        host = Host()
        participant, plan = _kept_store_participant(host, AckLists(), port, f"1-silent-{time.time()}")
        trainer.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        assert participant.accept(plan.model_dump(mode="json")) == {"ok": True, "node": "w@h"}
        assert time.monotonic() - started < EARLY_CLAIM_S + 10.0  # not held until the store answers
        trainer.send_signal(signal.SIGCONT)
        assert participant._current is not None
        participant._current.result(60)
        # The sync thread's claim went through: the engine was called (and, here, failed).
        assert ("engine", "rq_update") in host.calls
    finally:
        trainer.send_signal(signal.SIGCONT)
        trainer.kill()
        trainer.wait()


def test_a_trigger_written_to_a_listeners_key_is_handed_on_once_and_taken_and_garbage_is_skipped() -> None:
    import queue

    from rollout_queue.workers.node.listener import TriggerListener

    port = free_port()
    store = wire.connect_store("127.0.0.1", port, 30.0, is_master=True)
    got: queue.Queue[dict[str, Any]] = queue.Queue()
    listener = TriggerListener("w@h", "127.0.0.1", port, got.put)
    try:
        assert listener.key.startswith("rq/trigger/w@h/")
        store.set(listener.key, json.dumps({"plan": {"round": "1-a"}, "auth": None}))
        assert got.get(timeout=10) == {"plan": {"round": "1-a"}, "auth": None}
        wait_for(lambda: not store.check([listener.key]), 10, "the trigger taken")  # the trainer can tell
        for garbage in (b"not json", b"[1, 2]"):  # logged; the listener waits on
            store.set(listener.key, garbage)
            wait_for(lambda: not store.check([listener.key]), 10, "the garbage taken")
        store.set(listener.key, json.dumps({"plan": {"round": "2-b"}}))
        assert got.get(timeout=10) == {"plan": {"round": "2-b"}}
        assert got.empty() and listener.waits_on("127.0.0.1", port)
        assert not listener.waits_on("127.0.0.1", port + 1)
    finally:
        listener.stop()
    assert listener.join(10) and not listener.waits_on("127.0.0.1", port)


def test_a_listener_ends_when_the_trainers_store_goes() -> None:
    from rollout_queue.workers.node.listener import TriggerListener

    port = free_port()
    trainer = subprocess.Popen([sys.executable, "-c", STORE_HOST, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout is not None and trainer.stdout.readline() == "up\n"
        listener = TriggerListener("w@h", "127.0.0.1", port, lambda arguments: None)
        wait_for(lambda: listener.waits_on("127.0.0.1", port) and not listener.join(0.2), 10, "the listener waiting")
    finally:
        trainer.kill()
        trainer.wait()
    assert listener.join(10) and not listener.waits_on("127.0.0.1", port)


def test_a_trigger_through_the_trainers_store_is_checked_as_a_broadcast_one_and_heard_both_ways_runs_once() -> None:
    """A decided round's worker listens on a key of its trainer's store
    (``workers.node.listener``): a trigger written there is checked and accepted
    as a broadcast one; the same trigger broadcast as well (the trainer's
    fallback) is a replay, refused without an ack; a forged one gets no ack.
    The worker listens in one trainer's store at a time."""

    class Host(RecordingHost):
        def collective_rpc(self, method: str, timeout: float, *args: Any) -> list[Any]:
            self.calls.append(("engine", method))
            raise RuntimeError("no engine here")

    port, other_port = free_port(), free_port()
    store = wire.connect_store("127.0.0.1", port, 30.0, is_master=True)
    other = wire.connect_store("127.0.0.1", other_port, 30.0, is_master=True)
    host, acks = Host(), AckLists()
    participant, plan = _kept_store_participant(host, acks, port, f"1-listened-{time.time()}")
    participant.verifier = CommandVerifier("w@h", "s3cret")
    try:
        key = participant._listen(plan)
        assert key is not None and participant._listen(plan) == key  # one listener per store
        signed = signed_arguments(keys.CONTROL_SYNC, {"plan": plan.model_dump(mode="json")}, "s3cret",
                                  destination=["w@h"])
        store.set(key, json.dumps(signed))
        wait_for(lambda: participant._current is not None, 10, "the sync started")
        assert participant._current is not None
        participant._current.result(30)
        (done,) = acks.acks(keys.sync_acks(plan.round, "done"))
        assert "store_delivery" in done.seconds and "delivery" not in done.seconds
        assert ("engine", "rq_update") in host.calls  # (and failed: no engine here)

        heard_again = participant.accept_signed(signed["plan"], signed["auth"])
        assert not heard_again["ok"] and "replayed" in heard_again["error"]
        forged_plan = plan.model_copy(update={"round": SyncRound(f"2-forged-{time.time()}")})
        forged = signed_arguments(keys.CONTROL_SYNC, {"plan": forged_plan.model_dump(mode="json")}, "other",
                                  destination=["w@h"])
        store.set(key, json.dumps(forged))
        wait_for(lambda: not store.check([key]), 10, "the forged trigger taken")
        participant._courier.shutdown(wait=True)
        assert acks.acks(keys.sync_acks(forged_plan.round, "accepted")) == []
        assert len(acks.acks(keys.sync_acks(plan.round, "done"))) == 1

        listener = participant._listener
        assert listener is not None
        moved = participant._listen(plan.model_copy(update={"store_port": other_port}))
        assert moved is not None and moved != key
        assert listener.join(10)  # the listener in the first trainer's store ended
        other.set(moved, b"not json")  # the new one takes what is written there
        wait_for(lambda: not other.check([moved]), 10, "the write taken by the new listener")
    finally:
        participant.close()


def test_a_decided_round_nobody_answers_is_called_off_in_the_store_and_moves_no_version(redis_client: Any) -> None:
    """A colocated worker in the registry that never hears the trigger (gone, or
    another secret): the trainer waits the trigger's timeout, claims the round's
    no-go, so a late worker could not load from its memory, and says who."""
    from rollout_queue.tasks.errors import WorkerLost
    from rollout_queue.tasks.registry import fleet_version, remove_entry, write_entry
    from rollout_queue.weight_sync.locality import host_id
    from rollout_queue.weight_sync.protocol import SyncDecision
    from rollout_queue.weight_sync.sender import WeightSender
    from rollout_queue.weight_sync.settings import SyncSettings, SyncTimeouts

    pool, node = f"decided-{time.time()}", "silent@tests"
    info = _member(node, colocated=True, host=host_id()).model_copy(update={"pool": pool, "queues": [pool]})
    write_entry(redis_client, node, info.model_dump_json(), 60_000)
    sender = WeightSender(SyncSettings(weight_sync_secret="not-the-workers", bucket_bytes=1 << 20,
                                       timeouts=SyncTimeouts(trigger=1.0)), pool)
    try:
        plans: list[SyncPlan] = []
        planned = sender.plan_round
        sender.plan_round = lambda *a, **kw: plans.append(planned(*a, **kw)) or plans[-1]  # type: ignore[method-assign]
        started = time.monotonic()
        with pytest.raises(WorkerLost, match="no worker answered the sync trigger within 1.0s: silent@tests"):
            sender.sync({"w": torch.ones(64)}, version=5, timeout=30)
        assert time.monotonic() - started < 10
        (plan,) = plans
        assert plan.decided and plan.handoffs == {node: "shm"}
        stood = SyncDecision.model_validate_json(sender.store.get(keys.sync_decision(plan.round)))
        assert not stood.go and stood.reason == "did not answer the trigger"
        # The worker, had it heard the trigger late: its claim finds the no-go.
        assert SyncDecision.handed(node).claim(sender.store, plan.round) == stood
        assert fleet_version(redis_client, pool) == 0
    finally:
        sender.close()
        remove_entry(redis_client, node)


def test_the_trainer_reads_members_version_and_epoch_in_one_round_trip_and_stores_a_manifest_gone_from_redis(
    redis_client: Any,
) -> None:
    """A sync's first round trip reads the registry, the fleet's next version and the
    round's epoch, and refreshes the last manifest's key; the plan then stores the
    manifest only where that key was gone (a new layout, a flushed Redis)."""
    from rollout_queue.tasks.registry import remove_entry, write_entry
    from rollout_queue.weight_sync.sender import WeightSender, list_tensors
    from rollout_queue.weight_sync.settings import SyncSettings

    pool, node = f"reads-{time.time()}", "reads@tests"
    info = _member(node, colocated=False, host="elsewhere").model_copy(update={"pool": pool, "queues": [pool]})
    write_entry(redis_client, node, info.model_dump_json(), 60_000)
    redis_client.set(keys.fleet_version(pool), 4)
    sender = WeightSender(SyncSettings(bucket_bytes=1 << 20), pool)
    weights = {"w": torch.ones(64)}
    try:
        members, version = sender._read_round(sender._ask_round(None), None)
        assert [w.node for w in members] == [node] and version == 5
        manifest, _, _ = sender.plan_manifest(list_tensors(weights), members, "gloo")
        epoch, digest = sender._take_epoch(manifest)
        stored = redis_client.get(keys.sync_manifest(digest))
        assert stored is not None and Manifest.from_wire(stored, digest).wire()[1] == digest

        redis_client.expire(keys.sync_manifest(digest), 60)
        members, version = sender._read_round(sender._ask_round(9), 9)  # the caller's version stands
        assert version == 9
        again, same = sender._take_epoch(manifest)
        assert same == digest and again > epoch
        assert redis_client.ttl(keys.sync_manifest(digest)) > 3600  # refreshed in the first round trip

        redis_client.delete(keys.sync_manifest(digest))  # Redis flushed between two syncs
        sender._read_round(sender._ask_round(10), 10)
        last, _ = sender._take_epoch(manifest)
        assert last > again and redis_client.get(keys.sync_manifest(digest)) == stored
    finally:
        sender.close()
        remove_entry(redis_client, node)
        redis_client.delete(keys.fleet_version(pool))


def test_a_worker_that_cannot_reach_the_trainers_store_fails_its_ready_ack_at_once_and_never_pauses(
) -> None:
    from rollout_queue.workers.node.sync import SyncParticipant
    from rollout_queue.workers.state import NodeState

    with socket.create_server(("127.0.0.1", 0)) as taken:
        closed_port = taken.getsockname()[1]  # nothing listens there once closed
    host, acks, state = RecordingHost(), AckLists(), NodeState()
    state.ready()
    participant = SyncParticipant(host, "w@h", acks, state)  # type: ignore[arg-type]  # acks: a fake Redis
    plan = _plan(round=SyncRound(f"1-unreachable-{time.time()}"), store_port=closed_port)
    started = time.monotonic()
    participant.sync(plan)
    assert time.monotonic() - started < 5  # refused at once: no wait for any timeout
    assert host.calls == []
    (ready,) = acks.acks(keys.sync_acks(plan.round, "ready"))
    assert not ready.ok and ready.error is not None and ready.error.kind == "rendezvous_unreachable"
    assert "set RQ_RENDEZVOUS_HOST on the trainer" in ready.error.message and "own loopback" in ready.error.message
    assert state.refusal() == "missed sync to version 3" and state.current == "fenced"


def test_a_newer_trigger_during_a_sync_runs_after_it_and_an_old_or_repeated_one_is_refused() -> None:
    """A trainer that gave a sync up triggers again (a retried catch-up) while this
    worker still ends the old one (its trigger heard late, its failure still being
    acked): the newer round (a later epoch) is accepted and runs once the old one is
    over; an older round is refused, and the round in hand heard again is ignored (its
    acks stand)."""
    import threading

    from rollout_queue.workers.node.sync import SyncParticipant
    from rollout_queue.workers.state import NodeState

    class Host(EngineHostFake):  # the engine host's surface a sync uses; the first pause waits, every pause fails
        def __init__(self) -> None:
            self.calls: list[Any] = []
            self.first_pause = threading.Event()

        def pause(self, mode: str, timeout: float) -> None:
            self.calls.append("pause")
            if self.calls.count("pause") == 1:
                assert self.first_pause.wait(30)
            raise TimeoutError("the engine did not pause in time")

        def resume(self, version: int | None, timeout: float) -> None:
            self.calls.append("resume")

    host, acks, state = Host(), AckLists(), NodeState()
    state.ready()
    participant = SyncParticipant(host, "w@h", acks, state)  # type: ignore[arg-type]  # acks: a fake Redis
    empty = Manifest(tensors=[], bucket_sizes=[])
    participant._manifests[empty.wire()[1]] = empty  # as if read from Redis before
    participant._shapes_loaded = True  # no checkpoint to compare with
    with socket.create_server(("127.0.0.1", 0)) as store:  # the trainer's store answers the probe
        port = store.getsockname()[1]
        plans = {epoch: _plan(round=SyncRound(f"{epoch}-{time.time()}"), store_port=port,
                              issued_at=time.time()) for epoch in (4, 5, 6)}
        assert participant.accept(plans[5].model_dump(mode="json"))["ok"]
        deadline = time.monotonic() + 30
        while host.calls != ["pause"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert host.calls == ["pause"]
        again = participant.accept(plans[5].model_dump(mode="json"))
        assert not again["ok"] and f"already in sync round {plans[5].round}" in again["error"]
        assert not participant.accept(plans[4].model_dump(mode="json"))["ok"]
        assert participant.accept(plans[6].model_dump(mode="json"))["ok"]
        assert host.calls == ["pause"]  # round 6-… waits for round 5-…
        host.first_pause.set()
        while participant.busy() and time.monotonic() < deadline:
            time.sleep(0.01)
    assert not participant.busy()
    assert host.calls == ["pause", "resume", "pause", "resume"]
    for epoch, accepted in ((4, False), (5, True), (6, True)):
        answers = [a for a in acks.acks(keys.sync_acks(plans[epoch].round, "accepted")) if a.phase == "accepted"]
        assert [a.ok for a in answers] == [accepted], (epoch, answers)
    (refused,) = acks.acks(keys.sync_acks(plans[4].round, "accepted"))
    assert refused.error is not None and f"already in sync round {plans[5].round}" in refused.error.message
    for epoch in (5, 6):
        (done,) = acks.acks(keys.sync_acks(plans[epoch].round, "done"))
        assert not done.ok and done.error is not None and "did not pause" in done.error.message


# --------------------------------------------------------------- transports


def _member(node: str, *, colocated: bool, host: str, device: str = "cpu", uuids: list[str] | None = None) -> Any:
    from rollout_queue.tasks.schemas import WorkerInfo

    return WorkerInfo(node=node, model="m", device=device, dtype="float32", colocated=colocated, host_id=host,
                      device_uuids=uuids or [])


def test_the_plan_hands_the_weights_to_colocated_workers_of_this_host_and_the_group_serves_the_rest() -> None:
    from rollout_queue.tasks.errors import SyncRefused
    from rollout_queue.weight_sync.locality import host_id
    from rollout_queue.weight_sync.protocol import SyncDecision
    from rollout_queue.weight_sync.sender import WeightSender
    from rollout_queue.weight_sync.settings import SyncSettings

    here = host_id()
    members = [_member("near@h", colocated=True, host=here), _member("far@h", colocated=True, host="other/boot"),
               _member("plain@h", colocated=False, host=here)]
    assert WeightSender(SyncSettings(), "p").choose_handoffs(members, "gloo") == {"near@h": "shm"}
    assert WeightSender(SyncSettings(transport="gloo"), "p").choose_handoffs(members, "gloo") == {}
    with pytest.raises(SyncRefused, match="far@h"):
        WeightSender(SyncSettings(transport="shm"), "p").choose_handoffs(members, "gloo")
    # On CUDA, "the same GPU" is the device UUID, never the index.
    gpu = [_member("same@h", colocated=True, host=here, device="cuda", uuids=["GPU-1"]),
           _member("other@h", colocated=True, host=here, device="cuda", uuids=["GPU-2"])]
    assert WeightSender._colocated(gpu[0], "GPU-1", "nccl") and not WeightSender._colocated(gpu[1], "GPU-1", "nccl")

    plan = SyncPlan(round=SyncRound("1-s"), weight_version=1, pause="wait", store_host="127.0.0.1", store_port=1,
                    members={"near@h": 1, "far@h": 1}, backend="gloo", handoffs={"near@h": "shm"},
                    manifest_digest="d", issued_at=0.0)
    assert plan.transport_of("near@h") == "shm" and plan.transport_of("far@h") == "gloo"
    assert plan.transports() == ["shm", "gloo"]  # handoffs announce first; the group waits for its ranks
    decision = SyncDecision(go=True, offsets={"far@h": 1}, world=2, handoff=["near@h"])
    assert decision.roster == {"near@h", "far@h"}


def test_transports_are_found_by_name_and_an_unknown_name_lists_the_known_ones() -> None:
    from rollout_queue.weight_sync import transports
    from rollout_queue.weight_sync.transports.groups import GroupReceiver, GroupSender
    from rollout_queue.weight_sync.transports.shm import ShmReceiver, ShmSender
    from rollout_queue.weight_sync.transports.trainer_group import TrainerGroupReceiver

    assert transports.names() == ["cuda_ipc", "gloo", "nccl", "shm", "vllm"]
    assert transports.sender_class("nccl") is GroupSender and transports.receiver_class("gloo") is GroupReceiver
    assert transports.sender_class("shm") is ShmSender and transports.receiver_class("shm") is ShmReceiver
    assert transports.receiver_class("vllm") is TrainerGroupReceiver
    with pytest.raises(ValueError, match="cuda_ipc, gloo, nccl, shm, vllm"):
        transports.sender_class("rdma")


class _Store:
    """The few TCPStore calls a handoff makes, in memory."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.values[key]

    def set_timeout(self, timeout: Any) -> None:
        pass

    def delete_key(self, key: str) -> bool:
        return self.values.pop(key, None) is not None


class _Sink:
    layerwise_open = False

    def __init__(self) -> None:
        self.loaded: dict[str, torch.Tensor] = {}
        self.names: set[str] = set()

    def load(self, buffer: Any, specs: Any, offsets: Any, *, learn_in_place: bool = True) -> None:
        for name, view in wire.bucket_views(buffer, specs, offsets):
            self.loaded[name] = view.clone()

    def load_tensors(self, tensors: Any) -> dict[str, float]:
        for spec, buffer, at, _ in tensors:
            self.loaded[spec.name] = wire.bucket_views(buffer, [spec], [at])[0][1].clone()
        return {}

    def arrived(self, names: Any) -> None:
        self.names.update(names)

    def in_place_targets(self, manifest: Any) -> dict[str, Any]:
        return {}

    def touched(self) -> None:
        pass


def test_a_shared_memory_handoff_delivers_every_tensor_and_reuses_its_segments() -> None:
    import os
    from concurrent.futures import ThreadPoolExecutor

    from rollout_queue.tasks.errors import SyncRefused
    from rollout_queue.weight_sync.protocol import SyncDecision, UpdateRequest
    from rollout_queue.weight_sync.settings import SyncSettings
    from rollout_queue.weight_sync.transports.base import SendJob
    from rollout_queue.weight_sync.transports.shm import ShmReceiver, ShmSender

    tensors = {f"t{i}": torch.randn(64 + i, 33) for i in range(7)}
    manifest = wire.plan_buckets([(n, "float32", list(t.shape)) for n, t in tensors.items()], 20_000)
    assert len(manifest.bucket_sizes) > 2
    store, sender, receiver = _Store(), ShmSender("shm", SyncSettings()), ShmReceiver("shm")
    plan = SyncPlan(round=SyncRound("1-one"), weight_version=1, pause="wait", store_host="127.0.0.1", store_port=1,
                    members={"w@h": 1}, backend="gloo", handoffs={"w@h": "shm"}, manifest_digest="d",
                    issued_at=0.0)
    decision = SyncDecision(go=True, world=1, handoff=["w@h"])
    receiver.store, receiver.store_address = store, ("127.0.0.1", 1)
    with ThreadPoolExecutor(1) as executor:
        for round_ in range(2):
            sender.send(SendJob(plan=plan, decision=decision, manifest=manifest, tensors=tensors, store=store,
                                nodes=["w@h"], deadline=time.monotonic() + 30, executor=executor))
            receiver.begin(UpdateRequest(plan=plan, decision=decision, node="w@h"), 0, torch.device("cpu"))
            sink = _Sink()
            receiver.receive(sink, manifest, torch.device("cpu"), time.monotonic() + 30)
            assert sink.names == set(tensors)
            assert all(torch.equal(sink.loaded[n], t) for n, t in tensors.items())
            sender.finished(plan)
            assert store.values == {}  # the sync's keys are gone from the store
            if round_ == 0:
                segments = {p for p in os.listdir("/dev/shm") if p.startswith(f"rq-sync-{sender._token}")}
                assert len(segments) == len(manifest.bucket_sizes)
                mapped = dict(receiver._mapped)
            tensors = {n: t * 2 for n, t in tensors.items()}
    assert receiver._mapped.keys() == mapped.keys()  # the second sync mapped nothing new
    sender.close()
    assert not [p for p in os.listdir("/dev/shm") if p.startswith(f"rq-sync-{sender._token}")]
    with pytest.raises(SyncRefused, match="not a weight-sync segment"):
        receiver.open({"segment": "../etc/passwd", "size": 1}, 1, torch.device("cpu"))


def test_a_handoff_of_the_trainers_own_storages_is_named_in_the_plan_and_made_anew_when_one_moves() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from rollout_queue.weight_sync.protocol import SyncDecision, UpdateRequest
    from rollout_queue.weight_sync.sender import list_tensors
    from rollout_queue.weight_sync.settings import SyncSettings
    from rollout_queue.weight_sync.transports.base import SendJob
    from rollout_queue.weight_sync.transports.shm import ShmReceiver, ShmSender

    tensors = {f"t{i}": torch.randn(16 + i, 8).share_memory_() for i in range(4)}
    manifest = wire.plan_buckets([(n, "float32", list(t.shape)) for n, t in tensors.items()], 1 << 20)
    store, sender, receiver = _Store(), ShmSender("shm", SyncSettings()), ShmReceiver("shm")
    decision = SyncDecision.handed("w@h")
    receiver.store, receiver.store_address = store, ("127.0.0.1", 1)
    digests = []
    try:
        with ThreadPoolExecutor(1) as executor:
            for step in range(3):
                if step == 2:  # one tensor replaced by another in other memory
                    tensors["t1"] = (tensors["t1"] * 3).share_memory_()
                plan = _plan(round=SyncRound(f"{step + 1}-own"), store_port=1, handoffs={"w@h": "shm"})
                own = list_tensors(tensors).layout
                # Before the trigger: the layout is stored and the plan names it.
                digest = sender.announce_layout(plan, tensors, own, store)
                assert digest is not None
                plan.layouts["shm"] = digest
                digests.append(digest)
                assert set(store.values) == {keys.sync_handoff_layout("shm", digest)}  # the one before it dropped
                if step == 1:  # a layout the engine holds is not read again: a steady sync reads nothing
                    store.values.clear()
                sender.send(SendJob(plan=plan, decision=decision, manifest=manifest, tensors=tensors, store=store,
                                    nodes=["w@h"], deadline=time.monotonic() + 30, executor=executor, own=own))
                assert not any(key.startswith(keys.sync_handoff(plan.round, "shm", 0)) for key in store.values)
                receiver.begin(UpdateRequest(plan=plan, decision=decision, node="w@h"), 0, torch.device("cpu"))
                sink = _Sink()
                receiver.receive(sink, manifest, torch.device("cpu"), time.monotonic() + 30)
                assert all(torch.equal(sink.loaded[n], t) for n, t in tensors.items())
                assert receiver.finish() is None  # on CPU the engine's copies are done when it answers
                sender.finished(plan)
                for tensor in tensors.values():
                    tensor.add_(1)  # a step in place: the same storages
        assert digests[0] == digests[1] != digests[2]
    finally:
        sender.close()


class _DeferringParameter(torch.nn.Parameter):
    """A parameter as vLLM's are (``BasevLLMParameter``): a ``__torch_function__`` that
    only defers to ``Parameter``'s; it counts the torch functions that went through it."""

    calls = 0

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        cls.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_the_kept_load_plans_check_reads_vllm_style_parameters_and_sees_their_data_move() -> None:
    from rollout_queue.weight_sync.inplace import InPlaceMap

    def unmoved(anchors: list[Any]) -> bool:  # as the kept plan checks them (receiver._SteadyLoad.copy)
        with torch._C.DisableTorchFunctionSubclass():
            return all(InPlaceMap.holds(anchor) for anchor in anchors)

    module = torch.nn.Module()
    module.weight = _DeferringParameter(torch.zeros(4, 4))
    param = module.weight
    anchors = [(module, "weight", param, param.data_ptr())]
    before = _DeferringParameter.calls
    assert unmoved(anchors)
    assert _DeferringParameter.calls == before, "the check read the address through Python"
    param.data = torch.ones(4, 4)  # vLLM gives it new storage
    assert not unmoved(anchors)
    anchors = [(module, "weight", param, param.data_ptr())]
    assert unmoved(anchors)
    module.weight = _DeferringParameter(torch.zeros(4, 4))  # or replaces it
    assert not unmoved(anchors)
    # The parameter's own torch functions are on again after the check.
    before = _DeferringParameter.calls
    module.weight.data_ptr()
    assert _DeferringParameter.calls == before + 1


def test_a_kept_load_plan_checks_each_parameter_before_its_first_copy_and_plans_anew_when_one_moved() -> None:
    """A steady handoff copies by the last load's plan, each parameter checked just
    before the first copy into it (vLLM-style parameters read without their torch
    functions). One that moved meanwhile stops the copies there (those before it
    went to places that held) and the load is planned anew, into where it lies now."""
    from types import SimpleNamespace

    from rollout_queue.weight_sync.protocol import TensorSpec
    from rollout_queue.weight_sync.receiver import EngineReceiver

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = torch.nn.Module()
            self.first.weight = _DeferringParameter(torch.zeros(4, 4))
            self.second = torch.nn.Module()
            self.second.weight = _DeferringParameter(torch.zeros(4, 4))  # holds "b" and "c", 32 bytes each
            self.loaded: list[str] = []

        def load_weights(self, weights: Any) -> None:
            self.loaded += [name for name, _ in weights]

    model = Model()
    receiver = EngineReceiver(SimpleNamespace(model_runner=SimpleNamespace(model=model)), "direct")
    receiver.in_place.places = {"a": ("first.weight", 0), "b": ("second.weight", 0), "c": ("second.weight", 32)}
    buffer = torch.arange(16 + 8 + 8, dtype=torch.float32).view(torch.uint8)  # the trainer's storage
    specs = [TensorSpec(name="a", dtype="float32", shape=[4, 4], bucket=0, offset=0, nbytes=64),
             TensorSpec(name="b", dtype="float32", shape=[2, 4], bucket=0, offset=64, nbytes=32),
             TensorSpec(name="c", dtype="float32", shape=[2, 4], bucket=0, offset=96, nbytes=32)]
    tensors = [(spec, buffer, spec.offset, 0) for spec in specs]
    whole = buffer.view(torch.float32)

    def landed() -> bool:
        return (torch.equal(model.first.weight.data.flatten(), whole[:16])
                and torch.equal(model.second.weight.data.flatten(), whole[16:]))

    assert receiver.load_tensors(tensors)["planned"] == 1.0 and landed()
    whole += 100  # the trainer's step, in place
    before = _DeferringParameter.calls
    steady = receiver.load_tensors(tensors)
    assert _DeferringParameter.calls == before, "the checks read the parameters' addresses through Python"
    assert steady["planned"] == 0.0 and steady["in_place_tensors"] == 3 and landed()
    assert steady["resolve_s"] >= 0 and steady["issue_s"] >= 0

    whole += 100
    old_second = model.second.weight.data
    model.second.weight.data = torch.full((4, 4), -1.0)  # vLLM gives it new storage
    kept = receiver._steady
    assert kept is not None and kept.copy() is None  # stopped at the moved parameter...
    assert torch.equal(model.first.weight.data.flatten(), whole[:16])  # ...after copying into the one before
    assert not torch.equal(old_second.flatten(), whole[16:])  # nothing went through the stale places
    assert torch.equal(model.second.weight.data, torch.full((4, 4), -1.0))
    assert receiver.load_tensors(tensors)["planned"] == 1.0 and landed()  # planned anew: where it lies now
    assert receiver.load_tensors(tensors)["planned"] == 0.0 and model.loaded == []


def test_a_plan_naming_a_layout_the_trainer_never_stored_fails_the_engine_at_its_deadline() -> None:
    from rollout_queue.weight_sync.protocol import SyncDecision, UpdateRequest
    from rollout_queue.weight_sync.transports.shm import ShmReceiver

    class _Waiting(_Store):
        def get(self, key: str) -> bytes:
            if key not in self.values:  # a TCPStore waits for the key until its timeout
                raise TimeoutError(f"wait timeout for key {key}")
            return super().get(key)

    manifest = wire.plan_buckets([("t0", "float32", [4, 4])], 1 << 20)
    receiver = ShmReceiver("shm")
    receiver.store, receiver.store_address = _Waiting(), ("127.0.0.1", 1)
    plan = _plan(round=SyncRound("1-lost"), store_port=1, handoffs={"w@h": "shm"}, layouts={"shm": "0" * 32})
    receiver.begin(UpdateRequest(plan=plan, decision=SyncDecision.handed("w@h"), node="w@h"), 0,
                   torch.device("cpu"))
    with pytest.raises(TimeoutError, match="wait timeout"):
        receiver.receive(_Sink(), manifest, torch.device("cpu"), time.monotonic() + 1)


def test_a_handoff_that_fails_while_packing_fails_the_engine_waiting_for_its_next_bucket_at_once() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from rollout_queue.tasks.errors import WorkerLost
    from rollout_queue.weight_sync.protocol import SyncDecision, UpdateRequest
    from rollout_queue.weight_sync.settings import SyncSettings
    from rollout_queue.weight_sync.transports.base import SendJob
    from rollout_queue.weight_sync.transports.shm import ShmReceiver, ShmSender

    tensors = {f"t{i}": torch.randn(64 + i, 33) for i in range(7)}
    manifest = wire.plan_buckets([(n, "float32", list(t.shape)) for n, t in tensors.items()], 20_000)
    store, sender, receiver = _Store(), ShmSender("shm", SyncSettings()), ShmReceiver("shm")
    plan = _plan(round=SyncRound("1-broken"), store_port=1, handoffs={"w@h": "shm"})
    decision = SyncDecision.handed("w@h")

    def cut(bucket: int) -> None:
        if bucket == 1:
            raise OSError("no space left on /dev/shm")

    sender.before_bucket = cut
    receiver.store, receiver.store_address = store, ("127.0.0.1", 1)
    try:
        with ThreadPoolExecutor(1) as executor, pytest.raises(WorkerLost, match="no space left"):
            sender.send(SendJob(plan=plan, decision=decision, manifest=manifest, tensors=tensors, store=store,
                                nodes=["w@h"], deadline=time.monotonic() + 30, executor=executor))
        receiver.begin(UpdateRequest(plan=plan, decision=decision, node="w@h"), 0, torch.device("cpu"))
        sink = _Sink()
        started = time.monotonic()
        with pytest.raises(WorkerLost, match="failed before bucket 1 was there.*no space left"):
            receiver.receive(sink, manifest, torch.device("cpu"), time.monotonic() + 60)
        assert time.monotonic() - started < 5
        assert sink.names == {spec.name for spec in manifest.tensors if spec.bucket == 0}  # bucket 0 arrived
        sender.finished(plan)
        assert store.values == {}  # the failure's keys leave the store with the round's
    finally:
        sender.close()


class _Worker:
    """vLLM's worker, as far as the engine receiver reads it: its model."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model_runner = type("Runner", (), {"model": model})()


def test_a_steady_handoff_reuses_its_load_plan_until_a_parameter_under_it_moves() -> None:
    from rollout_queue.weight_sync.receiver import EngineReceiver

    model = _LoaderModel()
    receiver = EngineReceiver(_Worker(model), "direct")
    state = _checkpoint(1)
    # The trainer's own storages, as a handoff lists them: (spec, storage bytes, offset, storage index).
    specs = wire.plan_buckets([(n, wire.dtype_name(t), list(t.shape)) for n, t in state.items()],
                              bucket_bytes=1 << 20).tensors
    layout = [(spec, wire.flat_bytes(state[spec.name]), 0, k) for k, spec in enumerate(specs)]

    def load_and_check(expect_planned: bool) -> dict[str, float]:
        stats = receiver.load_tensors(layout)
        assert stats["planned"] == float(expect_planned)
        reference = _LoaderModel()
        reference.load_weights(list(state.items()))
        for (name, got), (_, want) in zip(model.named_parameters(), reference.named_parameters()):
            assert torch.equal(got, want), name
        return stats

    assert load_and_check(True)["in_place_tensors"] == 0  # the first: watched, learns the places
    assert load_and_check(True)["in_place_tensors"] == 4  # planned from what was learned, kept
    for tensor in state.values():  # the trainer's step, in place
        tensor.add_(1.0)
    load_and_check(False)
    # vLLM gives a parameter new storage, or replaces it: planned again, and the
    # copies land in the parameter the model holds now.
    model.qkv.data = torch.zeros_like(model.qkv.data)
    load_and_check(True)
    load_and_check(False)
    model.o = torch.nn.Parameter(torch.zeros(4, 4))
    load_and_check(True)
    # Another layout (a list the handoff made anew) is planned for.
    layout = list(layout)
    load_and_check(True)
    receiver.abort_update()  # it lets go of the trainer's memory: so does the plan
    load_and_check(True)
