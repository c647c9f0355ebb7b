"""Property-based fuzzing of what ``convert`` reads: safetensors headers, the index, ``config.json``
and a Megatron checkpoint's metadata, mutated by hypothesis from the tiny checkpoints.

Each example runs the CLI in this process (``convert.app.main``, one rank) and asserts the contract
of ``exit_codes``: an exit code in {0, 1, 2, 4} (1 only for ``verify``), never a traceback, and no
output directory (nor a staging leftover) unless the command succeeded and the output is a
complete checkpoint. Seeded (``derandomize``), bounded (``max_examples`` per property and a time
budget per property, after which the remaining examples return at once), so the file runs in about
a minute on 2 CPU cores; the default suite runs it.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import struct
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from mbridge_refit.convert import ExitCode, main
from mbridge_refit.models import recipes
from mbridge_refit.testing.conformance import restored_environment

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Seconds of examples per property; the examples after it return at once (the total time bound).
BUDGET_S = 15.0
FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=False,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: the first failing example is reported as found
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)


class Budget:
    """Wall-clock budget of one property: ``spent()`` once ``BUDGET_S`` have passed since its first
    example, unless an example failed (hypothesis then runs the failing example again to report it)."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.failed = False

    def spent(self) -> bool:
        self.start = self.start if self.start is not None else time.monotonic()
        return not self.failed and time.monotonic() - self.start > BUDGET_S

    @contextlib.contextmanager
    def example(self) -> Iterator[None]:
        try:
            yield
        except BaseException:
            self.failed = True
            raise


def run(capsys, *argv) -> tuple[int, str]:
    with restored_environment():
        code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def assert_contract(code: int, output: str, out: Path | None, *, allowed: set[int]) -> None:
    assert code in allowed, f"exit {code} (allowed {sorted(allowed)}):\n{output[-3000:]}"
    assert "Traceback" not in output and "internal error" not in output, output[-3000:]
    if out is None:
        return
    leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")]
    assert not leftovers, f"exit {code} left {leftovers}"
    if code != ExitCode.OK:
        assert not out.exists(), f"exit {code} but {out} exists"
    elif (out / "mbridge_refit_megatron.json").exists():
        from mbridge_refit.checkpoints.megatron import CheckpointInfo

        CheckpointInfo.read(out)  # a complete Megatron checkpoint (its metadata is written last)
    else:
        from mbridge_refit.checkpoints.hf import HFCheckpoint

        HFCheckpoint.open(out).validate()  # a complete HF checkpoint: every shard the index names, each readable


def fresh(tmp_path: Path, source: Path) -> Path:
    work = Path(tempfile.mkdtemp(dir=tmp_path))
    shutil.copytree(source, work / "in")
    return work


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fuzz") / "sharded"
    recipe = recipes.get_model_recipe("qwen3-tiny")
    return recipes.make_random_checkpoint(recipe, out, seed=5, max_shard_bytes=96 * 1024)


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fuzz") / "single"
    return recipes.make_random_checkpoint(recipes.get_model_recipe("qwen3-tiny"), out, seed=5)


@pytest.fixture(scope="module")
def megatron(single, tmp_path_factory) -> Path:
    """``single`` imported; every property asks for it, so the first example of none pays for
    importing Megatron and building a first model (15 s here) out of its time budget."""
    out = tmp_path_factory.mktemp("fuzz") / "mcore"
    with restored_environment():
        assert main(["import", "--hf", str(single), "--megatron", str(out)]) == ExitCode.OK
    return out


# --- mutations ----------------------------------------------------------------------------------------

JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64),
    st.sampled_from([0, -1, 1, 2**31, 2**63, 10**9, 8_400_000]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
DTYPES = st.sampled_from(["BF16", "F16", "F32", "F64", "I64", "U8", "BOOL", "F8_E4M3", "F4", "Q7", "", "bf16"])


@st.composite
def header_mutations(draw):
    """(description, function raw shard bytes -> damaged bytes)."""
    kinds = ["length", "truncate", "bytes", "dtype", "shape", "offsets", "drop", "duplicate", "add", "json"]
    kind = draw(st.sampled_from(kinds))
    if kind == "length":
        value = draw(st.one_of(st.integers(0, 2**64 - 1), st.integers(0, 4096)))
        return kind, lambda raw: struct.pack("<Q", value) + raw[8:]
    if kind == "truncate":
        cut = draw(st.floats(0, 1))
        return kind, lambda raw: raw[: int(len(raw) * cut)]
    if kind == "bytes":
        at, junk = draw(st.integers(0, 4000)), draw(st.binary(min_size=1, max_size=16))
        return kind, lambda raw: raw[:at] + junk + raw[at + len(junk) :]
    if kind == "json":
        value = draw(JSON_VALUES)
        return kind, lambda raw: _with_header(json.dumps(value).encode(), _split(raw)[1])
    pick, value = draw(st.integers(0, 10**6)), None
    if kind == "dtype":
        value = draw(DTYPES)
    elif kind == "shape":
        value = draw(st.lists(st.integers(-2, 2**40), max_size=4))
    elif kind == "offsets":
        value = draw(st.lists(st.integers(-1, 2**40), min_size=0, max_size=3))
    elif kind == "add":
        value = draw(st.dictionaries(st.sampled_from(["dtype", "shape", "data_offsets", "x"]), JSON_VALUES, max_size=3))
    return kind, lambda raw: _edit_entry(raw, kind, pick, value)


def _split(raw: bytes) -> tuple[dict, bytes]:
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def _with_header(text: bytes, body: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text + body


def _edit_entry(raw: bytes, kind: str, pick: int, value) -> bytes:
    header, body = _split(raw)
    names = sorted(k for k in header if k != "__metadata__")
    name = names[pick % len(names)]
    if kind == "dtype":
        header[name]["dtype"] = value
    elif kind == "shape":
        header[name]["shape"] = value
    elif kind == "offsets":
        header[name]["data_offsets"] = value
    elif kind == "drop":
        del header[name]
    elif kind == "add":
        header[f"{name}.extra"] = value
    text = json.dumps(header).encode()
    if kind == "duplicate":
        text = text[:-1] + b", " + json.dumps(name).encode() + b": " + json.dumps(header[name]).encode() + b"}"
    return _with_header(text, body)


INDEX_VALUES = st.one_of(
    JSON_SCALARS,
    st.sampled_from(["../sharded/model-00001-of-00005.safetensors", "/etc/passwd", "", ".", "a/../b", "x" * 300]),
)


@st.composite
def index_mutations(draw):
    """(description, function index dict | None -> new index text)."""
    kind = draw(st.sampled_from(["value", "drop", "add", "weight_map", "json", "bytes"]))
    pick = draw(st.integers(0, 10**6))
    if kind == "json":
        value = draw(JSON_VALUES)
        return kind, lambda index: json.dumps(value)
    if kind == "bytes":
        junk = draw(st.binary(max_size=64))
        return kind, lambda index: junk.decode("latin-1")
    value = draw(INDEX_VALUES if kind != "weight_map" else JSON_VALUES)

    def edit(index: dict) -> str:
        names = sorted(index["weight_map"])
        name = names[pick % len(names)]
        if kind == "value":
            index["weight_map"][name] = value
        elif kind == "drop":
            del index["weight_map"][name]
        elif kind == "add":
            index["weight_map"][f"{name}.extra"] = value
        else:
            index["weight_map"] = value
        return json.dumps(index)

    return kind, edit


CONFIG_FIELDS = [
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "tie_word_embeddings",
    "architectures",
    "model_type",
    "rms_norm_eps",
    "layer_types",
    "dtype",
    "rope_parameters",
]
CONFIG_NUMBERS = st.one_of(
    st.sampled_from([0, -1, 1, 3, 7, 63, 65, 128, 256, 1024, 8_400_000, 10**9, 2**31, 2**63]),
    st.integers(-(2**40), 2**40),
)


@st.composite
def config_mutations(draw):
    """(description, function config dict -> new config text)."""
    kind = draw(st.sampled_from(["number", "number", "number", "value", "delete", "json", "bytes"]))
    if kind == "json":
        value = draw(JSON_VALUES)
        return kind, lambda config: json.dumps(value)
    if kind == "bytes":
        junk = draw(st.binary(max_size=64))
        return kind, lambda config: junk.decode("latin-1")
    field = draw(st.sampled_from(CONFIG_FIELDS))
    value = draw(CONFIG_NUMBERS if kind == "number" else JSON_VALUES)

    def edit(config: dict) -> str:
        if kind == "delete":
            config.pop(field, None)
        else:
            config[field] = value
        return json.dumps(config)

    return f"{kind} {field}", edit


@st.composite
def megatron_mutations(draw):
    """(description, function checkpoint dir -> None) on a copy of the Megatron checkpoint."""
    kind = draw(st.sampled_from(["index-bytes", "index-truncate", "info", "distcp-truncate", "config"]))
    if kind == "config":
        _, edit = draw(config_mutations())

        def edit_config(path: Path) -> None:
            (path / "config.json").write_text(edit(json.loads((path / "config.json").read_text())))

        return kind, edit_config
    if kind == "info":
        field = draw(st.sampled_from(["saved_layout", "params_dtype", "hf_dtypes", "format", "version", "weights_dir"]))
        value = draw(st.one_of(JSON_VALUES, st.sampled_from(["float64", "bfloat16", "float16", "int8", {"tp": 2}])))

        def edit_info(path: Path) -> None:
            info = json.loads((path / "mbridge_refit_megatron.json").read_text())
            info[field] = value
            (path / "mbridge_refit_megatron.json").write_text(json.dumps(info))

        return f"info {field}", edit_info
    at, junk, cut = draw(st.integers(0, 20000)), draw(st.binary(min_size=1, max_size=8)), draw(st.floats(0, 1))

    def edit_file(path: Path) -> None:
        weights = path / "release"
        target = weights / ".metadata" if kind.startswith("index") else next(weights.glob("*.distcp"))
        raw = target.read_bytes()
        if kind == "index-bytes":
            at_ = at % len(raw)
            raw = raw[:at_] + junk + raw[at_ + len(junk) :]
        else:
            raw = raw[: int(len(raw) * cut)]
        target.write_bytes(raw)

    return kind, edit_file


# --- properties ---------------------------------------------------------------------------------------


HEADER_BUDGET, INDEX_BUDGET, CONFIG_BUDGET, MEGATRON_BUDGET = Budget(), Budget(), Budget(), Budget()


@settings(FUZZ, max_examples=150)
@given(mutation=header_mutations(), layout=st.sampled_from(["sharded", "single"]))
def test_fuzzed_safetensors_headers(mutation, layout, sharded, single, megatron, tmp_path, capsys):
    if HEADER_BUDGET.spent():
        return
    with HEADER_BUDGET.example():
        source = sharded if layout == "sharded" else single
        work = fresh(tmp_path, source)
        shard = sorted((work / "in").glob("*.safetensors"))[0]
        shard.write_bytes(mutation[1](shard.read_bytes()))
        code, output = run(capsys, "verify", source, work / "in")
        assert_contract(code, output, None, allowed={0, 1, 2, 4})
        code, output = run(capsys, "roundtrip", "--hf", work / "in", "--out", work / "out", "--no-progress")
        assert_contract(code, output, work / "out", allowed={0, 2, 4})


@settings(FUZZ, max_examples=150)
@given(mutation=index_mutations())
def test_fuzzed_index(mutation, sharded, megatron, tmp_path, capsys):
    if INDEX_BUDGET.spent():
        return
    with INDEX_BUDGET.example():
        work = fresh(tmp_path, sharded)
        index = json.loads((work / "in" / INDEX).read_text())
        (work / "in" / INDEX).write_text(mutation[1](index), encoding="utf-8", errors="surrogatepass")
        code, output = run(capsys, "verify", sharded, work / "in")
        assert_contract(code, output, None, allowed={0, 1, 2, 4})
        code, output = run(capsys, "roundtrip", "--hf", work / "in", "--out", work / "out", "--no-progress")
        assert_contract(code, output, work / "out", allowed={0, 2, 4})


@settings(FUZZ, max_examples=120)
@given(mutation=config_mutations(), command=st.sampled_from(["roundtrip", "import"]))
def test_fuzzed_config(mutation, command, single, megatron, tmp_path, capsys):
    if CONFIG_BUDGET.spent():
        return
    with CONFIG_BUDGET.example():
        work = fresh(tmp_path, single)
        config = json.loads((work / "in" / "config.json").read_text())
        (work / "in" / "config.json").write_text(mutation[1](config), encoding="utf-8", errors="surrogatepass")
        flags = ["--out", work / "out", "--no-progress"] if command == "roundtrip" else ["--megatron", work / "out"]
        code, output = run(capsys, command, "--hf", work / "in", *flags)
        assert_contract(code, output, work / "out", allowed={0, 2, 4})


@settings(FUZZ, max_examples=120)
@given(mutation=megatron_mutations())
def test_fuzzed_megatron_checkpoint(mutation, megatron, tmp_path, capsys):
    if MEGATRON_BUDGET.spent():
        return
    with MEGATRON_BUDGET.example():
        work = fresh(tmp_path, megatron)
        mutation[1](work / "in")
        code, output = run(capsys, "export", "--megatron", work / "in", "--out", work / "out", "--no-progress")
        assert_contract(code, output, work / "out", allowed={0, 2, 4})
