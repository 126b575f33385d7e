/* Fused CPU kernels for the layer glue between the matmuls (see cpu_kernels.py).
 *
 * Each kernel does in one call what eager PyTorch does in 3-15 small ops; at decode those ops cost
 * ~5 us each in dispatch alone, more than their arithmetic. Every kernel exists for T = float (f32)
 * and T = bfloat16 (bf16, stored as uint16), and rounds to T at the same points as the PyTorch /
 * Hugging Face code it replaces (float32 arithmetic, round-to-nearest-even to bfloat16), so results
 * match that code up to float32 summation order. Rows are split over OpenMP threads when the work is
 * large; no allocation except the scores buffers of decode_attn; shapes and strides are checked by the
 * Python caller.
 */
#include <math.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#define MAX_THREADS() omp_get_max_threads()
#define THREAD_ID() omp_get_thread_num()
#else
#define MAX_THREADS() 1
#define THREAD_ID() 0
#endif
/* Work (elements, or key x head products) below which a kernel stays on the calling thread: an
 * OpenMP fork costs a few microseconds. Built with -fopenmp the kernels share PyTorch's own libgomp
 * (same soname, already loaded), so torch.set_num_threads governs them too. */
#define PAR_MIN_WORK 32768
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, NaN kept quiet (as c10::BFloat16) */
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded); /* branch-free: vectorizes */
}

/* exp(x) for float32 in plain C that compilers vectorize (libm's expf does not vectorize here):
 * Cody-Waite reduction x = n ln2 + f, |f| <= ln2/2, then a degree-7 Taylor polynomial of e^f
 * (relative error < 2e-7, i.e. within ~2 float32 ulp of expf) scaled by 2^n built in the exponent
 * bits. Inputs below -87.3 give 0 (as expf underflows), above 88.7 give +inf; NaN stays NaN. */
static inline float fast_expf(float x) {
    float xc = x < -87.33654f ? -87.33654f : (x > 88.72283f ? 88.72283f : x);
    float n = __builtin_rintf(xc * 1.44269504088896341f);
    float f = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.f + f * (1.f + f * (0.5f + f * (1.f / 6 + f * (1.f / 24 + f * (1.f / 120 + f * (1.f / 720 + f * (1.f / 5040)))))));
    int32_t e = (int32_t)n + 127;
    e = e < 1 ? 1 : e; /* n >= -126 here; 2^-126 times p, then the x < -87.3 case below */
    uint32_t bits = (uint32_t)e << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    float r = p * scale;
    r = x < -87.33654f ? 0.f : r;
    r = x > 88.72283f ? INFINITY : r;
    return x != x ? x : r;
}

#define LD_f32(p) (*(p))
#define ST_f32(p, v) (*(p) = (v))
#define RD_f32(v) (v) /* rounding a float32 value to T */
#define LD_bf16(p) bf16_to_f32(*(p))
#define ST_bf16(p, v) (*(p) = f32_to_bf16(v))
#define RD_bf16(v) bf16_to_f32(f32_to_bf16(v))

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
/* decode_attn for bfloat16 with d a multiple of 32 on AVX512-BF16 CPUs: q.k by VDPBF16PS (bf16 pairs
 * multiplied exactly, summed in float32), p.v in float32 FMAs. Same contract as decode_attn_bf16. */
