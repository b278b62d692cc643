/* rms_norm.c: RMSNorm on CPU with the residual add before it fused in (vLLM's fused_add_rms_norm).

   Built and loaded with the attention kernels by nanoserve/cpu/kernels.py. Why C: in torch the
   add and the norm are seven elementwise ops (add, pow, mean, add, rsqrt, mul, mul), each a pass
   over the rows and, in a decode step of a few rows, each mostly dispatch overhead; here they are
   one pass per row. Where the product after the norm runs in gemm.c, the norm runs there instead,
   on each tile's rows as they are copied (rms_norm_row, cpu_kernels.h), and the normalised rows
   are never stored (the measurements: scripts/results/README.md).

   The numbers are HF's (LlamaRMSNorm), so greedy output still matches transformers:
       residual = dtype(x + residual)                       (when a residual is given)
       out      = dtype(weight * dtype(r * rsqrt(mean(r^2) + eps)))   in float32, r = residual
   i.e. normalised in float32, rounded to the model dtype, then multiplied by the weight and rounded
   again (for float32 models both roundings are nothing).

   Worked example, dim 2, eps 0, weight [1, 2], x [3, 4], no residual: mean(r^2) = 12.5,
   rsqrt = 0.2828, out = [0.8485, 2.2627].
*/
#include "cpu_kernels.h"

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
