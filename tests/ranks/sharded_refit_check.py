"""Per-rank checks of the sharded refit (transfer plan + ShardedTransfer); run under torchrun by
tests/test_sharded_refit.py (CPU, gloo, 4 ranks).

Usage: sharded_refit_check.py --hf CKPT --result DIR --engines tp1 tp2 tp4 [--faults] [--tp N --pp N --ep N]

Every rank loads the checkpoint into its shard of the trainer layout, then, failing with exit 1:
  * the ranks' real Megatron coordinates equal ``megatron_rank_grid`` of the layout;
  * for each engine layout (engine rank i on global rank i): the transfer plan survives JSON; a
    run fills this rank's engine shards (pre-filled with a byte pattern), each equal to the
    matching slice of the checkpoint on disk, cut by ``expected_shards`` below: the engine's
    rules written again here from HF names and the config, not from the plan; the set of
    tensors each rank holds is the one those rules give;
  * after every trainer parameter is changed (+1) the next run delivers the changed values
    (the checkpoint's tensors + 1), and the transfer's buffers are the same ones;
  * ``--faults``: ranks holding different plans, a rank whose shards do not fit the plan, and a
    byte flipped on its way (checksums on) each raise on every rank; a clean run follows.
Writes DIR/rank<r>.json with each plan's summary (bytes moved, local, full-gather).
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rank_checks import checker_parser, checkpoint_session, fail, oracle, same_bytes  # noqa: E402

from mbridge_refit.convert.flags import layout_from_flags  # noqa: E402
from mbridge_refit.runtime import sharded_transfer  # noqa: E402

PATTERN = 0xA5
VOCAB_PADDING = 64


def expected_shards(names, read, config, tp: int, ep: int, rank: int) -> dict[str, torch.Tensor]:
    """What engine rank ``rank`` of an engine at ``tp`` (``ep``) holds: vLLM's sharding rules,
    written from HF names and the config (an independent statement of plan.engine_layout)."""
    kv_heads, experts = config.num_key_value_heads, getattr(config, "num_experts", 0) or 0
    result = {}
    for name in names:
        full = read(name)
        expert = re.search(r"\.experts\.(\d+)\.", name)
        if expert and ep > 1:
            if int(expert.group(1)) // (experts // ep) == rank:
                result[name] = full
            continue
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            per = -(-full.shape[0] // VOCAB_PADDING) * VOCAB_PADDING // tp
            result[name] = full[min(rank * per, full.shape[0]) : (rank + 1) * per]
        elif re.search(r"\.(k_proj|v_proj)\.", name) and kv_heads < tp:
            rows = full.shape[0] // kv_heads
            head = rank // (tp // kv_heads)
            result[name] = full[head * rows : (head + 1) * rows]
        elif re.search(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.", name):
            result[name] = full.chunk(tp, dim=0)[rank]
        elif re.search(r"\.(o_proj|down_proj)\.weight$", name):
            result[name] = full.chunk(tp, dim=1)[rank]
        elif name.endswith("norm.weight") or re.search(r"\.mlp\.gate\.weight$", name):
            result[name] = full
        else:
            fail(f"the test's engine rules have no case for {name}")
    return result


def check_run(transfer, shards, expected: dict[str, torch.Tensor], what: str) -> None:
    for tensor in shards.values():
        tensor.view(torch.uint8).fill_(PATTERN)
    transfer.run(shards)
    if set(shards) != set(expected):
        fail(f"{what}: this rank holds {sorted(set(shards) ^ set(expected))[:6]} against the engine rules")
    for name, tensor in expected.items():
        if not same_bytes(shards[name], tensor.contiguous()):
            fail(f"{what}: engine shard {name} differs from the checkpoint's slice")


def expect_raise(error_type, action, what: str) -> str:
    try:
        action()
    except error_type as err:
        return str(err)
    fail(f"{what}: no {error_type.__name__} on rank {dist.get_rank()}")


def run_faults(bridge, chunks, engines: list[str], shards_of) -> dict:
    from mbridge_refit.runtime.sharded_transfer import (
        TransferChecksumError,
        TransferMismatchError,
    )

    rank = dist.get_rank()
    plans = [bridge.transfer_plan(chunks, e) for e in engines]
    mine = plans[1] if rank == 0 else plans[0]  # rank 0 holds another engine's plan
    transfer = bridge.sharded_transfer(chunks, mine)
    message = expect_raise(TransferMismatchError, lambda: transfer.run(shards_of(transfer)), "different plans")
    if "different transfer plans" not in message:
        fail(f"plan mismatch message does not say so: {message}")

    transfer = bridge.sharded_transfer(chunks, plans[-1])
    if rank == 0:
        transfer.wire_version -= 1  # an older install on rank 0: refused by name, not a checksum failure
    message = expect_raise(TransferMismatchError, lambda: transfer.run(shards_of(transfer)), "another wire version")
    if "sharded transfer wire version mismatch" not in message or "same mbridge_refit" not in message:
        fail(f"the wire-version refusal does not say so: {message}")

    transfer = bridge.sharded_transfer(chunks, plans[-1])
    shards = shards_of(transfer)
    if rank == 1 and shards:
        shards.pop(next(iter(shards)))
    message = expect_raise(TransferMismatchError, lambda: transfer.run(shards), "a missing shard")
    if "[1]" not in message:
        fail(f"the missing-shard refusal does not name rank 1: {message}")

    moving = next(p for p in reversed(plans) if p.bytes_moved)
    transfer = bridge.sharded_transfer(chunks, moving, checksum=True)
    senders = sorted({m.source_rank for m in moving.moves if not m.is_local})
    shards = shards_of(transfer)
    with flipping_sent_bytes(transfer, flip=rank == senders[0]):
        message = expect_raise(TransferChecksumError, lambda: transfer.run(shards), "a flipped byte")
    transfer.run(shards)  # the same transfer runs clean afterwards
    return {"checksum_error": message[:200], "replica_error": disagreeing_replicas_refused(bridge, chunks, plans)[:300]}


def disagreeing_replicas_refused(bridge, chunks, plans) -> str:
    """One element of a tensor that two trainer ranks send (a replicated norm) changed on one of
    them: the transfer's first run refuses on every rank, naming the tensor and both ranks, before
    any shard is written; with the element restored a new transfer runs."""
    from mbridge_refit.runtime.replica_agreement import ReplicaMismatchError, replicated_regions

    plan = next(p for p in plans if replicated_regions(p))
    region = replicated_regions(plan)[0]
    transfer = bridge.sharded_transfer(chunks, plan)
    shards = {name: t.zero_() for name, t in transfer.allocate_shards().items()}
    before = {name: t.clone() for name, t in shards.items()}
    rank, param, box = region.sources[-1]
    changed = transfer.params[param] if dist.get_rank() == rank else None
    element = tuple(start for start, _ in box)
    with torch.no_grad():
        if changed is not None:
            changed[element] += 1
        message = expect_raise(ReplicaMismatchError, lambda: transfer.run(shards), "replicas that differ")
        if changed is not None:
            changed[element] -= 1
    if region.hf_name not in message or str(list(region.source_ranks)) not in message:
        fail(f"the replica refusal does not name {region.hf_name} on {list(region.source_ranks)}: {message}")
    if any(not torch.equal(before[name], t) for name, t in shards.items()):
        fail("the refused transfer wrote engine shards")

    from mbridge_refit.errors import TransportError

    failing = bridge.sharded_transfer(chunks, plan)
    if dist.get_rank() == rank:  # this rank's checksum raises (its parameter is gone): every rank must hear of it
        failing = sharded_transfer.ShardedTransfer(plan, params=failing.params, chunks=chunks)  # no lookups: as set
        failing.params = {name: t for name, t in failing.params.items() if name != param}
    failure = expect_raise(TransportError, lambda: failing.run(shards), "a rank whose checksum failed")
    if f"rank(s) [{rank}] could not checksum" not in failure:
        fail(f"the checksum failure does not name rank {rank}: {failure}")
    bridge.sharded_transfer(chunks, plan).run(shards)
    return message


@contextlib.contextmanager
def flipping_sent_bytes(transfer, *, flip: bool):
    """Inside the block, each buffer this rank sends has its first byte flipped right after its
    checksum is taken (as a bad link would), through the module's checksum function: the
    transfer's own code is unchanged. Received buffers (summed into ``_local_sum``) are left alone."""
    original = sharded_transfer._word_sum

    def summed_then_flipped(buffer, *, out):
        result = original(buffer, out=out)
        if out is not transfer._local_sum:
            buffer[0] ^= 1
        return result

    if flip:
        sharded_transfer._word_sum = summed_then_flipped
    try:
        yield
    finally:
        sharded_transfer._word_sum = original


