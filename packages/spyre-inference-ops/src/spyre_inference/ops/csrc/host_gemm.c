#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

/* Host GEMM of the cpu target for 16-bit weights stored [in, out].
 *
 *   y[M, N] (float32) = x[M, K] (float32) @ w[K, N] (bfloat16 or float16)
 *
 * Why it exists: the spec stores every linear weight transposed at load,
 * [in, out] (what the card's matmul wants), and on CPUs without AVX-512 BF16 or
 * AMX PyTorch has no fast 16-bit GEMM for that layout (ATen's scalar fallback
 * is 10-500x slower than MKL's float32 GEMM). Keeping float32 copies of the
 * weights works but reads twice the bytes per decode step and doubles the
 * weights' memory. This kernel reads the 16-bit weight of record directly,
 * widens it in registers (exact: every bfloat16/float16 value is a float32)
 * and accumulates in float32 with AVX2 FMA.
 *
 * Numerics: every output element is y = p0 + p1, where p0 and p1 are fused
 * multiply-add chains starting from +0 over the two halves of k that
 * k_split(K) fixes (one chain over all of k when K < 64), in every path below.
 * The split depends on K alone, so the result of a row does not depend on M,
 * the tiling or the thread count: a sequence gets the same bits whether it
 * runs alone or in a batch.
 *
 * Paths: up to FEW_ROWS_MAX rows (decode) are memory bound, the goal is the
 * bandwidth: the threads divide the two halves of k, so each streams a
 * contiguous run of whole rows of w (measured on a 2-core Zen 1 with the
 * weights of a 30-layer model cycled through DRAM: 23-35 ms per model pass
 * with each thread reading a column segment of every row, 21-24 ms with
 * contiguous rows), accumulating four rows of w at a time into y or a scratch
 * row, then add the halves. More rows (prefill, large batches) widen a
 * 16-column block of w into a float32 panel once and run a 6x16 register tile
 * over all rows, summing both halves in one pass per tile (compute bound);
 * those threads split columns.
 *
 * Two builds of this file: AVX2 (-mavx2 -mfma -mf16c) and, on CPUs with
 * AVX-512 (F, BW, VL), an AVX-512 build in which both paths use 16-wide
 * vectors and the many-rows tile is 12x32. The arithmetic per output element
 * is the same in both (the same FMA chains in the same k order), so the two
 * builds give bit-identical results and a machine's choice never changes a
 * token. spyre_gemm_isa() says which build is loaded.
 *
 * Built at first use by spyre_inference.ops.host_gemm with -O3 -fopenmp;
 * OpenMP resolves to the libgomp torch already loaded (same soname), so there
 * is one thread pool. */

