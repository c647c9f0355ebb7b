"""Writes a Megatron-Bridge training checkpoint of a whole model, and what it must export to; run by
tests/test_training_checkpoint.py.

Usage: training_checkpoint_writer.py --hf BASE --result DIR [--tp N --pp N]

Every rank builds the model from BASE and changes every weight (a stand-in for training steps, so that the
checkpoint's weights are not BASE's), then saves iteration 2 as Megatron-Bridge 0.6.2's ``save_checkpoint``
saves it with ``ckpt_format: torch_dist``, ``save_optim`` and ``save_rng`` on. Its module imports modelopt and
its torch_dist writer needs CUDA, so its steps are restated: ``generate_state_dict`` (``checkpoint_version``
3.0, ``iteration``, ``model`` / ``model<i>`` = each chunk's ``sharded_state_dict()``, ``optimizer`` = Adam's
states as Megatron-Core's ``optim_state_to_sharding_state`` keys them, ``optimizer.state.<name>.<model key>``,
with its param groups, ``opt_param_scheduler``, ``rng_state`` as ``get_rng_state`` builds it for torch_dist:
a ``ShardedObject`` of Python's, numpy's and torch's RNG states over (pp, tp), the dp rank its replica id),
saved with Megatron-Core's ``dist_checkpointing.save`` and the content metadata
``_build_sharded_state_dict_metadata`` gives (the CPU writer of ``checkpoints.megatron``: the same torch_dist
format through torch's synchronous DCP writer); then, on rank 0, ``train_state.pt`` (torch.save), its copy
``latest_train_state.pt``, the tracker naming the iteration, and ``run_config.yaml`` (the provider and the
checkpoint settings serialised by Megatron-Bridge's own config serialiser and YAML dumper, ``peft`` null).

The same checkpoint with Megatron-LM's ``args`` in its common state goes to DIR/save_lm_args. The oracle, from
the live model before the save: stock ``AutoBridge.export_hf_weights`` of the changed model,
as DIR/expected/model.safetensors.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rank_checks import change_weights, checker_parser, checkpoint_session  # noqa: E402

from mbridge_refit.convert.flags import layout_from_flags  # noqa: E402

STEP = 2
ADAM_STATES = ("exp_avg", "exp_avg_sq")


def optimizer_state(model_state: dict) -> dict:
    """Adam's states of every model tensor, keyed as Megatron-Core's ``make_sharded_optimizer_tensor`` keys
    them (``optimizer.state.<name>.<model key>``, the model tensor's sharding, fp32), and its param groups."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    generator = torch.Generator().manual_seed(1000 + dist.get_rank())
    state: dict = {}
    params = [item for item in nested_values(model_state) if isinstance(item, (ShardedTensor, ShardedTensorFactory))]
    for number, item in enumerate(params):
        state[number] = {
            name: dataclasses.replace(
                item,
                key=f"optimizer.state.{name}.{item.key}",
                data=torch.rand(item.data.shape, generator=generator, dtype=torch.float32),
                **({"dtype": torch.float32} if isinstance(item, ShardedTensor) else {}),
            )
            for name in ADAM_STATES
        }
    groups = [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "params": list(range(len(params)))}]
    return {"state": state, "param_groups": groups}


def rng_state():
    """``get_rng_state``'s ShardedObject for torch_dist without expert parallelism (no CUDA states on CPU)."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    states = [
        {
            "random_rng_state": random.getstate(),
            "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
        }
    ]
    shape = (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size())
    offset = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank())
    return ShardedObject(
        "rng_state", states, shape, offset, replica_id=ps.get_data_parallel_rank(with_context_parallel=True)
    )


def save_like_megatron_bridge(chunks, provider, save: Path, *, megatron_lm_args: bool = False) -> None:
    """``save_checkpoint``'s files (module docstring); ``megatron_lm_args`` adds what Megatron-LM's own
    ``generate_state_dict`` stores beside them, its ``argparse.Namespace`` of arguments, to the common state."""
    from megatron.bridge.training.utils.config_utils import _ConfigContainerBase
    from megatron.bridge.utils.yaml_utils import dump_dataclass_to_yaml
    from megatron.core import dist_checkpointing

    from mbridge_refit.checkpoints.megatron import cpu_save_strategy, model_keys

    state: dict = {"checkpoint_version": 3.0, "iteration": STEP}
    for key, chunk in zip(model_keys(len(chunks)), chunks):
        state[key] = chunk.sharded_state_dict()
    state["optimizer"] = optimizer_state({key: state[key] for key in model_keys(len(chunks))})
    state["opt_param_scheduler"] = {"max_lr": 3e-4, "min_lr": 3e-5, "lr_warmup_steps": 0, "num_steps": STEP * 8}
    state["rng_state"] = rng_state()
    if megatron_lm_args:
        state["args"] = argparse.Namespace(tensor_model_parallel_size=2, ckpt_format="torch_dist", lr=3e-4)
    iteration = save / f"iter_{STEP:07d}"
    if dist.get_rank() == 0:
        iteration.mkdir(parents=True)
    dist.barrier()
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    dist_checkpointing.save(state, str(iteration), sharded_strategy=cpu_save_strategy(), content_metadata=metadata)
    dist.barrier()
    if dist.get_rank() == 0:
        train_state = {"step": torch.tensor(STEP), "consumed_train_samples": torch.tensor(STEP * 8)}
        train_state["floating_point_operations_so_far"] = torch.tensor(1.0e12, dtype=torch.float32)
        torch.save(train_state, iteration / "train_state.pt")
        shutil.copy(iteration / "train_state.pt", save / "latest_train_state.pt")
        (save / "latest_checkpointed_iteration.txt").write_text(str(STEP))
        run_config = {
            "model": _ConfigContainerBase._convert_value_to_dict(provider),
            "peft": None,
            "checkpoint": {"save": str(save), "ckpt_format": "torch_dist", "save_optim": True, "save_rng": True},
        }
        dump_dataclass_to_yaml(run_config, str(iteration / "run_config.yaml"))  # as ConfigContainer.to_yaml
    dist.barrier()


def main() -> None:
    from safetensors.torch import save_file

    args = checker_parser().parse_args()
    with checkpoint_session(args.hf, layout_from_flags(args)) as (bridge, chunks):
        expected = change_weights(bridge, chunks)  # stock's export of the changed, live model: the oracle
        provider = bridge.to_megatron_provider(load_weights=False)
        save_like_megatron_bridge(chunks, provider, args.result / "save")
        save_like_megatron_bridge(chunks, provider, args.result / "save_lm_args", megatron_lm_args=True)
        if dist.get_rank() == 0:
            (args.result / "expected").mkdir()
            save_file(
                {n: t.contiguous() for n, t in expected.items()}, str(args.result / "expected" / "model.safetensors")
            )
            saved = sorted(str(p.relative_to(args.result)) for p in (args.result / "save").rglob("*"))
            (args.result / "done.json").write_text(json.dumps({"saved": saved}))
        dist.barrier()


if __name__ == "__main__":
    main()
