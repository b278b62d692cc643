/* prefill_attention.c: paged causal attention on CPU for requests with several new tokens
   (prefills, chunked prefills, prefix-cache hits), reading K/V straight from the cache.

   Built and loaded with the other CPU kernels by nanoserve/cpu/kernels.py. Why C: torch's
   path gathers each request's blocks into a copy and calls SDPA per request, which runs far below
   the rate at which the same cores multiply matrices; prefill is compute-bound, so that rate is
   what counts.

   Flash attention (one pass, online softmax), with the query ROWS in the vector lanes: a task is
   one request, one query head and a tile of LANES consecutive query tokens. Its queries are
   transposed once into qt[d] (lane r = token r's d-th value), so that

       score[c] (lane r)  = sum_d qt[d] * k_c[d]         k_c[d]: one float, broadcast
       out_t[d] (lane r) += sum_c weight[c] * v_c[d]      v_c[d]: one float, broadcast

   are plain vector FMAs over K and V rows read in place from the cache: no transposed K, no
   horizontal sums, and the softmax's max and sum are lane-wise too. bf16 on a CPU with
   AVX512-BF16: the scores by its dot product of bf16 pairs (qt[i] holds values 2i and 2i + 1, the
   K row is read as pairs, unwidened); and the weighted sum of V two keys at a time: each lane
   holds token r's weights for keys c and c + 1, rounded to bf16 (as torch's CPU flash attention
   rounds them before its product with V), and each V pair is those keys' bf16 values of one
   dimension, broadcast.
   bf16 on a CPU with AMX (Sapphire Rapids and later Xeons; head_dim a multiple of 32, blocks a
   multiple of 16 positions): the same tiles with both products in AMX's tile registers, so only
   the softmax stays in vectors (attend_tile_amx below).
   A tile's query goes into the lanes, and its output back into rows, by AVX-512 gathers (not
   value by value through memory, which stalls each vector load on 16 narrow stores).
   The measurements behind these choices, each on the CPU it names: scripts/results/README.md.
   Keys go CHUNK positions at a time; the causal mask only touches chunks past the tile's first
   position (token r at position first + r sees keys 0..first + r).

   Worked example, LANES 4, a 6-token prompt: tiles are tokens 0-3 and 4-5 (lanes 2-3 idle);
   tile 0 reads keys 0..3 and masks key 3 for tokens 0, 1, 2, key 2 for 0, 1, key 1 for 0.
*/
#include "cpu_kernels.h"

enum { CHUNK = 8 }; /* key positions per step: CHUNK score vectors + one query vector in registers */

/* One KV head's row (`offset` into the cached row of every KV head) as float32: fp32 in place,
   bf16 widened into `buf`. */
static inline const float *head_row(const void *cache, int64_t slot, int kv_row, int offset,
                                    int head_dim, int bf16, float *buf) {
    const int64_t at = slot * kv_row + offset;
    if (!bf16) return (const float *)cache + at;
    for (int d = 0; d < head_dim; d++) buf[d] = bf16_to_f32(((const uint16_t *)cache)[at + d]);
    return buf;
}

/* The online softmax's step over n keys (both tile loops): the causal mask where its edge runs
   through keys p0..p0 + n - 1 (lane r is the token at position[r]), then the running max and total
   updated and score[] turned into weights e^(scale (score - max)), as 2^(score c - max c) with
   c = `log2_scale` (scale log2 e: scores and max stay unscaled). Returns the factor the sums so far
   are rescaled by. */
static inline __attribute__((always_inline)) vfloat
online_softmax(vfloat *score, const int n, int p0, int first, vint32 position, vfloat *max_score,
               vfloat *total, float log2_scale) {
    if (p0 + n - 1 > first)
        for (int c = 0; c < n; c++) score[c] = select_lanes(position >= p0 + c, score[c], splat(-FLT_MAX));
    vfloat new_max = *max_score;
    for (int c = 0; c < n; c++) new_max = max_lanes(new_max, score[c]);
    const vfloat rescale = exp2_lanes((*max_score - new_max) * log2_scale), shift = new_max * log2_scale;
    *total *= rescale;
    for (int c = 0; c < n; c++) *total += (score[c] = exp2_lanes(score[c] * log2_scale - shift));
    *max_score = new_max;
    return rescale;
}

/* out rows row0.. of query head qh: each lane's sums divided by its total. Row r is lane r of
   every ot[d]: on AVX-512 gathered LANES dimensions at a time from the (L1-resident) ot and stored
   as a vector. (Assembled value by value into a row and then loaded as a vector, each load would
   wait for 16 narrow stores to land.) */
