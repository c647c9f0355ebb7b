"""``convert import`` / ``convert export``: HF -> Megatron checkpoint on disk -> HF, bit for bit.

Real ranks under torchrun on CPU (gloo). The checkpoint is saved at one layout and exported at
the same and at other layouts; the oracle is the source checkpoint (tests/oracle.py). Bad input
ends with exit code 2 before any collective and writes nothing.
"""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import torchrun
from oracle import assert_bitwise_equal_checkpoints

from mbridge_refit.checkpoints.megatron import METADATA_NAME, WEIGHTS_DIR
from mbridge_refit.convert import ExitCode, build_parser, main

multirank = pytest.mark.multirank


def convert(nproc: int, *args: str):
    return torchrun(nproc, ["mbridge_refit.convert", *map(str, args)], timeout=300)


def import_(nproc, hf, megatron, *flags):
    return convert(nproc, "import", "--hf", hf, "--megatron", megatron, *flags)


def export(nproc, megatron, out, *flags):
    return convert(nproc, "export", "--megatron", megatron, "--out", out, "--no-progress", *flags)


@pytest.fixture(scope="module")
def qwen3_tp2(source_checkpoints, tmp_path_factory):
    """qwen3-tiny imported at TP2 on 2 ranks (shared by the export tests)."""
    source = source_checkpoints("qwen3-tiny")
    megatron = tmp_path_factory.mktemp("qwen3-tp2") / "megatron"
    run = import_(2, source, megatron, "--tp", "2")
    assert run.returncode == 0, run.output[-6000:]
    return source, megatron


@multirank
def test_import_writes_a_complete_checkpoint(qwen3_tp2):
    source, megatron = qwen3_tp2
    meta = json.loads((megatron / METADATA_NAME).read_text())
    assert meta["saved_layout"]["tp"] == 2
    assert (megatron / WEIGHTS_DIR / "metadata.json").is_file()
    assert (megatron / "config.json").read_text() == (source / "config.json").read_text()
    assert not [p.name for p in megatron.rglob(".tmp-*")], "temporary files left behind"


EXPORT_LAYOUTS = [  # (ranks, flags): the saved layout (tp2), then others
    (2, ["--tp", "2"]),
    (2, ["--pp", "2"]),
    (1, []),
]


@multirank
@pytest.mark.parametrize(("nproc", "flags"), EXPORT_LAYOUTS, ids=["tp2", "pp2", "tp1"])
def test_export_is_bitwise_exact_at_any_layout(qwen3_tp2, nproc, flags, tmp_path):
    source, megatron = qwen3_tp2
    out = tmp_path / "hf"
    run = export(nproc, megatron, out, *flags)
    assert run.returncode == 0, run.output[-6000:]
    assert_bitwise_equal_checkpoints(source, out)
    assert (out / "config.json").read_text() == (source / "config.json").read_text()


@multirank
@pytest.mark.parametrize(
    ("recipe", "import_flags", "export_nproc", "export_flags"),
    [
        ("qwen3-moe-tiny", ["--ep", "2"], 2, ["--tp", "2"]),  # experts split by EP, read back whole
        ("llama-tied-tiny", ["--pp", "2"], 1, []),  # tied output weight on the last stage
    ],
    ids=["moe-ep2-to-tp2", "tied-pp2-to-tp1"],
)
def test_import_export_across_layouts(source_checkpoints, tmp_path, recipe, import_flags, export_nproc, export_flags):
    source = source_checkpoints(recipe)
    megatron, out = tmp_path / "megatron", tmp_path / "hf"
    run = import_(2, source, megatron, *import_flags)
    assert run.returncode == 0, run.output[-6000:]
    run = export(export_nproc, megatron, out, *export_flags)
    assert run.returncode == 0, run.output[-6000:]
    assert_bitwise_equal_checkpoints(source, out)


