/* y = x W^T (+ b) for a few rows of x: the decoding step of a sampler on CPU.
 *
 * x: M x K (row stride ldx), W: N x K row-major (a torch nn.Linear weight), y: M x N (row stride ldy).
 * With M <= 8 rows, every weight element is loaded from memory once and used for M fused
 * multiply-adds against rows of x that stay in L1, so a call streams W once at close to the
 * memory bandwidth. A general GEMM instead packs W into panels on every call (about twice the
 * memory traffic) and is tuned for many rows. Weight rows are split over OpenMP threads.
 * Built by posttrain/accel/few_rows.py with -O3 -mavx2 -mfma -fopenmp, and where the CPU has AVX-512F
 * also with -mavx512f (the products then take 16 floats per instruction, `block512`).
 *
 * Each x vector loaded from L1 is multiplied with the same columns of NB weight rows (register blocking):
 * with one weight row per pass, a step of 8 columns costs R + 1 loads for R multiply-adds, and the loads,
 * not the memory, bound the rate. Every output is still one accumulator per lane over the columns in
 * order, so blocking does not change a result; the AVX-512 path sums 16 lanes (then adds lane i and i + 8),
 * so its results differ from the AVX2 path's by float rounding.
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

#define PF_ROWS 2  /* the weight row prefetched ahead of a one-row pass (1-3 measured alike) */

/* one load of an x vector for the NB multiply-adds that use it: without this the compiler folds the load into
 * each of them (NB loads instead of one) */
#define KEEP_IN_REGISTER(v) __asm__("" : "+v"(v)) /* "v": any vector register (AVX-512: 32) */

/* y[m, n + j] for rows m < R and weight rows j < NB from the accumulators' lane sums */
static inline __attribute__((always_inline)) void store_outputs(const int R, const float *sums, const float *x,
                                                                ptrdiff_t ldx, const float *wn, const float *b,
                                                                float *y, ptrdiff_t ldy, ptrdiff_t n, ptrdiff_t k8,
                                                                ptrdiff_t k1, int add) {
    for (int m = 0; m < R; m++) {
        float s = sums[m];
        for (ptrdiff_t k = k8; k < k1; k++) s += x[m * ldx + k] * wn[k];
        if (add)
            y[m * ldy + n] += s;
        else
            y[m * ldy + n] = b ? s + b[n] : s;
    }
}

/* rows m < R of y[:, n0:n1], over the columns [k0, k1) of x and W (k1 - k0 a multiple of 8 unless k1 = K);
 * `add`: add to y instead of writing it (later column blocks; the bias goes with the first block).
 * NB weight rows per pass (n1 - n0 a multiple of NB). R and NB are compile-time constants at each call site,
 * so acc[][] lives in registers (AVX2 has 16: NB R + NB <= 16). */
static inline __attribute__((always_inline)) void block(const int R, const int NB, const float *x, ptrdiff_t ldx,
                                                         const float *w, const float *b, float *y, ptrdiff_t ldy,
                                                         ptrdiff_t n0, ptrdiff_t n1, ptrdiff_t K, ptrdiff_t k0,
                                                         ptrdiff_t k1, int add) {
    const ptrdiff_t k8 = k0 + ((k1 - k0) & ~(ptrdiff_t)7);
    ptrdiff_t n = n0;
    for (; n + NB <= n1; n += NB) {
        const float *wn = w + n * K;
        __m256 acc[2][8]; /* NB <= 2; fixed sizes: a variable-length array would live in memory */
        for (int j = 0; j < NB; j++)
            for (int m = 0; m < 8; m++) acc[j][m] = _mm256_setzero_ps();
        for (ptrdiff_t k = k0; k < k8; k += 8) {
            /* one cache line of the rows ahead per 16 floats: keeps the memory busy while the FMAs run */
            if (!(k & 15))
                for (int j = 0; j < NB; j++)
                    _mm_prefetch((const char *)(wn + ((NB > 1 ? NB : PF_ROWS) + j) * K + k), _MM_HINT_T0);
            __m256 wv[2];
            for (int j = 0; j < NB; j++) wv[j] = _mm256_loadu_ps(wn + j * K + k);
            for (int m = 0; m < R; m++) {
                __m256 xv = _mm256_loadu_ps(x + m * ldx + k);
                KEEP_IN_REGISTER(xv);
                for (int j = 0; j < NB; j++) acc[j][m] = _mm256_fmadd_ps(wv[j], xv, acc[j][m]);
            }
        }
        for (int j = 0; j < NB; j++) {
            float out[8];
            _mm256_storeu_ps(out, sum8(acc[j][0], acc[j][1], acc[j][2], acc[j][3], acc[j][4], acc[j][5], acc[j][6],
                                       acc[j][7]));
            store_outputs(R, out, x, ldx, wn + j * K, b, y, ldy, n + j, k8, k1, add);
        }
    }
}

