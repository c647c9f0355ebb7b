"""GPU check: export from a model trained by Megatron DDP with the distributed optimizer, right after a step.

    torchrun --nproc-per-node 1 scripts/check_ddp_export_gpu.py --out-dir DIR

For ``overlap_param_gather`` off and on, on a Qwen3 shape (``--model``, ``--layers``) built with
Megatron's TE spec in bf16:

1. the trainer: the model wrapped by Megatron DDP (``use_distributed_optimizer``,
   ``overlap_grad_reduce``, fp32 gradient buffers) and Megatron's distributed optimizer (Adam,
   the only one it supports; fp32 main parameters beside the bf16 model parameters);
2. one step on a real loss (next-token cross-entropy on seeded random tokens): forward,
   backward, ``finish_grad_sync``, ``optimizer.step()``; the export runs right after the step,
   before any forward pass (with ``overlap_param_gather`` that is when Megatron's parameter
   all-gather is still deferred);
3. the oracle, read back from the optimizer, not from the trainer's model: its fp32 main
   parameters after the step (``shard_fp32_from_float16_groups``, matched to the model
   parameters by ``model_float16_groups``, each rank's ranges joined over the data-parallel
   group), rounded to bf16 as Megatron's copy to the model
   does, written into a second model of the same shape without DDP, and exported by stock
   ``AutoBridge.export_hf_weights``.

Checks (exit 1 on any failure): RefitBridge's export after the step equals the oracle bit for
bit for every tensor; it differs from the pre-step export in every tensor the step changed (a
check that an export of pre-step weights fails); with ``overlap_param_gather`` the export found
deferred gathers and completed them. One data-parallel replica per GPU, each training on its
own tokens: with two or more, ``model_params_stale_before_export`` counts the parameters that
still held pre-step values on the rank when the export started (the stale read it prevents);
with one GPU the deferred gather has no other rank to fetch from, so that count is 0. Writes
``ddp_export_<model>.json`` (with its manifest, rank 0's results and every rank's ok) to --out-dir.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from provenance import results_dir, write_result

LR = 1e-3


def build(bridge, layout, ddp_config=None):
    from mbridge_refit.models.builder import BuildOptions, configure_provider

    options = BuildOptions(device=torch.device("cuda"), params_dtype=torch.bfloat16)
    provider = configure_provider(bridge.to_megatron_provider(load_weights=False), layout, options)
    if ddp_config is None:
        return provider.provide_distributed_model(wrap_with_ddp=False, mixed_precision_wrapper=None)
    return provider.provide_distributed_model(wrap_with_ddp=True, ddp_config=ddp_config, bf16=True)


def exported(bridge, chunks, stock: bool = False) -> dict[str, torch.Tensor]:
    stream = bridge.export_hf_weights_stock(chunks) if stock else bridge.export_hf_weights(chunks, show_progress=False)
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in stream}


def unwrapped_params(chunks) -> dict[str, torch.nn.Parameter]:
    from megatron.core.utils import unwrap_model

    return {f"{i}.{name}": p for i, chunk in enumerate(unwrap_model(chunks)) for name, p in chunk.named_parameters()}


def train_step(chunks, optimizer, vocab: int, seed: int) -> float:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    tokens = torch.randint(0, vocab, (2, 65), generator=gen).cuda()
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(inputs.shape[1], device="cuda").unsqueeze(0).expand_as(inputs)
    optimizer.zero_grad()
    for chunk in chunks:
        chunk.zero_grad_buffer()
    losses = chunks[0](inputs, positions, None, labels=labels)
    loss = losses.float().mean()
    loss.backward()
    for chunk in chunks:
        chunk.finish_grad_sync()
    ok, _, _ = optimizer.step()
    if not ok:
        raise RuntimeError("optimizer.step() reported an unsuccessful update")
    return float(loss)


def optimizer_main_params(optimizer, trainer_params: dict) -> dict[str, torch.Tensor]:
    """Parameter name -> the distributed optimizer's fp32 main parameter after its step, whole.

    Read from the optimizer's own groups: each data-parallel rank holds the main values of its
    range of each parameter (``_get_model_param_range_map``); the ranges are joined by an
    all-reduce of their bits (int32, zero elsewhere: exact, -0 kept). Collective over the
    data-parallel group, every parameter in name order."""
    local: dict[str, list] = {}
    group = None
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        group = opt.data_parallel_group
        name_of = {id(p): name for name, p in trainer_params.items()}
        for model_group, main_group in zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups):
            for model_param, main in zip(model_group, main_group):
                piece = opt._get_model_param_range_map(model_param)["param"]
                local.setdefault(name_of[id(model_param)], []).append((piece.start, piece.end, main.detach()))
    mains = {}
    for name in sorted(trainer_params):
        bits = torch.zeros(trainer_params[name].numel(), dtype=torch.int32, device="cuda")
        for start, end, main in local.get(name, []):
            bits[start:end] = main.reshape(-1).view(torch.int32)
        dist.all_reduce(bits, group=group)
        mains[name] = bits.view(torch.float32)
    return mains


def stale_params(trainer_params: dict, mains: dict) -> list[str]:
    """Parameters whose bf16 values on this rank are not the optimizer's result (before any export)."""
    return sorted(n for n, p in trainer_params.items() if not same(p.detach(), mains[n].view(p.shape).to(p.dtype)))


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def check(args, overlap: bool) -> dict:
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.models.recipes import full_size_config
    from mbridge_refit.plan.layout import ParallelLayout
    from mbridge_refit.runtime.param_sync import deferred_gather_groups

    config = full_size_config(args.model)
    config.num_hidden_layers = args.layers
    bridge, oracle_bridge = RefitBridge.from_hf_config(config), RefitBridge.from_hf_config(config)
    layout = ParallelLayout()
    ddp = DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        overlap_grad_reduce=True,
        overlap_param_gather=overlap,
        grad_reduce_in_fp32=True,
    )
    torch.manual_seed(1234)
    trainer = build(bridge, layout, ddp)
    oracle = build(oracle_bridge, layout)
    trainer_params, oracle_params = unwrapped_params(trainer), unwrapped_params(oracle)
    with torch.no_grad():
        for name, param in oracle_params.items():
            param.copy_(trainer_params[name])
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=LR,
            min_lr=LR,
            weight_decay=0.0,
            bf16=True,
            use_distributed_optimizer=True,
            clip_grad=1.0,
            params_dtype=torch.bfloat16,
        ),
        trainer,
    )
    before = exported(bridge, trainer)
    loss = train_step(trainer, optimizer, config.vocab_size, seed=7 + dist.get_rank())  # each replica its own data
    deferred = len(deferred_gather_groups(trainer))
    mains = optimizer_main_params(optimizer, trainer_params)
    stale = stale_params(trainer_params, mains)  # what an export that did not finish the gathers would read
    after = exported(bridge, trainer)  # right after the step: no forward pass in between
    with torch.no_grad():
        for name, main in mains.items():
            param = oracle_params[name]
            param.copy_(main.view(param.shape).to(param.dtype))
    expected = exported(oracle_bridge, oracle, stock=True)
    differing = sorted(n for n in expected if n not in after or not same(after[n], expected[n]))
    changed = sorted(n for n in expected if not same(before[n], expected[n]))
    unchanged = sorted(n for n in changed if same(after[n], before[n]))
    return {
        "overlap_param_gather": overlap,
        "rank": dist.get_rank(),
        "loss": loss,
        "tensors": len(expected),
        "changed_by_step": len(changed),
        "deferred_gather_groups_before_export": deferred,
        "model_params_stale_before_export": len(stale),
        "differing_from_oracle": differing[:10],
        "exported_pre_step_values": unchanged[:10],
        "dtypes": sorted({str(t.dtype) for t in after.values()}),
        "ok": not differing
        and not unchanged
        and bool(changed)
        and set(after) == set(expected)
        and (deferred > 0) == overlap,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-1.7b", help="a shape in recipes/shapes/")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()

    from mbridge_refit.convert.session import init_model_parallel, init_process_group
    from mbridge_refit.plan.layout import ParallelLayout

    init_process_group(device=torch.device("cuda"), timeout=datetime.timedelta(minutes=5))
    init_model_parallel(ParallelLayout(), seed=1234)  # also seeds Megatron's CUDA RNG tracker (TE layers)
    results = [check(args, overlap) for overlap in (False, True)]
    for row in results:
        print(row, flush=True)
    everyone_ok = [None] * dist.get_world_size()
    dist.all_gather_object(everyone_ok, all(r["ok"] for r in results))
    if dist.get_rank() == 0:
        from provenance import device_name

        payload = {
            "device": device_name(),
            "model": f"{args.model} ({args.layers} layers)",
            "dp": dist.get_world_size(),
            "optimizer": f"Megatron distributed Adam, lr {LR}",
            "results_rank0": results,
            "ok_per_rank": everyone_ok,
        }
        write_result(args.out_dir or results_dir(), f"ddp_export_{args.model}.json", payload)
    ok = all(everyone_ok)
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
