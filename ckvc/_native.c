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
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
/* AVX2 where the CPU has it, SSE2 otherwise; chosen once at load time. */
#define KERNEL __attribute__((target_clones("avx2", "default")))
/* The Huffman loops shift by variable counts: BMI2's shlx/shrx take one uop where
 * the base ISA's shifts by %cl take three. */
#define BIT_KERNEL __attribute__((target_clones("bmi2", "default")))
#else
#define KERNEL
#define BIT_KERNEL
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

KERNEL static void split2(const uint8_t *src, uint8_t *const *dst, size_t n, int swap) {
    uint8_t *restrict p0 = dst[0], *restrict p1 = dst[1];
    for (size_t i = 0; i < n; i++) {
        uint8_t b0 = src[2 * i], b1 = src[2 * i + 1];
        if (swap) SWAP_BITS(b1, b0);
        p0[i] = b0;
        p1[i] = b1;
    }
}

KERNEL static void split4(const uint8_t *src, uint8_t *const *dst, size_t n, int swap) {
    uint8_t *restrict p0 = dst[0], *restrict p1 = dst[1], *restrict p2 = dst[2], *restrict p3 = dst[3];
    for (size_t i = 0; i < n; i++) {
        uint8_t b0 = src[4 * i], b1 = src[4 * i + 1], b2 = src[4 * i + 2], b3 = src[4 * i + 3];
        if (swap) SWAP_BITS(b3, b2);
        p0[i] = b0;
        p1[i] = b1;
        p2[i] = b2;
        p3[i] = b3;
    }
}

KERNEL static void split8(const uint8_t *src, uint8_t *const *dst, size_t n, int swap) {
    for (size_t i = 0; i < n; i++) {
        uint8_t b[8];
        memcpy(b, src + 8 * i, 8);
        if (swap) SWAP_BITS(b[7], b[6]);
        for (int k = 0; k < 8; k++) dst[k][i] = b[k];
    }
}

/* Plane k of the n elements at src to dst[k]. */
static void split_into(const uint8_t *src, size_t width, uint8_t *const *dst, size_t n, int swap) {
    if (width == 2) split2(src, dst, n, swap);
    else if (width == 4) split4(src, dst, n, swap);
    else split8(src, dst, n, swap);
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

/* A scaled sub delta's prediction of one float32 element (FORMAT.md 6.3): its
 * base times scale, rounded to nearest, unless base or product is zero, subnormal,
 * infinite or NaN (exponent field 0 or 255, e - 1 >= 254): then the base's bits.
 * Decided on the bits, not by float comparisons, so flush-to-zero and
 * denormals-are-zero modes give the same bytes; branch-free so loops vectorize. */
static inline uint32_t scaled_bits(uint32_t bits, float scale) {
    float value;
    uint32_t scaled;
    memcpy(&value, &bits, 4);
    value *= scale;
    memcpy(&scaled, &value, 4);
    uint32_t eb = (bits >> 23) & 0xFF, es = (scaled >> 23) & 0xFF;
    uint32_t keep = 0u - (uint32_t)((eb - 1u >= 254u) | (es - 1u >= 254u));
    return (bits & keep) | (scaled & ~keep);
}

KERNEL static void scale32(const uint8_t *src, float scale, uint8_t *dst, size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, src + 4 * i, 4);
        bits = scaled_bits(bits, scale);
        memcpy(dst + 4 * i, &bits, 4);
    }
}

