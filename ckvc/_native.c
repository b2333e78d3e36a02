/* ckvc._native: the byte loops under the bytegroup and delta codecs.
 *
 * numpy needs one memory pass per plane and per operation for these (1.3 ms for
 * a 4 MiB fp32 chunk's plane join, 1.5 ms for its split); one fused loop that
 * gcc vectorizes does either in ~0.2 ms. Every function checks its buffer sizes,
 * releases the GIL while it loops (checkout and commit run one thread per core)
 * and writes nothing past the buffers it is given. The Python fallbacks in
 * ckvc/codecs/planes.py and delta.py compute the same bytes; tests compare them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
/* AVX2 where the CPU has it, SSE2 otherwise; chosen once at load time. */
#define KERNEL __attribute__((target_clones("avx2", "default")))
#else
#define KERNEL
#endif

/* Sign swap (FORMAT.md, "bytegroup payload"): bit 7 of the top byte trades
 * places with bit 7 of the byte below it, so the top plane holds the whole
 * exponent of an fp32 or bf16. hi/lo are the two top bytes of one element. */
#define SWAP_BITS(hi, lo)                          \
    do {                                           \
        uint8_t s_ = (uint8_t)(((hi) ^ (lo)) & 0x80); \
        (hi) = (uint8_t)((hi) ^ s_);               \
        (lo) = (uint8_t)((lo) ^ s_);               \
    } while (0)

KERNEL static void split2(const uint8_t *src, uint8_t *restrict dst, size_t n, int swap) {
    uint8_t *restrict p0 = dst, *restrict p1 = dst + n;
    for (size_t i = 0; i < n; i++) {
        uint8_t b0 = src[2 * i], b1 = src[2 * i + 1];
        if (swap) SWAP_BITS(b1, b0);
        p0[i] = b0;
        p1[i] = b1;
    }
}

KERNEL static void split4(const uint8_t *src, uint8_t *restrict dst, size_t n, int swap) {
    uint8_t *restrict p0 = dst, *restrict p1 = dst + n, *restrict p2 = dst + 2 * n, *restrict p3 = dst + 3 * n;
    for (size_t i = 0; i < n; i++) {
        uint8_t b0 = src[4 * i], b1 = src[4 * i + 1], b2 = src[4 * i + 2], b3 = src[4 * i + 3];
        if (swap) SWAP_BITS(b3, b2);
        p0[i] = b0;
        p1[i] = b1;
        p2[i] = b2;
        p3[i] = b3;
    }
}

KERNEL static void split8(const uint8_t *src, uint8_t *restrict dst, size_t n, int swap) {
    for (size_t i = 0; i < n; i++) {
        uint8_t b[8];
        memcpy(b, src + 8 * i, 8);
        if (swap) SWAP_BITS(b[7], b[6]);
        for (int k = 0; k < 8; k++) dst[k * n + i] = b[k];
    }
}

KERNEL static void join2(const uint8_t *p0, const uint8_t *p1, uint8_t *restrict dst, size_t n, int swap) {
    for (size_t i = 0; i < n; i++) {
        uint8_t b0 = p0[i], b1 = p1[i];
        if (swap) SWAP_BITS(b1, b0);
        dst[2 * i] = b0;
        dst[2 * i + 1] = b1;
    }
}

KERNEL static void join4(const uint8_t *p0, const uint8_t *p1, const uint8_t *p2, const uint8_t *p3,
                         uint8_t *restrict dst, size_t n, int swap) {
    for (size_t i = 0; i < n; i++) {
        uint8_t b0 = p0[i], b1 = p1[i], b2 = p2[i], b3 = p3[i];
        if (swap) SWAP_BITS(b3, b2);
        dst[4 * i] = b0;
        dst[4 * i + 1] = b1;
        dst[4 * i + 2] = b2;
        dst[4 * i + 3] = b3;
    }
}

KERNEL static void join8(const uint8_t *const *p, uint8_t *restrict dst, size_t n, int swap) {
    for (size_t i = 0; i < n; i++) {
        uint8_t b[8];
        for (int k = 0; k < 8; k++) b[k] = p[k][i];
        if (swap) SWAP_BITS(b[7], b[6]);
        memcpy(dst + 8 * i, b, 8);
    }
}

/* Zigzag residuals (FORMAT.md, "delta payload"): zz = (d << 1) ^ (d >> (bits-1))
 * of the wrapping difference d = new - base of little-endian element patterns. */
