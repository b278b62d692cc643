/* gemm.c: y = x @ W.T + b for the model's Linear layers on CPU, on a weight packed once at load:
   one of the paths nanoserve/cpu/gemm.py times at start-up (`kernel`), kept only where it is the
   fastest on the machine at hand. At the end, for bf16 on a CPU with AMX, a second product on the
   weight as it is (`gemm_amx`, cpu/gemm.py's `amx` path).

   Built and loaded with the other CPU kernels by nanoserve/cpu/kernels.py. Why our own: a decode
   step multiplies 1 to 64 rows, and there a library's product (oneDNN's) can be far from the
   machine's peak, while at thousands of rows both run at the peak. The loop is the textbook one
   (BLIS's micro-kernel), its register tile (NV, MR) sized by the vector width the compiler is
   given. Its other constants are fixed, not measured on the machine at hand: ROW_BLOCK, and the
   AMX loop's prefetch distance PREFETCH_AHEAD (chosen by measurement on the CPUs named in
   scripts/results/README.md, which also has the measurements behind the choices below). What
   start-up measures is whether this product beats the other paths on each of the model's shapes
   (nanoserve/cpu/gemm.py), and it is used only where it does.

   Packing: W [N outputs, K inputs] is cut into panels of PANEL output columns, each stored k by k
   (packed[p][k][j] = W[p * PANEL + j][k]), so the inner loop reads one panel row as NV vectors.
   The last panel is padded with zero columns. bf16 weights are packed in pairs along k
   (packed[p][k / 2][j][k % 2]), the layout of AVX512-BF16's dot product of bf16 pairs.
   Worked example, PANEL 4, W 5 x 3: panel 0 holds outputs 0-3, panel 1 output 4 and three zero
   columns; W[4][2] is packed[1][2][0], element (1 * 3 + 2) * 4 + 0 = 20.

   The product: x is first copied into row tiles of MR rows, stored k by k (xp[t][k][i] = x[t * MR
   + i][k]; bf16: pairs along k, as the weights), so that a tile's MR values of one k are one
   contiguous run at one moving pointer. Each thread then takes (block of rows, panel) pairs; each
   tile keeps MR rows x PANEL columns of y in registers (float32) over the whole of K, then stores
   them (bf16: rounded once, to nearest even, as oneDNN and torch round a bf16 product). The panel
   stays in L2 across the row tiles.
   Why copy x: read in place, the MR rows are MR pointers, more than the registers left beside the
   accumulators, so the loop would reload them from the stack at every k.
   The loop multiplies only. Two fusions into it were built and measured, and lost (an A/B of 64
   requests, bf16, on AMX: the engine ran 1.037x faster without the RMSNorm done on the rows as
   they were copied, 1.024x without silu(gate) * up on gate_up's tiles; scripts/results/README.md,
   a twenty-first session), so the norm and the activation stay kernels of their own.
*/
#include "cpu_kernels.h"

#define NV 3                 /* vectors per tile row */
#define PANEL (NV * LANES)   /* output columns per panel */
#if LANES == 16
#define MR 8                 /* 8 x 3 accumulators + 3 panel vectors + 1 broadcast of 32 registers */
#else
#define MR 4                 /* AVX2 and SSE have 16 vector registers */
#endif
#define ROW_BLOCK 64         /* rows one work item covers (a decode step is one block) */

int gemm_panel_width(void) { return PANEL; }

static inline vfloat broadcast(float x) { return x - (vfloat){}; }

/* m (<= MR) rows of x (one row tile of xp) times one panel, into `sums` (store_tile then stores
   them); `bf16` and `m` constants once inlined.
   `next`: the next panel (or NULL), of which this tile asks L2 for every `every`-th k step from
   `phase` on, so that a block's row tiles (passes over the panel) share the prefetch of the next
   panel between them. Why: a decode step's panel comes from memory once and is then re-read from
   L2 by each tile of 8 rows; without the prefetch the memory stream stalls the first tile and idles
   during the others. With it, the next panel streams in across all of them.
   The k loop is unrolled 4 times, and the step that asks for `next` is counted (`fetch_at`), not
   found by k % every: that integer division would run at every k step, beside 24 FMAs. */
static inline __attribute__((always_inline)) void
tile(const void *x, const void *panel, const float *bias, float sums[MR][PANEL], int K, const int m,
     const int bf16, const char *next, int phase, int every) {
    vfloat acc[MR][NV];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 4
        for (int j = 0; j < NV; j++) memcpy(&acc[i][j], bias + j * LANES, sizeof(vfloat));
    int fetch_at = next ? phase : -1;   /* the next k step that asks for a part of `next` */
    if (!bf16) {
        const float *a = x, *b = panel;
#pragma GCC unroll 4
        for (int k = 0; k < K; k++) {
            vfloat w[NV];
#pragma GCC unroll 4
            for (int j = 0; j < NV; j++) memcpy(&w[j], b + (int64_t)k * PANEL + j * LANES, sizeof(vfloat));
            if (k == fetch_at) {
                for (int j = 0; j < NV; j++) __builtin_prefetch(next + ((int64_t)k * PANEL + j * LANES) * 4, 0, 2);
                fetch_at += every;
            }
#pragma GCC unroll 8
            for (int i = 0; i < m; i++) {
                const vfloat v = broadcast(a[(int64_t)k * MR + i]);
#pragma GCC unroll 4
                for (int j = 0; j < NV; j++) acc[i][j] += v * w[j];
            }
        }
    } else {
        const uint16_t *a = x;
        const uint32_t *b = panel;   /* a pair of bf16 weights per uint32: k even in the low half */
#pragma GCC unroll 4
        for (int k = 0; k < K; k += 2) {
            vuint32 w[NV];
#pragma GCC unroll 4
            for (int j = 0; j < NV; j++) memcpy(&w[j], b + (int64_t)(k / 2) * PANEL + j * LANES, sizeof(vuint32));
            if (k / 2 == fetch_at) {
                for (int j = 0; j < NV; j++) __builtin_prefetch(next + ((int64_t)(k / 2) * PANEL + j * LANES) * 4, 0, 2);
                fetch_at += every;
            }
#pragma GCC unroll 8
            for (int i = 0; i < m; i++) {
                const uint32_t pair = ((const uint32_t *)a)[(int64_t)(k / 2) * MR + i];   /* k, k + 1 */
#ifdef DPBF16
                const __m512i v = _mm512_set1_epi32((int)pair);
#pragma GCC unroll 4
                for (int j = 0; j < NV; j++)
                    acc[i][j] = (vfloat)_mm512_dpbf16_ps((__m512)acc[i][j], (__m512bh)v, (__m512bh)(__m512i)w[j]);
#else   /* widen each half of the pairs: the low one by a shift, the high one by a mask */
                const vfloat even = broadcast(bf16_to_f32(pair & 0xffffu)), odd = broadcast(bf16_to_f32(pair >> 16));
#pragma GCC unroll 4
                for (int j = 0; j < NV; j++)
                    acc[i][j] += even * (vfloat)(w[j] << 16) + odd * (vfloat)(w[j] & 0xffff0000u);
#endif
            }
        }
    }
    memcpy(sums, acc, sizeof(float) * m * PANEL);
}

