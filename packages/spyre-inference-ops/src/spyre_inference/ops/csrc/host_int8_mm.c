#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

/* INT8 x INT8 -> INT32 product of the cpu target, weights [in, out].
 *
 *   y[M, N] (int32) = x[M, K] (int8) @ w[K, N] (int8)
 *
 * Why it exists: INT8 W8A8 checkpoints (issue 25) keep their weights in 8 bits,
 * transposed at load as every Spyre linear weight. Two regimes:
 *
 * - A few rows (M <= FEW_ROWS_MAX: decode steps of a few sequences) are memory
 *   bound: 8-bit weights should read half the bytes of 16-bit ones, but
 *   torch._int_mm (oneDNN) on a plain [K, N] weight ran at one row at ~10 GB/s
 *   on a 2-core Zen 4 (89 us per SmolLM2 product, 10.7 ms per decode step
 *   against 6.5 ms for the 16-bit host GEMM reading twice the bytes). This path
 *   streams the weight of record at the memory's pace.
 * - More rows (prefill chunks, large decode batches) are compute bound. Where
 *   the CPU has AVX-512 VNNI, torch._int_mm's oneDNN path serves them (the
 *   caller decides, spyre_inference.ops.host_int8). Without it, torch._int_mm
 *   is a scalar loop: 2.5 GOPS on a 2-core AVX2 EPYC at 32 x 576 x 1536, fifty
 *   times slower than a float32 matmul of the same shape, which made a
 *   512-token prefill step of INT8 SmolLM2 take tens of seconds. The
 *   register-blocked path below is for those hosts.
 *
 * Numerics: exact. Products of two int8 values summed in int32 (vpmaddwd adds
 * two int16 products into an int32 lane, which cannot overflow), so the result
 * equals torch._int_mm's bit for bit, whatever the path, the split over
 * threads, the build or the row count (int32 sums are exact while they fit:
 * |sum| <= 128 * 128 * K, within int32 for K < 131072; the caller checks K).
 *
 * Few rows, how: the threads divide k, so each streams a contiguous run of
 * whole rows of w (as the 16-bit kernel's few-rows path does, for the same
 * reason: hardware prefetchers follow long runs). Two rows k, k+1 of a
 * 16-column segment are interleaved byte-wise into (w[k][n], w[k+1][n]) pairs,
 * sign-extended to int16 and multiplied by the broadcast pair (x[m][k],
 * x[m][k+1]) with vpmaddwd; the int32 sums accumulate in y (or a thread's
 * scratch), column blocks sized to stay in L1. Prefetches into L2 (T1), 16 rows
 * ahead.
 *
 * Many rows, how: x is converted once to int16 pairs (one int32 per pair of
 * k). The threads divide the columns into panels of NR vectors; a thread packs
 * a panel's w (KB rows at a time) into the same pairs, then runs every
 * MR-row tile of x over it with MR x NR accumulators held in registers, so a
 * packed weight vector serves MR rows and a broadcast x pair NR vectors.
 *
 * Two builds: AVX2 (8 columns per vector) and AVX-512 BW (16). Built at first
 * use by spyre_inference.ops.host_int8 with -O3 -fopenmp. */

#ifndef PFD
#define PFD 16
#endif
#define FEW_ROWS_MAX 4
#define Y_BLOCK_BYTES 16384

#ifdef __AVX512BW__
#define VW 16
typedef __m512i vint;
/* 16 columns of rows k and k+1 as 16 (int16, int16) pairs in column order. */
static inline __attribute__((always_inline)) vint pairs(const int8_t *a, const int8_t *b) {
    __m128i ra = _mm_loadu_si128((const __m128i *)a), rb = _mm_loadu_si128((const __m128i *)b);
    __m256i ab = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi8(ra, rb)),
                                         _mm_unpackhi_epi8(ra, rb), 1);
    return _mm512_cvtepi8_epi16(ab);
}
#define VLOAD(p) _mm512_loadu_si512((const void *)(p))
#define VSTORE(p, v) _mm512_storeu_si512((void *)(p), v)
#define VADD _mm512_add_epi32
#define VMADD _mm512_madd_epi16
#define VSET1 _mm512_set1_epi32
#define ISA_BITS 512
#else
#define VW 8
typedef __m256i vint;
static inline __attribute__((always_inline)) vint pairs(const int8_t *a, const int8_t *b) {
    __m128i ra = _mm_loadl_epi64((const __m128i *)a), rb = _mm_loadl_epi64((const __m128i *)b);
    return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(ra, rb));
}
#define VLOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define VSTORE(p, v) _mm256_storeu_si256((__m256i *)(p), v)
#define VADD _mm256_add_epi32
#define VMADD _mm256_madd_epi16
#define VSET1 _mm256_set1_epi32
#define ISA_BITS 256
#endif

