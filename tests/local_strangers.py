"""Another local process on a go-ahead line (``engines.ipc.go_ahead``), for its tests: a child forked before the
line exists (another pid; with ``uid``, another user too), told where to connect and what to send, that
then says what became of each of its connections.

What a connection's end tells of the trainer's side (Linux ``AF_UNIX`` streams): a close with the
stranger's bytes unread resets the stranger's next read (``ECONNRESET``), a close before it could send
breaks its send (``EPIPE``): both ``"unread"``; a close after reading them is an end of file
(``"read"``); a connection kept open times out (``"kept"``), or hears words (``"heard"``).
"""

from __future__ import annotations

import json
import os
import socket
import time
import warnings

_CONNECT_S = 0.5  # the stranger's connect: a queue that stays full makes it give up


class Stranger:
    """A forked child that connects to a line when told (``connect`` or ``flood``), then reports."""

    def __init__(self, uid: int | None = None) -> None:
        to_child, self._to_child = os.pipe()
        self._from_child, from_parent = os.pipe()
        with warnings.catch_warnings():  # its child runs only the socket calls below, then exits
            warnings.simplefilter("ignore", DeprecationWarning)
            self.pid = os.fork()
        if self.pid == 0:
            os.close(self._to_child)
            os.close(self._from_child)
            _child(to_child, from_parent, uid)
        os.close(to_child)
        os.close(from_parent)
        self._replies = os.fdopen(self._from_child, "r")

    def connect(self, address: str, hellos: list[bytes | None]) -> int:
        """Connect once per entry of ``hellos`` (in order, each held open), sending it (None: nothing, a
        silent connection); the number of connections the line's queue took."""
        self._tell({"address": address.encode().hex(), "hellos": [None if h is None else h.hex() for h in hellos]})
        return self._reply()["connected"]

    def outcomes(self) -> list[str]:
        """What became of each connection (module docstring); the child then exits."""
        self._tell({"report": True})
        return self._reply()["outcomes"]

    def flood(self, address: str, seconds: float, held: int) -> None:
        """Open silent connections as fast as the line takes them for ``seconds``, ``held`` open at most
        (the oldest closed first); ``flooded`` says how many, after."""
        self._tell({"address": address.encode().hex(), "flood_s": seconds, "held": held})

    def flooded(self) -> dict[str, int]:
        return self._reply()

    def close(self) -> None:
        try:
            os.kill(self.pid, 9)
        except ProcessLookupError:
            pass
        os.waitpid(self.pid, 0)
        os.close(self._to_child)
        self._replies.close()

    def _tell(self, job: dict) -> None:
        os.write(self._to_child, (json.dumps(job) + "\n").encode())

    def _reply(self) -> dict:
        line = self._replies.readline()
        if not line:
            raise RuntimeError(f"the stranger (pid {self.pid}) ended without a reply")
        return json.loads(line)


def _child(jobs_fd: int, replies_fd: int, uid: int | None) -> None:
    try:
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        jobs = os.fdopen(jobs_fd, "r")
        job = json.loads(jobs.readline())
        address = bytes.fromhex(job["address"]).decode()
        if "flood_s" in job:
            os.write(replies_fd, (json.dumps(_flood(address, job["flood_s"], job["held"])) + "\n").encode())
            os._exit(0)
        held = []
        for hello in job["hellos"]:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(_CONNECT_S)
            try:
                sock.connect(address)
            except OSError:
                sock.close()
                continue
            outcome = None
            if hello is not None:
                try:
                    sock.sendall(bytes.fromhex(hello))
                except (BrokenPipeError, ConnectionResetError):
                    outcome = "unread"
            held.append((sock, outcome))
        os.write(replies_fd, (json.dumps({"connected": len(held)}) + "\n").encode())
        jobs.readline()
        outcomes = [outcome or _outcome(sock) for sock, outcome in held]
        os.write(replies_fd, (json.dumps({"outcomes": outcomes}) + "\n").encode())
    finally:
        os._exit(0)


def _outcome(sock: socket.socket) -> str:
    sock.settimeout(0.5)
    try:
        data = sock.recv(64)
    except ConnectionResetError:
        return "unread"
    except TimeoutError:
        return "kept"
    return "heard" if data else "read"


def _flood(address: str, seconds: float, held: int) -> dict[str, int]:
    """Silent connections, as many as the line takes, for ``seconds``."""
    opened, failed, socks = 0, 0, []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(_CONNECT_S)
        try:
            sock.connect(address)
        except OSError:
            sock.close()
            failed += 1
            continue
        opened += 1
        socks.append(sock)
        if len(socks) > held:
            socks.pop(0).close()
    return {"opened": opened, "failed": failed}