static inline __attribute__((always_inline)) void
tile_rows(const void *x, const void *panel, const float *bias, float sums[MR][PANEL], int K, int m,
          const int bf16, const char *next, int phase, int every) {
    switch (m) {   /* one copy of the tile per row count, each with its loops unrolled */
#if MR == 8
    case 8: tile(x, panel, bias, sums, K, 8, bf16, next, phase, every); break;
    case 7: tile(x, panel, bias, sums, K, 7, bf16, next, phase, every); break;
    case 6: tile(x, panel, bias, sums, K, 6, bf16, next, phase, every); break;
    case 5: tile(x, panel, bias, sums, K, 5, bf16, next, phase, every); break;
#endif
    case 4: tile(x, panel, bias, sums, K, 4, bf16, next, phase, every); break;
    case 3: tile(x, panel, bias, sums, K, 3, bf16, next, phase, every); break;
    case 2: tile(x, panel, bias, sums, K, 2, bf16, next, phase, every); break;
    default: tile(x, panel, bias, sums, K, 1, bf16, next, phase, every); break;
    }
}

/* A tile's float32 sums (m rows) into y's rows, ldy apart, `columns` of them (bf16: rounded once,
   to nearest even, as oneDNN and torch round a bf16 product). */
static inline __attribute__((always_inline)) void
store_tile(const float sums[MR][PANEL], int m, void *y, int64_t ldy, int columns, const int bf16) {
    const int size = bf16 ? 2 : 4;
    for (int i = 0; i < m; i++) {
        char *row = (char *)y + i * ldy * size;
        for (int n = 0; n < columns; n++) store_at(row, n, sums[i][n], bf16);
    }
}

/* w [N, K] -> packed (N rounded up to PANEL columns) x K (bf16: K rounded up to even). Every
   value is written, the padding with zeros: the padding is multiplied too (by zeros of x), and
   garbage that happens to be a NaN would make the product NaN. */
void gemm_pack(const void *w, void *packed, int N, int K, int bf16) {
    const int panels = (N + PANEL - 1) / PANEL, pairs = (K + 1) / 2;
    for (int p = 0; p < panels; p++)
        for (int k = 0; k < (bf16 ? 2 * pairs : K); k++)
            for (int j = 0; j < PANEL; j++) {
                const int n = p * PANEL + j;
                const float v = n < N && k < K ? value_at(w, (int64_t)n * K + k, bf16) : 0.f;
                if (bf16) store_at(packed, (((int64_t)p * pairs + k / 2) * PANEL + j) * 2 + k % 2, v, 1);
                else store_at(packed, ((int64_t)p * K + k) * PANEL + j, v, 0);
            }
}

/* x [M, K] -> row tiles of MR rows (rows past M zero), k by k, in 4-byte units: a float32, or a
   bf16 pair (k, k + 1; an odd K's last pair is (x[K - 1], 0)). units = K, or (K + 1) / 2. */
static void pack_rows(const void *x, uint32_t *xp, int M, int K, int units, int bf16, int t) {
    uint32_t *dst = xp + (int64_t)t * MR * units;
    const int rows = M - t * MR < MR ? M - t * MR : MR, whole = bf16 && K % 2 ? units - 1 : units;
    const char *src[MR];
    for (int i = 0; i < rows; i++) src[i] = (const char *)x + (int64_t)(t * MR + i) * K * (bf16 ? 2 : 4);
    if (rows < MR) memset(dst, 0, sizeof(uint32_t) * MR * units);
    for (int u = 0; u < whole; u++)
        for (int i = 0; i < rows; i++) memcpy(dst + (int64_t)u * MR + i, src[i] + 4 * u, 4);
    if (whole < units)   /* odd K, bf16: x[K - 1] beside a zero */
        for (int i = 0; i < rows; i++) {
            uint32_t last = 0;
            memcpy(&last, src[i] + 4 * whole, 2);
            dst[(int64_t)whole * MR + i] = last;
        }
}

/* int8 weights (`--quantization int8`) are packed as a float32 weight is, one byte an element:
   packed[p][k][j]; for bf16 x, as a bf16 weight is, in k-pairs: packed[p][k / 2][j][k % 2] (K
   padded to even). Two forms multiply them, the faster one chosen by the row count (gemm_int8):
   - in registers (a decode step's few rows, or every count where it wins: cpu/gemm.py measures):
     each panel's bytes widened as they are loaded, so a decode step streams the weight once,
     reading 1 byte where bf16 reads 2.
     float32 x: the bytes widened to float32 lanes for float32 FMAs (tile_int8).
     bf16 x: integer products (tile_int16). Each row of x is first scaled by a power of two into
     int16 (pack_rows_int16: exact for every value within 2^7 of the row's largest, as a bf16
     value holds 8 significant bits; smaller ones rounded at 2^-16 of it, far below the error of
     the bf16 product itself). A k-pair of a row then meets 16 columns' k-pairs of bytes, widened
     to int16 by ONE instruction, in one multiply-add of int16 pairs into int32 lanes (AVX512-VNNI
     vpdpwssd; vpmaddwd + vpaddd on AVX2). Why: the widening to bf16 or float32 this replaced took
     six instructions per 32 weights and held a decode step to ~8 GB/s a core, short of memory's
     speed. The int32 sums are exact, and go to float32 every PAIRS_PER_SUM pairs, before they can
     overflow;
   - more rows, a widened panel: each work item first widens its panel into the thread's scratch
     (L2-sized) in the layout of x's dtype, whose tiles then run as that dtype's (bf16: pairs), so
     the widening is paid once per 64 rows, not per row tile.
   Either way the sums are of x . q; the column's scale (and the row's power of two) and the
   bias make them x . W + b. */
/* LANES int8 values as float32 lanes. GCC 12 turns __builtin_convertvector from int8 into a scalar
   loop, so AVX-512 and AVX2 name their sign-extend and convert. */
