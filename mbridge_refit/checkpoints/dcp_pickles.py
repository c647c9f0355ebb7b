"""The pickled parts of a torch_dist checkpoint, read so that nothing in them can run code.

A torch_dist checkpoint (torch.distributed.checkpoint, "DCP") holds two kinds of pickles: the
index ``.metadata`` (every tensor's global shape, dtype and chunks, and where each item lies in
the ``.distcp`` files) and byte items inside the ``.distcp`` files (Megatron's ``_extra_state``
objects and its ``common_state``, written with ``torch.save``). DCP reads the index with plain
``pickle.load`` and byte items with ``torch.load(weights_only=False)``: either runs whatever a
crafted file names. Here:

* ``load_index`` unpickles an index with ``IndexUnpickler``, byte and tensor items are checked with
  ``ByteItemUnpickler``; both are pickle's Python unpickler with the same hardening
  (``_AllowListUnpickler``). ``find_class`` resolves only the exact (module, name) pairs of one table
  (after pickle's own mapping of Python 2 names, so the name looked up is the one a full unpickler
  would import) to objects chosen here, never imports, and refuses a dotted name (which pickle's own
  ``find_class`` resolves attribute by attribute from protocol 4 on, reaching e.g. ``os.system``
  through any allowed module). The extension opcodes, which pickle resolves through copyreg's cache
  without ``find_class``, are refused, and so is DUP (pickle's writer never emits it); REDUCE,
  NEWOBJ, INST and OBJ call only what the unpickler allows; BUILD sets state only where it allows
  (never on a class, an enum member or a dtype, which would change them for the whole process).
  None of the allowed objects runs code when called or given state, so a pickle that loads is data.
* The index's table is ``index_globals`` (the classes DCP's index is made of, torch dtypes, a layout
  lookup, ``PosixPath``); BUILD sets state only on instances of the index's dataclasses. Data can
  still cost: a few hundred bytes of tuples that share their items (memo references) hash and print
  in time exponential in their depth. So a dict or set key must be a string, an int or a
  ``MetadataIndex`` of a string and a ``torch.Size`` (checked as the key goes in, before it is
  hashed), the memory-format enum takes only an int, every message shows a bounded ``reprlib`` form
  of what it names, and the loaded index must have the shape DCP writes (``check_index_shape``:
  each field of the type DCP gives it), so no later check meets anything else.
* A byte item's table is ``byte_item_table``, each entry with why it is there: what torch.save writes
  of Megatron's ``_extra_state`` and common state (plain tensors as storages in persistent ids and
  ``_rebuild_tensor_v2``, dtypes, ``OrderedDict``, ``torch.Size``, sets, bytes, ``PosixPath``,
  Megatron's enums and ``signal.Signals``, ``argparse.Namespace``, ``BytesIO``). Every callable
  resolves to a function here that checks its arguments and returns what the real one returns (an
  enum's existing member by its value, never a new enum; a path of strings; an empty ``OrderedDict``)
  or a stand-in for a tensor (no storage is read); classes are made only fresh, by NEWOBJ with no
  arguments, and only those fresh instances take state, of the shape their entry says. This table,
  not torch's process-wide safe globals, is the gate: importing megatron.core registers its safe
  globals (its enums, numpy's dtypes, ``Namespace``, ...), and torch's weights-only loader then
  BUILDs on any instance of an allowed type, an enum member too, so a crafted item would change
  ``AttnBackend.flash`` for the whole process while it was being "checked", and DCP's own load (a
  full pickle) would do the same. Protocol 2 is what torch.save, DCP and Megatron write (and all
  torch's weights-only loader reads).
* ``check_torch_archive`` looks at an item (byte or tensor) before ``torch.load(weights_only=True)``
  reads it: weights-only loading runs no code, but the archive and its pickle are data that can
  still cost (a compressed member that inflates, a pickle of shared references that hashes in
  exponential time), so an item must be the archive ``torch.save`` writes, as torch's own zip
  reader sees it, members stored, its pickle bounded (``expanded_objects``); only the archive's
  directory and pickle are read, not the tensor's bytes.
* ``check_byte_item`` checks a byte item's archive so, its pickle with ``ByteItemUnpickler``, then loads
  it with ``torch.load(weights_only=True)`` (a second layer, not the gate: it reads the storages, each
  record present and as long as its tensors need). ``check_tensor_item`` checks a tensor item's
  archive and its pickle (one plain tensor): DCP loads it with ``torch.load(weights_only=True)``.
* ``CheckedFileSystemReader`` is DCP's reader with these checks built in: the index through
  ``load_index`` and every place it puts bytes through ``location_problem`` (a regular file inside
  the checkpoint, long enough), every byte item through ``check_byte_item`` before DCP loads the
  same bytes, and every tensor item a load reads through ``check_tensor_item`` before DCP does.
  ``checked_megatron_reads`` makes Megatron-Core's ``dist_checkpointing.load`` read through it,
  so what is loaded is what was checked, however the files change after a first check.
"""

from __future__ import annotations

import _compat_pickle
import argparse
import collections
import contextlib
import enum
import functools
import importlib
import io
import logging
import os
import pathlib
import pickle
import pickletools
import re
import reprlib
import signal
import stat
import struct
import zipfile
from pathlib import Path
from types import MappingProxyType
from typing import Any, BinaryIO, Callable, Iterator, Mapping, NamedTuple

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType

from mbridge_refit.checkpoints.regular_files import open_regular_file
from mbridge_refit.errors import InputError

__all__ = [
    "CheckedFileSystemReader",
    "INDEX_NAME",
    "ByteItemUnpickler",
    "IndexUnpickler",
    "UnsafePickle",
    "byte_item_globals",
    "byte_item_table",
    "byte_items",
    "ByteItemRefused",
    "check_byte_item",
    "check_byte_items",
    "check_index_shape",
    "check_tensor_item",
    "check_torch_archive",
    "checked_megatron_reads",
    "index_globals",
    "load_index",
    "location_problem",
]

logger = logging.getLogger(__name__)

INDEX_NAME = ".metadata"
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_DCP_FILESYSTEM = "torch.distributed.checkpoint.filesystem"


class UnsafePickle(InputError, pickle.UnpicklingError):
    """A pickled part of a checkpoint names something an index or a byte item never holds."""