static void store_tile(void *out, const vfloat *ot, vfloat total, int64_t row0, int rows, int q_row,
                       int qh, int hd, int bf16) {
    const vfloat inverse = 1.f / total;
    const int size = bf16 ? 2 : 4;
    for (int r = 0; r < rows; r++) {
        char *dest = (char *)out + ((row0 + r) * q_row + qh * hd) * size;
        int d = 0;
#if LANES == 16
        for (; d + LANES <= hd; d += LANES)
            store_lanes(dest + d * size,
                        (vfloat)_mm512_i32gather_ps(lane_offsets(LANES), (const float *)(ot + d) + r, 4) * inverse[r],
                        bf16);
#endif
        for (; d < hd; d++) store_at(dest, d, ot[d][r] * inverse[r], bf16);
    }
}

#ifdef DPBF16
/* bf16 pairs: qt[i] lane r holds token r's query values 2i and 2i + 1 as they are (unscaled, so
   each product is exact in float32); the scale goes into the softmax's exponent. One gather per
   pair, lane r from token r's row (q_row / 2 pairs apart); lanes past `rows` zero. */
static void query_pairs(vfloat *qt, const void *query, int64_t row0, int rows, int q_row, int qh, int hd) {
    const int32_t *pairs = (const int32_t *)((const uint16_t *)query + row0 * q_row + qh * hd);
    const __m512i row_apart = lane_offsets(q_row / 2);
    const __mmask16 valid = (__mmask16)((1u << rows) - 1);
    for (int i = 0; i < hd / 2; i++)
        qt[i] = (vfloat)_mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, row_apart, pairs + i, 4);
}

/* Lane r: (weight of key c, of key c + 1) for token r, as bf16 pairs. vcvtne2ps2bf16 rounds to
   nearest even like f32_to_bf16, except that weights below 1.2e-38 (denormal) become 0; its words
   0-15 are one key's weights, 16-31 the next key's: interleaved. */
