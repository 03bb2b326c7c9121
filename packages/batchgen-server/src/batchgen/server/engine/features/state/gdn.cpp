// The sequential parts of a Gated DeltaNet layer (Qwen3.5, Qwen3-Next) on CPU, for every sequence of a step in one
// call, reading and writing the state cache in place: gdn.py's caller runs the projections, the gates and the norm on
// the packed row, these the short convolution and the delta rule, per sequence piece ("segment").
//
// A segment is rows [first, end) of the packed row continuing the state in slot `slot` (from zero where `fresh`),
// then, where `checkpoint` >= 0, copied to that slot (a prefix checkpoint at the piece's end). Decodes are segments of
// one row; a prompt chunk cut at its checkpoints is several, in order. The math is transformers' torch functions'
// (modeling_qwen3_5.py): `causal_conv1d_update` over the kept columns (its SiLU left to the caller), and
// `torch_recurrent_gated_delta_rule` token by token (its l2-normalised query and key, the query scaled by 1/sqrt(dk), state decayed by exp(g), the delta
// rule's write scaled by beta), in float32 as it computes. Token by token rather than transformers' 64-token chunks:
// the state of one head (dk x dv floats) stays in the L1 cache across a prompt, and a token costs about 4 dk dv
// multiply-adds either way. Registered as batchgen::gdn_conv and batchgen::gdn_rule (native.py builds them).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t MAX_KERNEL = 16;

struct Segment {
    int64_t first, end, slot, fresh, checkpoint;
};

std::vector<Segment> segments_of(const at::Tensor& segments, int64_t rows, int64_t slots, const char* op) {
    TORCH_CHECK(segments.scalar_type() == at::kLong && segments.dim() == 2 && segments.size(1) == 5 &&
                    segments.is_contiguous(),
                op, ": segments must be a contiguous int64 [N, 5] (first, end, slot, fresh, checkpoint)");
    std::vector<Segment> out(segments.size(0));
    std::memcpy(out.data(), segments.const_data_ptr<int64_t>(), out.size() * sizeof(Segment));
    for (const Segment& s : out) {
        TORCH_CHECK(0 <= s.first && s.first <= s.end && s.end <= rows, op, ": segment rows ", s.first, " to ", s.end,
                    " outside the ", rows, " rows");
        TORCH_CHECK(0 <= s.slot && s.slot < slots && s.checkpoint < slots && s.checkpoint != s.slot, op,
                    ": segment slots ", s.slot, " and ", s.checkpoint, " outside a cache of ", slots);
    }
    return out;
}

// Channels [c0, c1) of every segment: a token's window is the kernel's last inputs, the rows before it in its segment
// or, for its first kernel - 1 tokens, the columns its slot kept (zeros where it starts fresh). Tokens outer, channels
// inner (the weight transposed to [K, C]): the rows are read in order and the inner loop vectorises.
template <typename T>
void conv_channels(const T* x, T* state, const float* weight_t, const float* bias, T* out,
                   const std::vector<Segment>& segments, int64_t channels, int64_t kernel, int64_t c0, int64_t c1) {
    std::vector<float> sums(c1 - c0);
    float* __restrict acc = sums.data() - c0;
    for (const Segment& s : segments) {
        T* kept = state + s.slot * channels * kernel;
        for (int64_t t = s.first; t < s.end; ++t) {
            for (int64_t c = c0; c < c1; ++c) acc[c] = bias ? bias[c] : 0.f;
            for (int64_t j = 0; j < kernel; ++j) {
                const int64_t r = t - (kernel - 1) + j;
                const float* __restrict w = weight_t + j * channels;
                if (r >= s.first) {
                    const T* __restrict row = x + r * channels;
                    for (int64_t c = c0; c < c1; ++c) acc[c] += w[c] * static_cast<float>(row[c]);
                } else if (!s.fresh) {  // the kept column of row r: the last is the row before the segment
                    const T* column = kept + kernel - (s.first - r);
                    for (int64_t c = c0; c < c1; ++c) acc[c] += w[c] * static_cast<float>(column[c * kernel]);
                }
            }
            for (int64_t c = c0; c < c1; ++c) out[t * channels + c] = static_cast<T>(acc[c]);
        }
        // The slot keeps the last `kernel` inputs: column j is row end - kernel + j, or (before the segment) the kept
        // column j + rows, which this loop has not yet overwritten (it writes column j after reading j + rows > j).
        const int64_t rows = s.end - s.first;
        for (int64_t j = 0; j < kernel; ++j) {
            const int64_t r = s.end - kernel + j;
            if (r >= s.first)
                for (int64_t c = c0; c < c1; ++c) kept[c * kernel + j] = x[r * channels + c];
            else
                for (int64_t c = c0; c < c1; ++c)
                    kept[c * kernel + j] = s.fresh ? static_cast<T>(0.f) : kept[c * kernel + j + rows];
        }
        if (s.checkpoint >= 0)
            std::memcpy(state + (s.checkpoint * channels + c0) * kernel, kept + c0 * kernel,
                        (c1 - c0) * kernel * sizeof(T));
    }
}

