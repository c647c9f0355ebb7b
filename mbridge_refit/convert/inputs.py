"""Checks of the command line's inputs that need no process group: same inputs, same verdict on
every rank, before any collective, so bad input ends all ranks with one message instead of a hang.

Each check raises ``BadInput`` naming the path, option or tensor and the fix.
"""

from __future__ import annotations

import argparse
import os
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mbridge_refit.convert.exit_codes import BadInput
from mbridge_refit.convert.flags import describe_flags, layout_from_flags
from mbridge_refit.plan.layout import LayoutError, ModelShape, ParallelLayout

if TYPE_CHECKING:
    import torch


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
    from mbridge_refit.tools.launch import LaunchEnv

    layout = layout_from_flags(args)
    try:
        layout.validate_model(ModelShape.from_hf_config(config))
        layout.validate_world_size(LaunchEnv.from_environ().world_size)
    except LayoutError as err:
        raise BadInput(f"layout {describe_flags(args)}: {err}") from err
    return layout


def check_output_dir(out: Path, overwrite: bool) -> None:
    """Before any model is loaded: the output is a directory (or absent; a symlink is written
    through to the directory it points to) we may write, no other writer holds it, it is empty
    unless ``overwrite``, with no leftover of a killed run unless ``overwrite``.

    The writer checks again under the output's lock (``checkpoints.publish``); this look only
    ends a doomed run before its model is loaded."""
    from mbridge_refit.checkpoints.output_lock import held_by
    from mbridge_refit.checkpoints.publish import busy_error, leftover_error, output_target

    target = output_target(out)
    if target.exists() and not target.is_dir():
        raise BadInput(f"output path {out} exists and is not a directory")
    leftover = leftover_error(out)  # listed before the look at the lock: a writer's own staging is then held
    holder = held_by(target) if target.parent.is_dir() else None
    if holder is not None:
        raise BadInput(busy_error(out, holder))
    if leftover and not overwrite:
        raise BadInput(leftover.replace("overwrite=True (--overwrite)", "--overwrite"))
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise BadInput(f"output directory {out} exists and is not empty: pass --overwrite to replace it")
    parent = next((p for p in (target, *target.parents) if p.exists()), Path("."))
    if not os.access(parent, os.W_OK | os.X_OK):
        raise BadInput(f"cannot write {out}: {parent} is not writable; choose another output directory")


def check_distinct_dirs(source: Path, source_flag: str, out: Path, out_flag: str) -> None:
    if out.resolve() == source.resolve():
        raise BadInput(f"{out_flag} must differ from {source_flag}")


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
    """The dtype of most floating-point tensors in the checkpoint (used as the params dtype)."""
    counts = Counter(checkpoint.dtype(name) for name in checkpoint.names())
    floating = [(n, d) for d, n in counts.items() if d.is_floating_point]
    if not floating:
        raise BadInput(f"checkpoint {checkpoint.path} has no floating-point tensors")
    return max(floating, key=lambda item: item[0])[1]
