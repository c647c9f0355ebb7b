"""The convert CLI: parser, help, and bad input ending with a clear message and exit code 2."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from conftest import torchrun

from mbridge_refit.convert import ExitCode, build_parser, main
from mbridge_refit.convert.flags import layout_flags, layout_from_flags
from mbridge_refit.plan.layout import ParallelLayout


def test_parser_knows_every_subcommand():
    parser = build_parser()
    args = parser.parse_args(["roundtrip", "--hf", "a", "--out", "b", "--tp", "2", "--pp", "2", "--vpp", "2"])
    assert (args.command, args.tp, args.pp, args.vpp, args.ep) == ("roundtrip", 2, 2, 2, 1)
    assert parser.parse_args(["verify", "x", "y"]).command == "verify"
    with pytest.raises(SystemExit):
        parser.parse_args(["roundtrip", "--hf", "a", "--out", "b", "--t", "2"])  # no abbreviations


@pytest.mark.parametrize(
    "layout",
    [
        ParallelLayout(),
        ParallelLayout(tp=2),
        ParallelLayout(pp=2, vpp=2),
        ParallelLayout(tp=2, ep=2, cp=2),
        ParallelLayout(pp=4, first_stage_layers=1, last_stage_layers=3),
    ],
    ids=lambda layout: layout.name,
)
def test_layout_flags_parse_back_to_the_layout(layout):
    args = build_parser().parse_args(["roundtrip", "--hf", "a", "--out", "b", *layout_flags(layout)])
    assert layout_from_flags(args) == layout


def test_help_has_examples(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "python -m mbridge_refit.convert --nproc-per-node 4 roundtrip" in text
    assert "torchrun --nproc-per-node 2 -m mbridge_refit.convert" in text
    assert "exit codes" in text


# ``python -m mbridge_refit.convert ARGS --help`` in this interpreter, then the heavy packages it loaded.
HELP_THEN_MODULES = """
import json, runpy, sys
sys.argv = ["mbridge_refit.convert", *sys.argv[1:]]
try:
    runpy.run_module("mbridge_refit.convert", run_name="__main__", alter_sys=True)
except SystemExit as exit:
    code = exit.code
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "megatron", "transformers", "safetensors"})
print(json.dumps({"code": code, "heavy": heavy}))
"""


def test_help_imports_no_torch_or_megatron():
    """``--help`` (top level and every subcommand) answers without importing torch, Megatron or
    transformers (seconds): the commands' modules are imported when a command runs."""
    import os
    import subprocess
    import sys

    from conftest import REPO

    from mbridge_refit.convert.parser import FLAGS

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for command in ["", *FLAGS, "export-adapter", "verify-refit"]:
        args = [command, "--help"] if command else ["--help"]
        run = subprocess.run(
            [sys.executable, "-c", HELP_THEN_MODULES, *args], cwd=REPO, env=env, capture_output=True, text=True
        )
        assert run.returncode == 0, run.stderr[-3000:]
        *help_text, last = run.stdout.strip().splitlines()
        assert "usage: python -m mbridge_refit.convert" in "\n".join(help_text), command
        assert json.loads(last) == {"code": 0, "heavy": []}, (command, last)


def test_the_shard_size_help_names_the_writers_default():
    from mbridge_refit.convert.parser import SHARD_BYTES_HELP
    from mbridge_refit.sinks.safetensors import DEFAULT_MAX_SHARD_BYTES

    assert SHARD_BYTES_HELP == f"{DEFAULT_MAX_SHARD_BYTES}, {DEFAULT_MAX_SHARD_BYTES // 1024**3} GiB"
    assert DEFAULT_MAX_SHARD_BYTES % 1024**3 == 0
    for command in ("roundtrip", "export"):
        args = build_parser().parse_args(
            [command, "--hf" if command == "roundtrip" else "--megatron", "a", "--out", "b"]
        )
        assert args.max_shard_bytes is None  # the commands take the writer's default


def roundtrip(nproc, source, out, *flags):
    return torchrun(
        nproc, ["mbridge_refit.convert", "roundtrip", "--hf", str(source), "--out", str(out), *flags], timeout=300
    )


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


