"""The engine refit protocols without vLLM: colocated (shared layouts, recorded apply plans,
fingerprints, held export outputs, and the whole loop from a Megatron model into an engine laid
out like vLLM: tests/ranks/engine_refit_check.py) and by broadcast to an engine in a process group
of its own (tests/ranks/engine_broadcast_check.py), under torchrun on CPU.

The vLLM engine itself is checked on the GPU host (scripts/check_vllm_refit_gpu.py).
"""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from conftest import REPO, free_port, torchrun
from test_roundtrip import layout_flags

from mbridge_refit.engines.ipc.sharing import (
    LAYOUT_VERSION,
    CudaIpcTransport,
    LayoutRecorder,
    LocalTransport,
    SharedLayout,
    SharingError,
    views,
)
from mbridge_refit.engines.replay import fingerprint as fp
from mbridge_refit.engines.replay.apply_plan import ApplyPlan
from mbridge_refit.testing.parameter_classes import DispatchingParameter

CHECKER = str(REPO / "tests" / "ranks" / "engine_refit_check.py")
BROADCAST_CHECKER = str(REPO / "tests" / "ranks" / "engine_broadcast_check.py")


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("recipe", "layout"),
    [("qwen3-tiny", "tp1"), ("qwen3-tiny", "tp2"), ("qwen3-moe-tiny", "tp2_ep2"), ("llama-tied-tiny", "pp2")],
)
def test_refit_into_engine_layout(recipe, layout, source_checkpoints, tmp_path):
    nproc, flags = layout_flags(layout)
    run = torchrun(nproc, [CHECKER, "--hf", str(source_checkpoints(recipe)), "--result", str(tmp_path), *flags])
    assert run.returncode == 0, run.output[-6000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]
    assert all(r["ok"] for r in reports)
    assert reports[0]["copies"] > 0 and reports[0]["via_loader"] > 0


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("recipe", "layout"), [("qwen3-tiny", "tp1"), ("qwen3-tiny", "tp2"), ("qwen3-moe-tiny", "ep2")]
)
def test_broadcast_refit_into_engine_layout(recipe, layout, source_checkpoints, tmp_path):
    """``VLLMBroadcastRefit`` from trainer ranks into an engine worker joined by address: the first
    refit records the engine's loader and is exact against the checkpoint; the next two replay the
    recorded copies and are exact against the changed model's stock export; a replaced loader is
    recorded again; a loader the recorder cannot see through, an unloaded engine parameter, a
    failing loader and a plan mismatch fail on every rank, none hangs, and the next refit is exact."""
    nproc, flags = layout_flags(layout)
    port = free_port()
    run = torchrun(
        nproc,
        [
            BROADCAST_CHECKER,
            "--hf",
            str(source_checkpoints(recipe)),
            "--result",
            str(tmp_path),
            "--port",
            str(port),
            *flags,
        ],
    )
    assert run.returncode == 0, run.output[-6000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]
    source, others = reports[0], reports[1:]
    assert all(r["ok"] for r in reports)
    assert source["modes"] == ["recorded", "replayed", "replayed"], source["modes"]
    assert all(count > 0 for count in source["via_loader"]), source["via_loader"]  # the norms, through a temporary
    assert source["mode_after_replaced_loader"] == "recorded"
    for case in ("replaced_loader", "sneaky", "unloaded", "loader", "mismatch"):
        assert not any(r[case]["ok"] for r in reports), case
        assert all(r[case]["seconds"] < 30 for r in reports), case
    assert "injected receiver-load" in source["replaced_loader"]["error"], source["replaced_loader"]
    assert source["sneaky"]["error"].startswith("ApplyPlanError") and "does not reproduce" in source["sneaky"]["error"]
    assert source["unloaded"]["error"].startswith("BroadcastRefitError") and "['extra']" in source["unloaded"]["error"]
    assert source["loader"]["error"].startswith("ValueError: test loader rejects the 5th tensor"), source["loader"]
    assert (
        source["mismatch"]["error"].startswith("PlanMismatchError")
        and "first differing entry #3" in source["mismatch"]["error"]
    )
    for other in others:
        assert other["unloaded"]["error"].startswith("RefitStatusError") and "['extra']" in other["unloaded"]["error"]
        assert "test loader rejects" in other["loader"]["error"] or "consumer failed" in other["loader"]["error"], other
        assert "PlanMismatchError" in other["mismatch"]["error"], other
        assert "does not reproduce" in other["sneaky"]["error"] or "consumer failed" in other["sneaky"]["error"], other
        assert any(s in other["replaced_loader"]["error"] for s in ("injected", "consumer failed")), other


