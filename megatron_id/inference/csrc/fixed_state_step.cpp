// The fused decode step's core for interdomain / S4D-only layers on a CPU, in one call: from the
// input projection's output y to the mixer output before o_proj, for one token of every slot
// (megatron_id/inference/fused_decode.py, fixed_state_mixer, is the reference this is tested
// against, in float64 to 1e-10: tests/test_fused_decode.py).
//
// Why: at short prefixes a decode step on a CPU is bound by per-op overhead (~40 small torch ops
// between the two matrix products of a layer), not by arithmetic; here they are one call, and
// the state is read and written once: each (slot, head) updates its key rows while accumulating
// the query's product with them, applies the Gram form G2, then updates its value rows while
// reading them out (the readout uses the updated state, as the model does).
//
// State layout (as fused_decode.py): S [B, H, P, 2M], Re and Im of each mode side by side.
// `rows` (optional, int64 [B]): the token of row b updates slot rows[b] of conv_tail and state,
// which may then be views with any stride between slots (each slot's own numbers contiguous):
// vLLM's state pages, updated in place without copying the slots out and back (vllm_plugin).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#include <vector>

namespace {

template <typename T>
inline T silu(T x) { return x / (T(1) + std::exp(-x)); }

// The state update X <- lambda X + bbar z of one row (M complex modes, Re and Im side by side), z
// real, on per-head tables laid out as the row is, so that it is contiguous multiply-adds:
//     X'[2m] = lr X[2m] - li X[2m+1] + br z,   X'[2m+1] = lr X[2m+1] + li X[2m] + bi z
//   = lr2[n] X[n] + lis[n] X[n^1] + bb[n] z   with lr2 = (lr, lr), lis = (-li, li), bb = (br, bi).
// Three forms: the update alone is not needed, each pass also reads the updated row, either into
// u += q_j row (the key rows) or into a dot with w (the value rows, the contraction readout), so
// that every row is loaded and stored once per token.
template <typename T>
inline void pair_tables(const T* lr, const T* li, const T* br, const T* bi, int64_t M, T* lr2, T* lis, T* bb) {
  for (int64_t m = 0; m < M; ++m) {
    lr2[2 * m] = lr2[2 * m + 1] = lr[m];
    lis[2 * m] = -li[m];
    lis[2 * m + 1] = li[m];
    bb[2 * m] = br[m];
    bb[2 * m + 1] = bi[m];
  }
}

template <typename T>
inline void update_pair(T* row, int64_t n, const T* lr2, const T* lis, const T* bb, T z) {
  const T re = row[n], im = row[n + 1];
  row[n] = lr2[n] * re + lis[n] * im + bb[n] * z;
  row[n + 1] = lr2[n + 1] * im + lis[n + 1] * re + bb[n + 1] * z;
}

// key row: update, then u += qj * row
template <typename T>
inline void update_accumulate(T* __restrict row, const T* lr2, const T* lis, const T* bb, T z, T qj,
                              T* __restrict u, int64_t M2) {
  for (int64_t n = 0; n < M2; n += 2) {
    update_pair(row, n, lr2, lis, bb, z);
    u[n] += qj * row[n];
    u[n + 1] += qj * row[n + 1];
  }
}

// value row (or the contraction's): update, then return row . w
template <typename T>
inline T update_dot(T* __restrict row, const T* lr2, const T* lis, const T* bb, T z, const T* __restrict w,
                    int64_t M2) {
  T acc = 0;
  for (int64_t n = 0; n < M2; n += 2) {
    update_pair(row, n, lr2, lis, bb, z);
    acc += row[n] * w[n] + row[n + 1] * w[n + 1];
  }
  return acc;
}

#if defined(__AVX2__) && defined(__FMA__)
// float32 with AVX2: 4 modes per register; X[n^1] is an in-lane swap of the pairs. Measured on this
// project's 2-core CPU (d 256, M 64, 4 heads: a 256 KB state per slot; one layer's call, 32 slots):
// 1.61 -> 0.72 ms on 1 thread, 0.86 -> 0.34 ms on 2, against GCC's own vectorisation of the loop
// over modes with lambda and bbar read per mode (docs/vllm.md).
inline __m256 update8(float* row, int64_t n, const float* lr2, const float* lis, const float* bb, __m256 z) {
  const __m256 x = _mm256_loadu_ps(row + n);
  __m256 r = _mm256_mul_ps(_mm256_loadu_ps(bb + n), z);
  r = _mm256_fmadd_ps(_mm256_loadu_ps(lis + n), _mm256_permute_ps(x, 0xB1), r);
  r = _mm256_fmadd_ps(_mm256_loadu_ps(lr2 + n), x, r);
  _mm256_storeu_ps(row + n, r);
  return r;
}

inline void update_accumulate(float* __restrict row, const float* lr2, const float* lis, const float* bb, float z,
                              float qj, float* __restrict u, int64_t M2) {
  const __m256 zz = _mm256_set1_ps(z), q = _mm256_set1_ps(qj);
  int64_t n = 0;
  for (; n + 8 <= M2; n += 8) {
    const __m256 r = update8(row, n, lr2, lis, bb, zz);
    _mm256_storeu_ps(u + n, _mm256_fmadd_ps(q, r, _mm256_loadu_ps(u + n)));
  }
  if (n < M2) update_accumulate<float>(row + n, lr2 + n, lis + n, bb + n, z, qj, u + n, M2 - n);   // the tail
}

inline float update_dot(float* __restrict row, const float* lr2, const float* lis, const float* bb, float z,
                        const float* __restrict w, int64_t M2) {
  const __m256 zz = _mm256_set1_ps(z);
  // two accumulators: one chain of dependent multiply-adds waited ~4 cycles each on the last
  __m256 acc8 = _mm256_setzero_ps(), odd8 = _mm256_setzero_ps();
  int64_t n = 0;
  for (; n + 16 <= M2; n += 16) {
    acc8 = _mm256_fmadd_ps(update8(row, n, lr2, lis, bb, zz), _mm256_loadu_ps(w + n), acc8);
    odd8 = _mm256_fmadd_ps(update8(row, n + 8, lr2, lis, bb, zz), _mm256_loadu_ps(w + n + 8), odd8);
  }
  for (; n + 8 <= M2; n += 8) acc8 = _mm256_fmadd_ps(update8(row, n, lr2, lis, bb, zz), _mm256_loadu_ps(w + n), acc8);
  acc8 = _mm256_add_ps(acc8, odd8);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc8);
  const float acc = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  return n < M2 ? acc + update_dot<float>(row + n, lr2 + n, lis + n, bb + n, z, w + n, M2 - n) : acc;   // the tail
}
#endif

