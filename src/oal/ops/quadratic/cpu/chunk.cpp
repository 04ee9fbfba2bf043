// Fused CPU forward of the chunked quadratic-kernel operator (the no-autograd path of ../chunk.py, and the forward of
// its _FusedChunk), below it the same outputs of a fresh segment in parallel form (parallel_forward: cheaper up to
// ~2k tokens) and the backward of the chunked forward (chunk_backward, the reverse chunk scan).
//
// Same arithmetic as _forward_no_grad with a KernelFactor: per (batch, KV head) and chunk of n tokens
//   num  = kern @ u  +  φ_q(Q) @ S,   den = kern @ w  +  φ_q(Q) · z      (intra-chunk part + readout, Eq. 6)
//   S   += φ_k(K)ᵀ @ u,               z  += φ_k(K)ᵀ @ w                 (state update, Eq. 5)
//   o    = num / max(den, floor · count)
// with u_j = w_j v_j for key weights w (all 1 without them), count the sum of the weights so far, φ in the cyclic
// layout of utils.cyclic_maps (feature f = r·P + δ is x'_r · x'_{(r+δ) mod e}, x' = [x, 1]) and
// kern[i, j] = c0 + Σ_m (c_m + scale·(q_i ⊙ W_m)·k_j)² for j ≤ i (Eq. 7).
//
// None of it goes through the BLAS. The two state products are nearly all the work; through the BLAS they
// need φ_q and φ_k written out (G·n·D and n·D floats per chunk) and packed again, and on the AMD CPU of
// earlier stops, MKL's sgemm reaches 60-70 % of the FMA peak (benchmarks/cpu_peak.py). Here one register-tiled
// kernel (12 rows x 32 columns of accumulators, tile_kernel) runs every product on features generated block by
// block into L1, and each thread owns a contiguous range of features: it keeps its slice of the state (stored as
// 16-column panels) in its own cache, reads it out and updates it, so only the per-thread partial outputs cross
// threads. The intra-chunk scores use the same kernel and skip the key columns that the causal mask zeroes.
#include <torch/extension.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>  // tiles.h's bf16 pair product
#endif

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using at::Tensor;

#include "tiles.h"

constexpr int64_t kBlock = 256;  // features per readout block: kRows x 256 generated floats stay in L1

// Σ_t a[t] · b[t], vectorised (a plain float reduction is not, without reassociation)
inline float dot(const float* a, const float* b, int64_t n) {
  v16 acc = {};
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) acc += load16(a + t) * load16(b + t);
  float total = sum16(acc);
  for (; t < n; ++t) total += a[t] * b[t];
  return total;
}

// features f ∈ [fa, fb) of one row: out[f - fa] = w[f] · y[r] · y[r + δ] (w null: without the weight), y the
// doubled [x, 1]; f = r·P + δ
template <typename T>
inline void pair_features(const T* y, const T* w, int64_t P, int64_t fa, int64_t fb, T* out) {
  // one division for the range, not one per run of ≤ P features (a 64-bit division costs as much as such a run)
  int64_t r = fa / P, delta = fa - r * P;
  for (int64_t f = fa; f < fb; ++r, delta = 0) {
    const int64_t len = std::min(P - delta, fb - f);
    const T yr = y[r];
    const T* ys = y + r + delta;
    T* dst = out + (f - fa);
    int64_t t = 0;
    if constexpr (std::is_same_v<T, float>) {  // 16 lanes at a time: the runs are ≤ P = e/2 + 1 long
      const v16 yv = splat16(yr);
      for (; t + 16 <= len; t += 16) {
        v16 x = yv * load16(ys + t);
        if (w) x *= load16(w + f + t);
        store16(dst + t, x);
      }
    }
    if (w) {
      const T* wf = w + f;
      for (; t < len; ++t) dst[t] = yr * ys[t] * wf[t];
    } else {
      for (; t < len; ++t) dst[t] = yr * ys[t];
    }
    f += len;
  }
}

// the canonical state row of each cyclic feature (utils.cyclic_maps), checked: initial and final states are canonical
inline const int64_t* canonical_rows(const Tensor& canon_of_cyc, int64_t Dc) {
  TORCH_CHECK(canon_of_cyc.scalar_type() == at::kLong && canon_of_cyc.numel() == Dc && canon_of_cyc.is_contiguous(),
              "canon_of_cyc: expected ", Dc, " contiguous int64 rows");
  return canon_of_cyc.data_ptr<int64_t>();
}