# --- bad input: exit 2, nothing written -----------------------------------------------------------
# Checked in-process: main() returns before any process group exists; its log goes to stderr.


def test_parser_knows_import_and_export():
    parser = build_parser()
    args = parser.parse_args(["import", "--hf", "a", "--megatron", "b", "--tp", "2", "--overwrite"])
    assert (args.command, args.tp, args.overwrite) == ("import", 2, True)
    args = parser.parse_args(["export", "--megatron", "b", "--out", "c", "--pp", "2", "--vpp", "2"])
    assert (args.command, args.pp, args.vpp) == ("export", 2, 2)


def test_import_missing_input(tmp_path, capsys):
    assert main(["import", "--hf", str(tmp_path / "nope"), "--megatron", str(tmp_path / "m")]) == ExitCode.BAD_INPUT
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_import_refuses_non_empty_output(source_checkpoints, tmp_path, capsys):
    out = tmp_path / "m"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert main(["import", "--hf", str(source_checkpoints("qwen3-tiny")), "--megatron", str(out)]) == ExitCode.BAD_INPUT
    assert "--overwrite" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def killed_runs_staging(out):
    """The staging directory a killed writer (pid 4242) left beside ``out``."""
    staging = out.parent / f".{out.name}.partial-4242-{0:015x}"
    staging.mkdir()
    return staging


def test_import_names_a_killed_runs_leftover(source_checkpoints, tmp_path, capsys):
    out = tmp_path / "m"
    staging = killed_runs_staging(out)
    assert main(["import", "--hf", str(source_checkpoints("qwen3-tiny")), "--megatron", str(out)]) == ExitCode.BAD_INPUT
    err = capsys.readouterr().err
    assert str(staging) in err and "interrupted" in err and "--overwrite" in err
    assert not out.exists()


@multirank
def test_import_overwrite_replaces_the_checkpoint_and_keeps_other_files(qwen3_tp2, tmp_path):
    source, megatron = qwen3_tp2
    out = tmp_path / "m"
    shutil.copytree(megatron, out)
    (out / "notes.txt").write_text("mine")
    (out / WEIGHTS_DIR / "stale.distcp").write_text("old")
    old_loader_entries = ["pytorch_model.bin", "preprocessor_config.json", "model.safetensors", "iter_0000100"]
    for name in old_loader_entries[:-1]:
        (out / name).write_text("old")
    (out / "iter_0000100").mkdir()
    staging = killed_runs_staging(out)  # --overwrite removes it
    run = import_(1, source, out, "--overwrite")
    assert run.returncode == 0, run.output[-4000:]
    assert (out / "notes.txt").read_text() == "mine"
    assert not [name for name in old_loader_entries if (out / name).exists()], "old files a loader could read are left"
    assert not (out / WEIGHTS_DIR / "stale.distcp").exists() and not staging.exists()
    assert json.loads((out / METADATA_NAME).read_text())["saved_layout"]["tp"] == 1
    exported = tmp_path / "hf"
    run = export(1, out, exported)
    assert run.returncode == 0, run.output[-4000:]
    assert_bitwise_equal_checkpoints(source, exported)


