"""How the export groups layers into buckets (pure logic on plan-shaped records, no ranks)."""

from __future__ import annotations

from types import SimpleNamespace

from mbridge_refit.fp8.plan import yielded_bytes
from mbridge_refit.runtime.schedule import Op, build_buckets, layer_of


def _entry(name: str, nbytes: int, scale_of: str | None = None) -> SimpleNamespace:
    """What bucketing and ``yielded_bytes`` read of a plan entry."""
    return SimpleNamespace(
        hf_name=name, megatron_param=name, pp_rank=0, alias_of=None, nbytes=nbytes, scale_of=scale_of
    )


def _layers_per_bucket(entries: list, bucket_bytes: int, sizes=None) -> list[list]:
    ops = [Op(entries=[e], builds=[e], assemblies=[], sources=(), sharded_over_tp=False, expert=False) for e in entries]
    buckets = build_buckets(ops, bucket_bytes, SimpleNamespace(), sizes)
    return [list(dict.fromkeys(layer_of(op.entries[0].megatron_param) for op in bucket.ops)) for bucket in buckets]


def test_fp8_buckets_hold_what_the_fp8_export_yields():
    """Buckets measured in the bytes the FP8 export yields (e4m3 data + scales) hold about twice
    the layers of BF16 buckets under the same budget; a non-layer tensor larger than the budget
    is a bucket of its own; the first bucket with a layer closes after it."""
    bf16, fp8 = [_entry("embed", 3000)], [_entry("embed", 3000)]
    for layer in range(4):
        weight, norm = f"model.layers.{layer}.q.weight", f"model.layers.{layer}.norm.weight"
        bf16 += [_entry(weight, 1000), _entry(norm, 10)]
        fp8 += [_entry(weight, 500), _entry(weight + "_scale_inv", 4, scale_of=weight), _entry(norm, 10)]

    sizes = yielded_bytes(SimpleNamespace(entries=fp8))
    assert (
        sizes["model.layers.0.q.weight"] == 504 and sizes["model.layers.0.norm.weight"] == 10 and sizes["embed"] == 3000
    )
    assert _layers_per_bucket(bf16, 2100) == [["embed"], [0], [1, 2], [3]]
    assert _layers_per_bucket(bf16, 2100, sizes) == [["embed"], [0], [1, 2, 3]]
    # control: a mapping with the plan's own sizes buckets as the plan does
    assert _layers_per_bucket(bf16, 2100, {e.hf_name: e.nbytes for e in bf16}) == _layers_per_bucket(bf16, 2100)