static int decode_attn_bf16_avx512(const uint16_t *q, int64_t q_stride, const int64_t *qrow,
                                   const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *slots,
                                   const int64_t *off, int64_t nb, int64_t nh, int64_t nkv, int64_t d,
                                   float scale, float *out_f, uint16_t *out_t, float *lse, const int64_t *orow) {
    int64_t grp = nh / nkv, nv = d / 32, max_len = 0;
    if (d % 32 || d > 256 || grp > 16) return 0;
    for (int64_t b = 0; b < nb; b++) if (off[b + 1] - off[b] > max_len) max_len = off[b + 1] - off[b];
    int64_t per = grp * (max_len > 0 ? max_len : 1), total = 0;
    for (int64_t b = 0; b < nb; b++) total += off[b + 1] - off[b];
    int nt = MAX_THREADS();
    float *sc_all = (float *)malloc(sizeof(float) * (size_t)(per * nt));
    if (!sc_all) return 0;
#pragma omp parallel if (total * nh * d >= PAR_MIN_WORK)
    {
    float *sc = sc_all + per * THREAD_ID();
    __m512bh qv[16][8];
    __m512 acc[16][16];
#pragma omp for schedule(dynamic, 2)
    for (int64_t b = 0; b < nb; b++) {
        int64_t len = off[b + 1] - off[b];
        const int64_t *sl = slots + off[b];
        for (int64_t kh = 0; kh < nkv; kh++) {
            float mx[16], sum[16];
            for (int64_t g = 0; g < grp; g++) {
                const uint16_t *qr = q + qrow[b] * q_stride + (kh * grp + g) * d;
                for (int64_t v = 0; v < nv; v++) qv[g][v] = (__m512bh)_mm512_loadu_si512(qr + 32 * v);
                mx[g] = -INFINITY;
            }
            for (int64_t j = 0; j < len; j++) {
                const uint16_t *kr = k_cache + (sl[j] * nkv + kh) * d;
                /* a request's slots are scattered over the pool: fetch keys ahead, values for pass 2 */
                if (j + 6 < len) {
                    const char *kn = (const char *)(k_cache + (sl[j + 6] * nkv + kh) * d);
                    for (int64_t c = 0; c < d * 2; c += 64) _mm_prefetch(kn + c, _MM_HINT_T0);
                }
                const char *vn = (const char *)(v_cache + (sl[j] * nkv + kh) * d);
                for (int64_t c = 0; c < d * 2; c += 64) _mm_prefetch(vn + c, _MM_HINT_T1);
                __m512bh kv[8];
                for (int64_t v = 0; v < nv; v++) kv[v] = (__m512bh)_mm512_loadu_si512(kr + 32 * v);
                for (int64_t g = 0; g < grp; g++) {
                    __m512 a = _mm512_setzero_ps();
                    for (int64_t v = 0; v < nv; v++) a = _mm512_dpbf16_ps(a, qv[g][v], kv[v]);
                    float s = _mm512_reduce_add_ps(a) * scale;
                    sc[g * len + j] = s;
                    if (s > mx[g]) mx[g] = s;
                }
            }
            for (int64_t g = 0; g < grp; g++) {
                sum[g] = 0.f;
                for (int64_t j = 0; j < len; j++) {
                    float e = fast_expf(sc[g * len + j] - mx[g]);
                    sc[g * len + j] = e;
                    sum[g] += e;
                }
                for (int64_t v = 0; v < 2 * nv; v++) acc[g][v] = _mm512_setzero_ps();
            }
            for (int64_t j = 0; j < len; j++) {
                const uint16_t *vr = v_cache + (sl[j] * nkv + kh) * d;
                __m512 vf[16];
                for (int64_t v = 0; v < 2 * nv; v++)
                    vf[v] = _mm512_castsi512_ps(_mm512_slli_epi32(
                        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vr + 16 * v))), 16));
                for (int64_t g = 0; g < grp; g++) {
                    __m512 pj = _mm512_set1_ps(sc[g * len + j]);
                    for (int64_t v = 0; v < 2 * nv; v++) acc[g][v] = _mm512_fmadd_ps(pj, vf[v], acc[g][v]);
                }
            }
            for (int64_t g = 0; g < grp; g++) {
                int64_t hd = kh * grp + g;
                float inv = len > 0 ? 1.0f / sum[g] : 0.f;
                float o[256];
                for (int64_t v = 0; v < 2 * nv; v++) _mm512_storeu_ps(o + 16 * v, _mm512_mul_ps(acc[g][v], _mm512_set1_ps(inv)));
                for (int64_t i = 0; i < d; i++) {
                    if (out_f) out_f[(orow[b] * nh + hd) * d + i] = o[i];
                    else out_t[(orow[b] * nh + hd) * d + i] = f32_to_bf16(o[i]);
                }
                if (lse) lse[orow[b] * nh + hd] = len > 0 ? mx[g] + logf(sum[g]) : -INFINITY;
            }
        }
    }
    }
    free(sc_all);
    return 1;
}
#define FAST_DECODE_bf16(...) if (decode_attn_bf16_avx512(__VA_ARGS__)) return;
#else
#define FAST_DECODE_bf16(...)
#endif
#define FAST_DECODE_f32(...)