static inline vfloat widen_bytes(const int8_t *p) {
#if LANES == 16
    return (vfloat)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif LANES == 8 && defined(__AVX2__)
    return (vfloat)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    vfloat v;
    for (int i = 0; i < LANES; i++) v[i] = p[i];
    return v;
#endif
}

static inline __attribute__((always_inline)) void
tile_int8(const float *a, const int8_t *panel, float sums[MR][PANEL], int K, const int m, const int8_t *next) {
    vfloat acc[MR][NV] = {};
#pragma GCC unroll 4
    for (int k = 0; k < K; k++) {
        vfloat w[NV];
        if (next) __builtin_prefetch(next + (int64_t)k * PANEL, 0, 2);   /* the weight's stream runs ahead */
#pragma GCC unroll 4
        for (int j = 0; j < NV; j++) w[j] = widen_bytes(panel + (int64_t)k * PANEL + j * LANES);
#pragma GCC unroll 8
        for (int i = 0; i < m; i++) {
            const vfloat v = broadcast(a[(int64_t)k * MR + i]);
#pragma GCC unroll 4
            for (int j = 0; j < NV; j++) acc[i][j] += v * w[j];
        }
    }
    memcpy(sums, acc, sizeof(float) * m * PANEL);
}

/* The integer form's two instructions: 2 x LANES bytes (the k-pairs of LANES columns) as int16,
   and acc + the sums of each lane's two int16 products. */
#if LANES == 16 && defined(__AVX512BW__)
#define INT16_PRODUCTS 1
static inline vint32 widen_pair_bytes(const int8_t *p) {
    return (vint32)_mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p));
}
static inline vint32 add_pair_products(vint32 acc, vint32 x, vint32 w) {
#ifdef __AVX512VNNI__
    return (vint32)_mm512_dpwssd_epi32((__m512i)acc, (__m512i)x, (__m512i)w);
#else
    return acc + (vint32)_mm512_madd_epi16((__m512i)x, (__m512i)w);
#endif
}
#elif LANES == 8 && defined(__AVX2__)
#define INT16_PRODUCTS 1
static inline vint32 widen_pair_bytes(const int8_t *p) {
    return (vint32)_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
}
static inline vint32 add_pair_products(vint32 acc, vint32 x, vint32 w) {
#ifdef __AVXVNNI__
    return (vint32)_mm256_dpwssd_avx_epi32((__m256i)acc, (__m256i)x, (__m256i)w);
#else
    return acc + (vint32)_mm256_madd_epi16((__m256i)x, (__m256i)w);
#endif
}
#else
#define INT16_PRODUCTS 0   /* bf16 x on int8 weights: the widened-panel form alone */
#endif

#if INT16_PRODUCTS
#define PAIRS_PER_SUM 256   /* 256 pairs x 2 x 32640 x 127 < 2^31: the int32 sums cannot overflow */
/* a: the row tile's int16 k-pairs, one uint32 each (pack_rows_int16). */
static inline __attribute__((always_inline)) void
tile_int16(const uint32_t *a, const int8_t *panel, float sums[MR][PANEL], int K, const int m,
           const int8_t *next) {
    const int pairs = (K + 1) / 2;
    memset(sums, 0, sizeof(float) * MR * PANEL);
    for (int first = 0; first < pairs; first += PAIRS_PER_SUM) {
        const int end = first + PAIRS_PER_SUM < pairs ? first + PAIRS_PER_SUM : pairs;
        vint32 acc[MR][NV] = {};
#pragma GCC unroll 2
        for (int k2 = first; k2 < end; k2++) {
            vint32 w[NV];
            if (next) __builtin_prefetch(next + (int64_t)k2 * 2 * PANEL, 0, 2);
            for (int j = 0; j < NV; j++) w[j] = widen_pair_bytes(panel + ((int64_t)k2 * PANEL + j * LANES) * 2);
#pragma GCC unroll 8
            for (int i = 0; i < m; i++) {
                const vint32 v = (vint32){} + a[(int64_t)k2 * MR + i];
#pragma GCC unroll 4
                for (int j = 0; j < NV; j++) acc[i][j] = add_pair_products(acc[i][j], v, w[j]);
            }
        }
        for (int i = 0; i < m; i++)
            for (int j = 0; j < NV; j++) {
                vfloat s;
                memcpy(&s, &sums[i][j * LANES], sizeof s);
                s += __builtin_convertvector(acc[i][j], vfloat);
                memcpy(&sums[i][j * LANES], &s, sizeof s);
            }
    }
}

/* Tile t's rows of bf16 x as int16 k-pairs (pack_rows' layout), each row times the power of two
   2^(15 - e) that brings its largest magnitude (< 2^e) into [2^14, 2^15); row_scales[r] = the
   inverse, by which its sums are multiplied back. Round to nearest even by the 1.5 x 2^23 trick,
   which vectorises where a call to lrintf would not. Worked example: a row [3.0, -0.5]: largest 3
   < 2^2, so times 2^13: [24576, -4096], row scale 2^-13. */
static void pack_rows_int16(const uint16_t *x, uint32_t *xp, float *row_scales, int M, int K, int t) {
    const int units = (K + 1) / 2, rows = M - t * MR < MR ? M - t * MR : MR;
    uint32_t *dst = xp + (int64_t)t * MR * units;
    if (rows < MR) memset(dst, 0, sizeof(uint32_t) * MR * units);
    for (int i = 0; i < rows; i++) {
        const uint16_t *row = x + (int64_t)(t * MR + i) * K;
        float largest = 0.f, values[2 * units];
        for (int k = 0; k < K; k++) largest = fmaxf(largest, fabsf(bf16_to_f32(row[k])));
        int e;
        frexpf(largest, &e);
        const float up = ldexpf(1.f, 15 - e), magic = 12582912.f;   /* 1.5 x 2^23 */
        row_scales[t * MR + i] = isfinite(largest) ? ldexpf(1.f, e - 15) : NAN;
        values[2 * units - 1] = 0.f;   /* an odd K's last pair: x[K - 1] beside a zero */
        for (int k = 0; k < K; k++) values[k] = (bf16_to_f32(row[k]) * up + magic) - magic;
        for (int u = 0; u < units; u++)
            dst[(int64_t)u * MR + i] = (uint16_t)(int16_t)values[2 * u] | (uint32_t)(uint16_t)(int16_t)values[2 * u + 1] << 16;
    }
}
#define TILE_INT8(m) (bf16 ? tile_int16(a, panel, sums, K, m, next) : tile_int8(a, panel, sums, K, m, next))
#else
#define TILE_INT8(m) tile_int8(a, panel, sums, K, m, next)
#endif

