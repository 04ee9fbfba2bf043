// The register-tiled product shared by chunk.cpp and window.cpp (included inside their anonymous namespace; the
// loader hashes this file into the build flags, so a change to it rebuilds both): c (rows, 16-column panels) +=
// a (rows, kdim) · b (kdim, panels), with b's panels contiguous (kdim, 16) blocks.
#pragma once

#include "simd.h"

constexpr int64_t kTile = 16;  // columns of one panel: one v16
#if defined(__AVX512F__)
constexpr int64_t kRows = 12;  // output rows of one pass: 12 x 2 panels = 24 accumulators + 2 panel vectors of 32
#else
constexpr int64_t kRows = 6;  // AVX2: 6 rows x 1 panel = 12 accumulators (two 8-lane halves each) + 2 of 16
#endif

// c0[i, 0:16] += Σ_k a[i·lda + k] · b0[k, 0:16] for i < MR, and the same for the panel pair (b1, c1) when TWO;
// b0, b1 contiguous (kdim, 16) panels. With AVX-512, two panels per pass and 12 rows: 24 accumulators, one
// broadcast of a per two FMAs (6 rows x 1 panel in 8-lane halves, the AVX2 form, ran at ~108 GFLOP/s on one core
// of the AVX-512 machine we measure on, this one at ~160).
template <int MR, bool TWO, bool ADD>
inline void tile_kernel(const float* a, int64_t lda, const float* b0, const float* b1, int64_t kdim, float* c0,
                        float* c1, int64_t ldc) {
  v16 acc0[MR], acc1[TWO ? MR : 1];
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i) {
    acc0[i] = ADD ? load16(c0 + i * ldc) : v16{};
    if constexpr (TWO) acc1[i] = ADD ? load16(c1 + i * ldc) : v16{};
  }
  for (int64_t k = 0; k < kdim; ++k) {
    const v16 p0 = load16(b0 + k * kTile);
    v16 p1{};
    if constexpr (TWO) p1 = load16(b1 + k * kTile);
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      const float s = a[i * lda + k];
      acc0[i] += s * p0;
      if constexpr (TWO) acc1[i] += s * p1;
    }
  }
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i) {
    store16(c0 + i * ldc, acc0[i]);
    if constexpr (TWO) store16(c1 + i * ldc, acc1[i]);
  }
}

template <int MR, bool ADD>
void tile_pair(bool two, const float* a, int64_t lda, const float* b0, const float* b1, int64_t kdim, float* c0,
               float* c1, int64_t ldc) {
  if (two) {
    tile_kernel<MR, true, ADD>(a, lda, b0, b1, kdim, c0, c1, ldc);
  } else {
    tile_kernel<MR, false, ADD>(a, lda, b0, b1, kdim, c0, c1, ldc);
  }
}

// c (rows, tiles panels) += a (rows, kdim) · b (kdim, tiles panels) for rows ≤ kRows (c = … with add false: no
// zeroing pass first): panel t of b at b + t·bstride, of c at c + t·cstride (row stride ldc). Without AVX-512
// (16 vector registers) one panel per pass.
inline void tile_rows(int64_t rows, const float* a, int64_t lda, const float* b, int64_t bstride, int64_t kdim,
                      float* c, int64_t cstride, int64_t ldc, int64_t tiles, bool add = true) {
  using Fn = void (*)(bool, const float*, int64_t, const float*, const float*, int64_t, float*, float*, int64_t);
#if defined(__AVX512F__)
  static constexpr Fn by_rows[2][kRows] = {
      {tile_pair<1, false>, tile_pair<2, false>, tile_pair<3, false>, tile_pair<4, false>, tile_pair<5, false>,
       tile_pair<6, false>, tile_pair<7, false>, tile_pair<8, false>, tile_pair<9, false>, tile_pair<10, false>,
       tile_pair<11, false>, tile_pair<12, false>},
      {tile_pair<1, true>, tile_pair<2, true>, tile_pair<3, true>, tile_pair<4, true>, tile_pair<5, true>,
       tile_pair<6, true>, tile_pair<7, true>, tile_pair<8, true>, tile_pair<9, true>, tile_pair<10, true>,
       tile_pair<11, true>, tile_pair<12, true>}};
  constexpr int64_t step = 2;
#else
  static constexpr Fn by_rows[2][kRows] = {
      {tile_pair<1, false>, tile_pair<2, false>, tile_pair<3, false>, tile_pair<4, false>, tile_pair<5, false>,
       tile_pair<6, false>},
      {tile_pair<1, true>, tile_pair<2, true>, tile_pair<3, true>, tile_pair<4, true>, tile_pair<5, true>,
       tile_pair<6, true>}};
  constexpr int64_t step = 1;
#endif
  const Fn f = by_rows[add][std::clamp<int64_t>(rows, 1, kRows) - 1];
  for (int64_t t = 0; t < tiles; t += step)
    f(step == 2 && t + 1 < tiles, a, lda, b + t * bstride, b + (t + 1) * bstride, kdim, c + t * cstride,
      c + (t + 1) * cstride, ldc);
}

