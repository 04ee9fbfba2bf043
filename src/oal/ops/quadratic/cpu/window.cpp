// Fused CPU exact part of the sink/window operator for a segment of queries (the no-autograd path of
// ../../sink_window/utils.py, evaluate; the torch reference is its block loop: _exact_keys + combine).
//
// For query i of the segment (position t0 + i) and query head g of KV head h, the exact set E_i is the sinks
// j ≤ t0 + i (j < n_sink) and the window: ext positions p with i < p ≤ i + w and t0 - w + p ≥ n_sink (a sink
// inside the window counts once, as a sink). With s_ij = scale · q·k_j and the kernel part's log-mass
// λ_i = β + log Σ_K κ (-inf for an empty kernel set) and its normalised output o_kern,
//
//   M = max(max_{E_i} s_ij, λ_i),  out = (Σ_{E_i} e^{s_ij - M} v_j + e^{λ_i - M} o_kern) / (Σ_{E_i} e^{s_ij - M} + e^{λ_i - M}),
//
// one normalisation for both parts (every exponential ≤ 1, the denominator ≥ 1). The torch loop does the same per
// block of queries but makes a pass over memory (and a Python dispatch) per elementwise step; here each block's
// two GEMMs are ATen's and everything between them is one pass over the block, in cache.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using at::Tensor;

#include "common.h"