// Ask for a row a few rows ahead (a prefetch never faults, past the end included). A step reads
// and writes every slot's whole state (256 KB a layer at d 256, M 64), which a serving step's LM
// head has evicted from the caches; the hardware's own prefetch stops at each 4 KB page.
// benchmarks/state_traffic.py (4 layers, caches evicted, 1 thread): 8 slots 2.14 -> 1.55 ms,
// 32 slots 7.25 -> 5.65 ms (AHEAD 8 measured as 4, 16 slower).
template <typename T>
inline void prefetch_row(const T* row, int64_t M2) {
#if defined(__AVX2__) && defined(__FMA__)
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < M2 * int64_t(sizeof(T)); b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
#endif
}
constexpr int64_t AHEAD = 4;

template <typename T>
void step(const at::Tensor& y, at::Tensor& conv_tail, const at::Tensor& conv_w, const at::Tensor& conv_b,
          const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& sin, const at::Tensor& kv_norm,
          const at::Tensor& kv_bias, const at::Tensor& lam_re, const at::Tensor& lam_im, const at::Tensor& bbar_re,
          const at::Tensor& bbar_im, const at::Tensor& readout, at::Tensor& state, int64_t rotated,
          int64_t mapped, bool query, bool dual, bool gate, double norm_eps, const int64_t* rowp,
          at::Tensor& out) {
  const int64_t tail_stride = conv_tail.stride(0), state_stride = state.stride(0);
  const int64_t B = y.size(0), Y = y.size(1), C = conv_w.size(0), K = conv_w.size(1);
  const int64_t H = kv_bias.size(1), Dh = kv_bias.size(2), M = lam_re.size(-1), M2 = 2 * M;
  const int64_t P = state.size(2), pieces = C / (H * Dh), first = query ? 1 : 0;
  const int64_t out_width = query ? P - Dh : P;   // per head: Dv (readout) or P (contraction)
  const T* yp = y.data_ptr<T>();
  T* tail = conv_tail.data_ptr<T>();
  const T *cw = conv_w.data_ptr<T>(), *cb = conv_b.data_ptr<T>();
  const T* cosp = rotated ? cos->data_ptr<T>() : nullptr;
  const T* sinp = rotated ? sin->data_ptr<T>() : nullptr;
  const T *kn = kv_norm.data_ptr<T>(), *kb = kv_bias.data_ptr<T>();
  const T *lr = lam_re.data_ptr<T>(), *li = lam_im.data_ptr<T>();
  const T *br = bbar_re.data_ptr<T>(), *bi = bbar_im.data_ptr<T>();
  const T* G = readout.data_ptr<T>();
  T* S = state.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const T eps = static_cast<T>(norm_eps);

  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> work(pieces * Dh + 2 * Dh + 5 * M2);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / H, h = task % H, slot = rowp ? rowp[b] : b;
      T* piece = work.data();              // [pieces, Dh]: this head's convolved projections
      T* z = piece + pieces * Dh;          // [2 Dh]: key, value
      T* u = z + 2 * Dh;                   // [2M]
      T* w = u + M2;                       // [2M]
      T* lr2 = w + M2;                     // [2M] x 3: this head's update tables (see pair_tables)
      T* lis = lr2 + M2;
      T* bb = lis + M2;
      const T* yb = yp + b * Y;
      // the short causal conv of this head's channels (the tail holds the previous K-1 inputs)
      for (int64_t p = 0; p < pieces; ++p) {
        for (int64_t d = 0; d < Dh; ++d) {
          const int64_t c = p * H * Dh + h * Dh + d;
          T* t = tail + slot * tail_stride + c * (K - 1);
          const T* wc = cw + c * K;
          T acc = cb[c] + yb[c] * wc[K - 1];
          for (int64_t i = 0; i < K - 1; ++i) acc += t[i] * wc[i];
          for (int64_t i = 0; i + 1 < K - 1; ++i) t[i] = t[i + 1];
          if (K > 1) t[K - 2] = yb[c];
          piece[p * Dh + d] = acc;
        }
      }
      // RoPE (half-split layout) on the first `rotated` pieces
      const int64_t half = Dh / 2;
      for (int64_t p = 0; p < rotated; ++p) {
        T* x = piece + p * Dh;
        for (int64_t d = 0; d < half; ++d) {
          const T c = cosp[b * half + d], s = sinp[b * half + d], x1 = x[d], x2 = x[d + half];
          x[d] = x1 * c - x2 * s;
          x[d + half] = x2 * c + x1 * s;
        }
      }
      // the feature map SiLU(x) / max(||SiLU(x)||, 1e-6) on the first `mapped` pieces
      for (int64_t p = 0; p < mapped; ++p) {
        T* x = piece + p * Dh;
        T sq = 0;
        for (int64_t d = 0; d < Dh; ++d) {
          x[d] = silu(x[d]);
          sq += x[d] * x[d];
        }
        const T scale = T(1) / std::max(std::sqrt(sq), T(1e-6));
        for (int64_t d = 0; d < Dh; ++d) x[d] *= scale;
      }
      // key and value, each RMS-normalised with its weight, plus its per-head bias
      const T* value = dual ? yb + C + h * Dh : piece + (first + 1) * Dh;
      for (int64_t d = 0; d < Dh; ++d) {
        z[d] = piece[first * Dh + d];
        z[Dh + d] = value[d];
      }
      for (int64_t i = 0; i < 2; ++i) {
        T* x = z + i * Dh;
        T sq = 0;
        for (int64_t d = 0; d < Dh; ++d) sq += x[d] * x[d];
        const T r = T(1) / std::sqrt(sq / T(Dh) + eps);
        for (int64_t d = 0; d < Dh; ++d) x[d] = x[d] * r * kn[i * Dh + d] + kb[(i * H + h) * Dh + d];
      }
      pair_tables(lr + h * M, li + h * M, br + h * M, bi + h * M, M, lr2, lis, bb);
      T* Sh = S + slot * state_stride + h * P * M2;
      if (task + 1 < end && h + 1 == H) {   // the next slot's first rows (the next head's follow these)
        const int64_t next = rowp ? rowp[b + 1] : b + 1;
        for (int64_t j = 0; j < AHEAD; ++j) prefetch_row(S + next * state_stride + j * M2, M2);
      }
      T* oh = o + b * H * out_width + h * out_width;
      if (query) {
        // u = q S_k (the updated key rows), w = u G2, o = S_v w (the updated value rows)
        const T* q = piece;
        for (int64_t n = 0; n < M2; ++n) u[n] = 0;
        for (int64_t j = 0; j < Dh; ++j) {
          prefetch_row(Sh + (j + AHEAD) * M2, M2);
          update_accumulate(Sh + j * M2, lr2, lis, bb, z[j], q[j], u, M2);
        }
        const T* Gh = G + h * M2 * M2;
        for (int64_t n = 0; n < M2; ++n) w[n] = 0;
        for (int64_t m = 0; m < M2; ++m) {
          const T um = u[m];
          const T* g = Gh + m * M2;
          for (int64_t n = 0; n < M2; ++n) w[n] += um * g[n];
        }
        prefetch_row(Sh + Dh * M2, M2);
        for (int64_t i = 0; i < out_width; ++i) {
          prefetch_row(Sh + (Dh + i + AHEAD) * M2, M2);
          oh[i] = update_dot(Sh + (Dh + i) * M2, lr2, lis, bb, z[Dh + i], w, M2);
        }
      } else {
        // the contraction readout o = Re(e^T X): one dot per updated row
        const T* e = G + h * M2;
        for (int64_t j = 0; j < P; ++j) oh[j] = update_dot(Sh + j * M2, lr2, lis, bb, z[j], e, M2);
      }
      if (gate) {
        const T* g = yb + Y - H * out_width + h * out_width;
        for (int64_t i = 0; i < out_width; ++i) oh[i] *= silu(g[i]);
      }
    }
  });
}

