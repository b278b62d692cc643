/* cpu_kernels.h: what the CPU kernels (decode_attention.c, prefill_attention.c, rms_norm.c, rope.c,
   silu_and_mul.c, argmax.c, gemm.c) share: bfloat16 <-> float32, a request's view of the paged
   cache, and the SIMD vector types.

   Layout (design §5): cache [num_blocks, block_size, num_kv_heads, head_dim]; token position p of
   a request is slot block_table[p / block_size] * block_size + p % block_size.

   The comments here and in the kernels say what each loop does and why. The measurements behind
   those choices, each on the CPU it names, and what was tried and not kept, are in
   scripts/results/README.md.
*/
#pragma once
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Threads for a parallel loop of n independent rows: no more than there are rows (a decode
   step of one request wakes no second thread for nothing to do), and at least one. */
#define THREADS_FOR(n, threads) ((n) < (threads) ? ((n) > 1 ? (n) : 1) : (threads))

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
    const uint32_t nearest_even = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, nan = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : nearest_even); /* NaN stays NaN; no
                                                       branch, so loops over it vectorise */
}

/* Element i of a float32 or bf16 array as float32, and back: what storing v in the model dtype
   keeps of it (`rounded`). Loops over these are written once for both dtypes and inlined with
   `bf16` a constant, so each copy vectorises. */
static inline float value_at(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline float rounded(float v, int bf16) { return bf16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

static inline void store_at(void *p, int64_t i, float v, int bf16) {
    if (bf16) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else ((float *)p)[i] = v;
}

/* Row `slot` of a [num_slots, row] cache as float32: fp32 rows are used in place, bf16 rows
   widened into `buf`. */
static inline const float *row_f32(const void *cache, int64_t slot, int row, int bf16, float *buf) {
    if (!bf16) return (const float *)cache + slot * row;
    const uint16_t *src = (const uint16_t *)cache + slot * row;
    for (int d = 0; d < row; d++) buf[d] = bf16_to_f32(src[d]);
    return buf;
}

/* What every pass needs to find a request's cached rows. */
typedef struct {
    const void *k_cache, *v_cache;
    const int32_t *table;  /* this request's block table */
    int seq_len, block_size, num_kv_heads, group, head_dim, bf16;
} Seq;

/* Position p's slot: table[p / block_size] * block_size + p % block_size. For a power-of-two
   block size (the default 16) by a shift and a mask: the decode kernel finds three slots a
   position (its row and the two it prefetches), and an integer division is slow beside the
   little arithmetic each position takes. */
static inline int64_t slot_of(const Seq *s, int p) {
    const int b = s->block_size;
    if ((b & (b - 1)) == 0) {
        const int shift = __builtin_ctz(b);
        return ((int64_t)s->table[p >> shift] << shift) | (p & (b - 1));
    }
    return (int64_t)s->table[p / b] * b + p % b;
}

/* The vector type: as many float lanes as this CPU's widest vector register holds. */
#if defined(__AVX512F__)
#define LANES 16
#include <immintrin.h>   /* a few AVX-512 intrinsics where vector extensions have no equivalent */
#elif defined(__AVX__)
#define LANES 8
#include <immintrin.h>   /* gemm.c's int8 widening (AVX2) */
#else
#define LANES 4
#endif
typedef float vfloat __attribute__((vector_size(4 * LANES)));
typedef uint32_t vuint32 __attribute__((vector_size(4 * LANES)));
typedef uint16_t vuint16 __attribute__((vector_size(2 * LANES)));
typedef int32_t vint32 __attribute__((vector_size(4 * LANES)));

#if LANES == 16
/* 16 rows of 16 32-bit values (`stride` bytes apart from `rows`) transposed in registers:
   row i's value j -> cols[j][i]. Three rounds of shuffles (pairs of rows interleaved, then fours,
   then 128-bit quarters), 64 in all. gemm.c's AMX loop turns its sum tiles back into rows with it
   (rather than a gather per column, which is no faster, and slower on CPUs whose microcode
   mitigates Gather Data Sampling); prefill_attention.c transposes V with it, two bf16 a value. */
static inline void transpose_16x16(const void *rows, int64_t stride, __m512 cols[16]) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps((const char *)rows + i * stride);
    for (int i = 0; i < 8; i++) {   /* quarter q: r2i[4q], r2i+1[4q], r2i[4q+1], r2i+1[4q+1] | [4q+2], [4q+3] */
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {   /* r[4i + c], quarter q: rows 4i..4i+3 of column 4q + c */
        r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int c = 0; c < 4; c++) {   /* column 4q + c: quarter q of r[c], r[4 + c], r[8 + c], r[12 + c] */
        const __m512 ab02 = _mm512_shuffle_f32x4(r[c], r[4 + c], _MM_SHUFFLE(2, 0, 2, 0));
        const __m512 ab13 = _mm512_shuffle_f32x4(r[c], r[4 + c], _MM_SHUFFLE(3, 1, 3, 1));
        const __m512 ef02 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], _MM_SHUFFLE(2, 0, 2, 0));
        const __m512 ef13 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], _MM_SHUFFLE(3, 1, 3, 1));
        cols[c] = _mm512_shuffle_f32x4(ab02, ef02, _MM_SHUFFLE(2, 0, 2, 0));
        cols[4 + c] = _mm512_shuffle_f32x4(ab13, ef13, _MM_SHUFFLE(2, 0, 2, 0));
        cols[8 + c] = _mm512_shuffle_f32x4(ab02, ef02, _MM_SHUFFLE(3, 1, 3, 1));
        cols[12 + c] = _mm512_shuffle_f32x4(ab13, ef13, _MM_SHUFFLE(3, 1, 3, 1));
    }
}

