"""WeightStore: a lazy view of a checkpoint folder.

Reads only the safetensors headers when opened; a tensor's bytes are touched when `get(name)`
is called, through a private (copy-on-write) mmap of its file, so nothing is read twice and a
tensor nobody asks for is never paged in. Understands the three layouts the releases use:
one `model.safetensors`, a sharded `*.safetensors.index.json`, and Mistral's native
`params.json` + `consolidated*.safetensors`.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
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


def read_header(path: Path) -> tuple[dict, int]:
    """Returns (header dict, offset of the data section) of one safetensors file."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path}: too short to be a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 * 2**20:
            raise CheckpointError(f"{path}: safetensors header of {n} bytes is not plausible")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    return header, 8 + n


class WeightStore:
    """All tensors of a checkpoint folder, by name, lazily."""

    def __init__(self, folder: str | os.PathLike, require_files: bool = True):
        """require_files=False opens a folder that holds only config.json (+ an index): tensors whose
        shard is absent are listed in `unread` by name only (used by `inspect`)."""
        self.folder = Path(folder)
        self.require_files = require_files
        self.unread: list[str] = []
        if not self.folder.is_dir():
            raise CheckpointError(f"{self.folder}: no such checkpoint folder")
        self.layout = "hf"
        self.config: dict = {}
        if (self.folder / "config.json").exists():
            self.config = _read_json(self.folder / "config.json")
        elif (self.folder / "params.json").exists():
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
        for path in self._files():
            header, data_start = read_header(path)
            size = path.stat().st_size
            self.metadata.update(header.pop("__metadata__", None) or {})
            for name, h in header.items():
                try:
                    begin, end = h["data_offsets"]
                    info = TensorInfo(
                        name, h["dtype"], tuple(h["shape"]), path, data_start + begin, data_start + end
                    )
                except (KeyError, TypeError, ValueError):
                    raise CheckpointError(f"{path}: malformed header entry for tensor {name!r}") from None
                if info.dtype not in SAFETENSORS:
                    raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {info.dtype}")
                if not data_start <= info.start <= info.end <= size:
                    raise CheckpointError(
                        f"{path}: tensor {name!r} lies beyond the end of the file "
                        f"({info.end} > {size} bytes): the file is truncated, download it again"
                    )
                if self.layout == "mistral":
                    name = _native_scale_name(name)
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
            weight_map = index.get("weight_map") or {}
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (self.folder / f).exists()]
            if missing and not self.require_files:
                self.unread = [n for n, f in weight_map.items() if f in missing]
                files = [f for f in files if f not in missing]
            elif missing:
                raise CheckpointError(f"{indexes[0].name} names shard files that are absent: {missing[:5]}")
            return [self.folder / f for f in files]
        pattern = "consolidated*.safetensors" if self.layout == "mistral" else "*.safetensors"
        return sorted(self.folder.glob(pattern))

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


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
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