/* join_add32 against the scaled base: a scaled delta applied in the same one pass. */
KERNEL static void join_add32_scaled(const uint8_t *restrict p0, const uint8_t *restrict p1,
                                     const uint8_t *restrict p2, const uint8_t *restrict p3, const uint8_t *base,
                                     uint8_t *dst, size_t n, float scale) {
    for (size_t i = 0; i < n; i++) {
        uint32_t zz = (uint32_t)p0[i] | ((uint32_t)p1[i] << 8) | ((uint32_t)p2[i] << 16) | ((uint32_t)p3[i] << 24), b;
        memcpy(&b, base + 4 * i, 4);
        uint32_t v = UNZIGZAG_ADD(32, zz, scaled_bits(b, scale));
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
    uint8_t *planes[8];
    for (Py_ssize_t k = 0; k < width; k++) planes[k] = (uint8_t *)dst.buf + (size_t)k * n;
    Py_BEGIN_ALLOW_THREADS
    split_into(src.buf, (size_t)width, planes, n, swap);
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
             "dst is n * width bytes for planes of n bytes. With scale (float32 planes\n"
             "only), the base's elements are first predicted as scaled_base does.");

static PyObject *join_planes_add(PyObject *self, PyObject *args) {
    PyObject *seq;
    Py_buffer base, dst;
    double scale = 0.0;  /* 0: no scale (a scale is a positive normal float32) */
    if (!PyArg_ParseTuple(args, "Oy*w*|d", &seq, &base, &dst, &scale)) return NULL;
    Planes pl;
    PyObject *result = NULL;
    if (planes_acquire(seq, &pl) < 0) goto done;
    size_t n = pl.n, width = (size_t)pl.width;
    if ((size_t)dst.len != n * width || (size_t)base.len < n * width) {
        PyErr_SetString(PyExc_ValueError, "join_planes_add: buffer sizes differ");
        goto done;
    }
    if (scale != 0.0 && width != 4) {
        PyErr_SetString(PyExc_ValueError, "join_planes_add: a scale needs float32 planes");
        goto done;
    }
    const uint8_t *const *p = pl.p;
    Py_BEGIN_ALLOW_THREADS
    if (width == 2) join_add16(p[0], p[1], base.buf, dst.buf, n);
    else if (width == 4 && scale != 0.0) join_add32_scaled(p[0], p[1], p[2], p[3], base.buf, dst.buf, n, (float)scale);
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

PyDoc_STRVAR(scaled_base_doc,
             "scaled_base(base, scale, dst)\n\n"
             "dst = each float32 element of base times scale (a float32), rounded to\n"
             "nearest; an element whose base or product is zero, subnormal, infinite or\n"
             "NaN keeps the base's bits; bytes past the last whole element are copied.\n"
             "dst is base's size and may be base itself.");

static PyObject *scaled_base(PyObject *self, PyObject *args) {
    Py_buffer base, dst;
    float scale;
    if (!PyArg_ParseTuple(args, "y*fw*", &base, &scale, &dst)) return NULL;
    PyObject *result = NULL;
    if (dst.len != base.len) {
        PyErr_SetString(PyExc_ValueError, "scaled_base: buffer sizes differ");
        goto done;
    }
    size_t n = (size_t)base.len / 4, tail = (size_t)base.len - 4 * n;
    Py_BEGIN_ALLOW_THREADS
    scale32(base.buf, scale, dst.buf, n);
    memmove((uint8_t *)dst.buf + 4 * n, (const uint8_t *)base.buf + 4 * n, tail);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
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

/* ---- Huffman plane coder (FORMAT.md, "Huffman plane") ----------------------
 *
 * An order-0 canonical Huffman code of at most 11 bits per symbol, one code per
 * plane, the plane cut into four streams that are coded and decoded in one
 * loop (four independent dependency chains). The decoder's table yields up to
 * four symbols per lookup (an exponent plane averages ~2.7 bits a symbol);
 * the encoder looks up two symbols at a time. zstd's Huffman stage does the
 * same job at about half the speed on these planes (docs/DESIGN.md). */

#define HUF_MAX_BITS 11
#define HUF_TABLE (1u << HUF_MAX_BITS)
#define HUF_STREAMS 4
#define HUF_BITMAP 32
#define HUF_SIZES (4 * (HUF_STREAMS - 1))

static inline uint64_t load64le(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

static inline void store64le(uint8_t *p, uint64_t v) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    memcpy(p, &v, 8);
}

static inline uint32_t load32le(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline void store32le(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v, p[1] = (uint8_t)(v >> 8), p[2] = (uint8_t)(v >> 16), p[3] = (uint8_t)(v >> 24);
}

typedef struct {
    uint8_t len[256];   /* 0: the symbol does not occur */
    uint16_t code[256]; /* bit-reversed: the code's first bit in bit 0 */
} HufCode;

/* Symbols [start, end) of stream t of a plane of n symbols. */
static void huf_stream_span(size_t n, int t, size_t *start, size_t *end) {
    size_t q = n / HUF_STREAMS + (n % HUF_STREAMS != 0);
    *start = (size_t)t * q < n ? (size_t)t * q : n;
    *end = (size_t)(t + 1) * q < n ? (size_t)(t + 1) * q : n;
}

/* Canonical codes (DEFLATE's order: by length, then by symbol) from hc->len.
 * Returns 0 when the lengths form a complete prefix code of at least two symbols. */
static int huf_assign_codes(HufCode *hc) {
    unsigned count[HUF_MAX_BITS + 1] = {0};
    int symbols = 0;
    for (int s = 0; s < 256; s++) {
        if (hc->len[s] > HUF_MAX_BITS) return -1;
        if (hc->len[s]) count[hc->len[s]]++, symbols++;
    }
    uint32_t kraft = 0;
    for (int l = 1; l <= HUF_MAX_BITS; l++) kraft += count[l] << (HUF_MAX_BITS - l);
    if (symbols < 2 || kraft != HUF_TABLE) return -1;
    unsigned next[HUF_MAX_BITS + 1];
    unsigned code = 0;
    count[0] = 0;
    for (int l = 1; l <= HUF_MAX_BITS; l++) {
        code = (code + count[l - 1]) << 1;
        next[l] = code;
    }
    for (int s = 0; s < 256; s++) {
        int l = hc->len[s];
        if (!l) continue;
        unsigned c = next[l]++, r = 0;
        for (int i = 0; i < l; i++) r = (r << 1) | ((c >> i) & 1);
        hc->code[s] = (uint16_t)r;
    }
    return 0;
}

/* Sorts k keys ascending, least significant byte first, in as many passes as the
 * largest key has bytes: qsort's compare calls took 7 us for a plane of 256 values,
 * as long as the histogram of a 16 KiB sample. */
static void huf_sort_keys(uint64_t *key, int k) {
    uint64_t other[256], *from = key, *to = other, top = 0;
    for (int i = 0; i < k; i++) top |= key[i];
    for (unsigned shift = 0; shift < 64 && top >> shift; shift += 8) {
        unsigned start[257] = {0};
        for (int i = 0; i < k; i++) start[((from[i] >> shift) & 255) + 1]++;
        for (int d = 0; d < 256; d++) start[d + 1] += start[d];
        for (int i = 0; i < k; i++) to[start[(from[i] >> shift) & 255]++] = from[i];
        uint64_t *t = from;
        from = to, to = t;
    }
    if (from != key) memcpy(key, from, (size_t)k * sizeof *key);
}

/* Huffman code lengths for counts with at least two nonzero, limited to
 * HUF_MAX_BITS by clamping and repaying the Kraft excess (miniz's method). */
static void huf_lengths(const uint64_t *cnt, uint8_t *len) {
    /* present symbols by count, ascending, ties by symbol: count << 8 | symbol sorts
     * so (a plane holds fewer than 2^56 symbols) */
    uint64_t key[256];
    int sym[256], k = 0;
    for (int s = 0; s < 256; s++) {
        len[s] = 0;
        if (cnt[s]) key[k++] = cnt[s] << 8 | (uint64_t)s;
    }
    huf_sort_keys(key, k);
    for (int i = 0; i < k; i++) sym[i] = (int)(key[i] & 255);
    /* two queues: the sorted leaves, and internal nodes in the order they are made */
    uint64_t weight[512];
    int parent[512], depth[512];
    for (int i = 0; i < k; i++) weight[i] = cnt[sym[i]];
    int leaf = 0, node = k, made = k;
    for (int m = 0; m < k - 1; m++) {
        int pick[2];
        for (int t = 0; t < 2; t++) {
            if (leaf < k && (node >= made || weight[leaf] <= weight[node])) pick[t] = leaf++;
            else pick[t] = node++;
        }
        weight[made] = weight[pick[0]] + weight[pick[1]];
        parent[pick[0]] = parent[pick[1]] = made++;
    }
    depth[made - 1] = 0;
    for (int i = made - 2; i >= 0; i--) depth[i] = depth[parent[i]] + 1;
    unsigned num[HUF_MAX_BITS + 2] = {0};
    for (int i = 0; i < k; i++) num[depth[i] > HUF_MAX_BITS ? HUF_MAX_BITS : depth[i]]++;
    uint32_t total = 0;
    for (int l = 1; l <= HUF_MAX_BITS; l++) total += num[l] << (HUF_MAX_BITS - l);
    while (total > HUF_TABLE) {
        num[HUF_MAX_BITS]--;
        for (int l = HUF_MAX_BITS - 1; l > 0; l--) {
            if (num[l]) {
                num[l]--;
                num[l + 1] += 2;
                break;
            }
        }
        total--;
    }
    int i = 0; /* the longest codes to the rarest symbols */
    for (int l = HUF_MAX_BITS; l > 0; l--)
        for (unsigned c = 0; c < num[l]; c++) len[sym[i++]] = (uint8_t)l;
}

BIT_KERNEL static void huf_histogram(const uint8_t *src, size_t n, uint64_t *cnt) {
    /* eight tables, one per byte of a 64-bit load: a plane of few values (an
     * exponent plane) would otherwise wait on the same counter's last increment */
    uint32_t h[8][256];
    memset(h, 0, sizeof h);
    memset(cnt, 0, 256 * sizeof *cnt);
    size_t i = 0;
    while (i < n) {
        size_t stop = n - i > ((size_t)1 << 30) ? i + ((size_t)1 << 30) : n; /* no counter overflows */
        for (; i + 8 <= stop; i += 8) {
            uint64_t w = load64le(src + i);
            h[0][w & 255]++;
            h[1][(w >> 8) & 255]++;
            h[2][(w >> 16) & 255]++;
            h[3][(w >> 24) & 255]++;
            h[4][(w >> 32) & 255]++;
            h[5][(w >> 40) & 255]++;
            h[6][(w >> 48) & 255]++;
            h[7][w >> 56]++;
        }
        for (; i < stop; i++) h[0][src[i]]++;
        for (int s = 0; s < 256; s++) {
            uint64_t sum = 0;
            for (int t = 0; t < 8; t++) sum += h[t][s], h[t][s] = 0;
            cnt[s] += sum;
        }
    }
}

/* Each stream's symbol counts, and their sum in cnt. */
static void huf_stream_counts(const uint8_t *src, size_t n, uint64_t part[HUF_STREAMS][256], uint64_t *cnt) {
    memset(cnt, 0, 256 * sizeof *cnt);
    for (int t = 0; t < HUF_STREAMS; t++) {
        size_t a, b;
        huf_stream_span(n, t, &a, &b);
        huf_histogram(src + a, b - a, part[t]);
        for (int s = 0; s < 256; s++) cnt[s] += part[t][s];
    }
}

static size_t huf_header_size(const HufCode *hc) {
    int k = 0;
    for (int s = 0; s < 256; s++) k += hc->len[s] != 0;
    return HUF_BITMAP + (size_t)(k + 1) / 2 + HUF_SIZES;
}

/* The exact payload size of hc's code on a plane with these stream counts, with
 * each stream's size in stream_size. */
static size_t huf_sized(const HufCode *hc, uint64_t part[HUF_STREAMS][256], size_t *stream_size) {
    size_t total = huf_header_size(hc);
    for (int t = 0; t < HUF_STREAMS; t++) {
        uint64_t bits = 0;
        for (int s = 0; s < 256; s++) bits += part[t][s] * hc->len[s];
        stream_size[t] = (size_t)((bits + 7) / 8);
        total += stream_size[t];
    }
    return total;
}

/* Builds the code for src from its full histogram (the lengths only, unless
 * codes) and returns the exact payload size, with each stream's size in
 * stream_size; 0 when fewer than two byte values occur. */
static size_t huf_plan(const uint8_t *src, size_t n, HufCode *hc, size_t *stream_size, int codes) {
    uint64_t part[HUF_STREAMS][256], cnt[256];
    huf_stream_counts(src, n, part, cnt);
    int k = 0;
    for (int s = 0; s < 256; s++) k += cnt[s] != 0;
    if (k < 2) return 0;
    huf_lengths(cnt, hc->len);
    if (codes) huf_assign_codes(hc);
    return huf_sized(hc, part, stream_size);
}

/* A long plane's code is built from a sample: HUF_SAMPLE_PIECES stretches spread
 * over it, plus, counted once so that they get a code, the values the sample
 * missed that may occur. Those are bounded by one vector pass: the smallest and
 * largest nonzero byte, plain and rotated left by one bit (the sign swap leaves
 * the lowest exponent bit in bit 7, so a float's exponent byte is a contiguous
 * range only rotated), and whether a zero occurs. The full histogram took as
 * long as the code writing itself (docs/DESIGN.md, "Huffman planes"). Where that
 * leaves more than HUF_MAX_UNSEEN candidates outside the sample, their codes
 * would take a noticeable share of the code space, and the full histogram
 * decides instead. */
#define HUF_SAMPLED_MIN ((size_t)1 << 18)
#define HUF_SAMPLE_PIECES 16
#define HUF_SAMPLE_PIECE ((size_t)4096)
#define HUF_MAX_UNSEEN 12

/* What huf_plan_sampled bounds a long plane's values by: whether a zero byte
 * occurs, and the range of its nonzero bytes, plain and rotated left by one bit.
 * (Gathered inside the split instead, it slowed the split of a chunk read from
 * memory by more than this pass costs.) */
typedef struct {
    uint8_t zero;
    uint8_t lo[2], hi[2]; /* [0] plain, [1] rotated */
} ByteRange;

static inline uint8_t rotl1(uint8_t v) { return (uint8_t)(v << 1 | v >> 7); }

#define MIN8(a, b) ((uint8_t)((a) < (b) ? (a) : (b)))
#define MAX8(a, b) ((uint8_t)((a) > (b) ? (a) : (b)))

/* Minima of v - 1 (wrapping) skip the zeros: they become 255. */
KERNEL static void byte_range(const uint8_t *src, size_t n, ByteRange *r) {
    uint8_t least = 255, lo = 255, hi = 0, rlo = 255, rhi = 0;
    for (size_t i = 0; i < n; i++) {
        uint8_t v = src[i], rv = rotl1(v);
        least = MIN8(least, v);
        lo = MIN8(lo, (uint8_t)(v - 1));
        hi = MAX8(hi, v);
        rlo = MIN8(rlo, (uint8_t)(rv - 1));
        rhi = MAX8(rhi, rv);
    }
    *r = (ByteRange){least == 0, {(uint8_t)(lo + 1), (uint8_t)(rlo + 1)}, {hi, rhi}};
}

/* Returns 0 with hc set and each stream's largest possible size in cap, or -1
 * where the plane is short or the sample too unlike it (then use huf_plan). */
static int huf_plan_sampled(const uint8_t *src, size_t n, HufCode *hc, size_t *cap) {
    if (n < HUF_SAMPLED_MIN) return -1;
    uint64_t cnt[256] = {0}, piece[256];
    for (size_t p = 0; p < HUF_SAMPLE_PIECES; p++) {
        huf_histogram(src + (n - HUF_SAMPLE_PIECE) / (HUF_SAMPLE_PIECES - 1) * p, HUF_SAMPLE_PIECE, piece);
        for (int s = 0; s < 256; s++) cnt[s] += piece[s];
    }
    ByteRange r;
    byte_range(src, n, &r);
    uint8_t possible[2][256] = {{0}};
    int unseen[2] = {0, 0};
    for (int d = 0; d < 2; d++) {
        possible[d][0] = r.zero;
        for (int s = 1; s < 256; s++) {
            uint8_t key = d ? rotl1((uint8_t)s) : (uint8_t)s;
            possible[d][s] = key >= r.lo[d] && key <= r.hi[d];
        }
        for (int s = 0; s < 256; s++) unseen[d] += possible[d][s] && !cnt[s];
    }
    int d = unseen[1] < unseen[0];
    if (unseen[d] > HUF_MAX_UNSEEN) return -1;
    int k = 0;
    for (int s = 0; s < 256; s++) {
        cnt[s] = possible[d][s] ? (cnt[s] ? cnt[s] : 1) : 0; /* the sample lies inside the plane */
        k += cnt[s] != 0;
    }
    if (k < 2) return -1;
    huf_lengths(cnt, hc->len);
    huf_assign_codes(hc);
    for (int t = 0; t < HUF_STREAMS; t++) {
        size_t a, b;
        huf_stream_span(n, t, &a, &b);
        cap[t] = ((b - a) * HUF_MAX_BITS + 7) / 8;
    }
    return 0;
}

typedef struct {
    uint64_t buf; /* pending bits, the next one in bit 0 */
    unsigned bits;
    uint8_t *out, *end;
} BitWriter;

/* Writes the header and stream t at its offset in dst, room for cap[t] bytes
 * (streams end to end after the header), and each stream's size into
 * stream_size: equal to cap where huf_plan's sizes are the caps. The header's
 * sizes are cap's; huf_compact mends them. pair: scratch for 65536 entries.
 * Never writes outside dst (header plus the caps). */
BIT_KERNEL static void huf_write(const HufCode *hc, const size_t *cap, const uint8_t *src, size_t n, uint8_t *dst,
                      uint32_t *pair, size_t *stream_size) {
    uint8_t *p = dst;
    memset(p, 0, HUF_BITMAP);
    uint8_t present[256];
    int k = 0;
    for (int s = 0; s < 256; s++)
        if (hc->len[s]) p[s >> 3] |= (uint8_t)(1u << (s & 7)), present[k++] = (uint8_t)s;
    p += HUF_BITMAP;
    memset(p, 0, (size_t)(k + 1) / 2);
    for (int j = 0; j < k; j++) p[j >> 1] |= (uint8_t)(hc->len[present[j]] << ((j & 1) * 4));
    p += (k + 1) / 2;
    for (int t = 0; t < HUF_STREAMS - 1; t++) store32le(p + 4 * t, (uint32_t)cap[t]);
    p += HUF_SIZES;
    /* two symbols per lookup: pair[s0 | s1 << 8] holds both codes (<= 22 bits) and
     * their total length in the top byte; only pairs of symbols that occur are set.
     * Filling it costs k * k stores: only worth it when that is small beside n (a
     * plane of 256 values and 16 K symbols spent 100 us filling it). */
    int pairs = (size_t)k * (size_t)k <= n / 4;
    for (int x = 0; pairs && x < k; x++)
        for (int y = 0; y < k; y++) {
            int s0 = present[x], s1 = present[y];
            pair[s0 | s1 << 8] = ((uint32_t)hc->code[s0] | (uint32_t)hc->code[s1] << hc->len[s0]) |
                                 (uint32_t)(hc->len[s0] + hc->len[s1]) << 24;
        }
    BitWriter w[HUF_STREAMS];
    uint8_t *begin[HUF_STREAMS];
    const uint8_t *in[HUF_STREAMS];
    size_t count[HUF_STREAMS], common = SIZE_MAX;
    for (int t = 0; t < HUF_STREAMS; t++) {
        size_t a, b;
        huf_stream_span(n, t, &a, &b);
        in[t] = src + a;
        count[t] = b - a;
        if (count[t] < common) common = count[t];
        w[t] = (BitWriter){0, 0, p, p + cap[t]};
        begin[t] = p;
        p += cap[t];
    }
    uint32_t c;
#define PUT2(t, v) (c = pair[v], w[t].buf |= (uint64_t)(c & 0xffffff) << w[t].bits, w[t].bits += c >> 24)
#define PUT(t, s) (w[t].buf |= (uint64_t)hc->code[s] << w[t].bits, w[t].bits += hc->len[s])
    /* Four symbols (<= 44 bits) go onto fewer than 8 pending bits, then 8 bytes are
     * stored: only while each stream has 8 bytes of its own left. */
    size_t i = 0;
    for (;;) {
        /* A turn stores 8 bytes and moves a stream on by at most 6 (44 bits on fewer
         * than 8 pending): this many turns stay inside every stream unchecked. A check
         * per turn was an eighth of the loop's time. */
        size_t turns = (common - i) / 4;
        for (int t = 0; t < HUF_STREAMS; t++) {
            ptrdiff_t room = w[t].end - w[t].out;
            size_t safe = room < 8 ? 0 : (size_t)(room - 8) / 6 + 1;
            if (safe < turns) turns = safe;
        }
        if (!turns) break;
        for (size_t stop = i + 4 * turns; i < stop; i += 4) {
            for (int t = 0; t < HUF_STREAMS; t++) {
                uint32_t v = load32le(in[t] + i);
                if (pairs) {
                    PUT2(t, v & 0xffff);
                    PUT2(t, v >> 16);
                } else {
                    PUT(t, v & 255);
                    PUT(t, (v >> 8) & 255);
                    PUT(t, (v >> 16) & 255);
                    PUT(t, v >> 24);
                }
                store64le(w[t].out, w[t].buf);
                w[t].out += w[t].bits >> 3;
                w[t].buf >>= w[t].bits & ~7u;
                w[t].bits &= 7;
            }
        }
    }
    for (int t = 0; t < HUF_STREAMS; t++) { /* the rest byte by byte */
        for (size_t m = i; m < count[t]; m++) {
            PUT(t, in[t][m]);
            for (; w[t].bits >= 8; w[t].bits -= 8, w[t].buf >>= 8) *w[t].out++ = (uint8_t)w[t].buf;
        }
        if (w[t].bits) *w[t].out++ = (uint8_t)w[t].buf;
        stream_size[t] = (size_t)(w[t].out - begin[t]);
    }
#undef PUT
#undef PUT2
}

/* Moves the streams huf_write left at their caps' offsets end to end and sets
 * the header's sizes; returns the payload's size. */
static size_t huf_compact(const HufCode *hc, const size_t *cap, const size_t *stream_size, uint8_t *dst) {
    size_t head = huf_header_size(hc), from = head, to = head;
    for (int t = 0; t < HUF_STREAMS; t++) {
        if (t < HUF_STREAMS - 1) store32le(dst + head - HUF_SIZES + 4 * t, (uint32_t)stream_size[t]);
        if (to != from) memmove(dst + to, dst + from, stream_size[t]);
        from += cap[t];
        to += stream_size[t];
    }
    return to;
}

/* A decode table entry: symbols in bytes 0-3, how many in byte 4, bits used in byte 5. */
typedef uint64_t HufEntry;

static int huf_read_header(const uint8_t *src, size_t len, HufCode *hc, size_t *pos) {
    if (len < HUF_BITMAP) return -1;
    int k = 0;
    for (int s = 0; s < 256; s++) k += (src[s >> 3] >> (s & 7)) & 1;
    if (len < HUF_BITMAP + (size_t)(k + 1) / 2 + HUF_SIZES) return -1;
    int j = 0;
    for (int s = 0; s < 256; s++) {
        hc->len[s] = 0;
        if ((src[s >> 3] >> (s & 7)) & 1) {
            hc->len[s] = (src[HUF_BITMAP + (j >> 1)] >> ((j & 1) * 4)) & 15;
            if (!hc->len[s]) return -1;
            j++;
        }
    }
    if (k & 1 && src[HUF_BITMAP + k / 2] >> 4) return -1; /* the padding nibble is zero */
    if (huf_assign_codes(hc)) return -1;
    *pos = HUF_BITMAP + (size_t)(k + 1) / 2;
    return 0;
}

static void huf_build_table(const HufCode *hc, HufEntry *tab) {
    uint16_t single[HUF_TABLE]; /* symbol | length << 8; the code is complete, so all set */
    for (int s = 0; s < 256; s++) {
        unsigned l = hc->len[s];
        if (l)
            for (unsigned r = hc->code[s]; r < HUF_TABLE; r += 1u << l) single[r] = (uint16_t)(s | l << 8);
    }
    for (unsigned i = 0; i < HUF_TABLE; i++) {
        uint64_t e = 0;
        unsigned used = 0, m = 0;
        while (m < 4) { /* the next symbol, if its whole code lies within the 11 bits */
            uint16_t d = single[(i >> used) & (HUF_TABLE - 1)];
            if (used + (d >> 8) > HUF_MAX_BITS) break;
            e |= (uint64_t)(d & 255) << (8 * m++);
            used += d >> 8;
        }
        tab[i] = e | (uint64_t)m << 32 | (uint64_t)used << 40;
    }
}

/* How many decode rounds one stream can take without a bounds check: a round
 * refills (reads 8 bytes, consumes at most 7) and takes five lookups (55 bits,
 * writing at most 20 bytes). */
static inline size_t huf_safe_rounds(const uint8_t *p, const uint8_t *end, const uint8_t *o, const uint8_t *oend) {
    size_t in = end - p >= 8 ? (size_t)(end - p - 8) / 7 + 1 : 0;
    size_t out = oend - o >= 20 ? (size_t)(oend - o - 20) / 20 + 1 : 0;
    return in < out ? in : out;
}

/* Memory the caller reads and writes next, fetched into the cache while the
 * decode, which waits on its table lookups rather than on memory, runs: the
 * plane set decoder's raw planes and output. step bytes of each per round. */
typedef struct {
    const uint8_t *read;
    uint8_t *write;
    size_t read_len, write_len, read_at, write_at, read_step, write_step;
} Prefetch;

static inline void prefetch_round(Prefetch *pf) {
    for (size_t b = 0; b < pf->read_step && pf->read_at < pf->read_len; b += 64, pf->read_at += 64)
        __builtin_prefetch(pf->read + pf->read_at, 0, 1);
    for (size_t b = 0; b < pf->write_step && pf->write_at < pf->write_len; b += 64, pf->write_at += 64)
        __builtin_prefetch(pf->write + pf->write_at, 1, 1);
}

/* Decodes exactly n symbols into dst. Returns 0, or -1 when the payload is
 * malformed. Reads only src[0:len) and writes only dst[0:n); pf may be NULL. */
BIT_KERNEL static int huf_decode(const uint8_t *src, size_t len, uint8_t *dst, size_t n, Prefetch *pf) {
    HufCode hc;
    size_t pos;
    if (huf_read_header(src, len, &hc, &pos)) return -1;
    const uint8_t *sizes = src + pos;
    pos += HUF_SIZES;
    const uint8_t *p[HUF_STREAMS], *end[HUF_STREAMS];
    uint8_t *o[HUF_STREAMS], *oend[HUF_STREAMS];
    for (int t = 0; t < HUF_STREAMS; t++) {
        size_t sz = t < HUF_STREAMS - 1 ? load32le(sizes + 4 * t) : len - pos;
        if (sz > len - pos) return -1;
        p[t] = src + pos;
        end[t] = src + pos + sz;
        pos += sz;
        size_t a, b;
        huf_stream_span(n, t, &a, &b);
        o[t] = dst + a;
        oend[t] = dst + b;
    }
    HufEntry tab[HUF_TABLE];
    huf_build_table(&hc, tab);
    uint64_t bb[HUF_STREAMS] = {0};
    unsigned bc[HUF_STREAMS] = {0};
    /* branchless refill to 56-63 bits (F. Giesen, "Reading bits in far too many ways") */
#define REFILL(t) (bb[t] |= load64le(p[t]) << bc[t], p[t] += (63 - bc[t]) >> 3, bc[t] |= 56)
#define STEP(t)                                              \
    do {                                                     \
        uint64_t e_ = tab[bb[t] & (HUF_TABLE - 1)];          \
        store32le(o[t], (uint32_t)e_);                       \
        o[t] += (e_ >> 32) & 7;                              \
        bb[t] >>= e_ >> 40;                                  \
        bc[t] -= (unsigned)(e_ >> 40);                       \
    } while (0)
    /* The bounds are checked once for as many rounds as they allow (huf_safe_rounds). */
    for (;;) {
        size_t rounds = SIZE_MAX;
        for (int t = 0; t < HUF_STREAMS; t++) {
            size_t own = huf_safe_rounds(p[t], end[t], o[t], oend[t]);
            if (own < rounds) rounds = own;
        }
        if (!rounds) break;
        for (size_t r = 0; r < rounds; r++) {
            if (pf) prefetch_round(pf);
            REFILL(0); REFILL(1); REFILL(2); REFILL(3);
            STEP(0); STEP(1); STEP(2); STEP(3);
            STEP(0); STEP(1); STEP(2); STEP(3);
            STEP(0); STEP(1); STEP(2); STEP(3);
            STEP(0); STEP(1); STEP(2); STEP(3);
            STEP(0); STEP(1); STEP(2); STEP(3);
        }
    }
    /* Streams whose symbols cost fewer bits end first; the others go on alone. */
    for (int t = 0; t < HUF_STREAMS; t++) {
        for (;;) {
            size_t rounds = huf_safe_rounds(p[t], end[t], o[t], oend[t]);
            if (!rounds) break;
            for (size_t r = 0; r < rounds; r++) {
                REFILL(t);
                STEP(t); STEP(t); STEP(t); STEP(t); STEP(t);
            }
        }
    }
#undef REFILL
#undef STEP
    /* The rest one symbol at a time. Bytes past a stream's end read as zero; a
     * stream whose symbols needed them is malformed. */
    for (int t = 0; t < HUF_STREAMS; t++) {
        size_t left = (size_t)(end[t] - p[t]), past = 0;
        while (o[t] < oend[t]) {
            for (; bc[t] <= 56; bc[t] += 8) {
                uint64_t byte = 0;
                if (left) byte = *p[t]++, left--;
                else past++;
                bb[t] |= byte << bc[t];
            }
            uint8_t s = (uint8_t)tab[bb[t] & (HUF_TABLE - 1)];
            *o[t]++ = s;
            bb[t] >>= hc.len[s];
            bc[t] -= hc.len[s];
        }
        if (8 * past > bc[t]) return -1;
    }
    return 0;
}

/* The encoder's pair table, one per thread for the thread's life (freed with the
 * thread): 256 KiB allocated per call would be fresh pages, a fault for every row
 * of it the plane's values touch. */
static _Thread_local uint32_t huf_pairs[65536];

PyDoc_STRVAR(huff_size_doc,
             "huff_size(src) -> int\n\n"
             "The size of huff_encode(src)'s payload, or 0 where it would return None.");

static PyObject *huff_size(PyObject *self, PyObject *args) {
    Py_buffer src;
    if (!PyArg_ParseTuple(args, "y*", &src)) return NULL;
    HufCode hc;
    size_t sizes[HUF_STREAMS], total;
    Py_BEGIN_ALLOW_THREADS
    if (huf_plan_sampled(src.buf, (size_t)src.len, &hc, sizes) == 0) {
        uint64_t part[HUF_STREAMS][256], cnt[256];
        huf_stream_counts(src.buf, (size_t)src.len, part, cnt);
        total = huf_sized(&hc, part, sizes);
    } else {
        total = huf_plan(src.buf, (size_t)src.len, &hc, sizes, 0);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    return PyLong_FromSize_t(total);
}

PyDoc_STRVAR(huff_encode_doc,
             "huff_encode(src) -> bytes | None\n\n"
             "src's bytes as a Huffman plane payload (FORMAT.md), or None when fewer than\n"
             "two byte values occur in src.");

/* A Huffman payload's largest size for a plane of n symbols: a header with every
 * value, and HUF_MAX_BITS bits a symbol. */
#define HUF_BOUND(n) (HUF_BITMAP + 128 + HUF_SIZES + ((n)*HUF_MAX_BITS + 7) / 8 + HUF_STREAMS)
/* The longest plane whose payload sizes fit the 32-bit fields that record them. */
#define HUF_MAX_PLANE (((size_t)UINT32_MAX - HUF_BITMAP - 128 - HUF_SIZES - HUF_STREAMS) / HUF_MAX_BITS * 8)

static int check_plane_size(size_t n) {
    if (n <= HUF_MAX_PLANE) return 0;
    PyErr_Format(PyExc_ValueError, "a plane of %zu bytes is longer than a payload records", n);
    return -1;
}

/* Codes plane src (n bytes) at dst, which has HUF_BOUND(n) bytes: whatever src
 * holds, even if another thread changes it meanwhile, no stream then runs past
 * them. A sampled code's streams are written at their largest sizes' offsets, then
 * moved end to end; a whole-histogram code's sizes are exact. Returns the
 * payload's size, or 0 where fewer than two values occur. */
static size_t huf_encode_into(const uint8_t *src, size_t n, uint8_t *dst) {
    HufCode hc;
    size_t cap[HUF_STREAMS], sizes[HUF_STREAMS];
    if (huf_plan_sampled(src, n, &hc, cap) == 0) {
        huf_write(&hc, cap, src, n, dst, huf_pairs, sizes);
        return huf_compact(&hc, cap, sizes, dst);
    }
    size_t total = huf_plan(src, n, &hc, cap, 1);
    if (total) huf_write(&hc, cap, src, n, dst, huf_pairs, sizes);
    return total;
}

static PyObject *huff_encode(PyObject *self, PyObject *args) {
    Py_buffer src;
    if (!PyArg_ParseTuple(args, "y*", &src)) return NULL;
    size_t n = (size_t)src.len, used;
    if (check_plane_size(n) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    /* Planned and written in one stretch without the GIL, into room for any plane
     * of n bytes; the bytes object then shrinks to fit (realloc, no copy). */
    PyObject *result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)HUF_BOUND(n));
    if (result != NULL) {
        uint8_t *dst = (uint8_t *)PyBytes_AS_STRING(result);
        Py_BEGIN_ALLOW_THREADS
        used = huf_encode_into(src.buf, n, dst);
        Py_END_ALLOW_THREADS
        if (!used) Py_SETREF(result, Py_NewRef(Py_None));
        else if (_PyBytes_Resize(&result, (Py_ssize_t)used) < 0) result = NULL;
    }
    PyBuffer_Release(&src);
    return result;
}

PyDoc_STRVAR(plane_payload_doc,
             "plane_payload(src, width, sign_swap, raw_planes, scratch) -> bytes | None\n\n"
             "The bytegroup payload (FORMAT.md) of src whose planes below raw_planes are\n"
             "stored raw and the others Huffman-coded: the bytes planes.encode_planes\n"
             "writes for those verdicts, without its copies (the raw planes are split\n"
             "straight into the payload). scratch: width - raw_planes planes' bytes.\n"
             "None where a Huffman plane would not shrink (the caller then codes it).");

static PyObject *plane_payload(PyObject *self, PyObject *args) {
    Py_buffer src, scratch;
    Py_ssize_t width, raw_planes;
    int swap;
    if (!PyArg_ParseTuple(args, "y*npnw*", &src, &width, &swap, &raw_planes, &scratch)) return NULL;
    PyObject *result = NULL;
    if (check_width(width) < 0) goto done;
    size_t w = (size_t)width, n = (size_t)src.len / w, tail = (size_t)src.len - n * w;
    if (raw_planes < 0 || raw_planes >= width) {
        PyErr_Format(PyExc_ValueError, "raw_planes %zd outside [0, %zd)", raw_planes, width);
        goto done;
    }
    if (check_plane_size(n) < 0) goto done;
    size_t raw = (size_t)raw_planes, coded = w - raw, head = 2 + 5 * w;
    if ((size_t)scratch.len < coded * n) {
        PyErr_Format(PyExc_ValueError, "scratch is %zd bytes, expected %zu", scratch.len, coded * n);
        goto done;
    }
    size_t bound = head + raw * n + coded * HUF_BOUND(n) + tail;
    result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)bound);
    if (result == NULL) goto done;
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(result);
    const uint8_t *in = src.buf;
    size_t used = 0;
    Py_BEGIN_ALLOW_THREADS
    uint8_t *planes[8];
    for (size_t k = 0; k < w; k++)
        planes[k] = k < raw ? out + head + k * n : (uint8_t *)scratch.buf + (k - raw) * n;
    split_into(in, w, planes, n, swap);
    out[0] = (uint8_t)w;
    out[1] = swap ? 1 : 0;
    size_t at = head + raw * n;
    for (size_t k = 0; k < w; k++) {
        size_t size = n;
        if (k >= raw && ((size = huf_encode_into(planes[k], n, out + at)) == 0 || size >= n)) break;
        if (k >= raw) at += size;
        out[2 + 5 * k] = k < raw ? 0 : 2;
        store32le(out + 3 + 5 * k, (uint32_t)size);
        if (k == w - 1) used = at;
    }
    if (used) {
        memcpy(out + used, in + n * w, tail);
        used += tail;
    }
    Py_END_ALLOW_THREADS
    if (!used) Py_SETREF(result, Py_NewRef(Py_None));
    else if (_PyBytes_Resize(&result, (Py_ssize_t)used) < 0) result = NULL;
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&scratch);
    return result;
}

PyDoc_STRVAR(plane_decode_doc,
             "plane_decode(payload, dst, scratch) -> bool\n\n"
             "Decode a bytegroup payload (FORMAT.md) of raw and Huffman planes into dst\n"
             "(exactly its raw size) in one call: planes.decode_planes_into without the\n"
             "Python around each plane. scratch: at least len(dst) bytes for the decoded\n"
             "Huffman planes. False, with dst untouched, where a plane is zstd-coded (the\n"
             "caller decodes those); ValueError where the payload is malformed.");

static PyObject *plane_decode(PyObject *self, PyObject *args) {
    Py_buffer src, dst, scratch;
    if (!PyArg_ParseTuple(args, "y*w*w*", &src, &dst, &scratch)) return NULL;
    PyObject *result = NULL;
    const char *bad = NULL;
    const uint8_t *in = src.buf;
    size_t len = (size_t)src.len, raw_size = (size_t)dst.len;
    if (len < 2) {
        bad = "bytegroup payload truncated";
        goto done;
    }
    size_t width = in[0], flags = in[1];
    if ((width != 2 && width != 4 && width != 8) || (flags & ~(size_t)1)) {
        PyErr_Format(PyExc_ValueError, "bytegroup header invalid (width %zu, flags %zu)", width, flags);
        goto done;
    }
    size_t n = raw_size / width, pos = 2 + 5 * width, coded = 0;
    if (len < pos) {
        bad = "bytegroup plane table truncated";
        goto done;
    }
    /* The whole table first: a zstd plane anywhere hands the payload back untouched.
     * The decode uses these checked copies, never the payload's table again (another
     * thread may change a bytearray while the GIL is released). */
    uint8_t codecs[8];
    size_t sizes[8];
    for (size_t k = 0, at = pos; k < width; k++) {
        uint8_t codec = codecs[k] = in[2 + 5 * k];
        size_t size = sizes[k] = load32le(in + 3 + 5 * k);
        if (codec == 1 || (codec == 2 && (size_t)scratch.len < (coded + 1) * n)) {
            result = Py_NewRef(Py_False);
            goto done;
        }
        if (size > len - at) {
            bad = "bytegroup plane truncated";
            goto done;
        }
        if (codec == 0 && size != n) {
            PyErr_Format(PyExc_ValueError, "raw plane is %zu bytes, expected %zu", size, n);
            goto done;
        }
        if (codec > 2) {
            PyErr_Format(PyExc_ValueError, "unknown plane codec %d", (int)codec);
            goto done;
        }
        coded += codec == 2;
        at += size;
        if (k == width - 1 && len - at != raw_size - n * width) {
            PyErr_Format(PyExc_ValueError, "bytegroup tail is %zu bytes, expected %zu", len - at, raw_size - n * width);
            goto done;
        }
    }
    const uint8_t *planes[8];
    uint8_t *out = dst.buf, *spare = scratch.buf;
    int rc = 0, swap = (int)(flags & 1);
    /* The join reads the raw planes (end to end in the payload when they come first)
     * and writes the output: fetched during the Huffman decodes (about 64 symbols a
     * round), at most a line to read and two to write a round. On MiniLM's weights
     * (warm output, alternating rounds) that took bf16's decode from 13.9 to 13.2 ms
     * and fp32's from 24.9 to 24.1; fetching all of fp32's three raw planes and its
     * output (seven lines a round) made it 28.9. */
    size_t raw_first = 0, rounds = n / 64 * coded + 1;
    while (raw_first < width && codecs[raw_first] == 0) raw_first++;
    Prefetch pf = {in + pos, out, raw_first * n, raw_size, 0, 0, 0, 0};
    pf.read_step = (pf.read_len / rounds + 63) & ~(size_t)63;
    pf.write_step = (pf.write_len / rounds + 63) & ~(size_t)63;
    pf.read_step = pf.read_step < 64 ? pf.read_step : 64;
    pf.write_step = pf.write_step < 128 ? pf.write_step : 128;
    Py_BEGIN_ALLOW_THREADS
    for (size_t k = 0; k < width && !rc; k++) {
        if (codecs[k] == 0) {
            planes[k] = in + pos;
        } else {
            rc = huf_decode(in + pos, sizes[k], spare, n, &pf);
            planes[k] = spare;
            spare += n;
        }
        pos += sizes[k];
    }
    if (!rc) {
        if (width == 2) join2(planes[0], planes[1], out, n, swap);
        else if (width == 4) join4(planes[0], planes[1], planes[2], planes[3], out, n, swap);
        else join8(planes, out, n, swap);
        memcpy(out + n * width, in + pos, raw_size - n * width);
    }
    Py_END_ALLOW_THREADS
    if (rc) bad = "malformed Huffman plane";
    else result = Py_NewRef(Py_True);
done:
    if (bad) PyErr_SetString(PyExc_ValueError, bad);
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&scratch);
    return result;
}

