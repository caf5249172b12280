/* engram.codec._cpu: the NVFP4, MXFP4 and FP8 E4M3 codecs on the CPU, the same bytes as
 * engram.codec.fp4_reference (which defines them; docs/FP4_NOTES.md states the rules). This file is the Python
 * glue; the loops are in _cpu_kernels.h, and engram/codec/cpu.py is the Python side (checks, payloads, errors).
 *
 * Why C and not numba or numpy: numba would JIT-compile at every daemon start and pull in llvmlite; a numpy
 * version is ~10 passes over the data (widen, abs, group max, divide, compare x7, pack) and stays far from
 * memory speed. A C loop per format, compiled once at install with -O3 and auto-vectorized, does one pass over
 * L1-sized tiles.
 *
 * The kernels are compiled twice, for the x86-64 baseline (SSE2) and for AVX2, and the module picks AVX2 where
 * the CPU has it: runtime dispatch keeps the wheel portable where -march=native would not. Both copies do the
 * same IEEE operations in the same order, and the tests run both (`isa`, `use_isa`).
 *
 * Bit-exactness rests on the reference's habits: rounding to E2M1/E4M3 and E8M0 exponents by integer operations
 * on float32 bits (plus one float add of a power of two whose ulp is the format's step, as the Triton kernels
 * do); IEEE float32 division where the reference divides; the per-element step multiplies by a per-group
 * reciprocal computed once; no FMA contraction (-ffp-contract=off, no -ffast-math); float32 subnormals are
 * ordinary values (nothing here sets FTZ/DAZ). bf16 and fp16 are widened, and rounded back (nearest even, as
 * torch's casts), by integer operations.
 *
 * Every function takes buffer-protocol objects (a torch tensor's numpy view: 16-bit floats as int16 bits),
 * reads inputs of any strides (1-3 dims, read as the (d0*d1, d2) matrix), writes into the caller's buffers,
 * and releases the GIL while it loops, so a daemon can run one encoding thread per core. It never allocates,
 * and it does not raise on NaN/Inf: it reports them and the caller raises the reference's error.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_cpu.h"

static const Kernels *K = &KERNELS_BASE;
static const char *ISA = "baseline";

/* ---- Python glue ---------------------------------------------------------------------------------- */

static int get_kind(int kind, Py_ssize_t item) {
    if ((kind == KIND_F32 && item == 4) || ((kind == KIND_BF16 || kind == KIND_F16) && item == 2)) return 0;
    PyErr_Format(PyExc_ValueError, "element kind %d does not match a buffer of %zd-byte items", kind, item);
    return -1;
}

/* A buffer of 1..3 dims as (blocks, rows, cols) with byte strides. */
static int view_dims(const Py_buffer *b, ptrdiff_t n[3], ptrdiff_t s[3]) {
    if (b->ndim < 1 || b->ndim > 3) {
        PyErr_Format(PyExc_ValueError, "expected a buffer of 1 to 3 dims, got %d", b->ndim);
        return -1;
    }
    n[0] = n[1] = 1;
    s[0] = s[1] = 0;
    for (int d = 0; d < b->ndim; d++) {
        n[3 - b->ndim + d] = b->shape[d];
        s[3 - b->ndim + d] = b->strides ? b->strides[d] : b->itemsize;
    }
    if (b->ndim < 2) s[1] = n[2] * s[2];
    if (b->ndim < 3) s[0] = n[1] * s[1];
    for (int d = 0; d < 3; d++)
        if (n[d] <= 0) {
            PyErr_SetString(PyExc_ValueError, "the input is empty");
            return -1;
        }
    return 0;
}

static int get_in(PyObject *obj, int kind, Py_buffer *buf, View *v) {
    if (PyObject_GetBuffer(obj, buf, PyBUF_STRIDES | PyBUF_FORMAT) < 0) return -1;
    if (get_kind(kind, buf->itemsize) < 0 || view_dims(buf, v->n, v->s) < 0) {
        PyBuffer_Release(buf);
        return -1;
    }
    v->base = buf->buf, v->kind = kind, v->item = buf->itemsize;
    return 0;
}

static int get_out(PyObject *obj, int kind, Py_buffer *buf, OutView *v) {
    if (PyObject_GetBuffer(obj, buf, PyBUF_STRIDES | PyBUF_FORMAT | PyBUF_WRITABLE) < 0) return -1;
    if (get_kind(kind, buf->itemsize) < 0 || view_dims(buf, v->n, v->s) < 0) {
        PyBuffer_Release(buf);
        return -1;
    }
    v->base = buf->buf, v->kind = kind, v->item = buf->itemsize;
    return 0;
}

/* A contiguous uint8 buffer of exactly `need` bytes. */
static int get_bytes(PyObject *obj, Py_buffer *buf, Py_ssize_t need, int writable, const char *what) {
    if (PyObject_GetBuffer(obj, buf, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) return -1;
    if (buf->len != need) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd bytes, got %zd", what, need, buf->len);
        PyBuffer_Release(buf);
        return -1;
    }
    return 0;
}

