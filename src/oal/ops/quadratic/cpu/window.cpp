// Fused CPU exact part of the sink/window operator for a segment of queries and its backward (_FusedWindow in
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

#if defined(__AVX512F__)
#include <immintrin.h>  // common.h's row maximum, tiles.h's bf16 pair product
#endif

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

using at::Tensor;

#include "common.h"
#include "tiles.h"

// Per task: one KV head and a block of BLOCK queries. Its G·BLOCK query rows meet the sinks and the window keys
// that cover the block (ext positions lo … hi-1) in GEMMs, with the mask, the maxima and the exponentials applied
// in between on the block, in cache.
constexpr int64_t BLOCK = 64;

struct Segment {
  const float *q, *ext_k, *ext_v, *sink_k, *sink_v, *log_mass;
  int64_t G, N, d, dv, t0, n_sink, w;
  float scale;
  int64_t ekh, evh;  // ext_k's and ext_v's head strides (w + N rows, or more for a view of longer heads)
};

// One block's query rows Q (G·nq, d) in (g, i) order, its exact keys K (L, d) and values V (L, dv) (the ns sinks
// some query of the block reaches, then window positions lo …), the weights P (G·nq, L) of each query's E_i and pi
// (G·nq) of its kernel part, normalised together.
struct Block {
  int64_t i_lo, nq, ns, lo;
  Tensor Q, K, V, P;
  std::vector<float> pi;
};

Block block_weights(const Segment& sg, int64_t bh, int64_t i_lo) {
  const int64_t G = sg.G, N = sg.N, d = sg.d, dv = sg.dv, n_sink = sg.n_sink, w = sg.w, t0 = sg.t0;
  const auto opts = at::TensorOptions().dtype(at::kFloat);
  Block b;
  const int64_t i_hi = std::min(N, i_lo + BLOCK), nq = i_hi - i_lo, rows = G * nq;
  const int64_t ns = std::min(n_sink, t0 + i_hi);                           // sinks some query reaches
  const int64_t lo = std::max(i_lo + 1, n_sink + w - t0), hi = i_hi + w;  // window keys of the block
  const int64_t nw = std::max<int64_t>(0, hi - lo), L = ns + nw;
  b.i_lo = i_lo, b.nq = nq, b.ns = ns, b.lo = lo;
  b.Q = at::empty({rows, d}, opts), b.K = at::empty({L, d}, opts), b.V = at::empty({L, dv}, opts);
  for (int64_t g = 0; g < G; ++g)
    std::memcpy(b.Q.data_ptr<float>() + g * nq * d, sg.q + ((bh * G + g) * N + i_lo) * d, sizeof(float) * nq * d);
  std::memcpy(b.K.data_ptr<float>(), sg.sink_k + bh * n_sink * d, sizeof(float) * ns * d);
  std::memcpy(b.V.data_ptr<float>(), sg.sink_v + bh * n_sink * dv, sizeof(float) * ns * dv);
  if (nw) {
    std::memcpy(b.K.data_ptr<float>() + ns * d, sg.ext_k + bh * sg.ekh + lo * d, sizeof(float) * nw * d);
    std::memcpy(b.V.data_ptr<float>() + ns * dv, sg.ext_v + bh * sg.evh + lo * dv, sizeof(float) * nw * dv);
  }
  b.P = at::mm(b.Q, b.K.t());  // logits (rows, L), normalised weights below
  float* pp = b.P.data_ptr<float>();
  b.pi.resize(rows);
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t x = 0; x < nq; ++x) {
      const int64_t i = i_lo + x, r = g * nq + x, row = (bh * G + g) * N + i;
      float* pr = pp + r * L;
      // E_i within the block's keys: sinks j ≤ t0 + i, window positions lo … i + w (from i + 1)
      const int64_t sj = std::min(n_sink, t0 + i + 1), w0 = ns + std::max<int64_t>(0, i + 1 - lo),
                    w1 = ns + (i + w - lo + 1);
      const float lam = sg.log_mass[row], ninf = -std::numeric_limits<float>::infinity();
      // E_i is two runs of the block's keys, the sinks [0, sj) and the window [w0, w1) after them (sj ≤ ns ≤ w0):
      // straight loops that vectorise, not a test per key
      const int64_t e2 = std::max(sj, w0), e3 = std::max(e2, w1);
      for (int64_t j = 0; j < sj; ++j) pr[j] *= sg.scale;
      for (int64_t j = sj; j < e2; ++j) pr[j] = ninf;
      for (int64_t j = e2; j < e3; ++j) pr[j] *= sg.scale;
      for (int64_t j = e3; j < L; ++j) pr[j] = ninf;
      const float M = std::max(lam, max_of(pr, L));
      const float total = exp_shifted(pr, L, M);  // -inf (outside E_i) gives 0
      const float kern = std::isinf(lam) ? 0.f : std::exp(lam - M);  // an empty kernel set adds nothing
      const float inv = 1.f / (total + kern);
#pragma omp simd
      for (int64_t j = 0; j < L; ++j) pr[j] *= inv;
      b.pi[r] = kern * inv;
    }
  }
  return b;
}

