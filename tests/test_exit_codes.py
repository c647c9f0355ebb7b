"""Every row of the exit-code table (``convert.exit_codes.EXIT_CODES``), run as a user runs the command
line: ``python -m mbridge_refit.convert`` in a child process, its exit code and its lines checked.

Faults are put where a user meets them: an output directory this user may not write (as root, whose
permission checks a ``chmod`` does not stop, the child runs without the capabilities that bypass
them), one on a read-only filesystem (a read-only bind mount in a mount namespace of its own,
where this machine allows one), and a signal sent at a chosen point of a write (a ``sitecustomize``
in the child sends it to its own process: during the write, right after the swap, while torch is
imported, after the command ended). ``--help`` and README.md show the table the code holds.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, Launch

from mbridge_refit.convert.exit_codes import EXIT_CODES, ExitCode, help_table, readme_table
from mbridge_refit.models import recipes


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    """Two tiny checkpoints of the same model with different weights (the source, and an old output)."""
    root = tmp_path_factory.mktemp("exit-codes")
    recipe = recipes.get_model_recipe("qwen3-tiny")
    return (
        recipes.make_random_checkpoint(recipe, root / "source", seed=1),
        recipes.make_random_checkpoint(recipe, root / "old", seed=2),
    )


def cli(*argv, shim: str | None = None, tmp_path: Path | None = None, prefix=(), **popen) -> Launch:
    """``python -m mbridge_refit.convert *argv`` in a child process (one rank), with ``shim`` as its
    ``sitecustomize`` (run before anything else)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(var, None)
    if shim is not None:
        (tmp_path / "shim").mkdir()
        (tmp_path / "shim" / "sitecustomize.py").write_text(shim)
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "shim"), str(REPO)])
    cmd = [*prefix, sys.executable, "-m", "mbridge_refit.convert", *map(str, argv)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, **popen)
    return Launch(proc.returncode, proc.stdout + proc.stderr)


def files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_help_and_readme_show_the_table_the_code_holds():
    shown = subprocess.run(
        [sys.executable, "-m", "mbridge_refit.convert", "--help"], cwd=REPO, capture_output=True, text=True
    )
    assert shown.returncode == 0 and help_table() in shown.stdout, shown.stdout[-3000:]
    assert readme_table() in (REPO / "README.md").read_text()
    assert sorted(code for row in EXIT_CODES for code in row.codes) == sorted(ExitCode)


# --- 0, 1, 2, 3 --------------------------------------------------------------------------------------


def test_ok_differences_and_bad_input(checkpoints, tmp_path):
    source, old = checkpoints
    same, different = cli("verify", source, source), cli("verify", source, old)
    assert same.returncode == ExitCode.OK, same.output[-3000:]
    assert different.returncode == ExitCode.DIFFERENCES and "difference(s)" in different.output, different.output
    missing = cli("verify", source, tmp_path / "nope")
    assert missing.returncode == ExitCode.BAD_INPUT and f"{tmp_path / 'nope'} does not exist" in missing.output
    assert "Traceback" not in missing.output


A_BUG = """
import mbridge_refit.checkpoints.hf as hf

def compare_checkpoints(a, b):
    raise ZeroDivisionError("a bug injected by the test")

hf.compare_checkpoints = compare_checkpoints
"""


def test_a_bug_is_an_internal_error_with_its_traceback(checkpoints, tmp_path):
    source, _ = checkpoints
    run = cli("verify", source, source, shim=A_BUG, tmp_path=tmp_path)
    assert run.returncode == ExitCode.INTERNAL_ERROR, run.output[-3000:]
    assert "internal error: please report it" in run.output and "Traceback" in run.output
    assert "ZeroDivisionError: a bug injected by the test" in run.output


# --- 4: an output this user may not write -------------------------------------------------------------

_PR_CAPBSET_DROP = 24
_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH = 1, 2


def _without_permission_bypass() -> None:
    """In the child before it runs Python: drop the capabilities that let root write anywhere (from
    the bounding set, so the program it runs starts without them)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH):
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def _unwritable(tmp_path: Path) -> tuple[Path, dict]:
    """A directory this test's child may not write, and how to start that child."""
    place = tmp_path / "read-only"
    place.mkdir()
    place.chmod(0o555)
    popen = {"preexec_fn": _without_permission_bypass} if os.geteuid() == 0 else {}
    probe = subprocess.run(
        [sys.executable, "-c", f"import os; print(os.access({str(place)!r}, os.W_OK))"],
        capture_output=True,
        text=True,
        **popen,
    )
    if probe.stdout.strip() != "False":
        pytest.skip(f"cannot make a directory this process may not write here ({probe.stdout}{probe.stderr})")
    return place, popen


def test_an_output_this_user_may_not_write_is_an_environment_failure(checkpoints, tmp_path):
    """It was bad input (2): the docs promise 4 for permissions, naming the path and the errno."""
    place, popen = _unwritable(tmp_path)
    run = cli("roundtrip", "--hf", checkpoints[0], "--out", place / "out", **popen)
    assert run.returncode == ExitCode.ENVIRONMENT, run.output[-3000:]
    assert f"{place}: Permission denied (the output {place / 'out'} is made here) [errno 13 EACCES]" in run.output
    assert "Traceback" not in run.output and not (place / "out").exists()