#ifdef __AVX512F__
/* block() with 16 floats per instruction: the columns past the last multiple of 16 through masked loads
 * (zeros beyond k1), so no scalar tail; each output's 16 lane sums are folded to 8 (lane i + lane i + 8) and
 * then summed as block()'s 8 are. 32 registers: NB R + NB <= 32. */
static inline __attribute__((always_inline)) void block512(const int R, const int NB, const float *x,
                                                            ptrdiff_t ldx, const float *w, const float *b, float *y,
                                                            ptrdiff_t ldy, ptrdiff_t n0, ptrdiff_t n1, ptrdiff_t K,
                                                            ptrdiff_t k0, ptrdiff_t k1, int add) {
    const ptrdiff_t k16 = k0 + ((k1 - k0) & ~(ptrdiff_t)15);
    const __mmask16 tail = (__mmask16)((1u << ((k1 - k0) & 15)) - 1);
    ptrdiff_t n = n0;
    for (; n + NB <= n1; n += NB) {
        const float *wn = w + n * K;
        __m512 acc[4][8];
        for (int j = 0; j < NB; j++)
            for (int m = 0; m < 8; m++) acc[j][m] = _mm512_setzero_ps();
        for (ptrdiff_t k = k0; k < k16; k += 16) {
            for (int j = 0; j < NB; j++) _mm_prefetch((const char *)(wn + (NB + j) * K + k), _MM_HINT_T0);
            __m512 wv[4];
            for (int j = 0; j < NB; j++) wv[j] = _mm512_loadu_ps(wn + j * K + k);
            for (int m = 0; m < R; m++) {
                __m512 xv = _mm512_loadu_ps(x + m * ldx + k);
                KEEP_IN_REGISTER(xv);
                for (int j = 0; j < NB; j++) acc[j][m] = _mm512_fmadd_ps(wv[j], xv, acc[j][m]);
            }
        }
        if (tail) {
            __m512 wv[4];
            for (int j = 0; j < NB; j++) wv[j] = _mm512_maskz_loadu_ps(tail, wn + j * K + k16);
            for (int m = 0; m < R; m++) {
                __m512 xv = _mm512_maskz_loadu_ps(tail, x + m * ldx + k16);
                for (int j = 0; j < NB; j++) acc[j][m] = _mm512_fmadd_ps(wv[j], xv, acc[j][m]);
            }
        }
        for (int j = 0; j < NB; j++) {
            __m256 h[8];
            for (int m = 0; m < 8; m++)
                h[m] = _mm256_add_ps(_mm512_castps512_ps256(acc[j][m]),
                                     _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[j][m]), 1)));
            float out[8];
            _mm256_storeu_ps(out, sum8(h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]));
            store_outputs(R, out, x, ldx, wn + j * K, b, y, ldy, n + j, k1, k1, add);
        }
    }
}
#define BLOCK(R, NB) BLOCKS(block512, R, NB)
#define ALIGN 15 /* column blocks: a multiple of 16 floats */
#define NB_SMALL 4 /* weight rows per pass for R <= 6 */
#define NB_LARGE 3 /* and for R = 7, 8 */
#else
#define BLOCK(R, NB) BLOCKS(block, R, NB)
#define ALIGN 7
#define NB_SMALL 2
#define NB_LARGE 1
#endif

