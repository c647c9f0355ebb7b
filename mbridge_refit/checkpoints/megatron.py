"""Megatron checkpoints on disk: save and load a model's weights with Megatron-Core's dist_checkpointing.

Owns the directory layout written by ``convert import`` and read by ``convert export``, and the
metadata that lets ``export`` rebuild the model and its HF checkpoint without the source::

    OUT/
      config.json, tokenizer and generation files   copied from the HF source (the model's identity)
      latest_checkpointed_iteration.txt             "release", as Megatron-LM names a release checkpoint
      release/                                      torch_dist checkpoint (metadata.json, .metadata, __R_0.distcp)
      mbridge_refit_megatron.json                   written last: its presence marks a complete checkpoint

Before a model is given memory, ``export`` compares it with the checkpoint: ``read_stored`` reads the
DCP index (through the restricted unpickler below) and checks that every stored piece lies inside
its file and that each tensor's pieces tile it; ``model_tensors`` lists the global shape and dtype
of every tensor a (meta-device) model would load; ``fit_problems`` compares the two. Megatron
marks the embedding and output layer ``allow_shape_mismatch`` (for padded vocabularies), so
without this check a vocabulary the config and the weights disagree on is cropped or zero-padded
by the load, silently.

The weights are Megatron-Core's ``sharded_state_dict()`` of the model chunks, stored under the
keys Megatron-LM uses (``model`` for one chunk, ``model0..N`` with virtual pipeline stages). Each
tensor is stored once, under its global name and shape, so a checkpoint saved at one layout
loads at another (TP, PP, VPP and EP may all change). There is no optimizer, RNG or training
state. The bridge's own ``save_megatron_model`` is not used: importing it needs modelopt,
datasets, megatron-energon, tensorboard and more, which this CPU conversion path avoids.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import math
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystem

from mbridge_refit.checkpoints.dcp_pickles import (
    INDEX_NAME,
    ByteItemRefused,
    check_byte_items,
    checked_megatron_reads,
    load_index,
    location_problem,
)
from mbridge_refit.checkpoints.hf import COPIED_FILE_NAMES, loads_unique_keys
from mbridge_refit.checkpoints.publish import TMP_PREFIX, begin_publication, carry_over, fsync_tree, is_loader_file
from mbridge_refit.checkpoints.side_files import copy_side_file
from mbridge_refit.errors import InputError
from mbridge_refit.plan.layout import ParallelLayout
from mbridge_refit.runtime.progress import progress_bar

__all__ = [
    "COMMON_STATE_NAME",
    "CheckpointInfo",
    "DIST_BACKEND",
    "DIST_CONFIG_NAME",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAX_DIST_CONFIG_BYTES",
    "METADATA_NAME",
    "NotAMegatronCheckpoint",
    "SIDE_FILE_NAMES",
    "StoredTensors",
    "TRACKER_NAME",
    "WEIGHTS_DIR",
    "check_dist_config",
    "check_pickled_parts",
    "cpu_save_strategy",
    "fit_problems",
    "load_model",
    "load_weights",
    "model_keys",
    "model_tensors",
    "read_stored",
    "save_model",
    "sharded_model_state",
    "stored_in",
    "tracked_iteration",
]

FORMAT_NAME = "mbridge_refit.checkpoints.megatron"
FORMAT_VERSION = 1

METADATA_NAME = "mbridge_refit_megatron.json"
DIST_CONFIG_NAME = "metadata.json"  # Megatron-Core dist_checkpointing's own config, beside the DCP index
DIST_BACKEND = "torch_dist"
MAX_DIST_CONFIG_BYTES = 2**20
TRACKER_NAME = "latest_checkpointed_iteration.txt"
WEIGHTS_DIR = "release"
COMMON_STATE_NAME = "common.pt"  # Megatron's legacy common state file (torch.load), never written by `import`
# Copied from the HF source next to the weights, so ``export`` needs nothing else.
SIDE_FILE_NAMES = ("config.json", *COPIED_FILE_NAMES)
# _any_overlap: a grid of at most this many cells per stored piece is checked cell by cell (a layout's
# pieces are one cell each); pieces that cut finer are compared pair by pair, at most this many of them.
MAX_GRID_CELLS_PER_PIECE = 64
MAX_PAIRWISE_PIECES = 2048


class NotAMegatronCheckpoint(InputError):
    """The directory holds no complete checkpoint written by ``save_model``; the message says why."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointInfo:
    """What ``mbridge_refit_megatron.json`` records about a saved checkpoint.

    Attributes:
        saved_layout: the layout the model had when saved (loading may use another).
        params_dtype: dtype of the Megatron parameters (the model is rebuilt with it).
        hf_dtypes: every HF tensor name of the source checkpoint and its dtype there; ``export``
            casts to these and checks it yields exactly these names.
        source: the HF checkpoint the weights came from (informational).
    """

    saved_layout: ParallelLayout
    params_dtype: torch.dtype
    hf_dtypes: dict[str, torch.dtype]
    source: str

    def to_json(self) -> str:
        data = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "saved_layout": dataclasses.asdict(self.saved_layout),
            "params_dtype": _dtype_name(self.params_dtype),
            "hf_dtypes": {name: _dtype_name(dtype) for name, dtype in sorted(self.hf_dtypes.items())},
            "source": self.source,
            "weights_dir": WEIGHTS_DIR,
        }
        return json.dumps(data, indent=2) + "\n"

    @classmethod
    def read(cls, path: Path) -> "CheckpointInfo":
        """Read and check the metadata of the checkpoint in ``path``; raises ``NotAMegatronCheckpoint``."""
        if not path.is_dir():
            raise NotAMegatronCheckpoint(f"{path} is not a directory")
        meta = path / METADATA_NAME
        if not meta.is_file():
            hint = (
                "it looks like a Hugging Face checkpoint: convert it with `import` first"
                if (path / "config.json").is_file() and any(path.glob("*.safetensors*"))
                else "write one with `python -m mbridge_refit.convert import --hf HF_DIR --megatron DIR`"
            )
            raise NotAMegatronCheckpoint(
                f"{path} has no {METADATA_NAME}, so it is not a complete checkpoint of ours: {hint}"
            )
        try:
            data = loads_unique_keys(meta.read_bytes())
            if data.get("format") != FORMAT_NAME or data.get("version") != FORMAT_VERSION:
                raise NotAMegatronCheckpoint(
                    f"{meta}: format {data.get('format')!r} version {data.get('version')!r}, expected "
                    f"{FORMAT_NAME!r} version {FORMAT_VERSION}: re-create it with this version's `import`"
                )
            info = cls(
                saved_layout=ParallelLayout(**data["saved_layout"]),
                params_dtype=_dtype_from_name(data["params_dtype"]),
                hf_dtypes={name: _dtype_from_name(d) for name, d in data["hf_dtypes"].items()},
                source=str(data.get("source", "")),
            )
        except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as err:  # any JSON, any field
            if isinstance(err, NotAMegatronCheckpoint):
                raise
            raise NotAMegatronCheckpoint(
                f"{meta} is unreadable ({err}): re-create the checkpoint with `import`"
            ) from err
        if not info.params_dtype.is_floating_point:  # `import` records the checkpoint's floating-point dtype
            dtype = _dtype_name(info.params_dtype)
            raise NotAMegatronCheckpoint(f"{meta}: params_dtype {dtype} is not a floating-point dtype: re-create it")
        for required in ("config.json", f"{WEIGHTS_DIR}/{DIST_CONFIG_NAME}", f"{WEIGHTS_DIR}/{INDEX_NAME}"):
            if not (path / required).is_file():
                raise NotAMegatronCheckpoint(f"{path} is incomplete: {required} is missing; re-create it with `import`")
        check_dist_config(path / WEIGHTS_DIR / DIST_CONFIG_NAME)
        check_pickled_parts(path / WEIGHTS_DIR)
        return info