def test_a_launchs_environment_failure_stays_four_printed_once(tmp_path):
    place, popen = _unwritable(tmp_path)
    run = cli("--nproc-per-node", "2", "make-tiny", "--out", place / "out", **popen)
    assert run.returncode == ExitCode.ENVIRONMENT, run.output[-3000:]
    assert run.output.count("[errno 13 EACCES]: give this user access") == 1, run.output[-3000:]
    assert "2 of 2 ranks failed" in run.output and "exit code 4" in run.output


def test_an_output_on_a_read_only_filesystem_is_an_environment_failure(tmp_path):
    place = tmp_path / "mounted"
    place.mkdir()
    unshare = shutil.which("unshare")
    mount = f"mount --bind -o ro {place} {place}"
    probe = subprocess.run(
        [unshare or "unshare", "--mount", "--propagation", "private", "sh", "-c", f"{mount} && touch {place}/x"],
        capture_output=True,
        text=True,
    )
    if unshare is None or "Read-only file system" not in probe.stderr:
        pytest.skip(f"no read-only bind mount in a private mount namespace here: {probe.stderr.strip()[:200]}")
    prefix = [unshare, "--mount", "--propagation", "private", "sh", "-c", f'{mount} && exec "$@"', "sh"]
    run = cli("make-tiny", "--out", place / "out", prefix=prefix)
    assert run.returncode == ExitCode.ENVIRONMENT, run.output[-3000:]
    assert f"{place}: Read-only file system (the output {place / 'out'} is made here) [errno 30 EROFS]" in run.output


# --- 130, 143: interrupted -----------------------------------------------------------------------------

SIGNAL_DURING_THE_WRITE = """
import os, signal
import mbridge_refit.sinks.safetensors as sink

real = sink.fsync_file

def fsync_file(path):  # the first shard is written and about to be synced
    os.kill(os.getpid(), signal.{sig})
    return real(path)

sink.fsync_file = fsync_file
"""

SIGNAL_RIGHT_AFTER_THE_SWAP = """
import os, signal
import mbridge_refit.checkpoints.publish as publish

real = publish.exchange

def exchange(a, b):  # the new checkpoint has just become the output
    done = real(a, b)
    os.kill(os.getpid(), signal.{sig})
    return done

publish.exchange = exchange
"""


@pytest.mark.parametrize(
    ("sig", "point"),
    [("SIGINT", "write"), ("SIGTERM", "write"), ("SIGTERM", "swap")],
    ids=["ctrl-c-during-the-write", "sigterm-during-the-write", "sigterm-right-after-the-swap"],
)
def test_an_interrupted_write_is_128_plus_the_signal_and_leaves_a_whole_output(checkpoints, sig, point, tmp_path):
    """Ctrl-C and SIGTERM were "interrupted", exit 3 (an internal error's code), and SIGTERM right after
    the swap logged that what was written was removed: now 130 and 143, one line, the old output whole
    (or the new one, once swapped) and nothing of the write beside it."""
    source, old = checkpoints
    out = tmp_path / "out"
    shutil.copytree(old, out)
    shim = (SIGNAL_DURING_THE_WRITE if point == "write" else SIGNAL_RIGHT_AFTER_THE_SWAP).replace("{sig}", sig)
    run = cli("roundtrip", "--hf", source, "--out", out, "--overwrite", "--no-progress", shim=shim, tmp_path=tmp_path)
    code = 128 + getattr(signal, sig)
    assert run.returncode == code, run.output[-3000:]
    assert f"interrupted by {sig}" in run.output and f"(exit code {code})" in run.output, run.output[-3000:]
    assert "Traceback" not in run.output and "internal error" not in run.output
    if point == "write":
        assert files(out) == files(old)
    else:
        assert "the new checkpoint is in place" in run.output
        assert cli("verify", source, out).returncode == ExitCode.OK
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "shim"], "staging or lock left beside the output"


SIGINT_WHILE_TORCH_IS_IMPORTED = """
import os, signal, sys

class Interrupting:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, Interrupting())
"""

SIGTERM_AS_THE_PROCESS_EXITS = """
import atexit, os, signal, time

def terminated():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)

atexit.register(terminated)
"""


def test_ctrl_c_while_starting_is_130_in_one_line(checkpoints, tmp_path):
    """torch is imported once the command runs (``app`` imports it after parsing), under the
    command's handler: one line, 130."""
    run = cli("verify", *checkpoints, shim=SIGINT_WHILE_TORCH_IS_IMPORTED, tmp_path=tmp_path)
    assert run.returncode == ExitCode.INTERRUPTED, run.output[-3000:]
    assert "Traceback" not in run.output and run.output.count("interrupted by SIGINT") == 1, run.output[-3000:]
    assert "(exit code 130)" in run.output


def test_sigterm_once_the_command_ended_is_143_naming_its_code(checkpoints, tmp_path):
    """The handler went with the command: a SIGTERM in the interpreter's clean-up killed the process
    (-15 to its parent, no line). Now 143 at once, saying the command had ended with 1."""
    run = cli("verify", *checkpoints, shim=SIGTERM_AS_THE_PROCESS_EXITS, tmp_path=tmp_path)
    assert run.returncode == ExitCode.TERMINATED, run.output[-3000:]
    assert "interrupted by SIGTERM while exiting: the command had ended with exit code 1" in run.output
