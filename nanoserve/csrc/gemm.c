/* gemm.c: y = x @ W.T + b for the model's Linear layers on CPU, on a weight packed once at load:
   one of the paths models/linear.py times at start-up (`kernel`), kept only where it is the
   fastest on the machine at hand.

   Built and loaded with the other CPU kernels by nanoserve/cpu_kernels.py. Why our own: a decode
   step multiplies 1 to 64 rows, and there oneDNN's product is far from the machine's peak (Zen 4,
   2 threads, float32, the bench model's four shapes cycled over 30 layers: 780 us a layer at 8
   rows where this loop takes 480, 1,770 against 1,170 at 32, 2,360 against 2,180 at 64), while at
   2,048 rows both run at the peak. The loop is the textbook one (BLIS's micro-kernel): nothing in
   it is tuned to one CPU beyond the vector width the compiler is given.

   Packing: W [N outputs, K inputs] is cut into panels of PANEL output columns, each stored k by k
   (packed[p][k][j] = W[p * PANEL + j][k]), so the inner loop reads one panel row as NV vectors.
   The last panel is padded with zero columns. bf16 weights are packed in pairs along k
   (packed[p][k / 2][j][k % 2]), the layout of AVX512-BF16's dot product of bf16 pairs.
   Worked example, PANEL 4, W 5 x 3: panel 0 holds outputs 0-3, panel 1 output 4 and three zero
   columns; W[4][2] is packed[1][2][0], element (1 * 3 + 2) * 4 + 0 = 20.

   The product: each thread takes (block of rows, panel) pairs; each tile keeps MR rows x PANEL
   columns of y in registers (float32) over the whole of K, then stores them (bf16: rounded once,
   to nearest even, as oneDNN and torch round a bf16 product). The panel stays in L2 across the
   row tiles.
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

/* m (<= MR) rows of x times one panel, into y; `bf16` and `m` constants once inlined. */
static inline __attribute__((always_inline)) void
tile(const void *x, const void *panel, const float *bias, void *y, int64_t ldy, int K, int columns,
     const int m, const int bf16) {
    vfloat acc[MR][NV];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 4
        for (int j = 0; j < NV; j++) memcpy(&acc[i][j], bias + j * LANES, sizeof(vfloat));
    if (!bf16) {
        const float *a = x, *b = panel;
        for (int k = 0; k < K; k++) {
            vfloat w[NV];
#pragma GCC unroll 4
            for (int j = 0; j < NV; j++) memcpy(&w[j], b + (int64_t)k * PANEL + j * LANES, sizeof(vfloat));
#pragma GCC unroll 8
            for (int i = 0; i < m; i++) {
                const vfloat v = broadcast(a[(int64_t)i * K + k]);
#pragma GCC unroll 4
                for (int j = 0; j < NV; j++) acc[i][j] += v * w[j];
            }
        }
    } else {
        const uint16_t *a = x;
        const uint32_t *b = panel;   /* a pair of bf16 weights per uint32: k even in the low half */
        for (int k = 0; k < K; k += 2) {
            vuint32 w[NV];
#pragma GCC unroll 4
            for (int j = 0; j < NV; j++) memcpy(&w[j], b + (int64_t)(k / 2) * PANEL + j * LANES, sizeof(vuint32));
#pragma GCC unroll 8
            for (int i = 0; i < m; i++) {
                uint32_t pair;   /* x's bf16 at k and k + 1 as one uint32 (an odd K's last: k alone) */
                if (k + 1 < K) memcpy(&pair, a + (int64_t)i * K + k, sizeof pair);
                else pair = a[(int64_t)i * K + k];
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
    for (int i = 0; i < m; i++) {
        const float *row = (const float *)acc[i];
        for (int n = 0; n < columns; n++) store_at(y, i * ldy + n, row[n], bf16);
    }
}

static inline __attribute__((always_inline)) void
tile_rows(const void *x, const void *panel, const float *bias, void *y, int64_t ldy, int K,
          int columns, int m, const int bf16) {
    switch (m) {   /* one copy of the tile per row count, each with its loops unrolled */
#if MR == 8
    case 8: tile(x, panel, bias, y, ldy, K, columns, 8, bf16); break;
    case 7: tile(x, panel, bias, y, ldy, K, columns, 7, bf16); break;
    case 6: tile(x, panel, bias, y, ldy, K, columns, 6, bf16); break;
    case 5: tile(x, panel, bias, y, ldy, K, columns, 5, bf16); break;
#endif
    case 4: tile(x, panel, bias, y, ldy, K, columns, 4, bf16); break;
    case 3: tile(x, panel, bias, y, ldy, K, columns, 3, bf16); break;
    case 2: tile(x, panel, bias, y, ldy, K, columns, 2, bf16); break;
    default: tile(x, panel, bias, y, ldy, K, columns, 1, bf16); break;
    }
}

/* w [N, K] -> packed (N rounded up to PANEL columns) x K (bf16: K rounded up to even). */
void gemm_pack(const void *w, void *packed, int N, int K, int bf16) {
    const int panels = (N + PANEL - 1) / PANEL, pairs = (K + 1) / 2;
    for (int p = 0; p < panels; p++)
        for (int k = 0; k < K; k++)
            for (int j = 0; j < PANEL; j++) {
                const int n = p * PANEL + j;
                const float v = n < N ? value_at(w, (int64_t)n * K + k, bf16) : 0.f;
                if (bf16) store_at(packed, (((int64_t)p * pairs + k / 2) * PANEL + j) * 2 + k % 2, v, 1);
                else store_at(packed, ((int64_t)p * K + k) * PANEL + j, v, 0);
            }
}

/* x: M x K and y: M x N, contiguous; bias: float32, padded to whole panels (zeros if none). */
void gemm(const void *x, const void *packed, const float *bias, void *y, int M, int N,
          int K, int bf16, int num_threads) {
    const int panels = (N + PANEL - 1) / PANEL, blocks = (M + ROW_BLOCK - 1) / ROW_BLOCK;
    const int64_t size = bf16 ? 2 : 4, panel_elems = (int64_t)(bf16 ? (K + 1) / 2 * 2 : K) * PANEL;
#pragma omp parallel for collapse(2) schedule(static) num_threads(num_threads)
    for (int block = 0; block < blocks; block++)
        for (int p = 0; p < panels; p++) {
            const void *panel = (const char *)packed + p * panel_elems * size;
            const int columns = N - p * PANEL < PANEL ? N - p * PANEL : PANEL;
            const int end = (block + 1) * ROW_BLOCK < M ? (block + 1) * ROW_BLOCK : M;
            for (int r = block * ROW_BLOCK; r < end; r += MR) {
                const int m = end - r < MR ? end - r : MR;
                const void *a = (const char *)x + (int64_t)r * K * size;
                void *c = (char *)y + ((int64_t)r * N + p * PANEL) * size;
                if (bf16) tile_rows(a, panel, bias + p * PANEL, c, N, K, columns, m, 1);
                else tile_rows(a, panel, bias + p * PANEL, c, N, K, columns, m, 0);
            }
        }
}
