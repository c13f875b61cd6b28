// Attention read in place from a paged K/V cache.
//
// Each row names its attended slots in order (slot = block * block_size + offset); its query s
// attends the first lengths[row, s] of them (a causal chunk: its past, then its own positions up to
// s). Nothing is copied out of the cache first (what the plain-ops path must do: gather every row's
// history into a dense tensor per step). A task is (row, kv head, a tile of QUERY_TILE query
// positions): the tile's query heads share each chunk of CHUNK columns as it is read. Each query
// walks its columns in chunks of CHUNK from its first with an online softmax, in the accumulation
// type (float for float32 and bfloat16, double for float64), so its arithmetic depends only on its
// own vector and the K/V it attends, in their order: never on the other rows or queries, the
// padding, the tile, the thread count, or whether its positions came one at a time (decode) or as
// one chunk (prefill).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t CHUNK = 32;  // columns scored before one softmax rescale
constexpr int LANES = 16;      // independent partial sums of a dot product (one or two vectors)
constexpr int64_t QUERY_TILE = 16;  // query positions of a row that share each chunk of K/V read

template <typename T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };

template <typename T> inline typename Acc<T>::type widen(T x) { return static_cast<typename Acc<T>::type>(x); }
template <> inline float widen<c10::BFloat16>(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// q . k over d channels: LANES running sums (vectorized by the compiler), then summed in a fixed order.
template <typename T, typename A>
inline A dot(const A* q, const T* k, int64_t d) {
  A lanes[LANES] = {};
  int64_t i = 0;
  for (; i + LANES <= d; i += LANES) {
    for (int j = 0; j < LANES; ++j) lanes[j] += q[i + j] * widen(k[i + j]);
  }
  for (int j = 0; i < d; ++i, ++j) lanes[j] += q[i] * widen(k[i]);
  for (int width = LANES / 2; width > 0; width /= 2) {
    for (int j = 0; j < width; ++j) lanes[j] += lanes[j + width];
  }
  return lanes[0];
}

template <typename T>
void attention_kernel(const at::Tensor& query, const at::Tensor& cache_k, const at::Tensor& cache_v,
                      const at::Tensor& slots, const at::Tensor& lengths, double scale, at::Tensor& out) {
  using A = typename Acc<T>::type;
  const int64_t rows = query.size(0), heads = query.size(1), steps = query.size(2), dim = query.size(3);
  const int64_t block = cache_k.size(1), kv_heads = cache_k.size(2), dim_v = cache_v.size(3);
  const int64_t width = slots.size(1), groups = heads / kv_heads;
  const int64_t tiles = (steps + QUERY_TILE - 1) / QUERY_TILE;
  const T* q_data = query.data_ptr<T>();
  const T* k_data = cache_k.data_ptr<T>();
  const T* v_data = cache_v.data_ptr<T>();
  const int64_t* slot_data = slots.data_ptr<int64_t>();
  const int64_t* length_data = lengths.data_ptr<int64_t>();
  T* out_data = out.data_ptr<T>();
  const int64_t q_row = query.stride(0), q_head = query.stride(1), q_step = query.stride(2);
  const int64_t k_block = cache_k.stride(0), k_slot = cache_k.stride(1), k_head = cache_k.stride(2);
  const int64_t v_block = cache_v.stride(0), v_slot = cache_v.stride(1), v_head = cache_v.stride(2);
  const int64_t o_row = out.stride(0), o_head = out.stride(1), o_step = out.stride(2);
  const A scale_a = static_cast<A>(scale);

  at::parallel_for(0, rows * kv_heads * tiles, 1, [&](int64_t begin, int64_t end) {
    const int64_t most = QUERY_TILE * groups;  // query vectors of one task
    std::vector<A> q(most * dim), acc(most * dim_v), top(most), total(most), scores(CHUNK);
    std::vector<const T*> keys(CHUNK), values(CHUNK);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / (kv_heads * tiles), kv = (task / tiles) % kv_heads, tile = task % tiles;
      const int64_t first = tile * QUERY_TILE, last = std::min(steps, first + QUERY_TILE);
      const int64_t* row_lengths = length_data + row * steps;
      int64_t longest = 0;
      for (int64_t s = first; s < last; ++s) {
        longest = std::max(longest, row_lengths[s]);
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t at = (s - first) * groups + g;
          const T* src = q_data + row * q_row + (kv * groups + g) * q_head + s * q_step;
          for (int64_t i = 0; i < dim; ++i) q[at * dim + i] = widen(src[i]);
          top[at] = -std::numeric_limits<A>::infinity();
          total[at] = 0;
        }
      }
      std::fill(acc.begin(), acc.end(), A(0));
      const int64_t* row_slots = slot_data + row * width;
      for (int64_t start = 0; start < longest; start += CHUNK) {
        const int64_t n = std::min(CHUNK, longest - start);
        for (int64_t j = 0; j < n; ++j) {  // the chunk's K/V where they lie
          const int64_t slot = row_slots[start + j];
          const int64_t where = slot / block, offset = slot % block;
          keys[j] = k_data + where * k_block + offset * k_slot + kv * k_head;
          values[j] = v_data + where * v_block + offset * v_slot + kv * v_head;
        }
        for (int64_t s = first; s < last; ++s) {
          const int64_t m = std::min(n, row_lengths[s] - start);  // the columns this query attends
          if (m <= 0) continue;
          for (int64_t g = 0; g < groups; ++g) {
            const int64_t at = (s - first) * groups + g;
            A best = top[at];
            for (int64_t j = 0; j < m; ++j) {
              scores[j] = dot(q.data() + at * dim, keys[j], dim) * scale_a;
              best = scores[j] > best ? scores[j] : best;
            }
            const A shrink = std::exp(top[at] - best);  // exp(-inf) = 0 on the first chunk
            A* a = acc.data() + at * dim_v;
            for (int64_t i = 0; i < dim_v; ++i) a[i] *= shrink;
            A sum = total[at] * shrink;
            for (int64_t j = 0; j < m; ++j) {
              const A p = std::exp(scores[j] - best);
              sum += p;
              const T* v = values[j];
              for (int64_t i = 0; i < dim_v; ++i) a[i] += p * widen(v[i]);
            }
            top[at] = best;
            total[at] = sum;
          }
        }
      }
      for (int64_t s = first; s < last; ++s) {
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t at = (s - first) * groups + g;
          T* dst = out_data + row * o_row + (kv * groups + g) * o_head + s * o_step;
          const A* a = acc.data() + at * dim_v;
          const A inv = total[at] > 0 ? A(1) / total[at] : A(0);  // a query of no columns: zeros
          for (int64_t i = 0; i < dim_v; ++i) dst[i] = static_cast<T>(a[i] * inv);
        }
      }
    }
  });
}

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& cache_k, const at::Tensor& cache_v,
                           const at::Tensor& slots, const at::Tensor& lengths, double scale) {
  TORCH_CHECK(query.device().is_cpu(), "paged_attention: CPU tensors only");
  TORCH_CHECK(query.dim() == 4, "paged_attention: query must be (B, H, S, D)");
  TORCH_CHECK(cache_k.dim() == 4 && cache_v.dim() == 4, "paged_attention: caches must be (N, block, H_kv, D)");
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == query.size(0) && slots.scalar_type() == at::kLong,
              "paged_attention: slots must be int64 (B, T)");
  TORCH_CHECK(lengths.dim() == 2 && lengths.size(0) == query.size(0) && lengths.size(1) == query.size(2) &&
                  lengths.scalar_type() == at::kLong,
              "paged_attention: lengths must be int64 (B, S)");
  TORCH_CHECK(query.size(1) % cache_k.size(2) == 0, "paged_attention: query heads must be a multiple of kv heads");
  TORCH_CHECK(query.size(3) == cache_k.size(3) && cache_k.size(2) == cache_v.size(2) &&
                  cache_k.size(0) == cache_v.size(0) && cache_k.size(1) == cache_v.size(1),
              "paged_attention: shapes disagree");
  TORCH_CHECK(cache_k.scalar_type() == query.scalar_type() && cache_v.scalar_type() == query.scalar_type(),
              "paged_attention: query and caches must share a dtype");
  TORCH_CHECK(query.stride(3) == 1 && cache_k.stride(3) == 1 && cache_v.stride(3) == 1,
              "paged_attention: the channel dim must be contiguous");
  at::Tensor slots_c = slots.contiguous(), lengths_c = lengths.contiguous();
  if (slots_c.numel()) {
    TORCH_CHECK(slots_c.min().item<int64_t>() >= 0 && slots_c.max().item<int64_t>() < cache_k.size(0) * cache_k.size(1),
                "paged_attention: every slot must lie in the cache");
  }
  if (lengths_c.numel()) {
    TORCH_CHECK(lengths_c.min().item<int64_t>() >= 0 && lengths_c.max().item<int64_t>() <= slots_c.size(1),
                "paged_attention: lengths must lie in [0, T]");
  }
  at::Tensor out = at::empty({query.size(0), query.size(1), query.size(2), cache_v.size(3)}, query.options());
  switch (query.scalar_type()) {
    case at::kFloat: attention_kernel<float>(query, cache_k, cache_v, slots_c, lengths_c, scale, out); break;
    case at::kDouble: attention_kernel<double>(query, cache_k, cache_v, slots_c, lengths_c, scale, out); break;
    case at::kBFloat16:
      attention_kernel<c10::BFloat16>(query, cache_k, cache_v, slots_c, lengths_c, scale, out);
      break;
    default: TORCH_CHECK(false, "paged_attention: float32, float64 or bfloat16 only, got ", query.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(hyper_gen, m) {
  m.def("paged_attention(Tensor query, Tensor cache_k, Tensor cache_v, Tensor slots, Tensor lengths, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(hyper_gen, CPU, m) { m.impl("paged_attention", &paged_attention); }