template <typename T>
std::vector<Tensor> forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& w, const Tensor& fw,
                            const Tensor& fc, const Tensor& c0, const Tensor& state0, const Tensor& key_weight,
                            const Tensor& canon_of_cyc, double kernel_floor, int64_t chunk, bool want_final,
                            bool want_dens) {
  const int64_t B = q.size(0), Hq = q.size(1), N = q.size(2), d = q.size(3);
  const int64_t Hkv = k.size(1), dv = v.size(3), G = Hq / Hkv, e = d + 1, e2 = 2 * e, P = e / 2 + 1, Dc = e * P;
  const int64_t R = fc.size(2), cs = std::min(chunk, N), one_row = d * P;
  const int64_t tiles = (dv + kTile - 1) / kTile, dvp = tiles * kTile;  // value columns padded to whole panels
  // one feature range per thread, each at least four kRows-feature update blocks long
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), Dc / (4 * kRows)));
  const auto f32 = q.options().dtype(at::kFloat);

  Tensor o = at::empty({B, Hq, N, dv}, q.options());
  Tensor dens = want_dens ? at::empty({B, Hkv, G, N}, f32) : at::empty({0}, f32);
  // canonical rows D = 1 + d + d(d+1)/2: the cyclic layout's Dc for even d; for odd d it holds d/2 + 1 pairs twice
  // (identical rows), each written to its one canonical row
  const int64_t D = 1 + d + d * (d + 1) / 2;
  Tensor finals = want_final ? at::empty({B, Hkv, D, dv + 1}, f32) : at::empty({0}, f32);
  // state: S as `tiles` panels (Dc, 16), then z (Dc)
  Tensor state_t = at::empty({tiles * Dc * kTile + Dc}, f32);
  Tensor yq_t = at::empty({G * cs * e2}, f32), ykt_t = at::empty({e2 * cs}, f32);
  Tensor ut_t = at::empty({tiles * cs * kTile}, f32), num_t = at::empty({G * cs * dvp}, f32);
  Tensor den_t = at::empty({G * cs}, f32), ykp_t = at::empty({(cs + kTile - 1) / kTile * kTile * e}, f32);
  // per thread: partial readout (G·cs, dvp), partial denominators (G·cs), a generated feature block
  const int64_t scratch = G * cs * dvp + G * cs + kRows * std::max(kBlock, cs);
  Tensor scratch_t = at::empty({threads * scratch}, f32);
  float *S = state_t.data_ptr<float>(), *Z = S + tiles * Dc * kTile;
  float *yq = yq_t.data_ptr<float>(), *ykt = ykt_t.data_ptr<float>(), *ut = ut_t.data_ptr<float>();
  float *num = num_t.data_ptr<float>(), *den = den_t.data_ptr<float>(), *ykp = ykp_t.data_ptr<float>();
  float* scr = scratch_t.data_ptr<float>();
  const float *W = w.data_ptr<float>(), *FW = fw.data_ptr<float>(), *FC = fc.data_ptr<float>();
  const float* C0 = c0.data_ptr<float>();
  const T *Q = q.data_ptr<T>(), *K = k.data_ptr<T>(), *V = v.data_ptr<T>();
  T* O = o.data_ptr<T>();
  float* DENS = want_dens ? dens.data_ptr<float>() : nullptr;
  const bool floored = kernel_floor >= 0, weighted = key_weight.numel() > 0;
  const float* KW = weighted ? key_weight.data_ptr<float>() : nullptr;
  const int64_t* canon = canonical_rows(canon_of_cyc, Dc);
  TORCH_CHECK(state0.numel() == 0 || state0.numel() == B * Hkv * D * (dv + 1), "state0: expected (B, Hkv, ", D, ", ",
              dv + 1, ") or empty");
  std::vector<float> ones(cs, 1.f), counts(cs);

  for (int64_t bh = 0; bh < B * Hkv; ++bh) {
    const int64_t bi = bh / Hkv, h = bh % Hkv;
    if (state0.numel()) {
      const float* s0 = state0.data_ptr<float>() + bh * D * (dv + 1);
      for (int64_t f = 0; f < Dc; ++f) {
        const float* row = s0 + canon[f] * (dv + 1);
        for (int64_t c = 0; c < dvp; ++c) S[(c / kTile * Dc + f) * kTile + c % kTile] = c < dv ? row[c] : 0.f;
        Z[f] = row[dv];
      }
    } else {
      std::fill(S, S + tiles * Dc * kTile + Dc, 0.f);
    }
    double seen = Z[one_row];  // (weighted) keys before this segment: the count of the constant feature
    const T* qh = Q + (bi * Hq + h * G) * N * d;
    const T* kh = K + bh * N * d;
    const T* vh = V + bh * N * dv;
    T* oh = O + (bi * Hq + h * G) * N * dv;
    const float* wh = W + h * G * Dc;
    const float* fwh = FW + h * G * R * d;
    const float* fch = FC + h * G * R;
    const float* c0h = C0 + h * G;
    float* dh = want_dens ? DENS + bh * G * N : nullptr;

    for (int64_t start = 0; start < N; start += cs) {
      const int64_t n = std::min(cs, N - start), rows = G * n, np = (n + kTile - 1) / kTile * kTile;
      const float* wk = weighted ? KW + bh * N + start : ones.data();
      for (int64_t j = 0; j < n; ++j) counts[j] = static_cast<float>(seen += wk[j]);
      // doubled [q, 1] rows (g, i); doubled [k, 1] token-contiguous (for the update); [k, 1] in 16-token panels and
      // v in 16-column panels (for the intra-chunk part)
      at::parallel_for(0, rows + n, 16, [&](int64_t lo, int64_t hi) {
        for (int64_t row = lo; row < hi; ++row) {
          if (row < rows) {
            const T* x = qh + ((row / n) * N + start + row % n) * d;
            float* y = yq + row * e2;
            for (int64_t r = 0; r < d; ++r) y[r] = y[r + e] = static_cast<float>(x[r]);
            y[d] = y[d + e] = 1.f;
          } else {
            const int64_t j = row - rows;
            const T* x = kh + (start + j) * d;
            float* yp = ykp + (j / kTile * e) * kTile + j % kTile;
            for (int64_t r = 0; r < d; ++r) {
              const float value = static_cast<float>(x[r]);
              ykt[r * n + j] = ykt[(r + e) * n + j] = yp[r * kTile] = value;
            }
            ykt[d * n + j] = ykt[(d + e) * n + j] = yp[d * kTile] = 1.f;
            const T* vx = vh + (start + j) * dv;
            for (int64_t c = 0; c < dvp; ++c)
              ut[(c / kTile * n + j) * kTile + c % kTile] = c < dv ? wk[j] * static_cast<float>(vx[c]) : 0.f;
          }
        }
      });
      // intra-chunk part kRows rows at a time: z_m = [scale·W_m ⊙ q_i, c_m] · [k_j, 1] through the tile kernel, only
      // over the key columns the block's causal rows reach; kern = c0 + Σ_m z_m² on j ≤ i (Eq. 7); num = kern @ v
      at::parallel_for(0, (rows + kRows - 1) / kRows, 1, [&](int64_t lo, int64_t hi) {
        std::vector<float> buf(kRows * (e + 2 * np));
        float *qwb = buf.data(), *zb = qwb + kRows * e, *kb = zb + kRows * np;
        for (int64_t blk = lo; blk < hi; ++blk) {
          const int64_t r0 = blk * kRows, mr = std::min(kRows, rows - r0);
          // a block across two query heads needs all n columns
          const int64_t width = r0 / n == (r0 + mr - 1) / n ? (r0 + mr - 1) % n + 1 : n;
          const int64_t wt = (width + kTile - 1) / kTile;
          std::fill(kb, kb + mr * np, 0.f);
          for (int64_t m = 0; m < R; ++m) {
            for (int64_t a = 0; a < mr; ++a) {
              const int64_t gm = (r0 + a) / n * R + m;
              const float* y = yq + (r0 + a) * e2;
              const float* f = fwh + gm * d;
              float* out = qwb + a * e;
              for (int64_t r = 0; r < d; ++r) out[r] = y[r] * f[r];
              out[d] = fch[gm];
            }
            tile_rows(mr, qwb, e, ykp, e * kTile, e, zb, kTile, np, wt, false);
            for (int64_t a = 0; a < mr; ++a) {
              const int64_t i = (r0 + a) % n;
              const float* zr = zb + a * np;
              float* kr = kb + a * np;
              for (int64_t j = 0; j <= i; ++j) kr[j] += zr[j] * zr[j];
            }
          }
          for (int64_t a = 0; a < mr; ++a) {
            const float c = c0h[(r0 + a) / n];
            float* kr = kb + a * np;
            for (int64_t j = 0; j <= (r0 + a) % n; ++j) kr[j] += c;
            den[r0 + a] = dot(kr, wk, (r0 + a) % n + 1);
          }
          tile_rows(mr, kb, np, ut, n * kTile, width, num + r0 * dvp, kTile, dvp, tiles, false);
        }
      });
      // readout of the state before this chunk, then its update, each thread on its own feature range
      at::parallel_for(0, threads, 1, [&](int64_t lo, int64_t hi) {
        for (int64_t th = lo; th < hi; ++th) {
          const int64_t fa = Dc * th / threads, fb = Dc * (th + 1) / threads;
          float* part = scr + th * scratch;
          float* dpart = part + rows * dvp;
          float* blk = dpart + rows;
          std::fill(part, part + rows * dvp + rows, 0.f);
          // the denominators' dot products in 16-lane accumulators, one per row (feature) of a block, reduced
          // together once per block (sum_lanes16): a horizontal sum per row and feature block had cost as much
          // as the readout's tile products, and per feature and chunk several times the update's
          v16 dacc[16];
          float dtail[kRows];
          for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
            const int64_t mr = std::min(kRows, rows - r0);
            std::fill(dacc, dacc + 16, v16{});
            std::fill(dtail, dtail + kRows, 0.f);
            for (int64_t f0 = fa; f0 < fb; f0 += kBlock) {
              const int64_t kb = std::min(kBlock, fb - f0);
              for (int64_t i = 0; i < mr; ++i) {
                float* a = blk + i * kb;
                pair_features(yq + (r0 + i) * e2, wh + (r0 + i) / n * Dc, P, f0, f0 + kb, a);
                int64_t t = 0;
                for (; t + 16 <= kb; t += 16) dacc[i] += load16(a + t) * load16(Z + f0 + t);
                for (; t < kb; ++t) dtail[i] += a[t] * Z[f0 + t];
              }
              tile_rows(mr, blk, kb, S + f0 * kTile, Dc * kTile, kb, part + r0 * dvp, kTile, dvp, tiles);
            }
            const v16 sums = sum_lanes16(dacc);
            for (int64_t i = 0; i < mr; ++i) dpart[r0 + i] += lane(sums, int(i)) + dtail[i];
          }
          for (int64_t f0 = fa; f0 < fb; f0 += kRows) {
            const int64_t mr = std::min(kRows, fb - f0);
            std::fill(dacc, dacc + 16, v16{});
            for (int64_t i = 0; i < mr; ++i) {
              const int64_t f = f0 + i, r = f / P;
              const float *ya = ykt + r * n, *yb = ykt + (r + f - r * P) * n;
              float* a = blk + i * n;
              int64_t j = 0;
              for (; j + 16 <= n; j += 16) {
                const v16 x = load16(ya + j) * load16(yb + j);
                store16(a + j, x);
                dacc[i] += x * load16(wk + j);
              }
              dtail[i] = 0.f;
              for (; j < n; ++j) dtail[i] += (a[j] = ya[j] * yb[j]) * wk[j];
            }
            const v16 sums = sum_lanes16(dacc);
            for (int64_t i = 0; i < mr; ++i) Z[f0 + i] += lane(sums, int(i)) + dtail[i];
            tile_rows(mr, blk, n, ut, n * kTile, n, S + f0 * kTile, Dc * kTile, kTile, tiles);
          }
        }
      });
      // sum the partial readouts and normalise
      at::parallel_for(0, rows, 16, [&](int64_t lo, int64_t hi) {
        for (int64_t row = lo; row < hi; ++row) {
          const int64_t g = row / n, i = row % n;
          float* nr = num + row * dvp;
          float dn = den[row];
          for (int64_t th = 0; th < threads; ++th) {
            const float* part = scr + th * scratch;
            const float* pr = part + row * dvp;
            for (int64_t c = 0; c < dv; ++c) nr[c] += pr[c];
            dn += part[rows * dvp + row];
          }
          if (floored) dn = std::max(dn, counts[i] * static_cast<float>(kernel_floor));
          if (dh) dh[g * N + start + i] = dn;
          if (weighted && counts[i] <= 0.f) dn = 1.f;  // no key with weight > 0 yet: output 0, not 0/0
          T* orow = oh + (g * N + start + i) * dv;
          for (int64_t c = 0; c < dv; ++c) orow[c] = static_cast<T>(nr[c] / dn);
        }
      });
    }
    if (want_final) {
      float* fin = finals.data_ptr<float>() + bh * D * (dv + 1);
      for (int64_t f = 0; f < Dc; ++f) {
        float* row = fin + canon[f] * (dv + 1);
        for (int64_t c = 0; c < dv; ++c) row[c] = S[(c / kTile * Dc + f) * kTile + c % kTile];
        row[dv] = Z[f];
      }
    }
  }
  return {o, dens, finals};
}


