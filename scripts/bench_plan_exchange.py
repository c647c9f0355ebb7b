"""Where the plan's contribution exchange spends its time, phase by phase, in one set of processes.

``scripts/simulate_plan.py`` times ``plan.exchange_contributions`` over WORLD fresh gloo processes,
one exchange each: the first collective of a new group. This script takes the contributions that
run left in its ``--work`` directory (``rank<R>.pkl``) and, in WORLD gloo processes on this host,
times each phase separately: the group's creation and first barrier, then ``--rounds`` times in
the same processes (a job's group is warm after its first collective) a one-integer object
all-gather, the library's exchange split into encoding, the all-gather of the encoded bytes and the
decoding of every rank's, and the uncompressed object all-gather of the contributions as they are.
Each phase's figure is the slowest rank's; every round is kept.

    python scripts/simulate_plan.py --model deepseek-v3 --tp 1 --pp 4 --ep 8 --first-stage-layers 16 \\
        --last-stage-layers 15 --work /tmp/dsv3
    python scripts/bench_plan_exchange.py --work /tmp/dsv3 --rounds 3
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import socket
import statistics
import tempfile
import time
from pathlib import Path

from provenance import results_dir, write_result

PHASES = ("tiny_s", "encode_s", "gather_s", "decode_s", "exchange_s", "uncompressed_s")


def _phase_times(rank: int, world: int, work: Path, port: int, rounds: int, result: Path) -> None:
    """One process of the exchange: its phases' times, gathered to rank 0, which writes them."""
    import torch.distributed as dist

    from mbridge_refit.plan.build import decode_contribution, encode_contribution

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    start = time.perf_counter()
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=10))
    init_s = time.perf_counter() - start
    contribution = pickle.loads((work / f"rank{rank}.pkl").read_bytes())
    start = time.perf_counter()
    dist.barrier()
    times = {"init_s": init_s, "first_barrier_s": time.perf_counter() - start, "rounds": []}
    for _ in range(rounds):
        phases = {}
        dist.barrier()
        start = time.perf_counter()
        dist.all_gather_object([None] * world, rank)
        phases["tiny_s"] = time.perf_counter() - start
        dist.barrier()
        start = time.perf_counter()
        mine = encode_contribution(contribution)
        phases["encode_s"] = time.perf_counter() - start
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        phases["gather_s"] = time.perf_counter() - start - phases["encode_s"]
        mid = time.perf_counter()
        [decode_contribution(each) for each in gathered]
        phases["decode_s"] = time.perf_counter() - mid
        phases["exchange_s"] = time.perf_counter() - start
        dist.barrier()
        start = time.perf_counter()
        dist.all_gather_object([None] * world, contribution)
        phases["uncompressed_s"] = time.perf_counter() - start
        times["rounds"].append(phases)
    everyone = [None] * world
    dist.all_gather_object(everyone, times)
    if rank == 0:
        result.write_text(json.dumps(everyone))
    dist.destroy_process_group()


def slowest(per_rank: list[dict]) -> dict:
    """The slowest rank's time of each phase, per round, and the median over rounds."""
    rounds = len(per_rank[0]["rounds"])
    by_round = [{phase: max(r["rounds"][i][phase] for r in per_rank) for phase in PHASES} for i in range(rounds)]
    return {
        "init_s": max(r["init_s"] for r in per_rank),
        "first_barrier_s": max(r["first_barrier_s"] for r in per_rank),
        "rounds": by_round,
        "median": {phase: statistics.median(r[phase] for r in by_round) for phase in PHASES},
    }


def hostname_lookup_s() -> float:
    """How long resolving this host's own name takes (a slow resolver shows up in gloo's setup)."""
    start = time.perf_counter()
    try:
        socket.getaddrinfo(socket.gethostname(), None)
    except OSError:
        pass
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="simulate_plan.py's --work directory (rank<R>.pkl)")
    parser.add_argument("--rounds", type=int, default=3, help="exchanges in the same processes (default: %(default)s)")
    parser.add_argument("--label", default="", help="a name for the contributions in the result (e.g. the model)")
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/<date>-cpu/")
    args = parser.parse_args()
    import torch.multiprocessing as mp
    from torch.distributed.elastic.utils.distributed import get_free_port

    world = len(list(args.work.glob("rank*.pkl")))
    if not world or not all((args.work / f"rank{r}.pkl").is_file() for r in range(world)):
        raise SystemExit(f"{args.work}: expected rank0.pkl .. rank{world - 1}.pkl from simulate_plan.py --work")
    os.environ.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    port = get_free_port()
    with tempfile.TemporaryDirectory() as scratch:
        result = Path(scratch, "times.json")
        mp.spawn(_phase_times, args=(world, args.work, port, args.rounds, result), nprocs=world, join=True)
        per_rank = json.loads(result.read_text())
    row = {
        "label": args.label,
        "world_size": world,
        "cpu_cores": os.cpu_count(),
        "contribution_bytes": sum((args.work / f"rank{r}.pkl").stat().st_size for r in range(world)),
        "hostname_lookup_s": hostname_lookup_s(),
        **slowest(per_rank),
        "date": datetime.date.today().isoformat(),
    }
    print(json.dumps({k: v for k, v in row.items() if k != "rounds"}, indent=1), flush=True)
    name = f"plan_exchange_{args.label or 'contributions'}_{world}ranks.json"
    path = write_result(args.out or results_dir("cpu"), name, row, device=f"CPU ({os.cpu_count()} cores)")
    print(f"[bench_plan_exchange] {path}", flush=True)


if __name__ == "__main__":
    main()
