"""Output paths that would have a write destroy or hang something: an output inside its input (or around
it), entries planted at the lock's or the staging directory's name, a mount point, ``.`` and ``..``.
Each is refused before any model is loaded (the CLI: exit 2, the input untouched), or written as the
directory it names.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from mbridge_refit.checkpoints.output_lock import LockFileError, OutputLock, held_by, lock_path
from mbridge_refit.checkpoints.publish import OutputRefused, begin_publication, output_target
from mbridge_refit.convert import ExitCode, main
from mbridge_refit.convert.exit_codes import BadInput
from mbridge_refit.convert.inputs import check_distinct_dirs, check_output_dir
from mbridge_refit.models import recipes
from mbridge_refit.testing.conformance import restored_environment


def convert(*argv) -> int:
    with restored_environment():
        return main([str(a) for a in argv])


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("paths") / "hf"
    return recipes.make_random_checkpoint(recipes.get_model_recipe("qwen3-tiny"), out, seed=6)


@pytest.mark.parametrize("where", ["inside", "around"])
def test_an_output_inside_or_around_its_input_is_refused_and_the_input_kept(source, where, tmp_path, capsys):
    # export --megatron M --out M/release --overwrite exited 0 having replaced M's weights with HF files
    root = tmp_path / "root"
    hf = root / "hf"
    shutil.copytree(source, hf)
    before = _files(hf)
    out = hf / "release" if where == "inside" else root
    assert convert("roundtrip", "--hf", hf, "--out", out, "--overwrite") == ExitCode.BAD_INPUT
    assert "lie one inside the other" in capsys.readouterr().err
    assert _files(hf) == before


def test_distinct_dirs_see_through_links_and_dots(tmp_path):
    (tmp_path / "in" / "sub").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "in")
    for out in (tmp_path / "link" / "sub", tmp_path / "in" / "sub" / ".." / "sub", tmp_path):
        with pytest.raises(BadInput):
            check_distinct_dirs(tmp_path / "in", "--hf", out, "--out")
    check_distinct_dirs(tmp_path / "in", "--hf", tmp_path / "in2", "--out")  # a name that only starts alike


@pytest.mark.parametrize("planted", ["symlink", "fifo", "directory"])
def test_an_entry_planted_at_the_lock_path_is_refused_not_followed(planted, tmp_path):
    # a planted link had the lock truncate and overwrite the file it names; a FIFO blocked the look for ever
    out = tmp_path / "out"
    lock = lock_path(out)
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's file\n")
    if planted == "symlink":
        lock.symlink_to(victim)
    elif planted == "fifo":
        os.mkfifo(lock)
    else:
        lock.mkdir()
    with pytest.raises(LockFileError):
        held_by(out)
    with pytest.raises(LockFileError):
        OutputLock.acquire(out)
    with pytest.raises(BadInput, match="lock file"):
        check_output_dir(out, overwrite=True)
    with pytest.raises(OutputRefused, match="lock file"):
        begin_publication(out, overwrite=True)
    assert victim.read_text() == "the user's file\n"


def test_a_file_at_the_staging_name_is_refused_not_removed(tmp_path):
    out = tmp_path / "out"
    planted = tmp_path / ".out.partial"
    planted.write_text("not a staging directory\n")
    with pytest.raises(BadInput, match="staging directory"):
        check_output_dir(out, overwrite=True)
    with pytest.raises(OutputRefused, match="staging directory"):
        begin_publication(out, overwrite=True)
    assert planted.read_text() == "not a staging directory\n"


def test_a_mount_point_output_is_refused_before_the_write(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    real = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda path: Path(path) == out or real(path))
    with pytest.raises(BadInput, match="mount point"):
        check_output_dir(out, overwrite=False)
    with pytest.raises(OutputRefused, match="mount point"):
        begin_publication(out, overwrite=False)


def test_dot_and_dotdot_outputs_name_the_directory_they_mean(tmp_path, monkeypatch):
    (tmp_path / "dd" / "sub").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "dd")
    assert output_target(Path(".")) == tmp_path.resolve() / "dd"
    assert output_target(Path("sub/..")) == tmp_path.resolve() / "dd"
    publication = begin_publication(Path("sub") / "..", overwrite=True)
    try:
        assert publication.staging.parent == tmp_path.resolve()
    finally:
        publication.abandon()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dd"]


def test_a_relative_output_is_not_logged_as_a_symlink_and_a_link_is_named(tmp_path, monkeypatch, caplog):
    """A relative output (``out``, ``sub/../out``) is the directory it names, written without a word
    about links; a symlink, or a symlinked folder on the way, is logged with the directory written."""
    home = tmp_path.resolve()
    (home / "real").mkdir()
    (home / "link").symlink_to("real")
    (home / "sub").mkdir()
    monkeypatch.chdir(home)
    caplog.set_level("INFO", logger="mbridge_refit.checkpoints.publish")
    logged = {}
    for out in ("out", "sub/../out2", "link", "link/inner"):
        caplog.clear()
        publication = begin_publication(Path(out), overwrite=True)
        publication.abandon()
        logged[out] = [r.getMessage() for r in caplog.records if "symlink" in r.getMessage()]
    assert logged["out"] == [] and logged["sub/../out2"] == [], logged
    assert logged["link"] == [f"link is a symlink: writing the directory it points to, {home / 'real'}"]
    assert logged["link/inner"] == [f"link/inner lies under a symlinked folder: writing {home / 'real' / 'inner'}"]
