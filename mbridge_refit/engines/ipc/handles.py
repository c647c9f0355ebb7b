"""CUDA IPC handles on the wire as JSON, so an engine builds nothing a payload names.

``torch.multiprocessing.reductions.reduce_tensor`` describes a CUDA tensor by the arguments of
``rebuild_cuda_tensor``: the tensor's class, size, stride and offset, the storage's class and
dtype, the device, the IPC handle (bytes), the storage's size and offset in its allocation,
``requires_grad``, the ref counter's handle and offset, the event handle and whether to sync on it.
``encode_payload`` writes them field by field (bytes in base64, classes and the dtype by name);
``decode_payload`` checks every field's type and looks names up in fixed tables, so a payload
only ever becomes arguments of the types ``rebuild_cuda_tensor`` expects, or is refused
(``BadIpcPayload``). The tables hold what ``CudaIpcTransport.share`` hands over: whole storages
as uint8 tensors. Lower layer of ``engines``: imports only torch.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any, Callable

import torch

from mbridge_refit.errors import InputError, wire_version_mismatch

__all__ = [
    "FORMAT",
    "VERSION",
    "WIRE_FORMAT",
    "BadIpcPayload",
    "decode_handle",
    "decode_payload",
    "encode_handle",
    "encode_payload",
]

FORMAT = "mbridge_refit.cuda_ipc"
VERSION = 1  # the payload's fields (``_FIELDS``), refused by name in another version
WIRE_FORMAT = "CUDA IPC payload"  # how a version mismatch names it

_TENSOR_CLASSES: dict[str, type] = {"Tensor": torch.Tensor}
_STORAGE_CLASSES: dict[str, type] = {"TypedStorage": torch.storage.TypedStorage}
_DTYPES: dict[str, torch.dtype] = {"uint8": torch.uint8}


class BadIpcPayload(InputError):
    """A CUDA IPC payload that is not what ``encode_payload`` writes; the message says which part."""


def _by_name(table: dict[str, Any], what: str) -> tuple[Callable[[Any], str], Callable[[Any], Any]]:
    names = {id(value): name for name, value in table.items()}

    def encode(value: Any) -> str:
        if id(value) not in names:
            raise BadIpcPayload(f"{what} {value!r} cannot be shared (known: {sorted(table)})")
        return names[id(value)]

    def decode(wire: Any) -> Any:
        if not isinstance(wire, str) or wire not in table:
            raise BadIpcPayload(f"{what} {wire!r:.80} is not one of {sorted(table)}")
        return table[wire]

    return encode, decode


def _count(wire: Any) -> int:
    if type(wire) is not int or wire < 0:
        raise BadIpcPayload(f"{wire!r:.80} is not a non-negative integer")
    return wire


def _counts(wire: Any) -> tuple[int, ...]:
    if not isinstance(wire, list):
        raise BadIpcPayload(f"{wire!r:.80} is not a list of integers")
    return tuple(_count(value) for value in wire)


def _flag(wire: Any) -> bool:
    if type(wire) is not bool:
        raise BadIpcPayload(f"{wire!r:.80} is not true or false")
    return wire


def _optional(decode: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda wire: None if wire is None else decode(wire)


def _bytes(wire: Any) -> bytes:
    if not isinstance(wire, str):
        raise BadIpcPayload(f"{wire!r:.80} is not base64 text")
    try:
        return base64.b64decode(wire, validate=True)
    except binascii.Error as err:
        raise BadIpcPayload(f"{wire!r:.80} is not base64 ({err})") from None


def _b64(value: bytes | None) -> str | None:
    return None if value is None else base64.b64encode(value).decode()


def _plain(value: Any) -> Any:
    return value


def _as_list(value: Any) -> list[int]:
    return [int(v) for v in value]


# rebuild_cuda_tensor's arguments, in order: (name, encode, decode).
_FIELDS: tuple[tuple[str, Callable[[Any], Any], Callable[[Any], Any]], ...] = (
    ("tensor_cls", *_by_name(_TENSOR_CLASSES, "tensor class")),
    ("size", _as_list, lambda wire: torch.Size(_counts(wire))),
    ("stride", _as_list, _counts),
    ("offset", _plain, _count),
    ("storage_cls", *_by_name(_STORAGE_CLASSES, "storage class")),
    ("dtype", *_by_name(_DTYPES, "dtype")),
    ("device", _plain, _count),
    ("handle", _b64, _optional(_bytes)),
    ("storage_size_bytes", _plain, _count),
    ("storage_offset_bytes", _plain, _count),
    ("requires_grad", _plain, _flag),
    ("ref_counter_handle", _b64, _optional(_bytes)),
    ("ref_counter_offset", _plain, _count),
    ("event_handle", _b64, _optional(_bytes)),
    ("event_sync_required", _plain, _optional(_flag)),
)


def encode_handle(args: tuple) -> dict[str, Any]:
    """JSON fields of ``rebuild_cuda_tensor``'s ``args`` (as ``reduce_tensor`` returns them)."""
    if len(args) != len(_FIELDS):
        raise BadIpcPayload(f"rebuild_cuda_tensor takes {len(_FIELDS)} arguments here, reduce_tensor gave {len(args)}")
    return {name: encode(value) for (name, encode, _), value in zip(_FIELDS, args)}


def decode_handle(wire: Any) -> tuple:
    """``rebuild_cuda_tensor``'s arguments from ``encode_handle``'s fields (all checked)."""
    if not isinstance(wire, dict) or set(wire) != {name for name, _, _ in _FIELDS}:
        keys = sorted(wire) if isinstance(wire, dict) else type(wire).__name__
        raise BadIpcPayload(f"a handle has the fields {[name for name, _, _ in _FIELDS]}, not {keys}")
    args = []
    for name, _, decode in _FIELDS:
        try:
            args.append(decode(wire[name]))
        except BadIpcPayload as err:
            raise BadIpcPayload(f"field {name}: {err}") from None
    return tuple(args)


def encode_payload(handles: list[dict[str, tuple]]) -> bytes:
    """One ``{gpu uuid: rebuild_cuda_tensor args}`` per storage, as JSON bytes."""
    storages = [{gpu: encode_handle(args) for gpu, args in handle.items()} for handle in handles]
    return json.dumps({"format": FORMAT, "version": VERSION, "storages": storages}).encode()


def decode_payload(payload: bytes) -> list[dict[str, tuple]]:
    """``encode_payload``'s handles back; raises ``BadIpcPayload`` for anything else."""
    try:
        wire = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BadIpcPayload(f"not JSON ({err}): not a payload of this version's CudaIpcTransport.share") from None
    if not isinstance(wire, dict) or wire.get("format") != FORMAT:
        head = {k: wire.get(k) for k in ("format", "version")} if isinstance(wire, dict) else type(wire).__name__
        raise BadIpcPayload(f"{head} is not {FORMAT} version {VERSION}: share and open with the same mbridge_refit")
    if wire.get("version") != VERSION:  # before the storages: another version's mean something else
        raise BadIpcPayload(wire_version_mismatch(WIRE_FORMAT, VERSION, wire.get("version"), "the trainer"))
    storages = wire.get("storages")
    if not isinstance(storages, list) or not all(isinstance(handle, dict) for handle in storages):
        raise BadIpcPayload("storages is not a list of {gpu uuid: handle} objects")
    return [{str(gpu): decode_handle(fields) for gpu, fields in handle.items()} for handle in storages]
