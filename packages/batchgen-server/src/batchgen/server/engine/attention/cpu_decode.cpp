// Decode attention over the paged KV cache, on CPU: decode.py's paged_decode, written out as loops.
//
// One (decode, KV head) at a time: each of its visible blocks is read once, keys then values, straight from the
// cache (flash-decoding's online softmax, rescaled once per block). With several query heads per KV head (GQA) the
// scores are the cost, so a key is loaded once for four heads and exp is vectorised; with one, the memory is
// (benchmarks/RESULTS.md). No torch headers: it builds in under a second, and Python calls it through ctypes
// (cpu_decode.py). Vectors are GCC/Clang vector extensions, so the compiler picks the instructions of the machine it
// builds on (AVX2, AVX-512, NEON).

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

inline void exp_minus(float* row, int64_t n, float m) {  // row[i] = exp(row[i] - m)
    int64_t i = 0;
    for (; i + W <= n; i += W) store(row + i, exp(load(row + i) - m));
    for (; i < n; ++i) row[i] = std::exp(row[i] - m);
}

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

// x[g * stride] = q[g] . key for the G query heads of a KV head, four at a time: each key vector is loaded once for
// four heads (grouped-query attention makes the scores, not the memory, the cost).
template <typename T>
inline void dots(const float* q, int64_t G, const T* key, int64_t dim, float* x, int64_t stride) {
    int64_t g = 0;
    for (; g + 4 <= G; g += 4) {
        const float *q0 = q + g * dim, *q1 = q0 + dim, *q2 = q1 + dim, *q3 = q2 + dim;
        vec a0 = {}, a1 = {}, a2 = {}, a3 = {};
        int64_t d = 0;
        for (; d + W <= dim; d += W) {
            vec kd = load(key + d);
            a0 += load(q0 + d) * kd, a1 += load(q1 + d) * kd, a2 += load(q2 + d) * kd, a3 += load(q3 + d) * kd;
        }
        float s0 = sum(a0), s1 = sum(a1), s2 = sum(a2), s3 = sum(a3);
        for (; d < dim; ++d) {
            float kd = scalar(key + d);
            s0 += q0[d] * kd, s1 += q1[d] * kd, s2 += q2[d] * kd, s3 += q3[d] * kd;
        }
        x[g * stride] = s0, x[(g + 1) * stride] = s1, x[(g + 2) * stride] = s2, x[(g + 3) * stride] = s3;
    }
    for (; g < G; ++g) x[g * stride] = dot(q + g * dim, key, dim);
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

// Decode b, KV head k: its `groups` query heads against the visible slots of pairs offsets[b]..offsets[b + 1].
// `work` holds groups * (block_size + 2) + groups * vdim floats.
template <typename T>
void attend_one(int64_t b, int64_t k, const float* query, const T* k_cache, const T* v_cache, const int64_t* blocks,
                const bool* visible, const int64_t* offsets, const float* sinks, float* out, const Shape& s,
                float scale, float softcap, float* work) {
    const int64_t G = s.groups, bs = s.block_size;
    float* scores = work;               // [G, bs]
    float* best = scores + G * bs;      // [G] running maximum
    float* total = best + G;            // [G] running sum of exp(score - best)
    float* acc = total + G;             // [G, vdim]
    const float* q = query + (b * s.kv_heads + k) * G * s.dim;
    for (int64_t g = 0; g < G; ++g) best[g] = -INFINITY, total[g] = 0.f;
    std::memset(acc, 0, sizeof(float) * G * s.vdim);
    const T* keys = k_cache + k * s.slots * s.dim;
    const T* values = v_cache + k * s.slots * s.vdim;
    for (int64_t p = offsets[b]; p < offsets[b + 1]; ++p) {
        const T* kb = keys + blocks[p] * bs * s.dim;
        const T* vb = values + blocks[p] * bs * s.vdim;
        const bool* seen = visible + p * bs;
        for (int64_t t = 0; t < bs; ++t) {
            if (seen[t]) {
                dots(q, G, kb + t * s.dim, s.dim, scores + t, bs);
                for (int64_t g = 0; g < G; ++g) {
                    float x = scores[g * bs + t] * scale;
                    scores[g * bs + t] = softcap > 0.f ? std::tanh(x / softcap) * softcap : x;
                }
            } else {
                for (int64_t g = 0; g < G; ++g) scores[g * bs + t] = -INFINITY;
            }
        }
        for (int64_t g = 0; g < G; ++g) {
            float* row = scores + g * bs;
            float m = best[g];
            for (int64_t t = 0; t < bs; ++t) m = row[t] > m ? row[t] : m;
            if (m == -INFINITY) {  // nothing visible so far: this block weighs nothing
                for (int64_t t = 0; t < bs; ++t) row[t] = 0.f;
                continue;
            }
            if (m > best[g]) {  // rescale what came before to the new maximum
                float r = std::exp(best[g] - m);
                total[g] *= r;
                for (int64_t d = 0; d < s.vdim; ++d) acc[g * s.vdim + d] *= r;
                best[g] = m;
            }
            exp_minus(row, bs, m);  // 0 where not visible
            for (int64_t t = 0; t < bs; ++t) total[g] += row[t];
        }
        for (int64_t g = 0; g < G; ++g) add_weighted(acc + g * s.vdim, scores + g * bs, vb, bs, s.vdim, s.vdim);
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
void attend_all(int64_t batch, const float* query, const void* k_cache, const void* v_cache, const int64_t* blocks,
                const bool* visible, const int64_t* offsets, const float* sinks, float* out, const Shape& s,
                float scale, float softcap, int threads) {
    const int64_t work_size = s.groups * (s.block_size + 2 + s.vdim);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float* work = new float[work_size];
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t b = 0; b < batch; ++b)
            for (int64_t k = 0; k < s.kv_heads; ++k)
                attend_one(b, k, query, static_cast<const T*>(k_cache), static_cast<const T*>(v_cache), blocks,
                           visible, offsets, sinks, out, s, scale, softcap, work);
        delete[] work;
    }
}

}  // namespace

// query [batch, kv_heads, groups, dim] float32; caches [kv_heads, slots, dim] (float32, or bfloat16 when
// `bf16_cache`); blocks [P], visible [P, block_size], offsets [batch + 1] as in decode.py's DecodePairs; sinks
// [kv_heads * groups] float32 or null; softcap <= 0 for none. Writes out [batch, kv_heads, groups, vdim] float32.
extern "C" void batchgen_paged_decode(int64_t batch, int64_t kv_heads, int64_t groups, int64_t dim, int64_t vdim,
                                      int64_t slots, int64_t block_size, const float* query, const void* k_cache,
                                      const void* v_cache, int bf16_cache, const int64_t* blocks,
                                      const bool* visible, const int64_t* offsets, const float* sinks, float* out,
                                      float scale, float softcap, int threads) {
    const Shape s{kv_heads, groups, dim, vdim, slots, block_size};
    if (bf16_cache)
        attend_all<uint16_t>(batch, query, k_cache, v_cache, blocks, visible, offsets, sinks, out, s, scale, softcap,
                             threads);
    else
        attend_all<float>(batch, query, k_cache, v_cache, blocks, visible, offsets, sinks, out, s, scale, softcap,
                          threads);
}
