"""Per-rank checks of the colocated refit protocol into an engine, without vLLM; run under torchrun
by tests/test_engine_refit.py (CPU, gloo).

Usage: engine_refit_check.py --hf CKPT --result DIR [--tp N --pp N --ep N]

Every rank plays trainer and colocated engine: the engine is ``EngineModel`` below, written for
this test the way vLLM lays weights out (q/k/v fused into ``qkv_proj``, gate/up into
``gate_up_proj``, experts stacked into ``w13``/``w2``), loaded by its own ``load_weights`` (narrow
and copy, as vLLM's loaders do; norms through a temporary, which the recorder cannot replay).
The session is ``VLLMRefit`` over an in-process RPC (arguments pickled, as across a process
boundary) with ``LocalTransport``. Checks, failing with exit 1:
  * every tensor ``RefitBridge.live_rows`` names is, read from its parameter's rows, the
    checkpoint's tensor on disk; without tensor or pipeline parallelism that is every tensor;
  * the first refit opens the layout; the engine equals the checkpoint on disk, fused by
    ``expected_engine_state`` (the oracle); nothing missing or unexpected; norms via the loader;
    live tensors made of several row runs (q, k, v at TP1) are composed, none refreshed;
  * after the trainer's parameters change in place, the next refit replays without reopening
    and the engine equals the stock export of the changed model; a third refit allocates no
    export buffer;
  * a freed export cache changes the layout when anything is exported: the next refit reopens,
    still exact; a live parameter whose storage is swapped (``param.data = ...``) reopens too;
    the engine gets the new storage's values;
  * an engine without one parameter fails the open on the engine side, naming it, and the
    trainer gets that error; a step with another layout's fingerprint is refused by name;
  * a loader that changes a parameter where the recorder cannot see it is caught by the check
    against the loader.
Writes DIR/rank<r>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pickle
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from oracle import read_checkpoint  # noqa: E402
from rank_checks import change_weights, fail, same_bytes  # noqa: E402

from mbridge_refit.convert.flags import add_layout_flags, layout_from_flags  # noqa: E402

FUSED = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))
EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def engine_name(hf_name: str) -> tuple[str, int | None, int]:
    """(engine parameter, expert index or None, part index) of an HF tensor in the engine layout."""
    match = EXPERT.match(hf_name)
    if match:
        prefix, expert, part = match.groups()
        return (
            (f"{prefix}.w2" if part == "down_proj" else f"{prefix}.w13"),
            int(expert),
            ("gate_proj", "up_proj", "down_proj").index(part) % 2,
        )
    for fused, parts in FUSED:
        for index, part in enumerate(parts):
            if f".{part}." in hf_name:
                return hf_name.replace(f".{part}.", f".{fused}."), None, index
    return hf_name, None, 0


def expected_engine_state(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The oracle: the engine's parameters built from HF tensors by concatenation and stacking."""
    groups: dict[str, list[tuple[int | None, int, torch.Tensor]]] = {}
    for name, tensor in hf.items():
        target, expert, part = engine_name(name)
        groups.setdefault(target, []).append((expert, part, tensor))
    state = {}
    for target, pieces in groups.items():
        if pieces[0][0] is None:
            state[target] = (
                torch.cat([t for _, _, t in sorted(pieces, key=lambda p: p[1])]) if len(pieces) > 1 else pieces[0][2]
            )
        else:
            experts = sorted({e for e, _, _ in pieces})
            state[target] = torch.stack(
                [torch.cat([t for e, _, t in sorted(pieces, key=lambda p: p[1]) if e == expert]) for expert in experts]
            )
    return state


