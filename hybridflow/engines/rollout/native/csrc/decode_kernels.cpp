// CPU kernels for the native rollout's decode step (fp32, AVX2 + FMA), built on first use by `kernels.py`.
//
// Why they exist (docs/performance.md): a decode step multiplies a few rows of activations by every weight
// matrix once. torch's GEMM (MKL) streams weights that are not in cache at about a third of this CPU's read
// bandwidth for 16 rows, and the decode attention over the cache is 2 x layers x slots x heads tiny batched
// matmuls plus softmax. These kernels do the same math in one pass each:
// - linear_rows: y = x @ w^T (+ bias) for a few rows x, with w packed once per weight version into panels of
//   16 output features (`pack_weight`): each panel is one contiguous stream, read from memory once and
//   multiplied by 6 rows of x at a time with 12 accumulators and no horizontal sums.
// - decode_attention: one query token per slot over that slot's valid cache positions only, grouped query
//   heads sharing K/V, softmax in fp32, no mask tensor.
// Threads: at::parallel_for, i.e. torch's intra-op pool (torch.set_num_threads applies).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 shuffled = _mm_movehdup_ps(s);
  s = _mm_add_ps(s, shuffled);
  shuffled = _mm_movehl_ps(shuffled, s);
  return _mm_cvtss_f32(_mm_add_ss(s, shuffled));
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp(x) for x <= 0 (softmax after subtracting the max): Cephes' range reduction and degree-5 polynomial,
// relative error ~1e-7 on [-87, 0]; 0 below that (fp32 exp underflows there anyway), and exp(-inf) = 0.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 in_range = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_GE_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(exponent)), in_range);
}

// ------------------------------------------------------------------------------------------ dot products
// A block of MR rows of x times NR rows of w, dot products along K (both row-major): decode attention's
// query-key scores. With MR=3 heads, NR=3 key rows: 9 accumulators, 6 loads per 9 FMAs.
// It also prefetches the rows of w `prefetch` floats ahead.
template <int MR, int NR>
inline void dot_block(const float* x, int64_t K, const float* w, float* y, int64_t ldy, int64_t prefetch) {
  __m256 acc[MR][NR];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    if ((k & 15) == 0) {
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + prefetch + j * K + k), _MM_HINT_T0);
    }
    __m256 wv[NR];
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) wv[j] = _mm256_loadu_ps(w + j * K + k);
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * K + k);
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  // Horizontal sums, four accumulators at a time (3 hadds and one add instead of 4 x 5 shuffles and adds).
  // (A copy, so that `acc` is never address-taken: GCC would otherwise keep it in memory inside the loop.)
  __m256 flat[MR * NR];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) flat[i * NR + j] = acc[i][j];
  float sums[MR * NR];
  int c = 0;
  for (; c + 4 <= MR * NR; c += 4) {
    const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(flat[c], flat[c + 1]), _mm256_hadd_ps(flat[c + 2], flat[c + 3]));
    _mm_storeu_ps(sums + c, _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1)));
  }
  for (; c < MR * NR; ++c) sums[c] = hsum(flat[c]);
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float sum = sums[i * NR + j];
      for (int64_t t = k; t < K; ++t) sum += x[i * K + t] * w[j * K + t];
      y[i * ldy + j] = sum;
    }
}

// ------------------------------------------------------------------------------------------ linear_rows
// Packed weight layout: (N_pad / 16, K, 16), N_pad = N rounded up to 16 (zero rows); panel p holds output
// features [16p, 16p + 16), k-major, so one k step reads one 64-byte line.
constexpr int64_t kPanel = 16;
constexpr int64_t kPanelsAhead = 2;  // prefetch distance in panels, by the first row block of each panel

