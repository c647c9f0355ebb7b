"""The engines layer's contracts: a refit session (trainer side), a refit worker (engine side), the
step result, and the registry of engine adapters. Imports no engine and no transport.

Three transports move the weights (each an engine-agnostic module of its own): ``ipc``, colocated
(the engine maps the trainer's memory by CUDA IPC and replays its recorded loader,
``engines.ipc.engine``), ``sharded_ipc``, colocated with a tensor-parallel engine (each worker maps its
shard, delivered by the sharded transfer, and replays its loader from it, ``engines.ipc.sharded``),
and ``broadcast``, to engines on other GPUs (the packed broadcast over a group
the workers join by address, ``engines.broadcast.engine``). A fourth, ``adapter_ipc``, moves only a LoRA
adapter's factors into a colocated engine's adapter slot, leaving its base weights as they are
(``engines.lora.ipc``). An engine adapter (``engines.<name>/``, e.g.
``engines.vllm``) is the only code that names its engine: a trainer-side ``RefitSession`` per
transport, the worker extension the engine loads (a ``RefitWorker``), and the arguments that start
the engine with it. It registers itself here with ``register_adapter`` when imported;
``engine_adapter(name)`` imports ``mbridge_refit.engines.<name>`` on first use.

The trainer calls its session; the session calls the engine's workers by RPC (plain data in and
out), every RPC named ``RPC_PREFIX + verb``; the worker runs the transport's engine side.
``RPC_VERSION`` versions those RPCs (their names, arguments and replies, and what they mean): each session's
first RPC into a worker (``open``, ``open_shards``, ``join``, ``adapter_open``) carries it as its last
argument, and the worker refuses another version, or none (a trainer from before the RPCs carried
it), with ``check_rpc_version`` before the call does anything. Every later RPC of the session
(``apply``, ``apply_shards``, ``receive``, ``adapter_load``, the closes), and the opening RPC's own
reply, is exchanged with a worker that took that open, so the one check covers them;
``fingerprints`` and ``adapter_limits`` take no arguments and version their replies.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from mbridge_refit.errors import EngineError, InputError, wire_version_mismatch
from mbridge_refit.runtime.weight_source import ExportsWeights, Model

__all__ = [
    "ADAPTER_IPC",
    "BROADCAST",
    "CallWorkers",
    "IPC",
    "RPC_PREFIX",
    "RPC_VERSION",
    "RpcVersionError",
    "TRANSPORT_NAMES",
    "EngineAdapter",
    "RefitSession",
    "RefitStep",
    "RefitWorker",
    "SHARDED_IPC",
    "check_rpc_version",
    "engine_adapter",
    "register_adapter",
    "registered_adapters",
]

IPC = "ipc"  # colocated: CUDA IPC, the engine's loader recorded once and replayed (engines.ipc.engine)
SHARDED_IPC = "sharded_ipc"  # colocated, engine TP > 1: each worker replays from its shard (engines.ipc.sharded)
BROADCAST = "broadcast"  # other GPUs: the packed broadcast over a group joined by address (engines.broadcast.engine)
ADAPTER_IPC = "adapter_ipc"  # colocated, a LoRA adapter only, into the engine's slot (engines.lora.ipc)
TRANSPORT_NAMES = (IPC, SHARDED_IPC, BROADCAST, ADAPTER_IPC)
RPC_PREFIX = "mbridge_refit_"  # every worker RPC's name starts so
# The worker RPCs (RefitWorker): their names, arguments, replies and meaning. Bump it with any change of them.
RPC_VERSION = 1

# How a trainer-side session calls an engine's workers, what an engine adapter gives each session:
# (RPC name, *arguments) -> the results of the workers the call reached, in worker order.
CallWorkers = Callable[..., list]


class RpcVersionError(EngineError):
    """A trainer whose worker RPCs are of another ``RPC_VERSION`` (another mbridge_refit) called this worker."""


def check_rpc_version(theirs: object, rpc: str) -> None:
    """Refuse ``theirs`` (the ``RPC_VERSION`` a session's first RPC carried; None: a trainer from before it
    was sent) unless it is this one's: ``RpcVersionError`` naming the RPC and both versions. A worker's
    opening RPC calls it before anything else."""
    if type(theirs) is not int or theirs != RPC_VERSION:
        raise RpcVersionError(
            wire_version_mismatch(f"worker RPC ({RPC_PREFIX}{rpc})", RPC_VERSION, theirs, "the trainer")
        )


@dataclass(frozen=True, kw_only=True)
class RefitStep:
    """One refit, as the sending trainer rank saw it (plain data but for the engine's reports).

    ``ms``: from the start of the export until the engine held the new weights. ``opened``: the
    step (re)shared its layout with the engine (``ipc``: the first step, or one whose export
    moved), and ``report`` is the engine's report of that open. ``export_ms``, ``apply_ms``,
    ``engine_ms``, ``reset_ms`` (``ipc``): the export, the RPC that applied it, the part of that the
    engine's worker spent, and after it the engine's follow-up (a prefix-cache reset) with the wait
    for the copies when the engine signals their end by event (``engines.ipc.completion``; its RPC then
    returns once they are launched); with ``early`` the apply RPC left before the export and its
    worker waited for the trainer's go-ahead (``engines.ipc.go_ahead``): ``export_ms`` ends at the
    go-ahead, ``apply_ms`` runs from it to the RPC's return and ``engine_ms`` is the worker's time
    after it; ``export_cpu_ms`` (``ipc``): this thread's CPU time in the
    export's host work, up to its wait for the export's device work (which ``export_ms`` includes and a
    CUDA wait may spend spinning): well below ``export_ms`` without device work, the host made the
    thread wait. ``broadcast``: ``export_ms`` until the sender drained (export, packing, every
    bucket sent), ``apply_ms`` the wait for the workers' receive RPC after that, ``reset_ms`` the
    engine's prefix-cache reset and the outcome shared with the trainer ranks; ``workers`` each
    worker's report of its receive (``receive_ms``: its own time in the RPC; ``phases`` with
    timing on), and ``phases`` the source's per-bucket marks and phases when the session times
    them (``engines.broadcast.timing``). ``adapter_ipc``: ``workers`` holds the engine's load
    report (``ms``, ``modules``, ``slot``, ``phases_ms``).
    """

    tensors: int
    bytes: int
    ms: float
    opened: bool = False
    report: dict[str, Any] | None = None
    export_ms: float | None = None
    export_cpu_ms: float | None = None
    apply_ms: float | None = None
    engine_ms: float | None = None
    workers: list[dict[str, Any]] = field(default_factory=list)
    reset_ms: float | None = None
    phases: dict[str, Any] | None = None
    early: bool = False  # ``ipc``: the apply RPC left before the export and waited for the go-ahead


@runtime_checkable
class RefitSession(Protocol):
    """The trainer side of refits into one engine, over one transport.

    Every rank of the model's groups holds a session and calls it alike (the export is
    collective); one rank sends (it holds the engine's handle). ``open``: once, before the first
    refit (collective: the export plan; a transport may also form its group with the engine).
    ``refit``: every step, with the same ``bridge``, ``model`` and ``fp8`` as ``open``; returns the
    step on the sending rank (None on the others); raises on every rank when the engine could not
    take the weights. ``close``: before the trainer frees the model or the bridge's buffers; the
    engine forgets what it mapped or leaves the group. Implementations may take more keyword
    options.
    """

    def open(self, bridge: ExportsWeights, model: Model, *, fp8: Any = None) -> None: ...

    def refit(self, bridge: ExportsWeights, model: Model, *, fp8: Any = None) -> RefitStep | None: ...

    def close(self) -> None: ...


@runtime_checkable
class RefitWorker(Protocol):
    """The RPCs an engine's worker extension answers, on every worker of the engine (arguments and
    results plain data). Each method hands over to a transport's engine side, which holds the
    contract: ``open``, ``apply``, ``close`` to ``engines.ipc.engine.RefitReceiver``, as do ``open_shards`` and
    ``apply_shards`` (every engine rank's entry in lists, each worker taking its own:
    ``engines.ipc.sharded``); ``join``, ``receive``, ``leave`` to ``engines.broadcast.engine.BroadcastTarget``
    (``join``'s ``group``: the keyword arguments of ``BroadcastTarget.join`` but ``rank``, the same for
    every worker, which joins as ``rank_offset`` + its index); ``adapter_limits``, ``adapter_open``, ``adapter_load``, ``adapter_close`` to
    ``engines.lora.ipc.AdapterReceiver`` and the engine's own adapter slots (a LoRA adapter in place of
    the previous one, the base weights untouched). ``fingerprints``: the exact per-parameter
    fingerprints of the engine's model (``engines.replay.fingerprint``). The opening RPCs' last
    argument, ``rpc_version``: the trainer's ``RPC_VERSION``, checked first (``check_rpc_version``)."""

    def mbridge_refit_open(
        self,
        wire: dict,
        payload: bytes,
        transport: str,
        check: bool,
        allow_partial: bool,
        completion: bool = False,
        go_ahead: dict | None = None,
        rpc_version: int | None = None,
    ) -> dict: ...

    def mbridge_refit_apply(self, fingerprint: str, signal: bool = False, go: int | None = None) -> float | None: ...

    def mbridge_refit_close(self) -> None: ...

    def mbridge_refit_open_shards(
        self,
        wires: list,
        payloads: list,
        transport: str,
        check: bool,
        allow_partial: bool,
        rpc_version: int | None = None,
    ) -> dict: ...

    def mbridge_refit_apply_shards(self, fingerprints: list) -> float: ...

    def mbridge_refit_join(
        self, group: dict, rank_offset: int, allow_partial: bool, rpc_version: int | None = None
    ) -> int: ...

    def mbridge_refit_receive(self) -> dict: ...

    def mbridge_refit_leave(self) -> None: ...

    def mbridge_refit_adapter_limits(self) -> dict: ...

    def mbridge_refit_adapter_open(
        self, wire: dict, payload: bytes, transport: str, rpc_version: int | None = None
    ) -> dict: ...

    def mbridge_refit_adapter_load(self, fingerprint: str, lora_int_id: int, config: dict) -> dict: ...

    def mbridge_refit_adapter_close(self) -> None: ...

    def mbridge_refit_fingerprints(self) -> dict: ...