// ------------------------------------------------------------------------------------------------ backward
//
// The reverse chunk scan (the layout fla gives a chunked linear-attention backward), for training. Per (batch, KV
// head) one forward sweep recomputes the state before every chunk (Dc·(dv+1) numbers per chunk, S_c), then the
// chunks run backwards carrying dS, the gradient of the state after the chunk (the final state's gradient, or 0):
//   dnum  = [do / den,  dden − Σ_c do_c o_c / den]      (the last entry 0 where the floor clamps den)
//   dφq   = dnum S_cᵀ          dφk = U dSᵀ          dU = φk dS + kernᵀ dnum          then dS ← dS + φqᵀ dnum
//   dkern = (dnum Uᵀ) on j ≤ i,  dz_m = 2 z_m ⊙ dkern through z_m = [W_m ⊙ q_i, c_m] · [k_j, 1] (Eq. 7) to q, k, W, c, c0
//   and the features' adjoint: φ_f = y_r y_{r+δ} (y the doubled [x, 1]) gives dy_r += dφ_f y_{r+δ}, dy_{r+δ} += dφ_f y_r.
// Features exist for one chunk at a time (G·n·Dc and n·Dc numbers), never for the sequence, which is what the
// autograd loop stores; the products go through at::mm, the rest runs in loops over rows.

// adjoint of pair_features over a whole row without weights: dy (2e, zeroed by the caller) += ∂(Σ_f g_f φ_f)/∂y
template <typename T>
inline void pair_features_adjoint(const T* __restrict y, const T* __restrict g, int64_t e, int64_t P,
                                 T* __restrict dy) {
  for (int64_t r = 0; r < e; ++r) {
    const T yr = y[r];
    const T* ys = y + r;
    const T* gr = g + r * P;
    T* dys = dy + r;
    T acc = 2 * gr[0] * yr;  // φ = y_r² at δ = 0
#pragma omp simd reduction(+ : acc)
    for (int64_t t = 1; t < P; ++t) {
      acc += gr[t] * ys[t];
      dys[t] += gr[t] * yr;
    }
    dy[r] += acc;
  }
}

// dx (d) += the gradient of the doubled row: coordinates r and r + e are both x_r; d and d + e are the constant 1
template <typename T>
inline void fold_doubled(const T* dy, int64_t d, int64_t e, T* dx) {
  for (int64_t r = 0; r < d; ++r) dx[r] += dy[r] + dy[r + e];
}

// a contiguous (rows, cols) matrix at the start of a flat buffer
inline Tensor mat(const Tensor& flat, int64_t rows, int64_t cols) {
  return flat.narrow(0, 0, rows * cols).view({rows, cols});
}