// fp32 CPU (B, H, rows, ·) whose heads' rows are contiguous and heads evenly apart: contiguous, or a view of
// consecutive rows of longer heads (a prompt's later chunk reads its window and keys from the kept keys in place)
void check_head_rows(const Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.dim() == 4 && x.stride(3) == 1 &&
                  x.stride(2) == x.size(3) && (x.size(0) == 1 || x.stride(0) == x.size(1) * x.stride(1)),
              name, ": expected a CPU float32 tensor (B, H, rows, ·) with contiguous rows, heads evenly apart");
}

void check_segment(const Tensor& q, const Tensor& ext_k, const Tensor& ext_v, const Tensor& sink_k,
                   const Tensor& sink_v, const Tensor& log_mass, const Tensor& o_kern, int64_t n_sink, int64_t w) {
  check_f32(q, "q", 5);
  check_head_rows(ext_k, "ext_k");
  check_head_rows(ext_v, "ext_v");
  check_f32(sink_k, "sink_k", 4);
  check_f32(sink_v, "sink_v", 4);
  check_f32(log_mass, "log_mass", 4);
  check_f32(o_kern, "o_kern", 5);
  const int64_t N = q.size(3), dv = ext_v.size(3);
  TORCH_CHECK(ext_k.size(2) == w + N && ext_v.size(2) == w + N, "ext_k, ext_v: expected w + N = ", w + N, " keys");
  TORCH_CHECK(sink_k.size(2) == n_sink && sink_v.size(2) == n_sink, "sink_k, sink_v: expected ", n_sink, " sinks");
  TORCH_CHECK(o_kern.size(4) == dv && log_mass.size(3) == N, "o_kern, log_mass: shapes");
  // with a sink or a window every query has an exact key (sink 0, or its own position), so no block is empty
  TORCH_CHECK(n_sink + w > 0, "n_sink, w: expected an exact part (n_sink + w > 0)");
}

Segment segment(const Tensor& q, const Tensor& ext_k, const Tensor& ext_v, const Tensor& sink_k,
                const Tensor& sink_v, const Tensor& log_mass, int64_t t0, int64_t n_sink, int64_t w, double scale) {
  return {q.data_ptr<float>(), ext_k.data_ptr<float>(), ext_v.data_ptr<float>(), sink_k.data_ptr<float>(),
          sink_v.data_ptr<float>(), log_mass.data_ptr<float>(), q.size(2), q.size(3), q.size(4), ext_v.size(3),
          t0, n_sink, w, float(scale), ext_k.stride(1), ext_v.stride(1)};
}

// q (B, Hkv, G, N, d); ext_k (B, Hkv, w + N, d), ext_v (…, dv): the window buffer followed by the segment;
// sink_k (B, Hkv, n_sink, d), sink_v (…, dv); log_mass (B, Hkv, G, N); o_kern (B, Hkv, G, N, dv);
// out (B, Hkv, G, N, dv) written; it may be o_kern itself (each row of o_kern is read just before that row of out
// is written).
void window_combine(const Tensor& q, const Tensor& ext_k, const Tensor& ext_v, const Tensor& sink_k,
                    const Tensor& sink_v, const Tensor& log_mass, const Tensor& o_kern, Tensor& out, int64_t t0,
                    int64_t n_sink, int64_t w, double scale) {
  check_segment(q, ext_k, ext_v, sink_k, sink_v, log_mass, o_kern, n_sink, w);
  check_f32(out, "out", 5);
  TORCH_CHECK(out.sizes() == o_kern.sizes(), "out: expected the shape of o_kern");
  const Segment sg = segment(q, ext_k, ext_v, sink_k, sink_v, log_mass, t0, n_sink, w, scale);
  const int64_t B = q.size(0), Hkv = q.size(1), G = sg.G, N = sg.N, dv = sg.dv, nblk = (N + BLOCK - 1) / BLOCK;
  const float* okp = o_kern.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * Hkv * nblk, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / nblk;
      const Block b = block_weights(sg, bh, (task % nblk) * BLOCK);
      const Tensor O = at::mm(b.P, b.V);  // (rows, dv), already normalised
      const float* o_blk = O.data_ptr<float>();
      for (int64_t g = 0; g < G; ++g)
        for (int64_t x = 0; x < b.nq; ++x) {
          const int64_t r = g * b.nq + x, row = (bh * G + g) * N + b.i_lo + x;
          float* o = op + row * dv;
          const float* ok = okp + row * dv;
          const float* ob = o_blk + r * dv;
          for (int64_t c = 0; c < dv; ++c) o[c] = ob[c] + b.pi[r] * ok[c];
        }
    }
  });
}