/* {0, stride, 2 stride, ..., 15 stride}: the offsets of a gather or scatter, one per lane. */
static inline __m512i lane_offsets(int stride) {
    return _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                              _mm512_set1_epi32(stride));
}
#endif

/* AVX512-BF16 (Zen 4, Cooper Lake, Sapphire Rapids): `vdpbf16ps` multiplies bf16 pairs and adds
   both products into float32 lanes. gemm.c and the bf16 attention kernels use it where the
   compiler targets it (with AVX512-BW, which every such CPU has, for the 16-bit shuffles that
   pair bf16 values); elsewhere they widen bf16 to float32 themselves. */
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && LANES == 16
#define DPBF16 1
#endif

/* AMX (Sapphire Rapids and later Xeons): eight tile registers of up to 16 rows x 64 bytes, and
   `tdpbf16ps`, which multiplies a 16 x 32 bf16 tile by a 32 x 16 one (bf16 pairs along k, the
   layout AVX512-BF16 uses too) into 16 x 16 float32 sums in one instruction: 16 times the work of
   an AVX-512 `vdpbf16ps`. Linux hands AMX's 8 KiB of tile state to a process only on request
   (arch_prctl ARCH_REQ_XCOMP_PERM); `amx_ready` asks once and says whether it was granted (a
   kernel without AMX support refuses, and the callers keep their AVX-512 loops). Each thread that
   uses the tiles loads their shapes first (`amx_configure`). */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__) && defined(DPBF16)
#define AMX 1
#include <sys/syscall.h>
#include <unistd.h>

static inline int amx_ready(void) {
    static int granted = -1;   /* a race between threads only asks twice: the answer is the same */
    if (granted < 0) granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                       18 /* XFEATURE_XTILEDATA */) == 0;
    return granted;
}

/* Tile t gets rows[t] rows of 64 bytes (the widest a tile takes), for t < 8. Not GCC 12's
   _tile_loadconfig: its asm tells the compiler that `ldtilecfg` reads the first 8 bytes of the
   configuration only, so at -O3 the stores of the shapes may be dropped as dead, and the first
   tile instruction then faults (seen: SIGILL once a call inside the tile loop changed the
   inlining). This asm names the whole 64 bytes as what it reads. */
static inline void amx_configure(const uint8_t rows[8]) {
    struct { uint8_t palette, start_row, reserved[14]; uint16_t bytes[16]; uint8_t rows[16]; }
        config = {.palette = 1};
    for (int t = 0; t < 8; t++) config.bytes[t] = 64, config.rows[t] = rows[t];
    __asm__ volatile("ldtilecfg %0" : : "m"(config));
}
#endif

/* Lane by lane, mask (all ones or zero, as a vector compare gives) ? yes : no. */
static inline vfloat select_lanes(vint32 mask, vfloat yes, vfloat no) {
    return (vfloat)((mask & (vint32)yes) | (~mask & (vint32)no));
}