/* a: x's row tile (float32 k by k, or bf16 x's int16 k-pairs). */
static inline void tile_int8_rows(const void *a, const int8_t *panel, float sums[MR][PANEL], int K, int m,
                                  const int8_t *next, int bf16) {
    (void)bf16;
    switch (m) {   /* one copy of the tile per row count, each with its loops unrolled */
#if MR == 8
    case 8: TILE_INT8(8); break;
    case 7: TILE_INT8(7); break;
    case 6: TILE_INT8(6); break;
    case 5: TILE_INT8(5); break;
#endif
    case 4: TILE_INT8(4); break;
    case 3: TILE_INT8(3); break;
    case 2: TILE_INT8(2); break;
    default: TILE_INT8(1); break;
    }
}

/* An int8 panel [k][j] (bf16: [k / 2][j][k % 2]) widened into `out` in the layout of x's dtype:
   float32 [k][j], or bf16 [k / 2][j][k % 2] (an odd K's last pair beside a zero, as packed).
   Exact: |q| <= 127 needs 8 bits of mantissa. */
static void widen_panel(const int8_t *panel, void *out, int K, int bf16) {
    if (!bf16) {
        float *o = out;
        for (int64_t i = 0; i < (int64_t)K * PANEL; i++) o[i] = panel[i];
        return;
    }
    uint16_t *o = out;
    for (int64_t i = 0; i < (int64_t)(K + 1) / 2 * 2 * PANEL; i++) {
        const float v = panel[i];
        uint32_t bits;
        memcpy(&bits, &v, 4);
        o[i] = bits >> 16;
    }
}

/* sums of x . q -> x . W + b: each row's power of two (the integer form's; NULL: none), each
   column's scale, then its bias. */
static inline void rescale(float sums[MR][PANEL], int m, const float *row_scales, const float *scale,
                           const float *bias) {
    for (int i = 0; i < m; i++) {
        const float row_scale = row_scales ? row_scales[i] : 1.f;
        for (int n = 0; n < PANEL; n++) sums[i][n] = sums[i][n] * row_scale * scale[n] + bias[n];
    }
}

/* One (row block, panel) work item of gemm_int8's product (the comment above says which form).
   row_scales: the integer form's, or NULL. */
static void int8_panel(const void *xp, const int8_t *panel, const int8_t *next, void *scratch,
                       const float *scale, const float *bias, const float *row_scales, void *y, int M,
                       int N, int K, int bf16, int block, int columns, int in_registers) {
    static const float zeros[PANEL];
    const int units = bf16 ? (K + 1) / 2 : K, end = (block + 1) * ROW_BLOCK < M ? (block + 1) * ROW_BLOCK : M;
    if (!in_registers) widen_panel(panel, scratch, K, bf16);
    for (int r = block * ROW_BLOCK; r < end; r += MR) {
        const int m = end - r < MR ? end - r : MR;
        const uint32_t *a = (const uint32_t *)xp + (int64_t)(r / MR) * MR * units;
        void *c = (char *)y + (int64_t)r * N * (bf16 ? 2 : 4);   /* y: this panel's first column */
        float sums[MR][PANEL];
        if (in_registers) tile_int8_rows(a, panel, sums, K, m, next, bf16);
        else if (bf16) tile_rows(a, scratch, zeros, sums, K, m, 1, NULL, 0, 1);
        else tile_rows(a, scratch, zeros, sums, K, m, 0, NULL, 0, 1);
        rescale(sums, m, row_scales ? row_scales + r : NULL, scale, bias);
        if (bf16) store_tile(sums, m, c, N, columns, 1);
        else store_tile(sums, m, c, N, columns, 0);
    }
}

/* gemm's product on an int8 weight: packed as above, scales and bias float32 per packed column,
   padded as gemm's bias. Up to `register_rows` rows in registers (bf16 x: where this CPU has the
   integer form), above them on widened panels (cpu/gemm.py measures where the second starts to
   win on this CPU). x and y as gemm's. y = (x . q) x scale + bias, summed in float32. Returns 0,
   or 1 when out of memory. */
int gemm_int8(const void *x, const int8_t *packed, const float *bias, void *y, int M, int N, int K,
              int bf16, const float *scales, int register_rows, int num_threads) {
    const int in_registers = M <= register_rows && (!bf16 || INT16_PRODUCTS);
    const int units = bf16 ? (K + 1) / 2 : K, panel_bytes = (bf16 ? 2 * units : K) * PANEL;
    const int panels = (N + PANEL - 1) / PANEL, blocks = (M + ROW_BLOCK - 1) / ROW_BLOCK, row_tiles = (M + MR - 1) / MR;
    const int64_t size = bf16 ? 2 : 4;
    uint32_t *xp = malloc(sizeof(uint32_t) * ((size_t)row_tiles * MR * units + 1));   /* + 1: M = 0 */
    float *row_scales = in_registers && bf16 ? malloc(sizeof(float) * ((size_t)M + 1)) : NULL;
    int failed = 0;
    if (!xp || (in_registers && bf16 && !row_scales)) {
        free(xp); free(row_scales);
        return 1;
    }
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int t = 0; t < row_tiles; t++) {
#if INT16_PRODUCTS
            if (row_scales) {
                pack_rows_int16(x, xp, row_scales, M, K, t);
                continue;
            }
#endif
            pack_rows(x, xp, M, K, units, bf16, t);
        }
        void *scratch = in_registers ? NULL : malloc((size_t)(K + 1) * PANEL * size);
        if (!in_registers && !scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for collapse(2) schedule(static)
        for (int block = 0; block < blocks; block++)
            for (int p = 0; p < panels; p++) {
                if (!in_registers && !scratch) continue;
                const int8_t *panel = packed + (int64_t)p * panel_bytes;
                const int columns = N - p * PANEL < PANEL ? N - p * PANEL : PANEL;
                int8_panel(xp, panel, p + 1 < panels ? panel + panel_bytes : NULL, scratch, scales + p * PANEL,
                           bias + p * PANEL, row_scales, (char *)y + (int64_t)p * PANEL * size, M, N, K, bf16,
                           block, columns, in_registers);
            }
        free(scratch);
    }
    free(xp);
    free(row_scales);
    return failed;
}

/* x: M x K and y: M x N, contiguous; bias: float32, padded to whole panels (zeros if none).
   Returns 0, or 1 when out of memory. */