/* Vector width in bits of this build (256: AVX2, 512: AVX-512). */
int spyre_int8_mm_isa(void) { return ISA_BITS; }

static inline int32_t pair_of(int8_t lo, int8_t hi) {
    return (int32_t)(((uint32_t)(uint16_t)(int16_t)hi << 16) | (uint16_t)(int16_t)lo);
}

/* y[m][n0:n1] += x[m][k0:k1] @ w[k0:k1][n0:n1] for the M (1-4) rows. */
static inline __attribute__((always_inline)) void block(
    const int8_t *x, const int M, long ldx, const int8_t *w, long ldw, long k0, long k1,
    int32_t *y, long ldy, long n0, long n1)
{
    long nv = (n1 - n0) / VW, ns = n0 + nv * VW;
    long k = k0;
    /* Four rows of w per pass over y: two vpmaddwd per vector before y is
     * loaded and stored once. */
    for (; k + 4 <= k1; k += 4) {
        const int8_t *w0 = w + k * ldw, *w1 = w0 + ldw, *w2 = w1 + ldw, *w3 = w2 + ldw;
        vint xa[FEW_ROWS_MAX], xb[FEW_ROWS_MAX];
        for (int m = 0; m < M; m++) {
            const int8_t *xm = x + m * ldx + k;
            xa[m] = VSET1(pair_of(xm[0], xm[1]));
            xb[m] = VSET1(pair_of(xm[2], xm[3]));
        }
        for (long j = 0; j < nv; j++) {
            long n = n0 + VW * j;
            if ((j & (64 / VW - 1)) == 0 && k + PFD + 4 <= k1) {
                _mm_prefetch((const char *)(w0 + PFD * ldw + n), _MM_HINT_T1);
                _mm_prefetch((const char *)(w1 + PFD * ldw + n), _MM_HINT_T1);
                _mm_prefetch((const char *)(w2 + PFD * ldw + n), _MM_HINT_T1);
                _mm_prefetch((const char *)(w3 + PFD * ldw + n), _MM_HINT_T1);
            }
            vint p = pairs(w0 + n, w1 + n), q = pairs(w2 + n, w3 + n);
            for (int m = 0; m < M; m++) {
                int32_t *ym = y + m * ldy + n;
                VSTORE(ym, VADD(VLOAD(ym), VADD(VMADD(p, xa[m]), VMADD(q, xb[m]))));
            }
        }
        for (int m = 0; m < M; m++) {
            const int8_t *xm = x + m * ldx + k;
            for (long n = ns; n < n1; n++)
                y[m * ldy + n] += (int32_t)xm[0] * w0[n] + (int32_t)xm[1] * w1[n]
                                + (int32_t)xm[2] * w2[n] + (int32_t)xm[3] * w3[n];
        }
    }
    for (; k + 2 <= k1; k += 2) {
        const int8_t *w0 = w + k * ldw, *w1 = w0 + ldw;
        vint xp[FEW_ROWS_MAX];
        for (int m = 0; m < M; m++) xp[m] = VSET1(pair_of(x[m * ldx + k], x[m * ldx + k + 1]));
        for (long j = 0; j < nv; j++) {
            long n = n0 + VW * j;
            if ((j & (64 / VW - 1)) == 0 && k + PFD + 2 <= k1) {
                _mm_prefetch((const char *)(w0 + PFD * ldw + n), _MM_HINT_T1);
                _mm_prefetch((const char *)(w1 + PFD * ldw + n), _MM_HINT_T1);
            }
            vint p = pairs(w0 + n, w1 + n);
            for (int m = 0; m < M; m++) {
                int32_t *ym = y + m * ldy + n;
                VSTORE(ym, VADD(VLOAD(ym), VMADD(p, xp[m])));
            }
        }
        for (int m = 0; m < M; m++) {
            const int8_t *xm = x + m * ldx + k;
            for (long n = ns; n < n1; n++)
                y[m * ldy + n] += (int32_t)xm[0] * w0[n] + (int32_t)xm[1] * w1[n];
        }
    }
    for (; k < k1; k++)
        for (int m = 0; m < M; m++)
            for (long n = n0; n < n1; n++) y[m * ldy + n] += (int32_t)x[m * ldx + k] * w[k * ldw + n];
}