#if defined(__AVX512BF16__)  // the includer includes <immintrin.h> (outside its namespace)
constexpr bool kNativeBf16 = true;

// The same product on bf16 numbers with AVX512_BF16's pair dot product (vdpbf16ps: per fp32 lane two products,
// exact in fp32, added to the accumulator), twice the fp32 FMA rate per instruction: c0[i, 0:16] (+)= Σ_k
// a[i·lda + k] · b0[k, 0:16] for i < MR over kdim = 2·kp, a bf16 rows (pairs (a[2p], a[2p+1]) contiguous), b0 a
// pair panel: for pair p the 16 columns' (b[2p, c], b[2p+1, c]) interleaved, 32 bf16 per pair.
template <int MR, bool TWO>
inline void tile_kernel_bf16(const uint16_t* a, int64_t lda, const uint16_t* b0, const uint16_t* b1, int64_t kp,
                             float* c0, float* c1, int64_t ldc, bool add) {
  __m512 acc0[MR], acc1[TWO ? MR : 1];
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i) {
    acc0[i] = add ? _mm512_loadu_ps(c0 + i * ldc) : _mm512_setzero_ps();
    if constexpr (TWO) acc1[i] = add ? _mm512_loadu_ps(c1 + i * ldc) : _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < kp; ++p) {
    const __m512bh p0 = (__m512bh)_mm512_loadu_si512(b0 + p * 2 * kTile);
    __m512bh p1{};
    if constexpr (TWO) p1 = (__m512bh)_mm512_loadu_si512(b1 + p * 2 * kTile);
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      int32_t pair;
      std::memcpy(&pair, a + i * lda + 2 * p, sizeof(pair));
      const __m512bh s = (__m512bh)_mm512_set1_epi32(pair);
      acc0[i] = _mm512_dpbf16_ps(acc0[i], s, p0);
      if constexpr (TWO) acc1[i] = _mm512_dpbf16_ps(acc1[i], s, p1);
    }
  }
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i) {
    _mm512_storeu_ps(c0 + i * ldc, acc0[i]);
    if constexpr (TWO) _mm512_storeu_ps(c1 + i * ldc, acc1[i]);
  }
}

template <int MR>
void tile_pair_bf16(bool two, const uint16_t* a, int64_t lda, const uint16_t* b0, const uint16_t* b1, int64_t kp,
                    float* c0, float* c1, int64_t ldc, bool add) {
  if (two) {
    tile_kernel_bf16<MR, true>(a, lda, b0, b1, kp, c0, c1, ldc, add);
  } else {
    tile_kernel_bf16<MR, false>(a, lda, b0, b1, kp, c0, c1, ldc, add);
  }
}

// tile_rows on bf16 numbers: c (rows ≤ kRows, tiles panels) (+)= a (rows, 2·kp) · b (2·kp, tiles pair panels),
// panel t of b at b + t·bstride, of c at c + t·cstride.
inline void tile_rows_bf16(int64_t rows, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t bstride,
                           int64_t kp, float* c, int64_t cstride, int64_t ldc, int64_t tiles, bool add) {
  using Fn = void (*)(bool, const uint16_t*, int64_t, const uint16_t*, const uint16_t*, int64_t, float*, float*,
                      int64_t, bool);
  static constexpr Fn by_rows[kRows] = {tile_pair_bf16<1>, tile_pair_bf16<2>,  tile_pair_bf16<3>,
                                        tile_pair_bf16<4>, tile_pair_bf16<5>,  tile_pair_bf16<6>,
                                        tile_pair_bf16<7>, tile_pair_bf16<8>,  tile_pair_bf16<9>,
                                        tile_pair_bf16<10>, tile_pair_bf16<11>, tile_pair_bf16<12>};
  const Fn f = by_rows[std::clamp<int64_t>(rows, 1, kRows) - 1];
  for (int64_t t = 0; t < tiles; t += 2)
    f(t + 1 < tiles, a, lda, b + t * bstride, b + (t + 1) * bstride, kp, c + t * cstride, c + (t + 1) * cstride, ldc,
      add);
}
#else
constexpr bool kNativeBf16 = false;
#endif
