"""The engines layer's contracts (``engines.base``): the vLLM adapter is registered and implements
them, the bridge implements ``ExportsWeights``, a missing adapter or transport is named, and no
engine adapter is needed to import a transport."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch

from mbridge_refit.engines import base
from mbridge_refit.errors import InputError


def _protocol_methods(protocol: type) -> list[str]:
    return sorted(name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_"))


def test_the_vllm_adapter_is_found_by_name_and_offers_every_transport():
    from mbridge_refit.engines.vllm import (
        VLLMAdapterRefit,
        VLLMBroadcastRefit,
        VLLMRefit,
        VLLMShardedRefit,
        engine_kwargs,
    )
    from mbridge_refit.engines.vllm.worker import RefitWorkerExtension

    adapter = base.engine_adapter("vllm")
    assert dict(adapter.sessions) == {
        base.IPC: VLLMRefit,
        base.SHARDED_IPC: VLLMShardedRefit,
        base.BROADCAST: VLLMBroadcastRefit,
        base.ADAPTER_IPC: VLLMAdapterRefit,
    }
    assert adapter.engine_kwargs is engine_kwargs
    assert engine_kwargs(seed=0) == {"worker_extension_cls": adapter.worker_extension, "seed": 0}
    module, _, name = adapter.worker_extension.rpartition(".")
    assert getattr(__import__(module, fromlist=[name]), name) is RefitWorkerExtension  # the path vLLM imports
    assert "vllm" in base.registered_adapters()


@pytest.mark.parametrize("session", ["VLLMRefit", "VLLMBroadcastRefit", "ShardedIpcSession", "VLLMAdapterRefit"])
def test_each_session_has_the_trainer_protocols_methods(session):
    from mbridge_refit.engines import vllm
    from mbridge_refit.engines.ipc import sharded as sharded_ipc

    cls = getattr(vllm, session, None) or getattr(sharded_ipc, session)
    for method in _protocol_methods(base.RefitSession):
        params = inspect.signature(getattr(cls, method)).parameters
        expected = inspect.signature(getattr(base.RefitSession, method)).parameters
        assert list(expected) == list(params)[: len(expected)], (
            f"{session}.{method}{inspect.signature(getattr(cls, method))}"
        )


def test_the_worker_extension_answers_every_rpc_under_one_prefix():
    from mbridge_refit.engines.vllm.worker import RefitWorkerExtension

    rpcs = _protocol_methods(base.RefitWorker)
    assert rpcs and all(name.startswith(base.RPC_PREFIX) for name in rpcs)
    assert isinstance(RefitWorkerExtension(), base.RefitWorker)
    public = _protocol_methods(RefitWorkerExtension)
    assert [name for name in public if not name.startswith(base.RPC_PREFIX)] == []
    for name in rpcs:
        assert list(inspect.signature(getattr(base.RefitWorker, name)).parameters) == list(
            inspect.signature(getattr(RefitWorkerExtension, name)).parameters
        ), name


def test_the_bridge_accepts_what_exports_weights_names():
    """``RefitBridge`` implements ``ExportsWeights``: every method, every parameter by name."""
    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.runtime.weight_source import ExportsWeights

    for method in _protocol_methods(ExportsWeights):
        params = inspect.signature(getattr(RefitBridge, method)).parameters
        wanted = [p for p in inspect.signature(getattr(ExportsWeights, method)).parameters if p != "self"]
        assert set(wanted) <= set(params), f"RefitBridge.{method} lacks {set(wanted) - set(params)}"


def test_an_unknown_adapter_or_transport_is_named_with_what_exists():
    with pytest.raises(InputError, match=r"no engine adapter 'nope'; known: \[.*'vllm'"):
        base.engine_adapter("nope")
    with pytest.raises(
        InputError, match=r"no 'carrier-pigeon' transport; it has \['adapter_ipc', 'broadcast', 'ipc', 'sharded_ipc'\]"
    ):
        base.engine_adapter("vllm").session("carrier-pigeon", object())
    with pytest.raises(InputError, match="unknown transports"):
        base.register_adapter(
            base.EngineAdapter(name="x", sessions={"smoke": object}, worker_extension="x.Y", engine_kwargs=dict)
        )


def test_a_second_adapter_plugs_in_without_the_transports_knowing():
    calls = []
    adapter = base.register_adapter(
        base.EngineAdapter(
            name="stand_in",
            sessions={base.IPC: lambda engine, **options: calls.append((engine, options)) or "session"},
            worker_extension="tests.StandIn",
            engine_kwargs=dict,
        )
    )
    try:
        assert base.engine_adapter("stand_in") is adapter
        assert adapter.session(base.IPC, "engine", timeout_s=1.0) == "session"
        assert calls == [("engine", {"timeout_s": 1.0})]
    finally:
        base._ADAPTERS.pop("stand_in")


def test_the_transports_import_without_any_engine_adapter():
    code = (
        "import sys, mbridge_refit.engines.ipc.engine, mbridge_refit.engines.broadcast.engine, mbridge_refit.engines.base, "
        "mbridge_refit.engines.ipc.sharded; "
        "print(sorted(m for m in sys.modules if m.startswith('mbridge_refit.engines.vllm') or m == 'vllm'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


# Each session's first RPC into a worker, with arguments that would reach the worker's engine side
# (none of which a refused call may touch: the bare worker below has no engine, so reaching it raises
# AttributeError instead of the refusal).
_OPENING_RPCS = {
    "open": ({"version": 1}, b"", "local", True, False, False, None),
    "open_shards": ([{"version": 1}], [b""], "local", True, False),
    "join": ({"host": "127.0.0.1", "port": 1}, 1, False),
    "adapter_open": ({"version": 1}, b"", "local"),
}


@pytest.mark.parametrize("version", [None, base.RPC_VERSION - 1, base.RPC_VERSION + 1, True])
@pytest.mark.parametrize("rpc", sorted(_OPENING_RPCS))
def test_a_worker_refuses_a_trainer_of_another_rpc_version_by_name_before_anything(rpc, version):
    """A trainer of another mbridge_refit (None: one from before the opening RPCs carried a version): the
    worker raises ``RpcVersionError`` naming the RPC, both versions and the fix, before the call reaches
    the engine. Before, the worker took the call as its own version's and the session's later RPCs
    (applies, loads) met arguments of another meaning."""
    from mbridge_refit.engines.vllm.worker import RefitWorkerExtension
    from mbridge_refit.testing.copy_engine import CopyEngineWorker

    workers = [RefitWorkerExtension()]
    if rpc == "open":
        workers.append(CopyEngineWorker.__new__(CopyEngineWorker))  # no receiver: reaching it would fail otherwise
    for worker in workers:
        arguments = _OPENING_RPCS[rpc] + (() if version is None else (version,))
        with pytest.raises(base.RpcVersionError) as refused:
            getattr(worker, base.RPC_PREFIX + rpc)(*arguments)
        shown = "none (an mbridge_refit from before it was versioned)" if version is None else version
        assert (
            f"worker RPC ({base.RPC_PREFIX}{rpc}) wire version mismatch: this side speaks version {base.RPC_VERSION}, "
            f"the trainer version {shown}. Run the same mbridge_refit version" in str(refused.value)
        ), refused.value
        assert vars(worker) == {}, vars(worker)  # nothing opened, joined or mapped


def test_each_session_s_first_rpc_carries_the_rpc_version_last():
    """The trainer sessions' opening calls end with ``RPC_VERSION`` (what the workers check)."""
    from mbridge_refit.engines.ipc.sharing import LocalTransport
    from mbridge_refit.engines.ipc.trainer import IpcSession

    calls = []

    def call_workers(method, *args):
        calls.append((method, args))
        return [{}]

    session = IpcSession(call_workers, transport=LocalTransport(), early_apply=False)
    session.refit_stream([("a", torch.zeros(4))])
    assert [method for method, _ in calls][:1] == ["mbridge_refit_open"], calls
    assert calls[0][1][-1] == base.RPC_VERSION and len(calls[0][1]) == 8, calls[0]