at::Tensor fixed_state_step(const at::Tensor& y, at::Tensor conv_tail, const at::Tensor& conv_w,
                            const at::Tensor& conv_b, const c10::optional<at::Tensor>& cos,
                            const c10::optional<at::Tensor>& sin, const at::Tensor& kv_norm, const at::Tensor& kv_bias,
                            const at::Tensor& lam_re, const at::Tensor& lam_im, const at::Tensor& bbar_re,
                            const at::Tensor& bbar_im, const at::Tensor& readout, at::Tensor state, int64_t rotated,
                            int64_t mapped, bool query, bool dual, bool gate, double norm_eps,
                            const c10::optional<at::Tensor>& rows) {
  const auto dtype = y.scalar_type();
  const at::Tensor* tensors[] = {&y, &conv_tail, &conv_w, &conv_b, &kv_norm, &kv_bias, &lam_re, &lam_im,
                                 &bbar_re, &bbar_im, &readout, &state};
  const char* names[] = {"y", "conv_tail", "conv_w", "conv_b", "kv_norm", "kv_bias", "lam_re", "lam_im",
                         "bbar_re", "bbar_im", "readout", "state"};
  for (int i = 0; i < 12; ++i) {
    const at::Tensor& t = *tensors[i];
    // with rows, the slots of conv_tail and state (i = 1, 11) may lie apart: each one contiguous
    const bool dense = (rows && (i == 1 || i == 11)) ? t[0].is_contiguous() : t.is_contiguous();
    TORCH_CHECK(t.device().is_cpu() && dense && t.scalar_type() == dtype, "fixed_state_step: ",
                names[i], " must be contiguous, on the CPU and ", dtype, " (as y); it is ", t.scalar_type(),
                " on ", t.device(), dense ? "" : ", not contiguous");
  }
  const int64_t B = y.size(0);
  const int64_t* rowp = nullptr;
  if (rows) {
    TORCH_CHECK(rows->device().is_cpu() && rows->is_contiguous() && rows->scalar_type() == at::kLong &&
                    rows->dim() == 1 && rows->size(0) == B,
                "fixed_state_step: rows must be a contiguous int64 CPU tensor of one slot per row of y");
    rowp = rows->data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(rowp[b] >= 0 && rowp[b] < state.size(0) && rowp[b] < conv_tail.size(0),
                  "fixed_state_step: rows[", b, "] = ", rowp[b], " is not a slot of the state (", state.size(0), ")");
    }
  } else {
    TORCH_CHECK(state.size(0) >= B && conv_tail.size(0) >= B, "fixed_state_step: ", B, " rows of y for ",
                state.size(0), " slots");
  }
  TORCH_CHECK(!rotated || (cos && sin && cos->is_contiguous() && sin->is_contiguous() &&
                           cos->scalar_type() == dtype && sin->scalar_type() == dtype),
              "fixed_state_step: RoPE needs contiguous cos and sin [B, Dh/2] of the model's dtype");
  const int64_t H = kv_bias.size(1), Dh = kv_bias.size(2), P = state.size(2);
  auto out = at::empty({y.size(0), H * (query ? P - Dh : P)}, y.options());
  if (dtype == at::kFloat) {
    step<float>(y, conv_tail, conv_w, conv_b, cos, sin, kv_norm, kv_bias, lam_re, lam_im, bbar_re, bbar_im, readout,
                state, rotated, mapped, query, dual, gate, norm_eps, rowp, out);
  } else if (dtype == at::kDouble) {
    step<double>(y, conv_tail, conv_w, conv_b, cos, sin, kv_norm, kv_bias, lam_re, lam_im, bbar_re, bbar_im, readout,
                 state, rotated, mapped, query, dual, gate, norm_eps, rowp, out);
  } else {
    TORCH_CHECK(false, "fixed_state_step: float32 or float64, not ", dtype);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(megatron_id, m) {
  m.def("fixed_state_step(Tensor y, Tensor(a!) conv_tail, Tensor conv_w, Tensor conv_b, Tensor? cos, Tensor? sin, "
        "Tensor kv_norm, Tensor kv_bias, Tensor lam_re, Tensor lam_im, Tensor bbar_re, Tensor bbar_im, "
        "Tensor readout, Tensor(b!) state, int rotated, int mapped, bool query, bool dual, bool gate, "
        "float norm_eps, Tensor? rows=None) -> Tensor");
  m.impl("fixed_state_step", c10::DispatchKey::CPU, TORCH_FN(fixed_state_step));
}
