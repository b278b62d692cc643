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

/* Token slot `p`'s row of a [num_slots, row] cache as float32: fp32 rows are used in place, bf16
   rows widened into `buf`. */
static inline const float *row_f32(const void *cache, int64_t slot, int row, int bf16, float *buf) {
    if (!bf16) return (const float *)cache + slot * row;
    const uint16_t *src = (const uint16_t *)cache + slot * row;
    for (int d = 0; d < row; d++) buf[d] = bf16_to_f32(src[d]);
    return buf;
}

/* Returns 0, or 1 when out of memory (the caller then uses torch). */
int decode_attention(const void *query, void *out, const void *k_cache, const void *v_cache,
                     const int32_t *token_index, const int32_t *block_table_rows,
                     const int32_t *seq_lens, int num_tokens, int max_blocks, int block_size,
                     int num_kv_heads, int group, int head_dim, float scale, int bf16,
                     int num_threads) {
    const int num_q_heads = num_kv_heads * group, q_row = num_q_heads * head_dim;
    const int kv_row = num_kv_heads * head_dim;
    int failed = 0;
#pragma omp parallel for schedule(dynamic) num_threads(num_threads)
    for (int i = 0; i < num_tokens; i++) {
        const int32_t *table = block_table_rows + (int64_t)i * max_blocks;
        const int seq_len = seq_lens[i];
        /* q, acc: [num_q_heads][head_dim]; scores: [num_q_heads][seq_len]; buf: one widened row. */
        float *q = malloc(sizeof(float) * ((size_t)2 * q_row + (size_t)num_q_heads * seq_len + q_row));
        if (!q) { failed = 1; continue; }
        float *acc = q + q_row, *scores = acc + q_row, *buf = scores + (size_t)num_q_heads * seq_len;
        const float *query_row = row_f32(query, token_index[i], q_row, bf16, buf);
        for (int d = 0; d < q_row; d++) q[d] = query_row[d] * scale;
        /* Pass 1: scores = q . k over every cached position, block by block. */
        for (int p0 = 0; p0 < seq_len; p0 += block_size) {
            const int64_t slot0 = (int64_t)table[p0 / block_size] * block_size;
            for (int p = p0; p < seq_len && p < p0 + block_size; p++) {
                const float *k = row_f32(k_cache, slot0 + p - p0, kv_row, bf16, buf);
                for (int qh = 0; qh < num_q_heads; qh++) {
                    const float *qv = q + qh * head_dim, *kv = k + (qh / group) * head_dim;
                    float s = 0.f;
                    for (int d = 0; d < head_dim; d++) s += qv[d] * kv[d];
                    scores[(int64_t)qh * seq_len + p] = s;
                }
            }
        }
        /* Softmax weights per head (unnormalised: divided by `total` at the end). */
        for (int qh = 0; qh < num_q_heads; qh++) {
            float *row = scores + (int64_t)qh * seq_len, max_score = -FLT_MAX, total = 0.f;
            for (int p = 0; p < seq_len; p++) max_score = row[p] > max_score ? row[p] : max_score;
            for (int p = 0; p < seq_len; p++) total += (row[p] = expf(row[p] - max_score));
            for (int p = 0; p < seq_len; p++) row[p] /= total;
        }
        /* Pass 2: acc = sum over positions of weight * v. */
        memset(acc, 0, sizeof(float) * q_row);
        for (int p0 = 0; p0 < seq_len; p0 += block_size) {
            const int64_t slot0 = (int64_t)table[p0 / block_size] * block_size;
            for (int p = p0; p < seq_len && p < p0 + block_size; p++) {
                const float *v = row_f32(v_cache, slot0 + p - p0, kv_row, bf16, buf);
                for (int qh = 0; qh < num_q_heads; qh++) {
                    const float w = scores[(int64_t)qh * seq_len + p], *vv = v + (qh / group) * head_dim;
                    float *a = acc + qh * head_dim;
                    for (int d = 0; d < head_dim; d++) a[d] += w * vv[d];
                }
            }
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