#define ZIGZAG_KERNELS(BITS)                                                                      \
    KERNEL static void residual##BITS(const uint8_t *new_, const uint8_t *base, uint8_t *dst, size_t n) { \
        for (size_t i = 0; i < n; i++) {                                                          \
            uint##BITS##_t a, b;                                                                  \
            memcpy(&a, new_ + i * (BITS / 8), BITS / 8);                                          \
            memcpy(&b, base + i * (BITS / 8), BITS / 8);                                          \
            uint##BITS##_t d = (uint##BITS##_t)(a - b);                                           \
            uint##BITS##_t zz = (uint##BITS##_t)((d << 1) ^ (uint##BITS##_t)(0 - (d >> (BITS - 1)))); \
            memcpy(dst + i * (BITS / 8), &zz, BITS / 8);                                          \
        }                                                                                         \
    }                                                                                             \
    KERNEL static void apply##BITS(uint8_t *out, const uint8_t *base, size_t n) {                 \
        for (size_t i = 0; i < n; i++) {                                                          \
            uint##BITS##_t zz, b;                                                                 \
            memcpy(&zz, out + i * (BITS / 8), BITS / 8);                                          \
            memcpy(&b, base + i * (BITS / 8), BITS / 8);                                          \
            uint##BITS##_t d = (uint##BITS##_t)((zz >> 1) ^ (uint##BITS##_t)(0 - (zz & 1)));      \
            uint##BITS##_t v = (uint##BITS##_t)(d + b);                                           \
            memcpy(out + i * (BITS / 8), &v, BITS / 8);                                           \
        }                                                                                         \
    }

ZIGZAG_KERNELS(16)
ZIGZAG_KERNELS(32)
ZIGZAG_KERNELS(64)

/* A delta's residual planes joined, unzigzagged and added to the base in one
 * pass (join + apply would write and re-read the whole chunk). Written out per
 * width so that gcc vectorizes them. base may be dst itself (element i reads
 * only base[i]), so those two are not restrict. */
#define UNZIGZAG_ADD(BITS, zz, b) ((uint##BITS##_t)((((zz) >> 1) ^ (uint##BITS##_t)(0 - ((zz)&1))) + (b)))

KERNEL static void join_add16(const uint8_t *restrict p0, const uint8_t *restrict p1, const uint8_t *base, uint8_t *dst,
                              size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint16_t zz = (uint16_t)(p0[i] | (p1[i] << 8)), b;
        memcpy(&b, base + 2 * i, 2);
        uint16_t v = UNZIGZAG_ADD(16, zz, b);
        memcpy(dst + 2 * i, &v, 2);
    }
}

KERNEL static void join_add32(const uint8_t *restrict p0, const uint8_t *restrict p1, const uint8_t *restrict p2,
                              const uint8_t *restrict p3, const uint8_t *base, uint8_t *dst, size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint32_t zz = (uint32_t)p0[i] | ((uint32_t)p1[i] << 8) | ((uint32_t)p2[i] << 16) | ((uint32_t)p3[i] << 24), b;
        memcpy(&b, base + 4 * i, 4);
        uint32_t v = UNZIGZAG_ADD(32, zz, b);
        memcpy(dst + 4 * i, &v, 4);
    }
}

KERNEL static void join_add64(const uint8_t *const *p, const uint8_t *base, uint8_t *dst, size_t n) {
    const uint8_t *restrict p0 = p[0], *restrict p1 = p[1], *restrict p2 = p[2], *restrict p3 = p[3];
    const uint8_t *restrict p4 = p[4], *restrict p5 = p[5], *restrict p6 = p[6], *restrict p7 = p[7];
    for (size_t i = 0; i < n; i++) {
        uint64_t zz = (uint64_t)p0[i] | ((uint64_t)p1[i] << 8) | ((uint64_t)p2[i] << 16) | ((uint64_t)p3[i] << 24) |
                      ((uint64_t)p4[i] << 32) | ((uint64_t)p5[i] << 40) | ((uint64_t)p6[i] << 48) |
                      ((uint64_t)p7[i] << 56),
                 b;
        memcpy(&b, base + 8 * i, 8);
        uint64_t v = UNZIGZAG_ADD(64, zz, b);
        memcpy(dst + 8 * i, &v, 8);
    }
}

static int check_width(Py_ssize_t width) {
    if (width == 2 || width == 4 || width == 8) return 0;
    PyErr_Format(PyExc_ValueError, "unsupported element width %zd", width);
    return -1;
}

