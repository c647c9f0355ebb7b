"""Per-rank checks of RefitBridge in the stock calls RL frameworks make; run under torchrun by
tests/test_dropin.py (CPU, gloo).

Usage: dropin_check.py --hf CKPT --result DIR [--tp N --pp N --vpp N --ep N] --checks NAME,NAME,...

Every rank loads the checkpoint into its shard of the model and runs the named checks in order.
The reference is a plain Megatron-Bridge ``AutoBridge``'s export with the same arguments (its
code, its own model bridges), compared name by name, in order, bit for bit. Whether RefitBridge
ran its plan is read from a spy on its model bridge's stock stream (never called on the plan's
path) and from ``export_diagnostics()``. Each verdict (None, or what failed) is written to
DIR/rank<R>.json after every check, so a check that crashes a rank leaves the earlier ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rank_checks import checker_parser, checkpoint_session  # noqa: E402

from mbridge_refit.convert.flags import layout_from_flags  # noqa: E402

CHECKS = {}


class CheckFailed(AssertionError):
    pass


def check(fn):
    CHECKS[fn.__name__.removeprefix("check_")] = fn
    return fn


@dataclasses.dataclass
class Context:
    path: Path
    bridge: object  # the RefitBridge the model was built and loaded with
    chunks: list
    stock: object  # a plain AutoBridge of the same checkpoint

    def tasks(self):
        """The tasks as NeMo-RL builds them: ``get_conversion_tasks`` once, ``None`` dropped."""
        return [t for t in self.bridge.get_conversion_tasks(self.chunks) if t is not None]

    def stock_export(self, **kwargs):
        return snapshot(self.stock.export_hf_weights(self.chunks, show_progress=False, **kwargs))


def snapshot(stream) -> list[tuple[str, torch.Tensor]]:
    return [(name, tensor.detach().cpu().clone()) for name, tensor in stream]


def expect_same(ours, stock, what: str) -> None:
    names, stock_names = [n for n, _ in ours], [n for n, _ in stock]
    if names != stock_names:
        pairs = enumerate(zip(names, stock_names))
        first = next((i for i, (a, b) in pairs if a != b), min(len(names), len(stock_names)))
        raise CheckFailed(
            f"{what}: {len(names)} names vs stock's {len(stock_names)}; first difference at {first}: "
            f"{names[first : first + 2]} vs {stock_names[first : first + 2]}"
        )
    for (name, a), (_, b) in zip(ours, stock):
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(_bytes(a), _bytes(b)):
            raise CheckFailed(f"{what}: {name} != stock ({a.dtype} {list(a.shape)}, {b.dtype} {list(b.shape)})")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@contextlib.contextmanager
def stock_stream_calls(bridge, chunks):
    """Counts calls of the stock stream on the model bridge ``bridge`` keeps for ``chunks``."""
    model_bridge = bridge.megatron_model_bridge(chunks)
    original = model_bridge.stream_weights_megatron_to_hf
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs.get("conversion_tasks"))
        return original(*args, **kwargs)

    model_bridge.stream_weights_megatron_to_hf = spy
    try:
        yield calls
    finally:
        del model_bridge.stream_weights_megatron_to_hf


def ours_on_the_plan(ctx: Context, what: str, **kwargs) -> list:
    """RefitBridge's export with ``kwargs``, checked to have run the plan."""
    with stock_stream_calls(ctx.bridge, ctx.chunks) as calls:
        ours = snapshot(ctx.bridge.export_hf_weights(ctx.chunks, show_progress=False, **kwargs))
    diagnostics = ctx.bridge.export_diagnostics()
    if calls or not diagnostics.planned or diagnostics.fallback_reason is not None:
        raise CheckFailed(
            f"{what}: ran the stock export (stock stream called {len(calls)} times, planned={diagnostics.planned}, "
            f"fallback_reason={diagnostics.fallback_reason!r})"
        )
    return ours


def ours_on_stock(ctx: Context, what: str, reason_says: str, **kwargs) -> list:
    """RefitBridge's export with ``kwargs``, checked to have run the stock path and said why."""
    with stock_stream_calls(ctx.bridge, ctx.chunks) as calls:
        ours = snapshot(ctx.bridge.export_hf_weights(ctx.chunks, show_progress=False, **kwargs))
    reason = ctx.bridge.export_diagnostics().fallback_reason
    if len(calls) != 1 or reason is None or reason_says not in reason:
        raise CheckFailed(
            f"{what}: expected the stock path with a reason naming {reason_says!r}; "
            f"stock stream called {len(calls)} times, fallback_reason={reason!r}"
        )
    return ours


# --- conversion_tasks ----------------------------------------------------------------------------


