"""Parameters the plan could miss without a word (tests/ranks/plan_hidden_params_check.py): one that no
mapping names is refused by name, and the embedding copy a multi-token-prediction layer keeps on the last
pipeline stage does not replace the first stage's, which stock exports. Before, the first was dropped from
the export (stock raises on it) and the second made ``model.embed_tokens.weight`` differ from stock's.
"""

from __future__ import annotations

import json

from conftest import REPO, torchrun

SCRIPT = str(REPO / "tests" / "ranks" / "plan_hidden_params_check.py")


def _results(output: str) -> list[dict]:
    return [json.loads(line.split("RESULT ", 1)[1]) for line in output.splitlines() if line.startswith("RESULT ")]


def test_a_parameter_no_mapping_names_is_refused_by_name():
    launch = torchrun(1, [SCRIPT, "--case", "unmapped"])
    assert launch.returncode == 0, launch.output[-4000:]
    (result,) = _results(launch.output)
    assert result["refused"] and "linear_q_proj.layer_norm_weight" in result["refused"], result


def test_the_mtp_embedding_copy_does_not_replace_the_first_stages():
    launch = torchrun(2, [SCRIPT, "--case", "mtp"])
    assert launch.returncode == 0, launch.output[-4000:]
    results = _results(launch.output)
    assert len(results) == 2, launch.output[-4000:]
    for result in results:
        assert result["fallback"] is None and result["names_equal"] and result["different"] == [], result