// x [T, C] (the projected q, k, v before the convolution), state [slots, C, K] of x's dtype, weight [C, K] float32,
// bias [C] float32 or none. Returns the convolution [T, C] in x's dtype, before its activation (the caller applies
// it, as transformers does, to the rounded output); each segment's slot keeps its last K inputs.
at::Tensor gdn_conv(const at::Tensor& x, const at::Tensor& state, const at::Tensor& weight,
                    const std::optional<at::Tensor>& bias, const at::Tensor& segments) {
    const char* op = "batchgen::gdn_conv";
    TORCH_CHECK(x.dim() == 2 && state.dim() == 3 && weight.dim() == 2, op,
                ": x [T, C], state [slots, C, K], weight [C, K]");
    const int64_t rows = x.size(0), channels = x.size(1), kernel = state.size(2);
    TORCH_CHECK(state.size(1) == channels && weight.size(0) == channels && weight.size(1) == kernel, op,
                ": state ", state.sizes(), " and weight ", weight.sizes(), " do not match x ", x.sizes());
    TORCH_CHECK(kernel >= 1 && kernel <= MAX_KERNEL, op, ": a kernel of ", kernel, " (at most ", MAX_KERNEL, ")");
    TORCH_CHECK(x.scalar_type() == state.scalar_type() && weight.scalar_type() == at::kFloat, op,
                ": x and state of one dtype, weight float32");
    TORCH_CHECK(x.is_contiguous() && state.is_contiguous() && weight.is_contiguous(), op, ": contiguous tensors");
    if (bias)
        TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == channels, op,
                    ": bias float32 [C]");
    const std::vector<Segment> segs = segments_of(segments, rows, state.size(0), op);
    at::Tensor out = at::zeros(x.sizes(), x.options());
    const float* b = bias ? bias->const_data_ptr<float>() : nullptr;
    std::vector<float> weight_t(kernel * channels);
    const float* w = weight.const_data_ptr<float>();
    for (int64_t c = 0; c < channels; ++c)
        for (int64_t j = 0; j < kernel; ++j) weight_t[j * channels + c] = w[c * kernel + j];
    auto run = [&](auto zero) {  // x's dtype: float32, bfloat16 or float16
        using T = decltype(zero);
        const T* xs = static_cast<const T*>(x.const_data_ptr());
        T* st = static_cast<T*>(state.mutable_data_ptr());
        T* os = static_cast<T*>(out.mutable_data_ptr());
        at::parallel_for(0, channels, 256, [&](int64_t c0, int64_t c1) {
            conv_channels(xs, st, weight_t.data(), b, os, segs, channels, kernel, c0, c1);
        });
    };
    switch (x.scalar_type()) {
        case at::kFloat: run(float{}); break;
        case at::kBFloat16: run(c10::BFloat16{}); break;
        case at::kHalf: run(c10::Half{}); break;
        default: TORCH_CHECK(false, op, ": x of ", x.scalar_type(), " (float32, bfloat16 or float16)");
    }
    return out;
}

inline float inverse_norm(const float* x, int64_t n) {  // transformers' l2norm: rsqrt(sum x^2 + 1e-6)
    float s = 0.f;
    for (int64_t i = 0; i < n; ++i) s += x[i] * x[i];
    return 1.f / std::sqrt(s + 1e-6f);
}

struct Heads {
    int64_t k_heads, v_heads, dk, dv;
};

