"""The refit verifier: the engine's weights against Megatron-Bridge's export bit for bit, and
Megatron (trainer) vs transformers (engine) log-probabilities after a refit.

CPU ranks (gloo, local layer spec). The weights check is exact in any dtype; the log-probability
comparison runs in float32 where a tight tolerance is wanted (in bf16 on CPU the two
implementations differ by ~1e-3 mean |d logprob|, within the derived bf16 tolerance). A
perturbed weight must fail with exit code 1, naming the tensor; the README's example must pass.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import torchrun

from mbridge_refit.convert.refit_verifier import (
    LogprobComparison,
    RefitMismatch,
    RefitVerdict,
    VerifyInputError,
    WeightsCheck,
    compare_logprobs,
    compare_weights,
    numerics_tolerance,
    token_logprobs,
    tolerance_from_reference,
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


def test_derived_tolerance_is_the_dtypes_eps_or_the_engines_own_spread():
    assert numerics_tolerance(torch.bfloat16) == (4 * 2**-7, "derived: 4 x bfloat16 eps")
    assert numerics_tolerance(torch.float32)[0] == 4 * torch.finfo(torch.float32).eps
    noisy = LogprobComparison(tokens=8, mean_abs_diff=0.025, max_abs_diff=0.1, mult_prob_error=1.03)
    tolerance, source = numerics_tolerance(torch.bfloat16, noisy)
    assert tolerance == pytest.approx(0.1) and "eager-vs-default attention" in source
    reference = LogprobComparison(tokens=8, mean_abs_diff=0.2, max_abs_diff=1, mult_prob_error=1.2)
    assert tolerance_from_reference(reference) == pytest.approx(0.8)


def _engine_sink():
    from mbridge_refit.sinks.model_update import HFModelUpdateSink

    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -0.0, 2.0], [3.0, 4.0, 5.0]]))
        model.bias.copy_(torch.tensor([0.5, float("nan")]))
    return HFModelUpdateSink(model), model


def test_weights_are_compared_bit_for_bit():
    sink, model = _engine_sink()
    same = [("weight", model.weight.detach().clone()), ("bias", model.bias.detach().clone())]
    assert compare_weights(sink, same, "oracle") == WeightsCheck(against="oracle", compared=2, differing=())
    flipped = model.weight.detach().clone()
    flipped.view(-1).view(torch.int32)[4] ^= 1  # one bit of one element
    signed = model.weight.detach().clone()
    signed[0, 1] = 0.0  # +0.0 where the engine holds -0.0: equal as numbers, not as bytes
    for oracle_weight in (flipped, signed):
        check = compare_weights(sink, [("weight", oracle_weight), ("bias", model.bias.detach().clone())], "oracle")
        assert not check.exact and check.differing == ("weight",)
    check = compare_weights(sink, [("weight", model.weight.detach().double()), ("extra", torch.zeros(1))], "oracle")
    assert check.differing == ("weight", "extra (no engine tensor)")


def test_verdict_names_the_failed_question():
    close = LogprobComparison(tokens=4, mean_abs_diff=0.2, max_abs_diff=0.5, mult_prob_error=1.2)
    exact = WeightsCheck(against="the oracle", compared=3, differing=())
    assert RefitVerdict(weights=exact, numerics=close, tolerance=None, tolerance_from="none").check().passed
    with pytest.raises(RefitMismatch, match=r"not the trainer's: 1 of 3 tensors differ bit for bit from the oracle"):
        RefitVerdict(
            weights=WeightsCheck(against="the oracle", compared=3, differing=("w",)),
            numerics=close,
            tolerance=1.0,
            tolerance_from="given",
        ).check()
    with pytest.raises(
        RefitMismatch, match=r"exact \(3 tensors bit for bit\), but .* 2\.000e-01 > tolerance 1\.000e-01"
    ):
        RefitVerdict(weights=exact, numerics=close, tolerance=0.1, tolerance_from="given").check()


class _StubRefit:
    """``VLLMRefit`` as ``verify_vllm_refit`` uses it: a refit, the engine's fingerprints."""

    def __init__(self, fingerprints):
        self.llm, self._fingerprints = None, fingerprints

    def refit(self, bridge, chunks, **kwargs):
        return None

    def fingerprints(self):
        return dict(self._fingerprints)


def test_vllm_verifier_separates_weights_from_numerics(monkeypatch):
    """Issue #31: an exact refit of a model whose engine numerics sit 0.2 from Megatron's (the
    DeepSeek-V3 shape in bf16) passes; a wrong parameter fails whatever the numerics."""
    from mbridge_refit.convert import refit_verifier as module

    trainer = -torch.rand(2, 5)
    monkeypatch.setattr(module, "megatron_logprobs", lambda chunks, tokens, vocab: trainer)
    monkeypatch.setattr(module, "vllm_logprobs", lambda llm, tokens: trainer + 0.2)
    bridge = type("B", (), {"hf_pretrained": type("P", (), {"vocab_size": 8})()})()
    disk = {"a": (1, 2), "b": (3, 4)}
    kwargs = dict(bridge=bridge, chunks=[], tokens=torch.zeros(2, 6, dtype=torch.long), sender=True)
    verdict = module.verify_vllm_refit(_StubRefit(disk), reference_fingerprints=disk, **kwargs)
    assert verdict.weights.exact and verdict.numerics.mean_abs_diff == pytest.approx(0.2) and verdict.tolerance is None
    reference = LogprobComparison(tokens=10, mean_abs_diff=0.2, max_abs_diff=0.2, mult_prob_error=1.22)
    assert module.verify_vllm_refit(
        _StubRefit(disk), reference_fingerprints=disk, tolerance=tolerance_from_reference(reference), **kwargs
    ).passed
    with pytest.raises(RefitMismatch, match=r"1 of 2 tensors differ .*\['b'\]"):
        wrong = _StubRefit({**disk, "b": (3, 5)})
        module.verify_vllm_refit(wrong, reference_fingerprints=disk, tolerance=1.0, **kwargs)
    with pytest.raises(VerifyInputError, match="nothing to check"):
        module.verify_vllm_refit(_StubRefit(disk), **kwargs)


