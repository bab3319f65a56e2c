// Native kernels of fastlm (engine v2): AVX-512 (F, BW, DQ, VL, BF16) + at::parallel_for, and AMX-BF16 for
// wide blocks where the CPU has it (mm_int8_amx; never called elsewhere, so the library loads on any AVX-512-BF16
// CPU).
//
// Every function here is deterministic by construction: each output element is computed by a fixed
// sequence of operations that depends only on its own inputs (its query, the keys it may see, fixed
// chunk boundaries), never on the batch size, the row it sits in, the thread count or how work is split.
// That is what lets a cache hit be bitwise identical to a full-prompt answer and a batched answer be
// bitwise identical to a single one.
// ATen and torch's pybind11 casters, not <torch/extension.h>: the kernels use at:: only, and the whole C++
// frontend's headers doubled the compile time of a fresh machine's first start (16 s of 30 s).
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cmath>
#include <cstring>
#include <algorithm>
#include <limits>
#include <vector>

namespace {

inline float bf2f(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f2bf(float f) {  // round to nearest even, like torch (NaN kept as NaN)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// 16 bf16 -> 16 fp32 (exact)
inline __m512 load_bf16x16(const uint16_t* p) {
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// 16 fp32 -> 16 bf16, round to nearest even (finite inputs)
inline void store_bf16x16(uint16_t* p, __m512 x) {
  __m256bh r = _mm512_cvtneps_pbh(x);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)r);
}

// exp for x <= ~88; fixed polynomial (max rel. error ~2 ulp), identical for every lane position
inline __m512 exp512(__m512 x) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 ln2hi = _mm512_set1_ps(0.693359375f);
  const __m512 ln2lo = _mm512_set1_ps(-2.12194440e-4f);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  x = _mm512_min_ps(x, _mm512_set1_ps(88.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, ln2hi, x);
  r = _mm512_fnmadd_ps(n, ln2lo, r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  __m512 r2 = _mm512_mul_ps(r, r);
  p = _mm512_fmadd_ps(p, r2, r);
  p = _mm512_add_ps(p, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// ------------------------------------------------------------------------------------------------
// Attention. Keys are processed in chunks with fixed boundaries (multiples of CHUNK from the start of the
// prefix, and from the start of each row's suffix). For one query and one chunk, a "partial" holds the
// softmax statistics (max m, sum l) and the unnormalised output o; partials are merged in chunk order
// (prefix chunks, then suffix chunks). A query's result therefore depends only on its own inputs: not on
// the batch, the thread count or which work item computed which chunk.
//
// Per chunk: the keys are transposed once into pair-major layout (KT[p][t] = bf16 pair p of key t), so
// scores of 16 keys are one dpbf16 chain per query without horizontal sums; the weights p = exp(s - m)
// are rounded to bf16 (l sums the rounded weights) and multiplied with values interleaved by key pairs,
// again with dpbf16. Scores, statistics and accumulation are fp32.

constexpr int CHUNK = 256;

struct Partial {
  float m, l;
};

// transpose a 16x16 matrix of 32-bit elements held in 16 registers (rows -> columns): four butterfly stages
// swapping the off-diagonal b x b blocks, b = 8, 4, 2, 1
alignas(64) static const int kTransposeIdx[4][2][16] = {
    {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}, {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}},
    {{0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27}, {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31}},
    {{0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}, {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31}},
    {{0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}, {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}},
};

template <int S>
inline void transpose_stage(__m512i* r) {
  constexpr int b = 8 >> S;
  const __m512i il = _mm512_load_si512(kTransposeIdx[S][0]), ih = _mm512_load_si512(kTransposeIdx[S][1]);
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    if (i & b) continue;
    const __m512i a = r[i], c = r[i + b];
    r[i] = _mm512_permutex2var_epi32(a, il, c);
    r[i + b] = _mm512_permutex2var_epi32(a, ih, c);
  }
}

inline void transpose16(__m512i* r) {
  transpose_stage<0>(r);
  transpose_stage<1>(r);
  transpose_stage<2>(r);
  transpose_stage<3>(r);
}

template <int D>
struct Attn {
  static constexpr int NP = D / 2;   // bf16 pairs per row
  static constexpr int NV = D / 16;  // fp32 vectors per output row
  static constexpr int QT = 6;                // queries per tile (scored together)
  static constexpr int PQ = D == 64 ? 4 : 2;  // queries whose values are accumulated together

  // output lane e of accumulator vector v holds dimension dim_of(v, e) (the key-pair interleave order)
  static inline int dim_of(int v, int e) { return 32 * (v / 2) + 8 * (e / 4) + 4 * (v % 2) + (e % 4); }

  // KT[p * CHUNK + t] = pair p of key t for t < n; zero rows up to the next multiple of 16
  static void transpose_keys(const uint16_t* k, int64_t ks, int n, uint32_t* KT) {
    for (int t0 = 0; t0 < n; t0 += 16) {
      const bool full = t0 + 16 <= n;
      for (int pb = 0; pb < NP; pb += 16) {
        __m512i r[16];
        if (full) {
#pragma GCC unroll 16
          for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(k + (t0 + j) * ks + 2 * pb);
        } else {
          for (int j = 0; j < 16; ++j)
            r[j] = (t0 + j < n) ? _mm512_loadu_si512(k + (t0 + j) * ks + 2 * pb) : _mm512_setzero_si512();
        }
        transpose16(r);
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) _mm512_storeu_si512(KT + (pb + j) * CHUNK + t0, r[j]);
      }
    }
  }

  // One chunk for a tile of NQ queries (pre-scaled bf16, viewed as NP pairs each): keys [0, nmax) of the
  // chunk (transposed in KT, values v with row stride vs); query i sees the first lim[i] keys. next_v,
  // next_k: the chunk that comes next, fetched into cache meanwhile (or null).
  template <int NQ>
  static void chunk(const uint32_t* const* q, const uint32_t* KT, const uint16_t* v, int64_t vs, const int* lim,
                    float* s, uint16_t* pb, Partial* part, float* o, const uint16_t* next_v, const uint16_t* next_k) {
    int nmax = 0;
    for (int i = 0; i < NQ; ++i) nmax = std::max(nmax, lim[i]);
    // scores, KB * 16 keys at a time; two chains (even / odd pairs) per query and key, added at the end. All
    // the tile's queries share each key vector loaded (the keys come from L2), and 4 * KB * NQ independent
    // chains keep dpbf16 busy; every key's chain is the same whatever KB and NQ.
    constexpr int KB = NQ <= 2 ? 4 : 2;
    for (int t0 = 0; t0 < nmax; t0 += 16 * KB) {
      __m512 a0[NQ][KB], a1[NQ][KB];
      for (int i = 0; i < NQ; ++i)
        for (int b = 0; b < KB; ++b) { a0[i][b] = _mm512_setzero_ps(); a1[i][b] = _mm512_setzero_ps(); }
      for (int p = 0; p < NP; p += 2) {
        if (next_k) {  // the next chunk's keys (CHUNK rows of D, contiguous), a few lines per step: issued
                       // all at once, during the transposition, most of them were dropped
          constexpr int ITER = CHUNK / (16 * KB) * (NP / 2), LINES = CHUNK * D * 2 / 64 / ITER;
          const int it = t0 / (16 * KB) * (NP / 2) + p / 2;
          for (int l = 0; l < LINES; ++l)
            _mm_prefetch(reinterpret_cast<const char*>(next_k) + 64 * (it * LINES + l), _MM_HINT_T1);
        }
        __m512bh k0[KB], k1[KB];
        for (int b = 0; b < KB; ++b) {
          k0[b] = (__m512bh)_mm512_loadu_si512(KT + p * CHUNK + t0 + 16 * b);
          k1[b] = (__m512bh)_mm512_loadu_si512(KT + (p + 1) * CHUNK + t0 + 16 * b);
        }
        for (int i = 0; i < NQ; ++i) {
          const __m512bh q0 = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[i][p]));
          const __m512bh q1 = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[i][p + 1]));
          for (int b = 0; b < KB; ++b) {
            a0[i][b] = _mm512_dpbf16_ps(a0[i][b], q0, k0[b]);
            a1[i][b] = _mm512_dpbf16_ps(a1[i][b], q1, k1[b]);
          }
        }
      }
      for (int i = 0; i < NQ; ++i)
        for (int b = 0; b < KB; ++b)
          _mm512_storeu_ps(s + i * CHUNK + t0 + 16 * b, _mm512_add_ps(a0[i][b], a1[i][b]));
    }
    // softmax statistics; weights rounded to bf16, l sums the rounded weights
    for (int i = 0; i < NQ; ++i) {
      const int li = lim[i];
      float* si = s + i * CHUNK;
      uint16_t* pi = pb + i * CHUNK;
      if (li <= 0) {
        part[i] = {-std::numeric_limits<float>::infinity(), 0.f};
        continue;
      }
      __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int t = 0; t < li; t += 16) {
        const __mmask16 mk = (li - t >= 16) ? 0xffff : (__mmask16)((1u << (li - t)) - 1);
        mv = _mm512_mask_max_ps(mv, mk, mv, _mm512_loadu_ps(si + t));
      }
      const float m = _mm512_reduce_max_ps(mv);
      const __m512 mm = _mm512_set1_ps(m);
      __m512 lv = _mm512_setzero_ps();
      for (int t = 0; t < li; t += 16) {
        const __mmask16 mk = (li - t >= 16) ? 0xffff : (__mmask16)((1u << (li - t)) - 1);
        const __m512 p = _mm512_maskz_mov_ps(mk, exp512(_mm512_sub_ps(_mm512_loadu_ps(si + t), mm)));
        __m256bh pbv = _mm512_cvtneps_pbh(p);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pi + t), (__m256i)pbv);
        lv = _mm512_add_ps(lv, load_bf16x16(pi + t));
      }
      part[i] = {m, _mm512_reduce_add_ps(lv)};
    }
    // o = sum_t p_t v_t, PQ queries at a time (their accumulators fill the registers)
    for (int i0 = 0; i0 < NQ; i0 += PQ) {
      const int ng = std::min(PQ, NQ - i0);
      switch (ng) {
        case 1: values<1>(i0, v, vs, lim, pb, o, i0 == 0 ? next_v : nullptr); break;
        case 2: values<2>(i0, v, vs, lim, pb, o, i0 == 0 ? next_v : nullptr); break;
        case 3: if constexpr (PQ >= 3) values<3>(i0, v, vs, lim, pb, o, i0 == 0 ? next_v : nullptr); break;
        default: if constexpr (PQ >= 4) values<4>(i0, v, vs, lim, pb, o, i0 == 0 ? next_v : nullptr); break;
      }
    }
  }

  // o[i] = sum_t p_t v_t for queries i0 .. i0 + NG - 1, over key pairs (t, t + 1) in key order; each query
  // stops at its own limit
  template <int NG>
  static void values(int i0, const uint16_t* v, int64_t vs, const int* lim, const uint16_t* pb, float* o,
                     const uint16_t* next_v) {
    int nmax = 0;
    for (int i = i0; i < i0 + NG; ++i) nmax = std::max(nmax, lim[i]);
    __m512 acc[NG][NV];
    for (int i = 0; i < NG; ++i)
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int t = 0; t < nmax; t += 2) {
      if (next_v)  // values of the chunk that comes next
        for (int line = 0; line < D * 4; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(next_v + t * vs) + line, _MM_HINT_T1);
      __m512i x[NV];
      const uint16_t* v0 = v + t * vs;
      const bool second = t + 1 < nmax;
      for (int b = 0; b < D / 32; ++b) {
        const __m512i va = _mm512_loadu_si512(v0 + 32 * b);
        const __m512i vb = second ? _mm512_loadu_si512(v0 + vs + 32 * b) : _mm512_setzero_si512();
        x[2 * b] = _mm512_unpacklo_epi16(va, vb);
        x[2 * b + 1] = _mm512_unpackhi_epi16(va, vb);
      }
      for (int i = 0; i < NG; ++i) {
        if (t >= lim[i0 + i]) continue;
        uint32_t pair;
        std::memcpy(&pair, pb + (i0 + i) * CHUNK + t, 4);
        const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
        for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], pp, (__m512bh)x[j]);
      }
    }
    for (int i = 0; i < NG; ++i)
      for (int j = 0; j < NV; ++j) _mm512_storeu_ps(o + (i0 + i) * D + 16 * j, acc[i][j]);
  }

  static void chunk_n(int nq, const uint32_t* const* q, const uint32_t* KT, const uint16_t* v, int64_t vs,
                      const int* lim, float* s, uint16_t* pb, Partial* part, float* o, const uint16_t* next_v,
                      const uint16_t* next_k) {
    switch (nq) {
      case 1: chunk<1>(q, KT, v, vs, lim, s, pb, part, o, next_v, next_k); break;
      case 2: chunk<2>(q, KT, v, vs, lim, s, pb, part, o, next_v, next_k); break;
      case 3: chunk<3>(q, KT, v, vs, lim, s, pb, part, o, next_v, next_k); break;
      case 4: chunk<4>(q, KT, v, vs, lim, s, pb, part, o, next_v, next_k); break;
      case 5: chunk<5>(q, KT, v, vs, lim, s, pb, part, o, next_v, next_k); break;
      default: chunk<6>(q, KT, v, vs, lim, s, pb, part, o, next_v, next_k); break;
    }
  }

  // running merge (M, L, O) <- (M, L, O) + (m, l, o); the same code for every query
  static inline void merge(float& M, float& L, float* O, const Partial& p, const float* o) {
    if (p.l == 0.f) return;
    if (L == 0.f) {
      M = p.m;
      L = p.l;
      std::memcpy(O, o, sizeof(float) * D);
      return;
    }
    const float Mn = std::max(M, p.m);
    const float a = std::exp(M - Mn), b = std::exp(p.m - Mn);
    L = L * a + p.l * b;
    const __m512 av = _mm512_set1_ps(a), bv = _mm512_set1_ps(b);
    for (int j = 0; j < NV; ++j)
      _mm512_storeu_ps(O + 16 * j, _mm512_fmadd_ps(_mm512_loadu_ps(O + 16 * j), av,
                                                   _mm512_mul_ps(_mm512_loadu_ps(o + 16 * j), bv)));
    M = Mn;
  }

  static inline void finish(float L, const float* O, uint16_t* out) {
    alignas(64) float ordered[D];
    for (int v = 0; v < NV; ++v)
      for (int e = 0; e < 16; ++e) ordered[dim_of(v, e)] = O[16 * v + e];
    const __m512 inv = _mm512_set1_ps(1.0f / L);
    for (int j = 0; j < NV; ++j) store_bf16x16(out + 16 * j, _mm512_mul_ps(_mm512_load_ps(ordered + 16 * j), inv));
  }
};

