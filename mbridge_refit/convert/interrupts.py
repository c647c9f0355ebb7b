"""How a signal stops a command: SIGINT (Ctrl-C) and SIGTERM interrupt it where it stands, and it ends
with one line and 128 + the signal's number (``exit_codes``: 130, 143), never as an internal error.

``signals_interrupt`` (around everything ``app.main`` does) and ``interrupt_from_now`` (from the first
line of ``__main__``, so the seconds of importing torch are covered too) make both signals raise ``KeyboardInterrupt``
in the main thread, its argument the signal (``interrupted_by``: Python's own SIGINT handler raises
one without), never an ``Exception``, which the package's ``except Exception`` clauses would catch. What the command had staged is then removed as for any
failure, and the output keeps its old checkpoint, or the new one where the swap was done
(``checkpoints.publish``); ``app.classify`` turns the interrupt into its code. A signal that was
ignored when the process started (``nohup``, SIGINT in a shell's background job) stays ignored.

``exit_on_signal`` is what ``__main__`` leaves in place once the command has ended: a signal in the
interpreter's last moments (its clean-up of torch and of threads) ends the process at once with the
same code and a line saying how the command had ended, not with a traceback or a death by the signal.

Imports nothing heavy: ``__main__`` loads it before torch.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Iterator

from mbridge_refit.convert.exit_codes import signal_exit_code

__all__ = [
    "INTERRUPTING_SIGNALS",
    "exit_on_signal",
    "interrupt_from_now",
    "interrupt_signal",
    "interrupted_by",
    "signals_interrupt",
]

INTERRUPTING_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def interrupted_by(signum: int) -> KeyboardInterrupt:
    """The interrupt the signal ``signum`` raises (``interrupt_signal`` reads it back)."""
    return KeyboardInterrupt(signal.Signals(signum))


def interrupt_signal(err: KeyboardInterrupt) -> int:
    """The signal that raised ``err``: its own (``interrupted_by``), SIGINT for Python's plain one."""
    named = err.args[0] if err.args else None
    return named if isinstance(named, signal.Signals) else signal.SIGINT


def interrupt_from_now() -> dict[int, object]:
    """From now on SIGINT and SIGTERM raise ``interrupted_by(signum)`` in the main thread (elsewhere nothing
    changes: signals go to the main thread); returns the handlers replaced, by signal."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def interrupt(signum: int, frame: object) -> None:
        raise interrupted_by(signum)

    return {
        signum: signal.signal(signum, interrupt)
        for signum in INTERRUPTING_SIGNALS
        if signal.getsignal(signum) is not signal.SIG_IGN
    }


@contextlib.contextmanager
def signals_interrupt() -> Iterator[None]:
    """``interrupt_from_now`` for the block; the handlers before it are restored after."""
    previous = interrupt_from_now()
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def exit_on_signal(code: int) -> None:
    """From now on SIGINT and SIGTERM end this process at once, with 128 + the signal's number and a
    line saying the command had ended with ``code`` (main thread only; ignored signals stay ignored)."""
    if threading.current_thread() is not threading.main_thread():
        return

    def leave(signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.write(f"interrupted by {name} while exiting: the command had ended with exit code {code}\n")
            sys.stderr.flush()
        os._exit(signal_exit_code(signum))

    for signum in INTERRUPTING_SIGNALS:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, leave)
