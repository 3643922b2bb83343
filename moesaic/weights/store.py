"""WeightStore: a lazy view of a checkpoint folder.

Reads only the safetensors headers when opened; a tensor's bytes are touched when `get(name)`
is called, through a private (copy-on-write) mmap of its file, so nothing is read twice and a
tensor nobody asks for is never paged in. Understands the three layouts the releases use:
one `model.safetensors`, a sharded `*.safetensors.index.json`, and Mistral's native
`params.json` + `consolidated*.safetensors`.
"""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import stat
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CheckpointError, ConfigError
from .dtypes import SAFETENSORS, SAFETENSORS_CODE


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors spelling, e.g. "BF16"
    shape: tuple[int, ...]
    file: Path
    start: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


MAX_JSON_BYTES = 100 * 2**20  # a config, an index or a safetensors header larger than this is not plausible


def read_header(path: Path) -> tuple[dict, int]:
    """Returns (header dict, offset of the data section) of one safetensors file."""
    _check_regular(path, "safetensors file", CheckpointError)
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path}: too short to be a safetensors file")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_JSON_BYTES:
                raise CheckpointError(f"{path}: safetensors header of {n} bytes is not plausible")
            text = f.read(n)
            if len(text) != n:
                raise CheckpointError(
                    f"{path}: the header says it is {n} bytes but the file ends after {len(text)}: the file "
                    "is truncated, download it again"
                )
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or e})") from None
    try:
        header = json.loads(text, object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{path}: safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    return header, 8 + n


def _no_duplicates(pairs: list) -> dict:
    """A JSON object whose keys are unique: a name given twice would silently hide one of its values."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"key {twice!r} appears twice")
    return out


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def parse_entry(path: Path, name: str, h, data_start: int, size: int) -> TensorInfo:
    """One header entry checked the way the safetensors reader checks it: a known dtype, a shape of
    non-negative ints, two ordered offsets inside the file that hold exactly shape x itemsize bytes."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(h, dict) or not {"dtype", "shape", "data_offsets"} <= h.keys():
        raise CheckpointError(f"{where}: malformed header entry (needs dtype, shape and data_offsets)")
    dtype, shape, offsets = h["dtype"], h["shape"], h["data_offsets"]
    if not isinstance(dtype, str) or dtype not in SAFETENSORS:
        raise CheckpointError(f"{where} has unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise CheckpointError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise CheckpointError(f"{where}: data_offsets {offsets!r} are not two non-negative integers")
    begin, end = offsets
    if end < begin:
        raise CheckpointError(f"{where}: data_offsets [{begin}, {end}] end before they begin")
    if data_start + end > size:
        raise CheckpointError(
            f"{where} lies beyond the end of the file (its data ends at byte {data_start + end}, the file "
            f"has {size}): the file is truncated, download it again"
        )
    numel = 1
    for d in shape:
        numel *= d
    if numel * SAFETENSORS[dtype].itemsize != end - begin:
        raise CheckpointError(
            f"{where}: header says {dtype}{shape} ({numel * SAFETENSORS[dtype].itemsize} bytes) "
            f"but its data_offsets [{begin}, {end}] hold {end - begin} bytes"
        )
    return TensorInfo(name, dtype, tuple(shape), path, data_start + begin, data_start + end)


def check_disjoint(path: Path, infos: list[TensorInfo]) -> None:
    """No two tensors of a file share bytes. The safetensors reader (huggingface/safetensors,
    safetensors/src/tensor.rs, `Metadata::validate`) refuses such a file; read as it is, writing one
    tensor's copy-on-write view would change the other."""
    spans = sorted((i.start, i.end, i.name) for i in infos if i.end > i.start)
    for (_, e0, a), (s1, e1, b) in zip(spans, spans[1:]):
        if s1 < e0:
            raise CheckpointError(
                f"{path}: tensors {a!r} and {b!r} share bytes {s1}..{min(e0, e1)} of the file "
                "(overlapping data_offsets): the file is corrupt"
            )


class WeightStore:
    """All tensors of a checkpoint folder, by name, lazily."""

    def __init__(self, folder: str | os.PathLike, require_files: bool = True):
        """require_files=False opens a folder that holds only config.json (+ an index): tensors whose
        shard is absent are listed in `unread` by name only (used by `inspect`)."""
        if not isinstance(folder, (str, os.PathLike)):
            raise CheckpointError(f"a checkpoint is a folder path, got {type(folder).__name__} {folder!r}")
        if str(folder) == "":  # Path("") is the current directory: never open it by accident
            raise CheckpointError("an empty path names no checkpoint folder")
        self.folder = Path(folder)
        self.require_files = require_files
        self.unread: list[str] = []
        if not self.folder.is_dir():
            why = "is not a folder" if os.path.lexists(self.folder) else "no such checkpoint folder"
            raise CheckpointError(f"{self.folder}: {why}")
        self.layout = "hf"
        self.config: dict = {}
        if os.path.lexists(self.folder / "config.json"):  # lexists: a broken link is reported, not skipped
            self.config = _read_json(self.folder / "config.json")
        elif os.path.lexists(self.folder / "params.json"):
            self.layout = "mistral"
            self.config = _read_json(self.folder / "params.json")
        else:
            raise ConfigError(f"{self.folder}: neither config.json nor params.json is present")
        self.infos: dict[str, TensorInfo] = {}
        self.metadata: dict[str, str] = {}
        self._maps: dict[Path, mmap.mmap] = {}
        self.random = False  # reads are pieces of tensors (a tensor-parallel rank's): no read-ahead
        self.bytes_read = 0
        self.reads: dict[str, int] = {}
        self.files = self._files()
        for path in self.files:
            header, data_start = read_header(path)
            size = path.stat().st_size
            meta = header.pop("__metadata__", None) or {}
            if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
                raise CheckpointError(f"{path}: __metadata__ must be an object of strings, got {meta!r:.200}")
            self.metadata.update(meta)
            infos = [parse_entry(path, name, h, data_start, size) for name, h in header.items()]
            check_disjoint(path, infos)
            for info in infos:
                name = _native_scale_name(info.name) if self.layout == "mistral" else info.name
                if name in self.infos:
                    raise CheckpointError(
                        f"tensor {name!r} is in both {self.infos[name].file.name} and {path.name}"
                    )
                self.infos[name] = info

    def _files(self) -> list[Path]:
        # A sharded index names the files; otherwise every *.safetensors of the layout.
        indexes = sorted(self.folder.glob("*.safetensors.index.json"))
        if self.layout == "mistral":
            indexes = [p for p in indexes if p.name.startswith("consolidated")]
        if indexes:
            index = _read_json(indexes[0])
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(
                    f"{indexes[0]}: 'weight_map' must be a non-empty object of tensor name -> shard file, "
                    f"got {type(weight_map).__name__}"
                )
            for n, f in weight_map.items():
                if not isinstance(f, str) or not _plain_file_name(f):
                    raise CheckpointError(
                        f"{indexes[0]}: weight_map[{n!r}] = {f!r} is not a shard file name in this folder"
                    )
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not os.path.lexists(self.folder / f)]
            if missing and not self.require_files:
                self.unread = [n for n, f in weight_map.items() if f in missing]
                files = [f for f in files if f not in missing]
            elif missing:
                raise CheckpointError(f"{indexes[0].name} names shard files that are absent: {missing[:5]}")
            return [self.folder / f for f in files]
        pattern = "consolidated*.safetensors" if self.layout == "mistral" else "*.safetensors"
        return sorted(self.folder.glob(pattern))

    def require_weights(self) -> None:
        """Loading needs weight files: a folder without any says so once (not one line per tensor)."""
        if not self.files:
            pattern = "consolidated*.safetensors" if self.layout == "mistral" else "*.safetensors"
            raise CheckpointError(
                f"{self.folder}: no {pattern} here (and no *.safetensors.index.json): the weight files "
                "are missing; put them next to the config"
            )

    # ---- queries ----
    def names(self) -> list[str]:
        return list(self.infos)

    def __contains__(self, name: str) -> bool:
        return name in self.infos

    def info(self, name: str) -> TensorInfo:
        try:
            return self.infos[name]
        except KeyError:
            raise CheckpointError(f"tensor {name!r} is not in the checkpoint {self.folder}") from None

    def get(self, name: str, count: bool = True) -> torch.Tensor:
        """The tensor, backed by the file's mmap (no copy). Callers copy/convert as they need.
        count=False is for validation that looks at shapes only (it is not a read)."""
        info = self.info(name)
        mm = self._maps.get(info.file)
        if mm is None:
            mm = _map(info.file)
            self._maps[info.file] = mm
            if self.random:
                _advise_random(mm)
        if count:
            self.count_read(name, info.nbytes)
        dtype = SAFETENSORS[info.dtype]
        numel = 1
        for s in info.shape:
            numel *= s
        if info.nbytes != numel * dtype.itemsize:
            raise CheckpointError(
                f"tensor {name!r}: header says {info.dtype}{list(info.shape)} but holds {info.nbytes} bytes"
            )
        if numel == 0:
            return torch.empty(info.shape, dtype=dtype)
        if info.start % dtype.itemsize:  # unaligned: frombuffer needs aligned data, so copy
            raw = torch.frombuffer(mm, dtype=torch.uint8, count=info.nbytes, offset=info.start).clone()
            return raw.view(dtype).reshape(info.shape)
        with warnings.catch_warnings():  # a read-only map (see _map) is fine: nothing writes to these
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(mm, dtype=dtype, count=numel, offset=info.start).reshape(info.shape)

    def advise_random(self) -> None:
        """Reads from now on are pieces of tensors (a tensor-parallel rank's rows or columns): the kernel
        reads no pages ahead of them (its read-ahead, up to megabytes, would page in the other ranks'
        rows too), so a rank's resident pages are its pieces."""
        self.random = True
        for mm in self._maps.values():
            _advise_random(mm)

    def count_read(self, name: str, nbytes: int) -> None:
        """Counts a read of `nbytes` of tensor `name` (all of it, or a tensor-parallel rank's piece)."""
        self.bytes_read += nbytes
        self.reads[name] = self.reads.get(name, 0) + 1

    def close(self) -> None:
        self._maps.clear()  # the tensors handed out keep their buffers alive

    @property
    def total_bytes(self) -> int:
        return sum(i.nbytes for i in self.infos.values())


# Mistral's native FP8 files name the per-tensor scales `.qscale_weight` / `.qscale_act`; they are the
# usual weight multiplier and activation scale (transformers' convert_mistral4_weight_to_hf.py
# dequantizes fp8 * qscale_weight; vLLM's mistral_large_3.py remaps them to weight_scale / input_scale).
_NATIVE_SCALES = {".qscale_weight": ".weight_scale", ".qscale_act": ".input_scale"}


def _native_scale_name(name: str) -> str:
    for native, usual in _NATIVE_SCALES.items():
        if name.endswith(native):
            return name[: -len(native)] + usual
    return name


def _map(path: Path) -> mmap.mmap:
    """A private copy-on-write map (torch wants writable buffers); a file larger than memory plus
    swap cannot be mapped writable under the kernel's default overcommit rule, so such a file
    (e.g. a 94 GiB Engram table) is mapped read-only: its tensors must then never be written to."""
    with open(path, "rb") as f:
        try:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except OSError:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def _advise_random(mm: mmap.mmap) -> None:
    if hasattr(mm, "madvise") and hasattr(mmap, "MADV_RANDOM"):
        mm.madvise(mmap.MADV_RANDOM)


def _check_regular(path: Path, what: str, error) -> None:
    """`path` is a regular file: a folder, a broken link, a link loop or a device (a FIFO would block,
    /dev/zero never ends) raises `error` saying which."""
    try:
        st = path.stat()
    except OSError as e:
        if os.path.islink(path):
            why = "a symlink loop" if e.errno == errno.ELOOP else f"a broken symlink (to {os.readlink(path)})"
        else:
            why = e.strerror or str(e)
        raise error(f"{path}: the {what} cannot be read: {why}") from None
    if stat.S_ISDIR(st.st_mode):
        raise error(f"{path}: the {what} is a folder, not a file")
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{path}: the {what} is not a regular file")


def _plain_file_name(name: str) -> bool:
    """A file of the folder itself (an index naming '../x' or '/x' would read outside the checkpoint)."""
    p = Path(name)
    return bool(name) and not p.is_absolute() and ".." not in p.parts


def _read_json(path: Path) -> dict:
    _check_regular(path, "JSON file", ConfigError)
    if path.stat().st_size > MAX_JSON_BYTES:
        raise ConfigError(f"{path}: {path.stat().st_size} bytes is not a plausible config or index")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f, object_pairs_hook=_no_duplicates)  # a key given twice: which one is meant?
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror or e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def save_safetensors(
    tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict | None = None
) -> None:
    """Writes a safetensors file (used by the demo model and the tests' checkpoint writers)."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    blobs = []
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        if t.dtype not in SAFETENSORS_CODE:
            raise ValueError(f"{name}: dtype {t.dtype} cannot be written to safetensors")
        data = ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b""
        header[name] = {
            "dtype": SAFETENSORS_CODE[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
        blobs.append(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data section 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for b in blobs:
            f.write(b)


def save_sharded(
    tensors: dict[str, torch.Tensor], folder: str | os.PathLike, max_shard_bytes: int, prefix: str = "model"
) -> None:
    """Writes tensors as `prefix-0000i-of-0000n.safetensors` shards plus `prefix.safetensors.index.json`."""
    folder = Path(folder)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nb = t.numel() * t.element_size()
        if shards[-1] and size + nb > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nb
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"{prefix}-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_safetensors(shard, folder / fname)
        weight_map.update({n: fname for n in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(folder / f"{prefix}.safetensors.index.json", "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
