"""``convert export-adapter``: a Megatron-Bridge LoRA training checkpoint -> an HF PEFT adapter checkpoint.

Reads the adapters of a PEFT run (``checkpoints.megatron_peft``: the iteration, run_config.yaml's
LoRA, the stored adapter tensors) onto the model of the base HF checkpoint ``--hf`` at any layout
(the stored tensors are global: the layout the run saved at does not matter), and writes
``adapter_model.safetensors`` + ``adapter_config.json`` with PEFT's names through
``RefitBridge.save_hf_adapter`` (Megatron-Bridge's writer fed by our adapter export). The output is
published crash-safely (``checkpoints.publish``): built beside ``--out``, fsynced, swapped in.

Refused before any collective (exit 2, the problem and the fix named): a path that is no PEFT
checkpoint (no tracker or index, a full-model run, our own ``import`` output), a PEFT other than
plain LoRA, a missing run_config.yaml, a base whose sizes differ from the run's, adapter tensors
whose shapes or dtypes do not fit the base model.
"""

from __future__ import annotations

import argparse
import datetime
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mbridge_refit.convert.exit_codes import BadInput, ExitCode
from mbridge_refit.convert.flags import (
    add_layout_flags,
    add_overwrite_flag,
    add_remote_code_flag,
    add_timeout_flag,
    timeout_from_flag,
)
from mbridge_refit.convert.inputs import check_distinct_dirs, check_output_dir, checked_layout, supported_config
from mbridge_refit.plan.layout import ParallelLayout

__all__ = [
    "AdapterArgs",
    "DESCRIPTION",
    "HELP",
    "add_export_adapter_parser",
    "cmd_export_adapter",
    "run_export_adapter",
]

logger = logging.getLogger(__name__)

HELP = "Megatron-Bridge LoRA training checkpoint -> HF PEFT adapter (adapter_model.safetensors, adapter_config.json)"
DESCRIPTION = (
    "Read the LoRA adapters of a Megatron-Bridge PEFT training checkpoint (--megatron: the run's checkpoint.save "
    "directory, whose latest_checkpointed_iteration.txt names the iteration, or one iter_* directory; the LoRA "
    "settings come from its run_config.yaml) onto the model of the base HF checkpoint --hf, at --tp/--pp/... (any "
    "layout, whatever the run saved at; default one rank), and write an HF PEFT adapter to --out: "
    "adapter_model.safetensors with PEFT's names (base_model.model....lora_A.weight / lora_B.weight) and "
    "adapter_config.json (r, lora_alpha, target_modules). Load it with peft.PeftModel.from_pretrained(base, OUT). "
    "Only the adapter tensors are read (no optimizer, RNG or train state; no pickle beyond the checked DCP index); "
    "the base model's weights are not read (its config and dtype are). Only Megatron-Bridge's LoRA is supported."
)
_EXAMPLE = """\
example:
  python -m mbridge_refit.convert export-adapter \\
      --megatron /runs/qwen3-lora/checkpoints --hf /ckpt/Qwen3-8B --out /ckpt/qwen3-8b-lora

exit codes: 0 ok, 2 bad input (no LoRA checkpoint, no run_config.yaml, a wrong base, an existing --out
            without --overwrite: the message names the fix), 3 internal error, 4 environment (disk full, ...)
"""


@dataclass(frozen=True, kw_only=True, slots=True)
class AdapterArgs:
    """A checked ``export-adapter``."""

    megatron: Path
    hf: Path
    out: Path
    layout: ParallelLayout
    overwrite: bool
    base_name: str
    timeout: datetime.timedelta
    trust_remote_code: bool = False


