"""An engine that quantizes the trainer's rows itself (``sharing.QuantizedRef``,
``ApplyPlan.compose_quantized``): where its loader copies a whole FP8 weight and its scale, the replay
quantizes straight into its parameters; where it does anything else, into the trainer's held tensors,
which the recorded copies then read. Either way the engine holds the blockwise quantization of the
trainer's current rows.

Oracle: ``fp8.reference.quantize_reference`` of the rows, gathered by the test (never the engine's own
quantizer output compared with itself).
"""

from __future__ import annotations

import pytest
import torch

from mbridge_refit.engines.ipc.engine import RefitReceiver
from mbridge_refit.engines.ipc.sharing import LayoutRecorder, LocalTransport, SharedLayout, SharingError
from mbridge_refit.engines.replay.apply_plan import ApplyPlanError
from mbridge_refit.fp8.format import FP8_DTYPE, SCALE_DTYPE, scale_shape
from mbridge_refit.fp8.quantize import JobQuantizer, block_row_jobs
from mbridge_refit.fp8.reference import quantize_reference

WIDTH = 256
Q_RUNS = ((0, 0, 256), (256, 384, 256))  # q: rows 0-255 and 384-639 of the trainer's QKV (k, v between)
W_RUNS = ((0, 128, 200),)  # w: a 200-row view (its last block partial) of a parameter, from row 128


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def _expected(origin: torch.Tensor, runs) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensor the runs make, gathered here, quantized by the reference."""
    return quantize_reference(torch.cat([origin[start : start + count] for _, start, count in runs]))


class _Trainer:
    """The trainer's side: two parameters and the FP8 weights the engine quantizes from their rows."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(3)
        self.qkv = (torch.randn(768, WIDTH, generator=generator) * 0.05).to(torch.bfloat16)
        self.mlp = (torch.randn(400, WIDTH, generator=generator) * 2).to(torch.bfloat16)
        self.sources = {"q": (self.qkv, Q_RUNS), "w": (self.mlp, W_RUNS)}
        self.kv, self.kv_scale = quantize_reference(self.qkv[256:384])

    def layout(self, runs_of: dict | None = None) -> tuple[SharedLayout, list]:
        """Quantized once here (the open's tensors, for the engine's loader) and named as rows."""
        recorder = LayoutRecorder()
        for name, (origin, runs) in self.sources.items():
            runs = (runs_of or {}).get(name, runs)
            rows = sum(count for _, _, count in runs)
            q = torch.empty(rows, WIDTH, dtype=FP8_DTYPE)
            scale = torch.empty(scale_shape((rows, WIDTH)), dtype=SCALE_DTYPE)
            JobQuantizer(block_row_jobs(origin, runs, q, scale)).run()
            recorder.add(name, q, quantized=(origin, runs, f"{name}_scale_inv"))
            recorder.add(f"{name}_scale_inv", scale)
        recorder.add("kv", self.kv)  # exported by the trainer as it is (the rest of the fused parameter)
        recorder.add("kv_scale_inv", self.kv_scale)
        return recorder.layout()

    def step(self) -> None:
        self.qkv.mul_(-3).add_(0.25)
        self.mlp.mul_(0.5)


class _Engine(torch.nn.Module):
    """q into the first rows of a fused FP8 parameter, w whole into its own; scales alike (one copy each)."""

    def __init__(self) -> None:
        super().__init__()
        self.fused = torch.nn.Parameter(torch.zeros(640, WIDTH, dtype=FP8_DTYPE), requires_grad=False)
        self.fused_scale = torch.nn.Parameter(torch.zeros(5, 2), requires_grad=False)
        self.w = torch.nn.Parameter(torch.zeros(200, WIDTH, dtype=FP8_DTYPE), requires_grad=False)
        self.w_scale = torch.nn.Parameter(torch.zeros(2, 2), requires_grad=False)

    # where the loader copies each tensor: (parameter, first row), in order
    PLACES = {
        "q": (("fused", 0),),
        "q_scale_inv": (("fused_scale", 0),),
        "kv": (("fused", 512),),
        "kv_scale_inv": (("fused_scale", 4),),
        "w": (("w", 0),),
        "w_scale_inv": (("w_scale", 0),),
    }

    def load_weights(self, weights):
        for name, tensor in weights:
            for parameter, row in self.PLACES.get(name, ()):
                getattr(self, parameter).data.narrow(0, row, tensor.shape[0]).copy_(tensor)

    def held(self) -> dict[str, torch.Tensor]:
        return {"q": self.fused[:512], "q_scale_inv": self.fused_scale[:4], "w": self.w, "w_scale_inv": self.w_scale}


class _Halves(_Engine):
    """w in two copies of half its rows, and q's scale through a temporary: neither quantizable in place."""

    def load_weights(self, weights):
        for name, tensor in weights:
            if name == "w":
                self.w.data[:100].copy_(tensor[:100])
                self.w.data[100:].copy_(tensor[100:])
            elif name == "q_scale_inv":
                self.fused_scale.data.narrow(0, 0, 4).copy_(tensor * 1)
            else:
                super().load_weights([(name, tensor)])