struct AttnArgs {
  const uint16_t* q;  // [R, W, KV, G, D] contiguous
  uint16_t* out;      // same layout
  const uint16_t *pk, *pv;
  int64_t pk_h, pk_t, pv_h, pv_t;  // prefix strides (head, token)
  int64_t P;
  const uint16_t *sk, *sv;
  int64_t sk_r, sk_h, sk_t, sv_r, sv_h, sv_t;  // suffix strides (row, head, token)
  const int64_t* start;
  int64_t R, W, KV, G;
};

template <int D>
void attend_impl(const AttnArgs& A) {
  using K = Attn<D>;
  constexpr int QT = K::QT;
  const int64_t per_row = A.W * A.G;  // queries per (row, kv head), n = w * G + g
  const int64_t tiles_per_row = (per_row + QT - 1) / QT;
  const int64_t n_tiles = A.R * A.KV * tiles_per_row;  // tile = (r * KV + h) * tiles_per_row + tr
  const int64_t n_pchunks = (A.P + CHUNK - 1) / CHUNK;
  int64_t n_schunks = 0;
  for (int64_t r = 0; r < A.R; ++r) n_schunks = std::max(n_schunks, (A.start[r] + A.W + CHUNK - 1) / CHUNK);
  const int64_t slots = n_pchunks + n_schunks;

  std::vector<Partial> pstat(static_cast<size_t>(n_tiles) * slots * QT, Partial{0.f, 0.f});
  std::vector<float> pbuf(static_cast<size_t>(n_tiles) * slots * QT * D);

  // the tile's queries (as pair pointers), its number of queries and their suffix limits
  auto tile_queries = [&](int64_t tile, const uint32_t** qp, int* slim) {
    const int64_t tr = tile % tiles_per_row, h = (tile / tiles_per_row) % A.KV, r = tile / (tiles_per_row * A.KV);
    int nq = 0;
    for (int64_t n = tr * QT; n < std::min<int64_t>(per_row, tr * QT + QT); ++n, ++nq) {
      const int64_t w = n / A.G, g = n % A.G;
      qp[nq] = reinterpret_cast<const uint32_t*>(A.q + (((r * A.W + w) * A.KV + h) * A.G + g) * D);
      slim[nq] = static_cast<int>(A.start[r] + w + 1);
    }
    return nq;
  };

  const int64_t prefix_items = A.KV * n_pchunks;
  const int64_t suffix_items = A.R * A.KV * n_schunks;
  at::parallel_for(0, prefix_items + suffix_items, 1, [&](int64_t b, int64_t e) {
    std::vector<uint32_t> KT(static_cast<size_t>(K::NP) * CHUNK);
    std::vector<float> s(QT * CHUNK);
    std::vector<uint16_t> pb(QT * CHUNK + 16, 0);
    for (int64_t item = b; item < e; ++item) {
      int64_t r0, r1, h, c, slot_c;
      const uint16_t *kp, *vp;
      int64_t ks, vs;
      int n;
      bool is_prefix = item < prefix_items;
      if (is_prefix) {
        h = item / n_pchunks, c = item % n_pchunks;
        r0 = 0, r1 = A.R, slot_c = c;
        n = static_cast<int>(std::min<int64_t>(CHUNK, A.P - c * CHUNK));
        kp = A.pk + h * A.pk_h + c * CHUNK * A.pk_t, ks = A.pk_t;
        vp = A.pv + h * A.pv_h + c * CHUNK * A.pv_t, vs = A.pv_t;
      } else {
        const int64_t j = item - prefix_items;
        c = j % n_schunks, h = (j / n_schunks) % A.KV, r0 = j / (n_schunks * A.KV), r1 = r0 + 1;
        slot_c = n_pchunks + c;
        const int64_t filled = A.start[r0] + A.W;  // suffix slots this block can see
        if (filled <= c * CHUNK) continue;
        n = static_cast<int>(std::min<int64_t>(CHUNK, filled - c * CHUNK));
        kp = A.sk + r0 * A.sk_r + h * A.sk_h + c * CHUNK * A.sk_t, ks = A.sk_t;
        vp = A.sv + r0 * A.sv_r + h * A.sv_h + c * CHUNK * A.sv_t, vs = A.sv_t;
      }
      // prefetch the next prefix chunk (of this head, or the next head's first) while this one is computed
      // (the keys as CHUNK contiguous rows: where the prefix's rows have gaps, only the values)
      const uint16_t *next_k = nullptr, *next_v = nullptr;
      if (is_prefix && c + 1 < n_pchunks) {
        next_k = kp + CHUNK * ks;
        next_v = vp + CHUNK * vs;
      } else if (is_prefix && h + 1 < A.KV) {
        next_k = A.pk + (h + 1) * A.pk_h;
        next_v = A.pv + (h + 1) * A.pv_h;
      }
      if (A.pk_t != D) next_k = nullptr;
      K::transpose_keys(kp, ks, n, KT.data());
      bool first_tile = true;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t tr = 0; tr < tiles_per_row; ++tr) {
          const int64_t tile = (r * A.KV + h) * tiles_per_row + tr;
          const uint32_t* qp[QT];
          int slim[QT], lim[QT];
          const int nq = tile_queries(tile, qp, slim);
          bool any = false;
          for (int i = 0; i < nq; ++i) {
            lim[i] = is_prefix ? n : static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(n, slim[i] - c * CHUNK)));
            any = any || lim[i] > 0;
          }
          if (!any) continue;
          const size_t slot = static_cast<size_t>(tile) * slots + slot_c;
          K::chunk_n(nq, qp, KT.data(), vp, vs, lim, s.data(), pb.data(), pstat.data() + slot * QT,
                     pbuf.data() + slot * QT * D, first_tile ? next_v : nullptr, first_tile ? next_k : nullptr);
          first_tile = false;
        }
      }
    }
  });
  at::parallel_for(0, n_tiles, 1, [&](int64_t b, int64_t e) {
    alignas(64) float O[QT * D];
    for (int64_t tile = b; tile < e; ++tile) {
      const uint32_t* qp[QT];
      int slim[QT];
      const int nq = tile_queries(tile, qp, slim);
      for (int i = 0; i < nq; ++i) {
        float M = -std::numeric_limits<float>::infinity(), L = 0.f;
        for (int64_t c = 0; c < slots; ++c) {
          const size_t at = (static_cast<size_t>(tile) * slots + c) * QT + i;
          K::merge(M, L, O + i * D, pstat[at], pbuf.data() + at * D);
        }
        uint16_t* out = A.out + (reinterpret_cast<const uint16_t*>(qp[i]) - A.q);
        K::finish(L, O + i * D, out);
      }
    }
  });
}

