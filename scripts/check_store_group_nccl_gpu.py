"""GPU host, 2 GPUs: a ``StoreGroup`` over NCCL between two processes, as a trainer and an engine worker form one.

    python3 scripts/check_store_group_nccl_gpu.py --out-dir DIR

No vLLM: the trainer process sees every GPU and uses GPU 0; the engine process sees only GPU 1
(``CUDA_VISIBLE_DEVICES=1``, as vLLM's worker does). Each case runs in two fresh processes;
each is checked (issue #31):

1. ``matched``: the same NCCL settings in both: a packed broadcast (checksums on, many buckets)
   arrives bit for bit, twice over the same group.
2. ``refused``: the engine process carries vLLM's batch-invariant NCCL variables
   (``NCCL_MAX_NCHANNELS=1``, ``NCCL_PROTO=Simple``, ...), the trainer not: both raise
   ``SettingsMismatchError`` naming ``NCCL_MAX_NCHANNELS``, within 30 s.
3. ``unchecked``: as 2 with the settings check switched off in both processes (what the code did
   before): NCCL's own failure must now raise on both sides within 30 s. With ``NCCL_DEBUG=WARN``
   the logs are kept: the issue's "Message truncated: received 12288 bytes instead of 512" is
   expected there (recorded, not a check: it confirms the diagnosis).
4. ``receiver-fails``: the engine's first bulk broadcast raises after the handshake: both raise
   within 30 s.
5. ``trainer-killed``: the trainer process is killed after the handshake: the engine raises
   within 30 s (its store is gone).
6. ``engine-killed``: the engine process is killed after its first tensor: the trainer raises
   within 30 s (the engine's heartbeat stops).

Writes DIR/store_group_nccl.json and each process's log; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from torch.distributed.elastic.utils.distributed import get_free_port as free_port

REPO = Path(__file__).resolve().parents[1]
BOUND_S = 30.0
CHILD_LIMIT_S = 150.0
SECRET_VARIABLE = "CHECK_STORE_GROUP_SECRET"  # not an argument: a command line is readable by every local user
CASES = ("matched", "refused", "unchecked", "receiver-fails", "trainer-killed", "engine-killed")
VLLM_BATCH_INVARIANT_NCCL = {  # what vLLM 0.26's batch-invariant mode sets in its workers
    "NCCL_LAUNCH_MODE": "GROUP",
    "NCCL_COLLNET_ENABLE": "0",
    "NCCL_NVLS_ENABLE": "0",
    "NCCL_P2P_NET_DISABLE": "1",
    "NCCL_MIN_NCHANNELS": "1",
    "NCCL_MAX_NCHANNELS": "1",
    "NCCL_PROTO": "Simple",
    "NCCL_ALGO": "allreduce:tree",
    "NCCL_NTHREADS": "1",
    "NCCL_SOCKET_NTHREADS": "1",
}


# --- one member (a child process) -------------------------------------------------------------------


def plan_and_tensors(device):
    import torch

    from mbridge_refit.testing.plans import replicated_plan

    specs = [
        ("embed", (8192, 1024), "bfloat16"),
        ("norm", (1024,), "float32"),
        ("proj", (3000, 2048), "bfloat16"),
        ("empty", (0,), "bfloat16"),
        ("bias", (77,), "float32"),
        ("head", (4096, 1024), "bfloat16"),
    ]
    plan = replicated_plan(*specs)
    gen = torch.Generator().manual_seed(7)
    tensors = [
        (e.hf_name, (torch.randn(e.shape, generator=gen) * 3).to(e.torch_dtype).to(device)) for e in plan.entries
    ]
    return plan, tensors


def member(args) -> dict:
    import torch

    from mbridge_refit.engines.broadcast import group as broadcast_group
    from mbridge_refit.engines.broadcast.group import StoreGroup
    from mbridge_refit.engines.broadcast.packed import (
        PackedBroadcastConfig,
        PackedBroadcastReceiver,
        PackedBroadcastSender,
        SendBuffers,
    )

    if args.case == "unchecked":  # the code before the fix compared nothing
        broadcast_group.group_settings = lambda backend, environ=None: {"backend": backend}
    trainer = args.member == "trainer"
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    plan, tensors = plan_and_tensors(device)
    config = PackedBroadcastConfig(bucket_bytes=4 << 20, num_buffers=2, checksum=True)
    kept = SendBuffers(plan, config, device)  # the source's memory from one refit to the next, as a session keeps it
    record: dict = {
        "role": args.member,
        "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "rounds": [],
    }
    started = time.monotonic()
    try:
        group = StoreGroup(
            host="127.0.0.1",
            port=args.port,
            rank=0 if trainer else 1,
            world_size=2,
            device=device,
            secret=bytes.fromhex(os.environ[SECRET_VARIABLE]),
            timeout=datetime.timedelta(seconds=120),
        )
        record["joined_s"] = round(time.monotonic() - started, 2)
        for _ in range(2 if args.case == "matched" else 1):
            round_started = time.monotonic()
            if trainer:
                sender = PackedBroadcastSender(plan, config, group=group, src=0, device=device, buffers=kept)
                if args.case == "trainer-killed":
                    time.sleep(1.0)
                    os.kill(os.getpid(), signal.SIGKILL)
                for name, tensor in tensors:
                    sender.consume(name, tensor)
                sender.finish()
                group.synchronize()
                record["rounds"].append(
                    {
                        "ms": round((time.monotonic() - round_started) * 1e3, 1),
                        "bytes": sender.bytes_sent,
                        "buckets_summed_by_their_copies": sum(
                            kept.summed_by_copies(b) for b in range(kept.packing.num_buckets)
                        ),
                        "buckets": kept.packing.num_buckets,
                    }
                )
            else:
                receiver = PackedBroadcastReceiver(plan, config, group=group, src=0, device=device)
                if args.case == "receiver-fails":

                    def broken(tensor, src, *, async_op=False):
                        raise RuntimeError("injected: the engine's bulk broadcast failed")

                    group.broadcast = broken
                got = {}
                for index, (name, tensor) in enumerate(receiver.receive()):
                    if args.case == "engine-killed" and index == 1:
                        os.kill(os.getpid(), signal.SIGKILL)
                    got[name] = tensor.clone()
                group.synchronize()
                exact = all(
                    got[n].dtype == t.dtype
                    and torch.equal(got[n].view(-1).view(torch.uint8), t.view(-1).view(torch.uint8))
                    for n, t in tensors
                    if t.numel()
                ) and set(got) == {n for n, _ in tensors}
                record["rounds"].append({"ms": round((time.monotonic() - round_started) * 1e3, 1), "exact": exact})
        group.close()
        record["error"] = None
    except BaseException as err:  # noqa: BLE001 - recorded for the parent
        record["error"] = f"{type(err).__name__}: {err}"
    record["seconds"] = round(time.monotonic() - started, 2)
    return record


# --- the parent: two members per case -------------------------------------------------------------


def run_case(case: str, out: Path, cpu: bool) -> dict:
    import secrets

    port, secret = free_port(), secrets.token_hex(32)  # the group's secret: to both members in their environment
    procs = {}
    for role in ("trainer", "engine"):
        env = {**os.environ, "PYTHONPATH": str(REPO), "NCCL_DEBUG": "WARN", SECRET_VARIABLE: secret}
        if role == "engine":
            env["CUDA_VISIBLE_DEVICES"] = "1"
            if case in ("refused", "unchecked"):
                env.update(VLLM_BATCH_INVARIANT_NCCL)
        log = open(out / f"store_group_nccl_{case}_{role}.log", "w")  # noqa: SIM115 - closed below
        result = out / f"store_group_nccl_{case}_{role}.json"
        result.unlink(missing_ok=True)
        command = [
            sys.executable,
            __file__,
            "--member",
            role,
            "--case",
            case,
            "--port",
            str(port),
            "--result",
            str(result),
        ]
        procs[role] = (
            subprocess.Popen(command + (["--cpu"] if cpu else []), env=env, stdout=log, stderr=subprocess.STDOUT),
            log,
            result,
        )
    deadline = time.monotonic() + CHILD_LIMIT_S
    for proc, log, _ in procs.values():
        try:
            proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    records = {role: json.loads(path.read_text()) if path.exists() else None for role, (_, _, path) in procs.items()}
    logs = "".join((out / f"store_group_nccl_{case}_{role}.log").read_text(errors="replace") for role in procs)
    return {"records": records, "message_truncated_in_nccl_log": "Message truncated" in logs}


def raised_within(record: dict | None, *needles: str) -> bool:
    return (
        record is not None
        and record["error"] is not None
        and record["seconds"] < BOUND_S
        and all(n in record["error"] for n in needles)
    )


def checks_of(case: str, outcome: dict) -> dict:
    trainer, engine = outcome["records"]["trainer"], outcome["records"]["engine"]
    if case == "matched":
        return {
            "matched_exact_twice": engine is not None
            and engine["error"] is None
            and trainer["error"] is None
            and len(engine["rounds"]) == 2
            and all(r["exact"] for r in engine["rounds"])
        }
    if case == "refused":
        return {
            "refused_on_both_within_30s": raised_within(trainer, "SettingsMismatchError", "NCCL_MAX_NCHANNELS")
            and raised_within(engine, "SettingsMismatchError", "NCCL_MAX_NCHANNELS")
        }
    if case in ("unchecked", "receiver-fails"):
        return {f"{case}_raised_on_both_within_30s": raised_within(trainer) and raised_within(engine)}
    if case == "trainer-killed":
        return {"trainer_killed_engine_raised_within_30s": raised_within(engine)}
    return {"engine_killed_trainer_raised_within_30s": raised_within(trainer)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, help="folder for the JSON result and the members' logs")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="a smoke run of this harness on CPU over gloo (no NCCL: 'refused' and 'unchecked' do not apply)",
    )
    parser.add_argument("--member", choices=["trainer", "engine"], help=argparse.SUPPRESS)
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.member is not None:
        record = member(args)
        args.result.write_text(json.dumps(record, indent=1))
        sys.stdout.flush()
        os._exit(0)  # a thread left in NCCL's bootstrap (the unchecked case) must not hold up the exit
    if args.out_dir is None:
        parser.error("--out-dir is required")
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown cases {unknown}: choose from {', '.join(CASES)}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result: dict = {"cases": {}, "checks": {}}
    for case in cases:
        outcome = run_case(case, args.out_dir, args.cpu)
        result["cases"][case] = outcome
        result["checks"].update(checks_of(case, outcome))
        print(case, json.dumps(checks_of(case, outcome)), flush=True)
    result["ok"] = all(result["checks"].values())
    (args.out_dir / "store_group_nccl.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["checks"], indent=2))
    print("OK" if result["ok"] else "FAILED", "store_group_nccl.json")
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
