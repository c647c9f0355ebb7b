"""The colocated step's go-ahead: the trainer tells an engine worker that already holds the step's
apply RPC whether to apply, with one message on a local socket instead of a second RPC.
``GoAheadLine`` (trainer side) and ``GoAheadWaiter`` (engine side).

Why: an RPC through vLLM reaches the worker a millisecond or more after it is sent, and the worker
then spends as long again looking at its own parameters. Both can run while the trainer exports: the
trainer sends the apply RPC first (on a thread), the worker checks its side and waits here, and the
trainer's export ends with one message, numbered by step, that says apply or skip. The worker reads
nothing of the trainer's memory before that message: the trainer's look at its own parameters (a
storage freed in place, a ``param.data`` swap) still comes before any engine read.

Contract:

* Trainer: ``line = GoAheadLine.listen()`` before the open RPC (it watches for the worker from then on),
  ``line.offer(timeout_s)`` (plain data) as its argument; after the open returned with the worker's
  acceptance, ``line.accept(timeout_s, peer_pid)`` with the pid the worker reported.
  Then per step ``line.send(step, apply)`` once its export is done and its device synchronized, for
  the ``step`` its apply RPC carried, even when the export failed (``apply=False``); ``close()`` at the
  end. A send is bounded (a worker whose apply failed before its wait leaves its word unread, and unread
  words fill the socket at last): it then raises, and the session drops the line. A forked child of the
  trainer (a data loader's worker) closes its copies of every line, so a trainer that dies still ends its
  worker's wait at once.
* Engine worker: ``GoAheadWaiter.connect(offer)`` in the open (before its long work: the trainer
  accepts when the open returns), its ``os.getpid()`` in the open's answer, then in each early apply ``wait(step)``: True to apply, False to
  skip. Messages of earlier steps (a step whose RPC failed before it waited) are passed over; the
  trainer's end closing or the offer's timeout passing raises ``GoAheadError``, so a dead trainer never
  leaves the engine waiting.

A local socket (``AF_UNIX``, a Linux abstract name of 64 random bits): the worker must run on the
trainer's host in its network and pid namespaces, as CUDA IPC needs the host anyway; elsewhere
``connect`` raises and the session applies the old way. Lowest layer of ``engines``: the standard
library and ``errors`` only.

Who may talk on the line. The name is no secret (any local process may connect to an abstract name,
and ``/proc/net/unix`` lists it), so each end checks the other with what the kernel says of it
(``SO_PEERCRED``: the pid and effective uid at connect, or at listen for the listening end) and the
worker proves itself with the offer's token (16 random bytes, carried by the open RPC):

* The trainer keeps only a connection of its own uid, of the engine worker's pid once it is known (the
  open report's ``go_ahead_pid``, given to ``accept``), that sends the token. A connection of another
  uid, or of another pid once the worker's is known, is closed before anything is read from it; one of
  this uid is given 0.2 s to send the token. Every refusal is logged as a warning naming the pid and
  uid (the first few peers of a line; the count of all at its end). A process of the same uid is
  trusted as far as the system trusts it (it may read this process's memory where ptrace allows);
  the checks keep a stray one of them off the line.
* The worker sends the token only to a listener of its own uid whose pid is the trainer's (the
  offer's ``pid``): a name some other process bound after the trainer let it go gets nothing.
* The offer carries ``GO_AHEAD_VERSION`` (the offer's and the words' format); a worker of another
  version refuses the line by name, with both versions, and its applies come after the export.
* The line carries no data a stranger could use: step numbers and apply or skip.

Flooding. From ``listen`` to ``accept`` a thread of the line (the gate) watches the listener, so its
queue (64) never stays full while the open runs: the worker's ``connect`` waits up to 5 s for room (a
full ``AF_UNIX`` queue would refuse a non-blocking one at once), and the kernel lets it in as soon as
the gate takes one. The gate takes each queued connection as it comes and checks its credentials
before reading anything (an accept, a ``getsockopt``, a close: microseconds a stranger); it reads the
tokens of this uid's connections side by side without blocking, each closed 0.2 s after it was taken
without its token, at most 64 waiting (the oldest closed first, and at most 32 taken before the
waiting ones are read again, so a connection whose token is on its way is read). The bound: a
stranger's connections, however many and however silent, delay the worker's by no more than the
gate's pass over those queued before it (on a loaded 2-core CPU host: 64 queued, 1.3 ms for the
worker's connect and the accept together; a flood of thousands of connections a second, 6 ms), and
cannot crowd it out (it is read in the gate's pass that takes it, or the next). ``accept`` given the worker's pid returns once the worker's connection proved
itself, or at once with the reason where it was refused or none of that pid is on the line once the
queue is taken; its ``timeout_s`` (the session's 10 s) bounds a starved gate only. Without the pid it
waits up to ``timeout_s`` for a worker. After ``accept`` nothing listens: later connections are
refused by the kernel.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import selectors
import socket
import struct
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

from mbridge_refit.errors import TransportError

__all__ = ["GO_AHEAD_VERSION", "GoAheadError", "GoAheadLine", "GoAheadWaiter"]

logger = logging.getLogger(__name__)

GO_AHEAD_VERSION = 1  # the offer's and the words' format: a worker refuses an offer of another version
_MESSAGE = struct.Struct("<QBd")  # step number, verdict (1 apply, 0 skip), the trainer's time.monotonic() at sending
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid
_NAME_PREFIX = "\0mbridge-refit-go-"  # an abstract Unix name (the leading NUL), 64 random bits after it
_TOKEN_BYTES = 16
_TOKEN_WAIT_S = 0.2  # what a connection of this uid gets to send its token
_WAITING_MAX = 64  # connections of this uid waiting for their tokens at once (the oldest closed first)
_TAKEN_PER_PASS = _WAITING_MAX // 2  # accepted before the waiting ones are read again
_BACKLOG = 64
_CONNECT_S = 5.0  # the worker's connect (the gate keeps the queue moving) and its token's sending
_SEND_S = 5.0  # a word the worker does not read (its apply failed before its wait) fills the buffer at last
_ACCEPT_RETRY_S = 0.01  # after an accept that failed (no file descriptor left)
_WARNED_PEERS = 8  # refused peers named in a warning each, per line (a flood's rest is counted)
_REFUSALS_KEPT = 4096  # refused pids remembered per line, for accept to fail at once on the worker's
_LINES: weakref.WeakSet = weakref.WeakSet()  # the trainer's lines, closed in a forked child (below)


class GoAheadError(TransportError):
    """The go-ahead line failed: the other end closed, a wait timed out, or a message was malformed."""


def _peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """The kernel's ``(pid, uid, gid)`` of the other end of a connected ``AF_UNIX`` socket: the process
    that connected, or for the connecting end the one that listened (``SO_PEERCRED``; the effective uid)."""
    return _CREDENTIALS.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size))


def _receive_exactly(sock: socket.socket, size: int, deadline: float, what: str) -> bytes:
    """``size`` bytes from ``sock`` before ``deadline`` (``time.monotonic``); raises ``GoAheadError``."""
    data = b""
    while len(data) < size:
        left = deadline - time.monotonic()
        if left <= 0:
            raise GoAheadError(f"{what} did not come within its timeout")
        sock.settimeout(left)
        try:
            chunk = sock.recv(size - len(data))
        except TimeoutError:
            continue
        except OSError as err:
            raise GoAheadError(f"the go-ahead line failed while waiting for {what}: {err}") from err
        if not chunk:
            raise GoAheadError(f"the other end closed the go-ahead line while this end waited for {what}")
        data += chunk
    return data


@dataclass
class _Caller:
    """A connection the gate took, with what the kernel says of its other end."""

    connection: socket.socket
    pid: int
    uid: int
    deadline: float = 0.0  # for its token (``time.monotonic``)
    received: bytes = b""


class _Gate:
    """The trainer's listener, watched on a thread of its own from ``listen`` until ``accept`` took the
    worker's connection or the line closed (module docstring: who may talk, flooding). The thread owns
    the listener and every connection until ``take`` hands one over."""

    def __init__(self, listener: socket.socket, token: bytes) -> None:
        self._listener = listener
        self._token = token
        self._uid = os.geteuid()
        self._wake_in, self._wake_out = socket.socketpair()  # the thread reads ``_wake_in``
        self._changed = threading.Condition()
        self._peer_pid: int | None = None  # the worker's, once ``take`` knows it: other pids refused unread
        self._waiting: dict[int, _Caller] = {}  # by file number, oldest first
        self._proven: list[_Caller] = []  # sent the token; the gate's until taken
        self._refused: dict[int, str] = {}  # why, by pid
        self._refusals = 0
        self._stopping = False
        self._failure: BaseException | None = None
        self._settled = False  # the pid known, the queue emptied since, nothing waiting: no worker to come
        self._pid_seen = False  # the thread's: it acts on the known pid
        self._emptied = False  # the thread's: the queue was empty once since
        self._accept_failed = False  # the thread's: warned of it once
        listener.setblocking(False)
        self._wake_in.setblocking(False)
        self._thread = threading.Thread(target=self._watch, name="mbridge-refit-go-ahead-gate", daemon=True)
        self._thread.start()

    def take(self, peer_pid: int | None, deadline: float) -> socket.socket | None:
        """The first connection that proved itself, of ``peer_pid`` where given (from now on, others are
        refused unread); None where none did by ``deadline``. Raises ``GoAheadError`` at once where the
        worker's own connection was refused, or the gate failed."""
        with self._changed:
            self._peer_pid = peer_pid
            self._wake()
            while True:
                while self._proven:
                    caller = self._proven.pop(0)
                    if peer_pid is None or caller.pid == peer_pid:
                        caller.connection.setblocking(True)
                        return caller.connection
                    self._refuse(caller, f"it sent the token, but the engine worker is pid {peer_pid}")
                if self._failure is not None:
                    raise GoAheadError(f"the go-ahead line stopped watching: {self._failure}") from self._failure
                if peer_pid in self._refused:
                    raise GoAheadError(
                        f"the engine worker's connection (pid {peer_pid}) was refused: {self._refused[peer_pid]}"
                    )
                if self._settled:
                    raise GoAheadError(
                        f"the engine worker (pid {peer_pid}) answered once connected, but no connection of that pid "
                        "is on the line (a worker in another pid namespace shows another pid): run the engine in "
                        "the trainer's pid namespace; until then every apply comes after the export"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._changed.wait(left)

    def stop(self) -> None:
        """Stop watching: the thread closes the listener and every connection not taken."""
        with self._changed:
            self._stopping = True
        self._wake()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=_CONNECT_S)
        self._wake_out.close()
        if self._refusals:
            logger.warning(
                "refit: the go-ahead line refused %d connection(s) from %d other process(es) in all",
                self._refusals,
                len(self._refused),
            )
            self._refusals = 0

    def forget_in_child(self) -> None:
        """Close this forked child's copies of the gate's sockets (its thread is not in the child)."""
        for sock in (
            self._listener,
            self._wake_in,
            self._wake_out,
            *(c.connection for c in list(self._waiting.values())),
            *(c.connection for c in list(self._proven)),
        ):
            sock.close()

    def _wake(self) -> None:
        try:
            self._wake_out.send(b"\0")
        except OSError:
            pass  # full (the thread is awake anyway) or closed

    def _watch(self) -> None:
        selector = selectors.PollSelector()  # no kernel state: a forked child's copy shares nothing
        try:
            selector.register(self._listener, selectors.EVENT_READ)
            selector.register(self._wake_in, selectors.EVENT_READ)
            while not self._stopping:
                timeout = None
                if self._waiting:
                    timeout = max(0.0, min(c.deadline for c in self._waiting.values()) - time.monotonic())
                for key, _ in selector.select(timeout):
                    if key.fileobj is self._listener:
                        self._emptied |= self._take_queued(selector) and self._pid_seen
                    elif key.fileobj is self._wake_in:
                        self._drain_wake(selector)
                    elif key.fd in self._waiting:
                        self._read_token(selector, self._waiting[key.fd])
                self._expire(selector)
                if self._pid_seen and self._emptied and not self._waiting:
                    with self._changed:
                        self._settled = True
                        self._changed.notify_all()
        except Exception as err:  # told to ``take``, which raises it
            logger.exception("refit: the go-ahead line's gate failed")
            with self._changed:
                self._failure = err
        finally:
            selector.close()
            with self._changed:
                left = [*self._waiting.values(), *self._proven]
                self._waiting.clear()
                self._proven.clear()
                self._changed.notify_all()
            for caller in left:
                caller.connection.close()
            self._listener.close()
            self._wake_in.close()

    def _take_queued(self, selector: selectors.BaseSelector) -> bool:
        """Take up to ``_TAKEN_PER_PASS`` queued connections: each refused unread where its uid (or pid)
        is not the worker's, else read at once (a worker's token is there) and left waiting if short.
        True where the queue was found empty."""
        for _ in range(_TAKEN_PER_PASS):
            try:
                connection, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return True
            except OSError as err:  # out of file descriptors, say: the queue is taken a little later
                if not self._accept_failed:
                    logger.warning("refit: the go-ahead line could not take a connection: %s", err)
                self._accept_failed = True
                time.sleep(_ACCEPT_RETRY_S)  # the queue stays readable: not a busy loop
                return False
            try:
                pid, uid, _ = _peer_credentials(connection)
            except OSError as err:
                connection.close()
                logger.warning("refit: the go-ahead line closed a connection with no credentials: %s", err)
                continue
            caller = _Caller(connection, pid, uid, time.monotonic() + _TOKEN_WAIT_S)
            if uid != self._uid:
                self._refuse(caller, f"not this trainer's uid {self._uid}")
                continue
            with self._changed:
                peer_pid = self._peer_pid
            if peer_pid is not None and pid != peer_pid:
                self._refuse(caller, f"not the engine worker's pid {peer_pid}")
                continue
            connection.setblocking(False)
            if len(self._waiting) >= _WAITING_MAX:
                oldest = self._waiting.pop(next(iter(self._waiting)))
                selector.unregister(oldest.connection)
                self._refuse(oldest, f"no token yet while {_WAITING_MAX} later connections came")
            self._waiting[connection.fileno()] = caller
            selector.register(connection, selectors.EVENT_READ)
            self._read_token(selector, caller)
        return False

    def _read_token(self, selector: selectors.BaseSelector, caller: _Caller) -> None:
        try:
            chunk = caller.connection.recv(_TOKEN_BYTES - len(caller.received))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as err:
            chunk, why = b"", f"it failed: {err}"
        else:
            why = "it closed before sending a token"
        if chunk:
            caller.received += chunk
            if len(caller.received) < _TOKEN_BYTES:
                return
            why = "a wrong token"
        self._waiting.pop(caller.connection.fileno())
        selector.unregister(caller.connection)
        if chunk and hmac.compare_digest(caller.received, self._token):
            with self._changed:
                self._proven.append(caller)
                self._changed.notify_all()
        else:
            self._refuse(caller, why)

    def _expire(self, selector: selectors.BaseSelector) -> None:
        now = time.monotonic()
        for fd in [fd for fd, caller in self._waiting.items() if caller.deadline <= now]:
            caller = self._waiting.pop(fd)
            selector.unregister(caller.connection)
            self._refuse(caller, f"no token within {_TOKEN_WAIT_S} s")

    def _drain_wake(self, selector: selectors.BaseSelector) -> None:
        """Read the wake-up bytes; where the worker's pid is now known, the others waiting go unread, and
        the queue is taken (the worker's connection is in it or taken already: it answered once connected)."""
        try:
            while self._wake_in.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        with self._changed:
            peer_pid = self._peer_pid
        if peer_pid is None or self._pid_seen:
            return
        self._pid_seen = True
        for fd in [fd for fd, caller in self._waiting.items() if caller.pid != peer_pid]:
            caller = self._waiting.pop(fd)
            selector.unregister(caller.connection)
            self._refuse(caller, f"not the engine worker's pid {peer_pid}")
        self._emptied = self._take_queued(selector)  # what was queued when the pid came

    def _refuse(self, caller: _Caller, why: str) -> None:
        """Close ``caller``'s connection; a warning names the first few peers refused (``stop`` counts all)."""
        caller.connection.close()
        with self._changed:
            self._refusals += 1
            known = caller.pid in self._refused
            if known or len(self._refused) < _REFUSALS_KEPT:
                self._refused[caller.pid] = why
            self._changed.notify_all()
            named = not known and len(self._refused) <= _WARNED_PEERS
        if named:
            logger.warning(
                "refit: the go-ahead line refused a connection from pid %d (uid %d): %s", caller.pid, caller.uid, why
            )


