/* Paged decode / verify attention on the CPU, reading each key and value where it lies in the pool (attention_cpu.py
 * builds and calls it; kernels/attention.py's torch reference is its oracle).
 *
 * One query row per sequence position: row i attends to keys 0 .. lens[i]-1 of page-table row rows[i] (rows NULL:
 * row i). The pool of one layer holds element (page, k/v, token, kv head, d) at
 *   page * sp + kv * sk + token * st + head * sh + d          (d contiguous)
 * so a page's rows are read in place, never gathered into a copy of the context. Each (row, kv head) is one work
 * item: the G query heads that share the kv head read each key once, and the scores of a page stay in a small
 * block (online softmax, page by page). When there are fewer items than threads, each item's keys are split into
 * parts whose partial sums are joined by their maxima (as flash decoding does), so a single long sequence uses every
 * core. The threads are torch's own OpenMP team (the same libgomp, loaded once).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#define MAX_G 32
#define MAX_HD 256
#define MAX_PS 256

typedef uint16_t bf16_t;

/* A row of hd values as float32 (the conversion loops vectorize: F16C / AVX-512 converts, a shift makes bf16). */
static inline void row_f32(const float *p, float *out, int hd) { memcpy(out, p, sizeof(float) * hd); }
static inline void row_bf16(const bf16_t *p, float *out, int hd) {
    uint32_t bits[MAX_HD];                                    /* memcpy: no float read through an int pointer */
    _Pragma("omp simd")
    for (int d = 0; d < hd; d++) bits[d] = (uint32_t)p[d] << 16;
    memcpy(out, bits, sizeof(float) * hd);
}
#ifdef __FLT16_MAX__                                          /* the compiler has _Float16 */
static inline void row_f16(const _Float16 *p, float *out, int hd) {
    _Pragma("omp simd")
    for (int d = 0; d < hd; d++) out[d] = (float)p[d];
}
#endif

/* One part of one work item: keys [t_begin, t_end) of a row, for the G heads of one kv head. Writes the part's
 * running maximum m[g], sum l[g] and unnormalised output acc[g][d]. */
#define PART(NAME, T, ROW)                                                                                          \
static void NAME(const float *qs, const T *pool, int64_t sp, int64_t sk, int64_t st, const int32_t *pages,         \
                 int t_begin, int t_end, int G, int hd, int ps, float *m, float *l, float *acc) {                  \
    float s[MAX_G][MAX_PS], row[MAX_HD];                                                                            \
    for (int g = 0; g < G; g++) { m[g] = -FLT_MAX; l[g] = 0.f; memset(acc + g * hd, 0, sizeof(float) * hd); }      \
    for (int t0 = t_begin; t0 < t_end;) {                                                                           \
        int page = t0 / ps, first = t0 % ps;                                                                        \
        int cnt = (page + 1) * ps < t_end ? ps - first : t_end - t0;                                                \
        const T *base = pool + (int64_t)pages[page] * sp + (int64_t)first * st;                                    \
        for (int j = 0; j < cnt; j++) {                                                                             \
            ROW(base + j * st, row, hd);                                                                            \
            for (int g = 0; g < G; g++) {                                                                           \
                const float *qg = qs + g * hd;                                                                      \
                float x = 0.f;                                                                                      \
                _Pragma("omp simd reduction(+:x)")                                                                  \
                for (int d = 0; d < hd; d++) x += qg[d] * row[d];                                                   \
                s[g][j] = x;                                                                                        \
            }                                                                                                       \
        }                                                                                                           \
        for (int g = 0; g < G; g++) {                                                                               \
            float top = m[g], sum = 0.f;                                                                            \
            for (int j = 0; j < cnt; j++) top = s[g][j] > top ? s[g][j] : top;                                      \
            float keep = expf(m[g] - top);                                                                          \
            _Pragma("omp simd reduction(+:sum)")                                                                    \
            for (int j = 0; j < cnt; j++) { float p = expf(s[g][j] - top); s[g][j] = p; sum += p; }                 \
            m[g] = top;                                                                                             \
            l[g] = l[g] * keep + sum;                                                                               \
            float *a = acc + g * hd;                                                                                \
            _Pragma("omp simd")                                                                                     \
            for (int d = 0; d < hd; d++) a[d] *= keep;                                                              \
        }                                                                                                           \
        for (int j = 0; j < cnt; j++) {                                                                             \
            ROW(base + sk + j * st, row, hd);                                                                       \
            for (int g = 0; g < G; g++) {                                                                           \
                float p = s[g][j], *a = acc + g * hd;                                                               \
                _Pragma("omp simd")                                                                                 \
                for (int d = 0; d < hd; d++) a[d] += p * row[d];                                                    \
            }                                                                                                       \
        }                                                                                                           \
        t0 += cnt;                                                                                                  \
    }                                                                                                               \
}