int gemm(const void *x, const void *packed, const float *bias, void *y, int M, int N, int K, int bf16,
         int num_threads) {
    const int panels = (N + PANEL - 1) / PANEL, blocks = (M + ROW_BLOCK - 1) / ROW_BLOCK;
    const int units = bf16 ? (K + 1) / 2 : K, row_tiles = (M + MR - 1) / MR;
    const int64_t size = bf16 ? 2 : 4, panel_elems = (int64_t)units * (bf16 ? 2 : 1) * PANEL;
    uint32_t *xp = malloc(sizeof(uint32_t) * ((size_t)row_tiles * MR * units + 1));   /* + 1: M = 0 */
    if (!xp) return 1;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int t = 0; t < row_tiles; t++) pack_rows(x, xp, M, K, units, bf16, t);
#pragma omp for collapse(2) schedule(static)
        for (int block = 0; block < blocks; block++)
            for (int p = 0; p < panels; p++) {
                const void *panel = (const char *)packed + p * panel_elems * size;
                const int columns = N - p * PANEL < PANEL ? N - p * PANEL : PANEL;
                const int end = (block + 1) * ROW_BLOCK < M ? (block + 1) * ROW_BLOCK : M;
                for (int r = block * ROW_BLOCK; r < end; r += MR) {
                    const int m = end - r < MR ? end - r : MR;
                    const uint32_t *a = xp + (int64_t)(r / MR) * MR * units;
                    void *c = (char *)y + ((int64_t)r * N + p * PANEL) * size;
                    const char *next = p + 1 < panels ? (const char *)panel + panel_elems * size : NULL;
                    const int tiles = (end - block * ROW_BLOCK + MR - 1) / MR, this_tile = (r - block * ROW_BLOCK) / MR;
                    float sums[MR][PANEL];
                    if (bf16) {
                        tile_rows(a, panel, bias + p * PANEL, sums, K, m, 1, next, this_tile, tiles);
                        store_tile(sums, m, c, N, columns, 1);
                    } else {
                        tile_rows(a, panel, bias + p * PANEL, sums, K, m, 0, next, this_tile, tiles);
                        store_tile(sums, m, c, N, columns, 0);
                    }
                }
            }
    }
    free(xp);
    return 0;
}

/* bf16 on a CPU with AMX: y = x @ W.T + b with W as it is ([N, K], the checkpoint's layout), as
   AMX's left operand. A tile of W (16 output rows x 32 k) is 16 rows of 64 bytes, K * 2 bytes
   apart: a `tileloadd` straight from the weight, so no packed copy is needed and the same tensor
   serves F.linear for prefill-sized row counts (cpu/gemm.py's `amx` path). The right operand
   is x's rows in bf16 pairs along k (xb, below: 16 pairs x 16 rows a tile, packed per call: x is
   small), and the sums come out transposed: tile (n, m) holds y[m][n] for 16 n x 16 m.
   Why: a decode step multiplies 1-64 rows, where the product is a stream of the weight from
   memory, and oneDNN's runs well below the memory's speed. Each thread streams its own contiguous
   rows of W, 16 or 32 at a time (pass_amx), and asks for the rows ~PREFETCH_AHEAD bytes on before
   it needs them, into L2 (`__builtin_prefetch` locality 2: prefetcht1): into L1, the misses in
   flight are capped by L1's few fill buffers, too few for a weight that comes from memory (as in
   the engine, where the KV cache's stream has pushed it out of L3).
   K must be a multiple of 32 (gemm_amx refuses otherwise, and the caller keeps another path); N
   need not be a multiple of 16 (the last rows are copied into a zero-padded block). */
#ifdef AMX
#include <omp.h>
void silu_and_mul(const void *gate_up, void *out, int rows, int dim, int bf16, int num_threads);
/* PREFETCH_AHEAD: how far ahead in W, in bytes, each thread asks for its rows. A fixed distance,
   chosen by measurement on the CPUs named in scripts/results/README.md and not re-measured at
   start-up (the start-up timing decides only whether this product is used, and up to how many
   rows): on another machine another distance may be faster. */
#define PREFETCH_AHEAD 32768

/* 16 rows of x (row[r], K values; NULL: a row of zeros) as AMX right operands: xb[kc] = 16 pairs
   x 16 rows of uint32 (bf16 x[r][2p], x[r][2p+1]). By pointers, so that the MoE gathers its rows
   in the same pass (moe_amx). */
static void pack_block_amx(const uint16_t *const row[16], uint32_t *xb, int K) {
    float block[16][16];   /* the 16 rows' pairs of one chunk, then transposed (transpose_16x16) */
    __m512 pairs[16];
    for (int kc = 0; kc < K / 32; kc++) {
        for (int r = 0; r < 16; r++)
            _mm512_storeu_ps(block[r], row[r] ? _mm512_loadu_ps(row[r] + kc * 32) : _mm512_setzero_ps());
        transpose_16x16(block, 64, pairs);
        for (int p = 0; p < 16; p++) _mm512_storeu_ps(xb + (int64_t)kc * 256 + p * 16, pairs[p]);
    }
}

/* x [M, K]'s row block mb, packed (pack_block_amx) at xb's block mb. */
static void pack_rows_amx(const uint16_t *x, uint32_t *xb, int M, int K, int mb) {
    const uint16_t *row[16];
    for (int r = 0; r < 16; r++) row[r] = mb * 16 + r < M ? x + (int64_t)(mb * 16 + r) * K : NULL;
    pack_block_amx(row, xb + (int64_t)mb * (K / 32) * 256, K);
}

/* One sum tile (16 outputs n0.. x 16 rows m0..) + bias -> y, transposed back, rounded to bf16 as
   oneDNN rounds (to nearest even). */
static void store_transposed(float sums[16][16], const float *bias, uint16_t *y, int M, int N,
                             int n0, int m0) {
    const int outputs = N - n0 < 16 ? N - n0 : 16;
    const __m512 b = _mm512_maskz_loadu_ps((__mmask16)((1u << outputs) - 1), bias + n0);
    __m512 cols[16];
    transpose_16x16(sums, 64, cols);
    for (int r = 0; r < 16 && m0 + r < M; r++) {
        const __m256bh row = _mm512_cvtneps_pbh(_mm512_add_ps(cols[r], b));
        _mm256_mask_storeu_epi16(y + (int64_t)(m0 + r) * N + n0, (__mmask16)((1u << outputs) - 1), (__m256i)row);
    }
}

