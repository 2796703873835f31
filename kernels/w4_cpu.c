/* y = x W^T on the CPU for 4-bit weights kept packed (kernels/w4_weight.py's layout), x and y in float32 or
 * bfloat16: each weight is dequantized in registers and multiplied in float32 (fused multiply-adds), so the result is
 * the dequantized checkpoint's product up to the order of the sums (kernels/w4.py's torch reference is the oracle;
 * w4_cpu.py builds and calls this file). No activation is quantized, unless the caller asks for int8 activations
 * (q8: model.int8_activations, int4 weights; block_q8, near the end of the kernels).
 *
 * Why it is fast: a decode (a few rows of x) is bound by reading the weight, and a 4-bit weight is ~1/7 of a float32
 * one, so what is left is to dequantize fast enough to keep up with the memory. The codes of a row are read in
 * place, 16 bytes (32 columns) at a time on AVX-512. A group's 16 possible weights are one register (a lookup table:
 * (q - zero) * scale for q = 0..15, or E2M1[q] * scale * global_scale), made once per group, and every code becomes
 * its weight in one permute: vpermps reads only the low 4 bits of each 32-bit index, so a byte of two codes,
 * zero-extended to 32 bits, indexes its low code as it is and its high code after a shift. That gives a chunk's even
 * columns in one register and its odd ones in another, so x is laid out once per call to match (`prepare_x`: each
 * chunk of 32 columns as its 16 even columns, then its 16 odd ones; act-order's columns gathered, bf16 widened). The
 * weights are exactly the reference's ((q - z) * s in float32); only the order of the sums differs. The codes are
 * prefetched a row block ahead: the hardware's prefetcher alone left the memory half used. The loader interleaves a
 * weight's blocks of rows (w4_weight.py's block_rows: `blocked`), so that a block is read as one stream, in the order
 * the kernel computes it: one decode row of the bench model's 58 projections took 7-11% less time than from rows,
 * eight rows ~6% (the same sums, to the bit). Rows are still read (weights whose rows are not whole 32-byte pieces).
 *
 * Blocking: NB output rows at a time share each load of x, and up to MB rows of x share each dequantized weight (the
 * NB * MB sums stay in registers); more rows of x are further passes over the same rows of W, in L1 by then. The
 * output rows are split over the threads of torch's own OpenMP team (the same libgomp, loaded once).
 *
 * Paths, chosen when this file is compiled (-march=native: the CPU's own flags): AVX-512 (the tables; with AVX512_BF16
 * and bfloat16 x, the weights made as bfloat16 and multiplied by bfloat16 dot products: block_bf), AVX2 + FMA (a
 * chunk of 16 columns, each code converted with arithmetic, as AVX2 has no 16-entry permute: for float32 x each
 * group's products with the codes summed, then scaled, block_grouped; bfloat16 x, block), and portable C
 * for the rest (and for a group size the vector paths do not take: not a multiple of 16). w4_dequant writes W's rows
 * in float32 or bfloat16 for a prefill's float GEMM (w4_cpu.py: which is faster there).
 *
 * The file has two halves: the kernel in C, and at its end the torch op around it in C++, compiled from this same
 * file a second time with W4_TORCH_OP defined (w4_cpu.py links both into one library).
 */
#include <stdint.h>
enum { F32 = 0, BF16 = 1, F16 = 2 };  /* dtype codes (w4_cpu.py's DTYPES) */

#ifndef W4_TORCH_OP                   /* the kernel, in C (the op at the end is this file compiled again, as C++) */
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>
#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define PATH 512
#define CH 32                          /* columns per chunk: 16 even + 16 odd, 16 bytes of codes */
#elif defined(__AVX2__) && defined(__FMA__)
#define PATH 256
#define CH 16                          /* 8 even + 8 odd, 8 bytes of codes */
#else
#define PATH 0
#define CH 2                           /* the portable path reads x in its own order */
#endif
#define NB 4                           /* output rows of a block (the last block repeats row N-1 to fill it) */
#define PIECE 32                       /* a blocked weight's block: its NB rows' first PIECE bytes, then their next
                                        * (w4_weight.py's block_rows); a chunk never straddles two pieces */
/* The codes are fetched into L1 one block ahead: a block's NB rows are one contiguous span (rows of K/2 bytes, one
 * after the other, or their pieces interleaved), read at one cache line per chunk, so while a block is read the same
 * line of the next block is fetched. The hardware prefetcher alone, following NB streams, kept one decode row of
 * gate_up (bench/w4_gemm.py) at ~9 GB/s on 2 Zen 4 cores; fetching 256 bytes ahead in each row, ~17; a block ahead,
 * ~20 (rows, before the blocks). */

enum { INT4 = 0, FP4 = 1 };
enum { SYM = 0, ASYM = 1, NVFP4 = 2 }; /* how a group's 16 weights are made: (q - zp) * s, (q - z[g]) * s, fp4 */

static const float E2M1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                               -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

typedef struct {                       /* one weight [N, K]: kernels/w4_weight.py's buffers */
    const uint8_t *codes;              /* [N, K/2], row stride cs bytes */
    const void *scales;                /* [N, K/group] of dtype sdt, row stride ss elements */
    const uint8_t *zeros;              /* [N, K/group], row stride zs; NULL: every zero is zp */
    int64_t cs, ss, zs;
    int sdt, zp, kind, group, N, K, mode;
    float gs;                          /* fp4's global scale */
    int bf16_w;                        /* x is bfloat16: each weight rounded to bfloat16 once, as the reference does */
    int blocked;                       /* the codes' whole blocks of NB rows interleaved in pieces (w4_weight.py) */
} weight_t;

/* bytes from a piece of a row's codes to its next: row n's byte j is at cp[n] + (j / PIECE) * step + j % PIECE, with
 * cp[n] the row's first piece (w4_gemm gives a blocked weight's ragged last block blocked too) */
#define PIECE_STEP(blocked) ((blocked) ? NB * PIECE : PIECE)

/* ---- conversions (scalar ones: per group or per element of x, never in the inner loop) ---- */

static inline float from_bf16(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

static inline uint16_t to_bf16(float f) {                 /* round to nearest even, as torch's .to(bfloat16) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40);               /* NaN stays a (quiet) NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

static inline float from_f16(uint16_t h) {               /* exact, subnormals included */
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, u;
    if (e == 0x1f)
        u = sign | 0x7f800000u | (m << 13);
    else if (e)
        u = sign | ((e + 112) << 23) | (m << 13);
    else if (!m)
        u = sign;
    else {                                                 /* subnormal: normalise */
        e = 113;
        while (!(m & 0x400)) { m <<= 1; e--; }
        u = sign | (e << 23) | ((m & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

static inline float load_as_float(const void *p, int dt, int64_t i) {
    return dt == F32 ? ((const float *)p)[i] : dt == BF16 ? from_bf16(((const uint16_t *)p)[i])
                                                          : from_f16(((const uint16_t *)p)[i]);
}

/* Row n's group scales and zeros as float32 (sf, zf: G each), once per row block: the inner loop then reads a
 * group's scale and zero as broadcasts from L1. fp4's global scale stays apart: the reference multiplies by it after
 * the group scale (two roundings, kept). */
static inline __attribute__((always_inline)) void row_scales(const weight_t *w, int n, int G, float *sf, float *zf) {
    const char *s = (const char *)w->scales + (int64_t)n * w->ss * (w->sdt == F32 ? 4 : 2);
    int g = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    for (; g < G; g += 16) {                 /* 16 at a time, the last ones masked (a row of K = 1024 has 8 groups of */
        __mmask16 k = G - g >= 16 ? 0xffff : (__mmask16)((1u << (G - g)) - 1);        /* 128): one conversion each */
        __m512 v;
        if (w->sdt == F32)
            v = _mm512_maskz_loadu_ps(k, (const float *)s + g);
        else if (w->sdt == BF16)
            v = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, (const uint16_t *)s + g)), 16));
        else
            v = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, (const uint16_t *)s + g));
        _mm512_mask_storeu_ps(sf + g, k, v);
    }
#elif defined(__AVX2__) && defined(__F16C__)
    for (; g + 8 <= G; g += 8) {             /* 8 at a time, the rest one by one */
        __m256 v;
        if (w->sdt == F32)
            v = _mm256_loadu_ps((const float *)s + g);
        else if (w->sdt == BF16)
            v = _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)s + g))), 16));
        else
            v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)s + g)));
        _mm256_storeu_ps(sf + g, v);
    }
#endif
    for (; g < G; g++)
        sf[g] = load_as_float(s, w->sdt, g);
    if (w->zeros) {
        const uint8_t *z = w->zeros + (int64_t)n * w->zs;
        for (g = 0; g < G; g++)
            zf[g] = (float)z[g];
    }
}

/* ---- x laid out for the kernel ---- */

