// Decode attention over the paged KV cache, on CPU: decode.py's paged_decode, written out as loops.
//
// One (decode, KV head) at a time: each of its visible blocks is read once, keys then values, straight from the
// cache (flash-decoding's online softmax, rescaled once per chunk of blocks), the next block's keys and this block's
// values prefetched while its keys are scored. The scores are computed in tiles of four query heads by two keys, the
// softmax's bookkeeping in vectors, so that even with several query heads per KV head (GQA) the cost is mostly the
// memory (benchmarks/RESULTS.md). Registered as the torch operator batchgen::paged_decode (native.py builds it), which
// checks its inputs and allocates its output here. Vectors are GCC/Clang vector extensions, so the compiler picks the
// instructions of the machine it builds on (AVX2, AVX-512, NEON).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int W = 8;  // floats a vector: AVX2's width (AVX-512 machines run it as well; wider measured no faster)
typedef float vec __attribute__((vector_size(W * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(W * sizeof(int32_t))));

inline vec load(const float* p) {
    vec v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

inline vec load(const uint16_t* p) {  // bfloat16: the high half of a float32
    typedef uint16_t half8 __attribute__((vector_size(W * sizeof(uint16_t))));
    typedef uint32_t word8 __attribute__((vector_size(W * sizeof(uint32_t))));
    half8 h;
    std::memcpy(&h, p, sizeof h);
    word8 w = __builtin_convertvector(h, word8) << 16;
    vec v;
    std::memcpy(&v, &w, sizeof v);
    return v;
}

inline float scalar(const float* p) { return *p; }

inline float scalar(const uint16_t* p) {
    uint32_t w = uint32_t(*p) << 16;
    float f;
    std::memcpy(&f, &w, sizeof f);
    return f;
}

inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof v); }

inline float sum(vec v) {  // pairwise halving: log2(W) vector adds, not W scalar ones
    typedef float half __attribute__((vector_size(W * sizeof(float) / 2)));
    half lo, hi;
    std::memcpy(&lo, &v, sizeof lo);
    std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
    lo += hi;
    float s = 0.f;
    for (int i = 0; i < W / 2; ++i) s += lo[i];
    return s;
}

// exp of W floats (Cephes' expf: 2^n e^r, |r| <= ln2 / 2, within 2 ulp), exactly 0 at -inf.
inline vec exp(vec x) {
    const vec masked = x == -INFINITY ? vec{} + 1.f : vec{};
    x = x < -87.3f ? vec{} - 87.3f : x;
    x = x > 88.3f ? vec{} + 88.3f : x;
    vec n = x * 1.44269504088896341f + 0.5f;
    ivec ni = __builtin_convertvector(n, ivec);
    n = __builtin_convertvector(ni, vec);
    n = n > x * 1.44269504088896341f + 0.5f ? n - 1.f : n;  // floor, where the conversion truncated upwards
    ni = __builtin_convertvector(n, ivec);
    vec r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vec p = vec{} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    ivec bits = (ni + 127) << 23;
    vec scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return masked != 0.f ? vec{} : p * scale;
}

// row[i] = exp(row[i] - m); returns their sum.
inline float exp_minus(float* row, int64_t n, float m) {
    vec total = {};
    int64_t i = 0;
    for (; i + W <= n; i += W) {
        vec e = exp(load(row + i) - m);
        store(row + i, e);
        total += e;
    }
    float s = sum(total);
    for (; i < n; ++i) s += row[i] = std::exp(row[i] - m);
    return s;
}

// row[i] *= scale, then the soft-cap if any (softcap <= 0: none); returns the row's maximum. -inf stays -inf.
inline float scale_and_max(float* row, int64_t n, float scale, float softcap) {
    vec top = vec{} - INFINITY;
    int64_t i = 0;
    if (softcap <= 0.f) {
        for (; i + W <= n; i += W) {
            vec x = load(row + i) * scale;
            store(row + i, x);
            top = x > top ? x : top;
        }
    }
    float m = -INFINITY;
    for (int j = 0; j < W; ++j) m = top[j] > m ? top[j] : m;
    for (; i < n; ++i) {
        float x = row[i] * scale;
        if (softcap > 0.f && x != -INFINITY) x = std::tanh(x / softcap) * softcap;
        row[i] = x;
        m = x > m ? x : m;
    }
    return m;
}

