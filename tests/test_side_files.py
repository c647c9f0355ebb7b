"""The files a conversion copies beside the weights (config, tokenizer: ``checkpoints.side_files``) come
only from inside the source checkpoint: a link to a file elsewhere (``/proc/self/environ``, a key in the
user's home) or to a FIFO is refused before any rank starts, and nothing is written; a Hugging Face
cache snapshot, whose files are links into the repository's blobs, is copied as before.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from mbridge_refit.checkpoints.side_files import SideFileError, copy_side_file, side_file_problem
from mbridge_refit.convert import ExitCode, main
from mbridge_refit.models import recipes
from mbridge_refit.testing.conformance import restored_environment

SECRET = b"SECRET-TOKEN-1234\n"


def convert(*argv) -> int:
    with restored_environment():
        return main([str(a) for a in argv])


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("side") / "hf"
    checkpoint = recipes.make_random_checkpoint(recipes.get_model_recipe("qwen3-tiny"), out, seed=5)
    (checkpoint / "tokenizer.json").write_text('{"model": "tiny"}\n')
    return checkpoint


def _secret(tmp_path: Path) -> Path:
    secret = tmp_path / "elsewhere" / "secret.txt"
    secret.parent.mkdir()
    secret.write_bytes(SECRET)
    return secret


@pytest.mark.parametrize("target", ["outside", "environ", "dangling", "fifo", "directory"])
def test_a_side_file_that_is_not_a_plain_file_of_the_checkpoint_is_refused(tmp_path, target):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    name = checkpoint / "tokenizer.json"
    if target == "outside":
        name.symlink_to(_secret(tmp_path))
    elif target == "environ":
        name.symlink_to("/proc/self/environ")
    elif target == "dangling":
        name.symlink_to(tmp_path / "missing")
    elif target == "fifo":
        os.mkfifo(name)
    else:
        name.mkdir()
    assert side_file_problem(checkpoint, "tokenizer.json") is not None
    with pytest.raises(SideFileError):
        copy_side_file(checkpoint, "tokenizer.json", tmp_path / "copy")
    assert not (tmp_path / "copy").exists()


def test_side_files_inside_the_checkpoint_and_hub_blobs_are_copied(tmp_path):
    repo = tmp_path / "models--org--tiny"
    blob = repo / "blobs" / "0123abcd"
    blob.parent.mkdir(parents=True)
    blob.write_bytes(b'{"hub": true}\n')
    snapshot = repo / "snapshots" / "rev1"
    snapshot.mkdir(parents=True)
    (snapshot / "tokenizer.json").symlink_to(Path("..") / ".." / "blobs" / "0123abcd")
    (snapshot / "vocab.json").write_bytes(b"{}\n")
    (snapshot / "merges.txt").symlink_to("vocab.json")  # a link that stays inside
    for name in ("tokenizer.json", "vocab.json", "merges.txt", "absent.json"):
        assert side_file_problem(snapshot, name) is None, name
    assert copy_side_file(snapshot, "tokenizer.json", tmp_path / "t.json")
    assert (tmp_path / "t.json").read_bytes() == b'{"hub": true}\n' and not (tmp_path / "t.json").is_symlink()
    assert not copy_side_file(snapshot, "absent.json", tmp_path / "a.json")
    # the same blob linked from a directory that is no snapshot of that repository is outside
    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer.json").symlink_to(blob)
    assert side_file_problem(other, "tokenizer.json") is not None


@pytest.mark.parametrize("command", ["roundtrip", "import"])
def test_conversion_refuses_a_side_file_linked_from_outside_before_writing(source, command, tmp_path, capsys):
    checkpoint = tmp_path / "hf"
    shutil.copytree(source, checkpoint)
    (checkpoint / "tokenizer.model").symlink_to(_secret(tmp_path))
    out = tmp_path / "out"
    flag = "--out" if command == "roundtrip" else "--megatron"
    assert convert(command, "--hf", checkpoint, flag, out) == ExitCode.BAD_INPUT
    err = capsys.readouterr().err
    assert "tokenizer.model" in err and "outside the checkpoint directory" in err, err
    assert not out.exists()


def test_conversion_copies_the_checkpoints_own_side_files(source, tmp_path):
    out = tmp_path / "out"
    assert convert("roundtrip", "--hf", source, "--out", out) == ExitCode.OK
    assert (out / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    assert (out / "config.json").is_file()
