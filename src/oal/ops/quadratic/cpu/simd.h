// Sixteen fp32 lanes, the unit every fused kernel computes in (chunk.cpp, decode.cpp, window.cpp). With AVX-512 a
// GCC vector (one register). Without it a pair of 8-lane vectors: GCC lowers a 64-byte vector type that the target
// has no register for through the stack (each operation a round-trip through memory and general registers; on an
// AVX2 machine the register-tiled product ran at ~1/4 of torch's SDPA), while 32-byte halves stay in registers.
// Lane l of the pair is lane l % 8 of half l / 8, so both forms compute the same numbers per lane.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>  // the int8 widening
#endif

#if defined(__AVX512F__)

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

inline v16 load16(const float* p) {
  v16 x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}
inline void store16(float* p, v16 x) { std::memcpy(p, &x, sizeof(x)); }
inline v16 splat16(float x) { return v16{} + x; }
inline float lane(const v16& x, int l) { return x[l]; }
// lanes of x below lo replaced by lo
inline v16 max_with(v16 x, v16 lo) { return x < lo ? lo : x; }
// lanes where x < lo set to 0, the others taken from y
inline v16 zero_where_below(v16 x, v16 lo, v16 y) { return x < lo ? v16{} : y; }
// y · 2^n for integral-valued lanes n (the exponent bits of y plus n; the caller keeps the result normal)
inline v16 scale_by_pow2(v16 y, v16 n) {
  i32x16 bits;
  std::memcpy(&bits, &y, sizeof(bits));
  bits += __builtin_convertvector(n, i32x16) << 23;
  std::memcpy(&y, &bits, sizeof(y));
  return y;
}
// 16 bf16 numbers (the top halves of fp32) widened to fp32 lanes
inline v16 load16(const uint16_t* p) {
  typedef uint16_t u16x16 __attribute__((vector_size(32)));
  typedef uint32_t u32x16 __attribute__((vector_size(64)));
  u16x16 x;
  std::memcpy(&x, p, sizeof(x));
  const u32x16 w = __builtin_convertvector(x, u32x16) << 16;
  v16 f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
}

