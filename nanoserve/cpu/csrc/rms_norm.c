/* rms_norm.c: RMSNorm on CPU with the residual add before it fused in (vLLM's fused_add_rms_norm).

   Built and loaded with the attention kernels by nanoserve/cpu/kernels.py. Why C: in torch the
   add and the norm are seven elementwise ops (add, pow, mean, add, rsqrt, mul, mul), each a pass
   over the rows and, in a decode step of a few rows, each mostly dispatch overhead; here they are
   one pass per row.

   The numbers are HF's (LlamaRMSNorm), so greedy output still matches transformers:
       residual = dtype(x + residual)                       (when a residual is given)
       out      = dtype(weight * dtype(r * rsqrt(mean(r^2) + eps)))   in float32, r = residual
   i.e. normalised in float32, rounded to the model dtype, then multiplied by the weight and rounded
   again (for float32 models both roundings are nothing).

   Worked example, dim 2, eps 0, weight [1, 2], x [3, 4], no residual: mean(r^2) = 12.5,
   rsqrt = 0.2828, out = [0.8485, 2.2627].
*/
#include "cpu_kernels.h"

/* RMSNorm of row `base / dim` (the comment above says how), inlined into a float32 and a bf16
   copy (`bf16` a constant): LANES at a time, the rest one by one (the compiler's own vectorising
   of the plain loop chose half-width vectors). `row`: dim floats of scratch, the (rounded) sum
   kept for the second pass. */
static inline __attribute__((always_inline)) void
rms_norm_row(const void *x, void *residual, const void *weight, void *out, int64_t base, int dim,
             float eps, const int bf16, float *row) {
    const int size = bf16 ? 2 : 4;
    const char *in = (const char *)x + base * size;
    char *sum = residual ? (char *)residual + base * size : NULL, *dest = (char *)out + base * size;
    vfloat squares_lanes = splat(0.f);
    int d = 0;
    for (; d + LANES <= dim; d += LANES) {
        vfloat v = load_lanes(in + d * size, bf16);
        if (sum) {
            v += load_lanes(sum + d * size, bf16);
            if (bf16) v = rounded_lanes(v);   /* the sum itself is what gets normalised */
            store_lanes(sum + d * size, v, bf16);
        }
        memcpy(row + d, &v, sizeof v);
        squares_lanes += v * v;
    }
    float squares = 0.f;
    for (int l = 0; l < LANES; l++) squares += squares_lanes[l];
    for (; d < dim; d++) {
        float v = value_at(in, d, bf16);
        if (sum) {
            v = rounded(v + value_at(sum, d, bf16), bf16);
            store_at(sum, d, v, bf16);
        }
        row[d] = v;
        squares += v * v;
    }
    const float inverse_rms = 1.f / sqrtf(squares / dim + eps);
    for (d = 0; d + LANES <= dim; d += LANES) {
        vfloat v;
        memcpy(&v, row + d, sizeof v);
        v *= inverse_rms;
        if (bf16) v = rounded_lanes(v);
        v *= load_lanes((const char *)weight + d * size, bf16);
        store_lanes(dest + d * size, v, bf16);
    }
    for (; d < dim; d++)
        store_at(dest, d, value_at(weight, d, bf16) * rounded(row[d] * inverse_rms, bf16), bf16);
}

/* rows x dim, contiguous. residual may be NULL (then x is normalised as it is); otherwise it is
   updated in place to x + residual, and that is what is normalised. */
void rms_norm(const void *x, void *residual, const void *weight, void *out, int rows, int dim,
              float eps, int bf16, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(THREADS_FOR(rows, num_threads))
    for (int r = 0; r < rows; r++) {
        float row[dim];
        if (bf16) rms_norm_row(x, residual, weight, out, (int64_t)r * dim, dim, eps, 1, row);
        else rms_norm_row(x, residual, weight, out, (int64_t)r * dim, dim, eps, 0, row);
    }
}