template <typename T>
std::vector<Tensor> backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& w, const Tensor& fw,
                             const Tensor& fc, const Tensor& c0, const Tensor& state0, const Tensor& key_weight,
                             double kernel_floor, int64_t chunk, const Tensor& o, const Tensor& dens,
                             const Tensor& d_o, const Tensor& d_den, const Tensor& d_final, bool want_dstate0,
                             bool want_dkw) {
  const int64_t B = q.size(0), Hq = q.size(1), N = q.size(2), d = q.size(3);
  const int64_t Hkv = k.size(1), dv = v.size(3), G = Hq / Hkv, e = d + 1, e2 = 2 * e, P = e / 2 + 1, Dc = e * P;
  const int64_t R = fc.size(2), cs = std::min(chunk, N), nch = (N + cs - 1) / cs, dv1 = dv + 1, one_row = d * P;
  const int64_t threads = at::get_num_threads();
  const auto opt = q.options();

  Tensor dq = at::zeros_like(q), dk = at::zeros_like(k), dvt = at::zeros_like(v);
  Tensor dw = at::zeros({Hkv, G, Dc}, opt), dfw = at::zeros({Hkv, G, R, d}, opt);
  Tensor dfc = at::zeros({Hkv, G, R}, opt), dc0 = at::zeros({Hkv, G}, opt);
  Tensor dstate0 = want_dstate0 ? at::zeros({B, Hkv, Dc, dv1}, opt) : at::empty({0}, opt);
  Tensor dkw = want_dkw ? at::zeros({B, Hkv, N}, opt) : at::empty({0}, opt);

  Tensor states = at::empty({nch, Dc, dv1}, opt), dS = at::empty({Dc, dv1}, opt);
  Tensor yq_f = at::empty({G * cs * e2}, opt), yk_f = at::empty({cs * e2}, opt);
  Tensor kb_f = at::empty({cs * e}, opt), u_f = at::empty({cs * dv1}, opt);
  Tensor pq_f = at::empty({G * cs * Dc}, opt), pk_f = at::empty({cs * Dc}, opt);
  Tensor dpq_f = at::empty({G * cs * Dc}, opt), dpk_f = at::empty({cs * Dc}, opt);
  Tensor dn_f = at::empty({G * cs * dv1}, opt), du_f = at::empty({cs * dv1}, opt);
  Tensor qw_f = at::empty({G * R * cs * e}, opt), z_f = at::empty({G * R * cs * cs}, opt);
  Tensor kern_f = at::empty({G * cs * cs}, opt), dkern_f = at::empty({G * cs * cs}, opt);
  Tensor dqw_f = at::empty({G * R * cs * e}, opt), dkb_f = at::empty({cs * e}, opt);
  Tensor dw_part = at::empty({threads, G, Dc}, opt), dy_t = at::empty({threads, e2}, opt);
  T *yq = yq_f.data_ptr<T>(), *yk = yk_f.data_ptr<T>(), *kb = kb_f.data_ptr<T>(), *u = u_f.data_ptr<T>();
  T *pq = pq_f.data_ptr<T>(), *pk = pk_f.data_ptr<T>(), *dpq = dpq_f.data_ptr<T>(), *dpk = dpk_f.data_ptr<T>();
  T *dn = dn_f.data_ptr<T>(), *du = du_f.data_ptr<T>(), *qw = qw_f.data_ptr<T>(), *z = z_f.data_ptr<T>();
  T *kern = kern_f.data_ptr<T>(), *dkern = dkern_f.data_ptr<T>(), *dqw = dqw_f.data_ptr<T>();
  T *dkb = dkb_f.data_ptr<T>(), *dwp = dw_part.data_ptr<T>(), *dyb = dy_t.data_ptr<T>();
  const T *Q = q.data_ptr<T>(), *K = k.data_ptr<T>(), *V = v.data_ptr<T>(), *W = w.data_ptr<T>();
  const T *FW = fw.data_ptr<T>(), *FC = fc.data_ptr<T>(), *C0 = c0.data_ptr<T>(), *O = o.data_ptr<T>();
  const T *DENS = dens.data_ptr<T>(), *DO = d_o.data_ptr<T>();
  const T* DDEN = d_den.numel() ? d_den.data_ptr<T>() : nullptr;
  T *DQ = dq.data_ptr<T>(), *DK = dk.data_ptr<T>(), *DV = dvt.data_ptr<T>(), *DFW = dfw.data_ptr<T>();
  T *DFC = dfc.data_ptr<T>(), *DC0 = dc0.data_ptr<T>(), *DW = dw.data_ptr<T>();
  T* DKW = want_dkw ? dkw.data_ptr<T>() : nullptr;
  const bool floored = kernel_floor >= 0, weighted = key_weight.numel() > 0;
  const T* KW = weighted ? key_weight.data_ptr<T>() : nullptr;
  // a denominator at the floor was clamped there (forward: den = max(num, floor · count)); the margin absorbs
  // the forward's rounding of floor · count, far below any real gap between a kernel sum and the floor
  const T clamp_margin = 1 + 16 * std::numeric_limits<T>::epsilon();
  std::vector<double> counts(N);
  std::vector<T> row_dc0(G * cs);

  for (int64_t bh = 0; bh < B * Hkv; ++bh) {
    const int64_t bi = bh / Hkv, h = bh % Hkv;
    const T* qh = Q + (bi * Hq + h * G) * N * d;
    const T* kh = K + bh * N * d;
    const T* vh = V + bh * N * dv;
    const T* wk = weighted ? KW + bh * N : nullptr;
    const T* wh = W + h * G * Dc;
    const T* fwh = FW + h * G * R * d;
    const T* fch = FC + h * G * R;
    if (state0.numel()) {
      states[0].copy_(state0[bi][h]);
    } else {
      states[0].zero_();
    }
    double seen = states[0][one_row][dv].item<double>();
    for (int64_t pos = 0; pos < N; ++pos) counts[pos] = seen += weighted ? static_cast<double>(wk[pos]) : 1.0;

    // keys of the chunk at `start`: doubled [k, 1] rows, [k, 1], U = [ω v, ω] and the key features
    auto load_keys = [&](int64_t start, int64_t n) {
      at::parallel_for(0, n, 8, [&](int64_t lo, int64_t hi) {
        for (int64_t j = lo; j < hi; ++j) {
          const T* x = kh + (start + j) * d;
          T* y = yk + j * e2;
          for (int64_t r = 0; r < d; ++r) y[r] = y[r + e] = kb[j * e + r] = x[r];
          y[d] = y[d + e] = kb[j * e + d] = 1;
          const T om = weighted ? wk[start + j] : T(1);
          const T* vx = vh + (start + j) * dv;
          for (int64_t c = 0; c < dv; ++c) u[j * dv1 + c] = om * vx[c];
          u[j * dv1 + dv] = om;
          pair_features<T>(y, nullptr, P, 0, Dc, pk + j * Dc);
        }
      });
    };
    for (int64_t c = 0; c + 1 < nch; ++c) {
      const int64_t start = c * cs, n = std::min(cs, N - start);
      load_keys(start, n);
      Tensor next = states[c + 1];
      at::addmm_out(next, states[c], mat(pk_f, n, Dc).t(), mat(u_f, n, dv1));
    }
    if (d_final.numel()) {
      dS.copy_(d_final[bi][h]);
    } else {
      dS.zero_();
    }
    dw_part.zero_();

    for (int64_t c = nch - 1; c >= 0; --c) {
      const int64_t start = c * cs, n = std::min(cs, N - start), rows = G * n;
      load_keys(start, n);
      // query rows: doubled [q, 1], weighted features, and the gradient of the unnormalised numerator
      at::parallel_for(0, rows, 8, [&](int64_t lo, int64_t hi) {
        for (int64_t row = lo; row < hi; ++row) {
          const int64_t g = row / n, pos = start + row % n;
          const T* x = qh + (g * N + pos) * d;
          T* y = yq + row * e2;
          for (int64_t r = 0; r < d; ++r) y[r] = y[r + e] = x[r];
          y[d] = y[d + e] = 1;
          pair_features<T>(y, wh + g * Dc, P, 0, Dc, pq + row * Dc);
          const int64_t at_ = (bh * G + g) * N + pos;  // dens (B, Hkv, G, N)
          const T den = DENS[at_], cnt = static_cast<T>(counts[pos]);
          const bool empty = weighted && cnt <= 0;  // no key yet: the forward divided by 1
          const bool clamped = floored && den <= cnt * static_cast<T>(kernel_floor) * clamp_margin;
          const T denp = empty ? T(1) : den;
          const T* dor = DO + ((bi * Hq + h * G + g) * N + pos) * dv;
          const T* orow = O + ((bi * Hq + h * G + g) * N + pos) * dv;
          T* dr = dn + row * dv1;
          T acc = 0;
          for (int64_t cc = 0; cc < dv; ++cc) {
            dr[cc] = dor[cc] / denp;
            acc += dor[cc] * orow[cc];
          }
          const T dden = DDEN ? DDEN[at_] : T(0);
          // an empty query's denominator is max(0, 0) under a floor: a tie, split in halves like torch.maximum
          dr[dv] = empty ? (floored ? dden / 2 : dden) : clamped ? T(0) : dden - acc / denp;
        }
      });
      const Tensor DN = mat(dn_f, rows, dv1), U = mat(u_f, n, dv1), KB = mat(kb_f, n, e);

      // intra-chunk part (Eq. 7): z_m = [W_m ⊙ q_i, c_m] · [k_j, 1], kern = c0 + Σ_m z_m² on j ≤ i
      at::parallel_for(0, G * R * n, 16, [&](int64_t lo, int64_t hi) {
        for (int64_t t = lo; t < hi; ++t) {
          const int64_t g = t / (R * n), m = t / n % R, i = t % n;
          const T* y = yq + (g * n + i) * e2;
          const T* f = fwh + (g * R + m) * d;
          T* out = qw + t * e;
          for (int64_t r = 0; r < d; ++r) out[r] = y[r] * f[r];
          out[d] = fch[g * R + m];
        }
      });
      Tensor QW = mat(qw_f, G * R * n, e), Z = mat(z_f, G * R * n, n);
      Tensor KERN = mat(kern_f, rows, n), DKERN = mat(dkern_f, rows, n);
      at::mm_out(Z, QW, KB.t());
      at::mm_out(DKERN, DN, U.t());
      at::parallel_for(0, rows, 8, [&](int64_t lo, int64_t hi) {
        for (int64_t row = lo; row < hi; ++row) {
          const int64_t g = row / n, i = row % n;
          T* kr = kern + row * n;
          T* dkr = dkern + row * n;
          const T base = C0[h * G + g];
          for (int64_t j = 0; j < n; ++j) kr[j] = j <= i ? base : T(0);
          T s = 0;
          for (int64_t j = i + 1; j < n; ++j) dkr[j] = 0;
          for (int64_t j = 0; j <= i; ++j) s += dkr[j];
          row_dc0[row] = s;
          for (int64_t m = 0; m < R; ++m) {
            T* zr = z + ((g * R + m) * n + i) * n;
            for (int64_t j = 0; j <= i; ++j) {
              kr[j] += zr[j] * zr[j];
              zr[j] *= 2 * dkr[j];  // z becomes dz
            }
            for (int64_t j = i + 1; j < n; ++j) zr[j] = 0;
          }
        }
      });
      for (int64_t row = 0; row < rows; ++row) DC0[h * G + row / n] += row_dc0[row];
      Tensor DU = mat(du_f, n, dv1), DQW = mat(dqw_f, G * R * n, e), DKB = mat(dkb_f, n, e);
      at::mm_out(DU, KERN.t(), DN);
      at::mm_out(DQW, Z, KB);
      at::mm_out(DKB, Z.t(), QW);
      // W, c of each (query head, square) summed over the chunk's queries
      at::parallel_for(0, G * R, 1, [&](int64_t lo, int64_t hi) {
        for (int64_t gm = lo; gm < hi; ++gm) {
          const int64_t g = gm / R;
          T* dfr = DFW + (h * G * R + gm) * d;
          T sc = 0;
          for (int64_t i = 0; i < n; ++i) {
            const T* y = yq + (g * n + i) * e2;
            const T* dr = dqw + (gm * n + i) * e;
            for (int64_t r = 0; r < d; ++r) dfr[r] += y[r] * dr[r];
            sc += dr[d];
          }
          DFC[h * G * R + gm] += sc;
        }
      });

      // state readout and update (Eq. 5–6): the gradients of the features and of U, then dS for the chunk before
      const Tensor Sc = states[c];
      const Tensor PQ = mat(pq_f, rows, Dc), PK = mat(pk_f, n, Dc);
      Tensor DPQ = mat(dpq_f, rows, Dc), DPK = mat(dpk_f, n, Dc);
      at::mm_out(DPQ, DN, Sc.t());
      at::mm_out(DPK, U, dS.t());
      DU.addmm_(PK, dS);
      dS.addmm_(PQ.t(), DN);

      // features' adjoint, row by row; query rows also take their intra-chunk part and give the query weights'
      at::parallel_for(0, rows + n, 4, [&](int64_t lo, int64_t hi) {
        const int64_t th = at::get_thread_num();
        T* dy = dyb + th * e2;
        for (int64_t row = lo; row < hi; ++row) {
          std::fill(dy, dy + e2, T(0));
          if (row < rows) {
            const int64_t g = row / n, i = row % n;
            const T* y = yq + row * e2;
            const T* wr = wh + g * Dc;
            T* gr = dpq + row * Dc;
            T* dwr = dwp + (th * G + g) * Dc;
            for (int64_t r = 0; r < e; ++r) {
              const T yr = y[r];
              const T* ys = y + r;
              T* grr = gr + r * P;
              T* dwrr = dwr + r * P;
              const T* wrr = wr + r * P;
              for (int64_t t = 0; t < P; ++t) {
                dwrr[t] += grr[t] * yr * ys[t];
                grr[t] *= wrr[t];
              }
            }
            pair_features_adjoint<T>(y, gr, e, P, dy);
            T* dx = DQ + ((bi * Hq + h * G + g) * N + start + i) * d;
            fold_doubled<T>(dy, d, e, dx);
            for (int64_t m = 0; m < R; ++m) {
              const T* f = fwh + (g * R + m) * d;
              const T* dr = dqw + ((g * R + m) * n + i) * e;
              for (int64_t r = 0; r < d; ++r) dx[r] += f[r] * dr[r];
            }
          } else {
            const int64_t j = row - rows, pos = start + j;
            pair_features_adjoint<T>(yk + j * e2, dpk + j * Dc, e, P, dy);
            T* dx = DK + (bh * N + pos) * d;
            fold_doubled<T>(dy, d, e, dx);
            for (int64_t r = 0; r < d; ++r) dx[r] += dkb[j * e + r];
            const T om = weighted ? wk[pos] : T(1);
            const T* dur = du + j * dv1;
            const T* vx = vh + pos * dv;
            T* dvx = DV + (bh * N + pos) * dv;
            T dom = dur[dv];
            for (int64_t cc = 0; cc < dv; ++cc) {
              dvx[cc] += om * dur[cc];
              dom += dur[cc] * vx[cc];
            }
            if (DKW) DKW[bh * N + pos] += dom;
          }
        }
      });
    }
    if (want_dstate0) dstate0[bi][h].copy_(dS);
    for (int64_t th = 0; th < threads; ++th)
      for (int64_t f = 0; f < G * Dc; ++f) DW[h * G * Dc + f] += dwp[th * G * Dc + f];
  }
  return {dq, dk, dvt, dw, dfw, dfc, dc0, dstate0, dkw};
}