static Py_ssize_t padded(Py_ssize_t cols, Py_ssize_t g) { return (cols + g - 1) / g * g; }

PyDoc_STRVAR(amax_doc, "amax(x, kind) -> (amax: float, nonfinite: bool)\n\n"
             "max |x| over a 1-3 dim buffer (kind 0 float32, 1 bf16 bits, 2 fp16 bits) as a float32 value.");

static PyObject *py_amax(PyObject *self, PyObject *args) {
    PyObject *xo;
    int kind;
    if (!PyArg_ParseTuple(args, "Oi", &xo, &kind)) return NULL;
    Py_buffer xb;
    View v;
    if (get_in(xo, kind, &xb, &v) < 0) return NULL;
    uint32_t m;
    Py_BEGIN_ALLOW_THREADS
    m = K->amax_bits(&v);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&xb);
    float amax;
    memcpy(&amax, &m, 4);
    return Py_BuildValue("(dO)", (double)amax, m >= 0x7F800000u ? Py_True : Py_False);
}

PyDoc_STRVAR(encode_grouped_doc,
             "encode_grouped(x, kind, fmt, scale, round_up, codes, scales) -> nonfinite: bool\n\n"
             "NVFP4 (fmt 0, scale = the tensor scale) or MXFP4 (fmt 1, round_up) codes and group scales of x, a\n"
             "1-3 dim buffer read as the (d0*d1, d2) matrix, into contiguous uint8 buffers of (rows, cols_p/2)\n"
             "and (rows, cols_p/G) bytes. Returns whether x held NaN/Inf (the outputs are then not an encoding).");

/* a * b * c in *out, or a ValueError: a buffer's dims come from the caller, and a view of stride 0 costs no
   memory, so their product can wrap around and pass a length check it should fail. */
static int product(Py_ssize_t a, Py_ssize_t b, Py_ssize_t c, Py_ssize_t *out) {
    Py_ssize_t ab;
    if (__builtin_mul_overflow(a, b, &ab) || __builtin_mul_overflow(ab, c, out)) {
        PyErr_SetString(PyExc_ValueError, "the buffer's dimensions multiply past what an index can hold");
        return -1;
    }
    return 0;
}

static PyObject *py_encode_grouped(PyObject *self, PyObject *args) {
    PyObject *xo, *co, *so;
    int kind, fmt, round_up;
    float scale;
    if (!PyArg_ParseTuple(args, "Oiifp" "OO", &xo, &kind, &fmt, &scale, &round_up, &co, &so)) return NULL;
    if (fmt != 0 && fmt != 1) return PyErr_Format(PyExc_ValueError, "fmt must be 0 (nvfp4) or 1 (mxfp4)");
    GroupSpec sp = {fmt, fmt == 0 ? 16u : 32u, scale, round_up};
    Py_buffer xb, cb, sb;
    View v;
    if (get_in(xo, kind, &xb, &v) < 0) return NULL;
    Py_ssize_t rows, cp = padded(v.n[2], sp.group), elems;
    if (product(v.n[0], v.n[1], 1, &rows) < 0 || product(rows, cp, 1, &elems) < 0) { PyBuffer_Release(&xb); return NULL; }
    if (get_bytes(co, &cb, elems / 2, 1, "codes") < 0) { PyBuffer_Release(&xb); return NULL; }
    if (get_bytes(so, &sb, elems / sp.group, 1, "scales") < 0) {
        PyBuffer_Release(&xb), PyBuffer_Release(&cb);
        return NULL;
    }
    uint32_t bad;
    Py_BEGIN_ALLOW_THREADS
    bad = K->encode_grouped(&v, &sp, cb.buf, sb.buf);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&xb), PyBuffer_Release(&cb), PyBuffer_Release(&sb);
    return PyBool_FromLong(bad != 0);
}

PyDoc_STRVAR(encode_fp8_doc, "encode_fp8(x, kind, scale, codes) -> nonfinite: bool\n\n"
             "FP8 E4M3 codes of x (1-3 dims, read as (d0*d1, d2)) with the tensor scale `scale`, into a\n"
             "contiguous uint8 buffer of rows*cols bytes.");

static PyObject *py_encode_fp8(PyObject *self, PyObject *args) {
    PyObject *xo, *co;
    int kind;
    float scale;
    if (!PyArg_ParseTuple(args, "OifO", &xo, &kind, &scale, &co)) return NULL;
    Py_buffer xb, cb;
    View v;
    if (get_in(xo, kind, &xb, &v) < 0) return NULL;
    Py_ssize_t elems;
    if (product(v.n[0], v.n[1], v.n[2], &elems) < 0) { PyBuffer_Release(&xb); return NULL; }
    if (get_bytes(co, &cb, elems, 1, "codes") < 0) { PyBuffer_Release(&xb); return NULL; }
    uint32_t bad;
    Py_BEGIN_ALLOW_THREADS
    float inv = 1.0f / scale;  /* the reference's ones_like(s) / s */
    bad = K->encode_fp8(&v, inv, cb.buf);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&xb), PyBuffer_Release(&cb);
    return PyBool_FromLong(bad != 0);
}

