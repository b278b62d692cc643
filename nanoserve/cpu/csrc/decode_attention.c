/* decode_attention.c: paged attention for decode tokens on CPU, reading K/V straight from the cache.

   Built and loaded by nanoserve/cpu/kernels.py (cc -O3 -march=native -fopenmp, then ctypes).
   Why C: a decode token reads its request's whole cached K and V once per layer, and on CPU that
   read is the cost (memory-bound). In torch, the blocks must first be gathered into a contiguous
   copy for SDPA, which reads the cache, writes the copy, and reads the copy again: three passes
   where one suffices. This loop follows the block table in place, so K and V are read once.

   One task per decode token, all heads at once: a cached token's K (or V) row for every KV head
   is one contiguous run of num_kv_heads * head_dim values, so the cache is read front to back,
   and each KV head's row serves the `group` query heads that share it (GQA). Two passes over
   the sequence: scores (q . k) and their softmax, then the weighted sum of V rows.

   Two versions of the passes: plain C for any shape and CPU, and SIMD for head_dim a multiple of
   the vector width. The SIMD loops use GCC/Clang vector extensions, which compile to the widest
   vectors -march=native offers (AVX-512: 16 floats, AVX/AVX2: 8, SSE or NEON: 4), so every
   machine gets them, not only AVX-512 ones. Why both: in the plain loops the compiler keeps the V
   pass's sums in memory, and their arithmetic then costs as much as reading the cache; the SIMD
   loops keep the sums in registers (and prefetch, below), so the passes run nearer the memory's
   speed.

   bf16 on a CPU with AVX512-BF16: the scores pass multiplies the model's bf16 query with the
   cached bf16 K row by that extension's dot product of bf16 pairs (exact products, float32 sums),
   with no widening of K. The V pass uses it too, on two positions at once with the softmax
   weights rounded to bf16 ("V in pairs" below).

   The cache layout and the helpers the CPU kernels share: cpu_kernels.h. The measurements behind
   these choices, each on the CPU it names, and what was tried and not kept:
   scripts/results/README.md.
*/
#include "cpu_kernels.h"

/* Each row of scores [rows][len] -> its softmax weights, LANES at a time with exp2_lanes
   (cpu_kernels.h), then one multiply by 1 / sum per weight: cheaper than glibc's expf and a
   division per weight. A row's last values are padded with -FLT_MAX, whose weight is 0. */
static inline vfloat load_padded(const float *row, int n) {   /* n < LANES values, then -FLT_MAX */
    vfloat v = splat(-FLT_MAX);
    for (int l = 0; l < n; l++) v[l] = row[l];
    return v;
}

static void softmax_rows(float *scores, int rows, int len) {
    const int whole = len / LANES * LANES, tail = len - whole;
    for (int r = 0; r < rows; r++) {
        float *row = scores + (int64_t)r * len;
        vfloat top = load_padded(row + whole, tail), total = splat(0.f), v;
        for (int p = 0; p < whole; p += LANES) {
            memcpy(&v, row + p, sizeof v);
            top = max_lanes(top, v);
        }
        float max_score = -FLT_MAX;
        for (int l = 0; l < LANES; l++) max_score = top[l] > max_score ? top[l] : max_score;
        for (int p = 0; p < whole; p += LANES) {
            memcpy(&v, row + p, sizeof v);
            v = exp2_lanes((v - max_score) * LOG2E);
            total += v;
            memcpy(row + p, &v, sizeof v);
        }
        v = exp2_lanes((load_padded(row + whole, tail) - max_score) * LOG2E);
        total += v;
        for (int l = 0; l < tail; l++) row[whole + l] = v[l];
        float sum = 0.f;
        for (int l = 0; l < LANES; l++) sum += total[l];
        const vfloat inverse = splat(1.f / sum);
        for (int p = 0; p < whole; p += LANES) {
            memcpy(&v, row + p, sizeof v);
            v *= inverse;
            memcpy(row + p, &v, sizeof v);
        }
        for (int p = whole; p < len; p++) row[p] *= inverse[0];
    }
}

