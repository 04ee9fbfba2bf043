// Fused CPU forward of the chunked quadratic-kernel operator (the no-autograd path of ../chunk.py).
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
// need φ_q and φ_k written out (G·n·D and n·D floats per chunk) and packed again, and on the AMD CPU we
// measure on, MKL's sgemm reaches 60-70 % of the FMA peak (benchmarks/cpu_peak.py). Here one register-tiled
// kernel (6 rows x 16 columns of accumulators, tile_kernel) runs every product on features generated block by
// block into L1, and each thread owns a contiguous range of features: it keeps its slice of the state (stored as
// 16-column panels) in its own cache, reads it out and updates it, so only the per-thread partial outputs cross
// threads. The intra-chunk scores use the same kernel and skip the key columns that the causal mask zeroes.
#include <torch/extension.h>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace {

using at::Tensor;

// eight floats; aligned(4) makes loads and stores through it unaligned ones, may_alias lets it read float arrays
typedef float vec8 __attribute__((vector_size(32), aligned(4), __may_alias__));

constexpr int64_t kTile = 16;    // output columns of one kernel pass: two vec8
constexpr int64_t kRows = 6;     // output rows of one pass: 12 accumulators + 2 panel vectors fit 16 registers
constexpr int64_t kBlock = 256;  // features per readout block: 6 x 256 generated floats stay in L1

// c[i, 0:16] += Σ_k a[i·lda + k] · b[k, 0:16] for i < MR, b a contiguous (kdim, 16) panel
template <int MR>
inline void tile_kernel(const float* a, int64_t lda, const float* b, int64_t kdim, float* c, int64_t ldc) {
  vec8 acc0[MR], acc1[MR];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) {
    acc0[i] = *reinterpret_cast<const vec8*>(c + i * ldc);
    acc1[i] = *reinterpret_cast<const vec8*>(c + i * ldc + 8);
  }
  for (int64_t k = 0; k < kdim; ++k) {
    const vec8 b0 = *reinterpret_cast<const vec8*>(b + k * kTile);
    const vec8 b1 = *reinterpret_cast<const vec8*>(b + k * kTile + 8);
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      const float s = a[i * lda + k];
      acc0[i] += s * b0;
      acc1[i] += s * b1;
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) {
    *reinterpret_cast<vec8*>(c + i * ldc) = acc0[i];
    *reinterpret_cast<vec8*>(c + i * ldc + 8) = acc1[i];
  }
}

inline void tile_rows(int64_t rows, const float* a, int64_t lda, const float* b, int64_t kdim, float* c,
                      int64_t ldc) {
  switch (rows) {
    case 6: tile_kernel<6>(a, lda, b, kdim, c, ldc); break;
    case 5: tile_kernel<5>(a, lda, b, kdim, c, ldc); break;
    case 4: tile_kernel<4>(a, lda, b, kdim, c, ldc); break;
    case 3: tile_kernel<3>(a, lda, b, kdim, c, ldc); break;
    case 2: tile_kernel<2>(a, lda, b, kdim, c, ldc); break;
    default: tile_kernel<1>(a, lda, b, kdim, c, ldc); break;
  }
}

// Σ_t a[t] · b[t], vectorised (a plain float reduction is not, without reassociation)
inline float dot(const float* a, const float* b, int64_t n) {
  vec8 acc0 = {}, acc1 = {};
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) {
    acc0 += *reinterpret_cast<const vec8*>(a + t) * *reinterpret_cast<const vec8*>(b + t);
    acc1 += *reinterpret_cast<const vec8*>(a + t + 8) * *reinterpret_cast<const vec8*>(b + t + 8);
  }
  acc0 += acc1;
  float total = 0.f;
  for (int l = 0; l < 8; ++l) total += acc0[l];
  for (; t < n; ++t) total += a[t] * b[t];
  return total;
}

// weighted query features f ∈ [fa, fb) of one row: out[f - fa] = w[f] · y[r] · y[r + δ], y the doubled [x, 1]
inline void query_features(const float* y, const float* w, int64_t P, int64_t fa, int64_t fb, float* out) {
  for (int64_t f = fa; f < fb;) {
    const int64_t r = f / P, delta = f - r * P, len = std::min(P - delta, fb - f);
    const float yr = y[r];
    const float* ys = y + r + delta;
    const float* wf = w + f;
    float* dst = out + (f - fa);
    for (int64_t t = 0; t < len; ++t) dst[t] = yr * ys[t] * wf[t];
    f += len;
  }
}

