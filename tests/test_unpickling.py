"""Nothing we read runs code: crafted pickles at every entry point that reads one.

Entry points: a Megatron checkpoint's index (``release/.metadata``) and its byte items
(``_extra_state``, the common state), read by ``check_pickled_parts`` and again by Megatron's
``dist_checkpointing.load`` under ``checked_megatron_reads``; the CUDA IPC payload of
``CudaIpcTransport.open``; what a ``StoreGroup`` member receives from ``broadcast_object``.

Every crafted payload would create a marker file if anything ran it (``os.system``,
``subprocess``, ``eval``/``exec``, ``open``, a ``getattr`` chain; through GLOBAL, STACK_GLOBAL,
INST, OBJ, REDUCE, dotted names, the extension registry, at pickle protocols 0-5); each test
checks that it is refused and that the marker does not exist. The CLI-level refusal of a real
checkpoint with a crafted index is in test_megatron_checkpoint.py.
"""

from __future__ import annotations

import builtins
import copyreg
import io
import multiprocessing
import os
import pickle
import subprocess
import time

import pytest
import torch
from conftest import free_port
from torch.distributed.checkpoint.api import CheckpointException

from mbridge_refit.checkpoints.dcp_pickles import check_byte_item
from mbridge_refit.checkpoints.megatron import NotAMegatronCheckpoint, check_pickled_parts
from mbridge_refit.engines.ipc.sharing import CudaIpcTransport, SharingError

ALLOWED_INDEX_MODULES = ("torch.distributed.checkpoint.filesystem", "torch.distributed.checkpoint.metadata", "torch")