#define DEFINE_KERNELS(SUF, T)                                                                          \
/* out[r] = w * T(x[r] * rsqrt(mean(x[r]^2) + eps)) over rows r < n of width h (HF LlamaRMSNorm).   \
 * With res != NULL first res[r] = T(res[r] + x[r]) and the norm is taken of the new res[r].       \
 * x, res, out: rows x_stride / res_stride / out_stride elements apart; w [h]. */                    \
void rms_norm_##SUF(const T *x, int64_t x_stride, T *res, int64_t res_stride, const T *w, T *out,    \
                    int64_t out_stride, int64_t n, int64_t h, float eps) {                          \
    _Pragma("omp parallel for if (n * h >= PAR_MIN_WORK)")                                            \
    for (int64_t r = 0; r < n; r++) {                                                                 \
        float buf[h];                                                                                 \
        const T *xr = x + r * x_stride;                                                               \
        T *outr = out + r * out_stride;                                                               \
        float ss[16] = {0};                                                                           \
        if (res) {                                                                                    \
            T *rr = res + r * res_stride;                                                             \
            for (int64_t i = 0; i < h; i++) {                                                         \
                float v = RD_##SUF(LD_##SUF(rr + i) + LD_##SUF(xr + i));                              \
                ST_##SUF(rr + i, v);                                                                  \
                buf[i] = v;                                                                           \
            }                                                                                         \
        } else {                                                                                      \
            for (int64_t i = 0; i < h; i++) buf[i] = LD_##SUF(xr + i);                                \
        }                                                                                             \
        int64_t i = 0;                                                                                \
        for (; i + 16 <= h; i += 16)                                                                  \
            for (int l = 0; l < 16; l++) ss[l] += buf[i + l] * buf[i + l];                            \
        for (; i < h; i++) ss[0] += buf[i] * buf[i];                                                  \
        float s = 0.f;                                                                                \
        for (int l = 0; l < 16; l++) s += ss[l];                                                      \
        float inv = 1.0f / sqrtf(s / (float)h + eps);                                                 \
        for (i = 0; i < h; i++) ST_##SUF(outr + i, LD_##SUF(w + i) * RD_##SUF(buf[i] * inv));         \
    }                                                                                                 \
}                                                                                                     \
                                                                                                      \
/* In place, rotate-half rotary embedding (HF apply_rotary_pos_emb) of n rows x nh heads x d:         \
 * x <- T(T(x * c) + T(rotate_half(x) * s)), c = T(cos[pos]), s = T(sin[pos]) from float32 tables    \
 * [*, d]; row r starts at x + r * x_stride, heads are d apart. */                                    \
void rope_##SUF(T *x, int64_t x_stride, const int64_t *pos, const float *cos_t, const float *sin_t,   \
                int64_t n, int64_t nh, int64_t d) {                                                   \
    int64_t half = d / 2;                                                                             \
    _Pragma("omp parallel for if (n * nh * d >= PAR_MIN_WORK)")                                       \
    for (int64_t r = 0; r < n; r++) {                                                                 \
        float c[d], s[d], v[d];                                                                       \
        const float *cr = cos_t + pos[r] * d, *sr = sin_t + pos[r] * d;                               \
        for (int64_t i = 0; i < d; i++) { c[i] = RD_##SUF(cr[i]); s[i] = RD_##SUF(sr[i]); }           \
        for (int64_t hd = 0; hd < nh; hd++) {                                                         \
            T *xh = x + r * x_stride + hd * d;                                                        \
            for (int64_t i = 0; i < d; i++) v[i] = LD_##SUF(xh + i);                                  \
            for (int64_t i = 0; i < half; i++)                                                        \
                ST_##SUF(xh + i, RD_##SUF(v[i] * c[i]) + RD_##SUF(-v[i + half] * s[i]));              \
            for (int64_t i = half; i < d; i++)                                                        \
                ST_##SUF(xh + i, RD_##SUF(v[i] * c[i]) + RD_##SUF(v[i - half] * s[i]));               \
        }                                                                                             \
    }                                                                                                 \
}                                                                                                     \
                                                                                                      \
/* out[r, i] = T(T(silu(g)) * u), g = gu[r, i], u = gu[r, m + i] (SwiGLU on a fused gate|up row).    \
 * gu [n, 2m] and out [n, m], contiguous. */                                                          \
void silu_mul_##SUF(const T *gu, T *out, int64_t n, int64_t m) {                                      \
    _Pragma("omp parallel for if (n * m >= PAR_MIN_WORK)")                                           \
    for (int64_t r = 0; r < n; r++) {                                                                 \
        const T *g = gu + r * 2 * m, *u = g + m;                                                      \
        T *o = out + r * m;                                                                           \
        for (int64_t i = 0; i < m; i++) {                                                             \
            float gv = LD_##SUF(g + i);                                                               \
            ST_##SUF(o + i, RD_##SUF(gv / (1.0f + fast_expf(-gv))) * LD_##SUF(u + i));                     \
        }                                                                                             \
    }                                                                                                 \
}                                                                                                     \
                                                                                                      \