// The gradients of window_combine: with the normalised weights P_ij of the exact keys and π_i of the kernel part
// (out = Σ P v + π o_kern, a softmax over E_i and one more "key"), D_i = dout_i · out_i and dP_ij = dout_i · v_j,
//   ds_ij = P_ij (dP_ij - D_i),   dλ_i = π_i (dout_i · o_kern_i - D_i),   do_kern_i = π_i dout_i,
//   dq_i = scale Σ_j ds_ij k_j,   dk_j = scale Σ_i ds_ij q_i,   dv_j = Σ_i P_ij dout_i.
// Each task recomputes its block's weights and runs four GEMMs more; the key gradients of the blocks overlap
// (windows do), so each task keeps its own and one pass per KV head adds them up.
// Returns [dq (like q), d_ext_k, d_ext_v, d_sink_k, d_sink_v, d_log_mass, d_o_kern].
std::vector<Tensor> window_backward(const Tensor& q, const Tensor& ext_k, const Tensor& ext_v, const Tensor& sink_k,
                                    const Tensor& sink_v, const Tensor& log_mass, const Tensor& o_kern,
                                    const Tensor& out, const Tensor& d_out, int64_t t0, int64_t n_sink, int64_t w,
                                    double scale) {
  check_segment(q, ext_k, ext_v, sink_k, sink_v, log_mass, o_kern, n_sink, w);
  check_f32(ext_k, "ext_k", 4);  // the key gradients are laid out as contiguous ext_k and ext_v
  check_f32(ext_v, "ext_v", 4);
  check_f32(out, "out", 5);
  check_f32(d_out, "d_out", 5);
  TORCH_CHECK(out.sizes() == o_kern.sizes() && d_out.sizes() == o_kern.sizes(),
              "out, d_out: expected the shape of o_kern");
  const Segment sg = segment(q, ext_k, ext_v, sink_k, sink_v, log_mass, t0, n_sink, w, scale);
  const int64_t B = q.size(0), Hkv = q.size(1), G = sg.G, N = sg.N, d = sg.d, dv = sg.dv;
  const int64_t nblk = (N + BLOCK - 1) / BLOCK;
  const float *okp = o_kern.data_ptr<float>(), *outp = out.data_ptr<float>(), *dop = d_out.data_ptr<float>();
  Tensor dq = at::empty_like(q), d_ext_k = at::zeros_like(ext_k), d_ext_v = at::zeros_like(ext_v);
  Tensor d_sink_k = at::zeros_like(sink_k), d_sink_v = at::zeros_like(sink_v);
  Tensor d_lm = at::empty_like(log_mass), d_ok = at::empty_like(o_kern);
  float *dqp = dq.data_ptr<float>(), *dlmp = d_lm.data_ptr<float>(), *dokp = d_ok.data_ptr<float>();
  std::vector<Tensor> dK(B * Hkv * nblk), dV(B * Hkv * nblk);
  std::vector<int64_t> lo_of(B * Hkv * nblk), ns_of(B * Hkv * nblk);
  at::parallel_for(0, B * Hkv * nblk, 1, [&](int64_t begin, int64_t end) {
    const auto opts = at::TensorOptions().dtype(at::kFloat);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / nblk;
      Block b = block_weights(sg, bh, (task % nblk) * BLOCK);
      const int64_t nq = b.nq, L = b.K.size(0);
      lo_of[task] = b.lo;
      ns_of[task] = b.ns;
      Tensor dO = at::empty({G * nq, dv}, opts);
      for (int64_t g = 0; g < G; ++g)
        std::memcpy(dO.data_ptr<float>() + g * nq * dv, dop + ((bh * G + g) * N + b.i_lo) * dv,
                    sizeof(float) * nq * dv);
      Tensor dP = at::mm(dO, b.V.t());  // (rows, L)
      const float* pp = b.P.data_ptr<float>();
      float* dpp = dP.data_ptr<float>();
      const float* dob = dO.data_ptr<float>();
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t x = 0; x < nq; ++x) {
          const int64_t r = g * nq + x, row = (bh * G + g) * N + b.i_lo + x;
          const float* pr = pp + r * L;
          float* dpr = dpp + r * L;
          const float* dor = dob + r * dv;
          const float pi = b.pi[r], Di = dot(dor, outp + row * dv, dv);
          dlmp[row] = pi == 0.f ? 0.f : pi * (dot(dor, okp + row * dv, dv) - Di);
          float* dok = dokp + row * dv;
          for (int64_t c = 0; c < dv; ++c) dok[c] = pi * dor[c];
#pragma omp simd
          for (int64_t j = 0; j < L; ++j) dpr[j] = pr[j] * (dpr[j] - Di) * sg.scale;  // dP becomes scale · ds
        }
      }
      const Tensor dQ = at::mm(dP, b.K);  // (rows, d)
      const float* dqb = dQ.data_ptr<float>();
      for (int64_t g = 0; g < G; ++g)
        std::memcpy(dqp + ((bh * G + g) * N + b.i_lo) * d, dqb + g * nq * d, sizeof(float) * nq * d);
      dK[task] = at::mm(dP.t(), b.Q);  // (L, d)
      dV[task] = at::mm(b.P.t(), dO);  // (L, dv)
    }
  });
  // add each block's key gradients: per KV head, its blocks in order (they overlap in the window keys)
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      float* dsk = d_sink_k.data_ptr<float>() + bh * n_sink * d;
      float* dsv = d_sink_v.data_ptr<float>() + bh * n_sink * dv;
      float* dek = d_ext_k.data_ptr<float>() + bh * (w + N) * d;
      float* dev = d_ext_v.data_ptr<float>() + bh * (w + N) * dv;
      for (int64_t blk = 0; blk < nblk; ++blk) {
        const int64_t task = bh * nblk + blk, ns = ns_of[task], lo = lo_of[task];
        const int64_t L = dK[task].size(0);
        const float *gk = dK[task].data_ptr<float>(), *gv = dV[task].data_ptr<float>();
        for (int64_t j = 0; j < L; ++j) {
          float* tk = j < ns ? dsk + j * d : dek + (lo + j - ns) * d;
          float* tv = j < ns ? dsv + j * dv : dev + (lo + j - ns) * dv;
          for (int64_t c = 0; c < d; ++c) tk[c] += gk[j * d + c];
          for (int64_t c = 0; c < dv; ++c) tv[c] += gv[j * dv + c];
        }
      }
    }
  });
  return {dq, d_ext_k, d_ext_v, d_sink_k, d_sink_v, d_lm, d_ok};
}