@functools.cache
def index_globals() -> Mapping[tuple[str, str], Any]:
    """Every global a DCP index names, and the object it resolves to (nothing else resolves).

    Found by reading the index of checkpoints written by ``convert import`` (dense, MoE, PP) and
    DCP's ``metadata`` and ``filesystem`` modules: ``Metadata`` and ``StorageMeta`` (with a
    ``PosixPath`` checkpoint id), ``MetadataIndex`` keys, ``_StorageInfo`` locations, tensor entries
    (``TensorStorageMetadata`` of ``TensorProperties``, whose memory format is the enum
    ``_MEM_FORMAT_ENCODING``, and ``ChunkStorageMetadata`` of ``torch.Size``), ``BytesStorageMetadata``,
    dtypes by name and layouts through ``torch.serialization._get_layout`` (here a lookup of torch's
    layouts by name).
    """
    from torch.distributed.checkpoint import filesystem

    names: dict[tuple[str, str], Any] = {
        (_DCP_METADATA, cls.__name__): cls for cls in _index_dataclasses() if cls.__module__ == _DCP_METADATA
    }
    names.update(
        {
            (_DCP_METADATA, "_MEM_FORMAT_ENCODING"): _memory_format,
            (_DCP_FILESYSTEM, "_StorageInfo"): filesystem._StorageInfo,
            ("torch", "Size"): torch.Size,
            ("torch.serialization", "_get_layout"): _layout_named,
            ("pathlib", "PosixPath"): pathlib.PosixPath,
        }
    )
    names.update({("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)})
    return MappingProxyType(names)


@functools.cache
def _index_dataclasses() -> tuple[type, ...]:
    """The classes whose instances an index holds with state (BUILD may set it on these only)."""
    from torch.distributed.checkpoint import filesystem, metadata

    return (
        metadata.Metadata,
        metadata.StorageMeta,
        metadata.MetadataIndex,
        metadata.TensorStorageMetadata,
        metadata.BytesStorageMetadata,
        metadata.ChunkStorageMetadata,
        metadata.TensorProperties,
        filesystem._StorageInfo,
    )


@functools.cache
def _allowed_ids() -> frozenset[int]:
    """Identities of the objects ``index_globals`` resolves to (kept alive by it)."""
    return frozenset(id(value) for value in index_globals().values())


def _layout_named(name: str) -> torch.layout:
    """``torch.serialization._get_layout`` as an index uses it: torch's layout called ``name``."""
    layout = _layouts().get(name) if isinstance(name, str) else None
    if layout is None:
        raise UnsafePickle(f"{brief(name)} is not a torch layout")
    return layout


def _memory_format(value: int) -> Any:
    """DCP's ``_MEM_FORMAT_ENCODING(value)`` as an index calls it: its member numbered ``value`` (an int:
    the enum's lookup hashes what it is given)."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    if type(value) is not int:
        raise UnsafePickle(f"a memory format is numbered by an int, not by {brief(value)}")
    try:
        return _MEM_FORMAT_ENCODING(value)
    except ValueError:
        raise UnsafePickle(f"{value} numbers no memory format") from None


_BRIEF = reprlib.Repr(maxlevel=2, maxtuple=4, maxlist=4, maxdict=4, maxset=4, maxfrozenset=4, maxstring=60, maxother=60)


def brief(obj: Any) -> str:
    """A bounded description of ``obj`` for a message (its type and a cut ``reprlib`` form: a full repr
    of shared nested tuples takes exponential time)."""
    return f"{type(obj).__name__} {_BRIEF.repr(obj)}"


def _key_problem(key: Any) -> str | None:
    """Why ``key`` cannot be a key of an index's dicts or sets (None: it can)."""
    kind = type(key)
    if kind is str or kind is int:
        return None
    if kind is MetadataIndex:
        state = vars(key)
        offset = state.get("offset")
        if type(state.get("fqn")) is str and (offset is None or type(offset) is torch.Size):
            return None
    return (
        f"{brief(key)} as a key: an index's keys are names, ints and MetadataIndex records of a name and a torch.Size"
    )


@functools.cache
def _layouts() -> Mapping[str, torch.layout]:
    return MappingProxyType({str(value): value for value in vars(torch).values() if isinstance(value, torch.layout)})


class _AllowListUnpickler(pickle._Unpickler):
    """pickle's Python unpickler resolving only the globals of one table and checking every opcode that can
    reach code (module docstring); a subclass says what its pickle may call, make and give state.

    pickle's Python implementation, so each such opcode is checked here: the C unpickler resolves the
    extension opcodes from copyreg's cache and calls whatever REDUCE finds on its stack, out of reach of a
    subclass. Names are mapped as pickle's own ``find_class`` maps them before importing (a protocol 0-2
    pickle's Python 2 names: ``__builtin__.set`` is ``builtins.set``), so the table is looked up under the
    name a full unpickler would import.
    """

    dispatch = dict(pickle._Unpickler.dispatch)
    holder = "a pickle"  # what is unpickled, as messages name it
    unknown = "a global it holds"  # what a name outside the table is not

    def allowed_globals(self) -> Mapping[tuple[str, str], Any]:
        raise NotImplementedError

    def check_call(self, opcode: str, func: Any, args: Any) -> None:
        """Raise ``UnsafePickle`` unless ``opcode`` (REDUCE, NEWOBJ, NEWOBJ_EX, INST/OBJ) may call ``func``."""
        raise UnsafePickle(f"{opcode} on {brief(func)}: {self.holder} calls nothing")

    def check_build(self, target: Any, state: Any) -> None:
        """Raise ``UnsafePickle`` unless BUILD may give ``target`` the state ``state``."""
        raise UnsafePickle(f"BUILD on {brief(target)}: {self.holder} sets no state")

    def key_problem(self, key: Any) -> str | None:
        """Why ``key`` cannot be a key of the pickle's dicts and sets (None: it can)."""
        return None

    def made(self, obj: Any) -> None:
        """``obj`` was just made by NEWOBJ (a fresh instance)."""

    def find_class(self, module: str, name: str) -> Any:
        if "." in name:
            raise UnsafePickle(
                f"{module}.{name}: a dotted name (an attribute of an attribute) is never in {self.holder}"
            )
        if self.proto < 3 and self.fix_imports:
            module, name = _COMPAT_NAMES.get((module, name), (_COMPAT_MODULES.get(module, module), name))
        try:
            return self.allowed_globals()[(module, name)]
        except (KeyError, TypeError):
            raise UnsafePickle(f"{module}.{name} is not {self.unknown}") from None

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickle(f"{self.holder} holds no persistent ids")

    def _require_keys(self, keys: Any, opcode: str) -> None:
        for key in keys:
            problem = self.key_problem(key)
            if problem is not None:
                raise UnsafePickle(f"{opcode} with {problem}")

    def _load_reduce(self) -> None:
        self.check_call("REDUCE", self.stack[-2], self.stack[-1])
        pickle._Unpickler.load_reduce(self)

    def _load_newobj(self) -> None:
        self.check_call("NEWOBJ", self.stack[-2], self.stack[-1])
        pickle._Unpickler.load_newobj(self)
        self.made(self.stack[-1])

    def _load_newobj_ex(self) -> None:
        self.check_call("NEWOBJ_EX", self.stack[-3], self.stack[-2])
        pickle._Unpickler.load_newobj_ex(self)
        self.made(self.stack[-1])

    def _instantiate(self, klass: Any, args: Any) -> None:  # INST and OBJ
        self.check_call("INST/OBJ", klass, args)
        pickle._Unpickler._instantiate(self, klass, args)

    def _load_build(self) -> None:
        self.check_build(self.stack[-2], self.stack[-1])
        pickle._Unpickler.load_build(self)

    # APPEND(S) and ADDITEMS call the target's own ``append``/``extend``/``add`` where it is not a list or a set,
    # which an instance given state could hold as an attribute: only a list or a set takes items.
    def _require_target(self, target: Any, kind: type, opcode: str) -> None:
        if type(target) is not kind:
            raise UnsafePickle(f"{opcode} on {brief(target)}: only a {kind.__name__} takes its items in {self.holder}")

    def _load_append(self) -> None:
        self._require_target(self.stack[-2], list, "APPEND")
        pickle._Unpickler.load_append(self)

    def _load_appends(self) -> None:
        self._require_target(self.metastack[-1][-1] if self.metastack and self.metastack[-1] else None, list, "APPENDS")
        pickle._Unpickler.load_appends(self)

    def _load_setitem(self) -> None:
        self._require_keys(self.stack[-2:-1], "SETITEM")
        pickle._Unpickler.load_setitem(self)

    # pickle's Python unpickler keeps the items since the last MARK in ``stack`` (the stacks below it in
    # ``metastack``): the keys of SETITEMS and DICT are every other one from the first, ADDITEMS' and
    # FROZENSET's all of them.
    def _load_setitems(self) -> None:
        self._require_keys(self.stack[::2], "SETITEMS")
        pickle._Unpickler.load_setitems(self)

    def _load_dict(self) -> None:
        self._require_keys(self.stack[::2], "DICT")
        pickle._Unpickler.load_dict(self)

    def _load_additems(self) -> None:
        self._require_target(self.metastack[-1][-1] if self.metastack and self.metastack[-1] else None, set, "ADDITEMS")
        self._require_keys(self.stack, "ADDITEMS")
        pickle._Unpickler.load_additems(self)

    def _load_frozenset(self) -> None:
        self._require_keys(self.stack, "FROZENSET")
        pickle._Unpickler.load_frozenset(self)

    def _load_dup(self) -> None:
        raise UnsafePickle(f"DUP is never in {self.holder} (pickle's writer does not use it)")

    def _load_ext(self) -> None:
        raise UnsafePickle(f"an extension code (EXT1/EXT2/EXT4) is never in {self.holder}")

    dispatch[pickle.REDUCE[0]] = _load_reduce
    dispatch[pickle.NEWOBJ[0]] = _load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = _load_newobj_ex
    dispatch[pickle.BUILD[0]] = _load_build
    dispatch[pickle.APPEND[0]] = _load_append
    dispatch[pickle.APPENDS[0]] = _load_appends
    dispatch[pickle.SETITEM[0]] = _load_setitem
    dispatch[pickle.SETITEMS[0]] = _load_setitems
    dispatch[pickle.DICT[0]] = _load_dict
    dispatch[pickle.ADDITEMS[0]] = _load_additems
    dispatch[pickle.FROZENSET[0]] = _load_frozenset
    dispatch[pickle.DUP[0]] = _load_dup
    for _ext in (pickle.EXT1, pickle.EXT2, pickle.EXT4):
        dispatch[_ext[0]] = _load_ext
    del _ext


_COMPAT_NAMES = _compat_pickle.NAME_MAPPING
_COMPAT_MODULES = _compat_pickle.IMPORT_MAPPING


class IndexUnpickler(_AllowListUnpickler):
    """Builds a DCP index and nothing else (module docstring): the globals of ``index_globals``, calls of those
    only, state set only on the index's own records, keys as ``_key_problem`` allows."""

    holder = "an index"
    unknown = "a type a checkpoint index holds"

    def allowed_globals(self) -> Mapping[tuple[str, str], Any]:
        return index_globals()

    def check_call(self, opcode: str, func: Any, args: Any) -> None:
        if id(func) not in _allowed_ids():
            raise UnsafePickle(f"{opcode} on {brief(func)}: an index calls only the types it holds")

    def check_build(self, target: Any, state: Any) -> None:
        if type(target) not in _index_dataclasses():
            raise UnsafePickle(f"BUILD on {brief(target)}: an index sets state only on its own records")

    def key_problem(self, key: Any) -> str | None:
        return _key_problem(key)


def load_index(data: bytes) -> Metadata:
    """The DCP index pickled in ``data``; raises (``UnsafePickle`` and others) for anything else."""
    index = IndexUnpickler(io.BytesIO(data)).load()
    if type(index) is not Metadata:
        raise UnsafePickle(f"the pickle holds a {type(index).__name__}, not a {Metadata.__name__}")
    check_index_shape(index)
    return index


def check_index_shape(index: Metadata) -> None:
    """Raise ``UnsafePickle`` unless every field of ``index`` has the type DCP writes: tensor entries of a
    ``torch.Size`` and chunks of ``torch.Size`` offsets and sizes, byte entries, locations of a file name
    and two non-negative ints, no transforms, planner paths of names and positions. BUILD
    sets a record's state field by field, so a record that loads may hold anything until this passes."""
    _StorageInfo = index_globals()[(_DCP_FILESYSTEM, "_StorageInfo")]
    for fqn, entry in _field(index, "state_dict_metadata", dict, where="the index").items():
        where = f"entry {brief(fqn)}"
        if type(entry) is BytesStorageMetadata:
            continue
        _require(type(entry) is TensorStorageMetadata, f"{where}: a {type(entry).__name__}")
        _field(_field(entry, "properties", TensorProperties, where=where), "dtype", torch.dtype, where=where)
        _field(entry, "size", torch.Size, where=where)
        for chunk in _field(entry, "chunks", list, where=where):
            _require(type(chunk) is ChunkStorageMetadata, f"{where}: a chunk that is a {type(chunk).__name__}")
            _field(chunk, "offsets", torch.Size, where=where)
            _field(chunk, "sizes", torch.Size, where=where)
    for key, location in (_field(index, "storage_data", dict, type(None), where="the index") or {}).items():
        where = f"the location of {brief(key)}"
        _require(type(key) is MetadataIndex and type(location) is _StorageInfo, where)
        _field(location, "relative_path", str, where=where)
        _require(_field(location, "offset", int, where=where) >= 0, f"{where}: its offset")
        _require(_field(location, "length", int, where=where) >= 0, f"{where}: its length")
        _field(location, "transform_descriptors", type(None), where=where)
    for fqn, path in (_field(index, "planner_data", dict, type(None), where="the index") or {}).items():
        # DCP's default planner: each flattened name's path in the state dict, names and list positions
        _require(
            type(path) is tuple and all(type(step) in (str, int) for step in path), f"the planner path of {brief(fqn)}"
        )
    _field(index, "storage_meta", StorageMeta, type(None), where="the index")
    _field(index, "version", str, type(None), where="the index")


def _field(record: Any, name: str, *kinds: type, where: str) -> Any:
    """``record.name``, which must be of exactly one of ``kinds``."""
    value = getattr(record, name, None)
    _require(type(value) in kinds, f"{where}: its {name} ({type(value).__name__})")
    return value


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise UnsafePickle(f"{what} is not what a DCP index holds there")


# --- byte items: what torch.save writes of Megatron's objects, and nothing else ----------------------------


class _StorageKind(NamedTuple):
    """What a storage type (``torch.FloatStorage``, ...) names in a byte item: its dtype."""

    dtype: torch.dtype


class _Storage(NamedTuple):
    """A storage a persistent id names (its bytes are not read here: torch's load reads them)."""

    dtype: torch.dtype
    numel: int


class _Tensor(NamedTuple):
    """A tensor ``_rebuild_tensor_v2`` would build of a ``_Storage`` (shape and strides checked, nothing read)."""

    storage: _Storage
    size: tuple[int, ...]


# Where torch.save says a storage lay (what torch.load restores it to): a CPU or a CUDA device.
_LOCATION = re.compile(r"cpu|cuda(:[0-9]{1,4})?")


def _storage_named(pid: Any) -> _Storage:
    """The storage of a persistent id as torch.save writes it: ``('storage', storage type, key, location, numel)``."""
    if (
        type(pid) is tuple
        and len(pid) == 5
        and pid[0] == "storage"
        and type(pid[1]) is _StorageKind
        and type(pid[2]) is str
        and type(pid[3]) is str
        and _LOCATION.fullmatch(pid[3])
        and _is_count(pid[4])
    ):
        return _Storage(pid[1].dtype, pid[4])
    raise UnsafePickle(
        f"the persistent id {brief(pid)} is not a storage as torch.save names it ('storage', a storage type, "
        "key, 'cpu' or 'cuda:N', element count)"
    )


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _rebuild_tensor(*args: Any) -> _Tensor:
    """``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad, backward_hooks)`` as
    torch.save writes a plain tensor: checked, not built (no metadata, no hooks, no subclass)."""
    if len(args) == 6:
        storage, offset, size, stride, requires_grad, hooks = args
        if (
            type(storage) is _Storage
            and _is_count(offset)
            and _is_shape(size)
            and _is_shape(stride)
            and len(size) == len(stride)
            and type(requires_grad) is bool
            and type(hooks) is collections.OrderedDict
            and not hooks
        ):
            return _Tensor(storage, size)
    raise UnsafePickle(
        f"torch._utils._rebuild_tensor_v2 with {brief(args)}: a byte item's tensors are plain ones as torch.save "
        "writes them (a storage, offset, size, stride, requires_grad, no backward hooks, no metadata)"
    )


def _is_shape(value: Any) -> bool:
    return type(value) is tuple and all(_is_count(item) for item in value)


def _torch_size(*args: Any) -> torch.Size:
    if len(args) == 1 and _is_shape(args[0]):
        return torch.Size(args[0])
    raise UnsafePickle(f"torch.Size of {brief(args)}: a size is made of one tuple of non-negative ints")


def _ordered_dict(*args: Any) -> collections.OrderedDict:
    if args:
        raise UnsafePickle(f"collections.OrderedDict of {brief(args)}: torch.save makes one empty, then fills it")
    return collections.OrderedDict()


def _set_of(kind: type) -> Callable[..., Any]:
    def made(*args: Any) -> Any:
        if len(args) == 1 and type(args[0]) is list and all(_byte_key_problem(item) is None for item in args[0]):
            return kind(args[0])
        raise UnsafePickle(f"builtins.{kind.__name__} of {brief(args)}: a set is made of one list of plain keys")

    return made


def _latin1_bytes(*args: Any) -> bytes:
    """``_codecs.encode(text, 'latin1')``, which is how protocol 2 writes ``bytes`` (other codecs import modules)."""
    if len(args) == 2 and type(args[0]) is str and args[1] == "latin1":
        return args[0].encode("latin1")
    raise UnsafePickle(f"_codecs.encode of {brief(args)}: protocol 2 writes bytes as encode(text, 'latin1') only")


def _posix_path(*args: Any) -> pathlib.PosixPath:
    if all(type(part) is str for part in args):
        return pathlib.PosixPath(*args)
    raise UnsafePickle(f"pathlib.PosixPath of {brief(args)}: a path is made of strings")


def _member_of(kind: type[enum.Enum]) -> Callable[..., enum.Enum]:
    """``kind(value)`` as pickle calls an enum: its existing member of that value, looked up (never made, never
    given state: BUILD on a member would change it for the whole process)."""

    def member(*args: Any) -> enum.Enum:
        value = args[0] if len(args) == 1 else None
        found = kind._value2member_map_.get(value) if type(value) in (int, str) else None
        if found is None or type(found.value) is not type(value):
            raise UnsafePickle(f"{kind.__module__}.{kind.__qualname__} of {brief(args)} names none of its members")
        return found

    return member


def _megatron_enums() -> tuple[tuple[type[enum.Enum], str], ...]:
    """Megatron's enums a byte item may hold, and why (each taken by value only)."""
    from megatron.core.enums import ModelType
    from megatron.core.rerun_state_machine import RerunDiagnostic, RerunMode, RerunState
    from megatron.core.transformer.enums import AttnBackend, CudaGraphModule, CudaGraphScope, InferenceCudaGraphScope

    config = "Megatron-LM's args (its generate_state_dict stores them in the common state) hold it"
    rerun = "the common state's rerun_state_machine entry (RerunStateMachine.state_dict) holds it"
    return (
        (AttnBackend, config),
        (CudaGraphModule, config),
        (CudaGraphScope, config),
        (InferenceCudaGraphScope, config),
        (ModelType, config),
        (RerunMode, rerun),
        (RerunState, rerun),
        (RerunDiagnostic, rerun),
        (signal.Signals, "Megatron-LM's args hold its --exit-signal as a signal.Signals"),
    )


# Classes a byte item makes fresh instances of (NEWOBJ with no arguments) and gives state once (BUILD): the
# state each may take, and why it is here. Nothing else is ever given state.
def _namespace_state(state: Any) -> bool:
    # attributes by name, none of pickle's or Python's own (a ``__setstate__`` attribute would be called by a
    # later BUILD in a full unpickler)
    return type(state) is dict and all(type(key) is str and not key.startswith("__") for key in state)


def _bytes_io_state(state: Any) -> bool:
    return (
        type(state) is tuple
        and len(state) == 3
        and type(state[0]) is bytes
        and _is_count(state[1])
        and state[1] <= len(state[0])
        and state[2] is None
    )


_RECORDS: Mapping[type, tuple[Callable[[Any], bool], str]] = MappingProxyType(
    {
        argparse.Namespace: (_namespace_state, "Megatron-LM's args in the common state: attributes by name"),
        io.BytesIO: (_bytes_io_state, "_extra_state of TE before 2.0 (Megatron-Core's _encode_extra_state)"),
    }
)


@functools.cache
def byte_item_table() -> tuple[tuple[str, str, Any, str], ...]:
    """Every global a byte item may name: (module, name, what it resolves to here, why it is there).

    Found by reading what torch.save writes (``pickletools.dis``) of what Megatron-Core and Megatron-Bridge store
    as byte items: TE's ``_extra_state`` (a uint8 tensor, an empty one without FP8; a BytesIO before TE 2.0)
    and the common state (``checkpoint_version``, ``iteration``, the optimizer's param groups, the scheduler's
    state, the grad scaler's tensors, the rerun machine's mode and state; with Megatron-LM its ``args``). A
    callable resolves to a function here that checks its arguments and returns what the real one would
    (an enum's existing member, a path, a size) or a stand-in of a tensor; a class resolves to itself only
    where a byte item makes instances of it (``_RECORDS``); dtypes and storage types are values.
    """
    rows: list[tuple[str, str, Any, str]] = [
        ("torch._utils", "_rebuild_tensor_v2", _rebuild_tensor, "every tensor torch.save writes"),
        ("collections", "OrderedDict", _ordered_dict, "a tensor's (empty) backward hooks; state dicts"),
        ("torch", "Size", _torch_size, "a torch.Size in a saved object"),
        ("builtins", "set", _set_of(set), "protocol 2 writes a set as set(list)"),
        ("_codecs", "encode", _latin1_bytes, "protocol 2 writes bytes as _codecs.encode(text, 'latin1')"),
        ("pathlib", "PosixPath", _posix_path, "paths in saved arguments (Megatron-Core registers it as safe)"),
    ]
    rows += [(kind.__module__, kind.__qualname__, kind, why) for kind, (_, why) in _RECORDS.items()]
    rows += [(kind.__module__, kind.__qualname__, _member_of(kind), why) for kind, why in _megatron_enums()]
    rows += [
        ("torch", name, value, "a dtype in saved arguments (Megatron-LM's params_dtype)")
        for name, value in vars(torch).items()
        if isinstance(value, torch.dtype)
    ]
    rows += [
        ("torch", name, _StorageKind(dtype), "the storage type of a tensor's persistent id")
        for name, dtype in torch.storage._storage_type_to_dtype_map().items()
    ]
    return tuple(rows)


@functools.cache
def byte_item_globals() -> Mapping[tuple[str, str], Any]:
    """``byte_item_table`` as a lookup: (module, name) -> what it resolves to."""
    return MappingProxyType({(module, name): value for module, name, value, _ in byte_item_table()})


@functools.cache
def _byte_item_calls() -> frozenset[int]:
    """Identities of the functions REDUCE may call in a byte item (the table's checking functions)."""
    return frozenset(id(value) for value in byte_item_globals().values() if type(value) is _FUNCTION)


_FUNCTION = type(_posix_path)


@functools.cache
def _byte_item_enums() -> frozenset[type]:
    return frozenset(kind for kind, _ in _megatron_enums())


_PLAIN_KEYS = (str, int, float, bool, bytes, type(None), torch.dtype)


def _byte_key_problem(key: Any) -> str | None:
    """Why ``key`` cannot be a key of a byte item's dicts and sets (None: it can): plain values, Megatron's
    enum members, dtypes, and flat tuples of those."""
    kind = type(key)
    items = key if kind is tuple else (key,)
    if all(type(item) in _PLAIN_KEYS or type(item) in _byte_item_enums() for item in items):
        return None
    return f"{brief(key)} as a key: a byte item's keys are plain values, enum members, dtypes and tuples of those"


class ByteItemUnpickler(_AllowListUnpickler):
    """Checks a byte item's pickle (its ``data.pkl``) against ``byte_item_table``, whatever torch's process-wide
    safe globals hold (module docstring): REDUCE calls only the table's checking functions, NEWOBJ makes only
    fresh ``_RECORDS`` with no arguments, BUILD gives state only to those fresh instances (of the shape
    ``_RECORDS`` says), INST/OBJ and NEWOBJ_EX are refused (protocol 2 writes neither). ``load`` returns what
    was checked, tensors as ``_Tensor`` stand-ins."""

    holder = "a byte item"
    unknown = "a global a checkpoint's byte item holds (dcp_pickles.byte_item_table)"

    def __init__(self, file: BinaryIO) -> None:
        super().__init__(file)
        self._fresh: dict[int, Any] = {}  # id -> instance made here (kept alive, so no id is reused)
        self._built: set[int] = set()  # ids of those already given state

    def allowed_globals(self) -> Mapping[tuple[str, str], Any]:
        return byte_item_globals()

    def persistent_load(self, pid: Any) -> Any:
        return _storage_named(pid)

    def check_call(self, opcode: str, func: Any, args: Any) -> None:
        if opcode == "REDUCE" and id(func) in _byte_item_calls():
            return
        if opcode == "NEWOBJ" and type(func) is type and func in _RECORDS and type(args) is tuple and not args:
            return
        raise UnsafePickle(
            f"{opcode} on {brief(func)}: a byte item calls only the checks of its table and makes only fresh "
            f"{', '.join(kind.__qualname__ for kind in _RECORDS)}"
        )

    def made(self, obj: Any) -> None:
        self._fresh[id(obj)] = obj

    def check_build(self, target: Any, state: Any) -> None:
        if id(target) not in self._fresh or self._fresh[id(target)] is not target or id(target) in self._built:
            raise UnsafePickle(
                f"BUILD on {brief(target)}: a byte item sets state only once, on an instance it just made (state on "
                "anything else, an enum member or a dtype, would change it for the whole process)"
            )
        self._built.add(id(target))
        if not _RECORDS[type(target)][0](state):
            raise UnsafePickle(f"BUILD of a {type(target).__qualname__} with {brief(state)}: not the state it takes")

    def key_problem(self, key: Any) -> str | None:
        return _byte_key_problem(key)


def check_byte_item(data: bytes) -> None:
    """Raise unless ``data`` is an archive torch.save wrote of plain data (``UnsafePickle`` naming what is not).

    ``check_torch_archive`` first (the archive torch.save writes, seen as torch's own reader sees it, members
    stored, its pickle bounded: torch's loader hashes a dict key and compares values as trees, so 1 kB of
    tuples sharing their items would take exponential time inside it, where no check of ours can reach); then
    its pickle through ``ByteItemUnpickler`` (the gate: only ``byte_item_table``'s globals, whatever
    torch's safe globals hold); then ``torch.load(weights_only=True)``, which reads the tensors' storages
    (their records exist and are as long as their tensors need) with torch's own checks."""
    buffer = io.BytesIO(data)
    _load_checked(check_torch_archive(buffer))
    buffer.seek(0)
    torch.load(buffer, weights_only=True)


def check_tensor_item(item: BinaryIO) -> None:
    """Raise ``UnsafePickle`` unless ``item`` is an archive torch.save wrote of one plain tensor (``check_torch_archive``,
    then its pickle through ``ByteItemUnpickler``): DCP reads a tensor item with ``torch.load(weights_only=True)``,
    which takes whatever torch's process-wide safe globals hold."""
    loaded = _load_checked(check_torch_archive(item))
    if type(loaded) is not _Tensor:
        raise UnsafePickle(f"it holds a {type(loaded).__name__}, not the one tensor DCP writes in a tensor item")


def _load_checked(pickled: bytes) -> Any:
    """``pickled`` through ``ByteItemUnpickler``; a pickle it cannot follow is an ``UnsafePickle`` too."""
    try:
        return ByteItemUnpickler(io.BytesIO(pickled)).load()
    except UnsafePickle:
        raise
    except Exception as err:  # a truncated or malformed stream: never what torch.save wrote
        raise UnsafePickle(f"its pickle cannot be read ({type(err).__name__}: {brief(str(err))})") from err


MAX_ARCHIVE_RECORDS = 1024  # a tensor item holds 7, an object a few per tensor in it
_LOCAL_HEADER = zipfile.stringFileHeader  # b"PK\x03\x04", what a zip's first record starts with


def check_torch_archive(item: BinaryIO) -> bytes:
    """Raise ``UnsafePickle`` unless ``item`` is a zip archive as ``torch.save`` writes it, checked as torch's
    own reader (``PyTorchFileReader``, miniz) will read it, not only as Python's ``zipfile`` does: the two
    parse differently (a prefix before the archive, letter case in names, zip64 locators, offsets taken as
    relative), so an archive one of them sees as harmless could be another to the other. So: it starts with a
    local header (else torch reads it as a legacy pickle stream); at most ``MAX_ARCHIVE_RECORDS`` records, no
    two names equal but for letter case; every record stored; both readers find the same records at the same
    data offsets; and the pickle torch will unpickle (its ``data.pkl``, read through torch's reader)
    stands for at most ``MAX_EXPANDED_OBJECTS`` objects (``expanded_objects``). Returns that pickle."""
    try:
        item.seek(0)
        if item.read(len(_LOCAL_HEADER)) != _LOCAL_HEADER:
            raise UnsafePickle("it is not the zip archive torch.save writes (torch would read it as a legacy pickle)")
        item.seek(0)
        with zipfile.ZipFile(item) as archive:
            members = archive.infolist()
            _check_members(members)
            ours = {info.filename: _data_offset(item, info) for info in members}
        item.seek(0)
        reader = torch._C.PyTorchFileReader(item)
        records = reader.get_all_records()
        prefix = members[0].filename.split("/")[0] + "/" if "/" in members[0].filename else ""
        torch_view = {prefix + name: reader.get_record_offset(name) for name in records}
        if torch_view != ours:
            raise UnsafePickle("torch's own zip reader sees other records, or the same at other places, than zipfile")
        if "data.pkl" not in records:
            raise UnsafePickle("it holds no data.pkl")
        pickled = bytes(reader.get_record("data.pkl"))  # stored and bounded by the item: checked above
    except (zipfile.BadZipFile, EOFError, OSError, RuntimeError) as err:  # damaged: torch would refuse it too
        raise UnsafePickle(f"its archive cannot be read ({type(err).__name__}: {brief(str(err))})") from err
    if expanded_objects(pickled) > MAX_EXPANDED_OBJECTS:
        raise UnsafePickle(
            f"its pickle stands for more than {MAX_EXPANDED_OBJECTS} objects once shared references are "
            "followed (a checkpoint's object holds a few hundred)"
        )
    return pickled


def _check_members(members: list[zipfile.ZipInfo]) -> None:
    if not members or len(members) > MAX_ARCHIVE_RECORDS:
        raise UnsafePickle(f"it holds {len(members)} records (torch.save writes 1 to a few hundred)")
    lowered = [info.filename.lower() for info in members]
    if len(set(lowered)) != len(lowered):
        raise UnsafePickle("two of its records have the same name (letter case aside)")
    packed = [info.filename for info in members if info.compress_type != zipfile.ZIP_STORED]
    if packed:
        raise UnsafePickle(f"its member {brief(packed[0])} is compressed, which torch.save never does")


def _data_offset(item: BinaryIO, info: zipfile.ZipInfo) -> int:
    """Where ``info``'s bytes start in ``item``, from its local header (as torch's reader computes it)."""
    item.seek(info.header_offset)
    header = item.read(zipfile.sizeFileHeader)
    fields = struct.unpack(zipfile.structFileHeader, header) if len(header) == zipfile.sizeFileHeader else None
    if fields is None or fields[0] != _LOCAL_HEADER:
        raise UnsafePickle(f"the record {brief(info.filename)} has no local header where the directory says")
    name_length, extra_length = fields[-2:]  # the header's last two fields, as zipfile's own layout names them
    return info.header_offset + zipfile.sizeFileHeader + name_length + extra_length


MAX_EXPANDED_OBJECTS = 1_000_000
_MUTATORS = {"APPEND": 1, "SETITEM": 2, "BUILD": 1, "APPENDS": None, "SETITEMS": None, "ADDITEMS": None}
_MEMO_PUTS = ("PUT", "BINPUT", "LONG_BINPUT")
_MEMO_GETS = ("GET", "BINGET", "LONG_BINGET")


def expanded_objects(pickled: bytes) -> int:
    """How many objects the pickle builds when every shared reference (memo GET, DUP) counts again, as a
    walk of the result as a tree (hashing, comparing, printing) meets them; capped just past
    ``MAX_EXPANDED_OBJECTS``. Follows the opcodes only (nothing is built); a pickle it cannot follow
    counts 0 and is left to the loader's own errors."""
    cap = MAX_EXPANDED_OBJECTS + 1
    stack: list[list[int]] = []  # one [count] per object; the same list where an object is referenced again
    marks: list[int] = []
    memo: dict[int, list[int]] = {}
    largest = 0
    try:
        for op, arg, _ in pickletools.genops(pickled):
            name = op.name
            if name == "MARK":
                marks.append(len(stack))
            elif name in _MEMO_PUTS or name == "MEMOIZE":
                memo[arg if name in _MEMO_PUTS else len(memo)] = stack[-1]
            elif name in _MEMO_GETS or name == "DUP":
                stack.append(memo[arg] if name in _MEMO_GETS else stack[-1])
            elif name in _MUTATORS:
                count = _MUTATORS[name]
                items = stack[-count:] if count else stack[marks[-1] :]
                del stack[len(stack) - len(items) :]
                if count is None:
                    marks.pop()
                target = stack[-1]
                target[0] = min(cap, target[0] + sum(item[0] for item in items))
                largest = max(largest, target[0])
            else:  # pops what the opcode takes (down to a mark if it takes one), pushes what it makes of them
                taken = stack[marks.pop() :] if pickletools.markobject in op.stack_before else []
                del stack[len(stack) - len(taken) :]
                plain = [
                    kind for kind in op.stack_before if kind not in (pickletools.markobject, pickletools.stackslice)
                ]
                if plain:
                    taken += stack[-len(plain) :]
                    del stack[-len(plain) :]
                made = min(cap, 1 + sum(item[0] for item in taken))
                stack += [[made] for _ in op.stack_after]
                largest = max(largest, made)
            if largest >= cap:
                return cap
    except (IndexError, KeyError, ValueError):  # not a pickle this follows: the loader says what is wrong
        return 0
    return largest


def location_problem(directory: Path, location: Any, sizes: dict[str, int | None] | None = None) -> str | None:
    """Why the bytes an index places at ``location`` (a ``_StorageInfo``) cannot be read from ``directory``
    (None: they can): its file must be named inside the directory (no absolute path, no ``..``), be a
    regular file there once links are resolved (a FIFO blocks, ``/dev/zero`` never ends, a link may lead
    anywhere), and hold ``offset + length`` bytes. ``sizes`` caches each file's size (None: unusable)."""
    name = location.relative_path
    if type(name) is not str or name.startswith("/") or any(part in ("", ".", "..") for part in name.split("/")):
        return f"the index places bytes in {brief(name)}, which is not a file name inside {directory}"
    sizes = {} if sizes is None else sizes
    if name not in sizes:
        sizes[name] = _regular_size(Path(directory), name)
    size = sizes[name]
    if size is None:
        return f"{directory}: the index names {name!r}, which is not a regular file of the checkpoint"
    end = location.offset + location.length
    if end > size:
        return f"{Path(directory) / name} has {size} bytes, but the index places bytes at {location.offset}..{end}: the file is truncated"
    return None


def _regular_size(directory: Path, name: str) -> int | None:
    try:
        home = directory.resolve()
        target = (directory / name).resolve(strict=True)
        status = os.stat(target)
    except (OSError, RuntimeError):
        return None
    return status.st_size if target.is_relative_to(home) and stat.S_ISREG(status.st_mode) else None


def byte_items(index: Metadata) -> Iterator[tuple[str, Any]]:
    """(fqn, storage location) of every byte item ``index`` lists."""
    for key, location in (index.storage_data or {}).items():
        if isinstance(index.state_dict_metadata.get(key.fqn), BytesStorageMetadata):
            yield key.fqn, location


class ByteItemRefused(UnsafePickle):
    """A byte item ``check_byte_items`` refuses: ``fqn`` names it, ``path`` is the file it lies in (the
    index, where the index places it where it cannot be read: ``placed``), ``reason`` says why."""

    def __init__(self, fqn: str, path: Path, reason: str, *, placed: bool) -> None:
        super().__init__(f"{path}: its object {fqn}: {reason}")
        self.fqn, self.path, self.reason, self.placed = fqn, path, reason, placed


def check_byte_items(weights: Path, index: Metadata, keep: Callable[[str], bool] = lambda fqn: True) -> None:
    """Check every byte item of ``index`` whose fqn ``keep`` accepts, in the checkpoint directory ``weights``:
    its place first (``location_problem``, before the file is opened: a FIFO would block, /dev/zero never
    end), then its bytes (``check_byte_item``). Raises ``ByteItemRefused`` for the first one refused."""
    sizes: dict[str, int | None] = {}
    for fqn, location in byte_items(index):
        if not keep(fqn):
            continue
        problem = location_problem(weights, location, sizes)
        if problem is not None:
            raise ByteItemRefused(fqn, weights / INDEX_NAME, problem, placed=True)
        try:
            with open(weights / location.relative_path, "rb") as handle:
                handle.seek(location.offset)
                check_byte_item(handle.read(location.length))
        except Exception as err:
            reason = f"{type(err).__name__}: {err}"
            raise ByteItemRefused(fqn, weights / location.relative_path, reason, placed=False) from err


class CheckedFileSystemReader(FileSystemReader):
    """DCP's file system reader, reading the index with ``load_index``, checking every byte item with
    ``check_byte_item`` before DCP's planner loads those same bytes, and every tensor item a load reads
    with ``check_torch_archive`` before DCP's ``torch.load`` does (module docstring).

    ``read_metadata`` takes no ``rank``: DCP then never falls back to a per-rank index, which
    ``convert import`` never writes. DCP's load swallows an exception of ``read_metadata`` (and
    then fails with "metadata is None"), so a refusal is logged too.
    """

    def __init__(self, path: Any, *args: Any, progress: Any = None, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        self.fs = _RegularFilesOnly()  # DCP opens each .distcp again after our checks: never a FIFO or device
        self.progress = progress  # a ``runtime.progress`` bar: grown by each plan's items, one step per item read

    def read_metadata(self) -> Metadata:
        path = Path(self.path) / INDEX_NAME
        try:
            with open_regular_file(path) as stream:
                index = load_index(stream.read())
            sizes: dict[str, int | None] = {}
            problems = (location_problem(Path(self.path), at, sizes) for at in (index.storage_data or {}).values())
            problem = next((p for p in problems if p is not None), None)
            if problem is not None:
                raise UnsafePickle(problem)
        except Exception as err:
            logger.error("refusing %s: %s: %s", path, type(err).__name__, err)
            raise
        if index.storage_meta is None:
            index.storage_meta = StorageMeta()
        index.storage_meta.load_id = self.load_id
        return index

    def read_data(self, plan: Any, planner: Any) -> Any:
        self._check_tensor_items(plan)
        if self.progress is not None:
            self.progress.grow(len(plan.items))
        return super().read_data(plan, _CheckedBytesPlanner(planner, self.progress))

    def _check_tensor_items(self, plan: Any) -> None:
        """``check_tensor_item`` on every tensor item ``plan`` reads (each once, file by file)."""
        items: dict[str, dict[Any, str]] = {}  # file -> {storage index: fqn}
        for read_item in plan.items:
            if read_item.type != LoadItemType.BYTE_IO:
                location = self.storage_data[read_item.storage_index]
                items.setdefault(location.relative_path, {})[read_item.storage_index] = read_item.dest_index.fqn
        for name, tensors in items.items():
            with open_regular_file(Path(self.path) / name) as stream:
                for index, fqn in tensors.items():
                    location = self.storage_data[index]
                    try:
                        check_tensor_item(_FileSlice(stream, location.offset, location.length))
                    except UnsafePickle as err:
                        raise UnsafePickle(f"tensor item {fqn} in {Path(self.path) / name}: {err}") from err


class _RegularFilesOnly(FileSystem):
    """DCP's file system, reading only regular files (``regular_files.open_regular_file``) and writing nothing."""

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[BinaryIO]:
        if mode != "rb":
            raise ValueError(f"the checked reader only reads (asked to open {path} with {mode!r})")
        with open_regular_file(path) as stream:
            yield stream


class _FileSlice(io.RawIOBase):
    """``length`` bytes of ``stream`` from ``offset``, as a seekable file of their own (reads stop at its end,
    seeks stay inside it). Not DCP's own view (``FileSystemReader._slice_file``): its ``SEEK_END`` adds a
    negative offset's magnitude instead of subtracting it, so ``zipfile``, which looks for the archive's end
    record with ``seek(-22, SEEK_END)``, would read past the item (torch's reader seeks from the end by 0 only)."""

    def __init__(self, stream: BinaryIO, offset: int, length: int) -> None:
        super().__init__()
        self._stream, self._offset, self._length, self._at = stream, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self._length}[whence]
        self._at = min(max(base + position, 0), self._length)
        return self._at

    def readinto(self, buffer: Any) -> int:
        count = min(len(buffer), self._length - self._at)
        if count <= 0:
            return 0
        self._stream.seek(self._offset + self._at)
        data = self._stream.read(count)
        buffer[: len(data)] = data
        self._at += len(data)
        return len(data)


class _CheckedBytesPlanner:
    """``planner`` with ``load_bytes`` checking the bytes first (they are in memory: DCP reads a
    byte item whole into a BytesIO before handing it over)."""

    def __init__(self, planner: Any, progress: Any = None) -> None:
        self._planner = planner
        self._progress = progress

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def commit_tensor(self, read_item: Any, tensor: Any) -> None:
        self._planner.commit_tensor(read_item, tensor)
        if self._progress is not None:
            self._progress.update(1)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            check_byte_item(value.getvalue())
        except Exception as err:
            fqn = read_item.dest_index.fqn
            raise UnsafePickle(f"byte item {fqn} is not plain data ({type(err).__name__}: {err})") from err
        value.seek(0)
        self._planner.load_bytes(read_item, value)
        if self._progress is not None:
            self._progress.update(1)


# Megatron-Core 0.19 builds every reader of dist_checkpointing.load with _get_filesystem_reader (the
# sharded load, the strict-mode metadata check, the common state) and reads a legacy common.pt
# with torch.load when _legacy_common_state_exists; none of them takes a reader from the caller.
_MEGATRON_SERIALIZATION = "megatron.core.dist_checkpointing.serialization"
_MEGATRON_TORCH_STRATEGY = "megatron.core.dist_checkpointing.strategies.torch"


def _checked_reader(checkpoint_dir: Any, *args: Any, progress: Any = None, **kwargs: Any) -> CheckedFileSystemReader:
    return CheckedFileSystemReader(checkpoint_dir, progress=progress)


def _no_legacy_common_state(checkpoint_dir: Any) -> bool:
    return False


_MEGATRON_READS = {
    (_MEGATRON_TORCH_STRATEGY, "_get_filesystem_reader"): _checked_reader,
    (_MEGATRON_SERIALIZATION, "_get_filesystem_reader"): _checked_reader,
    (_MEGATRON_SERIALIZATION, "_legacy_common_state_exists"): _no_legacy_common_state,
}


@contextlib.contextmanager
def checked_megatron_reads(progress: Any = None) -> Iterator[None]:
    """While active, Megatron-Core's ``dist_checkpointing`` reads checkpoints only through
    ``CheckedFileSystemReader`` (the common state from the checkpoint, never a ``common.pt``), each
    item read a step of ``progress`` (a ``runtime.progress`` bar) where one is given.

    Process-wide while active (it replaces the functions above in Megatron's modules, and
    restores them on exit). Raises if this Megatron-Core lacks one of them: it then reads
    checkpoints in a way this module does not know.
    """
    modules = {name: importlib.import_module(name) for name in {module for module, _ in _MEGATRON_READS}}
    missing = [f"{module}.{attr}" for module, attr in _MEGATRON_READS if not hasattr(modules[module], attr)]
    if missing:
        raise RuntimeError(
            f"megatron-core has no {', '.join(missing)}: its checkpoint reads cannot be checked; "
            "install the megatron-core that scripts/requirements.txt pins"
        )
    saved = {(module, attr): getattr(modules[module], attr) for module, attr in _MEGATRON_READS}
    try:
        for (module, attr), replacement in _MEGATRON_READS.items():
            if replacement is _checked_reader and progress is not None:
                replacement = functools.partial(_checked_reader, progress=progress)
            setattr(modules[module], attr, replacement)
        yield
    finally:
        for (module, attr), original in saved.items():
            setattr(modules[module], attr, original)
