// Fused CPU decode step of one converted attention layer (the in-place path of ../../../kernels/decode.py).
//
// One call per layer and token computes what the torch recurrent paths compute for every KV head of the layer:
//
// * kernel heads (OAL / global, optionally with exact sinks and window; ../recurrent.py, ../../sink_window/):
//   the entering key e (the one leaving the window, or the new key without a window) updates the packed state
//   S += φ_k(k_e) [v_e; 1]ᵀ (Eq. 5) if it belongs to the kernel set, and in the same pass over S each query head
//   g of the group reads num_g = φ_q(q_g) S (Eq. 6); S is read once per KV head, for all its query heads, and
//   updated in place. The pass is a (G × D)·(D × dv+1) product with its accumulators in registers (a decode
//   step is bound by reading S from memory); when the batch has fewer KV heads than 2 × threads, each state is
//   split into row ranges run as separate tasks (split-D) and their partial sums added before the rest.
//   den = max(num[dv], floor · count). With sinks / window, the exact keys join in one normalisation with the
//   kernel part's log-mass β + log den (../../sink_window/utils.py, combine), then the window slides by one
//   (oldest first) and the sinks take the new key while t < n_sink.
// * exact heads (../../../kernels/hybrid.py): the new key/value is written at slot t of the head's buffer and
//   each query head of the group attends, softmax, over keys 0 … t (the buffer is read once per KV head), in
//   parts of EXACT_BLOCK keys run as separate tasks and combined by their maxima (split-K, as flash-decoding).
//   Stored in fp32, bf16, or int8 with one fp32 scale per token and head (the 8-bit exact cache: the new key is
//   quantised here as hybrid.py's quantize_int8 does, bit for bit; the integers are widened in registers and the
//   scales folded into the scores and the weights, as hybrid.py's bf16_product_attention(round_kv=False) defines
//   them with bf16 products).
//   With a decode budget (../../page_select/naive.py, Quest-style) each exact head also keeps per page of `page`
//   keys the bf16 element-wise minimum and maximum of its keys, updated here with the new key; a step over more
//   pages than the budget's ranks the pages by the score bounds they give the group's queries and attends, in one
//   task per head, to page 0, the recent pages and the best others only (runs of consecutive keys combined as the
//   split-K parts are).
//
// * kept kernel heads (../../../kernels/kept.py: below the memory crossover the cache keeps a kernel head's keys and
//   values instead of its state): the new key/value is written at slot t, and the kernel part is evaluated from the
//   kept keys through the kernel's factor, κ_g(k) = c0 + Σ_m (c_m + scale Σ_r W_mr q_gr k_r)² (Eq. 7 as a sum of
//   squares), in blocks of KEPT_BLOCK keys run as separate tasks whose sums add up (split-K); the sinks and the
//   window are softmax parts over the same kept keys, joined as above.
//
// Packed layout of φ: [1, x_1 … x_d, x_r x_t for r ≤ t row-major], the layout of utils.key_features.
#include <torch/extension.h>

#if defined(__AVX512F__)
#include <immintrin.h>  // common.h's row maximum
#endif

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using at::Tensor;

// keys of an exact head per task: an 8k head splits into 4 tasks (split-K, combined after), so the two threads
// share one layer's few long heads instead of one thread reading them all
constexpr int64_t EXACT_BLOCK = 2048;
// kept keys of a kernel head per task (below the crossover, ≤ ~1.3k keys): a 1k head splits into 4 tasks whose sums
// add up, so that batch 1's three heads keep both threads busy
constexpr int64_t KEPT_BLOCK = 256;
// pages a budgeted step always attends besides page 0: the new key's and the one before (page_select.RECENT_PAGES)
constexpr int64_t RECENT_PAGES = 2;

#include "common.h"

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

// Rows [r0, r1) of the packed state's layout φ = [1, x_1 … x_d, x_i x_l (i ≤ l) row-major]: row r's monomial of
// x is φ_r(x). The row → (i, l) table has -1 for "no factor".
struct RowTable {
  std::vector<int32_t> i, l;
  explicit RowTable(int64_t d) : i(1 + d + d * (d + 1) / 2, -1), l(i.size(), -1) {
    int64_t r = 1;
    for (int64_t a = 0; a < d; ++a, ++r) i[r] = int32_t(a);
    for (int64_t a = 0; a < d; ++a)
      for (int64_t b = a; b < d; ++b, ++r) i[r] = int32_t(a), l[r] = int32_t(b);
  }
  float monomial(const float* x, int64_t r) const {
    return (i[r] < 0 ? 1.f : x[i[r]]) * (l[r] < 0 ? 1.f : x[l[r]]);
  }
};

// acc (G, dv1) += Σ_{r ∈ [r0, r1)} c[g][r] S[r] for the G (≤ 4) query heads, after S[r] += Σ_j F[j][r] U[j] for
// the n keys folded in. The readout is a (G × rows) · (rows × dv1) product whose accumulators stay in registers:
// each row of S is loaded once (and stored once if keys fold in). NC = dv1 / 16 full vectors, the rest scalar.
template <int G, int NC>
void rows_pass(float* S, int64_t dv1, int64_t r0, int64_t r1, const float* c, int64_t D, const float* F,
               const float* U, int64_t n, float* acc) {
  v16 av[G][NC > 0 ? NC : 1];
  for (int g = 0; g < G; ++g)
    for (int ch = 0; ch < NC; ++ch) av[g][ch] = v16{};
  const int64_t tail0 = int64_t(NC) * 16;
  float at[G][16] = {};
  for (int64_t r = r0; r < r1; ++r) {
    float* s = S + r * dv1;
    for (int64_t j = 0; j < n; ++j) {
      const float fj = F[j * D + r];
      const float* uj = U + j * dv1;
      for (int ch = 0; ch < NC; ++ch) store16(s + ch * 16, load16(s + ch * 16) + fj * load16(uj + ch * 16));
      for (int64_t e = tail0; e < dv1; ++e) s[e] += fj * uj[e];
    }
    v16 x[NC > 0 ? NC : 1];
    for (int ch = 0; ch < NC; ++ch) x[ch] = load16(s + ch * 16);
    for (int g = 0; g < G; ++g) {
      const float cg = c[g * D + r];
      for (int ch = 0; ch < NC; ++ch) av[g][ch] += cg * x[ch];
      for (int64_t e = tail0; e < dv1; ++e) at[g][e - tail0] += cg * s[e];
    }
  }
  for (int g = 0; g < G; ++g) {
    float* ag = acc + g * dv1;
    for (int ch = 0; ch < NC; ++ch) store16(ag + ch * 16, load16(ag + ch * 16) + av[g][ch]);
    for (int64_t e = tail0; e < dv1; ++e) ag[e] += at[g][e - tail0];
  }
}

// the same for any G and dv1, accumulating in memory (shapes the templates do not cover)
void rows_pass_any(float* S, int64_t dv1, int64_t r0, int64_t r1, const float* c, int64_t D, int64_t G,
                   const float* F, const float* U, int64_t n, float* acc) {
  for (int64_t r = r0; r < r1; ++r) {
    float* s = S + r * dv1;
    for (int64_t j = 0; j < n; ++j) axpy(s, F[j * D + r], U + j * dv1, dv1);
    for (int64_t g = 0; g < G; ++g) axpy(acc + g * dv1, c[g * D + r], s, dv1);
  }
}