inline void scale_by(float* x, int64_t n, float r) {
    int64_t i = 0;
    for (; i + W <= n; i += W) store(x + i, load(x + i) * r);
    for (; i < n; ++i) x[i] *= r;
}

template <typename T>
inline float dot(const float* q, const T* k, int64_t dim) {
    vec a = {}, b = {};
    int64_t d = 0;
    for (; d + 2 * W <= dim; d += 2 * W) {
        a += load(q + d) * load(k + d);
        b += load(q + d + W) * load(k + d + W);
    }
    for (; d + W <= dim; d += W) a += load(q + d) * load(k + d);
    float s = sum(a + b);
    for (; d < dim; ++d) s += q[d] * scalar(k + d);
    return s;
}

// x[i * stride + j] = q[i] . keys[j] for R query heads and two keys: each vector of a key is loaded once for R heads,
// each of a query once for both keys.
template <int R, typename T>
inline void tile(const float* q, const T* k0, const T* k1, int64_t dim, float* x, int64_t stride) {
    vec a[R][2] = {};
    int64_t d = 0;
    for (; d + W <= dim; d += W) {
        vec c0 = load(k0 + d), c1 = load(k1 + d);
        for (int i = 0; i < R; ++i) {
            vec qi = load(q + i * dim + d);
            a[i][0] += qi * c0, a[i][1] += qi * c1;
        }
    }
    for (int i = 0; i < R; ++i) {
        float s0 = sum(a[i][0]), s1 = sum(a[i][1]);
        for (int64_t e = d; e < dim; ++e) s0 += q[i * dim + e] * scalar(k0 + e), s1 += q[i * dim + e] * scalar(k1 + e);
        x[i * stride] = s0, x[i * stride + 1] = s1;
    }
}

// The scores of a KV head's G query heads against two keys, in tiles of four heads (with several query heads per KV
// head, the scores and not the memory would be the cost).
template <typename T>
inline void dots2(const float* q, int64_t G, const T* k0, const T* k1, int64_t dim, float* x, int64_t stride) {
    int64_t g = 0;
    for (; g + 4 <= G; g += 4) tile<4>(q + g * dim, k0, k1, dim, x + g * stride, stride);
    switch (G - g) {
        case 3: tile<3>(q + g * dim, k0, k1, dim, x + g * stride, stride); break;
        case 2: tile<2>(q + g * dim, k0, k1, dim, x + g * stride, stride); break;
        case 1: tile<1>(q + g * dim, k0, k1, dim, x + g * stride, stride); break;
    }
}

// acc[0:dim] += sum over the n rows t of w[t] * rows[t * stride:][0:dim] (rows not visible have w[t] == 0 and are
// skipped: a slot not yet written may hold anything). Four vectors of acc stay in registers across the rows.
template <typename T>
inline void add_weighted(float* acc, const float* w, const T* rows, int64_t n, int64_t stride, int64_t dim) {
    int64_t d = 0;
    for (; d + 4 * W <= dim; d += 4 * W) {
        vec a0 = load(acc + d), a1 = load(acc + d + W), a2 = load(acc + d + 2 * W), a3 = load(acc + d + 3 * W);
        for (int64_t t = 0; t < n; ++t) {
            if (w[t] == 0.f) continue;
            const T* r = rows + t * stride + d;
            a0 += w[t] * load(r), a1 += w[t] * load(r + W), a2 += w[t] * load(r + 2 * W), a3 += w[t] * load(r + 3 * W);
        }
        store(acc + d, a0), store(acc + d + W, a1), store(acc + d + 2 * W, a2), store(acc + d + 3 * W, a3);
    }
    for (; d + W <= dim; d += W) {
        vec a = load(acc + d);
        for (int64_t t = 0; t < n; ++t)
            if (w[t] != 0.f) a += w[t] * load(rows + t * stride + d);
        store(acc + d, a);
    }
    for (; d < dim; ++d)
        for (int64_t t = 0; t < n; ++t)
            if (w[t] != 0.f) acc[d] += w[t] * scalar(rows + t * stride + d);
}

