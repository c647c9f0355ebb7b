"""The group a packed broadcast runs over: a torch.distributed group, or a group of its own joined by address.

The packed broadcast (``engines.broadcast.packed``) needs six things of its group: whether this
process is the source, ``broadcast`` (also asynchronous), ``all_reduce`` (MAX/MIN),
``broadcast_object`` (the failure path only: the plan's signature and an error message, JSON data)
and ``post_error`` (a member that leaves the protocol on an error says so). ``BroadcastGroup``
names them; two kinds provide them:

* ``TorchGroup``: a group of this process's ``torch.distributed`` world (``new_group``); ``src`` is a
  global rank, as ``torch.distributed`` has it. Its members share a world and its timeout.
* ``StoreGroup``: a process group of its own, made from a ``TCPStore`` at ``host:port`` that its
  members join by address (``src`` is a rank of this group). Its members need not share a
  ``torch.distributed`` world: a trainer rank and the workers of an inference engine on other
  GPUs (each with a world of its own) form one, which is what a refit into a separately launched
  engine needs. NCCL on CUDA (one GPU per member), gloo otherwise. vLLM's weight transfer builds
  the same thing from its ``StatelessProcessGroup``; this one is plain torch, so the trainer side
  needs no engine package.

Joining a ``StoreGroup``: rank 0 hosts the store, listening on ``host``'s address only (torch's
store would listen on every interface: ``_tcp_store``); every member passes the same ``host``,
``port``, ``world_size`` and ``secret``. Construction returns once all of them have joined and
connected, or raises:

1. Settings. Each member posts the keyed digest of its ``group_settings`` (the backend and, for
   NCCL, the library's version and every ``NCCL_*`` variable of its environment but diagnostics
   and host-local device names) and waits for everyone's; only when the digests differ do the
   members post the settings themselves, to name the differences. NCCL needs them equal on every member: a process
   whose environment pins other channel counts, protocols or algorithms builds a communicator
   its peers' does not fit, and NCCL fails inside its bootstrap ("Message truncated: received
   12288 bytes instead of 512": 24 channels' connection data meeting a peer that set up one)
   or a collective hangs. vLLM's batch-invariant mode (``VLLM_BATCH_INVARIANT=1``) sets such
   variables (``NCCL_MIN_NCHANNELS=NCCL_MAX_NCHANNELS=1``, ``NCCL_PROTO=Simple``, ...) in its
   workers only. A difference raises ``GroupSetupError`` on every member, naming each variable
   and each member's value, before any NCCL call. NCCL reads these variables once, at the first
   communicator of a process: set them before that.
2. Connecting: the communicators are created and checked by one all-reduce, on a helper thread
   watched as below, so a member that fails to connect cannot leave the others in NCCL's
   bootstrap.

Who may write: a ``TCPStore`` lets anyone who reaches its address read, write and delete any key,
so every entry the members write (settings, heartbeats, failures) is signed with the group's
``secret`` (``engines.broadcast.store_entries``: an HMAC over the entry's key, its member and its body) and
every entry they read is checked: a stranger's entry, or one under a member the group does not
have, is ignored with a warning, so a forged failure aborts no one and forged settings do not
join. The secret is made by one member (``new_secret``) and handed to the others out of band (the
broadcast session sends it in its join RPC); it never enters the store. What a stranger who
reaches the store can still do is deny service: delete or overwrite entries, fill the store's
memory (rank 0's process), read the process group's bootstrap keys (under ``pg/``, torch's, not
signed) and reach NCCL's or gloo's own connections, which have no authentication either. The
members then fail as for a lost member, within ``PEER_SILENT_S`` or their timeout, naming the
entries that failed their check. A member that writes entries of another protocol
(``STORE_PROTOCOL``; another mbridge_refit) and holds the secret is refused by name.

Failures reach every member as ``PeerFailedError`` within seconds instead of the timeout:

* a member that leaves the protocol on an error posts it to the store (``post_error``);
* each member's watchdog thread beats a heartbeat into the store and, every ``PEER_CHECK_S``,
  reads the posted errors and the others' heartbeats. A posted error, a member silent for
  ``PEER_SILENT_S``, or a store that refuses the connection (its host, rank 0, is gone) or has
  not answered for ``PEER_SILENT_S`` (stopped) marks the group failed and, for NCCL, aborts its
  communicators (a kernel waiting for a gone peer ends);
* every wait (a collective, ``synchronize``, connecting) polls for completion, for that mark
  and for outside signals the caller registers (``watching``; e.g. the RPC that runs the
  engine's side ended in an error while this member still waits for it). The ``timeout``
  bounds each wait; past it the member posts its failure and raises. A wait polls every
  ``FAST_POLL_S`` for its first ``FAST_POLL_WINDOW_S`` (a refit's last collective ends within
  tens of milliseconds; a wait that overshoots its end by a poll interval delays the step by as
  much), then every ``poll_s`` (milliseconds: a member waiting for a slow peer costs no CPU).

On CUDA the group's NCCL kernels run on a high-priority stream (``is_high_priority_stream``): a
packed broadcast runs its copies, checksums and the consumer's replay beside its broadcasts, and
a kernel that fills every SM would otherwise hold the next broadcast's kernel back until it ends,
which serializes the pipeline the buffers are there to overlap.

A failed group stays failed (every later collective raises at once): close it and form a new
one. Failures the packed broadcast reports itself (a plan mismatch, a bad checksum, a failing
consumer) complete the collectives on every member and leave the group usable.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from mbridge_refit.engines.broadcast.store_entries import (
    STORE_PROTOCOL,
    SignedEntries,
    StoreProtocolError,
    check_secret,
    new_secret,
)
from mbridge_refit.errors import TransportError

__all__ = [
    "BroadcastGroup",
    "BroadcastGroupError",
    "DEFAULT_TIMEOUT",
    "EXIT_WAIT_S",
    "FAST_POLL_S",
    "FAST_POLL_WINDOW_S",
    "GroupLike",
    "GroupSetupError",
    "OUTSIDE_GRACE_S",
    "PEER_CHECK_S",
    "PEER_SILENT_S",
    "POST_WAIT_S",
    "PeerFailedError",
    "STORE_PROTOCOL",
    "SettingsMismatchError",
    "StoreGroup",
    "StoreProtocolError",
    "TorchGroup",
    "as_broadcast_group",
    "group_settings",
    "new_secret",
    "settings_differences",
]

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)
PEER_CHECK_S = 0.5  # how often a member's watchdog beats and reads the others' state
PEER_SILENT_S = 15.0  # a member whose heartbeat has not advanced for this long is gone
POST_WAIT_S = 2.0  # how long posting a failure may take before the caller goes on raising its own
OUTSIDE_GRACE_S = 1.0  # an outside failure counts once it stood this long while the wait stayed open
FAST_POLL_S = 2e-4  # how often a wait polls for its first FAST_POLL_WINDOW_S
FAST_POLL_WINDOW_S = 0.25
_KEYS = "mbridge_refit/"  # the group's own keys in the store (the process group's are under _KEYS + "pg/")
_UNSET = "<unset>"
_FAILED_GLOO_GROUPS: list[Any] = []  # kept, not destroyed: see StoreGroup.close
EXIT_WAIT_S = 2.0  # how long the exit hook waits for the watchdogs of groups never closed
# NCCL variables members may set differently: diagnostics and names of this host's devices and files.
_HOST_LOCAL_NCCL_VARIABLES = frozenset(
    {
        "NCCL_DEBUG",
        "NCCL_DEBUG_SUBSYS",
        "NCCL_DEBUG_FILE",
        "NCCL_DEBUG_TIMESTAMP_FORMAT",
        "NCCL_DEBUG_TIMESTAMP_LEVELS",
        "NCCL_WARN_ENABLE_DEBUG_INFO",
        "NCCL_SOCKET_IFNAME",
        "NCCL_IB_HCA",
        "NCCL_HOSTID",
        "NCCL_TOPO_FILE",
        "NCCL_TOPO_DUMP_FILE",
        "NCCL_GRAPH_DUMP_FILE",
    }
)


class BroadcastGroupError(TransportError):
    """The group cannot run a collective (the subclass says why)."""


class GroupSetupError(BroadcastGroupError):
    """The members cannot form the group: their settings differ, a member did not join, or connecting failed."""


class SettingsMismatchError(GroupSetupError):
    """The members' settings differ (each differing setting and every member's value is named);
    raised on every member alike, before any NCCL call."""


class PeerFailedError(BroadcastGroupError):
    """Another member of the group failed or is gone (its message, or what was seen, is named)."""


@runtime_checkable
class BroadcastGroup(Protocol):
    """What a packed broadcast runs over (module docstring). ``src`` means what the group says."""

    def is_member(self) -> bool: ...

    def is_source(self, src: int) -> bool: ...

    def broadcast(self, tensor: torch.Tensor, src: int, *, async_op: bool = False) -> Any: ...

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp) -> None: ...

    def broadcast_object(self, obj: Any, src: int, device: torch.device) -> Any: ...

    def post_error(self, message: str) -> None: ...


GroupLike = BroadcastGroup | dist.ProcessGroup  # a group as the packed broadcast's ends take it (as_broadcast_group)


class TorchGroup:
    """A ``torch.distributed`` group (``None``: the default group); ``src`` is a global rank."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def is_member(self) -> bool:
        return dist.get_rank(self.group) >= 0

    def is_source(self, src: int) -> bool:
        return dist.get_rank() == src

    def broadcast(self, tensor: torch.Tensor, src: int, *, async_op: bool = False) -> Any:
        return dist.broadcast(tensor, src=src, group=self.group, async_op=async_op)

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp) -> None:
        dist.all_reduce(tensor, op=op, group=self.group)

    def broadcast_object(self, obj: Any, src: int, device: torch.device) -> Any:
        holder = [obj]
        dist.broadcast_object_list(holder, src=src, group=self.group, device=device if device.type == "cuda" else None)
        return holder[0]

    def post_error(self, message: str) -> None:
        """Nothing to post: the members share a ``torch.distributed`` world, whose timeout bounds their waits."""