def test_export_missing_input(tmp_path, capsys):
    assert main(["export", "--megatron", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == ExitCode.BAD_INPUT
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_export_from_an_hf_checkpoint_says_import_first(source_checkpoints, tmp_path, capsys):
    code = main(["export", "--megatron", str(source_checkpoints("qwen3-tiny")), "--out", str(tmp_path / "o")])
    assert code == ExitCode.BAD_INPUT
    assert "`import` first" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_export_from_an_incomplete_checkpoint(qwen3_tp2, tmp_path, capsys):
    _, megatron = qwen3_tp2
    broken = tmp_path / "broken"
    shutil.copytree(megatron, broken)
    shutil.rmtree(broken / WEIGHTS_DIR)
    assert main(["export", "--megatron", str(broken), "--out", str(tmp_path / "o")]) == ExitCode.BAD_INPUT
    assert f"{WEIGHTS_DIR}/metadata.json is missing" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_export_refuses_non_empty_output(qwen3_tp2, tmp_path, capsys):
    _, megatron = qwen3_tp2
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert main(["export", "--megatron", str(megatron), "--out", str(out)]) == ExitCode.BAD_INPUT
    assert "--overwrite" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_export_layout_that_does_not_fit(qwen3_tp2, tmp_path, capsys):
    # Same check as roundtrip's (test_convert_cli launches real ranks for it): world size 1, tp=2.
    _, megatron = qwen3_tp2
    assert (
        main(["export", "--megatron", str(megatron), "--out", str(tmp_path / "o"), "--tp", "2"]) == ExitCode.BAD_INPUT
    )
    err = capsys.readouterr().err
    assert "layout tp=2" in err and "--nproc-per-node 2" in err, err
    assert not (tmp_path / "o").exists()


class _Payload:
    """Unpickling this runs ``open(marker, "w")``: a stand-in for code a crafted checkpoint carries."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@multirank
def test_export_refuses_a_crafted_index_without_running_it(qwen3_tp2, tmp_path, capsys):
    import pickle

    _, megatron = qwen3_tp2
    crafted = tmp_path / "crafted"
    shutil.copytree(megatron, crafted)
    marker = tmp_path / "ran"
    (crafted / WEIGHTS_DIR / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    assert main(["export", "--megatron", str(crafted), "--out", str(tmp_path / "o")]) == ExitCode.BAD_INPUT
    err = capsys.readouterr().err
    assert "refusing" in err and ".metadata" in err and "io.open is not a type a checkpoint index holds" in err
    assert not marker.exists(), "the crafted index ran"
    assert not (tmp_path / "o").exists()


class _System:
    """Unpickling this runs ``os.system(command)``."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        import os

        return (os.system, (self.command,))


@multirank
def test_export_refuses_a_dotted_call_in_a_genuine_index_without_running_it(qwen3_tp2, tmp_path, capsys):
    # The checkpoint's own index with one field made by os.system, named through a module the
    # old unpickler allowed ("torch.distributed.checkpoint.filesystem" + "os.system", resolved
    # attribute by attribute at protocol 4): it ran, and `export` went on to exit 0.
    import pickle

    _, megatron = qwen3_tp2
    crafted = tmp_path / "crafted"
    shutil.copytree(megatron, crafted)
    marker = tmp_path / "ran"
    index_path = crafted / WEIGHTS_DIR / ".metadata"
    index = pickle.loads(index_path.read_bytes())  # the test's own checkpoint
    index.storage_meta.save_id = _System(f"touch {marker}")
    data = pickle.dumps(index, protocol=2)
    dotted = b"ctorch.distributed.checkpoint.filesystem\nos.system\n"
    index_path.write_bytes(b"\x80\x04" + data[2:].replace(b"cposix\nsystem\n", dotted))
    assert main(["export", "--megatron", str(crafted), "--out", str(tmp_path / "o")]) == ExitCode.BAD_INPUT
    err = capsys.readouterr().err
    assert "refusing" in err and ".metadata" in err and "dotted name" in err, err
    assert not marker.exists(), "the crafted index ran"
    assert not (tmp_path / "o").exists()


def test_byte_items_must_be_plain_data(tmp_path):
    import io

    import torch

    from mbridge_refit.checkpoints.dcp_pickles import UnsafePickle, check_byte_item

    plain = io.BytesIO()
    torch.save({"a": torch.ones(2), "b": None}, plain)
    check_byte_item(plain.getvalue())
    crafted = io.BytesIO()
    torch.save(_Payload(tmp_path / "ran"), crafted)
    with pytest.raises(UnsafePickle, match="is not a global a checkpoint.s byte item holds"):
        check_byte_item(crafted.getvalue())
    assert not (tmp_path / "ran").exists()