static const uint16_t PAIR_ORDER[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                        8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

static inline __m512i weight_pairs(vfloat key_c, vfloat key_next) {
    return _mm512_permutexvar_epi16(_mm512_loadu_si512(PAIR_ORDER),
                                    (__m512i)_mm512_cvtne2ps_pbh((__m512)key_next, (__m512)key_c));
}
#endif

/* One task: query head `qh` of `rows` (<= LANES) consecutive tokens of one request, the first at
   flat row `row0` and position `first`. qt, ot: head_dim vectors of scratch; kbuf, vbuf: CHUNK
   widened K and V rows of one head (bf16 only). */
static void attend_tile(const Seq *s, const void *query, void *out, int64_t row0, int rows,
                        int first, int qh, float scale, vfloat *qt, vfloat *ot, float *kbuf, float *vbuf) {
    const int hd = s->head_dim, q_row = s->num_kv_heads * s->group * hd, kv_row = s->num_kv_heads * hd;
    const int kv_offset = (qh / s->group) * hd, key_end = first + rows;
    for (int d = 0; d < hd; d++) qt[d] = ot[d] = splat(0.f);
#ifdef DPBF16
    const int pairs = s->bf16 && hd % 2 == 0;   /* see query_pairs */
    if (pairs) query_pairs(qt, query, row0, rows, q_row, qh, hd);
#else
    const int pairs = 0;
#endif
    if (!pairs)
        for (int r = 0; r < rows; r++)
            for (int d = 0; d < hd; d++) qt[d][r] = scale * value_at(query, (row0 + r) * q_row + qh * hd + d, s->bf16);
    vint32 position = {0};
    for (int r = 0; r < LANES; r++) position[r] = first + r;
    vfloat max_score = splat(-FLT_MAX), total = splat(0.f);
    for (int p0 = 0; p0 < key_end; p0 += CHUNK) {
        const float *k[CHUNK], *v[CHUNK];
        int block = p0 / s->block_size, offset = p0 % s->block_size;   /* one division a chunk */
        for (int c = 0; c < CHUNK; c++, offset++) {
            if (offset == s->block_size) block++, offset = 0;
            /* past key_end: any valid row (the first), masked below */
            const int64_t slot = p0 + c < key_end ? (int64_t)s->table[block] * s->block_size + offset
                                                  : slot_of(s, 0);
            k[c] = pairs ? (const float *)((const uint16_t *)s->k_cache + slot * kv_row + kv_offset)
                         : head_row(s->k_cache, slot, kv_row, kv_offset, hd, s->bf16, kbuf + c * hd);
            v[c] = pairs ? (const float *)((const uint16_t *)s->v_cache + slot * kv_row + kv_offset)
                         : head_row(s->v_cache, slot, kv_row, kv_offset, hd, s->bf16, vbuf + c * hd);
        }
        vfloat score[CHUNK];
        for (int c = 0; c < CHUNK; c++) score[c] = splat(0.f);
#ifdef DPBF16
        if (pairs) {   /* k[c]: the cached bf16 row itself, read as hd / 2 pairs */
            for (int i = 0; i < hd / 2; i++) {
                const __m512bh q = (__m512bh)(__m512i)qt[i];
                for (int c = 0; c < CHUNK; c++)
                    score[c] = (vfloat)_mm512_dpbf16_ps((__m512)score[c], q,
                                                        (__m512bh)_mm512_set1_epi32(((const int32_t *)k[c])[i]));
            }
        } else
#endif
        for (int d = 0; d < hd; d++) {
            const vfloat q = qt[d];
            for (int c = 0; c < CHUNK; c++) score[c] += q * k[c][d];
        }
        const vfloat rescale = online_softmax(score, CHUNK, p0, first, position, &max_score, &total,
                                              pairs ? scale * LOG2E : LOG2E);   /* not pairs: q scaled */
#ifdef DPBF16
        if (pairs) {   /* keys c and c + 1 at once: their bf16 weights and V values in each lane */
            uint32_t *v_pairs = (uint32_t *)vbuf;   /* [c / 2][d]: V rows c and c + 1, dimension d */
            for (int c = 0; c < CHUNK; c += 2)
                for (int d = 0; d < hd; d++)
                    v_pairs[c / 2 * hd + d] = ((const uint16_t *)v[c])[d] | (uint32_t)((const uint16_t *)v[c + 1])[d] << 16;
            __m512bh weights[CHUNK / 2];
            for (int c = 0; c < CHUNK; c += 2) weights[c / 2] = (__m512bh)weight_pairs(score[c], score[c + 1]);
            for (int d = 0; d < hd; d++) {
                __m512 o = (__m512)(ot[d] * rescale);
                for (int c = 0; c < CHUNK / 2; c++)
                    o = _mm512_dpbf16_ps(o, weights[c], (__m512bh)_mm512_set1_epi32((int)v_pairs[c * hd + d]));
                ot[d] = (vfloat)o;
            }
            continue;
        }
#endif
        for (int d = 0; d < hd; d++) {
            vfloat o = ot[d] * rescale;
            for (int c = 0; c < CHUNK; c++) o += score[c] * v[c][d];
            ot[d] = o;
        }
    }
    store_tile(out, ot, total, row0, rows, q_row, qh, hd, s->bf16);
}

#ifdef AMX
/* bf16 with AMX (head_dim a multiple of 32, block_size of 16): the same tile of LANES = 16 query
   tokens, with both products in AMX tiles and only the softmax in vectors. Keys go 32 at a time.
     scores^T [16 keys][16 tokens] = K [16 keys][32 dims] x qt [16 dim pairs][16 tokens]
       K: 16 cached rows read in place (one block holds them: the tile's row stride is the cache
       row); qt: the query pairs above, which are exactly AMX's pair layout for the right operand.
       A row of the result is one key's score for every token: the vector `score[c]` below.
     out^T [16 dims][16 tokens] += V^T [16 dims][32 keys] x weights [16 key pairs][16 tokens]
       weights: the bf16 pairs (key c, key c + 1) in each lane, as the AVX512-BF16 loop builds
       them; V^T: the request's V transposed once per KV head (`transpose_v`), shared by every
       tile and query head that reads it. A row of out^T is `ot[d]`, rescaled in vectors.
   Tiles: 0 scores, 1 K, 2 qt, 3 out, 4 V^T, 5 weights (each thread sets their shapes once).
   V transposed by 16 x 16 blocks in registers and the weights by exp2_lanes with the scale folded
   in (cpu_kernels.h). */
enum { KEYS = 32 };

/* V of KV head h of a request, transposed: vt[d][p] (bf16), `len` (seq_len rounded up to KEYS)
   positions a row, zeros past seq_len so that the last keys' weights of 0 multiply zeros.
   16 positions (one block holds them) x 32 dimensions at a time: each row's 16 pairs of bf16 are
   16 32-bit values, transposed in registers (transpose_16x16); a pair's vector then holds dims d,
   d + 1 of the 16 positions, interleaved, which one permute splits into the two rows of vt. */
static void transpose_v(const Seq *s, int h, uint16_t *vt, int len) {
    const int hd = s->head_dim, kv_row = s->num_kv_heads * hd;
    __m512i split;   /* 16-bit lanes 0, 2, .., 30 (dim d of each position), then 1, 3, .., 31 (d + 1) */
    for (int k = 0; k < 32; k++) ((uint16_t *)&split)[k] = (uint16_t)(k < 16 ? 2 * k : 2 * (k - 16) + 1);
    for (int p0 = 0; p0 < len; p0 += 16) {
        const int rows = s->seq_len - p0;   /* the others zero */
        const uint16_t *first = rows > 0 ? (const uint16_t *)s->v_cache + slot_of(s, p0) * kv_row + h * hd : NULL;
        for (int d0 = 0; d0 < hd; d0 += 32) {
            __m512 pairs[16];
            if (rows >= 16) transpose_16x16(first + d0, (int64_t)kv_row * 2, pairs);
            else {
                float part[16][16] = {{0}};
                for (int r = 0; r < rows; r++) memcpy(part[r], first + (int64_t)r * kv_row + d0, 64);
                transpose_16x16(part, 64, pairs);
            }
            for (int j = 0; j < 16; j++) {
                const __m512i both = _mm512_permutexvar_epi16(split, (__m512i)pairs[j]);
                _mm256_storeu_si256((__m256i *)(vt + (int64_t)(d0 + 2 * j) * len + p0), _mm512_castsi512_si256(both));
                _mm256_storeu_si256((__m256i *)(vt + (int64_t)(d0 + 2 * j + 1) * len + p0), _mm512_extracti64x4_epi64(both, 1));
            }
        }
    }
}

static inline int keys_padded(int seq_len) { return (seq_len + KEYS - 1) / KEYS * KEYS; }

static void attend_tile_amx(const Seq *s, const void *query, void *out, int64_t row0, int rows,
                            int first, int qh, float scale, vfloat *qt, vfloat *ot,
                            const uint16_t *vt, int len) {
    const int hd = s->head_dim, q_row = s->num_kv_heads * s->group * hd, kv_row = s->num_kv_heads * hd;
    const int h = qh / s->group, key_end = first + rows;
    for (int d = 0; d < hd; d++) qt[d] = ot[d] = splat(0.f);
    query_pairs(qt, query, row0, rows, q_row, qh, hd);
    vint32 position = {0};
    for (int r = 0; r < LANES; r++) position[r] = first + r;
    vfloat max_score = splat(-FLT_MAX), total = splat(0.f);
    float scores[KEYS][16] __attribute__((aligned(64))), sums[16][16] __attribute__((aligned(64)));
    uint32_t weights[KEYS / 2][16] __attribute__((aligned(64)));
    for (int p0 = 0; p0 < key_end; p0 += KEYS) {
        for (int c0 = p0; c0 < p0 + KEYS; c0 += 16) {
            if (c0 >= key_end) {   /* past every token's last key: no cached rows to read */
                for (int c = c0 - p0; c < c0 - p0 + 16; c++) *(vfloat *)scores[c] = splat(-FLT_MAX);
                continue;
            }
            const uint16_t *k = (const uint16_t *)s->k_cache + (slot_of(s, c0) * kv_row + h * hd);
            _tile_zero(0);
            for (int i = 0; i < hd / 32; i++) {
                _tile_loadd(1, k + 32 * i, kv_row * 2);
                _tile_loadd(2, qt + 16 * i, 64);
                _tile_dpbf16ps(0, 1, 2);
            }
            _tile_stored(0, scores[c0 - p0], 64);
        }
        vfloat score[KEYS];
        for (int c = 0; c < KEYS; c++) score[c] = *(vfloat *)scores[c];
        const vfloat rescale = online_softmax(score, KEYS, p0, first, position, &max_score, &total,
                                              scale * LOG2E);
        for (int c = 0; c < KEYS; c += 2) _mm512_store_si512(weights[c / 2], weight_pairs(score[c], score[c + 1]));
        _tile_loadd(5, weights, 64);
        for (int d0 = 0; d0 < hd; d0 += 16) {
            _tile_zero(3);
            _tile_loadd(4, vt + (int64_t)d0 * len + p0, len * 2);
            _tile_dpbf16ps(3, 4, 5);
            _tile_stored(3, sums, 64);
            for (int d = 0; d < 16; d++) ot[d0 + d] = ot[d0 + d] * rescale + *(vfloat *)sums[d];
        }
    }
    store_tile(out, ot, total, row0, rows, q_row, qh, hd, 1);
}
#endif

/* out[t] = causal attention of query[t] for every token t of the `num_reqs` requests: request i
   has query_len[i] tokens from flat row query_start[i], the last at position seq_lens[i] - 1.
   Returns 0, or 1 when out of memory (the caller then uses torch). */
int prefill_attention(const void *query, void *out, const void *k_cache, const void *v_cache,
                      const int32_t *query_start, const int32_t *query_len,
                      const int32_t *block_table_rows, const int32_t *seq_lens, int num_reqs,
                      int max_blocks, int block_size, int num_kv_heads, int group, int head_dim,
                      float scale, int bf16, int num_threads) {
    const int num_q_heads = num_kv_heads * group;
    int num_tiles = 0, failed = 0;
    for (int i = 0; i < num_reqs; i++) num_tiles += (query_len[i] + LANES - 1) / LANES;
    int *tile_req = malloc(sizeof(int) * (num_tiles + 1)), *tile_first = malloc(sizeof(int) * (num_tiles + 1));
    if (!tile_req || !tile_first) { free(tile_req); free(tile_first); return 1; }
    for (int i = 0, t = 0; i < num_reqs; i++)
        for (int j = 0; j < query_len[i]; j += LANES, t++) tile_req[t] = i, tile_first[t] = j;
    uint16_t *vt = NULL;   /* AMX: every request's V transposed, per KV head (transpose_v) */
    int64_t *vt_at = NULL;
#ifdef AMX
    if (bf16 && head_dim % 32 == 0 && block_size % 16 == 0 && amx_ready()) {
        vt_at = malloc(sizeof(int64_t) * (num_reqs + 1));   /* where request i's transposes start */
        if (vt_at) {
            vt_at[0] = 0;
            for (int i = 0; i < num_reqs; i++)
                vt_at[i + 1] = vt_at[i] + (int64_t)keys_padded(seq_lens[i]) * num_kv_heads * head_dim;
            vt = malloc(sizeof(uint16_t) * (size_t)vt_at[num_reqs]);
        }
        if (!vt) { free(vt_at); free(tile_req); free(tile_first); return 1; }
#pragma omp parallel for schedule(dynamic) num_threads(num_threads)
        for (int task = 0; task < num_reqs * num_kv_heads; task++) {
            const int i = task / num_kv_heads, h = task % num_kv_heads, len = keys_padded(seq_lens[i]);
            const Seq s = {k_cache, v_cache, block_table_rows + (int64_t)i * max_blocks, seq_lens[i],
                           block_size, num_kv_heads, group, head_dim, bf16};
            transpose_v(&s, h, vt + vt_at[i] + (int64_t)h * head_dim * len, len);
        }
    }
#endif
#pragma omp parallel num_threads(num_threads)
    {
        const size_t vectors = sizeof(vfloat) * 2 * head_dim, rows = sizeof(float) * 2 * CHUNK * head_dim;
        vfloat *qt = aligned_alloc(sizeof(vfloat), vectors);
        float *kbuf = malloc(rows);
        if (!qt || !kbuf) failed = 1;
#ifdef AMX
        if (vt) amx_configure((const uint8_t[8]){16, 16, 16, 16, 16, 16, 16, 16});
#endif
#pragma omp for schedule(dynamic)
        for (int task = 0; task < num_tiles * num_q_heads; task++) {
            if (!qt || !kbuf) continue;
            const int t = task / num_q_heads, qh = task % num_q_heads, i = tile_req[t], j = tile_first[t];
            const Seq s = {k_cache, v_cache, block_table_rows + (int64_t)i * max_blocks, seq_lens[i],
                           block_size, num_kv_heads, group, head_dim, bf16};
            const int rows = query_len[i] - j < LANES ? query_len[i] - j : LANES;
#ifdef AMX
            if (vt) {
                const int len = keys_padded(seq_lens[i]);
                attend_tile_amx(&s, query, out, query_start[i] + j, rows, seq_lens[i] - query_len[i] + j,
                                qh, scale, qt, qt + head_dim, vt + vt_at[i] + (int64_t)(qh / group) * head_dim * len, len);
                continue;
            }
#endif
            attend_tile(&s, query, out, query_start[i] + j, rows, seq_lens[i] - query_len[i] + j, qh,
                        scale, qt, qt + head_dim, kbuf, kbuf + CHUNK * head_dim);
        }
#ifdef AMX
        if (vt) _tile_release();
#endif
        free(qt);
        free(kbuf);
    }
    free(vt);
    free(vt_at);
    free(tile_req);
    free(tile_first);
    return failed;
}
