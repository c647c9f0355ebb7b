"""An engine adapter plugs into the colocated transport without vLLM: a few lines bind
``engines.ipc.trainer.IpcSession`` to an engine of this test's own (its workers called in this
process, arguments and results pickled as between processes; the worker is the transport's engine
side, ``engines.ipc.engine.RefitReceiver``), and a Megatron model on one CPU rank refits it exactly.

Oracles: the checkpoint on disk for the first refit, the stock export (Megatron-Bridge's own) of the
changed model for the second; never our own export.
"""

from __future__ import annotations

import datetime
import os
import pickle
import sys
import time

import pytest
import torch
from conftest import REPO, loaded_model

from mbridge_refit.engines.ipc.sharing import LocalTransport
from mbridge_refit.engines.ipc.trainer import IpcSession
from mbridge_refit.engines.replay.fingerprint import FINGERPRINT_VERSION, fingerprints_to_wire, named_fingerprints
from mbridge_refit.errors import EngineError
from mbridge_refit.testing.copy_engine import CopyEngine
from mbridge_refit.testing.copy_engine import CopyEngineWorker as Worker

sys.path.insert(0, str(REPO / "tests" / "ranks"))
from oracle import read_checkpoint  # noqa: E402
from rank_checks import change_weights  # noqa: E402

SKIPPED = "model.norm.weight"  # a name this engine does not have: its adapter says it skips it


class Engine(CopyEngine):
    """The stand-in engine, without the name its adapter skips."""

    def __init__(self, hf: dict[str, torch.Tensor]) -> None:
        super().__init__(hf, skipped={SKIPPED})


def test_an_engine_adapter_of_its_own_refits_through_ipc_session_exactly(source_checkpoints):
    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.convert.session import distributed_session
    from mbridge_refit.models.builder import BuildOptions, build_model
    from mbridge_refit.plan.layout import ParallelLayout
    from mbridge_refit.testing.conformance import restored_environment

    hf_dir = source_checkpoints("qwen3-tiny")
    on_disk = read_checkpoint(hf_dir)
    engine = Engine(on_disk)
    worker, written, called = Worker(engine), [], []

    def call_workers(method, *args):  # the adapter: how to reach its engine's workers
        called.append(method.removeprefix("mbridge_refit_"))
        args = pickle.loads(pickle.dumps(args))
        return pickle.loads(pickle.dumps([getattr(worker, method)(*args)]))

    session = IpcSession(
        call_workers,
        transport=LocalTransport(),
        ignored=lambda bridge: frozenset({SKIPPED}),
        after_weights_written=lambda: written.append(True),
    )
    cpu, layout = torch.device("cpu"), ParallelLayout()
    with restored_environment(), distributed_session(layout, device=cpu, timeout=datetime.timedelta(minutes=2)):
        bridge = RefitBridge.from_hf_pretrained(hf_dir)
        chunks = build_model(bridge, layout, BuildOptions(device=cpu, params_dtype=torch.bfloat16))
        bridge.load_hf_shards(chunks, hf_dir)

        first = session.refit(bridge, chunks)
        assert first.opened and not first.report["missing"] and not first.report["unexpected"], first.report
        expected = {name: t for name, t in on_disk.items() if name != SKIPPED}
        assert first.tensors == len(expected)
        state = engine.state()
        assert set(state) == set(expected)
        assert [n for n in expected if not torch.equal(state[n].view(torch.uint8), expected[n].view(torch.uint8))] == []

        changed = change_weights(bridge, chunks)  # the stock export of the changed model
        second = session.refit(bridge, chunks)
        assert not second.opened  # replayed
        assert 0 < second.export_cpu_ms <= second.export_ms + 1.0, (
            second
        )  # this thread's CPU time, within the wall time
        state = engine.state()
        wrong = [n for n in state if not torch.equal(state[n].view(torch.uint8), changed[n].view(torch.uint8))]
        assert wrong == []
        assert written == [True, True]

        replaced = _replace_parameters(chunks)  # new Parameter objects and a .data swap, as offloading frameworks do
        changed = {name: t.clone() for name, t in bridge.export_hf_weights_stock(chunks, show_progress=False)}
        third = session.refit(bridge, chunks)
        state = engine.state()
        wrong = [n for n in state if not torch.equal(state[n].view(torch.uint8), changed[n].view(torch.uint8))]
        assert wrong == [], (replaced, wrong[:5])
        assert third.opened  # the parameters the engine mapped are no longer the model's: shared anew

        called.clear()  # a .data swap alone is seen before the engine is asked for anything: the step opens
        swapped = _swap_a_live_parameter(chunks)
        changed = {name: t.clone() for name, t in bridge.export_hf_weights_stock(chunks, show_progress=False)}
        fourth = session.refit(bridge, chunks)
        state = engine.state()
        wrong = [n for n in state if not torch.equal(state[n].view(torch.uint8), changed[n].view(torch.uint8))]
        assert wrong == [], (swapped, wrong[:5])
        assert fourth.opened and called == ["open"], called  # the engine never read the old storage
        called.clear()
        assert not session.refit(bridge, chunks).opened and called == ["apply"]  # the new layout replays
        session.close()
        bridge.release_export_buffers()
    assert not worker.receiver.is_open