def check_dist_config(path: Path) -> None:
    """Refuse a dist_checkpointing ``metadata.json`` that is not the JSON object ``import`` writes there:
    Megatron-Core's load reads it with ``json.load`` and builds its config from the object's
    ``sharded_backend`` (a list, a missing backend or a key given twice failed inside it, or was read
    last-wins); the backend must be ``torch_dist``, the one this module saves and loads."""
    size = path.stat().st_size
    try:
        if size > MAX_DIST_CONFIG_BYTES:
            raise ValueError(f"{size} bytes, more than the {MAX_DIST_CONFIG_BYTES} such a file ever needs")
        config = loads_unique_keys(path.read_bytes())
        if not isinstance(config, dict):
            raise ValueError(f"a JSON {type(config).__name__}, not an object")
        if config.get("sharded_backend") != DIST_BACKEND:
            raise ValueError(f"sharded_backend {config.get('sharded_backend')!r}, not {DIST_BACKEND!r}")
    except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise NotAMegatronCheckpoint(
            f"{path} is not the metadata.json `import` writes ({err}): re-create the checkpoint with `import`"
        ) from err


# --- pickled parts, checked before anything else reads them ------------------------------------
#
# The index ``.metadata`` and the byte items in the ``.distcp`` files are pickles (``dcp_pickles``
# says why and how they are read here). ``check_pickled_parts`` reads them all before the first
# collective, so a crafted checkpoint is refused (exit 2) with the file named; ``load_model`` reads
# through ``checked_megatron_reads``, so what it loads is what passed the same checks.


