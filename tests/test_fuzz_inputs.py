"""Property-based fuzzing of what ``convert`` reads: safetensors headers, the index, ``config.json``
and a Megatron checkpoint's metadata, mutated by hypothesis from the tiny checkpoints.

Two levels. The readers alone (``checkpoints.hf``, ``checkpoints.megatron``, the command line's
input checks) get hundreds of mutations in seconds, each either accepted or refused with the
package's own error (``errors.InputError``, exit code 2): any other exception fails the example.
Their mutations add what a hostile file holds: a JSON object naming a key twice, a shard linked to a
file outside the checkpoint, and Megatron ``.metadata`` indexes with a call to a function that runs
code (``os.system``, ``exec``, ...) put between their own opcodes: such a pickle must be refused and the
call never made (each payload would create a marker file; none may exist afterwards).

Then whole commands: each example runs the CLI in this process (``convert.app.main``, one rank) and
asserts the contract of ``exit_codes``: an exit code in {0, 1, 2, 4} (1 only for ``verify``), never a
traceback, a refusal on one line, and no output directory (nor a staging leftover) unless the command
succeeded and the output is a complete checkpoint. The commands: ``verify`` and ``roundtrip`` (headers,
index), ``roundtrip`` and ``import`` (config), ``export`` (the Megatron checkpoint: metadata, pickles,
``metadata.json``, ``common.pt``, the tracker), ``export-adapter`` (a LoRA save directory's tracker and
``run_config.yaml``, its base's config and header). Seeded (``derandomize``), bounded (``max_examples``
per property and a time budget per property, after which the remaining examples return at once), so
the file runs in about a minute on 2 CPU cores; the default suite runs it. ``MBRIDGE_REFIT_FUZZ=long``
(``test_long_fuzz_run``, marked slow) carries every property ``LONG_SCALE`` times further.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import pickletools
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
from mbridge_refit.errors import InputError
from mbridge_refit.models import recipes
from mbridge_refit.testing.conformance import restored_environment

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# MBRIDGE_REFIT_FUZZ=long (what the slow-marked test_long_fuzz_run sets): LONG_SCALE times the examples and
# time of every property, the same seeds (derandomize) carried further.
LONG = os.environ.get("MBRIDGE_REFIT_FUZZ") == "long"
LONG_SCALE = 20
# Seconds of examples per property; the examples after it return at once (the total time bound).
BUDGET_S = 12.0 * (LONG_SCALE if LONG else 1)


def examples(count: int) -> int:
    return count * LONG_SCALE if LONG else count


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
        self.ran = 0  # examples run within the budget

    def spent(self) -> bool:
        self.start = self.start if self.start is not None else time.monotonic()
        return not self.failed and time.monotonic() - self.start > BUDGET_S

    @contextlib.contextmanager
    def example(self) -> Iterator[None]:
        self.ran += 1
        try:
            yield
        except BaseException:
            self.failed = True
            raise


@pytest.fixture(scope="module", autouse=True)
def examples_run(request):
    """Report how many examples each property ran within its budget, on the terminal at the end."""
    yield
    counts = {name: budget.ran for name, budget in globals().items() if isinstance(budget, Budget)}
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"fuzz examples run: {sum(counts.values())} in all, {counts}")


def run(capsys, *argv) -> tuple[int, str]:
    with restored_environment():
        code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def assert_contract(code: int, output: str, out: Path | None, *, allowed: set[int]) -> None:
    assert code in allowed, f"exit {code} (allowed {sorted(allowed)}):\n{output[-3000:]}"
    assert "Traceback" not in output and "internal error" not in output, output[-3000:]
    if code not in (ExitCode.OK, 1):  # a refusal: one ERROR record, on one line (every line a record's own)
        lines = output.splitlines()
        errors = [at for at, line in enumerate(lines) if " ERROR " in line]
        assert len(errors) == 1, f"exit {code} with {len(errors)} ERROR lines:\n{output[-3000:]}"
        following = lines[errors[0] + 1 :]  # after it, only other tagged records ("[rank0] INFO", "[transformers]")
        assert all(line.startswith("[") for line in following), f"a refusal of more than one line:\n{output[-3000:]}"
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
    kind = draw(st.sampled_from(["value", "drop", "add", "weight_map", "json", "bytes", "duplicate", "link"]))
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
        elif kind == "duplicate":  # the name again, mapped to any value: json.loads would keep the last
            return with_key_twice(json.dumps(index), name, value)
        elif kind == "link":  # a shard turned into a link: the index itself is unchanged
            return json.dumps(index)
        else:
            index["weight_map"] = value
        return json.dumps(index)

    return kind, edit


def with_key_twice(text: str, key: str, value) -> str:
    """``text`` (JSON) with ``key`` given a second time, first, inside the object that holds it."""
    at = text.index(json.dumps(key) + ":")
    return text[:at] + f"{json.dumps(key)}: {json.dumps(value)}, " + text[at:]


LINK_TARGETS = ["outside", "outside-copy", "dangling", "self", "hub-blob", "inside"]


def link_a_shard(checkpoint: Path, how: str, pick: int) -> None:
    """Replace a shard of ``checkpoint`` by a link: to a file outside it (a copy of the shard, or
    another file), nowhere, itself, a Hugging Face cache blob it is no snapshot of, or (allowed)
    another name inside it."""
    shards = sorted(checkpoint.glob("*.safetensors"))
    shard = shards[pick % len(shards)]
    outside = checkpoint.parent / "outside"
    outside.mkdir(exist_ok=True)
    targets = {
        "outside": outside / "other.bin",
        "outside-copy": outside / shard.name,
        "dangling": outside / "missing",
        "self": shard,
        "hub-blob": checkpoint.parent / "blobs" / ("0" * 40),
        "inside": checkpoint / f".{shard.name}.moved",
    }
    target = targets[how]
    target.parent.mkdir(exist_ok=True)
    if how == "outside":
        target.write_bytes(b"not a shard")
    elif how not in ("self", "dangling"):
        shutil.move(shard, target)
    shard.unlink(missing_ok=True)
    shard.symlink_to(target)


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
    kind = draw(st.sampled_from(["number", "number", "number", "value", "delete", "json", "bytes", "duplicate"]))
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
        elif kind == "duplicate":
            config.setdefault(field, 1)
            return with_key_twice(json.dumps(config), field, value)
        else:
            config[field] = value
        return json.dumps(config)

    return f"{kind} {field}", edit


# A call a crafted index would make while it is unpickled: (module, name, argument); each would create
# the file MARKER in the example's working directory (or run nothing, where the name is harmless).
MARKER = "RAN-CODE"
CALLS = [
    ("builtins", "exec", f"open({MARKER!r}, 'w').close()"),
    ("builtins", "eval", f"open({MARKER!r}, 'w')"),
    ("builtins", "open", MARKER),  # opened for reading: fails, but is a call all the same
    ("os", "system", f"touch {MARKER}"),
    ("posix", "system", f"touch {MARKER}"),
    ("subprocess", "getoutput", f"touch {MARKER}"),
    ("torch", "load", MARKER),
    ("torch.serialization", "load", MARKER),
    ("pathlib", "Path.touch", MARKER),  # a dotted name: protocol 4 resolves it attribute by attribute
    ("torch.distributed.checkpoint.metadata", "os.system", f"touch {MARKER}"),
    ("copyreg", "_reconstructor", MARKER),
    ("pathlib", "PosixPath", MARKER),  # allowed in an index: builds a path, runs nothing
]


def _unframed(raw: bytes) -> bytes:
    """The pickle ``raw`` without its FRAME opcodes (optional to a reader), so opcodes can go anywhere."""
    out, last = [], 0
    for op, _, at in pickletools.genops(raw):
        if op.name == "FRAME":
            out.append(raw[last:at])
            last = at + 9
    return b"".join(out) + raw[last:]


def _boundaries(raw: bytes) -> list[int]:
    """Where each opcode after PROTO starts (a place an opcode may go), STOP's position last."""
    return [at for op, _, at in pickletools.genops(raw) if op.name != "PROTO"]


