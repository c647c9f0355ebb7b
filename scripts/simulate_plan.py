"""Simulate the export plan of a layout too large for this machine (e.g. TP4 x PP4 x EP8, 32 ranks).

A real 32-rank job needs 32 processes of ~1 GiB each (torch + Megatron imports); this machine
has 24 GiB. So each part of ``build_export_plan`` is run honestly, rank by rank, and timed:

1. ``names``: one process builds the full model (TP1) on the meta device and writes the global
   parameter names (what Megatron-Bridge exchanges over the pipeline group) and the TP1 plan's
   (name, shape, dtype) list, the reference for step 4.
2. ``rank``: one process per simulated rank R: a fake process group (``torch.distributed``'s
   "fake" backend: rank R of WORLD, collectives are no-ops) and Megatron's real parallel state
   for the layout; it builds rank R's shard of the model on the meta device and runs
   ``plan.rank_contribution`` (the bridge's conversion tasks + this rank's parameter specs).
   The bridge's pipeline name exchange is the one thing a fake group cannot do: its result
   (step 1's names) is handed to the bridge through its own cache attribute. Writes the
   contribution (pickled) and the time and peak RSS.
3. ``exchange``: WORLD real processes (gloo) each exchange its own step-2 contribution with
   ``plan.exchange_contributions``, as ``build_export_plan`` does (compressed, one object
   all-gather, every contribution unpickled); timed.
4. ``assemble``: ``plan.assemble_plan`` over the 32 contributions, timed, and checked: the
   plan's (name, shape, dtype) entries must be the TP1 plan's (as a set: with EP > 1 the export,
   like stock Megatron-Bridge's, yields the experts of one local index across EP ranks together,
   so the order differs from TP1's; the tests check the order against stock export at EP2).
   Then, for each rank, what its export of that plan yields, copies on its device and receives in
   gathers and pipeline broadcasts (``runtime.rank_traffic``, from the rank's place in its groups
   and the parameters it holds, recorded in step 2).

Per-rank plan time = max over ranks of step 2 + step 3 + step 4. The timings are appended to
``--out`` (plan_scale.jsonl); the per-rank traffic, with the timings, is written to
``rank_traffic_<model>_<layout>.json`` with its manifest (``scripts/estimate_refit.py`` turns it
into time estimates).

    python scripts/simulate_plan.py --model qwen3-235b-a22b --tp 4 --pp 4 --ep 8 --first-stage-layers 23 --last-stage-layers 23
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench_plan import (  # the sibling benchmark (scripts/ is on sys.path)
    append_jsonl,
    peak_rss_gib,
)
from provenance import results_dir, write_result

REPO = Path(__file__).resolve().parents[1]
DEVICE = f"CPU ({os.cpu_count()} cores)"


def layout_of(args):
    from mbridge_refit.plan.layout import ParallelLayout

    return ParallelLayout(
        tp=args.tp,
        pp=args.pp,
        ep=args.ep,
        first_stage_layers=args.first_stage_layers,
        last_stage_layers=args.last_stage_layers,
    )


def meta_model(model: str, layout):
    from mbridge_refit.models.recipes import full_size_config
    from mbridge_refit.testing.simulated_ranks import build_rank_model

    return build_rank_model(full_size_config(model), layout, materialize=False)


def step_names(args) -> None:
    """Step 1: global parameter names and the TP1 reference plan."""
    from mbridge_refit.plan.layout import ParallelLayout
    from mbridge_refit.testing.simulated_ranks import enter_rank, global_param_names

    enter_rank(ParallelLayout(), 0)
    bridge, chunks = meta_model(args.model, ParallelLayout())
    names = global_param_names(bridge, chunks)
    plan = bridge.export_plan(chunks)
    reference = [(e.hf_name, list(e.shape), e.dtype) for e in plan.entries]
    (args.work / "names.json").write_text(json.dumps({"names": names, "reference": reference}))


def step_rank(args) -> None:
    """Step 2: one simulated rank's contribution, its place in its groups and the parameters it holds."""
    from mbridge_refit.plan.build import encode_contribution, rank_contribution
    from mbridge_refit.runtime.collectives import current_groups
    from mbridge_refit.runtime.live_params import LiveParams
    from mbridge_refit.testing.simulated_ranks import enter_rank

    layout = layout_of(args)
    enter_rank(layout, args.rank)
    names = json.loads((args.work / "names.json").read_text())["names"]
    start = time.perf_counter()
    bridge, chunks = meta_model(args.model, layout)
    build_s = time.perf_counter() - start
    model_bridge = bridge.megatron_model_bridge(chunks)
    model_bridge._cached_param_names = names  # the result of the bridge's pipeline name exchange
    start = time.perf_counter()
    tasks = model_bridge.build_conversion_tasks(bridge.hf_pretrained, chunks)
    contribution = rank_contribution(model_bridge, bridge.hf_pretrained, chunks, tasks)
    contribution_s = time.perf_counter() - start
    groups = current_groups()
    payload = pickle.dumps(contribution)
    (args.work / f"rank{args.rank}.pkl").write_bytes(payload)
    (args.work / f"rank{args.rank}.json").write_text(
        json.dumps(
            dict(
                rank=args.rank,
                meta_build_s=build_s,
                contribution_s=contribution_s,
                specs=len(contribution.specs),
                payload_bytes=len(payload),
                sent_bytes=len(encode_contribution(contribution)),
                peak_rss_gib=peak_rss_gib(),
                place={field: getattr(groups, field) for field in PLACE},
                params=sorted(LiveParams(chunks, tasks).params),
            )
        )
    )