def check_pickled_parts(weights: Path) -> None:
    """Refuse a checkpoint whose pickled parts would build anything but checkpoint data (see above)."""
    legacy_common = weights / COMMON_STATE_NAME
    if legacy_common.exists():
        raise NotAMegatronCheckpoint(
            f"refusing {legacy_common}: `import` never writes it (the common state lives in the torch_dist "
            "checkpoint); re-create the checkpoint from the HF source"
        )
    index_path = weights / INDEX_NAME
    try:
        index = load_index(index_path.read_bytes())
    except Exception as err:
        raise NotAMegatronCheckpoint(
            f"refusing {index_path}: {type(err).__name__}: {err}. It is not an index written by `import`; "
            "re-create the checkpoint from the HF source"
        ) from err
    try:
        check_byte_items(weights, index)
    except ByteItemRefused as refused:
        what = f": {refused.reason}" if refused.placed else f" is not plain data ({refused.reason})"
        raise NotAMegatronCheckpoint(
            f"refusing {refused.path}: its object {refused.fqn}{what}; re-create the checkpoint from the HF source"
        ) from refused


# --- the stored tensors against a model's, before anything is allocated or read -----------------


@dataclass(frozen=True, kw_only=True, slots=True)
class StoredTensors:
    """What a checkpoint's DCP index says it holds.

    Attributes:
        tensors: key -> (global shape, dtype) of every stored tensor.
        objects: keys of the stored byte items (``_extra_state``).
        nbytes: bytes of all stored tensors.
        problems: pieces outside their file, pieces that do not tile their tensor (a damaged or
            crafted index, or truncated ``.distcp`` files).
    """

    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]
    objects: frozenset[str]
    nbytes: int
    problems: list[str]


def read_stored(path: Path) -> StoredTensors:
    """The tensors of the checkpoint in ``path`` (``CheckpointInfo.read`` accepted it), from its index
    alone; ``NotAMegatronCheckpoint`` if the index does not hold what torch_dist writes there."""
    weights = path / WEIGHTS_DIR
    check_pickled_parts(weights)
    return stored_in(weights, fix="re-create the checkpoint with `import`")


def stored_in(weights: Path, *, fix: str) -> StoredTensors:
    """The tensors of the torch_dist checkpoint in the directory ``weights``, from its index alone (read
    through ``dcp_pickles.load_index``; its byte items are not read); ``NotAMegatronCheckpoint`` naming
    ``fix`` if the index is not one torch_dist writes."""
    index_path = weights / INDEX_NAME
    try:
        index = load_index(index_path.read_bytes())
        return _stored(weights, index)
    except (
        AttributeError,
        TypeError,
        ValueError,
        KeyError,
        IndexError,
        OverflowError,
        EOFError,
        pickle.UnpicklingError,
    ) as err:
        raise NotAMegatronCheckpoint(
            f"{index_path} does not describe tensors as torch_dist writes them ({type(err).__name__}: {err}): {fix}"
        ) from err


