"""The FP8 export transform: a bucketed BF16 export in, the blockwise FP8 stream out.

``quantize_buckets`` quantizes each bucket's weights together (on CUDA one grouped Triton launch
per bucket and input dtype, where the kernel reproduces the reference bits; else the reference
path) into cached buffers, and yields each weight's e4m3 data followed by its
``weight_scale_inv``; a bucket the exporter stamped (``runtime.stamps``: the same views of parameters
where they were) is quantized again by the launches planned for it, its output picked in C and stamped
in turn, with no Python work per tensor. ``quantize_blockwise`` quantizes one tensor the same way; ``ShardQuantizer``
quantizes the same tensors every step (an engine rank's shards in a sharded refit) into buffers
made once.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

from mbridge_refit.fp8.format import BLOCK, FP8_DTYPE, SCALE_DTYPE, FP8Pair, Scratch, row_piece, scale_shape
from mbridge_refit.fp8.reference import padded_shape, quantize_reference
from mbridge_refit.plan.entries import ExportPlan
from mbridge_refit.runtime.buffers import ExportBuffers, check_not_rebound
from mbridge_refit.runtime.selection import RowSelection, materialized
from mbridge_refit.runtime.stamps import StampedBucket, new_stamp, stamp_of

__all__ = [
    "BucketQuantizer",
    "JobQuantizer",
    "ShardQuantizer",
    "block_row_jobs",
    "block_row_runs",
    "quantize_blockwise",
    "quantize_bucket_lists",
    "quantize_buckets",
    "quantizer_path",
]


def quantize_blockwise(
    x: torch.Tensor, *, out: Scratch = None, scale_out: Scratch = None, work: Scratch = None
) -> FP8Pair:
    """``quantize_reference``'s bits, by the single-tensor Triton kernel on CUDA where it is
    usable (then ``work`` is not used), else by the reference itself."""
    if x.is_cuda and x.dim() == 2 and _kernel_usable("single"):
        out = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device) if out is None else out
        if scale_out is None:
            scale_out = torch.empty(scale_shape(tuple(x.shape)), dtype=SCALE_DTYPE, device=x.device)
        _cuda_kernels().quantize_single(x, out, scale_out)
        return out, scale_out
    return quantize_reference(x, out=out, scale_out=scale_out, work=work)


class JobQuantizer:
    """Quantizes ``(source, q, scale)`` jobs (``fp8.format.row_piece``'s kind: a 2-D source whose storage
    stays put, the e4m3 data and the ``scale_inv`` it is written to, each a view wherever the caller
    wants the bits) every ``run``, allocating nothing then. Bits: ``quantize_blockwise``'s (the
    reference's) for each job's blocks, anchored at the job's (0, 0). On CUDA the sources the grouped
    kernel reads in place are quantized by one launch per dtype and device, planned here (thousands of
    expert weights: one launch, not one each); the others one at a time. The launches hold raw
    pointers: valid while every job's tensors keep their storage."""

    def __init__(self, jobs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        self.jobs = list(jobs)
        for x, q, scale in self.jobs:
            if not x.device == q.device == scale.device:
                raise ValueError(
                    f"a quantize job reads {x.device} and writes {q.device} and {scale.device}: a kernel writes "
                    "only its own device's memory"
                )
        self.grouped, self.alone = _grouped_launches(self.jobs)
        self._work: dict[tuple, torch.Tensor] = {}  # the torch path's fp32 scratch, one per padded shape and device
        for x, _, _ in (self.jobs[i] for i in self.alone):
            if not (x.is_cuda and _kernel_usable("single")):
                key = (padded_shape(tuple(x.shape)), x.device)
                if key not in self._work:
                    self._work[key] = torch.empty(key[0], dtype=torch.float32, device=x.device)

    def run(self) -> None:
        """Quantize every job's source as it is now into its ``q`` and ``scale``."""
        for launch in self.grouped:
            _cuda_kernels().launch_grouped(launch)
        for x, q, scale in (self.jobs[i] for i in self.alone):
            quantize_blockwise(x, out=q, scale_out=scale, work=self._work.get((padded_shape(tuple(x.shape)), x.device)))


class ShardQuantizer(JobQuantizer):
    """Quantizes ``sources`` (name -> 2-D tensor whose storage stays put, e.g. an engine rank's BF16
    shards), each as a whole tensor, into FP8 data and ``scale_inv`` buffers made here and kept
    (``q``, ``scales``: name -> tensor), so that ``run`` allocates nothing (``JobQuantizer``)."""

    def __init__(self, sources: dict[str, torch.Tensor]) -> None:
        self.sources = dict(sources)
        self.q = {n: torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device) for n, x in self.sources.items()}
        self.scales = {
            n: torch.empty(scale_shape(tuple(x.shape)), dtype=SCALE_DTYPE, device=x.device)
            for n, x in self.sources.items()
        }
        super().__init__([(x, self.q[n], self.scales[n]) for n, x in self.sources.items()])