def launched(nproc: int, *args: str, timeout: float = 600, env_extra: dict | None = None):
    """``python -m mbridge_refit.convert --nproc-per-node N ...`` as a user types it (no torchrun)."""
    import os
    import subprocess
    import sys

    from conftest import REPO, Launch

    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        **(env_extra or {}),
    }
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "mbridge_refit.convert", "--nproc-per-node", str(nproc), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    return Launch(proc.returncode, proc.stdout + proc.stderr)


def test_launcher_success_is_zero_and_exact(source_checkpoints, tmp_path):
    from oracle import assert_bitwise_equal_checkpoints

    source = source_checkpoints("qwen3-tiny")
    run = launched(2, "roundtrip", "--hf", str(source), "--out", str(tmp_path / "out"), "--tp", "2")
    assert run.returncode == ExitCode.OK, run.output[-3000:]
    assert_bitwise_equal_checkpoints(source, tmp_path / "out")


RANK_0_STARTS_LATE = """
import os, time
if os.environ.get("RANK") == "0":
    time.sleep(float(os.environ["RANK_0_DELAY_S"]))
"""


@pytest.mark.parametrize("rank_0_delay_s", [0, 90], ids=["rank-0-in-time", "rank-0-last"])
def test_launcher_bad_input_is_two_printed_once(source_checkpoints, tmp_path, rank_0_delay_s):
    """torchrun would exit 1 here; the launcher exits with the ranks' own code, and the error every
    rank sees alike is printed once, also when the other ranks fail first and torchrun stops rank 0
    before it gets there (seen in a loaded full run: the message was lost when rank 0 printed it)."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(RANK_0_STARTS_LATE)
    source, late = source_checkpoints("qwen3-tiny"), {"PYTHONPATH": str(shim), "RANK_0_DELAY_S": str(rank_0_delay_s)}
    run = launched(3, "roundtrip", "--hf", str(source), "--out", str(tmp_path / "out"), "--tp", "2", env_extra=late)
    assert run.returncode == ExitCode.BAD_INPUT, run.output[-3000:]
    assert run.output.count("world size 3 is not divisible") == 1, run.output[-3000:]
    assert "3 of 3 ranks failed" in run.output and "exit code 2" in run.output
    if rank_0_delay_s:
        assert "rank 0: killed by signal 15" in run.output, run.output[-3000:]
    assert not (tmp_path / "out").exists()


def test_launcher_differences_are_one(source_checkpoints, tmp_path):
    """``verify`` on every rank finds the same difference: the launch exits 1, not torchrun's catch-all 1 for errors."""
    source, other = source_checkpoints("qwen3-tiny"), source_checkpoints("qwen3-tiny-3layer")
    run = launched(2, "verify", str(source), str(other))
    assert run.returncode == ExitCode.DIFFERENCES, run.output[-3000:]


def test_launcher_refuses_to_run_under_torchrun(source_checkpoints, tmp_path):
    run = torchrun(2, ["mbridge_refit.convert", "--nproc-per-node", "2", "verify", str(tmp_path), str(tmp_path)])
    assert run.returncode != 0 and "without torchrun" in run.output and "exitcode  : 2" in run.output, run.output[
        -3000:
    ]


@pytest.mark.parametrize(
    ("codes", "expected"),
    [
        ({}, ExitCode.OK),
        ({0: 2, 1: 2}, ExitCode.BAD_INPUT),
        ({1: 3, 0: -15}, ExitCode.INTERNAL_ERROR),  # a rank's internal error; torchrun stopped the other
        ({0: 2, 1: -15}, ExitCode.BAD_INPUT),
        ({0: -9}, ExitCode.INTERNAL_ERROR),  # killed (e.g. out of memory): no rank explained it
        ({0: 1, 1: 1}, ExitCode.DIFFERENCES),
        ({0: 1, 1: 3}, ExitCode.INTERNAL_ERROR),
        ({0: 77}, ExitCode.INTERNAL_ERROR),
        ({1: 4, 0: -15}, ExitCode.ENVIRONMENT),  # a rank's disk filled up; torchrun stopped the other
        ({0: 3, 1: 4}, ExitCode.ENVIRONMENT),  # the peer of a rank whose disk filled up failed too
        ({0: 2, 1: 143}, ExitCode.BAD_INPUT),  # torchrun stopped the other rank, which cleaned up
        ({0: 143, 1: 143}, ExitCode.TERMINATED),  # a SIGTERM to the ranks
        ({0: 130, 1: 143}, ExitCode.INTERRUPTED),  # Ctrl-C, then torchrun stopped the rest
        ({0: 130, 1: -15}, ExitCode.INTERRUPTED),
    ],
)
def test_launch_exit_code_is_the_most_severe(codes, expected):
    from mbridge_refit.convert.launcher import launch_exit_code

    assert launch_exit_code(codes) == expected