class EngineModel(torch.nn.Module):
    """An engine holding ``expected_engine_state``-shaped parameters, loaded the vLLM way."""

    def __init__(self, hf: dict[str, torch.Tensor], *, drop: str | None = None, sneaky: bool = False) -> None:
        super().__init__()
        self.params = torch.nn.ParameterDict()
        for name, tensor in expected_engine_state(hf).items():
            if name != drop:
                self.params[name.replace(".", "__")] = torch.nn.Parameter(torch.zeros_like(tensor), requires_grad=False)
        self.rows = {name: tensor.shape[0] for name, tensor in hf.items()}
        self.sneaky = sneaky

    def named_engine_parameters(self) -> dict[str, torch.Tensor]:
        return {name.replace("__", "."): p for name, p in self.params.items()}

    def load_weights(self, weights):
        for name, tensor in weights:
            target, expert, part = engine_name(name)
            key = target.replace(".", "__")
            if key not in self.params:
                continue  # as vLLM does for names it skips
            param = self.params[key].data
            if expert is not None:
                param = param[expert]
            if name.endswith("norm.weight"):
                param.copy_(tensor.float().to(param.dtype))  # through a temporary: not replayable
                continue
            offset = sum(self.rows[name.replace(engine_part(name, part), engine_part(name, p))] for p in range(part))
            param.narrow(0, offset, tensor.shape[0]).copy_(tensor)
            if self.sneaky and part == 0 and expert is None and target.endswith("qkv_proj.weight"):
                param.view(torch.int16).numpy()[0, 0] ^= 1  # invisible to the recorder


def engine_part(name: str, part: int) -> str:
    """The HF module name of part ``part`` of the fused group ``name`` belongs to."""
    if EXPERT.match(name):
        return (".gate_proj.", ".up_proj.")[part]
    for _, parts in FUSED:
        if any(f".{p}." in name for p in parts):
            return f".{parts[part]}."
    return ""


class InProcessLLM:
    """``LLM.collective_rpc`` in this process: arguments and results cross a pickle, as between
    processes; the worker is ``RefitWorkerExtension`` over ``model``."""

    def __init__(self, model: torch.nn.Module) -> None:
        from mbridge_refit.engines.vllm.worker import RefitWorkerExtension

        class Runner:
            def get_model(self):
                return model

        self.worker = RefitWorkerExtension()
        self.worker.model_runner = Runner()
        self.worker.device = "cpu"
        self.timeouts: list[float] = []
        self.prefix_cache_resets = 0
        self.idle = True  # vLLM refuses the reset while requests hold cached blocks

    def reset_prefix_cache(self) -> bool:
        self.prefix_cache_resets += 1
        return self.idle

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.timeouts.append(timeout)
        args = pickle.loads(pickle.dumps(args))
        return pickle.loads(pickle.dumps([getattr(self.worker, method)(*args)]))


def engine_equals(engine: EngineModel, expected: dict[str, torch.Tensor], what: str) -> None:
    actual = engine.named_engine_parameters()
    if set(actual) != set(expected):
        fail(f"{what}: engine parameters {sorted(set(actual) ^ set(expected))[:4]} differ in name")
    wrong = [n for n in expected if not same_bytes(actual[n], expected[n])]
    if wrong:
        fail(f"{what}: {len(wrong)} engine parameter(s) differ from the oracle, e.g. {wrong[:4]}")