static void rows_range(const int8_t *x, long M, long ldx, const int8_t *w, long N, long ldw,
                       long k0, long k1, int32_t *y, long ldy) {
    for (long m = 0; m < M; m++) memset(y + m * ldy, 0, N * sizeof(int32_t));
    long bc = (Y_BLOCK_BYTES / (long)sizeof(int32_t) / M) & ~63L;
    if (bc < 64) bc = 64;
    for (long b0 = 0; b0 < N; b0 += bc) {
        long b1 = b0 + bc < N ? b0 + bc : N;
        switch (M) {
        case 1: block(x, 1, ldx, w, ldw, k0, k1, y, ldy, b0, b1); break;
        case 2: block(x, 2, ldx, w, ldw, k0, k1, y, ldy, b0, b1); break;
        case 3: block(x, 3, ldx, w, ldw, k0, k1, y, ldy, b0, b1); break;
        default: block(x, 4, ldx, w, ldw, k0, k1, y, ldy, b0, b1); break;
        }
    }
}

/* ---- Many rows -------------------------------------------------------- */

/* Rows per tile: MR x NR accumulators, NR packed weight vectors and one
 * broadcast fit the register file (AVX2: 12 + 2 + 1 of 16 ymm; AVX-512:
 * 16 + 2 + 1 of 32 zmm). */
#ifdef __AVX512BW__
#define MR 8
#else
#define MR 6
#endif
#define NR 2
#define NB (NR * VW)
/* Pairs of k per packed panel: AVX2 512 x 16 columns x 4 bytes = 32 KiB,
 * AVX-512 64 KiB, beside the tile's x rows in L2. */
#define KP 512

/* y[0:mr][0:nr*VW] (+)= xp[0:mr][0:np] @ panel[0:np][0:nr*VW] in int16 pairs. */
static inline __attribute__((always_inline)) void tile(
    const int32_t *xp, long ldxp, const int32_t *panel, long np, const int mr, const int nr,
    int32_t *y, long ldy, int accumulate)
{
    vint acc[MR][NR];
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < nr; j++)
            acc[m][j] = accumulate ? VLOAD(y + m * ldy + j * VW) : VSET1(0);
    for (long p = 0; p < np; p++) {
        vint wv[NR];
        for (int j = 0; j < nr; j++) wv[j] = VLOAD(panel + p * NB + j * VW);
        for (int m = 0; m < mr; m++) {
            vint xb = VSET1(xp[m * ldxp + p]);
            for (int j = 0; j < nr; j++) acc[m][j] = VADD(acc[m][j], VMADD(wv[j], xb));
        }
    }
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < nr; j++) VSTORE(y + m * ldy + j * VW, acc[m][j]);
}

#define TILE_CASE(R)                                                                \
    case R:                                                                         \
        if (nr == NR) tile(xp, ldxp, panel, np, R, NR, y, ldy, accumulate);        \
        else tile(xp, ldxp, panel, np, R, 1, y, ldy, accumulate);                  \
        break;

/* The tile for mr (1..MR) rows and nr (1 or NR) vectors, as constants. */
static void tile_any(const int32_t *xp, long ldxp, const int32_t *panel, long np, int mr, int nr,
                     int32_t *y, long ldy, int accumulate)
{
    switch (mr) {
    TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) TILE_CASE(6)
#if MR > 6
    TILE_CASE(7) TILE_CASE(8)
#endif
    default: break;
    }
}

/* Pairs p0..p1 of k of columns n0..n0+nv*VW of w, as int16 pairs, into panel
 * (NB int32 per pair; an odd K's last pair has a zero high half). */
static void pack_panel(const int8_t *w, long K, long ldw, long p0, long p1, long n0, int nv,
                       int32_t *panel)
{
    static const int8_t zeros[64] = {0};
    for (long p = p0; p < p1; p++) {
        const int8_t *a = w + 2 * p * ldw + n0;
        for (int j = 0; j < nv; j++) {
            const int8_t *b = 2 * p + 1 < K ? a + ldw + j * VW : zeros;
            VSTORE(panel + (p - p0) * NB + j * VW, pairs(a + j * VW, b));
        }
    }
}

