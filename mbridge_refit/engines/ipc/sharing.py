"""Where the export's tensors live, and sharing those storages with an engine process.

A refit into a colocated engine moves no bytes through a staging buffer: the engine maps the
trainer's memory and copies from it. What it needs is the *shared layout* of one export: for
every yielded ``(hf_name, tensor)``, which storage holds it and where (offset, shape, stride,
dtype). The storages are the model's parameters (an export yields views of them wherever the HF
tensor is a slice of one parameter) and the export's cached buffers
(``export_hf_weights(..., reuse_buffer_from_cache=True, hold_outputs=True)``), so they are the
same from one step to the next: the layout is shared once and each later step only says that
the bytes are ready. A step whose layout differs (another model, a freed cache, a stream of
fresh tensors) is shared anew.

A tensor may instead be an engine rank's *shard* of an HF tensor (``ShardBox``: the HF tensor's
shape and the box the shard holds, in HF coordinates, from a transfer plan): the engine records
its loader against a full-size tensor built around the shard and then reads the shard itself
(``engines.replay.shard_remap``).

A tensor may also name the rows it is made of (``RowsRef``: row runs of another shared tensor,
e.g. q, k and v as runs of the trainer's fused QKV parameter). The engine then reads those rows
where they live, every step, and the exported copy is needed only while the engine records its
loader.

A blockwise FP8 tensor may name what it is the quantization of (``QuantizedRef``: row runs of a
BF16 source, in whole 128-row blocks, and the tensor holding its scales): the engine then quantizes
those rows itself, every step, and the shared copy is needed only while it records its loader.

Transports hand the storages over: ``CudaIpcTransport`` (CUDA IPC handles, opened once by the
engine process and kept) and ``LocalTransport`` (the same process: CPU tests, or an engine that
runs inside the trainer's process). Lower layer of ``engines``: imports only torch (and
``ipc_handles``, the CUDA IPC payload's format).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import operator
import uuid
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

import torch

from mbridge_refit.engines.ipc.handles import BadIpcPayload, decode_payload, encode_payload
from mbridge_refit.errors import EngineError, wire_version_mismatch
from mbridge_refit.runtime.stamps import stamp_of

__all__ = [
    "TRANSPORTS",
    "CudaIpcTransport",
    "ExportSnapshot",
    "LayoutRecorder",
    "LocalTransport",
    "QuantizedRef",
    "RowsRef",
    "Runs",
    "ShardBox",
    "LAYOUT_VERSION",
    "SharedLayout",
    "SharingError",
    "TensorRef",
    "Transport",
    "quantized_sources",
    "row_sources",
    "views",
]


class SharingError(EngineError):
    """The shared layout and the storages that arrived do not fit together."""


# The layout's wire format (``SharedLayout.to_wire``): the fields of each tensor, in order. 1: the first
# that carried a version (shards and quantized sources included).
LAYOUT_VERSION = 1


Runs = tuple[tuple[int, int, int], ...]  # (row of the tensor, row of the source, rows)


@dataclass(frozen=True)
class RowsRef:
    """The rows a tensor is made of: ``runs`` of a source tensor (same dtype, same trailing
    shape) that is a view of a shared storage; ``offset`` and ``stride`` in elements."""

    storage: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    runs: Runs

    def to_wire(self) -> list:
        return [self.storage, list(self.shape), list(self.stride), self.offset, [list(run) for run in self.runs]]

    @classmethod
    def from_wire(cls, wire: list | None) -> "RowsRef | None":
        if wire is None:
            return None
        storage, shape, stride, offset, runs = wire
        return cls(
            int(storage), tuple(shape), tuple(stride), int(offset), tuple(tuple(int(x) for x in run) for run in runs)
        )


@dataclass(frozen=True)
class ShardBox:
    """Where a shared tensor sits in the HF tensor it is a shard of: the HF tensor's ``shape`` and
    the ``box`` (one ``(start, stop)`` per dimension) the shard holds."""

    shape: tuple[int, ...]
    box: tuple[tuple[int, int], ...]

    def to_wire(self) -> list:
        return [list(self.shape), [list(extent) for extent in self.box]]

    @classmethod
    def from_wire(cls, wire: list | None) -> "ShardBox | None":
        if wire is None:
            return None
        shape, box = wire
        return cls(tuple(int(n) for n in shape), tuple((int(a), int(b)) for a, b in box))


@dataclass(frozen=True)
class QuantizedRef:
    """What a blockwise FP8 tensor is the quantization of: row ``rows.runs`` of a ``dtype`` source
    (the trainer's parameter, a view of a shared storage), in whole block rows; ``scale`` names the
    layout's tensor that holds its ``scale_inv``. The engine then quantizes those rows itself, every
    step, where it would have copied the tensor (``ApplyPlan.compose_quantized``)."""

    scale: str
    dtype: str  # the source's torch dtype name
    rows: RowsRef

    def to_wire(self) -> list:
        return [self.scale, self.dtype, self.rows.to_wire()]

    @classmethod
    def from_wire(cls, wire: list | None) -> "QuantizedRef | None":
        if wire is None:
            return None
        scale, dtype, rows = wire
        return cls(str(scale), str(dtype), RowsRef.from_wire(rows))


@dataclass(frozen=True)
class TensorRef:
    """One exported tensor as a view of a shared storage (``offset`` and ``stride`` in elements),
    and optionally the rows of another shared tensor it is a copy of."""

    name: str
    storage: int  # index into SharedLayout.storage_bytes
    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    rows: RowsRef | None = None
    shard: ShardBox | None = None
    quantized: QuantizedRef | None = None


@dataclass(frozen=True)
class SharedLayout:
    """The tensors of one export, in export order, and the sizes of the storages they live in."""

    refs: tuple[TensorRef, ...]
    storage_bytes: tuple[int, ...]

    @property
    def names(self) -> list[str]:
        return [ref.name for ref in self.refs]

    @cached_property
    def fingerprint(self) -> str:
        """Identifies the layout on both sides: the trainer sends it with every step, the engine
        refuses a step whose fingerprint is not the layout it opened."""
        return hashlib.sha256(json.dumps(self.to_wire(), sort_keys=True).encode()).hexdigest()[:16]

    @cached_property
    def nbytes(self) -> int:
        """Bytes of the exported tensors (not of the storages they live in)."""
        return sum(_numel(ref.shape) * _dtype(ref.dtype).itemsize for ref in self.refs)

    def to_wire(self) -> dict[str, Any]:
        """Plain lists and numbers (for an RPC that serializes with msgpack or JSON), with ``LAYOUT_VERSION``."""
        return {
            "version": LAYOUT_VERSION,
            "refs": [
                [
                    r.name,
                    r.storage,
                    r.dtype,
                    list(r.shape),
                    list(r.stride),
                    r.offset,
                    r.rows and r.rows.to_wire(),
                    *([r.shard and r.shard.to_wire()] if r.shard is not None or r.quantized is not None else []),
                    *([r.quantized.to_wire()] if r.quantized is not None else []),
                ]
                for r in self.refs
            ],
            "storage_bytes": list(self.storage_bytes),
        }

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> "SharedLayout":
        """``to_wire``'s layout back; a wire of another ``LAYOUT_VERSION`` (or none) raises ``SharingError``."""
        if wire.get("version") != LAYOUT_VERSION:
            raise SharingError(
                wire_version_mismatch("shared layout", LAYOUT_VERSION, wire.get("version"), "the trainer")
            )
        refs = tuple(_ref_from_wire(*ref) for ref in wire["refs"])
        return cls(refs=refs, storage_bytes=tuple(int(n) for n in wire["storage_bytes"]))


def _ref_from_wire(name, storage, dtype, shape, stride, offset, rows, shard=None, quantized=None) -> TensorRef:
    return TensorRef(
        name,
        int(storage),
        dtype,
        tuple(shape),
        tuple(stride),
        int(offset),
        RowsRef.from_wire(rows),
        ShardBox.from_wire(shard),
        QuantizedRef.from_wire(quantized),
    )


class ExportSnapshot:
    """Trainer side: one export's buckets of ``(name, tensor)`` pairs, held, and what tells the next
    export to sit exactly where this one did without noting each tensor anew.

    A steady cached export (``hold_outputs``) yields the very same tensor objects every step (the
    exporter's held outputs and its kept views of parameters; it makes new ones when a buffer or a
    parameter's storage moves). ``same_as(previous)`` sees it bucket by bucket, both exports cut
    alike (their stamps, one per bucket, None where a bucket has none, compare equal):

    * a stamped bucket (``runtime.stamps``) equals the previous export's bucket of the same stamp:
      the same pairs, whose producers checked in this export that each tensor reads what it read
      before. No work per tensor (the experts of an MoE model, whose buckets are views of them or
      quantized from such views).
    * the pairs of the other buckets are compared with the previous export's, position by position:
      name, tensor object and data address. One data-address read per tensor (``Tensor.data_ptr``,
      one call into C) and list compares in C, where ``LayoutRecorder`` builds a key of seven fields
      with a Python call per tensor. Unlike that key, shape, stride, dtype and storage size are not
      compared; that is sound because the exporter never changes its outputs in place (no ``set_``,
      ``.data =`` or resize on a tensor it yielded), and because the caller holds the storages of the
      layout it shared (``IpcSession``'s ``_held``), so no other storage can take those addresses
      (unless one is freed in place, ``resize_(0)``, which holding it does not prevent).

    ``owner`` (the consumer's routes: which pairs of the buckets it keeps) must be the same object.
    """

    __slots__ = ("buckets", "stamps", "owner", "names", "tensors", "pointers")

    def __init__(self, buckets: list[list[tuple[str, torch.Tensor]]], owner: Any = None) -> None:
        self.buckets, self.owner = buckets, owner
        self.stamps = tuple(map(stamp_of, buckets))
        loose = [pair for bucket, stamp in zip(buckets, self.stamps) if stamp is None for pair in bucket]
        self.names = [name for name, _ in loose]
        self.tensors = [tensor for _, tensor in loose]
        self.pointers = list(map(torch.Tensor.data_ptr, self.tensors))

    def pairs(self, ignored: frozenset[str] = frozenset()) -> list[tuple[str, torch.Tensor]]:
        """Every pair of the export, in order, but those named in ``ignored``."""
        pairs = list(itertools.chain.from_iterable(self.buckets))
        return [pair for pair in pairs if pair[0] not in ignored] if ignored else pairs

    def same_as(self, previous: "ExportSnapshot | None") -> bool:
        """Whether this export's tensors are the previous export's objects, at the same addresses."""
        return (
            previous is not None
            and self.owner is previous.owner
            and self.stamps == previous.stamps
            and self.pointers == previous.pointers
            and self.names == previous.names
            and all(map(operator.is_, self.tensors, previous.tensors))
        )


class LayoutRecorder:
    """Trainer side: notes where each tensor of one export lives while the export is consumed.

    ``key`` (plain tuples: name, storage address and size, offset, shape, stride, dtype) is cheap
    to build and compare, so a steady-state step only compares it with the previous step's;
    ``layout()`` builds the shared layout and its storages when the key changed. The tensors are
    referenced until the recorder is dropped, so no storage is freed and reused meanwhile.
    """

    def __init__(self) -> None:
        self._keys: list[tuple] = []
        self._tensors: list[torch.Tensor] = []
        self._rows: list[tuple[torch.Tensor, Runs] | None] = []
        self._shards: list[ShardBox | None] = []
        self._quantized: list[tuple[torch.Tensor, Runs, str] | None] = []

    def add(
        self,
        name: str,
        tensor: torch.Tensor,
        rows: tuple[torch.Tensor, Runs] | None = None,
        shard: ShardBox | None = None,
        quantized: tuple[torch.Tensor, Runs, str] | None = None,
    ) -> None:
        """Note ``tensor``; with ``rows`` = ``(source, runs)``, also that it is a copy of those rows
        of ``source`` (the engine then reads them from ``source``); with ``shard``, that it is that
        box of a larger HF tensor; with ``quantized`` = ``(source, runs, scale name)``, that it is the
        blockwise FP8 quantization of those rows of ``source`` (``QuantizedRef``)."""
        tensor = tensor.detach()
        if quantized is not None:
            source, runs, scale = quantized[0].detach(), tuple(quantized[1]), quantized[2]
            if rows is not None or shard is not None or tensor.dim() != 2 or source.shape[1:] != tensor.shape[1:]:
                raise SharingError(
                    f"{name}: a {tuple(tensor.shape)} tensor cannot be the quantized rows of a "
                    f"{tuple(source.shape)} source"
                )
            quantized = (source, runs, scale)
        key = (name, *_where(tensor))
        if shard is not None:
            if tuple(tensor.shape) != tuple(b - a for a, b in shard.box):
                raise SharingError(f"{name}: a {tuple(tensor.shape)} tensor cannot hold the box {shard.box}")
            key += (shard,)
        if rows is not None:
            source, runs = rows[0].detach(), tuple(rows[1])
            if source.dtype != tensor.dtype or source.shape[1:] != tensor.shape[1:]:
                raise SharingError(
                    f"{name}: rows of a {source.dtype} {tuple(source.shape)} source cannot make a "
                    f"{tensor.dtype} {tuple(tensor.shape)} tensor"
                )
            key += (*_where(source), runs)
            rows = (source, runs)
        if quantized is not None:
            key += ("quantized", *_where(quantized[0]), quantized[1], quantized[2])
        self._keys.append(key)
        self._tensors.append(tensor)
        self._rows.append(rows)
        self._shards.append(shard)
        self._quantized.append(quantized)

    @property
    def key(self) -> tuple:
        return tuple(self._keys)

    def layout(self) -> tuple[SharedLayout, list[torch.UntypedStorage]]:
        """The shared layout and the storages it indexes (each once, in first-use order)."""
        index: dict[tuple[int, int], int] = {}
        storages: list[torch.UntypedStorage] = []

        def storage_of(tensor: torch.Tensor) -> int:
            storage = tensor.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key not in index:
                index[key] = len(storages)
                storages.append(storage)
            return index[key]

        def rows_ref(source: torch.Tensor, runs: Runs) -> RowsRef:
            return RowsRef(
                storage=storage_of(source),
                shape=tuple(source.shape),
                stride=tuple(source.stride()),
                offset=source.storage_offset(),
                runs=runs,
            )

        refs = []
        for key, tensor, rows, shard, quantized in zip(
            self._keys, self._tensors, self._rows, self._shards, self._quantized
        ):
            quantized_ref = None
            if quantized is not None:
                source, runs, scale = quantized
                quantized_ref = QuantizedRef(scale, _dtype_name(source.dtype), rows_ref(source, runs))
            refs.append(
                TensorRef(
                    name=key[0],
                    storage=storage_of(tensor),
                    dtype=_dtype_name(tensor.dtype),
                    shape=tuple(tensor.shape),
                    stride=tuple(tensor.stride()),
                    offset=tensor.storage_offset(),
                    rows=None if rows is None else rows_ref(*rows),
                    shard=shard,
                    quantized=quantized_ref,
                )
            )
        layout = SharedLayout(refs=tuple(refs), storage_bytes=tuple(st.nbytes() for st in storages))
        return layout, storages


def views(
    layout: SharedLayout, storages: list[torch.UntypedStorage], device: torch.device
) -> list[tuple[str, torch.Tensor]]:
    """Engine side: ``(hf_name, tensor)`` for every ref, as views of the opened ``storages``
    (no copy, no allocation). Checks that the storages are the ones the layout describes."""
    if len(storages) != len(layout.storage_bytes):
        raise SharingError(f"the layout names {len(layout.storage_bytes)} storages but {len(storages)} were shared")
    for index, (storage, expected) in enumerate(zip(storages, layout.storage_bytes)):
        if storage.nbytes() != expected:
            raise SharingError(f"shared storage {index} has {storage.nbytes()} bytes, the layout says {expected}")
    out = []
    for ref in layout.refs:
        tensor = torch.empty(0, dtype=_dtype(ref.dtype), device=device)
        tensor.set_(storages[ref.storage], ref.offset, ref.shape, ref.stride)
        out.append((ref.name, tensor))
    return out


def row_sources(
    layout: SharedLayout, storages: list[torch.UntypedStorage], device: torch.device
) -> dict[str, tuple[torch.Tensor, Runs]]:
    """Engine side: for every ref that names its rows, ``(source view, runs)`` over the opened
    ``storages`` (call after ``views``, which checks the storages). Checks that the runs lie
    inside the source and cover the tensor's rows exactly once."""
    return {
        ref.name: (_rows_source(ref, ref.rows, ref.dtype, storages, device), ref.rows.runs)
        for ref in layout.refs
        if ref.rows is not None
    }


def quantized_sources(
    layout: SharedLayout, storages: list[torch.UntypedStorage], device: torch.device
) -> dict[str, tuple[torch.Tensor, Runs, str]]:
    """Engine side: for every ref that is the quantization of rows (``QuantizedRef``), ``(source view,
    runs, scale name)`` over the opened ``storages`` (after ``views``). Checks the runs as
    ``row_sources`` does and that the scale is a tensor of the layout; whether the runs are whole
    block rows is the quantizer's to check."""
    names = set(layout.names)
    out = {}
    for ref in layout.refs:
        if ref.quantized is None:
            continue
        if ref.quantized.scale not in names or ref.quantized.scale == ref.name:
            raise SharingError(f"{ref.name}: its scale {ref.quantized.scale!r} is not another tensor of the layout")
        source = _rows_source(ref, ref.quantized.rows, ref.quantized.dtype, storages, device)
        out[ref.name] = (source, ref.quantized.rows.runs, ref.quantized.scale)
    return out


def _rows_source(
    ref: TensorRef, rows: RowsRef, dtype: str, storages: list[torch.UntypedStorage], device: torch.device
) -> torch.Tensor:
    """The view ``rows`` names, checked to make ``ref``'s tensor: runs inside it that cover every row once."""
    if not 0 <= rows.storage < len(storages):
        raise SharingError(f"{ref.name}: its rows are in storage {rows.storage}, and {len(storages)} were shared")
    source = torch.empty(0, dtype=_dtype(dtype), device=device)
    source.set_(storages[rows.storage], rows.offset, rows.shape, rows.stride)
    covered = sorted((hf_row, hf_row + count) for hf_row, _, count in rows.runs)
    tiles = (
        covered
        and covered[0][0] == 0
        and covered[-1][1] == ref.shape[0]
        and all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
    )
    inside = all(0 <= start and start + count <= rows.shape[0] for _, start, count in rows.runs)
    if not (tiles and inside and tuple(rows.shape[1:]) == tuple(ref.shape[1:])):
        raise SharingError(
            f"{ref.name}: its row runs {list(rows.runs)[:4]} do not make a {ref.shape} tensor from a "
            f"{rows.shape} source"
        )
    return source


def _where(tensor: torch.Tensor) -> tuple:
    """Where a tensor's bytes are: storage address and size, offset, shape, stride, dtype."""
    storage = tensor.untyped_storage()
    return (
        storage.data_ptr(),
        storage.nbytes(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tensor.stride(),
        tensor.dtype,
    )


class Transport(Protocol):
    """Hands storages from the trainer process to the engine process."""

    name: str

    def share(self, storages: list[torch.UntypedStorage]) -> bytes:
        """Trainer side: a payload that lets the engine open ``storages``."""
        ...

    def open(self, payload: bytes, device: torch.device) -> list[torch.UntypedStorage]:
        """Engine side: the storages of ``payload``, on ``device``."""
        ...


class CudaIpcTransport:
    """CUDA IPC: the engine maps the trainer's allocations (same GPU, another process).

    The payload holds one handle per storage, keyed by the GPU's UUID (device indices differ
    between processes with different ``CUDA_VISIBLE_DEVICES``). It is JSON (``ipc_handles``), not
    a pickle: opening it builds the arguments of ``rebuild_cuda_tensor`` field by field, of fixed
    types, and nothing a payload names.
    """

    name = "cuda_ipc"

    def share(self, storages: list[torch.UntypedStorage]) -> bytes:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

        handles = []
        for storage in storages:
            whole = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            rebuild, args = reduce_tensor(whole)
            if rebuild is not rebuild_cuda_tensor:
                raise SharingError(
                    f"a {storage.device} storage cannot be shared by CUDA IPC "
                    f"(torch reduces it with {rebuild.__name__})"
                )
            handles.append({_gpu_uuid(storage.device): args})
        return encode_payload(handles)

    def open(self, payload: bytes, device: torch.device) -> list[torch.UntypedStorage]:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        try:
            handles = decode_payload(payload)
        except BadIpcPayload as err:
            raise SharingError(f"refusing a CUDA IPC payload: {err}") from err
        gpu = _gpu_uuid(device)
        storages = []
        for handle in handles:
            if gpu not in handle:
                raise SharingError(
                    f"no CUDA IPC handle for this engine's GPU {gpu} (shared from {sorted(handle)}): colocated "
                    "refit needs the trainer rank and the engine worker on the same GPU"
                )
            args = list(handle[gpu])
            args[6] = device.index  # reduce_tensor's device index is the trainer's; ours may differ
            storages.append(rebuild_cuda_tensor(*args).untyped_storage())
        return storages


_LOCAL: dict[str, list[torch.UntypedStorage]] = {}


class LocalTransport:
    """The same process: storages are handed over as objects (kept until ``release``)."""

    name = "local"

    def share(self, storages: list[torch.UntypedStorage]) -> bytes:
        token = uuid.uuid4().hex
        _LOCAL[token] = list(storages)
        return token.encode()

    def open(self, payload: bytes, device: torch.device) -> list[torch.UntypedStorage]:
        try:
            return _LOCAL[payload.decode()]
        except KeyError:
            raise SharingError(
                "the local transport's storages are not in this process: the engine runs in "
                "another process, use CudaIpcTransport"
            ) from None

    @staticmethod
    def release(payload: bytes) -> None:
        _LOCAL.pop(payload.decode(), None)


TRANSPORTS: dict[str, type] = {CudaIpcTransport.name: CudaIpcTransport, LocalTransport.name: LocalTransport}


def _gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise SharingError(f"unknown dtype {name!r} in a shared layout")
    return dtype


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
