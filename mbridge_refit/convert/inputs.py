"""Checks of the command line's inputs that need no process group: same inputs, same verdict on
every rank, before any collective, so bad input ends all ranks with one message instead of a hang.

Each check raises ``BadInput`` naming the path, option or tensor and the fix, except an output this
user may not write (``OutputNotWritable``: the machine refuses, exit code 4 naming the path and the errno).
"""

from __future__ import annotations

import argparse
import errno
import os
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mbridge_refit.convert.exit_codes import BadInput
from mbridge_refit.convert.flags import describe_flags, layout_from_flags
from mbridge_refit.errors import RefitError
from mbridge_refit.plan.layout import LayoutError, ModelShape, ParallelLayout

if TYPE_CHECKING:
    import torch

__all__ = [
    "EXPERT_COUNTS",
    "MAX_SIZE",
    "OPTIONAL_SIZES",
    "OutputNotWritable",
    "REQUIRED_SIZES",
    "check_config_numbers",
    "check_distinct_dirs",
    "check_output_dir",
    "check_side_files",
    "check_provider",
    "check_tied_output",
    "checked_hf_input",
    "checked_layout",
    "checkpoint_float_dtype",
    "supported_config",
]


def checked_hf_input(args: argparse.Namespace) -> ParallelLayout:
    """``--hf`` is a readable HF checkpoint of a supported architecture, and the layout flags fit
    its model and the launched world size."""
    from mbridge_refit.checkpoints.hf import HFCheckpoint

    if not args.hf.is_dir():
        raise BadInput(f"input checkpoint directory {args.hf} does not exist (--hf)")
    if not (args.hf / "config.json").is_file():
        raise BadInput(f"{args.hf} has no config.json: --hf must be a Hugging Face checkpoint directory")
    try:
        HFCheckpoint.open(args.hf)
    except FileNotFoundError as err:
        raise BadInput(str(err)) from err
    return checked_layout(args, supported_config(args.hf, trust_remote_code=args.trust_remote_code))


def checked_layout(args: argparse.Namespace, config: Any) -> ParallelLayout:
    """The layout flags against the model (HF ``config``) and the launched world size."""
    from mbridge_refit.convert.session import LaunchEnv

    layout = layout_from_flags(args)
    check_config_numbers(config)
    try:
        layout.validate_model(ModelShape.from_hf_config(config))
        layout.validate_world_size(LaunchEnv.from_environ().world_size)
    except LayoutError as err:
        raise BadInput(f"layout {describe_flags(args)}: {err}") from err
    check_provider(config, layout)
    return layout


# Config fields that size a model: each must be a positive integer where the config has it (the
# first four in every config a bridge reads), so that nothing downstream divides by a string, and
# at most MAX_SIZE: the meta-device build still allocates a few small tensors on the CPU from these
# sizes (the rotary embedding's frequencies, from head_dim), and published models stay far below it
# (hidden sizes to 2**15, vocabularies to 2**18, context lengths to 2**23.3).
MAX_SIZE = 2**24
REQUIRED_SIZES = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size")
OPTIONAL_SIZES = (
    "intermediate_size",
    "num_key_value_heads",
    "head_dim",
    "moe_intermediate_size",
    "max_position_embeddings",
)
# Expert counts: 0 (or absent) on a dense model.
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok")


