/* Paged decode / verify attention on the CPU, reading each key and value where it lies in the pool (attention_cpu.py
 * builds and calls it; kernels/attention.py's torch reference is its oracle).
 *
 * One query row per sequence position: row i attends to keys 0 .. lens[i]-1 of page-table row rows[i] (rows NULL:
 * row i). The pool of one layer holds element (page, k/v, token, kv head, d) at
 *   page * sp + kv * sk + token * st + head * sh + d          (d contiguous)
 * so a page's rows are read in place, never gathered into a copy of the context. Each row is one work item: its
 * heads read a page while it is in L1 (the G query heads of a kv head share its rows, no per-head copy), and the
 * scores of a page stay in a small block (online softmax, page by page). When there are fewer items than threads,
 * each item's keys are split into parts whose partial sums are joined by their maxima (as flash decoding does), so a
 * single long sequence uses every core. The threads are torch's own OpenMP team (the same libgomp, loaded once).
 *
 * The file has two halves: the kernel in C, and at its end the torch op around it in C++, compiled from this same
 * file a second time with ATTN_TORCH_OP defined (attention_cpu.py links both into one library).
 */
#ifndef ATTN_TORCH_OP                 /* the kernel, in C */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define MAX_G 32
#define MAX_H 128
#define MAX_HD 256
#define MAX_PS 256

typedef uint16_t bf16_t;