// ------------------------------------------------------------------------------------------------------------------
// Exact causal softmax of a prompt (the exact heads of ExactHeadsKernel over a prompt, ../../../kernels/hybrid.py):
// for query head g of KV head h and new query i (position t0 + i), over the keys j ≤ t0 + i,
//   out_i = Σ_j e^{s_ij - m_i} v_j / Σ_j e^{s_ij - m_i},   s_ij = scale · q_i · k_j,
// as F.scaled_dot_product_attention computes it. Flash-style: per task one KV head and a block of EXACT_Q queries,
// whose G · EXACT_Q rows (all query heads of the KV head: one pass over the keys serves them all) meet the keys in
// blocks of EXACT_K with a running maximum and sum; both products run on the register tiles of tiles.h, the keys
// (fp32 or bf16, widened here) packed into 16-key panels per block, the values into 16-column panels.
constexpr int64_t EXACT_Q = 128, EXACT_K = 128;

// a stored key / value number as fp32: fp32 itself, bf16 widened, int8 (an 8-bit exact cache) dequantised by its
// row's scale s (s applies to int8 only)
template <typename T>
inline float widen(T x, float s) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, int8_t>) {
    return float(x) * s;
  } else {  // bf16 bits
    uint32_t bits = uint32_t(x) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  }
}

// The keys and values of one KV head as exact_block reads them, packed once for all its query blocks (widened
// from bf16; int8: the keys' integers as they are, their scales ks applied to the scores by exact_block, the values
// dequantised by their scales vs (both null for the other storages); ROUND: rounded to bf16): keys in (d, 16) panels of 16 keys, panel p at Kp + p·d·16 (the last
// panel's missing keys zero); values per block of EXACT_K keys in (EXACT_K, 16) panels of 16 columns, column
// panel c of block b at Vp + (b·panels_d + c)·EXACT_K·16.
template <typename T, bool ROUND>
void pack_f32(const T* K, const T* V, const float* vs, int64_t keys, int64_t d, int64_t dv, float* Kp, float* Vp) {
  const int64_t panels_d = (dv + kTile - 1) / kTile, nblk = (keys + EXACT_K - 1) / EXACT_K;
  const auto operand = [](T x, float s) { return ROUND ? round_bf16(widen(x, s)) : widen(x, s); };
  std::fill(Kp, Kp + nblk * EXACT_K * d, 0.f);
  std::fill(Vp, Vp + nblk * panels_d * EXACT_K * kTile, 0.f);
  for (int64_t j = 0; j < keys; ++j) {
    const T* kj = K + j * d;
    const float sv = vs ? vs[j] : 1.f;
    float* kd = Kp + (j / kTile) * d * kTile + j % kTile;
    for (int64_t c = 0; c < d; ++c) kd[c * kTile] = operand(kj[c], 1.f);
    const T* vj = V + j * dv;
    float* vd = Vp + (j / EXACT_K) * panels_d * EXACT_K * kTile + (j % EXACT_K) * kTile;
    for (int64_t c = 0; c < dv; ++c) vd[(c / kTile) * EXACT_K * kTile + c % kTile] = operand(vj[c], sv);
  }
}

// A block's outputs: accumulator row r = g·nq + x (dvp columns) over its normaliser l[r], into query i_lo + x of
// query head g of out (G, N, dv).
inline void write_normalised(const float* acc, const float* l, float* out, int64_t G, int64_t nq, int64_t N,
                             int64_t i_lo, int64_t dv, int64_t dvp) {
  for (int64_t g = 0; g < G; ++g)
    for (int64_t x = 0; x < nq; ++x) {
      const int64_t r = g * nq + x;
      const float inv = 1.f / l[r];
      float* o = out + (g * N + i_lo + x) * dv;
      for (int64_t c = 0; c < dv; ++c) o[c] = acc[r * dvp + c] * inv;
    }
}

