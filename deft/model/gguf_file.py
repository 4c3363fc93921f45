"""A lean GGUF reader: metadata and tensor directory parsed once, tensors dequantised on demand.

``gguf.GGUFReader`` builds a numpy view per metadata element, which takes seconds for a
49k-token vocabulary; this reader parses the same header with ``struct`` in a fraction
of that and leaves dequantisation to ``gguf.quants.dequantize``. Tensor data stays
memory-mapped until a tensor is asked for.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..checks import is_int

try:
    import gguf
    import gguf.quants
except ImportError:  # only GGUF files need it (the ``model`` extra), not other checkpoints
    gguf = None
if TYPE_CHECKING:
    from gguf import GGMLQuantizationType

__all__ = ["GGUFFile", "GGUFTensor"]

# The format's value type ids: its scalars' struct formats, then string and array.
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_NUMPY = {t: np.dtype(f) for t, f in _SCALAR.items()}
_U64 = struct.Struct("<Q")


class _Corrupt(Exception):
    """Raised while parsing; :class:`GGUFFile` turns it into a ``ValueError`` naming the file."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor's directory entry. ``shape`` is in torch order (GGUF lists dims reversed)."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos, self.end = buf, 0, len(buf)

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > self.end:
            raise _Corrupt(f"truncated at byte {self.pos}")
        (val,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return val

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > self.end:
            raise _Corrupt(f"string of {n} bytes at byte {self.pos} runs past the end of the file")
        s = str(self.buf[self.pos:self.pos + n], "utf-8")
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype in _SCALAR:
            return self.take(_SCALAR[vtype])
        if vtype != _ARRAY:
            raise _Corrupt(f"unknown value type {vtype} at byte {self.pos}")
        etype, count = self.take("<I"), self.take("<Q")
        if etype in _NUMPY:
            size = _NUMPY[etype].itemsize * count
            if self.pos + size > self.end:
                raise _Corrupt(f"array of {count} values at byte {self.pos} runs past the end of the file")
            arr = np.frombuffer(self.buf, _NUMPY[etype], count, self.pos).copy()
            self.pos += size
            return arr
        if etype == _STRING:
            return self._strings(count)
        return [self.value(etype) for _ in range(count)]

    def _strings(self, count: int) -> list[str]:
        # The hot loop of a vocabulary: tens of thousands of short strings.
        buf, pos, end, out = self.buf, self.pos, self.end, []
        for _ in range(count):
            if pos + 8 > end:
                raise _Corrupt(f"truncated at byte {pos}")
            (n,) = _U64.unpack_from(buf, pos)
            pos += 8
            if pos + n > end:
                raise _Corrupt(f"string of {n} bytes at byte {pos} runs past the end of the file")
            out.append(str(buf[pos:pos + n], "utf-8"))
            pos += n
        self.pos = pos
        return out


class GGUFFile:
    """A parsed GGUF file (version 2 or 3, little-endian).

    Raises ``FileNotFoundError`` for a missing file, ``ValueError`` naming ``path`` for
    anything that is not a well-formed GGUF file and ``ImportError`` without the ``gguf``
    package (its quantisation tables and dequantisers).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        if gguf is None:
            raise ImportError(f"{self.path}: reading GGUF files needs the gguf package "
                              "(pip install 'deft-llm[model]')")
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"{self.path}: no such GGUF file")
        size = os.path.getsize(self.path)
        if size < 24:
            raise ValueError(f"{self.path}: not a GGUF file ({size} bytes, too short for a header)")
        with open(self.path, "rb") as f:
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        magic = bytes(self._buf[:4])
        if magic != b"GGUF":
            raise ValueError(f"{self.path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
        try:
            self.metadata, self.tensors = self._parse()
        except (_Corrupt, UnicodeDecodeError) as exc:
            raise ValueError(f"{self.path}: corrupt GGUF file ({exc})") from None

    def _parse(self) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
        cur = _Cursor(self._buf)
        cur.pos = 4
        version = cur.take("<I")
        if version not in (2, 3):
            raise _Corrupt(f"unsupported GGUF version {version}, expected 2 or 3")
        n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
        if n_tensors > cur.end or n_kv > cur.end:
            raise _Corrupt(f"implausible counts: {n_tensors} tensors, {n_kv} key/values")
        metadata = {}
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.take("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.take("<I")
            if n_dims > 8:
                raise _Corrupt(f"tensor {name!r} has {n_dims} dims")
            dims = [cur.take("<Q") for _ in range(n_dims)]
            raw_type, offset = cur.take("<I"), cur.take("<Q")
            try:
                qtype = gguf.GGMLQuantizationType(raw_type)
            except ValueError:
                raise _Corrupt(f"tensor {name!r} has unknown type id {raw_type}") from None
            infos.append((name, dims, qtype, offset))
        align = metadata.get("general.alignment", 32)
        if not is_int(align) or align < 1:
            raise _Corrupt(f"general.alignment: expected a positive integer, got {align!r}")
        start = cur.pos + (-cur.pos) % align
        tensors = {}
        for name, dims, qtype, offset in infos:
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            elems = math.prod(dims)  # exact: a damaged dim must not wrap around
            if dims and dims[0] % block:
                raise _Corrupt(f"tensor {name!r}: row length {dims[0]} is not a multiple of {block}")
            nbytes = elems // block * type_size
            if start + offset + nbytes > cur.end:
                raise _Corrupt(f"tensor {name!r} runs past the end of the file (truncated?)")
            tensors[name] = GGUFTensor(name, tuple(reversed(dims)), qtype, start + offset, nbytes)
        return metadata, tensors

    def dequantize(self, name: str, dim: int | None = None, start: int = 0,
                   stop: int | None = None) -> np.ndarray:
        """Tensor ``name`` as float32 ``[*shape]`` (a fresh array, not tied to the file); with
        ``dim`` (0 or 1 of a 2-D tensor), only ``[start, stop)`` along it. Only those rows'
        bytes are read, or those columns' where they fall on whole quantisation blocks
        (else whole rows are, then sliced)."""
        t = self.tensors[name]
        shape = t.shape
        if t.nbytes == 0:
            return np.zeros(shape, np.float32)[_span(shape, dim, start, stop)]
        rows = math.prod(shape[:-1])
        raw = np.frombuffer(self._buf, np.uint8, t.nbytes, t.offset).reshape(rows, t.nbytes // rows)
        after = _span(shape, dim, start, stop)  # what is left to slice once dequantised
        if dim is not None and len(shape) == 2:
            stop = shape[dim] if stop is None else stop
            block, type_size = gguf.GGML_QUANT_SIZES[t.qtype]
            if dim == 0:
                raw, shape, after = raw[start:stop], (stop - start, shape[1]), ()
            elif start % block == 0 and stop % block == 0:
                raw = raw[:, start // block * type_size:stop // block * type_size]
                shape, after = (shape[0], stop - start), ()
        try:
            out = gguf.quants.dequantize(np.ascontiguousarray(raw), t.qtype)
        except NotImplementedError:
            raise ValueError(
                f"{self.path}: tensor {name!r} has type {t.qtype.name}, which gguf cannot dequantise"
            ) from None
        if t.qtype == gguf.GGMLQuantizationType.F32:
            out = out.copy()  # dequantize returns a view of the mapped file
        return np.ascontiguousarray(out.astype(np.float32, copy=False).reshape(shape)[after])


def _span(shape: tuple[int, ...], dim: int | None, start: int, stop: int | None) -> tuple:
    """The index of ``[start, stop)`` along ``dim`` of an array of ``shape`` (all of it if
    ``dim`` is None)."""
    if dim is None:
        return ()
    if not 0 <= dim < len(shape):
        raise ValueError(f"dim: expected one of the {len(shape)} dimensions, got {dim}")
    return (slice(None),) * dim + (slice(start, stop),)
