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
#define MAX_H 128
#define MAX_HD 256
#define MAX_PS 256

typedef uint16_t bf16_t;

/* 8 floats: the compiler maps them onto AVX2 / AVX-512 / NEON registers (head_dim is a multiple of 8 here) */
typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }
static inline float hsum8(v8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

/* A row of hd values as float32: a float32 pool is read where it lies, a half one converted into `buf` first (one
 * vectorised loop: bf16 is a shift, f16 a hardware conversion where the CPU has F16C). */
static inline const float *row_f32(const float *p, float *buf, int hd) { (void)buf; (void)hd; return p; }
static inline const float *row_bf16(const bf16_t *p, float *buf, int hd) {
    uint32_t bits[MAX_HD];                                    /* memcpy: no float read through an int pointer */
    _Pragma("omp simd")
    for (int d = 0; d < hd; d++) bits[d] = (uint32_t)p[d] << 16;
    memcpy(buf, bits, sizeof(float) * hd);
    return buf;
}
#ifdef __FLT16_MAX__                                          /* the compiler has _Float16 */
static inline const float *row_f16(const _Float16 *p, float *buf, int hd) {
    _Pragma("omp simd")
    for (int d = 0; d < hd; d++) buf[d] = (float)p[d];
    return buf;
}
#endif

/* One part of one row: keys [t_begin, t_end), for all H query heads (head h reads kv head h / G). Writes the part's
 * running maximum m[h], sum l[h] and unnormalised output acc[h][d]. A page is read in memory order (token by token,
 * each kv head's row, K then V), each row once for the G heads that share it: 8 lanes of each head's dot at a time,
 * one horizontal sum per head and key. */
#define PART(NAME, T, ROW)                                                                                          \
static void NAME(const float *qs, const T *pool, int64_t sp, int64_t sk, int64_t st, int64_t sh,                   \
                 const int32_t *pages, int t_begin, int t_end, int H, int G, int hd, int ps, float *m, float *l,   \
                 float *acc) {                                                                                      \
    static _Thread_local float s[MAX_H][MAX_PS];                                                                    \
    float buf[MAX_HD];                                                                                              \
    int KV = H / G;                                                                                                 \
    for (int h = 0; h < H; h++) { m[h] = -FLT_MAX; l[h] = 0.f; memset(acc + h * hd, 0, sizeof(float) * hd); }      \
    for (int t0 = t_begin; t0 < t_end;) {                                                                           \
        int page = t0 / ps, first = t0 % ps;                                                                        \
        int cnt = (page + 1) * ps < t_end ? ps - first : t_end - t0;                                                \
        const T *base = pool + (int64_t)pages[page] * sp + (int64_t)first * st;                                    \
        for (int j = 0; j < cnt; j++)                                                                               \
            for (int kvh = 0; kvh < KV; kvh++) {                                                                    \
                const float *k = ROW(base + j * st + kvh * sh, buf, hd);                                            \
                v8 dots[MAX_G];                                                                                     \
                for (int g = 0; g < G; g++) dots[g] = (v8){0};                                                      \
                for (int d = 0; d < hd; d += 8) {                                                                   \
                    v8 kd = load8(k + d);                                                                           \
                    for (int g = 0; g < G; g++) dots[g] += load8(qs + (kvh * G + g) * hd + d) * kd;                 \
                }                                                                                                   \
                for (int g = 0; g < G; g++) s[kvh * G + g][j] = hsum8(dots[g]);                                     \
            }                                                                                                       \
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
        for (int j = 0; j < cnt; j++)                                                                               \
            for (int kvh = 0; kvh < KV; kvh++) {                                                                    \
                const float *v = ROW(base + sk + j * st + kvh * sh, buf, hd);                                       \
                for (int d = 0; d < hd; d += 8) {                                                                   \
                    v8 vd = load8(v + d);                                                                           \
                    for (int g = 0; g < G; g++) {                                                                   \
                        float *a = acc + (kvh * G + g) * hd + d;                                                    \
                        store8(a, load8(a) + s[kvh * G + g][j] * vd);                                               \
                    }                                                                                               \
                }                                                                                                   \
            }                                                                                                       \
        t0 += cnt;                                                                                                  \
    }                                                                                                               \
}

PART(part_f32, float, row_f32)
PART(part_bf16, bf16_t, row_bf16)
#ifdef __FLT16_MAX__
PART(part_f16, _Float16, row_f16)
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
