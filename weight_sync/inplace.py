"""Receive a checkpoint tensor straight into the parameter memory that holds it.

With direct loading (CUDA, unquantized), vLLM's ``load_weights`` ends, for
most checkpoint tensors, in one ``copy_`` of the whole tensor into a
contiguous region of one parameter: ``o_proj.weight`` into its parameter,
``q_proj.weight`` into the first rows of ``qkv_proj.weight``, ``up_proj`` into
the second half of ``gate_up_proj``. For such a tensor the receive buffer and
the copy are waste: the broadcast can land in that region directly.

:class:`InPlaceMap` learns which tensors those are by watching the loads of a
normal sync (``watch``): a tensor qualifies only if the single thing done
with its bytes was one whole, same-dtype copy into a contiguous region of a
parameter. Anything else (a narrowed or converted copy as with tensor
parallelism or quantization, a copy done twice, an in-place change, any
value computed from it) leaves the tensor on the normal path, loaded through
``load_weights`` every sync. The map holds parameter names and byte offsets,
and resolves them against the model at each sync (or, for a load planned
before, checks that each parameter under it is still the model's, at the
same address: :meth:`InPlaceMap.anchors`), so a parameter vLLM reallocated
is never written through a stale pointer.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from rollout_queue.weight_sync.protocol import TensorSpec

# Ops that read a tensor's metadata only; their results hold none of its values.
_METADATA = frozenset({
    "__get__", "size", "dim", "numel", "stride", "storage_offset", "data_ptr", "element_size",
    "is_contiguous", "is_floating_point", "__len__", "untyped_storage", "nelement", "ndimension",
})


def _mutates(name: str) -> bool:
    """In-place torch ops (``add_``), item assignment, augmented assignment (``__iadd__``)."""
    if name.startswith("__"):
        return name == "__setitem__" or (
            name.startswith("__i") and name not in ("__index__", "__int__", "__invert__", "__iter__"))
    return name.endswith("_")


class InPlaceMap:
    """Checkpoint name → (parameter name, byte offset) for tensors received in place."""

    def __init__(self) -> None:
        self.places: dict[str, tuple[str, int]] = {}
        self.refused: set[str] = set()
        # The byte views of the last sync, by name, with where they were made
        # (parameter address, offset): a view costs a few torch calls, ~140 of
        # them on the receiver's path before its first receive is posted.
        self._views: dict[str, tuple[int, int, Any]] = {}
        # Bumped whenever a watch changes what is mapped: a load planned from an
        # older map is planned again.
        self.generation = 0

    def known(self, name: str) -> bool:
        return name in self.places or name in self.refused

    def targets(self, model: Any, specs: Sequence[TensorSpec]) -> dict[str, Any]:
        """Byte views of the parameter regions the mapped tensors of ``specs`` land in."""
        params = dict(model.named_parameters(remove_duplicate=False))
        out: dict[str, Any] = {}
        for spec in specs:
            place = self.places.get(spec.name)
            if place is None:
                continue
            param = params.get(place[0])
            if param is None:
                continue
            cached = self._views.get(spec.name)
            # Its storage is where it was (a view keeps the old one alive, so a
            # replaced parameter cannot reappear at the same address).
            if cached is not None and cached[:2] == (param.data_ptr(), place[1]) and cached[2].numel() == spec.nbytes:
                out[spec.name] = cached[2]
                continue
            if not param.is_contiguous():
                continue
            flat = param.data.view(-1).view(torch.uint8)
            offset = place[1]
            if offset + spec.nbytes <= flat.numel():
                out[spec.name] = flat[offset : offset + spec.nbytes]
                self._views[spec.name] = (param.data_ptr(), offset, out[spec.name])
        return out

    def anchors(self, model: Any, names: Iterable[str]) -> tuple[list[tuple[Any, str, Any, int]], list[int]]:
        """What the regions :meth:`targets` just gave for ``names`` rest on: per parameter,
        its module, its name there, the parameter and its address; and, per name, its
        parameter's index in that list. :meth:`holds` then tells whether a region still
        lies in the model's parameter, a few attribute reads instead of a walk of the model."""
        found: dict[str, int] = {}
        anchors: list[tuple[Any, str, Any, int]] = []
        rests_on: list[int] = []
        for name in names:
            owner = self.places[name][0]
            if owner not in found:
                prefix, _, leaf = owner.rpartition(".")
                module = model.get_submodule(prefix)
                param = module._parameters[leaf]
                found[owner] = len(anchors)
                anchors.append((module, leaf, param, param.data_ptr()))
            rests_on.append(found[owner])
        return anchors, rests_on

    @staticmethod
    def holds(anchor: tuple[Any, str, Any, int]) -> bool:
        """Whether the parameter of one anchor is still its module's, at the same address
        (a parameter vLLM replaced, or whose data it swapped, is not).

        vLLM's parameters are subclasses whose ``__torch_function__`` only defers to
        ``Parameter``'s: with it on, each ``data_ptr()`` goes through Python (2.65 us
        against 0.18 us with it off, on the 2-core VM): call this under
        ``torch._C.DisableTorchFunctionSubclass()`` (``receiver._SteadyLoad.copy`` does)."""
        module, leaf, param, address = anchor
        return module._parameters.get(leaf) is param and param.data_ptr() == address

    @contextmanager
    def watch(
        self, model: Any, buffer: Any, specs: Sequence[TensorSpec], offsets: Sequence[int]
    ) -> Iterator[None]:
        """Learn, from the ``load_weights`` calls inside, which of ``specs`` (at
        ``offsets`` in ``buffer``, received bytes) can be received in place from now on."""
        with self.watch_buffers(model, [(buffer, specs, offsets)]):
            yield

    @contextmanager
    def watch_buffers(
        self, model: Any, buffers: Sequence[tuple[Any, Sequence[TensorSpec], Sequence[int]]]
    ) -> Iterator[None]:
        """``watch`` over tensors that lie in several buffers (each with its specs
        and their offsets in it): one ``load_weights`` for all of them."""
        recorder = _CopyRecorder(model, buffers)
        with recorder:
            yield
        for _, specs, _ in buffers:
            for spec in specs:
                copies = recorder.copies.get(spec.name, [])
                if spec.name in recorder.tainted or len(copies) != 1:
                    self.refused.add(spec.name)
                    self.places.pop(spec.name, None)
                else:
                    self.places[spec.name] = copies[0]
        self.generation += 1


