/* Prefill attention over the token-major paged KV cache, for the cpu target,
 * with AVX-512 BF16 dot products (VDPBF16PS).
 *
 * One call attends one sequence's chunk of L query rows (positions
 * context_len .. context_len + L - 1) over its n = context_len + L keys:
 * causal, optionally a sliding window (a row at p sees keys > p - window) and
 * attention sinks. It replaces PyTorch's CPU flash kernel for bfloat16 caches
 * on CPUs with AVX-512 BF16 but no AMX: that kernel's tile products ran at
 * ~60 GFLOP/s for a 500-token prompt and ~130 for 8000 tokens on a 2-core
 * Zen 4, no faster than in float32, while the CPU's bf16 dot product has
 * twice the float32 FMA rate (benchmarks/sxs/analysis/amd-avx512-bf16.md,
 * "Stop 39").
 *
 * Arithmetic, as PyTorch's flash kernel does it for bfloat16: the products
 * q.k and p.v take bf16 pairs and accumulate in float32; the scores, the
 * online softmax (running maximum, float32 exp) and the output accumulator are
 * float32; the probabilities are rounded to bf16 (nearest-even) for p.v, and
 * the result to bf16 (nearest-even) at the end.
 *
 * How:
 * 1. The sequence's K and V are packed once per call, every KV head, into the
 *    layouts VDPBF16PS reads: K as [group of 16 keys][D/2 pairs][16 keys][2]
 *    (one 64-byte load gives one dimension pair of 16 keys), V as
 *    [pair of keys][D][2] (one load gives 16 dimensions of two keys). Keys
 *    past n are zero.
 * 2. Work items are (KV head, block of query positions); each holds its rows'
 *    running max, sum and float32 output, and walks the keys a block of 64 at
 *    a time, every row tile (4 rows, a row being a (position, query head)
 *    pair of the KV head's group) against that block while it is in L1:
 *    S = Q K^T (4 x 64, 16 accumulators), mask (only on blocks that cross the
 *    diagonal or the window's edge), exp, P to bf16, O = O * alpha + P V.
 *    Blocks wholly above the diagonal or behind the window are skipped.
 * 3. Each row's output is divided by its sum (with the sink's term when
 *    given) and written as bf16.
 *
 * Layout (elements; every last dimension contiguous):
 *   q        row i, head h at q + i*q_row + h*q_head (bf16)
 *   pages    K|V rows of 2*D values; slot (block b, offset o, KV head h) at
 *            b*page_stride + o*slot_stride + h*head_stride (bf16)
 *   block_ids [ceil(n / BS)] int64, the sequence's pages in order
 *   sinks    [H] float32 or NULL
 *   out      row i, head h at out + i*out_row + h*out_head (bf16)
 * Requires D % 16 == 0 and H % KVH == 0 (checked by the caller).
 *
 * Built only with AVX-512 F/BW/VL/DQ + BF16 (-mavx512bf16); OpenMP resolves to
 * the libgomp torch already loaded, so there is one thread pool. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

/* Keys per block: four 16-lane vectors of scores per row. */
#define BK 64
/* Rows per micro-tile: 4 rows x 4 vectors of scores = 16 accumulators, and
 * 4 rows x 4 vectors of output (64 dimensions) = 16 for P V. */
#define TR 4
/* Query rows (position x query head) a work item holds: its float32 output
 * (ROWS x D x 4 bytes) and the key block stay in L1/L2. */
#ifndef ITEM_ROWS
#define ITEM_ROWS 48
#endif

/* exp of 16 floats (Cody-Waite reduction, Cephes' degree-6 polynomial, ~1 ulp,
 * the decode kernel's exp8 at 16 lanes); below -87.3 (masked keys' -inf
 * included) exactly 0. */
static inline __m512 exp16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.3f);
    const __mmask16 keep = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
    x = _mm512_max_ps(x, lo);
    const __m512 n = _mm512_roundscale_ps(
        _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    const __m512i e =
        _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(keep, p, _mm512_castsi512_ps(e));
}

