// Fused CPU decode step of one converted attention layer (the in-place path of ../../../kernels/decode.py).
//
// One call per layer and token computes what the torch recurrent paths compute for every KV head of the layer:
//
// * kernel heads (OAL / global, optionally with exact sinks and window; ../recurrent.py, ../../sink_window/):
//   the entering key e (the one leaving the window, or the new key without a window) updates the packed state
//   S += φ_k(k_e) [v_e; 1]ᵀ (Eq. 5) if it belongs to the kernel set, and in the same pass over S each query head
//   g of the group reads num_g = φ_q(q_g) S (Eq. 6); S is read once per KV head, for all its query heads, and
//   updated in place. den = max(num[dv], floor · count). With sinks / window, the exact keys join in one
//   normalisation with the kernel part's log-mass β + log den (../../sink_window/utils.py, combine), then the
//   window slides by one (oldest first) and the sinks take the new key while t < n_sink.
// * exact heads (../../../kernels/hybrid.py): the new key/value is written at slot t of the head's buffer and
//   each query head of the group attends, softmax, over keys 0 … t (the buffer is read once per KV head).
//
// Packed layout of φ: [1, x_1 … x_d, x_r x_t for r ≤ t row-major], the layout of utils.key_features.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using at::Tensor;

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float* y, float a, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

struct KernelHeadArgs {
  const float* q;     // (G, d): the group's queries
  const float* k;     // (d,) new key
  const float* v;     // (dv,) new value
  float* S;           // (D, dv+1)
  const float* wq;    // (G, D)
  const float* beta;  // (G,)
  float* sink_k;      // (n_sink, d)
  float* sink_v;      // (n_sink, dv)
  float* win_k;       // (w, d), oldest first
  float* win_v;       // (w, dv)
  float* out;         // (G, dv)
};