// one row of parallel_forward's kernel matrix: kr[j] = c0 + Σ_m (c_m + Σ_p A[m·lda + p] s_p[j])² for j ≤ i, 0 after,
// with s_p[j] = sc[p·pstride + j]; PP > 0 fixes the class count at compile time (scores held in registers), 0 reads
// it from P
template <int PP>
inline void kappa_row(const float* sc, int64_t pstride, const float* A, int64_t lda, const float* c, int64_t R,
                      float c0, int64_t i, int64_t npad, float* kr, int64_t P = PP) {
  for (int64_t j = 0; j < npad; j += 16) {
    v16 kv = {};
    if (j <= i) {
      kv += c0;
      if constexpr (PP > 0) {
        v16 s[PP];
        for (int p = 0; p < PP; ++p) s[p] = load16(sc + p * pstride + j);
        for (int64_t m = 0; m < R; ++m) {
          v16 z = splat16(c[m]);
          for (int p = 0; p < PP; ++p) z += A[m * lda + p] * s[p];
          kv += z * z;
        }
      } else {
        for (int64_t m = 0; m < R; ++m) {
          v16 z = splat16(c[m]);
          for (int64_t p = 0; p < P; ++p) z += A[m * lda + p] * load16(sc + p * pstride + j);
          kv += z * z;
        }
      }
    }
    store16(kr + j, kv);
    if (j <= i)
      for (int64_t l = i + 1 - j; l < 16; ++l) kr[j + l] = 0.f;  // causal: keys after i weigh nothing
  }
}

