/* argmax.c: the index of each row's largest value (greedy sampling over a vocabulary).

   Built and loaded with the other CPU kernels by nanoserve/cpu/kernels.py. Why C: torch's CPU
   argmax tracks its index one float at a time, far slower than reading the logits, and greedy
   sampling runs it in every decode step; here the vector lanes each keep their own maximum.
   (The measurements: scripts/results/README.md.)

   torch's answer exactly: the FIRST index of the maximum, and a NaN counts as larger than every
   number (so the first NaN wins). Each vector lane keeps the largest value it has seen and where
   (a strictly larger value replaces it, so a lane keeps its first maximum); at the row's end the
   answer is the smallest index among the lanes that hold the row's maximum. NaN is found from
   the bits (exponent all ones, mantissa not zero): -ffast-math's float compares assume none.

   float32 or bf16: a bf16 model's logits are read as they are, since widening them all to float32
   first (a pass over them) would cost more than the argmax itself.

   Worked example, LANES 4, row [1, 5, 2, 5, 0, 5]: lanes see {1, 0}, {5, 5}, {2}, {5}: lane 1
   keeps (5, index 1), lane 3 (5, index 3); the maximum 5 is at the smallest of 1, 3: index 1.
*/
#include "cpu_kernels.h"

static inline int is_nan(float v) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    return (bits & 0x7fffffffu) > 0x7f800000u;
}

/* One row of float32 or bf16 values (`bf16` a constant: inlined into a copy for each). bf16 values
   are widened first (exactly, NaN staying NaN), so the answer is that of the float32 row. */
static inline __attribute__((always_inline)) int64_t argmax_row(const void *row, int64_t n, const int bf16) {
    const int size = bf16 ? 2 : 4;
    const char *x = row;
    int64_t i = 0, best = 0;
    float best_value = n ? value_at(x, 0, bf16) : 0.f;
    if (n >= LANES) {
        vfloat max_value = load_lanes(x, bf16);
        vint32 at, index, nan = (vint32){0};   /* index: each lane's position in the chunk at i */
        for (int l = 0; l < LANES; l++) at[l] = index[l] = l;
        for (i = 0; i + LANES <= n; i += LANES, index += LANES) {   /* chunk 0 too: its NaNs */
            const vfloat v = load_lanes(x + i * size, bf16);
            const vint32 larger = v > max_value;
            max_value = select_lanes(larger, v, max_value);
            at = (larger & index) | (~larger & at);
            nan |= ((vuint32)v & 0x7fffffffu) > 0x7f800000u;
        }
        for (int l = 0; l < LANES; l++) nan[0] |= nan[l];
        if (nan[0]) {
            for (int64_t j = 0; j < n; j++)
                if (is_nan(value_at(x, j, bf16))) return j;
        }
        best_value = max_value[0], best = at[0];
        for (int l = 1; l < LANES; l++)
            if (max_value[l] > best_value || (max_value[l] == best_value && at[l] < best))
                best_value = max_value[l], best = at[l];
    }
    for (; i < n; i++) {   /* the last n % LANES values (or a row shorter than LANES) */
        const float v = value_at(x, i, bf16);
        if (is_nan(v)) return i;   /* the values before it held none */
        if (v > best_value) best_value = v, best = i;
    }
    return best;
}

/* x: rows x n, float32 or (bf16) bf16, contiguous; out: rows int64. */
void argmax(const void *x, int64_t *out, int rows, int64_t n, int bf16, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int r = 0; r < rows; r++)
        out[r] = bf16 ? argmax_row((const uint16_t *)x + (int64_t)r * n, n, 1)
                      : argmax_row((const float *)x + (int64_t)r * n, n, 0);
}