def check_config_numbers(config: Any) -> None:
    """The size fields of ``config`` (its text config for a vision-language model) are positive integers."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    problems = []
    for name in (*REQUIRED_SIZES, *OPTIONAL_SIZES, *EXPERT_COUNTS):
        value = getattr(text, name, None)
        if value is None and name not in REQUIRED_SIZES:
            continue
        values = value if isinstance(value, list) and value and name not in REQUIRED_SIZES else [value]  # per modality
        least = 0 if name in EXPERT_COUNTS else 1
        if any(isinstance(v, bool) or not isinstance(v, int) or not least <= v <= MAX_SIZE for v in values):
            problems.append(f"{name}={value!r}")
    if problems:
        where = getattr(config, "_name_or_path", "") or "the checkpoint"
        raise BadInput(
            f"config.json of {where}: {', '.join(problems)}: each must be an integer from 1 (expert counts: 0) to "
            f"{MAX_SIZE}. Fix config.json "
            "(it must be the config the weights were saved with)"
        )


def check_provider(config: Any, layout: ParallelLayout) -> None:
    """Megatron-Core accepts the sizes of ``config`` at ``layout``: the bridge's provider is
    finalised here, where Megatron-Core's own checks of the sizes (heads and groups dividing,
    ...) run, before any process group. A provider the bridge cannot make at all is left to the
    model build, which raises it again where it is reported as the bridge's failure."""
    import torch

    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.models.builder import BuildOptions, configure_provider

    try:
        provider = RefitBridge.from_hf_config(config).to_megatron_provider(load_weights=False)
    except Exception:  # not a size check: see the docstring
        return
    try:
        configure_provider(provider, layout, BuildOptions(device=torch.device("cpu"), weights_only=True))
    except (ValueError, AssertionError, ZeroDivisionError) as err:
        where = getattr(config, "_name_or_path", "") or "the checkpoint"
        raise BadInput(
            f"config.json of {where} describes no model Megatron-Core can build at layout {layout.name} "
            f"({type(err).__name__}: {err}). Fix config.json (it must be the config the weights were saved with)"
        ) from err


def check_tied_output(checkpoint_dir: Path, *, trust_remote_code: bool = False) -> None:
    """A config that ties the output layer to the embedding, over a checkpoint that stores an output
    weight of its own differing from the embedding, is refused (``RefitBridge.check_tied_output``:
    ``TiedOutputError``, exit 2) before any process group; every rank reads the two tensors alike.
    A provider the bridge cannot make is left to the model build (as in ``check_provider``)."""
    from mbridge_refit.bridge import RefitBridge

    config = supported_config(checkpoint_dir, trust_remote_code=trust_remote_code)
    try:
        bridge = RefitBridge.from_hf_config(config)
        provider = bridge.to_megatron_provider(load_weights=False)
    except Exception:  # not this check's to report: see the docstring
        return
    bridge.check_tied_output(checkpoint_dir, provider)


class OutputNotWritable(RefitError, OSError):
    """A directory where the output must be made that this user may not write (``errno`` EACCES, or
    EROFS on a read-only filesystem): the machine's refusal (an ``OSError``: exit code 4), found on
    every rank alike."""


def check_output_dir(out: Path, overwrite: bool) -> None:
    """Before any model is loaded: the output is a directory (or absent; a symlink is written
    through to the directory it points to) we may write, no other writer holds it, it is empty
    unless ``overwrite``, with no leftover of a killed run unless ``overwrite``.

    The writer checks again under the output's lock (``checkpoints.publish``); this look only
    ends a doomed run before its model is loaded."""
    from mbridge_refit.checkpoints.output_lock import LockFileError, held_by
    from mbridge_refit.checkpoints.publish import (
        busy_error,
        leftover_error,
        output_target,
        placement_problem,
    )

    try:
        out.resolve(strict=False)
    except (OSError, RuntimeError) as err:  # a symlink loop
        raise BadInput(f"output path {out} cannot be resolved ({err}): point it at a directory") from err
    target = output_target(out)
    if target.exists() and not target.is_dir():
        raise BadInput(f"output path {out} exists and is not a directory")
    problem = placement_problem(target, overwrite=overwrite)
    if problem is not None:
        raise BadInput(problem)
    leftover = leftover_error(out)  # listed before the look at the lock: a writer's own staging is then held
    try:
        holder = held_by(target) if target.parent.is_dir() else None
    except LockFileError as err:
        raise BadInput(str(err)) from err
    if holder is not None:
        raise BadInput(busy_error(out, holder))
    if leftover and not overwrite:
        raise BadInput(leftover.replace("overwrite=True (--overwrite)", "--overwrite"))
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise BadInput(f"output directory {out} exists and is not empty: pass --overwrite to replace it")
    # the lock, the staging directory and the swap are made in the target's parent (its first existing
    # ancestor); an existing target's old content is removed after the swap
    parent = next((p for p in target.parents if p.exists()), Path("/"))
    if not parent.is_dir():
        raise BadInput(f"output path {out} runs through {parent}, which is not a directory: choose another output")
    for place in (parent, target) if target.exists() else (parent,):
        if not os.access(place, os.W_OK | os.X_OK):
            number = errno.EROFS if os.statvfs(place).f_flag & os.ST_RDONLY else errno.EACCES
            raise OutputNotWritable(number, f"{os.strerror(number)} (the output {out} is made here)", str(place))