def replace_parameters(chunks) -> None:
    """Every parameter replaced by a new ``Parameter`` object holding its values + 1 (``module.weight =
    Parameter(...)``, as a checkpoint reload with ``assign=True`` does); the old objects keep theirs."""
    for chunk in chunks:
        for module in chunk.modules():
            for name, param in list(module._parameters.items()):
                if param is not None:
                    setattr(module, name, torch.nn.Parameter(param.detach() + 1, requires_grad=param.requires_grad))


def main() -> None:
    parser = checker_parser()
    parser.add_argument("--engines", nargs="+", required=True)
    parser.add_argument("--faults", action="store_true")
    args = parser.parse_args()
    layout = layout_from_flags(args)

    from megatron.core import parallel_state as ps

    from mbridge_refit.plan.transfer import TransferPlan, megatron_rank_grid
    from mbridge_refit.runtime.collectives import current_trainer_rank

    read = oracle(args.hf)
    with checkpoint_session(args.hf, layout) as (bridge, chunks):
        rank, world = dist.get_rank(), dist.get_world_size()
        config = bridge.hf_pretrained.config

        grid = [None] * world
        dist.all_gather_object(grid, current_trainer_rank())
        dp = ps.get_data_parallel_world_size()
        if tuple(grid) != megatron_rank_grid(tp=layout.tp, pp=layout.pp, ep=layout.ep, dp=dp, etp=layout.etp):
            fail(f"Megatron's rank coordinates {grid} differ from megatron_rank_grid")

        names = bridge.export_plan(chunks).names()
        summaries = {}
        for engine_name in args.engines:
            plan = bridge.transfer_plan(chunks, engine_name)
            if TransferPlan.from_json(plan.to_json()) != plan:
                fail(f"{engine_name}: the transfer plan does not survive JSON")
            transfer = bridge.sharded_transfer(chunks, plan)
            shards = transfer.allocate_shards()
            expected = (
                expected_shards(names, read, config, plan.engine.tp, plan.engine.ep, rank)
                if rank in plan.engine_ranks
                else {}
            )
            check_run(transfer, shards, expected, f"engine {engine_name}")
            summaries[engine_name] = plan.summary()

        last = args.engines[-1]
        originals = [p.detach().clone() for chunk in chunks for p in chunk.parameters()]
        with torch.no_grad():
            for chunk in chunks:
                for param in chunk.parameters():
                    param.add_(1)
        pointers = transfer.buffer_pointers()
        bumped = {name: (tensor.to(torch.bfloat16) + 1) for name, tensor in expected.items()}
        check_run(transfer, shards, bumped, f"engine {last} after the parameters changed")
        if transfer.buffer_pointers() != pointers:
            fail("the transfer allocated new buffers in a steady-state run")
        replace_parameters(chunks)  # new objects, + 1 again: the transfer must read them, not the old ones
        again = {name: tensor + 1 for name, tensor in bumped.items()}
        check_run(transfer, shards, again, f"engine {last} after the model replaced its parameter objects")
        bridge.forget_model()  # its plan gone, a run must not plan again (collective) on one rank: every rank refuses
        refused = expect_raise(
            sharded_transfer.TransferMismatchError, lambda: transfer.run(shards), "a run after forget_model()"
        )
        if "no longer holds the plan" not in refused:
            fail(f"the refusal after forget_model() does not say why: {refused}")
        with torch.no_grad():
            for param, original in zip((p for chunk in chunks for p in chunk.parameters()), originals):
                param.copy_(original)

        faults = run_faults(bridge, chunks, args.engines, lambda t: t.allocate_shards()) if args.faults else {}

        args.result.mkdir(parents=True, exist_ok=True)
        (args.result / f"rank{rank}.json").write_text(
            json.dumps({"rank": rank, "plans": summaries, "faults": faults, "ok": True})
        )


if __name__ == "__main__":
    main()
