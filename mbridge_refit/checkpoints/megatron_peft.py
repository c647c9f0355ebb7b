"""Megatron-Bridge PEFT training checkpoints on disk: which iteration, which LoRA, which adapter tensors.

A Megatron-Bridge run with ``cfg.peft`` set saves, every ``save_interval`` steps (``megatron.bridge.
training.checkpointing.save_checkpoint``)::

    SAVE/
      latest_checkpointed_iteration.txt   the last complete iteration (a number, or "release")
      latest_train_state.pt               torch.save of the train state (never read here)
      iter_0000100/                       torch_dist checkpoint (metadata.json, .metadata, *.distcp)
        run_config.yaml                   the whole ConfigContainer (model provider, peft, checkpoint, ...)
        train_state.pt                    (never read here)

Its model section holds only what ``PEFT.adapter_key_filter`` keeps (``...adapter.linear_in.weight``,
``...adapter.linear_out.weight``; ``_extra_state`` dropped), under Megatron-Core's global sharded keys
(``decoder.layers.self_attention.linear_qkv.adapter.linear_in.weight``, layers stacked): it loads at any
layout. Beside it lie the optimizer's states, RNG and rerun state: never read here.

``PeftCheckpoint.open`` finds the iteration directory (from ``SAVE`` through the tracker, or given),
reads ``run_config.yaml`` with ``yaml.SafeLoader`` (data only, as Megatron-Bridge reads it) and takes
the LoRA settings of its ``peft`` section; only Megatron-Bridge's plain ``LoRA`` is accepted. The file
must be what ``yaml.safe_dump`` writes of a tree: at most ``MAX_RUN_CONFIG_BYTES``, and no aliases or
anchors (``&``/``*``), which would let a file of under 1 kB stand for a tree of 10**12 values.
``adapter_keys`` lists the stored adapter tensors from the DCP index (``dcp_pickles``: nothing in it
runs code). Loading goes through ``checkpoints.megatron.load_weights``. Every refusal is a
``NotAPeftCheckpoint`` naming the file and the fix.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from mbridge_refit.checkpoints.megatron import NotAMegatronCheckpoint, StoredTensors, stored_in, tracked_iteration

__all__ = [
    "ADAPTER_MARK",
    "LORA_TARGET",
    "MAX_RUN_CONFIG_BYTES",
    "NotAPeftCheckpoint",
    "PeftCheckpoint",
    "RUN_CONFIG_NAME",
    "TRACKER_NAME",
    "base_mismatches",
    "is_adapter_key",
]

logger = logging.getLogger(__name__)

TRACKER_NAME = "latest_checkpointed_iteration.txt"
RUN_CONFIG_NAME = "run_config.yaml"
LORA_TARGET = "megatron.bridge.peft.lora.LoRA"
# A run's run_config.yaml is about 12 kB (the whole ConfigContainer); a thousand times that is no run's.
MAX_RUN_CONFIG_BYTES = 16 * 2**20
ADAPTER_MARK = ".adapter."
# The init methods Megatron-Bridge's ParallelLinearAdapter builds (peft.utils); any other raises
# NotImplementedError while the model is wrapped.
LORA_INIT_METHODS = frozenset({"xavier", "normal", "kaiming", "zero"})
# run_config.yaml's model section -> the provider field it is compared with (a wrong base shows here).
_BASE_FIELDS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "num_moe_experts",
    "moe_ffn_hidden_size",
    "vocab_size",
)
_MEGATRON_INDEX = ".metadata"


class NotAPeftCheckpoint(NotAMegatronCheckpoint):
    """The path holds no Megatron-Bridge LoRA checkpoint this reader can use; the message says why and the fix."""


def is_adapter_key(key: str) -> bool:
    """A stored (sharded) key of a LoRA adapter tensor."""
    return ADAPTER_MARK in key and "_extra_state" not in key


@dataclass(frozen=True, kw_only=True, slots=True)
class PeftCheckpoint:
    """One iteration of a Megatron-Bridge PEFT checkpoint.

    Attributes:
        weights: the iteration directory (the torch_dist checkpoint and its run_config.yaml).
        peft: the ``peft`` section of run_config.yaml (``_target_`` is ``LORA_TARGET``).
        model: the ``model`` section (the provider's fields as the run had them).
        stored: the index's tensors (all of them: adapters, optimizer states, ...).
    """

    weights: Path
    peft: dict[str, Any]
    model: dict[str, Any]
    stored: StoredTensors

    @classmethod
    def open(cls, path: Path) -> "PeftCheckpoint":
        """The checkpoint at ``path``: a save directory (its tracker names the iteration) or an iteration
        directory. Raises ``NotAPeftCheckpoint``."""
        weights = _iteration_dir(path)
        config = _run_config(weights)
        peft = config.get("peft")
        if peft is None:
            raise NotAPeftCheckpoint(
                f"{weights / RUN_CONFIG_NAME}: peft is null: the run trained the whole model, so the checkpoint "
                "holds no adapters; export its weights with `export` (a checkpoint written by `import`) or train "
                "with a LoRA config"
            )
        target = peft.get("_target_") if isinstance(peft, dict) else None
        if target != LORA_TARGET:
            raise NotAPeftCheckpoint(
                f"{weights / RUN_CONFIG_NAME}: peft is {target!r}; only {LORA_TARGET} adapters can be written as a "
                "PEFT LoRA checkpoint (DoRA and CanonicalLoRA are not supported)"
            )
        model = config.get("model")
        if not isinstance(model, dict):
            raise NotAPeftCheckpoint(f"{weights / RUN_CONFIG_NAME} has no model section: copy the run's own file")
        stored = stored_in(weights, fix="copy the iteration directory again from the training run")
        if stored.problems:
            raise NotAPeftCheckpoint(f"{weights} is damaged: {stored.problems[0]} ({len(stored.problems)} problem(s))")
        checkpoint = cls(weights=weights, peft=peft, model=model, stored=stored)
        if not checkpoint.adapter_keys():
            raise NotAPeftCheckpoint(
                f"{weights} stores no LoRA adapter tensor (no key with {ADAPTER_MARK!r} among {len(stored.tensors)}): "
                "it is not a checkpoint of a LoRA run; pass the run's own checkpoint directory"
            )
        return checkpoint

    def adapter_keys(self) -> dict[str, tuple[tuple[int, ...], Any]]:
        """key -> (global shape, dtype) of every stored adapter tensor."""
        return {key: value for key, value in self.stored.tensors.items() if is_adapter_key(key)}

    def adapter_bytes(self) -> int:
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in self.adapter_keys().values())

    def lora(self) -> Any:
        """Megatron-Bridge's ``LoRA`` with the run's settings (the plain-data fields of the peft section)."""
        from megatron.bridge.peft.lora import LoRA

        fields = {field.name for field in dataclasses.fields(LoRA) if field.init}
        settings = {k: v for k, v in self.peft.items() if k in fields and _plain(v)}
        if isinstance(settings.get("params_to_save"), (set, list)):
            settings["params_to_save"] = set(settings["params_to_save"])
        for name in ("lora_A_init_method", "lora_B_init_method"):  # LoRA takes any; wrapping the model refuses
            if name in settings and not (isinstance(settings[name], str) and settings[name] in LORA_INIT_METHODS):
                raise NotAPeftCheckpoint(
                    f"{self.weights / RUN_CONFIG_NAME}: peft.{name} is {settings[name]!r}, not one of "
                    f"{sorted(LORA_INIT_METHODS)} (Megatron-Bridge's adapters): copy the run's own file"
                )
        dropout = settings.get("dropout", 0.0)  # LoRA takes any; torch's Dropout refuses it while the model is wrapped
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout <= 1:
            raise NotAPeftCheckpoint(
                f"{self.weights / RUN_CONFIG_NAME}: peft.dropout is {dropout!r}, not a probability in [0, 1]: "
                "copy the run's own file"
            )
        try:
            return LoRA(**settings)
        except (TypeError, ValueError) as err:
            raise NotAPeftCheckpoint(
                f"{self.weights / RUN_CONFIG_NAME}: its peft section is not a LoRA: {err}"
            ) from err

    def keep(self, lora: Any) -> Callable[[str], bool]:
        """The state-dict names Megatron-Bridge saved for ``lora`` (its ``adapter_key_filter``, no ``_extra_state``)."""
        return lambda name: lora.adapter_key_filter(name) and "_extra_state" not in name


def base_mismatches(run_model: dict[str, Any], provider: Any) -> list[str]:
    """The model sizes the run's config and the base checkpoint's provider disagree on (a wrong base)."""
    problems = []
    for name in _BASE_FIELDS:
        trained, base = run_model.get(name), getattr(provider, name, None)
        if isinstance(trained, int) and isinstance(base, int) and trained != base:
            problems.append(f"{name}: the run trained {trained}, the base has {base}")
    return problems


def _iteration_dir(path: Path) -> Path:
    if not path.is_dir():
        raise NotAPeftCheckpoint(f"{path} is not a directory: pass a Megatron-Bridge save directory or its iter_*")
    if (path / _MEGATRON_INDEX).is_file():
        return path
    tracker = path / TRACKER_NAME
    if not tracker.is_file():
        hint = (
            "it is a checkpoint written by `import` (a full model, no adapters): use `export`"
            if (path / "mbridge_refit_megatron.json").is_file()
            else "pass the run's checkpoint.save directory (it holds latest_checkpointed_iteration.txt) or one of "
            "its iter_* directories"
        )
        raise NotAPeftCheckpoint(f"{path} holds neither {_MEGATRON_INDEX} nor {TRACKER_NAME}: {hint}")
    return tracked_iteration(path, tracker, _MEGATRON_INDEX, NotAPeftCheckpoint)


def _run_config(weights: Path) -> dict[str, Any]:
    import yaml

    path = weights / RUN_CONFIG_NAME
    if not path.is_file():
        raise NotAPeftCheckpoint(
            f"{weights} has no {RUN_CONFIG_NAME}, which holds the run's LoRA settings (alpha, targets): Megatron-Bridge "
            "writes it into every iteration directory; copy it from the training run"
        )
    size = path.stat().st_size
    if size > MAX_RUN_CONFIG_BYTES:
        raise NotAPeftCheckpoint(
            f"{path} has {size} bytes, more than the {MAX_RUN_CONFIG_BYTES} of any {RUN_CONFIG_NAME} Megatron-Bridge "
            "writes (about 12 kB): copy the run's own file"
        )
    try:
        config = yaml.load(path.read_text(), Loader=_tree_loader())
    except _AliasFound as err:
        raise NotAPeftCheckpoint(
            f"{path} uses YAML aliases (&/*), which Megatron-Bridge's {RUN_CONFIG_NAME} never does ({err}): copy the "
            "run's own file"
        ) from err
    except RecursionError as err:
        raise NotAPeftCheckpoint(
            f"{path} is nested deeper than the YAML reader follows, which Megatron-Bridge's {RUN_CONFIG_NAME} never "
            "is: copy the run's own file"
        ) from err
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise NotAPeftCheckpoint(f"{path} is not YAML Megatron-Bridge wrote ({err}): copy the run's own file") from err
    if not isinstance(config, dict):
        raise NotAPeftCheckpoint(f"{path} is not a mapping: copy the run's own file")
    return config


class _AliasFound(NotAPeftCheckpoint):
    """A YAML alias or anchor where ``_tree_loader`` reads (the message says where)."""


@functools.cache
def _tree_loader() -> type:
    """``yaml.SafeLoader`` that raises ``_AliasFound`` at the first alias or anchor: ``yaml.safe_dump``
    writes one only for an object shared within the data, which a config's tree never has, and an
    alias makes shared nodes that every later walk (``_plain``) visits once per path."""
    import yaml

    class TreeLoader(yaml.SafeLoader):
        def compose_node(self, parent: Any, index: Any) -> Any:
            event = self.peek_event()
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
                mark = event.start_mark
                raise _AliasFound(
                    f"{'*' if isinstance(event, yaml.AliasEvent) else '&'}{event.anchor} at line "
                    f"{mark.line + 1}, column {mark.column + 1}"
                )
            return super().compose_node(parent, index)

    return TreeLoader


def _plain(value: Any) -> bool:
    """YAML data a LoRA field may take as it is (no ``_target_`` object to build)."""
    if isinstance(value, dict):
        return "_target_" not in value and all(_plain(v) for v in value.values())
    if isinstance(value, (list, tuple, set)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (str, int, float, bool))
