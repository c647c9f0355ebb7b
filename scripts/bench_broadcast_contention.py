"""Why bucketed NCCL broadcasts run slower inside a refit than one raw broadcast: the same bytes, two GPUs,
with and without the device work a packed broadcast puts beside them.

    PYTHONPATH=$PWD torchrun --nproc-per-node 2 scripts/bench_broadcast_contention.py --gib 16 --bucket-mib 512 --out F.json

Rank 0 sends, rank 1 receives (one NCCL group, GPU = rank). Each variant moves ``--gib`` GiB; its time is
the host's wall time from a barrier to both ranks' streams drained, taken in rounds so every variant meets
the host's drift alike (first round dropped as warm-up; median and range of the rest):

* ``single``: one broadcast of every byte (the raw broadcast the refit benchmarks compare with).
* ``buckets``: the bytes in ``--bucket-mib`` buckets from two rotating buffers, no other work.
* ``buckets_copy``: the same, and the device copies of a packed broadcast beside it: the sender copies each
  bucket's bytes from a "parameters" tensor into the buffer (the pack), the receiver copies each received
  bucket out (the engine's replay); the buffer of bucket k is packed again only after broadcast k-2 ended.
* ``buckets_copy_sum``: and a checksum of every bucket on both ends (a sum over it, as the refit's).
* ``buckets_copy_sender_only`` / ``_receiver_only``: which end's copies slow the broadcast.
* ``library_ctas{N}``: the library's own order: the source's copies and both checksums on ``N`` programs, the
  receiver's copies torch's (an engine's replay runs on every SM); ``_no_checksum``, ``_source_checksum_only``,
  ``_receiver_checksum_only``: what each end's checksum costs; ``_source_fused``: the source's checksum summed by
  its copy (``BoundedKernels.copy_summing``: no second read of the bucket); ``_receiver_beside``: the receiver's
  checksum on a stream of its own while it copies the bucket out; ``_receiver_checksum_ctas{2N}``: on more
  programs; ``_source_fused_receiver_copies_ctas{N}[_beside]``: and the receiver's copies (an engine's replay)
  on ``N`` programs too, its checksum after them or beside them.
* ``buckets_copy_sum_ctas{N}``: copies and checksums by the library's bounded kernels (``engines.broadcast.bounded_kernels``)
  on ``N`` programs (fewer SMs, the same bytes): whether spreading their memory traffic over the broadcast's
  time gives NCCL its bandwidth back;
  ``buckets_copy_ctas{N}_sum_ctas{2N}``: the checksums on twice the programs;
  ``buckets_sender_copy_receiver_ctas{N}_sum_ctas{N}``: only the receiver's copies and both checksums so.

Also each kind of copy and checksum alone over the same bytes (``sender_copies_alone_ms``, the fused copy as
``fused_ctasN``; ``checksums_alone_ms``); ``triton_checksum_equals_torch`` compares the bounded checksum and the
fused copy's sum of one bucket with torch's.

Writes one JSON (rank 0): the device, NCCL's version and settings, bytes, each variant's rounds and GB/s.
Needs torch, Triton and this package (run from the repository root with ``PYTHONPATH=$PWD``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from mbridge_refit.engines.broadcast.bounded_kernels import BoundedKernels

SENDER = 0


class Bench:
    def __init__(self, total: int, bucket: int, device: torch.device) -> None:
        self.total, self.bucket, self.device = total, bucket, device
        self.rank = dist.get_rank()
        self.buckets = -(-total // bucket)
        self.whole = torch.empty(total, dtype=torch.uint8, device=device)  # the raw broadcast's tensor
        self.params = torch.randint(0, 255, (total,), dtype=torch.uint8, device=device)  # pack source / replay target
        self.buffers = [torch.empty(bucket, dtype=torch.uint8, device=device) for _ in range(2)]
        self.sums = torch.zeros(self.buckets, dtype=torch.int64, device=device)
        self._bounded: dict[int, BoundedKernels] = {}
        self.side = torch.cuda.Stream(device)  # the receiver's checksum beside its copy (``beside``)

    def _piece(self, index: int) -> tuple[int, int]:
        start = index * self.bucket
        return start, min(self.bucket, self.total - start)

    def single(self) -> None:
        dist.broadcast(self.whole, SENDER)

    def bucketed(
        self,
        send: str | None,
        receive: str | None,
        checksum: str | None,
        *,
        receive_checksum: str | None = "same",
        beside: bool = False,
    ) -> None:
        """The packed broadcast's order on each end (``engines.broadcast.packed``): the sender packs bucket k once
        broadcast k-2 (same buffer) ended, issues it, then sums it beside the broadcast; the receiver keeps two
        broadcasts posted, and sums and copies out bucket k before posting k+2 into its buffer. Each side's copy
        and the checksum: None (not done), ``copy_`` / ``sum`` (torch, every SM), ``ctasN`` (the bounded kernels on
        N programs); the sender's checksum ``fused``: summed by its copy (``BoundedKernels.copy_summing``, the copy
        ``ctasN``). ``receive_checksum``: the receiver's, where it differs from ``checksum``; ``beside``: the
        receiver sums on a stream of its own while it copies the bucket out (both only read the bucket)."""
        if self.rank == SENDER:
            self._send_all(send, checksum)
        else:
            self._receive_all(receive, checksum if receive_checksum == "same" else receive_checksum, beside)

    def _send_all(self, copy: str | None, checksum: str | None) -> None:
        works: list = [None, None]
        for index in range(self.buckets):
            slot = index % 2
            start, length = self._piece(index)
            buffer = self.buffers[slot][:length]
            if works[slot] is not None:
                works[slot].wait()  # stream-ordered: the buffer's last broadcast ended before it is packed again
            if checksum == "fused":
                kernels = self._kernels(copy)
                kernels.start_sum(index)
                if not kernels.copy_summing(buffer, self.params[start : start + length], index):
                    raise SystemExit("the fused copy did not run on these bytes: nothing to measure")
            elif copy is not None:
                self._copy(buffer, self.params[start : start + length], copy)
            works[slot] = dist.broadcast(buffer, SENDER, async_op=True)
            if checksum == "fused":
                self._kernels(copy).summed_into(index, self.sums[index])
            elif checksum is not None:
                self._checksum(buffer, index, checksum)
        for work in works:
            if work is not None:
                work.wait()

    def _receive_all(self, copy: str | None, checksum: str | None, beside: bool) -> None:
        works: dict[int, object] = {}
        current = torch.cuda.current_stream(self.device)

        def post(index: int) -> None:
            if index < self.buckets:
                works[index] = dist.broadcast(self.buffers[index % 2][: self._piece(index)[1]], SENDER, async_op=True)

        post(0)
        post(1)
        for index in range(self.buckets):
            works.pop(index).wait()
            start, length = self._piece(index)
            buffer = self.buffers[index % 2][:length]
            if checksum is not None and beside:
                self.side.wait_stream(current)
                with torch.cuda.stream(self.side):
                    self._checksum(buffer, index, checksum)
            elif checksum is not None:
                self._checksum(buffer, index, checksum)
            if copy is not None:
                self._copy(self.params[start : start + length], buffer, copy)
            if checksum is not None and beside:
                current.wait_stream(self.side)  # both reads of the buffer ended before it is posted again
            post(index + 2)

    def _kernels(self, how: str) -> BoundedKernels:
        """The library's bounded kernels (``engines.broadcast.bounded_kernels``) on the programs ``how`` names (``ctasN``)."""
        programs = int(how.removeprefix("ctas"))
        if programs not in self._bounded:
            kernels = BoundedKernels(self.device, programs, slots=self.buckets)
            if not kernels.enabled:
                raise SystemExit(f"the bounded kernels do not run on {self.device} (see the log): nothing to measure")
            self._bounded[programs] = kernels
        return self._bounded[programs]

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, how: str) -> None:
        if how == "copy_":
            dst.copy_(src)
        else:
            self._kernels(how).copy(dst, src)

    def _checksum(self, data: torch.Tensor, index: int, how: str) -> None:
        if how == "sum":
            torch.sum(data.view(torch.int64), dim=0, out=self.sums[index])
        else:
            self._kernels(how).checksum_into(data, self.sums[index], index)