// One KV head's block of EXACT_Q queries over the keys packed by pack_f32. ROUND (bf16 products, on a core
// without AVX512_BF16; exact_block_bf16 is the native form): the scaled queries and the weights e^{s - m} rounded
// to bf16 too (the keys and values were in packing), so that the fp32 tiles compute the products exactly (a
// product of two bf16 numbers is an fp32 number); l sums the rounded weights.
template <bool ROUND = false>
void exact_block(const float* q, const float* Kp, const float* Vp, const float* ks, float* out, int64_t G, int64_t N,
                 int64_t d, int64_t dv, int64_t t0, int64_t i_lo, float scale, std::vector<float>& work) {
  const auto operand = [](float x) { return ROUND ? round_bf16(x) : x; };
  const int64_t i_hi = std::min(N, i_lo + EXACT_Q), nq = i_hi - i_lo, rows = G * nq;
  const int64_t panels_d = (dv + kTile - 1) / kTile, dvp = panels_d * kTile, keys = t0 + i_hi;
  work.resize(rows * d + rows * EXACT_K + rows * dvp + 2 * rows);
  float *Q = work.data(), *S = Q + rows * d, *acc = S + rows * EXACT_K, *m = acc + rows * dvp, *l = m + rows;
  for (int64_t g = 0; g < G; ++g)  // rows in (g, i) order, scaled once
    for (int64_t x = 0; x < nq; ++x)
      for (int64_t c = 0; c < d; ++c) Q[(g * nq + x) * d + c] = operand(scale * q[(g * N + i_lo + x) * d + c]);
  std::fill(acc, acc + rows * dvp, 0.f);
  std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
  std::fill(l, l + rows, 0.f);
  for (int64_t j0 = 0; j0 < keys; j0 += EXACT_K) {
    const int64_t nk = std::min(EXACT_K, keys - j0), panels_k = (nk + kTile - 1) / kTile;
    for (int64_t r = 0; r < rows; r += kRows)
      tile_rows(std::min(kRows, rows - r), Q + r * d, d, Kp + j0 * d, d * kTile, d, S + r * EXACT_K, kTile, EXACT_K,
                panels_k, false);
    // the causal mask (query t0 + i sees keys ≤ t0 + i), the running maximum and sum, the rescaled accumulator
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = S + r * EXACT_K;
      const int64_t visible = std::clamp<int64_t>(t0 + i_lo + r % nq + 1 - j0, 0, nk);
      if (ks)
        for (int64_t j = 0; j < visible; ++j) sr[j] *= ks[j0 + j];
      for (int64_t j = visible; j < panels_k * kTile; ++j) sr[j] = -std::numeric_limits<float>::infinity();
      const float mr = std::max(m[r], max_of(sr, visible));
      if (mr == -std::numeric_limits<float>::infinity()) {  // no visible key yet: the row adds nothing
        std::fill(sr, sr + panels_k * kTile, 0.f);
        continue;
      }
      const float alpha = exp_nonpos(m[r] - mr);
      float sum = exp_shifted(sr, panels_k * kTile, mr);
      if constexpr (ROUND) sum = round_bf16_sum(sr, panels_k * kTile);
      l[r] = l[r] * alpha + sum;
      m[r] = mr;
      if (alpha != 1.f)
        for (int64_t c = 0; c < dvp; ++c) acc[r * dvp + c] *= alpha;
    }
    const float* Vb = Vp + (j0 / EXACT_K) * panels_d * EXACT_K * kTile;  // this block's value panels
    for (int64_t r = 0; r < rows; r += kRows)
      tile_rows(std::min(kRows, rows - r), S + r * EXACT_K, EXACT_K, Vb, EXACT_K * kTile, nk, acc + r * dvp, kTile,
                dvp, panels_d);
  }
  write_normalised(acc, l, out, G, nq, N, i_lo, dv, dvp);
}

