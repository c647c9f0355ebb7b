"""The subcommands of ``python -m mbridge_refit.convert``, one function each (``cmd_<name>``).

``make-tiny`` (random test checkpoints), ``roundtrip`` (HF -> Megatron -> HF in memory),
``import`` / ``export`` (HF <-> a Megatron checkpoint on disk, see ``checkpoint`` modules),
``plan`` (what an export yields) and ``verify`` (compare two HF checkpoints). Each validates its
input on every rank before the first collective (``inputs``), then runs (``run_<name>``); a
command that loads weights builds its model on the meta device first and compares it with the
checkpoint before giving it memory (``preflight``).
Returns an ``ExitCode``; raises ``BadInput`` for input that cannot work.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mbridge_refit.checkpoints.hf import INDEX_NAME
from mbridge_refit.convert.exit_codes import BadInput, ExitCode
from mbridge_refit.convert.flags import device_from_flag, fp8_from_flags, progress_from_flags, timeout_from_flag
from mbridge_refit.convert.inputs import (
    check_distinct_dirs,
    check_output_dir,
    check_side_files,
    check_tied_output,
    checked_hf_input,
    checked_layout,
    checkpoint_float_dtype,
    supported_config,
)
from mbridge_refit.convert.session import LaunchEnv
from mbridge_refit.convert.summary import write_summary
from mbridge_refit.convert.writing import write_hf_checkpoint
from mbridge_refit.plan.layout import ParallelLayout
from mbridge_refit.sinks.safetensors import DEFAULT_MAX_SHARD_BYTES

if TYPE_CHECKING:
    import torch

    from mbridge_refit.fp8.format import BlockwiseFP8Config

__all__ = [
    "ImportArgs",
    "WriteArgs",
    "cmd_export",
    "cmd_import",
    "cmd_make_tiny",
    "cmd_plan",
    "cmd_roundtrip",
    "cmd_verify",
    "format_plan",
    "run_export",
    "run_import",
    "run_roundtrip",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class WriteArgs:
    """A checked ``roundtrip`` or ``export``: its source (an HF or a Megatron checkpoint), the HF
    checkpoint to write, the layout, and how to write it."""

    source: Path
    out: Path
    layout: ParallelLayout
    overwrite: bool
    max_shard_bytes: int
    show_progress: bool
    timeout: datetime.timedelta
    fp8: "BlockwiseFP8Config | None" = None
    device: "torch.device | None" = None  # roundtrip only: export is CPU-only
    trust_remote_code: bool = False  # --trust-remote-code: the checkpoint's own code may run
    hf: Path | None = None  # export of a training run's checkpoint: the HF checkpoint it started from (--hf)

    @property
    def side_files(self) -> Path:
        """Where config.json and the tokenizer files come from: ``--hf`` where given, else the source."""
        return self.hf if self.hf is not None else self.source


# --- make-tiny ---------------------------------------------------------------------------------


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from mbridge_refit.models import recipes

    if args.list:
        for name, recipe in recipes.MODEL_RECIPES.items():
            print(f"model   {name:20s} {recipe.description}")
        for name, layout in recipes.LAYOUTS.items():
            print(f"layout  {name:20s} world size {layout.expected_world_size}")
        return ExitCode.OK
    if args.out is None:
        raise BadInput("make-tiny needs --out DIR")
    try:
        recipe = recipes.get_model_recipe(args.recipe or recipes.DEFAULT_MODEL)
    except (KeyError, ValueError) as err:
        raise BadInput(str(err)) from err
    check_output_dir(args.out, args.overwrite)
    path = recipes.make_random_checkpoint(
        recipe, args.out, seed=args.seed, max_shard_bytes=args.max_shard_bytes, overwrite=args.overwrite
    )
    logger.info("wrote %s checkpoint to %s", recipe.name, path)
    return ExitCode.OK


# --- verify ------------------------------------------------------------------------------------


def cmd_verify(args: argparse.Namespace) -> int:
    from mbridge_refit.checkpoints.hf import HFCheckpoint, compare_checkpoints

    start = time.monotonic()
    for path in (args.a, args.b):
        if not path.is_dir():
            raise BadInput(f"checkpoint directory {path} does not exist")
    try:
        differences = compare_checkpoints(args.a, args.b)
        tensors = [len(HFCheckpoint.open(path).names()) for path in (args.a, args.b)]
    except FileNotFoundError as err:
        raise BadInput(str(err)) from err
    code = ExitCode.DIFFERENCES if differences else ExitCode.OK
    if differences:
        print(f"{len(differences)} difference(s) between {args.a} and {args.b}:")
        for line in differences:
            print(f"  {line}")
    else:
        print(f"identical: {args.a} and {args.b} (names, shapes, dtypes and bytes)")
    if LaunchEnv.from_environ().rank == 0:
        write_summary(
            {
                "command": "verify",
                "ok": code == ExitCode.OK,
                "exit_code": int(code),
                "a": {"path": os.path.abspath(args.a), "tensors": tensors[0]},
                "b": {"path": os.path.abspath(args.b), "tensors": tensors[1]},
                "exact": not differences,
                "differences": differences,
                "seconds": round(time.monotonic() - start, 3),
            }
        )
    return code


# --- roundtrip ---------------------------------------------------------------------------------


def cmd_roundtrip(args: argparse.Namespace) -> int:
    options = _validate_roundtrip(args)
    return run_roundtrip(options)


def _validate_roundtrip(args: argparse.Namespace) -> WriteArgs:
    """Every check that needs no process group: same inputs, same verdict on every rank."""
    layout = checked_hf_input(args)
    check_side_files(args.hf, "--hf")
    check_distinct_dirs(args.hf, "--hf", args.out, "--out")
    check_output_dir(args.out, args.overwrite)
    return _write_args(args, source=args.hf, layout=layout, device=device_from_flag(args))


def _write_args(args: argparse.Namespace, **checked) -> WriteArgs:
    return WriteArgs(
        out=args.out,
        overwrite=args.overwrite,
        max_shard_bytes=args.max_shard_bytes if args.max_shard_bytes is not None else DEFAULT_MAX_SHARD_BYTES,
        show_progress=progress_from_flags(args),
        timeout=timeout_from_flag(args),
        fp8=fp8_from_flags(args),
        trust_remote_code=args.trust_remote_code,
        **checked,
    )


def run_roundtrip(options: WriteArgs) -> int:
    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.checkpoints.hf import HFCheckpoint
    from mbridge_refit.convert.preflight import build_checked, check_hf_source
    from mbridge_refit.convert.session import distributed_session
    from mbridge_refit.models.builder import BuildOptions

    start = time.monotonic()
    checkpoint = HFCheckpoint.open(options.source)
    checkpoint.validate()  # every file readable and agreeing with the index, before any collective
    check_tied_output(options.source, trust_remote_code=options.trust_remote_code)
    with distributed_session(options.layout, device=options.device, timeout=options.timeout) as env:
        bridge = RefitBridge.from_hf_pretrained(options.source, trust_remote_code=options.trust_remote_code)
        build = BuildOptions(device=options.device, params_dtype=checkpoint_float_dtype(checkpoint), weights_only=True)
        chunks = build_checked(bridge, options.layout, build, lambda meta: check_hf_source(bridge, meta, checkpoint))
        report = bridge.load_hf_shards(chunks, options.source, show_progress=options.show_progress)
        logger.info("loaded %d slices (%.1f MB on this rank)", report.tensors_written, report.bytes_read / 1e6)
        source_dtypes = {name: checkpoint.dtype(name) for name in checkpoint.names()}
        timing = _Timing("roundtrip", start, loaded=time.monotonic())
        return _write_hf(bridge, chunks, options, source_dtypes, only_source_names=False, env=env, timing=timing)


@dataclass(frozen=True, slots=True)
class _Timing:
    """When a ``roundtrip`` or ``export`` started and had its model loaded (``time.monotonic``)."""

    command: str
    start: float
    loaded: float


def _write_hf(
    bridge, chunks, options: WriteArgs, source_dtypes, *, only_source_names: bool, env: LaunchEnv, timing: _Timing
) -> int:
    """The HF checkpoint at ``options.out`` from the loaded ``chunks`` (collective), logged and
    summarized (``--json``); exit code 0."""
    rank = env.rank
    count = write_hf_checkpoint(
        bridge,
        chunks,
        out=options.out,
        source_dtypes=source_dtypes,
        fp8=options.fp8,
        only_source_names=only_source_names,
        copy_files_from=options.side_files,
        max_shard_bytes=options.max_shard_bytes,
        overwrite=options.overwrite,
        show_progress=options.show_progress and rank == 0,
    )
    logger.info("wrote %d tensors to %s (layout %s)", count, options.out, options.layout.name)
    if rank == 0:
        written = time.monotonic()
        index = json.loads((options.out / INDEX_NAME).read_text())
        write_summary(
            {
                "command": timing.command,
                "ok": True,
                "exit_code": int(ExitCode.OK),
                "source": os.path.abspath(options.source),
                "out": os.path.abspath(options.out),
                "layout": options.layout.name,
                "world_size": env.world_size,
                "fp8": options.fp8 is not None,
                "tensors": count,
                "bytes": index["metadata"]["total_size"],
                "files": sorted(p.name for p in options.out.iterdir()),
                "seconds": {
                    "load": round(timing.loaded - timing.start, 3),
                    "export_write": round(written - timing.loaded, 3),
                    "total": round(written - timing.start, 3),
                },
            }
        )
    return ExitCode.OK


# --- import / export ----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class ImportArgs:
    """A checked ``import``: the HF checkpoint to read, the Megatron checkpoint to write."""

    hf: Path
    megatron: Path
    layout: ParallelLayout
    overwrite: bool
    timeout: datetime.timedelta
    trust_remote_code: bool = False  # --trust-remote-code: the checkpoint's own code may run
    show_progress: bool = False  # the progress bar of the load, on rank 0


def cmd_import(args: argparse.Namespace) -> int:
    layout = checked_hf_input(args)
    check_side_files(args.hf, "--hf")
    check_distinct_dirs(args.hf, "--hf", args.megatron, "--megatron")
    check_output_dir(args.megatron, args.overwrite)
    return run_import(
        ImportArgs(
            hf=args.hf,
            megatron=args.megatron,
            layout=layout,
            overwrite=args.overwrite,
            timeout=timeout_from_flag(args),
            trust_remote_code=args.trust_remote_code,
            show_progress=progress_from_flags(args),
        )
    )


def cmd_export(args: argparse.Namespace) -> int:
    from mbridge_refit.checkpoints.megatron import (
        CheckpointInfo,
        NotAMegatronCheckpoint,
    )
    from mbridge_refit.checkpoints.megatron_training import is_training_checkpoint

    if not args.megatron.is_dir():
        raise BadInput(f"input checkpoint directory {args.megatron} does not exist (--megatron)")
    if is_training_checkpoint(args.megatron):
        return run_export(_checked_training_export(args))
    if args.hf is not None:
        raise BadInput(
            f"--hf is for a training run's checkpoint, but --megatron {args.megatron} has no tracker or index of one: "
            "drop --hf (a checkpoint of `import` carries its HF config)"
        )
    try:
        CheckpointInfo.read(args.megatron)
    except NotAMegatronCheckpoint as err:
        raise BadInput(f"--megatron {args.megatron}: {err}") from err
    layout = checked_layout(args, supported_config(args.megatron, trust_remote_code=args.trust_remote_code))
    check_side_files(args.megatron, "--megatron")
    check_distinct_dirs(args.megatron, "--megatron", args.out, "--out")
    check_output_dir(args.out, args.overwrite)
    return run_export(_write_args(args, source=args.megatron, layout=layout))


def _checked_training_export(args: argparse.Namespace) -> WriteArgs:
    """An export of a training run's checkpoint (``checkpoints.megatron_training``): its weights, and from
    ``--hf`` (the HF checkpoint the run started from) the config, the tensor names and dtypes, the tokenizer."""
    from mbridge_refit.checkpoints.megatron_training import NotATrainingCheckpoint, TrainingCheckpoint

    if args.hf is None:
        raise BadInput(
            f"--megatron {args.megatron} is a training run's checkpoint, which holds no HF config, tensor names or "
            "tokenizer: pass --hf HF_DIR, the HF checkpoint the run started from (its weights are not read)"
        )
    try:
        training = TrainingCheckpoint.open(args.megatron)
    except NotATrainingCheckpoint as err:
        raise BadInput(f"--megatron {args.megatron}: {err}") from err
    layout = checked_hf_input(args)
    check_side_files(args.hf, "--hf")
    for path, flag in ((args.megatron, "--megatron"), (args.hf, "--hf")):
        check_distinct_dirs(path, flag, args.out, "--out")
    check_output_dir(args.out, args.overwrite)
    return _write_args(args, source=training.weights, layout=layout, hf=args.hf)


def run_import(options: ImportArgs) -> int:
    """HF -> Megatron checkpoint on CPU (gloo); every rank saves its own shards."""
    import torch

    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.checkpoints.hf import HFCheckpoint
    from mbridge_refit.checkpoints.megatron import CheckpointInfo, save_model
    from mbridge_refit.convert.preflight import build_checked, check_hf_source
    from mbridge_refit.convert.session import distributed_session
    from mbridge_refit.models.builder import BuildOptions

    cpu = torch.device("cpu")
    checkpoint = HFCheckpoint.open(options.hf)
    checkpoint.validate()
    check_tied_output(options.hf, trust_remote_code=options.trust_remote_code)
    info = CheckpointInfo(
        saved_layout=options.layout,
        params_dtype=checkpoint_float_dtype(checkpoint),
        hf_dtypes={name: checkpoint.dtype(name) for name in checkpoint.names()},
        source=str(options.hf.resolve()),
    )
    with distributed_session(options.layout, device=cpu, timeout=options.timeout):
        bridge = RefitBridge.from_hf_pretrained(options.hf, trust_remote_code=options.trust_remote_code)
        build = BuildOptions(device=cpu, params_dtype=info.params_dtype, weights_only=True)
        chunks = build_checked(bridge, options.layout, build, lambda meta: check_hf_source(bridge, meta, checkpoint))
        report = bridge.load_hf_shards(chunks, options.hf, show_progress=options.show_progress)
        logger.info("loaded %d slices (%.1f MB on this rank)", report.tensors_written, report.bytes_read / 1e6)
        save_model(chunks, options.megatron, info=info, copy_files_from=options.hf, overwrite=options.overwrite)
    logger.info("wrote a Megatron checkpoint (layout %s) to %s", options.layout.name, options.megatron)
    return ExitCode.OK


def run_export(options: WriteArgs) -> int:
    """Megatron checkpoint -> HF on CPU (gloo), at ``options.layout`` (may differ from the saved one): one of
    ``import``'s, or a training run's iteration (``options.hf`` names the HF checkpoint it started from)."""
    import torch

    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.checkpoints.hf import load_config
    from mbridge_refit.convert.preflight import build_checked
    from mbridge_refit.convert.session import distributed_session
    from mbridge_refit.models.builder import BuildOptions

    start = time.monotonic()
    cpu = torch.device("cpu")
    source = _export_source(options)
    with distributed_session(options.layout, device=cpu, timeout=options.timeout) as env:
        # Config only: the checkpoint holds no HF weights; the names to write come from `source.hf_dtypes`.
        bridge = RefitBridge.from_hf_config(
            load_config(options.side_files, trust_remote_code=options.trust_remote_code)
        )
        build = BuildOptions(device=cpu, params_dtype=source.params_dtype, weights_only=True)
        chunks = build_checked(bridge, options.layout, build, source.check)
        source.load(chunks, show_progress=options.show_progress and env.rank == 0)
        logger.info("loaded %s (%s) at layout %s", options.source, source.description, options.layout.name)
        timing = _Timing("export", start, loaded=time.monotonic())
        return _write_hf(bridge, chunks, options, source.hf_dtypes, only_source_names=True, env=env, timing=timing)


@dataclass(frozen=True, slots=True)
class _ExportSource:
    """What ``run_export`` reads: the model's dtype, the HF names and dtypes to write, the meta-model check
    (``preflight``) and the load."""

    params_dtype: "torch.dtype"
    hf_dtypes: dict
    description: str
    check: object  # chunks (meta) -> None, raises on a misfit
    load: object  # (chunks, *, show_progress) -> None


def _export_source(options: WriteArgs) -> _ExportSource:
    from functools import partial

    from mbridge_refit.checkpoints.megatron import CheckpointInfo, load_model, load_weights
    from mbridge_refit.convert.preflight import check_megatron_source

    if options.hf is None:
        info = CheckpointInfo.read(options.source)
        return _ExportSource(
            params_dtype=info.params_dtype,
            hf_dtypes=info.hf_dtypes,
            description=f"saved at layout {info.saved_layout.name}",
            check=lambda meta: check_megatron_source(meta, options.source),
            load=partial(load_model, path=options.source),
        )
    from mbridge_refit.checkpoints.hf import HFCheckpoint
    from mbridge_refit.checkpoints.megatron_training import TrainingCheckpoint

    training = TrainingCheckpoint.open(options.source)
    names = HFCheckpoint.open(options.hf)
    fix = "copy the iteration directory again from the training run, or pass the --hf it started from"
    return _ExportSource(
        params_dtype=training.params_dtype,
        hf_dtypes={name: names.dtype(name) for name in names.names()},
        description=f"a training checkpoint, {training.training_tensors} training-state tensors left unread",
        check=lambda meta: check_megatron_source(meta, options.source, stored=training.stored),
        load=partial(load_weights, weights=options.source, fix=fix, keep=_everything),
    )


def _everything(name: str) -> bool:
    """``load_weights``' ``keep`` for a training checkpoint: every model entry, the stored training state not asked for."""
    return True


