"""A checkpoint's byte items (and tensor items) are checked against the package's own allow-list, whatever torch's
process-wide safe globals hold.

Importing megatron.core registers its safe globals with torch (Megatron's enums, numpy dtypes, Namespace, ...),
and torch's weights_only loader then BUILDs on any instance of an allowed type, enum members included: a crafted
byte item could change ``AttnBackend.flash`` for the whole process while being "checked", and DCP's own load (a
full pickle) would do the same. Each attack here is a crafted item in a real torch_dist checkpoint, read
through the package's paths (``check_pickled_parts``, Megatron's ``dist_checkpointing`` under
``checked_megatron_reads``, ``CheckedFileSystemReader``, ``convert export``): refused naming the global or
opcode, and the process state unchanged. Byte items as Megatron writes them (its common state with Megatron-LM's
args, TE's ``_extra_state``) still load.
"""

from __future__ import annotations

import argparse
import collections
import copyreg
import enum
import io
import pathlib
import signal
import zipfile

import numpy as np
import pytest
import torch
from megatron.core.dist_checkpointing.serialization import load_common_state_dict
from megatron.core.enums import ModelType
from megatron.core.rerun_state_machine import RerunMode, RerunState
from megatron.core.transformer.enums import AttnBackend, CudaGraphScope
from test_input_faults import convert
from test_unpickling import _megatron_dir, _saved
from torch.distributed.checkpoint.api import CheckpointException

from mbridge_refit.checkpoints.dcp_pickles import CheckedFileSystemReader, checked_megatron_reads
from mbridge_refit.checkpoints.megatron import NotAMegatronCheckpoint, check_pickled_parts
from mbridge_refit.convert import ExitCode

PROBED_ENUMS = (AttnBackend, ModelType, RerunMode, signal.Signals)


@pytest.fixture(autouse=True)
def megatron_safe_globals():
    """Megatron-Core's safe globals are registered (so torch's weights_only loader takes its enums), and every
    member of the probed enums is put back as it was after the test (an attack that got through must not
    spoil the next test)."""
    assert AttnBackend in torch.serialization.get_safe_globals(), "importing megatron.core registers its safe globals"
    saved = {member: dict(vars(member)) for kind in PROBED_ENUMS for member in kind}
    yield
    for member, state in saved.items():
        vars(member).clear()
        vars(member).update(state)


def process_state():
    """What an attack would change: the members' values and names, a numpy dtype's byte order."""
    members = {f"{kind.__name__}.{m.name}": (m.value, m.name) for kind in PROBED_ENUMS for m in kind}
    return members, np.dtype("u4").str, np.dtype("f4").str


class _Reduce:
    """Pickles as ``func(*args)``, then BUILD with ``state`` if given."""

    def __init__(self, func, args, state=None):
        self.value = (func, args) if state is None else (func, args, state)

    def __reduce__(self):
        return self.value


def _archive(data_pkl: bytes) -> bytes:
    """torch.save's archive of a list, its pickle replaced by ``data_pkl`` (records stored, as torch writes them)."""
    source = zipfile.ZipFile(io.BytesIO(_saved([0])))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        for info in source.infolist():
            body = data_pkl if info.filename.endswith("/data.pkl") else source.read(info)
            archive.writestr(info.filename, body)
    return out.getvalue()


def _global(module: str, name: str) -> bytes:
    return b"c" + f"{module}\n{name}\n".encode()


def _str(value: str) -> bytes:
    data = value.encode()
    return b"X" + len(data).to_bytes(4, "little") + data


_ENUMS = "megatron.core.transformer.enums"
_NAMESPACE = b"\x80\x02" + _global("argparse", "Namespace") + b")\x81"  # a fresh Namespace (NEWOBJ)
_EXT_CODE = 0xF2