/* xd [M][Kp] float32 (Kp: K rounded up to the chunk, zero padded): chunk c's ch/2 even columns, then its odd ones,
 * column k being x's column perm[k] under act-order. With ch = 2 (the portable path) this is x itself. */
static void prepare_x(const void *x, int xdt, int64_t xs, int M, int K, const int64_t *perm, float *xd, int64_t Kp,
                      int ch) {
    for (int m = 0; m < M; m++) {
        const char *row = (const char *)x + (int64_t)m * xs * (xdt == F32 ? 4 : 2);
        float *out = xd + m * Kp;
        int64_t c = 0;
#if PATH == 512
        if (!perm && ch == 32) {                           /* 32 columns: two loads, two permutes, two stores */
            const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
            const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
            for (; c + 32 <= K; c += 32) {
                __m512 a, b;
                if (xdt == F32) {
                    a = _mm512_loadu_ps((const float *)row + c);
                    b = _mm512_loadu_ps((const float *)row + c + 16);
                } else {
                    const __m256i *h = (const __m256i *)((const uint16_t *)row + c);
                    a = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(h)), 16));
                    b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(h + 1)), 16));
                }
                _mm512_storeu_ps(out + c, _mm512_permutex2var_ps(a, even, b));
                _mm512_storeu_ps(out + c + 16, _mm512_permutex2var_ps(a, odd, b));
            }
        }
#endif
        for (; c < Kp; c += ch)
            for (int i = 0; i < ch / 2; i++)
                for (int odd = 0; odd < 2; odd++) {
                    int64_t k = c + 2 * i + odd;
                    out[c + odd * (ch / 2) + i] = k < K ? load_as_float(row, xdt, perm ? perm[k] : k) : 0.f;
                }
    }
}

#if defined(__AVX2__)
static inline float hsum8(__m256 a) {                    /* the sum of a's 8 lanes */
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
#endif

/* ---- the kernels of one block: NB rows of W (row pointers cp) against mb rows of x at xd ---- */
/* sf/zf: the rows' scales and zeros (row_scales), G apart; out[m * NB + n]. In each instance below nb, mb, dual and
 * mode are constants (always_inline): the accumulators are registers and the tables' recipe has no branch. */

#if PATH == 512
#define MB 4                           /* rows of x a pass keeps in registers: NB * MB = 16 accumulators */

/* float32 values rounded to the nearest bfloat16 (even on ties), kept in float32: a weight as x's dtype holds it */
static inline __m512 round_bf16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd);
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u)));
}

/* the 16 weights of group g of one row: (iota - zp) * s (izp: iota - zp), (iota - z) * s, or (E2M1 * s) * gs;
 * rounded to bfloat16 for bfloat16 x */
static inline __attribute__((always_inline)) __m512
table(const int mode, const float *sf, const float *zf, int g, __m512 izp, __m512 gs, int bf16_w) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 e2m1 = _mm512_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f,
                                       -4.f, -6.f);
    __m512 s = _mm512_set1_ps(sf[g]), t;
    if (mode == NVFP4)
        t = _mm512_mul_ps(_mm512_mul_ps(e2m1, s), gs);
    else if (mode == ASYM)
        t = _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps(zf[g])), s);
    else
        t = _mm512_mul_ps(izp, s);
    return bf16_w ? round_bf16(t) : t;
}

/* lane i = the sum of a[i]'s 16 lanes: pairs, then quads of the vectors added lane by lane, then their 128-bit
 * quarters */
static inline __attribute__((always_inline)) __m512 reduce16(const __m512 a[16]) {
    __m512 s8[8], s4[4], s2[2];
    _Pragma("GCC unroll 8")
    for (int i = 0; i < 8; i++)    /* each 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of a = a[2i], b = a[2i+1] */
        s8[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    _Pragma("GCC unroll 4")
    for (int i = 0; i < 4; i++) {  /* each 128-bit lane: its partial sums of a[4i .. 4i+3] */
        __m512d x = _mm512_castps_pd(s8[2 * i]), y = _mm512_castps_pd(s8[2 * i + 1]);
        s4[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    _Pragma("GCC unroll 2")
    for (int i = 0; i < 2; i++)    /* 128-bit lanes [x0+x1, x2+x3, y0+y1, y2+y3] of x = s4[2i], y = s4[2i+1] */
        s2[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s4[2 * i], s4[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(s4[2 * i], s4[2 * i + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s2[0], s2[1], 0x88), _mm512_shuffle_f32x4(s2[0], s2[1], 0xdd));
}

/* the NB x mb sums of a block zeroed (acc_odd: a lone row of x's second chain of sums) */
static inline __attribute__((always_inline)) void zero_sums(__m512 (*acc)[MB], __m512 *acc_odd, const int mb) {
    _Pragma("GCC unroll 4")
    for (int n = 0; n < NB; n++) {
        acc_odd[n] = _mm512_setzero_ps();
        _Pragma("GCC unroll 4")
        for (int m = 0; m < mb; m++) acc[n][m] = _mm512_setzero_ps();
    }
}

/* each sum's lanes added into out[m * NB + n] */
static inline __attribute__((always_inline)) void
store_sums(__m512 (*acc)[MB], const __m512 *acc_odd, const int mb, float *out) {
    if (mb == 1) {
        _Pragma("GCC unroll 4")
        for (int n = 0; n < NB; n++) out[n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[n][0], acc_odd[n]));
    } else {                                               /* all the sums at once: a third of the instructions */
        __m512 sums[NB * MB];
        _Pragma("GCC unroll 16")
        for (int i = 0; i < NB * MB; i++) sums[i] = i / NB < mb ? acc[i % NB][i / NB] : _mm512_setzero_ps();
        _mm512_storeu_ps(out, reduce16(sums));
    }
}

static inline __m512 iota_minus_zp(const weight_t *w) {  /* q - zp for q = 0..15: the symmetric tables' factor */
    return _mm512_sub_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                         _mm512_set1_ps((float)w->zp));
}

/* One chunk (32 columns): each row's 16 code bytes become its weights (we: even columns, wo: odd ones), multiplied
 * into the sums of every row of x. dual: the group size is a multiple of 16 but not of 32, so a chunk's halves
 * (columns 32c .. 32c+15, 32c+16 .. 32c+31) may lie in two groups: a permute of two tables (vpermt2ps: index bit 4
 * picks the second), made here per row (2 registers, not 2 * NB). half: the last chunk when K % 32 == 16, 8 bytes. */
static inline __attribute__((always_inline)) void
chunk(const uint8_t *const *cp, int c, const float *xc, int64_t Kp, const int mb, const int dual, const int mode,
      const int half, const __m512 *luts, const float *sf, const float *zf, int G, int g0, int g1, __m512 izp,
      __m512 gs, int bf, const int bl, const char *ahead, __m512 (*acc)[MB], __m512 *acc_odd) {
    const __m512i hi16 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 16, 16, 16, 16, 16, 16, 16, 16);
    _mm_prefetch(ahead + c * 64, _MM_HINT_T0);             /* the next block's line c (see `ahead`) */
    __m512 xe[MB], xo[MB];                                 /* x's chunk: loaded once, used by the NB rows */
    _Pragma("GCC unroll 4")
    for (int m = 0; m < mb; m++) {
        xe[m] = _mm512_loadu_ps(xc + m * Kp);
        xo[m] = _mm512_loadu_ps(xc + m * Kp + 16);
    }
    _Pragma("GCC unroll 4")
    for (int n = 0; n < NB; n++) {
        const uint8_t *at = bl ? cp[0] + (c >> 1) * (NB * PIECE) + n * PIECE + (c & 1) * 16   /* half a piece */
                               : cp[n] + c * 16;
        __m128i bytes = half ? _mm_loadl_epi64((const __m128i *)at) : _mm_loadu_si128((const __m128i *)at);
        __m512i v = _mm512_cvtepu8_epi32(bytes);           /* byte j = codes 2j (low nibble), 2j+1 (high) */
        __m512 we, wo;
        if (dual) {
            __m512 lut = table(mode, sf + n * G, zf + n * G, g0, izp, gs, bf);
            __m512 lut2 = table(mode, sf + n * G, zf + n * G, g1, izp, gs, bf);
            we = _mm512_permutex2var_ps(lut, _mm512_ternarylogic_epi32(v, _mm512_set1_epi32(0xf), hi16, 0xea), lut2);
            wo = _mm512_permutex2var_ps(lut, _mm512_or_si512(_mm512_srli_epi32(v, 4), hi16), lut2);
        } else {
            we = _mm512_permutexvar_ps(v, luts[n]);                          /* low 4 bits: the low code */
            wo = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), luts[n]);
        }
        if (half) {                                        /* lanes 8..15 are past K */
            we = _mm512_maskz_mov_ps(0xff, we);
            wo = _mm512_maskz_mov_ps(0xff, wo);
        }
        _Pragma("GCC unroll 4")
        for (int m = 0; m < mb; m++) {
            acc[n][m] = _mm512_fmadd_ps(we, xe[m], acc[n][m]);
            if (mb == 1)                                   /* one row of x: two chains of sums, not one */
                acc_odd[n] = _mm512_fmadd_ps(wo, xo[m], acc_odd[n]);
            else
                acc[n][m] = _mm512_fmadd_ps(wo, xo[m], acc[n][m]);
        }
    }
}

