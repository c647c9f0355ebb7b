"""Benchmark: the engine worker's look for replaced parameters (``ApplyPlan.targets_moved``), the host
work every colocated apply and every broadcast receive does before its copies, on parameters whose
class overrides ``__torch_function__`` as vLLM's linear layers' do.

    python3 scripts/bench_replaced_check.py [--params 291] [--rounds 7] [--out-dir DIR]

Builds ``--params`` modules of one parameter each (the count of a Qwen3-8B engine's parameters) of
vLLM's ``BasevLLMParameter`` where vLLM is installed, else of a stand-in class that overrides
``__torch_function__`` the same way, on GPU 0 if there is one; records their loads (plain copies),
then times, in alternating rounds, the look as the plan runs it (``targets_moved``: subclass
dispatch off) and the same look with dispatch on (``subclass_dispatch=True``: as it was before). Needs only
torch and this package (no Megatron, no engine). Writes DIR/bench_replaced_check.json with its
manifest (``provenance.write_result``); prints it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from provenance import results_dir, write_result


def parameter_class() -> tuple[type, str]:
    """vLLM's parameter base class if importable, else a stand-in overriding ``__torch_function__`` as it does."""
    try:
        from vllm.model_executor.parameter import BasevLLMParameter

        def make(data):
            return BasevLLMParameter(data, weight_loader=lambda *args: None)

        return make, "vllm BasevLLMParameter"
    except ImportError:
        pass

    from mbridge_refit.testing.parameter_classes import DispatchingParameter

    return DispatchingParameter, "stand-in overriding __torch_function__ as vLLM's BasevLLMParameter does"


class Engine(torch.nn.Module):
    def __init__(self, count: int, make, device: torch.device) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Module() for _ in range(count))
        for layer in self.layers:
            layer.weight = make(torch.zeros(16, device=device))

    def load_weights(self, weights):
        for name, tensor in weights:
            self.get_parameter(name).data.copy_(tensor)


def timed_ms(fn, repeats: int = 20) -> float:
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=291)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()
    from mbridge_refit.engines.replay.apply_plan import ApplyPlan

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    make, kind = parameter_class()
    model = Engine(args.params, make, device)
    plan = ApplyPlan.record(model, [(f"layers.{i}.weight", torch.randn(16, device=device)) for i in range(args.params)])
    assert plan.targets_moved(model) == [] and plan.targets_moved(model, subclass_dispatch=True) == []
    ours, before = [], []
    for _ in range(args.rounds):
        ours.append(timed_ms(lambda: plan.targets_moved(model)))
        before.append(timed_ms(lambda: plan.targets_moved(model, subclass_dispatch=True)))
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "host_cpu_threads": torch.get_num_threads(),
        "parameter_class": kind,
        "params": args.params,
        "look_ms": {"median": round(statistics.median(ours), 4), "all": [round(v, 4) for v in ours]},
        "dispatching_look_ms": {"median": round(statistics.median(before), 4), "all": [round(v, 4) for v in before]},
        "us_per_param": round(statistics.median(ours) * 1e3 / args.params, 3),
        "dispatching_us_per_param": round(statistics.median(before) * 1e3 / args.params, 3),
    }
    print(json.dumps(result, indent=1))
    if args.out_dir is not None or device.type == "cuda":
        path = write_result(args.out_dir or results_dir(), "bench_replaced_check.json", result)
        print("wrote", path)


if __name__ == "__main__":
    main()