const uint16_t* u16(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }
uint16_t* u16m(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

void check_bf16_lastdim(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, " must be bfloat16");
  TORCH_CHECK(t.stride(-1) == 1, name, " must have a contiguous last dimension");
}

}  // namespace

// q, out: [R, W, KV, G, D] bf16 contiguous; pk/pv: [KV, P, D] (P may be 0); sk/sv: [R, KV, CAP, D];
// start: int64 [R]. Query w of row r sees every prefix key and suffix keys [0, start[r] + w + 1).
void attend(at::Tensor q, at::Tensor pk, at::Tensor pv, at::Tensor sk, at::Tensor sv, at::Tensor start,
            at::Tensor out) {
  TORCH_CHECK(q.dim() == 5 && q.is_contiguous() && out.is_contiguous() && q.sizes() == out.sizes());
  check_bf16_lastdim(q, "q");
  check_bf16_lastdim(sk, "suffix keys");
  check_bf16_lastdim(sv, "suffix values");
  TORCH_CHECK(start.scalar_type() == at::kLong && start.is_contiguous());
  AttnArgs A{};
  A.q = u16(q);
  A.out = u16m(out);
  A.R = q.size(0); A.W = q.size(1); A.KV = q.size(2); A.G = q.size(3);
  const int64_t D = q.size(4);
  A.P = pk.numel() ? pk.size(1) : 0;
  if (A.P) {
    check_bf16_lastdim(pk, "prefix keys");
    check_bf16_lastdim(pv, "prefix values");
    TORCH_CHECK(pk.size(0) == A.KV && pk.size(2) == D && pv.sizes() == pk.sizes());
    A.pk = u16(pk); A.pv = u16(pv);
    A.pk_h = pk.stride(0); A.pk_t = pk.stride(1); A.pv_h = pv.stride(0); A.pv_t = pv.stride(1);
  }
  TORCH_CHECK(sk.size(0) == A.R && sk.size(1) == A.KV && sk.size(3) == D && sv.sizes() == sk.sizes());
  A.sk = u16(sk); A.sv = u16(sv);
  A.sk_r = sk.stride(0); A.sk_h = sk.stride(1); A.sk_t = sk.stride(2);
  A.sv_r = sv.stride(0); A.sv_h = sv.stride(1); A.sv_t = sv.stride(2);
  A.start = start.data_ptr<int64_t>();
  for (int64_t r = 0; r < A.R; ++r) TORCH_CHECK(A.start[r] + A.W <= sk.size(2), "suffix buffer too small");
  if (D == 64) attend_impl<64>(A);
  else if (D == 128) attend_impl<128>(A);
  else TORCH_CHECK(false, "head_dim must be 64 or 128");
}


