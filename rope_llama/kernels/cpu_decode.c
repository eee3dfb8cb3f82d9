/* One decode step of model/llama.py's Llama for ONE sequence, on the CPU: weights and KV cache in float32, or
 * in bfloat16 when compiled with -DROPE_BF16 (every activation still float32).
 *
 * Why C: a batch-1 decode step is bound by reading the weights (16 MiB for the default model), and
 * the torch / torch.compile step spends about as long again between its dozens of kernels, each with
 * its own thread fork and join. Here the whole step is one OpenMP parallel region: the threads split
 * every matrix-vector product by rows and meet at a barrier between operations. The maths is the
 * model's, line for line (RMSNorm, fused qkv, RoPE, GQA attention, SwiGLU, tied head); tests check
 * it against the torch forward (tests/test_generate.py). kernels/cpu_decode.py builds and calls it.
 *
 * Shapes: C = d_model, H / KV = query / key-value heads, D = head_dim, F = ffn_hidden, V = vocab,
 * R = rotary dims (<= D). Weights are row-major torch tensors: qkv (H*D + 2*KV*D, C), o_proj
 * (C, H*D), gate_up (2F, C), down (C, F), embed / head (V, C). The cache of each layer is the
 * (1, KV, capacity, D) tensor of model/kv_cache.py; keys are stored after rotation.
 *
 * bf16: a batch-1 step reads every weight once, so half the bytes of float32 is up to twice the speed; a bf16
 * number is the upper half of a float32, so loading one is a shift, and a key or value written to the cache is
 * rounded to nearest even, as torch's .to(torch.bfloat16).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) /* AVX-512 CPUs have both */
#include <immintrin.h>
#endif