def _short_unicode(text: str) -> bytes:
    data = text.encode()
    return b"\x8c" + bytes([len(data)]) + data


def with_a_call(raw: bytes, call: tuple[str, str, str], pick: int) -> bytes:
    """``raw`` (a pickle) with ``module.name(argument)`` pushed, called and popped between two of its
    opcodes: the index still unpickles to what it held, once the call has run."""
    raw = _unframed(raw)
    module, name, argument = call
    payload = (
        (_short_unicode(module) + _short_unicode(name) + pickle.STACK_GLOBAL + _short_unicode(argument))
        + pickle.TUPLE1
        + pickle.REDUCE
        + pickle.POP
    )
    at = _boundaries(raw)[pick % len(_boundaries(raw))]
    return raw[:at] + payload + raw[at:]


OPCODES = sorted({op.code.encode("latin-1") for op in pickletools.opcodes})


def with_an_opcode_changed(raw: bytes, pick: int, code: bytes, drop: bool) -> bytes:
    """``raw`` with one opcode (and its argument, when ``drop``) replaced by ``code`` or removed."""
    raw = _unframed(raw)
    starts = _boundaries(raw)
    index = pick % len(starts)
    end = starts[index + 1] if index + 1 < len(starts) else len(raw)
    at = starts[index]
    return raw[:at] + (b"" if drop else code + raw[at + 1 : end]) + raw[end:]