def add_export_adapter_parser(sub: Any) -> None:
    parser = sub.add_parser(
        "export-adapter",
        help=HELP,
        description=DESCRIPTION,
        epilog=_EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument(
        "--megatron",
        type=Path,
        required=True,
        help="Megatron-Bridge PEFT checkpoint: the run's checkpoint.save directory (latest iteration) or an iter_* "
        "directory",
    )
    parser.add_argument(
        "--hf", type=Path, required=True, help="the base HF checkpoint the run fine-tuned (config.json is read)"
    )
    parser.add_argument("--out", type=Path, required=True, help="output PEFT adapter directory")
    parser.add_argument(
        "--base-model-name",
        default=None,
        help="base_model_name_or_path written into adapter_config.json (default: the --hf path as given)",
    )
    add_overwrite_flag(parser)
    add_layout_flags(parser)
    add_remote_code_flag(parser)
    add_timeout_flag(parser)


def cmd_export_adapter(args: argparse.Namespace) -> int:
    from mbridge_refit.checkpoints.megatron_peft import PeftCheckpoint

    if not args.hf.is_dir():
        raise BadInput(f"base checkpoint directory {args.hf} does not exist (--hf)")
    PeftCheckpoint.open(args.megatron)  # refused here, before any collective, with the fix
    layout = checked_layout(args, supported_config(args.hf, trust_remote_code=args.trust_remote_code))
    for source, flag in ((args.megatron, "--megatron"), (args.hf, "--hf")):
        check_distinct_dirs(source, flag, args.out, "--out")
    check_output_dir(args.out, args.overwrite)
    options = AdapterArgs(
        megatron=args.megatron,
        hf=args.hf,
        out=args.out,
        layout=layout,
        overwrite=args.overwrite,
        base_name=args.base_model_name if args.base_model_name is not None else str(args.hf),
        timeout=timeout_from_flag(args),
        trust_remote_code=args.trust_remote_code,
    )
    return run_export_adapter(options)


def run_export_adapter(options: AdapterArgs) -> int:
    """Build the base model at ``options.layout`` (CPU, gloo), wrap it with the run's LoRA, load the adapters,
    write the PEFT checkpoint; collective."""
    import torch

    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.checkpoints.hf import HFCheckpoint
    from mbridge_refit.checkpoints.megatron import load_weights
    from mbridge_refit.checkpoints.megatron_peft import PeftCheckpoint
    from mbridge_refit.convert.inputs import checkpoint_float_dtype
    from mbridge_refit.convert.session import distributed_session
    from mbridge_refit.models.builder import BuildOptions, build_model

    cpu = torch.device("cpu")
    checkpoint = PeftCheckpoint.open(options.megatron)
    params_dtype = checkpoint_float_dtype(HFCheckpoint.open(options.hf))
    with distributed_session(options.layout, device=cpu, timeout=options.timeout):
        bridge = RefitBridge.from_hf_pretrained(options.hf, trust_remote_code=options.trust_remote_code)
        _check_base(checkpoint, bridge, options.hf)
        lora = checkpoint.lora()
        build = BuildOptions(device=cpu, params_dtype=params_dtype)
        _check_fit(checkpoint, _wrapped_on_meta(bridge, options.layout, build, lora), lora)
        chunks = lora(build_model(bridge, options.layout, build), training=True)  # as the run wrapped it
        load_weights(chunks, checkpoint.weights, keep=checkpoint.keep(lora), fix="pass the run's own checkpoint")
        logger.info("loaded %d adapter tensors from %s", len(checkpoint.adapter_keys()), checkpoint.weights)
        _write_adapter(bridge, chunks, lora, options)
    logger.info("wrote the PEFT adapter to %s (layout %s)", options.out, options.layout.name)
    return ExitCode.OK


def _check_base(checkpoint: Any, bridge: Any, hf: Path) -> None:
    from mbridge_refit.checkpoints.megatron_peft import base_mismatches

    problems = base_mismatches(checkpoint.model, bridge.to_megatron_provider(load_weights=False))
    if problems:
        raise BadInput(
            f"--hf {hf} is not the base the run fine-tuned ({'; '.join(problems)}): pass the base checkpoint the run "
            f"started from (its run_config.yaml: {checkpoint.weights / 'run_config.yaml'})"
        )


def _wrapped_on_meta(bridge: Any, layout: Any, build: Any, lora: Any) -> list:
    """The model ``lora`` wraps, built and wrapped on the meta device: the fit is checked before any memory
    is given to the base or to adapters of a damaged ``dim`` (a rank of millions would take GiBs)."""
    import dataclasses

    import torch

    from mbridge_refit.models.builder import build_model

    meta = build_model(bridge, layout, dataclasses.replace(build, materialize=False))
    with torch.device("meta"):
        return lora(meta, training=True)


def _check_fit(checkpoint: Any, chunks: list, lora: Any) -> None:
    """Every adapter tensor of the model is stored with its global shape and dtype (a wrong base, a wrong r)."""
    from mbridge_refit.checkpoints.megatron import fit_problems, model_tensors

    wanted, _ = model_tensors(chunks, checkpoint.keep(lora))
    problems = fit_problems(wanted, frozenset(), checkpoint.stored)
    if not wanted:
        problems = [f"the LoRA of run_config.yaml ({lora.target_modules}) adapts no module of the base model"]
    if problems:
        raise BadInput(
            f"the adapters in {checkpoint.weights} do not fit the base model ({len(problems)} problem(s), e.g. "
            f"{problems[:3]}): pass the base checkpoint and run_config.yaml of the run that saved them"
        )


def _write_adapter(bridge: Any, chunks: list, lora: Any, options: AdapterArgs) -> None:
    """Megatron-Bridge's adapter writer (fed by RefitBridge's export) into a staging directory, published
    crash-safely: ``--out`` holds the old or the new adapter, never a part."""
    from mbridge_refit.checkpoints.publish import begin_publication, carry_over, fsync_tree, is_loader_file

    publication = begin_publication(options.out, overwrite=options.overwrite, distributed=True)
    try:
        bridge.save_hf_adapter(
            chunks,
            publication.staging,
            peft_config=lora,
            base_model_name_or_path=options.base_name,
            show_progress=False,
        )
        if publication.is_first_rank:
            if options.overwrite:
                carry_over(publication.target, publication.staging, is_loader_file)
            fsync_tree(publication.staging)
            publication.swap_in()
    except BaseException:
        publication.abandon()
        raise
