/* decode_attention.c: paged attention for decode tokens on CPU, reading K/V straight from the cache.

   Built and loaded by nanoserve/paged_attention_cpu.py (cc -O3 -march=native -fopenmp, then ctypes).
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
   pass's sums in memory, and their arithmetic took as long as reading the cache; with the sums in
   registers (and the prefetch below), a 64-request decode step of the bench model spends 56
   instead of 81 ms in attention in float32, 44 instead of 67 in bfloat16 on an AVX-512 machine
   (30 layers, ~22k cached tokens; reading them at full memory speed takes ~42 / ~21).

   Layout (design §5): cache [num_blocks, block_size, num_kv_heads, head_dim]; token position p of
   a request is slot block_table[p / block_size] * block_size + p % block_size.
*/
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* bfloat16 is the top half of a float32: widening is a shift; narrowing rounds to nearest even. */
static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Row `slot` of a [num_slots, row] cache as float32: fp32 rows are used in place, bf16 rows
   widened into `buf`. */
static inline const float *row_f32(const void *cache, int64_t slot, int row, int bf16, float *buf) {
    if (!bf16) return (const float *)cache + slot * row;
    const uint16_t *src = (const uint16_t *)cache + slot * row;
    for (int d = 0; d < row; d++) buf[d] = bf16_to_f32(src[d]);
    return buf;
}

/* What every pass needs to find a request's cached rows. */
typedef struct {
    const void *k_cache, *v_cache;
    const int32_t *table;  /* this request's block table */
    int seq_len, block_size, num_kv_heads, group, head_dim, bf16;
} Seq;

static inline int64_t slot_of(const Seq *s, int p) {
    return (int64_t)s->table[p / s->block_size] * s->block_size + p % s->block_size;
}

/* Each row of scores [rows][len] -> its softmax weights. */
static void softmax_rows(float *scores, int rows, int len) {
    for (int r = 0; r < rows; r++) {
        float *row = scores + (int64_t)r * len, max_score = -FLT_MAX, total = 0.f;
        for (int p = 0; p < len; p++) max_score = row[p] > max_score ? row[p] : max_score;
        for (int p = 0; p < len; p++) total += (row[p] = expf(row[p] - max_score));
        for (int p = 0; p < len; p++) row[p] /= total;
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

/* The vector type: as many float lanes as this CPU's widest vector register holds. */
#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif
typedef float vfloat __attribute__((vector_size(4 * LANES)));
typedef uint32_t vuint32 __attribute__((vector_size(4 * LANES)));
typedef uint16_t vuint16 __attribute__((vector_size(2 * LANES)));
#define MAX_NJ (128 / LANES) /* head_dim up to 128 */

/* Why prefetch: blocks lie anywhere in the cache, and the hardware prefetcher stops at each page
   edge, so without a hint every block starts with a stall. Asking for K rows 4 positions ahead
   and the next V block while this one is summed took the bench step's attention from ~67 to
   ~56 ms in float32 (from ~56 to ~43 in bfloat16) on an AVX-512 machine. */
enum { PREFETCH_ROWS = 4 };

static inline void prefetch(const char *start, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(start + b);
}

/* LANES values of a cache row from `row` as float32 (bf16: widen by shifting into the top half).
   memcpy is how C loads an unaligned vector; it compiles to one vector load. */
static inline vfloat load_lanes(const void *row, int bf16) {
    vfloat v;
    if (!bf16) {
        memcpy(&v, row, sizeof v);
        return v;
    }
    vuint16 narrow;
    memcpy(&narrow, row, sizeof narrow);
    vuint32 wide = __builtin_convertvector(narrow, vuint32) << 16;
    memcpy(&v, &wide, sizeof v);
    return v;
}

static inline float sum_lanes(vfloat v) {
    float total = 0.f;
    for (int i = 0; i < LANES; i++) total += v[i];
    return total;
}

/* The same two passes, head_dim = LANES * nj. Always inlined with constant nj and bf16, so the
   compiler unrolls the j loops and keeps k[] and a[] in vector registers. */
static inline __attribute__((always_inline)) void
passes_simd(const Seq *s, const float *q, float *scores, float *acc, const int nj, const int bf16) {
    const int head_dim = LANES * nj, size = bf16 ? 2 : 4;
    const int64_t row_bytes = (int64_t)s->num_kv_heads * head_dim * size;
    for (int p = 0; p < s->seq_len; p++) {
        const char *row = (const char *)s->k_cache + slot_of(s, p) * row_bytes;
        if (p + PREFETCH_ROWS < s->seq_len)
            prefetch((const char *)s->k_cache + slot_of(s, p + PREFETCH_ROWS) * row_bytes, row_bytes);
        for (int h = 0; h < s->num_kv_heads; h++) {
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
    /* Block by block (its rows stay in L1): each query head's sum in registers over the block. */
    for (int p0 = 0; p0 < s->seq_len; p0 += s->block_size) {
        const char *block = (const char *)s->v_cache + slot_of(s, p0) * row_bytes;
        const int n = s->seq_len - p0 < s->block_size ? s->seq_len - p0 : s->block_size;
        const int next = p0 + s->block_size, next_n = s->seq_len - next;
        if (next_n > 0)
            prefetch((const char *)s->v_cache + slot_of(s, next) * row_bytes,
                     (next_n < s->block_size ? next_n : s->block_size) * row_bytes);
        for (int qh = 0; qh < s->num_kv_heads * s->group; qh++) {
            const char *head = block + (qh / s->group) * head_dim * size;
            const float *w = scores + (int64_t)qh * s->seq_len + p0;
            vfloat a[MAX_NJ];
            for (int j = 0; j < nj; j++) a[j] = load_lanes(acc + qh * head_dim + LANES * j, 0);
            for (int p = 0; p < n; p++) {
                const float wp = w[p];
                for (int j = 0; j < nj; j++)
                    a[j] += wp * load_lanes(head + p * row_bytes + LANES * j * size, bf16);
            }
            for (int j = 0; j < nj; j++) memcpy(acc + qh * head_dim + LANES * j, &a[j], sizeof a[j]);
        }
    }
}

/* The SIMD passes when head_dim is LANES * nj, up to 128; else returns 0 (use the plain ones). */
static int passes_simd_if_supported(const Seq *s, const float *q, float *scores, float *acc) {
#define NJ_CASE(nj) \
    case nj: s->bf16 ? passes_simd(s, q, scores, acc, nj, 1) : passes_simd(s, q, scores, acc, nj, 0); return 1;
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
#pragma omp parallel for schedule(dynamic) num_threads(num_threads)
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
        if (!passes_simd_if_supported(&s, q, scores, acc)) {
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