/* 8 floats: the compiler maps them onto AVX2 / AVX-512 / NEON registers (head_dim is a multiple of 8 here) */
typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }
static inline float hsum8(v8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }
/* the sums of 8 vectors, one per lane: pairs, then quads, then halves added across */
static inline v8 sum8x8(const v8 a[8]) {
    v8 u[4], w[2];
    for (int i = 0; i < 4; i++)
        u[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14)
             + __builtin_shufflevector(a[2 * i], a[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int i = 0; i < 2; i++)
        w[i] = __builtin_shufflevector(u[2 * i], u[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13)
             + __builtin_shufflevector(u[2 * i], u[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(w[0], w[1], 0, 1, 2, 3, 8, 9, 10, 11)
         + __builtin_shufflevector(w[0], w[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

/* 8 values of a pool row as float32, converted in registers: bf16 is a shift, f16 a hardware conversion where the
 * CPU has one (x86's F16C, ARM's FP16). */
static inline v8 ld_f32(const float *p) { return load8(p); }
#if defined(__AVX2__)
static inline v8 ld_bf16(const bf16_t *p) {                   /* widen to 32 bits, shift into the high half */
    __m256 f = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    v8 v;
    memcpy(&v, &f, sizeof v);
    return v;
}
#else
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
static inline v8 ld_bf16(const bf16_t *p) {
    u16x8 h;
    memcpy(&h, p, sizeof h);
    u32x8 w = __builtin_convertvector(h, u32x8) << 16;
    v8 v;
    memcpy(&v, &w, sizeof v);                                 /* memcpy: no float read through an int pointer */
    return v;
}
#endif
#if defined(__F16C__)                                         /* x86's conversion instruction */
static inline v8 ld_f16(const _Float16 *p) {
    __m256 f = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    v8 v;
    memcpy(&v, &f, sizeof v);
    return v;
}
#elif defined(__FLT16_MAX__)                                  /* the compiler has _Float16 (ARM: one instruction) */
typedef _Float16 h8 __attribute__((vector_size(16)));
static inline v8 ld_f16(const _Float16 *p) { h8 h; memcpy(&h, p, sizeof h); return __builtin_convertvector(h, v8); }
#endif

#define BLOCK 64                                              /* output values of one head kept in 8 registers */

/* One part of one row: keys [t_begin, t_end), for all H query heads (head h reads kv head h / G). Writes the part's
 * running maximum m[h], sum l[h] and unnormalised output acc[h][d]. Scores: for each head, 8 keys at a time, their
 * 8 dot products kept in registers and summed across lanes together (sum8x8), the G heads of a kv head reading its
 * key rows from L1 after the first. Values: for each head, BLOCK outputs stay in registers while the page's value
 * rows stream through, so each multiply-add costs one load, not a load and a store. */
#define PART(NAME, T, LD)                                                                                           \
static void NAME(const float *qs, const T *pool, int64_t sp, int64_t sk, int64_t st, int64_t sh,                   \
                 const int32_t *pages, int t_begin, int t_end, int H, int G, int hd, int ps, float *m, float *l,   \
                 float *acc) {                                                                                      \
    static _Thread_local float s[MAX_H][MAX_PS];                                                                    \
    for (int h = 0; h < H; h++) { m[h] = -FLT_MAX; l[h] = 0.f; memset(acc + h * hd, 0, sizeof(float) * hd); }      \
    for (int t0 = t_begin; t0 < t_end;) {                                                                           \
        int page = t0 / ps, first = t0 % ps;                                                                        \
        int cnt = (page + 1) * ps < t_end ? ps - first : t_end - t0;                                                \
        const T *base = pool + (int64_t)pages[page] * sp + (int64_t)first * st;                                    \
        for (int h = 0; h < H; h++) {                                                                               \
            const float *qh = qs + h * hd;                                                                          \
            const T *k = base + (h / G) * sh;                                                                       \
            int j = 0;                                                                                              \
            for (; j + 8 <= cnt; j += 8) {                     /* 8 keys at a time: 8 sums in registers */          \
                v8 a[8] = {{0}};                                                                                    \
                for (int d = 0; d < hd; d += 8) {                                                                   \
                    v8 qd = load8(qh + d);                                                                          \
                    for (int c = 0; c < 8; c++) a[c] += qd * LD(k + (j + c) * st + d);                              \
                }                                                                                                   \
                store8(s[h] + j, sum8x8(a));                                                                        \
            }                                                                                                       \
            for (; j < cnt; j++) {                                                                                  \
                v8 a = {0};                                                                                         \
                for (int d = 0; d < hd; d += 8) a += load8(qh + d) * LD(k + j * st + d);                            \
                s[h][j] = hsum8(a);                                                                                 \
            }                                                                                                       \
        }                                                                                                           \
        for (int h = 0; h < H; h++) {                                                                               \
            float top = m[h], sum = 0.f;                                                                            \
            for (int j = 0; j < cnt; j++) top = s[h][j] > top ? s[h][j] : top;                                      \
            float keep = expf(m[h] - top);                                                                          \
            _Pragma("omp simd reduction(+:sum)")                                                                    \
            for (int j = 0; j < cnt; j++) { float p = expf(s[h][j] - top); s[h][j] = p; sum += p; }                 \
            m[h] = top;                                                                                             \
            l[h] = l[h] * keep + sum;                                                                               \
            if (keep != 1.f) {                                                                                      \
                float *a = acc + h * hd;                                                                            \
                _Pragma("omp simd")                                                                                 \
                for (int d = 0; d < hd; d++) a[d] *= keep;                                                          \
            }                                                                                                       \
        }                                                                                                           \
        for (int h = 0; h < H; h++) {                                                                               \
            const T *v = base + sk + (h / G) * sh;                                                                  \
            const float *p = s[h];                                                                                  \
            int d0 = 0;                                                                                             \
            for (; d0 + BLOCK <= hd; d0 += BLOCK) {                                                                 \
                v8 a[BLOCK / 8];                                                                                    \
                for (int c = 0; c < BLOCK / 8; c++) a[c] = load8(acc + h * hd + d0 + 8 * c);                        \
                for (int j = 0; j < cnt; j++)                                                                       \
                    for (int c = 0; c < BLOCK / 8; c++) a[c] += p[j] * LD(v + j * st + d0 + 8 * c);                 \
                for (int c = 0; c < BLOCK / 8; c++) store8(acc + h * hd + d0 + 8 * c, a[c]);                        \
            }                                                                                                       \
            for (; d0 < hd; d0 += 8) {                                /* hd not a multiple of BLOCK: 8 at a time */ \
                v8 a = load8(acc + h * hd + d0);                                                                    \
                for (int j = 0; j < cnt; j++) a += p[j] * LD(v + j * st + d0);                                      \
                store8(acc + h * hd + d0, a);                                                                       \
            }                                                                                                       \
        }                                                                                                           \
        t0 += cnt;                                                                                                  \
    }                                                                                                               \
}

PART(part_f32, float, ld_f32)
PART(part_bf16, bf16_t, ld_bf16)
#ifdef __FLT16_MAX__
PART(part_f16, _Float16, ld_f16)
#endif

/* q [N, H, hd] and out [N, H, hd] float32, contiguous; dtype 0 float32, 1 bfloat16, 2 float16 (the pool's). A row
 * is one work item, or several parts of its keys when there are fewer rows than threads; the parts of a row are
 * joined by their maxima (as flash decoding does). */
int paged_decode(const float *q, float *out, const void *pool, int dtype, int64_t sp, int64_t sk, int64_t st,
                 int64_t sh, const int32_t *page_table, int64_t width, const int64_t *rows, const int32_t *lens,
                 int N, int H, int KV, int hd, int ps, float scale) {
    int G = H / KV;
    if (G > MAX_G || H > MAX_H || hd > MAX_HD || hd % 8 || ps > MAX_PS || G * KV != H)
        return 1;
#ifndef __FLT16_MAX__
    if (dtype == 2)
        return 3;
#endif
    int threads = omp_get_max_threads();
    int splits = N >= threads ? 1 : (threads + N - 1) / N;
    int64_t part = (int64_t)H * (hd + 2);                      /* m[H], l[H], acc[H][hd] of one part */
    float *parts = malloc(sizeof(float) * part * N * splits);
    if (!parts)
        return 2;
    #pragma omp parallel for schedule(static)
    for (int w = 0; w < N * splits; w++) {
        int n = w / splits, piece = w % splits;
        const int32_t *pages = page_table + (rows ? rows[n] : n) * width;
        int L = lens[n];
        int t_begin = (int)((int64_t)L * piece / splits), t_end = (int)((int64_t)L * (piece + 1) / splits);
        float qs[MAX_H * MAX_HD];
        const float *qn = q + (int64_t)n * H * hd;
        for (int i = 0; i < H * hd; i++) qs[i] = qn[i] * scale;
        float *m = parts + part * w, *l = m + H, *acc = l + H;
        if (dtype == 0)
            part_f32(qs, (const float *)pool, sp, sk, st, sh, pages, t_begin, t_end, H, G, hd, ps, m, l, acc);
        else if (dtype == 1)
            part_bf16(qs, (const bf16_t *)pool, sp, sk, st, sh, pages, t_begin, t_end, H, G, hd, ps, m, l, acc);
#ifdef __FLT16_MAX__
        else
            part_f16(qs, (const _Float16 *)pool, sp, sk, st, sh, pages, t_begin, t_end, H, G, hd, ps, m, l, acc);
#endif
    }
    for (int n = 0; n < N; n++) {                              /* join the parts: rescale each to the top max */
        for (int h = 0; h < H; h++) {
            float top = -FLT_MAX, total = 0.f;
            for (int p = 0; p < splits; p++) {
                float *m = parts + part * (n * splits + p);
                if (m[H + h] > 0.f && m[h] > top) top = m[h];
            }
            float *o = out + ((int64_t)n * H + h) * hd;
            memset(o, 0, sizeof(float) * hd);
            for (int p = 0; p < splits; p++) {
                float *m = parts + part * (n * splits + p), *l = m + H, *acc = l + H + h * hd;
                if (l[h] <= 0.f) continue;
                float w = expf(m[h] - top);
                total += l[h] * w;
                for (int d = 0; d < hd; d++) o[d] += acc[d] * w;
            }
            float inv = total > 0.f ? 1.f / total : 0.f;
            for (int d = 0; d < hd; d++) o[d] *= inv;
        }
    }
    free(parts);
    return 0;
}

#else  /* ATTN_TORCH_OP */
/* ---- the torch op tinyserve::paged_decode_cpu, from C++ (its schema and shape function are in attention_cpu.py):
 * three calls a decode step of the bench model, each 19-22 us on one sequence against 13-19 us for the kernel called
 * through ctypes, where the same op in Python around a ctypes call (paged_decode_cpu_python, without a C++ compiler)
 * takes 37-42 us. */
#include <torch/library.h>
#include <ATen/ops/empty_like.h>

extern "C" int paged_decode(const float *q, float *out, const void *pool, int dtype, int64_t sp, int64_t sk,
                            int64_t st, int64_t sh, const int32_t *page_table, int64_t width, const int64_t *rows,
                            const int32_t *lens, int N, int H, int KV, int hd, int ps, float scale);
extern "C" int attention_torch_op(void) { return 1; }  /* attention_cpu.py asks whether the library has the op */

static at::Tensor paged_decode_cpu(const at::Tensor &q, const at::Tensor &rows, const at::Tensor &page_table,
                                   const at::Tensor &seq_lens, const std::optional<at::Tensor> &table_rows,
                                   double scale) {
    const auto dt = rows.scalar_type();
    TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, "attention_cpu.c: a pool of ", dt);
    TORCH_CHECK(rows.dim() == 5 && rows.stride(4) == 1, "attention_cpu.c: the pool's head_dim must be contiguous");
    const at::Tensor qf = q.to(at::kFloat).contiguous();
    at::Tensor out = at::empty_like(qf);
    const at::Tensor table = page_table.to(at::kInt).contiguous(), lens = seq_lens.to(at::kInt).contiguous();
    const at::Tensor which = table_rows ? table_rows->to(at::kLong).contiguous() : at::Tensor();
    const int N = (int)q.size(0), H = (int)q.size(1), hd = (int)q.size(2);
    const int code = paged_decode(qf.data_ptr<float>(), out.data_ptr<float>(), rows.data_ptr(),
                                  dt == at::kFloat ? 0 : dt == at::kBFloat16 ? 1 : 2, rows.stride(0), rows.stride(1),
                                  rows.stride(2), rows.stride(3), table.data_ptr<int32_t>(), table.stride(0),
                                  table_rows ? which.data_ptr<int64_t>() : nullptr, lens.data_ptr<int32_t>(), N, H,
                                  (int)rows.size(3), hd, (int)rows.size(2), (float)scale);
    TORCH_CHECK(code == 0, "attention_cpu.c refused the call (code ", code, "): H ", H, ", KV ", rows.size(3),
                ", hd ", hd, ", page size ", rows.size(2));
    return out.scalar_type() == q.scalar_type() ? out : out.to(q.scalar_type());
}

TORCH_LIBRARY_IMPL(tinyserve, CPU, m) { m.impl("paged_decode_cpu", paged_decode_cpu); }
#endif