static inline __attribute__((always_inline)) void
block(const weight_t *w, const uint8_t *const *cp, const float *xd, int64_t Kp, const int mb, const int dual,
      const int mode, const int bl, const float *sf, const float *zf, int G, float *out) {
    __m512 acc[NB][MB], acc_odd[NB], luts[NB];
    zero_sums(acc, acc_odd, mb);
    const __m512 izp = iota_minus_zp(w), gs = _mm512_set1_ps(w->gs);
    const int group = w->group, K = w->K, full = K / CH, chunks = (K + CH - 1) / CH, per = group / CH;
    const char *ahead = (const char *)cp[0] + NB * w->cs;  /* the next block's rows: one line fetched per chunk */
    int g = 0, left = 0;                                   /* !dual: the next group, chunks left in the current */
    int g0 = 0, g1 = 0, end0 = group, end1 = group;        /* dual: the groups of columns 32c and 32c + 16 */
    for (int c = 0; c < chunks; c++) {
        const float *xc = xd + (int64_t)c * CH;
        if (!dual) {
            if (left == 0) {                               /* a new group: each row's table */
                _Pragma("GCC unroll 4")
                for (int n = 0; n < NB; n++) luts[n] = table(mode, sf + n * G, zf + n * G, g, izp, gs, w->bf16_w);
                g++;
                left = per;
            }
            left--;
            chunk(cp, c, xc, Kp, mb, 0, mode, 0, luts, sf, zf, G, 0, 0, izp, gs, 0, bl, ahead, acc, acc_odd);
        } else {
            while (c * CH >= end0) { g0++; end0 += group; }
            while (c * CH + 16 >= end1 && g1 + 1 < G) { g1++; end1 += group; }
            if (c < full)
                chunk(cp, c, xc, Kp, mb, 1, mode, 0, luts, sf, zf, G, g0, g1, izp, gs, w->bf16_w, bl, ahead, acc,
                      acc_odd);
            else
                chunk(cp, c, xc, Kp, mb, 1, mode, 1, luts, sf, zf, G, g0, g1, izp, gs, w->bf16_w, bl, ahead, acc,
                      acc_odd);
        }
    }
    store_sums(acc, acc_odd, mb, out);
}


#if defined(__AVX512BF16__)
/* bfloat16 x on a CPU with bfloat16 dot products (AVX512_BF16): the weights are made as bfloat16 (the table is a
 * group's 16 weights rounded to bfloat16, as the reference rounds them) and vdpbf16ps multiplies 32 pairs at once,
 * twice the float32 path's products per instruction; each product of two bfloat16 values is exact in float32, so the
 * result is still the reference's up to the order of the sums (vdpbf16ps reads a subnormal bfloat16 as 0, and the
 * tables' rounding flushes a subnormal weight to 0: the reference's x and weights have none in practice). A chunk is
 * 64 columns (32 bytes of codes a row) in one group (group % 64 == 0): vpermw takes 32 codes at once, its 32-entry
 * table being the group's 16 weights twice, so a byte zero-extended to 16 bits indexes its low code as it is (bit 4,
 * the high code's lowest, picks the same copy) and its high code after a shift. x is laid out to match (prepare_xb):
 * each chunk's 32 even columns, then its odd. */
#define BCH 64

/* t's 16 float32 values rounded to bfloat16 (to nearest, even on ties, as torch rounds), twice: one instruction
 * (vcvtne2ps2bf16) where rounding in integer arithmetic and packing took ten; at group 128 a block's tables had cost
 * as much as its chunks */
static inline __attribute__((always_inline)) __m512i table_bf16(__m512 t) {
    return (__m512i)_mm512_cvtne2ps_pbh(t, t);
}

static inline __attribute__((always_inline)) void
block_bf(const weight_t *w, const uint8_t *const *cp, const uint16_t *xb, int64_t Kp, const int mb, const int mode,
         const int bl, const float *sf, const float *zf, int G, float *out) {
    __m512 acc[NB][MB], acc_odd[NB];
    zero_sums(acc, acc_odd, mb);
    const __m512 izp = iota_minus_zp(w), gs = _mm512_set1_ps(w->gs);
    const int per = w->group / BCH;
    const char *ahead = (const char *)cp[0] + NB * w->cs;  /* as block(): two lines of the next block a chunk */
    for (int g = 0; g < G; g++) {
        __m512i tb[NB];
        _Pragma("GCC unroll 4")
        for (int n = 0; n < NB; n++) tb[n] = table_bf16(table(mode, sf + n * G, zf + n * G, g, izp, gs, 0));
        for (int c = g * per; c < (g + 1) * per; c++) {
            _mm_prefetch(ahead + c * 128, _MM_HINT_T0);
            _mm_prefetch(ahead + c * 128 + 64, _MM_HINT_T0);
            const uint16_t *xc = xb + (int64_t)c * BCH;
            _Pragma("GCC unroll 4")
            for (int n = 0; n < NB; n++) {
                __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(
                    bl ? cp[0] + c * (NB * PIECE) + n * PIECE : cp[n] + c * 32)));
                __m512bh we = (__m512bh)_mm512_permutexvar_epi16(v, tb[n]);
                __m512bh wo = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), tb[n]);
                _Pragma("GCC unroll 4")
                for (int m = 0; m < mb; m++) {
                    __m512bh xe = (__m512bh)_mm512_loadu_si512(xc + m * Kp);
                    __m512bh xo = (__m512bh)_mm512_loadu_si512(xc + m * Kp + 32);
                    acc[n][m] = _mm512_dpbf16_ps(acc[n][m], we, xe);
                    if (mb == 1)
                        acc_odd[n] = _mm512_dpbf16_ps(acc_odd[n], wo, xo);
                    else
                        acc[n][m] = _mm512_dpbf16_ps(acc[n][m], wo, xo);
                }
            }
        }
    }
    store_sums(acc, acc_odd, mb, out);
}

/* xb [M][Kp] bfloat16 (K a multiple of 64 here): each chunk's 32 even columns, then its 32 odd ones */
static void prepare_xb(const uint16_t *x, int64_t xs, int M, int K, const int64_t *perm, uint16_t *xb, int64_t Kp) {
    const __m512i even = _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32, 30, 28, 26,
                                          24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i one = _mm512_set1_epi16(1);
    for (int m = 0; m < M; m++) {
        const uint16_t *row = x + (int64_t)m * xs;
        uint16_t *out = xb + m * Kp;
        if (perm) {
            for (int64_t c = 0; c < K; c += BCH)
                for (int i = 0; i < BCH / 2; i++) {
                    out[c + i] = row[perm[c + 2 * i]];
                    out[c + BCH / 2 + i] = row[perm[c + 2 * i + 1]];
                }
            continue;
        }
        for (int64_t c = 0; c < K; c += BCH) {
            __m512i a = _mm512_loadu_si512(row + c), b = _mm512_loadu_si512(row + c + 32);
            _mm512_storeu_si512(out + c, _mm512_permutex2var_epi16(a, even, b));
            _mm512_storeu_si512(out + c + 32, _mm512_permutex2var_epi16(a, _mm512_add_epi16(even, one), b));
        }
    }
}

typedef void block_bf_fn(const weight_t *, const uint8_t *const *, const uint16_t *, int64_t, const float *,
                         const float *, int, float *);
#define INSTANCE_BF(MB_, MODE_, BL_)                                                                               \
    static __attribute__((noinline)) void block_bf_##MB_##_##MODE_##_##BL_(const weight_t *w,                     \
            const uint8_t *const *cp, const uint16_t *xb, int64_t Kp, const float *sf, const float *zf, int G,    \
            float *out) {                                                                                          \
        block_bf(w, cp, xb, Kp, MB_, MODE_, BL_, sf, zf, G, out);                                                  \
    }
#define MODES_BF(MB_, BL_) INSTANCE_BF(MB_, 0, BL_) INSTANCE_BF(MB_, 1, BL_) INSTANCE_BF(MB_, 2, BL_)
#define ROW_BF(MB_, BL_) {block_bf_##MB_##_0_##BL_, block_bf_##MB_##_1_##BL_, block_bf_##MB_##_2_##BL_}
MODES_BF(1, 0) MODES_BF(2, 0) MODES_BF(3, 0) MODES_BF(4, 0) MODES_BF(1, 1) MODES_BF(2, 1) MODES_BF(3, 1) MODES_BF(4, 1)
static block_bf_fn *const BLOCKS_BF[2][MB][3] = {                                /* [blocked][mb - 1][mode] */
    {ROW_BF(1, 0), ROW_BF(2, 0), ROW_BF(3, 0), ROW_BF(4, 0)}, {ROW_BF(1, 1), ROW_BF(2, 1), ROW_BF(3, 1), ROW_BF(4, 1)}};