/* the weight rows [n0, n1) in passes of NB, the last n1 - n0 mod NB one at a time */
#define BLOCKS(fn, R, NB)                                                                     \
    do {                                                                                      \
        const ptrdiff_t nb = n0 + (n1 - n0) / (NB) * (NB);                                    \
        fn(R, NB, x, ldx, w, b, y, ldy, n0, nb, K, k0, k1, add);                              \
        if ((NB) > 1 && nb < n1) fn(R, 1, x, ldx, w, b, y, ldy, nb, n1, K, k0, k1, add);      \
    } while (0)

/* Columns per block: x's rows over a block of at most KBLOCK columns (8 x 640 floats, 20 KB) stay in L1
 * while the weight streams past; K is cut into equal blocks, a multiple of 8 (16) each (a down projection's
 * 8 x 1536 floats would not fit, and its products would wait on L2; K = 576 stays one block). */
#define KBLOCK 640

/* one specialised loop per row count */
static inline __attribute__((always_inline)) void block_cases(int M, const float *x, ptrdiff_t ldx, const float *w,
                                                               const float *b, float *y, ptrdiff_t ldy, ptrdiff_t n0,
                                                               ptrdiff_t n1, ptrdiff_t K, ptrdiff_t k0, ptrdiff_t k1,
                                                               int add) {
    switch (M) {
        case 1: BLOCK(1, NB_SMALL); break;
        case 2: BLOCK(2, NB_SMALL); break;
        case 3: BLOCK(3, NB_SMALL); break;
        case 4: BLOCK(4, NB_SMALL); break;
        case 5: BLOCK(5, NB_SMALL); break;
        case 6: BLOCK(6, NB_SMALL); break;
        case 7: BLOCK(7, NB_LARGE); break;
        default: BLOCK(8, NB_LARGE); break;
    }
}

static void rows_upto8(int M, const float *x, ptrdiff_t ldx, const float *w, const float *b, float *y,
                       ptrdiff_t ldy, ptrdiff_t n0, ptrdiff_t n1, ptrdiff_t K) {
    if (K <= KBLOCK) {  /* one block: compiled with constant bounds */
        block_cases(M, x, ldx, w, b, y, ldy, n0, n1, K, 0, K, 0);
        return;
    }
    const ptrdiff_t blocks = (K + KBLOCK - 1) / KBLOCK, size = ((K + blocks - 1) / blocks + ALIGN) & ~(ptrdiff_t)ALIGN;
    for (ptrdiff_t k0 = 0; k0 < K; k0 += size) {
        const ptrdiff_t k1 = K - k0 > size ? k0 + size : K;
        block_cases(M, x, ldx, w, b, y, ldy, n0, n1, K, k0, k1, k0 > 0);
    }
}

#define CHUNK 16  /* weight rows per scheduling unit: 16 x K floats */

/* y[:, n] for all weight rows n, rows of x in groups of 8, the weight rows split over the team (call
 * inside a parallel region) */
static void team_linear(int M, const float *x, ptrdiff_t ldx, const float *w, const float *b, float *y,
                        ptrdiff_t ldy, ptrdiff_t N, ptrdiff_t K) {
    const ptrdiff_t units = (N + CHUNK - 1) / CHUNK;
#pragma omp for schedule(static)
    for (ptrdiff_t u = 0; u < units; u++) {
        ptrdiff_t n0 = u * CHUNK, n1 = n0 + CHUNK < N ? n0 + CHUNK : N;
        for (int m0 = 0; m0 < M; m0 += 8)
            rows_upto8(M - m0 < 8 ? M - m0 : 8, x + m0 * ldx, ldx, w, b, y + m0 * ldy, ldy, n0, n1, K);
    }
}

/* y[M, N] = x[M, K] W[N, K]^T (+ b[N]) */
void few_rows_linear(const float *x, ptrdiff_t ldx, const float *w, const float *b, float *y, ptrdiff_t ldy,
                     int M, ptrdiff_t N, ptrdiff_t K, int threads) {
#pragma omp parallel num_threads(threads)
    team_linear(M, x, ldx, w, b, y, ldy, N, K);
}

