// Products with weights kept as the GGUF file stores them in Q4_K blocks (4.5 bits a weight), so decoding reads
// 0.59 bytes a weight instead of int8's 1: a one-core decode step is bound by the bytes it reads. Included by
// fastlm_kernels.cpp (its helpers, u16/u16m, load_bf16x16, store_out, come from there).
//
// A Q4_K super-block holds 256 inputs of one output row: fp16 d and dmin, eight 6-bit scales sc_j and mins m_j
// (one per 32 inputs) and 4-bit quants q. The weight is w = (d * sc_j) * q - (dmin * m_j), exactly as ggml
// dequantizes it. The product is computed per 32 inputs without dequantizing:
//   y[m, n] = bf16( sum_j (d*sc_j) * sum_i q_i x_i  -  (dmin*m_j) * sum_i x_i )
// with each quant turned into the exact bf16 value 128 + q by two bit operations (the 128 is taken back out with
// the sum of x) and multiplied with dpbf16 in two chains (even and odd input pairs), restarted for every 32
// inputs. Every output is the same fixed sequence of operations whatever the number of rows, the tiling or the
// thread count, so rows are bitwise independent of the batch.
//
// Packed layout (pack_q4k), per block of 16 output channels and per super-block, 2432 bytes:
//   d[16], dmin[16] fp32 | 8 x ( sc[16], m[16] uint8 | 8 groups x 32 bytes of quants )
// In a group (4 inputs k0..k0+3 of the 32), byte 2c+e holds channel c's q[k0+e] (low nibble) and q[k0+2+e]
// (high nibble): zero-extended to 16-bit lanes, the low nibbles are the 32 bf16 lanes of input pair k0/2 in
// pack_int8's lane order (channel c, element e), the high nibbles those of the next pair.

constexpr int64_t Q4K_BLOCK_BYTES = 144;      // one GGUF Q4_K super-block
constexpr int64_t Q4K_PACKED_BYTES = 2432;    // 16 channels x one super-block, packed
constexpr int64_t Q4K_SUB_BYTES = 32 + 256;   // scales, mins and quants of 32 inputs x 16 channels
constexpr int64_t PREFETCH_SUBS = 16;  // sub-blocks ahead: 8-32 measured, 16 the fastest
// many rows: each tile of up to Q4K_TILE rows against Q4K_GROUP blocks of 16 channels (measured on
// Qwen2.5-Coder-1.5B, 25 / 512 rows: 2 x 6 57 / 72 tokens/s, 2 x 4 54 / 69, 3 x 4 48 / 65, 4 x 3 46 / 60)
constexpr int64_t Q4K_GROUP = 2;
constexpr int64_t Q4K_TILE = 6;  // mm_q4k_rows dispatches tiles of 1 to 6 rows

inline void q4k_scale_min(const uint8_t* s, int j, uint8_t* sc, uint8_t* m) {  // ggml's get_scale_min_k4
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

inline float fp16_to_f32(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }

// raw: uint8 [N, K/256 * 144], the GGUF tensor's rows (N a multiple of 16) -> uint8 [N/16, K/256, 2432]
at::Tensor pack_q4k(const at::Tensor& raw) {
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.is_contiguous());
  const int64_t N = raw.size(0), SB = raw.size(1) / Q4K_BLOCK_BYTES;
  TORCH_CHECK(N % 16 == 0 && raw.size(1) == SB * Q4K_BLOCK_BYTES, "Q4_K rows: N a multiple of 16, whole blocks");
  auto out = at::empty({N / 16, SB, Q4K_PACKED_BYTES}, raw.options());
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t nb = 0; nb < N / 16; ++nb)
    for (int64_t s = 0; s < SB; ++s) {
      uint8_t* o = dst + (nb * SB + s) * Q4K_PACKED_BYTES;
      float* d = reinterpret_cast<float*>(o);
      for (int c = 0; c < 16; ++c) {
        const uint8_t* b = src + (nb * 16 + c) * raw.size(1) + s * Q4K_BLOCK_BYTES;
        uint16_t h[2];
        std::memcpy(h, b, 4);
        d[c] = fp16_to_f32(h[0]);
        d[16 + c] = fp16_to_f32(h[1]);
        const uint8_t* qs = b + 16;
        for (int j = 0; j < 8; ++j) {
          uint8_t* sub = o + 128 + j * Q4K_SUB_BYTES;
          q4k_scale_min(b + 4, j, sub + c, sub + 16 + c);
          for (int g = 0; g < 8; ++g)
            for (int e = 0; e < 2; ++e) {
              auto quant = [&](int i) {  // input i (0..31) of sub-block j: ggml's nibble order
                const uint8_t byte = qs[32 * (j / 2) + i];
                return j % 2 ? byte >> 4 : byte & 0xF;
              };
              sub[32 + g * 32 + 2 * c + e] = static_cast<uint8_t>(quant(4 * g + e) | (quant(4 * g + 2 + e) << 4));
            }
        }
      }
    }
  return out;
}