def _stored(weights: Path, index: Any) -> StoredTensors:
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    objects: set[str] = set()
    problems = _storage_problems(weights, index)
    for key, entry in index.state_dict_metadata.items():
        if type(entry).__name__ == "BytesStorageMetadata":
            objects.add(str(key))
            continue
        shape = tuple(_count(n) for n in entry.size)
        dtype = entry.properties.dtype
        if not isinstance(key, str) or not isinstance(dtype, torch.dtype):
            raise TypeError(f"entry {key!r}: a {type(key).__name__} key with dtype {dtype!r}")
        tensors[key] = (shape, dtype)
        chunks = [(tuple(_count(o) for o in c.offsets), tuple(_count(n) for n in c.sizes)) for c in entry.chunks]
        problems += _tiling_problems(key, shape, chunks, index)
    nbytes = sum(math.prod(shape) * dtype.itemsize for shape, dtype in tensors.values())
    return StoredTensors(tensors=tensors, objects=frozenset(objects), nbytes=nbytes, problems=problems)


def _count(value: Any) -> int:
    """A size or offset of the index: a non-negative int."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r} is not a size")
    return value


def _storage_problems(weights: Path, index: Any) -> list[str]:
    """Every stored piece lies inside a file of ``weights`` (a truncated ``.distcp`` shows here)."""
    sizes: dict[str, int | None] = {}
    problems = (location_problem(weights, location, sizes) for location in (index.storage_data or {}).values())
    return list(dict.fromkeys(problem for problem in problems if problem is not None))  # each file's once


def _tiling_problems(key: str, shape: tuple[int, ...], chunks: list[tuple[tuple, tuple]], index: Any) -> list[str]:
    """The stored pieces of tensor ``key`` cover it exactly once, and each has a place in a file."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    inside = all(
        len(offsets) == len(shape) == len(sizes)
        and all(0 <= o and o + n <= d for o, n, d in zip(offsets, sizes, shape))
        for offsets, sizes in chunks
    )
    covered = sum(math.prod(sizes) for _, sizes in chunks)
    if not inside or covered != math.prod(shape) or _any_overlap(chunks):
        return [f"{key}: the index's pieces of this {list(shape)} tensor do not cover it exactly once"]
    storage = getattr(index, "storage_data", {})
    unstored = [offsets for offsets, _ in chunks if MetadataIndex(key, torch.Size(offsets)) not in storage]
    return [f"{key}: the index places no bytes for its piece at {list(unstored[0])}"] if unstored else []


def _any_overlap(chunks: list[tuple[tuple, tuple]]) -> bool:
    """Whether two of ``chunks`` (boxes inside one tensor) share an element, in time linear in the cells of
    the grid their edges cut (every layout Megatron saves is such a grid, one box a cell: a pairwise
    check took a minute for 8k one-element pieces); pieces cutting more than ``MAX_GRID_CELLS_PER_PIECE``
    cells each are compared pairwise, at most ``MAX_PAIRWISE_PIECES`` of them."""
    if len(chunks) < 2:
        return False
    cuts = [sorted({o[d] for o, _ in chunks} | {o[d] + n[d] for o, n in chunks}) for d in range(len(chunks[0][0]))]
    if math.prod(len(c) - 1 for c in cuts) <= MAX_GRID_CELLS_PER_PIECE * len(chunks):
        positions = [{cut: i for i, cut in enumerate(c)} for c in cuts]
        seen: set[tuple[int, ...]] = set()
        for offsets, sizes in chunks:
            spans = [range(at[o], at[o + n]) for at, o, n in zip(positions, offsets, sizes)]
            for cell in itertools.product(*spans):
                if cell in seen:
                    return True
                seen.add(cell)
        return False
    if len(chunks) > MAX_PAIRWISE_PIECES:
        return True  # not a grid and too many pieces to compare: refused as a tiling no layout writes
    for i, (a_offsets, a_sizes) in enumerate(chunks):
        for b_offsets, b_sizes in chunks[i + 1 :]:
            if all(a < b + m and b < a + n for a, n, b, m in zip(a_offsets, a_sizes, b_offsets, b_sizes)):
                return True
    return False