def test_launcher_reads_records_in_rank_order(tmp_path):
    """The records of ranks 2 and 10 (and one cut short by a stop): codes by rank, messages in rank order, once."""
    import json

    from mbridge_refit.convert.launcher import _records

    (tmp_path / "rank10").write_text(json.dumps({"code": 2, "message": "second"}))
    (tmp_path / "rank2").write_text(json.dumps({"code": 2, "message": "first"}))
    (tmp_path / "rank3").write_text(json.dumps({"code": 2, "message": "first"}))
    (tmp_path / "rank4").write_text('{"code": 2, "mess')
    assert _records(tmp_path) == ({2: 2, 3: 2, 10: 2}, ["first", "second"])


DISK_FULL_ON_RANK_1 = """
import os
if os.environ.get("RANK") == "1":
    import errno
    import safetensors.torch

    def save_file(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device (injected by the test)")

    safetensors.torch.save_file = save_file
"""


def test_launcher_disk_full_on_one_rank_is_four_at_once(source_checkpoints, tmp_path):
    """Rank 1's disk fills while it writes its shard (an environment failure) while rank 0 waits in
    a collective: the launch ends at once (the launcher stops rank 0) with exit 4 and one line naming
    the output, the errno and the fix, and the existing output is untouched."""
    import time

    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(DISK_FULL_ON_RANK_1)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    start = time.monotonic()
    run = launched(
        2,
        "roundtrip",
        "--hf",
        str(source_checkpoints("qwen3-tiny")),
        "--out",
        str(out),
        "--tp",
        "2",
        "--overwrite",
        "--max-shard-bytes",
        "40000",
        env_extra={"PYTHONPATH": str(shim)},
    )
    assert run.returncode == ExitCode.ENVIRONMENT, run.output[-4000:]
    assert time.monotonic() - start < 120, "the healthy rank must not wait for the process-group timeout"
    assert "No space left on device (injected by the test) [errno 28 ENOSPC]: free space" in run.output
    assert "rank 1: exit 4 (environment)" in run.output and "Traceback" not in run.output
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"] and not list(tmp_path.glob(".out*"))


def test_an_output_another_writer_holds_is_refused_before_any_work(source_checkpoints, tmp_path, capsys):
    """Another writer (a process with a ShardedSafetensorsWriter open on --out) is writing it:
    exit 2 naming it (pid, host, since when) before the model is loaded; the output is untouched."""
    import os
    import signal
    import subprocess
    import sys

    from conftest import REPO

    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    holding = (
        "import sys, time\nfrom mbridge_refit.sinks import ShardedSafetensorsWriter\n"
        "w = ShardedSafetensorsWriter(out_dir=sys.argv[1], overwrite=True)\nprint('HOLDING', flush=True)\ntime.sleep(300)\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", holding, str(out)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""},
    )
    try:
        line = holder.stdout.readline()
        assert line.startswith("HOLDING"), line
        code = main(["roundtrip", "--hf", str(source_checkpoints("qwen3-tiny")), "--out", str(out), "--overwrite"])
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
    err = capsys.readouterr().err
    assert code == ExitCode.BAD_INPUT, err[-3000:]
    assert f"{out} is being written by another writer (pid {holder.pid} on host " in err and "wait until" in err, err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


# What the packages below the CLI print on their own: Python warnings (Megatron's "Apex is not
# installed", absl's, DCP's deprecations), Transformer Engine's and Megatron's log lines, torch's.
THIRD_PARTY_NOISE = re.compile(
    r"UserWarning|DeprecationWarning|FutureWarning|warnings\.warn|Apex is not installed|absl|TransformerEngine"
    r"|IS DEPRECATED|No CUDA runtime|torch_dtype. is deprecated"
)


