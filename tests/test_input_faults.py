"""Damaged, hostile and mismatched inputs end with the documented exit code and a message that names
the file, never a traceback, a crop or a memory bomb (issue #35 items 3-6); a tied config over a
checkpoint that holds its own, different ``lm_head.weight`` (issue #56 item 8).

Commands run in this process through ``convert.app.main`` (one rank), except where a resource
limit or a signal is the point: those run ``python -m mbridge_refit.convert`` in a child process.
Exit codes: 2 bad input, 3 internal error, 4 environment, 128 + N a signal (``exit_codes``).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO

from mbridge_refit.convert import ExitCode, main
from mbridge_refit.models import recipes
from mbridge_refit.testing.conformance import restored_environment

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def convert(*argv) -> int:
    """``python -m mbridge_refit.convert *argv`` in this process (one rank)."""
    with restored_environment():  # Megatron's build sets variables the next build asserts
        return main([str(a) for a in argv])


@pytest.fixture(scope="module")
def single_file(tmp_path_factory) -> Path:
    """qwen3-tiny as one ``model.safetensors`` (vocab 512, hidden 64)."""
    out = tmp_path_factory.mktemp("single") / "hf"
    return recipes.make_random_checkpoint(recipes.get_model_recipe("qwen3-tiny"), out, seed=3)


@pytest.fixture(scope="module")
def megatron(single_file, tmp_path_factory) -> Path:
    """``single_file`` imported into a Megatron checkpoint (TP1)."""
    out = tmp_path_factory.mktemp("megatron") / "mcore"
    assert convert("import", "--hf", single_file, "--megatron", out) == ExitCode.OK
    return out


def copy_with_config(source: Path, dest: Path, **changes) -> Path:
    shutil.copytree(source, dest)
    config = json.loads((dest / "config.json").read_text())
    config.update(changes)
    (dest / "config.json").write_text(json.dumps(config))
    return dest


# --- item 3 (and 6): export never crops, pads or fails as a "difference" ----------------------------

EMBEDDING = "embedding.word_embeddings.weight"


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"vocab_size": 256}, f"{EMBEDDING}: stored as [512, 64], but the model of config.json needs [256, 64]"),
        ({"vocab_size": 1024}, f"{EMBEDDING}: stored as [512, 64], but the model of config.json needs [1024, 64]"),
        ({"hidden_size": 128}, "final_layernorm.weight: stored as [64], but the model of config.json needs [128]"),
        (
            {"num_hidden_layers": 3, "layer_types": ["full_attention"] * 3},
            "stored as [4, 64], but the model of config.json needs [3, 64]",
        ),
    ],
    ids=["vocab-smaller", "vocab-larger", "hidden-larger", "fewer-layers"],
)
def test_export_refuses_a_config_that_disagrees_with_the_weights(megatron, changes, needle, tmp_path, capsys):
    """A vocabulary the config and the weights disagree on was cropped (256) or zero-padded (1024)
    with exit 0: Megatron marks the embedding ``allow_shape_mismatch``. Other sizes ended in
    torch's CheckpointException (a BaseException: exit 1 from the interpreter)."""
    bad = copy_with_config(megatron, tmp_path / "mcore", **changes)
    code = convert("export", "--megatron", bad, "--out", tmp_path / "hf", "--no-progress")
    err = capsys.readouterr().err
    assert code == ExitCode.BAD_INPUT, err[-3000:]
    assert needle in err and "Traceback" not in err
    assert not (tmp_path / "hf").exists()