# --- settings every member must share -------------------------------------------------------------


def group_settings(backend: str, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """What every member of a ``StoreGroup`` must agree on (module docstring): the backend and, for
    NCCL, the library's version and the ``NCCL_*`` variables of ``environ`` (default: this
    process's) that shape a communicator. (The store's protocol is in each entry's envelope:
    ``engines.broadcast.store_entries``.)"""
    environ = os.environ if environ is None else environ
    settings: dict[str, Any] = {"backend": backend}
    if backend == "nccl":
        settings["nccl_version"] = ".".join(str(part) for part in torch.cuda.nccl.version())
        settings["nccl_env"] = {
            name: value
            for name, value in sorted(environ.items())
            if name.startswith("NCCL_") and name not in _HOST_LOCAL_NCCL_VARIABLES
        }
    return settings


def settings_differences(by_member: Mapping[int, Mapping[str, Any]]) -> list[str]:
    """Each setting not equal on every member, as ``"NAME: member 0 X, member 1 Y"`` (sorted by
    name; a variable one member does not set shows as ``<unset>``)."""
    flat = {member: _flat_settings(settings) for member, settings in sorted(by_member.items())}
    names = sorted(set().union(*flat.values())) if flat else []
    differences = []
    for name in names:
        values = {member: settings.get(name, _UNSET) for member, settings in flat.items()}
        if len(set(values.values())) > 1:
            differences.append(f"{name}: " + ", ".join(f"member {m} {v}" for m, v in values.items()))
    return differences


def _flat_settings(settings: Mapping[str, Any]) -> dict[str, str]:
    flat = {name: str(value) for name, value in settings.items() if name != "nccl_env"}
    flat.update(settings.get("nccl_env", {}))
    return flat


def _settings_error(differences: list[str], host: str, port: int) -> SettingsMismatchError:
    return SettingsMismatchError(
        f"the members of the group at {host}:{port} cannot form one communicator, their settings differ: "
        + "; ".join(differences)
        + ". NCCL needs them equal on every member (a communicator built with other channel counts, protocols or "
        "algorithms does not fit its peers': NCCL fails in its bootstrap or a collective hangs). Set the same "
        "NCCL_* values in every member's environment before its first NCCL call; vLLM's batch-invariant mode "
        "(VLLM_BATCH_INVARIANT=1) sets some in its workers only, so set them in the trainer too or run without it"
    )


# --- the group joined by address -------------------------------------------------------------------


class StoreGroup:
    """A process group of its own, joined by address (module docstring); ``src`` is a rank of it.

    Args:
        host, port: the store's address; rank 0 listens there (on ``host``'s address only), the others
            connect.
        rank, world_size: this member's rank and the number of members.
        secret: the group's secret (``new_secret()``: at least 32 random bytes), the same on every
            member, handed to the others out of band (never through the store): every entry the
            members write is signed with it and entries that fail it are ignored (module docstring).
        device: the device its tensors live on; NCCL when it is CUDA (set it as the current device
            first), gloo otherwise (``backend`` overrides: gloo also carries CUDA tensors, through host
            memory, e.g. for two members on one GPU, which NCCL refuses).
        timeout: bounds the join and every wait.
        peer_failure: an outside signal checked while joining (see ``watching``).
    """

    store_protocol = STORE_PROTOCOL  # the protocol of the entries this member writes (a test's subclass lowers it)

    def __init__(
        self,
        *,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        device: torch.device | str,
        secret: bytes,
        backend: str | None = None,
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
        peer_failure: Callable[[], str | None] | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not a member of a group of {world_size}: ranks are 0..{world_size - 1}")
        self.host, self.port, self.timeout = host, port, timeout
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        if self.backend not in ("nccl", "gloo"):
            raise ValueError(f"backend {self.backend!r} is not supported: use 'nccl' (CUDA) or 'gloo'")
        self.process_group: Any = None
        self._entries = SignedEntries(check_secret(secret), _KEYS, world_size, protocol=self.store_protocol)
        self._beats = 0  # this member's heartbeats so far
        self._failure: str | None = None
        self._posted = False
        self._outside: list[Callable[[], str | None]] = []
        self._stop = threading.Event()
        self._post_lock = threading.Lock()
        self.store = _tcp_store(host, port, world_size, is_master=rank == 0, timeout=timeout)
        self._post_store = self.store.clone()
        self._last_round = time.monotonic()  # when the watchdog last heard from the store
        self._watchdog = threading.Thread(
            target=self._watch, args=(self.store.clone(),), daemon=True, name=f"store-group-watchdog-{rank}"
        )
        self._watchdog.start()
        _WATCHED.add(self)
        try:
            with self.watching(peer_failure) if peer_failure is not None else contextlib.nullcontext():
                self._agree_on_settings(group_settings(self.backend))
                self._connect()
        except BaseException as err:
            if not isinstance(err, (SettingsMismatchError, PeerFailedError)):  # those every member raises alike
                self.post_error(f"joining the group failed on member {rank}: {type(err).__name__}: {err}")
            self.close()
            raise

    def is_member(self) -> bool:
        return True

    def is_source(self, src: int) -> bool:
        return self.rank == src

    @property
    def failed(self) -> str | None:
        """Why the group failed (a member's posted error, or what this member saw), or None."""
        return self._failure

    def close(self) -> None:
        """Stop the watchdog and release the group's communicators (NCCL's hold GPU memory until
        then); call once, on every member, after its last collective. A group never closed has its
        watchdog stopped when the interpreter exits (``_stop_watchdogs_at_exit``)."""
        self._stop_watchdog(2 * PEER_CHECK_S)
        group, self.process_group = self.process_group, None
        if group is None:
            return
        if self._failure is None:
            shutdown = getattr(group, "shutdown", None)
            if shutdown is not None:
                shutdown()
        elif self.backend == "gloo":  # its pending operations end at its timeout; its destructor would wait for them
            _FAILED_GLOO_GROUPS.append(group)

    def _stop_watchdog(self, wait_s: float) -> bool:
        """Tell the watchdog to stop and wait up to ``wait_s`` for it; whether it has ended."""
        self._stop.set()
        if self._watchdog.is_alive() and self._watchdog is not threading.current_thread():
            self._watchdog.join(timeout=wait_s)
        return not self._watchdog.is_alive()

    # -- collectives -----------------------------------------------------------------------

    def broadcast(self, tensor: torch.Tensor, src: int, *, async_op: bool = False) -> Any:
        self._check_usable("a broadcast")
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = src, 0
        work = self.process_group.broadcast([tensor], options)
        if async_op:
            return _WatchedWork(self, work, stream_ordered=tensor.is_cuda)
        self._finish(work, "a broadcast")
        return None

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp) -> None:
        self._check_usable("an all-reduce")
        options = dist.AllreduceOptions()
        options.reduceOp = op
        self._finish(self.process_group.allreduce([tensor], options), "an all-reduce")

    def broadcast_object(self, obj: Any, src: int, device: torch.device) -> Any:
        """``obj`` of ``src`` (JSON data: a member joined by address may be another program, so
        what arrives is parsed, never unpickled; tuples arrive as lists)."""
        payload = json.dumps(obj).encode() if self.rank == src else b""
        size = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        self.broadcast(size, src)
        data = torch.empty(int(size), dtype=torch.uint8, device=self.device)
        if self.rank == src:
            data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self.broadcast(data, src)
        return obj if self.rank == src else json.loads(data.cpu().numpy().tobytes())

    def synchronize(self) -> None:
        """Wait until this device's current stream has run everything queued (CUDA), watching the
        peers as every wait does: a kernel of a collective whose peer failed does not end."""
        if self.device.type != "cuda":
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._wait_until(event.query, "synchronizing the device")

    # -- failures --------------------------------------------------------------------------

    def post_error(self, message: str) -> None:
        """Tell every member that this one failed (``message`` names the error) and mark the group
        failed here; the others raise ``PeerFailedError`` at their next check. Best effort: a store
        that no longer answers is logged, not raised (the caller is raising its own error)."""
        if self._posted:
            return
        self._posted = True
        self._mark_failed(f"member {self.rank} failed: {message}")

        def post() -> None:
            try:
                with self._post_lock:
                    self._entries.put(self._post_store, f"error/{self.rank}", self.rank, message[:4000])
            except Exception as err:  # noqa: BLE001 - the store's host may be gone; the caller raises its own error
                logger.warning(
                    "could not post this member's failure to the group's store at %s:%d: %s", self.host, self.port, err
                )

        poster = threading.Thread(target=post, daemon=True, name=f"store-group-post-{self.rank}")
        poster.start()
        poster.join(POST_WAIT_S)  # a store that does not answer must not hold up the caller's own error
        if poster.is_alive():
            logger.warning(
                "the group's store at %s:%d did not take this member's failure within %.0f s",
                self.host,
                self.port,
                POST_WAIT_S,
            )

    @contextlib.contextmanager
    def watching(self, check: Callable[[], str | None]) -> Iterator[None]:
        """Within the block, every wait of this member also calls ``check``: a message (e.g. "the
        RPC that runs the engine's side ended with ...") that stands for ``OUTSIDE_GRACE_S`` while
        the awaited collective is still open fails the group, posted for the other members."""
        self._outside.append(check)
        try:
            yield
        finally:
            self._outside.remove(check)

    def _mark_failed(self, failure: str) -> None:
        if self._failure is not None:
            return
        self._failure = failure
        group = self.process_group
        if self.backend == "nccl" and group is not None:
            try:
                group.abort()  # ends kernels still waiting for a gone peer; the group is not used again
            except Exception as err:  # noqa: BLE001 - best effort: the failure is raised either way
                logger.warning("aborting the NCCL communicators of the failed group failed: %s", err)

    def _check_usable(self, what: str) -> None:
        if self._failure is not None:
            raise PeerFailedError(f"{what} on a failed group: {self._failure}; close it and form a new one")
        if self.process_group is None:
            raise BroadcastGroupError(f"{what} on a closed group: form a new one")

    def _finish(self, work: Any, what: str) -> None:
        """Wait for ``work`` (watching the peers), then surface its own error."""
        self._wait_until(work.is_completed, what)
        try:
            work.wait()
        except Exception as err:
            if self._failure is not None:
                raise PeerFailedError(f"{what}: {self._failure}") from err
            raise

    def _wait_until(
        self,
        done: Callable[[], bool],
        what: str,
        *,
        poll_s: float = 0.002,
        fast: bool = True,
        on_deadline: Callable[[], BaseException] | None = None,
    ) -> None:
        """Poll ``done`` until it is true; raise ``PeerFailedError`` once the group failed or an
        outside check's failure stood ``OUTSIDE_GRACE_S``, and past the timeout (posting it).
        ``fast``: poll every ``FAST_POLL_S`` for the first ``FAST_POLL_WINDOW_S`` (waits for a
        collective or the device; not joining, whose polls are round trips to the store)."""
        began = time.monotonic()
        window = FAST_POLL_WINDOW_S if fast else 0.0
        deadline = began + self.timeout.total_seconds()
        delay, outside_since = min(5e-5, poll_s), None
        while not done():
            if self._failure is not None:
                raise PeerFailedError(f"{what} on member {self.rank}: {self._failure}")
            now = time.monotonic()
            if now - self._last_round > PEER_SILENT_S:  # the watchdog is stuck in a store call that gets no answer
                self._mark_failed(
                    f"the group's store at {self.host}:{self.port} has not answered for "
                    f"{PEER_SILENT_S:.0f} s: its host, member 0, is stopped or unreachable"
                )
                continue
            outside = next((message for message in (check() for check in self._outside) if message), None)
            outside_since = None if outside is None else (outside_since or now)
            if outside_since is not None and now - outside_since >= OUTSIDE_GRACE_S:
                self.post_error(f"{what} cannot complete: {outside}")
                raise PeerFailedError(f"{what} on member {self.rank}: {outside}")
            if now > deadline:
                error = (
                    on_deadline()
                    if on_deadline is not None
                    else PeerFailedError(
                        f"{what} did not complete within {self.timeout.total_seconds():.0f} s on member {self.rank}: "
                        "a member is not taking part (it has not called it, or it is blocked)"
                    )
                )
                self.post_error(str(error))
                raise error
            time.sleep(delay)
            delay = min(delay * 2, min(poll_s, FAST_POLL_S) if now - began < window else poll_s)
        if self._failure is not None:  # NCCL's abort of a failed group ends its collectives: done, with no result
            # (a wait on work that had ended before the failure raises too: the group is done for either way)
            raise PeerFailedError(f"{what} on member {self.rank}: {self._failure}")

    def _watch(self, store: Any) -> None:
        """The watchdog thread: beat, then read the others' errors and heartbeats, every ``PEER_CHECK_S``."""
        beats: dict[int, tuple[int, float]] = {}
        while self._failure is None:
            try:
                self._beats += 1
                self._entries.put(store, f"alive/{self.rank}", self.rank, str(self._beats))
                failure = self._peer_failure(store, beats)
                self._last_round = time.monotonic()
            except StoreProtocolError as err:  # a member of another mbridge_refit: its entries cannot be read
                failure = str(err)
            except Exception as err:  # noqa: BLE001 - a store that does not answer is the failure seen
                failure = (
                    f"the group's store at {self.host}:{self.port} does not answer "
                    f"({type(err).__name__}: {err}); its host, member 0, is gone"
                )
            if failure is not None:
                if not self._stop.is_set():
                    self._mark_failed(failure)
                return
            if self._stop.wait(PEER_CHECK_S):
                return

    def _peer_failure(self, store: Any, beats: dict[int, tuple[int, float]]) -> str | None:
        """A failure another member posted, or a member whose heartbeat stopped (after it began). Only
        the members' own signed entries count: a stranger's are ignored (``SignedEntries.read``)."""
        others = [member for member in range(self.world_size) if member != self.rank]
        for member in others:
            message = self._entries.read(store, f"error/{member}", member)
            if message is not None:
                return f"member {member} failed: {message}"
        now = time.monotonic()
        for member in others:
            count = _count(self._entries.read(store, f"alive/{member}", member))
            last = beats.get(member)
            if last is None or count > last[0]:  # a beat counts once it advances: an older one replayed does not
                beats[member] = (count, now)
            elif last[0] > 0 and now - last[1] > PEER_SILENT_S:
                return (
                    f"member {member} has sent no heartbeat for {PEER_SILENT_S:.0f} s: its process is gone or stuck"
                    + self._rejected_note()
                )
        return None

    def _rejected_note(self) -> str:
        """What a failure's message adds when entries failed their check (a stranger wrote to the store)."""
        if not self._entries.rejected:
            return ""
        return (
            f" (the entries of {self._entries.rejected} keys in the store at {self.host}:{self.port} failed their check: a "
            "process that does not hold the group's secret writes to it; keep the store's address to the members)"
        )

    # -- joining ---------------------------------------------------------------------------

    def _agree_on_settings(self, mine: dict[str, Any]) -> None:
        """Step 1 of the join (module docstring): post the keyed digest of ``mine``, wait for every
        member's, compare; only if they differ, post ``mine`` itself and name the differences."""
        text = json.dumps(mine, sort_keys=True)
        digests = self._gather_entries("settings", self._entries.digest(text), "joining the group")
        if len(set(digests.values())) == 1:
            return
        values = self._gather_entries("settings-values", text, "naming the members' differing settings")
        differences = settings_differences({member: json.loads(value) for member, value in values.items()})
        if not differences:  # equal settings whose digests differ: a member computes them otherwise
            differences = [f"settings digest: member {m} {d[:16]}" for m, d in sorted(digests.items())]
        raise _settings_error(differences, self.host, self.port)

    def _gather_entries(self, name: str, mine: str, what: str) -> dict[int, str]:
        """Post ``mine`` as this member's signed entry ``name/<rank>`` and wait (bounded by the timeout)
        until every member's is there and valid; their bodies by member. An entry that fails its check
        is ignored: its member's own entry may still come (it overwrites the stranger's)."""
        self._entries.put(self.store, f"{name}/{self.rank}", self.rank, mine)
        keys = [f"{_KEYS}{name}/{member}" for member in range(self.world_size)]
        bodies: dict[int, str] = {}

        def complete() -> bool:
            if not self.store.check(keys):  # one round trip while members are still coming
                return False
            for member in range(self.world_size):
                if member not in bodies:
                    body = self._entries.read(self.store, f"{name}/{member}", member)
                    if body is not None:
                        bodies[member] = body
            return len(bodies) == self.world_size

        def missing() -> GroupSetupError:
            absent = [member for member in range(self.world_size) if member not in bodies]
            return GroupSetupError(
                f"members {absent} did not join the group at {self.host}:{self.port} within "
                f"{self.timeout.total_seconds():.0f} s: start them with the same host, port, world size "
                f"({self.world_size}) and secret" + self._rejected_note()
            )

        self._wait_until(complete, what, poll_s=0.05, fast=False, on_deadline=missing)
        return bodies

    def _connect(self) -> None:
        """Step 2 of the join: create the communicators and all-reduce one count on a helper thread,
        watched (NCCL's bootstrap cannot be interrupted; a member that fails there posts it)."""
        outcome: dict[str, Any] = {}

        def connect() -> None:
            try:
                if self.device.type == "cuda":
                    torch.cuda.set_device(self.device)
                store = dist.PrefixStore(_KEYS + "pg", self.store.clone())
                self.process_group = _process_group(self.backend, store, self.rank, self.world_size, self.timeout)
                count = torch.ones(1, dtype=torch.int64, device=self.device)
                options = dist.AllreduceOptions()
                options.reduceOp = dist.ReduceOp.SUM
                self.process_group.allreduce([count], options).wait()
                outcome["members"] = int(count.item())  # on CUDA: waits for the all-reduce itself
            except BaseException as err:  # noqa: BLE001 - handed to the joining thread
                outcome["error"] = err

        thread = threading.Thread(target=connect, daemon=True, name=f"store-group-connect-{self.rank}")
        thread.start()
        self._wait_until(lambda: not thread.is_alive(), f"connecting the {self.backend} group", poll_s=0.01, fast=False)
        if "error" in outcome:
            agreed = f"NCCL {group_settings(self.backend)['nccl_version']}" if self.backend == "nccl" else "gloo"
            raise GroupSetupError(
                f"connecting the {self.backend} group at {self.host}:{self.port} failed on member {self.rank}: "
                f"{type(outcome['error']).__name__}: {outcome['error']}. The members' settings agree ({agreed}); "
                "an NCCL_* variable set in a process after its first NCCL call takes no effect there"
            ) from outcome["error"]
        if outcome["members"] != self.world_size:
            raise GroupSetupError(
                f"the group's first all-reduce counted {outcome['members']} members, not {self.world_size}"
            )


class _WatchedWork:
    """An asynchronous collective of a ``StoreGroup``. ``wait`` on a stream-ordered (CUDA) work
    orders the current stream after it and returns; the CPU never blocks there, so a failed peer
    is met at the next blocking wait. Otherwise it blocks, watching the peers."""

    def __init__(self, group: StoreGroup, work: Any, *, stream_ordered: bool) -> None:
        self.group, self.work, self.stream_ordered = group, work, stream_ordered

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self) -> None:
        if self.stream_ordered:
            self.group._check_usable("waiting for a broadcast")
            self.work.wait()
        else:
            self.group._finish(self.work, "a broadcast")


