"""Megatron training checkpoints of a whole model on disk: which iteration, which of its stored tensors are the model's.

Megatron-Bridge's ``save_checkpoint`` (``megatron.bridge.training.checkpointing``; Megatron-LM's is alike),
with ``ckpt_format: torch_dist``, writes every ``save_interval`` steps::

    SAVE/
      latest_checkpointed_iteration.txt   the last complete iteration (a number, or "release")
      latest_train_state.pt               torch.save of the train state (never read here)
      iter_0000100/                       torch_dist checkpoint (metadata.json, .metadata, __*_*.distcp)
        run_config.yaml                   the whole ConfigContainer (never read here)
        train_state.pt                    (never read here)

The torch_dist checkpoint holds ``generate_state_dict``'s state: ``model`` (``model0..N`` with virtual
pipeline stages), each chunk's ``sharded_state_dict()`` under Megatron-Core's global keys
(``decoder.layers.self_attention.linear_qkv.weight``, layers stacked: it loads at any layout), the optimizer's
tensors under ``optimizer.`` (``optimizer.state.exp_avg.<model key>``, ...), the RNG and rerun-machine state as
byte items (``rng_state``, ``rerun_state_machine_state``), and the rest (``checkpoint_version``, ``iteration``,
the scheduler's and optimizer's plain state) in the byte item ``common_state``. It holds no HF config, no HF
names and no tokenizer: ``convert export`` takes those from the HF checkpoint the run started from (``--hf``).

``TrainingCheckpoint.open`` finds the iteration directory (from ``SAVE`` through the tracker, or given), reads
the DCP index (``dcp_pickles``: nothing in it runs code), keeps the model's tensors (every stored tensor not
under ``optimizer.``) and checks, before any collective, the byte items a model load reads (``common_state``
and the model's ``_extra_state``): plain data (``check_byte_item``: only the globals of ``dcp_pickles``' own
``byte_item_table``, whatever torch's process-wide safe globals hold, among them Megatron-LM's ``argparse.Namespace``
of arguments, taking state only as a fresh instance, and Megatron's enums by value). The RNG
state (numpy arrays, Python's random state) and the optimizer's tensors and objects are never read. A LoRA run's checkpoint (adapter tensors only) is refused
naming ``export-adapter``. Every refusal is a ``NotATrainingCheckpoint`` naming the file and the fix.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from mbridge_refit.checkpoints.dcp_pickles import INDEX_NAME, ByteItemRefused, check_byte_items, load_index
from mbridge_refit.checkpoints.megatron import (
    METADATA_NAME,
    TRACKER_NAME,
    NotAMegatronCheckpoint,
    StoredTensors,
    stored_in,
    tracked_iteration,
)
from mbridge_refit.checkpoints.megatron_peft import is_adapter_key

__all__ = [
    "MODEL_BYTE_ITEMS",
    "NotATrainingCheckpoint",
    "TRAINING_STATE_PREFIXES",
    "TrainingCheckpoint",
    "is_training_checkpoint",
]

logger = logging.getLogger(__name__)

# Stored tensors of the training state, not of the model: Megatron-Core's optimizers name theirs so.
TRAINING_STATE_PREFIXES = ("optimizer.",)
# Byte items a model load reads besides the model's own ``_extra_state``: Megatron-Core loads the common state always
# (DCP keys it by its ShardedObject's unique key, ``common_state/shard_0_1``).
MODEL_BYTE_ITEMS = ("common_state",)
_FIX = "copy the iteration directory again from the training run"


class NotATrainingCheckpoint(NotAMegatronCheckpoint):
    """The path holds no Megatron training checkpoint of a whole model this reader can use; the message says why."""


def is_training_checkpoint(path: Path) -> bool:
    """``path`` looks like a training run's checkpoint (a tracker or a DCP index) rather than one of ``import``'s."""
    if (path / METADATA_NAME).is_file():
        return False
    return (path / TRACKER_NAME).is_file() or (path / INDEX_NAME).is_file()


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingCheckpoint:
    """One iteration of a Megatron training checkpoint.

    Attributes:
        weights: the iteration directory (the torch_dist checkpoint).
        stored: the model's tensors in the index (those under ``TRAINING_STATE_PREFIXES`` left out) and its
            byte items; ``problems`` as ``stored_in`` finds them.
        training_tensors: how many stored tensors are the training state's (never read).
    """

    weights: Path
    stored: StoredTensors
    training_tensors: int

    @classmethod
    def open(cls, path: Path) -> "TrainingCheckpoint":
        """The checkpoint at ``path``: a save directory (its tracker names the iteration) or an iteration
        directory. Raises ``NotATrainingCheckpoint``."""
        weights = _iteration_dir(path)
        everything = stored_in(weights, fix=_FIX)
        if everything.problems:
            raise NotATrainingCheckpoint(f"{weights} is damaged: {everything.problems[0]}: {_FIX}")
        if any(is_adapter_key(key) for key in everything.tensors):
            raise NotATrainingCheckpoint(
                f"{weights} stores LoRA adapter tensors: it is a LoRA run's checkpoint (the adapters only); write "
                "them as an HF PEFT adapter with `export-adapter --megatron ... --hf BASE`"
            )
        model = {k: v for k, v in everything.tensors.items() if not k.startswith(TRAINING_STATE_PREFIXES)}
        if not model:
            raise NotATrainingCheckpoint(f"{weights} stores no model tensor (only {len(everything.tensors)} others)")
        stored = replace(everything, tensors=model)
        _check_model_byte_items(weights)
        return cls(weights=weights, stored=stored, training_tensors=len(everything.tensors) - len(model))

    @property
    def params_dtype(self) -> torch.dtype:
        """The dtype most stored floating-point model tensors have (the run's parameter dtype)."""
        counts = Counter(dtype for _, dtype in self.stored.tensors.values() if dtype.is_floating_point)
        if not counts:
            raise NotATrainingCheckpoint(f"{self.weights} stores no floating-point model tensor")
        return counts.most_common(1)[0][0]


def _iteration_dir(path: Path) -> Path:
    if not path.is_dir():
        raise NotATrainingCheckpoint(f"{path} is not a directory: pass a training run's checkpoint.save or its iter_*")
    if (path / INDEX_NAME).is_file():
        return path
    tracker = path / TRACKER_NAME
    if not tracker.is_file():
        raise NotATrainingCheckpoint(
            f"{path} holds neither {INDEX_NAME} nor {TRACKER_NAME}: pass the run's checkpoint.save directory or one of "
            "its iter_* directories"
        )
    return tracked_iteration(path, tracker, INDEX_NAME, NotATrainingCheckpoint)


def _check_model_byte_items(weights: Path) -> None:
    """The byte items a model load reads are plain data (``check_byte_item``), read here before any collective."""
    index = load_index((weights / INDEX_NAME).read_bytes())
    try:
        check_byte_items(weights, index, keep=_read_by_a_model_load)
    except ByteItemRefused as refused:
        if refused.placed:
            raise NotATrainingCheckpoint(f"refusing {refused.path}: its object {refused.fqn}: {refused.reason}; {_FIX}")
        raise NotATrainingCheckpoint(
            f"refusing {refused.path}: its object {refused.fqn} is not plain data ({refused.reason}): reading it "
            f"would run its pickle; {_FIX}, or convert it with Megatron-Bridge's own tools where its code may run"
        ) from refused


def _read_by_a_model_load(fqn: str) -> bool:
    """Whether a model load reads the byte item ``fqn`` (the common state, the model's ``_extra_state``; never
    the RNG, rerun-machine and optimizer objects)."""
    return fqn.partition("/")[0] in MODEL_BYTE_ITEMS or "_extra_state" in fqn