TRACKER_FILE = "latest_checkpointed_iteration.txt"
# What a tracker may hold: gone, an iteration that is or is not there, junk, a number's look-alikes.
TRACKER_TEXTS = st.one_of(
    st.none(),
    st.sampled_from([b"release\n", b"1\n", b"0000001", b"-1", b"\xb2", "²".encode(), b"release\x00", b"../..", b""]),
    st.binary(max_size=32),
    st.text(max_size=24).map(str.encode),
)


def _torch_saved(value) -> bytes:
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


# A legacy common.pt, which `import` never writes: a torch.save of data or of a call, or junk.
COMMON_STATES = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([{"iteration": 1}, {"args": None}, []]).map(_torch_saved),
    st.just(b"cos\nsystem\n(V" + f"touch {MARKER}".encode() + b"\ntR."),  # os.system("touch RAN-CODE")
)


@st.composite
def megatron_mutations(draw):
    """(description, function checkpoint dir -> None) on a copy of the Megatron checkpoint."""
    kinds = ["index-bytes", "index-truncate", "info", "info-duplicate", "distcp-truncate", "config"]
    kind = draw(
        st.sampled_from([*kinds, "metadata-json", "pickle-call", "pickle-call", "pickle-opcode", "tracker", "common"])
    )
    if kind in ("tracker", "common"):
        content = draw(TRACKER_TEXTS if kind == "tracker" else COMMON_STATES)

        def edit_side_file(path: Path) -> None:
            target = path / (TRACKER_FILE if kind == "tracker" else "release/common.pt")
            target.unlink(missing_ok=True)
            if content is None:
                return  # the tracker removed
            target.write_bytes(content)

        return kind, edit_side_file
    if kind == "pickle-call":
        call, pick = draw(st.sampled_from(CALLS)), draw(st.integers(0, 10**6))

        def edit_index(path: Path) -> None:
            index = path / "release" / ".metadata"
            index.write_bytes(with_a_call(index.read_bytes(), call, pick))

        return f"{kind} {call[0]}.{call[1]}", edit_index
    if kind == "pickle-opcode":
        pick, code, drop = draw(st.integers(0, 10**6)), draw(st.sampled_from(OPCODES)), draw(st.booleans())

        def edit_opcode(path: Path) -> None:
            index = path / "release" / ".metadata"
            index.write_bytes(with_an_opcode_changed(index.read_bytes(), pick, code, drop))

        return f"{kind} {code!r} {'dropped' if drop else ''}", edit_opcode
    if kind in ("metadata-json", "info-duplicate"):
        name = "release/metadata.json" if kind == "metadata-json" else "mbridge_refit_megatron.json"
        value, duplicate = draw(JSON_VALUES), draw(st.booleans()) or kind == "info-duplicate"

        def edit_json(path: Path) -> None:
            text = (path / name).read_text()
            data = json.loads(text)
            key = sorted(data)[0]
            (path / name).write_text(with_key_twice(text, key, value) if duplicate else json.dumps(value))

        return f"{kind} {'duplicate' if duplicate else 'value'}", edit_json
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