# name -> (the byte item, what its refusal names)
ATTACKS = {
    "BUILD on an AttnBackend member": (
        lambda: _saved([_Reduce(AttnBackend, (AttnBackend.flash.value,), {"_value_": 999, "_name_": "evil"})]),
        "BUILD on AttnBackend",
    ),
    "BUILD on a ModelType member": (
        lambda: _saved([_Reduce(ModelType, (ModelType.encoder_or_decoder.value,), {"_value_": 7})]),
        "BUILD on ModelType",
    ),
    "BUILD on a RerunMode member": (
        lambda: _saved([_Reduce(RerunMode, (RerunMode.DISABLED.value,), {"_value_": "enabled", "_name_": "X"})]),
        "BUILD on RerunMode",
    ),
    "BUILD on a Signals member": (
        lambda: _saved([_Reduce(signal.Signals, (15,), {"_name_": "SIGKILL", "_value_": 9})]),
        "BUILD on Signals",
    ),
    "BUILD on a numpy dtype singleton": (
        lambda: _saved([_Reduce(np.dtypes.UInt32DType, (), (3, ">", None, None, None, -1, -1, 0))]),
        "numpy.dtypes.UInt32DType is not a global",
    ),
    "numpy dtype made then BUILD": (
        lambda: _saved([_Reduce(np.dtype, ("f4", False, True), (3, ">", None, None, None, -1, -1, 0))]),
        "numpy.dtype is not a global",
    ),
    "OptimizerConfig called with odd args": (
        lambda: _saved([_Reduce(__import__("megatron.core.optimizer").core.optimizer.OptimizerConfig, ("x", 1))]),
        "OptimizerConfig is not a global",
    ),
    "Generator('cuda')": (lambda: _saved([_Reduce(torch._C.Generator, ("cuda",))]), "Generator is not a global"),
    "SimpleNamespace": (lambda: _saved([_Reduce(__import__("types").SimpleNamespace, ())]), "types.SimpleNamespace"),
    "an enum call that makes a new enum": (
        lambda: _saved([_Reduce(AttnBackend, ("Evil", "a b"))]),
        "AttnBackend of ",
    ),
    "BUILD on a class": (
        lambda: _archive(b"\x80\x02" + _global(_ENUMS, "AttnBackend") + b"N}" + _str("flash") + b"K\x07s\x86b."),
        "BUILD on function",
    ),
    "a Namespace given a __setstate__": (
        lambda: _archive(
            _NAMESPACE + b"}" + _str("__setstate__") + _global(_ENUMS, "AttnBackend") + b"sb}" + _str("x") + b"K\x01sb."
        ),
        "BUILD of a Namespace with",
    ),
    "BUILD twice on one Namespace": (
        lambda: _archive(_NAMESPACE + b"}" + _str("a") + b"K\x01sb}" + _str("b") + b"K\x02sb."),
        "sets state only once",
    ),
    "APPENDS on a Namespace with an extend attribute": (
        lambda: _archive(
            _NAMESPACE + b"}" + _str("extend") + _global("pathlib", "PosixPath") + b"sb(" + _str("x") + b"e."
        ),
        "APPENDS on Namespace",
    ),
    "INST": (lambda: _archive(b"(" + b"iargparse\nNamespace\n."), "INST/OBJ on"),
    "OBJ": (lambda: _archive(b"\x80\x02(" + _global("argparse", "Namespace") + b"o."), "INST/OBJ on"),
    "NEWOBJ with arguments": (
        lambda: _archive(b"\x80\x02" + _global("argparse", "Namespace") + b"K\x01\x85\x81."),
        "NEWOBJ on",
    ),
    "dotted STACK_GLOBAL": (
        lambda: _archive(
            b"\x80\x04\x8c\x07pathlib\x8c\x1ePosixPath.__init__.__globals__\x93."  # noqa: ISC003
        ),
        "dotted name",
    ),
    "extension code": (
        lambda: _archive(b"\x80\x02\x82" + bytes([_EXT_CODE]) + _str("true") + b"\x85R."),
        "extension code",
    ),
    "a Python 2 name the full load maps to builtins.eval": (
        lambda: _archive(b"\x80\x02" + _global("__builtin__", "eval") + _str("1") + b"\x85R."),
        "builtins.eval is not a global",
    ),
    "a storage named outside torch": (
        lambda: _archive(
            b"\x80\x02"
            + _global("torch._utils", "_rebuild_tensor_v2")
            + b"(("
            + _str("storage")
            + _global("os", "FloatStorage")
            + _str("0")
            + _str("cpu")
            + b"K\x01tQK\x00K\x01\x85K\x01\x85\x89"
            + _global("collections", "OrderedDict")
            + b")RtR."
        ),
        "os.FloatStorage is not a global",
    ),
    "a tensor with backward hooks": (
        lambda: _archive(
            b"\x80\x02"
            + _global("torch._utils", "_rebuild_tensor_v2")
            + b"(("
            + _str("storage")
            + _global("torch", "FloatStorage")
            + _str("0")
            + _str("cpu")
            + b"K\x01tQK\x00K\x01\x85K\x01\x85\x89"
            + _global("collections", "OrderedDict")
            + b")RK\x01K\x02stR."
        ),
        "tensors are plain ones",
    ),
}