/* ---------------------------------------------------------------------------------------------
 * One decoding step of a Llama-style model (RMSNorm, rotary q/k, grouped-query attention over a
 * KV cache, SiLU-gated MLP, tied or untied output layer) for A <= 16 rows, in one call and one
 * OpenMP team: the weight products as above, split over weight rows; the small per-row work
 * (norms, rotary, attention) split over rows and heads. Called by posttrain/rollout/decode.py,
 * which checks the architecture and prepares the pointers.
 */
#include <math.h>

/* e^x for 8 floats: x = n ln2 + r with |r| <= ln2 / 2, e^r from its Taylor series to r^7 (truncation
 * error < 1e-8 relative; measured within 8e-8, about one float ulp, of exp over [-87, 88.72]), times
 * 2^n built in the exponent bits. Below -87.3 (e^x under the smallest normal float) the result is 0,
 * so masked scores (-inf or the dtype minimum) give 0; NaN gives NaN. */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f), hi = _mm256_set1_ps(88.8f);  /* above 88.72: inf */
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(hi, _mm256_max_ps(lo, x));  /* operand order: a NaN passes through (max/min return the second) */
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    /* ln 2 in two parts, so n * ln2_hi is exact and r keeps its low bits */
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.f / 5040);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    /* 2^n as 2^h 2^(n - h), h = floor(n / 2): both factors stay normal floats for n in [-126, 128] */
    __m256i ni = _mm256_cvtps_epi32(n), h = _mm256_srai_epi32(ni, 1), bias = _mm256_set1_epi32(127);
    __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h, bias), 23));
    __m256 e2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, h), bias), 23));
    return _mm256_andnot_ps(under, _mm256_mul_ps(_mm256_mul_ps(p, e1), e2));
}

/* y = e^x over n floats with exp8 (exported for its accuracy test) */
void vector_exp(const float *x, float *y, ptrdiff_t n) {
    ptrdiff_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, exp8(_mm256_loadu_ps(x + i)));
    if (i < n) {  /* the tail through a padded vector, so every value takes the same path */
        float in[8] = {0}, out[8];
        for (ptrdiff_t j = i; j < n; j++) in[j - i] = x[j];
        _mm256_storeu_ps(out, exp8(_mm256_loadu_ps(in)));
        for (ptrdiff_t j = i; j < n; j++) y[j] = out[j - i];
    }
}

static inline float hsum8(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* out[hd] = softmax(q K^T * scaling + mask) V over T cached positions (K, V: T x hd, hd a multiple of 8) */
static void attend(const float *q, const float *K, const float *V, const float *mask, float scaling, int T, int hd,
                   float *sc, float *out) {
    float top = -INFINITY;
    int t = 0;
    for (; t + 8 <= T; t += 8) {  /* 8 positions at a time: 8 dot products reduced into one vector */
        __m256 acc[8];
        for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
        for (int i = 0; i < hd; i += 8) {
            __m256 qv = _mm256_loadu_ps(q + i);
            for (int j = 0; j < 8; j++)
                acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(K + (ptrdiff_t)(t + j) * hd + i), acc[j]);
        }
        __m256 s = _mm256_fmadd_ps(sum8(acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7]),
                                   _mm256_set1_ps(scaling), _mm256_loadu_ps(mask + t));
        _mm256_storeu_ps(sc + t, s);
    }
    for (; t < T; t++) {
        __m256 acc = _mm256_setzero_ps();
        for (int i = 0; i < hd; i += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(K + (ptrdiff_t)t * hd + i), acc);
        sc[t] = hsum8(acc) * scaling + mask[t];
    }
    for (t = 0; t < T; t++) top = sc[t] > top ? sc[t] : top;
    if (top == -INFINITY) top = 0.f;  /* every position masked: softmax of -inf, as torch, gives NaN below */
    __m256 total = _mm256_setzero_ps(), topv = _mm256_set1_ps(top);
    for (t = 0; t + 8 <= T; t += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + t), topv));
        _mm256_storeu_ps(sc + t, e);
        total = _mm256_add_ps(total, e);
    }
    float sum = hsum8(total);
    for (; t < T; t++) sum += (sc[t] = expf(sc[t] - top));
    const float inv = 1.f / sum;
    for (int i = 0; i < hd; i += 32) {  /* 4 output vectors at a time, over all positions */
        const int nv = hd - i >= 32 ? 4 : (hd - i) / 8;
        __m256 o0 = _mm256_setzero_ps(), o1 = o0, o2 = o0, o3 = o0;
        for (t = 0; t < T; t++) {
            const float *v = V + (ptrdiff_t)t * hd + i;
            __m256 p = _mm256_set1_ps(sc[t]);
            o0 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v), o0);
            if (nv > 1) o1 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8), o1);
            if (nv > 2) o2 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 16), o2);
            if (nv > 3) o3 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 24), o3);
        }
        __m256 s = _mm256_set1_ps(inv);
        _mm256_storeu_ps(out + i, _mm256_mul_ps(o0, s));
        if (nv > 1) _mm256_storeu_ps(out + i + 8, _mm256_mul_ps(o1, s));
        if (nv > 2) _mm256_storeu_ps(out + i + 16, _mm256_mul_ps(o2, s));
        if (nv > 3) _mm256_storeu_ps(out + i + 24, _mm256_mul_ps(o3, s));
    }
}