#define BF16_DOTS 1
#endif

#elif PATH == 256
/* AVX2: no 16-entry permute, so each code is converted and scaled: (float(q) - z) * s (the reference's two exact
 * steps), fp4's E2M1 magnitude from an 8-entry permute of the low 3 bits and its sign from bit 3. A chunk is 16
 * columns (8 bytes), inside one group (the group size is a multiple of 16). 16 ymm registers: NB * MB = 8 sums.
 * block() takes bfloat16 x (each weight rounded to bfloat16, as its reference does); float32 x, block_grouped. */
#define MB 2

static inline __m256 round_bf16(__m256 v) {              /* as the AVX-512 path's */
    __m256i u = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd);
    return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xffff0000u)));
}

static inline __attribute__((always_inline)) __m256
dq8(const int mode, __m256i q, __m256 z, __m256 s, __m256 gs, int bf16_w) {
    __m256 w;
    if (mode == NVFP4) {
        const __m256 mag = _mm256_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f);
        __m256 v = _mm256_permutevar8x32_ps(mag, q);                     /* low 3 bits */
        __m256i sign = _mm256_and_si256(_mm256_slli_epi32(q, 28), _mm256_set1_epi32((int)0x80000000u));
        v = _mm256_xor_ps(v, _mm256_castsi256_ps(sign));
        w = _mm256_mul_ps(_mm256_mul_ps(v, s), gs);
    } else
        w = _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(q), z), s);
    return bf16_w ? round_bf16(w) : w;
}

static inline __attribute__((always_inline)) void
block(const weight_t *w, const uint8_t *const *cp, const float *xd, int64_t Kp, const int mb, const int dual,
      const int mode, const int bl, const float *sf, const float *zf, int G, float *out) {
    (void)dual, (void)bl;                                  /* rows or blocked alike: PIECE_STEP */
    __m256 acc[NB][MB], acc_odd[NB];
    for (int n = 0; n < NB; n++) {
        acc_odd[n] = _mm256_setzero_ps();
        for (int m = 0; m < mb; m++) acc[n][m] = _mm256_setzero_ps();
    }
    const int per = w->group / CH, ps = PIECE_STEP(w->blocked);
    const char *ahead = (const char *)cp[0] + NB * w->cs;
    const __m256i low4 = _mm256_set1_epi32(0xf);
    const __m256 gs = _mm256_set1_ps(w->gs);
    for (int g = 0; g < G; g++) {
        __m256 z[NB], s[NB];
        for (int n = 0; n < NB; n++) {
            z[n] = _mm256_set1_ps(mode == ASYM ? zf[n * G + g] : (float)w->zp);
            s[n] = _mm256_set1_ps(sf[n * G + g]);
        }
        for (int c = g * per; c < (g + 1) * per; c++) {
            const float *xc = xd + (int64_t)c * CH;
            if ((c & 1) == 0)                              /* 32 bytes of the block a chunk: a line every 2 */
                _mm_prefetch(ahead + c * 32, _MM_HINT_T0);
            for (int n = 0; n < NB; n++) {
                const uint8_t *at = cp[n] + (c >> 2) * ps + (c & 3) * 8;           /* a quarter of a piece */
                __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)at));
                __m256 we = dq8(mode, _mm256_and_si256(v, low4), z[n], s[n], gs, w->bf16_w);
                __m256 wo = dq8(mode, _mm256_srli_epi32(v, 4), z[n], s[n], gs, w->bf16_w);
                for (int m = 0; m < mb; m++) {
                    acc[n][m] = _mm256_fmadd_ps(we, _mm256_loadu_ps(xc + m * Kp), acc[n][m]);
                    if (mb == 1)
                        acc_odd[n] = _mm256_fmadd_ps(wo, _mm256_loadu_ps(xc + m * Kp + 8), acc_odd[n]);
                    else
                        acc[n][m] = _mm256_fmadd_ps(wo, _mm256_loadu_ps(xc + m * Kp + 8), acc[n][m]);
                }
            }
        }
    }
    for (int n = 0; n < NB; n++)
        for (int m = 0; m < mb; m++)
            out[m * NB + n] = hsum8(mb == 1 ? _mm256_add_ps(acc[n][m], acc_odd[n]) : acc[n][m]);
}

/* float32 x (AVX2): block() above makes each weight as the reference does, (q - z) * s, in five instructions a vector,
 * and once per pass of MB rows of x (four times for eight rows): its dequantization took more instructions than its
 * products, and one decode row ran at a seventh of the memory's bandwidth (2-core AMD EPYC 7001). Here a code becomes
 * the float32 of q itself (fp4: its E2M1 value), once for up to MB8 rows of x, and each group's products are summed per
 * row of x apart, then scaled: y = sum over groups of s * (sum q x - z * sum x), with each group's sum of x made once
 * per call (xg). Chains of sums enough to hide the multiply-add's latency: nr output rows at once (4 for one row of x,
 * 2 for two to four: 1.19x at three rows against 1, each load of x used twice; else 1), two chains a row of x for one
 * or two rows. The reference's value up to float32 rounding (bfloat16 x, whose reference rounds each weight to
 * bfloat16, stays with block()). */
#define MB8 8

static inline __attribute__((always_inline)) void
block_grouped(const weight_t *w, const uint8_t *const *cp, const float *xd, const float *xg, int64_t Kp, const int mb,
              const int mode, const float *sf, const float *zf, int G, float *out) {
    const int nr = mb == 1 ? 4 : mb <= 4 ? 2 : 1, two = mb <= 2;
    const int per = w->group / CH, ps = PIECE_STEP(w->blocked), chunks = w->K / CH;
    const char *ahead = (const char *)cp[0] + NB * w->cs;  /* the next block: a line every 8 chunks of a row */
    const __m256i low4 = _mm256_set1_epi32(0xf);
    const __m256 mag = _mm256_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f);
    for (int n0 = 0; n0 < NB; n0 += nr) {
        __m256 total[4][MB8];
        float fix[4][MB8];                                 /* sum over groups of s * z * sum x */
        _Pragma("GCC unroll 4")
        for (int r = 0; r < nr; r++)
            _Pragma("GCC unroll 8")
            for (int m = 0; m < mb; m++) total[r][m] = _mm256_setzero_ps(), fix[r][m] = 0.f;
        for (int g = 0; g < G; g++) {
            __m256 sum[4][MB8], sum2[4][MB8];
            _Pragma("GCC unroll 4")
            for (int r = 0; r < nr; r++)
                _Pragma("GCC unroll 8")
                for (int m = 0; m < mb; m++) sum[r][m] = sum2[r][m] = _mm256_setzero_ps();
            for (int c = g * per; c < (g + 1) * per; c++) {
                const int line = (n0 * chunks + c * nr) / 8;
                if ((c * nr) % 8 < nr)                     /* a line every 8 chunks, whatever nr */
                    _mm_prefetch(ahead + line * 64, _MM_HINT_T0);
                const float *xc = xd + (int64_t)c * CH;
                _Pragma("GCC unroll 4")
                for (int r = 0; r < nr; r++) {
                    const uint8_t *at = cp[n0 + r] + (c >> 2) * ps + (c & 3) * 8;
                    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)at));
                    __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_srli_epi32(v, 4);
                    __m256 we, wo;
                    if (mode == NVFP4) {                   /* E2M1: magnitude from the low 3 bits, sign from bit 3 */
                        const __m256i b3 = _mm256_set1_epi32(8);
                        we = _mm256_xor_ps(_mm256_permutevar8x32_ps(mag, lo),
                                           _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(lo, b3), 28)));
                        wo = _mm256_xor_ps(_mm256_permutevar8x32_ps(mag, hi),
                                           _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(hi, b3), 28)));
                    } else {
                        we = _mm256_cvtepi32_ps(lo);
                        wo = _mm256_cvtepi32_ps(hi);
                    }
                    _Pragma("GCC unroll 8")
                    for (int m = 0; m < mb; m++) {
                        sum[r][m] = _mm256_fmadd_ps(we, _mm256_loadu_ps(xc + m * Kp), sum[r][m]);
                        if (two)
                            sum2[r][m] = _mm256_fmadd_ps(wo, _mm256_loadu_ps(xc + m * Kp + 8), sum2[r][m]);
                        else
                            sum[r][m] = _mm256_fmadd_ps(wo, _mm256_loadu_ps(xc + m * Kp + 8), sum[r][m]);
                    }
                }
            }
            _Pragma("GCC unroll 4")
            for (int r = 0; r < nr; r++) {
                const int i = (n0 + r) * G + g;
                const float sc = mode == NVFP4 ? sf[i] * w->gs : sf[i];
                const float zs = mode == NVFP4 ? 0.f : sc * (mode == ASYM ? zf[i] : (float)w->zp);
                const __m256 s = _mm256_set1_ps(sc);
                _Pragma("GCC unroll 8")
                for (int m = 0; m < mb; m++) {
                    total[r][m] = _mm256_fmadd_ps(s, two ? _mm256_add_ps(sum[r][m], sum2[r][m]) : sum[r][m],
                                                  total[r][m]);
                    fix[r][m] += zs * xg[m * G + g];
                }
            }
        }
        _Pragma("GCC unroll 4")
        for (int r = 0; r < nr; r++)
            _Pragma("GCC unroll 8")
            for (int m = 0; m < mb; m++) out[m * NB + n0 + r] = hsum8(total[r][m]) - fix[r][m];
    }
}
#else
#define MB 1
#endif
#ifndef MB8
#define MB8 MB
#endif
#ifndef BF16_DOTS
#define BF16_DOTS 0
#endif