// 32 packed bytes -> two input pairs' quants as bf16 128 + q (low nibbles, high nibbles): the bit pattern
// 0x4300 | q is exactly 128 + q, so a mask and an or make the value, and the folding step takes 128 * sum(x)
// back out.
struct Q4Unpack {
  __m512i low = _mm512_set1_epi16(0x000F), bias = _mm512_set1_epi16(0x4300);
  inline void quants(const uint8_t* p, __m512bh* lo, __m512bh* hi) const {
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    *lo = (__m512bh)_mm512_ternarylogic_epi32(b, low, bias, 0xEA);  // (b & low) | bias
    *hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(b, 4), bias);
  }
};

// the 16 channels' a = d * sc_j and b = 128 * a + dmin * m_j of one sub-block (b takes the unpacked quants' 128 out)
inline void q4k_sub_scales(const uint8_t* head, const uint8_t* sub, __m512* a, __m512* b) {
  const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sub))));
  const __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sub + 16))));
  *a = _mm512_mul_ps(_mm512_loadu_ps(reinterpret_cast<const float*>(head)), sc);
  *b = _mm512_fmadd_ps(*a, _mm512_set1_ps(128.0f),
                       _mm512_mul_ps(_mm512_loadu_ps(reinterpret_cast<const float*>(head) + 16), mn));
}

// xs[m * K/32 + j] = fp32 sum of x[m, 32j .. 32j + 31], a fixed order per row
std::vector<float> q4k_input_sums(const uint16_t* x, int64_t M, int64_t K) {
  std::vector<float> xs(M * (K / 32));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < K / 32; ++j)
      xs[m * (K / 32) + j] = _mm512_reduce_add_ps(
          _mm512_add_ps(load_bf16x16(x + m * K + 32 * j), load_bf16x16(x + m * K + 32 * j + 16)));
  return xs;
}

// The per-sub-block step both paths share: the chains e/o of sub-block j folded into acc.
inline __m512 q4k_fold(__m512 acc, __m512 e, __m512 o, __m512 a, __m512 b, float xsum) {
  acc = _mm512_fmadd_ps(a, _mm512_add_ps(e, o), acc);
  return _mm512_fnmadd_ps(b, _mm512_set1_ps(xsum), acc);
}

// MT rows against BN blocks of 16 channels, quants unpacked as they stream by (decoding: few rows)
template <int MT, int BN>
inline void mm_q4k_direct(const uint32_t* x, const float* xs, int64_t K, const uint8_t* wq, int64_t nb,
                          int64_t SB, uint16_t* y, int64_t ldy, const Q4Unpack& unpack) {
  const int64_t KP = K / 2, J = K / 32;
  __m512 acc[MT][BN];
  for (int m = 0; m < MT; ++m)
    for (int bn = 0; bn < BN; ++bn) acc[m][bn] = _mm512_setzero_ps();
  for (int64_t s = 0; s < SB; ++s)
    for (int j = 0; j < 8; ++j) {
      __m512 e[MT][BN], o[MT][BN], a[BN], b[BN];
      for (int bn = 0; bn < BN; ++bn) {
        const uint8_t* head = wq + ((nb + bn) * SB + s) * Q4K_PACKED_BYTES;
        const uint8_t* sub = head + 128 + j * Q4K_SUB_BYTES;
        // into L1: ~PREFETCH_SUBS sub-blocks ahead in this stream; into L2: the same place in the stream the
        // next call takes (BN blocks on), whose start would otherwise wait on memory (1.4x the speed at K = 1536)
        for (int line = 0; line < Q4K_SUB_BYTES; line += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(sub + PREFETCH_SUBS * Q4K_SUB_BYTES + line), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(sub + BN * SB * Q4K_PACKED_BYTES + line), _MM_HINT_T1);
        }
        q4k_sub_scales(head, sub, &a[bn], &b[bn]);
        for (int m = 0; m < MT; ++m) { e[m][bn] = _mm512_setzero_ps(); o[m][bn] = _mm512_setzero_ps(); }
      }
      const int64_t kp0 = (s * 8 + j) * 16;
      for (int g = 0; g < 8; ++g)
        for (int bn = 0; bn < BN; ++bn) {
          __m512bh w0, w1;
          unpack.quants(wq + ((nb + bn) * SB + s) * Q4K_PACKED_BYTES + 128 + j * Q4K_SUB_BYTES + 32 + g * 32, &w0, &w1);
          for (int m = 0; m < MT; ++m) {
            const uint32_t* xr = x + m * KP + kp0 + 2 * g;
            e[m][bn] = _mm512_dpbf16_ps(e[m][bn], (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[0])), w0);
            o[m][bn] = _mm512_dpbf16_ps(o[m][bn], (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[1])), w1);
          }
        }
      for (int m = 0; m < MT; ++m)
        for (int bn = 0; bn < BN; ++bn)
          acc[m][bn] = q4k_fold(acc[m][bn], e[m][bn], o[m][bn], a[bn], b[bn], xs[m * J + s * 8 + j]);
    }
  for (int m = 0; m < MT; ++m)
    for (int bn = 0; bn < BN; ++bn) store_out(y + m * ldy + (nb + bn) * 16, 16, acc[m][bn]);
}

