// A linear layer's GEMM for few rows, on CPU: out = x . w^T + bias, with w packed once into panels (cpu_linear.py).
//
// A decode step multiplies a few rows (one per sequence) by every weight matrix, whose bytes come from memory each
// step: there the time is reading the weights, and MKL (which repacks w on every call) and oneDNN leave the reads and
// the arithmetic one after the other. Here w is packed once into panels of NR output columns, k-major, so each panel
// is one contiguous stream; a register tile of up to MR rows by NR columns multiplies it, and while one panel is
// multiplied the next is prefetched, so the reads overlap the arithmetic (benchmarks/cpu_linear.py: 1.3-1.9x MKL at
// 16-32 rows, 1.1-1.2x at 64, level or behind from 80, where the caller keeps MKL). K is cut into slices of KC so that
// a slice of the panel and of x stay in cache across row blocks and panels (packed order: slice, panel, k, column).
// Registered as torch operators (native.py builds it): batchgen::pack_panels, and batchgen::panel_linear, which checks
// and allocates here so that a call from Python costs one dispatch. Only the headers it uses: each adds to the build.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

namespace {

#ifdef __AVX512F__
constexpr int W = 16;  // floats a vector
constexpr int MR = 12;  // rows a tile: 2 x MR accumulators + 2 panel vectors fit in 32 registers
#else
constexpr int W = 8;  // AVX2, NEON (two halves), anything else
constexpr int MR = 6;  // 16 registers
#endif
constexpr int NR = 2 * W;  // columns a panel
constexpr int64_t KC = 512;  // k a slice
constexpr int LINES = NR * sizeof(float) / 64;  // cache lines a panel row (k) spans

typedef float vec __attribute__((vector_size(W * sizeof(float))));

inline vec load(const float* p) {
    vec v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof v); }

// out[i][0..NR) (+)= x[i] . panel for R rows over kc; starts from `init` (a row of NR) unless it accumulates. While it
// multiplies, it prefetches its share of what comes next in the packed order (the next panel's slice): lines
// [first, first + kc * step) in 16.16 fixed point.
template <int R>
void tile(int64_t kc, const float* x, int64_t ldx, const float* panel, float* out, int64_t ldo, bool accumulate,
          const float* init, const char* next, int64_t first, int64_t step) {
    vec acc[R][2];
    for (int i = 0; i < R; ++i) {
        const float* from = accumulate ? out + i * ldo : init;
        acc[i][0] = load(from);
        acc[i][1] = load(from + W);
    }
    for (int64_t k = 0; k < kc; ++k) {
        const vec b0 = load(panel + k * NR), b1 = load(panel + k * NR + W);
        if (next)  // every line of the share, whether a step is less than a line or more
            for (int64_t line = (first + k * step) >> 16; line < (first + (k + 1) * step) >> 16; ++line)
                __builtin_prefetch(next + line * 64, 0, 2);
        for (int i = 0; i < R; ++i) {
            const float a = x[i * ldx + k];
            acc[i][0] += a * b0;
            acc[i][1] += a * b1;
        }
    }
    for (int i = 0; i < R; ++i) {
        store(out + i * ldo, acc[i][0]);
        store(out + i * ldo + W, acc[i][1]);
    }
}

typedef void (*tile_fn)(int64_t, const float*, int64_t, const float*, float*, int64_t, bool, const float*,
                        const char*, int64_t, int64_t);

template <int... R>
constexpr std::array<tile_fn, sizeof...(R)> tiles(std::integer_sequence<int, R...>) {
    return {tile<R + 1>...};
}

constexpr auto TILES = tiles(std::make_integer_sequence<int, MR>{});  // TILES[r - 1]: r rows

// panels: for each slice of KC k's, for each panel of NR columns, for each k, the panel's NR weights (0 past N).
void pack(int64_t N, int64_t K, const float* w, float* panels) {
    const int64_t count = (N + NR - 1) / NR, padded = count * NR;
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = K - k0 < KC ? K - k0 : KC;
        for (int64_t p = 0; p < count; ++p)
            for (int64_t k = 0; k < kc; ++k)
                for (int j = 0; j < NR; ++j) {
                    const int64_t n = p * NR + j;
                    panels[k0 * padded + (p * kc + k) * NR + j] = n < N ? w[n * K + k0 + k] : 0.f;
                }
    }
}