/* Plain C passes, any head_dim. q: pre-scaled [num_q_heads][head_dim]; scores: [num_q_heads][seq_len];
   acc: [num_q_heads][head_dim], zeroed; buf: one widened row. */
static void scores_plain(const Seq *s, const float *q, float *scores, float *buf) {
    const int kv_row = s->num_kv_heads * s->head_dim, num_q_heads = s->num_kv_heads * s->group;
    for (int p = 0; p < s->seq_len; p++) {
        const float *k = row_f32(s->k_cache, slot_of(s, p), kv_row, s->bf16, buf);
        for (int qh = 0; qh < num_q_heads; qh++) {
            const float *qv = q + qh * s->head_dim, *kv = k + (qh / s->group) * s->head_dim;
            float sum = 0.f;
            for (int d = 0; d < s->head_dim; d++) sum += qv[d] * kv[d];
            scores[(int64_t)qh * s->seq_len + p] = sum;
        }
    }
}

static void weighted_v_plain(const Seq *s, const float *weights, float *acc, float *buf) {
    const int kv_row = s->num_kv_heads * s->head_dim, num_q_heads = s->num_kv_heads * s->group;
    for (int p = 0; p < s->seq_len; p++) {
        const float *v = row_f32(s->v_cache, slot_of(s, p), kv_row, s->bf16, buf);
        for (int qh = 0; qh < num_q_heads; qh++) {
            const float w = weights[(int64_t)qh * s->seq_len + p], *vv = v + (qh / s->group) * s->head_dim;
            float *a = acc + qh * s->head_dim;
            for (int d = 0; d < s->head_dim; d++) a[d] += w * vv[d];
        }
    }
}

#define MAX_NJ (128 / LANES) /* head_dim up to 128 */
#define SUMS (LANES == 16 ? 16 : 8) /* V-pass sums in registers: half of AVX-512's 32, of AVX2's 16 */

/* Why prefetch: a request's blocks lie anywhere in a cache of gigabytes, so the hardware
   prefetcher restarts at every block edge, and the loads stall on memory between the arithmetic
   instead of overlapping it. The passes ask for the rows PREFETCH_BYTES ahead (in positions, across
   block edges), into L2 (`__builtin_prefetch` locality 2: prefetcht1 on x86): L2 tracks more
   misses in flight than L1. The scores pass asks for the V rows as well as the K rows: a
   request's V for one layer (a few hundred KiB at the bench model's lengths) is then mostly in L2
   when the weighted sum reads it. The V pass still asks again, for sequences whose V does not stay
   in L2 (a prefetch of a line in L2 costs little).
   PREFETCH_BYTES is a fixed distance, chosen by measurement on one CPU and not re-measured at
   start-up: scripts/results/README.md names that CPU, and another that preferred a shorter
   distance into L1. TILE: the V pass's positions a step (below). */
enum { PREFETCH_BYTES = 16384, TILE = 16 };

/* V in pairs. bf16 on AVX512-BF16 (head_dim a multiple of 32): the weighted sum of V rows by the
   dot product of bf16 pairs, two positions at once. The rows of p and p + 1 are interleaved
   (unpacklo/hi_epi16, which pair them within each 128-bit quarter: a sum vector then holds
   dimensions {0-3, 8-11, 16-19, 24-27} or {4-7, 12-15, 20-23, 28-31} of each 32, put back in order
   at the end), and multiplied by the pair of weights (w_p, w_p+1), both rounded to bf16: where HF
   rounds its softmax before the product with V. One instruction for two positions' products and
   sums, and no widening of V. */

static inline void prefetch_row(const Seq *s, const void *cache, int p, int64_t row_bytes) {
    if (p >= s->seq_len) return;
    const char *row = (const char *)cache + slot_of(s, p) * row_bytes;
    for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(row + b, 0, 2);
}

/* The total of a vector's lanes. AVX-512: its reduction intrinsic (a tree of shuffles and adds);
   the plain loop over lanes compiled to a long chain that cost more than the products before it. */