// forward's outputs (o, dens) for a segment without an initial state, in parallel form: per query head
//   num_i = Σ_{j ≤ i} κ_ij ω_j [v_j, 1],   κ_ij = c0 + Σ_m z_m²,   z_m = c_m + Σ_p A_mp s_p,   s_p = Σ_{r ∈ p} q_ir k_jr
// where the channels r of a query head fall into the classes p of equal columns of scale·W (fw[m, r] = A_mp): for
// OAL the P = G groups of Eq. 7 (Eq. 6 reads s̄ = [1, s_1 … s_G]), so the partial scores cost one d-long product
// per pair, where the factor form of the intra-chunk part spends R of them. Per pair and query head that is
// d + R·P + R + dv + 1 operations, against D (dv + 1) per query for the state readout: cheaper up to N ≈ 2000 for
// SmolLM2's shapes (the caller decides, chunk.py). The final state (Eq. 5 over the segment) is one product per
// block of kRows features over all N keys: S_f = Σ_j φ_f(k_j) ω_j [v_j, 1], in forward's cyclic feature order.
// rep (Hq, d) int64: for each channel the first channel with the same column (its class representative).
// q may hold fewer rows than k (Nq ≤ N): its rows are then the last Nq positions of the N keys (causal aligned at the
// end: row r is position N - Nq + r and reads keys 0 … N - Nq + r), e.g. a prompt's later chunk over the kept keys.
template <typename T>
std::vector<Tensor> parallel_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& fw,
                                     const Tensor& fc, const Tensor& c0, const Tensor& rep, const Tensor& key_weight,
                                     const Tensor& canon_of_cyc, double kernel_floor, bool want_final) {
  const int64_t B = q.size(0), Hq = q.size(1), Nq = q.size(2), d = q.size(3);
  const int64_t Hkv = k.size(1), N = k.size(2), dv = v.size(3), G = Hq / Hkv, R = fc.size(2), lead = N - Nq;
  const int64_t tiles = (dv + kTile - 1) / kTile, dvp = tiles * kTile, Np = (N + kTile - 1) / kTile * kTile;
  TORCH_CHECK(lead >= 0, "q: expected at most as many rows as k has keys, got ", Nq, " and ", N);
  const auto f32 = q.options().dtype(at::kFloat);
  TORCH_CHECK(rep.scalar_type() == at::kLong && rep.is_contiguous() && rep.numel() == Hq * d,
              "rep: expected (Hq, d) contiguous int64 class representatives");
  const bool floored = kernel_floor >= 0, weighted = key_weight.numel() > 0;
  // k and v may be views of longer buffers (a head's first N rows): rows contiguous, heads ksh / vsh apart
  const int64_t ksh = k.stride(1), vsh = v.stride(1);
  TORCH_CHECK(q.is_contiguous(), "q: expected a contiguous tensor");
  TORCH_CHECK(k.stride(3) == 1 && k.stride(2) == d && (B == 1 || k.stride(0) == Hkv * ksh),
              "k: expected contiguous rows of contiguous heads (a view of a head's first rows at most)");
  TORCH_CHECK(v.stride(3) == 1 && v.stride(2) == dv && (B == 1 || v.stride(0) == Hkv * vsh),
              "v: expected contiguous rows of contiguous heads (a view of a head's first rows at most)");
  const T *Q = q.data_ptr<T>(), *K = k.data_ptr<T>(), *V = v.data_ptr<T>();
  const float *FW = fw.data_ptr<float>(), *FC = fc.data_ptr<float>(), *C0 = c0.data_ptr<float>();
  const int64_t* REP = rep.data_ptr<int64_t>();
  const float* KW = weighted ? key_weight.data_ptr<float>() : nullptr;
  Tensor o = at::empty({B, Hq, Nq, dv}, q.options());
  Tensor dens = at::empty({B, Hkv, G, Nq}, f32);
  T* O = o.data_ptr<T>();
  float* DENS = dens.data_ptr<float>();

  // per query head: channel order by class, class offsets and A (R, P)
  std::vector<int64_t> perm(Hq * d), off(Hq * (d + 1)), classes(Hq);
  std::vector<float> A(Hq * R * d);
  for (int64_t hq = 0; hq < Hq; ++hq) {
    const int64_t* rp = REP + hq * d;
    int64_t P = 0, c = 0;
    for (int64_t r = 0; r < d; ++r) {
      if (rp[r] != r) continue;  // r represents its class: collect its members
      off[hq * (d + 1) + P] = c;
      for (int64_t m = 0; m < R; ++m) A[(hq * R + m) * d + P] = FW[(hq * R + m) * d + r];
      for (int64_t t = r; t < d; ++t)
        if (rp[t] == r) perm[hq * d + c++] = t;
      ++P;
    }
    TORCH_CHECK(c == d, "rep: every channel's representative must be a channel representing itself");
    off[hq * (d + 1) + P] = d;
    classes[hq] = P;
  }
  // per (batch, KV head): ω v as 16-column panels, ω, counts
  std::vector<float> up(B * Hkv * tiles * Np * kTile, 0.f), om(B * Hkv * Np, 0.f), counts(B * Hkv * N);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t bh = lo; bh < hi; ++bh) {
      const T* vs = V + bh * vsh;
      float* ud = up.data() + bh * tiles * Np * kTile;
      float* wd = om.data() + bh * Np;
      double seen = 0;
      for (int64_t j = 0; j < N; ++j) {
        wd[j] = weighted ? KW[bh * N + j] : 1.f;
        counts[bh * N + j] = static_cast<float>(seen += wd[j]);
        for (int64_t c = 0; c < dv; ++c)
          ud[(c / kTile * Np + j) * kTile + c % kTile] = wd[j] * static_cast<float>(vs[j * dv + c]);
      }
    }
  });
  // the queries and keys in each query head's channel order are packed for a slab of S query heads at a time
  // (enough blocks to keep the threads busy), not for all B·Hq at once: per head (N + Nq)·d floats, where all of
  // them took 3.5 MB for a 512-token chunk over 1,024 keys of SmolLM2's nine query heads (its largest transient)
  const int64_t nb = (Nq + kRows - 1) / kRows, BHq = B * Hq;
  const int64_t S = std::min<int64_t>(BHq, std::max<int64_t>(1, (8 * at::get_num_threads() + nb - 1) / nb));
  std::vector<float> qc(S * Nq * d), kp(S * Np * d, 0.f);  // key rows past N stay 0 in every slab
  for (int64_t s0 = 0; s0 < BHq; s0 += S) {
    const int64_t sn = std::min(S, BHq - s0), kpanels = (N + kTile - 1) / kTile;
    at::parallel_for(0, sn * (Nq + kpanels), 16, [&](int64_t lo, int64_t hi) {
      for (int64_t x = lo; x < hi; ++x) {
        const int64_t si = x / (Nq + kpanels), y = x % (Nq + kpanels), bq = s0 + si;
        const int64_t hq = bq % Hq, bh = bq / Hq * Hkv + hq / G;
        const int64_t* pm = perm.data() + hq * d;
        if (y < Nq) {  // one query row
          const T* qs = Q + (bq * Nq + y) * d;
          float* qd = qc.data() + (si * Nq + y) * d;
          for (int64_t c = 0; c < d; ++c) qd[c] = static_cast<float>(qs[pm[c]]);
        } else {  // one panel of kTile keys
          const int64_t t = y - Nq;
          const T* ks = K + bh * ksh;
          float* kd = kp.data() + si * Np * d + t * d * kTile;
          for (int64_t i = t * kTile; i < std::min(N, (t + 1) * kTile); ++i)
            for (int64_t c = 0; c < d; ++c) kd[c * kTile + i % kTile] = static_cast<float>(ks[i * d + pm[c]]);
        }
      }
    });
    // tasks: (query head of the slab, block of kRows queries), each head's blocks in the order first, last, second, …
    // so that any contiguous range of tasks (one thread's share) holds long and short blocks alike; a block's rows
    // r0 … r1-1 are positions i0 … i1-1 (lead after them)
    at::parallel_for(0, sn * nb, 1, [&](int64_t lo, int64_t hi) {
      std::vector<float> sc, kap, num(kRows * dvp);
      for (int64_t task = lo; task < hi; ++task) {
        const int64_t si = task / nb, bq = s0 + si, x = task % nb, blk = x % 2 ? nb - 1 - x / 2 : x / 2;
        const int64_t hq = bq % Hq, h = hq / G, g = hq % G, bh = bq / Hq * Hkv + h;
        const int64_t r0 = blk * kRows, mr = std::min(Nq, r0 + kRows) - r0, i0 = lead + r0, i1 = i0 + mr;
        const int64_t wt = (i1 + kTile - 1) / kTile, npad = wt * kTile, P = classes[hq];
        const int64_t* of = off.data() + hq * (d + 1);
        sc.resize(P * mr * npad);
        kap.resize(mr * npad);
        const float* qd = qc.data() + (si * Nq + r0) * d;
        const float* kd = kp.data() + si * Np * d;
        for (int64_t p = 0; p < P; ++p)  // partial scores s_p of the block's rows against keys 0 … i1-1
          tile_rows(mr, qd + of[p], d, kd + of[p] * kTile, d * kTile, of[p + 1] - of[p], sc.data() + p * mr * npad,
                    kTile, npad, wt, false);
        const float* Ah = A.data() + hq * R * d;
        const float* ch = FC + hq * R;
        const float cz = C0[hq];
        for (int64_t a = 0; a < mr; ++a) {
          const float* sa = sc.data() + a * npad;
          float* kr = kap.data() + a * npad;
          switch (P) {  // the classes' scores in registers; OAL has P = G ≤ 4 groups in practice
            case 1: kappa_row<1>(sa, mr * npad, Ah, d, ch, R, cz, i0 + a, npad, kr); break;
            case 2: kappa_row<2>(sa, mr * npad, Ah, d, ch, R, cz, i0 + a, npad, kr); break;
            case 3: kappa_row<3>(sa, mr * npad, Ah, d, ch, R, cz, i0 + a, npad, kr); break;
            case 4: kappa_row<4>(sa, mr * npad, Ah, d, ch, R, cz, i0 + a, npad, kr); break;
            default: kappa_row<0>(sa, mr * npad, Ah, d, ch, R, cz, i0 + a, npad, kr, P); break;
          }
        }
        tile_rows(mr, kap.data(), npad, up.data() + bh * tiles * Np * kTile, Np * kTile, i1, num.data(), kTile, dvp,
                  tiles, false);
        const float* wd = om.data() + bh * Np;
        for (int64_t a = 0; a < mr; ++a) {
          const int64_t i = i0 + a;
          const float cnt = counts[bh * N + i];
          float dn = dot(kap.data() + a * npad, wd, i + 1);
          if (floored) dn = std::max(dn, cnt * static_cast<float>(kernel_floor));
          DENS[(bh * G + g) * Nq + r0 + a] = dn;
          if (weighted && cnt <= 0.f) dn = 1.f;  // no key with weight > 0 yet: output 0, not 0/0
          T* orow = O + (bq * Nq + r0 + a) * dv;
          for (int64_t c = 0; c < dv; ++c) orow[c] = static_cast<T>(num[a * dvp + c] / dn);
        }
      }
    });
  }
  Tensor final = at::empty({0}, f32);
  if (want_final) {
    const int64_t e = d + 1, P = e / 2 + 1, Dc = e * P, D = 1 + d + d * (d + 1) / 2;
    const int64_t* canon = canonical_rows(canon_of_cyc, Dc);
    final = at::empty({B, Hkv, D, dv + 1}, f32);
    float* FIN = final.data_ptr<float>();
    // doubled [k, 1] per KV head, token-contiguous: yk[r·N + j], r < 2e
    std::vector<float> yk(B * Hkv * 2 * e * N);
    at::parallel_for(0, B * Hkv, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t bh = lo; bh < hi; ++bh) {
        float* y = yk.data() + bh * 2 * e * N;
        const T* ks = K + bh * ksh;
        for (int64_t j = 0; j < N; ++j) {
          for (int64_t r = 0; r < d; ++r) y[r * N + j] = y[(r + e) * N + j] = static_cast<float>(ks[j * d + r]);
          y[d * N + j] = y[(d + e) * N + j] = 1.f;
        }
      }
    });
    const int64_t fb = (Dc + kRows - 1) / kRows;
    at::parallel_for(0, B * Hkv * fb, 1, [&](int64_t lo, int64_t hi) {
      std::vector<float> blk(kRows * N), acc(kRows * dvp);
      for (int64_t task = lo; task < hi; ++task) {
        const int64_t bh = task / fb, f0 = task % fb * kRows, mr = std::min(kRows, Dc - f0);
        const float* y = yk.data() + bh * 2 * e * N;
        const float* wd = om.data() + bh * Np;
        float* fin = FIN + bh * D * (dv + 1);
        v16 zacc[16] = {};  // the features' weighted sums z, reduced together as in forward's update
        float ztail[kRows] = {};
        for (int64_t a = 0; a < mr; ++a) {
          const int64_t f = f0 + a, r = f / P;
          const float *ya = y + r * N, *yb = y + (r + f - r * P) * N;
          float* x = blk.data() + a * N;
          int64_t j = 0;
          for (; j + 16 <= N; j += 16) {
            const v16 p = load16(ya + j) * load16(yb + j);
            store16(x + j, p);
            zacc[a] += p * load16(wd + j);
          }
          for (; j < N; ++j) ztail[a] += (x[j] = ya[j] * yb[j]) * wd[j];
        }
        tile_rows(mr, blk.data(), N, up.data() + bh * tiles * Np * kTile, Np * kTile, N, acc.data(), kTile, dvp,
                  tiles, false);
        const v16 zs = sum_lanes16(zacc);
        for (int64_t a = 0; a < mr; ++a) {  // odd d: a pair listed twice writes its one canonical row twice, alike
          float* row = fin + canon[f0 + a] * (dv + 1);
          for (int64_t c = 0; c < dv; ++c) row[c] = acc[a * dvp + c];
          row[dv] = lane(zs, int(a)) + ztail[a];
        }
      }
    });
  }
  return {o, dens, final};
}

}  // namespace