# --- the readers alone: accepted, or refused with the package's own error --------------------------------

# Seconds of examples per reader property (hundreds of examples: the readers take milliseconds).
READER_BUDGET_S = 5.0 * (LONG_SCALE if LONG else 1)
READERS = settings(FUZZ, max_examples=examples(200))


def accepted_or_refused(read) -> InputError | None:
    """``read()``'s refusal (an ``InputError``), or None when it accepted its input; any other exception
    propagates and fails the example."""
    try:
        read()
    except InputError as err:
        return err
    return None


def read_hf(checkpoint: Path) -> None:
    """Everything a conversion reads of an HF checkpoint: its index or header, every header against the
    index, every tensor's dtype, shape and bytes."""
    from mbridge_refit.checkpoints.hf import HFCheckpoint

    opened = HFCheckpoint.open(checkpoint)
    opened.validate()
    for name in opened.names():
        opened.dtype(name), opened.shape(name), opened.tensor(name)


def check_hf_input(checkpoint: Path) -> None:
    """The command line's checks of ``--hf`` before any collective (``inputs.checked_hf_input``)."""
    from mbridge_refit.convert import build_parser
    from mbridge_refit.convert.inputs import checked_hf_input

    with restored_environment():
        checked_hf_input(build_parser().parse_args(["roundtrip", "--hf", str(checkpoint), "--out", "unused"]))


def read_megatron(checkpoint: Path) -> None:
    """What ``export`` reads of a Megatron checkpoint before the model is built: its metadata, the
    pickled parts' checks, the index's tensors."""
    from mbridge_refit.checkpoints.megatron import CheckpointInfo, read_stored

    CheckpointInfo.read(checkpoint)
    read_stored(checkpoint)


class ReaderBudget(Budget):
    def spent(self) -> bool:
        self.start = self.start if self.start is not None else time.monotonic()
        return not self.failed and time.monotonic() - self.start > READER_BUDGET_S


HEADER_READS, INDEX_READS, LINK_READS, CONFIG_READS, MEGATRON_READS = (ReaderBudget() for _ in range(5))


@settings(READERS)
@given(mutation=header_mutations(), layout=st.sampled_from(["sharded", "single"]))
def test_fuzzed_headers_are_read_or_refused(mutation, layout, sharded, single, tmp_path):
    if HEADER_READS.spent():
        return
    with HEADER_READS.example():
        work = fresh(tmp_path, sharded if layout == "sharded" else single)
        shard = sorted((work / "in").glob("*.safetensors"))[0]
        shard.write_bytes(mutation[1](shard.read_bytes()))
        accepted_or_refused(lambda: read_hf(work / "in"))


@settings(READERS)
@given(mutation=index_mutations())
def test_fuzzed_indexes_are_read_or_refused(mutation, sharded, tmp_path):
    if INDEX_READS.spent():
        return
    with INDEX_READS.example():
        work = fresh(tmp_path, sharded)
        index = json.loads((work / "in" / INDEX).read_text())
        (work / "in" / INDEX).write_text(mutation[1](index), encoding="utf-8", errors="surrogatepass")
        refused = accepted_or_refused(lambda: read_hf(work / "in"))
        if mutation[0] == "duplicate":
            assert refused is not None and "more than once" in str(refused), refused


