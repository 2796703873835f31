/* One decode token of the gated delta rule on the CPU, every (sequence, value head) in one pass over its state
 * (gdn_cpu.py builds and calls this file; kernels/gdn.py's _delta_rule_step is the torch reference and the oracle).
 *
 * Per value head, with the state S [dk, dv] (float32) and a = exp(g):
 *     S^T k and S^T q in one read of S;  delta = beta (v - a S^T k);  o = a S^T q + (q . k) delta;
 *     S' = a S + k delta^T, written in place (or, in a NEXTN verify, to the token's own slot).
 * The torch ops of the reference, traced into a compiled step, read a decode's states five times (gather, the two
 * products, the update, the write back); here a head's 16 KB (dk = dv = 64) is read once into the L1 and written once,
 * in the pool itself.
 * Each head's numbers come from its own inputs alone, in the same order whatever the batch: a sequence decodes to
 * the same bits alone or batched, and a NEXTN verify (one call per token) to those of its decodes.
 *
 * The file has two halves: the kernel in C, and at its end the torch op around it in C++, compiled from this same
 * file a second time with GDN_TORCH_OP defined (gdn_cpu.py links both into one library).
 */
#include <stdint.h>

#ifndef GDN_TORCH_OP
#include <math.h>

#define MAX_DV 256

/* q, k [N, H, dk], v [N, HV, dv], g, beta [N, HV]: float32, contiguous. pool: one layer of the state pool, float32,
 * rows rs apart, each row's heads [HV, dk, dv] contiguous: sequence n's state is read from row in_rows[n] and the
 * state after the token written to row out_rows[n] (the same row for a decode; no sequence's out row is another's in
 * row). out [N, HV, dv]: float32, contiguous. Returns 0, or 1 for a shape it does not take. */
int gdn_decode(const float *q, const float *k, const float *v, const float *g, const float *beta, float *pool,
               int64_t rs, const int64_t *in_rows, const int64_t *out_rows, float *out, int N, int H, int HV, int dk,
               int dv) {
    if (dv > MAX_DV || H <= 0 || HV % H)
        return 1;
    const int per = HV / H;                                   /* value heads per key head */
    #pragma omp parallel for schedule(static)
    for (int w = 0; w < N * HV; w++) {
        const int n = w / HV, h = w % HV;
        const float *qn = q + ((int64_t)n * H + h / per) * dk, *kn = k + ((int64_t)n * H + h / per) * dk;
        const float *vn = v + (int64_t)w * dv;
        const float *S = pool + in_rows[n] * rs + (int64_t)h * dk * dv;    /* may be Sn itself: each element is read */
        float *Sn = pool + out_rows[n] * rs + (int64_t)h * dk * dv, *o = out + (int64_t)w * dv;   /* before written */
        const float a = expf(g[w]), b = beta[w];
        float kS[MAX_DV], qS[MAX_DV], delta[MAX_DV], qk = 0.f;
        for (int j = 0; j < dv; j++) kS[j] = qS[j] = 0.f;
        for (int i = 0; i < dk; i++) {                        /* S^T k and S^T q: one read of S */
            const float ki = kn[i], qi = qn[i], *row = S + (int64_t)i * dv;
            qk += qi * ki;
            for (int j = 0; j < dv; j++) {
                kS[j] += ki * row[j];
                qS[j] += qi * row[j];
            }
        }
        for (int j = 0; j < dv; j++) {
            delta[j] = b * (vn[j] - a * kS[j]);
            o[j] = a * qS[j] + qk * delta[j];
        }
        for (int i = 0; i < dk; i++) {                        /* S' = a S + k delta^T (S is in the L1 by now) */
            const float ki = kn[i], *row = S + (int64_t)i * dv;
            float *dst = Sn + (int64_t)i * dv;
            for (int j = 0; j < dv; j++) dst[j] = a * row[j] + ki * delta[j];
        }
    }
    return 0;
}

#else  /* GDN_TORCH_OP */
/* ---- the torch op tinyserve::gdn_decode_cpu, from C++ (its schema and shape function are in gdn_cpu.py) ---- */
#include <torch/library.h>
#include <ATen/ops/empty.h>

extern "C" int gdn_decode(const float *q, const float *k, const float *v, const float *g, const float *beta,
                          float *pool, int64_t rs, const int64_t *in_rows, const int64_t *out_rows, float *out, int N,
                          int H, int HV, int dk, int dv);
extern "C" int gdn_torch_op(void) { return 1; }         /* gdn_cpu.py asks whether the library has the op */

/* pool [rows, layers, HV, dk, dv]: the whole state pool, written in place at layer `layer` (the schema says so, and a
 * compiled step calls the op on the pool itself: no copy of it) */
static at::Tensor gdn_decode_cpu(const at::Tensor &pool, int64_t layer, const at::Tensor &q, const at::Tensor &k,
                                 const at::Tensor &v, const at::Tensor &g, const at::Tensor &beta,
                                 const at::Tensor &in_rows, const at::Tensor &out_rows) {
    TORCH_CHECK(pool.scalar_type() == at::kFloat && pool.dim() == 5 && pool.stride(4) == 1 &&
                pool.stride(3) == pool.size(4) && pool.stride(2) == pool.size(3) * pool.size(4),
                "gdn_cpu.c: the state pool must be float32 [rows, layers, HV, dk, dv], each row's heads contiguous");
    const int N = (int)q.size(0), H = (int)q.size(1), dk = (int)q.size(2), HV = (int)v.size(1), dv = (int)v.size(2);
    const auto f32 = [](const at::Tensor &t) { return t.to(at::kFloat).contiguous(); };
    const at::Tensor qf = f32(q), kf = f32(k), vf = f32(v), gf = f32(g), bf = f32(beta);
    const at::Tensor src = in_rows.to(at::kLong).contiguous(), dst = out_rows.to(at::kLong).contiguous();
    at::Tensor out = at::empty({N, HV, dv}, pool.options());
    const int code = gdn_decode(qf.data_ptr<float>(), kf.data_ptr<float>(), vf.data_ptr<float>(), gf.data_ptr<float>(),
                                bf.data_ptr<float>(), pool.data_ptr<float>() + layer * pool.stride(1), pool.stride(0),
                                src.data_ptr<int64_t>(), dst.data_ptr<int64_t>(), out.data_ptr<float>(), N, H, HV, dk,
                                dv);
    TORCH_CHECK(code == 0, "gdn_cpu.c refused the call: H ", H, ", HV ", HV, ", dv ", dv);
    return out.scalar_type() == v.scalar_type() ? out : out.to(v.scalar_type());
}

TORCH_LIBRARY_IMPL(tinyserve, CPU, m) { m.impl("gdn_decode_cpu", gdn_decode_cpu); }
#endif