class _Received:
    """One buffer of received bytes: where it starts and the tensors in it, by offset."""

    def __init__(self, buffer: Any, specs: Sequence[TensorSpec], offsets: Sequence[int]) -> None:
        self.base = buffer.data_ptr()
        placed = sorted(zip(offsets, specs), key=lambda pair: pair[0])
        self.starts = [at for at, _ in placed]
        self.specs = [spec for _, spec in placed]


class _CopyRecorder(TorchFunctionMode):
    """Sees every torch call made while loading, and follows the received bytes."""

    def __init__(self, model: Any, buffers: Sequence[tuple[Any, Sequence[TensorSpec], Sequence[int]]]) -> None:
        super().__init__()
        # Received buffers by their storage (two buffers may share one storage: a
        # trainer's tensors carved out of one allocation).
        self.received: dict[int, list[_Received]] = {}
        for buffer, specs, offsets in buffers:
            self.received.setdefault(buffer.untyped_storage().data_ptr(), []).append(
                _Received(buffer, specs, offsets))
        self.params: dict[int, tuple[str, Any]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            if param.is_contiguous() and param.device.type != "meta":
                self.params.setdefault(param.untyped_storage().data_ptr(), (name, param))
        self.copies: dict[str, list[tuple[str, int]]] = {}
        self.tainted: set[str] = set()

    def _in_bucket(self, tensor: Any) -> bool:
        return (isinstance(tensor, torch.Tensor) and tensor.device.type != "meta"
                and tensor.untyped_storage().data_ptr() in self.received)

    def _locate(self, tensor: Any) -> tuple[_Received, int] | None:
        """Which received tensor ``tensor`` views (its buffer, its index there), if any."""
        if not self._in_bucket(tensor):
            return None
        for received in self.received[tensor.untyped_storage().data_ptr()]:
            offset = tensor.data_ptr() - received.base
            at = bisect.bisect_right(received.starts, offset) - 1
            if at >= 0 and offset < received.starts[at] + received.specs[at].nbytes:
                return received, at
        return None

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        touched = {found[0].specs[found[1]].name
                   for found in map(self._locate, tree_flatten((args, kwargs))[0]) if found is not None}
        if not touched:
            return result
        name = getattr(func, "__name__", "")
        if name == "copy_" and len(args) >= 2 and self._whole_copy(args[0], args[1]):
            return result
        outputs = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
        view_like = bool(outputs) and all(map(self._in_bucket, outputs))
        if (view_like and not _mutates(name)) or (not outputs and name in _METADATA):
            return result  # a view of the bucket, or its shape: no value left it
        self.tainted.update(touched)
        return result

    def _whole_copy(self, dest: Any, src: Any) -> bool:
        """``dest.copy_(src)`` with ``src`` a whole received tensor and ``dest`` a
        contiguous region of one parameter; recorded when so."""
        found = self._locate(src)
        if found is None or self._locate(dest) is not None:
            return False
        received, at = found
        spec = received.specs[at]
        owner = self.params.get(dest.untyped_storage().data_ptr())
        if (
            owner is None
            or src.data_ptr() - received.base != received.starts[at]
            or src.numel() * src.element_size() != spec.nbytes
            or not src.is_contiguous()
            or not dest.is_contiguous()
            or dest.dtype != src.dtype
            or dest.numel() != src.numel()
            or dest.device != owner[1].device
        ):
            return False
        self.copies.setdefault(spec.name, []).append((owner[0], dest.data_ptr() - owner[1].data_ptr()))
        return True