def model_tensors(
    chunks: list[torch.nn.Module], keep: Callable[[str], bool] | None = None
) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], frozenset[str]]:
    """(key -> (global shape, dtype) of every tensor, keys of byte items) that ``load_model`` (or
    ``load_weights`` with ``keep``) would read for this rank's ``chunks``; works on meta-device chunks
    (nothing is allocated or read)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        apply_factories,
    )
    from megatron.core.utils import unwrap_model

    state = sharded_model_state(unwrap_model(chunks), keep)
    apply_factories(state)
    tensors, objects = {}, set()
    for item in nested_values(state):
        if isinstance(item, ShardedTensor):
            tensors[item.key] = (tuple(int(n) for n in item.global_shape), item.dtype)
        elif isinstance(item, ShardedObject):
            objects.add(item.unique_key)
    return tensors, frozenset(objects)


def fit_problems(
    model: dict[str, tuple[tuple[int, ...], torch.dtype]],
    model_objects: frozenset[str],
    stored: StoredTensors,
) -> list[str]:
    """Each tensor this rank's model reads must be stored with exactly its global shape and dtype
    (never cropped, padded or cast), and each byte item must be stored."""
    problems = []
    for key, (shape, dtype) in sorted(model.items()):
        if key not in stored.tensors:
            problems.append(f"{key}: the model has it ({list(shape)}), the checkpoint does not")
            continue
        stored_shape, stored_dtype = stored.tensors[key]
        if stored_shape != shape:
            problems.append(f"{key}: stored as {list(stored_shape)}, but the model of config.json needs {list(shape)}")
        elif stored_dtype != dtype:
            problems.append(f"{key}: stored as {_dtype_name(stored_dtype)}, but the model keeps {_dtype_name(dtype)}")
    missing_objects = sorted(model_objects - stored.objects)
    problems += [f"{key}: the model has this object, the checkpoint does not" for key in missing_objects]
    return problems


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def model_keys(num_chunks: int) -> list[str]:
    """State-dict keys of the model chunks, as Megatron-LM's checkpointing names them."""
    return ["model"] if num_chunks == 1 else [f"model{i}" for i in range(num_chunks)]


def sharded_model_state(chunks: list[torch.nn.Module], keep: Callable[[str], bool] | None = None) -> dict[str, Any]:
    """``{"model" | "model<i>": chunk.sharded_state_dict()}`` for this rank's chunks; with ``keep``,
    only the entries whose state-dict name it keeps (as Megatron-Bridge filters a PEFT checkpoint)."""
    from megatron.core.utils import unwrap_model

    unwrapped = unwrap_model(chunks)
    states = {key: chunk.sharded_state_dict() for key, chunk in zip(model_keys(len(unwrapped)), unwrapped)}
    if keep is None:
        return states
    return {key: {name: item for name, item in state.items() if keep(name)} for key, state in states.items()}


