/* Decode attention over the token-major paged KV cache, for the cpu target.
 *
 * One query row per sequence (a decode step). For every (sequence, KV head)
 * pair the kernel walks the sequence's block table once to list the unmasked
 * slots' K|V rows where they lie in the cache, then computes
 * softmax(q k^T * scale + mask) v for the G query heads that share the KV
 * head, all in float32 (16-bit values widened in registers): scores four keys
 * at a time (independent FMA chains, one horizontal reduction for the four),
 * a vectorised exp, and P V with the output rows held in registers. A loop of
 * one key at a time with a scalar expf took 2.2 ms per layer at 32 sequences
 * of ~160 keys with the cache cold; this form takes 0.3-0.4 ms (measured in
 * benchmarks/sxs/analysis/amd-avx2.md, run of 2026-12-03). It replaces, on the
 * cpu target only, the compiled batched-decode graph, which gathers whole
 * pages into a new tensor, widens them to float32 and runs PyTorch's flash
 * kernel: that costs 300-800 us per layer at one to four sequences on a 2-core
 * Zen 1 host, nearly all of it fixed cost, where the bytes to read are ~100 KB
 * per page.
 *
 * Mask entries below `skip_below` are masked keys (padding slots, slots
 * outside a sliding window): they are not read and get probability exactly 0,
 * as exp(mask - max) underflows to in the graph it replaces. A sequence with
 * no unmasked key (a padding entry of the batch) gets zeros.
 *
 * Attention sinks (gpt-oss): `sinks`, when not NULL, holds one logit per query
 * head that joins that head's softmax denominator with no value of its own:
 * out = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) + exp(sink - m)), with m
 * the maximum over the scores and the sink.
 *
 * The same call can first store the step's new K|V rows into the cache (the
 * KV store the card runs as its own compiled graph), so a layer's attention
 * on the cpu target is one call: the store finishes (an OpenMP barrier)
 * before any attention reads a page, as the card's store graph finishes
 * before its attention graph starts.
 *
 * Layout (elements, not bytes; every last dimension contiguous):
 *   q        query row s, head h at q + s*q_row + h*q_head; float32, bfloat16
 *            or float16 (q_kind)
 *   pages    K|V rows of 2*D values; slot (block b, offset o, KV head h)
 *            starts at b*page_stride + o*slot_stride + h*head_stride
 *   block_ids [S, NBK] int64, contiguous
 *   mask     [S, NBK*BS] float32, contiguous (additive)
 *   sinks    [H] float32 or NULL
 *   out      row s, head h at out + s*out_row + h*out_head, of out_kind;
 *            rows S .. S+zero_rows-1 are zeroed (a step's padding rows)
 *   k, v     new row t, KV head h at k + t*k_row + h*k_head (likewise v), of
 *            the cache's kind; stored at slots[t] (int64; block slots[t]/BS,
 *            offset slots[t]%BS) before attention; kv_tokens 0 stores nothing
 * Requires D % 8 == 0 and H % KVH == 0 (checked by the caller).
 *
 * Built with -O3 -mavx2 -mfma -mf16c -fopenmp, and again with AVX-512 F/BW/VL/DQ
 * (attend512 below); OpenMP resolves to the libgomp torch already loaded, so
 * there is one thread pool. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

enum { KIND_F32 = 0, KIND_BF16 = 1, KIND_F16 = 2 };

/* How many key rows ahead of the scores loop to prefetch, and into which
 * cache level. Into L2 (T1), 16 rows ahead: a row is 2*D values of each
 * (sequence, KV head) pair, every KVH-th run of a slot, and prefetching them
 * into L1 (T0) held each thread to a few outstanding misses (L1's miss
 * buffers) while the rows sat in DRAM: SmolLM2's heads (9 query / 3 KV x 64,
 * bfloat16), 32 sequences x 192 keys, pages cold, on a 2-core Zen 4: T0 8 rows
 * 389-424 us per layer, T1 16 rows 255 us (AVX2 build 498-523 -> 292-309 us);
 * 8 sequences x 256 keys 117-124 -> 73-75 us. The scores pass reads the row
 * from L2 a moment later, and the P V pass reads V from L1/L2. */