PyDoc_STRVAR(decode_grouped_doc, "decode_grouped(codes, scales, fmt, tensor_scale, out, kind) -> None\n\n"
             "NVFP4 (fmt 0) or MXFP4 (fmt 1) payload bytes into out, a writable 1-3 dim buffer of any strides\n"
             "read as the (d0*d1, d2) matrix of the unpadded shape (kind 0 float32, 1 bf16, 2 fp16).");

static PyObject *py_decode_grouped(PyObject *self, PyObject *args) {
    PyObject *co, *so, *oo;
    int fmt, kind;
    float ts;
    if (!PyArg_ParseTuple(args, "OOifOi", &co, &so, &fmt, &ts, &oo, &kind)) return NULL;
    if (fmt != 0 && fmt != 1) return PyErr_Format(PyExc_ValueError, "fmt must be 0 (nvfp4) or 1 (mxfp4)");
    GroupSpec sp = {fmt, fmt == 0 ? 16u : 32u, ts, 0};
    Py_buffer ob, cb, sb;
    OutView v;
    if (get_out(oo, kind, &ob, &v) < 0) return NULL;
    Py_ssize_t rows, cp = padded(v.n[2], sp.group), elems;
    if (product(v.n[0], v.n[1], 1, &rows) < 0 || product(rows, cp, 1, &elems) < 0) { PyBuffer_Release(&ob); return NULL; }
    if (get_bytes(co, &cb, elems / 2, 0, "codes") < 0) { PyBuffer_Release(&ob); return NULL; }
    if (get_bytes(so, &sb, elems / sp.group, 0, "scales") < 0) {
        PyBuffer_Release(&ob), PyBuffer_Release(&cb);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    K->decode_grouped(cb.buf, sb.buf, &sp, &v);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&ob), PyBuffer_Release(&cb), PyBuffer_Release(&sb);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(decode_fp8_doc, "decode_fp8(codes, scale, out, kind) -> None\n\n"
             "FP8 E4M3 codes (rows*cols bytes) times scale into out (1-3 dims, any strides).");

static PyObject *py_decode_fp8(PyObject *self, PyObject *args) {
    PyObject *co, *oo;
    int kind;
    float scale;
    if (!PyArg_ParseTuple(args, "OfOi", &co, &scale, &oo, &kind)) return NULL;
    Py_buffer ob, cb;
    OutView v;
    if (get_out(oo, kind, &ob, &v) < 0) return NULL;
    Py_ssize_t elems;
    if (product(v.n[0], v.n[1], v.n[2], &elems) < 0) { PyBuffer_Release(&ob); return NULL; }
    if (get_bytes(co, &cb, elems, 0, "codes") < 0) { PyBuffer_Release(&ob); return NULL; }
    Py_BEGIN_ALLOW_THREADS
    K->decode_fp8(cb.buf, scale, &v);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&ob), PyBuffer_Release(&cb);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(isa_doc, "isa() -> str\n\nThe instruction set whose kernels run: 'avx2' or 'baseline'.");

static PyObject *py_isa(PyObject *self, PyObject *args) { return PyUnicode_FromString(ISA); }

PyDoc_STRVAR(use_isa_doc, "use_isa(name) -> None\n\nRun the 'avx2' or the 'baseline' kernels from now on (for tests and\n"
             "benchmarks: both must give the same bytes). ValueError if this build or CPU has no such kernels.");

static int select_isa(const char *name) {
    if (strcmp(name, "baseline") == 0) {
        K = &KERNELS_BASE, ISA = "baseline";
        return 0;
    }
#ifdef HAVE_AVX2
    if (strcmp(name, "avx2") == 0 && __builtin_cpu_supports("avx2")) {
        K = &KERNELS_AVX2, ISA = "avx2";
        return 0;
    }
#endif
    return -1;
}

static PyObject *py_use_isa(PyObject *self, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    if (select_isa(name) < 0)
        return PyErr_Format(PyExc_ValueError, "no %s kernels on this build and CPU; 'baseline' always runs", name);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"isa", py_isa, METH_NOARGS, isa_doc},
    {"use_isa", py_use_isa, METH_VARARGS, use_isa_doc},
    {"amax", py_amax, METH_VARARGS, amax_doc},
    {"encode_grouped", py_encode_grouped, METH_VARARGS, encode_grouped_doc},
    {"encode_fp8", py_encode_fp8, METH_VARARGS, encode_fp8_doc},
    {"decode_grouped", py_decode_grouped, METH_VARARGS, decode_grouped_doc},
    {"decode_fp8", py_decode_fp8, METH_VARARGS, decode_fp8_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "engram.codec._cpu",
    "NVFP4, MXFP4 and FP8 E4M3 codecs on the CPU (see engram/codec/cpu.py and the header of _cpu.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__cpu(void) {
    KERNELS_BASE.init();
#ifdef HAVE_AVX2
    __builtin_cpu_init();
    KERNELS_AVX2.init();
    select_isa("avx2");  /* stays on the baseline where the CPU has no AVX2 */
#endif
    return PyModule_Create(&module);
}