#ifdef ROPE_BF16
typedef uint16_t real; /* how weights and the KV cache are stored */
static inline float to_float(real h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
static inline real from_float(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (real)((bits >> 16) | 0x40u); /* NaN stays NaN */
    return (real)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
#else
typedef float real;
static inline float to_float(real x) { return x; }
static inline real from_float(float x) { return x; }
#endif

#ifdef __AVX512F__
static inline __m512 load16(const real *p) { /* 16 stored numbers as floats */
#ifdef ROPE_BF16
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
#else
    return _mm512_loadu_ps(p);
#endif
}
#endif
#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 load8(const real *p) { /* 8 stored numbers as floats */
#ifdef ROPE_BF16
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
#else
    return _mm256_loadu_ps(p);
#endif
}
#endif

typedef struct {
    int n_layers, d_model, n_heads, n_kv_heads, head_dim, ffn_hidden, vocab, rotary_dim, interleaved,
        capacity, n_threads;
    float eps;
    const real *embed, *head, *final_norm;
    const real **attn_norm, **qkv, **o_proj, **mlp_norm, **gate_up, **down; /* [n_layers] */
    real **k_cache, **v_cache;                                             /* [n_layers] */
    float *x, *xn, *qkv_out, *attn, *ffn, *hidden, *scores; /* scratch: C, C, (H+2KV)*D, H*D, 2F, F, H*capacity */
} Model;

/* y (n) = W (n, k) @ x (k), or y += W @ x: rows split over the threads (inside a parallel region). bf16
 * rows are widened 16 (AVX-512) or 8 (AVX2) at a time: GCC does not vectorize the scalar widening. */
static void matvec(const real *restrict W, const float *restrict x, float *restrict y, int n, int k,
                   int accumulate) {
#pragma omp for schedule(static)
    for (int i = 0; i < n; i++) {
        const real *w = W + (size_t)i * k;
        float acc = 0.f;
        int j = 0;
#if defined(ROPE_BF16) && defined(__AVX512F__)
        __m512 sum = _mm512_setzero_ps();
        for (; j + 16 <= k; j += 16) sum = _mm512_fmadd_ps(load16(w + j), _mm512_loadu_ps(x + j), sum);
        acc = _mm512_reduce_add_ps(sum);
#elif defined(ROPE_BF16) && defined(__AVX2__) && defined(__FMA__)
        __m256 sum = _mm256_setzero_ps();
        for (; j + 8 <= k; j += 8) sum = _mm256_fmadd_ps(load8(w + j), _mm256_loadu_ps(x + j), sum);
        float lanes[8];
        _mm256_storeu_ps(lanes, sum);
        for (int l = 0; l < 8; l++) acc += lanes[l];
#endif
#pragma omp simd reduction(+ : acc)
        for (int r = j; r < k; r++) acc += to_float(w[r]) * x[r];
        y[i] = accumulate ? y[i] + acc : acc;
    }
}

/* out = x * rsqrt(mean(x^2) + eps) * weight (nn.RMSNorm); d_model floats, one thread. */
static void rmsnorm(const float *x, const real *weight, float *out, int n, float eps) {
    float sum_sq = 0.f;
    for (int i = 0; i < n; i++) sum_sq += x[i] * x[i];
    const float rstd = 1.f / sqrtf(sum_sq / n + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * rstd * to_float(weight[i]);
}

/* Rotate the first R channels of one head: x * cos + rotate(x) * sin, with rotate_half (-x2, x1)
 * or, interleaved, rotate_pairs (-x1, x0, -x3, x2, ...) as in model/rope.py. */
static void rope(float *v, const float *cos, const float *sin, int rotary_dim, int interleaved) {
    const int pair = interleaved ? 1 : rotary_dim / 2; /* distance between the two rotated channels */
    const int step = interleaved ? 2 : 1;
    const int count = interleaved ? rotary_dim : rotary_dim / 2;
    for (int i = 0; i < count; i += step) {
        const float a = v[i], b = v[i + pair];
        v[i] = a * cos[i] - b * sin[i];
        v[i + pair] = b * cos[i + pair] + a * sin[i + pair];
    }
}

/* exp(x) for the x <= 0 of a softmax after its max is subtracted, without libm's call per element
 * (docs/performance.md): x = k ln2 + r with k an integer and |r| <= ln2/2
 * (ln 2 split in two, so k * hi is exact: Cody-Waite), exp(r) from its Taylor series to degree 7, and
 * 2^k written into a float's exponent bits. Relative error < 1e-7, i.e. within a float ulp. */
static const float EXP_FLOOR = -87.f; /* exp(-87) ~ 1.6e-38: 2^k stays a normal float */
static const float LOG2E = 1.44269504f, LN2_HI = 0.693145751953125f, LN2_LO = 1.428606765330187e-6f;
static const float TAYLOR[8] = {1.f / 5040, 1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}; /* 1/7! .. 1/0! */

static inline float exp_nonpositive(float x) {
    x = x < EXP_FLOOR ? EXP_FLOOR : x;
    const float k = nearbyintf(x * LOG2E);
    const float r = (x - k * LN2_HI) - k * LN2_LO;
    float p = TAYLOR[0]; /* Horner */
    for (int i = 1; i < 8; i++) p = p * r + TAYLOR[i];
    const int bits = ((int)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* s[j] = exp(s[j] - shift) for j < n (every s[j] <= shift), in place; returns their sum. With AVX2 the
 * steps of exp_nonpositive run 8 floats at a time: GCC leaves the scalar form unvectorized for AVX2 targets. */
static float exp_shifted_sum(float *s, int n, float shift) {
    float total = 0.f;
    int j = 0;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 sum = _mm256_setzero_ps();
    for (; j + 8 <= n; j += 8) {
        const __m256 x = _mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(shift)),
                                       _mm256_set1_ps(EXP_FLOOR));
        const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(LN2_LO), _mm256_fnmadd_ps(k, _mm256_set1_ps(LN2_HI), x));
        __m256 p = _mm256_set1_ps(TAYLOR[0]);
        for (int i = 1; i < 8; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(TAYLOR[i]));
        const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
        const __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
        _mm256_storeu_ps(s + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, sum);
    for (int i = 0; i < 8; i++) total += lanes[i];
#endif
#pragma omp simd reduction(+ : total)
    for (int i = j; i < n; i++) total += (s[i] = exp_nonpositive(s[i] - shift));
    return total;
}

#ifdef __AVX512F__
/* q . k for 16 consecutive keys (head_dim a multiple of 16) -> the 16 dot products in key order.
 * Summing each key's vector across its lanes one key at a time costs more than the products; here
 * the 16 vectors are added in a transposing tree (pairs of lanes, of 64-bit halves, of 128-bit
 * blocks), about 3 instructions per key. */
static inline __m512 dot16(const float *q, const real *keys, int head_dim) {
    __m512 v[16], w[8], x[4], z[2];
    for (int i = 0; i < 16; i++) {
        const real *k = keys + (size_t)i * head_dim;
        v[i] = _mm512_mul_ps(_mm512_loadu_ps(q), load16(k));
        for (int d = 16; d < head_dim; d += 16)
            v[i] = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(k + d), v[i]);
    }
    for (int i = 0; i < 8; i++) /* per 128-bit block: lanes of keys 2i, 2i+1 interleaved */
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit block: one partial sum each of keys 4i .. 4i+3 */
        const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
        x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; i++) /* blocks 0+1 and 2+3 of keys 8i .. 8i+3, then of 8i+4 .. 8i+7 */
        z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88), _mm512_shuffle_f32x4(z[0], z[1], 0xDD));
}
#elif defined(__AVX2__) && defined(__FMA__)
/* dot16's tree for 8-lane AVX2 (head_dim a multiple of 8): the 8 dot products of 8 consecutive keys. */
static inline __m256 dot8(const float *q, const real *keys, int head_dim) {
    __m256 v[8], w[4], x[2];
    for (int i = 0; i < 8; i++) {
        const real *k = keys + (size_t)i * head_dim;
        v[i] = _mm256_mul_ps(_mm256_loadu_ps(q), load8(k));
        for (int d = 8; d < head_dim; d += 8)
            v[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), v[i]);
    }
    for (int i = 0; i < 4; i++) /* per 128-bit half: lanes of keys 2i, 2i+1 interleaved */
        w[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; i++) { /* per 128-bit half: one partial sum each of keys 4i .. 4i+3 */
        const __m256d a = _mm256_castps_pd(w[2 * i]), b = _mm256_castps_pd(w[2 * i + 1]);
        x[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)),
                             _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(x[0], x[1], 0x20), _mm256_permute2f128_ps(x[0], x[1], 0x31));
}
#endif