template <int G>
void rows_pass_g(float* S, int64_t dv1, int64_t r0, int64_t r1, const float* c, int64_t D, const float* F,
                 const float* U, int64_t n, float* acc) {
  switch (dv1 / 16) {
    case 0: return rows_pass<G, 0>(S, dv1, r0, r1, c, D, F, U, n, acc);
    case 1: return rows_pass<G, 1>(S, dv1, r0, r1, c, D, F, U, n, acc);
    case 2: return rows_pass<G, 2>(S, dv1, r0, r1, c, D, F, U, n, acc);
    case 3: return rows_pass<G, 3>(S, dv1, r0, r1, c, D, F, U, n, acc);
    case 4: return rows_pass<G, 4>(S, dv1, r0, r1, c, D, F, U, n, acc);
    default: return rows_pass_any(S, dv1, r0, r1, c, D, G, F, U, n, acc);
  }
}

// Phase 1 of a kernel head: rows [r0, r1) of its state. The entering key (if `enter`) updates those rows, and the
// group's G queries read them into acc (G, dv1) (zeroed here): num_g = Σ_r φ_r(q_g) wq_gr S_r (Eq. 6).
void kernel_rows(const KernelHeadArgs& a, bool enter, const RowTable& rows, int64_t G, int64_t d, int64_t dv,
                 int64_t w, int64_t r0, int64_t r1, float* acc) {
  const int64_t dv1 = dv + 1, D = int64_t(rows.i.size()), m = r1 - r0;
  // the key entering the kernel set: the one leaving the window, or the new key without a window
  const int64_t n = enter ? 1 : 0;
  const float* keys = w > 0 ? a.win_k : a.k;
  const float* vals = w > 0 ? a.win_v : a.v;
  // query coefficients φ_r(q_g) wq_gr and the folded keys' features φ_r(k_j), for these rows only
  std::vector<float> c(G * m), F(n * m), U(n * dv1);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t r = r0; r < r1; ++r) c[g * m + r - r0] = rows.monomial(a.q + g * d, r) * a.wq[g * D + r];
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t r = r0; r < r1; ++r) F[j * m + r - r0] = rows.monomial(keys + j * d, r);
    std::copy(vals + j * dv, vals + (j + 1) * dv, U.begin() + j * dv1);
    U[j * dv1 + dv] = 1.f;
  }
  std::fill(acc, acc + G * dv1, 0.f);
  float* S = a.S + r0 * dv1;  // rows_pass indexes rows from 0 with stride m in c and F
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const int64_t gb = std::min<int64_t>(4, G - g0);
    const int64_t nb = g0 == 0 ? n : 0;  // fold once, in the first block of query heads
    const float* cb = c.data() + g0 * m;
    float* ab = acc + g0 * dv1;
    switch (gb) {
      case 1: rows_pass_g<1>(S, dv1, 0, m, cb, m, F.data(), U.data(), nb, ab); break;
      case 2: rows_pass_g<2>(S, dv1, 0, m, cb, m, F.data(), U.data(), nb, ab); break;
      case 3: rows_pass_g<3>(S, dv1, 0, m, cb, m, F.data(), U.data(), nb, ab); break;
      default: rows_pass_g<4>(S, dv1, 0, m, cb, m, F.data(), U.data(), nb, ab); break;
    }
  }
}

template <typename T>
void exact_part_of_head(const float* q, const T* K, const T* V, float* M, float* total, float* out, int64_t G,
                        int64_t d, int64_t dv, int64_t j0, int64_t j1, float scale, bool round_weights = false,
                        const float* ks = nullptr, const float* vs = nullptr);

// The output of a kernel head's G query heads from acc (G, dv1): the kernel part's numerator and denominator over
// `count` keys, and (sp / wp not null) the softmax parts of the sinks and the window (each M (G,), total (G,),
// out (G, dv), as exact_part_of_head writes them; a part of no keys has M = -inf), joined with the kernel part's
// log-mass β + log den in one normalisation.
void join_finish(const float* acc, float count, const float* beta, const float* sp, const float* wp, int64_t G,
                 int64_t dv, float floor, float* out) {
  const int64_t dv1 = dv + 1;
  for (int64_t g = 0; g < G; ++g) {
    const float* num = acc + g * dv1;
    const float den = std::max(num[dv], floor * count);
    float* o = out + g * dv;
    if (sp == nullptr && wp == nullptr) {
      for (int64_t c = 0; c < dv; ++c) o[c] = num[c] / den;
      continue;
    }
    const float log_mass = count > 0.f ? beta[g] + std::log(den) : -std::numeric_limits<float>::infinity();
    float M = log_mass;  // finite: the exact set always holds sink 0 or the new key
    if (sp != nullptr) M = std::max(M, sp[g]);
    if (wp != nullptr) M = std::max(M, wp[g]);
    float total = 0.f;
    std::fill(o, o + dv, 0.f);
    auto join = [&](const float* part_of) {  // one softmax part, rescaled to the common max
      const float f = std::exp(part_of[g] - M);
      total += f * part_of[G + g];
      axpy(o, f, part_of + 2 * G + g * dv, dv);
    };
    if (sp != nullptr) join(sp);
    if (wp != nullptr) join(wp);
    const float ks = count > 0.f ? std::exp(log_mass - M) : 0.f;
    total += ks;
    const float inv = 1.f / total, kern = count > 0.f ? ks / den : 0.f;  // an empty kernel set adds nothing
    for (int64_t c = 0; c < dv; ++c) o[c] = (o[c] + kern * num[c]) * inv;
  }
}

// Phase 2 of a kernel head, with acc the sum of its row parts: the normalisation, and (with sinks / a window) the
// window slide, the sinks and the exact part in one normalisation with the kernel part.
void kernel_finish(const KernelHeadArgs& a, float* acc, int64_t G, int64_t d, int64_t dv, int64_t t,
                   int64_t n_sink, int64_t w, float scale, float floor, bool exact_part) {
  const float count = a.S[dv];  // H0's last column: keys in the kernel set so far
  if (!exact_part) return join_finish(acc, count, a.beta, nullptr, nullptr, G, dv, floor, a.out);
  // slide the window (its oldest entry has entered the state in phase 1) and fill the sinks
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
  // the sinks j < ns and the window slots s0 … w-1 are each contiguous: two softmax parts (exact_part_of_head:
  // max, Σ e^{s-M}, Σ e^{s-M} v), joined with the kernel part's log-mass in one normalisation
  const int64_t part = G * (dv + 2);
  std::vector<float> parts(2 * part);
  float *sp = parts.data(), *wp = parts.data() + part;
  if (ns > 0) exact_part_of_head(a.q, a.sink_k, a.sink_v, sp, sp + G, sp + 2 * G, G, d, dv, 0, ns, scale);
  if (s0 < w) exact_part_of_head(a.q, a.win_k, a.win_v, wp, wp + G, wp + 2 * G, G, d, dv, s0, w, scale);
  join_finish(acc, count, a.beta, ns > 0 ? sp : nullptr, s0 < w ? wp : nullptr, G, dv, floor, a.out);
}

// a row of n stored keys / values as fp32: the row itself, or (bf16 storage) its widening into buf, or (int8
// storage, an 8-bit exact cache) its integers widened into buf (the row's scale is applied to its score / weight)
inline const float* row_f32(const float* x, int64_t, float*) { return x; }
inline const float* row_f32(const uint16_t* x, int64_t n, float* buf) {
  for (int64_t r = 0; r < n; ++r) {  // bf16 is the top half of an fp32: widening is a shift
    const uint32_t bits = static_cast<uint32_t>(x[r]) << 16;
    std::memcpy(buf + r, &bits, sizeof(float));
  }
  return buf;
}
inline const float* row_f32(const int8_t* x, int64_t n, float* buf) {
  for (int64_t r = 0; r < n; ++r) buf[r] = float(x[r]);
  return buf;
}