/* cache[slots[r]] = src[r] for n rows of `width` elements; src rows src_stride apart. */            \
void kv_write_##SUF(T *cache, const T *src, int64_t src_stride, const int64_t *slots, int64_t n,      \
                    int64_t width) {                                                                  \
    for (int64_t r = 0; r < n; r++) memcpy(cache + slots[r] * width, src + r * src_stride, width * sizeof(T)); \
}                                                                                                     \
                                                                                                      \
/* Attention of one query row per request against that request's keys in the KV pool (decode).      \
 * Request b: query row q + qrow[b] * q_stride ([nh, d]); keys/values k_cache/v_cache[slots[j]]       \
 * ([nkv, d] each) for j in [off[b], off[b+1]), all visible; query head hd reads kv head              \
 * hd / (nh / nkv). Softmax in float32 (exact two-pass). Output row orow[b] of out_f ([*, nh, d]      \
 * float32) or out_t (T), whichever is not NULL; lse [*, nh] float32 (natural log) if not NULL. */   \
void decode_attn_##SUF(const T *q, int64_t q_stride, const int64_t *qrow, const T *k_cache,          \
                       const T *v_cache, const int64_t *slots, const int64_t *off, int64_t nb,        \
                       int64_t nh, int64_t nkv, int64_t d, float scale, float *out_f, T *out_t,       \
                       float *lse, const int64_t *orow) {                                            \
    FAST_DECODE_##SUF(q, q_stride, qrow, k_cache, v_cache, slots, off, nb, nh, nkv, d, scale, out_f,  \
                      out_t, lse, orow)                                                               \
    int64_t grp = nh / nkv, max_len = 0;                                                              \
    for (int64_t b = 0; b < nb; b++) if (off[b + 1] - off[b] > max_len) max_len = off[b + 1] - off[b]; \
    int64_t per = grp * (max_len > 0 ? max_len : 1), total = 0;                                        \
    for (int64_t b = 0; b < nb; b++) total += off[b + 1] - off[b];                                    \
    int nt = MAX_THREADS();                                                                           \
    float *sc_all = (float *)malloc(sizeof(float) * (size_t)(per * nt));                              \
    if (!sc_all) return;                                                                              \
    _Pragma("omp parallel if (total * nh * d >= PAR_MIN_WORK)")                                       \
    {                                                                                                 \
    float *sc = sc_all + per * THREAD_ID();                                                           \
    float qf[grp][d], acc[grp][d], kf[d];                                                             \
    _Pragma("omp for schedule(dynamic, 2)")                                                           \
    for (int64_t b = 0; b < nb; b++) {                                                                \
        int64_t len = off[b + 1] - off[b];                                                            \
        const int64_t *sl = slots + off[b];                                                           \
        for (int64_t kh = 0; kh < nkv; kh++) {                                                        \
            for (int64_t g = 0; g < grp; g++)                                                         \
                for (int64_t i = 0; i < d; i++)                                                       \
                    qf[g][i] = LD_##SUF(q + qrow[b] * q_stride + (kh * grp + g) * d + i);             \
            float mx[grp];                                                                            \
            for (int64_t g = 0; g < grp; g++) mx[g] = -INFINITY;                                      \
            for (int64_t j = 0; j < len; j++) {                                                       \
                const T *kr = k_cache + (sl[j] * nkv + kh) * d;                                       \
                for (int64_t i = 0; i < d; i++) kf[i] = LD_##SUF(kr + i);                             \
                for (int64_t g = 0; g < grp; g++) {                                                   \
                    float p[16] = {0};                                                                \
                    int64_t i = 0;                                                                    \
                    for (; i + 16 <= d; i += 16)                                                      \
                        for (int l = 0; l < 16; l++) p[l] += qf[g][i + l] * kf[i + l];               \
                    for (; i < d; i++) p[0] += qf[g][i] * kf[i];                                      \
                    float s = 0.f;                                                                    \
                    for (int l = 0; l < 16; l++) s += p[l];                                           \
                    s *= scale;                                                                       \
                    sc[g * len + j] = s;                                                              \
                    if (s > mx[g]) mx[g] = s;                                                         \
                }                                                                                     \
            }                                                                                         \
            float sum[grp];                                                                           \
            for (int64_t g = 0; g < grp; g++) {                                                       \
                sum[g] = 0.f;                                                                         \
                for (int64_t j = 0; j < len; j++) {                                                   \
                    float e = fast_expf(sc[g * len + j] - mx[g]);                                          \
                    sc[g * len + j] = e;                                                              \
                    sum[g] += e;                                                                      \
                }                                                                                     \
                for (int64_t i = 0; i < d; i++) acc[g][i] = 0.f;                                      \
            }                                                                                         \
            for (int64_t j = 0; j < len; j++) {                                                       \
                const T *vr = v_cache + (sl[j] * nkv + kh) * d;                                       \
                for (int64_t i = 0; i < d; i++) kf[i] = LD_##SUF(vr + i);                             \
                for (int64_t g = 0; g < grp; g++) {                                                   \
                    float pj = sc[g * len + j];                                                       \
                    for (int64_t i = 0; i < d; i++) acc[g][i] += pj * kf[i];                          \
                }                                                                                     \
            }                                                                                         \
            for (int64_t g = 0; g < grp; g++) {                                                       \
                int64_t hd = kh * grp + g;                                                            \
                float inv = len > 0 ? 1.0f / sum[g] : 0.f;                                            \
                for (int64_t i = 0; i < d; i++) {                                                     \
                    float o = acc[g][i] * inv;                                                        \
                    if (out_f) out_f[(orow[b] * nh + hd) * d + i] = o;                                \
                    else ST_##SUF(out_t + (orow[b] * nh + hd) * d + i, o);                            \
                }                                                                                     \
                if (lse) lse[orow[b] * nh + hd] = len > 0 ? mx[g] + logf(sum[g]) : -INFINITY;         \
            }                                                                                         \
        }                                                                                             \
    }                                                                                                 \
    }                                                                                                 \
    free(sc_all);                                                                                     \
}                                                                                                     \
                                                                                                      \