@dataclass(frozen=True, kw_only=True)
class EngineAdapter:
    """An inference engine as a refit target.

    ``sessions``: transport name (``TRANSPORT_NAMES``) -> the trainer-side session class or
    factory, called as ``factory(engine, **options)``. ``worker_extension``: the dotted path of
    the engine's worker class (a ``RefitWorker``). ``engine_kwargs``: the keyword arguments that
    start the engine with that worker class (given overrides merged in).
    """

    name: str
    sessions: Mapping[str, Callable[..., RefitSession]]
    worker_extension: str
    engine_kwargs: Callable[..., dict[str, Any]]

    def session(self, transport: str, engine: Any, **options: Any) -> RefitSession:
        """A trainer-side session over ``transport`` into ``engine`` (the engine's handle)."""
        factory = self.sessions.get(transport)
        if factory is None:
            raise InputError(f"the {self.name} adapter has no {transport!r} transport; it has {sorted(self.sessions)}")
        return factory(engine, **options)


_ADAPTERS: dict[str, EngineAdapter] = {}


def register_adapter(adapter: EngineAdapter) -> EngineAdapter:
    """Make ``adapter`` known by its name (an adapter's package calls this when imported)."""
    unknown = sorted(set(adapter.sessions) - set(TRANSPORT_NAMES))
    if unknown:
        raise InputError(
            f"engine adapter {adapter.name!r} names unknown transports {unknown}; known: {list(TRANSPORT_NAMES)}"
        )
    _ADAPTERS[adapter.name] = adapter
    return adapter


def engine_adapter(name: str) -> EngineAdapter:
    """The adapter registered as ``name``, importing ``mbridge_refit.engines.<name>`` on first use."""
    if name not in _ADAPTERS and name in _adapter_packages():
        importlib.import_module(f"{__package__}.{name}")
    adapter = _ADAPTERS.get(name)
    if adapter is None:
        raise InputError(
            f"no engine adapter {name!r}; known: {registered_adapters()} (an adapter is the package "
            f"mbridge_refit.engines.<name>, which calls register_adapter when imported)"
        )
    return adapter


def registered_adapters() -> list[str]:
    """Names of the adapters registered or shipped as packages under ``engines/``."""
    return sorted(set(_ADAPTERS) | set(_adapter_packages()))


def _adapter_packages() -> list[str]:
    """Subpackages of ``engines/`` (each an engine adapter), found without importing them."""
    return sorted(path.parent.name for path in Path(__file__).parent.glob("*/__init__.py"))