static inline __attribute__((always_inline)) __m256 ld16(const uint16_t *p, int f16) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (f16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline float sc16(uint16_t v, int f16) {
    if (f16) return _cvtsh_ss(v);
    union { uint32_t u; float f; } c; c.u = ((uint32_t)v) << 16; return c.f;
}

/* Software prefetch distance in rows of w for the few-rows path, and the
 * cache level: each thread streams many short row segments, which the
 * hardware prefetchers of the CPU this was first measured on (Zen 1) do not
 * follow well; 8 rows ahead took a [1, 1536] x [1536, 576] product from 6.8 to
 * 12 GB/s. Into L2 (T1) rather than L1 (T0), 16 rows ahead: prefetches into
 * L1 hold a thread to L1's few miss buffers. SmolLM2's 120 decode GEMMs at
 * one row, weights cycled through DRAM, 30 us of other work between calls
 * (as in the engine), 2-core Zen 4: 8.5-9.3 -> 6.5-6.8 ms (AVX-512 build);
 * two rows 9.8 -> 6.8 ms; four rows unchanged. Prefetches only: same bits. */
#ifndef PFD
#define PFD 16
#endif
#define PF_HINT _MM_HINT_T1

/* ---- few rows: stream w row segments, accumulate in y (L1) ----
 *
 * Each group of four rows of w is widened once and applied to all M rows of x
 * (the loop over m is innermost), and the columns are cut into blocks whose M
 * rows of y fit in L1 (FEW_Y_BYTES), each block streaming its row segments of
 * w over the whole k range. Measured on a 2-core Zen 4 (SmolLM2's 120 decode
 * GEMMs, weights cycled through DRAM): with m outermost and whole rows of y,
 * 4 rows cost 1.55x one row (each w group widened M times, y spilling to L2);
 * see the analysis of the amd-avx512-bf16 class. The order of the FMAs into
 * each output element is unchanged: k ascending, four at a time. */
#define FEW_Y_BYTES 16384

static inline __attribute__((always_inline)) void few_rows_block(
    const float *x, const int M, long K, long ldx, const uint16_t *w, long ldw,
    float *y, long ldy, long n0, long n1, int f16)
{
    long nv = (n1 - n0) / 8;          /* vector columns in [n0, n1) */
    long ns = n0 + nv * 8;            /* scalar tail start */
    long k = 0;
    for (; k + 4 <= K; k += 4) {
        const uint16_t *w0 = w + k * ldw, *w1 = w0 + ldw, *w2 = w1 + ldw, *w3 = w2 + ldw;
        for (long j = 0; j < nv; j++) {
            long n = n0 + 8 * j;
            if ((j & 3) == 0 && k + PFD + 4 <= K) {
                _mm_prefetch((const char *)(w0 + PFD * ldw + n), PF_HINT);
                _mm_prefetch((const char *)(w1 + PFD * ldw + n), PF_HINT);
                _mm_prefetch((const char *)(w2 + PFD * ldw + n), PF_HINT);
                _mm_prefetch((const char *)(w3 + PFD * ldw + n), PF_HINT);
            }
            __m256 b0 = ld16(w0 + n, f16), b1 = ld16(w1 + n, f16);
            __m256 b2 = ld16(w2 + n, f16), b3 = ld16(w3 + n, f16);
            for (int m = 0; m < M; m++) {
                const float *xm = x + m * ldx + k;
                float *ym = y + m * ldy + n;
                __m256 acc = _mm256_loadu_ps(ym);
                acc = _mm256_fmadd_ps(_mm256_broadcast_ss(xm), b0, acc);
                acc = _mm256_fmadd_ps(_mm256_broadcast_ss(xm + 1), b1, acc);
                acc = _mm256_fmadd_ps(_mm256_broadcast_ss(xm + 2), b2, acc);
                acc = _mm256_fmadd_ps(_mm256_broadcast_ss(xm + 3), b3, acc);
                _mm256_storeu_ps(ym, acc);
            }
        }
        for (int m = 0; m < M; m++) {
            const float *xm = x + m * ldx + k;
            float *ym = y + m * ldy;
            for (long n = ns; n < n1; n++) {
                float acc = ym[n];
                acc = __builtin_fmaf(xm[0], sc16(w0[n], f16), acc);
                acc = __builtin_fmaf(xm[1], sc16(w1[n], f16), acc);
                acc = __builtin_fmaf(xm[2], sc16(w2[n], f16), acc);
                acc = __builtin_fmaf(xm[3], sc16(w3[n], f16), acc);
                ym[n] = acc;
            }
        }
    }
    for (; k < K; k++) {
        const uint16_t *w0 = w + k * ldw;
        for (long j = 0; j < nv; j++) {
            long n = n0 + 8 * j;
            __m256 b0 = ld16(w0 + n, f16);
            for (int m = 0; m < M; m++) {
                float *ym = y + m * ldy + n;
                _mm256_storeu_ps(ym, _mm256_fmadd_ps(_mm256_broadcast_ss(x + m * ldx + k), b0,
                                                     _mm256_loadu_ps(ym)));
            }
        }
        for (int m = 0; m < M; m++)
            for (long n = ns; n < n1; n++)
                y[m * ldy + n] = __builtin_fmaf(x[m * ldx + k], sc16(w0[n], f16), y[m * ldy + n]);
    }
}

/* Columns per block for M rows: whole 64-column runs whose M rows of y fit in
 * FEW_Y_BYTES (at least one run). */
static inline long few_block_cols(long M) {
    long c = (FEW_Y_BYTES / (long)sizeof(float) / M) & ~63L;
    return c < 64 ? 64 : c;
}

/* FEW_ROWS_BODY(block): zero y's columns [n0, n1) and run block() over them in
 * L1-sized column blocks, with the row count a compile-time constant (1-4). */
#define FEW_ROWS_BODY(block)                                                        \
    for (long m = 0; m < M; m++) memset(y + m * ldy + n0, 0, (n1 - n0) * sizeof(float)); \
    long bc = few_block_cols(M);                                                    \
    for (long b0 = n0; b0 < n1; b0 += bc) {                                         \
        long b1 = b0 + bc < n1 ? b0 + bc : n1;                                      \
        switch (M) {                                                                \
        case 1: block(x, 1, K, ldx, w, ldw, y, ldy, b0, b1, f16); break;            \
        case 2: block(x, 2, K, ldx, w, ldw, y, ldy, b0, b1, f16); break;            \
        case 3: block(x, 3, K, ldx, w, ldw, y, ldy, b0, b1, f16); break;            \
        default: block(x, 4, K, ldx, w, ldw, y, ldy, b0, b1, f16); break;           \
        }                                                                           \
    }

static inline __attribute__((always_inline)) void few_rows(
    const float *x, long M, long K, long ldx, const uint16_t *w, long ldw,
    float *y, long ldy, long n0, long n1, int f16)
{
    FEW_ROWS_BODY(few_rows_block)
}

/* ---- many rows: pack a 16-column block of w to fp32, 6x16 register tiles ---- */
#define NB 16
#define MRMAX 6
/* MR x 16 tile (MR = 2, 4 or 6, a compile-time constant after inlining);
 * rows past mr repeat the last row (rows are independent) and are not stored.
 * Named accumulators, not an array: with an array GCC keeps them in memory. */
#define ROWPTR(i) const float *x##i = x + (mr > i ? i : mr - 1) * ldx
#define FMA_ROW(i)                                                                  \
    if (MR > i) {                                                                   \
        __m256 a = _mm256_broadcast_ss(x##i + k);                                   \
        c##i##0 = _mm256_fmadd_ps(a, b0, c##i##0);                                  \
        c##i##1 = _mm256_fmadd_ps(a, b1, c##i##1);                                  \
    }
#define STORE_ROW(i)                                                                \
    if (MR > i) {                                                                   \
        _mm256_storeu_ps(tmp[i], c##i##0);                                          \
        _mm256_storeu_ps(tmp[i] + 8, c##i##1);                                      \
    }
#define ADD_ROW(i)                                                                  \
    if (MR > i) {                                                                   \
        c##i##0 = _mm256_add_ps(_mm256_loadu_ps(tmp[i]), c##i##0);                  \
        c##i##1 = _mm256_add_ps(_mm256_loadu_ps(tmp[i] + 8), c##i##1);              \
    }
static inline __attribute__((always_inline)) void micro(
    int MR, int mr, const float *x, long ldx, const float *pw, long K0, long K, float *y, long ldy,
    int ncols)
{
    ROWPTR(0); ROWPTR(1); ROWPTR(2); ROWPTR(3); ROWPTR(4); ROWPTR(5);
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    float tmp[MRMAX][NB];
    for (long k = 0; k < K0; k++) {
        __m256 b0 = _mm256_loadu_ps(pw + k * NB), b1 = _mm256_loadu_ps(pw + k * NB + 8);
        FMA_ROW(0) FMA_ROW(1) FMA_ROW(2) FMA_ROW(3) FMA_ROW(4) FMA_ROW(5)
    }
    if (K0 < K) {
        /* p0 parked in tmp; the same registers then sum p1 from +0. */
        STORE_ROW(0) STORE_ROW(1) STORE_ROW(2) STORE_ROW(3) STORE_ROW(4) STORE_ROW(5)
        c00 = _mm256_setzero_ps(); c01 = c00; c10 = c00; c11 = c00; c20 = c00; c21 = c00;
        c30 = c00; c31 = c00; c40 = c00; c41 = c00; c50 = c00; c51 = c00;
        for (long k = K0; k < K; k++) {
            __m256 b0 = _mm256_loadu_ps(pw + k * NB), b1 = _mm256_loadu_ps(pw + k * NB + 8);
            FMA_ROW(0) FMA_ROW(1) FMA_ROW(2) FMA_ROW(3) FMA_ROW(4) FMA_ROW(5)
        }
        ADD_ROW(0) ADD_ROW(1) ADD_ROW(2) ADD_ROW(3) ADD_ROW(4) ADD_ROW(5)
    }
    STORE_ROW(0) STORE_ROW(1) STORE_ROW(2) STORE_ROW(3) STORE_ROW(4) STORE_ROW(5)
    for (int m = 0; m < mr; m++) memcpy(y + m * ldy, tmp[m], ncols * sizeof(float));
}

/* Rows of the next tile: 6, and the remainder in one tile of the smallest
 * width (2, 4 or 6) that holds it. */
static inline int tile_rows(long left) { return left < 6 ? (int)left : 6; }

static void micro_any(int mr, const float *x, long ldx, const float *pw, long K0, long K, float *y, long ldy, int ncols) {
    if (mr > 4) micro(6, mr, x, ldx, pw, K0, K, y, ldy, ncols);
    else if (mr > 2) micro(4, mr, x, ldx, pw, K0, K, y, ldy, ncols);
    else micro(2, mr, x, ldx, pw, K0, K, y, ldy, ncols);
}

/* The two halves of k every output element is summed over: y = p0 + p1, each
 * p a fused multiply-add chain from +0 over its half in ascending k. Fixed by
 * K alone (never by M or the thread count), so results stay batch- and
 * thread-invariant; it lets the few-rows path give each thread a contiguous
 * run of whole rows of w instead of a short segment of every row. */
static inline long k_split(long K) { return K >= 64 ? (K / 2) & ~3L : K; }

static void pack(const uint16_t *w, long ldw, long K, int ncols, float *pw, int f16) {
    for (long k = 0; k < K; k++) {
        const uint16_t *r = w + k * ldw;
        float *d = pw + k * NB;
        if (ncols == NB) {
            _mm256_storeu_ps(d, ld16(r, f16)); _mm256_storeu_ps(d + 8, ld16(r + 8, f16));
        } else {
            for (int n = 0; n < NB; n++) d[n] = n < ncols ? sc16(r[n], f16) : 0.f;
        }
    }
}

#ifdef __AVX512F__
/* ---- AVX-512 build: the same two paths with 16-wide vectors ---- */
static inline __attribute__((always_inline)) __m512 ld16x16(const uint16_t *p, int f16) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    if (f16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* few_rows with 16-wide vectors: at most one 8-wide vector and a scalar tail
 * after them. Per element: the same chain as few_rows. */
static inline __attribute__((always_inline)) void few_rows_block_512(
    const float *x, const int M, long K, long ldx, const uint16_t *w, long ldw,
    float *y, long ldy, long n0, long n1, int f16)
{
    long nv = (n1 - n0) / 16;
    long n8 = n0 + nv * 16;                        /* 8-wide remainder start */
    long ns = n8 + ((n1 - n8) / 8) * 8;            /* scalar tail start */
    long k = 0;
    for (; k + 4 <= K; k += 4) {
        const uint16_t *w0 = w + k * ldw, *w1 = w0 + ldw, *w2 = w1 + ldw, *w3 = w2 + ldw;
        for (long j = 0; j < nv; j++) {
            long n = n0 + 16 * j;
            if ((j & 1) == 0 && k + PFD + 4 <= K) {
                _mm_prefetch((const char *)(w0 + PFD * ldw + n), PF_HINT);
                _mm_prefetch((const char *)(w1 + PFD * ldw + n), PF_HINT);
                _mm_prefetch((const char *)(w2 + PFD * ldw + n), PF_HINT);
                _mm_prefetch((const char *)(w3 + PFD * ldw + n), PF_HINT);
            }
            __m512 b0 = ld16x16(w0 + n, f16), b1 = ld16x16(w1 + n, f16);
            __m512 b2 = ld16x16(w2 + n, f16), b3 = ld16x16(w3 + n, f16);
            for (int m = 0; m < M; m++) {
                const float *xm = x + m * ldx + k;
                float *ym = y + m * ldy + n;
                __m512 acc = _mm512_loadu_ps(ym);
                acc = _mm512_fmadd_ps(_mm512_set1_ps(xm[0]), b0, acc);
                acc = _mm512_fmadd_ps(_mm512_set1_ps(xm[1]), b1, acc);
                acc = _mm512_fmadd_ps(_mm512_set1_ps(xm[2]), b2, acc);
                acc = _mm512_fmadd_ps(_mm512_set1_ps(xm[3]), b3, acc);
                _mm512_storeu_ps(ym, acc);
            }
        }
        for (int m = 0; m < M; m++) {
            const float *xm = x + m * ldx + k;
            float *ym = y + m * ldy;
            if (ns > n8) {
                __m256 acc = _mm256_loadu_ps(ym + n8);
                acc = _mm256_fmadd_ps(_mm256_broadcast_ss(xm), ld16(w0 + n8, f16), acc);
                acc = _mm256_fmadd_ps(_mm256_broadcast_ss(xm + 1), ld16(w1 + n8, f16), acc);
                acc = _mm256_fmadd_ps(_mm256_broadcast_ss(xm + 2), ld16(w2 + n8, f16), acc);
                acc = _mm256_fmadd_ps(_mm256_broadcast_ss(xm + 3), ld16(w3 + n8, f16), acc);
                _mm256_storeu_ps(ym + n8, acc);
            }
            for (long n = ns; n < n1; n++) {
                float acc = ym[n];
                acc = __builtin_fmaf(xm[0], sc16(w0[n], f16), acc);
                acc = __builtin_fmaf(xm[1], sc16(w1[n], f16), acc);
                acc = __builtin_fmaf(xm[2], sc16(w2[n], f16), acc);
                acc = __builtin_fmaf(xm[3], sc16(w3[n], f16), acc);
                ym[n] = acc;
            }
        }
    }
    for (; k < K; k++) {
        const uint16_t *w0 = w + k * ldw;
        for (long j = 0; j < nv; j++) {
            long n = n0 + 16 * j;
            __m512 b0 = ld16x16(w0 + n, f16);
            for (int m = 0; m < M; m++) {
                float *ym = y + m * ldy + n;
                _mm512_storeu_ps(ym, _mm512_fmadd_ps(_mm512_set1_ps(x[m * ldx + k]), b0,
                                                     _mm512_loadu_ps(ym)));
            }
        }
        for (int m = 0; m < M; m++) {
            const float *xm = x + m * ldx + k;
            float *ym = y + m * ldy;
            if (ns > n8)
                _mm256_storeu_ps(ym + n8, _mm256_fmadd_ps(_mm256_broadcast_ss(xm), ld16(w0 + n8, f16),
                                                          _mm256_loadu_ps(ym + n8)));
            for (long n = ns; n < n1; n++) ym[n] = __builtin_fmaf(xm[0], sc16(w0[n], f16), ym[n]);
        }
    }
}

static inline __attribute__((always_inline)) void few_rows_512(
    const float *x, long M, long K, long ldx, const uint16_t *w, long ldw,
    float *y, long ldy, long n0, long n1, int f16)
{
    FEW_ROWS_BODY(few_rows_block_512)
}

/* Many rows: 32-column panels, MR x 32 register tiles (MR = 2, 4, 8 or 12;
 * 24 accumulators at most, of the 32 zmm registers). */
#define NB5 32
#define MRMAX5 12
#define ROWPTR5(i) const float *x##i = x + (mr > i ? i : mr - 1) * ldx
#define FMA_ROW5(i)                                                                 \
    if (MR > i) {                                                                   \
        __m512 a = _mm512_set1_ps(x##i[k]);                                         \
        c##i##0 = _mm512_fmadd_ps(a, b0, c##i##0);                                  \
        c##i##1 = _mm512_fmadd_ps(a, b1, c##i##1);                                  \
    }
#define STORE_ROW5(i)                                                               \
    if (MR > i) {                                                                   \
        _mm512_storeu_ps(tmp[i], c##i##0);                                          \
        _mm512_storeu_ps(tmp[i] + 16, c##i##1);                                     \
    }
#define ADD_ROW5(i)                                                                 \
    if (MR > i) {                                                                   \
        c##i##0 = _mm512_add_ps(_mm512_loadu_ps(tmp[i]), c##i##0);                  \
        c##i##1 = _mm512_add_ps(_mm512_loadu_ps(tmp[i] + 16), c##i##1);             \
    }
#define ALL5(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define ZERO5(i) __m512 c##i##0 = _mm512_setzero_ps(), c##i##1 = c##i##0;
#define REZERO5(i) c##i##0 = _mm512_setzero_ps(); c##i##1 = c##i##0;
#define ROWPTRS5(i) ROWPTR5(i);
static inline __attribute__((always_inline)) void micro512(
    int MR, int mr, const float *x, long ldx, const float *pw, long K0, long K, float *y, long ldy,
    int ncols)
{
    ALL5(ROWPTRS5)
    ALL5(ZERO5)
    float tmp[MRMAX5][NB5];
    for (long k = 0; k < K0; k++) {
        __m512 b0 = _mm512_loadu_ps(pw + k * NB5), b1 = _mm512_loadu_ps(pw + k * NB5 + 16);
        ALL5(FMA_ROW5)
    }
    if (K0 < K) {
        ALL5(STORE_ROW5)
        ALL5(REZERO5)
        for (long k = K0; k < K; k++) {
            __m512 b0 = _mm512_loadu_ps(pw + k * NB5), b1 = _mm512_loadu_ps(pw + k * NB5 + 16);
            ALL5(FMA_ROW5)
        }
        ALL5(ADD_ROW5)
    }
    ALL5(STORE_ROW5)
    for (int m = 0; m < mr; m++) memcpy(y + m * ldy, tmp[m], ncols * sizeof(float));
}

static inline int tile_rows512(long left) { return left < MRMAX5 ? (int)left : MRMAX5; }

static void micro512_any(int mr, const float *x, long ldx, const float *pw, long K0, long K, float *y, long ldy, int ncols) {
    if (mr > 8) micro512(12, mr, x, ldx, pw, K0, K, y, ldy, ncols);
    else if (mr > 4) micro512(8, mr, x, ldx, pw, K0, K, y, ldy, ncols);
    else if (mr > 2) micro512(4, mr, x, ldx, pw, K0, K, y, ldy, ncols);
    else micro512(2, mr, x, ldx, pw, K0, K, y, ldy, ncols);
}

static void pack512(const uint16_t *w, long ldw, long K, int ncols, float *pw, int f16) {
    for (long k = 0; k < K; k++) {
        const uint16_t *r = w + k * ldw;
        float *d = pw + k * NB5;
        if (ncols == NB5) {
            _mm512_storeu_ps(d, ld16x16(r, f16)); _mm512_storeu_ps(d + 16, ld16x16(r + 16, f16));
        } else {
            for (int n = 0; n < NB5; n++) d[n] = n < ncols ? sc16(r[n], f16) : 0.f;
        }
    }
}
#define FEW_ROWS few_rows_512
#define PANEL_COLS NB5
#define PACK pack512
#define TILE_ROWS tile_rows512
#define MICRO_ANY micro512_any
#define GEMM_ISA 512
#else
#define FEW_ROWS few_rows
#define PANEL_COLS NB
#define PACK pack
#define TILE_ROWS tile_rows
#define MICRO_ANY micro_any
#define GEMM_ISA 256
#endif

/* Vector width in bits of this build (256: AVX2, 512: AVX-512). */
int spyre_gemm_isa(void) { return GEMM_ISA; }

#define FEW_ROWS_MAX 4

/* Part i of g of the columns [0, N), in whole 8-column vectors. */
static inline void col_range(long N, long i, long g, long *n0, long *n1) {
    long nvec = (N + 7) / 8, v0 = nvec * i / g, v1 = nvec * (i + 1) / g;
    *n0 = v0 * 8;
    *n1 = v1 * 8 < N ? v1 * 8 : N;
}

#define FEW(xp, kk, wp, yp, ldyp, a, b)                                              \
    do {                                                                            \
        if (f16) FEW_ROWS(xp, M, kk, ldx, wp, ldw, yp, ldyp, a, b, 1);                \
        else FEW_ROWS(xp, M, kk, ldx, wp, ldw, yp, ldyp, a, b, 0);                    \
    } while (0)

/* Returns 0, or 1 when a thread could not allocate its panel (y is then
 * incomplete and the caller must raise). */
int spyre_gemm_w16(const float *x, long M, long K, long ldx, const uint16_t *w, long N, long ldw,
                   float *y, long ldy, int f16, int nthreads) {
    int failed = 0;
    if (nthreads < 1) nthreads = 1;
    long K0 = k_split(K), K1 = K - K0;
    if (M <= FEW_ROWS_MAX && K1) {
        float *p1 = aligned_alloc(64, ((M * N * sizeof(float)) + 63) / 64 * 64);
        if (!p1) return 1;
        #pragma omp parallel num_threads(nthreads)
        {
            int nt = omp_get_num_threads(), t = omp_get_thread_num();
            long n0, n1;
            if (nt == 1) {
                FEW(x, K0, w, y, ldy, 0, N);
                FEW(x + K0, K1, w + K0 * ldw, p1, N, 0, N);
            } else {
                /* Threads [0, nt0) sum the first half, the others the second. */
                int nt0 = (nt + 1) / 2, h = t >= nt0, g = h ? nt - nt0 : nt0, i = h ? t - nt0 : t;
                col_range(N, i, g, &n0, &n1);
                if (n1 > n0) {
                    if (h) FEW(x + K0, K1, w + K0 * ldw, p1, N, n0, n1);
                    else FEW(x, K0, w, y, ldy, n0, n1);
                }
            }
            #pragma omp barrier
            col_range(N, t, nt, &n0, &n1);
            for (long m = 0; m < M; m++)
                for (long n = n0; n < n1; n++) y[m * ldy + n] = y[m * ldy + n] + p1[m * N + n];
        }
        free(p1);
        return 0;
    }
    if (M <= FEW_ROWS_MAX) {
        /* K < 64: one chain over k; contiguous column chunks per thread. */
        #pragma omp parallel num_threads(nthreads)
        {
            long n0, n1;
            col_range(N, omp_get_thread_num(), omp_get_num_threads(), &n0, &n1);
            if (n1 > n0) FEW(x, K, w, y, ldy, n0, n1);
        }
        return 0;
    }
    long nblocks = (N + PANEL_COLS - 1) / PANEL_COLS;
    #pragma omp parallel num_threads(nthreads)
    {
        float *pw = aligned_alloc(64, ((K * PANEL_COLS * sizeof(float)) + 63) / 64 * 64);
        if (!pw) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (long b = 0; b < nblocks; b++) {
            if (!pw) continue;
            long n0 = b * PANEL_COLS;
            int ncols = (int)(N - n0 < PANEL_COLS ? N - n0 : PANEL_COLS);
            PACK(w + n0, ldw, K, ncols, pw, f16);
            for (long m0 = 0; m0 < M;) {
                int mr = TILE_ROWS(M - m0);
                MICRO_ANY(mr, x + m0 * ldx, ldx, pw, K0, K, y + m0 * ldy + n0, ldy, ncols);
                m0 += mr;
            }
        }
        free(pw);
    }
    return failed;
}
