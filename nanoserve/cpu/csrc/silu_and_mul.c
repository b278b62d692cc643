/* silu_and_mul.c: the MLP's activation on CPU, silu(gate) * up, from the fused gate_up product
   into a new contiguous tensor (vLLM's silu_and_mul).

   Built and loaded with the other CPU kernels by nanoserve/cpu/kernels.py. Why C: in torch this is
   two passes over the gate half of the [tokens, 2 * intermediate] product (silu in place, then the
   multiply), and down_proj then reads a strided view; here it is one pass that reads gate and up
   once and writes the contiguous [tokens, intermediate] rows down_proj multiplies fastest.

   The numbers are HF's: silu(g) = g / (1 + e^-g) in float32, rounded to the model dtype, then the
   product with up rounded again (for float32 models both roundings are nothing).

   Worked example, intermediate 2, one token, gate_up [0, 2, 3, 4]: silu(0) = 0, silu(2) = 1.7616,
   out = [0 * 3, 1.7616 * 4] = [0, 7.0464].
*/
#include "cpu_kernels.h"

/* silu(g) * u lane by lane, HF's numbers (act_fn(gate) * up): silu(g) = g / (1 + e^-g) in float32,
   rounded to bf16 for a bf16 model, then times u (the caller's store rounds the product). The
   sigmoid from e = e^-|g|, which never overflows: 1 / (1 + e) for g >= 0, e / (1 + e) below.
   Why not expf: the compiler's vector expf (glibc's libmvec) took longer than reading the rows,
   so the pass was bound by arithmetic, not memory; e is 2^(-|g| log2 e) by exp2_lanes instead.
   Worked example: g = [0, 2], u = [3, 4] -> [0 * 3, 1.7616 * 4] = [0, 7.0464]. */
static inline vfloat silu_mul_lanes(vfloat g, vfloat u, int bf16) {
    const vint32 negative = g < 0.f;
    const vfloat e = exp2_lanes(select_lanes(negative, g, -g) * LOG2E);
    vfloat silu = g * select_lanes(negative, e, splat(1.f)) / (1.f + e);
    if (bf16) silu = rounded_lanes(silu);
    return silu * u;
}

/* One row; inlined into a float32 and a bf16 copy (`bf16` a constant). LANES at a time with
   silu_mul_lanes, the rest one by one. */
static inline __attribute__((always_inline)) void
activate_row(const void *gate_up, void *out, int64_t row, int dim, const int bf16) {
    const int size = bf16 ? 2 : 4;
    const char *gate = (const char *)gate_up + row * 2 * dim * size, *up = gate + (int64_t)dim * size;
    char *dest = (char *)out + row * dim * size;
    int d = 0;
    for (; d + LANES <= dim; d += LANES)
        store_lanes(dest + d * size, silu_mul_lanes(load_lanes(gate + d * size, bf16),
                                                    load_lanes(up + d * size, bf16), bf16), bf16);
    for (; d < dim; d++) {
        const float g = value_at(gate, d, bf16);
        store_at(dest, d, rounded(g / (1.f + expf(-g)), bf16) * value_at(up, d, bf16), bf16);
    }
}

/* gate_up: rows x (2 * dim), contiguous, gate first; out: rows x dim. */
void silu_and_mul(const void *gate_up, void *out, int rows, int dim, int bf16, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(THREADS_FOR(rows, num_threads))
    for (int r = 0; r < rows; r++) {
        if (bf16) activate_row(gate_up, out, r, dim, 1);
        else activate_row(gate_up, out, r, dim, 0);
    }
}