#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 16
#endif
#define PREFETCH_HINT _MM_HINT_T1

static inline __attribute__((always_inline)) __m256 load8(const void *base, long i, int kind) {
    if (kind == KIND_F32) return _mm256_loadu_ps((const float *)base + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
    if (kind == KIND_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* Store 8 floats as `kind` at base[i]: float16 and bfloat16 round to nearest
 * even, as torch's conversions do (a NaN stays a quiet NaN). */
static inline __attribute__((always_inline)) void store8(void *base, long i, __m256 x, int kind) {
    if (kind == KIND_F32) {
        _mm256_storeu_ps((float *)base + i, x);
        return;
    }
    __m128i h;
    if (kind == KIND_F16) {
        h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    } else {
        __m256i b = _mm256_castps_si256(x);
        __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
        __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
        r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
        /* packus works per 128-bit lane: gather the two lanes' halves. */
        r = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
        h = _mm256_castsi256_si128(r);
    }
    _mm_storeu_si128((__m128i *)((uint16_t *)base + i), h);
}

static inline float hsum(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

/* exp of 8 floats: Cody-Waite range reduction to r in [-ln2/2, ln2/2] and a
 * degree-6 polynomial (the classic Cephes expf coefficients, ~1 ulp), scaled
 * by 2^n through the exponent bits. Inputs here are scores minus their
 * maximum, so <= 0; below -87.3 the result is exactly 0, as expf underflows
 * (a padding lane of -inf included). */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f);
    __m256 keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
    x = _mm256_max_ps(x, lo);
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep);
}

/* Scores of key rows j..j+3 against one query row, in one register each
 * (four independent FMA chains instead of one), reduced together. */
static inline __attribute__((always_inline)) __m128 dot4(const char *const *rows, const float *qg,
                                                         long D, int kind) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (long d = 0; d < D; d += 8) {
        __m256 qv = _mm256_loadu_ps(qg + d);
        a0 = _mm256_fmadd_ps(load8(rows[0], d, kind), qv, a0);
        a1 = _mm256_fmadd_ps(load8(rows[1], d, kind), qv, a1);
        a2 = _mm256_fmadd_ps(load8(rows[2], d, kind), qv, a2);
        a3 = _mm256_fmadd_ps(load8(rows[3], d, kind), qv, a3);
    }
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* out[0:8*NB] = sum_j p[j] * V_j[d0:d0+8*NB] * ig, NB registers of sums. */
#define PV_BLOCK(NB)                                                                   \
    do {                                                                               \
        __m256 acc[NB];                                                                \
        for (int b = 0; b < NB; b++) acc[b] = _mm256_setzero_ps();                     \
        for (long j = 0; j < n; j++) {                                                 \
            __m256 pj = _mm256_set1_ps(p[j]);                                          \
            const char *v = rows[j] + (D + d0) * esize;                                \
            for (int b = 0; b < NB; b++)                                               \
                acc[b] = _mm256_fmadd_ps(pj, load8(v, 8 * b, kind), acc[b]);           \
        }                                                                              \
        for (int b = 0; b < NB; b++)                                                   \
            _mm256_storeu_ps(og + d0 + 8 * b, _mm256_mul_ps(acc[b], _mm256_set1_ps(ig))); \
        d0 += 8 * NB;                                                                  \
    } while (0)

/* Each head's scores p = sc[g][0:n8] (padded with -inf to n8) turned into
 * exp(p - max) in place, and inv[g] = 1 / (sum + exp(sink - max)). */
static inline void softmax_heads(float *sc, long n, long n8, long G, const float *sk, float *inv) {
    for (long g = 0; g < G; g++) {
        float *p = sc + g * n8;
        for (long t = n; t < n8; t++) p[t] = -INFINITY; /* exp8 -> 0 */
        if (n == 0) {
            inv[g] = 0.f;
            continue;
        }
        __m256 m8 = _mm256_set1_ps(-INFINITY);
        for (long t = 0; t < n8; t += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(p + t));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        float mxs = _mm_cvtss_f32(m4);
        if (sk && sk[g] > mxs) mxs = sk[g];
        __m256 mx = _mm256_set1_ps(mxs);
        __m256 s8 = _mm256_setzero_ps();
        for (long t = 0; t < n8; t += 8) {
            __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + t), mx));
            _mm256_storeu_ps(p + t, e);
            s8 = _mm256_add_ps(s8, e);
        }
        inv[g] = 1.f / (hsum(s8) + (sk ? expf(sk[g] - mxs) : 0.f));
    }
}