/* The sum tiles of the pass before, copied out of the tiles, which the next pass transposes into
   y one at a time between its products (`count` of them; `done` so far): the AVX-512 shuffles
   then run while the tile unit multiplies, where done after the pass they would leave it idle. */
typedef struct {
    float sums[4][16][16];
    int n0[4], m0[4], count, done;
    const float *bias;
    uint16_t *y;
    int M, N;          /* y's rows and columns */
} Pending;

static inline void store_pending(Pending *p) {
    const int e = p->done++;
    store_transposed(p->sums[e], p->bias, p->y, p->M, p->N, p->n0[e], p->m0[e]);
}

static void sum_tile_to_memory(int t, float sums[16][16]) {   /* _tile_stored takes a constant */
    switch (t) {
    case 0: _tile_stored(0, sums, 64); break;
    case 1: _tile_stored(1, sums, 64); break;
    case 2: _tile_stored(2, sums, 64); break;
    default: _tile_stored(3, sums, 64); break;
    }
}

/* One pass over K for `ng` (1-2) blocks of 16 outputs (W rows a[0..ng), K * 2 bytes apart) times
   `mg` (1-2) blocks of 16 rows of x from row block m0: ng * mg sum tiles, tile n * mg + m for
   outputs block n and rows block m; W's tiles are 4 + n, x's 7 - m (8 tiles hold it all). Why two
   by two from 17 rows on: each tdpbf16ps waits for the one before on the same sum tile, so four
   independent sums keep the unit busier than the one to three of a single W block, and two W
   tiles against two x tiles load one tile per product instead of two. Up to 16 rows (a single x
   block) the product waits on W's stream, and one block a pass is as fast.
   `fetch` (or NULL): for each of the ng W blocks, a later block of W (below `fetch_end`), asked
   for 16 lines a chunk, so that all of it is asked for by the last chunk (16 rows x K * 2 bytes =
   16 lines per 32 k). `pending`: the pass before's sums, stored into y one tile every 4 chunks,
   the rest after the pass. */
static inline __attribute__((always_inline)) void
pass_amx(const uint16_t *const a[2], const uint32_t *xb, int chunks, int m0, const int ng,
         const int mg, const char *const fetch[2], const char *fetch_end, Pending *pending) {
    _tile_zero(0);
    if (ng * mg > 1) _tile_zero(1);
    if (ng * mg > 2) _tile_zero(2);
    if (ng * mg > 3) _tile_zero(3);
    const int64_t step = (int64_t)chunks * 256, stride = (int64_t)chunks * 64;
    for (int kc = 0; kc < chunks; kc++) {
        for (int n = 0; fetch && n < ng; n++)
            for (int l = 0; l < 16; l++) {
                const char *line = fetch[n] + ((int64_t)kc * 16 + l) * 64;
                if (line < fetch_end) __builtin_prefetch(line, 0, 2);
            }
        if (kc % 4 == 2 && pending->done < pending->count) store_pending(pending);
        const uint32_t *b = xb + (int64_t)m0 * step + kc * 256;
        _tile_loadd(7, b, 64);
        if (mg > 1) _tile_loadd(6, b + step, 64);
        _tile_loadd(4, a[0] + kc * 32, stride);
        _tile_dpbf16ps(0, 4, 7);
        if (mg > 1) _tile_dpbf16ps(1, 4, 6);
        if (ng > 1) {
            _tile_loadd(5, a[1] + kc * 32, stride);
            if (mg > 1) { _tile_dpbf16ps(2, 5, 7); _tile_dpbf16ps(3, 5, 6); }
            else _tile_dpbf16ps(1, 5, 7);
        }
    }
}

static void pass_amx_any(const uint16_t *const a[2], const uint32_t *xb, int chunks, int m0, int ng,
                         int mg, const char *const fetch[2], const char *fetch_end, Pending *pending) {
    switch (ng * 4 + mg) {   /* each shape a copy with its tile numbers constant */
    case 4 + 1: pass_amx(a, xb, chunks, m0, 1, 1, fetch, fetch_end, pending); break;
    case 4 + 2: pass_amx(a, xb, chunks, m0, 1, 2, fetch, fetch_end, pending); break;
    case 8 + 1: pass_amx(a, xb, chunks, m0, 2, 1, fetch, fetch_end, pending); break;
    default: pass_amx(a, xb, chunks, m0, 2, 2, fetch, fetch_end, pending); break;
    }
}

/* y's columns nb * 16.. (`group` W blocks a[]) for all `mblocks` row blocks of xb: the passes,
   each one's sums left in `pending` for the next to store. The first pass asks for W ahead. */
static void block_passes(const uint16_t *const a[2], const char *const fetch[2], const char *fetch_end,
                         int group, const uint32_t *xb, int chunks, int mblocks, int nb, Pending *pending) {
    for (int m0 = 0, mg; m0 < mblocks; m0 += mg) {
        mg = mblocks - m0 > 1 ? 2 : 1;
        pass_amx_any(a, xb, chunks, m0, group, mg, m0 ? NULL : fetch, fetch_end, pending);
        while (pending->done < pending->count) store_pending(pending);
        pending->count = pending->done = 0;
        for (int n = 0; n < group; n++)   /* tile n * mg + m -> sums[n * mg + m] */
            for (int m = 0; m < mg; m++) sum_tile_to_memory(n * mg + m, pending->sums[n * mg + m]);
        for (int e = 0; e < group * mg; e++, pending->count++) {
            pending->n0[e] = (nb + e / mg) * 16;
            pending->m0[e] = (m0 + e % mg) * 16;
        }
    }
}

int gemm_amx_ready(void) { return amx_ready(); }

/* x [M, K], w [N, K], y [M, N] bf16, contiguous; bias float32 [N] (zeros if none).
   Returns 0, or 1 where it cannot run (K not a multiple of 32, AMX refused, out of memory), before
   it has changed anything. */