// the per-key scale of an int8 row (1 for the other storages, whose scale pointer is null)
inline float row_scale(const float* s, int64_t j) { return s ? s[j] : 1.f; }

// an 8-bit exact cache's new key / value row: x (n,) fp32 -> int8 with scale absmax / 127 (absmax at least 1e-30),
// x / scale rounded half to even and clamped to ±127: the quantisation of kernels/hybrid.py's quantize_int8
inline float quantize_row(const float* x, int64_t n, int8_t* out) {
  float amax = 0.f;
  for (int64_t r = 0; r < n; ++r) amax = std::max(amax, std::fabs(x[r]));
  const float s = std::max(amax, 1e-30f) / 127.f;
  for (int64_t r = 0; r < n; ++r) out[r] = int8_t(std::clamp(std::nearbyint(x[r] / s), -127.f, 127.f));
  return s;
}

// one split-K part of an exact head's softmax: the G queries over keys [j0, j1) (the new key already written at
// slot t), keys and values stored as T (fp32, bf16 as uint16, or int8 with the per-key scales ks, vs, folded into
// the scores and the weights: s_j = sk_j · (q · k_j), o = Σ_j (p_j · sv_j) v_j, the integers widened exactly).
// Writes per query g the part's max M[g],
// Σ e^{s-M} total[g] and Σ e^{s-M} v into out (G, dv). Any shape; exact_part_fast below for the usual ones.
// logit (G, n) -> e^{logit - M} per row in place, with each row's max M[g] and Σ total[g]; round_weights (bf16
// products): the weights rounded to bf16 and total their sum
inline void exp_rows(float* logit, int64_t G, int64_t n, float* M, float* total, bool round_weights) {
  for (int64_t g = 0; g < G; ++g) {
    float* lg = logit + g * n;
    M[g] = max_of(lg, n);
    total[g] = exp_shifted(lg, n, M[g]);
    if (round_weights) total[g] = round_bf16_sum(lg, n);
  }
}

template <typename T>
void exact_part_any(const float* q, const T* K, const T* V, float* M, float* total, float* out, int64_t G,
                    int64_t d, int64_t dv, int64_t j0, int64_t j1, float scale, bool round_weights, const float* ks,
                    const float* vs) {
  const int64_t n = j1 - j0;
  std::vector<float> logit(G * n), buf(std::max(d, dv));
  for (int64_t j = 0; j < n; ++j) {
    const float* kj = row_f32(K + (j0 + j) * d, d, buf.data());
    for (int64_t g = 0; g < G; ++g) logit[g * n + j] = dot(q + g * d, kj, d) * scale * row_scale(ks, j0 + j);
  }
  exp_rows(logit.data(), G, n, M, total, round_weights);
  std::fill(out, out + G * dv, 0.f);
  for (int64_t j = 0; j < n; ++j) {
    const float* vj = row_f32(V + (j0 + j) * dv, dv, buf.data());
    for (int64_t g = 0; g < G; ++g) axpy(out + g * dv, logit[g * n + j] * row_scale(vs, j0 + j), vj, dv);
  }
}

#if defined(__AVX512BF16__)
// exact_part_fast for bf16 keys and values with bf16 products (the queries and the softmax weights bf16 numbers, as
// hybrid.py's bf16_product_attention defines them): AVX512_BF16's pair products (vdpbf16ps: per fp32 lane two
// bf16 products, exact in fp32, added to the accumulator) in place of widening every stored number and one FMA per
// product. The scores of 16 keys at a time over pairs of dimensions, summed by one reduction tree; the weighted values
// over pairs of keys, the two rows interleaved in registers (unpacklo/hi_epi16: lane 4b + i of the low half holds
// column 8b + i of a 32-column chunk, of the high half column 8b + 4 + i). The same numbers up to the order of the
// fp32 additions (and subnormal bf16 inputs read as 0).
template <int G, int NB>
void exact_part_pairs(const float* q, const uint16_t* K, const uint16_t* V, float* M, float* total, float* out,
                      int64_t j0, int64_t j1, float scale) {
  constexpr int64_t d = 32 * NB;
  const int64_t n = j1 - j0;
  std::vector<float> logit(G * n);
  __m512bh qv[G][NB];  // the queries' bf16 numbers (exact: they are bf16 numbers held as fp32)
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NB; ++c)
      qv[g][c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + g * d + 32 * c + 16), _mm512_loadu_ps(q + g * d + 32 * c));
  auto row_score = [&](int g, const uint16_t* k) {
    __m512 a = _mm512_setzero_ps();
    for (int c = 0; c < NB; ++c) a = _mm512_dpbf16_ps(a, qv[g][c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
    return (v16)a;
  };
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const uint16_t* kb = K + (j0 + j) * d;
    for (int g = 0; g < G; ++g) {
      v16 acc[16];
      for (int x = 0; x < 16; ++x) acc[x] = row_score(g, kb + x * d);
      store16(logit.data() + g * n + j, sum_lanes16(acc) * scale);
    }
  }
  for (; j < n; ++j)
    for (int g = 0; g < G; ++g) logit[g * n + j] = sum16(row_score(g, K + (j0 + j) * d)) * scale;
  exp_rows(logit.data(), G, n, M, total, true);
  // the weights (bf16 numbers now) of keys 2m, 2m+1 as one bf16 pair, the odd part's last paired with 0
  const int64_t np = (n + 1) / 2;
  std::vector<uint32_t> pairs(G * np);
  for (int g = 0; g < G; ++g) {
    const float* pg = logit.data() + g * n;
    int64_t m = 0;
    for (; 2 * m + 32 <= n; m += 16)  // 32 weights -> 16 pairs (exact: they are bf16 numbers)
      _mm512_storeu_si512(pairs.data() + g * np + m,
                          (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(pg + 2 * m + 16), _mm512_loadu_ps(pg + 2 * m)));
    for (; m < np; ++m) {
      uint32_t lo, hi = 0;
      std::memcpy(&lo, logit.data() + g * n + 2 * m, sizeof(lo));
      if (2 * m + 1 < n) std::memcpy(&hi, logit.data() + g * n + 2 * m + 1, sizeof(hi));
      pairs[g * np + m] = (lo >> 16) | (hi & 0xffff0000u);
    }
  }
  __m512 o[G][2 * NB];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 2 * NB; ++c) o[g][c] = _mm512_setzero_ps();
  for (int64_t m = 0; m < np; ++m) {
    const uint16_t* va = V + (j0 + 2 * m) * d;
    const bool two = 2 * m + 1 < n;
    __m512bh lo[NB], hi[NB];
    for (int c = 0; c < NB; ++c) {
      const __m512i a = _mm512_loadu_si512(va + 32 * c);
      const __m512i b = two ? _mm512_loadu_si512(va + d + 32 * c) : _mm512_setzero_si512();
      lo[c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
      hi[c] = (__m512bh)_mm512_unpackhi_epi16(a, b);
    }
    for (int g = 0; g < G; ++g) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(int32_t(pairs[g * np + m]));
      for (int c = 0; c < NB; ++c) {
        o[g][2 * c] = _mm512_dpbf16_ps(o[g][2 * c], w, lo[c]);
        o[g][2 * c + 1] = _mm512_dpbf16_ps(o[g][2 * c + 1], w, hi[c]);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NB; ++c) {
      alignas(64) float lo[16], hi[16];
      _mm512_store_ps(lo, o[g][2 * c]);
      _mm512_store_ps(hi, o[g][2 * c + 1]);
      float* oc = out + g * d + 32 * c;
      for (int b = 0; b < 4; ++b)
        for (int i = 0; i < 4; ++i) {
          oc[8 * b + i] = lo[4 * b + i];
          oc[8 * b + 4 + i] = hi[4 * b + i];
        }
    }
}
#endif

// exact_part_any for G query heads and d = 16·ND, dv = 16·NV: the scores of 16 keys at a time in 16 vector
// accumulators summed by one reduction tree, the weighted values accumulated in G·NV vector registers. The
// decode step's exact heads were bound by instructions (a horizontal sum per key and query, values re-loaded
// and stored per key), not by the bytes they read.
template <typename T, int G, int ND, int NV>
void exact_part_fast(const float* q, const T* K, const T* V, float* M, float* total, float* out, int64_t j0,
                     int64_t j1, float scale, bool round_weights, const float* ks, const float* vs) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, uint16_t> && ND == NV && ND % 2 == 0) {
    if (round_weights && ks == nullptr) return exact_part_pairs<G, ND / 2>(q, K, V, M, total, out, j0, j1, scale);
  }