def test_fingerprint_is_exact():
    base = torch.randn(1000, dtype=torch.float32)
    same = base.clone()
    assert fp.tensor_fingerprint(base) == fp.tensor_fingerprint(same)
    flipped = base.clone()
    flipped.view(torch.int32)[123] ^= 1
    assert fp.tensor_fingerprint(flipped) != fp.tensor_fingerprint(base)
    swapped = base.clone()
    swapped[[3, 4]] = base[[4, 3]]
    assert fp.tensor_fingerprint(swapped)[0] == fp.tensor_fingerprint(base)[0]  # the plain sum cannot tell
    assert fp.tensor_fingerprint(swapped) != fp.tensor_fingerprint(base)
    assert fp.tensor_fingerprint(torch.tensor([0.0])) != fp.tensor_fingerprint(torch.tensor([-0.0]))
    odd = torch.arange(7, dtype=torch.uint8)  # a trailing partial word
    assert fp.tensor_fingerprint(odd) != fp.tensor_fingerprint(torch.arange(6, dtype=torch.uint8))
    assert fp.differing({"a": (1, 2), "b": (3, 4)}, {"a": (1, 2), "c": (0, 0)}) == ["b", "c"]


def test_fingerprint_chunks_agree(monkeypatch):
    data = torch.randn(4099, dtype=torch.bfloat16)
    whole = fp.tensor_fingerprint(data)
    monkeypatch.setattr(fp, "_CHUNK_WORDS", 64)
    assert fp.tensor_fingerprint(data) == whole


def test_layout_records_views_and_round_trips():
    base = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    other = torch.ones(3, dtype=torch.bfloat16)
    recorder = LayoutRecorder()
    recorder.add("rows", base[2:5])
    recorder.add("cols", base[:, 1])
    recorder.add("other", other)
    layout, storages = recorder.layout()
    assert layout.storage_bytes == (256, 6) and len(storages) == 2
    wire = pickle.loads(pickle.dumps(layout.to_wire()))
    assert SharedLayout.from_wire(wire) == layout
    assert SharedLayout.from_wire(wire).fingerprint == layout.fingerprint
    transport = LocalTransport()
    payload = transport.share(storages)
    opened = dict(views(layout, transport.open(payload, torch.device("cpu")), torch.device("cpu")))
    assert torch.equal(opened["rows"], base[2:5]) and torch.equal(opened["cols"], base[:, 1])
    base[3, 1] = -1.0  # views, not copies
    assert opened["rows"][1, 1] == -1.0 and opened["cols"][3] == -1.0
    LocalTransport.release(payload)
    with pytest.raises(SharingError, match="another process"):
        transport.open(payload, torch.device("cpu"))


@pytest.mark.parametrize("version", [None, LAYOUT_VERSION + 1])
def test_a_layout_of_another_wire_version_is_refused_by_name(version):
    """The layout a trainer of another mbridge_refit sends (None: one from before layouts were versioned)."""
    recorder = LayoutRecorder()
    recorder.add("a", torch.zeros(4))
    wire = recorder.layout()[0].to_wire()
    wire = {key: value for key, value in wire.items() if key != "version"} | (
        {} if version is None else {"version": version}
    )
    with pytest.raises(SharingError, match="shared layout wire version mismatch") as caught:
        SharedLayout.from_wire(wire)
    shown = "none (an mbridge_refit from before it was versioned)" if version is None else version
    assert f"this side speaks version {LAYOUT_VERSION}, the trainer version {shown}" in str(caught.value)


def test_layout_refuses_storages_that_do_not_fit():
    recorder = LayoutRecorder()
    recorder.add("a", torch.zeros(4))
    layout, _ = recorder.layout()
    with pytest.raises(SharingError, match="has 8 bytes, the layout says 16"):
        views(layout, [torch.zeros(2).untyped_storage()], torch.device("cpu"))
    with pytest.raises(SharingError, match="names 1 storages but 0"):
        views(layout, [], torch.device("cpu"))


