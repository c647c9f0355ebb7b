"""Entries of a ``TCPStore`` that only the holders of a shared secret can write: an HMAC on each.

A ``TCPStore`` has no authentication: whoever reaches its address reads, writes and deletes any
key. The members of a ``engines.broadcast.group.StoreGroup`` coordinate through one (their settings,
their heartbeats, their failures), so each entry they write is signed and each entry they read is
checked: ``SignedEntries.put`` writes ``{"protocol", "member", "body", "mac"}`` as JSON, the MAC an
HMAC-SHA256 under the group's secret over the protocol, the entry's full key, the writing member and
the body; ``SignedEntries.read`` returns the body of a valid entry of the member the caller expects
there, and None for an absent entry or one that fails the check (logged once per key and counted in
``rejected``, by key: a process that does not hold the secret wrote it). An entry moved to another key or
claiming another member does not verify; the secret is per group, so entries of another group (or
an earlier one at the same address) do not verify either.

What the secret does not give: secrecy (bodies are readable by anyone who reaches the store; put
nothing there a stranger must not read), or availability (a stranger can still delete or overwrite
entries, and the reader then sees them absent: its own timeouts must make that loud).

``STORE_PROTOCOL`` versions the entries' layout and what their bodies mean. The envelope and its MAC
stay as they are in every protocol, so an entry of another protocol that verifies is a member of
the group running another mbridge_refit, refused by name (``StoreProtocolError``), while one that
does not verify is a stranger's, ignored like any other.

The secret never enters the store. Takes any store with torch's ``set`` and ``compare_set``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
from typing import Any

from mbridge_refit.errors import TransportError, wire_version_mismatch

__all__ = [
    "SECRET_BYTES",
    "STORE_PROTOCOL",
    "SignedEntries",
    "StoreProtocolError",
    "check_secret",
    "new_secret",
    "read_now",
]

logger = logging.getLogger(__name__)

# 3: signed entries, one failure entry per member, the settings as a keyed digest (2: plain JSON
# settings, failures under a shared counter; 1: before the settings carried the protocol).
STORE_PROTOCOL = 3
SECRET_BYTES = 32
_ABSENT = "\x00mbridge_refit/absent"  # what read_now returns for a key that is not there (no entry is this)


class StoreProtocolError(TransportError):
    """A member of the group writes its store entries in another protocol (another mbridge_refit)."""


def new_secret() -> bytes:
    """A fresh secret for one group: ``SECRET_BYTES`` random bytes (``secrets.token_bytes``)."""
    return secrets.token_bytes(SECRET_BYTES)


def check_secret(secret: Any) -> bytes:
    """``secret`` as bytes, or ``ValueError`` naming the fix (at least ``SECRET_BYTES`` bytes)."""
    if not isinstance(secret, (bytes, bytearray)) or len(secret) < SECRET_BYTES:
        shown = f"{len(secret)} bytes" if isinstance(secret, (bytes, bytearray)) else type(secret).__name__
        raise ValueError(
            f"a group's secret must be at least {SECRET_BYTES} random bytes, got {shown}: make one with "
            "engines.broadcast.store_entries.new_secret() on one member and hand it to the others out of band (never "
            "through the store)"
        )
    return bytes(secret)


def read_now(store: Any, key: str) -> bytes | None:
    """The value at ``key``, or None when there is none, in one round trip and without waiting
    (``get`` waits for a missing key up to the store's timeout). ``compare_set`` with an expected
    value no entry holds returns the current value, or that expected value when the key is absent,
    and writes nothing either way."""
    value = store.compare_set(key, _ABSENT, _ABSENT)
    return None if value == _ABSENT.encode() else value


class SignedEntries:
    """Signed entries under ``prefix`` of a store, written and read by the members ``0..members-1``
    (module docstring). ``protocol``: the protocol this member writes (``STORE_PROTOCOL``; a test
    passes another to stand for another install)."""

    def __init__(self, secret: bytes, prefix: str, members: int, *, protocol: int = STORE_PROTOCOL) -> None:
        self._secret = check_secret(secret)
        self.prefix, self.members, self.protocol = prefix, members, protocol
        self._warned: set[str] = set()  # the keys whose entries failed the check

    @property
    def rejected(self) -> int:
        """How many keys held an entry that failed the check (a stranger's)."""
        return len(self._warned)

    def digest(self, text: str) -> str:
        """HMAC-SHA256 of ``text`` under the secret, hex: equal texts give equal digests, and a stranger
        without the secret can neither compute one nor test a guess of ``text`` against it."""
        return hmac.new(self._secret, b"digest\n" + text.encode(), hashlib.sha256).hexdigest()

    def put(self, store: Any, name: str, member: int, body: str) -> None:
        """Write ``body`` as ``member``'s entry ``name`` (the key ``prefix + name``)."""
        key = self.prefix + name
        entry = {"protocol": self.protocol, "member": member, "body": body}
        entry["mac"] = self._mac(key, self.protocol, member, body)
        store.set(key, json.dumps(entry))

    def read(self, store: Any, name: str, member: int) -> str | None:
        """The body of ``member``'s valid entry ``name``, or None (absent, or not valid: logged once per
        key and counted). Raises ``StoreProtocolError`` for a valid entry of another protocol. A
        member outside ``0..members-1`` is never read: its entries are nobody's."""
        if not 0 <= member < self.members:
            raise ValueError(f"member {member} is not one of the group's {self.members}")
        key = self.prefix + name
        value = read_now(store, key)
        if value is None:
            return None
        entry = _parsed(value)
        if entry is None or entry["member"] != member:
            return self._rejected(key, "it is not a signed entry of this member")
        if not hmac.compare_digest(
            entry["mac"].encode(), self._mac(key, entry["protocol"], member, entry["body"]).encode()
        ):
            return self._rejected(key, "its MAC does not verify under the group's secret")
        if entry["protocol"] != self.protocol:
            raise StoreProtocolError(
                wire_version_mismatch(
                    "broadcast group store", self.protocol, entry["protocol"], f"member {member} of the group"
                )
            )
        return entry["body"]

    def _mac(self, key: str, protocol: Any, member: int, body: str) -> str:
        message = json.dumps([protocol, key, member, body]).encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def _rejected(self, key: str, why: str) -> None:  # read's None
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(
                "ignoring the store entry %s: %s (a process that does not hold the group's secret wrote it)", key, why
            )
        return None


def _parsed(value: bytes) -> dict[str, Any] | None:
    """The envelope's fields with their types checked, or None."""
    try:
        entry = json.loads(value)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(entry, dict) or set(entry) != {"protocol", "member", "body", "mac"}:
        return None
    if type(entry["protocol"]) is not int or type(entry["member"]) is not int:
        return None
    if not isinstance(entry["body"], str) or not isinstance(entry["mac"], str):
        return None
    return entry
