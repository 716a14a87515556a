"""The fused quantization kernel (``csrc/quant.c``), loaded with ctypes.

One pass per block does what takes a dozen torch ops (compare with the snapshot, min/max,
quantize, pack, update the reconstruction and the snapshot), several times faster.
:mod:`checkflow.codec._build` compiles it at first use with the system's C compiler. When
there is no compiler, or ``CHECKFLOW_NATIVE=0``, or the library does not load (not the
kernel, missing symbols), :func:`load` warns once and returns None, and the codecs use the
torch path, whose results are bit-identical (tests check both ways).
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import threading
from typing import Any

import numpy as np
import torch

from checkflow.codec._build import BuildError, compile_kernel, forget
from checkflow.codec.base import CodecError
from checkflow.codec.blocks import Layout, compress_section, int_view, pack_bitmap

logger = logging.getLogger(__name__)

ENV_DISABLE = "CHECKFLOW_NATIVE"

_lock = threading.Lock()
_loaded: NativeKernel | None = None
_tried = False

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


def load() -> NativeKernel | None:
    """The compiled kernel, building it once per machine; None when it cannot be built."""
    global _loaded, _tried
    if os.environ.get(ENV_DISABLE, "1") == "0":
        return None
    if _tried:
        return _loaded
    with _lock:
        if not _tried:
            try:
                _loaded = _open(compile_kernel())
            except (BuildError, OSError, subprocess.SubprocessError, AttributeError) as e:
                # Not fatal: the torch path gives the same bytes, only slower. A library
                # that is not the kernel (missing symbols: AttributeError) lands here too.
                logger.warning("quantization kernel unavailable (%s); using torch ops", e)
                _loaded = None
            _tried = True
    return _loaded


def _open(library: Any) -> NativeKernel:
    try:
        return NativeKernel(ctypes.CDLL(str(library)))
    finally:
        forget(library)


_HUGE = 1 << 21
_MADV_HUGEPAGE = 14
_libc: Any = None


def fresh(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An empty buffer backed by huge pages where the OS allows it (Linux THP=madvise).

    A fresh 64 MiB buffer takes 16384 page faults with 4 KiB pages, which cost more than the
    kernel that fills it; 2 MiB pages take 32 (measured ~3x faster to first-fill).
    """
    global _libc
    t = torch.empty(numel, dtype=dtype)
    nbytes = numel * t.element_size()
    if nbytes < 4 * _HUGE:
        return t
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        start = (t.data_ptr() + _HUGE - 1) & ~(_HUGE - 1)
        end = (t.data_ptr() + nbytes) & ~(_HUGE - 1)
        _libc.madvise(start, end - start, _MADV_HUGEPAGE)  # advisory: failure is harmless
    except (OSError, AttributeError):
        pass
    return t


def _ptr(t: torch.Tensor | np.ndarray) -> int:
    return t.data_ptr() if isinstance(t, torch.Tensor) else t.ctypes.data