class _Call:
    """Pickles as ``func(*args)``. Callable, so that it can stand for the function another
    ``_Call`` calls (``_Call(_Call(getattr, m, "system"), cmd)`` pickles ``getattr(m, "system")(cmd)``)."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args

    def __call__(self, *args):
        raise AssertionError("never called: only pickled")


def _reduce_payloads(marker) -> dict[str, object]:
    """Objects whose unpickling creates ``marker``, each through another callable."""
    touch = f"open({str(marker)!r}, 'w').close()"
    return {
        "os.system": _Call(os.system, f"touch {marker}"),
        "subprocess": _Call(subprocess.check_call, ["touch", str(marker)]),
        "eval": _Call(builtins.eval, touch),
        "exec": _Call(builtins.exec, touch),
        "open": _Call(open, str(marker), "w"),
        "getattr-chain": _Call(_Call(getattr, _Call(builtins.__import__, "os"), "system"), f"touch {marker}"),
    }


def _text(value: str) -> bytes:
    return value.encode()


def _short_unicode(value: str) -> bytes:
    data = value.encode()
    return b"\x8c" + bytes([len(data)]) + data


def _unicode(value: str) -> bytes:
    data = value.encode()
    return b"X" + len(data).to_bytes(4, "little") + data


def _raw_payloads(marker) -> dict[str, bytes]:
    """Hand-made opcode streams: dotted names (PROTO 4, where pickle resolves them attribute by
    attribute) through a module an unpickler allows, INST and OBJ (protocol 0 and 1), and
    GLOBAL / STACK_GLOBAL nested in the arguments of a call."""
    cmd = f"touch {marker}"
    payloads = {}
    for module in ALLOWED_INDEX_MODULES:
        payloads[f"dotted-GLOBAL-{module}"] = b"\x80\x04c" + _text(f"{module}\nos.system\n") + _unicode(cmd) + b"\x85R."
        payloads[f"dotted-STACK_GLOBAL-{module}"] = (
            b"\x80\x04" + _short_unicode(module) + _short_unicode("os.system") + b"\x93" + _unicode(cmd) + b"\x85R."
        )
    payloads["dotted-INST-torch"] = b"\x80\x04(" + _unicode(cmd) + b"itorch\nos.system\n."
    payloads["INST"] = b"(S'" + _text(cmd) + b"'\nios\nsystem\n."
    payloads["OBJ"] = b"(cos\nsystem\nS'" + _text(cmd) + b"'\no."
    payloads["nested-GLOBAL"] = (
        b"cbuiltins\ngetattr\n(cbuiltins\n__import__\n(S'os'\ntRS'system'\ntR(S'" + _text(cmd) + b"'\ntR."
    )
    payloads["nested-STACK_GLOBAL"] = (
        b"\x80\x04"
        + _short_unicode("builtins")
        + _short_unicode("getattr")
        + b"\x93"
        + _short_unicode("builtins")
        + _short_unicode("__import__")
        + b"\x93"
        + _short_unicode("os")
        + b"\x85R"
        + _short_unicode("system")
        + b"\x86R"
        + _unicode(cmd)
        + b"\x85R."
    )
    return payloads


def _payload_cases() -> list[tuple[str, object]]:
    """(id, builder(marker) -> bytes) for every crafted payload."""
    cases = []
    for name in _reduce_payloads("m"):
        for protocol in range(6):
            build = lambda marker, n=name, p=protocol: pickle.dumps(_reduce_payloads(marker)[n], protocol=p)  # noqa: E731
            cases.append((f"{name}-p{protocol}", build))
    for name in _raw_payloads("m"):
        cases.append((name, lambda marker, n=name: _raw_payloads(marker)[n]))
    return cases


PAYLOADS = _payload_cases()
payloads = pytest.mark.parametrize("build", [build for _, build in PAYLOADS], ids=[name for name, _ in PAYLOADS])


def test_the_payloads_run_when_unpickled(tmp_path):
    """The crafted payloads are live: plain pickle runs each (else the refusals below prove nothing)."""
    for name, build in PAYLOADS:
        marker = tmp_path / f"ran-{name}"
        try:
            pickle.loads(build(marker))
        except Exception:
            pass
        assert marker.exists(), f"{name} did not run under plain pickle"


# --- the Megatron checkpoint's index and byte items ------------------------------------------


@payloads
def test_index_refuses_crafted_pickles(build, tmp_path):
    marker = tmp_path / "ran"
    (tmp_path / ".metadata").write_bytes(build(marker))
    with pytest.raises(NotAMegatronCheckpoint, match=r"refusing .*\.metadata"):
        check_pickled_parts(tmp_path)
    assert not marker.exists(), "the crafted index ran"


def _genuine_index(tmp_path):
    """The index DCP writes for a small state dict (tensors of two dtypes and a byte item)."""
    import torch.distributed.checkpoint as dcp

    state = {"a": torch.ones(3, 4, dtype=torch.bfloat16), "b": io.BytesIO(b"x"), "c": torch.zeros(2)}
    dcp.save(state, checkpoint_id=tmp_path / "genuine", no_dist=True)
    return pickle.loads((tmp_path / "genuine" / ".metadata").read_bytes())


def test_index_refuses_a_dotted_call_inside_a_genuine_index(tmp_path):
    # A whole, valid index with os.system reached through an allowed module in one field: the
    # old unpickler ran it and returned a correct index (so `export` then exited 0).
    marker = tmp_path / "ran"
    index = _genuine_index(tmp_path)
    index.storage_meta.save_id = _Call(os.system, f"touch {marker}")
    data = pickle.dumps(index, protocol=2)
    data = b"\x80\x04" + data[2:].replace(b"cposix\nsystem\n", b"ctorch.distributed.checkpoint.filesystem\nos.system\n")
    (tmp_path / ".metadata").write_bytes(data)
    with pytest.raises(NotAMegatronCheckpoint, match="dotted name"):
        check_pickled_parts(tmp_path)
    assert not marker.exists(), "the crafted index ran"


def test_index_reads_a_genuine_index_unchanged(tmp_path):
    from mbridge_refit.checkpoints.dcp_pickles import load_index

    index = _genuine_index(tmp_path)
    for protocol in range(2, 6):  # DCP pickles with the default protocol; any protocol builds the same index
        assert load_index(pickle.dumps(index, protocol=protocol)) == index


def test_index_refuses_state_on_a_class(tmp_path):
    # BUILD with slot state on an allowed class would set a class attribute for the whole process.
    from torch.distributed.checkpoint.metadata import Metadata

    (tmp_path / ".metadata").write_bytes(
        b"\x80\x04ctorch.distributed.checkpoint.metadata\nMetadata\nN}"
        + _short_unicode("crafted_attr")
        + b"K\x01s\x86b."
    )
    try:
        with pytest.raises(NotAMegatronCheckpoint, match="BUILD on"):
            check_pickled_parts(tmp_path)
        assert not hasattr(Metadata, "crafted_attr"), "the crafted index changed a class"
    finally:
        if hasattr(Metadata, "crafted_attr"):
            del Metadata.crafted_attr


def _shared_tuples(depth: int, *, dup: bool) -> bytes:
    """Opcodes leaving a tuple of ``depth`` levels, each level two references to the one below: a few bytes
    a level, 2**depth to hash, compare or print (DUP, or a memo PUT and GET of each level)."""
    levels = b"".join(b"2\x86" if dup else b"q" + bytes([i]) + b"h" + bytes([i]) + b"\x86" for i in range(depth))
    return b")" + levels


@pytest.mark.parametrize("dup", [True, False], ids=["dup", "memo"])
@pytest.mark.parametrize("use", ["dict key", "set item", "memory format", "refused call"])
def test_index_refuses_shared_tuples_at_once(use, dup, tmp_path):
    # 135 bytes of DUPs used as a dict key hashed for ever (a review's reproducer); the same tuple in the
    # refusal of a call was printed in full before the message was cut.
    from mbridge_refit.checkpoints.dcp_pickles import UnsafePickle, load_index

    tuples = _shared_tuples(60, dup=dup)
    data = {
        "dict key": b"\x80\x04}" + tuples + b"Ns.",
        "set item": b"\x80\x04(" + tuples + b"\x91.",
        "memory format": b"\x80\x04ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\n" + tuples + b"\x85R.",
        "refused call": b"\x80\x04" + tuples + b")R.",  # the tuple called: named in the refusal
    }[use]
    started = time.monotonic()
    with pytest.raises((UnsafePickle, pickle.UnpicklingError)) as refused:
        load_index(data)
    assert time.monotonic() - started < 2.0 and len(str(refused.value)) < 400, str(refused.value)[:400]


@pytest.mark.parametrize(
    "damage",
    ["storage_data", "offset", "chunk offsets", "dtype", "planner_data", "transforms", "storage_meta"],
)
def test_index_refuses_fields_of_another_type(damage, tmp_path):
    # BUILD sets a record's state field by field: an index of the right classes may hold anything in them,
    # which the checks after the load then met as raw AttributeErrors.
    from mbridge_refit.checkpoints.dcp_pickles import UnsafePickle, load_index

    index = _genuine_index(tmp_path)
    location = next(iter(index.storage_data.values()))
    tensor = index.state_dict_metadata["a"]
    if damage == "storage_data":
        index.storage_data = 5
    elif damage == "offset":
        location.offset = -1
    elif damage == "chunk offsets":
        tensor.chunks[0].offsets = [0, 0]
    elif damage == "dtype":
        tensor.properties.dtype = "bfloat16"
    elif damage == "planner_data":
        index.planner_data = {"a": ("a", ("b",))}
    elif damage == "transforms":
        location.transform_descriptors = ["stream.zstd"]
    else:
        index.storage_meta = torch.float32
    with pytest.raises(UnsafePickle, match="is not what a DCP index holds there"):
        load_index(pickle.dumps(index))


def test_index_refuses_extension_codes(tmp_path):
    # copyreg's extension cache hands a resolved global to the unpickler without find_class.
    marker = tmp_path / "ran"
    code = 0xF1
    copyreg.add_extension("posix", "system", code)
    try:
        pickle.loads(b"\x80\x02\x82" + bytes([code]) + b".")  # another reader resolved it once: now cached
        (tmp_path / ".metadata").write_bytes(b"\x80\x02\x82" + bytes([code]) + _unicode(f"touch {marker}") + b"\x85R.")
        with pytest.raises(NotAMegatronCheckpoint, match="refusing"):
            check_pickled_parts(tmp_path)
    finally:
        copyreg.remove_extension("posix", "system", code)
    assert not marker.exists(), "the crafted index ran"


@payloads
def test_byte_items_refuse_crafted_pickles(build, tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(Exception):
        check_byte_item(build(marker))
    assert not marker.exists(), "the crafted byte item ran"


@pytest.mark.parametrize("protocol", range(2, 6))
def test_byte_items_refuse_crafted_torch_saves(protocol, tmp_path):
    from mbridge_refit.checkpoints.dcp_pickles import UnsafePickle

    for name, payload in _reduce_payloads(tmp_path / "ran").items():
        buffer = io.BytesIO()
        torch.save({"state": payload}, buffer, pickle_protocol=protocol)
        with pytest.raises(UnsafePickle, match="is not a global a checkpoint.s byte item holds"):
            check_byte_item(buffer.getvalue())
        assert not (tmp_path / "ran").exists(), f"the crafted byte item ({name}) ran"


# --- what Megatron's dist_checkpointing.load reads after the check --------------------------


class _RawBytesPlanner:
    """DCP's save planner writing byte items as they are (Megatron's own planner does the same)."""

    @staticmethod
    def make():
        from torch.distributed.checkpoint import DefaultSavePlanner

        class Planner(DefaultSavePlanner):
            def transform_object(self, write_item, object):
                return object

        return Planner()


def _megatron_dir(path, common_state: bytes):
    """A torch_dist checkpoint as Megatron lays it out: a tensor, the common state, metadata.json."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    key = ShardedObject("common_state", None, (1,), (0,)).unique_key
    state = {"w": torch.arange(6.0).reshape(2, 3), key: io.BytesIO(common_state)}
    dcp.save(state, checkpoint_id=path, planner=_RawBytesPlanner.make(), no_dist=True)
    save_config(CheckpointingConfig("torch_dist", 1), str(path))
    return path


