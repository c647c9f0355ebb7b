"""Benchmark: ways to fill a stacked expert tensor [E, ...] from E separate expert parameters.

A stacked tensor (GPT-OSS's experts, a checkpoint's packed experts: ``plan.stacking``) is no slice
of one parameter, so every export writes it: slot ``e`` from expert ``e``'s parameter, re-laid out
(transposed for Qwen3-VL-MoE's published layout). This times, on one GPU, the candidate ways to
write all E slots, each checked bit for bit against the per-expert loop:

* ``loop``: ``ExpertStack.copy_into`` per expert (one copy kernel each);
* ``foreach``: one ``torch._foreach_copy_`` over the same (slot view, parameter view) pairs;
* ``stack``: ``torch.stack`` of the parameters into the output (no re-layout), or into a staging
  buffer followed by one transposing copy into the output (transposed stacks);
* ``fill_stack``: what the exporter runs (``runtime.stack_fill``: the stack, or the Triton tiled
  transpose of ``runtime.stack_kernels`` for transposed stacks);

against one copy of the same bytes (the floor). Shapes default to Qwen3-VL-30B-A3B's experts
(128 experts, hidden 2048, ffn 768: gate_up [1536, 2048], down [2048, 768]).

    python scripts/bench_stacked_experts.py [--experts 128 --hidden 2048 --ffn 768] [--device cuda]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from pathlib import Path

import torch
from provenance import results_dir, write_result

from mbridge_refit.runtime.stack_fill import fill_stack


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median milliseconds of ``fn()`` after one warm-up call (device synchronised around each)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def candidates(stack, experts: list[torch.Tensor], out: torch.Tensor, staging: torch.Tensor) -> dict:
    """Name -> a function writing every slot of ``out`` (views built once, as a cached exporter would)."""
    pairs = [stack.slot_views(out[e], expert) for e, expert in enumerate(experts)]
    targets, sources = [t for t, _ in pairs], [s for _, s in pairs]

    def loop():
        for e, expert in enumerate(experts):
            stack.copy_into(out[e], expert)

    def foreach():
        torch._foreach_copy_(targets, sources)

    def stacked():  # no re-layout: straight into the output; transposed: staged, then one transposing copy
        if stack.transpose:
            torch.stack(experts, out=staging)
            out.copy_(staging.transpose(-1, -2))
        else:
            torch.stack(experts, out=out)

    memo: dict = {}

    def chosen():  # what the exporter runs (runtime.stack_fill)
        fill_stack(stack, out, experts, memo)

    found = {"loop": loop, "foreach": foreach}
    if stack.interleave == 1:
        found["stack"] = stacked
    found["fill_stack"] = chosen
    return found


def run(args) -> dict:
    from mbridge_refit.plan.stacking import ExpertStack

    device = torch.device(args.device)
    generator = torch.Generator(device="cpu").manual_seed(0)
    rows = {}
    cases = {
        "gate_up transposed (Qwen3-VL-MoE published)": (ExpertStack(transpose=True), (2 * args.ffn, args.hidden)),
        "down transposed (Qwen3-VL-MoE published)": (ExpertStack(transpose=True), (args.hidden, args.ffn)),
        "gate_up as stacked (transformers' layout)": (ExpertStack(), (2 * args.ffn, args.hidden)),
        "gate_up interleaved, transposed (GPT-OSS)": (
            ExpertStack(interleave=2, transpose=True),
            (2 * args.ffn, args.hidden),
        ),
    }
    for label, (stack, shape) in cases.items():
        experts = [torch.randn(shape, generator=generator).to(torch.bfloat16).to(device) for _ in range(args.experts)]
        reference = torch.empty((args.experts, *stack.expert_shape(shape)), dtype=torch.bfloat16, device=device)
        for e, expert in enumerate(experts):
            stack.copy_into(reference[e], expert)
        staging = torch.empty((args.experts, *shape), dtype=torch.bfloat16, device=device)
        out = torch.empty_like(reference)
        nbytes = reference.numel() * reference.element_size()
        floor_source = torch.empty(nbytes, dtype=torch.uint8, device=device)
        floor_out = torch.empty_like(floor_source)
        row = {
            "bytes": nbytes,
            "clone_floor_ms": timed(lambda out=floor_out, source=floor_source: out.copy_(source), device, args.repeats),
        }
        for name, fn in candidates(stack, experts, out, staging).items():
            out.fill_(float("nan"))
            fn()
            exact = torch.equal(out.view(torch.int16), reference.view(torch.int16))
            row[name] = {"ms": timed(fn, device, args.repeats), "bitwise_equal": exact}
        rows[label] = row
        print(
            f"{label}: {nbytes / 2**20:.0f} MiB, copy floor {row['clone_floor_ms']:.3f} ms; "
            + ", ".join(
                f"{n} {r['ms']:.3f} ms{'' if r['bitwise_equal'] else ' (DIFFERENT)'}"
                for n, r in row.items()
                if isinstance(r, dict)
            ),
            flush=True,
        )
        del experts, reference, staging, out, floor_source, floor_out
    return {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "experts": args.experts,
        "hidden": args.hidden,
        "ffn": args.ffn,
        "repeats": args.repeats,
        "cases": rows,
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out-dir", type=Path, default=None, help="default: benchmarks/results/<date>-<device>/")
    args = parser.parse_args()
    row = run(args)
    if args.device == "cuda":
        print(f"wrote {write_result(args.out_dir or results_dir(), 'stacked_experts.json', row)}")


if __name__ == "__main__":
    main()
