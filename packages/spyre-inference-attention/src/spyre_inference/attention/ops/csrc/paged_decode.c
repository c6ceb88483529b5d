/* Decode attention over the token-major paged KV cache, for the cpu target.
 *
 * One query row per sequence (a decode step). For every (sequence, KV head)
 * pair the kernel walks the sequence's pages through its block table, reads
 * each slot's K|V row where it lies in the cache (16-bit values widened to
 * float32 in registers), and computes softmax(q k^T * scale + mask) v for the
 * G query heads that share the KV head, all in float32. It replaces, on the
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
 * Layout (elements, not bytes):
 *   q        [S, H, D] float32, contiguous
 *   pages    K|V rows of 2*D values; slot (block b, offset o, KV head h)
 *            starts at b*page_stride + o*slot_stride + h*head_stride
 *   block_ids [S, NBK] int64, contiguous
 *   mask     [S, NBK*BS] float32, contiguous (additive)
 *   out      [S, H, D] float32, contiguous
 * Requires D % 8 == 0 and H % KVH == 0 (checked by the caller).
 *
 * Built with -O3 -mavx2 -mfma -mf16c -fopenmp; OpenMP resolves to the libgomp
 * torch already loaded, so there is one thread pool. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>

enum { KIND_F32 = 0, KIND_BF16 = 1, KIND_F16 = 2 };

static inline __attribute__((always_inline)) __m256 load8(const void *base, long i, int kind) {
    if (kind == KIND_F32) return _mm256_loadu_ps((const float *)base + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
    if (kind == KIND_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float hsum(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

/* One (sequence, KV head): scores in sc[G][T], output rows os[G][D]. */
static inline __attribute__((always_inline)) void attend(
    int kind, const float *qs, long G, long D, const char *pages, long esize, long page_stride,
    long slot_stride, long head_offset, const int64_t *blocks, long BS, long T, const float *ms,
    float scale, float skip_below, float *sc, float *os) {
    float mx[64], sum[64];
    for (long g = 0; g < G; g++) mx[g] = -INFINITY, sum[g] = 0.f;
    for (long t = 0; t < T; t++) {
        if (ms[t] < skip_below) continue;
        const char *k = pages + (blocks[t / BS] * page_stride + (t % BS) * slot_stride + head_offset) * esize;
        for (long g = 0; g < G; g++) {
            __m256 acc = _mm256_setzero_ps();
            for (long d = 0; d < D; d += 8)
                acc = _mm256_fmadd_ps(load8(k, d, kind), _mm256_loadu_ps(qs + g * D + d), acc);
            float v = hsum(acc) * scale + ms[t];
            sc[g * T + t] = v;
            if (v > mx[g]) mx[g] = v;
        }
    }
    for (long i = 0; i < G * D; i++) os[i] = 0.f;
    for (long t = 0; t < T; t++) {
        if (ms[t] < skip_below) continue;
        for (long g = 0; g < G; g++) {
            float p = expf(sc[g * T + t] - mx[g]);
            sc[g * T + t] = p;
            sum[g] += p;
        }
        const char *v = pages + (blocks[t / BS] * page_stride + (t % BS) * slot_stride + head_offset) * esize;
        for (long d = 0; d < D; d += 8) {
            __m256 vv = load8(v, D + d, kind);
            for (long g = 0; g < G; g++) {
                float *o = os + g * D + d;
                _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_set1_ps(sc[g * T + t]), vv, _mm256_loadu_ps(o)));
            }
        }
    }
    for (long g = 0; g < G; g++) {
        float inv = sum[g] > 0.f ? 1.f / sum[g] : 0.f;
        for (long d = 0; d < D; d++) os[g * D + d] *= inv;
    }
}

/* Returns 0; 1 when a thread could not allocate its score buffer (out is then
 * incomplete and the caller must raise); 2 for a group size over 64. */
int spyre_paged_decode(const float *q, long S, long H, long D, const void *pages, int kind,
                       long page_stride, long slot_stride, long head_stride, long KVH,
                       const int64_t *block_ids, long NBK, long BS, const float *mask,
                       float scale, float skip_below, float *out, int nthreads) {
    const long G = H / KVH, T = NBK * BS;
    const long esize = kind == KIND_F32 ? 4 : 2;
    if (G > 64) return 2;
    if (nthreads < 1) nthreads = 1;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *sc = malloc(sizeof(float) * (size_t)(G * T));
        if (!sc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static) collapse(2)
        for (long s = 0; s < S; s++) {
            for (long h = 0; h < KVH; h++) {
                if (!sc) continue;
                const float *qs = q + (s * H + h * G) * D;
                float *os = out + (s * H + h * G) * D;
                const int64_t *blocks = block_ids + s * NBK;
                const float *ms = mask + s * T;
                const char *p = (const char *)pages;
                switch (kind) {
                    case KIND_BF16:
                        attend(KIND_BF16, qs, G, D, p, esize, page_stride, slot_stride, h * head_stride,
                               blocks, BS, T, ms, scale, skip_below, sc, os);
                        break;
                    case KIND_F16:
                        attend(KIND_F16, qs, G, D, p, esize, page_stride, slot_stride, h * head_stride,
                               blocks, BS, T, ms, scale, skip_below, sc, os);
                        break;
                    default:
                        attend(KIND_F32, qs, G, D, p, esize, page_stride, slot_stride, h * head_stride,
                               blocks, BS, T, ms, scale, skip_below, sc, os);
                }
            }
        }
        free(sc);
    }
    return failed;
}