class GoAheadLine:
    """Trainer side: a listening socket, watched by its gate, until the worker connected with the token,
    then its connection."""

    def __init__(self, listener: socket.socket, address: str, token: bytes) -> None:
        self._gate: _Gate | None = _Gate(listener, token)
        self._connection: socket.socket | None = None
        self.address = address
        self._token = token
        weakref.finalize(self, self._gate.stop)  # a line dropped unclosed: its gate's thread ends

    @classmethod
    def listen(cls) -> GoAheadLine:
        """A new line, listening on an abstract local name (raises ``OSError`` where there is none)."""
        address = _NAME_PREFIX + secrets.token_hex(8)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(address)
            listener.listen(_BACKLOG)
        except OSError:
            listener.close()
            raise
        line = cls(listener, address, secrets.token_bytes(_TOKEN_BYTES))
        _LINES.add(line)
        return line

    def offer(self, timeout_s: float) -> dict[str, Any]:
        """What the open RPC carries to the worker (plain data): the format's version, where to connect
        and who listens there, the token that proves the worker, and how long it waits for a go-ahead
        before it gives up."""
        return {
            "version": GO_AHEAD_VERSION,
            "address": self.address.encode().hex(),
            "pid": os.getpid(),
            "token": self._token.hex(),
            "timeout_s": float(timeout_s),
        }

    def accept(self, timeout_s: float, peer_pid: int | None = None) -> None:
        """Take the worker's connection: the first one of this uid that sent the token, of ``peer_pid``
        where given; then stop listening. ``peer_pid`` is the pid the worker answered with, after its
        ``connect`` returned: its connection is then queued or taken already, so ``accept`` raises
        ``GoAheadError`` at once where it was refused or none of that pid is on the line once the queue is
        taken (``timeout_s`` only bounds it). Without ``peer_pid`` it waits up to ``timeout_s`` for one."""
        if self._gate is None:
            raise GoAheadError("the go-ahead line is closed")
        if peer_pid is not None and not _is_pid(peer_pid):
            self.close()
            raise GoAheadError(f"the engine worker's pid {peer_pid!r} is not a process id")
        gate, self._gate = self._gate, None
        try:
            connection = gate.take(peer_pid, time.monotonic() + timeout_s)
        finally:
            gate.stop()
        if connection is None:
            who = "no worker" if peer_pid is None else f"no connection of the engine worker (pid {peer_pid})"
            raise GoAheadError(f"{who} connected with the token within {timeout_s:.2g} s")
        connection.settimeout(_SEND_S)
        self._connection = connection

    @property
    def connected(self) -> bool:
        return self._connection is not None

    def send(self, step: int, apply: bool) -> None:
        """Tell the worker waiting for ``step`` whether to apply. Raises ``GoAheadError`` when the line is
        down (the worker's process ended: its RPC then reports why)."""
        if self._connection is None:
            raise GoAheadError("the go-ahead line is not connected")
        try:
            self._connection.sendall(_MESSAGE.pack(step, 1 if apply else 0, time.monotonic()))
        except OSError as err:
            raise GoAheadError(f"the go-ahead line failed: {err}") from err

    def close(self) -> None:
        """Close the line: the worker's wait ends at once (shut down, so a copy of the socket a forked
        process still holds keeps nothing open)."""
        if self._connection is not None:
            try:
                self._connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._connection.close()
        self._connection = None
        if self._gate is not None:
            self._gate.stop()
        self._gate = None

    def _forget_in_child(self) -> None:
        if self._gate is not None:
            self._gate.forget_in_child()
        if self._connection is not None:
            self._connection.close()
        self._gate = self._connection = None


