"""A real model whose fast-path export has one flipped byte: its conformance cells must say so.

Usage: conformance_corruption_check.py --architecture NAME --result FILE

Wraps ``RefitBridge.export_hf_weights`` so that the sixth tensor it yields (BF16 and FP8 streams
alike) has one bit flipped, runs ``testing.conformance.check_architecture`` at TP1 on CPU, and
writes the cells to FILE for test_conformance.py to read.
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--architecture", required=True)
    parser.add_argument("--result", type=Path, required=True)
    args = parser.parse_args()
    RefitBridge.export_hf_weights = corrupting(RefitBridge.export_hf_weights)
    cpu = torch.device("cpu")
    with distributed_session(ParallelLayout(), device=cpu, timeout=datetime.timedelta(minutes=2)):
        cells = conformance.check_architecture(args.architecture, "tp1", device=cpu)
    args.result.write_text(json.dumps([cell.to_json() for cell in cells]))


if __name__ == "__main__":
    main()
