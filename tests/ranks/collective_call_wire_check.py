"""Two gloo ranks make a ``runtime.handshake.CollectiveCall`` with rank 1 standing for another mbridge_refit:
one of the next ``CALLS_PROTOCOL``, then one from before the calls' keys were versioned (its keys where they
were, no protocol posted). Every rank of a version must raise ``CollectiveMisuseError`` naming the other's
version and ranks once its wait runs out (before, both ranks waited in keys the other never wrote and named
their peer as a rank that did not call); then agreeing ranks' call goes through. Each rank writes
``rank<N>.json`` into the directory its argument names (one file a rank: two ranks' prints can share a line
of torchrun's output)."""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch.distributed as dist

from mbridge_refit.runtime import handshake

TIMEOUT_S = 2.0


def arrival(call: handshake.CollectiveCall) -> str:
    try:
        call.arrive()
    except handshake.CollectiveMisuseError as err:
        return str(err)
    return "arrived"


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    version, messages = handshake.CALLS_PROTOCOL, {}
    for case in ("newer", "none"):
        if rank == 1:  # another install on rank 1
            handshake.CALLS_PROTOCOL = version + 1 if case == "newer" else version
        call = handshake.CollectiveCall("the export", [0, 1], timeout_s=TIMEOUT_S)
        if rank == 1 and case == "none":  # where an unversioned install kept its keys; it posts no protocol
            call._prefix = handshake._UNVERSIONED + handshake._digest(call.participants)
            call._store = _WithoutProtocolPosts(call._store)
            call._store.delete_key(f"{handshake._PROTOCOLS}{rank}")  # what the newer install posted
        messages[case] = arrival(call)
        dist.barrier()
    handshake.CALLS_PROTOCOL = version
    messages["agreed"] = arrival(handshake.CollectiveCall("the export", [0, 1], timeout_s=30.0))
    (Path(sys.argv[1]) / f"rank{rank}.json").write_text(json.dumps({"rank": rank, **messages}))
    dist.destroy_process_group()


class _WithoutProtocolPosts:
    """The job's store, but a rank's post of its calls' protocol is dropped (an install from before it)."""

    def __init__(self, store) -> None:
        self._store = store

    def set(self, key: str, value) -> None:
        if not key.startswith(handshake._PROTOCOLS):
            self._store.set(key, value)

    def __getattr__(self, name: str):
        return getattr(self._store, name)


if __name__ == "__main__":
    main()