@check
def check_nemo_rl_tasks(ctx: Context) -> None:
    """Every task, built once and passed on every export (NeMo-RL's refit): the plan, = stock."""
    tasks = ctx.tasks()
    stock = ctx.stock_export(conversion_tasks=tasks)
    for cache in (False, True, True):
        what = f"all tasks (cache={cache})"
        ours = ours_on_the_plan(ctx, what, conversion_tasks=tasks, reuse_buffer_from_cache=cache)
        expect_same(ours, stock, what)


@check
def check_task_subsets(ctx: Context) -> None:
    """Parts of the task list in their order (a chunk, every third task, one task): the plan,
    yielding exactly what stock yields for them, in stock's order."""
    tasks = ctx.tasks()
    third = len(tasks) // 3
    subsets = {"middle third": tasks[third : 2 * third], "every third": tasks[::3], "first task": tasks[:1], "none": []}
    for what, subset in subsets.items():
        ours = ours_on_the_plan(ctx, what, conversion_tasks=subset)
        expect_same(ours, ctx.stock_export(conversion_tasks=subset), what)
        if what != "none" and not ours:
            raise CheckFailed(f"{what}: yielded nothing")


class LazyTasks:
    """A task list read on demand (slime maps its tasks lazily, with a length)."""

    def __init__(self, tasks):
        self.tasks, self.passes = tasks, 0

    def __len__(self):
        return len(self.tasks)

    def __iter__(self):
        self.passes += 1
        return iter(self.tasks)


@check
def check_lazy_tasks(ctx: Context) -> None:
    """A lazy iterable of tasks: the stock path, read once, with the reason."""
    lazy, stock_lazy = LazyTasks(ctx.tasks()), LazyTasks(ctx.tasks())
    ours = ours_on_stock(ctx, "lazy tasks", "not a list", conversion_tasks=lazy)
    expect_same(ours, ctx.stock_export(conversion_tasks=stock_lazy), "lazy tasks")
    if lazy.passes != stock_lazy.passes:
        raise CheckFailed(f"lazy tasks read {lazy.passes} times, stock reads them {stock_lazy.passes} times")


def doubled(tasks, rank: int | None = None):
    """The tasks with each local parameter replaced by twice its value (exact in bf16), on every
    rank or on ``rank`` only."""
    if rank is not None and dist.get_rank() != rank:
        return tasks
    return [
        t if t.param_weight is None else dataclasses.replace(t, param_weight=2 * t.param_weight.detach()) for t in tasks
    ]


@check
def check_replaced_weights(ctx: Context) -> None:
    """Tasks carrying other tensors than the model's (slime swaps in its own copies): stock's
    export of those tensors, with the reason."""
    tasks = doubled(ctx.tasks())
    ours = ours_on_stock(ctx, "replaced weights", "another tensor", conversion_tasks=tasks)
    expect_same(ours, ctx.stock_export(conversion_tasks=tasks), "replaced weights")


@check
def check_replaced_on_one_rank(ctx: Context) -> None:
    """Replaced tensors on the last rank only: every rank takes the stock path (no rank runs the
    plan while another runs stock), the others with the agreed reason."""
    tasks = doubled(ctx.tasks(), rank=dist.get_world_size() - 1)
    ours = ours_on_stock(ctx, "replaced on one rank", "", conversion_tasks=tasks)
    expect_same(ours, ctx.stock_export(conversion_tasks=tasks), "replaced on one rank")


@check
def check_reordered_tasks(ctx: Context) -> None:
    """Tasks out of the bridge's order: stock's order, with the reason."""
    tasks = list(reversed(ctx.tasks()[:6]))
    ours = ours_on_stock(ctx, "reordered tasks", "order", conversion_tasks=tasks)
    expect_same(ours, ctx.stock_export(conversion_tasks=tasks), "reordered tasks")


@check
def check_foreign_tasks(ctx: Context) -> None:
    """Tasks of another model (another build of the same architecture): stock's export of that
    model, with the reason."""
    from mbridge_refit.models.builder import BuildOptions, build_model

    layout = layout_from_flags(ARGS)
    other = build_model(ctx.stock, layout, BuildOptions(device=torch.device("cpu"), params_dtype=torch.bfloat16))
    tasks = [t for t in ctx.stock.get_conversion_tasks(other) if t is not None]
    ours = ours_on_stock(ctx, "foreign tasks", "another tensor", conversion_tasks=tasks)
    expect_same(ours, ctx.stock_export(conversion_tasks=tasks), "foreign tasks")


# --- weight_dtype --------------------------------------------------------------------------------


@check
def check_weight_dtype_same(ctx: Context) -> None:
    """weight_dtype equal to the parameters' (bf16): the plan, = stock."""
    ours = ours_on_the_plan(ctx, "weight_dtype=bfloat16", weight_dtype=torch.bfloat16)
    expect_same(ours, ctx.stock_export(weight_dtype=torch.bfloat16), "weight_dtype=bfloat16")