class NativeKernel:
    """ctypes bindings of the C kernel, for fp32 and bf16 chunks."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._enc, self._dec = {}, {}
        for suffix in _SUFFIX.values():
            if not hasattr(lib, f"q_encode_{suffix}"):
                continue  # float16 needs the compiler's _Float16
            enc = getattr(lib, f"q_encode_{suffix}")
            enc.argtypes = [_P, _P, _P, *[_I64] * 5, _INT, _INT, _I64, *[_P] * 5]
            enc.restype = _INT
            dec = getattr(lib, f"q_decode_{suffix}")
            dec.argtypes = [_P, _P, _I64, _I64, _I64, _I64, _I64, _INT, *[_P] * 7]
            dec.restype = _INT
            self._enc[suffix], self._dec[suffix] = enc, dec
        self._d_enc, self._d_dec = lib.d_encode, lib.d_decode
        self._d_enc.argtypes = [_P, _P, *[_I64] * 6, _P, _P, _P]
        self._d_dec.argtypes = [_P, *[_I64] * 6, _P, _P, _P, _I64]
        self._d_enc.restype = self._d_dec.restype = _INT
        self._shuffle, self._unshuffle = lib.shuffle, lib.unshuffle
        for fn in (self._shuffle, self._unshuffle):
            fn.argtypes = [_P, _P, _I64, _I64]
            fn.restype = None
        self._unshuffle_planes = lib.unshuffle_planes
        self._unshuffle_planes.argtypes = [_P, _P, _I64, _I64, _INT]
        self._unshuffle_planes.restype = None
        self._nib4_pack = lib.nib4_pack
        self._nib4_pack.argtypes = [_P, _I64, _P, _P, _P, _P, _I64]
        self._nib4_pack.restype = _I64
        self._nib4_unpack = lib.nib4_unpack
        self._nib4_unpack.argtypes = [_P, _I64, _P, _P]
        self._nib4_unpack.restype = None

    def shuffle(
        self, raw: torch.Tensor | np.ndarray, itemsize: int, inverse: bool = False
    ) -> torch.Tensor:
        """Byte-shuffle (or un-shuffle) flat uint8 bytes of ``itemsize``-byte elements (a
        tensor, or a numpy array, which may be read-only: it is only read)."""
        out = fresh(raw.nbytes, torch.uint8)
        if raw.nbytes:
            fn = self._unshuffle if inverse else self._shuffle
            fn(_ptr(raw), _ptr(out), raw.nbytes // itemsize, itemsize)
        return out

    def unshuffle_planes(
        self, planes: list[Any], numel: int, itemsize: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``numel`` elements of ``itemsize`` bytes from their byte planes (buffers of
        ``numel`` bytes each, read-only ones too: they are only read), into ``out`` (a
        contiguous tensor of ``numel * itemsize`` bytes, written past the cache: a live
        tensor filled by a restore) or a fresh uint8 tensor."""
        stream = out is not None
        if out is None:
            out = fresh(numel * itemsize, torch.uint8)
        elif not out.is_contiguous() or out.numel() * out.element_size() != numel * itemsize:
            raise ValueError(f"out must be contiguous and hold {numel * itemsize} bytes")
        if numel:
            arrays = [np.frombuffer(p, dtype=np.uint8) for p in planes]
            pointers = (ctypes.c_void_p * itemsize)(*[a.ctypes.data for a in arrays])
            self._unshuffle_planes(pointers, _ptr(out), numel, itemsize, int(stream))
        return out

    def nib4_pack(
        self, plane: np.ndarray, code: np.ndarray, max_escapes: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """``plane`` (uint8) as 4-bit codes two per byte, and its escapes (positions, values);
        None when it has more than ``max_escapes`` (see ``csrc/quant.c``)."""
        n = plane.size
        packed = np.empty((n + 1) // 2, dtype=np.uint8)
        positions = np.empty(max_escapes, dtype=np.uint32)
        values = np.empty(max_escapes, dtype=np.uint8)
        count = self._nib4_pack(
            _ptr(plane), n, _ptr(code), _ptr(packed), _ptr(positions), _ptr(values), max_escapes
        )
        return None if count < 0 else (packed, positions[:count], values[:count])

    def nib4_unpack(self, packed: Any, n: int, value: np.ndarray, plane: np.ndarray) -> None:
        """The ``n`` bytes coded in ``packed`` (a buffer), into ``plane``; escapes are left
        holding ``value[15]``."""
        src = np.frombuffer(packed, dtype=np.uint8)
        if src.size != (n + 1) // 2 or plane.size < n:
            raise ValueError(f"{src.size} packed bytes do not hold {n} codes")
        self._nib4_unpack(_ptr(src), n, _ptr(value), _ptr(plane))

    def supports(self, dtype: torch.dtype) -> bool:
        return _SUFFIX.get(dtype) in self._enc

    def encode(
        self,
        flat: torch.Tensor,
        ref: Any,
        layout: Layout,
        bits: int,
        log_space: bool,
        max_step: int,
    ) -> tuple[list[Any], int]:
        """Encode a flat chunk against ``ref`` (a ``QuantRef``), updating it in place."""
        fn = self._enc[_SUFFIX[flat.dtype]]
        nb = layout.nblocks
        changed = np.empty(nb, dtype=np.uint8)
        kinds = np.empty(nb, dtype=np.uint8)
        meta = np.empty((nb, 2), dtype=np.int32)
        # Worst case; pages never written are never touched. LOG16 blocks take 2 bytes a code.
        wide = log_space and max_step >= 0
        code_bytes = sum(
            r.count * max((r.blen * bits + 7) // 8, 2 * r.blen if wide else 0)
            for r in layout.regions
        )
        codes = fresh(code_bytes, torch.uint8).numpy()
        counts = np.zeros(3, dtype=np.int64)
        args = (_ptr(flat), _ptr(ref.snap), _ptr(ref.recon))
        raw_parts = []
        for r in layout.regions:
            before = int(counts[0])
            rc = fn(*args, r.offset, r.nrows, r.row_stride, r.nblocks, r.blen, bits,
                    int(log_space), max_step, _ptr(changed[r.first :]), _ptr(kinds), _ptr(meta),
                    _ptr(codes), _ptr(counts))  # fmt: skip
            if rc != 0:
                raise MemoryError("quantization kernel could not allocate its scratch")
            raw_parts.extend(_raw_blocks(flat, r, changed, kinds[before : int(counts[0])]))
        nch, nq, cb = (int(c) for c in counts)
        sections = [
            pack_bitmap(changed.astype(bool)),
            compress_section(kinds[:nch].data),
            meta[:nq].tobytes(),
            codes[:cb].data,
            b"".join(raw_parts),
        ]
        return sections, nch

    def delta_encode(
        self, flat: torch.Tensor, prev: torch.Tensor, layout: Layout
    ) -> tuple[np.ndarray, torch.Tensor]:
        """Changed flags per block and the XOR of the changed blocks; ``prev`` takes ``flat``."""
        es = flat.element_size()
        changed = np.empty(layout.nblocks, dtype=np.uint8)
        xor = fresh(flat.numel() * es, torch.uint8)
        pos = np.zeros(1, dtype=np.int64)
        for r in layout.regions:
            self._d_enc(_ptr(flat), _ptr(prev), es, r.offset, r.nrows, r.row_stride, r.nblocks,
                        r.blen, _ptr(changed[r.first :]), _ptr(xor), _ptr(pos))  # fmt: skip
        return changed, xor[: int(pos[0])]

    def delta_decode(
        self, out: torch.Tensor, layout: Layout, changed: np.ndarray, xor: np.ndarray
    ) -> None:
        """XOR the changed blocks of ``out`` (a copy of the base) in place."""
        ch = np.ascontiguousarray(changed, dtype=np.uint8)
        pos = np.zeros(1, dtype=np.int64)
        for r in layout.regions:
            rc = self._d_dec(_ptr(out), out.element_size(), r.offset, r.nrows, r.row_stride,
                             r.nblocks, r.blen, _ptr(ch[r.first :]), _ptr(xor), _ptr(pos),
                             xor.nbytes)  # fmt: skip
            if rc != 0:
                raise CodecError("delta payload is shorter than its block map says")
        if int(pos[0]) != xor.nbytes:
            raise CodecError("delta payload is longer than its block map says")

    def decode(
        self,
        src: torch.Tensor,
        out: torch.Tensor,
        layout: Layout,
        bits: int,
        changed: np.ndarray,
        kinds: np.ndarray,
        sections: list[memoryview],
    ) -> None:
        """Write into ``out`` the base ``src`` with a stored delta applied (both flat)."""
        fn = self._dec[_SUFFIX[out.dtype]]
        meta_b, codes_b, raw_b = (np.frombuffer(s, dtype=np.uint8) for s in sections)
        itemsize = out.element_size()
        if meta_b.nbytes % 8 or raw_b.nbytes % itemsize:
            raise CodecError("quantized delta sections have a torn length")
        ch = np.ascontiguousarray(changed, dtype=np.uint8)
        counts = np.zeros(4, dtype=np.int64)
        limits = np.array(
            [kinds.size, meta_b.nbytes // 8, codes_b.nbytes, raw_b.nbytes // itemsize],
            dtype=np.int64,
        )
        for r in layout.regions:
            rc = fn(_ptr(src), _ptr(out), r.offset, r.nrows, r.row_stride, r.nblocks, r.blen, bits,
                    _ptr(ch[r.first :]), _ptr(kinds), _ptr(meta_b), _ptr(codes_b), _ptr(raw_b),
                    _ptr(counts), _ptr(limits))  # fmt: skip
            if rc == -2:
                raise CodecError("quantized delta is shorter than its block map says")
            if rc != 0:
                raise CodecError(f"quantized delta is corrupt (kernel error {rc})")
        if not np.array_equal(counts, limits):
            raise CodecError("quantized delta is longer than its block map says")


def _raw_blocks(flat: torch.Tensor, region: Any, changed: np.ndarray, kinds: np.ndarray) -> list:
    """Exact bytes of the RAW blocks of one region, in block order (rare: NaN/inf blocks)."""
    if not (kinds == 3).any():
        return []
    ids = np.flatnonzero(changed[region.first : region.first + region.count])[kinds == 3]
    rows, cols = torch.from_numpy(ids // region.nblocks), torch.from_numpy(ids % region.nblocks)
    # Integer view: float indexing may canonicalize NaN payloads.
    blocks = region.view(int_view(flat))[rows, cols].contiguous()
    return [bytes(blocks.view(torch.uint8).numpy())]