int gemm_amx(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *y, int M, int N, int K,
             int num_threads) {
    if (K % 32 || !amx_ready()) return 1;
    if (M == 0) return 0;
    const int chunks = K / 32, mblocks = (M + 15) / 16, nblocks = (N + 15) / 16;
    const int64_t block_bytes = (int64_t)16 * K * 2;
    const int blocks_ahead = PREFETCH_AHEAD / block_bytes > 1 ? (int)(PREFETCH_AHEAD / block_bytes) : 1;
    uint32_t *xb = malloc((size_t)mblocks * chunks * 1024);
    uint16_t *last = N % 16 ? calloc((size_t)16 * K, 2) : NULL;   /* a part-filled last block */
    if (!xb || (N % 16 && !last)) { free(xb); free(last); return 1; }
    if (last) memcpy(last, w + (int64_t)(nblocks - 1) * 16 * K, (size_t)(N % 16) * K * 2);
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int mb = 0; mb < mblocks; mb++) pack_rows_amx(x, xb, M, K, mb);
        amx_configure((const uint8_t[8]){16, 16, 16, 16, 16, 16, 16, 16});
        /* Each thread its own run of y's blocks of 16 columns, and so of W's rows. */
        const int t = omp_get_thread_num(), threads = omp_get_num_threads();
        const int first = (int)((int64_t)nblocks * t / threads), end = (int)((int64_t)nblocks * (t + 1) / threads);
        const int full_end = end < N / 16 ? end : N / 16;   /* `last` is no part of w */
        const char *mine = (const char *)(w + (int64_t)first * 16 * K);
        const char *mine_end = (const char *)(w + (int64_t)full_end * 16 * K);
        const int per_pass = mblocks > 1 ? 2 : 1;   /* y blocks per pass (see pass_amx): two W blocks from 17 rows on */
        const int ahead = blocks_ahead + per_pass - 1;   /* y blocks whose W is asked for before it is needed */
        /* the first blocks, which the loop asks for no one */
        for (const char *line = mine; line < mine + ahead * block_bytes && line < mine_end; line += 64)
            __builtin_prefetch(line, 0, 2);
        Pending pending = {.count = 0, .done = 0, .bias = bias, .y = y, .M = M, .N = N};
        for (int nb = first; nb < end; nb += per_pass) {
            const int group = end - nb < per_pass ? end - nb : per_pass;   /* W blocks */
            const uint16_t *a[2];
            const char *fetch[2];
            for (int n = 0; n < group; n++) {
                const int64_t row = (int64_t)(nb + n) * 16;
                a[n] = row + 16 <= N ? w + row * K : last;
                fetch[n] = (const char *)(w + (row + (int64_t)ahead * 16) * K);
            }
            block_passes(a, fetch, mine_end, group, xb, chunks, mblocks, nb, &pending);
        }
        while (pending.done < pending.count) store_pending(&pending);
        _tile_release();
    }
    free(xb);
    free(last);
    return 0;
}

/* FusedMoE's experts on AMX, one call a layer (cpu/moe.py's form where both of its products took
   the `amx` path): a counting sort of the (token, expert) pairs by local expert, tokens ascending
   within one; each expert's rows gathered from x into AMX operands (pack_block_amx); every
   expert's w13 product, silu(gate) * up, every expert's w2 product; then out[token] = the sum of
   its pairs' y * router weight, expert by expert in order, rounded to bf16 at each step as
   forward_native's index_add_ rounds. Pairs routed to an expert not held here (local_of[id] ==
   experts) are dropped.
   Why one parallel region for all of it: a decode step multiplies a few rows by each expert's
   weights, a stream from memory (16 experts x 1.3 MiB a layer in the bench model); with the
   experts' weights stacked as one matrix of 16-row blocks, each thread streams one contiguous run
   of it across the experts (experts_product) where a product an expert restarted the stream (and
   a Python call, slice and torch.cat around it). And every row count on the AMX loop: at a
   prefill's few hundred rows an expert, F.linear (gemm.py's AmxGemm above its loop rows) had
   oneDNN build a kernel for each new count, 5x slower (scripts/results/README.md). */
typedef struct {
    int experts;                   /* local experts */
    int64_t busy;                  /* of them with rows */
    const int64_t *count, *row0, *block0;   /* each expert's rows, first row, first 16-row block */
} Groups;

/* y rows of each expert e = its packed rows (xb from block0[e]) @ W[e].T, W [experts, N, K] (N a
   multiple of 16) as one matrix of 16-row blocks; the busy experts' blocks shared out among the
   threads in contiguous runs. Called by every thread of a parallel region, tiles configured. */
static void experts_product(const uint16_t *w, const uint32_t *xb, const Groups *g, uint16_t *y,
                            int N, int K, const float *zeros) {
    const int chunks = K / 32, nblocks = N / 16;
    const int64_t block_bytes = (int64_t)16 * K * 2, total = g->busy * nblocks;
    const int ahead = (PREFETCH_AHEAD / block_bytes > 1 ? (int)(PREFETCH_AHEAD / block_bytes) : 1) + 1;
    const int t = omp_get_thread_num(), threads = omp_get_num_threads();
    const int64_t first = total * t / threads, end = total * (t + 1) / threads;
    const char *w_end = (const char *)(w + (int64_t)g->experts * N * K);
    Pending pending = {.count = 0, .done = 0, .bias = zeros, .N = N};
    for (int64_t e = 0, v = 0; e < g->experts && v < end; v += g->count[e++] ? nblocks : 0) {
        const int64_t lo = first > v ? first : v, hi = end < v + nblocks ? end : v + nblocks;
        if (!g->count[e] || lo >= hi) continue;
        while (pending.done < pending.count) store_pending(&pending);   /* the expert before's */
        pending.count = pending.done = 0;
        pending.y = y + g->row0[e] * N, pending.M = (int)g->count[e];
        const int mblocks = (int)((g->count[e] + 15) / 16), per_pass = mblocks > 1 ? 2 : 1;
        const uint16_t *we = w + e * N * K;
        if (lo == first)   /* the run's first blocks, which no pass asks for */
            for (const char *line = (const char *)(we + (lo - v) * 16 * K);
                 line < (const char *)(we + (lo - v + ahead) * 16 * K) && line < w_end; line += 64)
                __builtin_prefetch(line, 0, 2);
        for (int64_t b = lo; b < hi; b += per_pass) {
            const int group = hi - b < per_pass ? (int)(hi - b) : per_pass, nb = (int)(b - v);
            const uint16_t *a[2];
            const char *fetch[2];
            for (int n = 0; n < group; n++) {
                a[n] = we + (int64_t)(nb + n) * 16 * K;
                fetch[n] = (const char *)(a[n] + (int64_t)ahead * 16 * K);
            }
            block_passes(a, fetch, w_end, group, xb + g->block0[e] * chunks * 256, chunks, mblocks, nb, &pending);
        }
    }
    while (pending.done < pending.count) store_pending(&pending);
}

/* Expert e's row block mb of `rows` ([.., K], its rows from row0[e]), or with `pairs` the rows of
   x of its pairs' tokens (a gather), packed at xb's block block0[e] + mb. */