#if PATH
/* one function per (rows of x, dual, mode, blocked): each compiled with its constants */
typedef void block_fn(const weight_t *, const uint8_t *const *, const float *, int64_t, const float *, const float *,
                      int, float *);
#define INSTANCE(MB_, D_, MODE_, BL_)                                                                               \
    static __attribute__((noinline)) void block_##MB_##_##D_##_##MODE_##_##BL_(const weight_t *w,                 \
            const uint8_t *const *cp, const float *xd, int64_t Kp, const float *sf, const float *zf, int G,       \
            float *out) {                                                                                          \
        block(w, cp, xd, Kp, MB_, D_, MODE_, BL_, sf, zf, G, out);                                                 \
    }
#define MODES(MB_, D_, BL_) INSTANCE(MB_, D_, 0, BL_) INSTANCE(MB_, D_, 1, BL_) INSTANCE(MB_, D_, 2, BL_)
#define TABLE_ROW(MB_, D_, BL_)                                                                                    \
    {block_##MB_##_##D_##_0_##BL_, block_##MB_##_##D_##_1_##BL_, block_##MB_##_##D_##_2_##BL_}
#if MB == 4
#define DUAL_ROWS(D_, BL_) {TABLE_ROW(1, D_, BL_), TABLE_ROW(2, D_, BL_), TABLE_ROW(3, D_, BL_), TABLE_ROW(4, D_, BL_)}
#define ALL_MB(D_, BL_) MODES(1, D_, BL_) MODES(2, D_, BL_) MODES(3, D_, BL_) MODES(4, D_, BL_)
ALL_MB(0, 0) ALL_MB(1, 0) ALL_MB(0, 1) ALL_MB(1, 1)
static block_fn *const BLOCKS[2][2][MB][3] = {           /* [blocked][dual][mb - 1][mode] */
    {DUAL_ROWS(0, 0), DUAL_ROWS(1, 0)}, {DUAL_ROWS(0, 1), DUAL_ROWS(1, 1)}};
#else                                              /* AVX2: one instance for both layouts (PIECE_STEP), any group */
MODES(1, 0, 0) MODES(2, 0, 0)
static block_fn *const BLOCKS[2][2][MB][3] = {
    {{TABLE_ROW(1, 0, 0), TABLE_ROW(2, 0, 0)}, {TABLE_ROW(1, 0, 0), TABLE_ROW(2, 0, 0)}},
    {{TABLE_ROW(1, 0, 0), TABLE_ROW(2, 0, 0)}, {TABLE_ROW(1, 0, 0), TABLE_ROW(2, 0, 0)}}};
typedef void grouped_fn(const weight_t *, const uint8_t *const *, const float *, const float *, int64_t,
                        const float *, const float *, int, float *);
#define INSTANCE_G(MB_, MODE_)                                                                                    \
    static __attribute__((noinline)) void grouped_##MB_##_##MODE_(const weight_t *w, const uint8_t *const *cp,    \
            const float *xd, const float *xg, int64_t Kp, const float *sf, const float *zf, int G, float *out) {  \
        block_grouped(w, cp, xd, xg, Kp, MB_, MODE_, sf, zf, G, out);                                              \
    }
#define MODES_G(MB_) INSTANCE_G(MB_, 0) INSTANCE_G(MB_, 1) INSTANCE_G(MB_, 2)
#define ROW_G(MB_) {grouped_##MB_##_0, grouped_##MB_##_1, grouped_##MB_##_2}
MODES_G(1) MODES_G(2) MODES_G(3) MODES_G(4) MODES_G(5) MODES_G(6) MODES_G(7) MODES_G(8)
static grouped_fn *const GROUPED[MB8][3] = {ROW_G(1), ROW_G(2), ROW_G(3), ROW_G(4), ROW_G(5), ROW_G(6), ROW_G(7),
                                            ROW_G(8)};
#endif
#endif

/* ---- int8 activations (w4_gemm's q8: model.int8_activations, int4 weights) ---- */
/* Each row of x is rounded, per group of the weight's (sorted) columns, to int8 steps of d = amax / 127, amax the
 * group's largest |x|: qx = round-half-even(x * (127 / amax)) (llama.cpp's Q8_0 does the same per 32 columns). A
 * group's product is then an integer, I = sum q qx - z sum qx (exact in 32 bits), and y = sum over groups of
 * (s d) I in float32. kernels/w4.py's int8_rounded is the oracle (the same rounding, then the float product).
 * Why: on AVX2 a code times an int8 is one lane of vpmaddubsw (32 columns an instruction, two codes summed into 16
 * bits), where the float path converts each code and multiplies 8 columns an instruction: the float path's decode
 * was bound by its instructions at a third of the memory's bandwidth (2-core AMD EPYC 7001). */
#define Q8_MB 4                        /* rows of x a pass takes */

/* A group's largest |x| (a NaN is passed over, as the comparison in the scalar loop does) and q[i] =
 * round(v[i] * id) to nearest, ties to even (vroundps in that mode is nearbyintf in the default one): eight at a time
 * where the group allows */
static inline float group_amax(const float *v, int n) {
    float amax = 0.f;
    int i = 0;
#if defined(__AVX2__)
    if (n >= 8) {
        const __m256 sign = _mm256_set1_ps(-0.f);
        __m256 mx = _mm256_setzero_ps();
        for (; i + 8 <= n; i += 8)                      /* max(|v|, mx): mx where |v| is NaN */
            mx = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(v + i)), mx);
        float lanes[8];
        _mm256_storeu_ps(lanes, mx);
        for (int j = 0; j < 8; j++) amax = lanes[j] > amax ? lanes[j] : amax;
    }
#endif
    for (; i < n; i++) {
        const float a = fabsf(v[i]);
        amax = a > amax ? a : amax;
    }
    return amax;
}

