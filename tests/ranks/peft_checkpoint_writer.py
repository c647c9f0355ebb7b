"""Writes a Megatron-Bridge LoRA training checkpoint, and what it must convert to; run by tests/test_export_adapter.py.

Usage: peft_checkpoint_writer.py --hf BASE --result DIR [--tp N --pp N]

Every rank builds the base model from BASE, wraps it with Megatron-Bridge's ``LoRA(dim=4, alpha=8)``
and gives every adapter random values (B included). Then, as a PEFT run's ``save_checkpoint`` saves:
Megatron-Bridge's ``generate_state_dict`` filtered by its ``apply_peft_adapter_filter_to_state_dict`` (restated),
saved with Megatron-Core's ``dist_checkpointing.save`` (torch_dist, the CPU writer of
``checkpoints.megatron``: stock's needs CUDA) into DIR/save/iter_0000001, run_config.yaml beside it (the
provider and the LoRA serialised by Megatron-Bridge's own config serialiser and YAML dumper), the tracker naming it.
Beside it, the oracles, from the live model:

  DIR/merged       the merged export (RefitBridge, bit for bit stock's: tests/test_lora.py), an HF checkpoint;
  DIR/expected1    stock ``AutoBridge.save_hf_adapter`` of the same model (the PEFT checkpoint to match).

Then the adapters change (an optimizer step) and iteration 2 is saved the same way, with DIR/expected2.
"""

from __future__ import annotations

import json
import shutil
import sys
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rank_checks import checker_parser, checkpoint_session  # noqa: E402

from mbridge_refit.convert.flags import layout_from_flags  # noqa: E402

RANK, ALPHA = 4, 8


def seed_adapters(chunks) -> None:
    from megatron.core import parallel_state as ps

    for name, param in ((n, p) for c in chunks for n, p in c.named_parameters() if ".adapter." in n):
        key = f"{ps.get_pipeline_model_parallel_rank()}/{name}/{ps.get_tensor_model_parallel_rank()}"
        generator = torch.Generator().manual_seed(zlib.crc32(key.encode()))
        with torch.no_grad():
            param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float32).to(param.dtype) * 0.1)


def save_like_megatron_bridge(chunks, lora, provider, save: Path, step: int) -> None:
    """What ``save_checkpoint`` writes for a PEFT run, without optimizer and RNG state. Its module needs
    modelopt, so its two steps are restated from Megatron-Bridge 0.6.2: ``generate_state_dict``
    (``checkpoint_version``, ``iteration``, ``model`` / ``model<i>`` = each chunk's ``sharded_state_dict()``)
    and ``apply_peft_adapter_filter_to_state_dict`` (a model section keeps what ``adapter_key_filter`` keeps,
    without ``_extra_state``)."""
    from megatron.bridge.training.utils.config_utils import _ConfigContainerBase
    from megatron.bridge.utils.yaml_utils import dump_dataclass_to_yaml
    from megatron.core import dist_checkpointing

    from mbridge_refit.checkpoints.megatron import cpu_save_strategy, model_keys

    state = {"checkpoint_version": 3.0, "iteration": step}
    for key, chunk in zip(model_keys(len(chunks)), chunks):
        state[key] = {
            name: item
            for name, item in chunk.sharded_state_dict().items()
            if lora.adapter_key_filter(name) and "_extra_state" not in name
        }
    iteration = save / f"iter_{step:07d}"
    if dist.get_rank() == 0:
        iteration.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(state, str(iteration), sharded_strategy=cpu_save_strategy())
    dist.barrier()
    if dist.get_rank() == 0:
        run_config = {
            "model": _ConfigContainerBase._convert_value_to_dict(provider),
            "peft": _ConfigContainerBase._convert_value_to_dict(lora),
            "checkpoint": {"save": str(save), "ckpt_format": "torch_dist", "save_optim": False, "save_rng": False},
        }
        dump_dataclass_to_yaml(run_config, str(iteration / "run_config.yaml"))  # as ConfigContainer.to_yaml
        (save / "latest_checkpointed_iteration.txt").write_text(str(step))
    dist.barrier()


def write_merged(bridge, chunks, base: Path, out: Path) -> None:
    from safetensors.torch import save_file

    tensors = {name: tensor.detach().clone() for name, tensor in bridge.export_hf_weights(chunks, cpu=True)}
    if dist.get_rank() == 0:
        out.mkdir()
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        shutil.copyfile(base / "config.json", out / "config.json")
    dist.barrier()


def main() -> None:
    args = checker_parser().parse_args()
    with checkpoint_session(args.hf, layout_from_flags(args), torch.float32) as (bridge, chunks):
        from megatron.bridge import AutoBridge
        from megatron.bridge.peft.lora import LoRA

        lora = LoRA(dim=RANK, alpha=ALPHA)
        chunks = lora(chunks, training=True)
        seed_adapters(chunks)
        provider = bridge.to_megatron_provider(load_weights=False)
        stock = AutoBridge.from_hf_pretrained(args.hf)
        save = args.result / "save"
        save_like_megatron_bridge(chunks, lora, provider, save, 1)
        write_merged(bridge, chunks, args.hf, args.result / "merged")
        stock.save_hf_adapter(chunks, args.result / "expected1", peft_config=lora, show_progress=False)
        with torch.no_grad():
            for param in (p for c in chunks for n, p in c.named_parameters() if ".adapter." in n):
                param.add_(0.03)
        save_like_megatron_bridge(chunks, lora, provider, save, 2)
        stock.save_hf_adapter(chunks, args.result / "expected2", peft_config=lora, show_progress=False)
        if dist.get_rank() == 0:
            (args.result / "done.json").write_text(json.dumps({"saved": sorted(p.name for p in save.iterdir())}))


if __name__ == "__main__":
    main()
