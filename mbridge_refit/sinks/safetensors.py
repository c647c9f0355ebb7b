"""Sharded Hugging Face safetensors checkpoints written from an export stream.

Owns the on-disk HF layout (``model-0000K-of-0000N.safetensors`` plus
``model.safetensors.index.json``), the greedy shard plan that every rank computes identically
from the stream, which rank writes which shard (shard ``k`` by rank ``k % world_size``), and the
crash-safe publish (``checkpoints.publish``): rank 0 locks the output (a second writer is
refused naming the holder), everything is written into this writer's own staging directory
beside the output, shards under temporary names renamed once the shard count is known, then the
side files and the index last, all fsynced; then the staging directory is swapped in atomically.
The output path holds the complete old or the complete new checkpoint whenever the process dies.
With ``overwrite``, the new checkpoint only: every old file a loader could read
(``publish.is_loader_file``: weights of any format, indexes, configs, tokenizer and processor
files) is dropped, other entries (notes, folders of one's own) are kept.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from mbridge_refit.checkpoints.hf import CONFIG_NAME, COPIED_FILE_NAMES, INDEX_NAME
from mbridge_refit.checkpoints.publish import (
    TMP_PREFIX,
    begin_publication,
    carry_over,
    fsync_dir,
    fsync_file,
    give_new_file_mode,
    is_loader_file,
)
from mbridge_refit.checkpoints.side_files import copy_side_file, read_side_file
from mbridge_refit.sinks.base import WeightSink

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "ShardAssignment",
    "ShardPlanner",
    "ShardedSafetensorsWriter",
    "plan_shards",
    "shard_file_name",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


def shard_file_name(shard: int, num_shards: int) -> str:
    """Final HF file name of 0-based ``shard``: ``model-00001-of-00003.safetensors`` for 0 of 3."""
    return f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"


def _tmp_shard_name(shard: int) -> str:
    return f"{TMP_PREFIX}model-{shard + 1:05d}.safetensors"


class ShardPlanner:
    """Greedy fill in stream order.

    A new shard starts when adding a tensor to a non-empty shard would exceed
    ``max_shard_bytes``; a tensor larger than the limit therefore gets a shard of its own.
    Depends only on the sequence of sizes, so every rank computes the same plan.
    """

    def __init__(self, max_shard_bytes: int) -> None:
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self._max = max_shard_bytes
        self._shard = -1
        self._used = 0
        self._count = 0

    @property
    def num_shards(self) -> int:
        return self._shard + 1

    def place(self, nbytes: int) -> int:
        """Assign a tensor of ``nbytes`` to a shard; returns the 0-based shard index."""
        if self._shard < 0 or (self._count > 0 and self._used + nbytes > self._max):
            self._shard += 1
            self._used = 0
            self._count = 0
        self._used += nbytes
        self._count += 1
        return self._shard


def plan_shards(sizes: Iterable[int], *, max_shard_bytes: int) -> list[int]:
    """The 0-based shard index of each size, as :class:`ShardPlanner` assigns them."""
    planner = ShardPlanner(max_shard_bytes)
    return [planner.place(n) for n in sizes]


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardAssignment:
    """A checkpoint's shards and the rank that writes each, fixed before the export starts.

    Built from the names and byte sizes the export will yield, in its order (from the export
    plan), so every rank computes the same files as the streaming writer would (the same greedy
    ``ShardPlanner``). ``writers[k]`` is the rank (in the writer's group) that writes shard ``k``:
    shard ``k`` goes to replica ``k % R`` of the ``R`` groups in ``replicas``, and within it to
    its ranks in turn. A replica then needs to export only ``names_for(its ranks)``.
    """

    names: tuple[str, ...]
    nbytes: tuple[int, ...]
    shard_of: tuple[int, ...]
    writers: tuple[int, ...]

    @classmethod
    def build(
        cls, tensors: Iterable[tuple[str, int]], *, max_shard_bytes: int, replicas: Iterable[Iterable[int]]
    ) -> "ShardAssignment":
        tensors = list(tensors)
        names, nbytes = zip(*tensors) if tensors else ((), ())
        shard_of = tuple(plan_shards(nbytes, max_shard_bytes=max_shard_bytes))
        groups = [sorted(ranks) for ranks in replicas]
        if not groups or not all(groups):
            raise ValueError(f"replicas must be non-empty rank lists, got {groups}")
        count = (max(shard_of) + 1) if shard_of else 0
        writers = tuple(_writer_of(k, groups) for k in range(count))
        return cls(names=tuple(names), nbytes=tuple(nbytes), shard_of=shard_of, writers=writers)

    @property
    def num_shards(self) -> int:
        return len(self.writers)

    def names_for(self, ranks: Iterable[int]) -> frozenset[str]:
        """The tensors of the shards that ``ranks`` write."""
        ranks = set(ranks)
        return frozenset(n for n, k in zip(self.names, self.shard_of) if self.writers[k] in ranks)


def _writer_of(shard: int, groups: list[list[int]]) -> int:
    """Shard ``k`` goes to group ``k % R``; within it, the group's ranks take turns (``k // R``)."""
    group = groups[shard % len(groups)]
    return group[(shard // len(groups)) % len(group)]


@dataclass(frozen=True, kw_only=True, slots=True)
class _Ranks:
    """This process's place in the group that iterates the export."""

    group: Any
    rank: int
    world_size: int
    distributed: bool

    @classmethod
    def resolve(cls, group: Any) -> _Ranks:
        """``group`` if given, else the default group if initialized, else a single process."""
        if group is None and not (dist.is_available() and dist.is_initialized()):
            return cls(group=None, rank=0, world_size=1, distributed=False)
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError(
                "this process is not a member of the process group given as `group`; pass the "
                "group of the ranks that iterate the export (or None for the default group)"
            )
        return cls(group=group, rank=rank, world_size=dist.get_world_size(group), distributed=True)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)


class ShardedSafetensorsWriter(WeightSink):
    """A :class:`WeightSink` that writes an HF-layout sharded safetensors checkpoint.

    Streaming (default): every rank of the group consumes the same stream, and the shards are
    cut as it arrives. Shard ``k`` is buffered and written by rank ``k % world_size`` only (as a
    CPU copy, so the caller may reuse its buffer); other ranks keep only names and sizes. Memory
    stays at about one shard per rank. In multi-rank use, ``out_dir`` must be on a filesystem
    shared by all ranks.

    With ``assignment`` (a ``ShardAssignment``, the same on every rank) the files and writers are
    fixed up front: a rank needs to consume only the tensors of the shards it writes (others are
    ignored), in any subset of the export's order, so data-parallel replicas can each export
    and write their own share. ``finish`` checks that every shard a rank writes was complete.

    One writer at a time: rank 0 locks ``out_dir`` in the constructor (``OutputRefused`` naming
    the holder if another writer has it) and releases it when ``finish`` has swapped the new
    checkpoint in, or in ``abort``; a writer never finished or aborted holds it until its process
    ends.

    Args:
        out_dir: output directory; created (with parents) if missing. A symlink is written through
            (the link stays; the directory it points to is replaced).
        max_shard_bytes: shard size limit (default 5 GiB).
        overwrite: allow a non-empty ``out_dir``: its checkpoint is replaced only once the new one
            is complete (old files a loader could read are dropped, other entries kept); also
            removes the leftover staging directory of a killed run.
        copy_files_from: an HF model directory whose ``config.json``, generation config and
            tokenizer files (:data:`COPIED_FILE_NAMES`) are copied when present.
        config_overrides: top-level keys merged into the copied ``config.json`` (needs
            ``copy_files_from`` with a ``config.json``).
        group: process group of the ranks iterating the export; None means the default group if
            torch.distributed is initialized, else a single process.
        metadata: extra string entries for each file's safetensors metadata, added to
            ``{"format": "pt"}``.
        assignment: the shards and their writers, fixed before the export (see above).
    """

    def __init__(
        self,
        *,
        out_dir: str | os.PathLike[str],
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        overwrite: bool = False,
        copy_files_from: str | os.PathLike[str] | None = None,
        config_overrides: Mapping[str, Any] | None = None,
        group: Any = None,
        metadata: Mapping[str, str] | None = None,
        assignment: ShardAssignment | None = None,
    ) -> None:
        self.out_dir = Path(out_dir)
        self._overwrite = overwrite
        self._planner = ShardPlanner(max_shard_bytes)
        self._copy_from = _check_copy_source(copy_files_from, config_overrides, self.out_dir)
        self._config_overrides = dict(config_overrides) if config_overrides else None
        self._metadata = _file_metadata(metadata)
        self._ranks = _Ranks.resolve(group)
        self._weight_map: dict[str, int] = {}
        self._total_bytes = 0
        self._open_shard: int | None = None
        self._buffer: dict[str, torch.Tensor] = {}
        self._written: dict[int, Path] = {}
        self._tmp_paths: set[Path] = set()
        self._closed = False
        self._aborted = False
        self.file_seconds = 0.0  # this rank's time in writing and syncing its shard files
        self._assignment = assignment
        if assignment is not None:
            self._planned = {
                name: (k, n) for name, k, n in zip(assignment.names, assignment.shard_of, assignment.nbytes)
            }
            # tensors still to come of each shard this rank writes, and those already here
            self._missing = Counter(k for k in assignment.shard_of if assignment.writers[k] == self._ranks.rank)
            self._shard_buffers: dict[int, dict[str, torch.Tensor]] = {k: {} for k in self._missing}
        self._publication = begin_publication(
            self.out_dir, overwrite=overwrite, group=self._ranks.group, distributed=self._ranks.distributed
        )
        self.staging = self._publication.staging

    # -- WeightSink ------------------------------------------------------------------------

    def consume(self, hf_name: str, tensor: torch.Tensor) -> None:
        self._check_open("consume")
        if hf_name in self._weight_map:
            raise ValueError(
                f"tensor {hf_name!r} was exported twice; every HF name must appear once in the "
                "stream (check the export plan for duplicate mappings)"
            )
        nbytes = tensor.nbytes  # what it occupies in the file: dense, no padding
        if self._assignment is not None:
            self._consume_assigned(hf_name, tensor, nbytes)
            return
        shard = self._planner.place(nbytes)
        if shard != self._open_shard:
            self._close_shard()
            self._open_shard = shard
        self._weight_map[hf_name] = shard
        self._total_bytes += nbytes
        if self._owns_streamed(shard):
            self._buffer[hf_name] = tensor.detach().to("cpu", copy=True).contiguous()

    def finish(self) -> None:
        self._check_open("finish")
        self._closed = True
        if self._assignment is not None:
            self._finish_assigned()
        elif not self._weight_map:
            raise ValueError(
                f"no tensors were consumed, so there is nothing to write to {self.out_dir}; "
                "check that the export stream is not empty"
            )
        self._close_shard()
        self._ranks.barrier()
        num_shards = self._planner.num_shards if self._assignment is None else self._assignment.num_shards
        self._publish_shards(num_shards)
        self._ranks.barrier()
        if self._ranks.rank == 0:
            self._copy_side_files()
            if self._overwrite:
                carry_over(self._publication.target, self.staging, is_loader_file)
            self._write_index(num_shards)
            fsync_dir(self.staging)
            self._publication.swap_in()
        self._ranks.barrier()
        if self._ranks.rank == 0:
            logger.info(
                "wrote %d safetensors files, %d tensors, %d bytes to %s",
                num_shards,
                len(self._weight_map),
                self._total_bytes,
                self.out_dir,
            )

    def abort(self) -> None:
        """Remove what this rank wrote (rank 0: the whole staging directory, and release the
        lock); the output directory is left as it was. After rank 0 swapped the new checkpoint in
        (an interrupt in the last steps), the output keeps it. A second call does nothing."""
        if self._aborted:
            return
        self._closed = self._aborted = True
        self._buffer.clear()
        if self._assignment is not None:
            self._shard_buffers.clear()
        if self._publication.swapped:  # interrupted after the swap, before the last barrier: the output is complete
            self._publication.abandon()  # what is left of the old content
            logger.warning("interrupted after %s was written: the new checkpoint is in place", self.out_dir)
            return
        for path in sorted(self._tmp_paths | set(self._written.values())):
            path.unlink(missing_ok=True)
        self._publication.abandon()
        logger.warning("aborted writing %s: removed what rank %d had written", self.out_dir, self._ranks.rank)
        self._tmp_paths.clear()

    # -- shards ----------------------------------------------------------------------------

    def _check_open(self, method: str) -> None:
        if self._closed:
            raise RuntimeError(
                f"{type(self).__name__}.{method}() called after finish() or abort(); "
                "create a new writer for a new export"
            )

    def _close_shard(self) -> None:
        """Streaming: write the open shard if this rank owns it."""
        shard = self._open_shard
        if shard is None or not self._owns_streamed(shard):
            return
        self._write_shard(shard, self._buffer)
        self._buffer = {}

    def _owns_streamed(self, shard: int) -> bool:
        """Streaming: shard ``k`` is written by rank ``k % world_size``."""
        return shard % self._ranks.world_size == self._ranks.rank

    def _write_shard(self, shard: int, tensors: dict[str, torch.Tensor]) -> None:
        """Write one shard under its temporary name, synced (renamed once the shard count is known)."""
        path = self.staging / _tmp_shard_name(shard)
        self._tmp_paths.add(path)
        start = time.monotonic()
        save_file(tensors, str(path), metadata=self._metadata)
        give_new_file_mode(path)  # save_file's 0o600 -> what config.json gets
        fsync_file(path)
        self.file_seconds += time.monotonic() - start
        self._written[shard] = path

    def _consume_assigned(self, hf_name: str, tensor: torch.Tensor, nbytes: int) -> None:
        planned = self._planned.get(hf_name)
        if planned is None:
            raise ValueError(
                f"tensor {hf_name!r} is not in the shard assignment this writer was built with (from the export plan)"
            )
        shard, expected = planned
        if nbytes != expected:
            raise ValueError(f"tensor {hf_name!r} has {nbytes} bytes, the shard assignment planned {expected}")
        if shard not in self._missing:
            return  # another rank writes this shard
        self._weight_map[hf_name] = shard
        self._shard_buffers[shard][hf_name] = tensor.detach().to("cpu", copy=True).contiguous()
        self._missing[shard] -= 1
        if self._missing[shard] == 0:
            self._write_shard(shard, self._shard_buffers.pop(shard))

    def _finish_assigned(self) -> None:
        """Every shard this rank writes must be complete; the index lists every planned tensor."""
        incomplete = {k: left for k, left in self._missing.items() if left}
        if incomplete:
            planned = self._assignment
            missing = [
                n for n, k in zip(planned.names, planned.shard_of) if k in incomplete and n not in self._weight_map
            ]
            raise ValueError(
                f"the export stream ended before shards {sorted(incomplete)} were complete; missing {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''}: this rank must consume every tensor of the shards it writes"
            )
        self._weight_map = dict(zip(self._assignment.names, self._assignment.shard_of))
        self._total_bytes = sum(self._assignment.nbytes)

    def _publish_shards(self, num_shards: int) -> None:
        for shard, tmp in sorted(self._written.items()):
            final = self.staging / shard_file_name(shard, num_shards)
            os.replace(tmp, final)
            self._written[shard] = final
            self._tmp_paths.discard(tmp)

    # -- rank 0: side files and index ------------------------------------------------------

    def _copy_side_files(self) -> None:
        if self._copy_from is None:
            return
        if self._config_overrides:
            data = json.loads(read_side_file(self._copy_from, CONFIG_NAME))
            data.update(self._config_overrides)
            self._atomic_write_text(CONFIG_NAME, json.dumps(data, indent=2, sort_keys=True) + "\n")
        else:
            self._atomic_copy(CONFIG_NAME)
        for name in COPIED_FILE_NAMES:
            self._atomic_copy(name)

    def _write_index(self, num_shards: int) -> None:
        index = {
            "metadata": {"total_size": self._total_bytes},
            "weight_map": {name: shard_file_name(shard, num_shards) for name, shard in self._weight_map.items()},
        }
        self._atomic_write_text(INDEX_NAME, json.dumps(index, indent=2, sort_keys=True) + "\n")

    def _atomic_copy(self, name: str) -> None:
        """``copy_files_from / name`` into the staging directory if present (``checkpoints.side_files``)."""
        tmp = self._track_tmp(name)
        if copy_side_file(self._copy_from, name, tmp):
            fsync_file(tmp)
            os.replace(tmp, self.staging / name)
        self._tmp_paths.discard(tmp)

    def _atomic_write_text(self, name: str, text: str) -> None:
        tmp = self._track_tmp(name)
        tmp.write_text(text)
        fsync_file(tmp)
        os.replace(tmp, self.staging / name)
        self._tmp_paths.discard(tmp)

    def _track_tmp(self, name: str) -> Path:
        tmp = self.staging / f"{TMP_PREFIX}{name}"
        self._tmp_paths.add(tmp)
        return tmp


# -- constructor checks --------------------------------------------------------------------


def _file_metadata(extra: Mapping[str, str] | None) -> dict[str, str]:
    metadata = {"format": "pt", **(extra or {})}
    bad = {k: v for k, v in metadata.items() if not (isinstance(k, str) and isinstance(v, str))}
    if bad:
        raise TypeError(f"safetensors metadata keys and values must be str; got {bad!r}")
    return metadata


def _check_copy_source(
    copy_files_from: str | os.PathLike[str] | None,
    config_overrides: Mapping[str, Any] | None,
    out_dir: Path,
) -> Path | None:
    if copy_files_from is None:
        if config_overrides:
            raise ValueError("config_overrides needs a config.json to merge into; pass copy_files_from=<HF model dir>")
        return None
    source = Path(copy_files_from)
    if not source.is_dir():
        raise FileNotFoundError(
            f"copy_files_from={source} is not a directory; pass the HF model directory that holds "
            "config.json and the tokenizer files"
        )
    if config_overrides and not (source / CONFIG_NAME).is_file():
        raise FileNotFoundError(
            f"config_overrides given but {source / CONFIG_NAME} does not exist; "
            "copy_files_from must hold a config.json to merge into"
        )
    if out_dir.exists() and source.resolve() == out_dir.resolve():
        raise ValueError(f"copy_files_from and out_dir are the same directory ({source}); write to a new directory")
    return source