/* One (sequence, KV head) over its n unmasked key rows (rows[j] points at a
 * K|V row, mv[j] is its mask value): scores in sc[G][n8], outputs os[G][D];
 * sk: the G heads' sink logits, or NULL. */
static inline __attribute__((always_inline)) void attend(
    int kind, const float *qs, long G, long D, long esize, const char *const *rows, const float *mv,
    long n, float scale, const float *sk, float *sc, float *os) {
    const long n8 = (n + 7) & ~7L;
    const long row_bytes = 2 * D * esize;
    long j = 0;
    for (; j + 4 <= n; j += 4) {
        /* The rows are scattered over pages that are cold in the caches (a
         * decode step reads each layer's KV once), at a stride the hardware
         * prefetchers do not follow across pages: without this the kernel
         * waits on DRAM latency, ~3x slower than from cache. The whole K|V
         * row is fetched, so the P V pass below reads V from cache. */
        for (long f = j + PREFETCH_ROWS; f < j + PREFETCH_ROWS + 4 && f < n; f++)
            for (long b = 0; b < row_bytes; b += 64) _mm_prefetch(rows[f] + b, PREFETCH_HINT);
        for (long g = 0; g < G; g++) {
            __m128 s = dot4(rows + j, qs + g * D, D, kind);
            s = _mm_fmadd_ps(s, _mm_set1_ps(scale), _mm_loadu_ps(mv + j));
            _mm_storeu_ps(sc + g * n8 + j, s);
        }
    }
    for (; j < n; j++)
        for (long g = 0; g < G; g++) {
            __m256 acc = _mm256_setzero_ps();
            for (long d = 0; d < D; d += 8)
                acc = _mm256_fmadd_ps(load8(rows[j], d, kind), _mm256_loadu_ps(qs + g * D + d), acc);
            sc[g * n8 + j] = hsum(acc) * scale + mv[j];
        }
    float inv[64];
    softmax_heads(sc, n, n8, G, sk, inv);
    for (long g = 0; g < G; g++) {
        const float *p = sc + g * n8;
        float *og = os + g * D;
        if (n == 0) {
            for (long d = 0; d < D; d++) og[d] = 0.f;
            continue;
        }
        const float ig = inv[g];
        long d0 = 0;
        while (D - d0 >= 64) PV_BLOCK(8);
        while (D - d0 >= 32) PV_BLOCK(4);
        while (D - d0 >= 8) PV_BLOCK(1);
    }
}

#if defined(__AVX512F__)
/* The AVX-512 build (SPYRE_CPU_ISA=avx512, or auto on a CPU with AVX-512):
 * 16 lanes, and each 16-bit K and V row widened once for all the group's
 * heads instead of once per head (the AVX2 form converts a row G times: at
 * G = 3 the conversions were half its instructions). Heads are taken up to 4
 * at a time for the scores (four key rows per step) and 4 at a time, over 64
 * values of V, for P V, so the accumulators stay in registers (32 zmm). Same
 * float32 arithmetic as the AVX2 form, in another summation order. With the
 * scores' reductions four keys at a time, a SmolLM2 step of 32 sequences x 192
 * keys with the pages in cache went from 311 to 220 us per layer (Zen 4); with
 * the pages cold it stays bound by memory (~580 us). */