def test_an_early_apply_reaches_the_worker_during_the_export_and_reads_nothing_before_the_go_ahead(
    source_checkpoints, monkeypatch
):
    """``early_apply``: a steady step's apply RPC arrives while the trainer still exports, and the worker
    replays only after the export ended; the live parameters' addresses are read after the word, while it
    copies, and a ``.data`` swap found there opens the layout anew before the step returns; a step whose
    parameters were replaced tells the waiting worker to skip, then opens; a failed export leaves no worker
    waiting. Oracle: the stock export of the changed model."""
    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.convert.session import distributed_session
    from mbridge_refit.engines.ipc import trainer as ipc_session
    from mbridge_refit.engines.ipc.go_ahead import GoAheadError, GoAheadLine, GoAheadWaiter
    from mbridge_refit.engines.replay.apply_plan import ApplyPlan
    from mbridge_refit.errors import TransportError
    from mbridge_refit.models.builder import BuildOptions, build_model
    from mbridge_refit.plan.layout import ParallelLayout
    from mbridge_refit.testing.conformance import restored_environment

    hf_dir = source_checkpoints("qwen3-tiny")
    engine = Engine(read_checkpoint(hf_dir))
    worker, events = Worker(engine), []

    def call_workers(method, *args):
        if method == "mbridge_refit_apply":
            events.append(("arrived", time.monotonic()))
        result = getattr(worker, method)(*pickle.loads(pickle.dumps(args)))
        if method == "mbridge_refit_apply":
            events.append(("returned", result))
        return pickle.loads(pickle.dumps([result]))

    replay, send, pointers = ApplyPlan.replay, GoAheadLine.send, ipc_session.live_pointers
    monkeypatch.setattr(ApplyPlan, "replay", lambda plan: (events.append(("replay", time.monotonic())), replay(plan)))
    monkeypatch.setattr(GoAheadLine, "send", lambda *a: (events.append(("word", time.monotonic())), send(*a))[1])
    monkeypatch.setattr(
        ipc_session, "live_pointers", lambda p: (events.append(("pointers", time.monotonic())), pointers(p))[1]
    )
    session = IpcSession(
        call_workers,
        transport=LocalTransport(),
        ignored=lambda bridge: frozenset({SKIPPED}),
        early_apply=True,
        timeout_s=30.0,
    )

    def state_is(expected: dict[str, torch.Tensor]) -> list[str]:
        state = engine.state()
        return [n for n in state if not torch.equal(state[n].view(torch.uint8), expected[n].view(torch.uint8))]

    cpu, layout = torch.device("cpu"), ParallelLayout()
    with restored_environment(), distributed_session(layout, device=cpu, timeout=datetime.timedelta(minutes=2)):
        bridge = RefitBridge.from_hf_pretrained(hf_dir)
        chunks = build_model(bridge, layout, BuildOptions(device=cpu, params_dtype=torch.bfloat16))
        bridge.load_hf_shards(chunks, hf_dir)
        export = bridge.export_hf_weight_buckets

        def slow_export(*args, **kwargs):  # the export's end, marked after a pause the RPC overtakes
            buckets = list(export(*args, **kwargs))
            time.sleep(0.3)
            events.append(("exported", time.monotonic()))
            return iter(buckets)

        monkeypatch.setattr(bridge, "export_hf_weight_buckets", slow_export)
        first = session.refit(bridge, chunks)
        assert first.opened and first.report["go_ahead"], first.report

        events.clear()
        changed = change_weights(bridge, chunks)
        second = session.refit(bridge, chunks)
        assert not second.opened and second.early and state_is(changed) == []
        marks = dict((what, at) for what, at in events if what in ("arrived", "exported", "replay", "word", "pointers"))
        assert marks["arrived"] < marks["exported"] < marks["word"] < marks["replay"], events
        assert marks["word"] < marks["pointers"], events  # read while the worker copies

        events.clear()
        _swap_a_live_parameter(chunks)  # found after the word: its old storage copied, then the layout shared anew
        changed = {name: t.clone() for name, t in bridge.export_hf_weights_stock(chunks, show_progress=False)}
        third = session.refit(bridge, chunks)
        assert third.opened and state_is(changed) == []
        whats = [what for what, _ in events if what not in ("exported", "pointers")]
        assert whats[:4] == ["arrived", "word", "replay", "returned"], events
        assert ("returned", None) not in events, events

        events.clear()
        _replace_parameters(chunks)  # new objects: found before the word, the worker skips
        changed = {name: t.clone() for name, t in bridge.export_hf_weights_stock(chunks, show_progress=False)}
        replaced = session.refit(bridge, chunks)
        assert replaced.opened and state_is(changed) == []
        whats = [what for what, _ in events if what not in ("exported", "pointers")]
        assert whats[:3] == ["arrived", "word", "returned"] and ("returned", None) in events, events

        events.clear()
        monkeypatch.setattr(bridge, "export_hf_weight_buckets", lambda *a, **k: (_ for _ in ()).throw(OSError("lost")))
        with pytest.raises(OSError, match="lost"):
            session.refit(bridge, chunks)
        assert [e for e in events if e[0] == "returned"] == [("returned", None)]  # the worker was let go

        monkeypatch.setattr(bridge, "export_hf_weight_buckets", export)
        changed = change_weights(bridge, chunks)
        fourth = session.refit(bridge, chunks)
        assert not fourth.opened and fourth.early and state_is(changed) == []

        session.check_after_word, changed = False, change_weights(bridge, chunks)
        events.clear()
        checked_first = session.refit(bridge, chunks)  # the addresses read before the word
        assert not checked_first.opened and checked_first.early and state_is(changed) == []
        marks = dict((what, at) for what, at in events if what in ("pointers", "word"))
        assert marks["pointers"] < marks["word"], events
        session.check_after_word = True

        waited = GoAheadWaiter.wait

        def too_late(self, step):  # the word came after the worker's wait gave up (a slow collective export)
            raise GoAheadError(f"the trainer's go-ahead for step {step} did not come within its timeout")

        monkeypatch.setattr(GoAheadWaiter, "wait", too_late)
        changed = change_weights(bridge, chunks)
        late = session.refit(bridge, chunks)  # applied after the export instead, exactly
        assert not late.opened and not late.early and state_is(changed) == []
        monkeypatch.setattr(GoAheadWaiter, "wait", waited)
        changed = change_weights(bridge, chunks)
        assert not session.refit(bridge, chunks).early and state_is(changed) == []  # late until the next open

        _swap_a_live_parameter(chunks)  # a new open, a new line
        changed = {name: t.clone() for name, t in bridge.export_hf_weights_stock(chunks, show_progress=False)}
        assert session.refit(bridge, chunks).opened and state_is(changed) == []
        session.timeout_s, slow = 0.5, [True]

        def stuck_then_through(method, *args):  # an apply RPC that outlives the session's timeout once
            if method == "mbridge_refit_apply" and slow:
                slow.clear()
                time.sleep(1.5)
            return call_workers(method, *args)

        session.call_workers = stuck_then_through
        with pytest.raises(TimeoutError):
            session.refit(bridge, chunks)
        with pytest.raises(TransportError, match="has not returned"):
            session.refit(bridge, chunks)  # refused while it still runs
        time.sleep(2.0)
        session.timeout_s = 30.0
        changed = change_weights(bridge, chunks)
        reopened = session.refit(bridge, chunks)  # the layout was dropped: opened anew, exactly
        assert reopened.opened and state_is(changed) == []
        session.call_workers = call_workers

        def unreachable(cls, offer):
            raise GoAheadError("another network namespace")

        monkeypatch.setattr(GoAheadWaiter, "connect", classmethod(unreachable))  # a worker that cannot take the line
        _swap_a_live_parameter(chunks)
        fifth = session.refit(bridge, chunks)
        assert fifth.opened and not fifth.report["go_ahead"], fifth.report
        assert "another network namespace" in fifth.report["go_ahead_error"]
        changed = change_weights(bridge, chunks)
        sixth = session.refit(bridge, chunks)  # applied the old way
        assert not sixth.opened and not sixth.early and state_is(changed) == []
        session.close()
        bridge.release_export_buffers()
    assert not worker.receiver.is_open