def test_ipc_payload_is_not_a_pickle():
    # Crafted payloads of every kind are in test_unpickling.py; this is the one the old transport wrote.
    with pytest.raises(SharingError, match="refusing a CUDA IPC payload: not JSON"):
        CudaIpcTransport().open(pickle.dumps([{"gpu": (torch.Tensor, torch.Size([4]))}]), torch.device("cpu"))


class _Fused(torch.nn.Module):
    """Two HF tensors into one parameter by narrow + copy, like vLLM's fused loaders."""

    def __init__(self):
        super().__init__()
        self.fused = torch.nn.Parameter(torch.zeros(6, 4), requires_grad=False)
        self.scale = torch.nn.Parameter(torch.zeros(4), requires_grad=False)

    def load_weights(self, weights):
        for name, tensor in weights:
            if name == "a":
                self.fused.data.narrow(0, 0, 2).copy_(tensor)
            elif name == "b":
                self.fused.data[2:] = tensor
            elif name == "s":
                self.scale.data.copy_(tensor * 2)  # a temporary: goes through the loader


def test_apply_plan_records_and_replays():
    model = _Fused()
    a, b, s = torch.randn(2, 4), torch.randn(4, 4), torch.randn(4)
    plan = ApplyPlan.record(model, [("a", a), ("b", b), ("s", s), ("extra", torch.zeros(1))])
    assert plan.copies == 2 and plan.via_loader == ["s"] and plan.unexpected == ["extra"] and plan.missing == []
    plan.check_against_loader()
    a.add_(1.0)
    b.mul_(3.0)
    s.sub_(2.0)
    plan.replay()
    assert torch.equal(model.fused.data, torch.cat([a, b])) and torch.equal(model.scale.data, s * 2)


def test_apply_plan_reports_missing_and_partial():
    model = _Fused()
    plan = ApplyPlan.record(model, [("a", torch.randn(2, 4))])
    assert plan.missing == ["scale"] and plan.partial == ["fused"]


class _Recorded:
    """Stands in for the engine's replay event (``engines.ipc.completion.ReplayDone``): counts its records."""

    def __init__(self) -> None:
        self.records = 0

    def record(self) -> None:
        self.records += 1


@pytest.mark.parametrize("signal", [False, True], ids=["waits", "signals"])
def test_receiver_records_again_when_the_engine_replaced_a_parameter(signal):
    """Also when the apply signals by event (it looks for moved parameters before it launches anything: the
    engine may have freed a replaced parameter's old storage), and a plain replay follows into the new one."""
    from mbridge_refit.engines.ipc.engine import RefitReceiver

    model = _Fused()
    recorder = LayoutRecorder()
    a, b, s = torch.randn(2, 4), torch.randn(4, 4), torch.randn(4)
    for name, tensor in (("a", a), ("b", b), ("s", s)):
        recorder.add(name, tensor)
    layout, storages = recorder.layout()
    receiver = RefitReceiver(model, torch.device("cpu"))
    transport = LocalTransport()
    report = receiver.open(layout.to_wire(), transport.share(storages), transport.name)
    assert report["copies"] == 2 and report["via_loader"] == ["s"]
    done = receiver._done = _Recorded() if signal else None
    old = model.fused
    model.fused = torch.nn.Parameter(torch.zeros(6, 4), requires_grad=False)  # e.g. a reload through another path
    old.data.untyped_storage().resize_(0)  # and the old storage freed (a replay into it crashed the engine)
    a.add_(1.0)
    receiver.apply(layout.fingerprint, signal=signal)
    assert torch.equal(model.fused.data, torch.cat([a, b]))
    a.add_(1.0)
    receiver.apply(layout.fingerprint, signal=signal)  # a plain replay into the new parameter
    assert torch.equal(model.fused.data, torch.cat([a, b]))
    assert done is None or done.records == 2


class _Layers(torch.nn.Module):
    """``count`` layers of one parameter of ``DispatchingParameter`` each, loaded by plain copies."""

    def __init__(self, count: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Module() for _ in range(count))
        for layer in self.layers:
            layer.weight = DispatchingParameter(torch.zeros(3))

    def load_weights(self, weights):
        for name, tensor in weights:
            self.get_parameter(name).data.copy_(tensor)