// 16 int8 numbers (an 8-bit exact cache's quantised keys / values) widened to fp32 lanes, exactly
// (vpmovsxbd + vcvtdq2ps: GCC lowers __builtin_convertvector from int8 lanes to one scalar conversion per lane)
inline v16 load16(const int8_t* p) {
  return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

#else

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

struct v16 {
  v8f lo, hi;
};

inline v16 operator+(v16 a, v16 b) { return {a.lo + b.lo, a.hi + b.hi}; }
inline v16 operator-(v16 a, v16 b) { return {a.lo - b.lo, a.hi - b.hi}; }
inline v16 operator*(v16 a, v16 b) { return {a.lo * b.lo, a.hi * b.hi}; }
inline v16 operator+(v16 a, float s) { return {a.lo + s, a.hi + s}; }
inline v16 operator-(v16 a, float s) { return {a.lo - s, a.hi - s}; }
inline v16 operator*(v16 a, float s) { return {a.lo * s, a.hi * s}; }
inline v16 operator*(float s, v16 a) { return {s * a.lo, s * a.hi}; }
inline v16& operator+=(v16& a, v16 b) { return a = a + b; }
inline v16& operator-=(v16& a, v16 b) { return a = a - b; }
inline v16& operator*=(v16& a, v16 b) { return a = a * b; }
inline v16& operator+=(v16& a, float s) { return a = a + s; }

inline v16 load16(const float* p) {
  v16 x;
  std::memcpy(&x.lo, p, sizeof(x.lo));
  std::memcpy(&x.hi, p + 8, sizeof(x.hi));
  return x;
}
inline void store16(float* p, v16 x) {
  std::memcpy(p, &x.lo, sizeof(x.lo));
  std::memcpy(p + 8, &x.hi, sizeof(x.hi));
}
inline v16 splat16(float x) { return {v8f{} + x, v8f{} + x}; }
inline float lane(const v16& x, int l) { return l < 8 ? x.lo[l] : x.hi[l - 8]; }
inline v16 max_with(v16 x, v16 lo) { return {x.lo < lo.lo ? lo.lo : x.lo, x.hi < lo.hi ? lo.hi : x.hi}; }
inline v16 zero_where_below(v16 x, v16 lo, v16 y) {
  return {x.lo < lo.lo ? v8f{} : y.lo, x.hi < lo.hi ? v8f{} : y.hi};
}
inline v8f scale_by_pow2(v8f y, v8f n) {
  v8i bits;
  std::memcpy(&bits, &y, sizeof(bits));
  bits += __builtin_convertvector(n, v8i) << 23;
  std::memcpy(&y, &bits, sizeof(y));
  return y;
}
inline v16 scale_by_pow2(v16 y, v16 n) { return {scale_by_pow2(y.lo, n.lo), scale_by_pow2(y.hi, n.hi)}; }
inline v8f widen_bf16(const uint16_t* p) {
  typedef uint16_t u16x8 __attribute__((vector_size(16)));
  typedef uint32_t u32x8 __attribute__((vector_size(32)));
  u16x8 x;
  std::memcpy(&x, p, sizeof(x));
  const u32x8 w = __builtin_convertvector(x, u32x8) << 16;
  v8f f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
}
inline v16 load16(const uint16_t* p) { return {widen_bf16(p), widen_bf16(p + 8)}; }
inline v8f widen_int8(const int8_t* p) {
#if defined(__AVX2__)
  return (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  v8f f;
  for (int l = 0; l < 8; ++l) f[l] = float(p[l]);
  return f;
#endif
}
inline v16 load16(const int8_t* p) { return {widen_int8(p), widen_int8(p + 8)}; }

#endif

// Σ of the 16 lanes, lane 0 first (the order of the scalar loops these replace)
inline float sum16(const v16& x) {
  float s = 0.f;
  for (int l = 0; l < 16; ++l) s += lane(x, l);
  return s;
}

// r[j] = Σ_l a[j][l] for 16 vectors: a transposing reduction tree (45 shuffles and adds for 16 sums, where one
// horizontal sum per vector (sum16, a chain of 15 dependent adds behind its lane extractions) costs about as many
// for one)
#if defined(__AVX512F__)
inline v16 sum_lanes16(const v16* a) {
  v16 b[8], c[4], e[2];
  for (int k = 0; k < 8; ++k)  // keys 2k, 2k+1: 8 partial sums each
    b[k] = __builtin_shufflevector(a[2 * k], a[2 * k + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * k], a[2 * k + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int k = 0; k < 4; ++k)  // keys 4k … 4k+3: 4 each
    c[k] = __builtin_shufflevector(b[2 * k], b[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(b[2 * k], b[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int k = 0; k < 2; ++k)  // keys 8k … 8k+7: 2 each
    e[k] = __builtin_shufflevector(c[2 * k], c[2 * k + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(c[2 * k], c[2 * k + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#else
inline v16 sum_lanes16(const v16* a) {  // the same tree on 8-lane halves, after adding each vector's two halves
  v8f s[16], b[8], c[4], e[2];
  for (int k = 0; k < 16; ++k) s[k] = a[k].lo + a[k].hi;
  for (int k = 0; k < 8; ++k)  // keys 2k, 2k+1: 4 partial sums each
    b[k] = __builtin_shufflevector(s[2 * k], s[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(s[2 * k], s[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int k = 0; k < 4; ++k)  // keys 4k … 4k+3: 2 each
    c[k] = __builtin_shufflevector(b[2 * k], b[2 * k + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(b[2 * k], b[2 * k + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  for (int k = 0; k < 2; ++k)  // keys 8k … 8k+7: 1 each
    e[k] = __builtin_shufflevector(c[2 * k], c[2 * k + 1], 0, 2, 4, 6, 8, 10, 12, 14) +
           __builtin_shufflevector(c[2 * k], c[2 * k + 1], 1, 3, 5, 7, 9, 11, 13, 15);
  return {e[0], e[1]};
}
#endif