def save_model(
    chunks: list[torch.nn.Module], out: Path, *, info: CheckpointInfo, copy_files_from: Path, overwrite: bool
) -> None:
    """Write ``chunks`` (this rank's part) and ``info`` to ``out``; collective over the default group.

    Crash-safe (``checkpoints.publish``): rank 0 locks ``out`` (another writer's lock is refused
    by name, ``OutputRefused``), the checkpoint is built in this write's own staging directory
    beside ``out``, fsynced, and swapped in; ``out`` holds the complete old or new checkpoint
    whenever the process dies. With ``overwrite``, the new checkpoint only: old files a loader
    could read (``publish.is_loader_file``) and Megatron checkpoint entries (``release/``,
    ``iter_*/``, the tracker, our metadata) are dropped, other entries kept; a killed run's
    staging directory is removed (without ``overwrite``, refused by name). A failure on rank 0
    removes the staging directory and releases the lock.
    """
    from megatron.core import dist_checkpointing

    publication = begin_publication(out, overwrite=overwrite, distributed=True)
    staging = publication.staging
    try:
        if publication.is_first_rank:
            (staging / WEIGHTS_DIR).mkdir()
        dist.barrier()
        dist_checkpointing.save(
            sharded_model_state(chunks),
            str(staging / WEIGHTS_DIR),
            sharded_strategy=cpu_save_strategy(),
            content_metadata={"format": FORMAT_NAME},
        )
        dist.barrier()
        if publication.is_first_rank:
            for name in SIDE_FILE_NAMES:
                copy_side_file(copy_files_from, name, staging / name)
            (staging / TRACKER_NAME).write_bytes(b"release\n")
            if overwrite:
                carry_over(publication.target, staging, _is_checkpoint_entry)
            (staging / METADATA_NAME).write_bytes(info.to_json().encode())
            fsync_tree(staging)
            publication.swap_in()
    except BaseException:
        publication.abandon()
        raise
    dist.barrier()


def _is_checkpoint_entry(path: Path) -> bool:
    """Megatron checkpoint entries (the weights, Megatron-LM's iteration folders and tracker, our
    metadata), and any file a loader could read."""
    name = path.name
    megatron_entry = name in (WEIGHTS_DIR, TRACKER_NAME, METADATA_NAME) or name.startswith(("iter_", TMP_PREFIX))
    return megatron_entry or is_loader_file(path)


def load_model(chunks: list[torch.nn.Module], path: Path, *, show_progress: bool = False) -> None:
    """Fill every parameter of ``chunks`` from the checkpoint in ``path``; collective (with
    ``show_progress``, a progress bar of the items this rank reads).

    The chunks may use a different layout than the one saved. Raises ``NotAMegatronCheckpoint`` if
    the checkpoint lacks a tensor the model needs, a tensor's global shape differs or a stored
    piece cannot be read (``export`` refuses the first two before building the model: ``fit_problems``),
    or if a pickled part read now would build anything but checkpoint data (``dcp_pickles``),
    whatever passed ``check_pickled_parts`` before.
    """
    load_weights(chunks, path / WEIGHTS_DIR, fix="re-create it with `import`", show_progress=show_progress)


