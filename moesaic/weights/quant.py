"""Quantized weights as the releases ship them, kept packed.

Four formats (element and scale codecs: `kernels/codecs.py`):

  "fp8_block"   E4M3 codes [.., N, K] + one scale per [bn, bk] block, scale tensor
                [.., ceil(N/bn), ceil(K/bk)], either fp32 *inverse* scales (a multiplier:
                HF `weight_scale_inv`, DeepSeek V4 `.scale`, compressed-tensors `weight_scale`)
                or UE8M0 exponent bytes (DeepSeek V4.1 `.scale`, 32x32).  Per-channel FP8 is the
                block [1, K].
  "fp8_tensor"  E4M3 codes + one fp32 multiplier per tensor (ModelOpt FP8 `weight_scale`).
  "mxfp4"       E2M1 codes packed two per byte (low nibble = even element) + one E8M0 exponent
                byte per 32 consecutive input elements. compressed-tensors `mxfp4-pack-quantized`
                (`weight_packed` U8 + `weight_scale` U8) and DeepSeek's fp4 experts (`weight` I8 +
                `scale` F8_E8M0) are the same math.
  "nvfp4"       E2M1 packed + one E4M3 scale per 16 input elements + one fp32 global scale.
                compressed-tensors (`weight_packed`, `weight_scale`, `weight_global_scale`) stores
                the global scale as a DIVISOR:  w = e2m1 * f32(weight_scale) / weight_global_scale
                (its `_dequantize` computes `scale / global_scale` in fp32, then `codes * that`).
                ModelOpt (`weight`, `weight_scale`, `weight_scale_2`) stores a MULTIPLIER:
                w = e2m1 * f32(weight_scale) * weight_scale_2.
                `QuantizedTensor.global_divides` records which; nothing is inverted at load, so
                both dequantize bit for bit like their producers.

Scale decoding conventions:
  * E8M0 byte e -> 2^(e-127) for e in 0..254; e = 0 is 2^-127 (OCP; compressed-tensors'
    `2 ** (e - 127)` gives the same); e = 0xFF is NaN (OCP; compressed-tensors would produce
    2^128 = inf there, which no real scale uses).
  * Every scale is applied in fp32 and the product rounded once to the requested dtype. For
    MXFP4 the product (2-bit significand times a power of two) is exact in bf16 as well, so the
    bf16 path multiplies in bf16 directly (same bits, less memory traffic).

A `QuantizedTensor` may be stacked ([E, N, K] for the experts of a layer); `qt[e]` is one expert
as views of the stacked storage. `matmul(x)` computes `x @ W.T` by dequantizing `tile_rows` rows
of W at a time (bounded temporaries, fp32 for half-precision x), never the whole matrix, or through the
compiled CPU kernels (`kernels/cpu.py`) at decode sizes. Activation scales (`input_scale`,
`input_global_scale`) are kept on the object but not applied: the matmul is weight-only
(activations stay in the compute dtype), as engines without FP8/FP4 tensor cores run it.

Format resolution (`resolve_format`) lets the tensors present decide the kind of a weight
(quantized or not, which family) and uses `quantization_config` for its parameters (block size,
group size) and to catch contradictions: a weight the config's ignore/exclude list keeps dense but
that ships quantized companions, or a weight whose companions do not match the format the config
assigns to it. A plain float weight without companions is dense even if the config's targets
cover it (K3 targets "Linear" yet ships its whole trunk in bf16).
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F

from ..errors import CheckpointError, ConfigError
from ..kernels import cpu, memory
from ..kernels.codecs import (
    E2M1_MAX,
    E2M1_VALUES,
    E4M3_MAX,
    MXFP4_GROUP,
    NVFP4_GROUP,
    e2m1_to_float,
    e4m3_to_float,
    e8m0_to_float,
    float_to_e2m1_codes,
    float_to_e4m3,
    pack_fp4_codes,
    pow2_ceil_e8m0,
    unpack_fp4,
    unpack_fp4_codes,
)
from ..kernels.codecs import as_u8 as _as_u8
from ..kernels.triton import kernels

__all__ = [
    "FORMATS",
    "E2M1_VALUES",
    "e2m1_to_float",
    "unpack_fp4_codes",
    "pack_fp4_codes",
    "unpack_fp4",
    "e8m0_to_float",
    "e4m3_to_float",
    "float_to_e2m1_codes",
    "float_to_e4m3",
    "pow2_ceil_e8m0",
    "QuantizedTensor",
    "stack",
    "resolve_format",
    "load_quantized",
    "from_suffix_dict",
    "quantize_fp8_block",
    "quantize_fp8_tensor",
    "quantize_mxfp4",
    "quantize_nvfp4",
]

FORMATS = ("fp8_block", "fp8_tensor", "mxfp4", "nvfp4")

# --------------------------------------------------------------------------------------------
# QuantizedTensor
# --------------------------------------------------------------------------------------------

_FLOAT_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_E8M0_DTYPES = (torch.uint8, torch.float8_e8m0fnu)
_PACKED_DTYPES = (torch.uint8, torch.int8)
TILE_ELEMS = 1 << 21  # dequantized elements per tile in matmul (8 MB of fp32)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _shape(t) -> list:
    return list(t.shape)


class _Check:
    """Validation of one weight's tensors, raising CheckpointErrors that name them."""

    def __init__(self, format: str, codes: torch.Tensor, names: Mapping[str, str]):
        self.format, self.codes, self.names = format, codes, names
        self.lead = tuple(codes.shape[:-2])

    def dtype(self, role: str, t: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
        if t.dtype not in allowed:
            raise CheckpointError(
                f"{self.names[role]}: dtype {t.dtype} is not valid for {self.format} "
                f"(expected {' or '.join(str(a).replace('torch.', '') for a in allowed)})"
            )

    def scale_shape(self, scale: torch.Tensor, expected: tuple, why: str) -> None:
        if tuple(scale.shape) != tuple(expected):
            raise CheckpointError(
                f"{self.names['scale']}: shape {_shape(scale)} does not match {self.names['codes']} "
                f"{_shape(self.codes)} ({why}; expected {list(expected)}). The checkpoint is corrupt or "
                f"its quantization_config names the wrong block/group size."
            )

    def per_matrix(self, role: str, t: torch.Tensor) -> torch.Tensor:
        """One float per matrix of the stack -> fp32 [*lead]."""
        if t.numel() != math.prod(self.lead):
            raise CheckpointError(
                f"{self.names[role]}: expected one value per matrix ({math.prod(self.lead)} "
                f"for {self.names['codes']} {_shape(self.codes)}), got shape {_shape(t)}"
            )
        self.dtype(role, t, _FLOAT_SCALE_DTYPES)
        return t.reshape(self.lead).to(torch.float32)

    def fp4_codes(self, group: int) -> tuple[torch.Tensor, int]:
        """Packed codes as bytes and the input dim they hold (a multiple of the group)."""
        self.dtype("codes", self.codes, _PACKED_DTYPES)
        k = 2 * self.codes.shape[-1]
        if k % group:
            raise CheckpointError(
                f"{self.names['codes']}: {self.format} needs the input dim ({k}) to be a "
                f"multiple of its group size {group}"
            )
        return _as_u8(self.codes), k


# Per format: (check, scale, block, global_scale) -> (codes, scale, K, block, global_scale), stored
# as the QuantizedTensor holds them (scale bytes as uint8, per-matrix scalars as fp32 [*lead]).


def _valid_fp8_block(c: _Check, scale, block, global_scale):
    c.dtype("codes", c.codes, (torch.float8_e4m3fn,))
    if (
        block is None
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise CheckpointError(
            f"{c.names['codes']}: unsupported fp8 block size {block!r} "
            f"(need two positive integers [rows, cols], e.g. [128, 128])"
        )
    bn, bk = int(block[0]), int(block[1])
    c.dtype("scale", scale, _FLOAT_SCALE_DTYPES + _E8M0_DTYPES)
    if scale.dtype in _E8M0_DTYPES:
        scale = _as_u8(scale)
    n, k = c.codes.shape[-2:]
    c.scale_shape(scale, c.lead + (_ceil_div(n, bn), _ceil_div(k, bk)), f"block {[bn, bk]}")
    return c.codes, scale, k, (bn, bk), None


def _valid_fp8_tensor(c: _Check, scale, block, global_scale):
    c.dtype("codes", c.codes, (torch.float8_e4m3fn,))
    return c.codes, c.per_matrix("scale", scale), c.codes.shape[-1], None, None


def _valid_mxfp4(c: _Check, scale, block, global_scale):
    codes, k = c.fp4_codes(MXFP4_GROUP)
    c.dtype("scale", scale, _E8M0_DTYPES + (torch.int8,))
    scale = _as_u8(scale)
    c.scale_shape(scale, c.lead + (codes.shape[-2], k // MXFP4_GROUP), f"one scale per {MXFP4_GROUP} inputs")
    return codes, scale, k, None, None


def _valid_nvfp4(c: _Check, scale, block, global_scale):
    codes, k = c.fp4_codes(NVFP4_GROUP)
    c.dtype("scale", scale, (torch.float8_e4m3fn,))
    if global_scale is None:
        raise CheckpointError(
            f"{c.names['global_scale']}: nvfp4 needs a global scale "
            f"(weight_global_scale or weight_scale_2) and none was given"
        )
    g = c.per_matrix("global_scale", global_scale)
    c.scale_shape(scale, c.lead + (codes.shape[-2], k // NVFP4_GROUP), f"one scale per {NVFP4_GROUP} inputs")
    return codes, scale, k, None, g


_VALIDATE = {
    "fp8_block": _valid_fp8_block,
    "fp8_tensor": _valid_fp8_tensor,
    "mxfp4": _valid_mxfp4,
    "nvfp4": _valid_nvfp4,
}


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul with x computes and returns in: x's float dtype, else fp32."""
    return (
        x.dtype if x.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64) else torch.float32
    )


def check_grouped(w, x: torch.Tensor, offs: torch.Tensor, what: str) -> None:
    """A grouped product's operands: a stack w [E, N, K], rows x [T, K] and end rows offs [E]."""
    if w.ndim != 3 or x.ndim != 2 or x.shape[-1] != w.shape[-1] or offs.shape != (w.shape[0],):
        raise ValueError(
            f"{what} needs a stack [E, N, K], x [T, K] and offs [E]; got "
            f"{list(w.shape)}, x {list(x.shape)}, offs {list(offs.shape)}"
        )


class QuantizedTensor:
    """Packed codes + scales of one weight [N, K] (or a stack [..., N, K] of them).

    format        one of FORMATS
    codes         fp8_*: float8_e4m3fn [.., N, K];  mxfp4 / nvfp4: uint8 [.., N, K/2]
    scale         fp8_block: fp32/bf16 multipliers or E8M0 bytes [.., ceil(N/bn), ceil(K/bk)]
                  fp8_tensor: fp32 [..] (one per matrix);  mxfp4: E8M0 bytes [.., N, K/32]
                  nvfp4: float8_e4m3fn [.., N, K/16]
    global_scale  nvfp4 only: fp32 [..] (one per matrix); divides if `global_divides`
    block         fp8_block only: (bn, bk)
    input_scale   the activation scale as stored (ModelOpt `input_scale` multiplies, compressed-tensors
                  `input_global_scale` divides, like the weight's global scale); not used by matmul
    name          the weight's name; `tensor_names` the checkpoint names of its codes / scale /
                  global_scale, used in error messages
    """

    def __init__(
        self,
        format: str,
        codes: torch.Tensor,
        scale: torch.Tensor,
        *,
        shape: Sequence[int] | None = None,
        block: Sequence[int] | None = None,
        global_scale: torch.Tensor | None = None,
        global_divides: bool = False,
        input_scale: torch.Tensor | None = None,
        name: str = "<weight>",
        tensor_names: Mapping[str, str] | None = None,
    ):
        names = {
            "codes": f"{name} (codes)",
            "scale": f"{name} (scale)",
            "global_scale": f"{name} (global scale)",
        }
        names.update(tensor_names or {})
        if format not in FORMATS:
            raise CheckpointError(
                f"{name}: unknown quantized format {format!r} (one of {', '.join(FORMATS)})"
            )
        if codes.ndim < 2:
            raise CheckpointError(
                f"{names['codes']}: a quantized weight needs at least 2 dims, got shape {_shape(codes)}"
            )
        check = _Check(format, codes, names)
        codes, scale, k, block, g = _VALIDATE[format](check, scale, block, global_scale)
        if format != "nvfp4" and global_scale is not None:
            raise CheckpointError(
                f"{names['global_scale']}: a global scale is only valid for nvfp4, not {format}"
            )
        self.name, self.tensor_names, self.format = name, names, format
        self.codes, self.scale, self.block, self.global_scale = codes, scale, block, g
        self.global_divides = bool(global_divides)
        self.input_scale = input_scale
        self.shape = torch.Size(check.lead + (codes.shape[-2], k))
        if shape is not None and tuple(shape) != tuple(self.shape):
            raise CheckpointError(
                f"{names['codes']}: holds a {format} weight of shape {list(self.shape)}, expected {list(shape)}"
            )

    # --- introspection ---------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def scale_kind(self) -> str:
        """'e8m0' or 'float' (the scale tensor's encoding)."""
        if self.format == "mxfp4" or (self.format == "fp8_block" and self.scale.dtype == torch.uint8):
            return "e8m0"
        return "e4m3" if self.format == "nvfp4" else "float"

    @property
    def nbytes(self) -> int:
        """Bytes held: codes + scales + global scale (+ input scale)."""
        ts = [self.codes, self.scale, self.global_scale, self.input_scale]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def __len__(self) -> int:
        if self.ndim < 3:
            raise TypeError("len() of a single (unstacked) QuantizedTensor")
        return self.shape[0]

    def __repr__(self) -> str:
        extra = f", block={list(self.block)}" if self.block else ""
        if self.format == "nvfp4":
            extra += ", global=" + ("divisor" if self.global_divides else "multiplier")
        return (
            f"QuantizedTensor({self.format}, shape={list(self.shape)}{extra}, scale={self.scale_kind}, "
            f"nbytes={self.nbytes}, name={self.name!r})"
        )

    def _replace(self, **kw) -> QuantizedTensor:
        new = object.__new__(QuantizedTensor)
        new.__dict__.update(self.__dict__)
        new.__dict__.update(kw)
        new.__dict__.pop("_operands", None)  # kernel_operand's cache is this tensor's own
        return new

    # --- stacking --------------------------------------------------------------------------
    def __getitem__(self, i) -> QuantizedTensor:
        """Index the leading (expert) dim of a stacked tensor: views, no copy."""
        if self.ndim < 3:
            raise TypeError(
                f"{self.name}: indexing needs a stacked [E, N, K] QuantizedTensor, "
                f"this one is {list(self.shape)}"
            )
        if isinstance(i, int):
            if not -self.shape[0] <= i < self.shape[0]:
                raise IndexError(f"{self.name}: index {i} out of range for {self.shape[0]} experts")
        elif not isinstance(i, slice):
            raise TypeError(
                f"{self.name}: QuantizedTensor supports an int or a slice index, not {type(i).__name__}"
            )
        lead = self.shape[:-2]
        ins = self.input_scale
        if ins is not None and ins.numel() == math.prod(lead) and ins.numel() > 1:
            ins = ins.reshape(lead)[i]
        codes = self.codes[i]
        return self._replace(
            codes=codes,
            scale=self.scale[i],
            global_scale=None if self.global_scale is None else self.global_scale[i],
            input_scale=ins,
            shape=torch.Size(codes.shape[:-1] + (self.shape[-1],)),
            name=f"{self.name}[{i if isinstance(i, int) else f'{i.start}:{i.stop}'}]",
        )

    @classmethod
    def stack(cls, tensors: Sequence[QuantizedTensor], name: str | None = None) -> QuantizedTensor:
        """One [E, ...] QuantizedTensor from E of the same format, shape and block."""
        if not tensors:
            raise ValueError("stack() of an empty list")
        t0 = tensors[0]
        name = name or f"stack({t0.name}, ...)"
        for t in tensors[1:]:
            if (t.format, t.shape, t.block, t.global_divides, t.scale.dtype) != (
                t0.format,
                t0.shape,
                t0.block,
                t0.global_divides,
                t0.scale.dtype,
            ):
                raise CheckpointError(
                    f"{name}: cannot stack {t!r} with {t0!r} (format, shape, block, "
                    f"scale dtype and global-scale convention must agree)"
                )
        gs = torch.stack([t.global_scale for t in tensors]) if t0.global_scale is not None else None
        ins = None
        if all(t.input_scale is not None for t in tensors):
            ins = torch.stack(
                [t.input_scale.reshape(()) if t.input_scale.numel() == 1 else t.input_scale for t in tensors]
            )
        scale = torch.stack([t.scale for t in tensors])
        return cls(
            t0.format,
            memory.stack([t.codes for t in tensors]),  # the big part: into huge pages (kernels/memory.py)
            scale,
            block=t0.block,
            global_scale=gs,
            global_divides=t0.global_divides,
            input_scale=ins,
            name=name,
        )

    def to(self, device) -> QuantizedTensor:
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return self._replace(
            codes=self.codes.to(device),
            scale=self.scale.to(device),
            global_scale=mv(self.global_scale),
            input_scale=mv(self.input_scale),
        )

    # --- dequantization --------------------------------------------------------------------
    def _matrix(self, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """codes, scale, global of matrix b of the flattened leading dims."""
        lead = self.shape[:-2]
        if not lead:
            return self.codes, self.scale, self.global_scale
        g = self.global_scale.reshape(-1)[b] if self.global_scale is not None else None
        return (
            self.codes.reshape(-1, *self.codes.shape[-2:])[b],
            self.scale.reshape(-1, *self.scale.shape[-2:])[b]
            if self.scale.ndim >= 2
            else self.scale.reshape(-1)[b],
            g,
        )

    def dequantize_rows(
        self, r0: int, r1: int, dtype: torch.dtype = torch.float32, matrix: int = 0
    ) -> torch.Tensor:
        """Rows r0:r1 of one matrix (index `matrix` over the flattened leading dims), [r1-r0, K]."""
        n, k = self.shape[-2:]
        if not 0 <= r0 <= r1 <= n:
            raise IndexError(f"{self.name}: rows {r0}:{r1} out of range for {n} rows")
        codes, scale, g = self._matrix(matrix)
        rows = r1 - r0
        fmt = self.format
        if fmt == "fp8_tensor":
            return (codes[r0:r1].to(torch.float32) * scale.to(torch.float32)).to(dtype)
        if fmt == "fp8_block":
            bn, bk = self.block
            q = codes[r0:r1].to(torch.float32)
            rb0, rb1 = r0 // bn, _ceil_div(r1, bn)
            s = scale[rb0:rb1]
            s = e8m0_to_float(s) if s.dtype == torch.uint8 else s.to(torch.float32)
            s = s.repeat_interleave(bn, dim=0)[r0 - rb0 * bn : r1 - rb0 * bn]  # [rows, kb]
            kf = (k // bk) * bk
            out = torch.empty(rows, k, dtype=torch.float32, device=q.device)
            if kf:
                torch.mul(
                    q[:, :kf].unflatten(1, (k // bk, bk)),
                    s[:, : k // bk, None],
                    out=out[:, :kf].unflatten(1, (k // bk, bk)),
                )
            if kf < k:
                out[:, kf:] = q[:, kf:] * s[:, -1:]
            return out.to(dtype)
        if fmt == "mxfp4":
            direct = dtype in (torch.float32, torch.bfloat16, torch.float64)
            work = dtype if direct else torch.float32
            vals = unpack_fp4(codes[r0:r1], work).view(rows, k // MXFP4_GROUP, MXFP4_GROUP)
            s = e8m0_to_float(scale[r0:r1]).to(work)
            vals.mul_(s[..., None])
            return vals.view(rows, k).to(dtype)
        # nvfp4: effective group scale in fp32 first (like both producers), then one product
        vals = unpack_fp4(codes[r0:r1], torch.float32).view(rows, k // NVFP4_GROUP, NVFP4_GROUP)
        s = scale[r0:r1].to(torch.float32)
        s = s / g if self.global_divides else s * g
        vals.mul_(s[..., None])
        return vals.view(rows, k).to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole weight [..., N, K] in `dtype` (for tests, oracles and small tensors)."""
        if tk := kernels("quant", self.codes):
            return tk.dequantize(self, dtype)
        n, k = self.shape[-2:]
        out = torch.empty(self.shape, dtype=dtype, device=self.device)
        flat = out.view(-1, n, k)
        tr = self.tile_rows()
        for b in range(flat.shape[0]):
            for r0 in range(0, n, tr):
                r1 = min(n, r0 + tr)
                flat[b, r0:r1] = self.dequantize_rows(r0, r1, dtype, matrix=b)
        return out

    def tile_rows(self, budget: int = TILE_ELEMS) -> int:
        """Rows per tile: about `budget` elements, 16..1024 rows, a multiple of the block rows."""
        n, k = self.shape[-2:]
        step = self.block[0] if self.format == "fp8_block" else 16
        rows = max(16, min(1024, budget // max(k, 1)))
        rows = max(step, rows // step * step)
        return min(rows, n) if n else 1

    def matmul(self, x: torch.Tensor, tile_rows: int | None = None) -> torch.Tensor:
        """x @ W.T for W [N, K] with x [..., K] -> [..., N] in x's dtype (fp32 for non-float x).
        For a stacked W [E, N, K], x is [E, ..., K] and the result [E, ..., N] (expert e on x[e]).
        Up to cpu.MAX_ROWS rows per matrix (more bf16 rows where vdpbf16ps or AMX tiles run:
        `cpu.packed_rows`) run through the compiled CPU kernels when they are available; otherwise
        (or with an explicit `tile_rows`) W is dequantized tile by tile."""
        n, k = self.shape[-2:]
        if x.shape[-1] != k:
            raise ValueError(
                f"{self.name}: matmul of x {list(x.shape)} with weight {list(self.shape)}: last dims differ"
            )
        if tk := kernels("quant", x):
            return tk.matmul(self, x)
        lead = self.shape[:-2]
        if not lead and tile_rows is None:  # the common case first: one matrix, the kernels
            x2 = x if x.dim() == 2 else x.reshape(-1, k)
            y = self._kernel(x2)
            if y is not None:
                return y if x.dim() == 2 else y.view(*x.shape[:-1], n)
        cd = _compute_dtype(x)
        if lead:
            if tuple(x.shape[: len(lead)]) != tuple(lead):
                raise ValueError(
                    f"{self.name}: stacked weight {list(self.shape)} needs x with leading dims "
                    f"{list(lead)}, got {list(x.shape)}"
                )
            xs = x.to(cd).reshape(math.prod(lead), -1, k)
            out = torch.empty(xs.shape[:2] + (n,), dtype=cd, device=x.device)
            for b in range(xs.shape[0]):
                self._matmul_2d(xs[b], out[b], b, tile_rows)
            return out.view(*x.shape[:-1], n)
        x2 = x.to(cd).reshape(-1, k)
        out = torch.empty(x2.shape[0], n, dtype=cd, device=x.device)
        self._matmul_2d(x2, out, 0, tile_rows, kernel=False)
        return out.view(*x.shape[:-1], n)

    def grouped_matmul(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """The rows of x [T, K] grouped by expert against this stack [E, N, K] -> [T, N] in x's
        dtype: expert e owns rows offs[e-1]:offs[e] (offs [E]: end rows, as torch's grouped_mm
        takes them). One call of the compiled CPU kernel for every expert with rows when it
        applies (at most cpu.packed_rows(x) rows for every expert), else expert by expert as `matmul`
        computes each: the same numbers as one `matmul` per expert either way."""
        n = self.shape[-2]
        check_grouped(self, x, offs, f"{self.name}: grouped_matmul")
        if tk := kernels("quant", x):
            return tk.grouped_matmul(x, offs, self)
        x = x.to(_compute_dtype(x))
        out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
        self._grouped_2d(x, offs, out)
        return out

    # out[:] = x2 @ W.T (out may be a column slice of a wider output: ConcatRows)
    def _matmul_2d(self, x2: torch.Tensor, out: torch.Tensor, b: int, tile_rows=None, kernel=True) -> None:
        if kernel and tile_rows is None and self._kernel(x2, out, matrix=b) is not None:
            return
        cpu.stats["fallback_calls"] += 1
        # half-precision x: fp32 tiles and products, one rounding of the output (the kernels' numbers;
        # bf16 tiles would round the nvfp4 / fp8 weight values themselves)
        wd = torch.float32 if x2.dtype in (torch.bfloat16, torch.float16) else x2.dtype
        xw = x2.to(wd)
        n = self.shape[-2]
        tr = tile_rows or self.tile_rows()
        # fp32 tiles decoded by the compiled kernels where they run (the same values; torch's fp8 -> fp32 and
        # table gathers were most of a packed prefill), into one buffer
        op = self.kernel_operand(b) if wd == torch.float32 and self.codes.is_cpu and cpu.available() else None
        buf = None if op is None else torch.empty(min(tr, n), self.shape[-1], dtype=wd)
        for r0 in range(0, n, tr):
            r1 = min(n, r0 + tr)
            if op is not None:
                w = cpu.operand_rows(op, r0, buf[: r1 - r0])
            else:
                w = self.dequantize_rows(r0, r1, wd, matrix=b)
            out[:, r0:r1] = xw @ w.T

    def _grouped_2d(self, x: torch.Tensor, offs: torch.Tensor, out: torch.Tensor) -> None:
        # one kernel call when every expert's rows fit (cpu.rows_fit): what one call per expert gives
        if cpu.rows_fit(offs, cpu.packed_rows(x)) and self._kernel(x, out, offs=offs) is not None:
            return
        start = 0
        for e, end in enumerate(offs.tolist()):
            if end > start:
                self._matmul_2d(x[start:end], out[start:end], e)
            start = end

    def kernel_matmul(self, x: torch.Tensor) -> torch.Tensor | None:
        """x @ W.T for one matrix and a 2-D x through the compiled CPU kernels (what `matmul` runs first), or
        None where they do not take x (then `matmul` dequantizes)."""
        if self.ndim != 2 or x.dim() != 2 or x.shape[-1] != self.shape[-1] or kernels("quant", x):
            return None
        return self._kernel(x)

    @property
    def stack_key(self) -> tuple | None:
        """Weights with one key can be stacked by rows (`stack_rows`): one format, width, block, scale and
        code dtype and device; None for one that cannot: a stack of matrices, a global scale (one per
        matrix: fp8_tensor, nvfp4's), fp8 blocks whose rows do not fill whole blocks."""
        if self.ndim != 2 or self.global_scale is not None or self.format == "fp8_tensor":
            return None
        if self.format == "fp8_block" and (self.shape[0] % self.block[0] or self.scale.ndim != 2):
            return None
        blk = None if self.block is None else tuple(self.block)
        return (self.format, self.shape[1], blk, self.scale.dtype, self.codes.dtype, str(self.device))

    @classmethod
    def stack_rows(cls, parts: Sequence) -> tuple[QuantizedTensor, list[QuantizedTensor]]:
        """Weights of one `stack_key` as one [sum N_i, K] weight, codes and scales concatenated by rows
        (nothing is re-packed), and each part as a view of its rows (layers/linear.py RowStack)."""
        p0 = parts[0]
        if p0.stack_key is None or any(p.stack_key != p0.stack_key for p in parts):
            raise ValueError("stack_rows: weights of one stack_key")
        codes, scale = memory.cat_rows([p.codes for p in parts]), torch.cat([p.scale for p in parts])
        whole = cls(p0.format, codes, scale, block=p0.block, name=" + ".join(p.name for p in parts))
        views, r, s = [], 0, 0
        for p in parts:
            n, ns = p.codes.shape[0], p.scale.shape[0]
            views.append(
                cls(
                    p.format,
                    codes[r : r + n],
                    scale[s : s + ns],
                    block=p.block,
                    input_scale=p.input_scale,
                    name=p.name,
                    tensor_names=p.tensor_names,
                )
            )
            r, s = r + n, s + ns
        return whole, views

    def _kernel(self, x2: torch.Tensor, out=None, matrix: int = 0, offs=None) -> torch.Tensor | None:
        """x2 @ W.T (into `out`, or a new tensor of x2's dtype) through the compiled CPU kernels, for
        matrix `matrix` of the stack or, with offs, the grouped form over the whole stack; None,
        nothing written, where they do not apply."""
        rows = cpu.packed_rows(x2) if offs is None else x2.shape[0]
        if not cpu.usable(x2, self.codes, rows):
            return None
        op = self.kernel_operand(None if offs is not None else matrix)
        return None if op is None else cpu.operand_matmul(x2, op, offs=offs, out=out)

    def kernel_operand(self, matrix: int | None = None) -> tuple | None:
        """Matrix `matrix` of the stack, or with None the whole stack as [E, ...] (a grouped call), as the
        compiled CPU kernels take it (kernels/cpu.py's *_operand); None where they do not serve it. Built
        once per matrix (a decode step asks for each of its matrices again)."""
        cache = self.__dict__.setdefault("_operands", {})
        if matrix not in cache:
            cache[matrix] = self._kernel_operand(matrix)
        return cache[matrix]

    def _kernel_operand(self, matrix: int | None) -> tuple | None:
        n, k = self.shape[-2:]
        if self.format == "fp8_block" and not cpu.fp8_block_ok(self.block, k):
            return None
        if matrix is not None:
            codes, scale, g = self._matrix(matrix)
        else:
            codes = self.codes.reshape(-1, *self.codes.shape[-2:])
            scale = self.scale.reshape(-1, *self.scale.shape[-2:]) if self.scale.ndim >= 2 else self.scale
            g = self.global_scale
        if self.format in ("mxfp4", "nvfp4"):
            group = MXFP4_GROUP if self.format == "mxfp4" else NVFP4_GROUP
            return cpu.fp4_operand(codes, scale, group, g, self.global_divides)
        if self.format == "fp8_block":
            return cpu.fp8_operand(codes, scale, self.block)
        # fp8_tensor: one block spanning the matrix
        scale = scale.reshape(-1, 1, 1) if matrix is None else scale.reshape(1, 1)
        return cpu.fp8_operand(codes, scale, (n, k))


def stack(tensors: Sequence[QuantizedTensor], name: str | None = None) -> QuantizedTensor:
    """Stacks per-expert QuantizedTensors into one [E, N, K] (copies once)."""
    return QuantizedTensor.stack(tensors, name)


# --------------------------------------------------------------------------------------------
# Format resolution from quantization_config + the tensors present
# --------------------------------------------------------------------------------------------

_TORCH_TO_ST = {
    "float32": "F32",
    "float": "F32",
    "bfloat16": "BF16",
    "float16": "F16",
    "half": "F16",
    "float64": "F64",
    "double": "F64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e8m0fnu": "F8_E8M0",
    "uint8": "U8",
    "int8": "I8",
    "int16": "I16",
    "int32": "I32",
    "int64": "I64",
    "bool": "BOOL",
}
_FLOAT_ST = ("F32", "BF16", "F16", "F64")
_COMPANIONS = (
    "weight_packed",
    "weight_scale",
    "weight_scale_inv",
    "scale",
    "weight_global_scale",
    "weight_scale_2",
    "input_scale",
    "input_global_scale",
)
COMPANION_SUFFIXES = _COMPANIONS  # tensors besides `.weight` that make a weight quantized
_SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv", "scale", "weight_global_scale", "weight_scale_2")


def _st_dtype(d) -> str:
    """safetensors spelling of a dtype given as 'BF16', 'bfloat16', 'torch.bfloat16' or torch.dtype."""
    if isinstance(d, (tuple, list)):
        d = d[0]
    if isinstance(d, torch.dtype):
        d = str(d)
    s = str(d).removeprefix("torch.")
    return _TORCH_TO_ST.get(s, s.upper())


def _entry_shape(v):
    return tuple(v[1]) if isinstance(v, (tuple, list)) and len(v) > 1 else None


def _strip_weight(base: str) -> str:
    return base[: -len(".weight")] if base.endswith(".weight") else base


def check_config(qc, where: str = "quantization_config") -> None:
    """The fields the readers below walk have the types they expect, else a ConfigError naming the key
    (a value of the right type that a reader does not support stays its CheckpointError, naming the
    tensor): the containers, the method names, and compressed-tensors' / ModelOpt's numbers."""

    def want(ok: bool, what: str, v) -> None:
        if not ok:
            raise ConfigError(f"{where}: {what}, got {type(v).__name__}: {v!r:.200}")

    def integer(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    def typed(d: Mapping, name: str, kinds: dict) -> None:
        for k, (ok, what) in kinds.items():
            if d.get(k) is not None:
                want(ok(d[k]), f"{name}{k!r} must be {what}", d[k])

    strings = lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)  # noqa: E731
    ints = lambda v: isinstance(v, list) and all(integer(x) for x in v)  # noqa: E731
    name, an_int, int_list = (
        (lambda v: isinstance(v, str), "a name"),
        (integer, "an integer"),
        (ints, "a list of integers"),
    )
    want(isinstance(qc, Mapping), "must be an object", qc)
    typed(qc, "", {"quant_method": name, "quant_algo": name, "format": name, "group_size": an_int})
    typed(qc, "", {"weight_block_size": int_list, "block_size": int_list})
    for k in ("ignore", "exclude_modules", "modules_to_not_convert", "ignored_layers"):
        if qc.get(k) is not None:
            want(strings(qc[k]), f"{k!r} must be a list of module names", qc[k])
    if qc.get("quantization") is not None:  # ModelOpt's hf_quant_config.json nests the config
        want(isinstance(qc["quantization"], Mapping), "'quantization' must be an object", qc["quantization"])
        check_config(qc["quantization"], f"{where}.quantization")
    for k in ("config_groups", "quantized_layers"):
        groups = qc.get(k)
        if groups is None:
            continue
        want(isinstance(groups, Mapping), f"{k!r} must be an object of name -> object", groups)
        for g_name, g in groups.items():
            at = f"{k}[{g_name!r}]"
            want(isinstance(g, Mapping), f"{at} must be an object", g)
            if g.get("targets") is not None:
                want(strings(g["targets"]), f"{at}.targets must be a list of names", g["targets"])
            typed(g, f"{at}.", {"format": name, "quant_algo": name, "group_size": an_int})
            typed(g, f"{at}.", {"block_size": int_list, "weight_block_size": int_list})
            for sub in ("weights", "input_activations"):
                a = g.get(sub)
                if a is None:
                    continue
                want(isinstance(a, Mapping), f"{at}.{sub} must be an object", a)
                typed(a, f"{at}.{sub}.", {"num_bits": an_int, "group_size": an_int, "type": name})
                typed(a, f"{at}.{sub}.", {"strategy": name, "block_structure": int_list})


def _qconfig(qc: Mapping | None) -> dict:
    """Flatten the producer-specific spellings into one dict with a 'method' key (its types checked)."""
    if not qc:
        return {"method": None}
    check_config(qc)
    qc = dict(qc)
    if "quantization" in qc and isinstance(qc["quantization"], Mapping):  # ModelOpt hf_quant_config.json
        inner = dict(qc["quantization"])
        inner.setdefault("quant_method", "modelopt")
        inner.setdefault("producer", qc.get("producer"))
        qc = inner
    method = qc.get("quant_method")
    if method is None and "quant_algo" in qc:
        method = "modelopt"
    qc["method"] = str(method).lower() if method is not None else None
    return qc


def _ct_match(name: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


def _ct_scheme(qc: dict, base: str):
    """(scheme dict or None, format str or None, ignored: bool) for a module under compressed-tensors."""
    if any(_ct_match(base, ign) for ign in qc.get("ignore") or ()):
        return None, None, True
    groups = qc.get("config_groups") or {}
    by_class = None
    for g in groups.values():
        targets = g.get("targets") or []
        if any(_ct_match(base, t) for t in targets):
            return g, g.get("format") or qc.get("format"), False
        if by_class is None and any(
            not t.startswith("re:") and "." not in t and t[:1].isupper() for t in targets
        ):
            by_class = g  # class-name target like "Linear": matches every linear module
    if by_class is not None:
        return by_class, by_class.get("format") or qc.get("format"), False
    return None, None, False


def _fp4_kind(weights: Mapping, base: str, fmt: str) -> str:
    gs = weights.get("group_size")
    if gs == MXFP4_GROUP:
        return "mxfp4"
    if gs == NVFP4_GROUP:
        return "nvfp4"
    raise CheckpointError(
        f"{base}: compressed-tensors {fmt} fp4 weights with group_size {gs} are not "
        f"supported (mxfp4 needs 32, nvfp4 16)"
    )


def _ct_expect(qc: dict, base: str) -> str | None:
    scheme, fmt, ignored = _ct_scheme(qc, base)
    if ignored:
        return "dense"
    if scheme is None:
        return "dense" if qc.get("config_groups") else None
    w = scheme.get("weights") or {}
    if not w:
        return "dense"
    fmt = fmt or "dense"
    if fmt == "dense":
        return "dense"
    if fmt == "mxfp4-pack-quantized":
        if w.get("group_size") != MXFP4_GROUP:
            raise CheckpointError(
                f"{base}: mxfp4-pack-quantized with group_size {w.get('group_size')} "
                f"is not supported (MXFP4 groups are 32)"
            )
        return "mxfp4"
    if fmt == "nvfp4-pack-quantized":
        if w.get("group_size") != NVFP4_GROUP:
            raise CheckpointError(
                f"{base}: nvfp4-pack-quantized with group_size {w.get('group_size')} "
                f"is not supported (NVFP4 groups are 16)"
            )
        return "nvfp4"
    is_float = w.get("type") == "float"
    if (
        fmt in ("float-quantized", "naive-quantized", "mixed-precision")
        and is_float
        and w.get("num_bits") == 8
    ):
        strategy = w.get("strategy")
        if strategy == "tensor":
            return "fp8_tensor"
        if strategy in ("block", "channel"):
            return "fp8_block"
        raise CheckpointError(
            f"{base}: compressed-tensors fp8 strategy {strategy!r} is not supported "
            f"(tensor, channel or block)"
        )
    if fmt == "mixed-precision" and is_float and w.get("num_bits") == 4:
        return _fp4_kind(w, base, fmt)
    return "unsupported:compressed-tensors format " + repr(fmt)


def _modelopt_algo(qc: dict, base: str) -> tuple[str | None, dict]:
    layers = qc.get("quantized_layers")
    if isinstance(layers, Mapping) and layers:
        for key in (base, base.removeprefix("model."), "model." + base):
            if key in layers:
                return str(layers[key].get("quant_algo")).upper(), layers[key]
        return None, {}
    algo = qc.get("quant_algo")
    return (str(algo).upper() if algo else None), qc


def _modelopt_excluded(qc: dict, base: str) -> bool:
    for pat in qc.get("exclude_modules") or qc.get("ignore") or ():
        if pat.startswith("re:"):
            if re.match(pat[3:], base):
                return True
        elif (
            fnmatch.fnmatchcase(base, pat)
            or base == pat
            or base.startswith(pat + ".")
            or fnmatch.fnmatchcase(base, pat + ".*")
        ):
            return True
    return False


def _modelopt_expect(qc: dict, base: str) -> str | None:
    if _modelopt_excluded(qc, base):
        return "dense"
    algo, params = _modelopt_algo(qc, base)
    if algo is None or algo == "MIXED_PRECISION":
        return "dense" if qc.get("quantized_layers") else None
    if algo == "NVFP4":
        gs = params.get("group_size", NVFP4_GROUP)
        if gs != NVFP4_GROUP:
            raise CheckpointError(f"{base}: ModelOpt NVFP4 with group_size {gs} is not supported (16)")
        return "nvfp4"
    if algo == "FP8":
        return "fp8_tensor"
    if algo in ("FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "FP8_BLOCK"):
        return "fp8_block"
    return "unsupported:ModelOpt quant_algo " + repr(algo)


def _fp8_block_size(qc: dict, base: str):
    bs = qc.get("weight_block_size")
    if bs is None:
        return None
    if (
        not isinstance(bs, (list, tuple))
        or len(bs) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in bs)
    ):
        raise CheckpointError(
            f"{base}: unsupported fp8 weight_block_size {bs!r} in quantization_config "
            f"(need [rows, cols] of positive integers, e.g. [128, 128] or [32, 32])"
        )
    return tuple(bs)


def _expect(qc: dict, base: str) -> str | None:
    """What the config says about this module: None (no opinion), 'dense', a format, or
    'unsupported:<why>'."""
    m = qc["method"]
    if m is None:
        return None
    if m == "fp8":
        _fp8_block_size(qc, base)
        skip = list(qc.get("modules_to_not_convert") or []) + list(qc.get("ignored_layers") or [])
        if any(
            base == s or base.startswith(s + ".") or s in base.split(".") or fnmatch.fnmatchcase(base, s)
            for s in skip
        ):
            return "dense"
        return None  # dense fp8 blocks, DeepSeek fp4 experts or bf16 projections: the tensors decide
    if m == "compressed-tensors":
        return _ct_expect(qc, base)
    if m == "modelopt":
        return _modelopt_expect(qc, base)
    return f"unsupported:quant_method {m!r}"


def _from_tensors(present: dict, shapes: dict, base: str, expect: str | None) -> str | None:
    def need(suffix, why):
        raise CheckpointError(
            f"{base}.{suffix} is missing: {why}. The checkpoint is incomplete "
            f"(re-download the shard that should hold it)."
        )

    def dtype_err(suffix, allowed):
        raise CheckpointError(
            f"{base}.{suffix}: dtype {present[suffix]} is not valid here (expected {' or '.join(allowed)})"
        )

    if "weight_packed" in present:
        if present["weight_packed"] not in ("U8", "I8"):
            dtype_err("weight_packed", ("U8", "I8"))
        if "weight_scale" not in present:
            need("weight_scale", f"{base}.weight_packed holds fp4 codes that need their group scales")
        sd = present["weight_scale"]
        if "weight_global_scale" in present:
            if sd != "F8_E4M3":
                dtype_err("weight_scale", ("F8_E4M3",))
            return "nvfp4"
        if sd in ("U8", "I8", "F8_E8M0"):
            return "mxfp4"
        if sd == "F8_E4M3":
            need("weight_global_scale", "nvfp4 weights (E4M3 group scales) need their fp32 global scale")
        dtype_err("weight_scale", ("U8", "F8_E8M0", "F8_E4M3"))
    if "weight" not in present:
        comp = [s for s in _COMPANIONS if s in present]
        if comp:
            need("weight", f"its companions {', '.join(base + '.' + c for c in comp)} are present")
        raise CheckpointError(f"{base}.weight is not in the checkpoint")
    wd = present["weight"]
    scales = [s for s in _SCALE_SUFFIXES if s in present]
    if wd in _FLOAT_ST:
        if scales:
            raise CheckpointError(
                f"{base}.weight is {wd} (not quantized) but has quantization scales "
                f"{', '.join(base + '.' + s for s in scales)}: inconsistent checkpoint"
            )
        return None
    if wd in ("U8", "I8"):
        if "weight_scale_2" in present:
            if present.get("weight_scale") != "F8_E4M3":
                if "weight_scale" not in present:
                    need("weight_scale", "ModelOpt nvfp4 weights need their E4M3 group scales")
                dtype_err("weight_scale", ("F8_E4M3",))
            return "nvfp4"
        sname = "scale" if "scale" in present else ("weight_scale" if "weight_scale" in present else None)
        if sname is None:
            need(
                "scale",
                f"{base}.weight is {wd} (packed fp4 or int8 codes) and has no scale "
                f"({base}.scale / {base}.weight_scale)",
            )
        sd = present[sname]
        if sd in ("U8", "I8", "F8_E8M0"):
            return "mxfp4"
        if sd == "F8_E4M3":
            need("weight_scale_2", "ModelOpt nvfp4 weights (E4M3 group scales) need their fp32 global scale")
        raise CheckpointError(
            f"{base}.weight is {wd} with a {sd} scale ({base}.{sname}): integer-quantized "
            f"weights (GPTQ/AWQ/W8A8-int) are not supported; use an FP8, MXFP4 or "
            f"NVFP4 checkpoint or the bf16 release"
        )
    if wd == "F8_E4M3":
        if "weight_scale_inv" in present or "scale" in present:
            sname = "weight_scale_inv" if "weight_scale_inv" in present else "scale"
            if present[sname] not in _FLOAT_ST + ("F8_E8M0", "U8"):
                dtype_err(sname, _FLOAT_ST + ("F8_E8M0",))
            return "fp8_block"
        if "weight_scale" in present:
            if present["weight_scale"] not in _FLOAT_ST + ("F8_E8M0", "U8"):
                dtype_err("weight_scale", _FLOAT_ST + ("F8_E8M0",))
            if expect in ("fp8_block", "fp8_tensor"):
                return expect
            shp = shapes.get("weight_scale")
            if shp is not None and math.prod(shp) > 1:
                return "fp8_block"
            return "fp8_tensor"
        need(
            "weight_scale_inv",
            f"{base}.weight is F8_E4M3 and needs a scale "
            f"({base}.weight_scale_inv, {base}.scale or {base}.weight_scale)",
        )
    raise CheckpointError(
        f"{base}.weight: dtype {wd} is not a supported weight encoding "
        f"(float, F8_E4M3 with scales, or packed fp4 in U8/I8)"
    )


def resolve_format(
    quantization_config: Mapping | None, tensor_names_and_dtypes: Mapping[str, object], base: str
) -> str | None:
    """The format of weight `base` (a module path; a trailing '.weight' is ignored): one of
    FORMATS, or None for a plain dense weight.

    `tensor_names_and_dtypes` maps checkpoint tensor names (at least base + '.weight' or
    '.weight_packed' and its companions) to their dtype, in safetensors ('F8_E4M3') or torch
    ('float8_e4m3fn') spelling, or to a (dtype, shape) pair. `quantization_config` is
    config.json's (or hf_quant_config.json's) dict. Raises CheckpointError naming the tensor
    when companions are missing, dtypes do not fit, or the config contradicts the tensors."""
    base = _strip_weight(base)
    qc = _qconfig(quantization_config)
    present, shapes = {}, {}
    for suffix in ("weight",) + _COMPANIONS:
        key = f"{base}.{suffix}"
        if key in tensor_names_and_dtypes:
            v = tensor_names_and_dtypes[key]
            present[suffix] = _st_dtype(v)
            shapes[suffix] = _entry_shape(v)
    expect = _expect(qc, base)
    dense_here = (
        present.get("weight") in _FLOAT_ST
        and "weight_packed" not in present
        and not any(s in present for s in _SCALE_SUFFIXES)
    )
    if dense_here:
        return None
    if expect is not None and expect.startswith("unsupported:"):
        raise CheckpointError(
            f"{base}: {expect.split(':', 1)[1]} is not supported (moesaic reads FP8 block/"
            f"tensor, MXFP4 and NVFP4 checkpoints); use another release of the model"
        )
    found = _from_tensors(present, shapes, base, expect)
    if expect == "dense" and found is not None:
        raise CheckpointError(
            f"{base}: quantization_config keeps this module unquantized (ignore/exclude "
            f"list) but the checkpoint holds it as {found}: inconsistent checkpoint"
        )
    if expect not in (None, "dense") and found is not None and found != expect:
        raise CheckpointError(
            f"{base}: quantization_config assigns {expect} but the tensors present "
            f"({', '.join(f'{base}.{s}:{d}' for s, d in present.items())}) are {found}"
        )
    return found


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def _infer_block(n: int, ns: int) -> int | None:
    """The power-of-two block b with ceil(n / b) == ns (the smallest), or None."""
    if ns == n:
        return 1
    b = 1
    while b <= max(n, 1) * 2:
        if _ceil_div(n, b) == ns:
            return b
        b *= 2
    return None


def _block_from_config(qc: dict, base: str, wshape, sshape) -> tuple[int, int]:
    n, k = wshape[-2:]
    m = qc["method"]
    if m == "fp8":
        bs = _fp8_block_size(qc, base)
        if bs is not None:
            return bs
    elif m == "compressed-tensors":
        scheme, _, _ = _ct_scheme(qc, base)
        w = (scheme or {}).get("weights") or {}
        if w.get("strategy") == "channel":
            return (1, k)
        bs = w.get("block_structure")
        if bs is not None:
            if (
                not isinstance(bs, (list, tuple))
                or len(bs) != 2
                or not all(isinstance(b, int) and b > 0 for b in bs)
            ):
                raise CheckpointError(f"{base}: unsupported compressed-tensors block_structure {bs!r}")
            return tuple(bs)
    elif m == "modelopt":
        algo, params = _modelopt_algo(qc, base)
        if algo == "FP8_PER_CHANNEL_PER_TOKEN":
            return (1, k)
        if params.get("block_size") or params.get("weight_block_size"):
            return tuple(params.get("block_size") or params.get("weight_block_size"))
    if len(sshape) < 2:
        raise CheckpointError(
            f"{base}: fp8 block scale of shape {list(sshape)} for weight {list(wshape)} "
            f"and no block size in quantization_config"
        )
    bn, bk = _infer_block(n, sshape[-2]), _infer_block(k, sshape[-1])
    if bn is None or bk is None:
        raise CheckpointError(
            f"{base}: cannot infer the fp8 block size from weight {list(wshape)} and scale "
            f"{list(sshape)}; set quantization_config.weight_block_size"
        )
    return (bn, bk)


def load_quantized(
    base: str,
    fetch: Callable[[str], torch.Tensor] | Mapping[str, torch.Tensor],
    format: str,
    cfg: Mapping | None = None,
    *,
    names=None,
    shape: Sequence[int] | None = None,
) -> QuantizedTensor:
    """Reads weight `base` of `format` (from resolve_format) into a QuantizedTensor.

    fetch(name) -> Tensor reads one checkpoint tensor; a Mapping or a WeightStore works too. A
    missing tensor is signalled by KeyError or None, or by its absence from `names` (anything
    supporting `in`: a set of the names present; taken from `fetch` itself when it supports `in`).
    cfg is the quantization_config (for the fp8 block size; inferred from the shapes when absent).
    `shape` optionally checks the logical [.., N, K] shape."""
    base = _strip_weight(base)
    qc = _qconfig(cfg)
    if names is None and hasattr(fetch, "__contains__") and hasattr(fetch, "get"):
        names = fetch  # a Mapping, or a WeightStore (`in` + `get`)
    getter = fetch.get if hasattr(fetch, "get") else fetch

    def opt(suffix):
        key = f"{base}.{suffix}"
        if names is not None and key not in names:
            return None
        try:
            return getter(key)
        except KeyError:
            return None

    def req(*suffixes):
        for s in suffixes:
            t = opt(s)
            if t is not None:
                return t, f"{base}.{s}"
        raise CheckpointError(
            f"{base}.{suffixes[0]} is missing (needed by the {format} weight {base}"
            + (
                f"; also looked for {', '.join(base + '.' + s for s in suffixes[1:])}"
                if len(suffixes) > 1
                else ""
            )
            + ")"
        )

    if format == "fp8_block":
        w, wn = req("weight")
        s, sn = req("weight_scale_inv", "scale", "weight_scale")
        block = _block_from_config(qc, base, w.shape, s.shape)
        return QuantizedTensor(
            "fp8_block",
            w,
            s,
            block=block,
            input_scale=opt("input_scale"),
            shape=shape,
            name=base,
            tensor_names={"codes": wn, "scale": sn},
        )
    if format == "fp8_tensor":
        w, wn = req("weight")
        s, sn = req("weight_scale", "weight_scale_inv", "scale")
        return QuantizedTensor(
            "fp8_tensor",
            w,
            s,
            input_scale=opt("input_scale"),
            shape=shape,
            name=base,
            tensor_names={"codes": wn, "scale": sn},
        )
    if format == "mxfp4":
        w, wn = req("weight_packed", "weight")
        s, sn = req("weight_scale") if wn.endswith("weight_packed") else req("scale", "weight_scale")
        return QuantizedTensor("mxfp4", w, s, shape=shape, name=base, tensor_names={"codes": wn, "scale": sn})
    if format == "nvfp4":
        packed = opt("weight_packed")
        if packed is not None:  # compressed-tensors: the global scale divides
            s, sn = req("weight_scale")
            g, gn = req("weight_global_scale")
            return QuantizedTensor(
                "nvfp4",
                packed,
                s,
                global_scale=g,
                global_divides=True,
                input_scale=opt("input_global_scale"),
                shape=shape,
                name=base,
                tensor_names={"codes": f"{base}.weight_packed", "scale": sn, "global_scale": gn},
            )
        w, wn = req("weight")  # ModelOpt: weight_scale_2 multiplies
        s, sn = req("weight_scale")
        g, gn = req("weight_scale_2")
        return QuantizedTensor(
            "nvfp4",
            w,
            s,
            global_scale=g,
            global_divides=False,
            input_scale=opt("input_scale"),
            shape=shape,
            name=base,
            tensor_names={"codes": wn, "scale": sn, "global_scale": gn},
        )
    raise CheckpointError(f"{base}: unknown quantized format {format!r} (one of {', '.join(FORMATS)})")


def from_suffix_dict(
    tensors: Mapping[str, torch.Tensor],
    cfg: Mapping | None = None,
    name: str = "weight",
    format: str | None = None,
) -> QuantizedTensor:
    """A QuantizedTensor from an encoder's output ({"weight_packed": .., "weight_scale": ..}, the
    suffixes of one checkpoint weight); the format is resolved from the dtypes when not given."""
    full = {f"{name}.{k}": v for k, v in tensors.items()}
    if format is None:
        format = resolve_format(cfg, {k: v.dtype for k, v in full.items()}, name)
        if format is None:
            raise CheckpointError(f"{name}: {sorted(tensors)} is a dense weight, not a quantized one")
    return load_quantized(name, full, format, cfg)


# --------------------------------------------------------------------------------------------
# Encoders (checkpoint writers of the tests; runtime quantisation)
# --------------------------------------------------------------------------------------------


def _check_2d(w: torch.Tensor, what: str):
    if w.ndim != 2:
        raise ValueError(f"{what} quantizes one [N, K] matrix, got {list(w.shape)}; stack experts afterwards")


# An encoder works through a weight a few rows at a time, its fp32 temporaries (~CHUNK_BYTES) staying in
# cache: whole-matrix temporaries (fresh memory, page-faulted) made packing at load ~8x slower
# (docs/perf.md). Each value's arithmetic is the same either way: the codes and scales are too.
CHUNK_BYTES = 1 << 20


def _row_chunks(n: int, width: int, unit: int = 1):
    """[r0, r1) ranges over n rows of `width` fp32 values, about CHUNK_BYTES each, a multiple of `unit` rows
    (a scale block's) but for the last."""
    step = unit * max(1, CHUNK_BYTES // (4 * width * unit))
    return [(r0, min(n, r0 + step)) for r0 in range(0, n, step)]


def quantize_fp8_block(
    w: torch.Tensor, block: Sequence[int] = (128, 128), scale_fmt: str = "float", naming: str = "hf"
) -> dict[str, torch.Tensor]:
    """E4M3 codes + one scale per block (scale = amax/448; 'ue8m0': the power of two >= that,
    amax floored at 1e-4, stored as float8_e8m0fnu). naming: 'hf' -> weight + weight_scale_inv,
    'deepseek' -> weight + scale, 'compressed-tensors' -> weight + weight_scale."""
    _check_2d(w, "quantize_fp8_block")
    sname = {"hf": "weight_scale_inv", "deepseek": "scale", "compressed-tensors": "weight_scale"}.get(naming)
    if sname is None:
        raise ValueError(f"naming must be 'hf', 'deepseek' or 'compressed-tensors', not {naming!r}")
    if scale_fmt not in ("float", "ue8m0"):
        raise ValueError(f"scale_fmt must be 'float' or 'ue8m0', not {scale_fmt!r}")
    bn, bk = block
    n, k = w.shape
    nb, kb = _ceil_div(n, bn), _ceil_div(k, bk)
    codes = memory.empty((n, k), torch.float8_e4m3fn, w.device)  # kept: in huge pages where they apply
    s_store = torch.empty(
        nb, kb, dtype=torch.uint8 if scale_fmt == "ue8m0" else torch.float32, device=w.device
    )
    done = cpu.encode_fp8(w, (bn, bk), scale_fmt == "ue8m0", codes.view(torch.uint8), s_store)  # one pass
    for r0, r1 in [] if done else _row_chunks(n, kb * bk, bn):  # whole block rows at a time
        rows = r1 - r0
        nbc = _ceil_div(rows, bn)
        wf = w[r0:r1].float()
        pad_r, pad_c = nbc * bn - rows, kb * bk - k
        blocks = (F.pad(wf, (0, pad_c, 0, pad_r)) if pad_r or pad_c else wf).view(nbc, bn, kb, bk)
        amax = blocks.abs().amax(dim=(1, 3))
        if scale_fmt == "ue8m0":
            e = pow2_ceil_e8m0(amax.clamp_min(1e-4) / E4M3_MAX)
            s_store[r0 // bn : r0 // bn + nbc] = e
            sc = e8m0_to_float(e)
        else:
            sc = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
            s_store[r0 // bn : r0 // bn + nbc] = sc
        q = (blocks / sc[:, None, :, None]).view(nbc * bn, kb * bk)[:rows, :k]
        codes[r0:r1] = float_to_e4m3(q)
    return {"weight": codes, sname: s_store.view(torch.float8_e8m0fnu) if scale_fmt == "ue8m0" else s_store}


def quantize_fp8_tensor(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """E4M3 codes + one fp32 multiplier (amax/448), ModelOpt naming: weight + weight_scale."""
    _check_2d(w, "quantize_fp8_tensor")
    amax = w.float().abs().amax()
    s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax)).reshape(())
    return {"weight": float_to_e4m3(w.float() / s), "weight_scale": s}


def quantize_mxfp4(w: torch.Tensor, naming: str = "compressed-tensors") -> dict[str, torch.Tensor]:
    """E2M1 codes (round to nearest, ties to even) with one E8M0 scale per 32 inputs,
    scale = pow2_ceil(amax / 6) (amax floored at 6*2^-126), so no value clips.
    naming 'compressed-tensors' -> weight_packed U8 + weight_scale U8;
    'deepseek' -> weight I8 + scale F8_E8M0."""
    _check_2d(w, "quantize_mxfp4")
    if naming not in ("compressed-tensors", "deepseek"):
        raise ValueError(f"naming must be 'compressed-tensors' or 'deepseek', not {naming!r}")
    n, k = w.shape
    if k % MXFP4_GROUP:
        raise ValueError(f"mxfp4 needs K % 32 == 0, got {k}")
    packed = memory.empty((n, k // 2), torch.uint8, w.device)  # kept: in huge pages where they apply
    e = torch.empty(n, k // MXFP4_GROUP, dtype=torch.uint8, device=w.device)
    done = cpu.encode_fp4("mxfp4", w, 0.0, packed, e)  # the same bytes in one compiled pass
    for r0, r1 in [] if done else _row_chunks(n, k):
        g = w[r0:r1].float().view(r1 - r0, k // MXFP4_GROUP, MXFP4_GROUP)
        amax = g.abs().amax(-1).clamp_min(E2M1_MAX * 2.0**-126)
        e[r0:r1] = ec = pow2_ceil_e8m0(amax / E2M1_MAX)
        packed[r0:r1] = pack_fp4_codes(float_to_e2m1_codes(g / e8m0_to_float(ec)[..., None]).view(r1 - r0, k))
    if naming == "compressed-tensors":
        return {"weight_packed": packed, "weight_scale": e}
    return {"weight": packed.view(torch.int8), "scale": e.view(torch.float8_e8m0fnu)}


def quantize_nvfp4(
    w: torch.Tensor, naming: str = "compressed-tensors", out: tuple | None = None
) -> dict[str, torch.Tensor]:
    """E2M1 codes with one E4M3 scale per 16 inputs and an fp32 global scale chosen so the largest
    group scale lands on 448: ModelOpt weight_scale_2 = amax/(448*6) (multiplier);
    compressed-tensors weight_global_scale = 448*6/amax (divisor). Codes are rounded against the
    effective scale exactly as the decoder applies it. `out`: (codes [N, K/2] uint8, scales [N, K/16]
    float8_e4m3fn), contiguous, to write into (a stack's matrix: contract.pack) instead of new tensors."""
    _check_2d(w, "quantize_nvfp4")
    if naming not in ("compressed-tensors", "modelopt"):
        raise ValueError(f"naming must be 'compressed-tensors' or 'modelopt', not {naming!r}")
    n, k = w.shape
    if k % NVFP4_GROUP:
        raise ValueError(f"nvfp4 needs K % 16 == 0, got {k}")
    chunks = _row_chunks(n, k)
    lo, hi = torch.aminmax(w)  # one pass, no temporary: max |w| exactly
    amax_t = torch.maximum(-lo, hi).float()
    amax_t = amax_t.clamp_min(torch.finfo(torch.float32).tiny)
    if naming == "compressed-tensors":
        gs = (E4M3_MAX * E2M1_MAX / amax_t).reshape(1)
    else:
        gs = (amax_t / (E4M3_MAX * E2M1_MAX)).reshape(())
    if out is None:
        packed = memory.empty((n, k // 2), torch.uint8, w.device)  # kept: in huge pages where they apply
        s = torch.empty(n, k // NVFP4_GROUP, dtype=torch.float8_e4m3fn, device=w.device)
    else:
        packed, s = out
        if packed.shape != (n, k // 2) or s.shape != (n, k // NVFP4_GROUP) or s.dtype != torch.float8_e4m3fn:
            raise ValueError(f"quantize_nvfp4: out must be ([{n}, {k // 2}] bytes, [{n}, {k // 16}] e4m3)")
    encoding = "nvfp4" if naming == "compressed-tensors" else "nvfp4-modelopt"
    done = cpu.encode_fp4(encoding, w, gs.item(), packed, s.view(torch.uint8))  # the same bytes, one pass
    for r0, r1 in [] if done else chunks:
        g = w[r0:r1].float().view(r1 - r0, k // NVFP4_GROUP, NVFP4_GROUP)
        gmax = g.abs().amax(-1)
        if naming == "compressed-tensors":
            s[r0:r1] = sc = float_to_e4m3(gmax / E2M1_MAX * gs)
            eff = sc.float() / gs
        else:
            s[r0:r1] = sc = float_to_e4m3(gmax / E2M1_MAX / gs)
            eff = sc.float() * gs
        safe = torch.where(eff > 0, eff, torch.ones_like(eff))
        x = torch.where(eff[..., None] > 0, g / safe[..., None], torch.zeros_like(g))
        packed[r0:r1] = pack_fp4_codes(float_to_e2m1_codes(x).view(r1 - r0, k))
    if naming == "compressed-tensors":
        return {"weight_packed": packed, "weight_scale": s, "weight_global_scale": gs.float()}
    return {"weight": packed, "weight_scale": s, "weight_scale_2": gs.float()}


class ConcatRows:
    """Several weights [.., N_i, K] used as one [.., ΣN_i, K]: the fused gate|up of experts whose
    parts are quantized separately (each part keeps its own scales; nothing is re-packed)."""

    def __init__(self, parts: Sequence):
        self.parts = list(parts)
        lead = tuple(self.parts[0].shape[:-1])
        self.shape = torch.Size(lead[:-1] + (sum(p.shape[-2] for p in self.parts), self.parts[0].shape[-1]))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return sum(
            p.nbytes
            if hasattr(p, "nbytes") and not isinstance(p, torch.Tensor)
            else p.numel() * p.element_size()
            for p in self.parts
        )

    def __getitem__(self, i) -> ConcatRows:
        return ConcatRows([p[i] for p in self.parts])

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T like QuantizedTensor.matmul; each part writes its own columns of one output."""
        if tk := kernels("quant", x):
            return tk.matmul(self, x)
        k, n = self.shape[-1], self.shape[-2]
        cd = _compute_dtype(x)
        lead = self.shape[:-2]
        xs = x.to(cd).reshape(math.prod(lead) if lead else 1, -1, k)
        out = torch.empty(xs.shape[:2] + (n,), dtype=cd, device=x.device)
        c0 = 0
        for p in self.parts:
            c1 = c0 + p.shape[-2]
            for b in range(xs.shape[0]):
                if isinstance(p, torch.Tensor):  # `linear`'s rule, as grouped_matmul computes it
                    out[b, :, c0:c1] = cpu.linear(xs[b], p.reshape(-1, *p.shape[-2:])[b].to(cd))
                else:
                    p._matmul_2d(xs[b], out[b, :, c0:c1], b)
            c0 = c1
        return out.view(*x.shape[:-1], n)

    def grouped_matmul(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """Like QuantizedTensor.grouped_matmul: one grouped call per part, into its own columns."""
        check_grouped(self, x, offs, "ConcatRows.grouped_matmul")
        if tk := kernels("quant", x):
            return tk.grouped_matmul(x, offs, self)
        x = x.to(_compute_dtype(x))
        out = torch.empty(x.shape[0], self.shape[-2], dtype=x.dtype, device=x.device)
        c0 = 0
        for p in self.parts:
            c1 = c0 + p.shape[-2]
            if isinstance(p, torch.Tensor):  # in x's dtype, like matmul
                out[:, c0:c1] = cpu.grouped_linear(x, p.to(x.dtype), offs)
            else:
                p._grouped_2d(x, offs, out[:, c0:c1])
            c0 = c1
        return out

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat(
            [p.dequantize(dtype) if not isinstance(p, torch.Tensor) else p.to(dtype) for p in self.parts],
            dim=-2,
        )

    def to(self, device) -> ConcatRows:
        return ConcatRows([p.to(device) for p in self.parts])

    def __repr__(self) -> str:
        return f"ConcatRows({self.parts!r})"