@pytest.mark.parametrize("early_apply", [True, False], ids=["early", "late"])
def test_a_steady_step_holds_collections_off_until_the_engine_applied(source_checkpoints, monkeypatch, early_apply):
    """``defer_gc``: a steady step exports and asks for the apply with the collector off and turns it on
    again as the engine's copies are let go: before the go-ahead (the worker's replay runs with it on) or,
    applied late, once the apply returned (the replay inside it ran with it off). An open (the first, or
    after a parameter was replaced) is not held off, a failed export leaves it on, ``defer_gc=False`` never turns it off, and a collector the caller
    turned off stays off. The engine still ends up with the stock export of the changed model."""
    import gc

    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.convert.session import distributed_session
    from mbridge_refit.engines.replay.apply_plan import ApplyPlan
    from mbridge_refit.models.builder import BuildOptions, build_model
    from mbridge_refit.plan.layout import ParallelLayout
    from mbridge_refit.testing.conformance import restored_environment

    hf_dir = source_checkpoints("qwen3-tiny")
    engine = Engine(read_checkpoint(hf_dir))
    worker, seen = Worker(engine), []
    replay = ApplyPlan.replay
    monkeypatch.setattr(ApplyPlan, "replay", lambda plan: (seen.append(("replay", gc.isenabled())), replay(plan)))

    def call_workers(method, *args):
        seen.append((method.removeprefix("mbridge_refit_"), gc.isenabled()))
        return pickle.loads(pickle.dumps([getattr(worker, method)(*pickle.loads(pickle.dumps(args)))]))

    session = IpcSession(
        call_workers,
        transport=LocalTransport(),
        ignored=lambda bridge: frozenset({SKIPPED}),
        after_weights_written=lambda: seen.append(("follow-up", gc.isenabled())),
        early_apply=early_apply,
        timeout_s=30.0,
    )
    cpu, layout = torch.device("cpu"), ParallelLayout()
    with restored_environment(), distributed_session(layout, device=cpu, timeout=datetime.timedelta(minutes=2)):
        bridge = RefitBridge.from_hf_pretrained(hf_dir)
        chunks = build_model(bridge, layout, BuildOptions(device=cpu, params_dtype=torch.bfloat16))
        bridge.load_hf_shards(chunks, hf_dir)
        export, fail = bridge.export_hf_weight_buckets, []

        def watched_export(*args, **kwargs):
            seen.append(("export", gc.isenabled()))
            if fail:
                raise RuntimeError("the export failed")
            return export(*args, **kwargs)

        monkeypatch.setattr(bridge, "export_hf_weight_buckets", watched_export)
        assert gc.isenabled()
        session.refit(bridge, chunks)
        assert seen[0] == ("export", True) and ("open", True) in seen and seen[-1] == ("follow-up", True), seen
        seen.clear()
        changed = change_weights(bridge, chunks)
        step = session.refit(bridge, chunks)
        assert not step.opened and step.early == early_apply
        if early_apply:  # asked for before the export; the word lets the replay go, with the collector on
            assert seen == [("apply", False), ("export", False), ("replay", True), ("follow-up", True)], seen
        else:
            assert seen == [("export", False), ("apply", False), ("replay", False), ("follow-up", True)], seen
        assert gc.isenabled()
        state = engine.state()
        assert [n for n in state if not torch.equal(state[n].view(torch.uint8), changed[n].view(torch.uint8))] == []

        seen.clear()
        _replace_parameters(chunks)  # planned anew: the step opens, its export not held off
        assert session.refit(bridge, chunks).opened and ("export", True) in seen, seen

        seen.clear()
        fail.append(True)
        with pytest.raises(RuntimeError, match="the export failed"):
            session.refit(bridge, chunks)
        assert gc.isenabled()
        fail.clear()

        session.defer_gc = False
        seen.clear()
        session.refit(bridge, chunks)
        assert ("export", True) in seen and ("apply", True) in seen, seen
        session.defer_gc = True
        gc.disable()
        try:
            seen.clear()
            session.refit(bridge, chunks)
            assert all(not enabled for _, enabled in seen) and not gc.isenabled(), seen
        finally:
            gc.enable()
        session.close()
        bridge.release_export_buffers()