def alone_ms(bench: Bench, work) -> float:
    """``work(index, start, length)`` over every bucket of the bytes with nothing beside it: the median of three
    passes after a warm-up, ms."""
    runs = []
    for _ in range(4):
        torch.cuda.synchronize()
        started = time.perf_counter()
        for index in range(bench.buckets):
            work(index, *bench._piece(index))
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - started) * 1e3)
    return statistics.median(runs[1:])


def timed(fn) -> float:
    dist.barrier()
    torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    dist.barrier()  # both ranks' streams drained
    return (time.perf_counter() - started) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=16.0, help="bytes moved by each variant, GiB (default 16)")
    parser.add_argument("--bucket-mib", type=int, default=512, help="bucket size, MiB (default 512)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds over every variant (first dropped; default 6)")
    parser.add_argument("--ctas", type=int, nargs="*", default=[32, 64], help="programs of the bounded-kernel variants")
    parser.add_argument("--out", help="JSON result (rank 0)")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(minutes=5))
    total, bucket = int(args.gib * (1 << 30)) // 4096 * 4096, args.bucket_mib << 20  # whole words for every kernel
    bench = Bench(total, bucket, device)
    variants = {
        "single": bench.single,
        "buckets": lambda: bench.bucketed(None, None, None),
        "buckets_copy": lambda: bench.bucketed("copy_", "copy_", None),
        "buckets_copy_sum": lambda: bench.bucketed("copy_", "copy_", "sum"),
        "buckets_copy_sender_only": lambda: bench.bucketed("copy_", None, None),
        "buckets_copy_receiver_only": lambda: bench.bucketed(None, "copy_", None),
        **{
            f"buckets_copy_sum_ctas{n}": (lambda n=n: bench.bucketed(f"ctas{n}", f"ctas{n}", f"ctas{n}"))
            for n in args.ctas
        },
        **{
            f"buckets_copy_ctas{n}_sum_ctas{2 * n}": (
                lambda n=n: bench.bucketed(f"ctas{n}", f"ctas{n}", f"ctas{2 * n}")
            )
            for n in args.ctas
        },
        **{
            f"buckets_sender_copy_receiver_ctas{n}_sum_ctas{n}": (
                lambda n=n: bench.bucketed("copy_", f"ctas{n}", f"ctas{n}")
            )
            for n in args.ctas
        },
    }
    for n in args.ctas:  # the library's order: the source's copies bounded, the engine's replay torch's (every SM)
        ctas = f"ctas{n}"
        variants |= {
            f"library_ctas{n}": lambda c=ctas: bench.bucketed(c, "copy_", c),
            f"library_ctas{n}_no_checksum": lambda c=ctas: bench.bucketed(c, "copy_", None),
            f"library_ctas{n}_source_checksum_only": lambda c=ctas: bench.bucketed(
                c, "copy_", c, receive_checksum=None
            ),
            f"library_ctas{n}_receiver_checksum_only": lambda c=ctas: bench.bucketed(
                c, "copy_", None, receive_checksum=c
            ),
            f"library_ctas{n}_source_fused": lambda c=ctas: bench.bucketed(c, "copy_", "fused", receive_checksum=c),
            f"library_ctas{n}_receiver_beside": lambda c=ctas: bench.bucketed(c, "copy_", c, beside=True),
            f"library_ctas{n}_source_fused_receiver_beside": lambda c=ctas: bench.bucketed(
                c, "copy_", "fused", receive_checksum=c, beside=True
            ),
            f"library_ctas{n}_receiver_checksum_ctas{2 * n}": lambda c=ctas, n=n: bench.bucketed(
                c, "copy_", c, receive_checksum=f"ctas{2 * n}"
            ),
            f"library_ctas{n}_source_fused_receiver_copies_ctas{n}": lambda c=ctas: bench.bucketed(
                c, c, "fused", receive_checksum=c
            ),
            f"library_ctas{n}_source_fused_receiver_copies_ctas{n}_beside": lambda c=ctas: bench.bucketed(
                c, c, "fused", receive_checksum=c, beside=True
            ),
        }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_index in range(args.rounds):
        for name, fn in variants.items():
            ms = timed(fn)
            if round_index > 0:
                times[name].append(ms)
    copy_alone = {
        how: alone_ms(
            bench,
            lambda index, start, length, how=how: bench._copy(
                bench.buffers[index % 2][:length], bench.params[start : start + length], how
            ),
        )
        for how in ["copy_", *(f"ctas{n}" for n in args.ctas)]
    } | {
        f"fused_ctas{n}": alone_ms(
            bench,
            lambda index, start, length, n=n: bench._kernels(f"ctas{n}").copy_summing(
                bench.buffers[index % 2][:length], bench.params[start : start + length], index
            ),
        )
        for n in args.ctas
    }
    sums_alone = {
        how: alone_ms(
            bench,
            lambda index, start, length, how=how: bench._checksum(bench.params[start : start + length], index, how),
        )
        for how in ["sum", *(f"ctas{n}" for n in sorted({*args.ctas, *(2 * n for n in args.ctas)}))]
    }
    sample = bench.params[: bench.bucket]
    bench._checksum(sample, 0, "sum")
    bench._checksum(sample, 1, f"ctas{args.ctas[0]}") if args.ctas else None
    checksums_agree = bool(bench.sums[0] == bench.sums[1]) if args.ctas else None
    if args.ctas:  # the fused copy's sum of the same bytes
        kernels = bench._kernels(f"ctas{args.ctas[0]}")
        kernels.start_sum(2)
        kernels.copy_summing(bench.buffers[0], sample, 2)
        kernels.summed_into(2, bench.sums[2])
        checksums_agree = checksums_agree and bool(bench.sums[0] == bench.sums[2])
    if rank == SENDER:
        result = {
            "triton_checksum_equals_torch": checksums_agree,
            "device": torch.cuda.get_device_name(device),
            "gpus": dist.get_world_size(),
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
            "torch": torch.__version__,
            "bytes": total,
            "bucket_bytes": bucket,
            "buckets": bench.buckets,
            "rounds_kept": args.rounds - 1,
            "variants": {
                name: {
                    "median_ms": round(statistics.median(ms), 3),
                    "min_ms": round(min(ms), 3),
                    "max_ms": round(max(ms), 3),
                    "gb_per_s": round(total / statistics.median(ms) / 1e6, 1),
                    "all_ms": [round(v, 3) for v in ms],
                }
                for name, ms in times.items()
            },
            "sender_copies_alone_ms": {k: round(v, 3) for k, v in copy_alone.items()},
            "checksums_alone_ms": {k: round(v, 3) for k, v in sums_alone.items()},
        }
        print(
            json.dumps({k: v["median_ms"] for k, v in result["variants"].items()}),
            copy_alone,
            checksums_agree,
            flush=True,
        )
        if args.out:
            with open(args.out, "w") as handle:
                json.dump(result, handle, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
