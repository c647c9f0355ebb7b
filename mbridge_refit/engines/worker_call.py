"""A call to an engine's workers on a thread of its own: ``WorkerCall`` (and ``on_a_thread``, the
``StartWorkers`` made from a session's ``CallWorkers``).

Two sessions start an RPC and go on while it runs: the broadcast's source rank sends the buckets
its workers' receive RPC takes (``engines.broadcast.trainer``), and the colocated session exports
while its early apply RPC travels to the worker, which then waits for its go-ahead
(``engines.ipc.trainer``, ``engines.ipc.go_ahead``). ``Thread.start`` returns once the thread runs, and
the RPC's own host work is short, so the request leaves before the starting thread's next long
stretch of Python. Lower layer of ``engines``: imports ``engines.base`` only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

from mbridge_refit.engines.base import CallWorkers

__all__ = ["StartWorkers", "WorkerCall", "WorkerCallHandle", "on_a_thread"]


class WorkerCallHandle(Protocol):
    """A call to the engine's workers running in the background (what ``start_workers`` returns)."""

    def failure(self) -> str | None: ...

    def error(self, timeout_s: float) -> BaseException | None: ...

    def result(self, timeout_s: float) -> Any: ...


# (RPC name, *arguments) -> the call, started: the workers' side of a collective this rank joins
StartWorkers = Callable[..., WorkerCallHandle]


class WorkerCall:
    """``call()`` (a call to the engine's workers, or another engine call) on a thread of its own: the
    workers' side of a collective this thread takes part in at the same time. A ``WorkerCallHandle``;
    ``what`` names the call in its messages."""

    def __init__(self, call: Callable[[], Any], name: str = "rpc", what: str = "the engine's workers' RPC") -> None:
        self._result: Any = None
        self._error: BaseException | None = None
        self.what = what
        self._thread = threading.Thread(target=self._run, args=(call,), name=name, daemon=True)
        self._thread.start()

    def _run(self, call: Callable[[], Any]) -> None:
        try:
            self._result = call()
        except BaseException as err:  # re-raised in the caller's thread
            self._error = err

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def failure(self) -> str | None:
        """The call's error as text once it ended with one; None while it runs or after it returned."""
        if self._thread.is_alive() or self._error is None:
            return None
        return f"{self.what} ended with {type(self._error).__name__}: {self._error}"

    def error(self, timeout_s: float) -> BaseException | None:
        """Wait for the call; its error, or None."""
        try:
            self.result(timeout_s)
        except Exception as err:
            return err
        return None

    def result(self, timeout_s: float) -> Any:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"{self.what} did not answer within {timeout_s:.0f} s")
        if self._error is not None:
            raise self._error
        return self._result


def on_a_thread(call_workers: CallWorkers) -> StartWorkers:
    """``start_workers`` from ``call_workers``: each call on a thread of its own (``WorkerCall``)."""

    def start_workers(method: str, *args: Any) -> WorkerCall:
        return WorkerCall(lambda: call_workers(method, *args), name=f"rpc-{method}")

    return start_workers