def cli(*args: str, env_extra: dict | None = None):
    """``python -m mbridge_refit.convert ARGS`` (one process); stdout and stderr apart."""
    import os
    import subprocess
    import sys

    from conftest import REPO

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}
    env.pop("MBRIDGE_REFIT_THIRD_PARTY_WARNINGS", None)
    env.update(env_extra or {})
    cmd = [sys.executable, "-m", "mbridge_refit.convert", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def tiny_megatron(source_checkpoints, tmp_path_factory):
    """qwen3-tiny's HF checkpoint and its Megatron checkpoint (``import``)."""
    source = source_checkpoints("qwen3-tiny")
    megatron = tmp_path_factory.mktemp("cli") / "mcore"
    run = cli("import", "--hf", str(source), "--megatron", str(megatron))
    assert run.returncode == 0, run.stderr[-3000:]
    return source, megatron


def test_an_export_prints_no_third_party_warnings(tiny_megatron, tmp_path):
    """The CLI's stderr holds its own lines only; with MBRIDGE_REFIT_THIRD_PARTY_WARNINGS=1 the
    packages' warnings are back (the control: they are there to hide)."""
    source, megatron = tiny_megatron
    run = cli("export", "--megatron", str(megatron), "--out", str(tmp_path / "out"), "--no-progress")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "wrote 47 tensors" in run.stderr
    noise = [line for line in run.stderr.splitlines() if THIRD_PARTY_NOISE.search(line)]
    assert noise == [], noise
    shown = {"MBRIDGE_REFIT_THIRD_PARTY_WARNINGS": "1"}
    run = cli("export", "--megatron", str(megatron), "--out", str(tmp_path / "again"), "--no-progress", env_extra=shown)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Apex is not installed" in run.stderr and "UserWarning" in run.stderr, run.stderr[-3000:]


def summary(run) -> dict:
    """The ``--json`` object: all of stdout (the log and Megatron's prints go to stderr)."""
    return json.loads(run.stdout)


def test_json_summaries_of_export_roundtrip_and_verify(tiny_megatron, tmp_path):
    """``--json`` prints one object on stdout, naming what was written (checked against the
    directory and the source's index), and ``verify --json`` says whether two checkpoints are exact."""
    import os

    source, megatron = tiny_megatron
    stored = json.loads((source / "model.safetensors.index.json").read_text())
    for command, flag, given in (("export", "--megatron", megatron), ("roundtrip", "--hf", source)):
        out = tmp_path / command
        run = cli(command, flag, str(given), "--out", str(out), "--json", "--no-progress")
        assert run.returncode == 0, run.stderr[-3000:]
        result = summary(run)
        assert (result["command"], result["ok"], result["exit_code"]) == (command, True, 0), result
        assert (result["source"], result["out"]) == (os.path.abspath(given), os.path.abspath(out))
        assert result["files"] == sorted(p.name for p in out.iterdir())
        assert result["tensors"] == len(stored["weight_map"]) and result["bytes"] == stored["metadata"]["total_size"]
        assert (result["layout"], result["world_size"], result["fp8"]) == ("tp1", 1, False)
        seconds = result["seconds"]
        assert 0 <= seconds["load"] <= seconds["total"] and 0 <= seconds["export_write"] <= seconds["total"]

    run = cli("verify", str(source), str(tmp_path / "export"), "--json")
    assert run.returncode == 0, run.stderr[-3000:]
    result = summary(run)
    assert (result["ok"], result["exact"], result["differences"]) == (True, True, []), result
    assert result["a"] == {"path": os.path.abspath(source), "tensors": len(stored["weight_map"])}

    other = tmp_path / "other"
    shutil.copytree(tmp_path / "roundtrip", other)
    (shard,) = other.glob("*.safetensors")
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1  # the last byte of the last tensor's data
    shard.write_bytes(bytes(data))
    run = cli("verify", str(source), str(other), "--json")
    result = summary(run)
    assert run.returncode == ExitCode.DIFFERENCES and result["exit_code"] == ExitCode.DIFFERENCES, run.stderr[-3000:]
    assert (result["ok"], result["exact"], len(result["differences"])) == (False, False, 1), result

    run = cli("verify", str(source), str(tmp_path / "nope"), "--json")
    result = summary(run)
    assert run.returncode == ExitCode.BAD_INPUT and result["exit_code"] == ExitCode.BAD_INPUT
    assert result["ok"] is False and "does not exist" in result["error"], result
