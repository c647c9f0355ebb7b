"""The command line's progress bars on loading (HF checkpoints for ``roundtrip`` and ``import``, Megatron
checkpoints for ``export``) and exporting: shown with ``--progress`` whatever stderr is, hidden with
``--no-progress``, and hidden where stderr is no terminal (here: pytest's capture) unless forced."""

from __future__ import annotations

import re

import pytest
from test_input_faults import convert

from mbridge_refit.convert import ExitCode
from mbridge_refit.models import recipes


def bars(text: str) -> set[str]:
    """The names of the tqdm bars in ``text`` (``load: 100%|...``)."""
    return set(re.findall(r"(?:^|\r|\n)(\w+): +\d+%\|", text))


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return recipes.make_random_checkpoint("qwen3-tiny", tmp_path_factory.mktemp("progress") / "hf", seed=1)


@pytest.mark.parametrize(
    ("flags", "expected"), [(["--progress"], {"load", "export"}), ([], set()), (["--no-progress"], set())]
)
def test_roundtrip_bars(hf, tmp_path, capsys, flags, expected):
    assert convert("roundtrip", "--hf", hf, "--out", tmp_path / "out", *flags) == ExitCode.OK
    assert bars(capsys.readouterr().err) == expected


def test_import_and_export_bars(hf, tmp_path, capsys):
    megatron = tmp_path / "mcore"
    assert convert("import", "--hf", hf, "--megatron", megatron, "--progress") == ExitCode.OK
    assert bars(capsys.readouterr().err) == {"load"}
    assert convert("export", "--megatron", megatron, "--out", tmp_path / "out", "--progress") == ExitCode.OK
    err = capsys.readouterr().err
    assert bars(err) == {"load", "export"}
    assert re.search(r"load: +\d+%\|[^\n\r]*\| \d+/[1-9]\d* \[[^\n\r]*piece/s", err), (
        "the Megatron load's bar counts pieces"
    )
    assert convert("export", "--megatron", megatron, "--out", tmp_path / "out2") == ExitCode.OK
    assert bars(capsys.readouterr().err) == set()


def test_progress_flags_exclude_each_other(hf, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        convert("roundtrip", "--hf", hf, "--out", tmp_path / "out", "--progress", "--no-progress")
    assert exit_info.value.code == ExitCode.BAD_INPUT and "not allowed with" in capsys.readouterr().err