void kernel_head(const KernelHeadArgs& a, int64_t G, int64_t d, int64_t dv, int64_t t, int64_t n_sink, int64_t w,
                 float scale, float floor, bool exact_part) {
  const int64_t dv1 = dv + 1;
  // the key entering the kernel set at this step: the one leaving the window, or the new key without a window
  const float* ke = w > 0 ? a.win_k : a.k;
  const float* ve = w > 0 ? a.win_v : a.v;
  const bool enter = t - w >= n_sink;
  std::vector<float> u(dv1, 0.f), acc(G * dv1, 0.f), ke_copy(ke, ke + d);
  if (enter) {
    std::copy(ve, ve + dv, u.begin());
    u[dv] = 1.f;
  }
  const float* kk = ke_copy.data();
  // one pass over the rows of S: update with the entering key, then read out for every query head
  auto row = [&](int64_t r, float fk, const float* fq_of_g) {
    float* s = a.S + r * dv1;
    if (enter) axpy(s, fk, u.data(), dv1);
    for (int64_t g = 0; g < G; ++g) axpy(acc.data() + g * dv1, fq_of_g[g] * a.wq[g * (1 + d + d * (d + 1) / 2) + r], s, dv1);
  };
  std::vector<float> fq(G);
  for (int64_t g = 0; g < G; ++g) fq[g] = 1.f;
  row(0, 1.f, fq.data());
  for (int64_t i = 0; i < d; ++i) {
    for (int64_t g = 0; g < G; ++g) fq[g] = a.q[g * d + i];
    row(1 + i, kk[i], fq.data());
  }
  int64_t r = 1 + d;
  for (int64_t i = 0; i < d; ++i) {
    for (int64_t j = i; j < d; ++j, ++r) {
      for (int64_t g = 0; g < G; ++g) fq[g] = a.q[g * d + i] * a.q[g * d + j];
      row(r, kk[i] * kk[j], fq.data());
    }
  }
  const float count = a.S[dv];  // H0's last column: keys in the kernel set so far

  if (!exact_part) {
    for (int64_t g = 0; g < G; ++g) {
      const float* num = acc.data() + g * dv1;
      const float den = std::max(num[dv], floor * count);
      for (int64_t c = 0; c < dv; ++c) a.out[g * dv + c] = num[c] / den;
    }
    return;
  }
  // slide the window (its oldest entry has entered the state above) and fill the sinks
  if (w > 0) {
    std::memmove(a.win_k, a.win_k + d, sizeof(float) * (w - 1) * d);
    std::memmove(a.win_v, a.win_v + dv, sizeof(float) * (w - 1) * dv);
    std::memcpy(a.win_k + (w - 1) * d, a.k, sizeof(float) * d);
    std::memcpy(a.win_v + (w - 1) * dv, a.v, sizeof(float) * dv);
  }
  if (t < n_sink) {
    std::memcpy(a.sink_k + t * d, a.k, sizeof(float) * d);
    std::memcpy(a.sink_v + t * dv, a.v, sizeof(float) * dv);
  }
  // exact set: sinks j ≤ t, and window slots s holding positions p = t - w + 1 + s with p ≥ n_sink
  const int64_t ns = std::min(n_sink, t + 1);
  const int64_t s0 = std::max<int64_t>(0, n_sink - (t - w + 1));
  const int64_t L = ns + std::max<int64_t>(0, w - s0);
  std::vector<const float*> keys(L), vals(L);
  for (int64_t j = 0; j < ns; ++j) keys[j] = a.sink_k + j * d, vals[j] = a.sink_v + j * dv;
  for (int64_t s = s0; s < w; ++s) keys[ns + s - s0] = a.win_k + s * d, vals[ns + s - s0] = a.win_v + s * dv;
  std::vector<float> p(L);
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = a.q + g * d;
    const float* num = acc.data() + g * dv1;
    const float den = std::max(num[dv], floor * count);
    const float log_mass =
        count > 0.f ? a.beta[g] + std::log(den) : -std::numeric_limits<float>::infinity();
    float M = log_mass;
    for (int64_t j = 0; j < L; ++j) {
      p[j] = dot(qg, keys[j], d) * scale;
      M = std::max(M, p[j]);
    }
    float total = 0.f;
    float* o = a.out + g * dv;
    std::fill(o, o + dv, 0.f);
    for (int64_t j = 0; j < L; ++j) {
      const float e = std::exp(p[j] - M);
      total += e;
      axpy(o, e, vals[j], dv);
    }
    const float ks = count > 0.f ? std::exp(log_mass - M) : 0.f;
    total += ks;
    const float inv = 1.f / total, kern = count > 0.f ? ks / den : 0.f;  // an empty kernel set adds nothing
    for (int64_t c = 0; c < dv; ++c) o[c] = (o[c] + kern * num[c]) * inv;
  }
}

// softmax of the G queries over keys 0 … t of one exact head (the new key already written at slot t)
void exact_head(const float* q, const float* K, const float* V, float* out, int64_t G, int64_t d, int64_t dv,
                int64_t t, float scale) {
  const int64_t n = t + 1;
  std::vector<float> logit(G * n), M(G, -std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < n; ++j) {
    const float* kj = K + j * d;
    for (int64_t g = 0; g < G; ++g) {
      const float s = dot(q + g * d, kj, d) * scale;
      logit[g * n + j] = s;
      M[g] = std::max(M[g], s);
    }
  }
  std::vector<float> total(G, 0.f);
  std::fill(out, out + G * dv, 0.f);
  for (int64_t j = 0; j < n; ++j) {
    const float* vj = V + j * dv;
    for (int64_t g = 0; g < G; ++g) {
      const float e = std::exp(logit[g * n + j] - M[g]);
      total[g] += e;
      axpy(out + g * dv, e, vj, dv);
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < dv; ++c) out[g * dv + c] /= total[g];
}

void check_f32(const Tensor& x, const char* name, int64_t dim) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.is_contiguous() && x.dim() == dim,
              name, ": expected a contiguous CPU float32 tensor with ", dim, " dimensions");
}

