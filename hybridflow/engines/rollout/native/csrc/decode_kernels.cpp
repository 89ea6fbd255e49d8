// CPU kernels for the native rollout's decode step (fp32, AVX2 + FMA), built on first use by `kernels.py`.
//
// Why they exist (docs/performance.md): a decode step multiplies a few rows of activations by every weight
// matrix once. torch's GEMM (MKL) streams weights that are not in cache at about a third of this CPU's read
// bandwidth for 16 rows, and the decode attention over the cache is 2 x layers x slots x heads tiny batched
// matmuls plus softmax. These kernels do the same math in one pass each:
// - linear_rows: y = x @ w^T (+ bias) for a few rows x, each weight row read once and dotted with all rows.
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
// relative error ~1e-7 on [-87, 0]; below that the result is ~0 (as exp underflows in fp32 anyway).
inline __m256 exp_nonpositive(__m256 x) {
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
  return _mm256_mul_ps(y, _mm256_castsi256_ps(exponent));
}

// ---------------------------------------------------------------------------------------------- linear_rows
// A block of MR activation rows times NR weight rows, dot products along K (both row-major, so no packing
// and the weights are read where they are). With MR=4, NR=3: 12 accumulators, 7 loads per 12 FMAs.
// PREFETCH: the first row block of a weight block also prefetches the weight block `prefetch` floats ahead.
template <int MR, int NR, bool PREFETCH>
inline void dot_block(const float* x, int64_t K, const float* w, float* y, int64_t ldy, int64_t prefetch) {
  __m256 acc[MR][NR];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    if (PREFETCH && (k & 15) == 0) {
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
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float sum = hsum(acc[i][j]);
      for (int64_t t = k; t < K; ++t) sum += x[i * K + t] * w[j * K + t];
      y[i * ldy + j] = sum;
    }
}

// All M activation rows against NR weight rows starting at `w`; y points at column 0 of those outputs.
template <int NR>
inline void weight_block(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t N, int64_t prefetch) {
  int64_t m = 0;
  if (M >= 4) {
    dot_block<4, NR, true>(x, K, w, y, N, prefetch);
    m = 4;
  }
  for (; m + 4 <= M; m += 4) dot_block<4, NR, false>(x + m * K, K, w, y + m * N, N, 0);
  switch (M - m) {
    case 3: dot_block<3, NR, false>(x + m * K, K, w, y + m * N, N, 0); break;
    case 2: dot_block<2, NR, false>(x + m * K, K, w, y + m * N, N, 0); break;
    case 1: dot_block<1, NR, false>(x + m * K, K, w, y + m * N, N, 0); break;
    default: break;
  }
}

constexpr int64_t kPrefetchRows = 8;    // cache rows ahead in decode_attention
constexpr int kGroupBlock = 3;          // query heads per pass over the values (x kLaneBlock accumulators)
constexpr int kLaneBlock = 4;           // 8-float lane blocks of head_dim per pass
constexpr int64_t kWeightRows = 3;      // NR
constexpr int64_t kPrefetchBlocks = 2;  // weight blocks ahead (measured 1-4 alike; 0 is ~10% slower)

void check_float_matrix(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat, name, ": expected a float32 CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1 && t.stride(0) == t.size(1), name, ": expected a contiguous matrix");
}

}  // namespace

torch::Tensor linear_rows(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias) {
  check_float_matrix(x, "x");
  check_float_matrix(weight, "weight");
  TORCH_CHECK(x.size(1) == weight.size(1), "linear_rows: x has ", x.size(1), " features, weight ", weight.size(1));
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = N / kWeightRows;
  const int64_t last_full = std::max<int64_t>(blocks - kPrefetchBlocks, 0);
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      // Never prefetch past the weight's end (the last blocks prefetch themselves: harmless).
      const int64_t ahead = b < last_full ? kPrefetchBlocks * kWeightRows * K : 0;
      weight_block<kWeightRows>(xp, M, K, wp + b * kWeightRows * K, yp + b * kWeightRows, N, ahead);
    }
  });
  const int64_t done = blocks * kWeightRows;
  if (N - done == 2) weight_block<2>(xp, M, K, wp + done * K, yp + done, N, 0);
  if (N - done == 1) weight_block<1>(xp, M, K, wp + done * K, yp + done, N, 0);
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

// ------------------------------------------------------------------------------------------ decode_attention
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
      // scores[g, t] = q[g] . k[t]: each key row is loaded once for all query heads of the group.
      for (int64_t t = 0; t < n; ++t) {
        const float* k_row = K + t * D;
        // The cache is read once per step from memory: ask for rows kPrefetchRows ahead (keys now, the
        // same rows of values for the pass below).
        for (int64_t line = 0; line < D; line += 16) {
          _mm_prefetch(reinterpret_cast<const char*>(k_row + kPrefetchRows * D + line), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(V + t * D + line), _MM_HINT_T1);
        }
        for (int64_t g = 0; g < group; ++g) {
          const float* q_row = Q + g * D;
          __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
          int64_t c = 0;
          for (; c + 2 <= chunks; c += 2) {
            acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(q_row + 8 * c), _mm256_loadu_ps(k_row + 8 * c), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(q_row + 8 * c + 8), _mm256_loadu_ps(k_row + 8 * c + 8), acc1);
          }
          if (c < chunks) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(q_row + 8 * c), _mm256_loadu_ps(k_row + 8 * c), acc0);
          scores[g * n + t] = hsum(_mm256_add_ps(acc0, acc1));
        }
      }
      // softmax per query head, then out[g] = sum_t p[g, t] v[t].
      for (int64_t g = 0; g < group; ++g) {
        float* p = scores.data() + g * n;
        __m256 vmax = _mm256_set1_ps(-INFINITY);
        int64_t t = 0;
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_rows", &linear_rows, "y = x @ weight^T (+ bias) for a few rows of x (fp32, AVX2)");
  m.def("decode_attention", &decode_attention, "one-token attention per slot over its visible cache (fp32, AVX2)");
}