static inline float sum_lanes(vfloat v) {
#if LANES == 16
    return _mm512_reduce_add_ps((__m512)v);
#else
    float total = 0.f;
    for (int i = 0; i < LANES; i++) total += v[i];
    return total;
#endif
}

/* The same two passes, head_dim = LANES * nj. Always inlined with constant nj and bf16, so the
   compiler unrolls the j loops and keeps k[] and a[] in vector registers. */
static inline __attribute__((always_inline)) void
passes_simd(const Seq *s, const float *q, const void *query, float scale, float *scores, float *acc,
            const int nj, const int bf16) {
    const int head_dim = LANES * nj, size = bf16 ? 2 : 4, kv_row = s->num_kv_heads * head_dim;
    const int64_t row_bytes = (int64_t)kv_row * size;
    const int ahead = PREFETCH_BYTES / row_bytes > 0 ? PREFETCH_BYTES / row_bytes : 1;
#ifdef DPBF16
    const int pairs = bf16 && nj % 2 == 0;   /* bf16 rows as pairs for AVX512-BF16's dot product */
#endif
    /* The first `ahead` rows, which no earlier position asks for, all at once: their misses then
       overlap instead of each waiting for the one before. */
    for (int p = 0; p < ahead; p++) {
        prefetch_row(s, s->k_cache, p, row_bytes);
        prefetch_row(s, s->v_cache, p, row_bytes);
    }
    for (int p = 0; p < s->seq_len; p++) {
        const char *row = (const char *)s->k_cache + slot_of(s, p) * row_bytes;
        prefetch_row(s, s->k_cache, p + ahead, row_bytes);
        prefetch_row(s, s->v_cache, p + ahead, row_bytes);
        for (int h = 0; h < s->num_kv_heads; h++) {
#ifdef DPBF16
            if (pairs) {   /* the model's own bf16 query (unscaled: exact products) */
                __m512bh k[MAX_NJ / 2];
                for (int j = 0; j < nj / 2; j++) memcpy(&k[j], row + (h * head_dim + 32 * j) * 2, 64);
                for (int qh = h * s->group; qh < (h + 1) * s->group; qh++) {
                    __m512 sum = _mm512_setzero_ps();
                    for (int j = 0; j < nj / 2; j++) {
                        __m512bh qv;
                        memcpy(&qv, (const uint16_t *)query + qh * head_dim + 32 * j, 64);
                        sum = _mm512_dpbf16_ps(sum, qv, k[j]);
                    }
                    scores[(int64_t)qh * s->seq_len + p] = scale * sum_lanes((vfloat)sum);
                }
                continue;
            }
#endif
            vfloat k[MAX_NJ];  /* this KV head's row, shared by its `group` query heads */
            for (int j = 0; j < nj; j++) k[j] = load_lanes(row + (h * head_dim + LANES * j) * size, bf16);
            for (int qh = h * s->group; qh < (h + 1) * s->group; qh++) {
                const float *qv = q + qh * head_dim;
                vfloat sum = k[0] * load_lanes(qv, 0);
                for (int j = 1; j < nj; j++) sum += k[j] * load_lanes(qv + LANES * j, 0);
                scores[(int64_t)qh * s->seq_len + p] = sum_lanes(sum);
            }
        }
    }
    softmax_rows(scores, s->num_kv_heads * s->group, s->seq_len);
    /* TILE rows at a time (within one block, so contiguous; they stay in L1). Each KV head's part
       of a row is loaded (bf16: widened) once, into registers, for up to heads_at_once of the query
       heads that share it, whose sums stay in registers over the tile. */
    const int heads_at_once = nj >= SUMS ? 1 : SUMS / nj;
    for (int p0 = 0, n; p0 < s->seq_len; p0 += n) {
        const int in_block = s->block_size - p0 % s->block_size, left = s->seq_len - p0;
        n = in_block < TILE ? in_block : TILE;
        n = left < n ? left : n;
        for (int p = p0 + ahead; p < p0 + ahead + n; p++) prefetch_row(s, s->v_cache, p, row_bytes);
        const char *rows = (const char *)s->v_cache + slot_of(s, p0) * row_bytes;
#ifdef DPBF16
        /* The tile's weights rounded to bf16 once per query head, zeros past the n-th, so that
           (w_p, w_p+1) is one 32-bit load for any p, not two roundings inside the loop below,
           beside its products. One masked load and one conversion of 16 floats (TILE) a query
           head. */
        _Static_assert(TILE == 16, "a tile's weights are one vector of 16 floats");
        uint16_t tile_weights[pairs ? s->num_kv_heads * s->group : 1][TILE + 2];
        if (pairs)
            for (int qh = 0; qh < s->num_kv_heads * s->group; qh++) {
                const __m512 w = _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), scores + (int64_t)qh * s->seq_len + p0);
                _mm256_storeu_si256((__m256i *)tile_weights[qh], (__m256i)_mm512_cvtneps_pbh(w));
                tile_weights[qh][TILE] = tile_weights[qh][TILE + 1] = 0;
            }