PyDoc_STRVAR(split_planes_doc,
             "split_planes(src, width, sign_swap, dst)\n\n"
             "Group the bytes of n = len(src) // width elements by significance into dst\n"
             "(n * width bytes): plane k, the k-th byte of every element, at dst[k*n:(k+1)*n].\n"
             "Bytes of src past the last whole element are ignored.");

static PyObject *split_planes(PyObject *self, PyObject *args) {
    Py_buffer src, dst;
    Py_ssize_t width;
    int swap;
    if (!PyArg_ParseTuple(args, "y*npw*", &src, &width, &swap, &dst)) return NULL;
    PyObject *result = NULL;
    if (check_width(width) < 0) goto done;
    size_t n = (size_t)(src.len / width);
    if ((size_t)dst.len != n * (size_t)width) {
        PyErr_Format(PyExc_ValueError, "dst is %zd bytes, expected %zu", dst.len, n * (size_t)width);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    if (width == 2) split2(src.buf, dst.buf, n, swap);
    else if (width == 4) split4(src.buf, dst.buf, n, swap);
    else split8(src.buf, dst.buf, n, swap);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

/* The planes argument of join_planes and join_planes_add: a sequence of width
 * (2, 4, 8) C-contiguous buffers of one length n. */
typedef struct {
    Py_buffer views[8];
    const uint8_t *p[8];
    Py_ssize_t held;
    Py_ssize_t width;
    size_t n;
} Planes;

static void planes_release(Planes *pl) {
    for (Py_ssize_t k = 0; k < pl->held; k++) PyBuffer_Release(&pl->views[k]);
    pl->held = 0;
}

static int planes_acquire(PyObject *seq, Planes *pl) {
    pl->held = 0;
    PyObject *fast = PySequence_Fast(seq, "planes must be a sequence of buffers");
    if (fast == NULL) return -1;
    int rc = -1;
    pl->width = PySequence_Fast_GET_SIZE(fast);
    if (check_width(pl->width) < 0) goto done;
    for (; pl->held < pl->width; pl->held++) {
        Py_buffer *view = &pl->views[pl->held];
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, pl->held), view, PyBUF_C_CONTIGUOUS) < 0) goto done;
        pl->p[pl->held] = view->buf;
    }
    pl->n = (size_t)pl->views[0].len;
    for (Py_ssize_t k = 1; k < pl->width; k++) {
        if ((size_t)pl->views[k].len != pl->n) {
            PyErr_SetString(PyExc_ValueError, "planes differ in length");
            goto done;
        }
    }
    rc = 0;
done:
    Py_DECREF(fast);
    if (rc < 0) planes_release(pl);
    return rc;
}

PyDoc_STRVAR(join_planes_doc,
             "join_planes(planes, sign_swap, dst)\n\n"
             "Inverse of split_planes: planes is a sequence of width (2, 4, 8) buffers of\n"
             "n bytes each, plane 0 lowest; dst receives the n * width element bytes.");

static PyObject *join_planes(PyObject *self, PyObject *args) {
    PyObject *seq;
    Py_buffer dst;
    int swap;
    if (!PyArg_ParseTuple(args, "Opw*", &seq, &swap, &dst)) return NULL;
    Planes pl;
    PyObject *result = NULL;
    if (planes_acquire(seq, &pl) < 0) goto done;
    size_t n = pl.n, width = (size_t)pl.width;
    if ((size_t)dst.len != n * width) {
        PyErr_Format(PyExc_ValueError, "dst is %zd bytes, expected %zu", dst.len, n * width);
        goto done;
    }
    const uint8_t *const *p = pl.p;
    Py_BEGIN_ALLOW_THREADS
    if (width == 2) join2(p[0], p[1], dst.buf, n, swap);
    else if (width == 4) join4(p[0], p[1], p[2], p[3], dst.buf, n, swap);
    else join8(p, dst.buf, n, swap);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    planes_release(&pl);
    PyBuffer_Release(&dst);
    return result;
}

PyDoc_STRVAR(zigzag_residual_doc,
             "zigzag_residual(new, base, width, dst)\n\n"
             "dst = zigzag(new - base) per little-endian element of width bytes, for the\n"
             "n = len(new) // width whole elements (dst is n * width bytes).");