def _saved(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def test_index_refuses_a_legacy_common_state_file(tmp_path):
    path = _megatron_dir(tmp_path / "ckpt", _saved([{"answer": 42}]))
    check_pickled_parts(path)
    (path / "common.pt").write_bytes(_saved({"from": "common.pt"}))
    with pytest.raises(NotAMegatronCheckpoint, match="common.pt: `import` never writes it"):
        check_pickled_parts(path)


def test_megatron_reads_a_genuine_checkpoint_through_the_checks(tmp_path):
    from megatron.core.dist_checkpointing.serialization import load_common_state_dict, load_sharded_metadata

    from mbridge_refit.checkpoints.dcp_pickles import checked_megatron_reads

    path = _megatron_dir(tmp_path / "ckpt", _saved([{"answer": 42}]))
    (path / "common.pt").write_bytes(_saved({"from": "common.pt"}))  # never read while checked
    with checked_megatron_reads():
        assert load_common_state_dict(str(path)) == {"answer": 42}
        assert sorted(load_sharded_metadata(str(path))) == ["common_state/shard_0_1", "w"]


def test_megatron_load_refuses_a_byte_item_crafted_after_the_check(tmp_path):
    from megatron.core.dist_checkpointing.serialization import load_common_state_dict

    from mbridge_refit.checkpoints.dcp_pickles import checked_megatron_reads

    marker = tmp_path / "ran"
    path = _megatron_dir(tmp_path / "ckpt", _saved([_Call(open, str(marker), "w")]))
    with pytest.raises(Exception):  # unchecked, Megatron runs it (torch.load with weights_only=False)
        load_common_state_dict(str(path))
        raise AssertionError("no error")
    assert marker.exists(), "the crafted common state is not live: this test proves nothing"
    marker.unlink()
    with checked_megatron_reads(), pytest.raises(CheckpointException, match="is not plain data"):
        load_common_state_dict(str(path))
    assert not marker.exists(), "the crafted common state ran"


@pytest.mark.parametrize("name", ["os.system-p5", "dotted-STACK_GLOBAL-torch.distributed.checkpoint.filesystem"])
def test_megatron_load_refuses_an_index_crafted_after_the_check(name, tmp_path):
    from megatron.core.dist_checkpointing.serialization import load_common_state_dict, load_sharded_metadata

    from mbridge_refit.checkpoints.dcp_pickles import UnsafePickle, checked_megatron_reads

    marker = tmp_path / "ran"
    path = _megatron_dir(tmp_path / "ckpt", _saved([{"answer": 42}]))
    (path / ".metadata").write_bytes(dict(PAYLOADS)[name](marker))
    with checked_megatron_reads():
        with pytest.raises(UnsafePickle):
            load_sharded_metadata(str(path))
        with pytest.raises(CheckpointException, match="metadata is None"):  # DCP swallows read_metadata's error
            load_common_state_dict(str(path))
    assert not marker.exists(), "the crafted index ran"


# --- the CUDA IPC payload ---------------------------------------------------------------------


@payloads
def test_ipc_payload_refuses_crafted_pickles(build, tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(SharingError, match="refusing"):
        CudaIpcTransport().open(build(marker), torch.device("cpu"))
    assert not marker.exists(), "the crafted IPC payload ran"


def _ipc_args(handle: bytes | None = b"\x01\x02" * 32) -> tuple:
    """rebuild_cuda_tensor's arguments as reduce_tensor makes them for a whole uint8 storage."""
    return (
        torch.Tensor,
        torch.Size([4096]),
        (1,),
        0,
        torch.storage.TypedStorage,
        torch.uint8,
        3,
        handle,
        4096,
        512,
        False,
        b"/torch_1234_5678_0",
        7,
        b"\x09" * 64,
        True,
    )


@pytest.mark.parametrize("args", [_ipc_args(), _ipc_args(handle=None)], ids=["handle", "empty"])
def test_ipc_payload_round_trip(args):
    from mbridge_refit.engines.ipc.handles import decode_payload, encode_payload

    payload = encode_payload([{"GPU-aaaa": args}, {"GPU-aaaa": args, "GPU-bbbb": args}])
    decoded = decode_payload(payload)
    assert decoded == [{"GPU-aaaa": args}, {"GPU-aaaa": args, "GPU-bbbb": args}]
    assert [type(value) for value in decoded[0]["GPU-aaaa"]] == [type(value) for value in args]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("tensor_cls", "os.system", "tensor class 'os.system'"),
        ("storage_cls", "torch.storage.UntypedStorage", "storage class"),
        ("dtype", "float32", "dtype 'float32'"),
        ("device", True, "non-negative integer"),
        ("size", [4096, -1], "non-negative integer"),
        ("handle", "not base64!", "not base64"),
        ("requires_grad", 0, "true or false"),
        ("extra", 1, "a handle has the fields"),
    ],
)
def test_ipc_payload_refuses_crafted_fields(field, value, message):
    import json

    from mbridge_refit.engines.ipc.handles import encode_payload

    wire = json.loads(encode_payload([{"GPU-aaaa": _ipc_args()}]))
    wire["storages"][0]["GPU-aaaa"][field] = value
    with pytest.raises(SharingError, match=message):
        CudaIpcTransport().open(json.dumps(wire).encode(), torch.device("cpu"))