static inline void group_round(const float *v, float id, int n, int32_t *q) {
    int i = 0;
#if defined(__AVX2__)
    const __m256 vid = _mm256_set1_ps(id);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_si256((__m256i *)(q + i), _mm256_cvtps_epi32(_mm256_round_ps(
            _mm256_mul_ps(_mm256_loadu_ps(v + i), vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
#endif
    for (; i < n; i++) q[i] = (int)nearbyintf(v[i] * id);
}

/* qx [M][K] (chunked by cw = 32 or 64: each cw columns as their cw / 2 even ones, then their odd ones; cw = 0: in
 * order), d [M][G] the groups' steps, qs [M][G] the groups' sums of qx as float32 (integers below 2^24: exact),
 * column k being x's column perm[k] under act-order. */
static void quantize_x(const void *x, int xdt, int64_t xs, int M, int K, int group, const int64_t *perm, int cw,
                       int8_t *qx, float *d, float *qs) {
    const int G = K / group;
    float v[group];
    int32_t q[group];
    for (int m = 0; m < M; m++) {
        const char *row = (const char *)x + (int64_t)m * xs * (xdt == F32 ? 4 : 2);
        for (int g = 0; g < G; g++) {
            const int64_t k0 = (int64_t)g * group;
            const float *src = v;                       /* float32 x in order is read where it is */
            if (xdt == F32 && !perm)
                src = (const float *)row + k0;
            else
                for (int i = 0; i < group; i++) v[i] = load_as_float(row, xdt, perm ? perm[k0 + i] : k0 + i);
            const float amax = group_amax(src, group);
            group_round(src, amax > 0.f ? 127.f / amax : 0.f, group, q);
            int8_t *out = qx + (int64_t)m * K + k0;
            if (cw)
                for (int c = 0; c < group; c += cw)     /* a chunk: its even columns, then its odd ones */
                    for (int j = 0; j < cw / 2; j++) {
                        out[c + j] = (int8_t)q[c + 2 * j];
                        out[c + cw / 2 + j] = (int8_t)q[c + 2 * j + 1];
                    }
            else
                for (int i = 0; i < group; i++) out[i] = (int8_t)q[i];
            int32_t sum = 0;
            for (int i = 0; i < group; i++) sum += q[i];
            d[m * G + g] = amax / 127.f;
            qs[m * G + g] = (float)sum;
        }
    }
}

#if defined(__AVX2__)
/* The chunk of nr rows of W at rp (each advanced by ps a chunk) against mb rows of qx at xc, its products summed
 * into acc (16 bits). wide: a chunk is a piece, 32 bytes of codes, whose low nibbles are its 32 even columns and
 * high nibbles its 32 odd ones, as qx lays them out (two masks and a shift make both); else 16 bytes, broadcast to
 * both halves, the high half shifted by 4, masked: 16 even columns, then 16 odd. vpmaddubsw multiplies the unsigned
 * codes by the signed qx and adds pairs into 16 bits. */
static inline __attribute__((always_inline)) void
chunk_q8(const uint8_t *const *rp, const int8_t *xc, int64_t K, const int nr, const int mb, const int wide,
         __m256i (*acc)[Q8_MB]) {
    const __m256i shifts = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4), low4 = _mm256_set1_epi8(0xf);
    _Pragma("GCC unroll 4")
    for (int r = 0; r < nr; r++) {
        if (wide) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)rp[r]);
            const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            _Pragma("GCC unroll 4")
            for (int m = 0; m < mb; m++)
                acc[r][m] = _mm256_add_epi16(acc[r][m], _mm256_add_epi16(
                    _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(xc + m * K))),
                    _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xc + m * K + 32)))));
        } else {
            const __m256i v = _mm256_and_si256(_mm256_srlv_epi32(
                _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)rp[r])), shifts), low4);
            _Pragma("GCC unroll 4")
            for (int m = 0; m < mb; m++)
                acc[r][m] = _mm256_add_epi16(acc[r][m], _mm256_maddubs_epi16(
                    v, _mm256_loadu_si256((const __m256i *)(xc + m * K))));
        }
    }
}

/* NB rows of W against mb rows of qx (chunked), nr output rows at once so that enough sums are in flight. Runs of
 * chunks (at most 16 products a 16-bit lane: 16 * 15 * 127 < 2^15) are widened to 32 bits (vpmaddwd), each lane's
 * sum q qx of the codes as stored (an integer, exact in float32) scaled by s d into the row's float sums. The codes'
 * offset z comes off once an output, at the end: the sum over groups of s z d qs, in scalars, where subtracting z qs
 * from the lanes cost two vector operations a group (the bench shapes' GEMM 1.06x at 8 rows, 2026-12-07). mode (SYM,
 * ASYM) is a constant of each instance. */
static inline __attribute__((always_inline)) void
block_q8(const weight_t *w, const uint8_t *const *cp, const int8_t *qx, const float *d, const float *qs,
         const int mb, const int wide, const int mode, const float *sf, const float *zf, int G, float *out) {
    const int nr = mb == 1 ? 4 : mb == 2 ? 2 : 1, CW = wide ? 64 : 32, run = wide ? 4 : 8;
    const int per = w->group / CW, ps = PIECE_STEP(w->blocked);
    const int64_t K = w->K;
    /* the next block's codes, fetched into L1 as this one is read: the bytes of the block this pass reads, a
     * chunk's worth at a time (a block is one stream when blocked) */
    const char *ahead = (const char *)cp[0] + NB * w->cs;
    const __m256i ones = _mm256_set1_epi16(1);
    const float zpf = (float)w->zp;
    for (int n0 = 0; n0 < NB; n0 += nr) {
        __m256 total[4][Q8_MB];
        const uint8_t *rp[4];
        _Pragma("GCC unroll 4")
        for (int r = 0; r < nr; r++) {
            rp[r] = cp[n0 + r];
            _Pragma("GCC unroll 4")
            for (int m = 0; m < mb; m++) total[r][m] = _mm256_setzero_ps();
        }
        const int8_t *xc = qx;
        const char *pf = ahead + (int64_t)n0 * w->cs;
        for (int g = 0; g < G; g++) {
            for (int c0 = 0; c0 < per; c0 += run) {
                const int c1 = c0 + run < per ? c0 + run : per;
                __m256i acc[4][Q8_MB];
                _Pragma("GCC unroll 4")
                for (int r = 0; r < nr; r++)
                    _Pragma("GCC unroll 4")
                    for (int m = 0; m < mb; m++) acc[r][m] = _mm256_setzero_si256();
                for (int c = c0; c < c1; c++) {
                    _mm_prefetch(pf, _MM_HINT_T0);
                    if (nr * CW / 2 > 64)
                        _mm_prefetch(pf + 64, _MM_HINT_T0);
                    pf += nr * CW / 2;
                    chunk_q8(rp, xc, K, nr, mb, wide, acc);
                    xc += CW;
                    const int step = wide ? ps : (xc - qx) & 32 ? 16 : ps - 16;   /* the next chunk: a piece, or */
                    _Pragma("GCC unroll 4")                                             /* a half piece */
                    for (int r = 0; r < nr; r++)
                        rp[r] += step;
                }
                _Pragma("GCC unroll 4")
                for (int r = 0; r < nr; r++) {
                    const float s = sf[(n0 + r) * G + g];
                    _Pragma("GCC unroll 4")
                    for (int m = 0; m < mb; m++)
                        total[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(acc[r][m], ones)),
                                                      _mm256_set1_ps(s * d[m * G + g]), total[r][m]);
                }
            }
        }
        _Pragma("GCC unroll 4")
        for (int r = 0; r < nr; r++)
            _Pragma("GCC unroll 4")
            for (int m = 0; m < mb; m++) {
                float fix = 0.f;                   /* sum over groups of s z d qs: the codes' offset z, outside */
                for (int g = 0; g < G; g++) {
                    const int i = (n0 + r) * G + g;
                    fix += sf[i] * (mode == ASYM ? zf[i] : zpf) * (d[m * G + g] * qs[m * G + g]);
                }
                out[m * NB + n0 + r] = hsum8(total[r][m]) - fix;
            }
    }
}

typedef void q8_fn(const weight_t *, const uint8_t *const *, const int8_t *, const float *, const float *,
                   const float *, const float *, int, float *);
#define INSTANCE_Q8(MB_, W_, MODE_)                                                                               \
    static __attribute__((noinline)) void q8_##MB_##_##W_##_##MODE_(const weight_t *w, const uint8_t *const *cp, \
            const int8_t *qx, const float *d, const float *qs, const float *sf, const float *zf, int G,           \
            float *out) {                                                                                          \
        block_q8(w, cp, qx, d, qs, MB_, W_, MODE_, sf, zf, G, out);                                                \
    }
#define MODES_Q8(MB_, W_) INSTANCE_Q8(MB_, W_, 0) INSTANCE_Q8(MB_, W_, 1)
#define WIDTHS_Q8(MB_) MODES_Q8(MB_, 0) MODES_Q8(MB_, 1)
WIDTHS_Q8(1) WIDTHS_Q8(2) WIDTHS_Q8(3) WIDTHS_Q8(4)
#define ROW_Q8(W_, MODE_) {q8_1_##W_##_##MODE_, q8_2_##W_##_##MODE_, q8_3_##W_##_##MODE_, q8_4_##W_##_##MODE_}
static q8_fn *const Q8[2][2][Q8_MB] = {{ROW_Q8(0, 0), ROW_Q8(0, 1)}, {ROW_Q8(1, 0), ROW_Q8(1, 1)}};  /* [wide][mode] */
#define Q8_VEC 1
#else
#define Q8_VEC 0
#endif

/* the same sums one at a time (no AVX2, or a group size that is not a multiple of 32; qx in order) */
static void block_q8_scalar(const weight_t *w, const uint8_t *const *cp, const int8_t *qx, const float *d,
                            const float *qs, int mb, const float *sf, const float *zf, int G, float *out) {
    for (int n = 0; n < NB; n++)
        for (int m = 0; m < mb; m++) {
            const int8_t *x = qx + (int64_t)m * w->K;
            float acc = 0.f;
            for (int g = 0; g < G; g++) {
                const int z = w->mode == ASYM ? (int)zf[n * G + g] : w->zp;
                int32_t sum = 0;
                for (int k = g * w->group; k < (g + 1) * w->group; k++)
                    sum += ((cp[n][(k >> 6) * PIECE_STEP(w->blocked) + ((k >> 1) & 31)] >> (4 * (k & 1))) & 0xf) * x[k];
                acc += (float)(sum - z * (int32_t)qs[m * G + g]) * (sf[n * G + g] * d[m * G + g]);
            }
            out[m * NB + n] = acc;
        }
}