static inline __attribute__((always_inline)) __m512 load16(const void *base, long i, int kind) {
    if (kind == KIND_F32) return _mm512_loadu_ps((const float *)base + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i));
    if (kind == KIND_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

enum { SCORE_HEADS = 4, PV_HEADS = 4, PV_CHUNKS = 4 };

/* Sums of four 16-lane vectors, one per lane of the result. */
static inline __attribute__((always_inline)) __m128 reduce4_512(__m512 a0, __m512 a1, __m512 a2,
                                                                __m512 a3) {
    const __m256 b0 = _mm256_add_ps(_mm512_castps512_ps256(a0), _mm512_extractf32x8_ps(a0, 1));
    const __m256 b1 = _mm256_add_ps(_mm512_castps512_ps256(a1), _mm512_extractf32x8_ps(a1, 1));
    const __m256 b2 = _mm256_add_ps(_mm512_castps512_ps256(a2), _mm512_extractf32x8_ps(a2, 1));
    const __m256 b3 = _mm256_add_ps(_mm512_castps512_ps256(a3), _mm512_extractf32x8_ps(a3, 1));
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(b0, b1), _mm256_hadd_ps(b2, b3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* Scores of GC heads (a compile-time 1..SCORE_HEADS) against every key row:
 * four rows at a time, each widened once for the GC heads, the 4 x GC dot
 * products reduced four at a time (one horizontal tree per head instead of
 * one per key and head: with _mm512_reduce_add_ps per pair the reductions
 * were a third of the loop's instructions). prefetch: the first pass over the
 * rows fetches ahead (cold, scattered rows, see attend); later passes read
 * them from cache. */
static inline __attribute__((always_inline)) void scores512(
    const int GC, int kind, const float *qg, long D, const char *const *rows, const float *mv,
    long n, long n8, float scale, float *scg, long row_bytes, int prefetch) {
    long j = 0;
    for (; j + 4 <= n; j += 4) {
        if (prefetch)
            for (long f = j + PREFETCH_ROWS; f < j + PREFETCH_ROWS + 4 && f < n; f++)
                for (long b = 0; b < row_bytes; b += 64) _mm_prefetch(rows[f] + b, PREFETCH_HINT);
        __m512 acc[SCORE_HEADS][4];
        for (int g = 0; g < GC; g++)
            for (int r = 0; r < 4; r++) acc[g][r] = _mm512_setzero_ps();
        for (long d = 0; d < D; d += 16) {
            const __m512 k0 = load16(rows[j], d, kind), k1 = load16(rows[j + 1], d, kind);
            const __m512 k2 = load16(rows[j + 2], d, kind), k3 = load16(rows[j + 3], d, kind);
            for (int g = 0; g < GC; g++) {
                const __m512 qv = _mm512_loadu_ps(qg + g * D + d);
                acc[g][0] = _mm512_fmadd_ps(k0, qv, acc[g][0]);
                acc[g][1] = _mm512_fmadd_ps(k1, qv, acc[g][1]);
                acc[g][2] = _mm512_fmadd_ps(k2, qv, acc[g][2]);
                acc[g][3] = _mm512_fmadd_ps(k3, qv, acc[g][3]);
            }
        }
        for (int g = 0; g < GC; g++) {
            __m128 s4 = reduce4_512(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
            s4 = _mm_fmadd_ps(s4, _mm_set1_ps(scale), _mm_loadu_ps(mv + j));
            _mm_storeu_ps(scg + g * n8 + j, s4);
        }
    }
    for (; j < n; j++) {
        if (prefetch && j + PREFETCH_ROWS < n)
            for (long b = 0; b < row_bytes; b += 64) _mm_prefetch(rows[j + PREFETCH_ROWS] + b, PREFETCH_HINT);
        __m512 acc[SCORE_HEADS];
        for (int g = 0; g < GC; g++) acc[g] = _mm512_setzero_ps();
        for (long d = 0; d < D; d += 16) {
            const __m512 k = load16(rows[j], d, kind);
            for (int g = 0; g < GC; g++)
                acc[g] = _mm512_fmadd_ps(k, _mm512_loadu_ps(qg + g * D + d), acc[g]);
        }
        for (int g = 0; g < GC; g++) scg[g * n8 + j] = _mm512_reduce_add_ps(acc[g]) * scale + mv[j];
    }
}

static inline __attribute__((always_inline)) void attend512(
    int kind, const float *qs, long G, long D, long esize, const char *const *rows, const float *mv,
    long n, float scale, const float *sk, float *sc, float *os) {
    const long n8 = (n + 7) & ~7L;
    const long row_bytes = 2 * D * esize;
    /* The heads in passes of at most SCORE_HEADS, as even as possible
     * (G = 6: 3 + 3, G = 7: 4 + 3). */
    const long passes = (G + SCORE_HEADS - 1) / SCORE_HEADS, per = (G + passes - 1) / passes;
    for (long g0 = 0; g0 < G; g0 += per) {
        const long gc = G - g0 < per ? G - g0 : per;
        const float *qg = qs + g0 * D;
        float *scg = sc + g0 * n8;
        const int pf = g0 == 0;
        switch (gc) {
            case 1: scores512(1, kind, qg, D, rows, mv, n, n8, scale, scg, row_bytes, pf); break;
            case 2: scores512(2, kind, qg, D, rows, mv, n, n8, scale, scg, row_bytes, pf); break;
            case 3: scores512(3, kind, qg, D, rows, mv, n, n8, scale, scg, row_bytes, pf); break;
            default: scores512(4, kind, qg, D, rows, mv, n, n8, scale, scg, row_bytes, pf); break;
        }
    }
    float inv[64];
    softmax_heads(sc, n, n8, G, sk, inv);
    if (n == 0) {
        for (long d = 0; d < G * D; d++) os[d] = 0.f;
        return;
    }
    for (long d0 = 0; d0 < D; d0 += 16 * PV_CHUNKS) {
        const long nd = (D - d0) / 16 < PV_CHUNKS ? (D - d0) / 16 : PV_CHUNKS;
        for (long g0 = 0; g0 < G; g0 += PV_HEADS) {
            const long gb = G - g0 < PV_HEADS ? G - g0 : PV_HEADS;
            __m512 acc[PV_HEADS][PV_CHUNKS];
            for (int g = 0; g < PV_HEADS; g++)
                for (int b = 0; b < PV_CHUNKS; b++) acc[g][b] = _mm512_setzero_ps();
            for (long j = 0; j < n; j++) {
                const char *v = rows[j] + D * esize;
                __m512 vv[PV_CHUNKS];
                for (int b = 0; b < PV_CHUNKS; b++)
                    if (b < nd) vv[b] = load16(v, d0 + 16 * b, kind);
                for (int g = 0; g < PV_HEADS; g++) {
                    if (g >= gb) continue;
                    const __m512 pj = _mm512_set1_ps(sc[(g0 + g) * n8 + j]);
                    for (int b = 0; b < PV_CHUNKS; b++)
                        if (b < nd) acc[g][b] = _mm512_fmadd_ps(pj, vv[b], acc[g][b]);
                }
            }
            for (int g = 0; g < PV_HEADS; g++) {
                if (g >= gb) continue;
                const __m512 iv = _mm512_set1_ps(inv[g0 + g]);
                for (int b = 0; b < PV_CHUNKS; b++)
                    if (b < nd)
                        _mm512_storeu_ps(os + (g0 + g) * D + d0 + 16 * b, _mm512_mul_ps(acc[g][b], iv));
            }
        }
    }
}
#endif

static inline long kind_size(int kind) { return kind == KIND_F32 ? 4 : 2; }

/* The store: K and V of token t, KV head h, side by side in its slot's row. */
static void store_rows(const char *k, const char *v, long k_row, long k_head, long v_row, long v_head,
                       const int64_t *slots, long kv_tokens, char *pages, long page_stride,
                       long slot_stride, long head_stride, long KVH, long D, long BS, long esize) {
    const size_t half = (size_t)(D * esize);
#pragma omp for schedule(static)
    for (long t = 0; t < kv_tokens; t++) {
        const long slot = (long)slots[t];
        char *row = pages + ((slot / BS) * page_stride + (slot % BS) * slot_stride) * esize;
        for (long h = 0; h < KVH; h++) {
            memcpy(row + h * head_stride * esize, k + (t * k_row + h * k_head) * esize, half);
            memcpy(row + h * head_stride * esize + half, v + (t * v_row + h * v_head) * esize, half);
        }
    }
}

/* Returns 0; 1 when a thread could not allocate its buffers (out is then
 * incomplete and the caller must raise); 2 for a group size over 64. */
int spyre_paged_decode(const void *q, int q_kind, long q_row, long q_head, long S, long H, long D,
                       void *pages, int kind, long page_stride, long slot_stride, long head_stride,
                       long KVH, const int64_t *block_ids, long NBK, long BS, const float *mask,
                       float scale, float skip_below, const float *sinks, void *out, int out_kind,
                       long out_row, long out_head, long zero_rows, const void *k, const void *v,
                       long k_row, long k_head, long v_row, long v_head, const int64_t *slots,
                       long kv_tokens, int nthreads) {
    const long G = H / KVH, T = NBK * BS, T8 = (T + 7) & ~7L;
    const long esize = kind_size(kind), q_size = kind_size(q_kind), o_size = kind_size(out_kind);
    if (G > 64) return 2;
    const long work = S * KVH > kv_tokens ? S * KVH : kv_tokens;
    if (nthreads < 1) nthreads = 1;
    if (work == 0) nthreads = 1;
    else if (nthreads > work) nthreads = (int)work;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        if (kv_tokens > 0)  /* ends in the omp for's barrier: every page written */
            store_rows((const char *)k, (const char *)v, k_row, k_head, v_row, v_head, slots,
                       kv_tokens, (char *)pages, page_stride, slot_stride, head_stride, KVH, D,
                       BS, esize);
        /* scores, mask values, then the group's query and output rows */
        float *sc = malloc(sizeof(float) * (size_t)(G * T8 + T8 + 2 * G * D));
        const char **rows = malloc(sizeof(char *) * (size_t)T8);
        if (!sc || !rows) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static) collapse(2)
        for (long s = 0; s < S; s++) {
            for (long h = 0; h < KVH; h++) {
                if (!sc || !rows) continue;
                float *mv = sc + G * T8;
                float *qs = mv + T8;
                float *os = qs + G * D;
                const float *ms = mask + s * T;
                const int64_t *blocks = block_ids + s * NBK;
                const char *base = (const char *)pages + h * head_stride * esize;
                long n = 0;
                /* Gather the unmasked slots once: masked keys (padding, outside a
                 * sliding window) are never read and get probability 0. */
                for (long t = 0; t < T; t++) {
                    if (ms[t] < skip_below) continue;
                    rows[n] = base + (blocks[t / BS] * page_stride + (t % BS) * slot_stride) * esize;
                    mv[n++] = ms[t];
                }
                for (long g = 0; g < G; g++) {
                    const char *qg = (const char *)q + (s * q_row + (h * G + g) * q_head) * q_size;
                    for (long d = 0; d < D; d += 8) _mm256_storeu_ps(qs + g * D + d, load8(qg, d, q_kind));
                }
                const float *sk = sinks ? sinks + h * G : NULL;
#if defined(__AVX512F__)
#define ATTEND(K)                                                                  \
    do {                                                                           \
        if (D % 16 == 0) attend512(K, qs, G, D, esize, rows, mv, n, scale, sk, sc, os); \
        else attend(K, qs, G, D, esize, rows, mv, n, scale, sk, sc, os);            \
    } while (0)
#else
#define ATTEND(K) attend(K, qs, G, D, esize, rows, mv, n, scale, sk, sc, os)
#endif
                switch (kind) {
                    case KIND_BF16:
                        ATTEND(KIND_BF16);
                        break;
                    case KIND_F16:
                        ATTEND(KIND_F16);
                        break;
                    default:
                        ATTEND(KIND_F32);
                }
                for (long g = 0; g < G; g++) {
                    char *og = (char *)out + (s * out_row + (h * G + g) * out_head) * o_size;
                    for (long d = 0; d < D; d += 8) store8(og, d, _mm256_loadu_ps(os + g * D + d), out_kind);
                }
            }
        }
#pragma omp for schedule(static)
        for (long r = S; r < S + zero_rows; r++)
            for (long hh = 0; hh < H; hh++)
                memset((char *)out + (r * out_row + hh * out_head) * o_size, 0, (size_t)(D * o_size));
        free(rows);
        free(sc);
    }
    return failed;
}