static void many_rows(const int8_t *x, long M, long K, long ldx, const int8_t *w, long N,
                      long ldw, int32_t *y, long ldy, int nthreads, int32_t *xp, int32_t *panels)
{
    const long P = (K + 1) / 2, npanel = N / NB;
    const long nvec = N / VW, ntail = N - nvec * VW;
    /* Units of work: full panels, then one single-vector panel if a vector is
     * left over; the scalar columns after the last vector go to the last thread. */
    const long units = npanel + (nvec - npanel * NR > 0 ? 1 : 0);
    int nt = nthreads;
    if (nt > units) nt = units > 0 ? (int)units : 1;
    #pragma omp parallel num_threads(nt)
    {
        int t = omp_get_thread_num(), g = omp_get_num_threads();
        for (long m = t; m < M; m += g) {
            const int8_t *xm = x + m * ldx;
            int32_t *out = xp + m * P;
            for (long p = 0; p < K / 2; p++) out[p] = pair_of(xm[2 * p], xm[2 * p + 1]);
            if (K & 1) out[P - 1] = pair_of(xm[K - 1], 0);
        }
        #pragma omp barrier
        int32_t *panel = panels + (long)t * KP * NB;
        long u0 = units * t / g, u1 = units * (t + 1) / g;
        for (long u = u0; u < u1; u++) {
            const long n0 = u * NB;
            const int nr = u < npanel ? NR : 1;
            for (long p0 = 0; p0 < P; p0 += KP) {
                const long p1 = p0 + KP < P ? p0 + KP : P;
                pack_panel(w, K, ldw, p0, p1, n0, nr, panel);
                for (long m0 = 0; m0 < M; m0 += MR) {
                    const int mr = M - m0 < MR ? (int)(M - m0) : MR;
                    tile_any(xp + m0 * P + p0, P, panel, p1 - p0, mr, nr, y + m0 * ldy + n0, ldy,
                             p0 > 0);
                }
            }
        }
        if (t == g - 1 && ntail > 0) {
            const long n0 = nvec * VW;
            for (long m = 0; m < M; m++) {
                int32_t *ym = y + m * ldy;
                for (long n = n0; n < N; n++) ym[n] = 0;
                for (long k = 0; k < K; k++) {
                    const int32_t xv = x[m * ldx + k];
                    const int8_t *wk = w + k * ldw;
                    for (long n = n0; n < N; n++) ym[n] += xv * wk[n];
                }
            }
        }
    }
}

/* ---- Entry point -------------------------------------------------------- */

/* Returns 0; 1 when M is out of range or the scratch cannot be allocated (y is
 * then incomplete and the caller must raise). */
int spyre_int8_mm(const int8_t *x, long M, long K, long ldx, const int8_t *w, long N, long ldw,
                  int32_t *y, long ldy, int nthreads) {
    if (M < 1) return 1;
    if (nthreads < 1) nthreads = 1;
    if (M > FEW_ROWS_MAX) {
        int32_t *xp = aligned_alloc(64, ((M * ((K + 1) / 2) * sizeof(int32_t)) + 63) / 64 * 64);
        int32_t *panels = aligned_alloc(64, (long)nthreads * KP * NB * sizeof(int32_t));
        if (!xp || !panels) {
            free(xp);
            free(panels);
            return 1;
        }
        many_rows(x, M, K, ldx, w, N, ldw, y, ldy, nthreads, xp, panels);
        free(xp);
        free(panels);
        return 0;
    }
    /* At least 64 rows of w per thread: below that a thread's share is not worth
     * its start-up and the reduction. */
    long max_threads = K / 64 > 0 ? K / 64 : 1;
    int nt = nthreads < max_threads ? nthreads : (int)max_threads;
    if (nt == 1) {
        rows_range(x, M, ldx, w, N, ldw, 0, K, y, ldy);
        return 0;
    }
    int32_t *scratch = aligned_alloc(64, (((nt - 1) * M * N * sizeof(int32_t)) + 63) / 64 * 64);
    if (!scratch) return 1;
    #pragma omp parallel num_threads(nt)
    {
        int t = omp_get_thread_num(), g = omp_get_num_threads();
        /* Whole groups of four rows per thread, so only the last has a tail. */
        long k0 = (K * t / g) & ~3L, k1 = t == g - 1 ? K : (K * (t + 1) / g) & ~3L;
        if (t == 0) rows_range(x, M, ldx, w, N, ldw, k0, k1, y, ldy);
        else rows_range(x, M, ldx, w, N, ldw, k0, k1, scratch + (t - 1) * M * N, N);
        #pragma omp barrier
        long per = (N + g - 1) / g, n0 = per * t, n1 = n0 + per < N ? n0 + per : N;
        for (int s = 1; s < g; s++)
            for (long m = 0; m < M; m++)
                for (long n = n0; n < n1; n++)
                    y[m * ldy + n] += scratch[((s - 1) * M + m) * N + n];
    }
    free(scratch);
    return 0;
}