@pytest.fixture
def extension_code():
    """An extension code another reader has resolved once (now in copyreg's cache, which pickle consults
    without find_class)."""
    copyreg.add_extension("posix", "system", _EXT_CODE)
    try:
        __import__("pickle").loads(b"\x80\x02\x82" + bytes([_EXT_CODE]) + b".")
        yield
    finally:
        copyreg.remove_extension("posix", "system", _EXT_CODE)


@pytest.mark.parametrize("name", list(ATTACKS))
def test_a_crafted_common_state_is_refused_before_a_load(name, tmp_path, extension_code):
    item, names = ATTACKS[name]
    path = _megatron_dir(tmp_path / "ckpt", item())
    before = process_state()
    with pytest.raises(NotAMegatronCheckpoint) as refusal:
        check_pickled_parts(path)
    message = str(refusal.value)
    assert names in message and f"refusing {path}/" in message and "re-create the checkpoint" in message, message
    assert process_state() == before, "the crafted byte item changed the process"


@pytest.mark.parametrize("name", list(ATTACKS))
def test_a_crafted_common_state_is_refused_by_megatrons_load(name, tmp_path, extension_code):
    item, names = ATTACKS[name]
    path = _megatron_dir(tmp_path / "ckpt", item())
    before = process_state()
    with checked_megatron_reads(), pytest.raises(CheckpointException, match="is not plain data") as refusal:
        load_common_state_dict(str(path))
    assert names in str(refusal.value)
    assert process_state() == before, "the crafted byte item changed the process"


def test_export_refuses_a_crafted_common_state_naming_the_file(tmp_path, capsys):
    """`convert export` of a training run's checkpoint whose common state BUILDs on an enum member: exit 2
    before anything is loaded, naming the file, the opcode and the fix; the member unchanged."""
    item = ATTACKS["BUILD on an AttnBackend member"][0]()
    path = _megatron_dir(tmp_path / "iter_0000002", item)
    code = convert("export", "--megatron", path, "--hf", tmp_path / "base", "--out", tmp_path / "out")
    err = capsys.readouterr().err
    assert code == ExitCode.BAD_INPUT, err
    assert f"refusing {path}/" in err and "common_state" in err and "BUILD on AttnBackend" in err, err
    assert "copy the iteration directory again" in err, err
    assert (AttnBackend.flash.value, AttnBackend.flash.name) == (1, "flash")
    assert not (tmp_path / "out").exists()


