// Helpers shared by the fused CPU kernels decode.cpp and window.cpp (included inside their anonymous namespace;
// the loader hashes this file into the build flags, so a change to it rebuilds both).
#pragma once

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)  // without it the float reduction stays scalar (strict FP ordering)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// e^x for x ≤ 0 (softmax weights after the max is subtracted), branch-free so that loops over it vectorise;
// glibc's vector expf needs -ffast-math, which would also assume away the infinities this file relies on.
// Range reduction x = n ln2 + r, |r| ≤ ln2/2, a degree-7 Taylor-like minimax polynomial (Cephes' expf
// coefficients), 2^n from the exponent bits; below -87 (2^-126) the result is 0. Relative error ≤ 2 ulp.
inline float exp_nonpos(float x) {
  const float xc = std::max(x, -87.f);
  const float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  const float r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  int32_t bits;  // n ≥ -125 here, so the scaled exponent stays normal
  std::memcpy(&bits, &p, sizeof(bits));
  bits += static_cast<int32_t>(n) * (1 << 23);
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return x < -87.f ? 0.f : out;
}

inline void axpy(float* y, float a, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

inline void check_f32(const at::Tensor& x, const char* name, int64_t dim) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.is_contiguous() && x.dim() == dim,
              name, ": expected a contiguous CPU float32 tensor with ", dim, " dimensions");
}