# --- plan --------------------------------------------------------------------------------------


def cmd_plan(args: argparse.Namespace) -> int:
    import torch

    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.checkpoints.hf import HFCheckpoint
    from mbridge_refit.convert.session import distributed_session
    from mbridge_refit.fp8.format import FP8FormatError
    from mbridge_refit.models.builder import BuildOptions, build_model

    layout = checked_hf_input(args)
    if args.json is not None and not args.json.parent.is_dir():
        raise BadInput(f"directory {args.json.parent} for --json does not exist")
    fp8 = fp8_from_flags(args)
    cpu = torch.device("cpu")
    dtype = checkpoint_float_dtype(HFCheckpoint.open(args.hf))
    with distributed_session(layout, device=cpu, timeout=timeout_from_flag(args)) as env:
        bridge = RefitBridge.from_hf_pretrained(args.hf, trust_remote_code=args.trust_remote_code)
        chunks = build_model(
            bridge, layout, BuildOptions(device=cpu, params_dtype=dtype, materialize=False, weights_only=True)
        )
        try:
            plan = bridge.export_plan(chunks, fp8=fp8)
        except FP8FormatError as err:
            raise BadInput(f"cannot plan an FP8 export: {err}") from err
        if env.rank == 0:
            print(format_plan(plan))
            if args.json is not None:
                tmp = args.json.with_name(f".{args.json.name}.tmp")
                tmp.write_text(plan.to_json())
                tmp.replace(args.json)
                logger.info("wrote %s", args.json)
    return ExitCode.OK