README_EXAMPLE = ["mbridge_refit.convert", "verify-refit", "--recipe", "qwen3-tiny", "--device", "cpu"]


def test_readme_example_passes_by_default(tmp_path):
    """``convert verify-refit --recipe qwen3-tiny --device cpu``, the README's and ``--help``'s
    example, in its default bf16: weights exact, log-probabilities within the derived tolerance."""
    out = tmp_path / "result.json"
    run = torchrun(1, [*README_EXAMPLE, "--json", str(out)])
    assert run.returncode == 0, run.output[-4000:]
    result = json.loads(out.read_text())
    assert result["passed"] and result["weights"]["exact"] and result["weights"]["compared"] > 10
    assert result["tolerance_from"].startswith("derived") and result["mean_abs_diff"] < result["tolerance"]


def test_a_perturbed_weight_fails_the_weights_check_by_default(tmp_path):
    out = tmp_path / "result.json"
    victim = "model.layers.1.mlp.down_proj.weight"
    run = torchrun(1, [*README_EXAMPLE, "--batch", "1", "--seq", "16", "--perturb", victim, "--json", str(out)])
    assert run.returncode == 1, run.output[-4000:]
    assert "the engine's weights are not the trainer's" in run.output and victim in run.output
    result = json.loads(out.read_text())
    assert not result["passed"] and result["weights"]["differing"] == [victim]


def test_numerics_beyond_a_given_tolerance_fail_with_exact_weights(tmp_path):
    run = torchrun(1, [*README_EXAMPLE, "--batch", "1", "--seq", "16", "--tolerance", "1e-9"])
    assert run.returncode == 1, run.output[-4000:]
    assert "the engine's weights are exact" in run.output and "> tolerance 1.000e-09 (given" in run.output


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
        [
            "mbridge_refit.convert",
            "verify-refit",
            "--recipe",
            recipe,
            "--device",
            "cpu",
            "--batch",
            "2",
            "--seq",
            "32",
            "--dtype",
            "float32",
            "--tolerance",
            "1e-5",
            "--json",
            str(out),
            *flags,
        ],
    )
    assert run.returncode == 0, run.output[-4000:]
    result = json.loads(out.read_text())
    assert result["passed"] and result["tokens"] == 2 * 31 and result["weights"]["exact"]
    assert result["mean_abs_diff"] <= 1e-5 and result["mult_prob_error"] < 1.0001
    noise = result["engine_eager_vs_default_attention"]  # the engine against itself, eager vs sdpa
    assert noise is not None and noise["tokens"] == 2 * 31 and noise["mean_abs_diff"] <= 1e-5


def test_verifier_fails_loudly_on_a_perturbed_weight(tmp_path):
    out = tmp_path / "result.json"
    run = torchrun(
        2,
        [
            "mbridge_refit.convert",
            "verify-refit",
            "--recipe",
            "qwen3-tiny",
            "--device",
            "cpu",
            "--tp",
            "2",
            "--batch",
            "2",
            "--seq",
            "32",
            "--dtype",
            "float32",
            "--tolerance",
            "1e-5",
            "--perturb",
            "model.layers.1.mlp.down_proj.weight",
            "--json",
            str(out),
        ],
    )
    assert run.returncode == 1, run.output[-4000:]
    assert "refit mismatch" in run.output
    result = json.loads(out.read_text())
    assert not result["passed"] and result["mean_abs_diff"] > 1e-3  # >100x the unperturbed difference
    assert result["weights"]["differing"] == ["model.layers.1.mlp.down_proj.weight"]


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
                {}
                if (row, t) == self.drop
                else {token: SimpleNamespace(logprob=float(self.table[row, t])), 999: SimpleNamespace(logprob=0.0)}
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
    from mbridge_refit.convert.refit_verifier import vllm_logprobs

    tokens = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    table = -torch.rand(2, 3)
    assert torch.equal(vllm_logprobs(_StubLLM(table), tokens), table.float())
    with pytest.raises(VerifyInputError, match="no log-probability for 1 prompt token"):
        vllm_logprobs(_StubLLM(table, drop=(1, 2)), tokens)


def test_perturbation_stays_finite_in_fp8():
    from mbridge_refit.convert.refit_verifier import _perturbed

    weight = (torch.randn(64, 64) * 200).clamp(-448, 448).to(torch.float8_e4m3fn)  # e4m3fn's finite range
    perturbed = _perturbed(weight)
    assert perturbed.dtype == weight.dtype and torch.isfinite(perturbed.float()).all()
    assert not torch.equal(perturbed.view(torch.uint8), weight.view(torch.uint8))