def _open(
    engine: _Engine, trainer: _Trainer, check: bool = True, **layout_args
) -> tuple[RefitReceiver, SharedLayout, dict]:
    layout, storages = trainer.layout(**layout_args)
    receiver = RefitReceiver(engine, torch.device("cpu"))
    transport = LocalTransport()
    report = receiver.open(layout.to_wire(), transport.share(storages), transport.name, check=check)
    return receiver, layout, report


def _replays_hold_the_trainer_s(receiver: RefitReceiver, layout: SharedLayout, engine: _Engine, trainer: _Trainer):
    """The engine holds the trainer's rows as quantized by the reference after the open and after two replays
    of changed rows."""
    for _ in range(2):
        _assert_holds_the_trainer_s(engine, trainer)
        trainer.step()
        receiver.apply(layout.fingerprint)
    _assert_holds_the_trainer_s(engine, trainer)


def _assert_holds_the_trainer_s(engine: _Engine, trainer: _Trainer) -> None:
    held = engine.held()
    for name, (origin, runs) in trainer.sources.items():
        q, scale = _expected(origin, runs)
        assert torch.equal(_bits(held[name]), _bits(q)), name
        assert torch.equal(held[f"{name}_scale_inv"], scale), name


@pytest.mark.parametrize("engine_class, in_place", [(_Engine, 2), (_Halves, 0)], ids=["in-place", "into-buffers"])
def test_the_engine_quantizes_the_trainer_s_current_rows_every_replay(engine_class, in_place):
    trainer, engine = _Trainer(), engine_class()
    receiver, layout, report = _open(engine, trainer)
    assert report["quantized"] == 2 and report["quantized_in_place"] == in_place and report["checked_against_loader"]
    _assert_holds_the_trainer_s(engine, trainer)
    copies = {step.name: len(step.copies) for step in receiver.plan.steps}
    if in_place:
        # the quantizer writes the parameters; the exported tensors are copied
        assert copies == {"q": 0, "q_scale_inv": 0, "w": 0, "w_scale_inv": 0, "kv": 1, "kv_scale_inv": 1}
    for _ in range(2):
        trainer.step()  # the trainer's parameters change; the tensors quantized at the open do not
        receiver.apply(layout.fingerprint)
        _assert_holds_the_trainer_s(engine, trainer)


def test_an_engine_parameter_replaced_is_recorded_again_from_freshly_quantized_sources():
    trainer, engine = _Trainer(), _Engine()
    receiver, layout, _ = _open(engine, trainer)
    engine.fused = torch.nn.Parameter(torch.zeros_like(engine.fused), requires_grad=False)  # a reload elsewhere
    trainer.step()
    receiver.apply(layout.fingerprint)  # the loader recorded again: from sources quantized from the new rows
    _assert_holds_the_trainer_s(engine, trainer)
    assert receiver.plan.quantized_in_place == ["q", "w"]
    trainer.step()
    receiver.apply(layout.fingerprint)
    _assert_holds_the_trainer_s(engine, trainer)


def test_runs_off_the_block_grid_are_refused_by_name():
    """The trainer names only whole-block runs (``RefitBridge.quantized_live_rows``); a layout that names
    others cannot be quantized to the same blocks, and the open says so instead of loading other bits."""
    trainer = _Trainer()
    trainer.sources["q"] = (trainer.qkv, ((0, 0, 200), (200, 384, 312)))
    with pytest.raises(ApplyPlanError, match=r"q: .*whole 128-row blocks"):
        _open(_Engine(), trainer)


def test_a_quantized_ref_survives_the_wire_and_changes_the_fingerprint():
    trainer = _Trainer()
    layout, _ = trainer.layout()
    again = SharedLayout.from_wire(layout.to_wire())
    assert again == layout and again.refs[0].quantized.scale == "q_scale_inv"
    assert again.refs[0].quantized.rows.runs == Q_RUNS and again.refs[0].quantized.dtype == "bfloat16"
    wire = layout.to_wire()
    unquantized = SharedLayout.from_wire(wire | {"refs": [ref[:7] for ref in wire["refs"]]})
    assert unquantized.refs[0].quantized is None and unquantized.fingerprint != layout.fingerprint


def test_a_quantized_tensor_must_be_2d_rows_of_its_source():
    recorder = LayoutRecorder()
    with pytest.raises(SharingError, match="cannot be the quantized rows"):
        recorder.add("x", torch.empty(4, 8, 2, dtype=FP8_DTYPE), quantized=(torch.zeros(4, 8), ((0, 0, 4),), "s"))
    with pytest.raises(SharingError, match="cannot be the quantized rows"):
        recorder.add("x", torch.empty(4, 8, dtype=FP8_DTYPE), quantized=(torch.zeros(4, 16), ((0, 0, 4),), "s"))