def format_plan(plan) -> str:
    """One line per HF tensor: name, shape, dtype, bytes, stage, source mesh, placements."""
    header = f"{'hf_name':60s} {'shape':>16s} {'dtype':>9s} {'bytes':>12s} {'pp/vpp':>6s} {'mesh':>14s}  placements"
    lines = [header]
    for e in plan.entries:
        mesh = "x".join(f"{dim}{size}" for dim, size in zip(e.sharding.mesh_dims, e.sharding.mesh_shape))
        owner = f" owner ep{e.sharding.owner_ep_rank}" if e.sharding.owner_ep_rank is not None and plan.ep > 1 else ""
        alias = f" (same data as {e.alias_of})" if e.alias_of else ""
        lines.append(
            f"{e.hf_name:60s} {str(list(e.shape)):>16s} {e.dtype:>9s} {e.nbytes:12d} {e.pp_rank:>4d}/{e.vpp_stage:<1d} "
            f"{mesh:>14s}  {', '.join(e.sharding.placements)}{owner}{alias}"
        )
    layers = ", ".join(f"{layer}:{pp}/{vpp}" for layer, (pp, vpp) in plan.layer_map.items())
    lines.append(f"{len(plan.entries)} tensors, {plan.total_bytes} bytes; layer -> pp/vpp: {layers}")
    return "\n".join(lines)