// ------------------------------------------------------------------------------------------------
// int8 weight x bf16 activation products (every linear of the model, any number of rows):
//   y[m, n] = bf16(scale[n] * sum_k w[n, k] * x[m, k])
// Weights are packed once as int8 [N/16, K/2, 16, 2]: for a block of 16 output channels and a pair of
// inputs (2kp, 2kp + 1), 32 consecutive bytes. They are converted to bf16 exactly (|w| <= 127) and
// multiplied with dpbf16: each lane accumulates one output channel in fp32, with two chains (even and odd
// input pairs) added at the end. No horizontal sums; every output is the same fixed sequence of
// operations whatever M, the tiling or the thread count (so rows are bitwise independent of the batch).

at::Tensor pack_int8(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous());
  const int64_t N = w.size(0), K = w.size(1), NB = (N + 15) / 16;
  TORCH_CHECK(K % 2 == 0, "K must be even");
  auto out = at::zeros({NB, K / 2, 16, 2}, w.options());
  const int8_t* src = w.data_ptr<int8_t>();
  int8_t* dst = out.data_ptr<int8_t>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) dst[(((n / 16) * (K / 2) + k / 2) * 16 + n % 16) * 2 + k % 2] = src[n * K + k];
  return out;
}

// 32 packed int8 (16 channels x one input pair) -> 16 bf16 pairs, exact
inline __m512bh int8_pairs_to_bf16(const int8_t* p) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