class _KvFirst(_Trainer):
    """The layout with the exported ``kv`` before the weights the engine quantizes."""

    def layout(self, runs_of: dict | None = None) -> tuple[SharedLayout, list]:
        layout, storages = super().layout(runs_of)
        refs = (*layout.refs[-2:], *layout.refs[:-2])
        return SharedLayout(refs=refs, storage_bytes=layout.storage_bytes), storages


class _Overlapping(_Engine):
    """``kv`` copied over q's last 128 rows (and its scale over q's last scale row) before q lands on top:
    the loader's order decides those bytes."""

    PLACES = _Engine.PLACES | {
        "kv": (("fused", 384), ("fused", 512)),
        "kv_scale_inv": (("fused_scale", 3), ("fused_scale", 4)),
    }


@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
def test_a_destination_another_copy_also_writes_is_not_quantized_in_place(check):
    """Quantizing in place writes before every copy, not at the weight's turn: where another copy writes the
    same bytes earlier in the loader's order, in place would let that copy win. Such a weight is quantized
    into its source and copied at its turn, so the engine holds what the loader left (q on top), checked
    against the loader at the open or not."""
    trainer, engine = _KvFirst(), _Overlapping()
    receiver, layout, report = _open(engine, trainer, check=check)
    assert report["quantized_in_place"] == 1 and receiver.plan.quantized_in_place == ["w"]
    _replays_hold_the_trainer_s(receiver, layout, engine, trainer)


def test_a_quantize_job_writes_only_its_source_s_device():
    with pytest.raises(ValueError, match="writes only its own device"):
        JobQuantizer(
            [(torch.zeros(128, 128), torch.empty(128, 128, dtype=FP8_DTYPE, device="meta"), torch.empty(1, 1))]
        )


class _Straddling(_Engine):
    """q in the fused parameter's last 512 rows; kv in its first 128 and again from row 64, so that a copy earlier in
    the loader's order starts before q's rows and ends inside them (q lands on top)."""

    PLACES = _Engine.PLACES | {
        "q": (("fused", 128),),
        "q_scale_inv": (("fused_scale", 1),),
        "kv": (("fused", 0), ("fused", 64)),
        "kv_scale_inv": (("fused_scale", 0),),
    }

    def held(self) -> dict[str, torch.Tensor]:
        return super().held() | {"q": self.fused[128:], "q_scale_inv": self.fused_scale[1:]}


class _ZeroingLoader(_Engine):
    """kv's scale through the loader, which zeroes the whole scale parameter first (as vLLM's padded loaders zero
    what they do not copy): a write the recorder cannot place, over q's scale rows, earlier in the loader's order."""

    def load_weights(self, weights):
        for name, tensor in weights:
            if name == "kv_scale_inv":
                self.fused_scale.data.zero_()
                self.fused_scale.data.narrow(0, 4, 1).copy_(tensor)
            else:
                super().load_weights([(name, tensor)])


@pytest.mark.parametrize("engine_class", [_Straddling, _ZeroingLoader])
def test_a_destination_an_earlier_write_reaches_into_is_copied_at_its_turn(engine_class):
    """A copy that starts before q's destination and ends inside it, or a loader step that writes q's scale
    parameter: either way q is quantized into its source and copied at its turn (w, untouched, in place)."""
    trainer, engine = _KvFirst(), engine_class()
    receiver, layout, report = _open(engine, trainer, check=False)
    assert receiver.plan.quantized_in_place == ["w"], report
    _replays_hold_the_trainer_s(receiver, layout, engine, trainer)


class _LoaderZeroesW(_Engine):
    """kv's loader also clears w's first 128 rows by an in-place op (not a copy): a loader step's write."""

    def load_weights(self, weights):
        for name, tensor in weights:
            super().load_weights([(name, tensor)])
            if name == "kv":
                self.w.data.view(torch.uint8).narrow(0, 0, 128).zero_()


class _Pooled(_Engine):
    """``fused`` and ``w`` views of one pool (the recorder names one parameter per storage); kv's loader also
    writes w's first rows from a temporary."""

    def __init__(self) -> None:
        super().__init__()
        pool = torch.zeros(840, WIDTH, dtype=FP8_DTYPE)
        self.fused = torch.nn.Parameter(pool[:640], requires_grad=False)
        self.w = torch.nn.Parameter(pool[640:], requires_grad=False)

    def load_weights(self, weights):
        for name, tensor in weights:
            super().load_weights([(name, tensor)])
            if name == "kv":
                self.w.data.narrow(0, 0, 128).copy_(tensor.clone())


@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
@pytest.mark.parametrize("engine_class", [_LoaderZeroesW, _Pooled])
def test_a_loader_step_s_write_keeps_the_weight_it_reaches_copied_at_its_turn(engine_class, check):
    """A loader step earlier in the loader's order writes w's rows, by an in-place op or into a parameter that
    shares w's storage: w is not quantized in place (the replay would quantize it before that write)."""
    trainer, engine = _KvFirst(), engine_class()
    receiver, layout, _ = _open(engine, trainer, check=check)
    assert "w" not in receiver.plan.quantized_in_place
    _replays_hold_the_trainer_s(receiver, layout, engine, trainer)