def check_side_files(source: Path, flag: str) -> None:
    """The files a write copies from ``source`` beside the weights (``checkpoints.side_files``) are
    regular files inside it: a crafted checkpoint cannot make the output carry a file from elsewhere."""
    from mbridge_refit.checkpoints.megatron import SIDE_FILE_NAMES
    from mbridge_refit.checkpoints.side_files import side_file_problems

    problems = side_file_problems(source, SIDE_FILE_NAMES)
    if problems:
        raise BadInput(f"{flag} {source}: {'; '.join(problems)}")


def check_distinct_dirs(source: Path, source_flag: str, out: Path, out_flag: str) -> None:
    """``out`` is neither ``source`` nor inside it nor around it: replacing the output would otherwise
    drop or move files of the input (an export into its input's ``release/`` folder removed its weights)."""
    source_dir, out_dir = Path(os.path.realpath(source)), Path(os.path.realpath(out))
    if out_dir == source_dir:
        raise BadInput(f"{out_flag} must differ from {source_flag}")
    if out_dir.is_relative_to(source_dir) or source_dir.is_relative_to(out_dir):
        raise BadInput(
            f"{out_flag} {out} and {source_flag} {source} lie one inside the other: writing the output would replace "
            "files of the input; choose an output directory outside the input"
        )


def supported_config(checkpoint_dir: Path, *, trust_remote_code: bool = False) -> Any:
    """The checkpoint's HF config, if Megatron-Bridge has a bridge for its architecture (read by
    ``checkpoints.hf.load_config``: the checkpoint's own code runs only with ``trust_remote_code``)."""
    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.checkpoints.hf import RemoteCodeError, load_config

    try:
        config = load_config(checkpoint_dir, trust_remote_code=trust_remote_code)
    except RemoteCodeError as err:
        raise BadInput(str(err)) from err
    except (ValueError, KeyError, OSError) as err:
        raise BadInput(f"cannot read {checkpoint_dir}/config.json: {err}") from err
    try:
        RefitBridge._validate_config(config, str(checkpoint_dir))
    except ValueError as err:
        architectures = getattr(config, "architectures", None)
        supported = ", ".join(sorted(RefitBridge.list_supported_models()))
        raise BadInput(
            f"unsupported architecture {architectures} in {checkpoint_dir}/config.json: Megatron-Bridge has no bridge "
            f"for it. Supported: {supported}"
        ) from err
    return config


def checkpoint_float_dtype(checkpoint: Any) -> "torch.dtype":
    """The params dtype of a model loaded from ``checkpoint`` (an ``HFCheckpoint``): the dtype its
    config.json names (``"dtype"``, or the older ``"torch_dtype"``) where some floating-point
    tensor of the checkpoint is stored in it, so that a mixed-dtype checkpoint loads into the wider
    dtype once its config asks for it (the loader's fix for a lossy cast); otherwise (no dtype named,
    or one no tensor has, e.g. float32 in the config of a bfloat16 checkpoint) the dtype of most
    floating-point tensors."""
    counts = Counter(checkpoint.dtype(name) for name in checkpoint.names())
    floating = [(n, d) for d, n in counts.items() if d.is_floating_point]
    if not floating:
        raise BadInput(f"checkpoint {checkpoint.path} has no floating-point tensors")
    declared = _config_dtype(checkpoint.config() or {})
    if declared is not None and declared in counts:
        return declared
    return max(floating, key=lambda item: item[0])[1]


def _config_dtype(config: dict[str, Any]) -> "torch.dtype | None":
    """The floating-point dtype config.json names (``"dtype"``, else ``"torch_dtype"``), or None."""
    import torch

    name = config.get("dtype", config.get("torch_dtype"))
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None
