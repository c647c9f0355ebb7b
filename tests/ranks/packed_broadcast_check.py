"""Per-rank checker for the packed broadcast: N trainer ranks + 1 receiver rank (CPU, gloo).

Run under torchrun with N+1 processes. Ranks 0..N-1 are the trainer (a Megatron model at
``--tp``/``--pp``/``--vpp``/``--ep`` over those ranks only; N must be the layout's world size);
the last rank is the receiver (no Megatron model) and applies what it receives to a fresh
transformers model with ``HFModelUpdateSink``.

With more trainer ranks than the layout needs, the rest are data-parallel replicas: replica 0
exports (``export_hf_weights(replica=0)``) and rank 0 sends; the other replicas' ranks get an
empty stream and build no sender.

Groups: Megatron 0.19's ``initialize_model_parallel(local_world_size=N)`` builds its groups over
ranks 0..N-1 only; ``new_group`` is collective over the default group, so the receiver makes the
same call and belongs to none of them. The plan is built over the trainer group only
(``export_plan(..., group=trainers)``). The broadcast group is ``new_group([0, receiver])``, or,
with ``--store-group PORT``, a ``StoreGroup`` the source and the receiver join by address (as a
separately launched engine does), in which the receiver is rank 0 and the source rank 1, so its
``src`` (1) differs from the source's trainer rank (0); the other trainer ranks pass ``group=None``.

Cases, in one launch, in this order (every rank runs every case; an expected error is caught and
recorded, then the next case runs on the same groups, which also proves no rank was left behind):

* split: bucket smaller than the largest tensor (tensors split across buffers), checksums on;
  the receiver's tensors equal the checkpoint on disk bit for bit, and the transformers model
  equals ``from_pretrained`` with its tensors' storage unchanged;
* whole: one bucket larger than the whole model, 3 buffers, checksums off;
* mismatch: the receiver's plan renames one entry -> PlanMismatchError on every rank;
* config: the receiver uses another bucket size -> PlanMismatchError on every rank;
* corrupt: a byte of received buffer 1 is flipped -> ChecksumError on the receiver naming the
  buffer and its tensors, RefitStatusError on both trainer ranks;
* consumer: the receiver's sink raises at the 6th tensor -> that error on the receiver (after it
  ran the rest of the protocol), RefitStatusError on both trainer ranks;
* again: the split case once more (the groups are still in step after the failures).

Writes DIR/rank<R>.json: {case: {"ok", "error", ...}}.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from oracle import read_checkpoint  # noqa: E402
from rank_checks import same_bytes  # noqa: E402

from mbridge_refit.convert.flags import add_layout_flags, layout_from_flags

SRC = 0  # trainer rank that sends; ranks 0..N-2 are trainers, the last rank is the receiver


def configs(plan):
    from mbridge_refit.engines.broadcast.packed import (
        ALIGN_BYTES,
        PackedBroadcastConfig,
        StreamPacking,
    )

    largest = max(e.nbytes for e in plan.entries)
    small = max(ALIGN_BYTES, largest // 3 // ALIGN_BYTES * ALIGN_BYTES)
    whole = StreamPacking.build(plan, ALIGN_BYTES).stream_bytes + 64 * ALIGN_BYTES
    split = PackedBroadcastConfig(bucket_bytes=small, num_buffers=2, checksum=True)
    return {
        "split": split,
        "whole": PackedBroadcastConfig(bucket_bytes=whole, num_buffers=3, checksum=False),
        "mismatch": split,
        "config": split,
        "corrupt": split,
        "consumer": split,
        "again": split,
    }


class OracleSink:
    """Checks every received tensor against the checkpoint, then forwards it to ``inner``."""

    def __init__(self, expected: dict[str, torch.Tensor], inner) -> None:
        self.expected, self.inner = expected, inner
        self.names: list[str] = []
        self.differing: list[str] = []

    def consume(self, name, tensor):
        self.names.append(name)
        if name not in self.expected or not same_bytes(tensor, self.expected[name]):
            self.differing.append(name)
        self.inner.consume(name, tensor)

    def finish(self):
        self.inner.finish()

    def abort(self):
        self.inner.abort()


class FailingSink:
    """The receiver's own sink fails part-way (e.g. an engine rejects a tensor)."""

    def __init__(self, inner, *, after: int) -> None:
        self.inner, self.left = inner, after

    def consume(self, name, tensor):
        self.left -= 1
        if self.left < 0:
            raise ValueError(f"test consumer rejects {name}")
        self.inner.consume(name, tensor)

    def finish(self):
        self.inner.finish()

    def abort(self):
        self.inner.abort()