struct Shape {
    int64_t kv_heads, groups, dim, vdim, slots, block_size;
};

// Up to this many slots of consecutive blocks are scored before one softmax update, then weighed: on 16-token blocks,
// rescaling per block cost as much as the reading on a fragmented cache (benchmarks/RESULTS.md).
constexpr int64_t CHUNK_SLOTS = 128;

// The slots of one chunk: whole blocks, at least one.
inline int64_t chunk_slots(int64_t block_size) {
    return block_size >= CHUNK_SLOTS ? block_size : CHUNK_SLOTS / block_size * block_size;
}

// Ask for `n` bytes from `p` on into L1, a line at a time. A block is a 4 KiB page of its own in a fragmented cache,
// where the hardware's prefetcher stops: reading the next block and this block's values while its keys are scored
// overlaps the memory with the arithmetic (with the chunks, 1.2-1.4x on one layer; benchmarks/RESULTS.md).
inline void prefetch(const void* p, int64_t n) {
    for (int64_t line = 0; line < n; line += 64) __builtin_prefetch(static_cast<const char*>(p) + line, 0, 3);
}

// What decode b sees: columns 0..count - 1 of its row of `tables`, column j the block holding positions from
// (first / block_size + j) * block_size on; of those, positions first..last.
struct Visible {
    const int64_t* row;
    int64_t count, base, first, last;  // base: the position of column 0's first slot

    Visible(const int64_t* tables, int64_t width, const int64_t* firsts, const int64_t* lasts, int64_t b, int64_t bs)
        : row(tables + b * width), first(firsts[b]), last(lasts[b]) {
        base = first / bs * bs;
        count = last / bs - first / bs + 1;
    }
};