// One value head over every segment. DV > 0: the value dimension as a constant (64, 128: the released layouts), so
// that the compiler keeps a row's accumulators in vector registers across the state's rows; 0: any, read at run time.
template <int DV>
void rule_head(int64_t h, const float* q, const float* k, const float* v, const float* g, const float* beta,
               float* state, float* out, const std::vector<Segment>& segments, const Heads& s, float scale) {
    const int64_t dv = DV > 0 ? DV : s.dv, kh = h / (s.v_heads / s.k_heads), size = s.dk * dv;
    std::vector<float> work(2 * s.dk + (DV > 0 ? 0 : 3 * dv));
    float *qn = work.data(), *kn = qn + s.dk;
    float fixed[DV > 0 ? 3 * DV : 1];
    float* kv = DV > 0 ? fixed : kn + s.dk;
    float *delta = kv + dv, *o = delta + dv;
    for (const Segment& seg : segments) {
        float* S = state + (seg.slot * s.v_heads + h) * size;
        if (seg.fresh) std::memset(S, 0, size * sizeof(float));
        for (int64_t t = seg.first; t < seg.end; ++t) {
            const float* qt = q + (t * s.k_heads + kh) * s.dk;
            const float* kt = k + (t * s.k_heads + kh) * s.dk;
            const float* vt = v + (t * s.v_heads + h) * dv;
            const float qs = inverse_norm(qt, s.dk) * scale, ks = inverse_norm(kt, s.dk);
            for (int64_t i = 0; i < s.dk; ++i) qn[i] = qt[i] * qs, kn[i] = kt[i] * ks;
            const float decay = std::exp(g[t * s.v_heads + h]), b = beta[t * s.v_heads + h];
            for (int64_t j = 0; j < dv; ++j) kv[j] = 0.f;
            for (int64_t i = 0; i < s.dk; ++i) {  // decay the state; what it recalls for this key
                float* __restrict row = S + i * dv;
                const float ki = kn[i];
                for (int64_t j = 0; j < dv; ++j) {
                    row[j] *= decay;
                    kv[j] += row[j] * ki;
                }
            }
            for (int64_t j = 0; j < dv; ++j) delta[j] = (vt[j] - kv[j]) * b, o[j] = 0.f;
            for (int64_t i = 0; i < s.dk; ++i) {  // write the correction; read with the query
                float* __restrict row = S + i * dv;
                const float ki = kn[i], qi = qn[i];
                for (int64_t j = 0; j < dv; ++j) {
                    row[j] += ki * delta[j];
                    o[j] += row[j] * qi;
                }
            }
            std::memcpy(out + (t * s.v_heads + h) * dv, o, dv * sizeof(float));
        }
        if (seg.checkpoint >= 0)
            std::memcpy(state + (seg.checkpoint * s.v_heads + h) * size, S, size * sizeof(float));
    }
}

// q, k [T, Hk, dk], v [T, Hv, dv], g and beta [T, Hv], state [slots, Hv, dk, dv]: all float32. Returns the rule's
// output [T, Hv, dv] float32; each segment's slot holds its state after its last row.
at::Tensor gdn_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                    const at::Tensor& beta, const at::Tensor& state, const at::Tensor& segments) {
    const char* op = "batchgen::gdn_rule";
    for (const at::Tensor* t : {&q, &k, &v, &g, &beta, &state})
        TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), op, ": contiguous float32 tensors");
    TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && state.dim() == 4, op,
                ": q, k [T, Hk, dk], v [T, Hv, dv], state [slots, Hv, dk, dv]");
    const int64_t rows = q.size(0);
    const Heads s{q.size(1), v.size(1), q.size(2), v.size(2)};
    TORCH_CHECK(v.size(0) == rows && g.dim() == 2 && g.size(0) == rows && g.size(1) == s.v_heads &&
                    beta.sizes() == g.sizes(),
                op, ": g and beta [T, Hv]");
    TORCH_CHECK(state.size(1) == s.v_heads && state.size(2) == s.dk && state.size(3) == s.dv, op, ": state ",
                state.sizes(), " for heads of ", s.dk, " x ", s.dv);
    TORCH_CHECK(s.k_heads > 0 && s.v_heads % s.k_heads == 0, op, ": ", s.v_heads, " value heads for ", s.k_heads,
                " key heads");
    const std::vector<Segment> segs = segments_of(segments, rows, state.size(0), op);
    at::Tensor out = at::zeros({rows, s.v_heads, s.dv}, v.options());
    const float scale = 1.f / std::sqrt(float(s.dk));
    const float *qs = q.const_data_ptr<float>(), *ks = k.const_data_ptr<float>(), *vs = v.const_data_ptr<float>();
    const float *gs = g.const_data_ptr<float>(), *bs = beta.const_data_ptr<float>();
    float *st = state.mutable_data_ptr<float>(), *os = out.mutable_data_ptr<float>();
    at::parallel_for(0, s.v_heads, 1, [&](int64_t h0, int64_t h1) {
        for (int64_t h = h0; h < h1; ++h) {
            if (s.dv == 64) rule_head<64>(h, qs, ks, vs, gs, bs, st, os, segs, s, scale);
            else if (s.dv == 128) rule_head<128>(h, qs, ks, vs, gs, bs, st, os, segs, s, scale);
            else rule_head<0>(h, qs, ks, vs, gs, bs, st, os, segs, s, scale);
        }
    });
    return out;
}

}  // namespace

// A fragment: the namespace is shared with the other kernels' libraries and with the operators Python defines.
TORCH_LIBRARY_FRAGMENT(batchgen, m) {
    m.def("gdn_conv(Tensor x, Tensor(a!) state, Tensor weight, Tensor? bias, Tensor segments) -> Tensor");
    m.def("gdn_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state, Tensor segments) -> Tensor");
}

TORCH_LIBRARY_IMPL(batchgen, CPU, m) {
    m.impl("gdn_conv", &gdn_conv);
    m.impl("gdn_rule", &gdn_rule);
}
