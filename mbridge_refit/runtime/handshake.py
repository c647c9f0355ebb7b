"""The collective contract of an export, checked: every participating rank starts it, none leaves early.

An export is collective: each rank's gathers and pipeline broadcasts wait for its peers. A rank
that calls it alone, or that stops iterating while its peers go on, leaves the others blocked in
a gather until the process group's timeout (minutes), which then reports a raw gloo/NCCL error.

``CollectiveCall`` makes both mistakes loud within a bounded time, through the job's key-value
store (the default group's ``TCPStore``; no collective, no device work):

* ``arrive``: each participant adds its bit to the call's key; the last one to arrive sets the
  call's "everyone is here" key, which the others wait for. A rank still waiting after
  ``timeout_s`` raises ``CollectiveMisuseError`` naming the ranks that did not call.
* ``guard``: wraps the export's stream. A rank whose consumer stops early (closes the generator,
  e.g. ``break``) records that it left, then runs the rest of the export without yielding it,
  so its peers' collectives complete; every peer raises ``CollectiveMisuseError`` naming it when
  its own export ends. ``open`` says whether the guarded stream may still issue collectives (not
  iterated to its end, closed or garbage-collected); ``open_call``, the call of this process (of
  any bridge) whose stream is still open.
* ``arrive(refusal=...)``: a rank that must refuse the call (an export of this process is still
  ``open``: two exports in flight pair their collectives with the wrong partners) posts the
  refusal under the call's key and raises at once, waiting for no one and issuing no collective;
  every other participant raises the same ``CollectiveMisuseError`` when it arrives, or, if it is
  already waiting, as soon as the refusal is posted. The verdict is the call's, so ranks that see
  the overlap at different times (one closed its previous export before the call, another did
  not) still agree. The refusal adds a flag to the arrival counter, so no later arrival counts as
  the last one and says go, then writes its note as the call's verdict (the key the others wait
  for: "go" or the refusal), which every rank that waits reads once.

Versions. The calls' keys live under ``mbridge_refit/calls/v<CALLS_PROTOCOL>/``, so ranks of another
layout of them (another mbridge_refit) never take each other's keys for their own; a rank about to
wait also posts its ``CALLS_PROTOCOL`` under ``mbridge_refit/calls/protocol/<rank>`` (a key whose
layout stays as it is in every version). A rank whose wait runs out looks there for the ranks that
did not arrive, and at the keys an mbridge_refit from before the calls were versioned used: ranks
found speaking another version, or none, are named in ``errors.wire_version_mismatch``'s words
instead of as ranks that did not call.

One call costs each rank its arrival (one store round trip; a rank that waits for the last
arrival also the wait and the read of the verdict; the last arrival four more: the verdict and
the previous call's keys deleted) and the "left" check at the end; calls of a single participant
skip the store.
Calls are numbered per set of participants, so every participant must make the same calls in the
same order, as the contract says anyway (a refused call counts too). A generator that is abandoned
without being closed is noticed only while it is alive (``open``): one garbage-collected unstarted
runs nothing, and its peers wait in their gathers until the process group's timeout. So does one
the cycle collector frees (dropped while a reference cycle, e.g. an exception's traceback, held
it): the collector finalizes the export it wraps first, in no set order. Running its rest there
would be worse: the collector runs at a different point on each rank, where the rest's
collectives would pair with whatever the peers run then.
"""

from __future__ import annotations

import datetime
import inspect
import logging
import weakref
from typing import Any, Iterable, Iterator, Sequence

import torch.distributed as dist

from mbridge_refit.errors import UsageError, wire_version_mismatch

__all__ = ["CALLS_PROTOCOL", "CollectiveCall", "CollectiveMisuseError", "DEFAULT_TIMEOUT_S", "open_call"]

# The layout of the calls' keys and what their values mean (module docstring): bump it with any change.
CALLS_PROTOCOL = 1
_PROTOCOLS = "mbridge_refit/calls/protocol/"  # + a rank: the protocol its calls speak (never changes layout)
_UNVERSIONED = "mbridge_refit/calls/"  # + digest/number: where calls of an mbridge_refit before CALLS_PROTOCOL lived

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0
_CONTRACT = (
    "is collective: every rank of the model's groups must call it, with the same arguments, and iterate it to the end"
)
_MASK_BITS = 62  # participants identified by their bit of one integer key (store.add); more are only counted
_REFUSED = 1 << _MASK_BITS  # added to the arrival counter by a participant that refuses the call
_GO = b"1"  # the verdict of a call every participant made; a refused call's is the refusal's note