def test_a_crafted_tensor_item_is_refused(tmp_path, monkeypatch):
    """DCP reads a tensor item with ``torch.load(weights_only=True)``, which takes whatever the safe globals
    hold: a tensor item whose pickle also BUILDs on an enum member is refused before DCP reads it."""
    import torch.distributed.checkpoint as dcp

    attack = _Reduce(AttnBackend, (AttnBackend.flash.value,), {"_value_": 999})
    real_save = torch.save

    def crafted_save(obj, f, *args, **kwargs):  # DCP's writer saves each tensor item with torch.save
        if isinstance(obj, torch.Tensor) and obj.numel() == 6:
            obj = [obj, attack]
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", crafted_save)
    dcp.save({"w": torch.arange(6.0)}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    monkeypatch.setattr(torch, "save", real_save)
    state = {"w": torch.zeros(6)}
    with pytest.raises(CheckpointException, match="tensor item w .*BUILD on AttnBackend"):
        dcp.load(state, storage_reader=CheckedFileSystemReader(tmp_path / "ckpt"), no_dist=True)
    assert (AttnBackend.flash.value, AttnBackend.flash.name) == (1, "flash")


def test_a_plain_tensor_item_loads(tmp_path):
    import torch.distributed.checkpoint as dcp

    stored = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)[1:]}
    dcp.save(stored, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    state = {"w": torch.zeros(2, 3), "b": torch.zeros(3, dtype=torch.bfloat16)}
    dcp.load(state, storage_reader=CheckedFileSystemReader(tmp_path / "ckpt"), no_dist=True)
    assert torch.equal(state["w"], stored["w"]) and torch.equal(state["b"], stored["b"])


def _megatron_common_state() -> dict:
    """A common state as Megatron-Bridge's ``generate_state_dict`` leaves it (checkpoint version, iteration, the
    optimizer's param groups, the scheduler, the grad scaler, the rerun machine) with Megatron-LM's args."""
    args = argparse.Namespace(
        tensor_model_parallel_size=2,
        params_dtype=torch.bfloat16,
        attention_backend=AttnBackend.auto,
        model_type=ModelType.encoder_or_decoder,
        exit_signal=signal.SIGTERM,
        cuda_graph_scope=[list(CudaGraphScope)[0]],
        data_path=pathlib.PosixPath("/data/train"),
        lr=3e-4,
        betas=(0.9, 0.95),
        seen={1, 2},
        blob=b"\x00\xff",
        big=2**70,
        nothing=None,
    )
    groups = [{"params": [0, 1], "lr": 3e-4, "betas": (0.9, 0.95), "wd_mult": 1.0, "default_config": True}]
    return {
        "checkpoint_version": 3.0,
        "iteration": 2,
        "args": args,
        "optimizer": {"param_groups": groups, "grad_scaler": {"scale": torch.tensor([65536.0]), "growth_tracker": 0}},
        "opt_param_scheduler": collections.OrderedDict(max_lr=3e-4, num_steps=16),
        "rerun_state_machine": {
            "mode": RerunMode.DISABLED,
            "state": RerunState.NOT_RUNNING_YET,
            "current_iteration": 2,
        },
        "sizes": torch.Size([2, 3]),
        "keys": {torch.float32: "f", AttnBackend.flash: "a", (1, "x"): 2},
    }


def test_megatrons_byte_items_still_load(tmp_path):
    """The common state and TE's ``_extra_state`` (an empty or a filled uint8 tensor, a BytesIO before TE 2.0),
    saved as Megatron saves them (torch.save, protocol 2), pass the pre-load check and load through Megatron's
    reader as saved."""
    common = _megatron_common_state()
    path = _megatron_dir(tmp_path / "ckpt", _saved([common]))
    check_pickled_parts(path)
    with checked_megatron_reads():
        loaded = load_common_state_dict(str(path))
    scale = loaded["optimizer"]["grad_scaler"].pop("scale")
    assert torch.equal(scale, common["optimizer"]["grad_scaler"].pop("scale"))
    assert loaded == common and loaded["args"].attention_backend is AttnBackend.auto
    extras = (torch.empty(0, dtype=torch.uint8), torch.arange(8, dtype=torch.uint8), io.BytesIO(_saved([1])))
    for number, extra in enumerate(extras):
        check_pickled_parts(_megatron_dir(tmp_path / f"extra{number}", _saved([extra])))


def test_the_full_load_would_have_run_the_attack(tmp_path):
    """The attack is live: DCP's own load (a full pickle) of the crafted common state changes the member, so
    the refusals above are what keeps the process as it was."""
    path = _megatron_dir(tmp_path / "ckpt", ATTACKS["BUILD on an AttnBackend member"][0]())
    load_common_state_dict(str(path))
    assert AttnBackend.flash.value == 999


def test_every_allowed_global_says_why():
    from mbridge_refit.checkpoints.dcp_pickles import byte_item_table

    table = byte_item_table()
    assert len({(module, name) for module, name, _, _ in table}) == len(table)
    assert all(isinstance(why, str) and why for *_, why in table)
    assert not any(isinstance(value, type) and issubclass(value, enum.Enum) for _, _, value, _ in table)