// Decode b, KV head k: its `groups` query heads against its visible slots, a chunk of blocks at a time. `work`
// holds groups * (chunk_slots(block_size) + 2 + vdim) floats.
template <typename T>
void attend_one(int64_t b, int64_t k, const float* query, const T* k_cache, const T* v_cache, const Visible& seen,
                const float* sinks, float* out, const Shape& s, float scale, float softcap, float* work) {
    const int64_t G = s.groups, bs = s.block_size, count = seen.count, base = seen.base;
    const int64_t from = seen.first, to = seen.last, *blocks = seen.row;  // locals: the loops read them often
    const int64_t width = chunk_slots(bs), chunk = width / bs;  // slots, blocks
    float* scores = work;              // [G, width]
    float* best = scores + G * width;  // [G] running maximum
    float* total = best + G;           // [G] running sum of exp(score - best)
    float* acc = total + G;            // [G, vdim]
    const float* q = query + (b * s.kv_heads + k) * G * s.dim;
    for (int64_t g = 0; g < G; ++g) best[g] = -INFINITY, total[g] = 0.f;
    std::memset(acc, 0, sizeof(float) * G * s.vdim);
    const T* keys = k_cache + k * s.slots * s.dim;
    const T* values = v_cache + k * s.slots * s.vdim;
    const int64_t key_bytes = s.dim * sizeof(T), value_bytes = s.vdim * sizeof(T);
    for (int64_t first = 0; first < count; first += chunk) {
        const int64_t end = first + chunk < count ? first + chunk : count, n = (end - first) * bs;
        for (int64_t p = first; p < end; ++p) {  // the scores of the chunk's keys
            const T* kb = keys + blocks[p] * bs * s.dim;
            const T* vb = values + blocks[p] * bs * s.vdim;
            const T* next = p + 1 < count ? keys + blocks[p + 1] * bs * s.dim : nullptr;
            const int64_t at = base + p * bs;  // slots lo..hi of this block are visible
            const int64_t lo = from > at ? from - at : 0, hi = to - at < bs ? to - at : bs - 1;
            float* x = scores + (p - first) * bs;
            int64_t t = 0;
            for (; t + 2 <= bs; t += 2) {
                prefetch(vb + t * s.vdim, 2 * value_bytes);
                if (next != nullptr) prefetch(next + t * s.dim, 2 * key_bytes);
                if (t + 1 >= lo && t <= hi) dots2(q, G, kb + t * s.dim, kb + (t + 1) * s.dim, s.dim, x + t, width);
            }
            for (; t < bs; ++t)  // an odd block size's last slot
                for (int64_t g = 0; g < G; ++g) x[g * width + t] = dot(q + g * s.dim, kb + t * s.dim, s.dim);
            if (lo > 0 || hi < bs - 1)  // a decode's first or last block: what it does not see weighs nothing
                for (int64_t g = 0; g < G; ++g)
                    for (int64_t u = 0; u < bs; ++u)
                        if (u < lo || u > hi) x[g * width + u] = -INFINITY;
        }
        for (int64_t g = 0; g < G; ++g) {
            float* row = scores + g * width;
            float m = scale_and_max(row, n, scale, softcap);  // finite: every block walked holds a visible slot
            if (m > best[g]) {  // rescale what came before to the new maximum
                float r = std::exp(best[g] - m);
                total[g] *= r;
                scale_by(acc + g * s.vdim, s.vdim, r);
                best[g] = m;
            }
            total[g] += exp_minus(row, n, best[g]);  // 0 where not visible
        }
        for (int64_t p = first; p < end; ++p) {  // their values, weighed
            const T* vb = values + blocks[p] * bs * s.vdim;
            for (int64_t g = 0; g < G; ++g)
                add_weighted(acc + g * s.vdim, scores + g * width + (p - first) * bs, vb, bs, s.vdim, s.vdim);
        }
    }
    for (int64_t g = 0; g < G; ++g) {
        float norm = total[g];
        float* o = out + ((b * s.kv_heads + k) * G + g) * s.vdim;
        float r = 1.f;
        if (sinks != nullptr) {  // one more softmax column, carrying no value
            float sink = sinks[k * G + g];
            float m = sink > best[g] ? sink : best[g];
            r = std::exp(best[g] - m);
            norm = norm * r + std::exp(sink - m);
        }
        for (int64_t d = 0; d < s.vdim; ++d) o[d] = acc[g * s.vdim + d] * r / norm;
    }
}

template <typename T>
void attend_all(int64_t batch, const float* query, const void* k_cache, const void* v_cache, const int64_t* tables,
                int64_t width, const int64_t* firsts, const int64_t* lasts, const float* sinks, float* out,
                const Shape& s, float scale, float softcap, int threads) {
    const int64_t work_size = s.groups * (chunk_slots(s.block_size) + 2 + s.vdim);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float* work = new float[work_size];
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t b = 0; b < batch; ++b)
            for (int64_t k = 0; k < s.kv_heads; ++k)
                attend_one(b, k, query, static_cast<const T*>(k_cache), static_cast<const T*>(v_cache),
                           Visible(tables, width, firsts, lasts, b, s.block_size), sinks, out, s, scale, softcap,
                           work);
        delete[] work;
    }
}