inline void store_out(uint16_t* y, int64_t valid, __m512 v) {
  __m256bh b = _mm512_cvtneps_pbh(v);
  if (valid >= 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), (__m256i)b);
  else _mm256_mask_storeu_epi16(y, (__mmask16)((1u << valid) - 1), (__m256i)b);
}

// MT rows of x against BN blocks of 16 channels, weights read (and converted) straight from the packed
// int8: for few rows, where converting once into a scratch buffer would not pay.
template <int MT, int BN>
inline void mm_direct(const uint32_t* x, int64_t KP, const int8_t* wb, int64_t nb, int64_t N, const float* sc,
                      uint16_t* y) {
  __m512 e[MT][BN], o[MT][BN];
  for (int m = 0; m < MT; ++m)
    for (int b = 0; b < BN; ++b) { e[m][b] = _mm512_setzero_ps(); o[m][b] = _mm512_setzero_ps(); }
  for (int64_t kp = 0; kp < KP; kp += 2) {
    for (int b = 0; b < BN; ++b) {
      const int8_t* p = wb + ((nb + b) * KP + kp) * 32;
      _mm_prefetch(reinterpret_cast<const char*>(p + 4096), _MM_HINT_T0);
      const __m512bh w0 = int8_pairs_to_bf16(p);
      const __m512bh w1 = int8_pairs_to_bf16(p + 32);
      for (int m = 0; m < MT; ++m) {
        e[m][b] = _mm512_dpbf16_ps(e[m][b], (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * KP + kp])), w0);
        o[m][b] = _mm512_dpbf16_ps(o[m][b], (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * KP + kp + 1])), w1);
      }
    }
  }
  for (int b = 0; b < BN; ++b) {
    const int64_t n0 = (nb + b) * 16;
    const __m512 s = _mm512_loadu_ps(sc + n0);
    for (int m = 0; m < MT; ++m) store_out(y + m * N + n0, N - n0, _mm512_mul_ps(_mm512_add_ps(e[m][b], o[m][b]), s));
  }
}

// MT rows of x against one block of 16 channels whose weights are already bf16 (scratch, KP vectors)
template <int MT>
inline void mm_block(const uint32_t* x, int64_t KP, const __m512bh* wv, int64_t nb, int64_t N, const float* sc,
                     uint16_t* y) {
  __m512 e[MT], o[MT];
  for (int m = 0; m < MT; ++m) { e[m] = _mm512_setzero_ps(); o[m] = _mm512_setzero_ps(); }
  for (int64_t kp = 0; kp < KP; kp += 2) {
    const __m512bh w0 = wv[kp], w1 = wv[kp + 1];
    for (int m = 0; m < MT; ++m) {
      e[m] = _mm512_dpbf16_ps(e[m], (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * KP + kp])), w0);
      o[m] = _mm512_dpbf16_ps(o[m], (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * KP + kp + 1])), w1);
    }
  }
  const int64_t n0 = nb * 16;
  const __m512 s = _mm512_loadu_ps(sc + n0);
  for (int m = 0; m < MT; ++m) store_out(y + m * N + n0, N - n0, _mm512_mul_ps(_mm512_add_ps(e[m], o[m]), s));
}