/* The portable path (and any group size the vector paths do not take): one output row, one row of x at a time. */
static void block_scalar(const weight_t *w, const uint8_t *const *cp, const float *xd, int64_t Kp, int mb,
                         const float *sf, const float *zf, int G, float *out) {
    for (int n = 0; n < NB; n++)
        for (int m = 0; m < mb; m++) {
            const float *x = xd + (int64_t)m * Kp;
            float acc = 0.f;
            for (int g = 0; g < G; g++) {
                float s = sf[n * G + g], z = w->mode == ASYM ? zf[n * G + g] : (float)w->zp, sum = 0.f;
                for (int k = g * w->group; k < (g + 1) * w->group; k++) {
                    int q = (cp[n][(k >> 6) * PIECE_STEP(w->blocked) + ((k >> 1) & 31)] >> (4 * (k & 1))) & 0xf;
                    float wk = w->mode == NVFP4 ? (E2M1[q] * s) * w->gs : ((float)q - z) * s;
                    if (w->bf16_w)
                        wk = from_bf16(to_bf16(wk));
                    sum += wk * x[k];
                }
                acc += sum;
            }
            out[m * NB + n] = acc;
        }
}

/* which path this build compiled: 512, 256 or 0 (the tests check that a build for AVX2 took it) */
int w4_path(void) { return PATH; }
/* whether it has the bfloat16 dot products (block_bf: bfloat16 x, group % 64 == 0) */
int w4_bf16_dots(void) { return BF16_DOTS; }

static int setup(weight_t *w, int xdt) {
    if (w->K <= 0 || w->N <= 0 || w->group <= 0 || w->group % 2 || w->K % w->group)
        return 1;
    if ((w->kind != INT4 && w->kind != FP4) || (w->sdt != F32 && w->sdt != BF16 && w->sdt != F16)
        || (xdt != F32 && xdt != BF16))
        return 2;
    if (w->blocked && (w->K / 2) % PIECE)
        return 1;
    w->mode = w->kind == FP4 ? NVFP4 : w->zeros ? ASYM : SYM;
    return 0;
}

/* y [M, N] (row stride ys) = x [M, K] (row stride xs, x's dtype xdt: F32 or BF16; y the same) @ W^T; perm [K] or
 * NULL (act-order: column k of W multiplies x's column perm[k]); blocked: the codes' whole blocks interleaved (then
 * cs == K / 2). Returns 0, or a code (w4_cpu.py raises). */
int w4_gemm(const void *x, int xdt, int64_t xs, void *y, int64_t ys, int M, const uint8_t *codes, int64_t cs,
            const void *scales, int sdt, int64_t ss, const uint8_t *zeros, int64_t zs, const int64_t *perm,
            int N, int K, int group, int kind, int zp, float gs, int blocked, int q8) {
    weight_t w = {codes, scales, zeros, cs, ss, zs, sdt, zp, kind, group, N, K, 0, gs, xdt == BF16, blocked};
    int bad = setup(&w, xdt);
    if (!bad && q8 && w.mode == NVFP4)
        bad = 2;                                           /* int8 activations: int4 weights only */
    if (bad || M <= 0)
        return bad ? bad : M < 0;
    const int G = K / group, blocks = (N + NB - 1) / NB;
    const int bf = !q8 && BF16_DOTS && xdt == BF16 && group % 64 == 0;  /* bfloat16 dot products (block_bf) */
    const int vec = PATH && group % 16 == 0, ch = vec ? CH : 2;
    const int q8cw = q8 && Q8_VEC && group % 32 == 0 ? (group % 64 ? 32 : 64) : 0;   /* block_q8's chunk, or 0 */
    const int64_t Kp = q8 ? K : bf ? K : (K + ch - 1) / ch * ch;
    /* x as the kernel reads it: float32 (+ xg's sums), bfloat16, or int8 with its groups' steps and sums */
    const int64_t qbytes = ((int64_t)M * K + 63) / 64 * 64;                  /* qx, then its steps and sums */
    void *xd = malloc(q8 ? qbytes + 2 * sizeof(float) * M * G
                         : (bf ? 2 : sizeof(float)) * M * Kp + sizeof(float) * M * G);
    if (!xd)
        return 3;
    float *qd = (float *)((int8_t *)xd + (q8 ? qbytes : 0));
    float *qs = qd + (int64_t)M * G;
    if (q8)
        quantize_x(x, xdt, xs, M, K, group, perm, q8cw, xd, qd, qs);
    else
#if BF16_DOTS
    if (bf)
        prepare_xb(x, xs, M, K, perm, xd, Kp);
    else
#endif
        prepare_x(x, xdt, xs, M, K, perm, xd, Kp, ch);
    /* a blocked weight's last N % NB rows are rows: they are interleaved here, with the last row repeated to fill
     * the block, so that every block of a blocked weight is read alike (the kernels' addresses are constants) */
    uint8_t *tail = NULL;
    if (w.blocked && N % NB) {
        if (!(tail = malloc(NB * cs))) {
            free(xd);
            return 3;
        }
        for (int n = 0; n < NB; n++) {
            const uint8_t *row = codes + (int64_t)(N / NB * NB + n < N ? N / NB * NB + n : N - 1) * cs;
            for (int64_t p = 0; p < cs / PIECE; p++)
                memcpy(tail + p * NB * PIECE + n * PIECE, row + p * PIECE, PIECE);
        }
    }
    /* float32 x on AVX2: block_grouped, with each group's sum of x (after x's rows in xd) */
    const float *xg = NULL;
#if PATH == 256
    if (!q8 && vec && xdt == F32) {
        float *sums = (float *)xd + (int64_t)M * Kp;
        for (int m = 0; m < M; m++)
            for (int g = 0; g < G; g++) {
                const float *at = (const float *)xd + m * Kp + (int64_t)g * group;
                __m256 t = _mm256_setzero_ps();
                for (int k = 0; k < group; k += 8) t = _mm256_add_ps(t, _mm256_loadu_ps(at + k));
                sums[m * G + g] = hsum8(t);
            }
        xg = sums;
    }
#endif
    const int pass = q8 ? Q8_MB : xg ? MB8 : MB;           /* rows of x a pass takes */
    /* a few hundred output rows are worth a second thread's start (~2 us); fewer run on the calling thread alone */
    int threads = (int64_t)N * K * (M < 4 ? M : 4) < (1 << 18) ? 1 : omp_get_max_threads();
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int b = 0; b < blocks; b++) {
        float sf[NB * G], zf[NB * G], out[NB * (MB8 > Q8_MB ? MB8 : Q8_MB)];   /* zf: read only with zeros */
        const uint8_t *cp[NB];
        int n0 = b * NB, rows = N - n0 < NB ? N - n0 : NB;
        for (int n = 0; n < NB; n++) {                     /* the last block of a ragged N repeats its last row */
            int row = n < rows ? n0 + n : N - 1;
            cp[n] = !w.blocked ? codes + (int64_t)row * cs : (rows == NB ? codes + (int64_t)n0 * cs : tail) + n * PIECE;
            row_scales(&w, row, G, sf + n * G, zf + n * G);
        }
        for (int m0 = 0; m0 < M; m0 += pass) {             /* passes of MB (MB8) rows of x over the block's rows */
            int mb = M - m0 < pass ? M - m0 : pass;
            const float *xm = (const float *)xd + (int64_t)m0 * Kp;
            const int8_t *qm = (const int8_t *)xd + (int64_t)m0 * K;
            if (q8) {
#if Q8_VEC
                if (q8cw)
                    Q8[q8cw == 64][w.mode][mb - 1](&w, cp, qm, qd + (int64_t)m0 * G,
                                                   qs + (int64_t)m0 * G, sf, zf, G, out);
                else
#endif
                    block_q8_scalar(&w, cp, qm, qd + (int64_t)m0 * G, qs + (int64_t)m0 * G, mb, sf, zf, G, out);
            } else
#if PATH == 256
            if (xg)
                GROUPED[mb - 1][w.mode](&w, cp, xm, xg + (int64_t)m0 * G, Kp, sf, zf, G, out);
            else
#endif
#if BF16_DOTS
            if (bf)
                BLOCKS_BF[w.blocked][mb - 1][w.mode](&w, cp, (const uint16_t *)xd + (int64_t)m0 * Kp, Kp, sf, zf, G,
                                                     out);
            else
#endif
#if PATH
            if (vec)
                BLOCKS[w.blocked][group % 32 != 0][mb - 1][w.mode](&w, cp, xm, Kp, sf, zf, G, out);
            else
#endif
                block_scalar(&w, cp, xm, Kp, mb, sf, zf, G, out);
            for (int m = 0; m < mb; m++)
                for (int n = 0; n < rows; n++) {
                    int64_t at = (int64_t)(m0 + m) * ys + n0 + n;
                    if (xdt == F32) ((float *)y)[at] = out[m * NB + n];
                    else ((uint16_t *)y)[at] = to_bf16(out[m * NB + n]);
                }
        }
    }
    free(xd);
    free(tail);
    return 0;
}