static inline __m512bh bcast_pair(const uint16_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return (__m512bh)_mm512_set1_epi32(v);
}

static inline __m512bh load_bh(const void *p) { return (__m512bh)_mm512_loadu_si512(p); }

/* K and V of keys [16 * grp, 16 * grp + 16) of KV head h into the packed
 * layouts (see the header); keys at or past n are zero. */
static void pack_group(const uint16_t *pages, long page_stride, long slot_stride, long head_stride,
                       long BS, const int64_t *block_ids, long n, long D, long h, long grp,
                       uint32_t *kp, uint16_t *vp) {
    const long half = D / 2;
    for (long jl = 0; jl < 16; jl++) {
        const long j = grp * 16 + jl;
        uint32_t *kcol = kp + jl;
        uint16_t *vpair = vp + ((jl / 2) * D) * 2 + (jl & 1);
        if (j >= n) {
            for (long p = 0; p < half; p++) kcol[p * 16] = 0;
            for (long d = 0; d < D; d++) vpair[d * 2] = 0;
            continue;
        }
        const uint16_t *row =
            pages + block_ids[j / BS] * page_stride + (j % BS) * slot_stride + h * head_stride;
        const uint32_t *k32 = (const uint32_t *)row;
        for (long p = 0; p < half; p++) kcol[p * 16] = k32[p];
        const uint16_t *v = row + D;
        for (long d = 0; d < D; d++) vpair[d * 2] = v[d];
    }
}

/* 0 on success, 1 when the packed copies or a thread's rows cannot be
 * allocated (nothing is written; the caller raises). */