// q (B, Hq, d), k (B, Hkv, d), v (B, Hkv, dv), out (B, Hq, dv) written.
// exact_heads (E,) int64 with ex_k (B, E, cap, d), ex_v (B, E, cap, dv), cap > t (slot t is written).
// kern_heads (K,) int64 with S (B, K, D, dv+1), wq (K·G, D), beta (K·G,), sink_k/v (B, K, n_sink, ·),
// win_k/v (B, K, w, ·). exact_part: whether the kernel heads have sinks / a window (else plain kernel).
void decode_step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, const Tensor& exact_heads,
                 Tensor& ex_k, Tensor& ex_v, const Tensor& kern_heads, Tensor& S, const Tensor& wq,
                 const Tensor& beta, Tensor& sink_k, Tensor& sink_v, Tensor& win_k, Tensor& win_v, int64_t t,
                 int64_t n_sink, int64_t w, double scale, double floor, bool exact_part) {
  check_f32(q, "q", 3);
  check_f32(k, "k", 3);
  check_f32(v, "v", 3);
  check_f32(out, "out", 3);
  const int64_t B = q.size(0), Hq = q.size(1), d = q.size(2), Hkv = k.size(1), dv = v.size(2);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "q, k: query heads must be a multiple of the KV heads");
  const int64_t G = Hq / Hkv, D = 1 + d + d * (d + 1) / 2;
  const int64_t E = exact_heads.numel(), K = kern_heads.numel();
  TORCH_CHECK(E + K == Hkv, "exact_heads, kern_heads: expected a partition of the ", Hkv, " KV heads");
  const int64_t* eh = exact_heads.data_ptr<int64_t>();
  const int64_t* kh = kern_heads.data_ptr<int64_t>();
  int64_t cap = 0;
  if (E) {
    check_f32(ex_k, "ex_k", 4);
    check_f32(ex_v, "ex_v", 4);
    cap = ex_k.size(2);
    TORCH_CHECK(cap > t && ex_v.size(2) == cap, "ex_k, ex_v: expected a capacity above t=", t);
  }
  if (K) {
    check_f32(S, "S", 4);
    check_f32(wq, "wq", 2);
    check_f32(beta, "beta", 1);
    TORCH_CHECK(S.size(2) == D && S.size(3) == dv + 1 && wq.size(0) == K * G && wq.size(1) == D,
                "S, wq: shapes do not match the heads");
    if (exact_part) {
      check_f32(sink_k, "sink_k", 4);
      check_f32(sink_v, "sink_v", 4);
      check_f32(win_k, "win_k", 4);
      check_f32(win_v, "win_v", 4);
      TORCH_CHECK(sink_k.size(2) == n_sink && win_k.size(2) == w, "sink_k, win_k: sizes differ from n_sink, w");
    }
  }
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, i = task % Hkv;
      if (i < E) {
        const int64_t h = eh[i];
        float* K_ = ex_k.data_ptr<float>() + (b * E + i) * cap * d;
        float* V_ = ex_v.data_ptr<float>() + (b * E + i) * cap * dv;
        std::memcpy(K_ + t * d, kp + (b * Hkv + h) * d, sizeof(float) * d);
        std::memcpy(V_ + t * dv, vp + (b * Hkv + h) * dv, sizeof(float) * dv);
        exact_head(qp + (b * Hq + h * G) * d, K_, V_, op + (b * Hq + h * G) * dv, G, d, dv, t, float(scale));
      } else {
        const int64_t j = i - E, h = kh[j];
        const int64_t bj = b * K + j;
        KernelHeadArgs a{qp + (b * Hq + h * G) * d,
                         kp + (b * Hkv + h) * d,
                         vp + (b * Hkv + h) * dv,
                         S.data_ptr<float>() + bj * D * (dv + 1),
                         wq.data_ptr<float>() + j * G * D,
                         beta.data_ptr<float>() + j * G,
                         exact_part ? sink_k.data_ptr<float>() + bj * n_sink * d : nullptr,
                         exact_part ? sink_v.data_ptr<float>() + bj * n_sink * dv : nullptr,
                         exact_part ? win_k.data_ptr<float>() + bj * w * d : nullptr,
                         exact_part ? win_v.data_ptr<float>() + bj * w * dv : nullptr,
                         op + (b * Hq + h * G) * dv};
        kernel_head(a, G, d, dv, t, exact_part ? n_sink : 0, exact_part ? w : 0, float(scale), float(floor),
                    exact_part);
      }
    }
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_step", &decode_step, "Fused CPU decode step of one converted attention layer (in place)");
}