def test_ipc_payload_refuses_another_format():
    with pytest.raises(SharingError, match="is not mbridge_refit.cuda_ipc version 1"):
        CudaIpcTransport().open(b'{"format": "x", "version": 1, "storages": []}', torch.device("cpu"))
    with pytest.raises(SharingError, match="not JSON"):
        CudaIpcTransport().open(pickle.dumps([{"gpu": (1, 2)}]), torch.device("cpu"))


@pytest.mark.parametrize("version", [None, 2])
def test_ipc_payload_of_another_version_is_refused_by_name(version):
    """A payload of another version (None: it names none) is refused before its storages are read."""
    import json

    from mbridge_refit.engines.ipc.handles import VERSION

    wire = {"format": "mbridge_refit.cuda_ipc", "storages": [{"GPU-aaaa": {"other": "fields"}}]}
    if version is not None:
        wire["version"] = version
    with pytest.raises(SharingError, match="CUDA IPC payload wire version mismatch") as caught:
        CudaIpcTransport().open(json.dumps(wire).encode(), torch.device("cpu"))
    shown = "none (an mbridge_refit from before it was versioned)" if version is None else version
    assert f"this side speaks version {VERSION}, the trainer version {shown}" in str(caught.value)


# --- what a StoreGroup member receives ---------------------------------------------------------