/* W's rows r0 .. r1-1 in float32 (odt F32) or bfloat16 (BF16), columns in the weight's own (sorted) order: out
 * [r1-r0, K], each value as W4Weight.dequantize computes it. For a prefill, which multiplies a block of rows at a time
 * with the float GEMM. */
int w4_dequant(const uint8_t *codes, int64_t cs, const void *scales, int sdt, int64_t ss, const uint8_t *zeros,
               int64_t zs, int N, int K, int group, int kind, int zp, float gs, int r0, int r1, void *out, int odt,
               int blocked) {
    weight_t w = {codes, scales, zeros, cs, ss, zs, sdt, zp, kind, group, N, K, 0, gs, 0, blocked};
    int bad = setup(&w, odt);
    if (bad || r0 < 0 || r1 > N || r0 > r1)
        return bad ? bad : 4;
    const int G = K / group;
    #pragma omp parallel for schedule(static)
    for (int n = r0; n < r1; n++) {
        float sf[G], zf[G], buf[odt == F32 ? 1 : K];
        float *row = odt == F32 ? (float *)out + (int64_t)(n - r0) * K : buf;
        row_scales(&w, n, G, sf, zf);
        const int inter = blocked && n / NB * NB + NB <= N, ps = PIECE_STEP(inter);  /* the last N % NB: rows */
        const uint8_t *cp = inter ? codes + (int64_t)(n / NB * NB) * cs + n % NB * PIECE : codes + (int64_t)n * cs;
        int k = 0;
#if PATH == 512
        if (group % 16 == 0) {                             /* 32 columns at a time: the tables, interleaved back */
            const __m512i hi16 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 16, 16, 16, 16, 16, 16, 16, 16);
            const __m512i lo_idx = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
            const __m512i hi_idx = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
            const __m512 izp = iota_minus_zp(&w);
            const __m512 gsv = _mm512_set1_ps(gs);
            for (; k + 32 <= K; k += 32) {
                __m512 lut = table(w.mode, sf, zf, k / group, izp, gsv, 0);
                __m512 lut2 = table(w.mode, sf, zf, (k + 16) / group, izp, gsv, 0);
                const uint8_t *at = cp + (k >> 6) * ps + ((k >> 1) & 31);           /* 16 bytes: half a piece */
                __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)at));
                __m512 we = _mm512_permutex2var_ps(lut, _mm512_ternarylogic_epi32(v, _mm512_set1_epi32(0xf), hi16,
                                                                                 0xea), lut2);
                __m512 wo = _mm512_permutex2var_ps(lut, _mm512_or_si512(_mm512_srli_epi32(v, 4), hi16), lut2);
                _mm512_storeu_ps(row + k, _mm512_permutex2var_ps(we, lo_idx, wo));
                _mm512_storeu_ps(row + k + 16, _mm512_permutex2var_ps(we, hi_idx, wo));
            }
        }
#elif PATH == 256
        if (group % 16 == 0) {                             /* 16 columns at a time (block()'s dq8), interleaved back */
            const __m256 gsv = _mm256_set1_ps(gs);
            for (; k + 16 <= K; k += 16) {
                const int g = k / group;
                const __m256 z = _mm256_set1_ps(zeros ? zf[g] : (float)zp), s = _mm256_set1_ps(sf[g]);
                const uint8_t *at = cp + (k >> 6) * ps + ((k >> 1) & 31);           /* 8 bytes: a quarter piece */
                __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)at));
                __m256 we = dq8(w.mode, _mm256_and_si256(v, _mm256_set1_epi32(0xf)), z, s, gsv, 0);
                __m256 wo = dq8(w.mode, _mm256_srli_epi32(v, 4), z, s, gsv, 0);
                __m256 lo = _mm256_unpacklo_ps(we, wo), hi = _mm256_unpackhi_ps(we, wo);   /* pairs, by 128 bits */
                _mm256_storeu_ps(row + k, _mm256_permute2f128_ps(lo, hi, 0x20));
                _mm256_storeu_ps(row + k + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
            }
        }
#endif
        for (; k < K; k++) {
            int q = (cp[(k >> 6) * ps + ((k >> 1) & 31)] >> (4 * (k & 1))) & 0xf, g = k / group;
            row[k] = kind == FP4 ? (E2M1[q] * sf[g]) * gs : ((float)q - (zeros ? zf[g] : (float)zp)) * sf[g];
        }
        if (odt != F32)
            for (k = 0; k < K; k++) ((uint16_t *)out)[(int64_t)(n - r0) * K + k] = to_bf16(row[k]);
    }
    return 0;
}

#else  /* W4_TORCH_OP */
/* ---- the torch op, from C++: w4_cpu.py compiles this file a second time, as C++ against torch's headers, and links
 * both halves into one library. Called from a compiled graph or from Python, the op then costs ~2 us more than the
 * kernel, where a Python op around a ctypes call costs ~10 us more (a decode step of bench/common.py's MEMORY_BOUND
 * model makes 58 such calls). Rows beyond the GEMM kernel's (a prefill) go to the Python op
 * tinyserve::w4_prefill_cpu (w4_cpu.py), where the float GEMM is chosen. Without a C++ compiler or torch's headers
 * the library is the kernel alone, and w4_cpu.py registers the op in Python instead. */
#include <torch/library.h>
#include <ATen/ops/empty.h>
#include <ATen/core/dispatch/Dispatcher.h>

extern "C" int w4_gemm(const void *x, int xdt, int64_t xs, void *y, int64_t ys, int M, const uint8_t *codes,
                       int64_t cs, const void *scales, int sdt, int64_t ss, const uint8_t *zeros, int64_t zs,
                       const int64_t *perm, int N, int K, int group, int kind, int zp, float gs, int blocked,
                       int q8);
extern "C" int w4_torch_op(void) { return 1; }           /* w4_cpu.py asks whether the library has the op */

using Prefill = at::Tensor(const at::Tensor &, const at::Tensor &, const at::Tensor &,
                           const std::optional<at::Tensor> &, const std::optional<at::Tensor> &, int64_t, int64_t,
                           int64_t, double, bool, int64_t, bool);

static at::Tensor w4_linear_cpu(const at::Tensor &x, const at::Tensor &codes, const at::Tensor &scales,
                              const std::optional<at::Tensor> &zeros, const std::optional<at::Tensor> &perm,
                              int64_t group, int64_t kind, int64_t zero_point, double global_scale, bool blocked,
                              int64_t gemm_rows, bool int8_x) {
    const int64_t K = x.size(-1), N = codes.size(0);
    at::Tensor x2 = x.dim() == 2 ? x : x.reshape({-1, K});
    const int64_t M = x2.size(0);
    if (M > gemm_rows) {
        static auto prefill = c10::Dispatcher::singleton().findSchemaOrThrow("tinyserve::w4_prefill_cpu", "")
                                  .typed<Prefill>();
        return prefill.call(x, codes, scales, zeros, perm, group, kind, zero_point, global_scale, blocked,
                            gemm_rows, int8_x);
    }
    if (x2.scalar_type() != at::kFloat && x2.scalar_type() != at::kBFloat16)
        x2 = x2.to(at::kFloat);                            /* float16 activations: float32 inside */
    if (x2.stride(1) != 1 || (M > 1 && x2.stride(0) < K))
        x2 = x2.contiguous();
    at::Tensor y = at::empty({M, N}, x2.options());
    const auto st = scales.scalar_type();
    const int code = w4_gemm(x2.data_ptr(), x2.scalar_type() == at::kFloat ? F32 : BF16, x2.stride(0),
                             y.data_ptr(), N, (int)M, codes.data_ptr<uint8_t>(), codes.stride(0), scales.data_ptr(),
                             st == at::kFloat ? F32 : st == at::kBFloat16 ? BF16 : F16,
                             scales.stride(0), zeros ? zeros->data_ptr<uint8_t>() : nullptr,
                             zeros ? zeros->stride(0) : 0, perm ? perm->data_ptr<int64_t>() : nullptr, (int)N,
                             (int)K, (int)group, (int)kind, (int)zero_point, (float)global_scale, blocked,
                             int8_x);
    TORCH_CHECK(code == 0, "w4_cpu.c refused the GEMM (code ", code, "): x ", x.sizes(), ", W [", N, ", ", K,
                "], group ", group);
    if (y.scalar_type() != x.scalar_type())
        y = y.to(x.scalar_type());
    if (x.dim() == 2)
        return y;
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = N;
    return y.view(shape);
}

/* the op's schema is defined in w4_cpu.py (with its shape function for torch.compile); this is its CPU kernel */
TORCH_LIBRARY_IMPL(tinyserve, CPU, m) { m.impl("w4_linear_cpu", w4_linear_cpu); }
#endif