def test_the_look_for_replaced_parameters_does_not_dispatch_per_parameter():
    """The apply's look for replaced parameters reads each written parameter's storage with subclass
    dispatch off: no ``__torch_function__`` call per parameter (about 4 µs each on vLLM's), and it still
    sees a ``.data`` swap and a replaced parameter of the subclass."""
    model = _Layers(64)
    sources = [(f"layers.{i}.weight", torch.randn(3)) for i in range(64)]
    plan = ApplyPlan.record(model, sources)
    DispatchingParameter.calls = 0
    assert plan.targets_moved(model) == []
    assert DispatchingParameter.calls == 0
    model.layers[5].weight.data = torch.zeros(3)
    model.layers[9].weight = DispatchingParameter(torch.zeros(3))
    assert plan.targets_moved(model) == ["layers.5.weight", "layers.9.weight"]


def _streamed(model, buffers, buckets, *, check=True):
    """Record ``model``'s loader bucket by bucket, bucket i landing in ``buffers[i % len(buffers)]``
    (as a broadcast receiver rotates them); returns each bucket's proven replay and the recording."""
    from mbridge_refit.engines.replay.apply_plan import LoadRecording

    recording = LoadRecording(model, buffers)
    replays = []
    for index, bucket in enumerate(buckets):
        buffer, loaded = buffers[index % len(buffers)], []
        for name, values in bucket:
            view = buffer[: values.numel()].view(values.shape)
            view.copy_(values)
            loaded.append(recording.load(name, view))
        replays.append(recording.check(loaded) if check else recording.replayer(loaded))
    return replays, recording


def test_streamed_recording_replays_each_bucket_from_its_reused_buffer():
    """The broadcast transport's recording: a and b arrive in one buffer one after the other; each
    bucket's replay, run right after its bytes land, rebuilds the engine exactly; s goes through the loader."""
    model, buffer = _Fused(), torch.zeros(16)
    a, b, s = torch.randn(2, 4), torch.randn(4, 4), torch.randn(4)
    replays, recording = _streamed(model, [buffer], [[("a", a)], [("b", b), ("s", s)]])
    plan = recording.finish()
    assert plan.copies == 2 and plan.via_loader == ["s"] and plan.missing == []
    assert torch.equal(model.fused.data, torch.cat([a, b])) and torch.equal(model.scale.data, s * 2)
    new_a, new_b = a + 1, b * 3
    buffer[:8].copy_(new_a.reshape(-1))
    replays[0]()
    buffer[:16].copy_(new_b.reshape(-1))
    buffer[16:] = 0
    replays[1]()  # s is read from buffer[:4] by its loader: b's first row now
    assert torch.equal(model.fused.data, torch.cat([new_a, new_b]))


def test_streamed_check_catches_a_write_the_recorder_cannot_see():
    from mbridge_refit.engines.replay.apply_plan import ApplyPlanError

    class Sneaky(_Fused):
        def load_weights(self, weights):
            super().load_weights(weights)
            self.fused.data.numpy()[5, 3] += 1.0  # invisible to the recorder

    with pytest.raises(ApplyPlanError, match=r"does not reproduce.*\['fused'\]"):
        _streamed(Sneaky(), [torch.zeros(16)], [[("a", torch.randn(2, 4)), ("b", torch.randn(4, 4))]])


def test_a_loader_that_keeps_its_sources_fails_the_streamed_recording():
    """A loader writing from a tensor of an earlier bucket while a later one loads (with more buckets
    than buffers, that memory is received into again before the write): the later bucket's check
    fails, and without the check the recording is refused, naming the source."""
    from mbridge_refit.engines.replay.apply_plan import ApplyPlanError

    class Keeping(_Fused):
        held = None

        def load_weights(self, weights):
            for name, tensor in weights:
                if name == "b" and self.held is not None:
                    self.fused.data[:2] = self.held  # a's tensor, written when b arrives
                if name == "a":
                    self.held = tensor
                super().load_weights([(name, tensor)])

    buckets = [[("a", torch.randn(2, 4))], [("b", torch.randn(4, 4))]]
    with pytest.raises(ApplyPlanError, match=r"does not reproduce.*\(loading \['b'\]\)"):
        _streamed(Keeping(), [torch.zeros(16), torch.zeros(16)], buckets)
    _, recording = _streamed(Keeping(), [torch.zeros(16), torch.zeros(16)], buckets, check=False)
    with pytest.raises(ApplyPlanError, match=r"wrote from 1 source\(s\) after later ones arrived, e.g. \['a'\]"):
        recording.finish()