def _forget_lines_in_child() -> None:
    """A forked child (a data loader's worker) closes its copies of the trainer's lines: else a trainer that
    dies leaves its worker waiting until the child exits. Not shut down: the parent's line stays up."""
    for line in list(_LINES):
        line._forget_in_child()


os.register_at_fork(after_in_child=_forget_lines_in_child)


class GoAheadWaiter:
    """Engine side: the worker's connection to the trainer's line."""

    def __init__(self, connection: socket.socket, timeout_s: float) -> None:
        self._connection: socket.socket | None = connection
        self.timeout_s = timeout_s
        self.last_wake_ms: float | None = None  # the last word's way: its sending to this end's reading it
        self.last_waited_ms: float | None = None  # how long the last wait took

    @classmethod
    def connect(cls, offer: dict[str, Any]) -> GoAheadWaiter:
        """Connect to the trainer's line, check that the trainer listens there (of this worker's uid, of
        the offer's pid) and prove this worker with the offer's token. Raises ``GoAheadError`` where the
        line cannot be reached (another host, network or pid namespace), the offer is malformed or of
        another version, or another process listens on its name (the token then never leaves)."""
        if not isinstance(offer, dict):
            raise GoAheadError(f"malformed go-ahead offer {offer!r:.200}: not a mapping")
        _check_version(offer.get("version"))  # first: the rest of an offer of another version means something else
        try:
            address = bytes.fromhex(offer["address"]).decode()
            token = bytes.fromhex(offer["token"])
            timeout_s = float(offer["timeout_s"])
        except (KeyError, TypeError, ValueError) as err:
            raise GoAheadError(f"malformed go-ahead offer {offer!r}: {err}") from err
        if not address.startswith(_NAME_PREFIX) or len(token) != _TOKEN_BYTES or not timeout_s > 0:
            raise GoAheadError(f"malformed go-ahead offer {offer!r}")
        trainer_pid = offer.get("pid")
        if not _is_pid(trainer_pid):
            raise GoAheadError(f"malformed go-ahead offer {offer!r}: its pid is not a process id")
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            _connect_waiting_for_room(connection, address)
            connection.settimeout(_CONNECT_S)
            _check_listener(connection, trainer_pid)
            connection.sendall(token)
        except OSError as err:
            connection.close()
            raise GoAheadError(f"cannot reach the trainer's go-ahead line: {err}") from err
        except GoAheadError:
            connection.close()
            raise
        return cls(connection, timeout_s)

    def wait(self, step: int) -> bool:
        """Block until the trainer's word for ``step``: True to apply, False to skip. Raises
        ``GoAheadError`` when the trainer's end closed, no word came within the offer's timeout, or
        the words run ahead of ``step`` (the two ends out of step)."""
        if self._connection is None:
            raise GoAheadError("the go-ahead line is closed")
        started = time.monotonic()
        deadline = started + self.timeout_s
        while True:
            what = f"the trainer's go-ahead for step {step}"
            told, verdict, sent = _MESSAGE.unpack(_receive_exactly(self._connection, _MESSAGE.size, deadline, what))
            if told < step:
                continue  # a step whose apply failed before it waited
            if told > step or verdict not in (0, 1):
                raise GoAheadError(
                    f"the trainer's go-ahead names step {told} ({verdict}) while this worker waits for {step}"
                )
            now = time.monotonic()
            self.last_wake_ms, self.last_waited_ms = (now - sent) * 1e3, (now - started) * 1e3
            return verdict == 1

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
        self._connection = None


