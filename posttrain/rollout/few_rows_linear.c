/* y = x W^T (+ b) for a few rows of x: the decoding step of a sampler on CPU.
 *
 * x: M x K (row stride ldx), W: N x K row-major (a torch nn.Linear weight), y: M x N (row stride ldy).
 * With M <= 8 rows, every weight element is loaded from memory once and used for M fused
 * multiply-adds against rows of x that stay in L1, so a call streams W once at close to the
 * memory bandwidth. A general GEMM instead packs W into panels on every call (about twice the
 * memory traffic) and is tuned for many rows. Weight rows are split over OpenMP threads.
 * Built by posttrain/rollout/few_rows.py with -O3 -mavx2 -mfma -fopenmp.
 */
#include <immintrin.h>
#include <stddef.h>

/* the sum of each of the 8 accumulators, lane i = sum of a[i] */
static inline __m256 sum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                          __m256 a7) {
    __m256 h01 = _mm256_hadd_ps(a0, a1), h23 = _mm256_hadd_ps(a2, a3);
    __m256 h45 = _mm256_hadd_ps(a4, a5), h67 = _mm256_hadd_ps(a6, a7);
    __m256 h03 = _mm256_hadd_ps(h01, h23), h47 = _mm256_hadd_ps(h45, h67);
    return _mm256_add_ps(_mm256_permute2f128_ps(h03, h47, 0x20), _mm256_permute2f128_ps(h03, h47, 0x31));
}

/* rows m < R of y[:, n0:n1]; R is a compile-time constant at each call site, so acc[] lives in registers */
static inline __attribute__((always_inline)) void block(const int R, const float *x, ptrdiff_t ldx,
                                                         const float *w, const float *b, float *y, ptrdiff_t ldy,
                                                         ptrdiff_t n0, ptrdiff_t n1, ptrdiff_t K) {
    const ptrdiff_t K8 = K & ~(ptrdiff_t)7;
    for (ptrdiff_t n = n0; n < n1; n++) {
        const float *wn = w + n * K;
        __m256 acc[8];
        for (int m = 0; m < 8; m++) acc[m] = _mm256_setzero_ps();
        for (ptrdiff_t k = 0; k < K8; k += 8) {
            __m256 wv = _mm256_loadu_ps(wn + k);
            for (int m = 0; m < R; m++) acc[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * ldx + k), acc[m]);
        }
        float out[8];
        _mm256_storeu_ps(out, sum8(acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7]));
        for (int m = 0; m < R; m++) {
            float s = out[m];
            for (ptrdiff_t k = K8; k < K; k++) s += x[m * ldx + k] * wn[k];
            y[m * ldy + n] = b ? s + b[n] : s;
        }
    }
}

static void rows_upto8(int M, const float *x, ptrdiff_t ldx, const float *w, const float *b, float *y,
                       ptrdiff_t ldy, ptrdiff_t n0, ptrdiff_t n1, ptrdiff_t K) {
    switch (M) {  /* one specialised loop per row count */
        case 1: block(1, x, ldx, w, b, y, ldy, n0, n1, K); break;
        case 2: block(2, x, ldx, w, b, y, ldy, n0, n1, K); break;
        case 3: block(3, x, ldx, w, b, y, ldy, n0, n1, K); break;
        case 4: block(4, x, ldx, w, b, y, ldy, n0, n1, K); break;
        case 5: block(5, x, ldx, w, b, y, ldy, n0, n1, K); break;
        case 6: block(6, x, ldx, w, b, y, ldy, n0, n1, K); break;
        case 7: block(7, x, ldx, w, b, y, ldy, n0, n1, K); break;
        default: block(8, x, ldx, w, b, y, ldy, n0, n1, K); break;
    }
}

/* y[M, N] = x[M, K] W[N, K]^T (+ b[N]); rows of x in groups of 8, weight rows split over threads */
void few_rows_linear(const float *x, ptrdiff_t ldx, const float *w, const float *b, float *y, ptrdiff_t ldy,
                     int M, ptrdiff_t N, ptrdiff_t K, int threads) {
    const ptrdiff_t chunk = 16;  /* weight rows per scheduling unit: 16 x K floats */
    const ptrdiff_t units = (N + chunk - 1) / chunk;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (ptrdiff_t u = 0; u < units; u++) {
        ptrdiff_t n0 = u * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
        for (int m0 = 0; m0 < M; m0 += 8)
            rows_upto8(M - m0 < 8 ? M - m0 : 8, x + m0 * ldx, ldx, w, b, y + m0 * ldy, ldy, n0, n1, K);
    }
}