int spyre_paged_prefill(const uint16_t *q, long q_row, long q_head, long L, long H, long D,
                        const uint16_t *pages, long page_stride, long slot_stride,
                        long head_stride, long KVH, long BS, const int64_t *block_ids,
                        long context_len, float scale, long window, const float *sinks,
                        uint16_t *out, long out_row, long out_head, int nthreads) {
    const long n = context_len + L, G = H / KVH, half = D / 2;
    const long nblk = (n + BK - 1) / BK, ngrp = nblk * (BK / 16), npair = nblk * (BK / 2);
    const long kp_head = ngrp * half * 16; /* uint32 per KV head */
    const long vp_head = npair * D * 2;    /* uint16 per KV head */
    uint32_t *kp = aligned_alloc(64, (size_t)(KVH * kp_head) * 4);
    uint16_t *vp = aligned_alloc(64, (size_t)(KVH * vp_head) * 2 + 64);
    if (!kp || !vp) {
        free(kp);
        free(vp);
        return 1;
    }
    const long bq = G >= ITEM_ROWS ? 1 : ITEM_ROWS / G; /* positions per work item */
    const long nqb = (L + bq - 1) / bq, items = nqb * KVH;
    const long rows_max = ((bq * G + TR - 1) / TR) * TR;
    int failed = 0;

#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static) collapse(2)
        for (long h = 0; h < KVH; h++)
            for (long grp = 0; grp < ngrp; grp++)
                pack_group(pages, page_stride, slot_stride, head_stride, BS, block_ids, n, D, h,
                           grp, kp + h * kp_head + grp * half * 16, vp + h * vp_head + grp * 8 * D * 2);
        /* the omp for's barrier: every packed key is written */

        float *o = aligned_alloc(64, (size_t)(rows_max * D) * 4);
        float *lsum = aligned_alloc(64, (size_t)rows_max * 64);
        float *mrow = malloc((size_t)rows_max * 4);
        float *alpha = malloc((size_t)rows_max * 4);
        uint16_t *zero_q = calloc((size_t)D, 2);
        uint16_t pbuf[TR][BK] __attribute__((aligned(64)));
        if (!o || !lsum || !mrow || !alpha || !zero_q) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(dynamic, 1)
            for (long item = 0; item < items; item++) {
                /* the longest (last) query blocks first: the dynamic schedule
                 * then ends with the short ones */
                const long qb = nqb - 1 - item / KVH, h = item % KVH;
                const long r0 = qb * bq, r1 = r0 + bq < L ? r0 + bq : L;
                const long rows = (r1 - r0) * G, rows_pad = ((rows + TR - 1) / TR) * TR;
                const uint32_t *kh = kp + h * kp_head;
                const uint16_t *vh = vp + h * vp_head;
                memset(o, 0, (size_t)(rows_pad * D) * 4);
                memset(lsum, 0, (size_t)rows_pad * 64);
                for (long r = 0; r < rows_pad; r++) mrow[r] = -1e30f;
                long kbeg = 0;
                if (window > 0) {
                    kbeg = context_len + r0 - window + 1;
                    if (kbeg < 0) kbeg = 0;
                }
                const long kend = context_len + r1; /* exclusive */
                for (long kb = (kbeg / BK) * BK; kb < kend; kb += BK) {
                    const uint32_t *kblk = kh + (kb / 16) * half * 16;
                    const uint16_t *vblk = vh + (kb / 2) * D * 2;
                    for (long t = 0; t < rows_pad; t += TR) {
                        /* positions of the tile's rows (a padding row repeats the last) */
                        long pos[TR];
                        const uint16_t *qr[TR];
                        for (int rr = 0; rr < TR; rr++) {
                            const long r = t + rr;
                            const long i = r < rows ? r / G : (rows - 1) / G;
                            pos[rr] = context_len + r0 + i;
                            qr[rr] = r < rows ? q + (r0 + i) * q_row + (h * G + r % G) * q_head
                                              : zero_q;
                        }
                        const long pmin = pos[0], pmax = pos[TR - 1];
                        if (kb > pmax) continue; /* above every row's diagonal */
                        if (window > 0 && kb + BK - 1 <= pmin - window) continue;
                        const int need_mask =
                            kb + BK - 1 > pmin || (window > 0 && kb <= pmax - window);

                        __m512 s[TR][4];
                        for (int rr = 0; rr < TR; rr++)
                            for (int c = 0; c < 4; c++) s[rr][c] = _mm512_setzero_ps();
                        for (long p = 0; p < half; p++) {
                            const __m512bh k0 = load_bh(kblk + (0 * half + p) * 16);
                            const __m512bh k1 = load_bh(kblk + (1 * half + p) * 16);
                            const __m512bh k2 = load_bh(kblk + (2 * half + p) * 16);
                            const __m512bh k3 = load_bh(kblk + (3 * half + p) * 16);
                            for (int rr = 0; rr < TR; rr++) {
                                const __m512bh qv = bcast_pair(qr[rr] + 2 * p);
                                s[rr][0] = _mm512_dpbf16_ps(s[rr][0], qv, k0);
                                s[rr][1] = _mm512_dpbf16_ps(s[rr][1], qv, k1);
                                s[rr][2] = _mm512_dpbf16_ps(s[rr][2], qv, k2);
                                s[rr][3] = _mm512_dpbf16_ps(s[rr][3], qv, k3);
                            }
                        }

                        const __m512 sc = _mm512_set1_ps(scale);
                        const __m512 ninf = _mm512_set1_ps(-INFINITY);
                        const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6,
                                                              5, 4, 3, 2, 1, 0);
                        for (int rr = 0; rr < TR; rr++) {
                            const long r = t + rr;
                            for (int c = 0; c < 4; c++) {
                                s[rr][c] = _mm512_mul_ps(s[rr][c], sc);
                                if (need_mask) {
                                    const __m512i key =
                                        _mm512_add_epi32(lane, _mm512_set1_epi32((int)(kb + 16 * c)));
                                    __mmask16 ok = _mm512_cmple_epi32_mask(
                                        key, _mm512_set1_epi32((int)pos[rr]));
                                    if (window > 0)
                                        ok &= _mm512_cmpgt_epi32_mask(
                                            key, _mm512_set1_epi32((int)(pos[rr] - window)));
                                    s[rr][c] = _mm512_mask_mov_ps(ninf, ok, s[rr][c]);
                                }
                            }
                            const float mx = _mm512_reduce_max_ps(_mm512_max_ps(
                                _mm512_max_ps(s[rr][0], s[rr][1]), _mm512_max_ps(s[rr][2], s[rr][3])));
                            const float m_old = mrow[r];
                            const float m_new = mx > m_old ? mx : m_old;
                            const float a = expf(m_old - m_new);
                            mrow[r] = m_new;
                            alpha[r] = a;
                            const __m512 mv = _mm512_set1_ps(m_new);
                            const __m512 p0 = exp16(_mm512_sub_ps(s[rr][0], mv));
                            const __m512 p1 = exp16(_mm512_sub_ps(s[rr][1], mv));
                            const __m512 p2 = exp16(_mm512_sub_ps(s[rr][2], mv));
                            const __m512 p3 = exp16(_mm512_sub_ps(s[rr][3], mv));
                            __m512 l = _mm512_load_ps(lsum + r * 16);
                            l = _mm512_fmadd_ps(l, _mm512_set1_ps(a),
                                                _mm512_add_ps(_mm512_add_ps(p0, p1), _mm512_add_ps(p2, p3)));
                            _mm512_store_ps(lsum + r * 16, l);
                            _mm512_store_si512((__m512i *)&pbuf[rr][0], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
                            _mm512_store_si512((__m512i *)&pbuf[rr][32], (__m512i)_mm512_cvtne2ps_pbh(p3, p2));
                        }

                        /* O = O * alpha + P V, 64 dimensions (4 vectors) at a time */
                        for (long dc = 0; dc < D; dc += 64) {
                            const int nd = D - dc >= 64 ? 4 : (int)((D - dc) / 16);
                            __m512 acc[TR][4];
                            for (int rr = 0; rr < TR; rr++) {
                                const __m512 av = _mm512_set1_ps(alpha[t + rr]);
                                float *orow = o + (t + rr) * D + dc;
                                for (int c = 0; c < 4; c++)
                                    acc[rr][c] = c < nd ? _mm512_mul_ps(_mm512_load_ps(orow + 16 * c), av)
                                                        : _mm512_setzero_ps();
                            }
                            for (long jj = 0; jj < BK / 2; jj++) {
                                const uint16_t *vrow = vblk + (jj * D + dc) * 2;
                                __m512bh v[4];
                                for (int c = 0; c < 4; c++)
                                    v[c] = c < nd ? load_bh(vrow + 32 * c) : (__m512bh)_mm512_setzero_si512();
                                for (int rr = 0; rr < TR; rr++) {
                                    const __m512bh pv = bcast_pair(&pbuf[rr][2 * jj]);
                                    for (int c = 0; c < 4; c++)
                                        if (c < nd) acc[rr][c] = _mm512_dpbf16_ps(acc[rr][c], pv, v[c]);
                                }
                            }
                            for (int rr = 0; rr < TR; rr++) {
                                float *orow = o + (t + rr) * D + dc;
                                for (int c = 0; c < nd; c++) _mm512_store_ps(orow + 16 * c, acc[rr][c]);
                            }
                        }
                    }
                }
                /* normalise, add the sink, write bf16 */
                for (long r = 0; r < rows; r++) {
                    const long i = r / G, hq = h * G + r % G;
                    float l = _mm512_reduce_add_ps(_mm512_load_ps(lsum + r * 16));
                    float f = 1.f;
                    if (sinks) {
                        const float m = mrow[r], sk = sinks[hq];
                        if (sk > m) {
                            f = expf(m - sk);
                            l = l * f + 1.f;
                        } else {
                            l += expf(sk - m);
                        }
                    }
                    const __m512 inv = _mm512_set1_ps(f / l);
                    uint16_t *orow = out + (r0 + i) * out_row + hq * out_head;
                    for (long d = 0; d < D; d += 16)
                        _mm256_storeu_si256((__m256i *)(orow + d),
                                            (__m256i)_mm512_cvtneps_pbh(
                                                _mm512_mul_ps(_mm512_load_ps(o + r * D + d), inv)));
                }
            }
        }
        free(o);
        free(lsum);
        free(mrow);
        free(alpha);
        free(zero_q);
    }
    free(kp);
    free(vp);
    return failed;
}