#endif
        for (int h = 0; h < s->num_kv_heads; h++)
            for (int g0 = 0; g0 < s->group; g0 += heads_at_once) {
                const int count = s->group - g0 < heads_at_once ? s->group - g0 : heads_at_once;
                const int qh0 = h * s->group + g0;
                vfloat a[SUMS][MAX_NJ];
#pragma GCC unroll 16
                for (int g = 0; g < heads_at_once; g++)
                    for (int j = 0; j < nj; j++)   /* unused ones zeroed: no "maybe uninitialised" */
                        a[g][j] = g < count ? load_lanes(acc + (qh0 + g) * head_dim + LANES * j, 0) : (vfloat){};
#ifdef DPBF16
                if (pairs) {   /* positions p, p + 1 at once; see "V in pairs" */
                    for (int p = 0; p < n; p += 2) {
                        const char *row = rows + (int64_t)p * row_bytes + (int64_t)h * head_dim * 2;
                        const int two = p + 1 < n;
                        __m512i v[MAX_NJ];
                        for (int c = 0; c < nj / 2; c++) {
                            __m512i first, second = _mm512_setzero_si512();
                            memcpy(&first, row + 64 * c, 64);
                            if (two) memcpy(&second, row + row_bytes + 64 * c, 64);
                            v[2 * c] = _mm512_unpacklo_epi16(first, second);
                            v[2 * c + 1] = _mm512_unpackhi_epi16(first, second);
                        }
#pragma GCC unroll 16
                        for (int g = 0; g < heads_at_once; g++)
                            if (g < count) {
                                uint32_t pair;
                                memcpy(&pair, &tile_weights[qh0 + g][p], sizeof pair);
                                const __m512bh weights = (__m512bh)_mm512_set1_epi32((int)pair);
                                for (int j = 0; j < nj; j++)
                                    a[g][j] = (vfloat)_mm512_dpbf16_ps((__m512)a[g][j], (__m512bh)v[j], weights);
                            }
                    }
                } else
#endif
                for (int p = 0; p < n; p++) {
                    const char *row = rows + (int64_t)p * row_bytes + (int64_t)h * head_dim * size;
                    vfloat v[MAX_NJ];
                    for (int j = 0; j < nj; j++) v[j] = load_lanes(row + LANES * j * size, bf16);
#pragma GCC unroll 16
                    for (int g = 0; g < heads_at_once; g++)
                        if (g < count) {
                            const float w = scores[(int64_t)(qh0 + g) * s->seq_len + p0 + p];
                            for (int j = 0; j < nj; j++) a[g][j] += w * v[j];
                        }
                }
#pragma GCC unroll 16
                for (int g = 0; g < heads_at_once; g++)
                    if (g < count)
                        for (int j = 0; j < nj; j++) memcpy(acc + (qh0 + g) * head_dim + LANES * j, &a[g][j], sizeof a[g][j]);
            }
    }
#ifdef DPBF16
    if (pairs)   /* the sums back into dimension order, per query head */
        for (int qh = 0; qh < s->num_kv_heads * s->group; qh++) {
            float sums[LANES * MAX_NJ], *head = acc + qh * head_dim;
            memcpy(sums, head, sizeof(float) * head_dim);
            for (int j = 0; j < nj; j++)
                for (int l = 0; l < LANES; l++) head[32 * (j / 2) + 8 * (l / 4) + 4 * (j % 2) + l % 4] = sums[LANES * j + l];
        }