def _receive_one(port: int, secret: bytes, results) -> None:
    """Member 1 of ``_store_group_pair``, in a process of its own: what ``broadcast_object`` gives it, or the
    exception it raised, into ``results``."""
    from mbridge_refit.engines.broadcast.group import StoreGroup

    try:
        group = StoreGroup(host="127.0.0.1", port=port, rank=1, world_size=2, device="cpu", secret=secret)
        results.put(group.broadcast_object(None, 0, torch.device("cpu")))
        group.close()
    except Exception as err:  # noqa: BLE001 - handed to the test
        results.put(err)


def _store_group_pair(send):
    """Two StoreGroup members on CPU (gloo), in two processes: this one, member 0, runs ``send(group)``; returns
    what member 1's ``broadcast_object`` gave it (or the exception it raised). Not two threads of one process:
    two gloo process groups of one process all-reducing in two threads once crashed gloo (a segmentation fault
    that ends the whole test run)."""
    from mbridge_refit.engines.broadcast.group import StoreGroup, new_secret

    port, context, secret = free_port(), multiprocessing.get_context("spawn"), new_secret()
    results = context.Queue()
    receiver = context.Process(target=_receive_one, args=(port, secret, results), daemon=True)
    receiver.start()
    try:
        try:
            group = StoreGroup(host="127.0.0.1", port=port, rank=0, world_size=2, device="cpu", secret=secret)
            send(group)
            group.close()
        except Exception:  # noqa: BLE001 - the sender's side may fail once the receiver refused: its verdict counts
            pass
        return results.get(timeout=120)
    finally:
        receiver.join(timeout=30)
        if receiver.is_alive():
            receiver.kill()