// query [B, H, D] (any float dtype); caches [KVH, slots, D] and [KVH, slots, Dv], both float32 or both bfloat16;
// tables [B, W], first and last [B], int64, as in step.py's DecodeBlocks; sinks [H] or none. Returns [B, H, Dv] in the
// query's dtype: decode.py's paged_decode. Everything the loops read is checked first, the block ids included: the
// loops read the caches wherever the tables point.
at::Tensor paged_decode(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& tables, const at::Tensor& first, const at::Tensor& last, int64_t block_size,
                        const std::optional<at::Tensor>& sinks, double scale, std::optional<double> softcap) {
    TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3,
                "batchgen::paged_decode: query [B, H, D] and caches [KVH, slots, D] are 3-d");
    TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
                    (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16),
                "batchgen::paged_decode: the caches must be both float32 or both bfloat16, not ",
                k_cache.scalar_type(), " and ", v_cache.scalar_type());
    TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "batchgen::paged_decode: the caches must be contiguous");
    const int64_t batch = query.size(0), heads = query.size(1), dim = query.size(2);
    const int64_t kv_heads = k_cache.size(0), slots = k_cache.size(1), vdim = v_cache.size(2);
    TORCH_CHECK(k_cache.size(2) == dim && v_cache.size(0) == kv_heads && v_cache.size(1) == slots,
                "batchgen::paged_decode: the caches' shapes ", k_cache.sizes(), " and ", v_cache.sizes(),
                " do not match the query's ", query.sizes());
    TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "batchgen::paged_decode: ", heads,
                " query heads are not a multiple of ", kv_heads, " KV heads");
    TORCH_CHECK(block_size > 0 && slots % block_size == 0, "batchgen::paged_decode: ", slots,
                " slots are not whole blocks of ", block_size);
    for (const at::Tensor* t : {&tables, &first, &last})
        TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(),
                    "batchgen::paged_decode: the block tables and bounds must be contiguous int64");
    TORCH_CHECK(tables.dim() == 2 && tables.size(0) == batch && first.dim() == 1 && first.size(0) == batch &&
                    last.dim() == 1 && last.size(0) == batch,
                "batchgen::paged_decode: tables [B, W], first and last [B] for ", batch, " decodes");
    const int64_t width = tables.size(1), blocks = slots / block_size;
    const int64_t *rows = tables.const_data_ptr<int64_t>(), *firsts = first.const_data_ptr<int64_t>(),
                  *lasts = last.const_data_ptr<int64_t>();
    for (int64_t b = 0; b < batch; ++b) {
        TORCH_CHECK(0 <= firsts[b] && firsts[b] <= lasts[b] && lasts[b] / block_size - firsts[b] / block_size < width,
                    "batchgen::paged_decode: decode ", b, " sees positions ", firsts[b], " to ", lasts[b],
                    ", more than its ", width, " blocks");
        const Visible seen(rows, width, firsts, lasts, b, block_size);
        for (int64_t j = 0; j < seen.count; ++j)
            TORCH_CHECK(0 <= seen.row[j] && seen.row[j] < blocks, "batchgen::paged_decode: decode ", b,
                        " reads block ", seen.row[j], " of a cache of ", blocks);
    }
    at::Tensor sink;
    if (sinks) {
        TORCH_CHECK(sinks->numel() == heads, "batchgen::paged_decode: ", sinks->numel(), " sinks for ", heads,
                    " query heads");
        sink = sinks->to(at::kFloat).contiguous();
    }
    const at::Tensor q = query.to(at::kFloat).contiguous();
    at::Tensor out = at::empty({batch, heads, vdim}, q.options());
    const Shape s{kv_heads, heads / kv_heads, dim, vdim, slots, block_size};
    const float *qs = q.const_data_ptr<float>(), *sp = sinks ? sink.const_data_ptr<float>() : nullptr;
    const float cap = softcap ? float(*softcap) : 0.f;
    if (k_cache.scalar_type() == at::kBFloat16)
        attend_all<uint16_t>(batch, qs, k_cache.const_data_ptr(), v_cache.const_data_ptr(), rows, width, firsts,
                             lasts, sp, out.mutable_data_ptr<float>(), s, float(scale), cap, at::get_num_threads());
    else
        attend_all<float>(batch, qs, k_cache.const_data_ptr(), v_cache.const_data_ptr(), rows, width, firsts, lasts,
                          sp, out.mutable_data_ptr<float>(), s, float(scale), cap, at::get_num_threads());
    return out.to(query.scalar_type());
}

}  // namespace

// A fragment: the namespace is shared with the other kernels' libraries and with the operators Python defines.
TORCH_LIBRARY_FRAGMENT(batchgen, m) {
    m.def("paged_decode(Tensor query, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor first, Tensor last, "
          "int block_size, Tensor? sinks, float scale, float? softcap) -> Tensor");
}

TORCH_LIBRARY_IMPL(batchgen, CPU, m) { m.impl("paged_decode", &paged_decode); }