// q (B, Hq, N, d), k (B, Hkv, N, d), v (B, Hkv, N, dv): contiguous, one dtype among fp32 / bf16 / fp16.
// w (Hkv, G, e, P), fw (Hkv, G, R, d) (scale folded in), fc (Hkv, G, R), c0 (Hkv, G): contiguous fp32.
// state0: (B, Hkv, D, dv+1) fp32 in the canonical layout, or empty; canon_of_cyc (e·P,) int64 its row of each cyclic
// feature (utils.cyclic_maps). key_weight: (B, Hkv, N) fp32, or empty. kernel_floor < 0: no floor.
// Returns [o (q's dtype), dens (B, Hkv, G, N) or empty, final state (canonical rows, as state0) or empty].
std::vector<Tensor> chunk_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& w, const Tensor& fw,
                                  const Tensor& fc, const Tensor& c0, const Tensor& state0,
                                  const Tensor& key_weight, const Tensor& canon_of_cyc, double kernel_floor,
                                  int64_t chunk, bool want_final, bool want_dens) {
  std::vector<Tensor> out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "oal_chunk_forward", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "q: the fused CPU kernel computes in fp32; fp64 inputs use the torch path");
    } else {
      out = forward<scalar_t>(q, k, v, w, fw, fc, c0, state0, key_weight, canon_of_cyc, kernel_floor, chunk,
                              want_final, want_dens);
    }
  });
  return out;
}