def expect_error(kind: type, needle: str, action, what: str) -> str:
    try:
        action()
    except kind as err:
        if needle not in str(err):
            fail(f"{what}: error does not say {needle!r}: {err}")
        return str(err)
    fail(f"{what}: no {kind.__name__} raised")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf", type=Path, required=True)
    parser.add_argument("--result", type=Path, required=True)
    add_layout_flags(parser)
    args = parser.parse_args()
    layout = layout_from_flags(args)

    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.convert.session import distributed_session
    from mbridge_refit.engines.ipc.engine import EngineRefitError
    from mbridge_refit.engines.ipc.sharing import LocalTransport
    from mbridge_refit.engines.replay.apply_plan import ApplyPlanError
    from mbridge_refit.engines.vllm import VLLMRefit
    from mbridge_refit.errors import EngineError
    from mbridge_refit.models.builder import BuildOptions, build_model

    cpu = torch.device("cpu")
    on_disk = read_checkpoint(args.hf)
    with distributed_session(layout, device=cpu, timeout=datetime.timedelta(minutes=5)):
        rank = dist.get_rank()
        bridge = RefitBridge.from_hf_pretrained(args.hf)
        bridge.bucket_bytes = 64 * 1024  # many buckets, so outputs of one export share shapes across buckets
        chunks = build_model(bridge, layout, BuildOptions(device=cpu, params_dtype=torch.bfloat16))
        bridge.load_hf_shards(chunks, args.hf)
        live = bridge.live_rows(chunks)
        plan_names = [e.hf_name for e in bridge.export_plan(chunks).entries]
        wrong = [name for name, rows in live.items() if not same_bytes(rows.tensor(), on_disk[name])]
        if wrong:
            fail(f"live rows differ from the checkpoint on disk: {wrong[:4]}")
        if layout.tp == layout.pp == layout.ep == 1 and set(live) != set(plan_names):
            fail(f"without model parallelism every tensor is live; not: {sorted(set(plan_names) - set(live))[:4]}")

        engine = EngineModel(on_disk)
        refit = VLLMRefit(InProcessLLM(engine), transport=LocalTransport(), timeout_s=30.0)
        first = refit.refit(bridge, chunks)
        report = first.report or {}
        if not first.opened or report.get("missing") or report.get("unexpected"):
            fail(f"first refit: expected a clean open, got {report}")
        if not report["via_loader"] or not all(n.endswith("norm.weight") for n in report["via_loader"]):
            fail(f"first refit: expected exactly the norms through the loader, got {report['via_loader'][:4]}")
        engine_equals(engine, expected_engine_state(on_disk), "first refit vs checkpoint on disk")
        several_runs = [name for name, rows in live.items() if not rows.is_view]
        if report["composed"] != len(several_runs) or report["refreshed"]:
            fail(
                f"first refit: expected {len(several_runs)} composed live tensors and none refreshed, got {report['composed']} "
                f"and {report['refreshed'][:4]}"
            )

        changed = change_weights(bridge, chunks)
        second = refit.refit(bridge, chunks)
        if second.opened:
            fail("second refit reopened although the export's layout did not change")
        engine_equals(engine, expected_engine_state(changed), "second refit vs stock export of the changed model")
        allocations = bridge.export_diagnostics().allocations
        refit.refit(bridge, chunks)
        if bridge.export_diagnostics().allocations != allocations:
            fail("a steady-state refit allocated export buffers")

        bridge.release_export_buffers()
        third = refit.refit(bridge, chunks)
        exports_something = set(live) != set(plan_names)
        if third.opened != exports_something:
            fail(
                f"a freed export cache must reopen the layout exactly when the refit exports tensors ({exports_something})"
            )
        engine_equals(engine, expected_engine_state(changed), "refit after the cache was freed")

        norm = next(p for chunk in chunks for n, p in chunk.named_parameters() if n.endswith("input_layernorm.weight"))
        norm.data = norm.data.clone().add_(1.0)  # a new storage: a live view of the old one would be stale
        swapped = {name: t.clone() for name, t in bridge.export_hf_weights_stock(chunks, show_progress=False)}
        fourth = refit.refit(bridge, chunks)
        if live and not fourth.opened:  # (an exported view of the parameter reopens too)
            fail("a swapped storage of a live parameter must reopen the layout")
        engine_equals(engine, expected_engine_state(swapped), "refit after a parameter's storage was swapped")

        if refit.llm.prefix_cache_resets != 5:
            fail(f"every refit resets the engine's prefix cache once: 5 refits, {refit.llm.prefix_cache_resets} resets")
        refit.llm.idle = False
        expect_error(
            EngineError, "refused to reset its prefix cache", lambda: refit.refit(bridge, chunks), "a busy engine"
        )
        refit.llm.idle = True

        bad = refit.llm.worker
        message = expect_error(
            EngineRefitError, "plan mismatch", lambda: bad.mbridge_refit_apply("0" * 16), "stale fingerprint"
        )
        dropped = next(n for n in expected_engine_state(on_disk) if n.endswith("post_attention_layernorm.weight"))
        partial = VLLMRefit(InProcessLLM(EngineModel(on_disk, drop=dropped)), transport=LocalTransport())
        missing = expect_error(
            EngineRefitError,
            "not loaded by the engine",
            lambda: partial.refit(bridge, chunks),
            "engine without a parameter",
        )
        if dropped not in missing:
            fail(f"the mismatch error does not name {dropped}: {missing}")
        sneaky = VLLMRefit(InProcessLLM(EngineModel(on_disk, sneaky=True)), transport=LocalTransport())
        expect_error(
            ApplyPlanError, "does not reproduce", lambda: sneaky.refit(bridge, chunks), "invisible loader write"
        )

        result = {
            "rank": rank,
            "ok": True,
            "tensors": first.tensors,
            "copies": report["copies"],
            "via_loader": len(report["via_loader"]),
            "stale_message": message,
        }
        (args.result / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
