"""The export-to-checkpoint path that ``roundtrip`` and ``export`` share.

``write_hf_checkpoint`` builds the output dtypes (the source checkpoint's, or with FP8 the e4m3
weights, their scales and a ``quantization_config``), then drains ``RefitBridge.export_hf_weights``
through an adapter (cast or match against the source's names) into a ``ShardedSafetensorsWriter``.
Collective: every rank of the model calls it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping

from mbridge_refit.convert.exit_codes import BadInput
from mbridge_refit.fp8.format import FP8_DTYPE, BlockwiseFP8Config, FP8FormatError
from mbridge_refit.sinks import ShardedSafetensorsWriter, drain

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

Stream = Iterable[tuple[str, "torch.Tensor"]]


def write_hf_checkpoint(
    bridge: Any, chunks: list, *, out: Path, source_dtypes: Mapping[str, "torch.dtype"], fp8: BlockwiseFP8Config | None,
    adapt: Callable[[Stream, Mapping[str, "torch.dtype"]], Stream], copy_files_from: Path, max_shard_bytes: int,
    overwrite: bool, show_progress: bool,
) -> int:
    """Export ``chunks`` into an HF checkpoint at ``out``; returns the tensors written."""
    dtypes, config_overrides = output_dtypes(bridge, chunks, source_dtypes, fp8)
    sink = ShardedSafetensorsWriter(
        out_dir=out, max_shard_bytes=max_shard_bytes, overwrite=overwrite, copy_files_from=copy_files_from,
        config_overrides=config_overrides,
    )
    stream = bridge.export_hf_weights(chunks, show_progress=show_progress, fp8=fp8)
    return drain(adapt(stream, dtypes), sink)


def cast_to_dtypes(stream: Stream, dtypes: Mapping[str, "torch.dtype"]) -> Iterator[tuple[str, "torch.Tensor"]]:
    """Give every exported tensor named in ``dtypes`` that dtype (a no-op when they agree)."""
    for name, tensor in stream:
        dtype = dtypes.get(name)
        if dtype is not None and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        yield name, tensor


def output_dtypes(
    bridge: Any, chunks: list, source_dtypes: Mapping[str, "torch.dtype"], fp8: BlockwiseFP8Config | None
) -> tuple[dict, dict | None]:
    """(dtype of every tensor to write, config.json overrides): the source checkpoint's dtypes,
    and with ``fp8`` the FP8 weights and their scales plus the ``quantization_config``.

    Builds the export plan (collective); FP8 problems surface here, on every rank alike, before
    any tensor moves.
    """
    if fp8 is None:
        return dict(source_dtypes), None
    try:
        plan = bridge.export_plan(chunks, fp8=fp8)
    except FP8FormatError as err:
        raise BadInput(f"cannot write an FP8 checkpoint: {err}") from err
    scales = [e for e in plan.entries if e.scale_of is not None]
    changed = {e.hf_name: e.torch_dtype for e in plan.entries if e.scale_of is not None or e.torch_dtype == FP8_DTYPE}
    logger.info("FP8 blockwise: %d of %d tensors quantized", len(scales), len(plan.entries) - len(scales))
    return {**source_dtypes, **changed}, {"quantization_config": fp8.quantization_config(plan)}