template <typename T>
std::vector<Tensor> forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& w, const Tensor& fw,
                            const Tensor& fc, const Tensor& c0, const Tensor& state0, const Tensor& key_weight,
                            double kernel_floor, int64_t chunk, bool want_final, bool want_dens) {
  const int64_t B = q.size(0), Hq = q.size(1), N = q.size(2), d = q.size(3);
  const int64_t Hkv = k.size(1), dv = v.size(3), G = Hq / Hkv, e = d + 1, e2 = 2 * e, P = e / 2 + 1, Dc = e * P;
  const int64_t R = fc.size(2), cs = std::min(chunk, N), one_row = d * P;
  const int64_t tiles = (dv + kTile - 1) / kTile, dvp = tiles * kTile;  // value columns padded to whole panels
  // one feature range per thread, each at least four 6-feature update blocks long
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), Dc / (4 * kRows)));
  const auto f32 = q.options().dtype(at::kFloat);

  Tensor o = at::empty({B, Hq, N, dv}, q.options());
  Tensor dens = want_dens ? at::empty({B, Hkv, G, N}, f32) : at::empty({0}, f32);
  Tensor finals = want_final ? at::empty({B, Hkv, Dc, dv + 1}, f32) : at::empty({0}, f32);
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
  std::vector<float> ones(cs, 1.f), counts(cs);

  for (int64_t bh = 0; bh < B * Hkv; ++bh) {
    const int64_t bi = bh / Hkv, h = bh % Hkv;
    if (state0.numel()) {
      const float* s0 = state0.data_ptr<float>() + bh * Dc * (dv + 1);
      for (int64_t f = 0; f < Dc; ++f) {
        for (int64_t c = 0; c < dvp; ++c)
          S[(c / kTile * Dc + f) * kTile + c % kTile] = c < dv ? s0[f * (dv + 1) + c] : 0.f;
        Z[f] = s0[f * (dv + 1) + dv];
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
      // intra-chunk part six rows at a time: z_m = [scale·W_m ⊙ q_i, c_m] · [k_j, 1] through the tile kernel, only
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
            std::fill(zb, zb + mr * np, 0.f);
            for (int64_t t = 0; t < wt; ++t) tile_rows(mr, qwb, e, ykp + t * e * kTile, e, zb + t * kTile, np);
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
          float* nr = num + r0 * dvp;
          std::fill(nr, nr + mr * dvp, 0.f);
          for (int64_t t = 0; t < tiles; ++t)
            tile_rows(mr, kb, np, ut + t * n * kTile, width, nr + t * kTile, dvp);
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
          for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
            const int64_t mr = std::min(kRows, rows - r0);
            for (int64_t f0 = fa; f0 < fb; f0 += kBlock) {
              const int64_t kb = std::min(kBlock, fb - f0);
              for (int64_t i = 0; i < mr; ++i) {
                float* a = blk + i * kb;
                query_features(yq + (r0 + i) * e2, wh + (r0 + i) / n * Dc, P, f0, f0 + kb, a);
                dpart[r0 + i] += dot(a, Z + f0, kb);
              }
              for (int64_t t = 0; t < tiles; ++t)
                tile_rows(mr, blk, kb, S + (t * Dc + f0) * kTile, kb, part + r0 * dvp + t * kTile, dvp);
            }
          }
          for (int64_t f0 = fa; f0 < fb; f0 += kRows) {
            const int64_t mr = std::min(kRows, fb - f0);
            for (int64_t i = 0; i < mr; ++i) {
              const int64_t f = f0 + i, r = f / P;
              const float *ya = ykt + r * n, *yb = ykt + (r + f - r * P) * n;
              float* a = blk + i * n;
              for (int64_t j = 0; j < n; ++j) a[j] = ya[j] * yb[j];
              Z[f] += dot(a, wk, n);
            }
            for (int64_t t = 0; t < tiles; ++t)
              tile_rows(mr, blk, n, ut + t * n * kTile, n, S + (t * Dc + f0) * kTile, kTile);
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
      float* fin = finals.data_ptr<float>() + bh * Dc * (dv + 1);
      for (int64_t f = 0; f < Dc; ++f) {
        for (int64_t c = 0; c < dv; ++c) fin[f * (dv + 1) + c] = S[(c / kTile * Dc + f) * kTile + c % kTile];
        fin[f * (dv + 1) + dv] = Z[f];
      }
    }
  }
  return {o, dens, finals};
}

}  // namespace

// q (B, Hq, N, d), k (B, Hkv, N, d), v (B, Hkv, N, dv): contiguous, one dtype among fp32 / bf16 / fp16.
// w (Hkv, G, e, P), fw (Hkv, G, R, d) (scale folded in), fc (Hkv, G, R), c0 (Hkv, G): contiguous fp32.
// state0: (B, Hkv, e·P, dv+1) fp32 in the cyclic layout, or empty. key_weight: (B, Hkv, N) fp32, or empty.
// kernel_floor < 0: no floor.
// Returns [o (q's dtype), dens (B, Hkv, G, N) or empty, final state (cyclic layout) or empty].
std::vector<Tensor> chunk_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& w, const Tensor& fw,
                                  const Tensor& fc, const Tensor& c0, const Tensor& state0,
                                  const Tensor& key_weight, double kernel_floor, int64_t chunk, bool want_final,
                                  bool want_dens) {
  std::vector<Tensor> out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "oal_chunk_forward", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "q: the fused CPU kernel computes in fp32; fp64 inputs use the torch path");
    } else {
      out = forward<scalar_t>(q, k, v, w, fw, fc, c0, state0, key_weight, kernel_floor, chunk, want_final,
                              want_dens);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("chunk_forward", &chunk_forward, "Fused CPU forward of the chunked quadratic-kernel operator");
}