/* LANES values of a cache row from `row` as float32 (bf16: widen by shifting into the top half).
   memcpy is how C loads an unaligned vector; it compiles to one vector load. With AVX-512, bf16
   is widened (and narrowed in store_lanes) by one vpmovzxwd (vpmovdw): from the vector extensions'
   conversion GCC 12 made two half-width conversions and a shuffle (narrowing: a two-table
   permute). */
static inline vfloat load_lanes(const void *row, int bf16) {
    vfloat v;
    if (!bf16) {
        memcpy(&v, row, sizeof v);
        return v;
    }
#if LANES == 16
    return (vfloat)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)row)), 16);
#else
    vuint16 narrow;
    memcpy(&narrow, row, sizeof narrow);
    vuint32 wide = __builtin_convertvector(narrow, vuint32) << 16;
    memcpy(&v, &wide, sizeof v);
    return v;
#endif
}

/* v rounded to bf16 as f32_to_bf16 rounds (NaN aside: not kept quiet here), lane by lane, and
   widened back: what storing v in a bf16 model keeps of it. */
static inline vfloat rounded_lanes(vfloat v) {
    vuint32 u = (vuint32)v;
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    return (vfloat)u;
}

/* LANES float32 values stored as float32 or, rounded as rounded_lanes rounds, bf16 (the vector
   store_at). */
static inline void store_lanes(void *row, vfloat v, int bf16) {
    if (!bf16) {
        memcpy(row, &v, sizeof v);
        return;
    }
#if LANES == 16
    _mm256_storeu_si256((__m256i *)row, _mm512_cvtepi32_epi16(_mm512_srli_epi32((__m512i)rounded_lanes(v), 16)));
#else
    const vuint16 narrow = __builtin_convertvector((vuint32)rounded_lanes(v) >> 16, vuint16);
    memcpy(row, &narrow, sizeof narrow);
#endif
}

static inline vfloat splat(float x) { return (vfloat){0} + x; }

static inline vfloat max_lanes(vfloat a, vfloat b) { return select_lanes(a > b, a, b); }

#define LOG2E 1.4426950409f   /* e^x = 2^(x LOG2E) */

/* 2^t lane by lane for t <= 0 (softmax arguments, as e^x = 2^(x LOG2E)), relative error ~2.2e-7.
   For a softmax whose scale folds into the argument: e^(scale (s - m)) = 2^(s c - m c), c = scale
   log2 e, one multiply-add. t = n + f with |f| <= 1/2, 2^f by the series of e^(f ln2) to f^6; with
   AVX-512 the rounding and the 2^n are one instruction each (vrndscaleps, vscalefps): 10
   instructions where e^x by a Cody-Waite split and 2^n in the exponent bits took 18.
   Below -125 the result is 0 (a masked score, -FLT_MAX, weighs nothing). Why 0 and not 2^-125
   (~2.4e-38, the smallest the formula builds): that weight times a V value below 0.5 is a
   denormal, and the CPU computes each denormal in a slow microcode assist. Masked keys are in
   every tile's diagonal chunks (prefill_attention.c), so float32 prefill attention would meet
   them in every tile (bf16's weights are rounded by an instruction that turns denormals into 0). */
static inline vfloat exp2_lanes(vfloat t) {
#if LANES == 16
    const __mmask16 kept = _mm512_cmp_ps_mask((__m512)t, _mm512_set1_ps(-125.f), _CMP_GE_OQ);
    const __m512 n = _mm512_roundscale_ps((__m512)t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    const vint32 tiny = t < -125.f;
    t = max_lanes(t, splat(-125.f));
    const vint32 whole = __builtin_convertvector(t - 0.5f, vint32);   /* truncation: the nearest, t <= 0 */
    const vfloat n = __builtin_convertvector(whole, vfloat);
#endif
    const vfloat f = t - (vfloat)n;   /* the series' coefficients: ln2^k / k! */
    const vfloat p = 1.f + f * (0.6931471806f + f * (0.2402265070f + f * (0.0555041087f + f * (0.0096181291f
                     + f * (0.0013333558f + f * 0.0001540353f)))));
#if LANES == 16
    return (vfloat)_mm512_maskz_scalef_ps(kept, (__m512)p, n);
#else
    return select_lanes(tiny, splat(0.f), p * (vfloat)((whole + 127) << 23));
#endif
}