static void pack_expert_block(const Groups *g, int64_t b, const uint16_t *rows, const int64_t *pairs,
                              int top_k, uint32_t *xb, int K) {
    int e = 0;
    while (b >= g->block0[e] + (g->count[e] + 15) / 16) e++;
    const int64_t m0 = (b - g->block0[e]) * 16;
    const uint16_t *row[16];
    for (int r = 0; r < 16; r++) {
        const int64_t m = g->row0[e] + m0 + r, source = pairs ? pairs[m] / top_k : m;
        row[r] = m0 + r < g->count[e] ? rows + source * K : NULL;
    }
    pack_block_amx(row, xb + b * (K / 32) * 256, K);
}

/* out rows t0..t1: each token's sum of y[row of its pair] * weight over its pairs held here, in
   forward_native's order (by local expert), each product and each partial sum rounded to bf16 as
   index_add_ rounds; a token with none: zeros. A row written once, by one thread. */
static void weighted_sum(const uint16_t *y, const int64_t *row_of, const int64_t *ids,
                         const int64_t *local_of, const float *weights, int top_k, int64_t t0,
                         int64_t t1, int H, uint16_t *out) {
    for (int64_t token = t0; token < t1; token++) {
        int64_t held[top_k];
        int n = 0;
        for (int64_t p = token * top_k; p < (token + 1) * top_k; p++) {   /* insertion sort by expert */
            if (row_of[p] < 0) continue;
            int i = n++;
            for (; i > 0 && local_of[ids[held[i - 1]]] > local_of[ids[p]]; i--) held[i] = held[i - 1];
            held[i] = p;
        }
        for (int c = 0; c < H; c += 16) {
            __m512 sum = _mm512_setzero_ps();
            for (int i = 0; i < n; i++) {
                const __m512 w = _mm512_set1_ps(bf16_to_f32(f32_to_bf16(weights[held[i]])));
                const __m512 yv = (__m512)_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                    _mm256_loadu_si256((const void *)(y + row_of[held[i]] * H + c))), 16);
                const __m512 product = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(_mm512_mul_ps(yv, w)));
                sum = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(_mm512_add_ps(sum, product)));
            }
            _mm256_storeu_si256((void *)(out + token * H + c), (__m256i)_mm512_cvtneps_pbh(sum));
        }
    }
}

/* x [T, H] bf16; ids, weights [T, top_k] (int64, float32); local_of [global experts] -> local
   index (`experts`: not here); w13 [experts, 2I, H], w2 [experts, H, I] bf16; zeros float32
   [max(2I, H)]; out [T, H]. H and I multiples of 32. Returns 0, or 1 (out of memory, no AMX),
   before it has written anything. */
int moe_amx(const uint16_t *x, const int64_t *ids, const float *weights, const int64_t *local_of,
            int T, int top_k, int experts, const uint16_t *w13, const uint16_t *w2, const float *zeros,
            uint16_t *out, int H, int I, int num_threads) {
    if (H % 32 || I % 32 || !amx_ready()) return 1;
    int64_t *count = calloc((size_t)4 * (experts + 1), 8), *row0 = count + experts + 1;
    int64_t *block0 = row0 + experts + 1, *cursor = block0 + experts + 1, *pairs = malloc((size_t)T * top_k * 16 + 8);
    int64_t *row_of = pairs + (int64_t)T * top_k;   /* each pair's row in `pairs`, -1: not held here */
    if (!count || !pairs) { free(count); free(pairs); return 1; }
    for (int64_t p = 0; p < (int64_t)T * top_k; p++) count[local_of[ids[p]]]++;
    Groups g = {.experts = experts, .busy = 0, .count = count, .row0 = row0, .block0 = block0};
    int64_t rows = 0, blocks = 0;
    for (int e = 0; e < experts; e++) {
        row0[e] = cursor[e] = rows, block0[e] = blocks;
        rows += count[e], blocks += (count[e] + 15) / 16, g.busy += count[e] > 0;
    }
    for (int64_t p = 0; p < (int64_t)T * top_k; p++) {   /* stable: tokens ascending within an expert */
        row_of[p] = local_of[ids[p]] < experts ? cursor[local_of[ids[p]]]++ : -1;
        if (row_of[p] >= 0) pairs[row_of[p]] = p;
    }
    uint32_t *xb = malloc((size_t)blocks * (H / 32) * 1024 + 64), *xb2 = malloc((size_t)blocks * (I / 32) * 1024 + 64);
    uint16_t *gate_up = malloc((size_t)rows * 2 * I * 2 + 64), *act = malloc((size_t)rows * I * 2 + 64);
    uint16_t *y = malloc((size_t)rows * H * 2 + 64);
    if (!xb || !xb2 || !gate_up || !act || !y) {
        free(count), free(pairs), free(xb), free(xb2), free(gate_up), free(act), free(y);
        return 1;
    }
#pragma omp parallel num_threads(num_threads)
    {
        const int t = omp_get_thread_num(), threads = omp_get_num_threads();
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) pack_expert_block(&g, b, x, pairs, top_k, xb, H);
        amx_configure((const uint8_t[8]){16, 16, 16, 16, 16, 16, 16, 16});
        experts_product(w13, xb, &g, gate_up, 2 * I, H, zeros);
#pragma omp barrier
        const int64_t r0 = rows * t / threads, r1 = rows * (t + 1) / threads;
        silu_and_mul(gate_up + r0 * 2 * I, act + r0 * I, (int)(r1 - r0), I, 1, 1);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) pack_expert_block(&g, b, act, NULL, 1, xb2, I);
        experts_product(w2, xb2, &g, y, H, I, zeros);
        _tile_release();
#pragma omp barrier
        weighted_sum(y, row_of, ids, local_of, weights, top_k, (int64_t)T * t / threads,
                     (int64_t)T * (t + 1) / threads, H, out);
    }
    free(count), free(pairs), free(xb), free(xb2), free(gate_up), free(act), free(y);
    return 0;
}
#else
int gemm_amx_ready(void) { return 0; }
int gemm_amx(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *y, int M, int N, int K,
             int num_threads) {
    (void)x, (void)w, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)num_threads;
    return 1;
}
int moe_amx(const uint16_t *x, const int64_t *ids, const float *weights, const int64_t *local_of,
            int T, int top_k, int experts, const uint16_t *w13, const uint16_t *w2, const float *zeros,
            uint16_t *out, int H, int I, int num_threads) {
    (void)x, (void)ids, (void)weights, (void)local_of, (void)T, (void)top_k, (void)experts, (void)w13;
    (void)w2, (void)zeros, (void)out, (void)H, (void)I, (void)num_threads;
    return 1;
}
#endif