// q (B, Hkv, G, N, d); ext_k (B, Hkv, w + N, d), ext_v (…, dv): the window buffer followed by the segment;
// sink_k (B, Hkv, n_sink, d), sink_v (…, dv); log_mass (B, Hkv, G, N); o_kern (B, Hkv, G, N, dv);
// out (B, Hkv, G, N, dv) written.
void window_combine(const Tensor& q, const Tensor& ext_k, const Tensor& ext_v, const Tensor& sink_k,
                    const Tensor& sink_v, const Tensor& log_mass, const Tensor& o_kern, Tensor& out, int64_t t0,
                    int64_t n_sink, int64_t w, double scale) {
  check_f32(q, "q", 5);
  check_f32(ext_k, "ext_k", 4);
  check_f32(ext_v, "ext_v", 4);
  check_f32(sink_k, "sink_k", 4);
  check_f32(sink_v, "sink_v", 4);
  check_f32(log_mass, "log_mass", 4);
  check_f32(o_kern, "o_kern", 5);
  check_f32(out, "out", 5);
  const int64_t B = q.size(0), Hkv = q.size(1), G = q.size(2), N = q.size(3), d = q.size(4), dv = ext_v.size(3);
  TORCH_CHECK(ext_k.size(2) == w + N && ext_v.size(2) == w + N, "ext_k, ext_v: expected w + N = ", w + N, " keys");
  TORCH_CHECK(sink_k.size(2) == n_sink && sink_v.size(2) == n_sink, "sink_k, sink_v: expected ", n_sink, " sinks");
  TORCH_CHECK(o_kern.size(4) == dv && out.size(4) == dv && log_mass.size(3) == N, "o_kern, out, log_mass: shapes");
  // with a sink or a window every query has an exact key (sink 0, or its own position), so no block is empty
  TORCH_CHECK(n_sink + w > 0, "n_sink, w: expected an exact part (n_sink + w > 0)");
  const float sc = float(scale);
  const float* qp = q.data_ptr<float>();
  const float* ekp = ext_k.data_ptr<float>();
  const float* evp = ext_v.data_ptr<float>();
  const float* skp = sink_k.data_ptr<float>();
  const float* svp = sink_v.data_ptr<float>();
  const float* lmp = log_mass.data_ptr<float>();
  const float* okp = o_kern.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // Per task: one KV head and a block of BLOCK queries. Its G·BLOCK query rows meet the sinks and the window
  // keys that cover the block (ext positions lo … hi-1) in two GEMMs (logits, then weights · values), with the
  // mask, the maxima, the exponentials and the kernel part applied in between on the block.
  constexpr int64_t BLOCK = 64;
  const int64_t nblk = (N + BLOCK - 1) / BLOCK;
  at::parallel_for(0, B * Hkv * nblk, 1, [&](int64_t begin, int64_t end) {
    const auto opts = at::TensorOptions().dtype(at::kFloat);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / nblk, i_lo = (task % nblk) * BLOCK, i_hi = std::min(N, i_lo + BLOCK);
      const int64_t nq = i_hi - i_lo, rows = G * nq;
      const int64_t ns = std::min(n_sink, t0 + i_hi);  // sinks some query of the block reaches
      const int64_t lo = std::max(i_lo + 1, n_sink + w - t0), hi = i_hi + w;  // window keys of the block
      const int64_t nw = std::max<int64_t>(0, hi - lo), L = ns + nw;
      at::Tensor Q = at::empty({rows, d}, opts), K = at::empty({L, d}, opts), V = at::empty({L, dv}, opts);
      for (int64_t g = 0; g < G; ++g)
        std::memcpy(Q.data_ptr<float>() + g * nq * d, qp + ((bh * G + g) * N + i_lo) * d, sizeof(float) * nq * d);
      std::memcpy(K.data_ptr<float>(), skp + bh * n_sink * d, sizeof(float) * ns * d);
      std::memcpy(V.data_ptr<float>(), svp + bh * n_sink * dv, sizeof(float) * ns * dv);
      if (nw) {
        std::memcpy(K.data_ptr<float>() + ns * d, ekp + (bh * (w + N) + lo) * d, sizeof(float) * nw * d);
        std::memcpy(V.data_ptr<float>() + ns * dv, evp + (bh * (w + N) + lo) * dv, sizeof(float) * nw * dv);
      }
      at::Tensor P = at::mm(Q, K.t());  // (rows, L)
      float* pp = P.data_ptr<float>();
      std::vector<float> ks(rows);
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t x = 0; x < nq; ++x) {
          const int64_t i = i_lo + x, r = g * nq + x, row = (bh * G + g) * N + i;
          float* pr = pp + r * L;
          // E_i within the block's keys: sinks j ≤ t0 + i, window positions lo … i + w (from i + 1)
          const int64_t sj = std::min(n_sink, t0 + i + 1), w0 = ns + std::max<int64_t>(0, i + 1 - lo),
                        w1 = ns + (i + w - lo + 1);
          const float lam = lmp[row];
          float M = lam;
          for (int64_t j = 0; j < L; ++j) {
            const bool in = j < sj || (j >= w0 && j < w1);
            pr[j] = in ? pr[j] * sc : -std::numeric_limits<float>::infinity();
            M = std::max(M, pr[j]);
          }
          float total = 0.f;
#pragma omp simd reduction(+ : total)
          for (int64_t j = 0; j < L; ++j) {
            pr[j] = exp_nonpos(pr[j] - M);  // -inf (outside E_i) gives 0
            total += pr[j];
          }
          ks[r] = std::isinf(lam) ? 0.f : std::exp(lam - M);  // an empty kernel set adds nothing
          const float inv = 1.f / (total + ks[r]);
#pragma omp simd
          for (int64_t j = 0; j < L; ++j) pr[j] *= inv;
          ks[r] *= inv;
        }
      }
      at::Tensor O = at::mm(P, V);  // (rows, dv), already normalised
      const float* o_blk = O.data_ptr<float>();
      for (int64_t g = 0; g < G; ++g)
        for (int64_t x = 0; x < nq; ++x) {
          const int64_t r = g * nq + x, row = (bh * G + g) * N + i_lo + x;
          float* o = op + row * dv;
          const float* ok = okp + row * dv;
          const float* ob = o_blk + r * dv;
          for (int64_t c = 0; c < dv; ++c) o[c] = ob[c] + ks[r] * ok[c];
        }
    }
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("window_combine", &window_combine, "Fused CPU exact part of the sink/window operator (one segment)");
}