@pytest.mark.parametrize("name", ["os.system-p5", "getattr-chain-p0", "dotted-STACK_GLOBAL-torch"])
def test_store_group_receives_data_not_code(name, tmp_path):
    marker = tmp_path / "ran"
    crafted = dict(PAYLOADS)[name](marker)

    def send_crafted(group):  # what broadcast_object's source sends, with a crafted body
        group.broadcast(torch.tensor([len(crafted)], dtype=torch.int64), 0)
        group.broadcast(torch.frombuffer(bytearray(crafted), dtype=torch.uint8), 0)

    received = _store_group_pair(send_crafted)
    assert isinstance(received, ValueError), received
    assert not marker.exists(), "the crafted broadcast ran"


def test_store_group_broadcasts_json_data():
    signature = [("model.embed_tokens.weight", (8, 4), "bfloat16"), ("lm_head.weight", (8, 4), "bfloat16")]
    received = _store_group_pair(lambda group: group.broadcast_object(signature, 0, torch.device("cpu")))
    assert received == [[name, list(shape), dtype] for name, shape, dtype in signature]


def _dcp_dir(tmp_path, state):
    import torch.distributed.checkpoint as dcp

    directory = tmp_path / "weights"
    dcp.save(state, checkpoint_id=directory, no_dist=True)
    return directory


def _in_thread(fn, timeout_s: float = 20.0):
    """``fn()``'s exception (or None), failing instead of hanging if it blocks past ``timeout_s``."""
    import threading

    outcome: list = []
    thread = threading.Thread(target=lambda: outcome.append(_raised(fn)), daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert outcome, f"still running after {timeout_s} s"
    return outcome[0]


def _raised(fn):
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - handed to the test
        return err
    return None


@pytest.mark.parametrize("replacement", ["fifo", "dev-zero link", "link outside"])
def test_byte_item_files_must_be_regular_files_of_the_checkpoint(replacement, tmp_path):
    # a FIFO in place of a .distcp blocked the check for ever; /dev/zero read as many bytes as the index asked
    directory = _dcp_dir(tmp_path, {"extra": io.BytesIO(b"x" * 64), "w": torch.zeros(4)})
    (data,) = directory.glob("*.distcp")
    elsewhere = tmp_path / "elsewhere.bin"
    elsewhere.write_bytes(data.read_bytes())
    data.unlink()
    if replacement == "fifo":
        os.mkfifo(data)
    elif replacement == "dev-zero link":
        data.symlink_to("/dev/zero")
    else:
        data.symlink_to(elsewhere)
    error = _in_thread(lambda: check_pickled_parts(directory))
    assert isinstance(error, NotAMegatronCheckpoint) and "not a regular file" in str(error), error


def test_checked_reader_refuses_an_index_placing_bytes_outside(tmp_path):
    # the reader Megatron's load goes through re-reads the index: its locations are checked there too
    from mbridge_refit.checkpoints.dcp_pickles import CheckedFileSystemReader, UnsafePickle

    directory = _dcp_dir(tmp_path, {"w": torch.zeros(4)})
    index = pickle.loads((directory / ".metadata").read_bytes())
    next(iter(index.storage_data.values())).relative_path = str(tmp_path / "other.distcp")
    (directory / ".metadata").write_bytes(pickle.dumps(index))
    with pytest.raises(UnsafePickle, match="not a file name inside"):
        CheckedFileSystemReader(directory).read_metadata()


def test_byte_items_refuse_compressed_members():
    # torch.save stores its members; a deflated one inflated a thousandfold before anything refused it
    import zipfile

    from mbridge_refit.checkpoints.dcp_pickles import UnsafePickle

    saved = io.BytesIO()
    torch.save({"zeros": torch.zeros(1 << 16)}, saved)
    packed = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(saved.getvalue())) as source, zipfile.ZipFile(packed, "w") as target:
        for info in source.infolist():
            target.writestr(info.filename, source.read(info), compress_type=zipfile.ZIP_DEFLATED)
    check_byte_item(saved.getvalue())  # the stored original loads
    with pytest.raises(UnsafePickle, match="compressed"):
        check_byte_item(packed.getvalue())