/* The `group` query heads of one KV head (GQA) over its n cached keys: softmax(q k^T / sqrt(D)) v.
 * q, out: (group, D); keys, values: (n, D); scores: (group, stride). Each key and value row comes
 * from memory once for the whole group. */
static void attend(const float *q, const real *keys, const real *values, float *scores, float *out,
                   int group, int n, int head_dim, int stride) {
    const float scale = 1.f / sqrtf((float)head_dim);
    int j = 0;
#ifdef __AVX512F__
    if (head_dim % 16 == 0)
        for (; j + 16 <= n; j += 16)
            for (int a = 0; a < group; a++)
                _mm512_storeu_ps(scores + (size_t)a * stride + j,
                                 _mm512_mul_ps(dot16(q + a * head_dim, keys + (size_t)j * head_dim, head_dim),
                                               _mm512_set1_ps(scale)));
#elif defined(__AVX2__) && defined(__FMA__)
    if (head_dim % 8 == 0)
        for (; j + 8 <= n; j += 8)
            for (int a = 0; a < group; a++)
                _mm256_storeu_ps(scores + (size_t)a * stride + j,
                                 _mm256_mul_ps(dot8(q + a * head_dim, keys + (size_t)j * head_dim, head_dim),
                                               _mm256_set1_ps(scale)));
#endif
    for (; j < n; j++) { /* the keys left over (all of them without AVX-512 or AVX2) */
        const real *k = keys + (size_t)j * head_dim;
        for (int a = 0; a < group; a++) {
            const float *qa = q + a * head_dim;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < head_dim; d++) dot += qa[d] * to_float(k[d]);
            scores[(size_t)a * stride + j] = dot * scale;
        }
    }
    for (int a = 0; a < group; a++) { /* softmax of each head's row, normalised into the values below */
        float *s = scores + (size_t)a * stride, max_score = -INFINITY;
#pragma omp simd reduction(max : max_score)
        for (int j = 0; j < n; j++) max_score = s[j] > max_score ? s[j] : max_score;
        const float inv_total = 1.f / exp_shifted_sum(s, n, max_score);
#pragma omp simd
        for (int j = 0; j < n; j++) s[j] *= inv_total;
    }
    memset(out, 0, sizeof(float) * group * head_dim);
    for (int j = 0; j < n; j++) {
        const real *v = values + (size_t)j * head_dim;
        for (int a = 0; a < group; a++) {
            const float p = scores[(size_t)a * stride + j];
            float *oa = out + a * head_dim;
#pragma omp simd
            for (int d = 0; d < head_dim; d++) oa[d] += p * to_float(v[d]);
        }
    }
}