/* g = silu(g) * u over n floats */
static void silu_mul(float *g, const float *u, ptrdiff_t n) {
    ptrdiff_t i = 0;
    const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(g + i);
        __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, x))));
        _mm256_storeu_ps(g + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++) g[i] = g[i] / (1.f + expf(-g[i])) * u[i];
}

typedef struct {
    const float *norm1, *qkv, *qkv_b, *o, *o_b, *norm2, *gate, *gate_b, *up, *up_b, *down, *down_b;
    float *keys, *values; /* [A, Hk, cap, hd], contiguous: this step writes position T - 1 */
} LeanLayer;

typedef struct {
    int A, D, Hq, Hk, hd, I, V, L, cap;
    float eps, scaling;
    const float *embed, *final_norm, *head, *head_b; /* embed: V x D; head: V x D (may equal embed) */
} LeanModel;

static void rms_norm_row(const float *x, const float *w, float eps, float *out, int D) {
    double ss = 0.;
    for (int i = 0; i < D; i++) ss += (double)x[i] * x[i];
    float r = (float)(1. / sqrt((float)(ss / D) + (double)eps));
    for (int i = 0; i < D; i++) out[i] = w[i] * (x[i] * r);
}

/* rows a < A of n floats each (row stride ld) into the record: record[(l * A + a) * F + offset + i] */
static void keep_rows(float *record, int l, int A, ptrdiff_t F, ptrdiff_t offset, const float *src, ptrdiff_t ld,
                      ptrdiff_t n) {
#pragma omp for schedule(static)
    for (int a = 0; a < A; a++) {
        float *dst = record + ((ptrdiff_t)l * A + a) * F + offset;
        for (ptrdiff_t i = 0; i < n; i++) dst[i] = src[(ptrdiff_t)a * ld + i];
    }
}

/* work: at least A * (3 D + (Hq + 2 Hk) hd + Hq hd + 2 I) + A * Hq * cap floats.
 * `record` (NULL: none): every layer's linear outputs for the A rows, as the nn.Linear modules give them
 * (q, k and v before the rotary embedding, gate and up before the SiLU), laid out (L, A, F) with
 * F = (Hq + 2 Hk) hd + D + 2 I + D: [q | k | v | o | gate | up | down]. */
