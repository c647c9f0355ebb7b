"""Two ways a model's parameters can hide from the plan, checked against stock on CPU ranks (run by
tests/test_plan_hidden_params.py):

* ``--case unmapped`` (one rank): DeepSeek-V2 without ``q_lora_rank`` (DeepSeek-V2-Lite's shape), whose MLA
  fuses a Q norm into ``linear_q_proj`` that no mapping names; the plan must refuse it by name (stock's
  export raises on it), not export the rest.
* ``--case mtp`` (two ranks, PP2): DeepSeek-V3 with a multi-token-prediction layer, whose last stage keeps its
  own copy of the embedding under the first stage's name; the copies are made to differ, and every tensor
  of ours must equal stock's (which exports the first stage's copy).

Prints one line ``RESULT <json>`` per rank.
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
from pathlib import Path

import torch

from mbridge_refit.convert.session import distributed_session
from mbridge_refit.plan.entries import PlanError
from mbridge_refit.plan.layout import ParallelLayout
from mbridge_refit.testing import conformance, tiny_models

CASES = {
    "unmapped": ("DeepseekV2ForCausalLM", {"q_lora_rank": None}, ParallelLayout()),
    "mtp": ("DeepseekV3ForCausalLM", {"num_nextn_predict_layers": 1}, ParallelLayout(pp=2)),
}


def with_fields(fields: dict):
    plain = tiny_models.tiny_config

    def config(model: str, **kwargs):
        made = plain(model, **kwargs)
        for name, value in fields.items():
            setattr(made, name, value)
        return made

    tiny_models.tiny_config = config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=sorted(CASES), required=True)
    case = CASES[parser.parse_args().case]
    architecture, fields, layout = case
    with_fields(fields)
    with distributed_session(layout, device=torch.device("cpu"), timeout=datetime.timedelta(minutes=5)) as env:
        with tempfile.TemporaryDirectory() as work, conformance.restored_environment():
            bridge, chunks, _ = conformance.random_megatron_model(
                architecture, layout, device=torch.device("cpu"), work_dir=Path(work)
            )
            result: dict = {"rank": env.rank}
            if architecture == "DeepseekV2ForCausalLM":
                try:
                    bridge.export_plan(chunks)
                    result["refused"] = None
                except PlanError as err:
                    result["refused"] = str(err)
            else:
                with torch.no_grad():  # the stages' copies of the embedding differ (training keeps them equal)
                    dict(chunks[0].named_parameters())["embedding.word_embeddings.weight"].add_(float(env.rank))
                stock = {n: t.clone() for n, t in bridge.export_hf_weights_stock(chunks, show_progress=False)}
                ours = {n: t.clone() for n, t in bridge.export_hf_weights(chunks, show_progress=False)}
                result["fallback"] = bridge.export_diagnostics().fallback_reason
                result["names_equal"] = list(stock) == list(ours)
                result["different"] = [n for n in stock if n in ours and not torch.equal(stock[n], ours[n])]
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
