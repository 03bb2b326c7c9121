// A linear layer's GEMM for few rows, on CPU: out = x . w^T + bias, with w packed once into panels (cpu_linear.py).
//
// A decode step multiplies a few rows (one per sequence) by every weight matrix, whose bytes come from memory each
// step: there the time is reading the weights, and MKL (which repacks w on every call) and oneDNN leave the reads and
// the arithmetic one after the other. Here w is packed once into panels of NR output columns, k-major, so each panel
// is one contiguous stream; a register tile of up to MR rows by NR columns multiplies it, and while one panel is
// multiplied the next is prefetched, so the reads overlap the arithmetic (benchmarks/cpu_linear.py: 1.3-1.9x MKL at
// 16-32 rows, 1.1-1.2x at 64, level or behind from 80, where the caller keeps MKL). K is cut into slices of KC so that
// a slice of the panel and of x stay in cache across row blocks and panels (packed order: slice, panel, k, column).
// No torch headers: it builds in under a second (native.py), and Python calls it through ctypes.

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

}  // namespace

extern "C" int batchgen_panel_width() { return NR; }

// panels: for each slice of KC k's, for each panel of NR columns, for each k, the panel's NR weights (0 past N).
extern "C" void batchgen_pack_panels(int64_t N, int64_t K, const float* w, float* panels) {
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
extern "C" void batchgen_panel_linear(int64_t M, int64_t N, int64_t K, const float* x, int64_t ldx,
                                      const float* panels, const float* bias, float* out, int threads) {
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
