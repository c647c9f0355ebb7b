"""A real model whose fast-path export is wrong: its conformance cells must say so.

Usage: conformance_corruption_check.py --architecture NAME --result FILE

Runs ``testing.conformance.check_architecture`` at TP1 on CPU twice, with a mutant each time, and
writes the cells of both runs to FILE for test_conformance.py to read:

1. ``RefitBridge.export_hf_weights`` yields its sixth tensor (BF16 and FP8 streams alike) with one
   bit flipped;
2. the export unchanged, the LoRA cells on, and LoRA's fast path broken twice: adapted weights leave
   unmerged (``AdapterExport.merged`` passes the base buckets through) and the adapter export drops
   its last factor (``AdapterExport.stream``). The BF16 and FP8 cells stay exact; both LoRA cells
   must end in ``different``.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch

from mbridge_refit.bridge import RefitBridge
from mbridge_refit.convert.session import distributed_session
from mbridge_refit.plan.layout import ParallelLayout
from mbridge_refit.runtime.lora import AdapterExport
from mbridge_refit.testing import conformance

CORRUPTED_INDEX = 5


def corrupting(export):
    def export_with_a_flipped_bit(self, *args, **kwargs):
        for index, (name, tensor) in enumerate(export(self, *args, **kwargs)):
            if index == CORRUPTED_INDEX:
                tensor = tensor.clone()
                tensor.reshape(-1).view(torch.uint8)[3] ^= 1
            yield name, tensor

    return export_with_a_flipped_bit


def unmerged(self, buckets, buffers):
    """``AdapterExport.merged`` that forgets to merge (the factors still exported, as a collective)."""
    self.factors()
    yield from buckets


def dropping_the_last_factor(stream):
    def stream_without_its_last(self):
        yield from list(stream(self))[:-1]

    return stream_without_its_last


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--architecture", required=True)
    parser.add_argument("--result", type=Path, required=True)
    args = parser.parse_args()
    export = RefitBridge.export_hf_weights
    cpu = torch.device("cpu")
    with distributed_session(ParallelLayout(), device=cpu, timeout=datetime.timedelta(minutes=2)):
        RefitBridge.export_hf_weights = corrupting(export)
        cells = conformance.check_architecture(args.architecture, "tp1", device=cpu)
        RefitBridge.export_hf_weights = export
        AdapterExport.merged = unmerged
        AdapterExport.stream = dropping_the_last_factor(AdapterExport.stream)
        cells += conformance.check_architecture(args.architecture, "tp1", device=cpu, lora=True)
    args.result.write_text(json.dumps([cell.to_json() for cell in cells]))


if __name__ == "__main__":
    main()