// parallel_forward (above) for fp32 / bf16 / fp16 inputs: returns [o, dens, final (B, Hkv, D, dv+1) canonical, or
// empty]
std::vector<Tensor> chunk_parallel_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& fw,
                                           const Tensor& fc, const Tensor& c0, const Tensor& rep,
                                           const Tensor& key_weight, const Tensor& canon_of_cyc, double kernel_floor,
                                           bool want_final) {
  std::vector<Tensor> out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "oal_chunk_parallel_forward", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "q: the fused CPU kernel computes in fp32; fp64 inputs use the torch path");
    } else {
      out = parallel_forward<scalar_t>(q, k, v, fw, fc, c0, rep, key_weight, canon_of_cyc, kernel_floor, want_final);
    }
  });
  return out;
}

// The gradients of chunk_forward's outputs (o, dens, final state) with respect to its inputs, in T = fp32 or fp64:
// every tensor argument contiguous in T (the Python side casts), o and dens those the forward returned (dens
// always, after the floor), d_den and d_final empty when their outputs got no gradient, d_o zeros if o got none.
// Returns [dq, dk, dv, dw (Hkv, G, e·P), dfw, dfc, dc0, dstate0 (cyclic layout) or empty, dkey_weight or empty].
std::vector<Tensor> chunk_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& w,
                                   const Tensor& fw, const Tensor& fc, const Tensor& c0, const Tensor& state0,
                                   const Tensor& key_weight, double kernel_floor, int64_t chunk, const Tensor& o,
                                   const Tensor& dens, const Tensor& d_o, const Tensor& d_den,
                                   const Tensor& d_final, bool want_dstate0, bool want_dkw) {
  for (const Tensor* t : {&k, &v, &w, &fw, &fc, &c0, &o, &dens, &d_o})
    TORCH_CHECK(t->scalar_type() == q.scalar_type() && t->is_contiguous() && t->device().is_cpu(),
                "chunk_backward: expected contiguous CPU tensors of one dtype");
  std::vector<Tensor> out;
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "oal_chunk_backward", [&] {
    out = backward<scalar_t>(q, k, v, w, fw, fc, c0, state0, key_weight, kernel_floor, chunk, o, dens, d_o, d_den,
                             d_final, want_dstate0, want_dkw);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("chunk_parallel_forward", &chunk_parallel_forward, "Parallel-form forward of a fresh segment and its state");
  m.def("chunk_forward", &chunk_forward, "Fused CPU forward of the chunked quadratic-kernel operator");
  m.def("chunk_backward", &chunk_backward, "Reverse chunk scan: gradients of chunk_forward's outputs");
}