#if defined(__AVX512BF16__)
// The keys and values of one KV head as exact_block_bf16 reads them, packed once for all its query blocks (int8:
// the keys' integers, exact in bf16, the values dequantised by vs and rounded): keys
// in pair panels of 16 keys (d padded to dp, even, with zeros; the last panel's missing keys zero), panel p at
// Kp + p·dp·16; values per block of EXACT_K keys in pair panels of 16 columns, column panel c of block b at
// Vp + (b·panels_d + c)·EXACT_K·16, the pairs over the block's keys (missing keys zero).
template <typename T>
void pack_bf16(const T* K, const T* V, const float* vs, int64_t keys, int64_t d, int64_t dv, uint16_t* Kp,
               uint16_t* Vp) {
  const int64_t dp = (d + 1) / 2 * 2, panels_d = (dv + kTile - 1) / kTile, nblk = (keys + EXACT_K - 1) / EXACT_K;
  const auto bits = [](T x, float s) -> uint16_t {
    if constexpr (std::is_same_v<T, uint16_t>) {
      return x;
    } else {  // fp32 rounded, int8 dequantised and rounded
      return to_bf16(widen(x, s));
    }
  };
  std::fill(Kp, Kp + nblk * EXACT_K * dp, uint16_t(0));
  std::fill(Vp, Vp + nblk * panels_d * EXACT_K * kTile, uint16_t(0));
  for (int64_t j = 0; j < keys; ++j) {
    const T* kj = K + j * d;
    const float sv = vs ? vs[j] : 1.f;
    uint16_t* kd = Kp + (j / kTile) * dp * kTile + (j % kTile) * 2;
    for (int64_t c = 0; c < d; ++c) kd[(c / 2) * 2 * kTile + c % 2] = bits(kj[c], 1.f);
    const T* vj = V + j * dv;
    uint16_t* vd = Vp + (j / EXACT_K) * panels_d * EXACT_K * kTile + ((j % EXACT_K) / 2) * 2 * kTile + j % 2;
    for (int64_t c = 0; c < dv; ++c) vd[(c / kTile) * EXACT_K * kTile + (c % kTile) * 2] = bits(vj[c], sv);
  }
}

// 16 lanes of e^{x - m} (x ≤ m or -inf) as 2^t, t = (x - m)·log2 e clamped at -150 (-inf: 0), for weights
// rounded to bf16 next: 2^t = 2^n · 2^f with n = round(t), f = t - n in [-1/2, 1/2], 2^f by its Taylor polynomial
// of degree 6 (relative error ~2e-7, a ten-thousandth of the bf16 rounding step that follows) and the power by
// vscalefps (no exponent arithmetic; 0 below 2^-149). 10 operations against exp_nonpos16's 17: the weights took a
// third of the prompt kernel's time.
inline __m512 exp_weights16(__m512 x, __m512 m) {
  const __m512 t = _mm512_max_ps(_mm512_mul_ps(_mm512_sub_ps(x, m), _mm512_set1_ps(1.44269504088896341f)),
                                 _mm512_set1_ps(-150.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530393381609e-4f);  // ln2^6 / 6!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// x[0:n] (n a multiple of 16, every x ≤ m or -inf) -> p[0:n] = bf16(e^{x - m}), returning Σ p (the rounded
// weights, so that the output is their normalised combination): 32 weights per conversion, their sum by one pair
// product with ones (exact, as the weights' product with the values)
inline float exp_rounded_bf16(const float* x, int64_t n, float m, uint16_t* p) {
  const __m512 mv = _mm512_set1_ps(m);
  const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3F80);
  __m512 acc = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    const __m512 lo = exp_weights16(_mm512_loadu_ps(x + j), mv), hi = exp_weights16(_mm512_loadu_ps(x + j + 16), mv);
    const __m512bh b = _mm512_cvtne2ps_pbh(hi, lo);  // lo in the low half: p[j … j + 31] in order
    _mm512_storeu_si512(p + j, (__m512i)b);
    acc = _mm512_dpbf16_ps(acc, b, ones);
  }
  if (j < n) {
    const __m256bh b = _mm512_cvtneps_pbh(exp_weights16(_mm512_loadu_ps(x + j), mv));
    std::memcpy(p + j, &b, sizeof(b));
    acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)b), 16)));
  }
  return _mm512_reduce_add_ps(acc);
}