@settings(READERS, max_examples=examples(60))
@given(how=st.sampled_from(LINK_TARGETS), pick=st.integers(0, 10**6), layout=st.sampled_from(["sharded", "single"]))
def test_fuzzed_shard_links_are_read_or_refused(how, pick, layout, sharded, single, tmp_path):
    """Only a link that stays inside the checkpoint reads; the rest is refused, the index unchanged."""
    if LINK_READS.spent():
        return
    with LINK_READS.example():
        work = fresh(tmp_path, sharded if layout == "sharded" else single)
        link_a_shard(work / "in", how, pick)
        refused = accepted_or_refused(lambda: read_hf(work / "in"))
        assert (refused is None) == (how == "inside"), (how, refused)


@settings(READERS, max_examples=examples(150))
@given(mutation=config_mutations())
def test_fuzzed_configs_are_accepted_or_refused(mutation, single, megatron, tmp_path):
    if CONFIG_READS.spent():
        return
    with CONFIG_READS.example():
        work = fresh(tmp_path, single)
        config = json.loads((work / "in" / "config.json").read_text())
        (work / "in" / "config.json").write_text(mutation[1](config), encoding="utf-8", errors="surrogatepass")
        refused = accepted_or_refused(lambda: check_hf_input(work / "in"))
        if mutation[0].startswith("duplicate"):
            assert refused is not None and "more than once" in str(refused), refused


@settings(READERS)
@given(mutation=megatron_mutations())
def test_fuzzed_megatron_metadata_is_read_or_refused(mutation, megatron, tmp_path, monkeypatch):
    """A ``.metadata`` with a call between its opcodes is refused and the call never runs (the marker a
    payload would create is looked for in the directory the example runs in)."""
    if MEGATRON_READS.spent():
        return
    with MEGATRON_READS.example():
        work = fresh(tmp_path, megatron)
        mutation[1](work / "in")
        monkeypatch.chdir(work)
        refused = accepted_or_refused(lambda: read_megatron(work / "in"))
        assert not (work / MARKER).exists(), f"{mutation[0]}: the index ran code"
        if mutation[0].startswith("pickle-call") and not mutation[0].endswith("pathlib.PosixPath"):
            assert refused is not None, mutation[0]
        if mutation[0] == "common":
            assert refused is not None and "common.pt" in str(refused), refused


# --- properties ---------------------------------------------------------------------------------------


HEADER_BUDGET, INDEX_BUDGET, CONFIG_BUDGET, MEGATRON_BUDGET, ADAPTER_BUDGET = (Budget() for _ in range(5))


@settings(FUZZ, max_examples=examples(150))
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


@settings(FUZZ, max_examples=examples(150))
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


@settings(FUZZ, max_examples=examples(120))
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


@settings(FUZZ, max_examples=examples(120))
@given(mutation=megatron_mutations())
def test_fuzzed_megatron_checkpoint(mutation, megatron, tmp_path, capsys, monkeypatch):
    if MEGATRON_BUDGET.spent():
        return
    with MEGATRON_BUDGET.example():
        work = fresh(tmp_path, megatron)
        mutation[1](work / "in")
        monkeypatch.chdir(work)
        code, output = run(capsys, "export", "--megatron", work / "in", "--out", work / "out", "--no-progress")
        assert_contract(code, output, work / "out", allowed={0, 2, 4})
        assert not (work / MARKER).exists(), f"{mutation[0]}: a pickled part ran code"


# --- export-adapter: a LoRA run's save directory and its base ---------------------------------------------

ADAPTER_KEY = "decoder.layers.0.self_attention.linear_proj.adapter.linear_in.weight"
PEFT_FIELDS = ["_target_", "dim", "alpha", "dropout", "target_modules", "dropout_position", "lora_A_init_method"]


