"""The boundary tap's eval callback in C, built once with the machine's C compiler.

llama.cpp's scheduler calls the context's eval callback for every node of the graph, twice for
the node the callback wants (``ask``, then with the data): about 630 calls per decode on a
19-layer SmolLM2 slice. A Python callback costs a few microseconds per call (the ctypes thunk, the
GIL, a ctypes call for the node's name): half a millisecond per decode, an eighth of the hop's
compute. The same callback in C costs nothing measurable.

The C function keeps its state in a struct the Python side owns (`TapState`): the node's name,
whether it is armed, the ggml functions it calls (their addresses, taken from the bundled ggml
library, so nothing is linked), and an output buffer it copies each micro-batch's rows into.
llama-cpp-python is built from source, so a C compiler is where it is; without one (``cc`` not
found, or ``NEURON_NATIVE_TAP=0``) `build` returns None and the Python callback runs instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from workers.files import atomic_output

SOURCE = r"""
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef const char *(*get_name_fn)(const void *);
typedef size_t (*nbytes_fn)(const void *);
typedef int64_t (*nrows_fn)(const void *);
typedef void (*tensor_get_fn)(const void *, void *, size_t, size_t);

struct tap_state {
    get_name_fn get_name;
    nbytes_fn nbytes;
    nrows_fn nrows;
    tensor_get_fn tensor_get;
    char node[64];
    int32_t armed;
    int32_t chunks;     /* micro-batches whose boundary rows were copied */
    int32_t bad;        /* 1: a boundary node of the wrong shape, 2: the buffer is too small */
    int32_t n_embd;
    char *buf;
    size_t cap;
    size_t used;
    char *trace;        /* names of the nodes offered, newline-separated (NULL: not recorded) */
    size_t trace_cap;
    size_t trace_used;
};

bool neuron_tap_eval(void *t, bool ask, void *user) {
    struct tap_state *s = (struct tap_state *) user;
    if (!s->armed) return !ask;
    const char *name = s->get_name(t);
    if (ask && s->trace) {
        size_t n = strlen(name);
        if (s->trace_used + n + 1 <= s->trace_cap) {
            memcpy(s->trace + s->trace_used, name, n);
            s->trace[s->trace_used + n] = '\n';
            s->trace_used += n + 1;
        }
    }
    int match = strcmp(name, s->node) == 0;
    if (ask) return match;
    if (!match) return true;
    size_t n = s->nbytes(t);
    if (n != (size_t) s->nrows(t) * (size_t) s->n_embd * 4) { s->bad = 1; return false; }
    if (s->used + n > s->cap) { s->bad = 2; return false; }
    s->tensor_get(t, s->buf + s->used, 0, n);
    s->used += n;
    s->chunks += 1;
    return false;  /* stop: the rest of the graph (output norm, lm_head) is not needed */
}
"""


class TapState(ctypes.Structure):
    _fields_ = [
        ("get_name", ctypes.c_void_p),
        ("nbytes", ctypes.c_void_p),
        ("nrows", ctypes.c_void_p),
        ("tensor_get", ctypes.c_void_p),
        ("node", ctypes.c_char * 64),
        ("armed", ctypes.c_int32),
        ("chunks", ctypes.c_int32),
        ("bad", ctypes.c_int32),
        ("n_embd", ctypes.c_int32),
        ("buf", ctypes.c_void_p),
        ("cap", ctypes.c_size_t),
        ("used", ctypes.c_size_t),
        ("trace", ctypes.c_void_p),
        ("trace_cap", ctypes.c_size_t),
        ("trace_used", ctypes.c_size_t),
    ]


_built: dict[str, ctypes.CDLL | None] = {}


def build() -> ctypes.CDLL | None:
    """The compiled callback library (built once per machine into the temp dir), or None."""
    if os.environ.get("NEURON_NATIVE_TAP", "1") == "0":
        return None
    digest = hashlib.sha256(SOURCE.encode()).hexdigest()[:16]
    if digest in _built:
        return _built[digest]
    lib = None
    out = Path(tempfile.gettempdir()) / f"neuron-bus-tap-{os.getuid()}-{digest}.so"
    try:
        if not out.is_file():
            _compile(out)
        lib = ctypes.CDLL(str(out))
    except (OSError, subprocess.SubprocessError):
        lib = None
    _built[digest] = lib
    return lib


def _compile(out: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise OSError("no C compiler")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "tap.c"
        src.write_text(SOURCE)
        with atomic_output(out) as part:  # workers starting together never load half a file
            subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(part), str(src)], check=True, capture_output=True)