// x bf16 [M, K]; wp = pack_int8(w); scale bf16 [N] -> y bf16 [M, N]
at::Tensor mm_int8(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16);
  TORCH_CHECK(wp.dim() == 4 && wp.is_contiguous() && wp.size(2) == 16 && wp.size(3) == 2);
  const int64_t M = x.size(0), K = x.size(1), KP = K / 2, N = scale.numel(), NB = wp.size(0);
  TORCH_CHECK(wp.size(1) == KP && NB == (N + 15) / 16 && KP % 2 == 0, "packed weight does not match x / scale");
  auto y = at::empty({M, N}, x.options());
  std::vector<float> sc(NB * 16, 0.f);
  const uint16_t* sp = u16(scale);
  for (int64_t n = 0; n < N; ++n) sc[n] = bf2f(sp[n]);
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x.data_ptr());
  const int8_t* wb = wp.data_ptr<int8_t>();
  uint16_t* yp = u16m(y);
  if (M <= 4) {  // decode: stream the weights once, 2-4 channel blocks at a time, no scratch
    at::parallel_for(0, (NB + 3) / 4, 4, [&](int64_t b, int64_t e) {
      for (int64_t g = b; g < e; ++g) {
        const int64_t nb = g * 4, bn = std::min<int64_t>(4, NB - nb);
        if (M >= 3) {  // two blocks at a time keep the accumulators in registers
          for (int64_t h = 0; h < bn; h += 2) {
            const bool two = bn - h >= 2;
            if (M == 4) two ? mm_direct<4, 2>(xp, KP, wb, nb + h, N, sc.data(), yp)
                            : mm_direct<4, 1>(xp, KP, wb, nb + h, N, sc.data(), yp);
            else two ? mm_direct<3, 2>(xp, KP, wb, nb + h, N, sc.data(), yp)
                     : mm_direct<3, 1>(xp, KP, wb, nb + h, N, sc.data(), yp);
          }
        } else if (M == 2) {
          switch (bn) {
            case 4: mm_direct<2, 4>(xp, KP, wb, nb, N, sc.data(), yp); break;
            case 3: mm_direct<2, 3>(xp, KP, wb, nb, N, sc.data(), yp); break;
            case 2: mm_direct<2, 2>(xp, KP, wb, nb, N, sc.data(), yp); break;
            default: mm_direct<2, 1>(xp, KP, wb, nb, N, sc.data(), yp); break;
          }
        } else {
          switch (bn) {
            case 4: mm_direct<1, 4>(xp, KP, wb, nb, N, sc.data(), yp); break;
            case 3: mm_direct<1, 3>(xp, KP, wb, nb, N, sc.data(), yp); break;
            case 2: mm_direct<1, 2>(xp, KP, wb, nb, N, sc.data(), yp); break;
            default: mm_direct<1, 1>(xp, KP, wb, nb, N, sc.data(), yp); break;
          }
        }
      }
    });
    return y;
  }
  at::parallel_for(0, NB, 1, [&](int64_t b, int64_t e) {
    std::vector<__m512bh> wv(KP);
    for (int64_t nb = b; nb < e; ++nb) {
      for (int64_t kp = 0; kp < KP; ++kp) wv[kp] = int8_pairs_to_bf16(wb + (nb * KP + kp) * 32);
      int64_t m = 0;
      for (; m + 8 <= M; m += 8) mm_block<8>(xp + m * KP, KP, wv.data(), nb, N, sc.data(), yp + m * N);
      switch (M - m) {
        case 7: mm_block<7>(xp + m * KP, KP, wv.data(), nb, N, sc.data(), yp + m * N); break;
        case 6: mm_block<6>(xp + m * KP, KP, wv.data(), nb, N, sc.data(), yp + m * N); break;
        case 5: mm_block<5>(xp + m * KP, KP, wv.data(), nb, N, sc.data(), yp + m * N); break;
        case 4: mm_block<4>(xp + m * KP, KP, wv.data(), nb, N, sc.data(), yp + m * N); break;
        case 3: mm_block<3>(xp + m * KP, KP, wv.data(), nb, N, sc.data(), yp + m * N); break;
        case 2: mm_block<2>(xp + m * KP, KP, wv.data(), nb, N, sc.data(), yp + m * N); break;
        case 1: mm_block<1>(xp + m * KP, KP, wv.data(), nb, N, sc.data(), yp + m * N); break;
        default: break;
      }
    }
  });
  return y;
}

#include "fastlm_q4k.h"

// ------------------------------------------------------------------------------------------------
// The same product with AMX tiles, for blocks of many rows (prefill): y[m, n] = bf16(scale[n] * sum_k ...),
// from the same packed weights. Each thread converts two 16-channel blocks of int8 weights to bf16 once (the
// packed [K/2, 16, 2] layout is exactly a B tile's pair-interleaved rows) and multiplies every 32 rows of x
// against them (2 x 2 accumulator tiles; 2 x 1 for a last 16 rows), 32 inputs per tile product, in order. A row's result depends
// on its own inputs only (tiles compute rows independently; rows past M are zero padding that is never
// stored), and threads split output channels, never the sum, so rows are bitwise independent of the batch and
// of the thread count, like mm_int8, whose results they match up to the order of summation.