@pytest.fixture(scope="module")
def peft_save(single, tmp_path_factory) -> Path:
    """A save directory as a LoRA run leaves it (tracker, iter_0000001 with its torch_dist index and
    run_config.yaml) over ``single`` as the base, holding one adapter tensor: ``export-adapter`` reads it
    through to the LoRA-wrapped model and refuses it there (the adapters do not fit), so every mutation
    below meets the reads before that."""
    import torch
    import torch.distributed.checkpoint as dcp

    from mbridge_refit.checkpoints.megatron_peft import LORA_TARGET, RUN_CONFIG_NAME

    root = tmp_path_factory.mktemp("fuzz") / "peft"
    iteration = root / "save" / "iter_0000001"
    dcp.save({ADAPTER_KEY: torch.zeros(4, 64)}, checkpoint_id=str(iteration), no_dist=True)
    config = json.loads((single / "config.json").read_text())
    run_config = {
        "model": {"num_layers": config["num_hidden_layers"], "hidden_size": config["hidden_size"]},
        "peft": {"_target_": LORA_TARGET, "dim": 4, "alpha": 8, "target_modules": ["linear_proj"]},
    }
    (iteration / RUN_CONFIG_NAME).write_text(json.dumps(run_config))  # JSON is YAML
    (root / "save" / TRACKER_FILE).write_text("1\n")
    shutil.copytree(single, root / "base")
    return root


@st.composite
def adapter_mutations(draw):
    """(description, function run dir -> None) on a copy of ``peft_save``: its tracker, run_config.yaml,
    the base's config.json or the base's safetensors header."""
    kind = draw(st.sampled_from(["tracker", "run-config", "peft-field", "base-config", "base-header"]))
    if kind == "tracker":
        content = draw(TRACKER_TEXTS)

        def edit_tracker(path: Path) -> None:
            (path / "save" / TRACKER_FILE).unlink()
            if content is not None:
                (path / "save" / TRACKER_FILE).write_bytes(content)

        return kind, edit_tracker
    run_config = "save/iter_0000001/run_config.yaml"
    if kind == "run-config":
        text = draw(
            st.one_of(
                st.binary(max_size=64),
                st.text(max_size=64).map(str.encode),
                JSON_VALUES.map(lambda value: json.dumps(value).encode()),
            )
        )
        return kind, lambda path: (path / run_config).write_bytes(text)
    if kind == "peft-field":
        field, value = draw(st.sampled_from(PEFT_FIELDS)), draw(st.one_of(CONFIG_NUMBERS, JSON_VALUES))

        def edit_peft(path: Path) -> None:
            config = json.loads((path / run_config).read_text())
            config["peft"][field] = value
            (path / run_config).write_text(json.dumps(config))

        return f"{kind} {field}", edit_peft
    if kind == "base-config":
        _, edit = draw(config_mutations())

        def edit_config(path: Path) -> None:
            config = path / "base" / "config.json"
            config.write_text(edit(json.loads(config.read_text())), encoding="utf-8", errors="surrogatepass")

        return kind, edit_config
    _, damage = draw(header_mutations())

    def edit_header(path: Path) -> None:
        shard = path / "base" / SINGLE
        shard.write_bytes(damage(shard.read_bytes()))

    return kind, edit_header


@settings(FUZZ, max_examples=examples(80))
@given(mutation=adapter_mutations())
def test_fuzzed_export_adapter(mutation, peft_save, megatron, tmp_path, capsys):
    if ADAPTER_BUDGET.spent():
        return
    with ADAPTER_BUDGET.example():
        work = fresh(tmp_path, peft_save) / "in"
        mutation[1](work)
        out = work.parent / "out"
        code, output = run(capsys, "export-adapter", "--megatron", work / "save", "--hf", work / "base", "--out", out)
        assert_contract(code, output, out, allowed={2, 4})  # the one adapter never fits: 0 would be a bug


@pytest.mark.slow
def test_long_fuzz_run():
    """Every property above carried LONG_SCALE times further (same seeds): ``MBRIDGE_REFIT_FUZZ=long`` in a
    child pytest on this file (docs/testing.md gives the command; 20-40 minutes on 2 cores)."""
    import subprocess
    import sys

    env = {**os.environ, "MBRIDGE_REFIT_FUZZ": "long"}
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env=env,
        cwd=Path(__file__).parent.parent,
        capture_output=True,
        text=True,
    )
    assert child.returncode == 0, (child.stdout + child.stderr)[-6000:]