// MT rows against BN blocks of 16 channels whose quants are already bf16 (wv[b]: KP vectors each) and whose
// sub-block scales are in ab[b] (2 per sub-block): every input broadcast serves BN blocks, every weight vector MT
// rows, so the loads keep up with the dpbf16s
template <int MT, int BN>
inline void mm_q4k_block(const uint32_t* x, const float* xs, int64_t K, const __m512bh* const* wv,
                         const __m512* const* ab, int64_t n0, uint16_t* y, int64_t ldy) {
  const int64_t KP = K / 2, J = K / 32;
  __m512 acc[MT][BN];
  for (int m = 0; m < MT; ++m)
    for (int b = 0; b < BN; ++b) acc[m][b] = _mm512_setzero_ps();
  for (int64_t j = 0; j < J; ++j) {
    __m512 e[MT][BN], o[MT][BN];
    for (int m = 0; m < MT; ++m)
      for (int b = 0; b < BN; ++b) { e[m][b] = _mm512_setzero_ps(); o[m][b] = _mm512_setzero_ps(); }
    for (int g = 0; g < 8; ++g) {
      const int64_t kp = j * 16 + 2 * g;
      for (int m = 0; m < MT; ++m) {
        const __m512bh x0 = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * KP + kp]));
        const __m512bh x1 = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * KP + kp + 1]));
        for (int b = 0; b < BN; ++b) {
          e[m][b] = _mm512_dpbf16_ps(e[m][b], x0, wv[b][kp]);
          o[m][b] = _mm512_dpbf16_ps(o[m][b], x1, wv[b][kp + 1]);
        }
      }
    }
    for (int m = 0; m < MT; ++m)
      for (int b = 0; b < BN; ++b)
        acc[m][b] = q4k_fold(acc[m][b], e[m][b], o[m][b], ab[b][2 * j], ab[b][2 * j + 1], xs[m * J + j]);
  }
  for (int m = 0; m < MT; ++m)
    for (int b = 0; b < BN; ++b) store_out(y + m * ldy + n0 + 16 * b, 16, acc[m][b]);
}

// rows [0, M) in tiles of at most Q4K_TILE rows, evenly sized (with 6: 25 rows are 5 + 5 + 5 + 5 + 5, not 6 x 4 + 1)
template <int BN>
inline void mm_q4k_rows(const uint32_t* x, const float* xs, int64_t M, int64_t K, const __m512bh* const* wv,
                        const __m512* const* ab, int64_t n0, uint16_t* y, int64_t ldy) {
  const int64_t KP = K / 2, J = K / 32, tiles = (M + Q4K_TILE - 1) / Q4K_TILE;
  for (int64_t t = 0, m = 0; t < tiles; ++t) {
    const int64_t rows = (M - m) / (tiles - t);
    const uint32_t* xr = x + m * KP;
    const float* xsr = xs + m * J;
    uint16_t* yr = y + m * ldy;
    switch (rows) {
      case 6: mm_q4k_block<6, BN>(xr, xsr, K, wv, ab, n0, yr, ldy); break;
      case 5: mm_q4k_block<5, BN>(xr, xsr, K, wv, ab, n0, yr, ldy); break;
      case 4: mm_q4k_block<4, BN>(xr, xsr, K, wv, ab, n0, yr, ldy); break;
      case 3: mm_q4k_block<3, BN>(xr, xsr, K, wv, ab, n0, yr, ldy); break;
      case 2: mm_q4k_block<2, BN>(xr, xsr, K, wv, ab, n0, yr, ldy); break;
      default: mm_q4k_block<1, BN>(xr, xsr, K, wv, ab, n0, yr, ldy); break;
    }
    m += rows;
  }
}