// exact_block<T, true> on AVX512_BF16's pair products (tile_rows_bf16), the keys and values packed by pack_bf16:
// the scaled queries (G·nq, dp) and the weights (G·nq, EXACT_K) as bf16 rows. The same numbers as
// exact_block<T, true> up to the summation order and exp_weights16's error (a weight may round to the bf16 number
// next to exact_block's, one in a few thousand).
void exact_block_bf16(const float* q, const uint16_t* Kp, const uint16_t* Vp, const float* ks, float* out, int64_t G,
                      int64_t N, int64_t d, int64_t dv, int64_t t0, int64_t i_lo, float scale,
                      std::vector<float>& work, std::vector<uint16_t>& bwork) {
  const int64_t i_hi = std::min(N, i_lo + EXACT_Q), nq = i_hi - i_lo, rows = G * nq;
  const int64_t panels_d = (dv + kTile - 1) / kTile, dvp = panels_d * kTile, keys = t0 + i_hi, dp = (d + 1) / 2 * 2;
  work.resize(rows * EXACT_K + rows * dvp + 2 * rows);
  float *S = work.data(), *acc = S + rows * EXACT_K, *m = acc + rows * dvp, *l = m + rows;
  bwork.resize(rows * dp + rows * EXACT_K);
  uint16_t *Q = bwork.data(), *P = Q + rows * dp;
  std::fill(Q, Q + rows * dp, uint16_t(0));
  for (int64_t g = 0; g < G; ++g)
    for (int64_t x = 0; x < nq; ++x)
      for (int64_t c = 0; c < d; ++c) Q[(g * nq + x) * dp + c] = to_bf16(scale * q[(g * N + i_lo + x) * d + c]);
  std::fill(acc, acc + rows * dvp, 0.f);
  std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
  std::fill(l, l + rows, 0.f);
  for (int64_t j0 = 0; j0 < keys; j0 += EXACT_K) {
    const int64_t nk = std::min(EXACT_K, keys - j0), panels_k = (nk + kTile - 1) / kTile, nkp = panels_k * kTile;
    for (int64_t r = 0; r < rows; r += kRows)
      tile_rows_bf16(std::min(kRows, rows - r), Q + r * dp, dp, Kp + j0 * dp, dp * kTile, dp / 2, S + r * EXACT_K,
                     kTile, EXACT_K, panels_k, false);
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = S + r * EXACT_K;
      uint16_t* pr = P + r * EXACT_K;
      const int64_t visible = std::clamp<int64_t>(t0 + i_lo + r % nq + 1 - j0, 0, nk);
      if (ks)
        for (int64_t j = 0; j < visible; ++j) sr[j] *= ks[j0 + j];
      const float mr = std::max(m[r], max_of(sr, visible));
      if (mr == -std::numeric_limits<float>::infinity()) {
        std::fill(pr, pr + nkp, uint16_t(0));
        continue;
      }
      for (int64_t j = visible; j < nkp; ++j) sr[j] = -std::numeric_limits<float>::infinity();
      const float alpha = mr == m[r] ? 1.f : exp_nonpos(m[r] - mr);  // past the first blocks the maximum rarely moves
      l[r] = l[r] * alpha + exp_rounded_bf16(sr, nkp, mr, pr);
      m[r] = mr;
      if (alpha != 1.f)
        for (int64_t c = 0; c < dvp; ++c) acc[r * dvp + c] *= alpha;
    }
    const uint16_t* Vb = Vp + (j0 / EXACT_K) * panels_d * EXACT_K * kTile;  // this block's value panels
    for (int64_t r = 0; r < rows; r += kRows)
      tile_rows_bf16(std::min(kRows, rows - r), P + r * EXACT_K, EXACT_K, Vb, EXACT_K * kTile, nkp / 2, acc + r * dvp,
                     kTile, dvp, panels_d, true);
  }
  write_normalised(acc, l, out, G, nq, N, i_lo, dv, dvp);
}
#endif

