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

* Trainer: ``line = GoAheadLine.listen()`` before the open RPC, ``line.offer(timeout_s)`` (plain data)
  as its argument; after the open returned with the worker's acceptance, ``line.accept(timeout_s)``.
  Then per step ``line.send(step, apply)`` once its export is done and its device synchronized, for
  the ``step`` its apply RPC carried, even when the export failed (``apply=False``); ``close()`` at the
  end. A send is bounded (a worker whose apply failed before its wait leaves its word unread, and unread
  words fill the socket at last): it then raises, and the session drops the line. A forked child of the
  trainer (a data loader's worker) closes its copies of every line, so a trainer that dies still ends its
  worker's wait at once.
* Engine worker: ``GoAheadWaiter.connect(offer)`` in the open (before its long work: the trainer
  accepts when the open returns), then in each early apply ``wait(step)``: True to apply, False to
  skip. Messages of earlier steps (a step whose RPC failed before it waited) are passed over; the
  trainer's end closing or the offer's timeout passing raises ``GoAheadError``, so a dead trainer never
  leaves the engine waiting.

A local socket (``AF_UNIX``, a Linux abstract name of 64 random bits): the worker must run on the
trainer's host in its network namespace, as CUDA IPC needs the host anyway; elsewhere ``connect``
raises and the session applies the old way. The name is not a secret (any local process may connect
to an abstract name), so the worker's first bytes are the offer's token (16 random bytes) and the
trainer keeps only a connection that sends it; a stranger's connection is closed unanswered, and
the line carries no data a stranger could use. Lowest layer of ``engines``: the standard library and
``errors`` only.
"""

from __future__ import annotations

import hmac
import os
import secrets
import socket
import struct
import time
import weakref
from typing import Any

from mbridge_refit.errors import TransportError

__all__ = ["GoAheadError", "GoAheadLine", "GoAheadWaiter"]

_MESSAGE = struct.Struct("<QBd")  # step number, verdict (1 apply, 0 skip), the trainer's time.monotonic() at sending
_NAME_PREFIX = "\0mbridge-refit-go-"  # an abstract Unix name (the leading NUL), 64 random bits after it
_TOKEN_BYTES = 16
_TOKEN_WAIT_S = 0.2  # what a connection gets to send its token before the next one is taken
_SEND_S = 5.0  # a word the worker does not read (its apply failed before its wait) fills the buffer at last
_BACKLOG = 16
_LINES: weakref.WeakSet = weakref.WeakSet()  # the trainer's lines, closed in a forked child (below)


class GoAheadError(TransportError):
    """The go-ahead line failed: the other end closed, a wait timed out, or a message was malformed."""


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


class GoAheadLine:
    """Trainer side: a listening socket until the worker connected with the token, then its connection."""

    def __init__(self, listener: socket.socket, address: str, token: bytes) -> None:
        self._listener: socket.socket | None = listener
        self._connection: socket.socket | None = None
        self.address = address
        self._token = token

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
        """What the open RPC carries to the worker (plain data): where to connect, the token that proves
        it, and how long the worker waits for a go-ahead before it gives up."""
        return {"address": self.address.encode().hex(), "token": self._token.hex(), "timeout_s": float(timeout_s)}

    def accept(self, timeout_s: float) -> None:
        """Take the worker's connection: the first one that sends the token within ``timeout_s``
        (others are closed); then stop listening. Raises ``GoAheadError`` when none does."""
        if self._listener is None:
            raise GoAheadError("the go-ahead line is closed")
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise GoAheadError(f"no worker connected with the token within {timeout_s:.2g} s")
                self._listener.settimeout(left)
                try:
                    connection, _ = self._listener.accept()
                except TimeoutError:
                    continue
                try:
                    token = _receive_exactly(
                        connection, _TOKEN_BYTES, min(deadline, time.monotonic() + _TOKEN_WAIT_S), "a token"
                    )
                except GoAheadError:
                    connection.close()
                    continue
                if hmac.compare_digest(token, self._token):
                    connection.settimeout(_SEND_S)
                    self._connection = connection
                    return
                connection.close()
        finally:
            self._listener.close()
            self._listener = None

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
        self._forget()

    def _forget(self) -> None:
        for sock in (self._listener, self._connection):
            if sock is not None:
                sock.close()
        self._listener = self._connection = None


def _forget_lines_in_child() -> None:
    """A forked child (a data loader's worker) closes its copies of the trainer's lines: else a trainer that
    dies leaves its worker waiting until the child exits. Not shut down: the parent's line stays up."""
    for line in list(_LINES):
        line._forget()


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
        """Connect to the trainer's line and prove it with the offer's token (raises ``GoAheadError``
        where the line cannot be reached, e.g. another host or network namespace, or the offer is
        malformed)."""
        try:
            address = bytes.fromhex(offer["address"]).decode()
            token = bytes.fromhex(offer["token"])
            timeout_s = float(offer["timeout_s"])
        except (KeyError, TypeError, ValueError) as err:
            raise GoAheadError(f"malformed go-ahead offer {offer!r}: {err}") from err
        if not address.startswith(_NAME_PREFIX) or len(token) != _TOKEN_BYTES or not timeout_s > 0:
            raise GoAheadError(f"malformed go-ahead offer {offer!r}")
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.settimeout(5.0)
            connection.connect(address)
            connection.sendall(token)
        except OSError as err:
            connection.close()
            raise GoAheadError(f"cannot reach the trainer's go-ahead line: {err}") from err
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
