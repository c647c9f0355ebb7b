"""RefitBridge in the stock calls RL frameworks make, on real ranks under torchrun (CPU, gloo).

``conversion_tasks`` built as NeMo-RL builds them (all, once) and parts of them in their order
run the plan and equal stock's export bit for bit, in stock's order; tasks the plan does not stand
for (a lazy iterable, replaced tensors, another order, another model's) and a ``weight_dtype`` that
casts run the stock path with the reason, every rank alike; a subclass's ``_model_bridge`` is the
one used; an exception while planning, on every rank or on one, falls back on every rank with its
reason, logged once. The checks run inside the ranks (tests/ranks/dropin_check.py), one launch
per layout; each check is one test here.
"""

from __future__ import annotations

import json

import pytest
from conftest import REPO, torchrun

pytestmark = pytest.mark.multirank
CHECKER = str(REPO / "tests" / "ranks" / "dropin_check.py")

LAYOUTS = {  # name -> (recipe, flags, ranks)
    "tp1": ("qwen3-tiny", [], 1),
    "tp2": ("qwen3-tiny", ["--tp", "2"], 2),
    "pp2-tied": ("llama-tied-tiny", ["--pp", "2"], 2),
    "ep2": ("qwen3-moe-tiny", ["--ep", "2"], 2),
}
CHECKS = {
    "tp1": [
        "nemo_rl_tasks",
        "task_subsets",
        "lazy_tasks",
        "replaced_weights",
        "reordered_tasks",
        "foreign_tasks",
        "weight_dtype_same",
        "weight_dtype_other",
        "model_bridge_override",
        "planning_error",
    ],
    "tp2": ["nemo_rl_tasks", "task_subsets", "replaced_on_one_rank", "planning_error_on_one_rank"],
    "pp2-tied": ["nemo_rl_tasks", "task_subsets"],
    "ep2": ["nemo_rl_tasks", "task_subsets"],
}


@pytest.fixture(scope="module")
def verdicts(source_checkpoints, tmp_path_factory):
    """``verdicts(layout)`` -> one dict (check -> None or what failed) per rank, from one launch."""
    done: dict[str, list[dict]] = {}

    def run(layout: str) -> list[dict]:
        if layout not in done:
            recipe, flags, ranks = LAYOUTS[layout]
            result = tmp_path_factory.mktemp(f"dropin-{layout}")
            args = [CHECKER, "--hf", str(source_checkpoints(recipe)), "--result", str(result), *flags]
            launch = torchrun(ranks, [*args, "--checks", ",".join(CHECKS[layout])])
            reports = [result / f"rank{r}.json" for r in range(ranks)]
            done[layout] = [json.loads(p.read_text()) if p.exists() else {} for p in reports]
            if launch.returncode != 0:
                print(launch.output[-6000:])
        return done[layout]

    return run


@pytest.mark.parametrize(("layout", "check"), [(layout, name) for layout, names in CHECKS.items() for name in names])
def test_stock_call(layout, check, verdicts):
    per_rank = [report.get(check, "not run: the rank stopped before it") for report in verdicts(layout)]
    assert per_rank == [None] * len(per_rank), per_rank