#endif
}

/* The SIMD passes when head_dim is LANES * nj, up to 128; else returns 0 (use the plain ones). */
static int passes_simd_if_supported(const Seq *s, const float *q, const void *query, float scale,
                                    float *scores, float *acc) {
#define NJ_CASE(nj) \
    case nj: s->bf16 ? passes_simd(s, q, query, scale, scores, acc, nj, 1) \
                     : passes_simd(s, q, query, scale, scores, acc, nj, 0); return 1;
    if (s->head_dim % LANES == 0) {
        switch (s->head_dim / LANES) {
            NJ_CASE(1) NJ_CASE(2) NJ_CASE(3) NJ_CASE(4) NJ_CASE(5) NJ_CASE(6) NJ_CASE(7) NJ_CASE(8)
#if MAX_NJ >= 16
            NJ_CASE(9) NJ_CASE(10) NJ_CASE(11) NJ_CASE(12) NJ_CASE(13) NJ_CASE(14) NJ_CASE(15) NJ_CASE(16)
#endif
#if MAX_NJ >= 32
            NJ_CASE(17) NJ_CASE(18) NJ_CASE(19) NJ_CASE(20) NJ_CASE(21) NJ_CASE(22) NJ_CASE(23) NJ_CASE(24)
            NJ_CASE(25) NJ_CASE(26) NJ_CASE(27) NJ_CASE(28) NJ_CASE(29) NJ_CASE(30) NJ_CASE(31) NJ_CASE(32)
#endif
        }
    }
    return 0;
}

/* Returns 0, or 1 when out of memory (the caller then uses torch). */
int decode_attention(const void *query, void *out, const void *k_cache, const void *v_cache,
                     const int32_t *token_index, const int32_t *block_table_rows,
                     const int32_t *seq_lens, int num_tokens, int max_blocks, int block_size,
                     int num_kv_heads, int group, int head_dim, float scale, int bf16,
                     int num_threads) {
    const int num_q_heads = num_kv_heads * group, q_row = num_q_heads * head_dim;
    const int kv_row = num_kv_heads * head_dim, buf_len = q_row > kv_row ? q_row : kv_row;
    int failed = 0;
#pragma omp parallel for schedule(dynamic) num_threads(THREADS_FOR(num_tokens, num_threads))
    for (int i = 0; i < num_tokens; i++) {
        const Seq s = {k_cache, v_cache, block_table_rows + (int64_t)i * max_blocks, seq_lens[i],
                       block_size, num_kv_heads, group, head_dim, bf16};
        /* q, acc: [num_q_heads][head_dim]; scores: [num_q_heads][seq_len]; buf: one widened row. */
        float *q = malloc(sizeof(float) * ((size_t)2 * q_row + (size_t)num_q_heads * s.seq_len + buf_len));
        if (!q) { failed = 1; continue; }
        float *acc = q + q_row, *scores = acc + q_row, *buf = scores + (size_t)num_q_heads * s.seq_len;
        const float *query_row = row_f32(query, token_index[i], q_row, bf16, buf);
        for (int d = 0; d < q_row; d++) q[d] = query_row[d] * scale;
        memset(acc, 0, sizeof(float) * q_row);
        const void *own_query = (const char *)query + (int64_t)token_index[i] * q_row * (bf16 ? 2 : 4);
        if (!passes_simd_if_supported(&s, q, own_query, scale, scores, acc)) {
            scores_plain(&s, q, scores, buf);
            softmax_rows(scores, num_q_heads, s.seq_len);
            weighted_v_plain(&s, scores, acc, buf);
        }
        const int64_t base = (int64_t)token_index[i] * q_row;
        for (int d = 0; d < q_row; d++) {
            if (bf16) ((uint16_t *)out)[base + d] = f32_to_bf16(acc[d]);
            else ((float *)out)[base + d] = acc[d];
        }
        free(q);
    }
    return failed;
}