def test_tiling_check_is_linear_in_a_grid_and_still_finds_overlaps():
    # 8k one-element pieces of one tensor took a minute pairwise
    from mbridge_refit.checkpoints.megatron import _any_overlap

    pieces = [((i,), (1,)) for i in range(8192)]
    started = time.monotonic()
    assert not _any_overlap(pieces)
    assert time.monotonic() - started < 2.0
    assert _any_overlap(pieces + [((5,), (2,))])
    grid = [((r, c), (2, 3)) for r in range(0, 8, 2) for c in range(0, 9, 3)]
    assert not _any_overlap(grid) and _any_overlap(grid + [((1, 1), (2, 2))])
    ragged = [((0, 0), (1, 4)), ((1, 0), (1, 1)), ((1, 1), (1, 3))]  # rows cut differently: not one grid cell each
    assert not _any_overlap(ragged) and _any_overlap(ragged + [((1, 2), (1, 1))])


def _with_pickle(pickled: bytes) -> bytes:
    """A torch.save archive whose data.pkl is ``pickled`` (members stored, as torch.save stores them)."""
    import zipfile

    saved = io.BytesIO()
    torch.save({"k": 1}, saved)
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(saved.getvalue())) as source, zipfile.ZipFile(out, "w") as target:
        for info in source.infolist():
            target.writestr(info.filename, pickled if info.filename.endswith("/data.pkl") else source.read(info))
    return out.getvalue()


def test_byte_items_refuse_shared_tuples_before_torch_reads_them():
    # torch's own loader hashed a 1.2 kB item's shared tuples as a dict key for ever (a review's reproducer)
    from mbridge_refit.checkpoints.dcp_pickles import UnsafePickle

    levels = b"h\x00h\x00\x86q\x00" * 40  # each level two memo references to the one below
    item = _with_pickle(b"\x80\x02}()q\x00" + levels + b"tNs.")
    started = time.monotonic()
    error = _in_thread(lambda: check_byte_item(item))
    assert isinstance(error, UnsafePickle) and "shared references" in str(error), error
    assert time.monotonic() - started < 5.0


def test_byte_items_with_a_few_shared_references_load():
    saved = io.BytesIO()
    shared = torch.arange(4)
    torch.save({"same": [shared] * 5, "config": {"sizes": (1, 2, 3), "name": "x" * 100}}, saved)
    check_byte_item(saved.getvalue())


def _dcp_with_tensor_item(tmp_path, item: bytes):
    """A DCP checkpoint of one tensor ``w`` whose item is ``item`` (the index placing it over the whole file)."""
    directory = _dcp_dir(tmp_path, {"w": torch.zeros(4)})
    (data,) = directory.glob("*.distcp")
    data.write_bytes(item)
    index = pickle.loads((directory / ".metadata").read_bytes())
    location = next(iter(index.storage_data.values()))
    location.offset, location.length = 0, len(item)
    (directory / ".metadata").write_bytes(pickle.dumps(index))
    return directory


def _load_checked(directory):
    import torch.distributed.checkpoint as dcp

    from mbridge_refit.checkpoints.dcp_pickles import CheckedFileSystemReader

    state = {"w": torch.full((4,), float("nan"))}
    try:
        dcp.load(state, storage_reader=CheckedFileSystemReader(directory), no_dist=True)
    except CheckpointException as err:  # a BaseException: this rank's failure, as Megatron's load sees it
        ((failure, _),) = err.failures.values()
        raise failure from err
    return state["w"]


def _stored_as(saved: bytes, compress_type: int) -> bytes:
    import zipfile

    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(saved)) as source, zipfile.ZipFile(out, "w") as target:
        for info in source.infolist():
            target.writestr(info.filename, source.read(info), compress_type=compress_type)
    return out.getvalue()


def test_tensor_items_load_through_the_checked_reader(tmp_path):
    values = torch.arange(4, dtype=torch.float32) * 1.5
    directory = tmp_path / "plain"
    _dcp_dir(directory, {"w": values})
    assert torch.equal(_load_checked(directory / "weights"), values)


