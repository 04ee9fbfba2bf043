// Helpers shared by the fused CPU kernels decode.cpp and window.cpp (included inside their anonymous namespace;
// the loader hashes this file into the build flags, so a change to it rebuilds both).
#pragma once

#include "simd.h"

// fp32 -> bf16, rounding to nearest even (the rounding torch's .to(torch.bfloat16) does; inputs are finite)
inline uint16_t to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// x rounded to the nearest bf16 number, as fp32
inline float round_bf16(float x) {
  const uint32_t bits = static_cast<uint32_t>(to_bf16(x)) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// x[0:n] rounded to bf16 in place (bf16 products: the softmax weights), returning their sum
inline float round_bf16_sum(float* x, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, x + i, sizeof(bits));
    bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    std::memcpy(x + i, &bits, sizeof(bits));
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    s += f;
  }
  return s;
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)  // without it the float reduction stays scalar (strict FP ordering)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// e^x for x ≤ 0 (softmax weights after the max is subtracted), branch-free; glibc's vector expf needs -ffast-math,
// which would also assume away the infinities these files rely on. Range reduction x = n ln2 + r, |r| ≤ ln2/2
// (n rounded to nearest by the 1.5·2^23 shift), a degree-7 Taylor-like minimax polynomial (Cephes' expf
// coefficients), 2^n from the exponent bits; below -87 (2^-126) the result is 0. Relative error ≤ 2 ulp. Written
// once for 16 lanes (GCC vectors): the scalar loop under `omp simd` compiled to ~5 ns per element, the vector
// form to ~0.3 ns. The scalar exp_nonpos is lane 0 of it, so a row's tail gets bit-identical weights.
inline v16 exp_nonpos16(v16 x) {
  const v16 lo = splat16(-87.f), shift = splat16(12582912.f);
  const v16 xc = max_with(x, lo);
  const v16 n = (xc * 1.44269504088896341f + shift) - shift;
  const v16 r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
  v16 p = splat16(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  return zero_where_below(x, lo, scale_by_pow2(p, n));  // n ≥ -126 here, so the scaled exponent stays normal
}

inline float exp_nonpos(float x) { return lane(exp_nonpos16(splat16(x)), 0); }

// x[j] = e^{x[j] - m} for j < n (every x[j] ≤ m, or -inf), returning Σ_j x[j]
inline float exp_shifted(float* x, int64_t n, float m) {
  v16 acc{};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const v16 e = exp_nonpos16(load16(x + j) - m);
    store16(x + j, e);
    acc += e;
  }
  float sum = sum16(acc);
  for (; j < n; ++j) sum += (x[j] = exp_nonpos(x[j] - m));
  return sum;
}

// max_j x[j] for j < n (-inf for n = 0; a NaN is passed over). With AVX-512 vmaxps and a tree reduction (the
// includer includes <immintrin.h>): the generic form compiles to a compare and a blend per vector and 15 dependent
// scalar maxima, once per row and key block of the prompt kernels.
inline float max_of(const float* x, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512F__)
  __m512 acc = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (; j + 16 <= n; j += 16) acc = _mm512_max_ps(_mm512_loadu_ps(x + j), acc);  // NaN lanes keep acc
  float m = _mm512_reduce_max_ps(acc);
#else
  v16 acc = splat16(-std::numeric_limits<float>::infinity());
  for (; j + 16 <= n; j += 16) acc = max_with(acc, load16(x + j));
  float m = lane(acc, 0);
  for (int l = 1; l < 16; ++l) m = std::max(m, lane(acc, l));
#endif
  for (; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

inline void axpy(float* y, float a, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

inline void check_f32(const at::Tensor& x, const char* name, int64_t dim) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.is_contiguous() && x.dim() == dim,
              name, ": expected a contiguous CPU float32 tensor with ", dim, " dimensions");
}