def _tcp_store(host: str, port: int, world_size: int, *, is_master: bool, timeout: datetime.timedelta) -> Any:
    """The group's ``TCPStore``; on the master, listening on ``host``'s address only.

    Given a host name, torch's store listens on every interface (both backends, torch 2.11: ``ss``
    shows ``*:port``), so a group meant for ``127.0.0.1`` was reachable from the network. The master
    binds the socket itself and hands it over (``master_listen_fd``; the store owns and closes it)."""
    if not is_master:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        listening = socket.create_server(address, family=family)
    except OSError as err:
        raise GroupSetupError(
            f"the group's store cannot listen on {host}:{port}: {err}. Give a free port and an address of this host"
        ) from err
    # Handed over, the socket is the store's: if the constructor fails, it is left open rather than closed
    # twice (the store may have taken it already).
    return dist.TCPStore(
        host,
        port,
        world_size,
        is_master=True,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=listening.detach(),
    )


def _count(body: str | None) -> int:
    """A heartbeat entry's count (0: none yet, or not readable)."""
    try:
        return int(body) if body is not None else 0
    except ValueError:
        return 0


def _process_group(backend: str, store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> Any:
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    options.is_high_priority_stream = True  # the broadcasts' kernels first (module docstring)
    return dist.ProcessGroupNCCL(store, rank, world_size, options)


def as_broadcast_group(group: GroupLike | None) -> BroadcastGroup:
    """``group`` as a ``BroadcastGroup``: itself if it is one, else a ``TorchGroup`` around it (None: the
    default ``torch.distributed`` group)."""
    return group if isinstance(group, BroadcastGroup) else TorchGroup(group)


# --- groups never closed ---------------------------------------------------------------------------

_WATCHED: weakref.WeakSet[StoreGroup] = weakref.WeakSet()  # a running watchdog holds its group


@atexit.register
def _stop_watchdogs_at_exit() -> None:
    """Stop the watchdogs of groups their owner never closed (a session left open by an error, or
    by a program that just ends), before the interpreter finalizes.

    A watchdog is a daemon thread that spends its time in store calls, which run C++ without the
    GIL. A daemon thread that asks for the GIL back once finalization has begun is ended by CPython
    with a forced unwind, and that unwind through pybind11's GIL guard (a destructor, so noexcept)
    is ``std::terminate``: the process aborts ("terminate called without an active exception",
    exit code 134) after its work has succeeded. ``atexit`` runs before finalization, while the
    thread can still finish its call and return."""
    groups = list(_WATCHED)
    for group in groups:
        group._stop.set()
    deadline = time.monotonic() + EXIT_WAIT_S
    stuck = [g.rank for g in groups if not g._stop_watchdog(max(0.0, deadline - time.monotonic()))]
    if stuck:
        logger.warning(
            "the watchdogs of group members %s were still in a store call at exit (a store that does not answer)",
            stuck,
        )