// y[:, 0 : 16 * wq.size(0)] of a [M, ldy] bf16 output = x bf16 [M, K] times the packed Q4_K weights
void mm_q4k_into(const at::Tensor& x, const at::Tensor& wq, uint16_t* yp, int64_t ldy) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16);
  TORCH_CHECK(wq.dim() == 3 && wq.is_contiguous() && wq.scalar_type() == at::kByte && wq.size(2) == Q4K_PACKED_BYTES);
  const int64_t M = x.size(0), K = x.size(1), NB = wq.size(0), SB = wq.size(1), KP = K / 2;
  TORCH_CHECK(SB * 256 == K, "Q4_K weight does not match x");
  const std::vector<float> xs = q4k_input_sums(u16(x), M, K);
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x.data_ptr());
  const uint8_t* wb = wq.data_ptr<uint8_t>();
  const Q4Unpack unpack;
  if (M <= 4) {  // decode: stream the quants once, a few channel blocks at a time
    const int64_t group = M == 1 ? 4 : M == 2 ? 2 : 1;
    at::parallel_for(0, (NB + group - 1) / group, 8 / group, [&](int64_t b, int64_t e) {
      for (int64_t g = b; g < e; ++g) {
        const int64_t nb = g * group;
        const bool two = nb + 1 < NB;
        switch (M) {
          case 1:
            if (nb + 4 <= NB) mm_q4k_direct<1, 4>(xp, xs.data(), K, wb, nb, SB, yp, ldy, unpack);
            else for (int64_t one = nb; one < NB; ++one) mm_q4k_direct<1, 1>(xp, xs.data(), K, wb, one, SB, yp, ldy, unpack);
            break;
          case 2: two ? mm_q4k_direct<2, 2>(xp, xs.data(), K, wb, nb, SB, yp, ldy, unpack)
                      : mm_q4k_direct<2, 1>(xp, xs.data(), K, wb, nb, SB, yp, ldy, unpack); break;
          case 3: mm_q4k_direct<3, 1>(xp, xs.data(), K, wb, nb, SB, yp, ldy, unpack); break;
          default: mm_q4k_direct<4, 1>(xp, xs.data(), K, wb, nb, SB, yp, ldy, unpack); break;
        }
      }
    });
    return;
  }
  // many rows: Q4K_GROUP blocks of 16 channels at a time, their quants unpacked once into bf16
  constexpr int64_t G = Q4K_GROUP;
  at::parallel_for(0, (NB + G - 1) / G, 1, [&](int64_t b, int64_t e) {
    std::vector<__m512bh> wv(G * KP);
    std::vector<__m512> ab(G * 2 * (K / 32));
    const __m512bh* wvs[G];
    const __m512* scales[G];
    for (int64_t c = 0; c < G; ++c) { wvs[c] = wv.data() + c * KP; scales[c] = ab.data() + c * 2 * (K / 32); }
    for (int64_t group = b; group < e; ++group) {
      const int64_t count = std::min<int64_t>(G, NB - G * group);
      for (int64_t c = 0; c < count; ++c)
        for (int64_t s = 0; s < SB; ++s) {
          const uint8_t* head = wb + ((G * group + c) * SB + s) * Q4K_PACKED_BYTES;
          for (int j = 0; j < 8; ++j) {
            const uint8_t* sub = head + 128 + j * Q4K_SUB_BYTES;
            const int64_t js = c * 2 * (K / 32) + 2 * (s * 8 + j);
            q4k_sub_scales(head, sub, &ab[js], &ab[js + 1]);
            for (int g = 0; g < 8; ++g) {
              const int64_t kp = c * KP + (s * 8 + j) * 16 + 2 * g;
              unpack.quants(sub + 32 + g * 32, &wv[kp], &wv[kp + 1]);
            }
          }
        }
      const int64_t n0 = 16 * G * group;
      switch (count) {
        case 4: mm_q4k_rows<4>(xp, xs.data(), M, K, wvs, scales, n0, yp, ldy); break;
        case 3: mm_q4k_rows<3>(xp, xs.data(), M, K, wvs, scales, n0, yp, ldy); break;
        case 2: mm_q4k_rows<2>(xp, xs.data(), M, K, wvs, scales, n0, yp, ldy); break;
        default: mm_q4k_rows<1>(xp, xs.data(), M, K, wvs, scales, n0, yp, ldy); break;
      }
    }
  });
}

// x bf16 [M, K]; wq = pack_q4k(raw) -> y bf16 [M, 16 * wq.size(0)]
at::Tensor mm_q4k(const at::Tensor& x, const at::Tensor& wq) {
  auto y = at::empty({x.size(0), wq.size(0) * 16}, x.options());
  mm_q4k_into(x, wq, u16m(y), y.size(1));
  return y;
}