// MR rows of x (row stride K) times one packed panel -> y[i * ldy + 0..15] (only `width` columns stored).
template <int MR>
inline void panel_block(const float* x, int64_t K, const float* panel, float* y, int64_t ldy, int64_t width,
                        const float* prefetch, bool add) {
  __m256 acc[MR][2];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    if (prefetch != nullptr) _mm_prefetch(reinterpret_cast<const char*>(prefetch + kPanel * k), _MM_HINT_T0);
    const __m256 w0 = _mm256_loadu_ps(panel + kPanel * k), w1 = _mm256_loadu_ps(panel + kPanel * k + 8);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_broadcast_ss(x + i * K + k);
      acc[i][0] = _mm256_fmadd_ps(xv, w0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(xv, w1, acc[i][1]);
    }
  }
  // Fully unrolled, so that `acc` stays in registers (indexing it with a loop variable would keep it in memory).
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    float* row = y + i * ldy;
    if (width == kPanel) {
      __m256 lo = acc[i][0], hi = acc[i][1];
      if (add) {
        lo = _mm256_add_ps(lo, _mm256_loadu_ps(row));
        hi = _mm256_add_ps(hi, _mm256_loadu_ps(row + 8));
      }
      _mm256_storeu_ps(row, lo);
      _mm256_storeu_ps(row + 8, hi);
    } else {  // the last, partial panel
      float lanes[kPanel];
      _mm256_storeu_ps(lanes, acc[i][0]);
      _mm256_storeu_ps(lanes + 8, acc[i][1]);
      for (int64_t j = 0; j < width; ++j) row[j] = add ? row[j] + lanes[j] : lanes[j];
    }
  }
}

constexpr int64_t kPrefetchRows = 8;    // key rows ahead in decode_attention (0-32 measured alike)
constexpr int kGroupBlock = 3;          // query heads per pass over the values (x kLaneBlock accumulators)
constexpr int kLaneBlock = 4;           // 8-float lane blocks of head_dim per pass

void check_float_matrix(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat, name, ": expected a float32 CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1 && t.stride(0) == t.size(1), name, ": expected a contiguous matrix");
}

// y (M, N) = x @ weight^T, or y += x @ weight^T when `add`; `packed` from pack_weight(weight).
void linear_rows_into(const torch::Tensor& x, const torch::Tensor& packed, torch::Tensor& y, bool add) {
  check_float_matrix(x, "x");
  check_float_matrix(y, "out");
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == torch::kFloat && packed.is_contiguous() &&
              packed.dim() == 3 && packed.size(2) == kPanel, "linear_rows: weight must come from pack_weight");
  TORCH_CHECK(x.size(1) == packed.size(1), "linear_rows: x has ", x.size(1), " features, weight ", packed.size(1));
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1), panels = packed.size(0);
  TORCH_CHECK(y.size(0) == M && N <= panels * kPanel && N > (panels - 1) * kPanel,
              "linear_rows: out must be (rows, out_features) of the packed weight");
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const float* panel = wp + p * K * kPanel;
      float* out = yp + p * kPanel;
      const int64_t width = std::min(kPanel, N - p * kPanel);
      // The first row block streams the panel from memory and asks for the panel kPanelsAhead on.
      const float* ahead = p + kPanelsAhead < panels ? panel + kPanelsAhead * K * kPanel : nullptr;
      int64_t m = 0;
      for (; m + 6 <= M; m += 6, ahead = nullptr) panel_block<6>(xp + m * K, K, panel, out + m * N, N, width, ahead, add);
      switch (M - m) {
        case 5: panel_block<5>(xp + m * K, K, panel, out + m * N, N, width, ahead, add); break;
        case 4: panel_block<4>(xp + m * K, K, panel, out + m * N, N, width, ahead, add); break;
        case 3: panel_block<3>(xp + m * K, K, panel, out + m * N, N, width, ahead, add); break;
        case 2: panel_block<2>(xp + m * K, K, panel, out + m * N, N, width, ahead, add); break;
        case 1: panel_block<1>(xp + m * K, K, panel, out + m * N, N, width, ahead, add); break;
        default: break;
      }
    }
  });
}

}  // namespace

// (N, K) -> (ceil(N / 16), K, 16): the layout linear_rows reads (zero rows pad the last panel).
torch::Tensor pack_weight(const torch::Tensor& weight) {
  check_float_matrix(weight, "weight");
  const int64_t N = weight.size(0), K = weight.size(1), panels = (N + kPanel - 1) / kPanel;
  auto padded = weight;
  if (panels * kPanel != N) padded = torch::cat({weight, weight.new_zeros({panels * kPanel - N, K})});
  return padded.view({panels, kPanel, K}).transpose(1, 2).contiguous();
}