static PyObject *zigzag_residual(PyObject *self, PyObject *args) {
    Py_buffer new_, base, dst;
    Py_ssize_t width;
    if (!PyArg_ParseTuple(args, "y*y*nw*", &new_, &base, &width, &dst)) return NULL;
    PyObject *result = NULL;
    if (check_width(width) < 0) goto done;
    size_t n = (size_t)(new_.len / width);
    if (base.len != new_.len || (size_t)dst.len != n * (size_t)width) {
        PyErr_SetString(PyExc_ValueError, "zigzag_residual: buffer sizes differ");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    if (width == 2) residual16(new_.buf, base.buf, dst.buf, n);
    else if (width == 4) residual32(new_.buf, base.buf, dst.buf, n);
    else residual64(new_.buf, base.buf, dst.buf, n);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&new_);
    PyBuffer_Release(&base);
    PyBuffer_Release(&dst);
    return result;
}

PyDoc_STRVAR(apply_zigzag_doc,
             "apply_zigzag(out, base, width)\n\n"
             "In place: out = unzigzag(out) + base per element, for the len(out) // width\n"
             "whole elements; base is at least that long.");

static PyObject *apply_zigzag(PyObject *self, PyObject *args) {
    Py_buffer out, base;
    Py_ssize_t width;
    if (!PyArg_ParseTuple(args, "w*y*n", &out, &base, &width)) return NULL;
    PyObject *result = NULL;
    if (check_width(width) < 0) goto done;
    size_t n = (size_t)(out.len / width);
    if ((size_t)base.len < n * (size_t)width) {
        PyErr_SetString(PyExc_ValueError, "apply_zigzag: base shorter than out");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    if (width == 2) apply16(out.buf, base.buf, n);
    else if (width == 4) apply32(out.buf, base.buf, n);
    else apply64(out.buf, base.buf, n);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&out);
    PyBuffer_Release(&base);
    return result;
}

PyDoc_STRVAR(join_planes_add_doc,
             "join_planes_add(planes, base, dst)\n\n"
             "dst = base + unzigzag(join_planes(planes)) per little-endian element of\n"
             "len(planes) bytes: a delta's residual planes applied in one pass. base (at\n"
             "least len(dst) bytes) is either dst itself (in place) or does not overlap it;\n"
             "dst is n * width bytes for planes of n bytes.");

static PyObject *join_planes_add(PyObject *self, PyObject *args) {
    PyObject *seq;
    Py_buffer base, dst;
    if (!PyArg_ParseTuple(args, "Oy*w*", &seq, &base, &dst)) return NULL;
    Planes pl;
    PyObject *result = NULL;
    if (planes_acquire(seq, &pl) < 0) goto done;
    size_t n = pl.n, width = (size_t)pl.width;
    if ((size_t)dst.len != n * width || (size_t)base.len < n * width) {
        PyErr_SetString(PyExc_ValueError, "join_planes_add: buffer sizes differ");
        goto done;
    }
    const uint8_t *const *p = pl.p;
    Py_BEGIN_ALLOW_THREADS
    if (width == 2) join_add16(p[0], p[1], base.buf, dst.buf, n);
    else if (width == 4) join_add32(p[0], p[1], p[2], p[3], base.buf, dst.buf, n);
    else join_add64(p, base.buf, dst.buf, n);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    planes_release(&pl);
    PyBuffer_Release(&base);
    PyBuffer_Release(&dst);
    return result;
}

PyDoc_STRVAR(distinct_bytes_doc,
             "distinct_bytes(src) -> int\n\n"
             "How many of the 256 byte values occur in src.");

static PyObject *distinct_bytes(PyObject *self, PyObject *args) {
    Py_buffer src;
    if (!PyArg_ParseTuple(args, "y*", &src)) return NULL;
    uint8_t seen[256] = {0};
    const uint8_t *p = src.buf;
    for (Py_ssize_t i = 0; i < src.len; i++) seen[p[i]] = 1;
    long count = 0;
    for (int v = 0; v < 256; v++) count += seen[v];
    PyBuffer_Release(&src);
    return PyLong_FromLong(count);
}

static PyMethodDef methods[] = {
    {"distinct_bytes", distinct_bytes, METH_VARARGS, distinct_bytes_doc},
    {"join_planes_add", join_planes_add, METH_VARARGS, join_planes_add_doc},
    {"split_planes", split_planes, METH_VARARGS, split_planes_doc},
    {"join_planes", join_planes, METH_VARARGS, join_planes_doc},
    {"zigzag_residual", zigzag_residual, METH_VARARGS, zigzag_residual_doc},
    {"apply_zigzag", apply_zigzag, METH_VARARGS, apply_zigzag_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "ckvc._native", "Native byte loops for ckvc's codecs (see _native.c).", -1, methods,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