/* Merge partial attention results (log-sum-exp weighting; Hydragen / FlashInfer merge_state):        \
 * for i < n and each head, row dst[i] of (out [*, nh, d] float32, lse [*, nh]) absorbs row src[i]    \
 * of (o [*, nh, d] T, l [*, nh] float32). A row with lse -inf holds nothing yet. */                  \
void merge_##SUF(float *out, float *lse, const T *o, const float *l, const int64_t *src,              \
                 const int64_t *dst, int64_t n, int64_t nh, int64_t d) {                              \
    _Pragma("omp parallel for if (n * nh * d >= PAR_MIN_WORK)")                                      \
    for (int64_t i = 0; i < n; i++) {                                                                 \
        for (int64_t hd = 0; hd < nh; hd++) {                                                         \
            float *ol = lse + dst[i] * nh + hd, nl = l[src[i] * nh + hd];                             \
            float *orow_ = out + (dst[i] * nh + hd) * d;                                              \
            const T *nrow = o + (src[i] * nh + hd) * d;                                               \
            if (nl == -INFINITY) continue;                                                            \
            if (*ol == -INFINITY) {                                                                   \
                for (int64_t j = 0; j < d; j++) orow_[j] = LD_##SUF(nrow + j);                        \
                *ol = nl;                                                                             \
                continue;                                                                             \
            }                                                                                         \
            float m = *ol > nl ? *ol : nl;                                                            \
            float w1 = expf(*ol - m), w2 = expf(nl - m), s = w1 + w2;                                 \
            for (int64_t j = 0; j < d; j++) orow_[j] = (orow_[j] * w1 + LD_##SUF(nrow + j) * w2) / s;  \
            *ol = m + logf(s);                                                                        \
        }                                                                                             \
    }                                                                                                 \
}

DEFINE_KERNELS(f32, float)
DEFINE_KERNELS(bf16, uint16_t)