// x @ weight^T (+ bias) for a few rows of x; `packed` = pack_weight(weight), out_features = weight.size(0).
torch::Tensor linear_rows(const torch::Tensor& x, const torch::Tensor& packed, int64_t out_features,
                          const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, "linear_rows: x must be a matrix");
  auto y = torch::empty({x.size(0), out_features}, x.options());
  linear_rows_into(x, packed, y, false);
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

// residual += x @ weight^T (+ bias), in place: the decoder's residual connection without a temporary.
void linear_rows_add_(torch::Tensor& residual, const torch::Tensor& x, const torch::Tensor& packed,
                      const c10::optional<torch::Tensor>& bias) {
  linear_rows_into(x, packed, residual, true);
  if (bias.has_value() && bias->defined()) residual.add_(*bias);
}

// ------------------------------------------------------------------------------------------ decode_attention
// Scores of all `group` query heads (rows of Q, length D) against NR consecutive key rows: y[g * ldy + t].
template <int NR>
inline void query_block(const float* Q, const float* keys, int64_t D, int64_t group, float* y, int64_t ldy) {
  const int64_t ahead = kPrefetchRows * D;
  int64_t g = 0;
  for (; g + 4 <= group; g += 4) dot_block<4, NR>(Q + g * D, D, keys, y + g * ldy, ldy, ahead);
  switch (group - g) {
    case 3: dot_block<3, NR>(Q + g * D, D, keys, y + g * ldy, ldy, ahead); break;
    case 2: dot_block<2, NR>(Q + g * D, D, keys, y + g * ldy, ldy, ahead); break;
    case 1: dot_block<1, NR>(Q + g * D, D, keys, y + g * ldy, ldy, ahead); break;
    default: break;
  }
}