def test_export_refuses_a_truncated_weights_file(megatron, tmp_path, capsys):
    """A truncated ``.distcp`` ended in CheckpointException (exit 1); now exit 2 before the model is built."""
    bad = tmp_path / "mcore"
    shutil.copytree(megatron, bad)
    (distcp,) = (bad / "release").glob("*.distcp")
    distcp.write_bytes(distcp.read_bytes()[:-1000])
    code = convert("export", "--megatron", bad, "--out", tmp_path / "hf", "--no-progress")
    err = capsys.readouterr().err
    assert code == ExitCode.BAD_INPUT, err[-3000:]
    assert f"{distcp} has" in err and "the file is truncated" in err and "Traceback" not in err
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[1, 2]", "a JSON list, not an object"),
        ('{"sharded_backend_version": 1}', "sharded_backend None, not 'torch_dist'"),
        ('{"sharded_backend": "zarr", "sharded_backend": "torch_dist"}', "names ['sharded_backend'] more than once"),
    ],
    ids=["list", "no-backend", "key-twice"],
)
def test_export_refuses_a_dist_checkpointing_config_import_never_writes(megatron, text, needle, tmp_path, capsys):
    """``release/metadata.json``, which Megatron-Core's load reads with ``json.load``: a list or an object
    without its backend failed inside the load (exit 3 with a traceback, found by tests/test_fuzz_inputs.py),
    a key given twice was read last-wins. Now exit 2 naming the file, before the model is built."""
    bad = tmp_path / "mcore"
    shutil.copytree(megatron, bad)
    (bad / "release" / "metadata.json").write_text(text)
    code = convert("export", "--megatron", bad, "--out", tmp_path / "hf", "--no-progress")
    err = capsys.readouterr().err
    assert code == ExitCode.BAD_INPUT, err[-3000:]
    assert str(bad / "release" / "metadata.json") in err and needle in err and "Traceback" not in err
    assert not (tmp_path / "hf").exists()


def test_export_refuses_an_unreadable_weights_item(megatron, tmp_path, capsys):
    """A tensor item torch cannot read (its first bytes overwritten, the length kept): the load's
    CheckpointException (a BaseException) becomes exit 2 naming the weights directory. (Its payload
    overwritten instead would load: torch_dist checkpoints carry no checksums.)"""
    from torch.distributed.checkpoint import FileSystemReader

    bad = tmp_path / "mcore"
    shutil.copytree(megatron, bad)
    storage = FileSystemReader(str(bad / "release")).read_metadata().storage_data  # our own file: plain pickle is fine
    where = next(info for index, info in storage.items() if index.fqn == "output_layer.weight")
    distcp = bad / "release" / where.relative_path
    raw = bytearray(distcp.read_bytes())
    raw[where.offset : where.offset + 40] = bytes(b ^ 0xFF for b in raw[where.offset : where.offset + 40])
    distcp.write_bytes(bytes(raw))
    code = convert("export", "--megatron", bad, "--out", tmp_path / "hf", "--no-progress")
    err = capsys.readouterr().err
    assert code == ExitCode.BAD_INPUT, err[-3000:]
    assert f"cannot read the weights in {bad / 'release'}" in err and "Traceback" not in err
    assert not (tmp_path / "hf").exists()


# --- item 4: a config far larger than its weights is refused before anything is allocated ----------

BOMBS = {  # name -> (config changes, refused by the size bound of config.json (else by the element bound))
    "vocab-1e9": ({"vocab_size": 10**9}, True),
    "hidden-1e9": ({"hidden_size": 10**9}, True),
    "vocab-1e7": ({"vocab_size": 10**7}, False),
    "hidden-1e7": ({"hidden_size": 10**7}, False),
    "intermediate-8.4M": ({"intermediate_size": 8_400_000}, False),
}
ADDRESS_SPACE_LIMIT = 12 * 2**30  # torch's import needs ~5 GiB of address space; each bomb asks for more than this

BOMB_DRIVER = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
from mbridge_refit.convert import main
from mbridge_refit.testing.conformance import restored_environment
codes = []
for argv in json.loads(sys.argv[1]):
    with restored_environment():
        codes.append(main(argv))
