"""Host work of a steady broadcast refit on the engine's side, counted (not timed): run by
tests/test_broadcast_host_work.py in a process of its own (CPU, gloo, two threads).

Usage: broadcast_host_work_check.py --layers N [N ...] --result FILE [--bucket-bytes B] [--no-checksum]

For each layer count, a plan of that many vLLM-like layers (q, k, v fused into ``qkv_proj``,
gate and up into ``gate_up_proj``, by a loader that parses names per tensor as vLLM's does) is sent
by a ``PackedBroadcastSender`` (one thread, its ``SendBuffers`` kept across refits as
``BroadcastSession`` keeps them) into a ``BroadcastTarget`` (another thread) over a ``StoreGroup``.
Three refits settle the session; the fourth is counted in the engine's thread only
(``sys.setprofile`` is per thread): Python calls, calls into C (by name, for the few that matter:
allocations and reads of a tensor's value to the host), the loader's calls, and the collectives the
engine issued; the fifth is counted the same way in the sender's thread (its ``consume`` calls and
``finish``, not the making of the tensors). The engine must equal the last refit's tensors. Writes
{layers: counts} to FILE, the sender's under "sender".
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import free_port  # noqa: E402
from test_packed_broadcast import _plan  # noqa: E402

from mbridge_refit.engines.broadcast.engine import BroadcastTarget  # noqa: E402
from mbridge_refit.engines.broadcast.group import StoreGroup, new_secret  # noqa: E402
from mbridge_refit.engines.broadcast.packed import (  # noqa: E402
    WIRE_VERSION,
    PackedBroadcastConfig,
    PackedBroadcastSender,
    SendBuffers,
)
from mbridge_refit.testing.parameter_classes import DispatchingParameter  # noqa: E402

HIDDEN, HEADS, KV, FFN = 16, 8, 4, 12
PARTS = {  # HF tensor -> (engine parameter, its row offset there)
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", HEADS),
    "v_proj": ("qkv_proj", HEADS + KV),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", FFN),
}
SHAPES = {
    "q_proj": (HEADS, HIDDEN),
    "k_proj": (KV, HIDDEN),
    "v_proj": (KV, HIDDEN),
    "o_proj": (HIDDEN, HEADS),
    "gate_proj": (FFN, HIDDEN),
    "up_proj": (FFN, HIDDEN),
    "down_proj": (HIDDEN, FFN),
    "norm": (HIDDEN,),
}
# the allocations and copies worth naming in the counts
NAMED_C_CALLS = ("empty", "zeros", "clone", "copy_", "_foreach_copy_")


def layer_plan(layers: int):
    return _plan(
        *((f"layers.{i}.{part}.weight", shape, "bfloat16") for i in range(layers) for part, shape in SHAPES.items())
    )


class Engine(torch.nn.Module):
    """vLLM-like parameters (the linear layers' of ``DispatchingParameter``, the norm's plain, as in vLLM) and a
    loader that maps names per tensor (a ``stacked_params_mapping`` walk)."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.params = torch.nn.ParameterDict()
        for i in range(layers):
            for name, shape in (
                ("qkv_proj", (HEADS + 2 * KV, HIDDEN)),
                ("o_proj", SHAPES["o_proj"]),
                ("gate_up_proj", (2 * FFN, HIDDEN)),
                ("down_proj", SHAPES["down_proj"]),
                ("norm", SHAPES["norm"]),
            ):
                data = torch.zeros(shape, dtype=torch.bfloat16)
                self.params[f"layers__{i}__{name}"] = (
                    torch.nn.Parameter(data, requires_grad=False) if name == "norm" else DispatchingParameter(data)
                )
        self.loader_calls = 0

    def load_weights(self, weights):
        self.loader_calls += 1
        loaded = set()
        for name, tensor in weights:
            _, layer, part, _ = name.split(".")
            target, row = PARTS.get(part, (part, None))
            key = f"layers__{layer}__{target}"
            param = self.params[key].data
            if row is None:
                param.copy_(tensor)
            else:
                param.narrow(0, row, tensor.shape[0]).copy_(tensor)
            loaded.add(f"params.{key}")
        return loaded

    def expected(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for i in {name.split(".")[1] for name in tensors}:
            get = lambda part: tensors[f"layers.{i}.{part}.weight"]  # noqa: E731
            out[f"layers__{i}__qkv_proj"] = torch.cat([get("q_proj"), get("k_proj"), get("v_proj")])
            out[f"layers__{i}__gate_up_proj"] = torch.cat([get("gate_proj"), get("up_proj")])
            for part in ("o_proj", "down_proj", "norm"):
                out[f"layers__{i}__{part}"] = get(part)
        return out


class CountingGroup:
    """The engine's ``StoreGroup`` with its collectives counted."""

    def __init__(self, inner: StoreGroup) -> None:
        self.inner, self.collectives = inner, Counter()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def is_member(self) -> bool:
        return self.inner.is_member()

    def is_source(self, src: int) -> bool:
        return self.inner.is_source(src)

    def broadcast_object(self, obj, src, device):
        return self.inner.broadcast_object(obj, src, device)

    def post_error(self, message: str) -> None:
        self.inner.post_error(message)

    def broadcast(self, tensor, src, *, async_op=False):
        self.collectives["broadcast"] += 1
        return self.inner.broadcast(tensor, src, async_op=async_op)

    def all_reduce(self, tensor, op):
        self.collectives["all_reduce"] += 1
        return self.inner.all_reduce(tensor, op)


def count_calls(action) -> dict:
    """Calls ``action`` makes in this thread, and its reads of a tensor's value to the host
    (``int(t)``, ``t.item()``, ``t.tolist()``: each a host round trip on a GPU); not the calls a
    blocking wait of the group makes while it polls (``StoreGroup._wait_until``: as many as the wait
    is long)."""
    counts = {"python_calls": 0, "c_calls": 0, "host_reads": 0}
    named: Counter = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in ("__int__", "__index__", "item", "tolist")}
    counting = threading.current_thread()

    def counted(original):
        def read(self, *args):
            counts["host_reads"] += threading.current_thread() is counting
            return original(self, *args)

        return read

    wrappers = {counted(original).__code__ for original in originals.values()}
    # a blocking wait polls as often as the peer keeps it waiting: those calls are not this end's work
    waits, waiting = {StoreGroup._wait_until.__code__}, [0]

    def probe(frame, event, arg):
        if frame.f_code in waits:
            waiting[0] += {"call": 1, "return": -1}.get(event, 0)
            return
        if waiting[0]:
            return
        if event == "call" and frame.f_code not in wrappers:
            counts["python_calls"] += 1
        elif event == "c_call":
            counts["c_calls"] += 1
            name = getattr(arg, "__name__", "")
            if name in NAMED_C_CALLS:
                named[name] += 1

    for name, original in originals.items():
        setattr(torch.Tensor, name, counted(original))
    sys.setprofile(probe)
    try:
        action()
    finally:
        sys.setprofile(None)
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    return {**counts, "named": dict(named)}