#endif
  constexpr int64_t d = 16 * ND, dv = 16 * NV;
  const int64_t n = j1 - j0;
  std::vector<float> logit(G * n);
  v16 qv[G][ND];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < ND; ++c) qv[g][c] = load16(q + g * d + c * 16);
  constexpr bool i8 = std::is_same_v<T, int8_t>;
  // q_g ⊙ k summed over the ND vector chunks of d: its 16 lanes add up to q_g · k
  auto products = [&](int g, const T* k) {
    v16 a = qv[g][0] * load16(k);
    for (int c = 1; c < ND; ++c) a += qv[g][c] * load16(k + c * 16);
    return a;
  };
  int64_t j = 0;
  v16 kbuf[16 * ND];  // bf16 / int8 keys widened once per block of 16, not once per query head
  for (; j + 16 <= n; j += 16) {
    const T* kb = K + (j0 + j) * d;
    if constexpr (sizeof(T) != sizeof(float)) {
      for (int c = 0; c < 16 * ND; ++c) kbuf[c] = load16(kb + c * 16);
    }
    for (int g = 0; g < G; ++g) {
      v16 acc[16];
      for (int x = 0; x < 16; ++x) {
        if constexpr (sizeof(T) != sizeof(float)) {
          acc[x] = qv[g][0] * kbuf[x * ND];
          for (int c = 1; c < ND; ++c) acc[x] += qv[g][c] * kbuf[x * ND + c];
        } else {
          acc[x] = products(g, kb + x * d);
        }
      }
      if constexpr (i8) {  // the 16 keys' scales
        store16(logit.data() + g * n + j, sum_lanes16(acc) * scale * load16(ks + j0 + j));
      } else {
        store16(logit.data() + g * n + j, sum_lanes16(acc) * scale);
      }
    }
  }
  for (; j < n; ++j) {
    v16 kr[ND];
    for (int c = 0; c < ND; ++c) kr[c] = load16(K + (j0 + j) * d + c * 16);
    for (int g = 0; g < G; ++g) {
      v16 a = qv[g][0] * kr[0];
      for (int c = 1; c < ND; ++c) a += qv[g][c] * kr[c];
      logit[g * n + j] = sum16(a) * scale * row_scale(ks, j0 + j);
    }
  }
  exp_rows(logit.data(), G, n, M, total, round_weights);
  v16 o[G][NV];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NV; ++c) o[g][c] = v16{};
  for (int64_t x = 0; x < n; ++x) {
    v16 vr[NV];
    for (int c = 0; c < NV; ++c) vr[c] = load16(V + (j0 + x) * dv + c * 16);
    const float sv = row_scale(vs, j0 + x);
    for (int g = 0; g < G; ++g) {
      const float p = logit[g * n + x] * sv;
      for (int c = 0; c < NV; ++c) o[g][c] += p * vr[c];
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NV; ++c) store16(out + g * dv + c * 16, o[g][c]);
}

// The register-blocked kernels' shapes: fn(G, ND) with both as std::integral_constant, for G ≤ 4 query heads per
// KV head and d = dv = 16·ND ∈ {32, 64, 128}; false (fn not called) for any other shape.
template <typename F>
bool fast_shape(int64_t G, int64_t d, int64_t dv, const F& fn) {
  if (d != dv || G < 1 || G > 4) return false;
  auto by_heads = [&](auto nd) {
    switch (G) {
      case 1: fn(std::integral_constant<int, 1>{}, nd); break;
      case 2: fn(std::integral_constant<int, 2>{}, nd); break;
      case 3: fn(std::integral_constant<int, 3>{}, nd); break;
      default: fn(std::integral_constant<int, 4>{}, nd); break;
    }
    return true;
  };
  switch (d) {
    case 32: return by_heads(std::integral_constant<int, 2>{});
    case 64: return by_heads(std::integral_constant<int, 4>{});
    case 128: return by_heads(std::integral_constant<int, 8>{});
    default: return false;
  }
}

// one split-K part of an exact head (see exact_part_any): the fast kernel for G ≤ 4 and d = dv ∈ {32, 64, 128}
template <typename T>
void exact_part_of_head(const float* q, const T* K, const T* V, float* M, float* total, float* out, int64_t G,
                        int64_t d, int64_t dv, int64_t j0, int64_t j1, float scale, bool round_weights,
                        const float* ks, const float* vs) {
  const bool done = fast_shape(G, d, dv, [&](auto g, auto nd) {
    exact_part_fast<T, decltype(g)::value, decltype(nd)::value, decltype(nd)::value>(q, K, V, M, total, out, j0, j1,
                                                                                   scale, round_weights, ks, vs);
  });
  if (!done) exact_part_any(q, K, V, M, total, out, G, d, dv, j0, j1, scale, round_weights, ks, vs);
}

