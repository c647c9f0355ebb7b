"""The refit verifier: Megatron (trainer) vs transformers (engine) log-probabilities after a refit.

CPU ranks (gloo, local layer spec), both models in float32 so that a refit error cannot hide in
bf16 kernel noise (in bf16 on CPU the two implementations differ by ~1e-3 mean |d logprob|; the
bf16 <= 1e-3 target is checked on the GPU host). A perturbed weight must fail with exit code 1.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import torchrun
from mbridge_refit.tools.verify_refit import (
    LogprobComparison,
    RefitMismatch,
    VerifyInputError,
    compare_logprobs,
    token_logprobs,
)


def test_compare_logprobs_numbers():
    ref = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]])
    got = ref + torch.tensor([[0.0, 0.1], [-0.2, 0.0]])
    result = compare_logprobs(ref, got)
    assert result.tokens == 4
    assert result.mean_abs_diff == pytest.approx(0.075)
    assert result.max_abs_diff == pytest.approx(0.2)
    assert result.mult_prob_error == pytest.approx((2 + torch.tensor([0.1, 0.2]).double().exp().sum().item()) / 4)


def test_check_raises_with_numbers_and_passes_within_tolerance():
    LogprobComparison(tokens=3, mean_abs_diff=1e-4, max_abs_diff=1e-3, mult_prob_error=1.0001).check(1e-3)
    with pytest.raises(RefitMismatch, match=r"mean \|d logprob\| 2\.000e-03 > tolerance 1\.0e-03"):
        LogprobComparison(tokens=3, mean_abs_diff=2e-3, max_abs_diff=1e-2, mult_prob_error=1.002).check(1e-3)
    with pytest.raises(RefitMismatch):
        LogprobComparison(tokens=3, mean_abs_diff=float("nan"), max_abs_diff=0, mult_prob_error=1).check(1e-3)


def test_compare_rejects_shape_mismatch():
    with pytest.raises(VerifyInputError, match="shapes differ"):
        compare_logprobs(torch.zeros(2, 3), torch.zeros(2, 4))


def test_token_logprobs_picks_next_token():
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [0.1, 0.8, 0.1], [1 / 3, 1 / 3, 1 / 3]]]))
    tokens = torch.tensor([[0, 1, 2]])
    assert torch.allclose(token_logprobs(logits, tokens), torch.log(torch.tensor([[0.25, 0.1]])))


CASES = [
    ("qwen3-tiny", 1, []),
    ("qwen3-tiny", 2, ["--tp", "2"]),
    ("llama-tied-tiny", 2, ["--tp", "2"]),
]


@pytest.mark.parametrize(("recipe", "nproc", "flags"), CASES, ids=[f"{r}-{n}" for r, n, _ in CASES])
def test_verifier_passes_after_refit(tmp_path, recipe, nproc, flags):
    out = tmp_path / "result.json"
    run = torchrun(
        nproc,
        ["mbridge_refit.convert", "verify-refit", "--recipe", recipe, "--device", "cpu", "--batch", "2", "--seq", "32",
         "--dtype", "float32", "--tolerance", "1e-5", "--json", str(out), *flags],
    )
    assert run.returncode == 0, run.output[-4000:]
    result = json.loads(out.read_text())
    assert result["passed"] and result["tokens"] == 2 * 31
    assert result["mean_abs_diff"] <= 1e-5 and result["mult_prob_error"] < 1.0001
    noise = result["engine_eager_vs_default_attention"]  # the engine against itself, eager vs sdpa
    assert noise is not None and noise["tokens"] == 2 * 31 and noise["mean_abs_diff"] <= 1e-5


def test_verifier_fails_loudly_on_a_perturbed_weight(tmp_path):
    out = tmp_path / "result.json"
    run = torchrun(
        2,
        ["mbridge_refit.convert", "verify-refit", "--recipe", "qwen3-tiny", "--device", "cpu", "--tp", "2", "--batch", "2",
         "--seq", "32", "--dtype", "float32", "--tolerance", "1e-5", "--perturb", "model.layers.1.mlp.down_proj.weight",
         "--json", str(out)],
    )
    assert run.returncode == 1, run.output[-4000:]
    assert "refit mismatch" in run.output or "> tolerance" in run.output
    result = json.loads(out.read_text())
    assert not result["passed"] and result["mean_abs_diff"] > 1e-3  # >100x the unperturbed difference


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--recipe", "qwen3-tiny", "--device", "cpu", "--seq", "1"], "--seq >= 2"),
        (["--recipe", "qwen3-tiny", "--device", "cpu", "--tp", "2"], "world size"),
        (["--shape", "qwen3-8b", "--device", "cpu"], "GPU"),
        (["--recipe", "qwen3-tiny", "--device", "cpu", "--perturb", "no.such.weight"], "not a name the export yields"),
        (["--recipe", "qwen3-moe-tiny", "--device", "cpu"], "verify mixture-of-experts models on a GPU"),
    ],
)
def test_verifier_bad_input_exit_2(args, message):
    run = torchrun(1, ["mbridge_refit.convert", "verify-refit", *args])
    assert run.returncode == 2, run.output[-3000:]
    assert message in run.output


class _StubLLM:
    """``vllm.LLM.generate`` as far as prompt logprobs go: per prompt, None for the first token,
    then ``{token: Logprob}`` dicts (``drop`` leaves one token's entry out)."""

    def __init__(self, table: torch.Tensor, drop: tuple[int, int] | None = None) -> None:
        self.table, self.drop = table, drop

    def generate(self, prompts, params, use_tqdm=False):
        from types import SimpleNamespace

        outputs = []
        for row, prompt in enumerate(prompts):
            ids = prompt["prompt_token_ids"]
            steps = [None] + [
                {} if (row, t) == self.drop else {token: SimpleNamespace(logprob=float(self.table[row, t])), 999: SimpleNamespace(logprob=0.0)}
                for t, token in enumerate(ids[1:])
            ]
            outputs.append(SimpleNamespace(prompt_logprobs=steps))
        return outputs


@pytest.fixture
def stub_vllm(monkeypatch):
    import sys
    from types import ModuleType

    module = ModuleType("vllm")
    module.SamplingParams = lambda **kwargs: kwargs
    monkeypatch.setitem(sys.modules, "vllm", module)


def test_vllm_logprobs_reads_the_engines_prompt_logprobs(stub_vllm):
    from mbridge_refit.tools.verify_refit import vllm_logprobs

    tokens = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    table = -torch.rand(2, 3)
    assert torch.equal(vllm_logprobs(_StubLLM(table), tokens), table.float())
    with pytest.raises(VerifyInputError, match="no log-probability for 1 prompt token"):
        vllm_logprobs(_StubLLM(table, drop=(1, 2)), tokens)


def test_perturbation_stays_finite_in_fp8():
    from mbridge_refit.tools.verify_refit import _perturbed

    weight = (torch.randn(64, 64) * 200).clamp(-448, 448).to(torch.float8_e4m3fn)  # e4m3fn's finite range
    perturbed = _perturbed(weight)
    assert perturbed.dtype == weight.dtype and torch.isfinite(perturbed.float()).all()
    assert not torch.equal(perturbed.view(torch.uint8), weight.view(torch.uint8))