// The kernel may use AMX tiles only once the OS has granted this process the tile state (Linux >= 5.16).
bool amx_ready() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// x bf16 [M, K] (K a multiple of 32); wp = pack_int8(w); scale bf16 [N] -> y bf16 [M, N]
at::Tensor mm_int8_amx(const at::Tensor& x_in, const at::Tensor& wp, const at::Tensor& scale) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.is_contiguous() && x_in.scalar_type() == at::kBFloat16);
  TORCH_CHECK(wp.dim() == 4 && wp.is_contiguous() && wp.size(2) == 16 && wp.size(3) == 2);
  TORCH_CHECK(amx_ready(), "the OS did not grant AMX tile state to this process");
  const int64_t M = x_in.size(0), K = x_in.size(1), KP = K / 2, N = scale.numel(), NB = wp.size(0);
  TORCH_CHECK(wp.size(1) == KP && NB == (N + 15) / 16 && K % 32 == 0, "packed weight does not match x / scale");
  const int64_t MP = (M + 15) / 16 * 16;
  at::Tensor x = x_in;
  if (MP != M) {  // whole tiles of 16 rows: zero rows after the last one
    x = at::zeros({MP, K}, x_in.options());
    x.narrow(0, 0, M).copy_(x_in);
  }
  auto y = at::empty({M, N}, x_in.options());
  std::vector<float> sc(NB * 16 + 16, 0.f);
  const uint16_t* sp = u16(scale);
  for (int64_t n = 0; n < N; ++n) sc[n] = bf2f(sp[n]);
  const uint16_t* xp = u16(x);
  const int8_t* wb = wp.data_ptr<int8_t>();
  uint16_t* yp = u16m(y);
  at::parallel_for(0, (NB + 1) / 2, 1, [&](int64_t b, int64_t e) {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }  // tiles 0-3 fp32 C, 4-5 x, 6-7 weights
    _tile_loadconfig(&cfg);
    std::vector<__m512bh> wv(2 * KP);  // two blocks of 16 channels, one 64-byte tile row per input pair
    alignas(64) float c[4][16][16];
    for (int64_t pair = b; pair < e; ++pair) {
      const int64_t nb = 2 * pair, second = std::min<int64_t>(nb + 1, NB - 1);  // an odd last block: twice
      for (int64_t kp = 0; kp < KP; ++kp) {
        wv[kp] = int8_pairs_to_bf16(wb + (nb * KP + kp) * 32);
        wv[KP + kp] = int8_pairs_to_bf16(wb + (second * KP + kp) * 32);
      }
      for (int64_t m = 0; m < MP; m += 32) {
        const bool pair_of_tiles = m + 16 < MP;  // else the last 16 rows alone
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t k = 0; k < K; k += 32) {
          _tile_loadd(4, xp + m * K + k, K * 2);
          _tile_loadd(6, &wv[k / 2], 64);
          _tile_loadd(7, &wv[KP + k / 2], 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          if (pair_of_tiles) {
            _tile_loadd(5, xp + (m + 16) * K + k, K * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, c[0], 64); _tile_stored(1, c[1], 64); _tile_stored(2, c[2], 64); _tile_stored(3, c[3], 64);
        for (int t = 0; t < (pair_of_tiles ? 4 : 2); ++t) {
          const int64_t block = t & 1 ? nb + 1 : nb, m0 = m + (t >> 1) * 16;
          if (block >= NB) continue;
          const __m512 s = _mm512_loadu_ps(sc.data() + block * 16);
          for (int64_t r = 0; r < 16 && m0 + r < M; ++r)
            store_out(yp + (m0 + r) * N + block * 16, N - block * 16, _mm512_mul_ps(_mm512_loadu_ps(c[t][r]), s));
        }
      }
    }
    _tile_release();
  });
  return y;
}

// ------------------------------------------------------------------------------------------------
// Fused element-wise steps of a decoder layer.

// y = bf16(x * rsqrt(mean(x^2) + eps) * w), x fp32 [M, H] (H multiple of 16)
at::Tensor rmsnorm_bf16(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(1) % 16 == 0);
  const int64_t M = x.size(0), H = x.size(1);
  auto y = at::empty({M, H}, x.options().dtype(at::kBFloat16));
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  uint16_t* yp = u16m(y);
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float* xr = xp + i * H;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t j = 0; j < H; j += 16) {
        __m512 v = _mm512_loadu_ps(xr + j);
        acc = _mm512_fmadd_ps(v, v, acc);
      }
      const float r = 1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(H) + static_cast<float>(eps));
      const __m512 rv = _mm512_set1_ps(r);
      for (int64_t j = 0; j < H; j += 16)
        store_bf16x16(yp + i * H + j, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(xr + j), rv), _mm512_loadu_ps(wp + j)));
    }
  });
  return y;
}

// Split a fused qkv projection (bf16 [R*W, (H + 2*KV) * D]), add the bias (fp32, optional), rotate q and
// k (cos/sin fp32 [R*W, D], rotate-half convention), scale q; write q (bf16 [R, W, KV, G, D]) and the
// new keys/values into the suffix buffers at slots start[r] + w.
void rope_split(const at::Tensor& qkv, const at::Tensor& bias, const at::Tensor& cos, const at::Tensor& sin,
                double scale, at::Tensor q, at::Tensor sk, at::Tensor sv, const at::Tensor& start) {
  const int64_t R = q.size(0), W = q.size(1), KV = q.size(2), G = q.size(3), D = q.size(4);
  const int64_t H = KV * G, width = (H + 2 * KV) * D, half = D / 2;
  TORCH_CHECK(qkv.is_contiguous() && qkv.size(1) == width && qkv.scalar_type() == at::kBFloat16);
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == D);
  const bool has_bias = bias.numel() > 0;
  const float* bp = has_bias ? bias.data_ptr<float>() : nullptr;
  const uint16_t* src = u16(qkv);
  uint16_t* qp = u16m(q);
  uint16_t* kp = u16m(sk);
  uint16_t* vp = u16m(sv);
  const int64_t* st = start.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, R * W, 16, [&](int64_t b, int64_t e) {
    float buf[256];
    for (int64_t m = b; m < e; ++m) {
      const int64_t r = m / W, w = m % W, slot = st[r] + w;
      const uint16_t* row = src + m * width;
      const float* c = cp + m * D;
      const float* s = sp + m * D;
      for (int64_t h = 0; h < H + 2 * KV; ++h) {
        for (int64_t j = 0; j < D; ++j) buf[j] = bf2f(row[h * D + j]) + (has_bias ? bp[h * D + j] : 0.f);
        uint16_t* dst;
        if (h < H) dst = qp + m * H * D + h * D;
        else if (h < H + KV) dst = kp + r * sk.stride(0) + (h - H) * sk.stride(1) + slot * sk.stride(2);
        else dst = vp + r * sv.stride(0) + (h - H - KV) * sv.stride(1) + slot * sv.stride(2);
        if (h >= H + KV) {  // values: no rotation
          for (int64_t j = 0; j < D; ++j) dst[j] = f2bf(buf[j]);
          continue;
        }
        const float f = h < H ? sc : 1.0f;
        for (int64_t j = 0; j < half; ++j) {
          dst[j] = f2bf((buf[j] * c[j] - buf[j + half] * s[j]) * f);
          dst[j + half] = f2bf((buf[j + half] * c[j + half] + buf[j] * s[j + half]) * f);
        }
      }
    }
  });
}

