"""gguf-py's GGUFReader, made several times faster at reading metadata.

The stock reader slices an ``np.memmap`` for every value it parses, and each slice of a memmap runs
two Python-level methods (``memmap.__getitem__`` and ``__array_finalize__``). A model with a large
vocabulary has hundreds of thousands of values (Gemma 3's 262,144 tokens, scores and types): the
stock reader took 9 s over Gemma 3 270M and 2.3 s over SmolLM2-135M, in every process that opened
one. This reader parses the same file through a plain ndarray view of the same mapping (2.6 s and
0.6 s; the stock _get's np.empty per value also goes); fields, parts and tensors are equal to the stock reader's, and tensor data are ndarray views
of the mapped file (the mapping stays alive as their base).

Arrays go further: the stock reader parses an array element by element, through its recursive
field parser, two array views per value. Here a scalar array is read as one array and split into
its elements' views, and a string array's lengths are read with ``struct`` (Gemma 3's metadata:
5.0 s with the views alone, measured 2026-12-07 on a busy 2-core machine; SmolLM2's: 1.9 s).
"""

from __future__ import annotations

import struct
from typing import Any

import gguf
import numpy as np
from gguf import GGUFValueType


class GGUFReader(gguf.GGUFReader):
    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:  # the stock __init__ assigns its np.memmap here
        self._data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        """``count`` values of ``dtype`` at ``offset``, in the file's byte order (as the stock _get)."""
        count = int(count)
        arr = self._data[offset : offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[np.ndarray], list[int], list[Any]]:
        """As the stock parser: (size, parts, data indices, types); an array of scalars or strings in one pass."""
        if raw_type != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype, count, offs = GGUFValueType(raw_itype[0]), int(alen[0]), orig_offs + 12
        types = [GGUFValueType.ARRAY] + ([itype] if count else [])  # the stock parser adds the first element's
        parts: list[np.ndarray] = [raw_itype, alen]
        if itype == GGUFValueType.STRING:
            u64 = np.dtype(np.uint64).newbyteorder(self.byte_order)
            length = struct.Struct(("<" if self.endianess == gguf.GGUFEndian.LITTLE else ">") + "Q").unpack_from
            data, view = self._data, self._data.data  # uint8: a slice of it is a string's bytes
            for _ in range(count):
                n = length(view, offs)[0]
                parts += (data[offs : offs + 8].view(u64), data[offs + 8 : offs + 8 + n])
                offs += 8 + n
            return offs - orig_offs, parts, list(range(3, 2 + 2 * count, 2)), types
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is None:  # an array of arrays: element by element, as the stock parser
            return super()._get_field_parts(orig_offs, raw_type)
        values = self._get(offs, nptype, count)
        parts += list(values.reshape(count, 1))  # the elements' one-value views
        return 12 + int(values.nbytes), parts, list(range(2, 2 + count)), types