class CollectiveMisuseError(UsageError):
    """A rank broke the collective contract of an export (called it alone, left it early, or started
    one while its previous one was still open)."""


class CollectiveCall:
    """One collective operation (``what``, e.g. an export) among ``participants`` (global ranks).

    Calls are numbered per set of participants, process-wide: the k-th call on one rank meets
    the k-th call on every other participant, which is what the collective contract asks of a
    program anyway (collectives pair up in order).
    """

    def __init__(self, what: str, participants: Sequence[int], *, timeout_s: float | None) -> None:
        self.what = what
        self.participants = tuple(sorted(participants))
        self.timeout_s = timeout_s
        self._store = _default_store() if len(self.participants) > 1 and timeout_s is not None else None
        self._rank = dist.get_rank() if self._store is not None else 0
        self.number = _CALLS[self.participants] = _CALLS.get(self.participants, 0) + 1
        self._prefix = f"mbridge_refit/calls/v{CALLS_PROTOCOL}/{_digest(self.participants)}"
        self._stream: weakref.ref | None = None  # the generator ``guard`` handed out

    @property
    def open(self) -> bool:
        """Whether the stream ``guard`` handed out may still issue collectives: alive and neither
        iterated to its end nor closed (started or not). False for a call with nothing to check."""
        stream = self._stream() if self._stream is not None else None
        return stream is not None and inspect.getgeneratorstate(stream) != inspect.GEN_CLOSED

    def arrive(self, refusal: str | None = None) -> None:
        """Wait until every participant has made this call (bounded by ``timeout_s``). With
        ``refusal`` (why this rank cannot take part), post it and raise ``CollectiveMisuseError``
        at once; a participant that finds a refusal posted raises it too (module docstring)."""
        if self._store is None:
            return
        key = self._key(self.number)
        bit = _bit(self.participants.index(self._rank), len(self.participants))
        full = _full_mask(len(self.participants))
        if refusal is not None:
            note = f"rank {self._rank} refused it: {refusal}"
            self._store.add(f"{key}/arrived", bit | _REFUSED)  # before the verdict: no later arrival says go
            self._store.set(f"{key}/all", note.encode())  # the verdict, which wakes the participants waiting here
            raise self._refused(note)
        arrived = self._store.add(f"{key}/arrived", bit)
        if arrived == full:  # the last arrival, and nobody refused
            self._store.set(f"{key}/all", _GO)
            if self.number > 1:  # everyone has passed the previous call: its keys can go
                for suffix in ("arrived", "all", "left"):
                    self._store.delete_key(f"{self._key(self.number - 1)}/{suffix}")
            return
        self._store.set(f"{_PROTOCOLS}{self._rank}", str(CALLS_PROTOCOL))  # read by a peer whose wait ran out
        try:
            self._store.wait([f"{key}/all"], datetime.timedelta(seconds=self.timeout_s))
        except Exception as err:  # the store's timeout (DistStoreError / RuntimeError, by version)
            arrived = self._store.add(f"{key}/arrived", 0) & ~_REFUSED
            other_versions = self._other_versions(arrived)
            if other_versions:
                raise CollectiveMisuseError(f"{self.what}: {other_versions}") from err
            raise CollectiveMisuseError(
                f"{self.what} {_CONTRACT}. Rank {self._rank} waited {self.timeout_s:g} s (call #{self.number} among "
                f"ranks {list(self.participants)}) for {_missing(arrived, self.participants)}: call it on every rank "
                "(a rank with nothing to keep iterates it into a DiscardSink)"
            ) from err
        verdict = self._store.get(f"{key}/all")
        if verdict != _GO:
            raise self._refused(verdict.decode())

    def guard(self, stream: Iterable[Any], *, issues_collectives: bool = True) -> Iterable[Any]:
        """``stream`` (this call's), with an early stop on this rank made loud on every rank (module
        docstring). ``issues_collectives=False``: this rank's stream has no collective to pair (a rank
        with no part in a replica's export), so it is never ``open``, iterated or not."""
        if self._store is None:
            return stream
        guarded = self._guarded(iter(stream), self._key(self.number))
        if issues_collectives:
            global _last_guarded
            self._stream = weakref.ref(guarded)
            _last_guarded = self
        return guarded

    def _other_versions(self, arrived: int) -> str | None:
        """Why the ranks that did not arrive at this call (``arrived``: the mask of those that did) are not
        here, where their keys say they speak another ``CALLS_PROTOCOL`` or none; else None."""
        if len(self.participants) > _MASK_BITS:
            return None
        missing = [rank for index, rank in enumerate(self.participants) if not arrived >> index & 1]
        by_version: dict[Any, list[int]] = {}
        for rank in missing:
            key = f"{_PROTOCOLS}{rank}"
            version = self._store.get(key).decode() if self._store.check([key]) else None
            if version is not None and version != str(CALLS_PROTOCOL):
                by_version.setdefault(int(version) if version.isdigit() else version, []).append(rank)
        unversioned = f"{_UNVERSIONED}{_digest(self.participants)}/{self.number}/arrived"
        if self._store.check([unversioned]):
            old = self._store.add(unversioned, 0)
            ranks = [rank for index, rank in enumerate(self.participants) if old >> index & 1 and rank in missing]
            if ranks:
                by_version[None] = ranks
        if not by_version:
            return None
        return "; ".join(
            wire_version_mismatch("collective call", CALLS_PROTOCOL, version, f"rank(s) {ranks}")
            for version, ranks in by_version.items()
        )

    def _refused(self, note: str) -> CollectiveMisuseError:
        return CollectiveMisuseError(
            f"{self.what} {_CONTRACT}: call #{self.number} among ranks {list(self.participants)} is refused on every "
            f"rank, before any collective: {note}"
        )

    def _guarded(self, items: Iterator[Any], key: str) -> Iterator[Any]:
        count = 0
        try:
            for item in items:
                count += 1
                yield item
        except GeneratorExit:
            self._leave_early(key, items, count)
            raise
        if self._store.check([f"{key}/left"]):
            note = self._store.get(f"{key}/left").decode()
            raise CollectiveMisuseError(f"{self.what} {_CONTRACT}: {note}; this rank's export completed")

    def _leave_early(self, key: str, items: Iterator[Any], count: int) -> None:
        """Record that this rank left, then run the rest of the export so its peers' collectives complete.

        Also reached when the consumer failed (its exception closes the stream): then the job may
        already be broken (a dead peer, a destroyed process group). Nothing here may replace the
        consumer's own error, so a failure to record or to finish is logged, not raised."""
        note = f"rank {self._rank} stopped iterating after {count} item(s) it was given (call #{self.number})"
        try:
            self._store.set(f"{key}/left", note.encode())
            if not dist.is_initialized():
                return
            logger.error(
                "%s %s: %s; running the rest of it so the other ranks' collectives complete", self.what, _CONTRACT, note
            )
            for _ in items:
                pass
        except Exception as err:  # the job is already failing: its peers fail on their own
            logger.warning(
                "%s: rank %d could not finish it for its peers after leaving early (%s: %s)",
                self.what,
                self._rank,
                type(err).__name__,
                err,
            )

    def _key(self, number: int) -> str:
        return f"{self._prefix}/{number}"


_CALLS: dict[tuple[int, ...], int] = {}
_last_guarded: CollectiveCall | None = None  # the last call whose stream ``guard`` handed out, in this process


def open_call() -> CollectiveCall | None:
    """The collective call of this process (any bridge's) whose stream is still open, or None:
    a collective export started while it is open pairs its collectives with the wrong partners."""
    last = _last_guarded
    return last if last is not None and last.open else None


def _digest(participants: tuple[int, ...]) -> str:
    import hashlib

    return hashlib.sha1(",".join(map(str, participants)).encode()).hexdigest()[:16]


def _default_store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # no default group, or a backend without a store: nothing to check with
        logger.debug("no default store: collective calls are not checked")
        return None


def _bit(index: int, count: int) -> int:
    return 1 << index if count <= _MASK_BITS else 1


def _full_mask(count: int) -> int:
    return (1 << count) - 1 if count <= _MASK_BITS else count


def _missing(arrived: int, participants: tuple[int, ...]) -> str:
    if len(participants) > _MASK_BITS:
        return f"{len(participants) - arrived} of {len(participants)} ranks"
    missing = [rank for index, rank in enumerate(participants) if not arrived >> index & 1]
    return f"rank(s) {missing}"