@check
def check_weight_dtype_other(ctx: Context) -> None:
    """weight_dtype=float32 on bf16 parameters: stock's cast, with the reason."""
    ours = ours_on_stock(ctx, "weight_dtype=float32", "weight_dtype", weight_dtype=torch.float32)
    expect_same(ours, ctx.stock_export(weight_dtype=torch.float32), "weight_dtype=float32")
    if {t.dtype for _, t in ours} != {torch.float32}:
        raise CheckFailed("weight_dtype=float32 did not cast")


# --- the model bridge ----------------------------------------------------------------------------


@check
def check_model_bridge_override(ctx: Context) -> None:
    """A subclass whose ``_model_bridge`` returns its own model bridge: the export (on the plan)
    uses that one."""
    from mbridge_refit.bridge import RefitBridge

    made = []

    class Overriding(RefitBridge):
        @property
        def _model_bridge(self):
            model_bridge = super()._model_bridge
            if not getattr(model_bridge, "from_override", False):
                model_bridge.from_override = True
                made.append(model_bridge)
            return model_bridge

    bridge = Overriding.from_hf_pretrained(ctx.path)
    ours = ours_on_the_plan(dataclasses.replace(ctx, bridge=bridge), "overridden _model_bridge")
    expect_same(ours, ctx.stock_export(), "overridden _model_bridge")
    if not made or bridge.megatron_model_bridge(ctx.chunks) is not made[-1]:
        raise CheckFailed(f"the export kept a model bridge the override did not make ({len(made)} made)")


class LogCounter(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def planning_raises(on_rank: int | None = None):
    """Test-only: describing a parameter raises AttributeError (an unexpected model bridge), on
    every rank or on ``on_rank`` only."""
    import mbridge_refit.plan.build as build

    original = build._local_spec

    def broken(task, *args, **kwargs):
        if on_rank is None or dist.get_rank() == on_rank:
            raise AttributeError(f"'UnexpectedMapping' object has no attribute 'tp_size' ({task.global_param_name})")
        return original(task, *args, **kwargs)

    build._local_spec = broken
    try:
        yield
    finally:
        build._local_spec = original


def planning_error_check(ctx: Context, on_rank: int | None) -> None:
    from mbridge_refit.bridge import RefitBridge

    bridge = RefitBridge.from_hf_pretrained(ctx.path)
    fresh = dataclasses.replace(ctx, bridge=bridge)
    logs = LogCounter()
    logging.getLogger("mbridge_refit").addHandler(logs)
    try:
        with planning_raises(on_rank):
            for _ in range(2):
                ours = ours_on_stock(fresh, "planning error", "AttributeError")
    finally:
        logging.getLogger("mbridge_refit").removeHandler(logs)
    expect_same(ours, ctx.stock_export(), "planning error")
    said = [m for m in logs.messages if "AttributeError" in m]
    if len(said) != 1:
        raise CheckFailed(f"the fallback was logged {len(said)} times over two exports, not once: {said[:2]}")


@check
def check_planning_error(ctx: Context) -> None:
    """An AttributeError while planning, on every rank: the stock path with its reason, logged once."""
    planning_error_check(ctx, on_rank=None)


@check
def check_planning_error_on_one_rank(ctx: Context) -> None:
    """An AttributeError while planning on the last rank only: every rank takes the stock path."""
    planning_error_check(ctx, on_rank=dist.get_world_size() - 1)


def main() -> None:
    global ARGS
    parser = checker_parser()
    parser.add_argument("--checks", required=True, help="comma-separated names: " + ", ".join(CHECKS))
    ARGS = parser.parse_args()
    names = ARGS.checks.split(",")
    from megatron.bridge import AutoBridge

    with checkpoint_session(ARGS.hf, layout_from_flags(ARGS)) as (bridge, chunks):
        ctx = Context(path=ARGS.hf, bridge=bridge, chunks=chunks, stock=AutoBridge.from_hf_pretrained(ARGS.hf))
        verdicts: dict[str, str | None] = {}
        out = ARGS.result / f"rank{dist.get_rank()}.json"
        ARGS.result.mkdir(parents=True, exist_ok=True)
        for name in names:
            try:
                CHECKS[name](ctx)
                verdicts[name] = None
            except Exception as err:  # recorded; the test reports it
                verdicts[name] = f"{type(err).__name__}: {err}"
                print(f"[rank{dist.get_rank()}] {name}: {traceback.format_exc()}", file=sys.stderr, flush=True)
            out.write_text(json.dumps(verdicts))


if __name__ == "__main__":
    main()
