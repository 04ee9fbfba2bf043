// Fused CPU forward of the chunked quadratic-kernel operator (the no-autograd path of ../chunk.py).
//
// Same arithmetic as _forward_no_grad with a KernelFactor: per (batch, KV head) and chunk of n tokens
//   num  = kern @ [v, 1]  +  φ_q(Q) @ S          (exact within-chunk part + inter-chunk readout, Eq. 6)
//   S   += φ_k(K)ᵀ @ [v, 1]                      (state update, Eq. 5)
//   o    = num[:, :dv] / max(num[:, dv], floor · count)
// with φ in the cyclic layout of utils.cyclic_maps (feature r·P + δ = x'_r · x'_{(r+δ) mod e}, x' = [x, 1]) and
// kern[i, j] = c0 + Σ_m (c_m + scale·(q_i ⊙ W_m)·k_j)² for j ≤ i (Eq. 7). The two state GEMMs and the score GEMM
// run in the BLAS; what torch ops would do in several passes over memory (features, query weights, squares,
// causal mask, normalisation) is one loop each here, reading the inputs in their own dtype.
#include <torch/extension.h>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace {

using at::Tensor;

// x' = [x, 1] twice in a row, so that x'_{(r+δ) mod e} = y[r + δ] with no modulo
template <typename T>
inline void doubled(const T* x, int64_t d, float* y) {
  const int64_t e = d + 1;
  for (int64_t r = 0; r < d; ++r) {
    const float value = static_cast<float>(x[r]);
    y[r] = value;
    y[r + e] = value;
  }
  y[d] = 1.f;
  y[d + e] = 1.f;
}

