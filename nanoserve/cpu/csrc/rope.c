/* rope.c: RoPE on the fused q/k/v rows, and k and v written straight into the paged KV cache.

   Built and loaded with the other CPU kernels by nanoserve/cpu/kernels.py. Why C: in torch this is
   apply_rope on q and on k (split, four products, a subtraction, an addition and a concatenation
   each) and store_kv's two index copies: some twenty ops a layer, in a decode step mostly dispatch
   overhead. Here it is one pass over each token's qkv row.

   The numbers are the torch path's (nanoserve/layers.py:apply_rope, HF's layout: dim i pairs with
   dim i + head_dim / 2), with the same roundings to the model dtype after every product and sum:
       out[i]            = x[i] * cos[i] - x[i + half] * sin[i]
       out[i + half]     = x[i + half] * cos[i] + x[i] * sin[i]
   cos and sin are the step's per-token tables, already in the model dtype (RotaryEmbedding).
   Token t's k and v go to cache slot slot_mapping[t] (design §5; none where it is < 0: a padded
   row), q to row t of q_out.
*/
#include "cpu_kernels.h"

/* Rotate one head: head_dim values from `src` into `dst`. restrict: the compiler may then vectorise
   without checking for overlap (q_out and the caches never overlap qkv). */
static inline __attribute__((always_inline)) void
rotate(const void *restrict src, void *restrict dst, const void *restrict cos,
       const void *restrict sin, int half, const int bf16) {
    const int size = bf16 ? 2 : 4;
    const char *x = src, *c_at = cos, *s_at = sin;
    char *out = dst;
    int i = 0;
    /* LANES pairs at a time in explicit vectors: the compiler's own vectorising of the loop below
       chose half-width vectors (slower; the measurements: scripts/results/README.md). */
    for (; i + LANES <= half; i += LANES) {
        const vfloat x1 = load_lanes(x + i * size, bf16), x2 = load_lanes(x + (half + i) * size, bf16);
        const vfloat c = load_lanes(c_at + i * size, bf16), s = load_lanes(s_at + i * size, bf16);
        vfloat a = x1 * c, b = x2 * s, d = x2 * c, e = x1 * s;
        if (bf16) a = rounded_lanes(a), b = rounded_lanes(b), d = rounded_lanes(d), e = rounded_lanes(e);
        store_lanes(out + i * size, a - b, bf16);
        store_lanes(out + (half + i) * size, d + e, bf16);
    }
    for (; i < half; i++) {
        const float x1 = value_at(src, i, bf16), x2 = value_at(src, half + i, bf16);
        const float c = value_at(cos, i, bf16), s = value_at(sin, i, bf16);
        store_at(dst, i, rounded(x1 * c, bf16) - rounded(x2 * s, bf16), bf16);
        store_at(dst, half + i, rounded(x2 * c, bf16) + rounded(x1 * s, bf16), bf16);
    }
}

/* One token: its q heads into q_out, k and v into their cache slot. */
static inline __attribute__((always_inline)) void
rope_token(const char *src, const char *cos, const char *sin, char *q, char *k, char *v,
           int num_heads, int num_kv_heads, int head_dim, const int bf16) {
    const int size = bf16 ? 2 : 4, bytes = head_dim * size;
    for (int h = 0; h < num_heads; h++) rotate(src + h * bytes, q + h * bytes, cos, sin, head_dim / 2, bf16);
    if (!k) return;   /* no cache slot: a padded row of a captured step stores nothing */
    for (int h = 0; h < num_kv_heads; h++)
        rotate(src + (num_heads + h) * bytes, k + h * bytes, cos, sin, head_dim / 2, bf16);
    memcpy(v, src + (num_heads + num_kv_heads) * bytes, (size_t)num_kv_heads * bytes);
}

/* qkv: [num_tokens][(num_heads + 2 * num_kv_heads) * head_dim], q then k then v heads; cos, sin:
   [num_tokens][head_dim / 2]; q_out: [num_tokens][num_heads * head_dim]; caches: [slots][num_kv_heads
   * head_dim]. */
void rope_store_kv(const void *qkv, const void *cos, const void *sin, const int64_t *slot_mapping,
                   void *q_out, void *k_cache, void *v_cache, int num_tokens, int num_heads,
                   int num_kv_heads, int head_dim, int bf16, int num_threads) {
    const int64_t size = bf16 ? 2 : 4, row = (num_heads + 2 * num_kv_heads) * head_dim * size;
    const int64_t q_row = num_heads * head_dim * size, kv_row = num_kv_heads * head_dim * size;
    const int64_t table_row = head_dim / 2 * size;
#pragma omp parallel for schedule(static) num_threads(THREADS_FOR(num_tokens, num_threads))
    for (int t = 0; t < num_tokens; t++) {
        /* The bf16 test inside the loop: the parallel body is a function of its own, and only a
           constant argument there gives the compiler its two vectorised copies. */
        const char *src = (const char *)qkv + t * row, *c = (const char *)cos + t * table_row;
        const char *s = (const char *)sin + t * table_row;
        const int64_t slot = slot_mapping[t];   /* < 0: no slot (step_inputs.py's padding) */
        char *q = (char *)q_out + t * q_row, *k = slot < 0 ? NULL : (char *)k_cache + slot * kv_row;
        char *v = slot < 0 ? NULL : (char *)v_cache + slot * kv_row;
        if (bf16) rope_token(src, c, s, q, k, v, num_heads, num_kv_heads, head_dim, 1);
        else rope_token(src, c, s, q, k, v, num_heads, num_kv_heads, head_dim, 0);
    }
}