void lean_decode_step(const LeanModel *m, const LeanLayer *layers, const long *tokens, int T, const float *cos,
                      const float *sin, const float *mask, float *logits, float *work, float *record, int threads) {
    const int A = m->A, D = m->D, Hq = m->Hq, Hk = m->Hk, hd = m->hd, I = m->I, half = hd / 2;
    const int QKV = (Hq + 2 * Hk) * hd, group = Hq / Hk;
    float *h = work, *x = h + (ptrdiff_t)A * D, *tmp = x + (ptrdiff_t)A * D, *qkv = tmp + (ptrdiff_t)A * D;
    float *attn = qkv + (ptrdiff_t)A * QKV, *g = attn + (ptrdiff_t)A * Hq * hd, *u = g + (ptrdiff_t)A * I;
    float *scores = u + (ptrdiff_t)A * I;
    const ptrdiff_t head_stride = (ptrdiff_t)m->cap * hd, row_stride = (ptrdiff_t)Hk * head_stride;
    const ptrdiff_t F = QKV + 2 * (ptrdiff_t)D + 2 * (ptrdiff_t)I;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int a = 0; a < A; a++)
            for (int i = 0; i < D; i++) h[(ptrdiff_t)a * D + i] = m->embed[(ptrdiff_t)tokens[a] * D + i];
        for (int l = 0; l < m->L; l++) {
            const LeanLayer *ly = &layers[l];
#pragma omp for schedule(static)
            for (int a = 0; a < A; a++) rms_norm_row(h + (ptrdiff_t)a * D, ly->norm1, m->eps, x + (ptrdiff_t)a * D, D);
            team_linear(A, x, D, ly->qkv, ly->qkv_b, qkv, QKV, QKV, D);
            if (record) keep_rows(record, l, A, F, 0, qkv, QKV, QKV);
            /* rotary on q and k heads; k and v into the cache at position T - 1 */
#pragma omp for schedule(static) collapse(2)
            for (int a = 0; a < A; a++)
                for (int hh = 0; hh < Hq + 2 * Hk; hh++) {
                    float *v = qkv + (ptrdiff_t)a * QKV + (ptrdiff_t)hh * hd, rot[256];
                    const float *c = cos + (ptrdiff_t)a * hd, *s = sin + (ptrdiff_t)a * hd;
                    if (hh < Hq + Hk) {
                        for (int i = 0; i < hd; i++) rot[i] = v[i] * c[i] + v[(i + half) % hd] * s[i];
                        for (int i = 0; i < hd; i++) v[i] = rot[i];
                    }
                    if (hh >= Hq) {
                        int kv = hh < Hq + Hk ? hh - Hq : hh - Hq - Hk;
                        float *dst = (hh < Hq + Hk ? ly->keys : ly->values) + a * row_stride + kv * head_stride
                                     + (ptrdiff_t)(T - 1) * hd;
                        for (int i = 0; i < hd; i++) dst[i] = v[i];
                    }
                }
            /* attention: each query head over the T cached positions of its key head */
#pragma omp for schedule(static) collapse(2)
            for (int a = 0; a < A; a++)
                for (int hq = 0; hq < Hq; hq++) {
                    const float *q = qkv + (ptrdiff_t)a * QKV + (ptrdiff_t)hq * hd;
                    const float *K = ly->keys + a * row_stride + (hq / group) * head_stride;
                    const float *Vv = ly->values + a * row_stride + (hq / group) * head_stride;
                    float *sc = scores + ((ptrdiff_t)a * Hq + hq) * m->cap;
                    attend(q, K, Vv, mask + (ptrdiff_t)a * T, m->scaling, T, hd, sc,
                           attn + (ptrdiff_t)a * Hq * hd + (ptrdiff_t)hq * hd);
                }
            team_linear(A, attn, (ptrdiff_t)Hq * hd, ly->o, ly->o_b, tmp, D, D, (ptrdiff_t)Hq * hd);
            if (record) keep_rows(record, l, A, F, QKV, tmp, D, D);
#pragma omp for schedule(static)
            for (int a = 0; a < A; a++) {
                for (int i = 0; i < D; i++) h[(ptrdiff_t)a * D + i] += tmp[(ptrdiff_t)a * D + i];
                rms_norm_row(h + (ptrdiff_t)a * D, ly->norm2, m->eps, x + (ptrdiff_t)a * D, D);
            }
            team_linear(A, x, D, ly->gate, ly->gate_b, g, I, I, D);
            team_linear(A, x, D, ly->up, ly->up_b, u, I, I, D);
            if (record) {
                keep_rows(record, l, A, F, QKV + D, g, I, I);
                keep_rows(record, l, A, F, QKV + D + I, u, I, I);
            }
#pragma omp for schedule(static)
            for (int a = 0; a < A; a++) silu_mul(g + (ptrdiff_t)a * I, u + (ptrdiff_t)a * I, I);
            team_linear(A, g, I, ly->down, ly->down_b, tmp, D, D, I);
            if (record) keep_rows(record, l, A, F, QKV + D + 2 * (ptrdiff_t)I, tmp, D, D);
#pragma omp for schedule(static)
            for (int a = 0; a < A; a++)
                for (int i = 0; i < D; i++) h[(ptrdiff_t)a * D + i] += tmp[(ptrdiff_t)a * D + i];
        }