def _exchange_worker(rank: int, world: int, work: str, port: int, result: str, uncompressed: bool) -> None:
    import torch.distributed as dist

    from mbridge_refit.plan.build import exchange_contributions

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=10))
    contribution = pickle.loads(Path(work, f"rank{rank}.pkl").read_bytes())
    dist.barrier()
    start = time.perf_counter()
    if uncompressed:  # the comparison: the contributions as they are, in one object all-gather
        dist.all_gather_object([None] * world, contribution)
    else:
        exchange_contributions(contribution)
    elapsed = time.perf_counter() - start
    times = [None] * world
    dist.all_gather_object(times, (elapsed, peak_rss_gib()))
    if rank == 0:
        Path(result).write_text(
            json.dumps({"exchange_s": max(t for t, _ in times), "peak_rss_gib": max(r for _, r in times)})
        )
    dist.destroy_process_group()


def step_exchange(args, uncompressed: bool = False) -> dict:
    """Step 3: the library's exchange of the real contributions over WORLD fresh gloo processes
    (``uncompressed``: one ``all_gather_object`` of the contributions as they are, for comparison)."""
    import torch.multiprocessing as mp
    from torch.distributed.elastic.utils.distributed import get_free_port

    world = layout_of(args).expected_world_size
    port = get_free_port()
    result = args.work / "exchange.json"
    mp.spawn(_exchange_worker, args=(world, str(args.work), port, str(result), uncompressed), nprocs=world, join=True)
    return json.loads(result.read_text())


def exchange_rounds(args) -> tuple[dict, dict | None]:
    """Step 3 (``--exchange-rounds`` times, each in fresh processes: a gloo group's first collective
    is what a plan pays) and, with ``--compare-uncompressed``, the uncompressed exchange alternated
    with it: the median of each, with every round's time."""
    ours, theirs = [], []
    for _ in range(args.exchange_rounds):
        ours.append(step_exchange(args))
        if args.compare_uncompressed:
            theirs.append(step_exchange(args, uncompressed=True))

    def median_of(rounds: list[dict]) -> dict | None:
        if not rounds:
            return None
        times = [r["exchange_s"] for r in rounds]
        return {
            "exchange_s": statistics.median(times),
            "rounds_s": times,
            "peak_rss_gib": max(r["peak_rss_gib"] for r in rounds),
        }

    return median_of(ours), median_of(theirs)