// q: (slots, kv_heads, group, head_dim), already scaled; keys, values: a layer's whole cache (num_slots,
// kv_heads, max_len, head_dim); visible: (slots,) int64, positions [0, visible) of each slot are attended.
// -> (slots, kv_heads, group, head_dim). head_dim must be a multiple of 8.
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                               const torch::Tensor& visible) {
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.dim() == 4, "decode_attention: 4-d tensors expected");
  TORCH_CHECK(q.is_contiguous() && keys.is_contiguous() && values.is_contiguous(), "decode_attention: contiguous");
  TORCH_CHECK(q.scalar_type() == torch::kFloat && keys.scalar_type() == torch::kFloat &&
              values.scalar_type() == torch::kFloat, "decode_attention: float32 only");
  TORCH_CHECK(visible.scalar_type() == torch::kLong && visible.is_contiguous(), "decode_attention: int64 visible");
  const int64_t slots = q.size(0), kv_heads = q.size(1), group = q.size(2), D = q.size(3);
  const int64_t max_len = keys.size(2);
  TORCH_CHECK(D % 8 == 0, "decode_attention: head_dim must be a multiple of 8, got ", D);
  TORCH_CHECK(keys.size(0) >= slots && keys.size(1) == kv_heads && keys.size(3) == D && keys.sizes() == values.sizes(),
              "decode_attention: cache shape does not match q");
  TORCH_CHECK(visible.numel() == slots, "decode_attention: one visible length per slot");
  const int64_t* vis = visible.data_ptr<int64_t>();
  for (int64_t s = 0; s < slots; ++s)
    TORCH_CHECK(vis[s] >= 1 && vis[s] <= max_len, "decode_attention: visible length out of range: ", vis[s]);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t chunks = D / 8;

  at::parallel_for(0, slots * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t slot = task / kv_heads;
      const int64_t n = vis[slot];
      const float* K = kp + task * max_len * D;  // (slot, head) rows are contiguous in the cache
      const float* V = vp + task * max_len * D;
      const float* Q = qp + task * group * D;
      float* O = op + task * group * D;
      scores.resize(group * n);
      // scores[g, t] = q[g] . k[t]: a small matrix product (group x D) . (D x n) with the weight-product
      // micro-kernel, query heads as rows and 3 key rows (positions) per block, keys prefetched ahead.
      int64_t t = 0;
      for (; t + 3 <= n; t += 3) query_block<3>(Q, K + t * D, D, group, scores.data() + t, n);
      if (n - t == 2) query_block<2>(Q, K + t * D, D, group, scores.data() + t, n);
      if (n - t == 1) query_block<1>(Q, K + t * D, D, group, scores.data() + t, n);
      // softmax per query head, then out[g] = sum_t p[g, t] v[t].
      for (int64_t g = 0; g < group; ++g) {
        float* p = scores.data() + g * n;
        __m256 vmax = _mm256_set1_ps(-INFINITY);
        t = 0;
        for (; t + 8 <= n; t += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(p + t));
        float maximum = hmax(vmax);
        for (; t < n; ++t) maximum = std::max(maximum, p[t]);
        const __m256 shift = _mm256_set1_ps(maximum);
        __m256 vsum = _mm256_setzero_ps();
        for (t = 0; t + 8 <= n; t += 8) {
          const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(p + t), shift));
          _mm256_storeu_ps(p + t, e);
          vsum = _mm256_add_ps(vsum, e);
        }
        float total = hsum(vsum);
        for (; t < n; ++t) {
          p[t] = std::exp(p[t] - maximum);
          total += p[t];
        }
        const float inv = 1.0f / total;
        for (t = 0; t < n; ++t) p[t] *= inv;
      }
      // out[g] = sum_t p[g, t] v[t], 8 lanes of head_dim at a time for all query heads of the group: each
      // value row is read once per lane block.
      for (int64_t g0 = 0; g0 < group; g0 += kGroupBlock) {
        const int64_t heads = std::min<int64_t>(kGroupBlock, group - g0);
        for (int64_t c0 = 0; c0 < chunks; c0 += kLaneBlock) {
          const int64_t width = std::min<int64_t>(kLaneBlock, chunks - c0);
          __m256 acc[kGroupBlock][kLaneBlock];
          for (int64_t g = 0; g < kGroupBlock; ++g)
            for (int64_t c = 0; c < kLaneBlock; ++c) acc[g][c] = _mm256_setzero_ps();
          if (heads == kGroupBlock && width == kLaneBlock) {
            for (int64_t s = 0; s < n; ++s) {
              const float* v_row = V + s * D + 8 * c0;
              __m256 v[kLaneBlock];
#pragma GCC unroll 4
              for (int c = 0; c < kLaneBlock; ++c) v[c] = _mm256_loadu_ps(v_row + 8 * c);
#pragma GCC unroll 4
              for (int g = 0; g < kGroupBlock; ++g) {
                const __m256 weight = _mm256_broadcast_ss(scores.data() + (g0 + g) * n + s);
#pragma GCC unroll 4
                for (int c = 0; c < kLaneBlock; ++c) acc[g][c] = _mm256_fmadd_ps(weight, v[c], acc[g][c]);
              }
            }
          } else {
            for (int64_t s = 0; s < n; ++s) {
              const float* v_row = V + s * D + 8 * c0;
              for (int64_t g = 0; g < heads; ++g) {
                const __m256 weight = _mm256_broadcast_ss(scores.data() + (g0 + g) * n + s);
                for (int64_t c = 0; c < width; ++c)
                  acc[g][c] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(v_row + 8 * c), acc[g][c]);
              }
            }
          }
          for (int64_t g = 0; g < heads; ++g)
            for (int64_t c = 0; c < width; ++c) _mm256_storeu_ps(O + (g0 + g) * D + 8 * (c0 + c), acc[g][c]);
        }
      }
    }
  });
  return out;
}

// ------------------------------------------------------------------------------------ per-row elementwise
// Each is one pass over a decode step's few rows, in place of 3-6 torch ops and their temporaries.

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat && t.is_contiguous(), name,
              ": expected a contiguous float32 CPU tensor");
}

