"""The convert CLI: parser, help, and bad input ending with a clear message and exit code 2."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import torchrun
from mbridge_refit.convert import ExitCode, build_parser, main


def test_parser_knows_every_subcommand():
    parser = build_parser()
    args = parser.parse_args(["roundtrip", "--hf", "a", "--out", "b", "--tp", "2", "--pp", "2", "--vpp", "2"])
    assert (args.command, args.tp, args.pp, args.vpp, args.ep) == ("roundtrip", 2, 2, 2, 1)
    assert parser.parse_args(["verify", "x", "y"]).command == "verify"
    with pytest.raises(SystemExit):
        parser.parse_args(["roundtrip", "--hf", "a", "--out", "b", "--t", "2"])  # no abbreviations


def test_help_has_examples(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "torchrun --nproc-per-node 4 -m mbridge_refit.convert roundtrip" in text
    assert "exit codes" in text


def roundtrip(nproc, source, out, *flags):
    return torchrun(nproc, ["mbridge_refit.convert", "roundtrip", "--hf", str(source), "--out", str(out), *flags], timeout=300)


def test_missing_input_directory(tmp_path):
    run = roundtrip(1, tmp_path / "nope", tmp_path / "out")
    assert run.returncode == ExitCode.BAD_INPUT, run.output
    assert "does not exist" in run.output
    assert not (tmp_path / "out").exists()


def test_existing_output_without_overwrite(source_checkpoints, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    run = roundtrip(1, source_checkpoints("qwen3-tiny"), out)
    assert run.returncode == ExitCode.BAD_INPUT, run.output
    assert "--overwrite" in run.output
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_unknown_architecture(source_checkpoints, tmp_path):
    source = tmp_path / "weird"
    shutil.copytree(source_checkpoints("qwen3-tiny"), source)
    config = json.loads((source / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (source / "config.json").write_text(json.dumps(config))
    run = roundtrip(1, source, tmp_path / "out")
    assert run.returncode == ExitCode.BAD_INPUT, run.output
    assert "unsupported architecture" in run.output and "NoSuchModelForCausalLM" in run.output
    assert not (tmp_path / "out").exists()


def test_tp_not_dividing_kv_heads_fails_on_every_rank_without_hanging(source_checkpoints, tmp_path):
    # qwen3-tiny has 2 KV heads: tp=4 cannot split them. Launch 4 real ranks: all must exit.
    run = roundtrip(4, source_checkpoints("qwen3-tiny"), tmp_path / "out", "--tp", "4")
    assert run.returncode != 0
    assert "num_key_value_heads=2" in run.output and "tp=4" in run.output
    assert run.output.count("num_key_value_heads=2") == 1, "the same message from every rank: rank 0 prints it once"
    assert run.output.count("(exitcode: 2)") == 4 or "exitcode  : 2" in run.output, run.output[-3000:]
    assert not (tmp_path / "out").exists()


def test_world_size_must_match_layout(source_checkpoints, tmp_path):
    run = roundtrip(1, source_checkpoints("qwen3-tiny"), tmp_path / "out", "--tp", "2")
    assert run.returncode == ExitCode.BAD_INPUT, run.output
    assert "world size 1" in run.output and "--nproc-per-node 2" in run.output


def test_ep_on_a_dense_model(source_checkpoints, tmp_path):
    run = roundtrip(1, source_checkpoints("qwen3-tiny"), tmp_path / "out", "--ep", "2")
    assert run.returncode == ExitCode.BAD_INPUT, run.output
    assert "mixture-of-experts" in run.output


@pytest.mark.parametrize("value", ["0", "-5"])
def test_shard_size_must_be_positive(value, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["roundtrip", "--hf", str(tmp_path), "--out", str(tmp_path / "o"), "--max-shard-bytes", value])
    assert exit_info.value.code == 2
    assert "--max-shard-bytes: must be a positive integer" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