#pragma omp for schedule(static)
        for (int a = 0; a < A; a++) rms_norm_row(h + (ptrdiff_t)a * D, m->final_norm, m->eps, x + (ptrdiff_t)a * D, D);
        team_linear(A, x, D, m->head, m->head_b, logits, m->V, m->V, D);
    }
}

/* ---------------------------------------------------------------------------------------------
 * The sampler's top-p filter sorts every decoded row's logits (a few rows of a whole vocabulary) at every
 * step; a comparison sort of (value, index) pairs costs about 50 times a pass over the row. This is a
 * stable least-significant-digit radix sort of each row's float32 values in descending order (three
 * passes of 11 bits over keys that order as the floats do): `values` the row sorted, `indices` where
 * each came from, equal values in the order of their indices. Returns the number of rows holding a NaN
 * (those rows are left unsorted: the caller sorts with torch instead). Rows are split over OpenMP threads.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* the key of a float for a descending order: larger values get smaller keys (+0 before -0, -inf last) */
static inline uint32_t descending_key(float v) {
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    return (u & 0x80000000u) ? u : (~u & 0x7fffffffu);
}

static int sort_row_descending(const float *x, ptrdiff_t n, float *values, int64_t *indices, uint32_t *buf) {
    uint32_t *key = buf, *idx = buf + n, *key2 = buf + 2 * n, *idx2 = buf + 3 * n;
    uint32_t count[3][2048];
    memset(count, 0, sizeof count);
    for (ptrdiff_t i = 0; i < n; i++) {
        if (x[i] != x[i]) return 1;  /* NaN */
        uint32_t k = descending_key(x[i]);
        key[i] = k, idx[i] = (uint32_t)i;
        count[0][k & 2047]++, count[1][(k >> 11) & 2047]++, count[2][k >> 22]++;
    }
    for (int pass = 0; pass < 3; pass++) {
        uint32_t start = 0, shift = 11 * pass;
        for (int d = 0; d < 2048; d++) {
            uint32_t c = count[pass][d];
            count[pass][d] = start, start += c;
        }
        for (ptrdiff_t i = 0; i < n; i++) {  /* in order: equal digits keep their order (stable) */
            uint32_t at = count[pass][(key[i] >> shift) & 2047]++;
            key2[at] = key[i], idx2[at] = idx[i];
        }
        uint32_t *t = key; key = key2, key2 = t;
        t = idx, idx = idx2, idx2 = t;
    }
    for (ptrdiff_t i = 0; i < n; i++) indices[i] = idx[i], values[i] = x[idx[i]];
    return 0;
}

int sort_rows_descending(const float *x, int rows, ptrdiff_t n, float *values, int64_t *indices, int threads) {
    int nan_rows = 0;
#pragma omp parallel num_threads(threads) reduction(+ : nan_rows)
    {
        uint32_t *buf = malloc(4 * (size_t)n * sizeof(uint32_t));
#pragma omp for schedule(static)
        for (int r = 0; r < rows; r++)
            nan_rows += buf == NULL ? 1 : sort_row_descending(x + r * n, n, values + r * n, indices + r * n, buf);
        free(buf);
    }
    return nan_rows;
}