def _replace_parameters(chunks) -> list[str]:
    """Replace two of the model's parameters by new objects (``module.weight = Parameter(...)``, as a checkpoint
    reload with ``assign=True`` does) and swap a third's storage (``param.data = ...``), each with other values."""
    named = [
        (name, module) for chunk in chunks for name, module in chunk.named_modules() if "weight" in module._parameters
    ]
    done = []
    for name, module in named[:2]:
        old = module.weight
        module.weight = torch.nn.Parameter(old.detach() * 2 + 1, requires_grad=old.requires_grad)
        done.append(f"{name}.weight replaced")
    name, module = named[-1]
    module.weight.data = module.weight.detach() * 3 - 1
    done.append(f"{name}.weight .data swapped")
    return done


def _swap_a_live_parameter(chunks) -> str:
    """``param.data = ...`` on the first layer's output projection, with other values: the same
    Parameter object, new storage."""
    name, module = next(
        (name, module)
        for chunk in chunks
        for name, module in chunk.named_modules()
        if name.endswith("linear_proj") and "weight" in module._parameters
    )
    module.weight.data = module.weight.detach() * 5 + 2
    return f"{name}.weight .data swapped"


def test_the_engine_agnostic_sessions_import_without_any_engine_adapter():
    import subprocess

    code = (
        "import sys, mbridge_refit.engines.ipc.trainer, mbridge_refit.engines.broadcast.trainer; "
        "print(sorted(m for m in sys.modules if m.startswith('mbridge_refit.engines.vllm') or m == 'vllm'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


class _Signal:
    """Stands in for the engine's replay event opened on the trainer (``engines.ipc.completion.DoneSignal``)."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def wait(self, timeout_s: float) -> None:
        self.calls.append("wait")


def _signalling_session(monkeypatch, calls: list[str], reset) -> IpcSession:
    """A session over an engine whose open report carries a replay event handle (as a CUDA engine's does):
    the RPCs, the follow-up and the waits land in ``calls`` in the order they happen."""
    import mbridge_refit.engines.ipc.trainer as ipc_session

    monkeypatch.setattr(ipc_session.DoneSignal, "open", classmethod(lambda cls, handle, device: _Signal(calls)))
    monkeypatch.setattr(ipc_session.torch.cuda, "current_device", lambda: 0)

    def call_workers(method, *args):
        signal = method == "mbridge_refit_apply" and args[1]
        calls.append(method.removeprefix("mbridge_refit_") + (" signalled" if signal else ""))
        return [{"completion": "00" * 64} if method == "mbridge_refit_open" else 0.1]

    return IpcSession(call_workers, transport=LocalTransport(), after_weights_written=reset)


def test_a_signalled_apply_runs_the_follow_up_before_it_waits_for_the_copies(monkeypatch):
    """The engine's follow-up (the prefix-cache reset) is asked for while the copies run, and the refit
    returns only after the wait on the engine's event, also when the follow-up fails."""
    calls: list[str] = []
    tensors = [("a", torch.arange(8, dtype=torch.float32))]
    session = _signalling_session(monkeypatch, calls, reset=lambda: calls.append("reset"))
    session.refit_stream(iter(tensors))
    assert calls == ["open", "reset"]  # the open itself returns when the engine is done
    calls.clear()
    step = session.refit_stream(iter(tensors))
    assert calls == ["apply signalled", "reset", "wait"] and not step.opened and step.reset_ms is not None
    calls.clear()
    session.overlap_follow_up = False  # the engine waits for its copies itself, the reset after them
    session.refit_stream(iter(tensors))
    assert calls == ["apply", "reset"]
    session.overlap_follow_up = True

    def refused():
        calls.append("reset")
        raise RuntimeError("the engine refused to reset its prefix cache")

    calls.clear()
    session.after_weights_written = refused
    try:
        session.refit_stream(iter(tensors))
    except RuntimeError:
        pass
    else:
        raise AssertionError("the follow-up's failure must fail the step")
    assert calls == ["apply signalled", "reset", "wait"]
    session.close()


def test_a_bad_replay_event_handle_is_refused_before_the_session_trusts_the_layout(monkeypatch):
    """An open report whose event handle is not one raises, and the session does not keep a layout whose
    applies it could not wait for: the next step opens again."""
    from mbridge_refit.engines.ipc.sharing import SharingError

    opened = []

    def call_workers(method, *args):
        opened.append(method)
        return [{"completion": "not hex"} if method == "mbridge_refit_open" else 0.1]

    monkeypatch.setattr("mbridge_refit.engines.ipc.trainer.torch.cuda.current_device", lambda: 0)
    session = IpcSession(call_workers, transport=LocalTransport())
    tensors = [("a", torch.arange(8, dtype=torch.float32))]
    for _ in range(2):
        try:
            session.refit_stream(iter(tensors))
        except SharingError as err:
            assert "replay event handle" in str(err)
        else:
            raise AssertionError("a malformed event handle must be refused")
    assert opened == ["mbridge_refit_open", "mbridge_refit_open"]


def test_a_cpu_engine_asked_for_an_event_has_none_and_applies_synchronously():
    """``completion=True`` on a device without CUDA events: the report has no handle, the apply waits itself."""
    engine = Engine({"a": torch.zeros(8)})
    worker = Worker(engine)
    session = IpcSession(lambda method, *args: [getattr(worker, method)(*args)], transport=LocalTransport())
    source = torch.arange(8, dtype=torch.float32)
    first = session.refit_stream(iter([("a", source)]))
    assert first.report["completion"] is None
    source += 1
    session.refit_stream(iter([("a", source)]))
    assert torch.equal(engine.state()["a"], source)
    session.close()


def test_only_a_single_worker_s_event_is_waited_on(monkeypatch):
    """Two workers answering the open would each record their own event: the session then waits in the RPC."""
    import mbridge_refit.engines.ipc.trainer as ipc_session

    opened = []
    monkeypatch.setattr(ipc_session.DoneSignal, "open", classmethod(lambda cls, handle, device: opened.append(handle)))

    def call_workers(method, *args):
        if method == "mbridge_refit_open":
            return [{"completion": "01" * 64}, {"completion": "02" * 64}]
        assert args[1] is False, "an apply must not be signalled when nobody waits on every worker"
        return [0.1, 0.1]

    session = IpcSession(call_workers, transport=LocalTransport())
    tensors = [("a", torch.arange(8, dtype=torch.float32))]
    session.refit_stream(iter(tensors))
    session.refit_stream(iter(tensors))
    assert opened == []


def _fp8_oracle(bridge, chunks) -> dict[str, torch.Tensor]:
    """The FP8 refit's oracle: Megatron-Bridge's own (stock) export of the model as it is now, through
    the reference quantizer where the format quantizes (``testing.export_comparison.fp8_expected``)."""
    from mbridge_refit.testing.export_comparison import fp8_expected

    stock = [(name, t.detach().clone()) for name, t in bridge.export_hf_weights_stock(chunks, show_progress=False)]
    return dict(fp8_expected(stock, bridge.fp8_config("blockwise")))


class _PickledEngine:
    """This test's ``Engine`` started from ``expected``, behind its ``Worker``, called as over RPC
    (arguments and results pickled): ``call_workers`` for a session, ``differs`` for the oracle."""

    def __init__(self, expected: dict[str, torch.Tensor]) -> None:
        self.engine = Engine(expected)
        self.worker = Worker(self.engine)

    def call_workers(self, method, *args):
        return pickle.loads(pickle.dumps([getattr(self.worker, method)(*pickle.loads(pickle.dumps(args)))]))

    def differs(self, oracle: dict[str, torch.Tensor]) -> list[str]:
        """The engine's tensors whose bits are not the oracle's."""
        state = self.engine.state()
        assert set(state) == set(oracle) - {SKIPPED}
        return [n for n in state if not torch.equal(state[n].view(torch.uint8), oracle[n].view(torch.uint8))]


def test_a_steady_fp8_refit_skips_noting_each_tensor_only_while_they_stay_where_they_were(
    monkeypatch, source_checkpoints
):
    """The FP8 export's tensors are the export's held buffers. A steady refit that finds the last
    refit's very tensor objects at the same addresses (``ExportSnapshot``) notes none of them
    (``LayoutRecorder.add``); once the export's buffers are freed and made anew, the refit notes them
    and shares the new layout, and the engine holds the new weights, not the old buffers' (which the
    session still holds, so a wrong shortcut would read them: stale values, not a crash)."""
    from mbridge_refit.convert.session import distributed_session
    from mbridge_refit.engines.ipc import sharing
    from mbridge_refit.plan.layout import ParallelLayout
    from mbridge_refit.testing.conformance import restored_environment

    cpu, layout = torch.device("cpu"), ParallelLayout()
    noted = []
    add = sharing.LayoutRecorder.add

    def noting_add(self, name, *args, **kwargs):
        noted.append(name)
        return add(self, name, *args, **kwargs)

    monkeypatch.setattr(sharing.LayoutRecorder, "add", noting_add)
    with restored_environment(), distributed_session(layout, device=cpu, timeout=datetime.timedelta(minutes=2)):
        bridge, chunks = loaded_model(source_checkpoints("qwen3-tiny"), layout, cpu)
        expected = _fp8_oracle(bridge, chunks)
        assert all(torch.isfinite(t.float()).all() for t in expected.values())
        engine = _PickledEngine(expected)
        engine_differs = engine.differs
        generator = torch.Generator().manual_seed(7)

        def change() -> dict[str, torch.Tensor]:
            """New values in every parameter (seeded noise: every quantized weight's bits change, which
            repeated affine changes do not guarantee), in place; the new oracle, which must differ
            from what the engine holds in every quantized weight, or a stale engine could pass."""
            with torch.no_grad():
                for chunk in chunks:
                    for param in chunk.parameters():
                        param.add_(torch.randn(param.shape, generator=generator).to(param.dtype))
            oracle = _fp8_oracle(bridge, chunks)
            stale = {n for n in engine_differs(oracle) if n.endswith("weight_scale_inv")}
            assert stale == {n for n in oracle if n.endswith("weight_scale_inv")}, "a change left a scale as it was"
            return oracle

        session = IpcSession(
            engine.call_workers, transport=LocalTransport(), ignored=lambda bridge: frozenset({SKIPPED})
        )
        first = session.refit(bridge, chunks, fp8="blockwise")
        assert first.opened and engine_differs(expected) == []
        quantized = sum(1 for name in expected if name.endswith("weight_scale_inv"))
        assert quantized > 0

        oracle = change()
        noted.clear()
        second = session.refit(bridge, chunks, fp8="blockwise")
        assert not second.opened and noted == []  # the same tensors, where they were: nothing noted
        assert engine_differs(oracle) == []

        oracle = change()
        bridge.release_export_buffers()  # the next export writes into buffers made anew
        third = session.refit(bridge, chunks, fp8="blockwise")
        assert engine_differs(oracle) == []  # a shortcut here would leave every scale as it was
        assert len(noted) >= 2 * quantized and third.opened  # other tensors: noted, and shared anew

        noted.clear()
        oracle = change()
        fourth = session.refit(bridge, chunks, fp8="blockwise")
        assert not fourth.opened and noted == [] and engine_differs(oracle) == []
        session.close()
        bridge.release_export_buffers()


def _expert_weights(chunks) -> list[tuple[str, torch.nn.Module, str]]:
    """(module name, module, parameter name) of every 2-D expert weight of the model."""
    return [
        (name, module, pname)
        for chunk in chunks
        for name, module in chunk.named_modules()
        if ".experts." in f"{name}."
        for pname, param in module._parameters.items()
        if param is not None and param.dim() == 2
    ]


class _GroupedKernelStandIn:
    """``fp8.kernels`` on the CPU, for its grouped launches only: a launch keeps the ``(source, q, scale)``
    views it was planned with and quantizes from them by the reference, as a CUDA launch reads the
    pointers it was planned with (so a launch reused for sources that moved reads the old ones)."""

    @staticmethod
    def usable(kind: str) -> bool:
        return kind == "grouped"

    @staticmethod
    def grouped_takes(x: torch.Tensor) -> bool:
        return True

    @staticmethod
    def grouped_writes(q: torch.Tensor) -> bool:
        return True

    @staticmethod
    def grouped_launch(jobs: list) -> list:
        return list(jobs)

    @staticmethod
    def launch_grouped(launch: list) -> None:
        from mbridge_refit.fp8.reference import quantize_reference

        for source, q, scale in launch:
            quantize_reference(source, out=q, scale_out=scale)


@pytest.mark.parametrize("launches", ["reference", "planned-launches"])
@pytest.mark.parametrize("quantizer", ["trainer", "engine"])
def test_a_steady_moe_fp8_refit_follows_replaced_and_swapped_expert_weights(
    source_checkpoints, monkeypatch, launches, quantizer
):
    """With the trainer quantizing (``engine_quantizes=False``), an MoE model's expert buckets come stamped
    (``runtime.stamps``): the exporter's kept views, then the quantizer's steady path, then the session's
    snapshot, each trusting the last stamp instead of looking at every tensor. With the engine quantizing
    the experts' rows itself (the default), the trainer exports none of them and the engine's quantizer
    launches were planned at the open for the parameters it mapped. Either way, an expert weight replaced by
    a new Parameter and another whose ``.data`` is swapped must break those shortcuts, and so must the
    export's buffers made anew: the engine then holds the quantized new values (the oracle: the stock export
    of the model as it is now, through the reference quantizer), and steady refits after it stay exact.
    ``planned-launches`` quantizes as the CUDA grouped kernel does, from the sources its launches were planned
    with (``_GroupedKernelStandIn``), so a steady path that kept a launch across a moved source reads the old
    weights."""
    from mbridge_refit.convert.session import distributed_session
    from mbridge_refit.fp8 import quantize
    from mbridge_refit.plan.layout import ParallelLayout
    from mbridge_refit.testing.conformance import restored_environment

    if launches == "planned-launches":
        monkeypatch.setattr(quantize, "_cuda_kernels", lambda: _GroupedKernelStandIn)
    cpu, layout = torch.device("cpu"), ParallelLayout()
    with restored_environment(), distributed_session(layout, device=cpu, timeout=datetime.timedelta(minutes=2)):
        bridge, chunks = loaded_model(source_checkpoints("qwen3-moe-tiny"), layout, cpu)
        expected = _fp8_oracle(bridge, chunks)
        engine = _PickledEngine(expected)
        engine_differs = engine.differs
        generator = torch.Generator().manual_seed(11)

        def noise(t: torch.Tensor) -> torch.Tensor:
            return t.detach() + torch.randn(t.shape, generator=generator).to(t.dtype)

        session = IpcSession(
            engine.call_workers,
            transport=LocalTransport(),
            ignored=lambda bridge: frozenset({SKIPPED}),
            engine_quantizes=quantizer == "engine",
        )
        first = session.refit(bridge, chunks, fp8="blockwise")
        assert first.opened and engine_differs(expected) == []
        scales = {name for name in expected if name.endswith("weight_scale_inv")}
        in_engine = {scale for _, scale in bridge.quantized_live_rows(chunks, fp8="blockwise").values()}
        assert len(in_engine) >= len(_expert_weights(chunks)), in_engine  # every expert's rows are whole blocks
        # this engine loads each weight by one copy: the engine quantizes straight into its parameters, and the
        # trainer exports the rest (q, k, v of this tiny model are runs of fewer rows than a block)
        assert first.report["quantized_in_place"] == (len(in_engine) if quantizer == "engine" else 0)
        exported = {name for bucket in session._steady[0].buckets for name, _ in bucket}
        assert exported & scales == (scales - in_engine if quantizer == "engine" else scales)

        def stamps() -> tuple:
            """The last refit's buckets' stamps, as the session's snapshot saw them (no export of the test's own:
            another export's selection would make the exporter's views anew)."""
            return session._steady[0].stamps

        def change_all() -> dict[str, torch.Tensor]:
            with torch.no_grad():
                for chunk in chunks:
                    for param in chunk.parameters():
                        param.copy_(noise(param))
            return _fp8_oracle(bridge, chunks)

        for _ in range(2):
            oracle = change_all()
            assert not session.refit(bridge, chunks, fp8="blockwise").opened and engine_differs(oracle) == []
        steady = stamps()
        oracle = change_all()
        assert not session.refit(bridge, chunks, fp8="blockwise").opened and engine_differs(oracle) == []
        if quantizer == "trainer":
            assert stamps() == steady and sum(s is not None for s in steady) >= 2, steady  # the steady path ran

        experts = _expert_weights(chunks)
        assert len(experts) >= 4, experts
        (_, replaced, replaced_name), (_, swapped, swapped_name) = experts[0], experts[-1]
        old = getattr(replaced, replaced_name)
        setattr(replaced, replaced_name, torch.nn.Parameter(noise(old), requires_grad=old.requires_grad))
        getattr(swapped, swapped_name).data = noise(getattr(swapped, swapped_name))
        oracle = _fp8_oracle(bridge, chunks)
        stale = engine_differs(oracle)
        assert len([n for n in stale if n.endswith("weight_scale_inv")]) >= 2, stale  # both experts changed
        assert session.refit(bridge, chunks, fp8="blockwise").opened == (quantizer == "engine")
        assert engine_differs(oracle) == []
        if quantizer == "trainer":
            moved = [i for i, (a, b) in enumerate(zip(stamps(), steady)) if a != b]
            assert len(moved) >= 2 and all(steady[i] is not None for i in moved), (moved, steady)

        def change_experts() -> dict[str, torch.Tensor]:
            with torch.no_grad():
                for _, module, pname in experts:
                    getattr(module, pname).copy_(noise(getattr(module, pname)))
            return _fp8_oracle(bridge, chunks)

        for _ in range(2):  # steady again, on the new parameters
            oracle = change_experts()
            assert not session.refit(bridge, chunks, fp8="blockwise").opened
            assert engine_differs(oracle) == []

        oracle = change_experts()
        bridge.release_export_buffers()  # quantized into buffers made anew: the old ones, still held, are stale
        assert session.refit(bridge, chunks, fp8="blockwise").opened and engine_differs(oracle) == []
        oracle = change_experts()
        assert not session.refit(bridge, chunks, fp8="blockwise").opened and engine_differs(oracle) == []
        bridge.check_lifetime = True  # the checking mode: held tensors guarded until the next export
        for _ in range(2):
            oracle = change_experts()
            session.refit(bridge, chunks, fp8="blockwise")
            assert engine_differs(oracle) == []
        session.close()
        bridge.release_export_buffers()


def test_an_export_snapshot_trusts_a_stamp_only_where_both_exports_carry_the_same_one():
    """``ExportSnapshot.same_as``: a stamped bucket is compared by its stamp (``runtime.stamps``), every other
    pair by name, object and address; a bucket stamped anew, a stamp against none, another owner or another
    tensor object (even a view at the same address) is not the same export."""
    from mbridge_refit.engines.ipc.sharing import ExportSnapshot
    from mbridge_refit.runtime.stamps import StampedBucket, new_stamp

    weight, norm = torch.zeros(4, 4), torch.zeros(4)
    experts = [("experts.0", weight[:2]), ("experts.1", weight[2:])]
    stamp, owner = new_stamp(), object()

    def snapshot(stamped, loose, *, owner=owner) -> ExportSnapshot:
        return ExportSnapshot([stamped, loose], owner=owner)

    first = snapshot(StampedBucket(experts, stamp), [("norm", norm)])
    assert snapshot(StampedBucket(experts, stamp), [("norm", norm)]).same_as(first)
    assert not snapshot(StampedBucket(experts, new_stamp()), [("norm", norm)]).same_as(first)
    assert not snapshot(list(experts), [("norm", norm)]).same_as(first)
    assert not snapshot(StampedBucket(experts, stamp), [("norm", norm)], owner=object()).same_as(first)
    assert not snapshot(StampedBucket(experts, stamp), [("norm", norm.view(4))]).same_as(first)
    assert not snapshot(StampedBucket(experts, stamp), [("norm.weight", norm)]).same_as(first)
    assert not snapshot(StampedBucket(experts, stamp), [("norm", norm)]).same_as(None)
    assert [name for name, _ in first.pairs(frozenset({"experts.1"}))] == ["experts.0", "norm"]


def test_a_step_through_a_check_loads_what_arrives_even_for_weights_the_engine_quantizes(source_checkpoints):
    """``through`` may alter a tensor in place (the same object, other bytes): that step's weights are loaded as
    they arrive, not named as quantized from the trainer's rows (the engine would otherwise load the altered
    tensor once and then overwrite it with the rows' quantization, or refuse the open); the next step opens
    anew and the engine quantizes again. Oracle: the stock export through the reference quantizer."""
    from mbridge_refit.convert.session import distributed_session
    from mbridge_refit.plan.layout import ParallelLayout
    from mbridge_refit.testing.conformance import restored_environment

    cpu, layout = torch.device("cpu"), ParallelLayout()
    with restored_environment(), distributed_session(layout, device=cpu, timeout=datetime.timedelta(minutes=2)):
        bridge, chunks = loaded_model(source_checkpoints("qwen3-moe-tiny"), layout, cpu)
        expected = _fp8_oracle(bridge, chunks)
        engine = _PickledEngine(expected)
        session = IpcSession(
            engine.call_workers, transport=LocalTransport(), ignored=lambda bridge: frozenset({SKIPPED})
        )
        assert session.refit(bridge, chunks, fp8="blockwise").report["quantized_in_place"] > 0
        victim = next(name for name in bridge.quantized_live_rows(chunks, fp8="blockwise") if ".experts." in name)

        def altered_in_place(stream):
            for name, tensor in stream:
                if name == victim:
                    tensor.view(torch.uint8).add_(1)  # the session's own tensor, altered where it is
                yield name, tensor

        step = session.refit(bridge, chunks, fp8="blockwise", through=altered_in_place)
        assert step.opened and step.report["quantized"] == 0
        assert engine.differs(expected) == [victim]
        again = session.refit(bridge, chunks, fp8="blockwise")
        assert again.opened and again.report["quantized_in_place"] > 0 and engine.differs(expected) == []
        session.close()


def test_a_step_the_sender_refuses_still_runs_its_collective_export(source_checkpoints, tmp_path):
    """Two ranks at TP 2; the sender refuses a step while an earlier apply RPC still runs, after its
    export ran on both ranks, and every later step leaves the engine holding the trainer's weights of
    that step (oracle: every parameter filled with the step's number; tests/ranks/ipc_refused_step_check.py)."""
    import json

    from conftest import torchrun

    checker = str(REPO / "tests" / "ranks" / "ipc_refused_step_check.py")
    run = torchrun(2, [checker, "--hf", str(source_checkpoints("qwen3-tiny")), "--result", str(tmp_path), "--tp", "2"])
    assert run.returncode == 0, run.output[-6000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [s["outcome"] for s in reports[0]["steps"]][2] == "TransportError", reports


def test_close_releases_the_session_s_references_even_when_the_engine_cannot_be_told():
    """An engine that is gone: ``close`` raises its error once, after the session dropped the storages, the
    routes and the exported tensors it held (the caller frees the model next)."""
    engine = Engine({"a": torch.zeros(8)})
    worker = Worker(engine)
    tensor = torch.arange(8, dtype=torch.float32)
    session = IpcSession(
        lambda method, *args: [getattr(worker, method)(*args)], transport=LocalTransport(), early_apply=False
    )
    assert session.refit_stream([("a", tensor)]).opened and torch.equal(engine.state()["a"], tensor)

    def gone(method, *args):
        raise ConnectionError("the engine is gone")

    session.call_workers = gone
    with pytest.raises(ConnectionError, match="gone"):
        session.close()
    assert session._held == [] and session._layout is None and session._payload is None
    session.close()  # nothing left to tell the engine: no error


def _go_ahead_report(pid: int) -> list[dict]:
    """A single worker's open answer: connected to the line, from ``pid``."""
    return [{"go_ahead": True, "go_ahead_pid": pid}]


def test_the_open_takes_the_go_ahead_connection_of_the_pid_its_worker_answered_with():
    """A process of this uid holding the token (a leak), queued before the worker: the open takes the
    worker's connection (the pid of its answer), and the word reaches the worker, not the stranger."""
    from local_strangers import Stranger

    from mbridge_refit.engines.ipc import trainer as ipc_session
    from mbridge_refit.engines.ipc.go_ahead import GoAheadLine, GoAheadWaiter

    stranger = Stranger()
    line = GoAheadLine.listen()
    offer = line.offer(2.0)
    try:
        assert stranger.connect(line.address, [bytes.fromhex(offer["token"])]) == 1
        waiter = GoAheadWaiter.connect(offer)
        taken = ipc_session._accepted(line, _go_ahead_report(os.getpid()))
        assert taken is line
        line.send(1, True)
        assert waiter.wait(1) is True
        assert stranger.outcomes() in (["read"], ["unread"])  # closed, its token read or not (the pid known)
        waiter.close()
    finally:
        stranger.close()
        line.close()


def test_an_open_whose_worker_connection_was_refused_or_is_not_there_gives_up_at_once():
    """The worker answered that it connected: where its connection was refused (a wrong token), or none of
    its pid is on the line (here the answer names another pid), the open goes on without the line at once,
    not after the accept's 10 s."""
    import socket

    from mbridge_refit.engines.ipc import trainer as ipc_session
    from mbridge_refit.engines.ipc.go_ahead import GoAheadLine, GoAheadWaiter

    line = GoAheadLine.listen()
    mistaken = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        mistaken.connect(line.address)
        mistaken.sendall(b"\0" * 16)
        started = time.monotonic()
        assert ipc_session._accepted(line, _go_ahead_report(os.getpid())) is None
        assert time.monotonic() - started < 2.0
    finally:
        mistaken.close()
        line.close()
    line = GoAheadLine.listen()
    waiter = GoAheadWaiter.connect(line.offer(2.0))
    try:
        started = time.monotonic()
        assert ipc_session._accepted(line, _go_ahead_report(os.getppid())) is None
        assert time.monotonic() - started < 2.0
    finally:
        waiter.close()
        line.close()


def test_a_flood_of_strangers_during_the_open_leaves_the_early_apply_on():
    """A process of this uid fills the line's queue (64 connections, silent or with wrong tokens) while the
    open RPC travels, before the worker connects: the worker still connects, the open takes its line (its
    applies will come early) and the open is not held up."""
    from local_strangers import Stranger

    engine = Engine({"a": torch.zeros(8)})
    worker, stranger, flooded = Worker(engine), Stranger(), []

    def call_workers(method, *args):
        if method == "mbridge_refit_open" and not flooded:
            address = bytes.fromhex(args[6]["address"]).decode()  # the go-ahead offer
            flooded.append(stranger.connect(address, [None, b"\0" * 16] * 32))
        return [getattr(worker, method)(*args)]

    session = IpcSession(call_workers, transport=LocalTransport(), early_apply=True, timeout_s=5.0)
    tensor = torch.arange(8, dtype=torch.float32)
    try:
        started = time.monotonic()
        step = session.refit_stream([("a", tensor)])
        took = time.monotonic() - started
        assert step.opened and step.report["go_ahead"], step.report
        assert step.report["go_ahead_pid"] == os.getpid()
        assert session._go_ahead is not None and session._go_ahead.connected  # early applies on
        assert took < 2.0 and flooded == [64], (took, flooded)
        assert torch.equal(engine.state()["a"], tensor)
    finally:
        session.close()
        stranger.close()


@pytest.mark.parametrize("version", [None, FINGERPRINT_VERSION + 1])
def test_an_engine_s_fingerprints_of_another_version_are_refused_by_name(version):
    """An engine of another mbridge_refit (None: its bare ``{name: [sum, weighted]}``, from before the
    reply carried a version) answers the fingerprints RPC: refused, never compared as weights."""
    numbers = {"model.norm.weight": [1, 2]}
    reply = numbers if version is None else {"version": version, "fingerprints": numbers}
    session = IpcSession(lambda method, *args: [reply])
    with pytest.raises(EngineError, match="fingerprints reply wire version mismatch") as caught:
        session.fingerprints()
    shown = "none (an mbridge_refit from before it was versioned)" if version is None else version
    assert f"this side speaks version {FINGERPRINT_VERSION}, the engine version {shown}" in str(caught.value)


def test_an_engine_s_fingerprints_reply_round_trips():
    fingerprints = named_fingerprints([("a", torch.arange(5.0)), ("b", torch.ones(3, dtype=torch.bfloat16))])
    session = IpcSession(lambda method, *args: [fingerprints_to_wire(fingerprints)])
    assert session.fingerprints() == fingerprints