def load_weights(
    chunks: list[torch.nn.Module],
    weights: Path,
    *,
    fix: str,
    keep: Callable[[str], bool] | None = None,
    show_progress: bool = False,
) -> None:
    """Fill the parameters of ``chunks`` (those ``keep`` keeps, or all) from the torch_dist checkpoint
    in the directory ``weights``, read only through ``dcp_pickles``' checks; collective. Stored tensors
    the model does not ask for (an optimizer's, say) are not read. Raises ``NotAMegatronCheckpoint``
    naming ``fix`` when a tensor is missing, does not fit or cannot be read. With ``show_progress``, a
    progress bar of the items read (``runtime.progress``)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from megatron.core.utils import unwrap_model
    from torch.distributed.checkpoint.api import CheckpointException

    unwrapped = unwrap_model(chunks)
    strict = StrictHandling.RAISE_ALL if keep is None else StrictHandling.RAISE_UNEXPECTED
    progress = progress_bar(0, desc="load", unit="piece", show=show_progress)
    try:
        with checked_megatron_reads(progress if show_progress else None):
            state = dist_checkpointing.load(sharded_model_state(unwrapped, keep), str(weights), strict=strict)
    except (CheckpointException, CheckpointingException) as err:  # the first is a BaseException
        raise NotAMegatronCheckpoint(
            f"cannot read the weights in {weights}: {_first_line(err)}. The checkpoint is damaged or does "
            f"not match its config: {fix}"
        ) from err
    finally:
        progress.close()
    for key, chunk in zip(model_keys(len(unwrapped)), unwrapped):
        if keep is None:
            chunk.load_state_dict(state[key], strict=True)
            continue
        missing = [name for name in chunk.load_state_dict(state[key], strict=False).missing_keys if keep(name)]
        assert not missing, f"asked for, not loaded: {missing[:5]}"  # the load above raises first


def _first_line(err: BaseException) -> str:
    """``err`` in one line; for torch's ``CheckpointException``, its first rank's failure."""
    failures = getattr(err, "failures", None)
    if failures:
        rank, failure = next(iter(sorted(failures.items(), key=lambda item: item[0])))
        inner = failure[0] if isinstance(failure, tuple) else getattr(failure, "exc", failure)
        return f"rank {rank}: {type(inner).__name__}: {str(inner).splitlines()[0] if str(inner) else ''}"
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


def cpu_save_strategy():
    """Megatron-Core's torch_dist save strategy, written synchronously through torch's DCP writer.

    Same files and metadata as ``TorchDistSaveShardedStrategy`` (it is one, so
    ``dist_checkpointing.save`` accepts it), minus its async writer, which needs CUDA even for a
    synchronous save in megatron-core 0.19.2 (``preload_tensors`` calls ``torch.cuda.synchronize``
    and the finalize step all-reduces a tensor on ``torch.cuda.current_device()``).
    """
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.api import CheckpointException

    class SyncTorchDistSaveStrategy(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir) -> None:
            sharded_state_dict, _, _ = _replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict, self.keep_only_main_replica
            )
            pyt_state_dict = mcore_to_pyt_state_dict(sharded_state_dict, False)
            writer = FileSystemWriter(str(checkpoint_dir), thread_count=self.thread_count)
            writer.fs = _ErrnoKeepingFileSystem()
            try:
                dcp_save(
                    pyt_state_dict,
                    storage_writer=writer,
                    planner=MCoreSavePlanner(
                        dedup_replicated_tensors=not self.keep_only_main_replica,
                        flatten_state_dict=False,
                        flatten_sharded_tensors=False,
                    ),
                )
            except CheckpointException as err:
                if writer.fs.os_error is not None:  # the cause on this rank, with its errno and file
                    raise writer.fs.os_error from err
                raise

    return SyncTorchDistSaveStrategy()


class _ErrnoKeepingFileSystem(FileSystem):
    """torch's DCP file system, keeping the first ``OSError`` of a file it writes (with the file's
    path). DCP reports a rank's failure as a pickled copy that drops the exception's context, and
    ``torch.save`` turns a failed write into a ``RuntimeError``: both lose the errno (disk full,
    file-size limit) that the command's error message names."""

    def __init__(self) -> None:
        super().__init__()
        self.os_error: OSError | None = None

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        try:
            with super().create_stream(path, mode) as stream:
                yield _ErrorKeepingStream(stream, lambda err: self.keep(err, path))
        except OSError as err:
            self.keep(err, path)
            raise

    def keep(self, err: OSError, path: Any) -> None:
        if self.os_error is None:
            self.os_error = OSError(err.errno, err.strerror, str(path))


class _ErrorKeepingStream:
    """A writable stream that passes an ``OSError`` of ``write`` to ``keep`` before raising it."""

    def __init__(self, stream: Any, keep: Any) -> None:
        self._stream, self._keep = stream, keep

    def write(self, data: Any) -> int:
        try:
            return self._stream.write(data)
        except OSError as err:
            self._keep(err)
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def tracked_iteration(path: Path, tracker: Path, index_name: str, error: type[Exception]) -> Path:
    """The iteration directory of ``path`` that a training run's tracker file (``latest_checkpointed_iteration.txt``)
    names: ``release`` or ``iter_<7 digits>``, holding ``index_name``; ``error`` names what is wrong otherwise."""
    text = tracker.read_text(errors="replace").strip()
    number = text.isascii() and text.isdigit()  # str.isdigit() also takes "²", which int() refuses
    name = "release" if text == "release" else (f"iter_{int(text):07d}" if number else None)
    if name is None or not (path / name / index_name).is_file():
        raise error(
            f"{tracker} names iteration {text!r}, but {path / (name or text)} holds no complete checkpoint: "
            "pass an iter_* directory that is complete"
        )
    logging.getLogger(__name__).info("%s: the latest iteration is %s", path, name)
    return path / name