PART(part_f32, float, row_f32)
PART(part_bf16, bf16_t, row_bf16)
#ifdef __FLT16_MAX__
PART(part_f16, _Float16, row_f16)
#endif

/* q [N, H, hd] and out [N, H, hd] float32, contiguous; dtype 0 float32, 1 bfloat16, 2 float16 (the pool's). */
int paged_decode(const float *q, float *out, const void *pool, int dtype, int64_t sp, int64_t sk, int64_t st,
                 int64_t sh, const int32_t *page_table, int64_t width, const int64_t *rows, const int32_t *lens,
                 int N, int H, int KV, int hd, int ps, float scale) {
    int G = H / KV;
    if (G > MAX_G || hd > MAX_HD || ps > MAX_PS || G * KV != H)
        return 1;
#ifndef __FLT16_MAX__
    if (dtype == 2)
        return 3;
#endif
    int threads = omp_get_max_threads();
    int items = N * KV;
    int splits = items >= threads ? 1 : (threads + items - 1) / items;
    int64_t part = (int64_t)G * (hd + 2);                      /* m[G], l[G], acc[G][hd] of one part */
    float *parts = malloc(sizeof(float) * part * items * splits);
    if (!parts)
        return 2;
    #pragma omp parallel for schedule(static)
    for (int w = 0; w < items * splits; w++) {
        int item = w / splits, sp_i = w % splits, n = item / KV, kvh = item % KV;
        const int32_t *pages = page_table + (rows ? rows[n] : n) * width;
        int L = lens[n];
        int t_begin = (int)((int64_t)L * sp_i / splits), t_end = (int)((int64_t)L * (sp_i + 1) / splits);
        float qs[MAX_G * MAX_HD];
        const float *qh = q + ((int64_t)n * H + kvh * G) * hd;
        for (int i = 0; i < G * hd; i++) qs[i] = qh[i] * scale;
        float *m = parts + part * w, *l = m + G, *acc = l + G;
        int64_t head = (int64_t)kvh * sh;
        if (dtype == 0)
            part_f32(qs, (const float *)pool + head, sp, sk, st, pages, t_begin, t_end, G, hd, ps, m, l, acc);
        else if (dtype == 1)
            part_bf16(qs, (const bf16_t *)pool + head, sp, sk, st, pages, t_begin, t_end, G, hd, ps, m, l, acc);
#ifdef __FLT16_MAX__
        else
            part_f16(qs, (const _Float16 *)pool + head, sp, sk, st, pages, t_begin, t_end, G, hd, ps, m, l, acc);
#endif
    }
    for (int item = 0; item < items; item++) {                 /* join the parts: rescale each to the top max */
        int n = item / KV, kvh = item % KV;
        for (int g = 0; g < G; g++) {
            float top = -FLT_MAX, total = 0.f;
            for (int p = 0; p < splits; p++) {
                float *m = parts + part * (item * splits + p);
                if (m[G + g] > 0.f && m[g] > top) top = m[g];
            }
            float *o = out + ((int64_t)n * H + kvh * G + g) * hd;
            memset(o, 0, sizeof(float) * hd);
            for (int p = 0; p < splits; p++) {
                float *m = parts + part * (item * splits + p), *l = m + G, *acc = l + G + g * hd;
                if (l[g] <= 0.f) continue;
                float w = expf(m[g] - top);
                total += l[g] * w;
                for (int d = 0; d < hd; d++) o[d] += acc[d] * w;
            }
            float inv = total > 0.f ? 1.f / total : 0.f;
            for (int d = 0; d < hd; d++) o[d] *= inv;
        }
    }
    free(parts);
    return 0;
}