// out (M x N, rows N apart) = x (M x K, rows ldx apart) . w^T + bias (bias may be null).
void multiply(int64_t M, int64_t N, int64_t K, const float* x, int64_t ldx, const float* panels, const float* bias,
              float* out, int threads) {
    if (M <= 0 || N <= 0) return;
    const int64_t count = (N + NR - 1) / NR, padded = count * NR;
    const int64_t blocks = (M + MR - 1) / MR;  // row blocks of M / blocks rows, give or take one
    const int64_t step = (int64_t(LINES) << 16) / blocks;
    const int64_t last = N % NR;  // columns of a partial last panel (0: none); it is computed in `edge`
    float* edge = last ? new float[M * NR] : nullptr;
#pragma omp parallel num_threads(threads) if (threads > 1)
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = K - k0 < KC ? K - k0 : KC;
        const float* slice = panels + k0 * padded;
        const char* end = reinterpret_cast<const char*>(panels + K * padded);
#pragma omp for schedule(static) nowait  // static: a thread has the same panels in every slice, its own to add to
        for (int64_t p = 0; p < count; ++p) {
            const float* panel = slice + p * kc * NR;
            const char* next = reinterpret_cast<const char*>(panel + kc * NR);
            if (next >= end) next = nullptr;
            const bool partial = last && p == count - 1;
            float* target = partial ? edge : out + p * NR;
            const int64_t ldo = partial ? NR : N;
            float init[NR] = {};
            if (bias)
                for (int j = 0; j < NR && p * NR + j < N; ++j) init[j] = bias[p * NR + j];
            for (int64_t b = 0, row = 0; b < blocks; ++b) {
                const int64_t rows = M / blocks + (b < M % blocks);
                TILES[rows - 1](kc, x + row * ldx + k0, ldx, panel, target + row * ldo, ldo, k0 > 0, init, next,
                                b * kc * step, step);
                row += rows;
            }
        }
    }
    if (edge) {
        for (int64_t i = 0; i < M; ++i) std::memcpy(out + i * N + N - last, edge + i * NR, last * sizeof(float));
        delete[] edge;
    }
}

// The row counts the kernel takes (benchmarks/cpu_linear.py: at one row MKL's path for a vector is as fast, from 64 to
// 128 rows the two are level, and from there MKL is ahead); cpu_linear.ROWS says them to Python.
constexpr int64_t MIN_ROWS = 2, MAX_ROWS = 64;

int64_t panels_size(int64_t N, int64_t K) { return (N + NR - 1) / NR * NR * K; }

at::Tensor pack_panels(const at::Tensor& weight) {
    TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat,
                "batchgen::pack_panels: the weight must be a 2-d float32 tensor, not ", weight.dim(), "-d ",
                weight.scalar_type());
    const at::Tensor w = weight.contiguous();
    const int64_t N = w.size(0), K = w.size(1);
    at::Tensor panels = at::empty({panels_size(N, K)}, w.options());
    pack(N, K, w.const_data_ptr<float>(), panels.mutable_data_ptr<float>());
    return panels;
}

// at::linear(x, weight, bias), through the panels (pack_panels(weight)) for the row counts the kernel takes.
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& panels,
                        const std::optional<at::Tensor>& bias) {
    TORCH_CHECK(weight.dim() == 2, "batchgen::panel_linear: the weight must be 2-d, not ", weight.dim(), "-d");
    const int64_t N = weight.size(0), K = weight.size(1);
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "batchgen::panel_linear: x's last dimension must be the weight's ",
                K, ", not ", x.dim() ? x.size(-1) : 0);
    const int64_t M = K ? x.numel() / K : 0;
    // The panels are a copy: a served model's weights do not change; one converted or reshaped since takes at::linear.
    if (M < MIN_ROWS || M > MAX_ROWS || x.scalar_type() != at::kFloat || weight.scalar_type() != at::kFloat ||
        panels.numel() != panels_size(N, K))
        return at::linear(x, weight, bias);
    TORCH_CHECK(panels.scalar_type() == at::kFloat && panels.is_contiguous(),
                "batchgen::panel_linear: the panels must be contiguous float32 (pack_panels' own)");
    const float* b = nullptr;
    if (bias) {
        TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous(),
                    "batchgen::panel_linear: the bias must be a contiguous float32 vector of ", N);
        b = bias->const_data_ptr<float>();
    }
    at::Tensor flat = x.reshape({M, K});
    if (flat.stride(1) != 1) flat = flat.contiguous();
    at::Tensor out = at::empty({M, N}, x.options());
    multiply(M, N, K, flat.const_data_ptr<float>(), flat.stride(0), panels.const_data_ptr<float>(), b,
             out.mutable_data_ptr<float>(), at::get_num_threads());
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = N;
    return out.view(shape);
}

// Its shape and dtype alone, for torch.compile's tracing (sizes symbolic: the token count is dynamic).
at::Tensor panel_linear_meta(const at::Tensor& x, const at::Tensor& weight, const at::Tensor&,
                             const std::optional<at::Tensor>&) {
    std::vector<c10::SymInt> shape(x.sym_sizes().begin(), x.sym_sizes().end());
    shape.back() = weight.sym_size(0);
    return at::empty_symint(shape, x.options());
}

}  // namespace

// A fragment: the namespace is shared with the other kernels' libraries and with the operators Python defines.
TORCH_LIBRARY_FRAGMENT(batchgen, m) {
    m.def("pack_panels(Tensor weight) -> Tensor");
    m.def("panel_linear(Tensor x, Tensor weight, Tensor panels, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(batchgen, CPU, m) {
    m.impl("pack_panels", &pack_panels);
    m.impl("panel_linear", &panel_linear);
}

TORCH_LIBRARY_IMPL(batchgen, Meta, m) { m.impl("panel_linear", &panel_linear_meta); }