def step_assemble(args) -> dict:
    """Step 4: assemble the plan from every contribution; compare with the TP1 reference."""
    from mbridge_refit.plan.build import assemble_plan, current_sizes
    from mbridge_refit.testing.simulated_ranks import enter_rank

    layout = layout_of(args)
    world = layout.expected_world_size
    enter_rank(layout, 0)
    bridge, chunks = meta_model(args.model, layout)
    start = time.perf_counter()
    contributions = [pickle.loads((args.work / f"rank{r}.pkl").read_bytes()) for r in range(world)]
    unpickle_s = time.perf_counter() - start  # the CPU share of the exchange on each rank
    start = time.perf_counter()
    plan = assemble_plan(
        contributions,
        current_sizes(chunks),
        chunks[0].config,
        bridge.megatron_model_bridge(chunks),
        bridge.hf_pretrained,
    )
    assemble_s = time.perf_counter() - start
    reference = sorted(json.loads((args.work / "names.json").read_text())["reference"])
    got = sorted([e.hf_name, list(e.shape), e.dtype] for e in plan.entries)
    owners = sorted({(e.pp_rank, e.sharding.owner_ep_rank) for e in plan.entries if e.is_expert})
    first_difference = next(
        ((i, a, b) for i, (a, b) in enumerate(zip(got, reference)) if a != b),
        None if len(got) == len(reference) else ("length", len(got), len(reference)),
    )
    return dict(
        first_difference_from_tp1=first_difference,
        unpickle_all_s=unpickle_s,
        assemble_s=assemble_s,
        entries=len(plan.entries),
        plan_gb=plan.total_bytes / 1e9,
        matches_tp1_plan=got == reference,
        expert_owners=len(owners),
        layer_stages=sorted(set(plan.layer_map.values())),
        assemble_peak_rss_gib=peak_rss_gib(),
        plan_tensors=len(plan.entries),
        plan_bytes=plan.total_bytes,
        ranks=[traffic_of_rank(plan, args.work, rank) for rank in range(world)],
    )


PLACE = ("tp_size", "pp_size", "ep_size", "etp_size", "tp_rank", "pp_rank", "ep_rank", "etp_rank")


def traffic_of_rank(plan, work: Path, rank: int) -> dict:
    """What rank ``rank``'s export of ``plan`` yields, copies and receives (``runtime.rank_traffic``),
    from its place in its groups and the parameters it holds (step 2)."""
    from mbridge_refit.runtime.rank_traffic import rank_traffic, simulated_groups

    recorded = json.loads((work / f"rank{rank}.json").read_text())
    place = recorded["place"]
    groups = simulated_groups(**{field.removesuffix("_size"): place[field] for field in PLACE})
    traffic = rank_traffic(plan, groups, dict.fromkeys(recorded["params"]))
    return dict(rank=rank, **{k: v for k, v in place.items() if k.endswith("_rank")}, **traffic.as_dict())