def _connect_waiting_for_room(connection: socket.socket, address: str) -> None:
    """Connect, waiting up to ``_CONNECT_S`` for room in the listener's queue: a blocking connect bounded
    by ``SO_SNDTIMEO`` (one with a Python timeout is non-blocking, and a full ``AF_UNIX`` queue then
    refuses it at once, ``EAGAIN``); the kernel wakes it as soon as the trainer's gate takes one."""
    seconds = int(_CONNECT_S)
    connection.setblocking(True)
    connection.setsockopt(
        socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", seconds, int((_CONNECT_S - seconds) * 1e6))
    )
    connection.connect(address)


def _is_pid(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _check_version(version: Any) -> None:
    """Refuse, by name, an offer of another go-ahead version than this worker's."""
    if type(version) is int and version == GO_AHEAD_VERSION:
        return
    theirs = "names no version (an mbridge_refit from before versioned go-aheads)"
    if version is not None:
        theirs = f"is version {version!r}"
    raise GoAheadError(
        f"the trainer's go-ahead offer {theirs}, and this worker speaks version {GO_AHEAD_VERSION}: install the "
        "same mbridge_refit in the trainer's and the engine's environments; until then every apply comes after "
        "the export"
    )


def _check_listener(connection: socket.socket, trainer_pid: int) -> None:
    """Refuse a listener that is not the trainer (another uid, another pid: a process that bound the name
    after the trainer let it go, or a trainer in another pid namespace) before the token is sent."""
    pid, uid, _ = _peer_credentials(connection)
    if uid != os.geteuid() or pid != trainer_pid:
        raise GoAheadError(
            f"the go-ahead line's listener is pid {pid} (uid {uid}), not the trainer's pid {trainer_pid} of this "
            f"worker's uid {os.geteuid()}: the token is not sent. Run the engine as the trainer's user in its pid "
            "namespace; until then every apply comes after the export"
        )