template <typename T>
std::vector<Tensor> forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& w, const Tensor& fw,
                            const Tensor& fc, const Tensor& c0, const Tensor& state0, double kernel_floor,
                            int64_t chunk, bool want_final, bool want_dens) {
  const int64_t B = q.size(0), Hq = q.size(1), N = q.size(2), d = q.size(3);
  const int64_t Hkv = k.size(1), dv = v.size(3), G = Hq / Hkv, e = d + 1, P = e / 2 + 1, Dc = e * P;
  const int64_t R = fc.size(2), dv1 = dv + 1, cs = std::min(chunk, N), one_row = d * P;
  const auto f32 = q.options().dtype(at::kFloat);

  Tensor o = at::empty({B, Hq, N, dv}, q.options());
  Tensor dens = want_dens ? at::empty({B, Hkv, G, N}, f32) : at::empty({0}, f32);
  Tensor finals = want_final ? at::empty({B, Hkv, Dc, dv1}, f32) : at::empty({0}, f32);
  Tensor pq_t = at::empty({G * cs * Dc}, f32), pk_t = at::empty({cs * Dc}, f32), u_t = at::empty({cs * dv1}, f32);
  Tensor num_t = at::empty({G * cs * dv1}, f32), kern_t = at::empty({G * cs * cs}, f32);
  Tensor qw_t = at::empty({G * R * cs * e}, f32), k1_t = at::empty({e * cs}, f32), z_t = at::empty({G * R * cs * cs}, f32);
  float *pq = pq_t.data_ptr<float>(), *pk = pk_t.data_ptr<float>(), *u = u_t.data_ptr<float>();
  float *num = num_t.data_ptr<float>(), *kern = kern_t.data_ptr<float>(), *qw = qw_t.data_ptr<float>();
  float *k1 = k1_t.data_ptr<float>(), *z = z_t.data_ptr<float>();
  const float *W = w.data_ptr<float>(), *FW = fw.data_ptr<float>(), *FC = fc.data_ptr<float>();
  const float* C0 = c0.data_ptr<float>();
  const T *Q = q.data_ptr<T>(), *K = k.data_ptr<T>(), *V = v.data_ptr<T>();
  T* O = o.data_ptr<T>();
  float* DENS = want_dens ? dens.data_ptr<float>() : nullptr;
  const bool floored = kernel_floor >= 0;

  for (int64_t bh = 0; bh < B * Hkv; ++bh) {
    const int64_t bi = bh / Hkv, h = bh % Hkv;
    Tensor state = state0.numel() ? state0[bi][h].clone() : at::zeros({Dc, dv1}, f32);
    const double seen = state[one_row][dv].item<double>();  // keys before this segment (H0's count column)
    const T* qh = Q + (bi * Hq + h * G) * N * d;
    const T* kh = K + bh * N * d;
    const T* vh = V + bh * N * dv;
    T* oh = O + (bi * Hq + h * G) * N * dv;
    const float* wh = W + h * G * e * P;
    const float* fwh = FW + h * G * R * d;
    const float* fch = FC + h * G * R;
    const float* c0h = C0 + h * G;
    float* dh = want_dens ? DENS + bh * G * N : nullptr;

    for (int64_t start = 0; start < N; start += cs) {
      const int64_t n = std::min(cs, N - start);
      // query features with the query weights applied, rows (g, i)
      at::parallel_for(0, G * n, 8, [&](int64_t lo, int64_t hi) {
        std::vector<float> y(2 * e);
        for (int64_t row = lo; row < hi; ++row) {
          const int64_t g = row / n, i = row % n;
          doubled(qh + (g * N + start + i) * d, d, y.data());
          const float* wg = wh + g * e * P;
          float* out = pq + row * Dc;
          for (int64_t r = 0; r < e; ++r) {
            const float yr = y[r];
            const float* ys = y.data() + r;
            const float* wr = wg + r * P;
            float* dst = out + r * P;
            for (int64_t t = 0; t < P; ++t) dst[t] = yr * ys[t] * wr[t];
          }
        }
      });
      // key features, u = [v, 1] and [k, 1]ᵀ
      at::parallel_for(0, n, 8, [&](int64_t lo, int64_t hi) {
        std::vector<float> y(2 * e);
        for (int64_t j = lo; j < hi; ++j) {
          doubled(kh + (start + j) * d, d, y.data());
          float* out = pk + j * Dc;
          for (int64_t r = 0; r < e; ++r) {
            const float yr = y[r];
            const float* ys = y.data() + r;
            float* dst = out + r * P;
            for (int64_t t = 0; t < P; ++t) dst[t] = yr * ys[t];
          }
          const T* vx = vh + (start + j) * dv;
          for (int64_t c = 0; c < dv; ++c) u[j * dv1 + c] = static_cast<float>(vx[c]);
          u[j * dv1 + dv] = 1.f;
          for (int64_t r = 0; r < e; ++r) k1[r * n + j] = y[r];
        }
      });
      // rows (g, m, i) of [scale·W_m ⊙ q_i, c_m]: their product with [k, 1]ᵀ is the m-th square's base (Eq. 7)
      at::parallel_for(0, G * R * n, 32, [&](int64_t lo, int64_t hi) {
        for (int64_t row = lo; row < hi; ++row) {
          const int64_t gm = row / n, i = row % n, g = gm / R;
          const T* x = qh + (g * N + start + i) * d;
          const float* f = fwh + gm * d;
          float* out = qw + row * e;
          for (int64_t r = 0; r < d; ++r) out[r] = static_cast<float>(x[r]) * f[r];
          out[d] = fch[gm];
        }
      });
      Tensor zv = at::from_blob(z, {G * R * n, n}, f32);
      at::mm_out(zv, at::from_blob(qw, {G * R * n, e}, f32), at::from_blob(k1, {e, n}, f32));
      at::parallel_for(0, G * n, 8, [&](int64_t lo, int64_t hi) {
        for (int64_t row = lo; row < hi; ++row) {
          const int64_t g = row / n, i = row % n;
          float* kr = kern + row * n;
          std::fill(kr, kr + n, 0.f);
          for (int64_t m = 0; m < R; ++m) {
            const float* zr = z + ((g * R + m) * n + i) * n;
            for (int64_t j = 0; j <= i; ++j) kr[j] += zr[j] * zr[j];
          }
          const float c = c0h[g];
          for (int64_t j = 0; j <= i; ++j) kr[j] += c;
        }
      });
      Tensor numv = at::from_blob(num, {G * n, dv1}, f32);
      Tensor uv = at::from_blob(u, {n, dv1}, f32);
      at::mm_out(numv, at::from_blob(kern, {G * n, n}, f32), uv);
      numv.addmm_(at::from_blob(pq, {G * n, Dc}, f32), state);
      state.addmm_(at::from_blob(pk, {n, Dc}, f32).t(), uv);

      for (int64_t row = 0; row < G * n; ++row) {
        const int64_t g = row / n, i = row % n;
        const float* nr = num + row * dv1;
        float den = nr[dv];
        if (floored) den = std::max(den, static_cast<float>((seen + start + i + 1) * kernel_floor));
        if (dh) dh[g * N + start + i] = den;
        T* orow = oh + (g * N + start + i) * dv;
        for (int64_t c = 0; c < dv; ++c) orow[c] = static_cast<T>(nr[c] / den);
      }
    }
    if (want_final) finals[bi][h].copy_(state);
  }
  return {o, dens, finals};
}

}  // namespace

// q (B, Hq, N, d), k (B, Hkv, N, d), v (B, Hkv, N, dv): contiguous, one dtype among fp32 / bf16 / fp16.
// w (Hkv, G, e, P), fw (Hkv, G, R, d) (scale folded in), fc (Hkv, G, R), c0 (Hkv, G): contiguous fp32.
// state0: (B, Hkv, e·P, dv+1) fp32 in the cyclic layout, or empty. kernel_floor < 0: no floor.
// Returns [o (q's dtype), dens (B, Hkv, G, N) or empty, final state (cyclic layout) or empty].
std::vector<Tensor> chunk_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& w, const Tensor& fw,
                                  const Tensor& fc, const Tensor& c0, const Tensor& state0, double kernel_floor,
                                  int64_t chunk, bool want_final, bool want_dens) {
  std::vector<Tensor> out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "oal_chunk_forward", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "q: the fused CPU kernel computes in fp32; fp64 inputs use the torch path");
    } else {
      out = forward<scalar_t>(q, k, v, w, fw, fc, c0, state0, kernel_floor, chunk, want_final, want_dens);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("chunk_forward", &chunk_forward, "Fused CPU forward of the chunked quadratic-kernel operator");
}