@pytest.mark.parametrize("crafted", ["shared tuples", "compressed", "not an archive"])
def test_tensor_items_are_checked_before_torch_reads_them(crafted, tmp_path):
    # DCP loads tensor items with torch.load(weights_only=True) itself: a 1.2 kB item of shared tuples hung it for
    # ever, a deflated member inflated before anything refused it
    import zipfile

    from mbridge_refit.checkpoints.dcp_pickles import UnsafePickle

    saved = io.BytesIO()
    torch.save(torch.zeros(4), saved)
    if crafted == "shared tuples":
        item = _with_pickle(b"\x80\x02}()q\x00" + b"h\x00h\x00\x86q\x00" * 40 + b"tNs.")
    elif crafted == "compressed":
        item = _stored_as(saved.getvalue(), zipfile.ZIP_DEFLATED)
    else:
        item = pickle.dumps(
            torch.zeros(4).numpy().tobytes()
        )  # a plain pickle: torch.load reads it, DCP never writes it
    directory = _dcp_with_tensor_item(tmp_path, item)
    started = time.monotonic()
    error = _in_thread(lambda: _load_checked(directory))
    assert isinstance(error, UnsafePickle) and "tensor item w" in str(error), error
    assert time.monotonic() - started < 10.0


def test_a_tensor_item_file_swapped_for_a_fifo_is_refused_without_blocking(tmp_path):
    directory = _dcp_dir(tmp_path, {"w": torch.zeros(4)})
    from mbridge_refit.checkpoints.dcp_pickles import CheckedFileSystemReader
    from mbridge_refit.checkpoints.regular_files import NotARegularFile

    reader = CheckedFileSystemReader(directory)
    metadata = reader.read_metadata()  # the index checked while the file was regular
    reader.set_up_storage_reader(metadata, is_coordinator=True)
    (data,) = directory.glob("*.distcp")
    data.unlink()
    os.mkfifo(data)

    class Item:
        type = "tensor"
        storage_index = next(iter(metadata.storage_data))
        dest_index = storage_index

    class Plan:
        items = [Item()]

    error = _in_thread(lambda: reader._check_tensor_items(Plan()))
    assert isinstance(error, NotARegularFile) and error.kind == "FIFO", error


def _saved(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _renamed(saved: bytes, old: str, new: str) -> bytes:
    """``saved`` with every occurrence of the record name ``old`` as ``new`` (same length: offsets stay)."""
    assert len(old) == len(new)
    return saved.replace(old.encode(), new.encode())


@pytest.mark.parametrize(
    "crafted",
    ["legacy pickle before an archive", "archive after another", "name in other letter case", "record named twice"],
)
def test_an_item_torch_would_read_otherwise_than_zipfile_is_refused(crafted):
    # a review's reproducers: Python's zipfile and torch's own reader (miniz) parse archives differently, so a check
    # through zipfile alone passed items from which torch then loaded another tensor, or hung on a pickle bomb
    from mbridge_refit.checkpoints.dcp_pickles import UnsafePickle, check_byte_item, check_torch_archive

    benign, other = _saved(torch.arange(4.0)), _saved(torch.full((4,), 7.0))
    if crafted == "legacy pickle before an archive":  # torch checks the first bytes only: a legacy stream to it
        legacy = io.BytesIO()
        torch.save(torch.full((4,), 7.0), legacy, _use_new_zipfile_serialization=False)
        item = legacy.getvalue() + benign
    elif crafted == "archive after another":  # zipfile shifts the second's offsets; torch reads them as absolute
        item = other + benign
    elif crafted == "name in other letter case":  # torch finds its records case-insensitively
        item = _renamed(benign, "data.pkl", "DATA.PKL")
    else:
        item = _duplicated_record(benign)
    for check in (lambda: check_torch_archive(io.BytesIO(item)), lambda: check_byte_item(item)):
        with pytest.raises(UnsafePickle):
            check()


def _duplicated_record(saved: bytes) -> bytes:
    """``saved`` with its central directory naming the ``data.pkl`` record twice."""
    import struct

    end = saved.rindex(b"PK\x05\x06")
    directory_size, directory_at = struct.unpack("<II", saved[end + 12 : end + 20])
    directory = saved[directory_at : directory_at + directory_size]
    first_end = 46 + sum(struct.unpack("<HHH", directory[28:34]))
    entry = directory[:first_end]
    assert entry[46:].endswith(b"data.pkl"), entry[46:]
    entries = struct.unpack("<H", saved[end + 10 : end + 12])[0] + 1
    tail = bytearray(saved[end:])
    tail[8:12] = struct.pack("<HH", entries, entries)
    tail[12:16] = struct.pack("<I", directory_size + len(entry))
    return saved[:directory_at] + directory + entry + bytes(tail)