// Kernel heads that keep their keys and values instead of the state (below the memory crossover; the kept form of
// ../../../kernels/kept.py): the kernel part from the keys, through the kernel's factor (Eq. 7 as a sum of R
// squares, utils.KernelFactor): κ_g(k) = c0_g + Σ_m (c_gm + p_gm · k)², with p_gm = scale · W_gm ⊙ q_g the query's
// side. acc (G, dv+1) += Σ_j κ_g(k_j) [v_j, 1] over keys [j0, j1), stored as T (fp32, or bf16 as uint16 for a bf16
// model, whose keys are bf16 numbers to begin with). The scores of 16 keys at a time for each of the G·R rows of
// p, summed by one reduction tree (as exact_part_fast), κ and the weighted values in registers.
template <typename T, int G, int ND, int NV>
void kernel_part_fast(const float* p, const float* c, const float* c0, int64_t R, const T* K, const T* V,
                      int64_t j0, int64_t j1, float* acc) {
  constexpr int64_t d = 16 * ND, dv = 16 * NV, dv1 = dv + 1;
  v16 o[G][NV], den[G];
  for (int g = 0; g < G; ++g) {
    den[g] = v16{};
    for (int ch = 0; ch < NV; ++ch) o[g][ch] = v16{};
  }
  float kap[G][16];
  int64_t j = j0;
  for (; j + 16 <= j1; j += 16) {
    const T* kb = K + j * d;
    for (int g = 0; g < G; ++g) {
      v16 kv = splat16(c0[g]);
      for (int64_t m = 0; m < R; ++m) {
        const float* pr = p + (g * R + m) * d;
        v16 pv[ND];
        for (int ch = 0; ch < ND; ++ch) pv[ch] = load16(pr + ch * 16);
        v16 prod[16];
        for (int x = 0; x < 16; ++x) {
          prod[x] = pv[0] * load16(kb + x * d);
          for (int ch = 1; ch < ND; ++ch) prod[x] += pv[ch] * load16(kb + x * d + ch * 16);
        }
        const v16 z = sum_lanes16(prod) + c[g * R + m];
        kv += z * z;
      }
      den[g] += kv;
      store16(kap[g], kv);
    }
    for (int x = 0; x < 16; ++x) {
      v16 vr[NV];
      for (int ch = 0; ch < NV; ++ch) vr[ch] = load16(V + (j + x) * dv + ch * 16);
      for (int g = 0; g < G; ++g) {
        const float w = kap[g][x];
        for (int ch = 0; ch < NV; ++ch) o[g][ch] += w * vr[ch];
      }
    }
  }
  float tail[G] = {}, kbuf[d];
  for (; j < j1; ++j) {  // the last keys one at a time
    const float* kj = row_f32(K + j * d, d, kbuf);
    for (int g = 0; g < G; ++g) {
      float kv = c0[g];
      for (int64_t m = 0; m < R; ++m) {
        const float z = c[g * R + m] + dot(p + (g * R + m) * d, kj, d);
        kv += z * z;
      }
      tail[g] += kv;
      for (int ch = 0; ch < NV; ++ch) o[g][ch] += kv * load16(V + j * dv + ch * 16);
    }
  }
  for (int g = 0; g < G; ++g) {
    float* ag = acc + g * dv1;
    for (int ch = 0; ch < NV; ++ch) store16(ag + ch * 16, load16(ag + ch * 16) + o[g][ch]);
    float sum = tail[g];
    for (int l = 0; l < 16; ++l) sum += lane(den[g], l);
    ag[dv] += sum;
  }
}

// the same for any G, d and dv, one key at a time
template <typename T>
void kernel_part_any(const float* p, const float* c, const float* c0, int64_t G, int64_t R, int64_t d, int64_t dv,
                     const T* K, const T* V, int64_t j0, int64_t j1, float* acc) {
  std::vector<float> kbuf(d), vbuf(dv);
  for (int64_t j = j0; j < j1; ++j) {
    const float* kj = row_f32(K + j * d, d, kbuf.data());
    const float* vj = row_f32(V + j * dv, dv, vbuf.data());
    for (int64_t g = 0; g < G; ++g) {
      float kv = c0[g];
      for (int64_t m = 0; m < R; ++m) {
        const float z = c[g * R + m] + dot(p + (g * R + m) * d, kj, d);
        kv += z * z;
      }
      axpy(acc + g * (dv + 1), kv, vj, dv);
      acc[g * (dv + 1) + dv] += kv;
    }
  }
}

// one part of a kept kernel head: the G queries q (G, d) against keys [j0, j1) with the factor W (G, R, d),
// c (G, R), c0 (G,) of the group's query heads; acc (G, dv+1) += the part's numerators and denominators
template <typename T>
void kernel_part_of_head(const float* q, const float* W, const float* c, const float* c0, int64_t G, int64_t R,
                         int64_t d, int64_t dv, const T* K, const T* V, int64_t j0, int64_t j1, float scale,
                         float* acc) {
  std::vector<float> p(G * R * d);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t m = 0; m < R; ++m)
      for (int64_t r = 0; r < d; ++r) p[(g * R + m) * d + r] = scale * W[(g * R + m) * d + r] * q[g * d + r];
  const bool done = fast_shape(G, d, dv, [&](auto g, auto nd) {
    kernel_part_fast<T, decltype(g)::value, decltype(nd)::value, decltype(nd)::value>(p.data(), c, c0, R, K, V, j0,
                                                                                    j1, acc);
  });
  if (!done) kernel_part_any(p.data(), c, c0, G, R, d, dv, K, V, j0, j1, acc);
}

inline float from_bf16(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

#if defined(__AVX512F__)
// bound_scores for GB ≤ 4 query heads with d % 8 == 0: the page's bounds loaded once, 2·GB independent chains of
// fp64 FMAs held in registers, each head's two reduced by a tree
template <int GB>
void bound_scores_block(const double* ap, const double* an, const double* lo, const double* hi, int64_t d, double* U,
                        int64_t stride) {
  __m512d acc_hi[GB], acc_lo[GB];
  for (int g = 0; g < GB; ++g) acc_hi[g] = acc_lo[g] = _mm512_setzero_pd();
  for (int64_t i = 0; i < d; i += 8) {
    const __m512d h = _mm512_loadu_pd(hi + i), l = _mm512_loadu_pd(lo + i);
    for (int g = 0; g < GB; ++g) {
      acc_hi[g] = _mm512_fmadd_pd(_mm512_loadu_pd(ap + g * d + i), h, acc_hi[g]);
      acc_lo[g] = _mm512_fmadd_pd(_mm512_loadu_pd(an + g * d + i), l, acc_lo[g]);
    }
  }
  for (int g = 0; g < GB; ++g) U[g * stride] = _mm512_reduce_add_pd(_mm512_add_pd(acc_hi[g], acc_lo[g]));
}
#endif

// U[g · stride] = Σ_i (ap_gi hi_i + an_gi lo_i) over i < d in fp64 for the G query heads (ap, an (G, d)) of one
// page: the products are exact (one factor of each pair is zero, the other an fp32 × bf16 product); summed in 8-lane
// vectors where AVX-512 has them (bound_scores_block), else in order
inline void bound_scores(const double* ap, const double* an, const double* lo, const double* hi, int64_t G, int64_t d,
                         double* U, int64_t stride) {
  int64_t g0 = 0;
#if defined(__AVX512F__)
  if (d % 8 == 0) {
    for (; g0 < G; g0 += 4) {
      const double *p = ap + g0 * d, *m = an + g0 * d;
      switch (std::min<int64_t>(4, G - g0)) {
        case 1: bound_scores_block<1>(p, m, lo, hi, d, U + g0 * stride, stride); break;
        case 2: bound_scores_block<2>(p, m, lo, hi, d, U + g0 * stride, stride); break;
        case 3: bound_scores_block<3>(p, m, lo, hi, d, U + g0 * stride, stride); break;
        default: bound_scores_block<4>(p, m, lo, hi, d, U + g0 * stride, stride); break;
      }
    }
  }
#endif
  for (int64_t g = g0; g < G; ++g) {
    double s = 0.0;
    for (int64_t i = 0; i < d; ++i) s += ap[g * d + i] * hi[i] + an[g * d + i] * lo[i];
    U[g * stride] = s;
  }
}

// The runs [j0, j1) of keys a budgeted step over keys 0 … t attends (page_select.select_pages): page 0, the
// RECENT_PAGES last pages and the S - 1 - RECENT_PAGES others ranked by max_g (U_g(p) - max_p' U_g(p')), U_g(p) =
// Σ_i max(a_gi lo_pi, a_gi hi_pi) with a = scale·q rounded to fp32, in fp64, ties to the lower page. Each term is
// a⁺_gi hi_pi + a⁻_gi lo_pi (a⁺ = max(a, 0), a⁻ = min(a, 0)): one product is zero and the other the reference's
// term, exactly (fp32 × bf16 products are exact in fp64); bound_scores sums them in another order than the
// reference, so only bounds within ~1e-15 of each other could rank differently. bounds: the head's (pages, 2, d)
// bf16 minima and maxima. Requires more than S pages.
std::vector<std::pair<int64_t, int64_t>> selected_runs(const float* q, const uint16_t* bounds, int64_t G, int64_t d,
                                                       int64_t t, int64_t page, int64_t S, float scale) {
  const int64_t n = t + 1, P = (n + page - 1) / page, C = P - 1 - RECENT_PAGES;  // candidates: pages 1 … C
  std::vector<double> pos(G * d), neg(G * d), U(G * C), score(C, -std::numeric_limits<double>::infinity());
  for (int64_t c = 0; c < G * d; ++c) {
    const double x = double(scale * q[c]);
    pos[c] = std::max(x, 0.0);
    neg[c] = std::min(x, 0.0);
  }
  std::vector<double> lo(d), hi(d);
  for (int64_t c = 0; c < C; ++c) {
    const uint16_t* b = bounds + (c + 1) * 2 * d;
    for (int64_t i = 0; i < d; ++i) lo[i] = double(from_bf16(b[i])), hi[i] = double(from_bf16(b[d + i]));
    bound_scores(pos.data(), neg.data(), lo.data(), hi.data(), G, d, U.data() + c, C);
  }
  for (int64_t g = 0; g < G; ++g) {
    const double m = *std::max_element(U.begin() + g * C, U.begin() + (g + 1) * C);
    for (int64_t c = 0; c < C; ++c) score[c] = std::max(score[c], U[g * C + c] - m);
  }
  std::vector<int64_t> order(C);
  for (int64_t c = 0; c < C; ++c) order[c] = c;
  const int64_t keep = S - 1 - RECENT_PAGES;
  std::partial_sort(order.begin(), order.begin() + keep, order.end(), [&](int64_t x, int64_t y) {
    return score[x] > score[y] || (score[x] == score[y] && x < y);
  });
  std::vector<int64_t> pages{0};
  for (int64_t c = 0; c < keep; ++c) pages.push_back(order[c] + 1);
  for (int64_t p = P - RECENT_PAGES; p < P; ++p) pages.push_back(p);
  std::sort(pages.begin(), pages.end());
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (const int64_t p : pages) {
    const int64_t j0 = p * page, j1 = std::min(n, j0 + page);
    if (!runs.empty() && runs.back().second == j0) {
      runs.back().second = j1;
    } else {
      runs.emplace_back(j0, j1);
    }
  }
  return runs;
}

// the exact head's output from its P parts (each M (G,), total (G,), out (G, dv), packed one after another)
void combine_exact_parts(const float* parts, int64_t P, int64_t G, int64_t dv, float* out) {
  const int64_t stride = G * (dv + 2);
  for (int64_t g = 0; g < G; ++g) {
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < P; ++p) m = std::max(m, parts[p * stride + g]);
    float total = 0.f;
    float* o = out + g * dv;
    std::fill(o, o + dv, 0.f);
    for (int64_t p = 0; p < P; ++p) {
      const float* part = parts + p * stride;
      const float w = std::exp(part[g] - m);
      total += w * part[G + g];
      axpy(o, w, part + 2 * G + g * dv, dv);
    }
    const float inv = 1.f / total;
    for (int64_t c = 0; c < dv; ++c) o[c] *= inv;
  }
}