def block_row_runs(runs: tuple[tuple[int, int, int], ...], rows: int) -> bool:
    """Whether row runs ``(row of the tensor, row of the source, rows)`` of a ``rows``-row tensor are
    whole block rows of it: each starts on a block row and is whole blocks but for the tensor's last,
    so that quantizing run by run (``block_row_jobs``) gives the tensor's own blocks."""
    return all(row % BLOCK == 0 and (length % BLOCK == 0 or row + length == rows) for row, _, length in runs)


def block_row_jobs(
    origin: torch.Tensor, runs: tuple[tuple[int, int, int], ...], q: torch.Tensor, scale: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The ``(source, q, scale)`` jobs that quantize the tensor made of row ``runs`` of ``origin``
    (``block_row_runs``) into ``q`` and ``scale``: one per run, read where the rows are."""
    return [row_piece(origin, q, scale, x_row=source_row, q_row=row, rows=length) for row, source_row, length in runs]


def quantize_buckets(
    buckets: Iterable[list[tuple[str, torch.Tensor | RowSelection]]], plan: ExportPlan, buffers: ExportBuffers
) -> Iterator[tuple[str, torch.Tensor]]:
    """Turn a bucketed BF16 export (``PlanExporter.export_buckets``, rows selected lazily or not)
    into the FP8 stream that ``plan`` (an ``fp8_plan``) describes.

    Each quantized weight is yielded as its e4m3fn data, then its ``weight_scale_inv``; tensors
    already in FP8 (shipped with their own scales) and tensors kept in their dtype pass through.
    A bucket's weights are quantized together (on CUDA: one grouped kernel launch per bucket and
    input dtype) into ``buffers`` keyed by position in the bucket, so the outputs stay valid
    until the generator moves past the bucket (reused across exports when the pool is
    persistent; how each bucket is quantized is then decided once and kept in ``buffers.memo``).
    A ``RowSelection`` whose runs start on block rows (and are whole blocks, but for the
    tensor's last) is quantized run by run from its source: the same blocks, no copy.
    """
    for bucket in quantize_bucket_lists(buckets, plan, buffers):
        yield from bucket


@dataclass(frozen=True, slots=True)
class _SteadyBucket:
    """The last stamped input of one bucket number and what it was quantized with (``quantize_bucket_lists``)."""

    stamp: int  # the input's
    quantizer: "BucketQuantizer"  # it planned its launches for that input's sources
    out_stamp: int  # the output's


def quantize_bucket_lists(
    buckets: Iterable[list[tuple[str, torch.Tensor | RowSelection]]], plan: ExportPlan, buffers: ExportBuffers
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``quantize_buckets``, one list per BF16 bucket: its tensors all stay valid until the next
    list is requested.

    A stamped input (``runtime.stamps``: the exporter's views-only buckets) gives a stamped output:
    the input's pairs for the tensors kept in their dtype and the quantizer's own pairs for the
    rest, picked in C. When a bucket number's input carries the stamp its last input had, the
    sources are those the quantizer's launches were planned for (its slot is replaced or dropped
    whenever that bucket number is quantized otherwise, and only that bucket number reaches that
    quantizer), so the step is the launches and that pick, with no Python work per tensor, and the
    output carries the last output's stamp."""
    scales: dict | None = None  # scale entry by weight name, for building quantizers
    for bucket in buckets:
        # Quantizers are kept per plan (another config quantizes other tensors) and bucket number (with held
        # outputs a quantizer's buffers are its bucket's), then per names (the ``needed`` subsets of a bucket).
        where = (id(plan), buffers.bucket)
        steady = buffers.memo.get(("fp8-steady", *where))
        stamp = stamp_of(bucket)
        if stamp is not None and steady is not None and steady.stamp == stamp:
            steady.quantizer.launch(bucket, buffers)
            yield StampedBucket(steady.quantizer.pick(bucket), steady.out_stamp)
            continue
        key = ("fp8", *where, tuple([name for name, _ in bucket]))
        quantizer = buffers.memo.get(key)
        if quantizer is None:
            if scales is None:
                scales = {e.scale_of: e for e in plan.entries if e.scale_of is not None}
            quantizer = buffers.memo[key] = BucketQuantizer.build(bucket, scales, buffers, plan)
        quantizer.run([bucket[i][1] for i in quantizer.positions], buffers)
        if stamp is not None:
            steady = _SteadyBucket(stamp, quantizer, new_stamp())
            buffers.memo[("fp8-steady", *where)] = steady
            yield StampedBucket(quantizer.pick(bucket), steady.out_stamp)
            continue
        buffers.memo.pop(("fp8-steady", *where), None)
        yield [(name, materialized(tensor)) for name, tensor in quantizer.pick(bucket)]  # selections copied out


def _block_runs(selection: RowSelection) -> tuple[tuple[int, int, int], ...] | None:
    """The selection's runs if each is a run of whole block rows of the HF tensor (the last may
    end the tensor in a partial block), so that quantizing run by run gives the tensor's blocks."""
    return selection.runs if block_row_runs(selection.runs, selection.shape[0]) else None


@dataclass(kw_only=True, slots=True)
class BucketQuantizer:
    """How one export bucket is quantized: which of its tensors, into which buffers, with which
    launches. Built on the bucket's first export; the launches are re-planned only when the
    sources' addresses or strides change (a persistent export's sources keep theirs)."""

    positions: tuple[int, ...]  # positions in the bucket of the weights to quantize
    scale_names: tuple[str, ...]
    q: tuple[torch.Tensor, ...]
    scales: tuple[torch.Tensor, ...]
    runs: tuple  # per weight: row runs to quantize from a RowSelection's source, or None
    produced: list[tuple[str, torch.Tensor]]  # per weight: (its name, q), (its scale's name, scale)
    order: tuple[int, ...]  # the output as indices into the bucket's pairs followed by ``produced``
    plan: ExportPlan | None = dataclasses.field(default=None, repr=False, compare=False)  # held: its id keys the memo
    _sources_key: tuple = ()
    _grouped: list = dataclasses.field(default_factory=list)  # kernels.GroupedLaunch, one per input dtype
    _singles: tuple[int, ...] = ()  # jobs (see _jobs) quantized one launch each (unaligned, or no grouped kernel)
    _aliases: tuple = ()  # private aliases of the ``produced`` tensors, made with them (``_check_outputs``)
    _dtypes: list = dataclasses.field(default_factory=list)  # and their dtypes

    @classmethod
    def build(
        cls, bucket: list[tuple[str, Any]], scales: dict, buffers: ExportBuffers, plan: ExportPlan | None = None
    ) -> "BucketQuantizer":
        positions, scale_names, q, s, runs = [], [], [], [], []
        for position, (name, tensor) in enumerate(bucket):
            entry = scales.get(name)
            if entry is None or tensor.dtype == FP8_DTYPE:  # FP8 already: shipped with its own scale
                continue
            index = len(positions)
            positions.append(position)
            scale_names.append(entry.hf_name)
            q.append(buffers.get("fp8", index, tuple(tensor.shape), FP8_DTYPE, tensor.device, name))
            s.append(buffers.get("fp8_scale", index, entry.shape, SCALE_DTYPE, tensor.device, entry.hf_name))
            runs.append(_block_runs(tensor) if isinstance(tensor, RowSelection) else None)
        job_at = {p: i for i, p in enumerate(positions)}
        produced, order = [], []
        for position, (name, _) in enumerate(bucket):
            job = job_at.get(position)
            if job is None:
                order.append(position)
            else:
                order += [len(bucket) + len(produced), len(bucket) + len(produced) + 1]
                produced += [(name, q[job]), (scale_names[job], s[job])]
        return cls(
            positions=tuple(positions),
            scale_names=tuple(scale_names),
            q=tuple(q),
            scales=tuple(s),
            runs=tuple(runs),
            produced=produced,
            order=tuple(order),
            plan=plan,
            _aliases=tuple(None if t.is_meta else t.detach() for _, t in produced),
            _dtypes=[t.dtype for _, t in produced],
        )

    def run(self, sources: list, buffers: ExportBuffers) -> None:
        """Quantize this export's ``sources`` (the bucket's tensors at ``positions``)."""
        self._check_outputs()
        sources = self._resolved(sources)
        key = tuple([(x.data_ptr(), x.stride(0) if x.dim() else 0) for x in sources])
        if key != self._sources_key:
            self._plan_launches(sources)
            self._sources_key = key
        self._launch_grouped()
        if self._singles:
            self._quantize_singles(sources, buffers, resolved=True)

    def launch(self, bucket: list, buffers: ExportBuffers) -> None:
        """Quantize ``bucket`` (plain tensors) whose sources are those the launches were last planned
        for (``quantize_bucket_lists``' steady path): no check of where they are (the outputs are checked)."""
        self._check_outputs()
        self._launch_grouped()
        if self._singles:
            self._quantize_singles([bucket[i][1] for i in self.positions], buffers)

    def pick(self, bucket: list) -> list[tuple[str, Any]]:
        """The output for ``bucket``: its pairs kept in their dtype (as they are: a ``RowSelection``
        stays one), and each quantized weight's ``produced`` pairs in its place (C calls only)."""
        combined = bucket + self.produced
        if len(self.order) == 1:
            return [combined[self.order[0]]]
        return list(operator.itemgetter(*self.order)(combined)) if self.order else []

    def _check_outputs(self) -> None:
        """Raise ``ReboundOutputError`` where a consumer changed one of the tensors this yields every export
        (the launches write where they were made): one ``is_set_to`` and one dtype per output, in C-level maps."""
        outputs = [tensor for _, tensor in self.produced]
        if None in self._aliases or (
            all(map(torch.Tensor.is_set_to, outputs, self._aliases))
            and list(map(operator.attrgetter("dtype"), outputs)) == self._dtypes
        ):
            return
        for (name, tensor), alias, dtype in zip(self.produced, self._aliases, self._dtypes):
            check_not_rebound(tensor, alias, dtype, name)

    def _launch_grouped(self) -> None:
        for launch in self._grouped:
            _cuda_kernels().launch_grouped(launch)

    def _quantize_singles(self, sources: list, buffers: ExportBuffers, *, resolved: bool = False) -> None:
        """The jobs quantized one launch each, from these sources (the bucket's items at ``positions``,
        or ``_resolved`` already)."""
        jobs = list(self._jobs(sources if resolved else self._resolved(sources)))  # views of this export's sources
        for source, q, scale in (jobs[i] for i in self._singles):
            work = None
            if not (source.is_cuda and _kernel_usable("single")):
                work = buffers.get("fp8_work", 0, padded_shape(tuple(source.shape)), torch.float32, source.device)
            quantize_blockwise(source, out=q, scale_out=scale, work=work)

    @property
    def launches(self) -> int:
        """Kernel launches per run: grouped launches plus one per job quantized alone."""
        return len(self._grouped) + len(self._singles)

    @property
    def grouped_launches(self) -> tuple:
        """The grouped launches (``kernels.GroupedLaunch``) a run makes, for benchmarks."""
        return tuple(self._grouped)

    def jobs(self, sources: list) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The ``(source, q, scale)`` jobs ``run`` quantizes for these sources (for benchmarks)."""
        return list(self._jobs(self._resolved(sources)))

    def _resolved(self, sources: list) -> list[torch.Tensor]:
        """What is read: a selection's source where it is quantized by runs, else a tensor (the
        bucket's items at ``positions`` have the kinds they had when this was built)."""
        return [x.source if runs is not None else materialized(x) for x, runs in zip(sources, self.runs)]

    def _jobs(self, sources: list[torch.Tensor]) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``(source, q, scale)`` triples: one per weight, or one per row run of a selection."""
        for source, q, scale, runs in zip(sources, self.q, self.scales, self.runs):
            if runs is None:
                yield source, q, scale
            else:
                yield from block_row_jobs(source, runs, q, scale)

    def _plan_launches(self, sources: list[torch.Tensor]) -> None:
        # Kept: job numbers and launch tables of raw pointers, no tensors (the pool outlives an
        # export; holding views would keep a trainer's offloaded parameters alive).
        self._grouped, singles = _grouped_launches(list(self._jobs(sources)))
        self._singles = tuple(singles)


def _grouped_launches(jobs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> tuple[list, list[int]]:
    """``(source, q, scale)`` jobs as grouped kernel launches (``kernels.GroupedLaunch``, one per dtype
    and device) for the jobs whose source the grouped kernel reads in place and whose ``q`` it writes
    in place, where it runs here; and the indices of the jobs left to quantize one at a time."""
    kernels = _cuda_kernels() if _kernel_usable("grouped") else None
    groups: dict[tuple, list] = {}
    alone = []
    for i, job in enumerate(jobs):
        if kernels is not None and kernels.grouped_takes(job[0]) and kernels.grouped_writes(job[1]):
            groups.setdefault((job[0].dtype, job[0].device), []).append(job)
        else:
            alone.append(i)
    return [kernels.grouped_launch(group) for group in groups.values()], alone


@functools.cache
def _cuda_kernels():
    """The ``fp8.kernels`` module, or None where Triton is not installed (then the torch path runs)."""
    try:
        from mbridge_refit.fp8 import kernels
    except ImportError:
        return None
    return kernels


def _kernel_usable(kind: str) -> bool:
    kernels = _cuda_kernels()
    return kernels is not None and kernels.usable(kind)


def quantizer_path() -> str:
    """``"triton-grouped"``, ``"triton"`` or ``"torch"``: what the FP8 export uses for CUDA tensors here."""
    if not torch.cuda.is_available():
        return "torch"
    return "triton-grouped" if _kernel_usable("grouped") else "triton" if _kernel_usable("single") else "torch"