PyDoc_STRVAR(huff_decode_doc,
             "huff_decode(src, dst)\n\n"
             "Decode the Huffman plane payload src into dst, exactly len(dst) symbols.\n"
             "Raises ValueError when src is malformed (dst's content is then undefined).");

static PyObject *huff_decode(PyObject *self, PyObject *args) {
    Py_buffer src, dst;
    if (!PyArg_ParseTuple(args, "y*w*", &src, &dst)) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = huf_decode(src.buf, (size_t)src.len, dst.buf, (size_t)dst.len, NULL);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    if (rc) {
        PyErr_SetString(PyExc_ValueError, "malformed Huffman plane");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"distinct_bytes", distinct_bytes, METH_VARARGS, distinct_bytes_doc},
    {"plane_payload", plane_payload, METH_VARARGS, plane_payload_doc},
    {"plane_decode", plane_decode, METH_VARARGS, plane_decode_doc},
    {"huff_decode", huff_decode, METH_VARARGS, huff_decode_doc},
    {"huff_encode", huff_encode, METH_VARARGS, huff_encode_doc},
    {"huff_size", huff_size, METH_VARARGS, huff_size_doc},
    {"join_planes_add", join_planes_add, METH_VARARGS, join_planes_add_doc},
    {"scaled_base", scaled_base, METH_VARARGS, scaled_base_doc},
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