// Store one new key and value per slot at that slot's cache position `lengths[slot]`.
// k_new, v_new: (slots, kv_heads, head_dim); keys, values: (num_slots, kv_heads, max_len, head_dim).
void append_kv(const torch::Tensor& k_new, const torch::Tensor& v_new, torch::Tensor& keys, torch::Tensor& values,
               const torch::Tensor& lengths) {
  check_rows(k_new, "k_new");
  check_rows(v_new, "v_new");
  check_rows(keys, "keys");
  check_rows(values, "values");
  TORCH_CHECK(lengths.scalar_type() == torch::kLong && lengths.is_contiguous(), "append_kv: int64 lengths");
  const int64_t slots = k_new.size(0), heads = k_new.size(1), D = k_new.size(2), max_len = keys.size(2);
  TORCH_CHECK(keys.size(0) >= slots && keys.size(1) == heads && keys.size(3) == D && keys.sizes() == values.sizes() &&
              v_new.sizes() == k_new.sizes() && lengths.numel() == slots, "append_kv: shapes do not match");
  const int64_t* len = lengths.data_ptr<int64_t>();
  for (int64_t s = 0; s < slots; ++s)
    TORCH_CHECK(len[s] >= 0 && len[s] < max_len, "append_kv: cache position out of range: ", len[s]);
  const float* kn = k_new.data_ptr<float>();
  const float* vn = v_new.data_ptr<float>();
  float* kc = keys.data_ptr<float>();
  float* vc = values.data_ptr<float>();
  for (int64_t s = 0; s < slots; ++s)
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t row = ((s * heads + h) * max_len + len[s]) * D;
      std::copy_n(kn + (s * heads + h) * D, D, kc + row);
      std::copy_n(vn + (s * heads + h) * D, D, vc + row);
    }
}

// RMSNorm as in Llama/Qwen2: weight * (x * rsqrt(mean(x^2) + eps)). x: (rows, hidden) -> new tensor.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(weight, "weight");
  const int64_t rows = x.size(0), H = x.size(1);
  TORCH_CHECK(x.dim() == 2 && weight.numel() == H, "rms_norm: x (rows, hidden) and weight (hidden,)");
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = xp + r * H;
    float* orow = op + r * H;
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= H; i += 8) {
      const __m256 v = _mm256_loadu_ps(xr + i);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    float squares = hsum(acc);
    for (; i < H; ++i) squares += xr[i] * xr[i];
    const float inv = 1.0f / std::sqrt(squares / static_cast<float>(H) + static_cast<float>(eps));
    for (i = 0; i < H; ++i) orow[i] = wp[i] * (xr[i] * inv);
  }
  return out;
}

// Rotary embedding (HF rotate_half convention), in place, times `scale`: x (rows, heads, head_dim),
// cos, sin (rows, head_dim).
void rotate_(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, double scale) {
  check_rows(x, "x");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  const int64_t rows = x.size(0), heads = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(x.dim() == 3 && D % 2 == 0 && cos.size(0) == rows && cos.size(-1) == D && sin.sizes() == cos.sizes(),
              "rotate_: x (rows, heads, head_dim), cos and sin (rows, head_dim)");
  const float f = static_cast<float>(scale);
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cp + r * D;
    const float* sn = sp + r * D;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = xp + (r * heads + h) * D;
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = (a * c[i] - b * sn[i]) * f;
        v[i + half] = (b * c[i + half] + a * sn[i + half]) * f;
      }
    }
  }
}

// silu(gate) * up, into gate. gate, up: (rows, features).
void silu_mul_(torch::Tensor& gate, const torch::Tensor& up) {
  check_rows(gate, "gate");
  check_rows(up, "up");
  TORCH_CHECK(gate.sizes() == up.sizes(), "silu_mul_: gate and up must have one shape");
  float* g = gate.data_ptr<float>();
  const float* u = up.data_ptr<float>();
  const int64_t n = gate.numel();
  at::parallel_for(0, n, 4096, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= end; i += 8) {
      const __m256 x = _mm256_loadu_ps(g + i);
      // sigmoid(x) from e = exp(-|x|) (never overflows): x >= 0 -> 1 / (1 + e), x < 0 -> e / (1 + e).
      const __m256 e = exp_nonpositive(_mm256_or_ps(x, sign));
      const __m256 negative = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
      const __m256 numerator = _mm256_blendv_ps(one, e, negative);
      const __m256 sigmoid = _mm256_div_ps(numerator, _mm256_add_ps(one, e));
      _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_mul_ps(x, sigmoid), _mm256_loadu_ps(u + i)));
    }
    for (; i < end; ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  });
}