// q (B, Hq, d), k (B, Hkv, d), v (B, Hkv, dv), out (B, Hq, dv) written.
// exact_heads (E,) int64 with ex_k (B, E, cap, d), ex_v (B, E, cap, dv) in fp32, bf16 or int8, cap > t (slot t is
// written); int8 (an 8-bit exact cache) with the per-key scales ex_ks, ex_vs (B, E, cap) fp32, the new key and value
// quantised into slot t (quantize_row); ex_bf16_products (ExactHeadsKernel product_dtype, with bf16 or int8 keys and
// values): the exact heads' scaled queries, weights and (int8) dequantised keys and values rounded to bf16 before
// their products.
// kern_heads (K,) int64, and either (kept false) the state S (B, K, D, dv+1), wq (K·G, D), beta (K·G,),
// sink_k/v (B, K, n_sink, ·), win_k/v (B, K, w, ·), or (kept true) the heads' keys and values kept_k
// (B, K, capk, d), kept_v (B, K, capk, dv) fp32 or bf16 with capk > t (slot t is written), the factor fw (K·G, R, d),
// fc (K·G, R), fc0 (K·G,) and beta (K·G,). exact_part: whether the kernel heads have sinks / a window (else plain
// kernel).
void decode_step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, const Tensor& exact_heads,
                 Tensor& ex_k, Tensor& ex_v, Tensor& ex_ks, Tensor& ex_vs, const Tensor& kern_heads, Tensor& S, const Tensor& wq,
                 const Tensor& beta, Tensor& sink_k, Tensor& sink_v, Tensor& win_k, Tensor& win_v, Tensor& kept_k,
                 Tensor& kept_v, const Tensor& fw, const Tensor& fc, const Tensor& fc0, bool kept, int64_t t,
                 int64_t n_sink, int64_t w, double scale, double floor, bool exact_part, bool ex_bf16_products,
                 Tensor& ex_bounds, int64_t page, int64_t budget) {
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
  int64_t cap = 0, capk = 0, R = 0;
  bool ex_bf16 = false, ex_i8 = false;  // the exact heads' keys and values stored in bf16 / int8 (kv_dtype)
  if (E) {
    ex_bf16 = ex_k.scalar_type() == at::kBFloat16;
    ex_i8 = ex_k.scalar_type() == at::kChar;
    TORCH_CHECK((ex_bf16 || ex_i8 || ex_k.scalar_type() == at::kFloat) && ex_v.scalar_type() == ex_k.scalar_type() &&
                    ex_k.is_contiguous() && ex_v.is_contiguous() && ex_k.dim() == 4 && ex_v.dim() == 4 &&
                    ex_k.device().is_cpu() && ex_v.device().is_cpu(),
                "ex_k, ex_v: expected contiguous CPU float32, bfloat16 or int8 tensors of one dtype with 4 "
                "dimensions");
    cap = ex_k.size(2);
    TORCH_CHECK(cap > t && ex_v.size(2) == cap, "ex_k, ex_v: expected a capacity above t=", t);
    if (ex_i8) {
      check_f32(ex_ks, "ex_ks", 3);
      check_f32(ex_vs, "ex_vs", 3);
      TORCH_CHECK(ex_ks.size(0) == B && ex_ks.size(1) == E && ex_ks.size(2) == cap && ex_vs.sizes() == ex_ks.sizes(),
                  "ex_ks, ex_vs: expected (B, E, capacity) = (", B, ", ", E, ", ", cap, ") scales, got ",
                  ex_ks.sizes(), " and ", ex_vs.sizes());
    }
  }
  // page bounds of the exact keys (a decode budget): updated with the new key; a step past the budget selects
  const bool has_bounds = E > 0 && ex_bounds.numel() > 0;
  int64_t pcap = 0;
  TORCH_CHECK(page >= 1, "page: expected a positive number of keys per page, got ", page);
  if (has_bounds) {
    TORCH_CHECK(ex_bounds.scalar_type() == at::kBFloat16 && ex_bounds.is_contiguous() && ex_bounds.dim() == 5 &&
                    ex_bounds.device().is_cpu() && ex_bounds.size(0) == B && ex_bounds.size(1) == E &&
                    ex_bounds.size(3) == 2 && ex_bounds.size(4) == d,
                "ex_bounds: expected contiguous CPU (B, E, pages, 2, d) = (", B, ", ", E, ", pages, 2, ", d,
                ") bfloat16 page bounds, got ", ex_bounds.sizes(), " ", ex_bounds.scalar_type());
    pcap = ex_bounds.size(2);
    TORCH_CHECK(pcap > t / page, "ex_bounds: expected a page for slot t=", t, " (", pcap, " pages of ", page, ")");
  }
  TORCH_CHECK(budget == 0 || (has_bounds && budget % page == 0 && budget / page >= RECENT_PAGES + 2),
              "budget: expected 0, or a multiple of page of at least ", RECENT_PAGES + 2,
              " pages with the page bounds ex_bounds, got ", budget);
  const int64_t budget_pages = budget / page;                         // pages a budgeted step attends
  const bool select = budget > 0 && (t + page) / page > budget_pages;  // more pages than the budget's
  bool kept_bf16 = false;  // kept keys and values stored in bf16 (a bf16 model's, exactly)
  if (K && kept) {
    kept_bf16 = kept_k.scalar_type() == at::kBFloat16;
    TORCH_CHECK((kept_bf16 || kept_k.scalar_type() == at::kFloat) && kept_v.scalar_type() == kept_k.scalar_type() &&
                    kept_k.is_contiguous() && kept_v.is_contiguous() && kept_k.dim() == 4 && kept_v.dim() == 4 &&
                    kept_k.device().is_cpu() && kept_v.device().is_cpu(),
                "kept_k, kept_v: expected contiguous CPU float32 or bfloat16 tensors of one dtype with 4 dimensions");
    check_f32(fw, "fw", 3);
    check_f32(fc, "fc", 2);
    check_f32(fc0, "fc0", 1);
    check_f32(beta, "beta", 1);
    capk = kept_k.size(2);
    R = fw.size(1);
    TORCH_CHECK(kept_k.size(0) == B && kept_k.size(1) == K && kept_k.size(3) == d && kept_v.size(0) == B &&
                    kept_v.size(1) == K && kept_v.size(2) == capk && kept_v.size(3) == dv && capk > t,
                "kept_k, kept_v: expected (B, K, capacity > t, d) keys and values of the kernel heads");
    TORCH_CHECK(fw.size(0) == K * G && fw.size(2) == d && fc.size(0) == K * G && fc.size(1) == R &&
                    fc0.size(0) == K * G && beta.size(0) == K * G,
                "fw, fc, fc0, beta: shapes do not match the heads");
  } else if (K) {
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
  // the new keys of the exact heads (and of kept kernel heads) first, so that every part can read slot t
  uint16_t* ekb = ex_bf16 ? reinterpret_cast<uint16_t*>(ex_k.data_ptr<at::BFloat16>()) : nullptr;
  uint16_t* evb = ex_bf16 ? reinterpret_cast<uint16_t*>(ex_v.data_ptr<at::BFloat16>()) : nullptr;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < E; ++i) {
      const int64_t h = eh[i], ko = ((b * E + i) * cap + t) * d, vo = ((b * E + i) * cap + t) * dv;
      const float *kx = kp + (b * Hkv + h) * d, *vx = vp + (b * Hkv + h) * dv;
      if (ex_bf16) {
        for (int64_t r = 0; r < d; ++r) ekb[ko + r] = to_bf16(kx[r]);
        for (int64_t c = 0; c < dv; ++c) evb[vo + c] = to_bf16(vx[c]);
      } else if (ex_i8) {
        const int64_t so = (b * E + i) * cap + t;
        ex_ks.data_ptr<float>()[so] = quantize_row(kx, d, ex_k.data_ptr<int8_t>() + ko);
        ex_vs.data_ptr<float>()[so] = quantize_row(vx, dv, ex_v.data_ptr<int8_t>() + vo);
      } else {
        std::memcpy(ex_k.data_ptr<float>() + ko, kx, sizeof(float) * d);
        std::memcpy(ex_v.data_ptr<float>() + vo, vx, sizeof(float) * dv);
      }
      if (has_bounds) {  // the new key's page: its stored numbers rounded to bf16 (exact for bf16 storage)
        uint16_t* lo = reinterpret_cast<uint16_t*>(ex_bounds.data_ptr<at::BFloat16>()) +
                       ((b * E + i) * pcap + t / page) * 2 * d;
        uint16_t* hi = lo + d;
        const bool first = t % page == 0;
        const float sk = ex_i8 ? ex_ks.data_ptr<float>()[(b * E + i) * cap + t] : 1.f;
        for (int64_t r = 0; r < d; ++r) {
          const float x = ex_bf16 ? from_bf16(ekb[ko + r])
                          : ex_i8 ? float(ex_k.data_ptr<int8_t>()[ko + r]) * sk
                                  : kx[r];
          const uint16_t xb = to_bf16(x);
          const float xr = from_bf16(xb);
          if (first || xr < from_bf16(lo[r])) lo[r] = xb;
          if (first || xr > from_bf16(hi[r])) hi[r] = xb;
        }
      }
    }
    if (kept)
      for (int64_t j = 0; j < K; ++j) {
        const int64_t h = kh[j], ko = ((b * K + j) * capk + t) * d, vo = ((b * K + j) * capk + t) * dv;
        const float *kx = kp + (b * Hkv + h) * d, *vx = vp + (b * Hkv + h) * dv;
        if (kept_bf16) {
          uint16_t* kk = reinterpret_cast<uint16_t*>(kept_k.data_ptr<at::BFloat16>());
          uint16_t* kv = reinterpret_cast<uint16_t*>(kept_v.data_ptr<at::BFloat16>());
          for (int64_t r = 0; r < d; ++r) kk[ko + r] = to_bf16(kx[r]);
          for (int64_t c = 0; c < dv; ++c) kv[vo + c] = to_bf16(vx[c]);
        } else {
          std::memcpy(kept_k.data_ptr<float>() + ko, kx, sizeof(float) * d);
          std::memcpy(kept_v.data_ptr<float>() + vo, vx, sizeof(float) * dv);
        }
      }
  }
  TORCH_CHECK(!ex_bf16_products || !E || ex_bf16 || ex_i8, "ex_bf16_products: expected the exact heads' keys and "
              "values in bfloat16 or int8, got ", ex_k.scalar_type());
  // split-K parts per exact head (a budgeted step: one task per head over its selected runs)
  const int64_t P = select ? 1 : (t + 1 + EXACT_BLOCK - 1) / EXACT_BLOCK;
  const int64_t part_size = G * (dv + 2);
  std::vector<float> parts(B * E * P * part_size);
  const int64_t w_eff = exact_part ? w : 0, n_sink_eff = exact_part ? n_sink : 0;
  // kept heads: the kernel set is keys [ka, kb), the sinks [0, ns), the window [wa, t]
  const int64_t ka = n_sink_eff, kb = std::max(ka, t - w_eff + 1);
  const int64_t ns = std::min(n_sink_eff, t + 1), wa = std::max(n_sink_eff, t - w_eff + 1);
  // parts per kernel head: row ranges of the state when the batch has fewer heads than 2 × threads (split-D), or
  // blocks of KEPT_BLOCK kept keys (split-K: the kernel part's sums simply add up)
  const int64_t threads = at::get_num_threads();
  const int64_t RP = !K ? 1
                     : kept ? std::max<int64_t>(1, (kb - ka + KEPT_BLOCK - 1) / KEPT_BLOCK)
                            : std::clamp<int64_t>((2 * threads + B * K - 1) / (B * K), 1, 8);
  const int64_t XP = kept && exact_part ? 1 : 0;  // a kept head's softmax part of its sinks and window: one task
  std::vector<float> acc(B * K * RP * G * (dv + 1));
  std::vector<float> kept_parts(B * K * XP * 2 * part_size);
  const RowTable rows(K && !kept ? d : 0);
  auto args = [&](int64_t b, int64_t j) {
    const int64_t h = kh[j], bj = b * K + j;
    const bool sw = exact_part && !kept;
    return KernelHeadArgs{qp + (b * Hq + h * G) * d,
                          kp + (b * Hkv + h) * d,
                          vp + (b * Hkv + h) * dv,
                          kept ? nullptr : S.data_ptr<float>() + bj * D * (dv + 1),
                          kept ? nullptr : wq.data_ptr<float>() + j * G * D,
                          beta.numel() ? beta.data_ptr<float>() + j * G : nullptr,
                          sw ? sink_k.data_ptr<float>() + bj * n_sink * d : nullptr,
                          sw ? sink_v.data_ptr<float>() + bj * n_sink * dv : nullptr,
                          sw ? win_k.data_ptr<float>() + bj * w * d : nullptr,
                          sw ? win_v.data_ptr<float>() + bj * w * dv : nullptr,
                          op + (b * Hq + h * G) * dv};
  };
  // a kept head's keys and values in their stored dtype: fn(K, V) with typed pointers to head bj's buffers
  auto with_kept = [&](int64_t bj, const auto& fn) {
    if (kept_bf16) {
      fn(reinterpret_cast<const uint16_t*>(kept_k.data_ptr<at::BFloat16>()) + bj * capk * d,
         reinterpret_cast<const uint16_t*>(kept_v.data_ptr<at::BFloat16>()) + bj * capk * dv);
    } else {
      fn(kept_k.data_ptr<float>() + bj * capk * d, kept_v.data_ptr<float>() + bj * capk * dv);
    }
  };
  const bool enter = t - w_eff >= n_sink_eff;  // a key enters the kernel set (else: a sink, or the window fills)
  // phase 1: B·K·RP parts of kernel heads, B·K·XP softmax parts of kept heads, then B·E·P parts of exact heads
  const int64_t n_kern = B * K * RP, n_kx = B * K * XP;
  at::parallel_for(0, n_kern + n_kx + B * E * P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      if (task >= n_kern + n_kx) {
        const int64_t x = task - n_kern - n_kx, part = x % P, bi = x / P, b = bi / E, i = bi % E, h = eh[i];
        float* slot = parts.data() + x * part_size;
        const int64_t j0 = part * EXACT_BLOCK, j1 = std::min(t + 1, j0 + EXACT_BLOCK);
        const float* qh = qp + (b * Hq + h * G) * d;
        std::vector<float> qr;  // bf16 products: the scaled queries rounded to bf16, the scale applied
        if (ex_bf16_products) {
          qr.resize(G * d);
          for (int64_t c = 0; c < G * d; ++c) qr[c] = round_bf16(float(scale) * qh[c]);
        }
        // int8: the head's scales beside its keys and values
        const float* ks = ex_i8 ? ex_ks.data_ptr<float>() + bi * cap : nullptr;
        const float* vs = ex_i8 ? ex_vs.data_ptr<float>() + bi * cap : nullptr;
        auto part_of = [&](const auto* Ks, const auto* Vs, float* into, int64_t a0, int64_t a1) {
          exact_part_of_head(ex_bf16_products ? qr.data() : qh, Ks + bi * cap * d, Vs + bi * cap * dv, into, into + G,
                             into + 2 * G, G, d, dv, a0, a1, ex_bf16_products ? 1.f : float(scale), ex_bf16_products,
                             ks, vs);
        };
        auto parts_of = [&](float* into, int64_t a0, int64_t a1) {
          if (ex_bf16) {
            part_of(ekb, evb, into, a0, a1);
          } else if (ex_i8) {
            part_of(ex_k.data_ptr<int8_t>(), ex_v.data_ptr<int8_t>(), into, a0, a1);
          } else {
            part_of(ex_k.data_ptr<float>(), ex_v.data_ptr<float>(), into, a0, a1);
          }
        };
        if (select) {  // the selected pages' runs, combined into the head's output here
          const auto runs = selected_runs(qh, reinterpret_cast<const uint16_t*>(ex_bounds.data_ptr<at::BFloat16>()) +
                                                  bi * pcap * 2 * d,
                                          G, d, t, page, budget_pages, float(scale));
          std::vector<float> run_parts(runs.size() * part_size);
          for (size_t r = 0; r < runs.size(); ++r)
            parts_of(run_parts.data() + r * part_size, runs[r].first, runs[r].second);
          combine_exact_parts(run_parts.data(), int64_t(runs.size()), G, dv, op + (b * Hq + h * G) * dv);
          continue;
        }
        parts_of(slot, j0, j1);
        continue;
      }
      if (task >= n_kern) {  // a kept head's sinks and window, from its kept keys
        const int64_t bj = task - n_kern, h = kh[bj % K];
        const float* qg = qp + (bj / K * Hq + h * G) * d;
        float *sp = kept_parts.data() + bj * 2 * part_size, *wp = sp + part_size;
        with_kept(bj, [&](const auto* Kb, const auto* Vb) {
          if (ns > 0) exact_part_of_head(qg, Kb, Vb, sp, sp + G, sp + 2 * G, G, d, dv, 0, ns, float(scale));
          if (w_eff > 0 && wa <= t)
            exact_part_of_head(qg, Kb, Vb, wp, wp + G, wp + 2 * G, G, d, dv, wa, t + 1, float(scale));
        });
        continue;
      }
      const int64_t bj = task / RP, c = task % RP;
      float* a = acc.data() + task * G * (dv + 1);
      if (kept) {
        const int64_t j = bj % K, j0 = ka + c * KEPT_BLOCK, j1 = std::min(kb, j0 + KEPT_BLOCK);
        if (j0 < j1)
          with_kept(bj, [&](const auto* Kb, const auto* Vb) {
            kernel_part_of_head(qp + (bj / K * Hq + kh[j] * G) * d, fw.data_ptr<float>() + j * G * R * d,
                                fc.data_ptr<float>() + j * G * R, fc0.data_ptr<float>() + j * G, G, R, d, dv, Kb, Vb,
                                j0, j1, float(scale), a);
          });
        continue;
      }
      kernel_rows(args(bj / K, bj % K), enter, rows, G, d, dv, w_eff, D * c / RP, D * (c + 1) / RP, a);
    }
  });
  // phase 2: each kernel head from its parts, each exact head from its split-K parts
  at::parallel_for(0, B * K + B * E, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      if (task >= B * K) {
        if (select) continue;  // written by its phase-1 task
        const int64_t bi = task - B * K, b = bi / E, h = eh[bi % E];
        combine_exact_parts(parts.data() + bi * P * part_size, P, G, dv, op + (b * Hq + h * G) * dv);
        continue;
      }
      float* a0 = acc.data() + task * RP * G * (dv + 1);
      for (int64_t c = 1; c < RP; ++c) axpy(a0, 1.f, a0 + c * G * (dv + 1), G * (dv + 1));
      const KernelHeadArgs a = args(task / K, task % K);
      if (!kept) {
        kernel_finish(a, a0, G, d, dv, t, n_sink_eff, w_eff, float(scale), float(floor), exact_part);
        continue;
      }
      const float* sp = kept_parts.data() + task * XP * 2 * part_size;
      join_finish(a0, float(kb - ka), a.beta, XP && ns > 0 ? sp : nullptr,
                  XP && w_eff > 0 && wa <= t ? sp + part_size : nullptr, G, dv, float(floor), a.out);
    }
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_step", &decode_step, "Fused CPU decode step of one converted attention layer (in place)");
}