def test_batched_replay_cuts_a_run_where_destinations_overlap():
    """Copies into disjoint memory go as one ``_foreach_copy_``; a copy into memory an earlier copy of
    the run wrote starts another, so the later write lands last."""
    from torch.overrides import TorchFunctionMode

    class Twice(_Fused):
        def load_weights(self, weights):
            for name, tensor in weights:
                self.fused.data.narrow(0, 0, 2).copy_(tensor[:2])  # a and b both write rows 0-1

    class Count(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Count.calls += getattr(func, "__name__", "") == "_foreach_copy_"
            return func(*args, **(kwargs or {}))

    for model, runs in ((_Fused(), 1), (Twice(), 2)):
        replays, _ = _streamed(model, [torch.zeros(32)], [[("a", torch.randn(2, 4)), ("b", torch.randn(4, 4))]])
        Count.calls = 0
        with Count():
            replays[0]()
        assert Count.calls == runs, (type(model).__name__, Count.calls)


def test_loader_failure_names_the_tensor():
    from mbridge_refit.engines.replay.apply_plan import ApplyPlanError

    class Broken(_Fused):
        def load_weights(self, weights):
            for name, _ in weights:
                if name == "b":
                    raise AttributeError("'Parameter' object has no attribute 'load_merged_column_weight'")

    with pytest.raises(
        ApplyPlanError, match=r"failed on b \(4, 4\).*load_merged_column_weight.*replaces its parameters"
    ):
        ApplyPlan.record(Broken(), [("a", torch.zeros(2, 4)), ("b", torch.zeros(4, 4))])


class _Processed(torch.nn.Module):
    """A layer like vLLM's FP8 linear: its loader needs a method of the parameter it created, and
    processing after loading re-registers the parameter (same bytes, or ``transform``'s) without it."""

    def __init__(self, transform=None):
        super().__init__()
        self.transform = transform
        self.weight = self.loadable(torch.zeros(4, 4))
        self.process()

    @staticmethod
    def loadable(data):
        param = torch.nn.Parameter(data, requires_grad=False)
        param.load_rows = lambda loaded, start: param.data[start : start + loaded.shape[0]].copy_(loaded)
        return param

    def process(self):
        data = self.weight.data if self.transform is None else self.transform(self.weight.data)
        self.weight = torch.nn.Parameter(data, requires_grad=False)

    def load_weights(self, weights):
        for name, tensor in weights:
            self.weight.load_rows(tensor, {"top": 0, "bottom": 2}[name])

    def staged_load(self):
        """Like vLLM's layerwise reload: loadable staging parameters in, processed bytes copied back
        into the parameter the engine computes with."""
        from mbridge_refit.engines.replay.apply_plan import StagedLoad

        kernel = {}

        def begin():
            kernel["weight"] = self.weight
            staging = self.loadable(torch.empty_like(self.weight))
            load_rows, pending = staging.load_rows, []

            def buffered(loaded, start):  # vLLM loads a layer once all its tensors have arrived
                pending.append((loaded, start))
                if len(pending) == 2:
                    for args in pending:
                        load_rows(*args)

            staging.load_rows = buffered
            self.weight = staging

        def end():
            self.process()
            kernel["weight"].data.copy_(self.weight)
            self.weight = kernel["weight"]

        return StagedLoad(begin=begin, end=end)


def _open_on(model, staged, tensors):
    from mbridge_refit.engines.ipc.engine import RefitReceiver

    recorder = LayoutRecorder()
    for name, tensor in tensors.items():
        recorder.add(name, tensor)
    layout, storages = recorder.layout()
    receiver = RefitReceiver(model, torch.device("cpu"), staged=staged)
    transport = LocalTransport()
    return receiver, layout, receiver.open(layout.to_wire(), transport.share(storages), transport.name)


def test_an_engine_that_reprocesses_after_loading_is_recorded_through_its_reload():
    from mbridge_refit.engines.replay.apply_plan import ApplyPlanError

    model = _Processed()
    sources = {"top": torch.randn(2, 4), "bottom": torch.randn(2, 4)}
    with pytest.raises(ApplyPlanError):  # the plain loader fails on the processed parameter
        ApplyPlan.record(model, list(sources.items()))
    computes_with = model.weight.data_ptr()
    receiver, layout, report = _open_on(model, model.staged_load(), sources)
    assert report["copies"] == 2 and report["via_loader"] == [] and report["checked_against_loader"]
    assert torch.equal(model.weight.data, torch.cat([sources["top"], sources["bottom"]]))
    sources["top"].add_(1.0)
    receiver.apply(layout.fingerprint)  # a replay: straight into the parameter the engine computes with
    assert model.weight.data_ptr() == computes_with
    assert torch.equal(model.weight.data, torch.cat([sources["top"], sources["bottom"]]))


def test_a_reload_that_changes_the_bytes_is_refused():
    from mbridge_refit.engines.replay.apply_plan import ApplyPlanError

    model = _Processed(transform=lambda w: w * 2)  # e.g. scales re-encoded after loading
    with pytest.raises(ApplyPlanError, match="does not reproduce the engine's loader"):
        _open_on(model, model.staged_load(), {"top": torch.randn(2, 4), "bottom": torch.randn(2, 4)})


class _Grouped(torch.nn.Module):
    """A fused parameter whose first part is ``q``: rows of the trainer's grouped QKV (one run of
    ``q_rows`` per group), loaded by a narrow and copy; ``bias`` whole."""

    def __init__(self, q_rows: int, groups: int, width: int) -> None:
        super().__init__()
        self.fused = torch.nn.Parameter(torch.zeros(q_rows * groups + 3, width), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.zeros(2, width), requires_grad=False)

    def load_weights(self, weights):
        for name, tensor in weights:
            if name == "q":
                self.fused.data.narrow(0, 0, tensor.shape[0]).copy_(tensor)
            elif name == "b":
                self.bias.data.copy_(tensor)
            elif name == "rest":
                self.fused.data.narrow(0, self.fused.shape[0] - 3, 3).copy_(tensor)


def _grouped_case(groups: int = 4, q_rows: int = 2, group_rows: int = 3, width: int = 5):
    """The trainer side: a QKV-like origin [groups * group_rows, width]; ``q`` is rows
    [g*group_rows, g*group_rows + q_rows) of every group, materialized; ``b`` rows 0-1 of another origin."""
    qkv = torch.randn(groups * group_rows, width)
    runs = tuple((g * q_rows, g * group_rows, q_rows) for g in range(groups))
    q = torch.cat([qkv[start : start + count] for _, start, count in runs])
    other = torch.randn(4, width)
    b = other[1:3].clone()
    return qkv, runs, q, other, b


def test_rows_are_composed_to_read_the_origin():
    from mbridge_refit.engines.ipc.engine import RefitReceiver

    qkv, runs, q, other, b = _grouped_case()
    rest = torch.randn(3, 5)
    recorder = LayoutRecorder()
    recorder.add("q", q, rows=(qkv, runs))
    recorder.add("b", b, rows=(other, ((0, 1, 2),)))
    recorder.add("rest", rest)
    layout, storages = recorder.layout()
    model = _Grouped(q_rows=2, groups=4, width=5)
    receiver = RefitReceiver(model, torch.device("cpu"))
    transport = LocalTransport()
    report = receiver.open(layout.to_wire(), transport.share(storages), transport.name)
    assert report["composed"] == 2 and report["refreshed"] == [] and report["checked_against_loader"]
    assert torch.equal(model.fused.data[:8], q) and torch.equal(model.bias.data, b)
    step = next(s for s in receiver.plan.steps if s.name == "q")
    assert len(step.copies) == 1 and step.copies[0][0].shape == (4, 2, 5)  # four equally spaced runs, one strided copy
    qkv.mul_(-2.0).add_(1.0)  # the origins change; the materialized copies do not
    other.add_(3.0)
    receiver.apply(layout.fingerprint)
    expected_q = torch.cat([qkv[start : start + count] for _, start, count in runs])
    assert torch.equal(model.fused.data[:8], expected_q) and not torch.equal(expected_q, q)
    assert torch.equal(model.bias.data, other[1:3])


def test_rows_a_loader_reads_in_other_shapes_are_refreshed_before_each_replay():
    class Transposing(_Grouped):
        def load_weights(self, weights):
            for name, tensor in weights:
                if name == "q":
                    self.fused.data[:8].copy_(
                        tensor.t().contiguous().t()
                    )  # reads through a temporary: loader every step
                else:
                    super().load_weights([(name, tensor)])

    class Columns(_Grouped):
        def load_weights(self, weights):
            for name, tensor in weights:
                if name == "q":
                    self.fused.data[:8, :2].copy_(tensor[:, :2])  # column slices: not whole rows
                    self.fused.data[:8, 2:].copy_(tensor[:, 2:])
                else:
                    super().load_weights([(name, tensor)])

    for engine in (Transposing, Columns):
        qkv, runs, model, receiver, layout, report = _open_q_only(engine)
        assert report["composed"] == 0 and report["refreshed"] == ["q"], engine.__name__
        qkv.add_(5.0)
        receiver.apply(layout.fingerprint)
        assert torch.equal(model.fused.data[:8], torch.cat([qkv[s : s + n] for _, s, n in runs])), engine.__name__


def _open_q_only(engine: type):
    """An engine of class ``engine`` opened on ``q`` (named as rows of the QKV origin) and ``rest``."""
    from mbridge_refit.engines.ipc.engine import RefitReceiver

    qkv, runs, q, _, _ = _grouped_case()
    recorder = LayoutRecorder()
    recorder.add("q", q, rows=(qkv, runs))
    recorder.add("rest", torch.randn(3, 5))
    layout, storages = recorder.layout()
    model = engine(q_rows=2, groups=4, width=5)
    receiver = RefitReceiver(model, torch.device("cpu"))
    transport = LocalTransport()
    report = receiver.open(layout.to_wire(), transport.share(storages), transport.name, allow_partial=True)
    return qkv, runs, model, receiver, layout, report


def test_composed_rows_are_rebuilt_before_the_loader_is_recorded_again():
    qkv, runs, model, receiver, layout, report = _open_q_only(_Grouped)
    assert report["composed"] == 1
    model.fused = torch.nn.Parameter(torch.zeros_like(model.fused), requires_grad=False)  # the engine reloaded it
    qkv.add_(7.0)
    receiver.apply(layout.fingerprint)
    assert torch.equal(model.fused.data[:8], torch.cat([qkv[s : s + n] for _, s, n in runs]))


def test_row_runs_that_do_not_make_the_tensor_are_refused():
    from mbridge_refit.engines.ipc.sharing import row_sources

    qkv, runs, q, _, _ = _grouped_case()
    for bad in (runs[:-1], (*runs[:-1], (6, 11, 2)), ((0, 0, 4), (2, 4, 6))):
        recorder = LayoutRecorder()
        recorder.add("q", q, rows=(qkv, bad))
        layout, storages = recorder.layout()
        with pytest.raises(SharingError, match="row runs"):
            row_sources(layout, storages, torch.device("cpu"))
    with pytest.raises(SharingError, match="cannot make"):
        LayoutRecorder().add("q", q, rows=(qkv.double(), runs))


def test_an_in_place_op_on_no_element_keeps_a_copy_replayable():
    class Padded(torch.nn.Module):  # vLLM's vocabulary-parallel embedding: copy, then zero the padding
        def __init__(self, rows: int, padded: int):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(padded, 4), requires_grad=False)
            self.rows = rows

        def load_weights(self, weights):
            for _, tensor in weights:
                self.weight.data[: tensor.shape[0]].copy_(tensor)
                self.weight.data[tensor.shape[0] :].fill_(0)

    unpadded = ApplyPlan.record(Padded(6, 6), [("w", torch.randn(6, 4))])
    assert unpadded.via_loader == [] and unpadded.copies == 1
    padded = ApplyPlan.record(Padded(6, 8), [("w", torch.randn(6, 4))])
    assert padded.via_loader == ["w"]  # zeroing real padding rows is not a copy: the loader runs every step
