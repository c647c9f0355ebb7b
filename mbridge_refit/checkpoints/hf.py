"""Reading Hugging Face safetensors checkpoints on disk: the independent oracle.

Owns :class:`HFCheckpoint` (names, shapes, dtypes and tensors of a checkpoint directory, read
through safetensors' own reader, never through our writer) and :func:`compare_checkpoints`, the
bitwise comparison used by tests and by ``verify``; and :func:`load_config`, a checkpoint's
``config.json`` read without running the checkpoint's own code unless the caller asks for it.

Everything read here is input: a damaged or hostile file raises ``CheckpointError`` (a
``config.json`` that cannot describe a model: ``ConfigError``) naming the file and what is wrong,
never a reader's own exception. Every safetensors file, the single ``model.safetensors`` as each
shard of an index, has its header checked the same way (``_header_names``: the length, the JSON,
a name given twice, then safetensors' own checks of dtypes and offsets); index entries must name
files inside the checkpoint directory, checked before any of them is opened, and none may be a
FIFO, device or socket (the first read of a FIFO waits for a writer forever). Every shard, the single
``model.safetensors`` too, follows the rule side files follow (``side_files.outside_problem``): once
links are resolved it lies in the checkpoint directory, or is a blob of the Hugging Face cache the
directory is a snapshot of; a link to a file elsewhere is refused when the checkpoint is opened, and
again at each open (``_shard_file``). Every file is opened without blocking and read only once
``fstat`` shows it is a regular file. The index and
``config.json`` are parsed as headers are, refusing an object that names a key twice
(``loads_unique_keys``: ``json.loads`` would keep the last value silently).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import torch
from safetensors import safe_open

from mbridge_refit.checkpoints.regular_files import file_kind, open_if_regular
from mbridge_refit.checkpoints.side_files import outside_problem
from mbridge_refit.errors import InputError

__all__ = [
    "CONFIG_NAME",
    "COPIED_FILE_NAMES",
    "CheckpointError",
    "CheckpointFilesMissing",
    "ConfigError",
    "HFCheckpoint",
    "INDEX_NAME",
    "MAX_CONFIG_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_INDEX_BYTES",
    "MAX_MODULE_COUNT",
    "MAX_NAME_BYTES",
    "RemoteCodeError",
    "SINGLE_FILE_NAME",
    "compare_checkpoints",
    "load_config",
    "loads_unique_keys",
    "read_config_json",
    "remote_code_refusal",
]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
# Copied verbatim from `copy_files_from` when present (config.json is handled separately).
COPIED_FILE_NAMES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
_MAX_OPEN_HANDLES = 8
# safetensors refuses headers longer than this (its MAX_HEADER_SIZE); checked before reading one.
MAX_HEADER_BYTES = 100_000_000
# An index lists one line per tensor: 100k tensors take about 10 MB.
MAX_INDEX_BYTES = 256 * 2**20
# The longest file name most filesystems hold (NAME_MAX), in bytes.
MAX_NAME_BYTES = 255

logger = logging.getLogger(__name__)

# safetensors dtype codes -> torch dtypes (optional ones only where this torch has them).
_DTYPES: dict[str, torch.dtype] = {
    code: getattr(torch, attr)
    for code, attr in {
        "BOOL": "bool",
        "U8": "uint8",
        "I8": "int8",
        "U16": "uint16",
        "I16": "int16",
        "U32": "uint32",
        "I32": "int32",
        "U64": "uint64",
        "I64": "int64",
        "F16": "float16",
        "BF16": "bfloat16",
        "F32": "float32",
        "F64": "float64",
        "C64": "complex64",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E4M3FNUZ": "float8_e4m3fnuz",
        "F8_E5M2": "float8_e5m2",
        "F8_E5M2FNUZ": "float8_e5m2fnuz",
        "F8_E8M0": "float8_e8m0fnu",
    }.items()
    if hasattr(torch, attr)
}


class CheckpointError(InputError):
    """A checkpoint's files are unreadable or disagree with its index (the message lists what)."""


class CheckpointFilesMissing(CheckpointError, FileNotFoundError):
    """The checkpoint directory, its weights, or shards its index names do not exist (a
    ``FileNotFoundError`` too, for callers that catch that)."""