def run_trainer(case, config, *, bridge, chunks, plan, refit, src, trainers, replica):
    """With ``replica`` set, only that replica's ranks (``trainers`` is their group) export and
    build a sender; the other trainer ranks get an empty stream and must not send anything."""
    from mbridge_refit.engines.broadcast.packed import PackedBroadcastSender
    from mbridge_refit.sinks import drain

    stream = bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=True, replica=replica)
    if replica is not None and not bridge.takes_part(chunks, replica):
        return {"tensors": sum(1 for _ in stream), "bytes_sent": 0, "sender": False}
    sender = PackedBroadcastSender(plan, config, group=refit, src=src, trainer_group=trainers, trainer_src=SRC)
    count = drain(stream, sender)
    return {"tensors": count, "bytes_sent": sender.bytes_sent, "sender": sender.is_source}


def run_receiver(case, config, *, plan_json, refit, src, expected, model, pointers, reference):
    from mbridge_refit.engines.broadcast.packed import PackedBroadcastReceiver
    from mbridge_refit.plan.entries import ExportPlan
    from mbridge_refit.sinks import drain
    from mbridge_refit.sinks.model_update import HFModelUpdateSink

    if case == "mismatch":
        plan = ExportPlan.from_json(plan_json)
        entries = list(plan.entries)
        entries[7] = dataclasses.replace(entries[7], hf_name=entries[7].hf_name + ".renamed")
        plan_json = dataclasses.replace(plan, entries=tuple(entries)).to_json()
    if case == "config":
        config = dataclasses.replace(config, bucket_bytes=config.bucket_bytes * 2)

    class FlippingReceiver(PackedBroadcastReceiver):
        """Bucket 1 arrives with one bit of its byte 5 flipped, before its checksum."""

        def _checksum(self, bucket, data):
            if bucket == 1:
                data[5] ^= 0x40
            super()._checksum(bucket, data)

    receiving = FlippingReceiver if case == "corrupt" else PackedBroadcastReceiver
    receiver = receiving(plan_json, config, group=refit, src=src, device="cpu")
    with torch.no_grad():  # start from zeros so every case must write every tensor again
        for tensor in model.state_dict().values():
            tensor.zero_()
    sink = OracleSink(expected, HFModelUpdateSink(model))
    if case == "consumer":
        sink.inner = FailingSink(sink.inner, after=5)
    count = drain(receiver.receive(), sink)
    state = model.state_dict()
    return {
        "tensors": count,
        "buckets": receiver.packing.num_buckets,
        "split_bytes": receiver.packing.max_split_bytes(),
        "in_order": sink.names == [e.hf_name for e in receiver.plan.entries],
        "differing_from_disk": sink.differing,
        "differing_from_pretrained": [n for n, t in reference.items() if not same_bytes(state[n], t)],
        "pointers_kept": {n: t.data_ptr() for n, t in state.items()} == pointers,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf", type=Path, required=True)
    parser.add_argument("--result", type=Path, required=True)
    parser.add_argument("--store-group", type=int, metavar="PORT", help="broadcast over a StoreGroup at this port")
    add_layout_flags(parser)
    args = parser.parse_args()

    from megatron.core import parallel_state as ps

    from mbridge_refit.convert.session import init_process_group, teardown

    cpu = torch.device("cpu")
    init_process_group(device=cpu, timeout=datetime.timedelta(seconds=90))
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = layout_from_flags(args)
    trainer_ranks, receiver_rank = tuple(range(world - 1)), world - 1
    if len(trainer_ranks) % layout.model_parallel_size or len(trainer_ranks) < layout.expected_world_size:
        raise SystemExit(
            f"run with a multiple of {layout.model_parallel_size} trainer ranks + 1 receiver for layout {layout.name}"
        )
    replica = 0 if len(trainer_ranks) > layout.expected_world_size else None  # data-parallel replicas: replica 0 sends
    ps.initialize_model_parallel(
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=args.vpp,
        expert_model_parallel_size=args.ep,
        context_parallel_size=layout.cp,
        expert_tensor_parallel_size=layout.etp,
        local_world_size=len(trainer_ranks),
    )
    trainers = dist.new_group(list(trainer_ranks))
    refit, src = dist.new_group([SRC, receiver_rank]), SRC
    if args.store_group is not None:
        from mbridge_refit.engines.broadcast.group import StoreGroup, new_secret

        secret = [new_secret() if rank == 0 else None]  # handed over out of band: here, through the job's world
        dist.broadcast_object_list(secret, src=0)
        store_ranks = {receiver_rank: 0, SRC: 1}
        src = store_ranks[SRC]
        refit = (
            StoreGroup(
                host="127.0.0.1",
                port=args.store_group,
                rank=store_ranks[rank],
                world_size=2,
                device=cpu,
                secret=secret[0],
                timeout=datetime.timedelta(seconds=90),
            )
            if rank in store_ranks
            else None
        )
    senders = trainers  # the ranks that iterate the export and build a sender
    results: dict[str, dict] = {}
    try:
        if rank in trainer_ranks:
            from mbridge_refit.bridge import RefitBridge
            from mbridge_refit.models.builder import BuildOptions, build_model

            bridge = RefitBridge.from_hf_pretrained(args.hf)
            chunks = build_model(bridge, layout, BuildOptions(device=cpu, params_dtype=torch.bfloat16))
            bridge.load_hf_shards(chunks, args.hf)
            plan = bridge.export_plan(chunks, group=trainers)
            payload = [plan.to_json()]
            exporting = [sorted(bridge.replica_ranks(chunks)[replica]) if replica is not None else None]
        else:
            from transformers import AutoConfig, AutoModelForCausalLM

            from mbridge_refit.plan.entries import ExportPlan

            payload, exporting = [None], [None]
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.hf), dtype=torch.bfloat16)
            pointers = {n: t.data_ptr() for n, t in model.state_dict().items()}
            reference = AutoModelForCausalLM.from_pretrained(args.hf, dtype=torch.bfloat16).state_dict()
            expected = read_checkpoint(args.hf)
        if rank in (SRC, receiver_rank):  # the receiver gets the plan from the trainer, as in production
            if args.store_group is not None:
                payload = [refit.broadcast_object(payload[0], src, cpu)]
            else:
                dist.broadcast_object_list(payload, src=SRC, group=refit)
        if replica is not None:  # new_group is collective over every rank: all learn replica 0's ranks
            dist.broadcast_object_list(exporting, src=SRC)
            senders = dist.new_group(exporting[0])
        if rank in trainer_ranks:
            run = lambda case, config: run_trainer(  # noqa: E731
                case,
                config,
                bridge=bridge,
                chunks=chunks,
                plan=plan,
                refit=refit,
                src=src,
                trainers=senders,
                replica=replica,
            )
        if rank == receiver_rank:
            plan = ExportPlan.from_json(payload[0])
            run = lambda case, config: run_receiver(  # noqa: E731
                case,
                config,
                plan_json=payload[0],
                refit=refit,
                src=src,
                expected=expected,
                model=model,
                pointers=pointers,
                reference=reference,
            )
        for case, config in configs(plan).items():
            start = time.monotonic()
            try:
                outcome = {"ok": True, "error": None, **run(case, config)}
            except Exception as err:  # recorded; the test decides whether it was expected
                outcome = {
                    "ok": False,
                    "error": f"{type(err).__name__}: {err}",
                    "trace": traceback.format_exc()[-3000:],
                }
            outcome["seconds"] = round(time.monotonic() - start, 2)
            outcome["bucket_bytes"] = config.bucket_bytes
            results[case] = outcome
            print(f"[rank{rank}] {case}: ok={outcome['ok']} {outcome['error'] or ''}", flush=True)
        results["replica_ranks"] = exporting[0]
        results["stream_bytes"] = {
            "ok": True,
            "value": sum(e.nbytes for e in plan.entries),
            "largest": max(e.nbytes for e in plan.entries),
        }
        args.result.mkdir(parents=True, exist_ok=True)
        (args.result / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    finally:
        teardown()


if __name__ == "__main__":
    main()
