// Decode attention read in place from the engine's paged K/V pool.
//
// One query token per row attends over the pool slots its row names, in order, without copying
// them out first (what the plain-ops path must do: gather every row's history into a dense tensor
// per step). Each (row, kv head) is one task: its G query heads walk the row's attended slots in
// fixed chunks of CHUNK columns with an online softmax, in the accumulation type (float for float32
// and bfloat16, double for float64). A task's arithmetic depends only on its own query and the K/V
// of the slots it names, in their order: never on the other rows, the padding, or the thread count.

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
void decode_kernel(const at::Tensor& query, const at::Tensor& pool_k, const at::Tensor& pool_v,
                   const at::Tensor& slots, double scale, at::Tensor& out) {
  using A = typename Acc<T>::type;
  const int64_t rows = query.size(0), heads = query.size(1), dim = query.size(3);
  const int64_t kv_heads = pool_k.size(1), dim_v = pool_v.size(2), width = slots.size(1);
  const int64_t groups = heads / kv_heads;
  const T* q_data = query.data_ptr<T>();
  const T* k_data = pool_k.data_ptr<T>();
  const T* v_data = pool_v.data_ptr<T>();
  const int64_t* slot_data = slots.data_ptr<int64_t>();
  T* out_data = out.data_ptr<T>();
  const int64_t q_row = query.stride(0), q_head = query.stride(1);
  const int64_t k_slot = pool_k.stride(0), k_head = pool_k.stride(1);
  const int64_t v_slot = pool_v.stride(0), v_head = pool_v.stride(1);
  const int64_t o_row = out.stride(0), o_head = out.stride(1);
  const A scale_a = static_cast<A>(scale);

  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<A> q(groups * dim), acc(groups * dim_v), scores(groups * CHUNK);
    std::vector<A> top(groups), total(groups);
    std::vector<int64_t> chunk(CHUNK);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / kv_heads, kv = task % kv_heads;
      for (int64_t g = 0; g < groups; ++g) {
        const T* src = q_data + row * q_row + (kv * groups + g) * q_head;
        for (int64_t i = 0; i < dim; ++i) q[g * dim + i] = widen(src[i]);
        top[g] = -std::numeric_limits<A>::infinity();
        total[g] = 0;
      }
      std::fill(acc.begin(), acc.end(), A(0));
      const int64_t* row_slots = slot_data + row * width;
      int64_t column = 0;
      while (column < width) {
        int64_t n = 0;  // the next (up to) CHUNK attended slots of the row, in order
        for (; column < width && n < CHUNK; ++column) {
          if (row_slots[column] >= 0) chunk[n++] = row_slots[column];
        }
        if (n == 0) break;
        for (int64_t g = 0; g < groups; ++g) {
          A* s = scores.data() + g * CHUNK;
          A best = top[g];
          for (int64_t j = 0; j < n; ++j) {
            s[j] = dot(q.data() + g * dim, k_data + chunk[j] * k_slot + kv * k_head, dim) * scale_a;
            best = s[j] > best ? s[j] : best;
          }
          const A shrink = std::exp(top[g] - best);  // exp(-inf) = 0 on the first chunk
          A* a = acc.data() + g * dim_v;
          for (int64_t i = 0; i < dim_v; ++i) a[i] *= shrink;
          A sum = total[g] * shrink;
          for (int64_t j = 0; j < n; ++j) {
            const A p = std::exp(s[j] - best);
            sum += p;
            const T* v = v_data + chunk[j] * v_slot + kv * v_head;
            for (int64_t i = 0; i < dim_v; ++i) a[i] += p * widen(v[i]);
          }
          top[g] = best;
          total[g] = sum;
        }
      }
      for (int64_t g = 0; g < groups; ++g) {
        T* dst = out_data + row * o_row + (kv * groups + g) * o_head;
        const A* a = acc.data() + g * dim_v;
        const A inv = total[g] > 0 ? A(1) / total[g] : A(0);
        for (int64_t i = 0; i < dim_v; ++i) dst[i] = static_cast<T>(a[i] * inv);
      }
    }
  });
}

at::Tensor paged_decode(const at::Tensor& query, const at::Tensor& pool_k, const at::Tensor& pool_v,
                        const at::Tensor& slots, double scale) {
  TORCH_CHECK(query.device().is_cpu(), "paged_decode: CPU tensors only");
  TORCH_CHECK(query.dim() == 4 && query.size(2) == 1, "paged_decode: query must be (B, H, 1, D)");
  TORCH_CHECK(pool_k.dim() == 3 && pool_v.dim() == 3, "paged_decode: pools must be (slots, H_kv, D)");
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == query.size(0) && slots.scalar_type() == at::kLong,
              "paged_decode: slots must be int64 (B, T)");
  TORCH_CHECK(query.size(1) % pool_k.size(1) == 0, "paged_decode: query heads must be a multiple of kv heads");
  TORCH_CHECK(query.size(3) == pool_k.size(2) && pool_k.size(1) == pool_v.size(1), "paged_decode: shapes disagree");
  TORCH_CHECK(pool_k.scalar_type() == query.scalar_type() && pool_v.scalar_type() == query.scalar_type(),
              "paged_decode: query and pools must share a dtype");
  TORCH_CHECK(query.stride(3) == 1 && pool_k.stride(2) == 1 && pool_v.stride(2) == 1,
              "paged_decode: the channel dim must be contiguous");
  at::Tensor slots_c = slots.contiguous();
  at::Tensor out = at::empty({query.size(0), query.size(1), 1, pool_v.size(2)}, query.options());
  switch (query.scalar_type()) {
    case at::kFloat: decode_kernel<float>(query, pool_k, pool_v, slots_c, scale, out); break;
    case at::kDouble: decode_kernel<double>(query, pool_k, pool_v, slots_c, scale, out); break;
    case at::kBFloat16: decode_kernel<c10::BFloat16>(query, pool_k, pool_v, slots_c, scale, out); break;
    default: TORCH_CHECK(false, "paged_decode: float32, float64 or bfloat16 only, got ", query.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(hyper_gen, m) {
  m.def("paged_decode(Tensor query, Tensor pool_k, Tensor pool_v, Tensor slots, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(hyper_gen, CPU, m) { m.impl("paged_decode", &paged_decode); }