// --------------------------------------------------------------------------------------------- sampling
// One token per row from softmax(logits / temperature) by inverse CDF with the given uniform draws, and its
// log-prob: the first index whose running sum of exp(l / T - max) exceeds u * total (as torch.searchsorted
// with right=True over the cumulative sum). logits: (rows, vocab); uniforms: (rows,) in [0, 1).
std::tuple<torch::Tensor, torch::Tensor> sample_rows(const torch::Tensor& logits, double temperature,
                                                     const torch::Tensor& uniforms) {
  check_rows(logits, "logits");
  check_rows(uniforms, "uniforms");
  TORCH_CHECK(logits.dim() == 2 && uniforms.numel() == logits.size(0), "sample_rows: one uniform per row");
  TORCH_CHECK(temperature > 0, "sample_rows: temperature must be > 0");
  const int64_t rows = logits.size(0), V = logits.size(1);
  auto tokens = torch::empty({rows}, logits.options().dtype(torch::kLong));
  auto log_probs = torch::empty({rows}, logits.options());
  const float* lp = logits.data_ptr<float>();
  const float* up = uniforms.data_ptr<float>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  float* op = log_probs.data_ptr<float>();
  const float inv_t = static_cast<float>(1.0 / temperature);
  constexpr int64_t kBlock = 256;  // weights are summed per block; the draw is located block, then index
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> block_sums((V + kBlock - 1) / kBlock);
    for (int64_t r = begin; r < end; ++r) {
      const float* l = lp + r * V;
      __m256 vmax = _mm256_set1_ps(-INFINITY);
      int64_t i = 0;
      for (; i + 8 <= V; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(l + i));
      float maximum = hmax(vmax);
      for (; i < V; ++i) maximum = std::max(maximum, l[i]);
      const float shift = maximum * inv_t;
      const __m256 scale = _mm256_set1_ps(inv_t), offset = _mm256_set1_ps(shift);
      double total = 0.0;
      for (int64_t b = 0; b * kBlock < V; ++b) {
        const int64_t stop = std::min(V, (b + 1) * kBlock);
        __m256 acc = _mm256_setzero_ps();
        for (i = b * kBlock; i + 8 <= stop; i += 8)
          acc = _mm256_add_ps(acc, exp_nonpositive(_mm256_fmsub_ps(_mm256_loadu_ps(l + i), scale, offset)));
        float sum = hsum(acc);
        for (; i < stop; ++i) sum += std::exp(l[i] * inv_t - shift);
        block_sums[b] = sum;
        total += sum;
      }
      // Locate u * total: the block first, then the index inside it (scalar exp, one block).
      const double target = static_cast<double>(up[r]) * total;
      double running = 0.0;
      int64_t token = -1;
      for (int64_t b = 0; b * kBlock < V && token < 0; ++b) {
        if (running + block_sums[b] <= target) {
          running += block_sums[b];
          continue;
        }
        for (i = b * kBlock; i < std::min(V, (b + 1) * kBlock); ++i) {
          const float weight = std::exp(l[i] * inv_t - shift);
          running += weight;
          if (running > target && weight > 0.0f) {
            token = i;
            break;
          }
        }
      }
      if (token < 0) {  // rounding left the draw past the last positive weight: take that token
        for (i = V - 1; i >= 0 && token < 0; --i)
          if (std::exp(l[i] * inv_t - shift) > 0.0f) token = i;
      }
      tp[r] = token;
      op[r] = l[token] * inv_t - shift - static_cast<float>(std::log(total));
    }
  });
  return {tokens, log_probs};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_weight", &pack_weight, "pack a (out, in) weight into the panels linear_rows reads");
  m.def("linear_rows", &linear_rows, "x @ weight^T (+ bias) for a few rows of x, weight packed (fp32, AVX2)");
  m.def("linear_rows_add_", &linear_rows_add_, "residual += x @ weight^T (+ bias), in place (fp32, AVX2)");
  m.def("append_kv", &append_kv, "store one key/value per slot at its cache position");
  m.def("rms_norm", &rms_norm, "Llama/Qwen2 RMSNorm of a few rows");
  m.def("rotate_", &rotate_, "rotary embedding in place, times a scale");
  m.def("silu_mul_", &silu_mul_, "gate = silu(gate) * up, in place");
  m.def("sample_rows", &sample_rows, "inverse-CDF sampling at a temperature with given uniforms, and log-probs");
  m.def("decode_attention", &decode_attention, "one-token attention per slot over its visible cache (fp32, AVX2)");
}
