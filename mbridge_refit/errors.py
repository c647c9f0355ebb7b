"""The errors mbridge_refit raises on purpose: one root, four kinds.

Every error class of the package derives from one of these (``tests/test_package.py`` checks it),
so a caller catches by kind and the command line maps kinds to exit codes
(``convert.exit_codes``) without listing classes:

* ``InputError`` (also a ``ValueError``): a model, layout, file, option or argument the library
  cannot work with; the message names it and the fix. ``convert`` exits 2.
* ``UsageError``: the caller broke an API contract (a collective called on one rank, a yielded
  tensor used after its lifetime).
* ``TransportError``: moving weights between ranks or processes failed (the two sides disagree on
  the plan, a checksum differs, a peer failed).
* ``EngineError``: an inference engine could not take the weights it was sent.

Two sides that speak a wire format (a stream, a handshake, a payload, store entries) check its
version and refuse another one with ``wire_version_mismatch``'s words: the format, both versions, and
the fix (the same mbridge_refit on both sides).

Anything else that escapes is a bug of ours (``convert`` exits 3 with the traceback), or the
machine's (an ``OSError`` naming an errno: exit 4). Lowest layer: imports nothing.
"""

from __future__ import annotations

__all__ = ["EngineError", "InputError", "RefitError", "TransportError", "UsageError", "wire_version_mismatch"]


class RefitError(Exception):
    """The root of every error mbridge_refit raises on purpose."""


class InputError(RefitError, ValueError):
    """An input the library cannot work with (a model, layout, file, option); the message names the fix."""


class UsageError(RefitError, RuntimeError):
    """The caller broke an API contract; the message names the contract."""


class TransportError(RefitError, RuntimeError):
    """Moving weights between ranks or processes failed; raised on every side that can know."""


class EngineError(RefitError, RuntimeError):
    """An inference engine could not take the weights it was sent."""


def wire_version_mismatch(wire_format: str, mine: object, theirs: object, peer: str) -> str:
    """The refusal of a peer that speaks another version of ``wire_format`` (``theirs``; None: a peer
    from before the format carried a version)."""
    theirs = "none (an mbridge_refit from before it was versioned)" if theirs is None else theirs
    return (
        f"{wire_format} wire version mismatch: this side speaks version {mine}, {peer} version {theirs}. Run the "
        "same mbridge_refit version on the trainer and the engine (every process of the refit)"
    )