class ConfigError(InputError):
    """A ``config.json`` that is not a JSON object describing a model (the message names the file)."""


@dataclass(frozen=True, kw_only=True)
class HFCheckpoint:
    """A safetensors checkpoint directory (sharded with an index, or one ``model.safetensors``).

    Attributes:
        path: the checkpoint directory.
        weight_map: tensor name -> file name (relative to ``path``).
    """

    path: Path
    weight_map: dict[str, str]
    _handles: OrderedDict[str, Any] = field(default_factory=OrderedDict, init=False, repr=False, compare=False)

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> HFCheckpoint:
        """Read the index (or the single file's header) of the checkpoint at ``path``."""
        path = Path(path)
        if not path.is_dir():
            raise CheckpointFilesMissing(
                f"checkpoint directory {path} does not exist; expected a directory holding "
                f"{INDEX_NAME} with its shards, or a single {SINGLE_FILE_NAME}"
            )
        if (path / INDEX_NAME).is_file():
            weight_map = _read_index(path)
        elif (path / SINGLE_FILE_NAME).is_file():
            _shard_file(path, SINGLE_FILE_NAME)  # a link to elsewhere is refused as such, not as damage
            try:
                names = _header_names(path, SINGLE_FILE_NAME)
            except CheckpointError as err:
                raise CheckpointError(
                    f"the checkpoint at {path} is damaged: {err}. Re-export or re-download it"
                ) from err
            weight_map = dict.fromkeys(names, SINGLE_FILE_NAME)
        else:
            found = sorted(p.name for p in path.glob("*.safetensors"))
            raise CheckpointFilesMissing(
                f"no checkpoint in {path}: expected {INDEX_NAME} (sharded) or {SINGLE_FILE_NAME}; "
                f"found safetensors files {found or 'none'}"
            )
        return cls(path=path, weight_map=weight_map)

    def validate(self) -> None:
        """Read every file's header and check it against the index, before anything is loaded.

        Raises ``CheckpointError`` listing each problem: a file that cannot be read or whose
        header does not parse (truncated, garbage, oversized, a name given twice, offsets outside
        the file or overlapping, an unknown dtype: ``_header_names``), a tensor the index lists
        but its file lacks, a tensor a file holds that the index does not list for that file (e.g.
        a second copy of a tensor)."""
        problems: list[str] = []
        listed: dict[str, set[str]] = {}
        for name, file_name in self.weight_map.items():
            listed.setdefault(file_name, set()).add(name)
        for file_name, names in sorted(listed.items()):
            try:
                held = set(_header_names(self.path, file_name))
            except CheckpointError as err:
                problems.append(str(err))
                continue
            problems += [f"{file_name} lacks {name}, which the index lists there" for name in sorted(names - held)]
            problems += [
                f"{file_name} holds {name}, which the index does not list there" for name in sorted(held - names)
            ]
        if problems:
            shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
            raise CheckpointError(f"the checkpoint at {self.path} is damaged: {shown}. Re-export or re-download it")

    def names(self) -> list[str]:
        """All tensor names, sorted."""
        return sorted(self.weight_map)

    def tensor(self, name: str) -> torch.Tensor:
        """The whole tensor ``name`` (read into CPU memory)."""
        return self._handle(name).get_tensor(name)

    def slice(self, name: str) -> Any:
        """safetensors' lazy slice of ``name``: index it (``s[0:4]``) to read only that part."""
        return self._handle(name).get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of ``name``, from the file header (no data read)."""
        return tuple(self.slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        """torch dtype of ``name``, from the file header (no data read)."""
        code = self.slice(name).get_dtype()
        if code not in _DTYPES:
            raise CheckpointError(
                f"tensor {name!r} in {self.path} has safetensors dtype {code}, which this torch "
                f"build cannot represent; known dtypes: {sorted(_DTYPES)}"
            )
        return _DTYPES[code]

    def config(self) -> dict[str, Any] | None:
        """Parsed ``config.json``, or None if the directory has none."""
        config = self.path / CONFIG_NAME
        return read_config_json(config) if config.is_file() else None

    def _handle(self, name: str) -> Any:
        if name not in self.weight_map:
            raise KeyError(f"tensor {name!r} is not in the checkpoint at {self.path}")
        file_name = self.weight_map[name]
        handle = self._handles.pop(file_name, None)
        if handle is None:
            handle = _safe_open(self.path, file_name)
        self._handles[file_name] = handle
        while len(self._handles) > _MAX_OPEN_HANDLES:
            self._handles.popitem(last=False)
        return handle


# Why a shard must lie in its checkpoint (``side_files.outside_problem``, the rule side files follow).
_SHARD_INSIDE = (
    "a shard is read as this checkpoint's weights (a conversion writes its tensors into the output), so it must "
    "lie in the checkpoint"
)


def _shard_file(directory: Path, name: str) -> Path:
    """``directory / name`` with its links resolved, once it passes the rule every file read from a
    checkpoint by name follows (``side_files.outside_problem``: a file inside the checkpoint, or a
    blob of the Hugging Face cache it is a snapshot of); ``CheckpointError`` naming it otherwise.
    Reading the path returned reads the file checked, whatever link is put at ``name`` since."""
    problem = outside_problem(directory, name, why=_SHARD_INSIDE)
    if problem is not None:
        raise CheckpointError(problem)
    return Path(os.path.realpath(Path(directory) / name))


def _safe_open(directory: Path, name: str) -> Any:
    """safetensors' reader of the shard ``directory / name`` (``_shard_file``); where the file cannot be
    opened, the OSError that says why (safetensors reports every failure to open, permission denied
    included, as "No such file or directory", and a directory as "No such device"), and
    ``CheckpointError`` for a FIFO, device or socket (``_open_regular``)."""
    file = _shard_file(directory, name)
    with _open_regular(file, shown=Path(directory) / name):
        pass
    return safe_open(file, framework="pt")


def _open_regular(file: Path, *, shown: Path | None = None) -> BinaryIO:
    """``file`` opened for reading; a directory raises ``IsADirectoryError`` (as ``open`` does), any
    other file that is not a regular file ``CheckpointError`` (naming ``shown``, the path as the
    checkpoint names it, where given). Opened without blocking (a FIFO with no writer would otherwise
    wait forever), then checked on the open descriptor, so a file replaced after the index was checked
    is refused too (``regular_files.open_if_regular``)."""
    fd, kind = open_if_regular(file)
    file = shown if shown is not None else file
    if kind == "directory":
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(file))
    if fd is None:
        raise CheckpointError(
            f"cannot read {file}: it is a {kind}, but it must be a regular safetensors file (reading a FIFO or "
            "device may never end)"
        )
    return os.fdopen(fd, "rb")


def _header_names(directory: Path, name: str) -> list[str]:
    """The tensor names in the header of the safetensors file ``directory / name`` (a shard:
    ``_shard_file``), once the whole header is checked.

    Checked here: the file holds the 8-byte length and that many header bytes (at most
    ``MAX_HEADER_BYTES``), the header is a JSON object (not nested past the JSON parser's depth)
    naming no key twice (safetensors would keep the last silently); then safetensors' own reader
    checks each entry's dtype and that the offsets tile the data exactly. Raises
    ``CheckpointError`` naming the file and what is wrong."""
    file, resolved = Path(directory) / name, _shard_file(directory, name)
    try:
        with _open_regular(resolved, shown=file) as handle:
            size = os.fstat(handle.fileno()).st_size
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise CheckpointError(
                    f"cannot read {file}: it has {size} bytes, fewer than the 8 of a safetensors header length"
                )
            length = int.from_bytes(prefix, "little")
            if length > min(MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(
                    f"cannot read {file}: its header length is {length} bytes, but the file has {size - 8} "
                    f"bytes after the length (and safetensors reads at most {MAX_HEADER_BYTES}): truncated or not "
                    "a safetensors file"
                )
            raw = handle.read(length)
    except OSError as err:
        raise CheckpointError(f"cannot read {file}: {type(err).__name__}: {err}") from err
    try:
        loads_unique_keys(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as err:  # JSONDecodeError is a ValueError
        raise CheckpointError(
            f"cannot read {file}: its header is not the JSON safetensors writes ({type(err).__name__}: {err})"
        ) from err
    try:
        with safe_open(resolved, framework="pt") as handle:
            return list(handle.keys())
    except Exception as err:  # safetensors raises its own error type (SafetensorError) for bad headers
        raise CheckpointError(f"cannot read {file}: {type(err).__name__}: {err}") from err


def loads_unique_keys(raw: bytes | str) -> Any:
    """``raw`` parsed as JSON, refusing an object that names a key twice: JSON allows it and
    ``json.loads`` keeps the last value silently, so two readers of one file could see different
    content. Raises ``ValueError`` (``json.JSONDecodeError`` for text that is not JSON) naming the
    repeated keys; linear in the number of keys (a safetensors header may hold millions)."""
    return json.loads(raw, object_pairs_hook=_refuse_repeated_keys)


def _refuse_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) < len(pairs):
        repeated = sorted(key for key, count in Counter(key for key, _ in pairs).items() if count > 1)
        raise ValueError(f"one object names {repeated[:3]} more than once (a JSON reader keeps only the last)")
    return result


def _read_index(path: Path) -> dict[str, str]:
    index_file = path / INDEX_NAME
    try:
        if index_file.stat().st_size > MAX_INDEX_BYTES:
            raise CheckpointError(f"{index_file.stat().st_size} bytes, more than the {MAX_INDEX_BYTES} of any HF index")
        index = loads_unique_keys(index_file.read_bytes())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
        raise CheckpointError(
            f"cannot read {index_file}: {err}; the index must be the JSON an HF export writes"
        ) from err
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_file} has no 'weight_map' object; is it an HF safetensors index?")
    problems = {name: _shard_name_problem(file) for name, file in weight_map.items()}
    bad = sorted(f"{name!r}: {problem}" for name, problem in problems.items() if problem)
    if bad:
        raise CheckpointError(
            f"{index_file} maps tensors to files that cannot be this checkpoint's shards ({'; '.join(bad[:5])}"
            f"{f'; and {len(bad) - 5} more' if len(bad) > 5 else ''}): every value of weight_map must be the name of a "
            f"file in {path}. Re-export or re-download the checkpoint"
        )
    outside = [
        problem for f in sorted(set(weight_map.values())) if (problem := outside_problem(path, f, why=_SHARD_INSIDE))
    ]
    if outside:
        raise CheckpointError(
            f"{index_file} maps tensors to files that are not this checkpoint's own ({'; '.join(outside[:3])}"
            f"{f'; and {len(outside) - 3} more' if len(outside) > 3 else ''})"
        )
    missing = sorted({f for f in weight_map.values() if not (path / f).exists()})
    if missing:
        raise CheckpointFilesMissing(
            f"{path / INDEX_NAME} names shard files that do not exist: {missing}; "
            "the checkpoint is incomplete (re-run the export)"
        )
    special = sorted({f for f in weight_map.values() if not ((path / f).is_file() or (path / f).is_dir())})
    if special:
        kinds = [f"{path / f} is a {file_kind((path / f).stat().st_mode)}" for f in special[:5]]
        raise CheckpointError(
            f"{index_file} maps tensors to files that are not regular files ({'; '.join(kinds)}"
            f"{f'; and {len(special) - 5} more' if len(special) > 5 else ''}): each shard must be a regular "
            "safetensors file (reading a FIFO or device may never end). Re-export or re-download the checkpoint"
        )
    return dict(weight_map)


def _shard_name_problem(file: Any) -> str | None:
    """Why ``file`` (a value of an index's weight_map) cannot name a shard inside the checkpoint
    directory, or None: a relative path without ``..`` whose every part a filesystem can hold.
    Checked on the text alone, so nothing outside the checkpoint is opened or even looked up."""
    if not isinstance(file, str):
        return f"{type(file).__name__} {str(file)[:40]!r} is not a file name"
    parts = file.split("/")
    if not file or "\0" in file or file.startswith("/") or any(part in ("", ".", "..") for part in parts):
        return f"{file[:80]!r} is not a plain relative path inside the checkpoint"
    longest = max(len(part.encode("utf-8", "surrogatepass")) for part in parts)
    if longest > MAX_NAME_BYTES:
        return f"a {longest}-byte file name, longer than the {MAX_NAME_BYTES} bytes a filesystem holds"
    return None


def compare_checkpoints(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> list[str]:
    """Human-readable differences between checkpoints ``a`` and ``b``; ``[]`` means identical.

    Reports names only in A, names only in B, and for common names a shape, dtype or byte
    mismatch. A damaged checkpoint (``HFCheckpoint.validate``) raises ``CheckpointError``
    instead: a corrupt file is not a difference. Bytes are compared exactly (so NaN payloads and -0.0 count); a byte mismatch
    reports the number of differing elements and the max abs difference in float32. Reads one
    tensor pair at a time.
    """
    ckpt_a, ckpt_b = HFCheckpoint.open(a), HFCheckpoint.open(b)
    ckpt_a.validate()
    ckpt_b.validate()
    names_a, names_b = set(ckpt_a.weight_map), set(ckpt_b.weight_map)
    diffs = [f"only in A ({ckpt_a.path}): {name}" for name in sorted(names_a - names_b)]
    diffs += [f"only in B ({ckpt_b.path}): {name}" for name in sorted(names_b - names_a)]
    for name in sorted(names_a & names_b):
        diff = _compare_tensor(ckpt_a, ckpt_b, name)
        if diff is not None:
            diffs.append(diff)
    return diffs


def _compare_tensor(a: HFCheckpoint, b: HFCheckpoint, name: str) -> str | None:
    shape_a, shape_b = a.shape(name), b.shape(name)
    if shape_a != shape_b:
        return f"shape mismatch: {name}: A {list(shape_a)} vs B {list(shape_b)}"
    dtype_a, dtype_b = a.dtype(name), b.dtype(name)
    if dtype_a != dtype_b:
        return f"dtype mismatch: {name}: A {dtype_a} vs B {dtype_b}"
    x, y = a.tensor(name).contiguous(), b.tensor(name).contiguous()
    if torch.equal(_element_bytes(x), _element_bytes(y)):
        return None
    return f"byte mismatch: {name}: {_describe_difference(x, y)}"


def _element_bytes(t: torch.Tensor) -> torch.Tensor:
    """One row of raw bytes per element (works for 0-d tensors too)."""
    return t.reshape(-1).view(torch.uint8).reshape(t.numel(), t.element_size())


def _describe_difference(x: torch.Tensor, y: torch.Tensor) -> str:
    differs = (_element_bytes(x) != _element_bytes(y)).any(dim=1)
    count = int(differs.sum())
    text = f"{count} of {x.numel()} elements differ"
    try:
        delta = (x.reshape(-1)[differs].float() - y.reshape(-1)[differs].float()).abs()
    except (RuntimeError, TypeError):  # e.g. complex dtypes
        return text
    finite = delta[torch.isfinite(delta)]
    if finite.numel():
        text += f", max abs diff {float(finite.max()):.6g}"
    if finite.numel() < delta.numel():
        text += f", {delta.numel() - finite.numel()} differing elements are NaN/inf"
    return text


class RemoteCodeError(InputError):
    """A checkpoint whose architecture exists only as its own Python code (``auto_map``), which runs
    only where the caller asks for it (``trust_remote_code=True``, the CLI's ``--trust-remote-code``)."""


def load_config(checkpoint_dir: str | os.PathLike[str], *, trust_remote_code: bool = False) -> Any:
    """The checkpoint's ``config.json`` as a transformers config, read once, by transformers.

    Without ``trust_remote_code`` no code from the checkpoint runs: transformers is called with
    ``trust_remote_code=False``, so a ``model_type`` it has built in loads with its built-in class
    whatever ``auto_map`` says (NVIDIA's Nemotron-H checkpoints carry both), and a config whose
    architecture exists only as the checkpoint's own code raises ``RemoteCodeError``. With it,
    transformers decides as it does for any caller (an ``auto_map`` class is then imported and run).
    The file is checked first (``read_config_json``: a JSON object of bounded size, layer and expert
    counts); a config transformers refuses is a ``ConfigError`` naming why.
    """
    from transformers import AutoConfig

    read_config_json(Path(checkpoint_dir) / CONFIG_NAME)
    if trust_remote_code:
        logger.warning("reading %s with trust_remote_code=True: the checkpoint's own code may run", checkpoint_dir)
    try:
        config = AutoConfig.from_pretrained(Path(checkpoint_dir), trust_remote_code=trust_remote_code)
    except OSError:
        raise
    except (
        Exception
    ) as err:  # a type that needs its own code, or transformers' field checks (StrictDataclassError, ValueError...)
        refusal = remote_code_refusal(checkpoint_dir) if not trust_remote_code else None
        if refusal is not None:
            raise refusal from err
        raise ConfigError(
            f"{Path(checkpoint_dir) / CONFIG_NAME}: transformers refuses it ({type(err).__name__}: {err})"
        ) from err
    if not trust_remote_code and getattr(config, "auto_map", None):
        logger.info("%s: model_type %r is built in; auto_map not used", checkpoint_dir, config.model_type)
    return config


def remote_code_refusal(checkpoint_dir: str | os.PathLike[str]) -> RemoteCodeError | None:
    """The ``RemoteCodeError`` for a local checkpoint whose ``model_type`` transformers does not have
    built in and whose config names the checkpoint's own code for it (``auto_map``); None for any
    other directory, config or unreadable file (transformers then reports what it finds). Reads
    ``config.json`` as JSON: nothing is imported."""
    from transformers import __version__ as transformers_version
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    path = Path(checkpoint_dir) / CONFIG_NAME
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("auto_map"), dict) or "AutoConfig" not in raw["auto_map"]:
        return None
    model_type = raw.get("model_type")
    if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
        return None
    return RemoteCodeError(
        f"{path}: model_type {model_type!r} is not built into transformers {transformers_version}; its auto_map names "
        f"the checkpoint's own Python code ({raw['auto_map']['AutoConfig']}), which runs only if you ask for it: "
        "trust_remote_code=True (Python API) or --trust-remote-code (command line), for checkpoints you trust. "
        "Or use a transformers release that has this architecture built in."
    )


# What a config.json may ask for before anything compares it with the weights. transformers expands
# a layer count into per-layer lists and the model is built one module per layer and per expert, so
# a count of 1e9 would take minutes and gigabytes before any check sees the checkpoint. Published
# models stay far below (about 200 layers, 512 routed experts); their config.json is kilobytes.
MAX_MODULE_COUNT = 16_384
MAX_CONFIG_BYTES = 16 * 2**20
_MODULE_COUNT_KEY = re.compile(r"(layers|layer|depth|experts)$")


def read_config_json(path: Path) -> dict[str, Any]:
    """``path`` (a ``config.json``) parsed; ``ConfigError`` unless it is a JSON object of at most
    ``MAX_CONFIG_BYTES`` whose layer and expert counts (keys ending in ``layers``, ``layer``,
    ``depth`` or ``experts``, at any depth) are at most ``MAX_MODULE_COUNT``."""
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{path} has {size} bytes (more than {MAX_CONFIG_BYTES}): it is not the config.json of an HF model"
        )
    try:
        raw = loads_unique_keys(path.read_bytes())
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise ConfigError(
            f"{path} is not the JSON of a config ({type(err).__name__}: {err}); it must be the config.json of an HF model"
        ) from err
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{path} holds a JSON {type(raw).__name__}, not an object: it must be the config.json of an HF model"
        )
    too_many = [f"{key}={value}" for key, value in _module_counts(raw) if value > MAX_MODULE_COUNT]
    if too_many:
        raise ConfigError(
            f"{path} asks for {', '.join(too_many[:3])}: more than {MAX_MODULE_COUNT} layers or experts, which no "
            "checkpoint holds (it would take minutes and gigabytes to build before any check). Fix config.json"
        )
    return raw


def _module_counts(value: Any, depth: int = 0) -> Iterator[tuple[str, int]]:
    """(key, count) of every integer whose key names layers or experts, at any depth of ``value``."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(item, int) and not isinstance(item, bool) and _MODULE_COUNT_KEY.search(str(key)):
            yield str(key), item
        elif isinstance(item, (dict, list)) and depth < 32:
            yield from _module_counts(item, depth + 1)
