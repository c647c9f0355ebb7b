"""Megatron checkpoints on disk: save and load a model's weights with Megatron-Core's dist_checkpointing.

Owns the directory layout written by ``convert import`` and read by ``convert export``, and the
metadata that lets ``export`` rebuild the model and its HF checkpoint without the source::

    OUT/
      config.json, tokenizer and generation files   copied from the HF source (the model's identity)
      latest_checkpointed_iteration.txt             "release", as Megatron-LM names a release checkpoint
      release/                                      torch_dist checkpoint (metadata.json, .metadata, __R_0.distcp)
      mbridge_refit_megatron.json                   written last: its presence marks a complete checkpoint

The weights are Megatron-Core's ``sharded_state_dict()`` of the model chunks, stored under the
keys Megatron-LM uses (``model`` for one chunk, ``model0..N`` with virtual pipeline stages). Each
tensor is stored once, under its global name and shape, so a checkpoint saved at one layout
loads at another (TP, PP, VPP and EP may all change). There is no optimizer, RNG or training
state. The bridge's own ``save_megatron_model`` is not used: importing it needs modelopt,
datasets, megatron-energon, tensorboard and more, which this CPU conversion path avoids.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mbridge_refit.plan.layout import ParallelLayout
from mbridge_refit.checkpoints.dcp_pickles import (
    INDEX_NAME,
    byte_items,
    check_byte_item,
    checked_megatron_reads,
    load_index,
)
from mbridge_refit.checkpoints.hf import COPIED_FILE_NAMES
from mbridge_refit.checkpoints.publish import begin_publication, carry_over, fsync_tree, is_loader_file

logger = logging.getLogger(__name__)

FORMAT_NAME = "mbridge_refit.checkpoints.megatron"
FORMAT_VERSION = 1

METADATA_NAME = "mbridge_refit_megatron.json"
TRACKER_NAME = "latest_checkpointed_iteration.txt"
WEIGHTS_DIR = "release"
TMP_PREFIX = ".tmp-"
COMMON_STATE_NAME = "common.pt"  # Megatron's legacy common state file (torch.load), never written by `import`
# Copied from the HF source next to the weights, so ``export`` needs nothing else.
SIDE_FILE_NAMES = ("config.json", *COPIED_FILE_NAMES)


class NotAMegatronCheckpoint(ValueError):
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
            raise NotAMegatronCheckpoint(f"{path} has no {METADATA_NAME}, so it is not a complete checkpoint of ours: {hint}")
        try:
            data = json.loads(meta.read_text())
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
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            if isinstance(err, NotAMegatronCheckpoint):
                raise
            raise NotAMegatronCheckpoint(f"{meta} is unreadable ({err}): re-create the checkpoint with `import`") from err
        for required in ("config.json", f"{WEIGHTS_DIR}/metadata.json", f"{WEIGHTS_DIR}/{INDEX_NAME}"):
            if not (path / required).is_file():
                raise NotAMegatronCheckpoint(f"{path} is incomplete: {required} is missing; re-create it with `import`")
        check_pickled_parts(path / WEIGHTS_DIR)
        return info


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
    for fqn, location in byte_items(index):
        try:
            with open(weights / location.relative_path, "rb") as handle:
                handle.seek(location.offset)
                check_byte_item(handle.read(location.length))
        except Exception as err:
            raise NotAMegatronCheckpoint(
                f"refusing {weights / location.relative_path}: its object {fqn} is not plain data "
                f"({type(err).__name__}: {err}); re-create the checkpoint from the HF source"
            ) from err


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


def sharded_model_state(chunks: list[torch.nn.Module]) -> dict[str, Any]:
    """``{"model" | "model<i>": chunk.sharded_state_dict()}`` for this rank's chunks."""
    from megatron.core.utils import unwrap_model

    unwrapped = unwrap_model(chunks)
    return {key: chunk.sharded_state_dict() for key, chunk in zip(model_keys(len(unwrapped)), unwrapped)}


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
            sharded_model_state(chunks), str(staging / WEIGHTS_DIR), sharded_strategy=_save_strategy(),
            content_metadata={"format": FORMAT_NAME},
        )
        dist.barrier()
        if publication.is_first_rank:
            for name in SIDE_FILE_NAMES:
                source = copy_files_from / name
                if source.is_file():
                    shutil.copyfile(source, staging / name)
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


def load_model(chunks: list[torch.nn.Module], path: Path) -> None:
    """Fill every parameter of ``chunks`` from the checkpoint in ``path``; collective.

    The chunks may use a different layout than the one saved. Raises if the checkpoint lacks a
    tensor the model needs or a tensor's global shape differs, or if a pickled part read now would
    build anything but checkpoint data (``dcp_pickles``), whatever passed ``check_pickled_parts`` before.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from megatron.core.utils import unwrap_model

    unwrapped = unwrap_model(chunks)
    with checked_megatron_reads():
        state = dist_checkpointing.load(
            sharded_model_state(unwrapped), str(path / WEIGHTS_DIR), strict=StrictHandling.RAISE_ALL
        )
    for key, chunk in zip(model_keys(len(unwrapped)), unwrapped):
        chunk.load_state_dict(state[key], strict=True)


def _save_strategy():
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

    class SyncTorchDistSaveStrategy(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir) -> None:
            sharded_state_dict, _, _ = _replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict, self.keep_only_main_replica
            )
            pyt_state_dict = mcore_to_pyt_state_dict(sharded_state_dict, False)
            dcp_save(
                pyt_state_dict,
                storage_writer=FileSystemWriter(str(checkpoint_dir), thread_count=self.thread_count),
                planner=MCoreSavePlanner(
                    dedup_replicated_tensors=not self.keep_only_main_replica,
                    flatten_state_dict=False,
                    flatten_sharded_tensors=False,
                ),
            )

    return SyncTorchDistSaveStrategy()
