"""Two gloo ranks exchange their contributions to a plan (``plan.build.exchange_contributions``) with
rank 1 standing for another mbridge_refit: one that sends no version (the exchange before it carried
one: the contribution pickled and compressed, nothing before it), then one of the next
``PLAN_EXCHANGE_VERSION``. Every rank must raise ``PlanError`` naming the format, the ranks and both
versions, before it unpickles anything; then an agreeing exchange returns both contributions. Each rank
writes ``rank<N>.json`` into the directory its argument names (one file a rank: two ranks' prints can
share a line of torchrun's output)."""

from __future__ import annotations

import datetime
import json
import pickle
import sys
import zlib
from pathlib import Path

import torch.distributed as dist

from mbridge_refit.plan import build
from mbridge_refit.plan.entries import PlanError


def unversioned(mine) -> bytes:
    """What a rank sent before the exchange carried a version."""
    return zlib.compress(pickle.dumps(mine, protocol=pickle.HIGHEST_PROTOCOL), 1)


def refusal(mine) -> str:
    try:
        build.exchange_contributions(mine)
    except PlanError as err:
        return str(err)
    raise SystemExit(f"rank {dist.get_rank()}: the exchange was not refused")


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    rank = dist.get_rank()
    mine = build.RankContribution(specs=(), layer_map={}, errors=(f"rank {rank}'s own",))
    version, encode = build.PLAN_EXCHANGE_VERSION, build.encode_contribution
    messages = {}
    for case in ("none", "newer"):
        if rank == 1:  # another install on rank 1
            build.encode_contribution = unversioned if case == "none" else encode
            build.PLAN_EXCHANGE_VERSION = version + 1 if case == "newer" else version
        messages[case] = refusal(mine)
    build.encode_contribution, build.PLAN_EXCHANGE_VERSION = encode, version
    messages["agreed"] = [list(c.errors) for c in build.exchange_contributions(mine)]
    (Path(sys.argv[1]) / f"rank{rank}.json").write_text(json.dumps({"rank": rank, **messages}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