def run_step(args, step: str, *extra: str) -> None:
    cmd = [
        sys.executable,
        __file__,
        "--model",
        args.model,
        "--tp",
        str(args.tp),
        "--pp",
        str(args.pp),
        "--ep",
        str(args.ep),
        "--work",
        str(args.work),
        "--step",
        step,
        *extra,
    ]
    for flag in ("first_stage_layers", "last_stage_layers"):
        if getattr(args, flag) is not None:
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"step {step} {' '.join(extra)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def orchestrate(args) -> None:
    layout = layout_of(args)
    world = layout.expected_world_size
    args.work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    run_step(args, "names")
    print(f"[simulate] names and TP1 reference: {time.perf_counter() - start:.1f} s", flush=True)
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(lambda r: run_step(args, "rank", "--rank", str(r)), range(world)))
    ranks = [json.loads((args.work / f"rank{r}.json").read_text()) for r in range(world)]
    print(f"[simulate] {world} rank contributions done", flush=True)
    exchange, uncompressed = exchange_rounds(args)
    run_step(args, "assemble")
    assembled = json.loads((args.work / "assemble.json").read_text())
    slowest = max(ranks, key=lambda r: r["contribution_s"])
    row = dict(
        model=args.model,
        layout=layout.name,
        world_size=world,
        simulated=True,
        entries=assembled["entries"],
        plan_gb=assembled["plan_gb"],
        matches_tp1_plan=assembled["matches_tp1_plan"],
        first_difference_from_tp1=assembled["first_difference_from_tp1"],
        rank_contribution_s_max=slowest["contribution_s"],
        exchange_s=exchange["exchange_s"],
        exchange_rounds_s=exchange["rounds_s"],
        exchange_uncompressed_s=uncompressed and uncompressed["exchange_s"],
        exchange_uncompressed_rounds_s=uncompressed and uncompressed["rounds_s"],
        exchange_note=f"{world} gloo processes on {os.cpu_count()} CPU cores, fresh each round",
        unpickle_all_s=assembled["unpickle_all_s"],
        assemble_s=assembled["assemble_s"],
        plan_s=slowest["contribution_s"] + exchange["exchange_s"] + assembled["assemble_s"],
        payload_bytes_total=sum(r["payload_bytes"] for r in ranks),
        sent_bytes_total=sum(r["sent_bytes"] for r in ranks),
        meta_build_s_max=max(r["meta_build_s"] for r in ranks),
        peak_rss_gib=max(max(r["peak_rss_gib"] for r in ranks), assembled["assemble_peak_rss_gib"]),
        exchange_peak_rss_gib=exchange["peak_rss_gib"],
        date=datetime.date.today().isoformat(),
    )
    print(
        f"{row['model']} {row['layout']} ({world} simulated ranks): {row['entries']} entries, same entries as the TP1 plan: "
        f"{row['matches_tp1_plan']}; per rank: contribution {row['rank_contribution_s_max']:.2f} s + exchange "
        f"{row['exchange_s']:.2f} s + assemble {row['assemble_s']:.2f} s = {row['plan_s']:.2f} s; peak RSS "
        f"{row['peak_rss_gib']:.2f} GiB; exchanged {row['payload_bytes_total'] / 2**20:.1f} MiB "
        f"({row['sent_bytes_total'] / 2**20:.2f} MiB compressed)",
        flush=True,
    )
    append_jsonl(args.out or results_dir("cpu") / "plan_scale.jsonl", row)
    traffic = dict(
        model=args.model,
        layout=layout.name,
        world_size=world,
        plan_tensors=assembled["plan_tensors"],
        plan_bytes=assembled["plan_bytes"],
        ranks=assembled["ranks"],
        planning=row,
    )
    path = write_result(
        args.traffic_dir or results_dir("cpu"), f"rank_traffic_{args.model}_{layout.name}.json", traffic, device=DEVICE
    )
    print(f"[simulate] each rank's export traffic: {path}", flush=True)
    if not row["matches_tp1_plan"]:
        raise SystemExit(
            f"the simulated plan's (name, shape, dtype) list differs from the TP1 plan: {row['first_difference_from_tp1']}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-235b-a22b", help="a shape in recipes/shapes/")
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--ep", type=int, default=8)
    parser.add_argument(
        "--first-stage-layers", type=int, default=None, help="uneven pipeline: layers on the first stage"
    )
    parser.add_argument("--last-stage-layers", type=int, default=None, help="uneven pipeline: layers on the last stage")
    parser.add_argument("--jobs", type=int, default=2, help="simulated ranks built at a time (default: %(default)s)")
    parser.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument(
        "--out", type=Path, default=None, help="default: benchmarks/results/<date>-cpu/plan_scale.jsonl"
    )
    parser.add_argument(
        "--traffic-dir",
        type=Path,
        default=None,
        help="where rank_traffic_<model>_<layout>.json goes (default: benchmarks/results/<date>-cpu/)",
    )
    parser.add_argument(
        "--exchange-rounds", type=int, default=1, help="step 3 this many times, median reported (default: 1)"
    )
    parser.add_argument(
        "--compare-uncompressed",
        action="store_true",
        help="alternate each exchange round with one of the contributions uncompressed (exchange_uncompressed_s)",
    )
    parser.add_argument("--step", choices=["names", "rank", "assemble"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step is None:
        with tempfile.TemporaryDirectory() as scratch:
            args.work = args.work or Path(scratch)
            orchestrate(args)
        return
    if args.step == "names":
        step_names(args)
    elif args.step == "rank":
        step_rank(args)
    else:
        (args.work / "assemble.json").write_text(json.dumps(step_assemble(args)))


if __name__ == "__main__":
    main()