// bf16(silu(g) * u) for a fused gate/up projection bf16 [M, 2I] -> [M, I], computed in fp32
at::Tensor silu_mul(const at::Tensor& gu) {
  TORCH_CHECK(gu.is_contiguous() && gu.scalar_type() == at::kBFloat16 && gu.size(1) % 32 == 0);
  const int64_t M = gu.size(0), I = gu.size(1) / 2;
  auto y = at::empty({M, I}, gu.options());
  const uint16_t* src = u16(gu);
  uint16_t* dst = u16m(y);
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t m = b; m < e; ++m)
      for (int64_t j = 0; j < I; j += 16) {
        __m512 g = load_bf16x16(src + m * 2 * I + j);
        __m512 u = load_bf16x16(src + m * 2 * I + I + j);
        __m512 sg = _mm512_div_ps(g, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        store_bf16x16(dst + m * I + j, _mm512_mul_ps(sg, u));
      }
  });
  return y;
}

// x += y (x fp32, y bf16), same shape
void add_bf16_(at::Tensor x, const at::Tensor& y) {
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous() && x.numel() == y.numel());
  float* xp = x.data_ptr<float>();
  const uint16_t* yp = u16(y);
  const int64_t n = x.numel();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) _mm512_storeu_ps(xp + j, _mm512_add_ps(_mm512_loadu_ps(xp + j), load_bf16x16(yp + j)));
  for (; j < n; ++j) xp[j] += bf2f(yp[j]);
}

// All decoder layers for one block of tokens. x: fp32 [R*W, hidden], updated in place. weights: 15 per
// layer (ln1, q_qkv, w_qkv, s_qkv, b_qkv or empty, q_o, w_o, s_o, ln2, q_gu, w_gu, s_gu, q_down, w_down,
// s_down): each linear is its first output channels in packed Q4_K blocks (q_*, may be empty) followed by
// int8 rows (w_*, s_*, may be empty). pk/pv: prefix K/V per layer (empty list: no prefix); sk/sv: suffix
// buffers per layer [R, KV, CAP, D].
void run_layers(at::Tensor x, const std::vector<at::Tensor>& weights, const at::Tensor& cos, const at::Tensor& sin,
                const std::vector<at::Tensor>& pk, const std::vector<at::Tensor>& pv,
                const std::vector<at::Tensor>& sk, const std::vector<at::Tensor>& sv, const at::Tensor& start,
                int64_t R, int64_t W, int64_t KV, int64_t G, int64_t D, double eps, double scale, int64_t matmul) {
  const int64_t layers = static_cast<int64_t>(sk.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 15 * layers);
  const at::Tensor none;
  auto q = at::empty({R, W, KV, G, D}, x.options().dtype(at::kBFloat16));
  auto att = at::empty({R, W, KV, G, D}, x.options().dtype(at::kBFloat16));
  const at::Tensor empty_kv = at::empty({0}, q.options());
  // matmul 0: _weight_int8pack_mm; 1: mm_int8; 2: mm_int8_amx (both on weights packed by pack_int8)
  auto mm = [matmul](const at::Tensor& a, const at::Tensor& b, const at::Tensor& s) {
    return matmul == 2 ? mm_int8_amx(a, b, s) : matmul == 1 ? mm_int8(a, b, s) : at::_weight_int8pack_mm(a, b, s);
  };
  auto linear = [&mm](const at::Tensor& a, const at::Tensor* w) {  // w: q4, int8 rows, their scales
    if (w[0].numel() == 0) return mm(a, w[1], w[2]);
    const int64_t n4 = w[0].size(0) * 16, n8 = w[2].numel();
    auto y = at::empty({a.size(0), n4 + n8}, a.options());
    mm_q4k_into(a, w[0], u16m(y), n4 + n8);
    if (n8) y.narrow(1, n4, n8).copy_(mm(a, w[1], w[2]));
    return y;
  };
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = &weights[15 * l];
    at::Tensor h = rmsnorm_bf16(x, w[0], eps);
    at::Tensor qkv = linear(h, w + 1);
    rope_split(qkv, w[4], cos, sin, scale, q, sk[l], sv[l], start);
    attend(q, pk.empty() ? empty_kv : pk[l], pv.empty() ? empty_kv : pv[l], sk[l], sv[l], start, att);
    add_bf16_(x, linear(att.view({R * W, KV * G * D}), w + 5));
    h = rmsnorm_bf16(x, w[8], eps);
    at::Tensor act = silu_mul(linear(h, w + 9));
    add_bf16_(x, linear(act, w + 12));
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend, "cascade attention over a shared prefix + per-row causal suffix");
  m.def("rmsnorm_bf16", &rmsnorm_bf16);
  m.def("rope_split", &rope_split);
  m.def("silu_mul", &silu_mul);
  m.def("add_bf16_", &add_bf16_);
  m.def("run_layers", &run_layers);
  m.def("mm_int8", &mm_int8);
  m.def("mm_int8_amx", &mm_int8_amx);
  m.def("amx_ready", &amx_ready);
  m.def("pack_int8", &pack_int8);
  m.def("pack_q4k", &pack_q4k);
  m.def("mm_q4k", &mm_q4k);
}