// q (B, Hkv, G, N, d) fp32: the new queries of each KV head's query heads; k (B, Hkv, t0 + N, d), v (…, dv) fp32,
// bf16 or int8: the keys and values of the t0 cached and the N new tokens, each head's rows contiguous (the heads may
// be apart); int8 (an 8-bit exact cache) with k_scale, v_scale (B, Hkv, t0 + N) fp32, each head's contiguous: the
// key scales folded into the scores (s_ij = sk_j · scale · q_i · k_j over the integers), the values dequantised,
// x · sv (rounded to bf16 with bf16_products: within 2^-9 · max |v| of hybrid.py's
// bf16_product_attention with round_kv=False).
// Returns out (B, Hkv, G, N, dv) fp32.
// bf16_products: the products on bf16 numbers (exact_block<T, true>), with AVX512_BF16's pair products where the
// build has them and native is true (native false: the fp32 tiles on the rounded numbers, for the tests).
Tensor exact_prefill(const Tensor& q, const Tensor& k, const Tensor& v, int64_t t0, double scale, bool bf16_products,
                     bool native, const std::optional<Tensor>& k_scale_opt, const std::optional<Tensor>& v_scale_opt) {
  const Tensor k_scale = k_scale_opt.value_or(Tensor()), v_scale = v_scale_opt.value_or(Tensor());
  check_f32(q, "q", 5);
  const bool bf16 = k.scalar_type() == at::kBFloat16, i8 = k.scalar_type() == at::kChar;
  TORCH_CHECK((bf16 || i8 || k.scalar_type() == at::kFloat) && v.scalar_type() == k.scalar_type() && k.dim() == 4 &&
                  v.dim() == 4 && k.device().is_cpu() && v.device().is_cpu(),
              "k, v: expected CPU float32, bfloat16 or int8 tensors of one dtype with 4 dimensions");
  const int64_t B = q.size(0), Hkv = q.size(1), G = q.size(2), N = q.size(3), d = q.size(4), dv = v.size(3);
  TORCH_CHECK(k.size(0) == B && k.size(1) == Hkv && k.size(2) == t0 + N && k.size(3) == d && v.size(0) == B &&
                  v.size(1) == Hkv && v.size(2) == t0 + N,
              "k, v: expected (B, Hkv, t0 + N, ·) = (", B, ", ", Hkv, ", ", t0 + N, ", ·) keys and values");
  // each head's keys and values contiguous (t0 + N, ·) rows; the heads may lie apart (the first t0 + N slots of a
  // cache buffer with room for more)
  TORCH_CHECK(k.stride(3) == 1 && k.stride(2) == d && v.stride(3) == 1 && v.stride(2) == dv,
              "k, v: expected each head's (t0 + N, ·) rows contiguous, got strides ", k.strides(), " and ",
              v.strides());
  if (i8) {
    for (const auto* sc : {&k_scale, &v_scale})
      TORCH_CHECK(sc->defined() && sc->scalar_type() == at::kFloat && sc->device().is_cpu() && sc->dim() == 3 &&
                      sc->size(0) == B && sc->size(1) == Hkv && sc->size(2) == t0 + N && sc->stride(2) == 1,
                  "k_scale, v_scale: int8 keys and values need (B, Hkv, t0 + N) = (", B, ", ", Hkv, ", ", t0 + N,
                  ") CPU float32 scales, each head's contiguous");
  } else {
    TORCH_CHECK(!k_scale.defined() && !v_scale.defined(), "k_scale, v_scale: only for int8 keys and values");
  }
  Tensor out = at::empty({B, Hkv, G, N, dv}, q.options());
  const int64_t nblk = (N + EXACT_Q - 1) / EXACT_Q, tasks = B * Hkv * nblk;
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const bool use_native = bf16_products && native && kNativeBf16;
  // a contiguous range of tasks per thread: order the blocks 0, n-1, 1, n-2, … so that every range holds early
  // (cheap) and late (expensive) causal blocks alike
  auto block_of = [&](int64_t x) { return x % 2 ? nblk - 1 - x / 2 : x / 2; };
  // keys and values packed once per KV head (all heads first: the query blocks of a head run on both threads)
  const int64_t keys = t0 + N, kblk = (keys + EXACT_K - 1) / EXACT_K, panels_d = (dv + kTile - 1) / kTile;
  const int64_t dp = use_native ? (d + 1) / 2 * 2 : d, vstride = kblk * panels_d * EXACT_K * kTile;
  const int64_t kstride = kblk * EXACT_K * dp;
  std::vector<float> Kf(use_native ? 0 : B * Hkv * kstride), Vf(use_native ? 0 : B * Hkv * vstride);
  std::vector<uint16_t> Kb(use_native ? B * Hkv * kstride : 0), Vb(use_native ? B * Hkv * vstride : 0);
  auto pack = [&](const auto* K, const auto* V, int64_t bh) {
    K += bh / Hkv * k.stride(0) + bh % Hkv * k.stride(1);
    V += bh / Hkv * v.stride(0) + bh % Hkv * v.stride(1);
    const float* vs = i8 ? v_scale.data_ptr<float>() + bh / Hkv * v_scale.stride(0) + bh % Hkv * v_scale.stride(1)
                         : nullptr;
    using T = std::remove_const_t<std::remove_pointer_t<decltype(K)>>;
#if defined(__AVX512BF16__)
    if (use_native) return pack_bf16(K, V, vs, keys, d, dv, Kb.data() + bh * kstride, Vb.data() + bh * vstride);
#endif
    if (bf16_products)
      return pack_f32<T, true>(K, V, vs, keys, d, dv, Kf.data() + bh * kstride, Vf.data() + bh * vstride);
    pack_f32<T, false>(K, V, vs, keys, d, dv, Kf.data() + bh * kstride, Vf.data() + bh * vstride);
  };
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      if (i8) {
        pack(k.data_ptr<int8_t>(), v.data_ptr<int8_t>(), bh);
      } else if (bf16) {
        pack(reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>()),
             reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>()), bh);
      } else {
        pack(k.data_ptr<float>(), v.data_ptr<float>(), bh);
      }
    }
  });
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> work;
    std::vector<uint16_t> bwork;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / nblk, i_lo = block_of(task % nblk) * EXACT_Q;
      const float* qh = qp + bh * G * N * d;
      float* oh = op + bh * G * N * dv;
      // int8 keys: their scales, applied to the scores (the packed keys are the integers)
      const float* ks =
          i8 ? k_scale.data_ptr<float>() + bh / Hkv * k_scale.stride(0) + bh % Hkv * k_scale.stride(1) : nullptr;
#if defined(__AVX512BF16__)
      if (use_native) {
        exact_block_bf16(qh, Kb.data() + bh * kstride, Vb.data() + bh * vstride, ks, oh, G, N, d, dv, t0, i_lo,
                         float(scale), work, bwork);
        continue;
      }
#endif
      const float *Kh = Kf.data() + bh * kstride, *Vh = Vf.data() + bh * vstride;
      if (bf16_products) {
        exact_block<true>(qh, Kh, Vh, ks, oh, G, N, d, dv, t0, i_lo, float(scale), work);
      } else {
        exact_block<false>(qh, Kh, Vh, ks, oh, G, N, d, dv, t0, i_lo, float(scale), work);
      }
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("window_combine", &window_combine, "Fused CPU exact part of the sink/window operator (one segment)");
  m.def("window_backward", &window_backward, "Gradients of window_combine");
  m.def("exact_prefill", &exact_prefill, "Exact causal softmax of a prompt's queries (flash-style, GQA-shared keys)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("t0"), py::arg("scale"), py::arg("bf16_products") = false,
        py::arg("native") = true, py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none());
}