/* Embed `token`, write its rotated key and value at cache `slot`, attend over slots 0..slot, and
 * write the next-token logits (V floats). cos / sin: the R-float rows of the token's position. */
void native_step(const Model *m, int token, int slot, const float *cos, const float *sin, float *logits) {
    const int C = m->d_model, H = m->n_heads, KV = m->n_kv_heads, D = m->head_dim, F = m->ffn_hidden;
    const int group = H / KV; /* query heads per KV head */
    for (int c = 0; c < C; c++) m->x[c] = to_float(m->embed[(size_t)token * C + c]);
#pragma omp parallel num_threads(m->n_threads)
    {
        for (int layer = 0; layer < m->n_layers; layer++) {
            real *k_cache = m->k_cache[layer], *v_cache = m->v_cache[layer];
#pragma omp single
            rmsnorm(m->x, m->attn_norm[layer], m->xn, C, m->eps); /* (each construct ends in a barrier) */
            matvec(m->qkv[layer], m->xn, m->qkv_out, (H + 2 * KV) * D, C, 0);
#pragma omp single
            {
                for (int h = 0; h < H + KV; h++) /* the query heads, then the key heads */
                    rope(m->qkv_out + h * D, cos, sin, m->rotary_dim, m->interleaved);
                for (int g = 0; g < KV; g++) {
                    const size_t at = ((size_t)g * m->capacity + slot) * D;
                    for (int d = 0; d < D; d++) {
                        k_cache[at + d] = from_float(m->qkv_out[(H + g) * D + d]);
                        v_cache[at + d] = from_float(m->qkv_out[(H + KV + g) * D + d]);
                    }
                }
            }
#pragma omp for schedule(static)
            for (int g = 0; g < KV; g++) { /* query heads g*group .. (g+1)*group - 1 share KV head g */
                const size_t kv = (size_t)g * m->capacity * D;
                attend(m->qkv_out + g * group * D, k_cache + kv, v_cache + kv,
                       m->scores + (size_t)g * group * m->capacity, m->attn + g * group * D, group, slot + 1, D,
                       m->capacity);
            }
            matvec(m->o_proj[layer], m->attn, m->x, C, H * D, 1); /* residual: x += o_proj(attn) */
#pragma omp single
            rmsnorm(m->x, m->mlp_norm[layer], m->xn, C, m->eps);
            matvec(m->gate_up[layer], m->xn, m->ffn, 2 * F, C, 0);
#pragma omp for schedule(static)
            for (int i = 0; i < F; i++) { /* SwiGLU: silu(gate) * up */
                const float gate = m->ffn[i];
                m->hidden[i] = gate / (1.f + expf(-gate)) * m->ffn[F + i];
            }
            matvec(m->down[layer], m->hidden, m->x, C, F, 1); /* residual: x += down(hidden) */
        }
#pragma omp single
        rmsnorm(m->x, m->final_norm, m->xn, C, m->eps);
        matvec(m->head, m->xn, logits, m->vocab, C, 0);
    }
}