print("CODES", json.dumps(codes))
# this process's own peak: ru_maxrss keeps the forked parent's across exec (pytest's, gigabytes late in a suite)
print("MAXRSS_KB", next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")))
"""


def test_a_config_far_larger_than_its_weights_is_refused_before_allocation(single_file, tmp_path):
    """hidden_size or vocab_size 1e9 or 1e7, intermediate_size 8.4M over a 214k-element checkpoint:
    refused by the size bound of config.json (1e9 > 2**24) or from the meta-device model with both
    element counts, the process never larger than 2 GiB (before: the model was built first; only
    the address-space limit stopped it, exit 3)."""
    runs = []
    for name, (changes, _) in BOMBS.items():
        source = copy_with_config(single_file, tmp_path / name, **changes)
        runs.append(["roundtrip", "--hf", str(source), "--out", str(tmp_path / f"out-{name}"), "--no-progress"])
    driver = BOMB_DRIVER.format(limit=ADDRESS_SPACE_LIMIT)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", driver, json.dumps(runs)]
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    codes = json.loads(output.split("CODES ", 1)[1].splitlines()[0])
    assert codes == [ExitCode.BAD_INPUT] * len(BOMBS), output[-4000:]
    by_size = [next(iter(changes.items())) for changes, sized in BOMBS.values() if sized]
    assert all(f"{field}={value}" in output for field, value in by_size), output[-4000:]
    assert output.count("stores only 213,696 elements") == len(BOMBS) - len(by_size) and "Traceback" not in output
    assert int(output.split("MAXRSS_KB ", 1)[1].split()[0]) < 2 * 2**20, "the model was allocated"
    assert not list(tmp_path.glob("out-*"))


# --- item 5: damaged single-file checkpoints are bad input, as damaged shards are ------------------


def _header(raw: bytes) -> tuple[dict, bytes]:
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def _with_header(header: dict | bytes, body: bytes) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body


def _names(header: dict) -> list[str]:
    return [k for k in header if k != "__metadata__"]


def _offsets_past_end(raw: bytes) -> bytes:
    header, body = _header(raw)
    first = _names(header)[0]
    header[first]["data_offsets"] = [0, len(body) + 64]
    return _with_header(header, body)


def _overlapping(raw: bytes) -> bytes:
    header, body = _header(raw)
    first, second = _names(header)[:2]
    header[second]["data_offsets"] = header[first]["data_offsets"]
    return _with_header(header, body)


def _unknown_dtype(raw: bytes) -> bytes:
    header, body = _header(raw)
    header[_names(header)[0]]["dtype"] = "Q7"
    return _with_header(header, body)


def _duplicate_key(raw: bytes) -> bytes:
    header, body = _header(raw)
    first = _names(header)[0]
    text = json.dumps(header).encode()
    again = json.dumps(first).encode() + b": " + json.dumps(header[first]).encode()
    return _with_header(text[:-1] + b", " + again + b"}", body)


SINGLE_FILE_DAMAGE = {
    "truncated": lambda raw: raw[:-7],
    "huge-header-length": lambda raw: struct.pack("<Q", 1 << 40) + raw[8:],
    "offsets-past-end": _offsets_past_end,
    "overlapping-offsets": _overlapping,
    "deeply-nested-header": lambda raw: _with_header(b"[" * 100_000 + b"]" * 100_000, _header(raw)[1]),
    "unknown-dtype": _unknown_dtype,
    "duplicate-key": _duplicate_key,
}


@pytest.mark.parametrize("command", ["verify", "roundtrip"])
@pytest.mark.parametrize("damage", list(SINGLE_FILE_DAMAGE))
def test_damaged_single_file_checkpoint_is_bad_input(single_file, damage, command, tmp_path, capsys):
    """Each was an internal error (exit 3, a SafetensorError traceback), or for a duplicate key with
    the same entry, accepted: the sharded form of each already ended with exit 2."""
    bad = tmp_path / "bad"
    shutil.copytree(single_file, bad)
    (bad / SINGLE).write_bytes(SINGLE_FILE_DAMAGE[damage]((single_file / SINGLE).read_bytes()))
    if command == "verify":
        code = convert("verify", single_file, bad)
    else:
        code = convert("roundtrip", "--hf", bad, "--out", tmp_path / "out", "--no-progress")
    err = capsys.readouterr().err
    assert code == ExitCode.BAD_INPUT, err[-3000:]
    assert f"cannot read {bad / SINGLE}" in err and "Traceback" not in err, err[-3000:]
    assert not (tmp_path / "out").exists()


# --- item 5: index entries, config.json and flags ---------------------------------------------------


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sharded") / "hf"
    recipe = recipes.get_model_recipe("qwen3-tiny")
    return recipes.make_random_checkpoint(recipe, out, seed=3, max_shard_bytes=64 * 1024)


def _index_pointing(sharded: Path, dest: Path, value) -> tuple[Path, str]:
    shutil.copytree(sharded, dest)
    index = json.loads((dest / INDEX).read_text())
    name = sorted(index["weight_map"])[0]
    index["weight_map"][name] = value(index["weight_map"][name]) if callable(value) else value
    (dest / INDEX).write_text(json.dumps(index))
    return dest, name


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        (lambda shard: f"../outside/{shard}", "is not a plain relative path inside the checkpoint"),
        ("OUTSIDE_ABSOLUTE", "is not a plain relative path inside the checkpoint"),
        (7, "int '7' is not a file name"),
        ("x" * 300 + ".safetensors", "a 312-byte file name"),
    ],
    ids=["dotdot", "absolute", "not-a-string", "too-long"],
)
def test_index_entries_must_name_files_inside_the_checkpoint(sharded, value, needle, tmp_path, capsys, monkeypatch):
    """``../x`` and absolute paths were opened (``verify`` compared the other checkpoint's file and
    exited 1; ``roundtrip`` stopped only at an upstream ValueError); a number and a 300-character
    name were internal errors. Now exit 2, and nothing outside the checkpoint is even looked up."""
    from mbridge_refit.checkpoints import hf

    outside = tmp_path / "outside"
    shutil.copytree(sharded, outside)
    if value == "OUTSIDE_ABSOLUTE":
        value = lambda shard: str(outside / shard)  # noqa: E731
    bad, _ = _index_pointing(sharded, tmp_path / "bad", value)
    opened: list[str] = []
    real_safe_open = hf.safe_open

    def recording(path, *args, **kwargs):
        opened.append(str(path))
        return real_safe_open(path, *args, **kwargs)

    monkeypatch.setattr(hf, "safe_open", recording)
    for argv in (["verify", sharded, bad], ["roundtrip", "--hf", bad, "--out", tmp_path / "out", "--no-progress"]):
        code = convert(*argv)
        err = capsys.readouterr().err
        assert code == ExitCode.BAD_INPUT, err[-3000:]
        assert needle in err and str(bad / INDEX) in err and "Traceback" not in err
    assert not [p for p in opened if str(outside) in p], opened
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("text", "needle"), [("[1, 2]", "holds a JSON list, not an object"), ('"qwen3"', "holds a JSON str")]
)
def test_config_that_is_not_an_object_is_bad_input(single_file, text, needle, tmp_path, capsys):
    """A config.json holding a list was an internal error (TypeError in transformers)."""
    bad = tmp_path / "bad"
    shutil.copytree(single_file, bad)
    (bad / "config.json").write_text(text)
    code = convert("roundtrip", "--hf", bad, "--out", tmp_path / "out", "--no-progress")
    err = capsys.readouterr().err
    assert code == ExitCode.BAD_INPUT, err[-3000:]
    assert needle in err and str(bad / "config.json") in err and "Traceback" not in err


def test_a_refusal_quoting_a_multi_line_library_error_is_one_line(single_file, tmp_path, capsys):
    """transformers' validation error for a float field given an int spans two lines; the refusal quoted
    it as it was, so the error went on past its line (found by tests/test_fuzz_inputs.py). Now one line."""
    bad = copy_with_config(single_file, tmp_path / "bad", rms_norm_eps=0)
    code = convert("roundtrip", "--hf", bad, "--out", tmp_path / "out", "--no-progress")
    err = capsys.readouterr().err
    assert code == ExitCode.BAD_INPUT, err[-3000:]
    line = next(line for line in err.splitlines() if " ERROR " in line)
    assert str(bad / "config.json") in line and "expected float, got int" in line, err[-3000:]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "brk", ["\n", "\r\n", "\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]
)
def test_a_refusal_quoting_a_name_with_any_line_break_is_one_line(brk):
    """A fuzzed pickle's global name held a line break ``str.splitlines`` knows but ``\\n`` is not (found by
    tests/test_fuzz_inputs.py: the refusal went on past its line). Every such break becomes one space."""
    from mbridge_refit.convert.app import one_line

    message = f"refusing in/.metadata: UnsafePickle: torch.Siz{brk}e is not a type{brk}{brk}"
    assert one_line(message) == "refusing in/.metadata: UnsafePickle: torch.Siz e is not a type"
    assert len(one_line(message).splitlines()) == 1


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"hidden_size": "64"}, "Field 'hidden_size' expected int, got str"),  # transformers' check
        ({"num_attention_heads": 0}, "num_attention_heads=0"),
        ({"intermediate_size": -128}, "intermediate_size=-128"),
        ({"num_hidden_layers": True}, "Field 'num_hidden_layers' expected int, got bool"),  # transformers' check
        # transformers' check
        ({"num_hidden_layers": 3}, "`num_hidden_layers` (3) must be equal to the number of `layer_types` (4)"),
        # before transformers reads it: it expands a layer count into per-layer lists (1e9: minutes, gigabytes)
        ({"num_hidden_layers": 10**9}, "asks for num_hidden_layers=1000000000: more than 16384 layers or experts"),
        ({"head_dim": 2**36}, "head_dim=68719476736"),  # the meta build allocates the rotary frequencies on the CPU
    ],
)
def test_config_sizes_must_be_positive_integers(single_file, changes, needle, tmp_path, capsys):
    bad = copy_with_config(single_file, tmp_path / "bad", **changes)
    code = convert("roundtrip", "--hf", bad, "--out", tmp_path / "out", "--no-progress")
    err = capsys.readouterr().err
    assert code == ExitCode.BAD_INPUT, err[-3000:]
    assert needle in err and "Traceback" not in err


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e300"])
def test_timeout_must_be_a_finite_positive_number(value, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["roundtrip", "--hf", str(tmp_path), "--out", str(tmp_path / "o"), f"--timeout-s={value}"])
    assert exit_info.value.code == 2
    assert "--timeout-s: must be a number of seconds in (0, 1e+07]" in capsys.readouterr().err


# --- issue #56 item 8: a tied config over a checkpoint holding its own lm_head.weight -----------------

LM_HEAD, EMBEDDING_NAME = "lm_head.weight", "model.embed_tokens.weight"
TIED_FIX = ("'lm_head.weight'", "tie_word_embeddings", '"tie_word_embeddings": false', "drop 'lm_head.weight'")


def tied_over(source: Path, dest: Path, *, equal_lm_head: bool) -> Path:
    """``source`` (qwen3-tiny: untied, its own random ``lm_head.weight``) with ``tie_word_embeddings``
    set; with ``equal_lm_head`` its ``lm_head.weight`` rewritten as a copy of the embedding."""
    from safetensors.torch import load_file, save_file

    path = copy_with_config(source, dest, tie_word_embeddings=True)
    tensors = load_file(str(path / SINGLE))
    assert not tensors[LM_HEAD].equal(tensors[EMBEDDING_NAME])
    if equal_lm_head:
        tensors[LM_HEAD] = tensors[EMBEDDING_NAME].clone()
        save_file(tensors, str(path / SINGLE), metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("command", ["roundtrip", "import", "verify-refit"])
def test_a_tied_config_over_a_different_lm_head_is_refused(single_file, command, tmp_path, capsys, monkeypatch):
    """Exit 0 and the embedding written as ``lm_head.weight`` (stock's loader drops the output weight
    of a tied model; ``verify-refit`` refused it only in the load, after the process group and the
    model's build). Now exit 2 naming the tensor, the config key and both fixes, before any process
    group starts (none may)."""
    from mbridge_refit.convert import session

    def no_session(*args, **kwargs):
        raise AssertionError("a process group was started")

    monkeypatch.setattr(session, "distributed_session", no_session)
    bad = tied_over(single_file, tmp_path / "bad", equal_lm_head=False)
    out = tmp_path / "out"
    written = {"roundtrip": ("--out", out), "import": ("--megatron", out), "verify-refit": ("--json", out)}
    code = convert(command, "--hf", bad, *written[command])
    err = capsys.readouterr().err
    assert code == ExitCode.BAD_INPUT, err[-3000:]
    assert all(needle in err for needle in TIED_FIX) and "Traceback" not in err, err[-3000:]
    assert not out.exists()


def test_a_tied_config_over_an_equal_lm_head_roundtrips_exactly(single_file, tmp_path, capsys):
    """Where the stored ``lm_head.weight`` is the embedding's copy, the roundtrip runs as before and
    writes the input back, ``lm_head.weight`` included (checked by the safetensors reader)."""
    from mbridge_refit.checkpoints.hf import compare_checkpoints

    source = tied_over(single_file, tmp_path / "tied", equal_lm_head=True)
    code = convert("roundtrip", "--hf", source, "--out", tmp_path / "out", "--no-progress")
    assert code == ExitCode.OK, capsys.readouterr().err[-3000:]
    assert compare_checkpoints(source, tmp_path / "out") == []


def test_the_library_load_refuses_a_tied_config_over_a_different_lm_head(single_file, tmp_path):
    """``RefitBridge.load_hf_shards`` (the loader every route shares) and ``check_tied_output`` raise
    the same named ``InputError``: a model loaded without the command line's checks."""
    import datetime

    import torch

    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.checkpoints.loader import TiedOutputError
    from mbridge_refit.convert.session import distributed_session
    from mbridge_refit.errors import InputError
    from mbridge_refit.models.builder import BuildOptions, build_model
    from mbridge_refit.plan.layout import ParallelLayout

    bad = tied_over(single_file, tmp_path / "bad", equal_lm_head=False)
    cpu, layout = torch.device("cpu"), ParallelLayout()
    bridge = RefitBridge.from_hf_pretrained(bad)
    with pytest.raises(TiedOutputError) as refused:
        bridge.check_tied_output()
    assert isinstance(refused.value, InputError) and all(needle in str(refused.value) for needle in TIED_FIX)
    with restored_environment(), distributed_session(layout, device=cpu, timeout=datetime.timedelta(minutes=2)):
        chunks = build_model(bridge, layout, BuildOptions(device=cpu, params_dtype=torch.bfloat16))
        with pytest.raises(TiedOutputError) as refused:
            bridge.load_hf_shards(chunks, bad)
    assert all(needle in str(refused.value) for needle in TIED_FIX)


def test_the_tied_output_check_compares_every_row_block(tmp_path, monkeypatch):
    """The two tensors are compared a block of rows at a time (here one row): a difference in the
    last row alone, or in the sign of a zero, is found; equal bytes (NaN included) are equal."""
    import torch
    from safetensors.torch import save_file

    from mbridge_refit.checkpoints import loader
    from mbridge_refit.checkpoints.hf import HFCheckpoint

    monkeypatch.setattr(loader, "_COMPARED_BYTES", 1)
    base = torch.randn(5, 3).to(torch.bfloat16)
    base[0, 0] = float("nan")
    last_row, signed_zero = base.clone(), base.clone()
    last_row[4, 2] += 1
    base[2, 1], signed_zero[2, 1] = 0.0, -0.0
    tensors = {"a": base, "same": base.clone(), "last_row": last_row, "signed_zero": signed_zero}
    save_file(tensors, str(tmp_path / SINGLE))
    checkpoint = HFCheckpoint.open(tmp_path)
    verdicts = {name: loader._same_stored_tensor(checkpoint, "a", name) for name in ("same", "last_row", "signed_zero")}
    assert verdicts == {"same": True, "last_row": False, "signed_zero": False}


# --- item 5: a full disk or a file-size limit is an environment failure (exit 4) ---------------------


@pytest.fixture
def file_size_limit():
    """Writes beyond 64 KiB fail with EFBIG in this process during the test (Python ignores SIGXFSZ)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


@pytest.mark.parametrize("command", ["roundtrip", "import"])
def test_a_file_size_limit_is_an_environment_failure(single_file, command, tmp_path, capsys, file_size_limit):
    """safetensors' writer (roundtrip) and torch.distributed.checkpoint's (import) both hide the
    errno (a SafetensorError; a RuntimeError inside a CheckpointException): exit 3 with a traceback,
    and 1 for import. Now one line with the path, the errno and what to do, exit 4."""
    out = tmp_path / "out"
    flag = "--megatron" if command == "import" else "--out"
    code = convert(command, "--hf", single_file, flag, out, *(["--no-progress"] if command == "roundtrip" else []))
    err = capsys.readouterr().err
    assert code == ExitCode.ENVIRONMENT, err[-3000:]
    assert "[errno 27 EFBIG]" in err and "ulimit -f" in err and "Traceback" not in err, err[-3000:]
    line = next(line for line in err.splitlines() if "EFBIG" in line)
    assert str(tmp_path) in line  # the file (import) or the output it was writing (roundtrip)


def test_classifier_finds_the_errno_inside_what_torch_wraps():
    import errno

    from mbridge_refit.convert.app import classify

    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")  # torch.save
    except RuntimeError as err:
        wrapped = err
    failure = classify(wrapped, output=Path("/data/out"))
    assert failure.code == ExitCode.ENVIRONMENT and not failure.traceback
    assert failure.message.startswith("writing /data/out: No space left on device [errno 28 ENOSPC]")
    assert classify(ValueError("our bug")).code == ExitCode.INTERNAL_ERROR and classify(ValueError("x")).traceback
    safetensors_error = type("SafetensorError", (Exception,), {})  # safetensors' writer: errno only in the text
    written = safetensors_error("Error while serializing: I/O error: File too large (os error 27)")
    assert classify(written, output=Path("/o")).message.startswith("writing /o: File too large [errno 27 EFBIG]")
    cpu_oom = RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: 8 GB")
    assert classify(cpu_oom).code == ExitCode.ENVIRONMENT and "out of memory" in classify(cpu_oom).message
    peer = RuntimeError("[gloo/transport/tcp/pair.cc:547] Connection closed by peer [127.0.0.1]:31648")
    assert classify(peer).code == ExitCode.INTERNAL_ERROR and not classify(peer).traceback


# --- item 6: a signal to the --nproc-per-node launcher ------------------------------------------------


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _importing_torch(pid: int) -> bool:
    """Whether process ``pid`` has loaded torch: a rank of ``python -m mbridge_refit.convert`` does so
    only inside ``__main__``'s handler (the packages above it import nothing heavy)."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_launcher_is_its_code_in_one_line(single_file, sig, tmp_path):
    """The launcher's ranks are running when it gets the signal: torchrun's machinery stops them and
    raises SignalException, which left a traceback (and exit 1), then exit 3 (an internal error's code).
    Now one line and the code one process ends with for that signal: 128 + its number. The signal
    is sent once both ranks are past the interpreter's own start (they have begun loading torch):
    a SIGINT forwarded to a rank still starting up (seen on a loaded machine 1 s after the ranks
    appeared) gets Python's traceback before any code of ours runs."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(var, None)
    argv = ["--nproc-per-node", "2", "roundtrip", "--hf", str(single_file), "--out", str(tmp_path / "out"), "--tp", "2"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "mbridge_refit.convert", *argv],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        ranks = _children(proc.pid)
        if len(ranks) >= 2 and all(_importing_torch(rank) for rank in ranks):
            break
        time.sleep(0.2)
    assert len(_children(proc.pid)) >= 2, "the ranks did not start"
    proc.send_signal(sig)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, output[-4000:]
    assert f"stopped by {sig.name}" in output and f"(exit code {128 + sig})" in output, output[-4000:]
    assert "Traceback" not in output and not list(tmp_path.iterdir()), output[-4000:]


# --- the order of a GPU build's checks ----------------------------------------------------------------


def test_a_gpu_build_is_checked_on_a_cpu_meta_build_first(monkeypatch):
    """The GPU model is built only after its CPU meta-device twin passed the check; a refused check
    builds nothing on the GPU, and a family the CPU cannot build is checked right after its GPU build."""
    import torch

    from mbridge_refit.convert import preflight
    from mbridge_refit.models.builder import BuildOptions
    from mbridge_refit.plan.layout import ParallelLayout

    calls: list = []

    def build(bridge, layout, options):
        calls.append(("build", options.device.type, options.materialize))
        return [f"{options.device.type} model"]

    def refuse(chunks):
        calls.append(("check", chunks))
        raise preflight.BadInput("mismatch")

    monkeypatch.setattr(preflight, "build_model", build)
    gpu = BuildOptions(device=torch.device("cuda"))
    chunks = preflight.build_checked(None, ParallelLayout(), gpu, lambda c: calls.append(("check", c)))
    assert chunks == ["cuda model"]
    assert calls == [("build", "cpu", False), ("check", ["cpu model"]), ("build", "cuda", True)]
    calls.clear()
    with pytest.raises(preflight.BadInput):
        preflight.build_checked(None, ParallelLayout(), gpu, refuse)
    assert calls == [("build", "cpu", False), ("check", ["cpu model"])]

    def no_cpu_build(bridge, layout, options):
        if options.device.type == "cpu":
            raise AssertionError("a Transformer Engine module without a CPU stand-in")
        return build(bridge, layout, options)

    calls.clear()
    monkeypatch.setattr(preflight, "build_model", no_cpu_build)
    assert preflight.build_checked(None, ParallelLayout(), gpu, lambda c: calls.append(("check", c))) == ["cuda model"]
    assert calls == [("build", "cuda", True), ("check", ["cuda model"])]