/*
 * The top-p (nucleus) filter of each row of x (rows, n) without sorting the whole row: out (rows, n) is x with -inf
 * in place of the logits outside the kept prefix, the shortest prefix of the row sorted in descending order whose
 * mass before each token stays below top_p (the first token always kept). p (rows, n) is each row's softmax. The
 * masses are summed as torch's cumsum sums them (in double, in the sorted order, each prefix rounded to float, then
 * the token's own p taken off in float), so the cut is the one `probs.cumsum(-1) - probs >= top_p` gives on the
 * sorted row when p equals the sorted row's softmax; as that softmax sums its normaliser in another order, a row is
 * cut only where the masses on both sides of the cut lie more than `band` away from top_p.
 *
 * As p grows with x, the tokens with p >= tau are a prefix of the sorted row: one pass takes them, for tau = 2^-20,
 * then 2^-27, then 0, until their mass passes top_p by a margin and the cut lies among them; only they are sorted
 * (`sort_row_descending`) for the exact sums. undecided[r] is 1 for a row it does not cut (then out holds x): a NaN
 * or +inf in it, equal values on both sides of the cut (which of them stays depends on the order of ties),
 * masses within `band` of top_p, or no memory. Returns the number of such rows.
 */
static int top_p_row(const float *x, const float *p, ptrdiff_t n, float top_p, float band, float *out, float *cand,
                     int64_t *where, float *values, int64_t *order, uint32_t *buf) {
    static const float taus[3] = {0x1p-20f, 0x1p-27f, 0.0f};
    for (int t = 0; t < 3; t++) {
        double held = 0.0;
        ptrdiff_t m = 0, i = 0;
        const __m256 tau = _mm256_set1_ps(taus[t]);
        for (; i + 8 <= n; i += 8) {  /* in index order: the sort below is stable */
            unsigned hits = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + i), tau, _CMP_GE_OQ));
            for (; hits; hits &= hits - 1) {
                ptrdiff_t j = i + __builtin_ctz(hits);
                cand[m] = x[j], where[m] = j, m++, held += p[j];
            }
        }
        for (; i < n; i++)
            if (p[i] >= taus[t]) cand[m] = x[i], where[m] = i, m++, held += p[i];
        if (m == 0) return 1;  /* a NaN or +inf logit: p is NaN */
        if (held < (double)top_p + 1e-3 && t < 2) continue;  /* take more: a smaller tau */
        if (sort_row_descending(cand, m, values, order, buf)) return 1;
        double sum = 0.0;
        float before_last = -INFINITY;  /* the mass before the last token kept */
        for (ptrdiff_t k = 0; k < m; k++) {
            float pk = p[where[order[k]]];
            sum += pk;
            float before = (float)sum - pk;
            if (k > 0 && before >= top_p) {  /* token k is the first one dropped */
                if (values[k - 1] == values[k]) return 1;  /* a tie across the cut */
                if (before < top_p + band || before_last >= top_p - band) return 1;  /* too close to call */
                float threshold = values[k - 1];
                for (ptrdiff_t j = 0; j < n; j++) out[j] = x[j] < threshold ? -INFINITY : x[j];
                return 0;
            }
            before_last = before;
        }
        if (m == n) {  /* nothing dropped */
            memcpy(out, x, n * sizeof *out);
            return 0;
        }
        /* the cut lies past the candidates (the token after them): a smaller tau */
    }
    return 1;
}

int top_p_filter_rows(const float *x, const float *p, int rows, ptrdiff_t n, float top_p, float band, float *out,
                      uint8_t *undecided, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(+ : failed)
    {
        char *space = malloc((size_t)n * (2 * sizeof(float) + 2 * sizeof(int64_t) + 4 * sizeof(uint32_t)));
#pragma omp for schedule(static)
        for (int r = 0; r < rows; r++) {
            int bad = 1;
            if (space != NULL) {
                float *cand = (float *)space, *values = cand + n;
                int64_t *where = (int64_t *)(values + n), *order = where + n;
                bad = top_p_row(x + r * n, p + r * n, n, top_p, band, out + r * n, cand, where, values, order,
                                (uint32_t *)(order + n));
            }
            if (bad) memcpy(out + r * n, x + r * n, n * sizeof *out);
            undecided[r] = (uint8_t)bad;
            failed += bad;
        }
        free(space);
    }
    return failed;
}
