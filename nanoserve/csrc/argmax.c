/* argmax.c: the index of each row's largest value (greedy sampling over a vocabulary).

   Built and loaded with the other CPU kernels by nanoserve/cpu_kernels.py. Why C: torch's CPU
   argmax tracks its index one float at a time; over 64 rows of a 49,152-token vocabulary it took
   ~2.7 ms (~4.6 GB/s) where reading the logits takes ~0.1 ms, in every decode step.

   torch's answer exactly: the FIRST index of the maximum, and a NaN counts as larger than every
   number (so the first NaN wins). Each vector lane keeps the largest value it has seen and where
   (a strictly larger value replaces it, so a lane keeps its first maximum); at the row's end the
   answer is the smallest index among the lanes that hold the row's maximum. NaN is found from
   the bits (exponent all ones, mantissa not zero): -ffast-math's float compares assume none.

   Worked example, LANES 4, row [1, 5, 2, 5, 0, 5]: lanes see {1, 0}, {5, 5}, {2}, {5}: lane 1
   keeps (5, index 1), lane 3 (5, index 3); the maximum 5 is at the smallest of 1, 3: index 1.
*/
#include "cpu_kernels.h"

static inline int is_nan(uint32_t bits) { return (bits & 0x7fffffffu) > 0x7f800000u; }

static int64_t argmax_row(const float *x, int64_t n) {
    const uint32_t *bits = (const uint32_t *)x;
    int64_t i = 0, best = 0;
    float best_value = n ? x[0] : 0.f;
    if (n >= LANES) {
        vfloat max_value;
        vint32 at, index, nan = (vint32){0};   /* index: each lane's position in the chunk at i */
        memcpy(&max_value, x, sizeof max_value);
        for (int l = 0; l < LANES; l++) at[l] = index[l] = l;
        for (i = 0; i + LANES <= n; i += LANES, index += LANES) {   /* chunk 0 too: its NaNs */
            vfloat v;
            vuint32 u;
            memcpy(&v, x + i, sizeof v);
            memcpy(&u, x + i, sizeof u);
            const vint32 larger = v > max_value;
            max_value = select_lanes(larger, v, max_value);
            at = (larger & index) | (~larger & at);
            nan |= (u & 0x7fffffffu) > 0x7f800000u;
        }
        for (int l = 0; l < LANES; l++) nan[0] |= nan[l];
        if (nan[0]) {
            for (int64_t j = 0; j < n; j++)
                if (is_nan(bits[j])) return j;
        }
        best_value = max_value[0], best = at[0];
        for (int l = 1; l < LANES; l++)
            if (max_value[l] > best_value || (max_value[l] == best_value && at[l] < best))
                best_value = max_value[l], best = at[l];
    }
    for (; i < n; i++) {   /* the last n % LANES values (or a row shorter than LANES) */
        if (is_nan(bits[i])) return i;   /* the values before it held none */
        if (x[i] > best_value) best_value = x[i], best = i;
    }
    return best;
}

/* x: rows x n float32, contiguous; out: rows int64. */
void argmax(const float *x, int64_t *out, int rows, int64_t n, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int r = 0; r < rows; r++) out[r] = argmax_row(x + (int64_t)r * n, n);
}