def measure(layers: int, bucket_bytes: int, checksum: bool) -> dict:
    plan = layer_plan(layers)
    config = PackedBroadcastConfig(bucket_bytes=bucket_bytes, num_buffers=2, checksum=checksum)
    port = free_port()
    engine = Engine(layers)
    target = BroadcastTarget(engine.load_weights, engine, "cpu")
    sender_group: list[StoreGroup] = []
    secret = new_secret()

    def join_sender() -> None:
        sender_group.append(StoreGroup(host="127.0.0.1", port=port, rank=0, world_size=2, device="cpu", secret=secret))

    joiner = threading.Thread(target=join_sender, daemon=True)
    joiner.start()
    target.join(
        host="127.0.0.1",
        port=port,
        rank=1,
        world_size=2,
        plan_json=plan.to_json(),
        config=vars_of(config),
        secret=secret.hex(),
        wire_version=WIRE_VERSION,
    )
    joiner.join()
    counting = CountingGroup(target.group)
    target.group = counting
    results: dict = {}
    memory = SendBuffers(plan, config, "cpu")  # kept across refits, as BroadcastSession keeps it

    def send(step: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(step)
        tensors = {e.hf_name: torch.randn(e.shape, generator=gen).to(torch.bfloat16) for e in plan.entries}

        def sending() -> None:
            sender = PackedBroadcastSender(plan, config, group=sender_group[0], src=0, buffers=memory)
            for name, tensor in tensors.items():
                sender.consume(name, tensor)
            sender.finish()

        if step == 4:
            results["sender"] = count_calls(sending)
        else:
            sending()
        return tensors

    for step in range(5):
        thread = threading.Thread(target=lambda s=step: results.__setitem__("sent", send(s)), daemon=True)
        thread.start()
        if step != 3:
            report = target.receive()
        else:
            counting.collectives.clear()
            calls_before = engine.loader_calls
            results["counts"] = count_calls(lambda: results.__setitem__("report", target.receive()))
            results["counts"]["loader_calls"] = engine.loader_calls - calls_before
            results["collectives"] = dict(counting.collectives)  # this refit's
        thread.join()
        report = results.get("report", report)
    want = engine.expected(results["sent"])
    wrong = [name for name, tensor in want.items() if not torch.equal(engine.params[name].data, tensor)]
    if wrong:
        raise SystemExit(f"the engine differs from the last refit's tensors in {wrong[:4]}")
    target.close()
    sender_group[0].close()
    from mbridge_refit.engines.broadcast.packed import StreamPacking

    return {
        **results["counts"],
        "sender": results["sender"],
        "collectives": results["collectives"],
        "tensors": len(plan.entries),
        "buckets": StreamPacking.build(plan, bucket_bytes).num_buckets,
        "report": {k: v for k, v in report.items() if k != "receive_ms"},
    }


def vars_of(config: PackedBroadcastConfig) -> dict:
    return {"bucket_bytes": config.bucket_bytes, "num_buffers": config.num_buffers, "checksum": config.checksum}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", required=True)
    parser.add_argument("--bucket-bytes", type=int, default=4096)
    parser.add_argument("--no-checksum", action="store_true", help="PackedBroadcastConfig(checksum=False)")
    parser.add_argument("--result", type=Path, required=True)
    args = parser.parse_args()
    results = {layers: measure(layers, args.bucket_bytes, not args.no_checksum) for layers in args.layers}
    args.result.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
