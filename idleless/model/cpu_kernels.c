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
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* Scratch memory kept by the calling thread from call to call, one region per SCRATCH_* user: per-call
 * buffers malloc'd and freed per layer made glibc hand memory back and take it again (heap trims: TLB
 * shootdowns to the other OpenMP thread, then page faults zeroing it; a W8A8 decode step took 4x its time
 * that way once the int8 attention's buffer moved the heap's top). At least `bytes` long, 64-byte aligned;
 * NULL if it cannot grow. Freed when the thread exits (a pthread key's destructor), or after a call that
 * left it over SCRATCH_KEEP (scratch_trim). */
enum { SCRATCH_K8, SCRATCH_W8A8, SCRATCH_CA, SCRATCH_CA_TASKS, SCRATCH_N };
static __thread void *scratch_mem[SCRATCH_N];
static __thread size_t scratch_cap[SCRATCH_N];
static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static void scratch_free(void *mem) { /* at a thread's exit: its regions (mem: its scratch_mem) */
    for (int i = 0; i < SCRATCH_N; i++) free(((void **)mem)[i]);
}
static void scratch_key_init(void) { pthread_key_create(&scratch_key, scratch_free); }
static void *scratch(int slot, size_t bytes) {
    if (bytes > scratch_cap[slot]) {
        pthread_once(&scratch_once, scratch_key_init);
        pthread_setspecific(scratch_key, scratch_mem);
        free(scratch_mem[slot]);
        size_t cap = (bytes + bytes / 4 + 63) / 64 * 64;
        scratch_mem[slot] = aligned_alloc(64, cap);
        scratch_cap[slot] = scratch_mem[slot] ? cap : 0;
    }
    return scratch_mem[slot];
}
/* a region larger than this is given back after its call (a huge batch's int8 keys are not held for good) */
#define SCRATCH_KEEP ((size_t)64 << 20)
static void scratch_trim(int slot) {
    if (scratch_cap[slot] > SCRATCH_KEEP) {
        free(scratch_mem[slot]);
        scratch_mem[slot] = NULL;
        scratch_cap[slot] = 0;
    }
}

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

/* ---- AVX2 helpers of the glue kernels (rms_norm, rope, silu_mul) ----------------------------------
 * Each helper does the leading multiple of 8 elements of a row with the same IEEE operations, in the
 * same order, as the scalar loop that follows it in the kernel (which finishes the row, and is all there
 * is in a build without AVX2): so AVX2, AVX-512 and portable builds give the same bits. v_exp is
 * fast_expf lane by lane (the same clamps, reduction, polynomial and scaling, no FMA contraction). */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
static inline __m256 v_ld_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 v_ld_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline __m256i v_bf16_bits(__m256 v) { /* f32_to_bf16 in the high half of each lane */
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
    return _mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u));
}
static inline void v_st_f32(float *p, __m256 v) { _mm256_storeu_ps(p, v); }
static inline void v_st_bf16(uint16_t *p, __m256 v) {
    __m256i h = _mm256_srli_epi32(v_bf16_bits(v), 16);
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    _mm_storeu_si128((__m128i *)p, packed);
}
static inline __m256 v_rd_f32(__m256 v) { return v; }
static inline __m256 v_rd_bf16(__m256 v) { return _mm256_castsi256_ps(v_bf16_bits(v)); }
/* 8 x 8 transpose of float32 rows r[0..8) in place */
static inline void transpose8_ps(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}
static inline __m256 v_exp(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.33654f), hi = _mm256_set1_ps(88.72283f);
    __m256 below = _mm256_cmp_ps(x, lo, _CMP_LT_OQ), above = _mm256_cmp_ps(x, hi, _CMP_GT_OQ);
    __m256 xc = _mm256_blendv_ps(_mm256_blendv_ps(x, hi, above), lo, below);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(_mm256_sub_ps(xc, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f))),
                             _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.f / 5040);
    const float c[7] = {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};
    for (int i = 0; i < 7; i++) p = _mm256_add_ps(_mm256_set1_ps(c[i]), _mm256_mul_ps(f, p));
    __m256i e = _mm256_max_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), _mm256_set1_epi32(1));
    __m256 r = _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
    r = _mm256_blendv_ps(r, _mm256_setzero_ps(), below);
    r = _mm256_blendv_ps(r, _mm256_set1_ps(INFINITY), above);
    return _mm256_blendv_ps(r, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}
/* ss[l] += buf[i + l]^2 over the leading multiple of 16 of h, l < 16 (as rms_norm's scalar lanes) */
static inline int64_t glue_sumsq(const float *buf, int64_t h, float *ss) {
    __m256 a = _mm256_loadu_ps(ss), b = _mm256_loadu_ps(ss + 8);
    int64_t i = 0;
    for (; i + 16 <= h; i += 16) {
        __m256 x0 = _mm256_loadu_ps(buf + i), x1 = _mm256_loadu_ps(buf + i + 8);
        a = _mm256_add_ps(a, _mm256_mul_ps(x0, x0));
        b = _mm256_add_ps(b, _mm256_mul_ps(x1, x1));
    }
    _mm256_storeu_ps(ss, a);
    _mm256_storeu_ps(ss + 8, b);
    return i;
}
#define DEFINE_GLUE_SIMD(SUF, T)                                                                        \
/* buf[i] = T(res[i] + x[i]), stored back into res */                                                  \
static inline int64_t glue_add_##SUF(const T *x, T *res, float *buf, int64_t h) {                      \
    int64_t i = 0;                                                                                     \
    for (; i + 8 <= h; i += 8) {                                                                       \
        __m256 v = v_rd_##SUF(_mm256_add_ps(v_ld_##SUF(res + i), v_ld_##SUF(x + i)));                  \
        v_st_##SUF(res + i, v);                                                                        \
        _mm256_storeu_ps(buf + i, v);                                                                  \
    }                                                                                                  \
    return i;                                                                                          \
}                                                                                                      \
static inline int64_t glue_load_##SUF(const T *x, float *buf, int64_t h) {                             \
    int64_t i = 0;                                                                                     \
    for (; i + 8 <= h; i += 8) _mm256_storeu_ps(buf + i, v_ld_##SUF(x + i));                          \
    return i;                                                                                          \
}                                                                                                      \
/* out[i] = T(w[i] * T(buf[i] * inv)) */                                                               \
static inline int64_t glue_scale_##SUF(const float *buf, const T *w, float inv, T *out, int64_t h) {    \
    int64_t i = 0;                                                                                     \
    __m256 vi = _mm256_set1_ps(inv);                                                                   \
    for (; i + 8 <= h; i += 8)                                                                         \
        v_st_##SUF(out + i, _mm256_mul_ps(v_ld_##SUF(w + i), v_rd_##SUF(_mm256_mul_ps(_mm256_loadu_ps(buf + i), vi)))); \
    return i;                                                                                          \
}                                                                                                      \
/* dst[i] = T(src[i]) for float32 src (the rope tables) */                                             \
static inline int64_t glue_round_##SUF(const float *src, float *dst, int64_t n) {                      \
    int64_t i = 0;                                                                                     \
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, v_rd_##SUF(_mm256_loadu_ps(src + i)));        \
    return i;                                                                                          \
}                                                                                                      \
/* the pairs (i, i + half) of one head: x[i] <- T(x[i] c[i]) + T(-x[i+half] s[i]), x[i+half] <-        \
 * T(x[i+half] c[i+half]) + T(x[i] s[i+half]), both from the values before the call */                 \
static inline int64_t glue_rope_##SUF(T *xh, const float *c, const float *s, int64_t half) {           \
    int64_t i = 0;                                                                                     \
    const __m256 neg = _mm256_set1_ps(-0.f);                                                           \
    for (; i + 8 <= half; i += 8) {                                                                    \
        __m256 a = v_ld_##SUF(xh + i), b = v_ld_##SUF(xh + half + i);                                  \
        __m256 lo = _mm256_add_ps(v_rd_##SUF(_mm256_mul_ps(a, _mm256_loadu_ps(c + i))),               \
                                  v_rd_##SUF(_mm256_mul_ps(_mm256_xor_ps(b, neg), _mm256_loadu_ps(s + i)))); \
        __m256 hi = _mm256_add_ps(v_rd_##SUF(_mm256_mul_ps(b, _mm256_loadu_ps(c + half + i))),        \
                                  v_rd_##SUF(_mm256_mul_ps(a, _mm256_loadu_ps(s + half + i))));        \
        v_st_##SUF(xh + i, lo);                                                                        \
        v_st_##SUF(xh + half + i, hi);                                                                 \
    }                                                                                                  \
    return i;                                                                                          \
}                                                                                                      \
/* o[i] = T(T(g / (1 + exp(-g))) * u) */                                                               \
static inline int64_t glue_silu_mul_##SUF(const T *g, const T *u, T *o, int64_t m) {                   \
    int64_t i = 0;                                                                                     \
    const __m256 one = _mm256_set1_ps(1.f), neg = _mm256_set1_ps(-0.f);                                \
    for (; i + 8 <= m; i += 8) {                                                                       \
        __m256 gv = v_ld_##SUF(g + i);                                                                 \
        __m256 sv = _mm256_div_ps(gv, _mm256_add_ps(one, v_exp(_mm256_xor_ps(gv, neg))));              \
        v_st_##SUF(o + i, _mm256_mul_ps(v_rd_##SUF(sv), v_ld_##SUF(u + i)));                           \
    }                                                                                                  \
    return i;                                                                                          \
}
#else
static inline int64_t glue_sumsq(const float *buf, int64_t h, float *ss) { return 0; }
#define DEFINE_GLUE_SIMD(SUF, T)                                                                        \
static inline int64_t glue_add_##SUF(const T *x, T *res, float *buf, int64_t h) { return 0; }          \
static inline int64_t glue_load_##SUF(const T *x, float *buf, int64_t h) { return 0; }                 \
static inline int64_t glue_scale_##SUF(const float *buf, const T *w, float inv, T *out, int64_t h) { return 0; } \
static inline int64_t glue_round_##SUF(const float *src, float *dst, int64_t n) { return 0; }          \
static inline int64_t glue_rope_##SUF(T *xh, const float *c, const float *s, int64_t half) { return 0; } \
static inline int64_t glue_silu_mul_##SUF(const T *g, const T *u, T *o, int64_t m) { return 0; }
#endif

/* ---- SwiGLU on bfloat16 by table ------------------------------------------------------------------
 * silu of a bfloat16 gate, rounded to bfloat16, is a function of the gate's 16 bits: silu_tab_bf16 holds
 * it for all 65536 of them, computed at load (about a millisecond) by the scalar formula of silu_mul, so
 * silu_mul_bf16 = T(tab[g] * u) gives the bits of that formula (and of the AVX2 loop, which gives its
 * bits) at a lookup per element instead of an exp and a division. */
static float silu_tab_bf16[65536];
__attribute__((constructor)) static void silu_tab_init(void) {
    for (uint32_t b = 0; b < 65536; b++) {
        float gv = bf16_to_f32((uint16_t)b);
        silu_tab_bf16[b] = RD_bf16(gv / (1.0f + fast_expf(-gv)));
    }
}
#if defined(__AVX512F__)
static inline __m512 v16_ld_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline __m512 v16_ld_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline void v16_st_f32(float *p, __m512 v) { _mm512_storeu_ps(p, v); }
static inline __m512 v16_rd_f32(__m512 v) { return v; }
static inline __m512 v16_rd_bf16(__m512 v) { /* rounded to bfloat16 as f32_to_bf16, back in float32 */
    __m512i u = _mm512_castps_si512(v);
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                 _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
    __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)));
}
static inline void v16_st_bf16(uint16_t *p, __m512 v) { /* f32_to_bf16 per lane (nearest even, NaN kept quiet) */
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v16_rd_bf16(v)), 16)));
}
/* rms_norm's row passes on 16 lanes, over the leading multiple of 16 of a row (the returned count; the AVX2
 * helpers and the scalar loops finish it): the same IEEE operations in the same order, so the same bits.
 * norm512_in: buf[i] = T(res[i] + x[i]) also written to res (res != NULL), else x[i], and in the same pass
 * ss[l] += buf[i]^2 for lane l = i % 16 (the sum of squares' lanes). norm512_out: out[i] = T(w[i] * T(buf[i] * inv)). */
#define DEFINE_NORM512(SUF, T)                                                                          \
static inline int64_t norm512_in_##SUF(const T *x, T *res, float *buf, int64_t h, float *ss) {         \
    __m512 acc = _mm512_loadu_ps(ss);                                                                  \
    int64_t i = 0;                                                                                     \
    for (; i + 16 <= h; i += 16) {                                                                     \
        __m512 v = v16_ld_##SUF(x + i);                                                               \
        if (res) {                                                                                     \
            v = v16_rd_##SUF(_mm512_add_ps(v16_ld_##SUF(res + i), v));                                \
            v16_st_##SUF(res + i, v);                                                                 \
        }                                                                                              \
        _mm512_storeu_ps(buf + i, v);                                                                  \
        acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));                                                 \
    }                                                                                                  \
    _mm512_storeu_ps(ss, acc);                                                                         \
    return i;                                                                                          \
}                                                                                                      \
static inline int64_t norm512_out_##SUF(const float *buf, const T *w, float inv, T *out, int64_t h) {  \
    const __m512 vi = _mm512_set1_ps(inv);                                                             \
    int64_t i = 0;                                                                                     \
    for (; i + 16 <= h; i += 16)                                                                       \
        v16_st_##SUF(out + i, _mm512_mul_ps(v16_ld_##SUF(w + i), v16_rd_##SUF(_mm512_mul_ps(_mm512_loadu_ps(buf + i), vi)))); \
    return i;                                                                                          \
}
#else
#define DEFINE_NORM512(SUF, T)                                                                          \
static inline int64_t norm512_in_##SUF(const T *x, T *res, float *buf, int64_t h, float *ss) { return 0; } \
static inline int64_t norm512_out_##SUF(const float *buf, const T *w, float inv, T *out, int64_t h) { return 0; }
#endif
DEFINE_NORM512(f32, float)
DEFINE_NORM512(bf16, uint16_t)
/* o[i] = T(tab[g[i]] * u[i]) for i < m (all of the row): returns m */
static inline int64_t silu_tab_mul_bf16(const uint16_t *g, const uint16_t *u, uint16_t *o, int64_t m) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= m; i += 16) {
        __m512i gi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(g + i)));
        v16_st_bf16(o + i, _mm512_mul_ps(_mm512_i32gather_ps(gi, silu_tab_bf16, 4), v16_ld_bf16(u + i)));
    }
#endif
    for (; i < m; i++) o[i] = f32_to_bf16(silu_tab_bf16[g[i]] * bf16_to_f32(u[i]));
    return i;
}
#define SILU_MUL_FAST_f32 glue_silu_mul_f32
#define SILU_MUL_FAST_bf16 silu_tab_mul_bf16
DEFINE_GLUE_SIMD(f32, float)
DEFINE_GLUE_SIMD(bf16, uint16_t)

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
#define FAST_DECODE_bf16(...) if (decode_attn_bf16_avx512(__VA_ARGS__)) return; FAST_DECODE_AVX2_bf16(__VA_ARGS__)
#else
#define FAST_DECODE_bf16(...) FAST_DECODE_AVX2_bf16(__VA_ARGS__)
#endif
/* decode attention's last step for one (request, KV head): query head kh * grp + g writes output row orow,
 * acc[g] / sum[g] (zeros without keys), and its log-sum-exp mx[g] + log(sum[g]) (-inf without keys);
 * acc [grp][d] */
#define DEFINE_DEC_OUT(SUF, T)                                                                          \
static inline void dec_out_##SUF(int64_t grp, int64_t d, const float *acc, const float *mx, const float *sum, \
                                 int64_t len, int64_t kh, int64_t nh, int64_t orow, float *out_f, T *out_t, \
                                 float *lse) {                                                          \
    for (int64_t g = 0; g < grp; g++) {                                                                 \
        int64_t hd = kh * grp + g;                                                                      \
        float inv = len > 0 ? 1.0f / sum[g] : 0.f;                                                      \
        for (int64_t i = 0; i < d; i++) {                                                               \
            float o = acc[g * d + i] * inv;                                                             \
            if (out_f) out_f[(orow * nh + hd) * d + i] = o;                                             \
            else ST_##SUF(out_t + (orow * nh + hd) * d + i, o);                                         \
        }                                                                                               \
        if (lse) lse[orow * nh + hd] = len > 0 ? mx[g] + logf(sum[g]) : -INFINITY;                      \
    }                                                                                                   \
}
DEFINE_DEC_OUT(f32, float)
DEFINE_DEC_OUT(bf16, uint16_t)

#if defined(__AVX2__) && defined(__FMA__)
/* decode_attn (and decode_attn_q8) on AVX2 with the scalar kernels' IEEE operations in their order (so every
 * build gives the same bits): q.k for 8 keys at once, lane = key (8 K rows transposed 8 x 8 into kt), the
 * scalar code's 16 partial sums p[l] each a vector over the keys, added up in the scalar order, times the
 * key's factor (the softmax scale; with an 8-bit pool the key's K scale times it, as the scalar kernel
 * forms it); the running maximum and the softmax sum taken key by key as there; exp by v_exp (fast_expf
 * per lane); p.v 8 dimensions at a time. An 8-bit pool (q8: lut non-NULL) is read through its 256-entry
 * table (a gather), V's scale folded into each key's weight as the scalar kernel does. Work items are
 * (request, KV head). Returns 0 (the scalar kernel runs) for d not a multiple of 16 or above 256, more
 * than 16 query heads per KV head, or no memory. */
static inline __m256 dec_row8(const void *cache, int64_t at, const float *lut, int bf16) {
    if (lut) return _mm256_i32gather_ps(lut, _mm256_cvtepu8_epi32(_mm_loadl_epi64(
                                            (const __m128i *)((const uint8_t *)cache + at))), 4);
    return bf16 ? v_ld_bf16((const uint16_t *)cache + at) : v_ld_f32((const float *)cache + at);
}
static inline float dec_one(const void *cache, int64_t at, const float *lut, int bf16) {
    if (lut) return lut[((const uint8_t *)cache)[at]];
    return bf16 ? bf16_to_f32(((const uint16_t *)cache)[at]) : ((const float *)cache)[at];
}
/* prefetch the nbytes bytes from element index at of a cache whose elements take esz bytes */
#define dec_prefetch(cache, at, esz, nbytes) do { const char *p_ = (const char *)(cache) + (at) * (esz); \
    for (int64_t o_ = 0; o_ < (nbytes); o_ += 64) _mm_prefetch(p_ + o_, _MM_HINT_T0); } while (0)
#define DEFINE_DECODE_AVX2(SUF, T, BF16)                                                                \
static inline __attribute__((always_inline)) int decode_avx2_core_##SUF(                               \
        const T *q, int64_t q_stride, const int64_t *qrow, const void *k_cache, const void *v_cache,    \
        const float *k_scale, const float *v_scale, int64_t ss, const float *lut, const int64_t *slots, \
        const int64_t *off, int64_t nb, int64_t nh, int64_t nkv, int64_t d, float scale, float *out_f,  \
        T *out_t, float *lse, const int64_t *orow) {                                                    \
    int64_t grp = nh / nkv, max_len = 0, total = 0;                                                     \
    const int64_t esz = lut ? 1 : (int64_t)sizeof(T);                                                    \
    if (d % 16 || d > 256 || grp > 16 || grp < 1) return 0;                                              \
    for (int64_t b = 0; b < nb; b++) {                                                                  \
        int64_t len = off[b + 1] - off[b];                                                              \
        if (len > max_len) max_len = len;                                                               \
        total += len;                                                                                   \
    }                                                                                                   \
    int64_t per = grp * (max_len > 0 ? max_len : 1);                                                    \
    float *sc_all = (float *)malloc(sizeof(float) * (size_t)(per * MAX_THREADS()));                    \
    if (!sc_all) return 0;                                                                              \
    _Pragma("omp parallel if (total * nh * d >= PAR_MIN_WORK)")                                         \
    {                                                                                                   \
    float *sc = sc_all + per * THREAD_ID();                                                             \
    float qf[grp][d], acc[grp][d], kt[d][8], mx[grp], sum[grp];                                         \
    _Pragma("omp for schedule(dynamic, 1)")                                                             \
    for (int64_t it = 0; it < nb * nkv; it++) {                                                         \
        int64_t b = it / nkv, kh = it % nkv, len = off[b + 1] - off[b];                                  \
        const int64_t *sl = slots + off[b];                                                             \
        for (int64_t g = 0; g < grp; g++) {                                                             \
            for (int64_t i = 0; i < d; i++) qf[g][i] = LD_##SUF(q + qrow[b] * q_stride + (kh * grp + g) * d + i); \
            mx[g] = -INFINITY;                                                                          \
        }                                                                                               \
        int64_t j = 0;                                                                                  \
        for (; j + 8 <= len; j += 8) {                                                                  \
            float kf8[8];                                                                               \
            for (int r = 0; r < 8; r++) kf8[r] = k_scale ? k_scale[sl[j + r] * ss + kh] * scale : scale; \
            for (int r = 0; r < 8; r++) { /* the next 8 keys' K rows and these 8 keys' V rows, into cache */ \
                if (j + 8 + r < len) dec_prefetch(k_cache, (sl[j + 8 + r] * nkv + kh) * d, esz, d * esz); \
                dec_prefetch(v_cache, (sl[j + r] * nkv + kh) * d, esz, d * esz);                        \
            }                                                                                           \
            for (int64_t c = 0; c < d; c += 8) {                                                        \
                __m256 x[8];                                                                            \
                for (int r = 0; r < 8; r++) x[r] = dec_row8(k_cache, (sl[j + r] * nkv + kh) * d + c, lut, BF16); \
                transpose8_ps(x);                                                                       \
                for (int r = 0; r < 8; r++) _mm256_storeu_ps(kt[c + r], x[r]);                          \
            }                                                                                           \
            for (int64_t g = 0; g < grp; g++) {                                                         \
                /* the 16 partial sums in two passes of 8 (16 accumulators would not fit the 16 ymm   \
                 * registers), each over the dims in order; then their sum in the scalar order */      \
                __m256 p[16];                                                                           \
                for (int h = 0; h < 16; h += 8) {                                                       \
                    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0; \
                    for (int64_t i = h; i < d; i += 16) {                                               \
                        const float *qg = qf[g] + i;                                                    \
                        a0 = _mm256_add_ps(a0, _mm256_mul_ps(_mm256_set1_ps(qg[0]), _mm256_loadu_ps(kt[i])));     \
                        a1 = _mm256_add_ps(a1, _mm256_mul_ps(_mm256_set1_ps(qg[1]), _mm256_loadu_ps(kt[i + 1]))); \
                        a2 = _mm256_add_ps(a2, _mm256_mul_ps(_mm256_set1_ps(qg[2]), _mm256_loadu_ps(kt[i + 2]))); \
                        a3 = _mm256_add_ps(a3, _mm256_mul_ps(_mm256_set1_ps(qg[3]), _mm256_loadu_ps(kt[i + 3]))); \
                        a4 = _mm256_add_ps(a4, _mm256_mul_ps(_mm256_set1_ps(qg[4]), _mm256_loadu_ps(kt[i + 4]))); \
                        a5 = _mm256_add_ps(a5, _mm256_mul_ps(_mm256_set1_ps(qg[5]), _mm256_loadu_ps(kt[i + 5]))); \
                        a6 = _mm256_add_ps(a6, _mm256_mul_ps(_mm256_set1_ps(qg[6]), _mm256_loadu_ps(kt[i + 6]))); \
                        a7 = _mm256_add_ps(a7, _mm256_mul_ps(_mm256_set1_ps(qg[7]), _mm256_loadu_ps(kt[i + 7]))); \
                    }                                                                                   \
                    p[h] = a0; p[h + 1] = a1; p[h + 2] = a2; p[h + 3] = a3;                             \
                    p[h + 4] = a4; p[h + 5] = a5; p[h + 6] = a6; p[h + 7] = a7;                         \
                }                                                                                       \
                __m256 s = _mm256_setzero_ps();                                                         \
                for (int l = 0; l < 16; l++) s = _mm256_add_ps(s, p[l]);                                \
                s = _mm256_mul_ps(s, _mm256_loadu_ps(kf8));                                             \
                float *sg = sc + g * len + j;                                                           \
                _mm256_storeu_ps(sg, s);                                                                \
                for (int r = 0; r < 8; r++) if (sg[r] > mx[g]) mx[g] = sg[r];                           \
            }                                                                                           \
        }                                                                                               \
        for (; j < len; j++) { /* the last keys as the scalar kernels do them */                       \
            float kf[d];                                                                                \
            int64_t at = (sl[j] * nkv + kh) * d;                                                        \
            for (int64_t i = 0; i < d; i++) kf[i] = dec_one(k_cache, at + i, lut, BF16);                \
            float ks = k_scale ? k_scale[sl[j] * ss + kh] * scale : scale;                              \
            for (int64_t g = 0; g < grp; g++) {                                                         \
                float p[16] = {0};                                                                      \
                for (int64_t i = 0; i < d; i += 16)                                                     \
                    for (int l = 0; l < 16; l++) p[l] += qf[g][i + l] * kf[i + l];                     \
                float s = 0.f;                                                                          \
                for (int l = 0; l < 16; l++) s += p[l];                                                 \
                s *= ks;                                                                                \
                sc[g * len + j] = s;                                                                    \
                if (s > mx[g]) mx[g] = s;                                                               \
            }                                                                                           \
        }                                                                                               \
        for (int64_t g = 0; g < grp; g++) {                                                             \
            float *sg = sc + g * len, tot = 0.f;                                                        \
            __m256 m8 = _mm256_set1_ps(mx[g]);                                                          \
            int64_t jj = 0;                                                                             \
            for (; jj + 8 <= len; jj += 8) {                                                            \
                _mm256_storeu_ps(sg + jj, v_exp(_mm256_sub_ps(_mm256_loadu_ps(sg + jj), m8)));          \
                for (int r = 0; r < 8; r++) tot += sg[jj + r];                                          \
            }                                                                                           \
            for (; jj < len; jj++) {                                                                    \
                sg[jj] = fast_expf(sg[jj] - mx[g]);                                                     \
                tot += sg[jj];                                                                          \
            }                                                                                           \
            sum[g] = tot;                                                                               \
        }                                                                                               \
        /* p.v: for 8 dims and up to 4 query heads at a time, the keys in order into registers */       \
        if (v_scale && ss) /* per-slot V scales: in each key's weight; per-head (ss 0): in the output */ \
            for (int64_t g = 0; g < grp; g++)                                                           \
                for (j = 0; j < len; j++) sc[g * len + j] *= v_scale[sl[j] * ss + kh];                  \
        for (int64_t c = 0; c < d; c += 16)                                                             \
            for (int64_t g0 = 0; g0 < grp; g0 += 3) {                                                   \
                int64_t ng = grp - g0 < 3 ? grp - g0 : 3;                                               \
                const float *s0 = sc + g0 * len, *s1 = s0 + (ng > 1 ? len : 0);                         \
                const float *s2 = s0 + (ng > 2 ? 2 * len : 0);                                          \
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, b0 = a0, b1 = a0, b2 = a0;           \
                for (j = 0; j < len; j++) {                                                             \
                    int64_t at = (sl[j] * nkv + kh) * d + c;                                            \
                    __m256 va = dec_row8(v_cache, at, lut, BF16), vb = dec_row8(v_cache, at + 8, lut, BF16); \
                    __m256 w0 = _mm256_set1_ps(s0[j]), w1 = _mm256_set1_ps(s1[j]), w2 = _mm256_set1_ps(s2[j]); \
                    a0 = _mm256_add_ps(a0, _mm256_mul_ps(w0, va)); b0 = _mm256_add_ps(b0, _mm256_mul_ps(w0, vb)); \
                    a1 = _mm256_add_ps(a1, _mm256_mul_ps(w1, va)); b1 = _mm256_add_ps(b1, _mm256_mul_ps(w1, vb)); \
                    a2 = _mm256_add_ps(a2, _mm256_mul_ps(w2, va)); b2 = _mm256_add_ps(b2, _mm256_mul_ps(w2, vb)); \
                }                                                                                       \
                _mm256_storeu_ps(acc[g0] + c, a0); _mm256_storeu_ps(acc[g0] + c + 8, b0);               \
                if (ng > 1) { _mm256_storeu_ps(acc[g0 + 1] + c, a1); _mm256_storeu_ps(acc[g0 + 1] + c + 8, b1); } \
                if (ng > 2) { _mm256_storeu_ps(acc[g0 + 2] + c, a2); _mm256_storeu_ps(acc[g0 + 2] + c + 8, b2); } \
            }                                                                                           \
        if (v_scale && !ss)                                                                             \
            for (int64_t g = 0; g < grp; g++)                                                           \
                for (int64_t i = 0; i < d; i++) acc[g][i] *= v_scale[kh];                               \
        dec_out_##SUF(grp, d, &acc[0][0], mx, sum, len, kh, nh, orow[b], out_f, out_t, lse);          \
    }                                                                                                   \
    }                                                                                                   \
    free(sc_all);                                                                                       \
    return 1;                                                                                           \
}                                                                                                       \
static int decode_attn_avx2_##SUF(const T *q, int64_t q_stride, const int64_t *qrow, const T *k_cache,  \
                                  const T *v_cache, const int64_t *slots, const int64_t *off, int64_t nb, \
                                  int64_t nh, int64_t nkv, int64_t d, float scale, float *out_f, T *out_t, \
                                  float *lse, const int64_t *orow) {                                    \
    return decode_avx2_core_##SUF(q, q_stride, qrow, k_cache, v_cache, NULL, NULL, 0, NULL, slots, off, nb, nh, \
                                  nkv, d, scale, out_f, out_t, lse, orow);                              \
}                                                                                                       \
static int decode_attn_q8_avx2_##SUF(const T *q, int64_t q_stride, const int64_t *qrow,                 \
                                     const uint8_t *k_cache, const uint8_t *v_cache, const float *k_scale, \
                                     const float *v_scale, int64_t ss, const float *lut, const int64_t *slots, \
                                     const int64_t *off, int64_t nb, int64_t nh, int64_t nkv, int64_t d, \
                                     float scale, float *out_f, T *out_t, float *lse, const int64_t *orow) { \
    return decode_avx2_core_##SUF(q, q_stride, qrow, k_cache, v_cache, k_scale, v_scale, ss, lut, slots, off, nb, \
                                  nh, nkv, d, scale, out_f, out_t, lse, orow);                          \
}
DEFINE_DECODE_AVX2(f32, float, 0)
DEFINE_DECODE_AVX2(bf16, uint16_t, 1)
#define FAST_DECODE_f32(...) if (decode_attn_avx2_f32(__VA_ARGS__)) return;
#define FAST_DECODE_AVX2_bf16(...) if (decode_attn_avx2_bf16(__VA_ARGS__)) return;
#define FAST_DECODE_Q8(SUF, ...) if (decode_attn_q8_avx2_##SUF(__VA_ARGS__)) return;
#else
#define FAST_DECODE_f32(...)
#define FAST_DECODE_AVX2_bf16(...)
#define FAST_DECODE_Q8(SUF, ...)
#endif

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
        T *rr = res ? res + r * res_stride : NULL;                                                    \
        int64_t i0 = norm512_in_##SUF(xr, rr, buf, h, ss); /* squares of buf[0..i0) already in ss */  \
        if (res) {                                                                                    \
            for (int64_t i = i0 + glue_add_##SUF(xr + i0, rr + i0, buf + i0, h - i0); i < h; i++) {   \
                float v = RD_##SUF(LD_##SUF(rr + i) + LD_##SUF(xr + i));                              \
                ST_##SUF(rr + i, v);                                                                  \
                buf[i] = v;                                                                           \
            }                                                                                         \
        } else {                                                                                      \
            for (int64_t i = i0 + glue_load_##SUF(xr + i0, buf + i0, h - i0); i < h; i++) buf[i] = LD_##SUF(xr + i); \
        }                                                                                             \
        int64_t i = i0 + glue_sumsq(buf + i0, h - i0, ss);                                            \
        for (; i + 16 <= h; i += 16)                                                                  \
            for (int l = 0; l < 16; l++) ss[l] += buf[i + l] * buf[i + l];                            \
        for (; i < h; i++) ss[0] += buf[i] * buf[i];                                                  \
        float s = 0.f;                                                                                \
        for (int l = 0; l < 16; l++) s += ss[l];                                                      \
        float inv = 1.0f / sqrtf(s / (float)h + eps);                                                 \
        i0 = norm512_out_##SUF(buf, w, inv, outr, h);                                                 \
        for (i = i0 + glue_scale_##SUF(buf + i0, w + i0, inv, outr + i0, h - i0); i < h; i++)         \
            ST_##SUF(outr + i, LD_##SUF(w + i) * RD_##SUF(buf[i] * inv));                             \
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
        float c[d], s[d];                                                                             \
        const float *cr = cos_t + pos[r] * d, *sr = sin_t + pos[r] * d;                               \
        for (int64_t i = glue_round_##SUF(cr, c, d); i < d; i++) c[i] = RD_##SUF(cr[i]);              \
        for (int64_t i = glue_round_##SUF(sr, s, d); i < d; i++) s[i] = RD_##SUF(sr[i]);              \
        for (int64_t hd = 0; hd < nh; hd++) {                                                         \
            T *xh = x + r * x_stride + hd * d;                                                        \
            for (int64_t i = glue_rope_##SUF(xh, c, s, half); i < half; i++) {                        \
                float a = LD_##SUF(xh + i), b = LD_##SUF(xh + half + i);                              \
                ST_##SUF(xh + i, RD_##SUF(a * c[i]) + RD_##SUF(-b * s[i]));                           \
                ST_##SUF(xh + half + i, RD_##SUF(b * c[half + i]) + RD_##SUF(a * s[half + i]));       \
            }                                                                                         \
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
        for (int64_t i = SILU_MUL_FAST_##SUF(g, u, o, m); i < m; i++) {                               \
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
    /* one work item per (request, KV head): a batch of one still spreads over the threads */        \
    _Pragma("omp for schedule(dynamic, 1)")                                                           \
    for (int64_t it = 0; it < nb * nkv; it++) {                                                       \
        int64_t b = it / nkv, kh = it % nkv;                                                          \
        int64_t len = off[b + 1] - off[b];                                                            \
        const int64_t *sl = slots + off[b];                                                           \
        {                                                                                             \
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
            dec_out_##SUF(grp, d, &acc[0][0], mx, sum, len, kh, nh, orow[b], out_f, out_t, lse);      \
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

/* ---- Batch-invariant kernels (deterministic inference) ------------------------------------------
 * A row's result must not depend on the other rows of a call, nor on how a computation is split between
 * calls (Thinking Machines, "Defeating Nondeterminism in LLM Inference", 2025; SGLang's
 * --enable-deterministic-inference). bi_linear: every output element is one chain of float32 fused
 * multiply-adds over k = 0 .. K-1 in order, whatever the number of rows or the tile the element falls
 * in (the tiles only decide which chains run side by side; the fmaf chain is the same on AVX2, AVX-512
 * and in scalar code). chunk_attn: keys in chunks of BI_CHUNK aligned to absolute positions, each
 * reduced in one fixed order and folded into a running (max, sum, acc) state in position order, so a
 * key range split between calls (a shared segment, then a request's tail) folds as in one call. */
#define BI_PANEL 16    /* output columns per packed weight panel */
#define BI_MR 6        /* rows per tile in bi_tile_rows (12 AVX2 accumulators) */
#define BI_NP 4        /* panels per group: a lone row runs BI_NP * BI_PANEL chains side by side */
#define BI_ROWS 64     /* rows per thread task of bi_linear (with one panel group) */
#define BI_CHUNK 64    /* keys per softmax chunk of chunk_attn */
#define BI_ATT_ROWS 16 /* query rows per thread task of chunk_attn (they share each gathered chunk) */
#define BI_MAX_D 256   /* largest head dimension chunk_attn takes */
/* words of one (chunk, kv head) block of chunk_attn's int8 keys and values: K codes [d / 4][BI_CHUNK] (word g of
 * key j: its codes 4g..4g+3), BI_CHUNK scales s_k (float32), BI_CHUNK values 128 x (sum of the key's codes)
 * (int32); from CA8_V(d) on, V codes [BI_CHUNK / 4][d] (word i of quad jq: element i of values 4jq..4jq+3),
 * then BI_CHUNK scales s_v (float32) */
#define CA8_V(d) ((d) / 4 * BI_CHUNK + 2 * BI_CHUNK)
#define CA8_WORDS(d) (CA8_V(d) + BI_CHUNK / 4 * (d) + BI_CHUNK)

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* 16 weights of a panel row as two float32 vectors */
static inline void bi_load_f32(const float *w, __m256 *lo, __m256 *hi) {
    *lo = _mm256_loadu_ps(w);
    *hi = _mm256_loadu_ps(w + 8);
}
static inline void bi_load_bf16(const uint16_t *w, __m256 *lo, __m256 *hi) {
    __m256i v = _mm256_loadu_si256((const __m256i *)w);
    *lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(v)), 16));
    *hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(v, 1)), 16));
}
#define BI_TILE_ROWS_SIMD(SUF)                                                                          \
    {                                                                                                   \
        __m256 a0l = _mm256_setzero_ps(), a0h = a0l, a1l = a0l, a1h = a0l, a2l = a0l, a2h = a0l;        \
        __m256 a3l = a0l, a3h = a0l, a4l = a0l, a4h = a0l, a5l = a0l, a5h = a0l;                        \
        for (int64_t kk = 0; kk < k; kk++) {                                                            \
            __m256 wl, wh, xv;                                                                          \
            bi_load_##SUF(w + kk * BI_PANEL, &wl, &wh);                                                 \
            xv = _mm256_broadcast_ss(x + kk);                                                           \
            a0l = _mm256_fmadd_ps(xv, wl, a0l); a0h = _mm256_fmadd_ps(xv, wh, a0h);                     \
            xv = _mm256_broadcast_ss(x + ldx + kk);                                                     \
            a1l = _mm256_fmadd_ps(xv, wl, a1l); a1h = _mm256_fmadd_ps(xv, wh, a1h);                     \
            xv = _mm256_broadcast_ss(x + 2 * ldx + kk);                                                 \
            a2l = _mm256_fmadd_ps(xv, wl, a2l); a2h = _mm256_fmadd_ps(xv, wh, a2h);                     \
            xv = _mm256_broadcast_ss(x + 3 * ldx + kk);                                                 \
            a3l = _mm256_fmadd_ps(xv, wl, a3l); a3h = _mm256_fmadd_ps(xv, wh, a3h);                     \
            xv = _mm256_broadcast_ss(x + 4 * ldx + kk);                                                 \
            a4l = _mm256_fmadd_ps(xv, wl, a4l); a4h = _mm256_fmadd_ps(xv, wh, a4h);                     \
            xv = _mm256_broadcast_ss(x + 5 * ldx + kk);                                                 \
            a5l = _mm256_fmadd_ps(xv, wl, a5l); a5h = _mm256_fmadd_ps(xv, wh, a5h);                     \
        }                                                                                               \
        __m256 all[12] = {a0l, a0h, a1l, a1h, a2l, a2h, a3l, a3h, a4l, a4h, a5l, a5h};                  \
        for (int i = 0; i < 12; i++) _mm256_storeu_ps(acc + 8 * i, all[i]);                             \
        return;                                                                                         \
    }
#define BI_TILE_COLS_SIMD(SUF)                                                                          \
    {                                                                                                   \
        __m256 a[2 * BI_NP];                                                                            \
        for (int i = 0; i < 2 * BI_NP; i++) a[i] = _mm256_setzero_ps();                                 \
        for (int64_t kk = 0; kk < k; kk++) {                                                            \
            __m256 xv = _mm256_broadcast_ss(x + kk);                                                    \
            for (int p = 0; p < BI_NP; p++) {                                                           \
                __m256 wl, wh;                                                                          \
                bi_load_##SUF(w + (p * k + kk) * BI_PANEL, &wl, &wh);                                   \
                a[2 * p] = _mm256_fmadd_ps(xv, wl, a[2 * p]);                                           \
                a[2 * p + 1] = _mm256_fmadd_ps(xv, wh, a[2 * p + 1]);                                   \
            }                                                                                           \
        }                                                                                               \
        for (int i = 0; i < 2 * np; i++) _mm256_storeu_ps(acc + 8 * i, a[i]);                           \
        return;                                                                                         \
    }
#define BI_TILE_ROWS_SIMD_f32 BI_TILE_ROWS_SIMD(f32)
#define BI_TILE_ROWS_SIMD_bf16 BI_TILE_ROWS_SIMD(bf16)
#define BI_TILE_COLS_SIMD_f32 BI_TILE_COLS_SIMD(f32)
#define BI_TILE_COLS_SIMD_bf16 BI_TILE_COLS_SIMD(bf16)
#else
#define BI_TILE_ROWS_SIMD_f32
#define BI_TILE_ROWS_SIMD_bf16
#define BI_TILE_COLS_SIMD_f32
#define BI_TILE_COLS_SIMD_bf16
#endif

/* chunk_attn's inner products on its float32 buffers (kf: a chunk's keys transposed [d][BI_CHUNK], vf: its
 * values [BI_CHUNK][d], q: nq <= CA_NQ query vectors d apart). Every score and every output element is the
 * chain the section comment states, whatever the blocking: scores sc[n][j] = fmaf chain over i of
 * q[n][i] k[j][i] from 0; acl[n][i] = fmaf chain over j < nn of p[n][j] v[j][i] from 0. The AVX2 versions
 * keep a block of chains in registers (CA_NQ queries x 32 keys, or x 32 output elements: 12 accumulators,
 * each loaded key or value vector used CA_NQ times); the scalar loops do the same chains one by one. */
#define CA_NQ 3
#if defined(__AVX2__) && defined(__FMA__)
static inline __attribute__((always_inline)) void ca_scores_n(const float *q, int64_t d, const float *kf, float *sc,
                                                              const int nq) {
    for (int half = 0; half < BI_CHUNK / 32; half++) {
        __m256 a[CA_NQ][4];
        for (int n = 0; n < nq; n++)
            for (int c = 0; c < 4; c++) a[n][c] = _mm256_setzero_ps();
        const float *kb = kf + half * 32;
        for (int64_t i = 0; i < d; i++) {
            __m256 k0 = _mm256_loadu_ps(kb + i * BI_CHUNK), k1 = _mm256_loadu_ps(kb + i * BI_CHUNK + 8);
            __m256 k2 = _mm256_loadu_ps(kb + i * BI_CHUNK + 16), k3 = _mm256_loadu_ps(kb + i * BI_CHUNK + 24);
            for (int n = 0; n < nq; n++) {
                __m256 qv = _mm256_broadcast_ss(q + n * d + i);
                a[n][0] = _mm256_fmadd_ps(qv, k0, a[n][0]);
                a[n][1] = _mm256_fmadd_ps(qv, k1, a[n][1]);
                a[n][2] = _mm256_fmadd_ps(qv, k2, a[n][2]);
                a[n][3] = _mm256_fmadd_ps(qv, k3, a[n][3]);
            }
        }
        for (int n = 0; n < nq; n++)
            for (int c = 0; c < 4; c++) _mm256_storeu_ps(sc + n * BI_CHUNK + half * 32 + c * 8, a[n][c]);
    }
}
static void ca_scores(const float *q, int nq, int64_t d, const float *kf, float *sc) {
    if (nq == 3) ca_scores_n(q, d, kf, sc, 3);
    else if (nq == 2) ca_scores_n(q, d, kf, sc, 2);
    else ca_scores_n(q, d, kf, sc, 1);
}
/* output elements [i0, i0 + 8 * NV) of nq rows */
static inline __attribute__((always_inline)) void ca_pv_n(const float *p, int64_t nn, const float *vf, int64_t d,
                                                          int64_t i0, float *acl, const int nq, const int nv) {
    __m256 a[CA_NQ][4];
    for (int n = 0; n < nq; n++)
        for (int c = 0; c < nv; c++) a[n][c] = _mm256_setzero_ps();
    for (int64_t j = 0; j < nn; j++) {
        __m256 v[4];
        for (int c = 0; c < nv; c++) v[c] = _mm256_loadu_ps(vf + j * d + i0 + 8 * c);
        for (int n = 0; n < nq; n++) {
            __m256 pv = _mm256_broadcast_ss(p + n * BI_CHUNK + j);
            for (int c = 0; c < nv; c++) a[n][c] = _mm256_fmadd_ps(pv, v[c], a[n][c]);
        }
    }
    for (int n = 0; n < nq; n++)
        for (int c = 0; c < nv; c++) _mm256_storeu_ps(acl + n * d + i0 + 8 * c, a[n][c]);
}
#if defined(__AVX512F__)
/* output elements [i0, i0 + 16 * NV) of nq rows with 512-bit FMAs: the same chains as ca_pv_n (H3) */
static inline __attribute__((always_inline)) void ca_pv512_n(const float *p, int64_t nn, const float *vf, int64_t d,
                                                             int64_t i0, float *acl, const int nq, const int nv) {
    __m512 a[CA_NQ][4];
    for (int n = 0; n < nq; n++)
        for (int c = 0; c < nv; c++) a[n][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < nn; j++) {
        __m512 v[4];
        for (int c = 0; c < nv; c++) v[c] = _mm512_loadu_ps(vf + j * d + i0 + 16 * c);
        for (int n = 0; n < nq; n++) {
            __m512 pv = _mm512_set1_ps(p[n * BI_CHUNK + j]);
            for (int c = 0; c < nv; c++) a[n][c] = _mm512_fmadd_ps(pv, v[c], a[n][c]);
        }
    }
    for (int n = 0; n < nq; n++)
        for (int c = 0; c < nv; c++) _mm512_storeu_ps(acl + n * d + i0 + 16 * c, a[n][c]);
}
#endif
static void ca_pv(const float *p, int nq, int64_t nn, const float *vf, int64_t d, float *acl) {
    int64_t i0 = 0;
#if defined(__AVX512F__)
    for (; i0 + 64 <= d; i0 += 64) {
        if (nq == 3) ca_pv512_n(p, nn, vf, d, i0, acl, 3, 4);
        else if (nq == 2) ca_pv512_n(p, nn, vf, d, i0, acl, 2, 4);
        else ca_pv512_n(p, nn, vf, d, i0, acl, 1, 4);
    }
    for (; i0 + 16 <= d; i0 += 16) ca_pv512_n(p, nn, vf, d, i0, acl, nq, 1);
#endif
    for (; i0 + 32 <= d; i0 += 32) {
        if (nq == 3) ca_pv_n(p, nn, vf, d, i0, acl, 3, 4);
        else if (nq == 2) ca_pv_n(p, nn, vf, d, i0, acl, 2, 4);
        else ca_pv_n(p, nn, vf, d, i0, acl, 1, 4);
    }
    for (; i0 + 8 <= d; i0 += 8) ca_pv_n(p, nn, vf, d, i0, acl, nq, 1);
    for (int n = 0; n < nq; n++)
        for (int64_t i = i0; i < d; i++) {
            float s = 0.f;
            for (int64_t j = 0; j < nn; j++) s = __builtin_fmaf(p[n * BI_CHUNK + j], vf[j * d + i], s);
            acl[n * d + i] = s;
        }
}
/* One query's chunk: sc[j] <- p_j = exp(s_j * scale - mc) for j < nn and 0 past it; *mc = the max of the
 * scaled scores (16 lanes, then the lanes in order), *lc = sum p (16 lanes over the chunk in order, then
 * the lanes in order). */
#if defined(__AVX512F__)
/* v_exp on 16 lanes: the same IEEE operations in the same order (H3), so fast_expf's bits */
static inline __m512 v_exp512(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.33654f), hi = _mm512_set1_ps(88.72283f);
    __mmask16 below = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), above = _mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ);
    __m512 xc = _mm512_mask_blend_ps(below, _mm512_mask_blend_ps(above, x, hi), lo);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(_mm512_sub_ps(xc, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f))),
                             _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
    __m512 p = _mm512_set1_ps(1.f / 5040);
    const float c[7] = {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};
    for (int i = 0; i < 7; i++) p = _mm512_add_ps(_mm512_set1_ps(c[i]), _mm512_mul_ps(f, p));
    __m512i e = _mm512_max_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), _mm512_set1_epi32(1));
    __m512 r = _mm512_mul_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(e, 23)));
    r = _mm512_mask_blend_ps(below, r, _mm512_setzero_ps());
    r = _mm512_mask_blend_ps(above, r, _mm512_set1_ps(INFINITY));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, x);
}
/* the AVX2 version's lanes (lane = j mod 16) in one register: the same operations, the same bits */
static inline void ca_softmax(float *sc, int64_t nn, float scale, float *mc_out, float *lc_out) {
    const __m512 vs = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    const __m512 lane = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 m = ninf, l = _mm512_setzero_ps();
    for (int64_t j = 0; j < BI_CHUNK; j += 16) {
        __mmask16 live = _mm512_cmp_ps_mask(_mm512_add_ps(lane, _mm512_set1_ps((float)j)), _mm512_set1_ps((float)nn), _CMP_LT_OQ);
        __m512 v = _mm512_mask_blend_ps(live, ninf, _mm512_mul_ps(_mm512_loadu_ps(sc + j), vs));
        _mm512_storeu_ps(sc + j, v);
        m = _mm512_max_ps(v, m);
    }
    float m16[16], l16[16], mc = -INFINITY, lc = 0.f;
    _mm512_storeu_ps(m16, m);
    for (int i = 0; i < 16; i++) mc = m16[i] > mc ? m16[i] : mc;
    __m512 vm = _mm512_set1_ps(mc);
    for (int64_t j = 0; j < BI_CHUNK; j += 16) {
        __m512 e = v_exp512(_mm512_sub_ps(_mm512_loadu_ps(sc + j), vm));
        _mm512_storeu_ps(sc + j, e);
        l = _mm512_add_ps(l, e);
    }
    _mm512_storeu_ps(l16, l);
    for (int i = 0; i < 16; i++) lc += l16[i];
    *mc_out = mc;
    *lc_out = lc;
}
#else
static inline void ca_softmax(float *sc, int64_t nn, float scale, float *mc_out, float *lc_out) {
    const __m256 vs = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 m[2] = {ninf, ninf}, l[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t j = 0; j < BI_CHUNK; j += 8) {
        __m256 live = _mm256_cmp_ps(_mm256_add_ps(lane, _mm256_set1_ps((float)j)), _mm256_set1_ps((float)nn), _CMP_LT_OQ);
        __m256 v = _mm256_blendv_ps(ninf, _mm256_mul_ps(_mm256_loadu_ps(sc + j), vs), live);
        _mm256_storeu_ps(sc + j, v);
        m[(j / 8) & 1] = _mm256_max_ps(v, m[(j / 8) & 1]); /* v > m ? v : m, as the scalar loop */
    }
    float m16[16], l16[16], mc = -INFINITY, lc = 0.f;
    _mm256_storeu_ps(m16, m[0]);
    _mm256_storeu_ps(m16 + 8, m[1]);
    for (int i = 0; i < 16; i++) mc = m16[i] > mc ? m16[i] : mc;
    __m256 vm = _mm256_set1_ps(mc);
    for (int64_t j = 0; j < BI_CHUNK; j += 8) {
        __m256 e = v_exp(_mm256_sub_ps(_mm256_loadu_ps(sc + j), vm));
        _mm256_storeu_ps(sc + j, e);
        l[(j / 8) & 1] = _mm256_add_ps(l[(j / 8) & 1], e);
    }
    _mm256_storeu_ps(l16, l[0]);
    _mm256_storeu_ps(l16 + 8, l[1]);
    for (int i = 0; i < 16; i++) lc += l16[i];
    *mc_out = mc;
    *lc_out = lc;
}
#endif
#else
static inline void ca_softmax(float *sc, int64_t nn, float scale, float *mc_out, float *lc_out) {
    float m16[16], l16[16], mc = -INFINITY, lc = 0.f;
    for (int l = 0; l < 16; l++) { m16[l] = -INFINITY; l16[l] = 0.f; }
    for (int64_t j0 = 0; j0 < BI_CHUNK; j0 += 16)
        for (int l = 0; l < 16; l++) {
            float v = j0 + l < nn ? sc[j0 + l] * scale : -INFINITY;
            sc[j0 + l] = v;
            m16[l] = v > m16[l] ? v : m16[l];
        }
    for (int l = 0; l < 16; l++) mc = m16[l] > mc ? m16[l] : mc;
    for (int64_t j = 0; j < BI_CHUNK; j++) sc[j] = fast_expf(sc[j] - mc);
    for (int64_t j0 = 0; j0 < BI_CHUNK; j0 += 16)
        for (int l = 0; l < 16; l++) l16[l] += sc[j0 + l];
    for (int l = 0; l < 16; l++) lc += l16[l];
    *mc_out = mc;
    *lc_out = lc;
}
static void ca_scores(const float *q, int nq, int64_t d, const float *kf, float *sc) {
    for (int n = 0; n < nq; n++) {
        float *s = sc + n * BI_CHUNK;
        for (int64_t j = 0; j < BI_CHUNK; j++) s[j] = 0.f;
        for (int64_t i = 0; i < d; i++)
            for (int64_t j = 0; j < BI_CHUNK; j++) s[j] = __builtin_fmaf(q[n * d + i], kf[i * BI_CHUNK + j], s[j]);
    }
}
static void ca_pv(const float *p, int nq, int64_t nn, const float *vf, int64_t d, float *acl) {
    for (int n = 0; n < nq; n++) {
        float *a = acl + n * d;
        for (int64_t i = 0; i < d; i++) a[i] = 0.f;
        for (int64_t j = 0; j < nn; j++)
            for (int64_t i = 0; i < d; i++) a[i] = __builtin_fmaf(p[n * BI_CHUNK + j], vf[j * d + i], a[i]);
    }
}
#endif

/* Gather n keys (rows k_cache + sl[j] * tok + off, j < n <= BI_CHUNK) transposed into kf [d][BI_CHUNK] and
 * their values into vf [BI_CHUNK][d], as float32: a copy, the same values in any build; AVX2 moves 8 keys
 * x 8 dims at a time through an 8 x 8 transpose. */
#if defined(__AVX2__) && defined(__FMA__)
#define CA_GATHER_SIMD(SUF, T)                                                                          \
    for (; j + 8 <= n; j += 8) {                                                                        \
        const T *kr[8];                                                                                 \
        for (int r = 0; r < 8; r++) kr[r] = k_cache + sl[j + r] * tok + off;                            \
        int64_t i = 0;                                                                                  \
        for (; i + 8 <= d; i += 8) {                                                                    \
            __m256 x[8];                                                                                \
            for (int r = 0; r < 8; r++) x[r] = v_ld_##SUF(kr[r] + i);                                   \
            transpose8_ps(x);                                                                           \
            for (int r = 0; r < 8; r++) _mm256_storeu_ps(kf + (i + r) * BI_CHUNK + j, x[r]);            \
        }                                                                                               \
        for (; i < d; i++)                                                                              \
            for (int r = 0; r < 8; r++) kf[i * BI_CHUNK + j + r] = LD_##SUF(kr[r] + i);                 \
        for (int r = 0; r < 8; r++) {                                                                   \
            const T *vr = v_cache + sl[j + r] * tok + off;                                              \
            float *vo = vf + (j + r) * d;                                                               \
            for (i = glue_load_##SUF(vr, vo, d); i < d; i++) vo[i] = LD_##SUF(vr + i);                  \
        }                                                                                               \
    }
#else
#define CA_GATHER_SIMD(SUF, T)
#endif
#define DEFINE_CA_GATHER(SUF, T)                                                                        \
static inline void ca_gather_##SUF(const T *k_cache, const T *v_cache, const int64_t *sl, int64_t n,     \
                                   int64_t tok, int64_t off, int64_t d, float *kf, float *vf) {          \
    int64_t j = 0;                                                                                      \
    CA_GATHER_SIMD(SUF, T)                                                                              \
    for (; j < n; j++) {                                                                                \
        const T *kr = k_cache + sl[j] * tok + off, *vr = v_cache + sl[j] * tok + off;                   \
        for (int64_t i = 0; i < d; i++) { kf[i * BI_CHUNK + j] = LD_##SUF(kr + i); vf[j * d + i] = LD_##SUF(vr + i); } \
    }                                                                                                   \
}
DEFINE_CA_GATHER(f32, float)
DEFINE_CA_GATHER(bf16, uint16_t)

/* One chunk_attn call: items i with keys slots[key_off[i]:key_off[i+1]], query rows rows[row_off[i]:row_off[i+1]],
 * row entry j seeing its first limits[j] keys (limits NULL: all) */
typedef struct { int64_t n_items; const int64_t *key_off, *slots, *row_off, *rows, *limits; } ca_call_t;
/* Where a task's softmax state lives: m / l [rows, nh], acc [rows, nh, d] float32 (m NULL: none, every row starts
 * empty); has (NULL: every row's state is there) [rows, nkv]: 1 where (row, kv head) holds a state, else the row
 * starts empty (-inf, 0, 0); store: write the state back (and set has) instead of the output */
typedef struct { float *m, *l, *acc; uint8_t *has; int store; } ca_state_t;
/* Background prefetch of the later calls' keys while a call with many rows per key computes: keys of the
 * calls c + 1 .. of a layer, numbered across calls (call i's keys from cum[i]; cum[n_calls] in all), handed
 * out by the shared cursor ctr; a call that reads each chunk for many rows is compute bound and a tail call
 * (a row's own keys at scattered slots) is memory bound, so the tails' token rows are fetched (into the
 * cache hierarchy: L2, then L3 as L2 evicts) during the segments' arithmetic instead of during the tails */
typedef struct { const ca_call_t *calls; const int64_t *cum; int64_t n_calls, c, tok; int64_t *ctr; } ca_bg_t;
#define CA_BG_KEYS 4 /* token rows prefetched per row and chunk computed (about 1,300 cycles on Zen 4 for 3 heads) */
/* The keys a task reads next (its next chunk, or the first chunk of the thread's next task), to prefetch; bg:
 * the background prefetch (NULL: none) */
typedef struct { const int64_t *sl; int64_t n, off; const ca_bg_t *bg; } ca_next_t;
static inline void ca_bg_prefetch(const ca_bg_t *bg, const void *k_cache, const void *v_cache, int64_t n) {
    if (!bg) return;
    int64_t total = bg->cum[bg->n_calls];
    if (__atomic_load_n(bg->ctr, __ATOMIC_RELAXED) >= total) return;
    int64_t i = __atomic_fetch_add(bg->ctr, n, __ATOMIC_RELAXED), i1 = i + n < total ? i + n : total;
    int64_t c = bg->c + 1;
    if (i < bg->cum[c]) i = bg->cum[c]; /* keys of this call or earlier: read already */
    for (; i < i1; i++) {
        while (bg->cum[c + 1] <= i) c++;
        int64_t slot = bg->calls[c].slots[i - bg->cum[c]];
        const char *kr = (const char *)k_cache + slot * bg->tok, *vr = (const char *)v_cache + slot * bg->tok;
        for (int64_t b = 0; b < bg->tok; b += 64) { __builtin_prefetch(kr + b, 0, 2); __builtin_prefetch(vr + b, 0, 2); }
    }
}
static inline int ca_loads(const ca_state_t *st, int64_t row, int64_t nkv, int64_t kh) {
    return st->m && (!st->has || st->has[row * nkv + kh]);
}
/* Software prefetch of n keys' rows (bytes [off, off + bytes) of k_cache / v_cache rows sl[j], tok bytes apart):
 * a chunk's keys sit at scattered slots (a decode token's own slot), which the hardware prefetchers do not
 * guess, so the next chunk is fetched while this one is computed */
static inline void ca_prefetch(const void *k_cache, const void *v_cache, const int64_t *sl, int64_t n, int64_t tok,
                               int64_t off, int64_t bytes) {
    for (int64_t j = 0; j < n; j++) {
        const char *kr = (const char *)k_cache + sl[j] * tok + off, *vr = (const char *)v_cache + sl[j] * tok + off;
        for (int64_t b = 0; b < bytes; b += 64) { __builtin_prefetch(kr + b); __builtin_prefetch(vr + b); }
        __builtin_prefetch(kr + bytes - 1);
        __builtin_prefetch(vr + bytes - 1);
    }
}
/* Prefetch into L2 the whole token rows (all kv heads: tok bytes, K and V) of up to CA_PF_ITEM keys sl[0..n): a
 * short item (a decode row's own keys), fetched while the item before it is computed */
#define CA_PF_ITEM 256
static inline void ca_prefetch_item(const void *k_cache, const void *v_cache, const int64_t *sl, int64_t n, int64_t tok) {
    if (n > CA_PF_ITEM) return;
    for (int64_t j = 0; j < n; j++) {
        const char *kr = (const char *)k_cache + sl[j] * tok, *vr = (const char *)v_cache + sl[j] * tok;
        for (int64_t b = 0; b < tok; b += 64) { __builtin_prefetch(kr + b, 0, 2); __builtin_prefetch(vr + b, 0, 2); }
    }
}
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define Q8_TABS 1
/* The 8-bit codes -> bfloat16 in registers: every value of the three formats is exact in bfloat16 (int8:
 * integers up to 127; e4m3 / e5m2: 3 / 2 mantissa bits, exponents within bfloat16's), so the table holds
 * the low and high bytes of bf16(lut[c]) for the magnitudes c = 0..127 (two 64-byte halves each, looked up
 * by VPERMI2B on the code's 7 low bits), the sign is the code's bit 7 (fp8 is sign-magnitude; an int8
 * code is looked up by its absolute value, -128 never being stored), and VPERMT2B interleaves low and high
 * bytes into words in element order. */
typedef struct { __m512i lo0, lo1, hi0, hi1, ia, ib; int is_int8; } Q8Tabs;
static inline Q8Tabs q8_tabs(const float *lut, int is_int8) {
    uint8_t lo[128], hi[128], ia[64], ib[64];
    for (int c = 0; c < 128; c++) {
        uint16_t h = f32_to_bf16(lut[c]);
        lo[c] = (uint8_t)(h & 0xff);
        hi[c] = (uint8_t)(h >> 8);
    }
    for (int k = 0; k < 32; k++) {
        ia[2 * k] = (uint8_t)k; ia[2 * k + 1] = (uint8_t)(64 + k);
        ib[2 * k] = (uint8_t)(32 + k); ib[2 * k + 1] = (uint8_t)(96 + k);
    }
    Q8Tabs t;
    t.lo0 = _mm512_loadu_si512(lo); t.lo1 = _mm512_loadu_si512(lo + 64);
    t.hi0 = _mm512_loadu_si512(hi); t.hi1 = _mm512_loadu_si512(hi + 64);
    t.ia = _mm512_loadu_si512(ia); t.ib = _mm512_loadu_si512(ib);
    t.is_int8 = is_int8;
    return t;
}
/* 64 codes at p -> bfloat16 of elements 0..31 (*a) and 32..63 (*b) */
static inline __attribute__((always_inline)) void q8_to_bf16_64(const Q8Tabs *t, const uint8_t *p, __m512i *a,
                                                                __m512i *b) {
    __m512i x = _mm512_loadu_si512(p);
    __m512i m = t->is_int8 ? _mm512_abs_epi8(x) : x;
    __m512i lo = _mm512_permutex2var_epi8(t->lo0, m, t->lo1);
    __m512i hi = _mm512_or_si512(_mm512_permutex2var_epi8(t->hi0, m, t->hi1),
                                 _mm512_and_si512(x, _mm512_set1_epi8((char)0x80)));
    *a = _mm512_permutex2var_epi8(lo, t->ia, hi);
    *b = _mm512_permutex2var_epi8(lo, t->ib, hi);
}
static inline __m512 q8_bf16_lo_ps(__m512i w) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(w)), 16));
}
static inline __m512 q8_bf16_hi_ps(__m512i w) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(w, 1)), 16));
}
#endif
/* A quantised KV pool as chunk_attn's pair paths read it (NULL: the caches hold values of the kernels' dtype):
 * codes k / v [num_slots, nkv, d] (one byte per element), scales ks / vs at [slot * ss + kv head] (ss = nkv:
 * per slot and head; 0: per head), lut [256] the value of each code, tabs its Q8Tabs (q8_tabs). A row's codes are
 * decoded as they are gathered into their exact bfloat16 values lut[code] (no dequantised copy of the cache
 * exists) and the scales are applied where decode_attn_q8 applies them: a key's to its scores (s_k (q . lut[kb])),
 * a value's to the probabilities (p s_v, rounded to bfloat16 for the P.V pairs); the softmax sum l adds the
 * probabilities themselves. Under int8 attention the decoded row is quantised as a bfloat16 row is and its
 * scale multiplied by the stored one. */
typedef struct { const uint8_t *k, *v; const float *ks, *vs, *lut; int64_t ss; const void *tabs; } ca_q8_t;
/* the tables of a ca_q8_t (CA_TABS(storage, lut): their address, NULL where the scalar decode runs) */
#ifdef Q8_TABS
typedef Q8Tabs ca_tabs_t;
#define CA_TABS(t, lut) ((t) = q8_tabs(lut, (lut)[255] == -1.0f && (lut)[1] == 1.0f), (const void *)&(t))
#else
typedef int ca_tabs_t;
#define CA_TABS(t, lut) ((void)(t), (const void *)NULL)
#endif
/* row sl (a slot) of kv head h of the codes (k or v of kvq, rows tok bytes apart) -> o[d] = bf16(lut[code]), exact
 * (every value of the three formats is a bfloat16); the row's scale is applied by the caller */
static inline const uint16_t *ca_q8_row_bf16(const ca_q8_t *kvq, int v, int64_t sl, int64_t tok, int64_t h, int64_t d,
                                             uint16_t *o) {
    const uint8_t *c = (v ? kvq->v : kvq->k) + sl * tok + h * d;
    int64_t i = 0;
#ifdef Q8_TABS
    for (; i + 64 <= d; i += 64) {
        __m512i a, b;
        q8_to_bf16_64((const Q8Tabs *)kvq->tabs, c + i, &a, &b);
        _mm512_storeu_si512(o + i, a);
        _mm512_storeu_si512(o + i + 32, b);
    }
#endif
    for (; i < d; i++) o[i] = f32_to_bf16(kvq->lut[c[i]]);
    return o;
}
/* the K (v = 0) or V scale of row sl, kv head h */
static inline float ca_q8_scale(const ca_q8_t *kvq, int v, int64_t sl, int64_t h) {
    return (v ? kvq->vs : kvq->ks)[sl * kvq->ss + h];
}
/* the per-slot scales (int8's) of n keys sl[0..n): a row's scale sits on a cache line of its own at a scattered slot */
static inline void ca_prefetch_scales(const ca_q8_t *kvq, const int64_t *sl, int64_t n) {
    if (!kvq || !kvq->ss) return;
    for (int64_t j = 0; j < n; j++) {
        __builtin_prefetch(kvq->ks + sl[j] * kvq->ss);
        __builtin_prefetch(kvq->vs + sl[j] * kvq->ss);
    }
}
/* a dtype without the VDPBF16PS pair paths: ca_dp_<sfx> says no, so ca_task_pp_<sfx> is never called */
#define CA_PP_STUB(T, sfx) \
    static inline int ca_dp_##sfx(int64_t d) { return 0; } \
    static inline int ca_k8_##sfx(int64_t d) { return 0; } \
    static inline uint32_t *ca_k8_buffer_##sfx(size_t words) { return NULL; } \
    static inline void ca_quant_kv8_##sfx(const T *k_cache, const T *v_cache, const int64_t *sl, int64_t n, \
        int64_t tok, int64_t d, uint32_t *blk, const ca_q8_t *kvq) {} \
    static inline void ca_task_pp_##sfx(const T *q, int64_t q_stride, const T *k_cache, const T *v_cache, \
        const int64_t *sl, int64_t nkeys, const int64_t *rows, const int64_t *limits, int64_t e0, int64_t e1, \
        int64_t kh, int64_t nh, int64_t nkv, int64_t d, float scale, const ca_state_t *st, const ca_next_t *nx, \
        T *out, uint32_t *kp, uint32_t *vp, float *acc, float *mx, float *sm, uint32_t *pb, const uint32_t *k8, \
        const ca_q8_t *kvq) {}
/* ---- Batch-invariant kernels on AVX-512 BF16 (helper H3, issue 11 on AMD EPYC Zen 4) ------------------
 * Where the CPU has VDPBF16PS, the bfloat16 batch-invariant kernels take bf16 pairs as the instruction
 * wants them: each product of two bf16 values is exact in float32, two of them added to the float32
 * accumulator per lane and step (Intel SDM, VDPBF16PS; inputs and outputs denormal-flushed). That is
 * another fixed summation order than the portable fmaf chains (so these bits differ from the scalar
 * build, by design, as decode_attn's VDPBF16PS kernel does), and still one chain per output element
 * whatever the number of rows, the tile an element falls in or the other queries of a call:
 *  - bi_linear: out[r, col] = chain over the K / 2 pairs p in order of acc = VDPBF16PS(acc, (x[2p],
 *    x[2p+1]), (w[col][2p], w[col][2p+1])) from 0, + bias, rounded to bf16 once; the weight packed per
 *    panel of BI_PANEL columns as [K / 2][BI_PANEL][2] (bi_linear_pack, K even; odd K keeps the fmaf path).
 *  - chunk_attn: a score q.k is the chain over the d / 2 pairs in order (lane = key: a chunk's keys are
 *    gathered as [d / 2][BI_CHUNK] bf16 pairs by a 16 x 16 transpose of 32-bit words); for d a multiple of
 *    32. P.V likewise over key pairs with the probabilities rounded to bf16, the softmax state folded into
 *    the accumulators (ca_task_pp_bf16). Elsewhere (other d, float32, other CPUs) the portable arithmetic,
 *    P.V by 512-bit FMAs where there are any, the same chains, the same bits. */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define BI_DP_MR 6 /* rows per register tile of bi_linear_dp (x BI_DP_NP panels: 24 accumulators) */
#define BI_DP_NP 4
/* r[0..16) rows of 16 32-bit words -> r[c] = column c (a 16 x 16 transpose) */
static inline void ca_transpose16_epi32(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int k = 0; k < 8; k++) {
        t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
        t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
    }
    for (int k = 0; k < 4; k++) { /* u[4k + c], 128-bit lane L: rows 4k..4k+3 of column 4L + c */
        u[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
        u[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
        u[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
        u[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
    }
    for (int c = 0; c < 4; c++) { /* column 4L + c, lane G = u[4G + c] lane L */
        __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xee);
        __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44), v3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xee);
        r[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        r[4 + c] = _mm512_shuffle_i32x4(v0, v2, 0xdd);
        r[8 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xdd);
    }
}
static inline uint32_t ld_pair(const uint16_t *p) { uint32_t u; memcpy(&u, p, 4); return u; }
static inline int ca_dp_bf16(int64_t d) { return d % 32 == 0; }
/* bf16 rounding of 16 float32 lanes as f32_to_bf16 (nearest even, NaN kept quiet), stored under mask */
static inline void bi_store_bf16x16(uint16_t *p, __m512 v, __mmask16 mask) {
    __m512i u = _mm512_castps_si512(v);
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                 _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
    __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
    _mm512_mask_cvtepi32_storeu_epi16(p, mask, _mm512_srli_epi32(r, 16));
}
/* chunk_attn's task on AVX-512 BF16 (d a multiple of 32, helper H2, issue 15): both products by VDPBF16PS.
 * Per (row, head) and chunk: scores s_j = the q.k pair chain (the section comment), x_j = s_j * scale for the
 * live keys j < nn (else -inf), mc = max x (exact, any order), mn = max(m, mc), a = fast_expf(m - mn),
 * p_j = bf16(e^(x_j - mn)) (ca_exp16: degree-5 polynomial, relative error < 3e-6, far below bf16's 2^-9; 0
 * past nn), l' = l a + (sum of the rounded p_j: even keys + odd keys per lane, the two 32-key halves added,
 * then _mm512_reduce_add_ps's fixed tree), acc'[i] = VDPBF16PS chain over the key pairs (j, j + 1) in order,
 * from acc[i] a, of (p_j, p_j+1).(v_j[i], v_j+1[i]) (a last odd key paired with +0). One chain per (row,
 * head, element) whatever the other rows of the task, and the state (m, l, acc) is all that crosses a chunk,
 * so a shared segment then a tail give one pass's bits. Probabilities rounded to bfloat16 for P V as
 * PyTorch's CPU flash kernel does for bfloat16 (the FlashAttention-2 step, Dao, arXiv 2307.08691). */
static inline __m512 ca_exp16(__m512 x) { /* e^x for x <= 0 (NaN, -inf: e^-87) */
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    f = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), f);
    __m512 p = _mm512_fmadd_ps(f, _mm512_set1_ps(1.f / 120), _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}
/* n <= BI_CHUNK keys: K as bf16 pairs kp [d / 2][BI_CHUNK] (32-bit words, lane = key, by a 16 x 16 transpose; a
 * short block padded with copies of its last key, masked later), V as key pairs vp [BI_CHUNK / 2][d] (word i
 * of pair jp: v_2jp[i] low, v_2jp+1[i] high; +0 past key n - 1); kp NULL: V only */
static void ca_gather_pp_bf16(const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *sl, int64_t n,
                              int64_t tok, int64_t off, int64_t d, uint32_t *kp, uint32_t *vp, const ca_q8_t *kvq,
                              float *kvs) {
    uint16_t rows[16][BI_MAX_D]; /* a quantised pool's rows, decoded (ca_q8_t); kvs: their K then V scales */
    for (int64_t j = 0; kvq && j < BI_CHUNK; j++) {
        int64_t sj = sl[j < n ? j : n - 1];
        kvs[j] = ca_q8_scale(kvq, 0, sj, off / d);
        kvs[BI_CHUNK + j] = ca_q8_scale(kvq, 1, sj, off / d);
    }
    for (int64_t j = 0; kp && j < n; j += 16) {
        const uint16_t *kr[16];
        for (int r = 0; r < 16; r++) {
            int64_t s = sl[j + r < n ? j + r : n - 1];
            kr[r] = kvq ? ca_q8_row_bf16(kvq, 0, s, tok, off / d, d, rows[r]) : k_cache + s * tok + off;
        }
        for (int64_t pb = 0; pb < d / 32; pb++) {
            __m512i x[16];
            for (int r = 0; r < 16; r++) x[r] = _mm512_loadu_si512(kr[r] + 32 * pb);
            ca_transpose16_epi32(x);
            for (int c = 0; c < 16; c++) _mm512_storeu_si512(kp + (16 * pb + c) * BI_CHUNK + j, x[c]);
        }
    }
    const __m512i lo = _mm512_setr_epi32(0x00200000, 0x00210001, 0x00220002, 0x00230003, 0x00240004, 0x00250005,
                                         0x00260006, 0x00270007, 0x00280008, 0x00290009, 0x002a000a, 0x002b000b,
                                         0x002c000c, 0x002d000d, 0x002e000e, 0x002f000f);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int64_t jp = 0; jp < (n + 1) / 2; jp++) {
        const uint16_t *r0 = kvq ? ca_q8_row_bf16(kvq, 1, sl[2 * jp], tok, off / d, d, rows[0])
                                : v_cache + sl[2 * jp] * tok + off;
        const uint16_t *r1 = 2 * jp + 1 >= n ? NULL : kvq ? ca_q8_row_bf16(kvq, 1, sl[2 * jp + 1], tok, off / d, d, rows[1])
                                                        : v_cache + sl[2 * jp + 1] * tok + off;
        for (int64_t i = 0; i < d; i += 32) {
            __m512i a = _mm512_loadu_si512(r0 + i), b = r1 ? _mm512_loadu_si512(r1 + i) : _mm512_setzero_si512();
            _mm512_storeu_si512(vp + jp * d + i, _mm512_permutex2var_epi16(a, lo, b));
            _mm512_storeu_si512(vp + jp * d + i + 16, _mm512_permutex2var_epi16(a, hi, b));
        }
    }
}
/* acc[n][i0 + 16 c] (c < nv) of nq heads: times a[n], then the pair chains over np key pairs of vp (the last
 * pair's high key masked to +0 when odd) with the probabilities pb[n][jp] */
static inline __attribute__((always_inline)) void ca_pv_pp_n(const uint32_t *pb, const uint32_t *vp, int64_t np,
                                                             int odd, int64_t d, int64_t i0, const float *a,
                                                             float *acc, const int nq, const int nv) {
    __m512 A[CA_NQ][4];
    for (int n = 0; n < nq; n++)
        for (int c = 0; c < nv; c++)
            A[n][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + n * d + i0 + 16 * c), _mm512_set1_ps(a[n]));
    for (int64_t jp = 0; jp < np; jp++) {
        __m512bh v[4];
        const uint32_t *vr = vp + jp * d + i0;
        for (int c = 0; c < nv; c++) {
            __m512i w = _mm512_loadu_si512(vr + 16 * c);
            if (odd && jp == np - 1) w = _mm512_and_si512(w, _mm512_set1_epi32(0xffff));
            v[c] = (__m512bh)w;
        }
        for (int n = 0; n < nq; n++) {
            __m512bh pv = (__m512bh)_mm512_set1_epi32((int)pb[n * (BI_CHUNK / 2) + jp]);
            for (int c = 0; c < nv; c++) A[n][c] = _mm512_dpbf16_ps(A[n][c], pv, v[c]);
        }
    }
    for (int n = 0; n < nq; n++)
        for (int c = 0; c < nv; c++) _mm512_storeu_ps(acc + n * d + i0 + 16 * c, A[n][c]);
}
/* ---- int8 attention (--activation-dtype int8; SageAttention's QK^T, Zhang et al., arXiv 2410.02367) ----
 * Under W8A8 the scores q.k are taken on int8 codes: q per (row, head) and k per (key, kv head) quantised
 * symmetrically (s = max|x| / 127, codes rint(x * (127 / max|x|)) clamped to +-127: ca_q8_row), the dot
 * product exact in int32 by VPDPBUSD on (q codes + 128) and k codes, less 128 x the key's code sum:
 * score_j = (float(dot_j) * s_kj) * (s_q * scale), then the softmax as for bf16 scores. P.V on int8
 * too: v per (key, kv head) quantised alike (s_v), w_j = p_j * s_vj for the chunk's keys, codes
 * u_j = rint(w_j * (255 / max_j w_j)) clamped to [0, 255] (0 past the live keys), the chunk's product
 * float(sum_j u_j v_j[i]) (exact in int32, VPDPBUSD over key quads) times max w / 255, added to acc[i] a by
 * one FMA; l sums the float p_j. (SageAttention keeps P.V in 16 bits for long sequences; here each chunk of
 * 64 keys has its own scale; the bundled model's KL to bf16 barely moved: benchmarks/README.md.) The
 * codes and scales are functions of one row, one key or one (row, chunk), so a row's bits stay independent
 * of its batch, task and call (K and V quantised once per call, ca_quant_kv8, read by all its tasks). Half
 * the instructions of both pair chains. Only here (AVX-512 BF16 + VNNI, d a multiple of 32); elsewhere
 * attention stays that of bf16 activations. */
#if defined(__AVX512VNNI__)
static inline int ca_k8_bf16(int64_t d) { return ca_dp_bf16(d); }
#else
static inline int ca_k8_bf16(int64_t d) { return 0; }
#endif
/* a call's int8 keys (a decode step's too: kept from call to call) */
static inline uint32_t *ca_k8_buffer_bf16(size_t words) { return (uint32_t *)scratch(SCRATCH_K8, 4 * words); }
/* one head's d bf16 values (d a multiple of 32) -> codes c[i] = rint(x[i] * (127 / amax)) clamped to +-127
 * (amax = max |x|; the reciprocal once, then products: the attention's own quantiser, cheaper per key than
 * quantize_rows' division), *sum = the codes' sum; returns the scale amax / 127. amax 0, inf or NaN: codes 0
 * (the scale carries inf / NaN into the scores) */
static inline float ca_q8_row(const uint16_t *x, int64_t d, int8_t *c, int32_t *sum) {
    __m512 v[BI_MAX_D / 16], m = _mm512_setzero_ps();
    const __m512i ab = _mm512_set1_epi32(0x7fffffff);
    __mmask16 nan = 0;
    for (int64_t i = 0; i < d / 16; i++) {
        __m256i h = _mm256_loadu_si256((const __m256i *)(x + 16 * i));
        v[i] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        m = _mm512_max_ps(m, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v[i]), ab)));
        nan |= _mm512_cmp_ps_mask(v[i], v[i], _CMP_UNORD_Q);
    }
    /* VMAXPS drops a NaN operand: a NaN element makes amax NaN explicitly */
    float amax = nan ? NAN : _mm512_reduce_max_ps(m), inv = amax > 0.f && amax < INFINITY ? 127.f / amax : 0.f;
    __m512i acc = _mm512_setzero_si512();
    for (int64_t i = 0; i < d / 16; i++) {
        __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], _mm512_set1_ps(inv)));
        q = _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
        acc = _mm512_add_epi32(acc, q);
        _mm_storeu_si128((__m128i *)(c + 16 * i), _mm512_cvtepi32_epi8(q));
    }
    *sum = _mm512_reduce_add_epi32(acc);
    return amax / 127.f;
}
/* n <= BI_CHUNK keys (token rows sl[j] of k_cache / v_cache, tok = nkv * d elements each) -> the blocks of
 * their nkv heads, blk + kh * CA8_WORDS(d) (keys from n on: codes, scales and sums 0). A decode row's keys
 * are read here first, at scattered slots: the token rows CA_K8_AHEAD keys on are prefetched */
#define CA_K8_AHEAD 6
/* four values' codes c[0..3] (d bytes each, d a multiple of 32) -> the quad's V words o[i] = (c0[i], c1[i],
 * c2[i], c3[i]) for i < d: bytes then 16-bit pairs interleaved within 128-bit lanes, then a 4 x 4 transpose of
 * the lanes puts the words in order */
static inline void ca_v8_quad(const int8_t (*c)[BI_MAX_D], int64_t d, uint32_t *o) {
    int64_t i = 0;
    for (; i + 64 <= d; i += 64) {
        __m512i r0 = _mm512_loadu_si512(c[0] + i), r1 = _mm512_loadu_si512(c[1] + i);
        __m512i r2 = _mm512_loadu_si512(c[2] + i), r3 = _mm512_loadu_si512(c[3] + i);
        __m512i a = _mm512_unpacklo_epi8(r0, r1), b = _mm512_unpackhi_epi8(r0, r1);
        __m512i e = _mm512_unpacklo_epi8(r2, r3), f = _mm512_unpackhi_epi8(r2, r3);
        __m512i w0 = _mm512_unpacklo_epi16(a, e), w1 = _mm512_unpackhi_epi16(a, e); /* lane L: 16L + 0..3, 4..7 */
        __m512i w2 = _mm512_unpacklo_epi16(b, f), w3 = _mm512_unpackhi_epi16(b, f); /* 16L + 8..11, 12..15 */
        __m512i t0 = _mm512_shuffle_i32x4(w0, w1, 0x44), t1 = _mm512_shuffle_i32x4(w2, w3, 0x44);
        __m512i t2 = _mm512_shuffle_i32x4(w0, w1, 0xee), t3 = _mm512_shuffle_i32x4(w2, w3, 0xee);
        _mm512_storeu_si512(o + i, _mm512_shuffle_i32x4(t0, t1, 0x88));
        _mm512_storeu_si512(o + i + 16, _mm512_shuffle_i32x4(t0, t1, 0xdd));
        _mm512_storeu_si512(o + i + 32, _mm512_shuffle_i32x4(t2, t3, 0x88));
        _mm512_storeu_si512(o + i + 48, _mm512_shuffle_i32x4(t2, t3, 0xdd));
    }
    for (; i < d; i++)
        o[i] = (uint32_t)(uint8_t)c[0][i] | (uint32_t)(uint8_t)c[1][i] << 8 | (uint32_t)(uint8_t)c[2][i] << 16 |
               (uint32_t)(uint8_t)c[3][i] << 24;
}
static void ca_quant_kv8_bf16(const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *sl, int64_t n,
                              int64_t tok, int64_t d, uint32_t *blk, const ca_q8_t *kvq) {
    int64_t nkv = tok / d, w = CA8_WORDS(d), rb = kvq ? tok : 2 * tok; /* bytes per token row */
    const char *kb = kvq ? (const char *)kvq->k : (const char *)k_cache, *vb = kvq ? (const char *)kvq->v : (const char *)v_cache;
    int8_t codes[BI_MAX_D], vc[4][BI_MAX_D];
    uint16_t row[BI_MAX_D]; /* a quantised pool's row, decoded (ca_q8_t) */
    for (int64_t j = 0; j < n && j < CA_K8_AHEAD; j++)
        for (int64_t b = 0; b < rb; b += 64) {
            __builtin_prefetch(kb + sl[j] * rb + b);
            __builtin_prefetch(vb + sl[j] * rb + b);
        }
    for (int64_t j0 = 0; j0 < BI_CHUNK; j0 += 4) { /* a quad of keys, all their kv heads */
        for (int64_t j = j0 + CA_K8_AHEAD; j < j0 + 4 + CA_K8_AHEAD && j < n; j++)
            for (int64_t b = 0; b < rb; b += 64) {
                __builtin_prefetch(kb + sl[j] * rb + b);
                __builtin_prefetch(vb + sl[j] * rb + b);
            }
        for (int64_t kh = 0; kh < nkv; kh++) {
            uint32_t *bk = blk + kh * w;
            float *sk = (float *)(bk + d / 4 * BI_CHUNK), *sv = (float *)(bk + CA8_V(d) + BI_CHUNK / 4 * d);
            int32_t *kc = (int32_t *)(sk + BI_CHUNK);
            for (int64_t j = j0; j < j0 + 4; j++) {
                int32_t sum = 0;
                if (j < n && kvq) /* the decoded row's codes, its scale times the stored one (ca_q8_t) */
                    sk[j] = ca_q8_row(ca_q8_row_bf16(kvq, 0, sl[j], tok, kh, d, row), d, codes, &sum) *
                            ca_q8_scale(kvq, 0, sl[j], kh);
                else if (j < n) sk[j] = ca_q8_row(k_cache + sl[j] * tok + kh * d, d, codes, &sum);
                else { sk[j] = 0.f; memset(codes, 0, (size_t)d); }
                kc[j] = 128 * sum;
                for (int64_t g = 0; g < d / 4; g++) memcpy(bk + g * BI_CHUNK + j, codes + 4 * g, 4);
                if (j < n && kvq)
                    sv[j] = ca_q8_row(ca_q8_row_bf16(kvq, 1, sl[j], tok, kh, d, row), d, vc[j - j0], &sum) *
                            ca_q8_scale(kvq, 1, sl[j], kh);
                else if (j < n) sv[j] = ca_q8_row(v_cache + sl[j] * tok + kh * d, d, vc[j - j0], &sum);
                else { sv[j] = 0.f; memset(vc[j - j0], 0, (size_t)d); }
            }
            ca_v8_quad((const int8_t (*)[BI_MAX_D])vc, d, bk + CA8_V(d) + j0 / 4 * d);
        }
    }
}
/* acc + VPDPBUSD(a unsigned bytes, b signed bytes) in place: GCC's intrinsic copied every accumulator twice
 * around each instruction in ca_row_pp_n's loop (two register moves per product) */
static inline __m512i ca_dpbusd(__m512i acc, __m512i a, __m512i b) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}
/* one query head's d values -> q8 (d / 4 words of codes + 128), returns its scale s_q */
static inline float ca_quant_q8(const uint16_t *q, int64_t d, uint32_t *q8) {
    int8_t codes[BI_MAX_D];
    int32_t sum;
    float s = ca_q8_row(q, d, codes, &sum);
    for (int64_t g = 0; g < d / 4; g++) {
        uint32_t w;
        memcpy(&w, codes + 4 * g, 4);
        q8[g] = w ^ 0x80808080u; /* each byte c + 128 */
    }
    return s;
}
#if defined(__AVX512VNNI__)
/* acc[n][i0 + 16 c] (c < nv) of nq heads = fma(float(sum over the nq4 key quads of u . v), ws[n], acc a[n]): pu
 * [nq][BI_CHUNK / 4] words of probability codes, vb the chunk's V codes (CA8_V) */
static inline __attribute__((always_inline)) void ca_pv8_n(const uint32_t *pu, const uint32_t *vb, int64_t nq4,
                                                           int64_t d, int64_t i0, const float *a, const float *ws,
                                                           float *acc, const int nq, const int nv) {
    __m512i I[CA_NQ][4];
    for (int n = 0; n < nq; n++)
        for (int c = 0; c < nv; c++) I[n][c] = _mm512_setzero_si512();
    for (int64_t jq = 0; jq < nq4; jq++) {
        __m512i v[4];
        for (int c = 0; c < nv; c++) {
            v[c] = _mm512_loadu_si512(vb + jq * d + i0 + 16 * c);
            __asm__("" : "+v"(v[c]));
        }
        for (int n = 0; n < nq; n++) {
            __m512i pv = _mm512_set1_epi32((int)pu[n * (BI_CHUNK / 4) + jq]);
            for (int c = 0; c < nv; c++) I[n][c] = ca_dpbusd(I[n][c], pv, v[c]);
        }
    }
    for (int n = 0; n < nq; n++)
        for (int c = 0; c < nv; c++) {
            float *p = acc + n * d + i0 + 16 * c;
            _mm512_storeu_ps(p, _mm512_fmadd_ps(_mm512_cvtepi32_ps(I[n][c]), _mm512_set1_ps(ws[n]),
                                                _mm512_mul_ps(_mm512_loadu_ps(p), _mm512_set1_ps(a[n]))));
        }
}
#endif
/* nq heads of one row (q: its first, heads d apart) fold one chunk (kp / vp, nn live keys) into their state
 * mx / sm / acc (acc: nq x d); pb: nq x BI_CHUNK / 2 words of scratch. nb = ceil(nn / 16): the 16-key blocks
 * with a live key, the only ones whose scores are computed (a function of the row's own nn, so its bits are
 * the same in any task). k8 not NULL: int8 attention (ca_quant_kv8's block of this chunk; q8: the nq heads'
 * codes + 128 as d / 4 words each, qs: their sq * scale; pb then holds the probability codes), kp / vp unused */
static inline __attribute__((always_inline)) void ca_row_pp_n(const uint16_t *q, int64_t d, const uint32_t *kp,
                                                              const uint32_t *vp, int64_t nn, float scale, float *mx,
                                                              float *sm, float *acc, uint32_t *pb, const uint32_t *k8,
                                                              const uint32_t *q8, const float *qs, const float *kvs,
                                                              const int nq, const int nb) {
    __m512 s[CA_NQ][4]; /* scores of keys 16 c .. 16 c + 15; the blocks from nb on (no live key) stay 0 */
    for (int n = 0; n < nq; n++)
        for (int c = 0; c < 4; c++) s[n][c] = _mm512_setzero_ps();
#if defined(__AVX512VNNI__)
    if (k8) {
        __m512i si[CA_NQ][4];
        for (int n = 0; n < nq; n++)
            for (int c = 0; c < 4; c++) si[n][c] = _mm512_setzero_si512();
        for (int64_t g = 0; g < d / 4; g++) {
            const uint32_t *kr = k8 + g * BI_CHUNK;
            __m512i k[4];
            for (int c = 0; c < nb; c++) {
                k[c] = _mm512_loadu_si512(kr + 16 * c);
                __asm__("" : "+v"(k[c])); /* kept in a register for the nq heads */
            }
            for (int n = 0; n < nq; n++) {
                __m512i qv = _mm512_set1_epi32((int)q8[n * (d / 4) + g]);
                for (int c = 0; c < nb; c++) si[n][c] = ca_dpbusd(si[n][c], qv, k[c]);
            }
        }
        const float *sk = (const float *)(k8 + d / 4 * BI_CHUNK);
        const int32_t *kc = (const int32_t *)(sk + BI_CHUNK);
        for (int c = 0; c < nb; c++) {
            __m512 vk = _mm512_loadu_ps(sk + 16 * c);
            __m512i vc = _mm512_loadu_si512(kc + 16 * c);
            for (int n = 0; n < nq; n++)
                s[n][c] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(si[n][c], vc)), vk);
        }
    } else
#endif
    for (int64_t i = 0; i < d / 2; i++) {
        const uint32_t *kr = kp + i * BI_CHUNK;
        __m512bh k[4];
        for (int c = 0; c < nb; c++) {
            __m512i w = _mm512_loadu_si512(kr + 16 * c);
            __asm__("" : "+v"(w)); /* kept in a register for the nq heads (GCC would reload it per head) */
            k[c] = (__m512bh)w;
        }
        for (int n = 0; n < nq; n++) {
            __m512bh qv = (__m512bh)_mm512_set1_epi32((int)ld_pair(q + n * d + 2 * i));
            for (int c = 0; c < nb; c++) s[n][c] = _mm512_dpbf16_ps(s[n][c], qv, k[c]);
        }
    }
    __mmask16 live[4];
    for (int c = 0; c < 4; c++) {
        int64_t r = nn - 16 * c;
        live[c] = r >= 16 ? (__mmask16)0xffff : (r > 0 ? (__mmask16)((1u << r) - 1u) : (__mmask16)0);
    }
    const __m512 vs = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    const __m512i himask = _mm512_set1_epi32((int)0xffff0000u);
    __m512 ks[4], vsc[4]; /* a quantised pool's key scales (times the softmax scale) and value scales (kvs) */
    for (int c = 0; kvs && c < 4; c++) {
        ks[c] = _mm512_mul_ps(_mm512_loadu_ps(kvs + 16 * c), vs);
        vsc[c] = _mm512_loadu_ps(kvs + BI_CHUNK + 16 * c);
    }
    float a[CA_NQ], ws[CA_NQ];
    for (int n = 0; n < nq; n++) {
        __m512 x[4], vsn = k8 ? _mm512_set1_ps(qs[n]) : vs;
        for (int c = 0; c < 4; c++) x[c] = _mm512_mask_mul_ps(ninf, live[c], s[n][c], kvs && !k8 ? ks[c] : vsn);
        float mc = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(x[0], x[1]), _mm512_max_ps(x[2], x[3])));
        float mo = mx[n], mn = mo > mc ? mo : mc;
        /* fast_expf(0) is exactly 1: skipped where the running max stands (most chunks after the first) */
        a[n] = mo == mn && mo - mo == 0.f ? 1.f : fast_expf(mo - mn);
        __m512 vm = _mm512_set1_ps(mn);
        __m512 e[4];
        for (int c = 0; c < 4; c++) e[c] = _mm512_maskz_mov_ps(live[c], ca_exp16(_mm512_sub_ps(x[c], vm)));
#if defined(__AVX512VNNI__)
        if (k8) { /* P.V on int8 (the section comment of ca_quant_kv8_bf16): codes u_j of w_j = p_j s_vj */
            const float *sv = (const float *)(k8 + CA8_V(d) + BI_CHUNK / 4 * d);
            __m512 w[4];
            for (int c = 0; c < 4; c++) w[c] = _mm512_maskz_mul_ps(live[c], e[c], _mm512_loadu_ps(sv + 16 * c));
            float wm = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(w[0], w[1]), _mm512_max_ps(w[2], w[3])));
            __mmask16 nan = 0; /* a NaN w (a value's NaN scale) makes the chunk's product NaN, as in bf16 */
            for (int c = 0; c < 4; c++) nan |= _mm512_cmp_ps_mask(w[c], w[c], _CMP_UNORD_Q);
            if (nan) wm = NAN;
            float inv = wm > 0.f && wm < INFINITY ? 255.f / wm : 0.f;
            ws[n] = wm / 255.f;
            for (int c = 0; c < 4; c++) {
                __m512i u = _mm512_cvtps_epi32(_mm512_mul_ps(w[c], _mm512_set1_ps(inv)));
                u = _mm512_max_epi32(_mm512_min_epi32(u, _mm512_set1_epi32(255)), _mm512_setzero_si512());
                _mm_storeu_si128((__m128i *)(pb + n * (BI_CHUNK / 4) + 4 * c), _mm512_cvtepi32_epi8(u));
            }
            float lc = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(e[0], e[1]), _mm512_add_ps(e[2], e[3])));
            float la = sm[n] * a[n];
            sm[n] = la + lc;
            mx[n] = mn;
            continue;
        }
#endif
        __m512i w0 = (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]), w1 = (__m512i)_mm512_cvtne2ps_pbh(e[3], e[2]);
        if (kvs) { /* P.V takes p s_v (the values' scales), the sum l the probabilities */
            _mm512_storeu_si512(pb + n * (BI_CHUNK / 2), (__m512i)_mm512_cvtne2ps_pbh(
                _mm512_maskz_mul_ps(live[1], e[1], vsc[1]), _mm512_maskz_mul_ps(live[0], e[0], vsc[0])));
            _mm512_storeu_si512(pb + n * (BI_CHUNK / 2) + 16, (__m512i)_mm512_cvtne2ps_pbh(
                _mm512_maskz_mul_ps(live[3], e[3], vsc[3]), _mm512_maskz_mul_ps(live[2], e[2], vsc[2])));
        } else {
            _mm512_storeu_si512(pb + n * (BI_CHUNK / 2), w0);
            _mm512_storeu_si512(pb + n * (BI_CHUNK / 2) + 16, w1);
        }
        __m512 r0 = _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(w0, 16)),
                                  _mm512_castsi512_ps(_mm512_and_si512(w0, himask)));
        __m512 r1 = _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(w1, 16)),
                                  _mm512_castsi512_ps(_mm512_and_si512(w1, himask)));
        float lc = _mm512_reduce_add_ps(_mm512_add_ps(r0, r1));
        float la = sm[n] * a[n];
        sm[n] = la + lc;
        mx[n] = mn;
    }
    int64_t np = (nn + 1) / 2, i0 = 0;
    int odd = (int)(nn & 1);
#if defined(__AVX512VNNI__)
    if (k8) {
        const uint32_t *vb = k8 + CA8_V(d);
        int64_t nq4 = (nn + 3) / 4;
        for (; i0 + 64 <= d; i0 += 64) ca_pv8_n(pb, vb, nq4, d, i0, a, ws, acc, nq, 4);
        for (; i0 < d; i0 += 32) ca_pv8_n(pb, vb, nq4, d, i0, a, ws, acc, nq, 2);
        return;
    }
#endif
    for (; i0 + 64 <= d; i0 += 64) ca_pv_pp_n(pb, vp, np, odd, d, i0, a, acc, nq, 4);
    for (; i0 < d; i0 += 32) ca_pv_pp_n(pb, vp, np, odd, d, i0, a, acc, nq, 2);
}
#define CA_ROW_PP_NB(NQ)                                                                                  \
    switch (nb) {                                                                                         \
    case 1: ca_row_pp_n(q, d, kp, vp, nn, scale, mx, sm, acc, pb, k8, q8, qs, kvs, NQ, 1); break;         \
    case 2: ca_row_pp_n(q, d, kp, vp, nn, scale, mx, sm, acc, pb, k8, q8, qs, kvs, NQ, 2); break;         \
    case 3: ca_row_pp_n(q, d, kp, vp, nn, scale, mx, sm, acc, pb, k8, q8, qs, kvs, NQ, 3); break;         \
    default: ca_row_pp_n(q, d, kp, vp, nn, scale, mx, sm, acc, pb, k8, q8, qs, kvs, NQ, 4);               \
    }
static void ca_row_pp(const uint16_t *q, int64_t d, const uint32_t *kp, const uint32_t *vp, int64_t nn, float scale,
                      float *mx, float *sm, float *acc, uint32_t *pb, const uint32_t *k8, const uint32_t *q8,
                      const float *qs, const float *kvs, int nq) {
    int nb = (int)((nn + 15) / 16);
    if (nq >= 3) { CA_ROW_PP_NB(3) }
    else if (nq == 2) { CA_ROW_PP_NB(2) }
    else { CA_ROW_PP_NB(1) }
}
/* One task of chunk_attn on the pair paths: rows e0..e1 (entries of rows / limits) of one item (sl: its nkeys
 * slots), kv head kh; kp / vp / acc / mx / sm / pb: the thread's buffers */
static void ca_task_pp_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                            const int64_t *sl, int64_t nkeys, const int64_t *rows, const int64_t *limits, int64_t e0,
                            int64_t e1, int64_t kh, int64_t nh, int64_t nkv, int64_t d, float scale,
                            const ca_state_t *st, const ca_next_t *nx, uint16_t *out, uint32_t *kp, uint32_t *vp,
                            float *acc, float *mx, float *sm, uint32_t *pb, const uint32_t *k8, const ca_q8_t *kvq) {
    int64_t grp = nh / nkv, maxlim = 0, esz = kvq ? 1 : 2; /* bytes per cached element */
    float kvs[2 * BI_CHUNK]; /* a quantised pool's chunk: its keys' K and V scales (ca_gather_pp_bf16) */
    const void *kc = kvq ? (const void *)kvq->k : (const void *)k_cache, *vc = kvq ? (const void *)kvq->v : (const void *)v_cache;
    /* int8 attention: the rows' query codes + 128 (d / 4 words per head) and sq * scale, after pb's CA_NQ
     * x BI_CHUNK / 2 words (the thread's pb buffer holds BI_ATT_ROWS x grp x d words) */
    uint32_t *q8 = pb + CA_NQ * BI_CHUNK / 2;
    float *qs = (float *)(q8 + BI_ATT_ROWS * grp * (d / 4));
    for (int64_t e = e0; e < e1; e++) {
        int64_t lim = limits ? limits[e] : nkeys;
        if (lim > maxlim) maxlim = lim;
        int ld = ca_loads(st, rows[e], nkv, kh);
        for (int64_t g = 0; g < grp; g++) {
            int64_t hd = kh * grp + g, si = (e - e0) * grp + g;
            if (k8) qs[si] = ca_quant_q8(q + rows[e] * q_stride + hd * d, d, q8 + si * (d / 4)) * scale;
            mx[si] = ld ? st->m[rows[e] * nh + hd] : -INFINITY;
            sm[si] = ld ? st->l[rows[e] * nh + hd] : 0.f;
            if (ld) memcpy(acc + si * d, st->acc + (rows[e] * nh + hd) * d, sizeof(float) * (size_t)d);
            else memset(acc + si * d, 0, sizeof(float) * (size_t)d);
        }
    }
    for (int64_t c0 = 0; c0 < maxlim; c0 += BI_CHUNK) {
        int64_t c1 = c0 + BI_CHUNK < maxlim ? c0 + BI_CHUNK : maxlim;
        const uint32_t *kb = k8 ? k8 + (c0 / BI_CHUNK * nkv + kh) * CA8_WORDS(d) : NULL;
        if (!kb) ca_gather_pp_bf16(k_cache, v_cache, sl + c0, c1 - c0, nkv * d, kh * d, d, kp, vp, kvq, kvs);
        if (c1 < maxlim) {
            ca_prefetch(kc, vc, sl + c1, (maxlim - c1 < BI_CHUNK ? maxlim - c1 : BI_CHUNK), esz * nkv * d,
                        esz * kh * d, esz * d);
            ca_prefetch_scales(kvq, sl + c1, (maxlim - c1 < BI_CHUNK ? maxlim - c1 : BI_CHUNK));
        } else if (nx && nx->sl) {
            ca_prefetch(kc, vc, nx->sl, nx->n, esz * nkv * d, esz * nx->off, esz * d);
            ca_prefetch_scales(kvq, nx->sl, nx->n);
        }
        for (int64_t e = e0; e < e1; e++) {
            int64_t lim = limits ? limits[e] : nkeys;
            if (lim <= c0) continue;
            int64_t nn = (lim < c1 ? lim : c1) - c0;
            for (int64_t g0 = 0; g0 < grp; g0 += CA_NQ) {
                int64_t si = (e - e0) * grp + g0;
                const uint16_t *qr = q + rows[e] * q_stride + (kh * grp + g0) * d;
                ca_row_pp(qr, d, kp, vp, nn, scale, mx + si, sm + si, acc + si * d, pb, kb, q8 + si * (d / 4),
                          qs + si, kvq && !kb ? kvs : NULL, (int)(grp - g0));
            }
            if (nx) ca_bg_prefetch(nx->bg, kc, vc, CA_BG_KEYS);
        }
    }
    for (int64_t e = e0; e < e1; e++)
        for (int64_t g = 0; g < grp; g++) {
            int64_t hd = kh * grp + g, si = (e - e0) * grp + g;
            const float *ar = acc + si * d;
            if (st->store) {
                st->m[rows[e] * nh + hd] = mx[si];
                st->l[rows[e] * nh + hd] = sm[si];
                memcpy(st->acc + (rows[e] * nh + hd) * d, ar, sizeof(float) * (size_t)d);
                if (st->has && g == 0) st->has[rows[e] * nkv + kh] = 1;
            } else {
                float l = sm[si];
                uint16_t *o = out + (rows[e] * nh + hd) * d;
                __m512 vl = _mm512_set1_ps(l);
                for (int64_t i = 0; i < d; i += 16)
                    bi_store_bf16x16(o + i, l > 0.f ? _mm512_div_ps(_mm512_loadu_ps(ar + i), vl) : _mm512_setzero_ps(),
                                     (__mmask16)0xffff);
            }
        }
}
/* The epilogue of every tile: out = bf16(acc + bias) (no add without a bias) for the columns below n */
static inline void bi_dp_out(__m512 acc, const uint16_t *bias, int64_t col, int64_t n, uint16_t *out) {
    __mmask16 mask = n - col >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - col)) - 1u);
    if (bias)
        acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, (const __m256i *)(bias + col))), 16)));
    bi_store_bf16x16(out + col, acc, mask);
}
/* MR rows x NP panels from panel p0: acc[r][p] = the pair chain (the section comment) */
static inline __attribute__((always_inline)) void bi_dp_tile(const uint16_t *x, int64_t ldx, const uint16_t *wp,
                                                             int64_t k, int64_t p0, const int mr, const int np,
                                                             const uint16_t *bias, int64_t n, uint16_t *out,
                                                             int64_t ldo) {
    __m512 a[BI_DP_MR][8];
    for (int r = 0; r < mr; r++)
        for (int p = 0; p < np; p++) a[r][p] = _mm512_setzero_ps();
    const int64_t k2 = k / 2;
    const uint16_t *w = wp + p0 * k * BI_PANEL;
    for (int64_t kk = 0; kk < k2; kk++) {
        __m512bh wv[8];
        for (int p = 0; p < np; p++) wv[p] = (__m512bh)_mm512_loadu_si512(w + (p * k2 + kk) * 2 * BI_PANEL);
        for (int r = 0; r < mr; r++) {
            __m512bh xv = (__m512bh)_mm512_set1_epi32((int)ld_pair(x + r * ldx + 2 * kk));
            for (int p = 0; p < np; p++) a[r][p] = _mm512_dpbf16_ps(a[r][p], xv, wv[p]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int p = 0; p < np; p++) {
            int64_t col = (p0 + p) * BI_PANEL;
            if (col < n) bi_dp_out(a[r][p], bias, col, n, out + r * ldo);
        }
}
/* MR rows from r over the group's panels [p0, p1), NPW panels per tile (the last ones one at a time) */
#define BI_DP_STRIP(MR, NPW)                                                                                   \
    do {                                                                                                       \
        int64_t p = p0;                                                                                        \
        for (; p + (NPW) <= p1; p += (NPW))                                                                    \
            bi_dp_tile(x + r * ldx, ldx, wp, k, p, MR, NPW, bias, n, out + r * ldo, ldo);                      \
        for (; p < p1; p++) bi_dp_tile(x + r * ldx, ldx, wp, k, p, MR, 1, bias, n, out + r * ldo, ldo);        \
    } while (0)
/* bi_linear for bf16 with k even (bi_linear_pack_bf16 packed pairs): tiles of BI_DP_MR rows x BI_DP_NP
 * panels; 2-5 rows left over as one strip (so a batch of 2-5 rows streams the weights once, not once per
 * row: 4 rows cost 1.45x 6 before), a last single row across 8 panels (a decode row streams 8 panels
 * side by side). Tiles only group elements: each is still its own chain from zero over k, the same bits.
 * Threads split (row block, group of 8 panels) pairs. Always returns 1 (no buffers). */
static int bi_linear_dp_bf16(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *wp, int64_t n,
                             const uint16_t *bias, uint16_t *out, int64_t ldo) {
    int64_t np = (n + BI_PANEL - 1) / BI_PANEL, ngroups = (np + 7) / 8, nrb = (m + BI_ROWS - 1) / BI_ROWS;
#pragma omp parallel for collapse(2) schedule(static) if (m * k * n >= 16 * PAR_MIN_WORK)
    for (int64_t rb = 0; rb < nrb; rb++)
        for (int64_t gi = 0; gi < ngroups; gi++) {
            int64_t r0 = rb * BI_ROWS, r1 = r0 + BI_ROWS < m ? r0 + BI_ROWS : m;
            int64_t p0 = gi * 8, p1 = p0 + 8 < np ? p0 + 8 : np, r = r0;
            for (; r + BI_DP_MR <= r1; r += BI_DP_MR) {
                int64_t p = p0;
                for (; p + BI_DP_NP <= p1; p += BI_DP_NP)
                    bi_dp_tile(x + r * ldx, ldx, wp, k, p, BI_DP_MR, BI_DP_NP, bias, n, out + r * ldo, ldo);
                for (; p < p1; p++) bi_dp_tile(x + r * ldx, ldx, wp, k, p, BI_DP_MR, 1, bias, n, out + r * ldo, ldo);
            }
            switch (r1 - r) {  /* accumulators + weight panels within the 32 zmm */
            case 5: BI_DP_STRIP(5, 4); r += 5; break;
            case 4: BI_DP_STRIP(4, 4); r += 4; break;
            case 3: BI_DP_STRIP(3, 4); r += 3; break;
            case 2: BI_DP_STRIP(2, 8); r += 2; break;
            default: break;
            }
            for (; r < r1; r++) {
                if (p1 - p0 == 8) bi_dp_tile(x + r * ldx, ldx, wp, k, p0, 1, 8, bias, n, out + r * ldo, ldo);
                else for (int64_t p = p0; p < p1; p++) bi_dp_tile(x + r * ldx, ldx, wp, k, p, 1, 1, bias, n, out + r * ldo, ldo);
            }
        }
    return 1;
}
/* w [n, k] -> pairs per panel [k / 2][BI_PANEL][2], zero past column n (k even) */
static void bi_linear_pack_dp_bf16(const uint16_t *w, int64_t n, int64_t k, uint16_t *wp) {
    int64_t np = (n + BI_PANEL - 1) / BI_PANEL;
#pragma omp parallel for if (n * k >= PAR_MIN_WORK)
    for (int64_t p = 0; p < np; p++)
        for (int64_t kk = 0; kk < k / 2; kk++)
            for (int64_t c = 0; c < BI_PANEL; c++)
                for (int h = 0; h < 2; h++) {
                    int64_t col = p * BI_PANEL + c;
                    wp[((p * (k / 2) + kk) * BI_PANEL + c) * 2 + h] = col < n ? w[col * k + 2 * kk + h] : 0;
                }
}
#define BI_DP_LINEAR_bf16(...) if (k % 2 == 0) return bi_linear_dp_bf16(__VA_ARGS__);
#define BI_DP_PACK_bf16(...) if (k % 2 == 0) { bi_linear_pack_dp_bf16(__VA_ARGS__); return; }
#else
CA_PP_STUB(uint16_t, bf16)
#define BI_DP_LINEAR_bf16(...)
#define BI_DP_PACK_bf16(...)
#endif
/* float32 never takes the pair paths */
CA_PP_STUB(float, f32)
#define BI_DP_LINEAR_f32(...)
#define BI_DP_PACK_f32(...)
/* ---- end of the AVX-512 BF16 batch-invariant block ---- */

/* ---- Batch-invariant GGUF Q4_1 x bfloat16 on AVX-512 BF16 (helper H3, issue 11) ---------------------
 * Deterministic inference with Q4_1 weights (the bundled model's) and bfloat16 activations. Per output
 * element, one chain whatever the number of rows: for each block b of 32 input features in order,
 * t = VDPBF16PS chain over the block's 16 pairs (x[2i], x[2i+1]) . (code[2i], code[2i+1]) from 0 (codes
 * 0..15 are exact in bf16, products exact), then acc = fma(d_b, t, acc), acc = fma(m_b, sx_b, acc) with
 * sx_b = the block's 32 x values summed in float32 in order; out = bf16(acc + bias). So w = d q + m is
 * used exactly (as q41_linear), not rounded to bf16. bi_q41_pack lays a weight out once per panel of 16
 * columns and block: d[16], m[16] (float16), then 16 pair steps of 16 bytes (byte c: code 2s of column c
 * in the low nibble, code 2s + 1 in the high one): BQ_PB bytes. A thread task (a block of rows, a group of
 * BQ_GP panels) decodes its group to bf16 pairs in its buffer once and runs its rows over it in BQ_MR x BQ_NP
 * register tiles (block chains and their sums both in registers; shorter strips and fewer panels at the
 * edges: the same chains). Row blocks are sized so their x rows stay in L2 while a thread's tasks cycle
 * through the groups. The tiling only decides which elements are computed together, never an element's
 * chain, so every row's bits are the same in any batch (tests/test_kernels_portable.py). */
#define BQ_PB 320     /* bytes per (panel, block) in bi_q41_pack's layout */
#define BQ_GP 8       /* panels per thread task */
#define BQ_ROWS 96    /* fewest rows per thread task in a large batch (each task decodes its group once) */
#define BQ_XBYTES 393216 /* bytes of x rows per thread task in a large batch: about half of a 1 MiB L2 */
#define BQ_MR 7       /* register tile: rows x panels of 16 columns (14 block chains + 14 sums in zmm) */
#define BQ_NP 2
/* the rows left after the full BQ_MR-row strips (1 .. BQ_MR - 1) in one strip of their own height, not row by
 * row: STRIP(rows, panels per tile), bq_rows' and bz_rows' strip macros */
#define BQ_LAST_ROWS(LEFT, STRIP)                                                                                 \
    switch (LEFT) {                                                                                               \
    case 1: STRIP(1, 4) break;                                                                                    \
    case 2: STRIP(2, 4) break;                                                                                    \
    case 3: STRIP(3, 4) break;                                                                                    \
    case 4: STRIP(4, BQ_NP) break;                                                                                \
    case 5: STRIP(5, BQ_NP) break;                                                                                \
    case 6: STRIP(6, BQ_NP) break;                                                                                \
    default: break;                                                                                               \
    }
_Static_assert(BQ_MR == 7, "BQ_LAST_ROWS covers 1 .. 6 rows left");
void bi_q41_pack(const uint8_t *qs, const uint16_t *d, const uint16_t *mm, int64_t n, int64_t k, uint8_t *out) {
    int64_t nb = k / 32, np = (n + 15) / 16;
#pragma omp parallel for if (n * k >= PAR_MIN_WORK)
    for (int64_t p = 0; p < np; p++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *o = out + (p * nb + b) * BQ_PB;
            uint16_t dm[32];
            for (int c = 0; c < 16; c++) {
                int64_t col = p * 16 + c;
                const uint8_t *q = qs + (col * nb + b) * 16;
                dm[c] = col < n ? d[col * nb + b] : 0;
                dm[16 + c] = col < n ? mm[col * nb + b] : 0;
                for (int s = 0; s < 16; s++) {
                    int i0 = 2 * s, i1 = 2 * s + 1; /* GGUF: code i < 16 in byte i's low nibble, else byte i - 16's high */
                    uint8_t c0 = col < n ? (i0 < 16 ? q[i0] & 15 : q[i0 - 16] >> 4) : 0;
                    uint8_t c1 = col < n ? (i1 < 16 ? q[i1] & 15 : q[i1 - 16] >> 4) : 0;
                    o[64 + s * 16 + c] = (uint8_t)(c0 | c1 << 4);
                }
            }
            memcpy(o, dm, 64);
        }
}
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
int bi_q41_available(void) { return 1; }
static inline __attribute__((always_inline)) void bq_tile(const uint16_t *x, int64_t ldx, const float *sx, int64_t nb,
                                                          const uint32_t *wb, const float *dmf, int64_t q0,
                                                          const int mr, const int npl, const uint16_t *bias,
                                                          int64_t col0, int64_t n, uint16_t *out, int64_t ldo) {
    __m512 acc[BQ_MR][4], t[BQ_MR][4]; /* both in registers: the block chains and their sums */
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < npl; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        for (int r = 0; r < mr; r++)
            for (int j = 0; j < npl; j++) t[r][j] = _mm512_setzero_ps();
        for (int s = 0; s < 16; s++) {
            __m512bh w[4];
            for (int j = 0; j < npl; j++) w[j] = (__m512bh)_mm512_loadu_si512(wb + (((q0 + j) * nb + b) * 16 + s) * 16);
            for (int r = 0; r < mr; r++) {
                __m512bh xv = (__m512bh)_mm512_set1_epi32((int)ld_pair(x + r * ldx + (b * 16 + s) * 2));
                for (int j = 0; j < npl; j++) t[r][j] = _mm512_dpbf16_ps(t[r][j], xv, w[j]);
            }
        }
        for (int j = 0; j < npl; j++) {
            __m512 dv = _mm512_loadu_ps(dmf + ((q0 + j) * nb + b) * 32), mv = _mm512_loadu_ps(dmf + ((q0 + j) * nb + b) * 32 + 16);
            for (int r = 0; r < mr; r++)
                acc[r][j] = _mm512_fmadd_ps(mv, _mm512_set1_ps(sx[r * nb + b]), _mm512_fmadd_ps(dv, t[r][j], acc[r][j]));
        }
    }
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < npl; j++) {
            int64_t col = col0 + (q0 + j) * 16;
            if (col < n) bi_dp_out(acc[r][j], bias, col, n, out + r * ldo);
        }
}
/* MR rows (1..BQ_MR) across a group's npg panels: tiles of NP panels (MR x NP block chains and as many sums in
 * registers; short strips take more panels, so a tile still has enough independent chains), then 2, then 1 */
#define BQ_STRIP(MR, NP)                                                                                          \
    {                                                                                                             \
        int64_t q = 0;                                                                                            \
        for (; q + (NP) <= npg; q += (NP))                                                                        \
            bq_tile(x + r * ldx, ldx, sx + r * nb, nb, wb, dmf, q, MR, NP, bias, col0, n, out + r * ldo, ldo);      \
        if ((NP) > 2 && q + 2 <= npg) {                                                                           \
            bq_tile(x + r * ldx, ldx, sx + r * nb, nb, wb, dmf, q, MR, 2, bias, col0, n, out + r * ldo, ldo);       \
            q += 2;                                                                                               \
        }                                                                                                         \
        for (; q < npg; q++)                                                                                      \
            bq_tile(x + r * ldx, ldx, sx + r * nb, nb, wb, dmf, q, MR, 1, bias, col0, n, out + r * ldo, ldo);       \
    }
static void bq_rows(const uint16_t *x, int64_t ldx, const float *sx, int64_t nb, const uint32_t *wb, const float *dmf,
                    int64_t npg, const uint16_t *bias, int64_t col0, int64_t n, uint16_t *out, int64_t ldo,
                    int64_t r, int64_t r1) {
    for (; r + BQ_MR <= r1; r += BQ_MR) BQ_STRIP(BQ_MR, BQ_NP)
    BQ_LAST_ROWS(r1 - r, BQ_STRIP)
}
#undef BQ_STRIP
/* sx[r * nb + b] = block b of row r's 32 x values summed in float32 in order (0 + x0 + x1 + ... + x31): 16
 * blocks at a time, one per lane, after a 16 x 16 transpose of their 32-bit words (x pairs); the same adds in the
 * same order as the scalar loop of the remaining blocks */
static void bq_block_sums(const uint16_t *x, int64_t m, int64_t nb, int64_t ldx, float *sx) {
    int64_t total = m * nb, f = 0;
    for (; f + 16 <= total; f += 16) {
        __m512i w[16];
        for (int j = 0; j < 16; j++) {
            int64_t g = f + j;
            w[j] = _mm512_loadu_si512(x + (g / nb) * ldx + (g % nb) * 32);
        }
        ca_transpose16_epi32(w); /* w[c] lane j: the pair (x[2c], x[2c + 1]) of block f + j */
        __m512 s = _mm512_setzero_ps();
        for (int c = 0; c < 16; c++) {
            s = _mm512_add_ps(s, _mm512_castsi512_ps(_mm512_slli_epi32(w[c], 16)));
            s = _mm512_add_ps(s, _mm512_castsi512_ps(_mm512_and_si512(w[c], _mm512_set1_epi32((int)0xffff0000u))));
        }
        _mm512_storeu_ps(sx + f, s);
    }
    for (; f < total; f++) {
        const uint16_t *p = x + (f / nb) * ldx + (f % nb) * 32;
        float s = 0.f;
        for (int i = 0; i < 32; i++) s += bf16_to_f32(p[i]);
        sx[f] = s;
    }
}
/* rows per row block of a thread task (the section comment; ng groups of panels, nt threads): about
 * BQ_XBYTES of x (at least BQ_ROWS rows), fewer where the groups alone would leave threads idle, a whole
 * number of BQ_MR-row strips */
static int64_t bq_block_rows(int64_t m, int64_t k, int64_t ng, int par, int nt) {
    int64_t most_rows = BQ_XBYTES / (2 * k) > BQ_ROWS ? BQ_XBYTES / (2 * k) : BQ_ROWS; /* k >= 32 */
    int64_t nrb = (m + most_rows - 1) / most_rows;
    if (par && ng * nrb < 2 * nt) { /* too few tasks for the threads: smaller row blocks, down to 48 rows */
        int64_t want = (2 * nt + ng - 1) / ng, most = (m + 47) / 48;
        nrb = want < most ? want : most;
        if (nrb < 1) nrb = 1;
    }
    if (par && (ng * nrb) % nt) { /* a multiple of the threads where a few more blocks make one */
        int64_t e = nrb;
        while (e < nrb + nt && (ng * e) % nt) e++;
        if ((ng * e) % nt == 0 && (m + e - 1) / e >= 48) nrb = e;
    }
    int64_t rows = (m + nrb - 1) / nrb;
    return (rows + BQ_MR - 1) / BQ_MR * BQ_MR; /* whole register strips (the tail strip: the last block's) */
}
/* out [m, n] (rows ldo apart) = x [m, k] (bf16 rows ldx apart) W^T (+ bias), W from bi_q41_pack; k a
 * multiple of 32. Returns 0 when buffers cannot be allocated, else 1. Thread tasks: (row block, group of
 * BQ_GP panels), row blocks outer, so a thread's consecutive tasks share their x rows; a row block holds
 * about BQ_XBYTES of x (at least BQ_ROWS rows), fewer rows where the groups alone would leave threads idle,
 * a whole number of BQ_MR-row strips. */
int bi_q41_linear(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint8_t *wp, int64_t n,
                  const uint16_t *bias, uint16_t *out, int64_t ldo) {
    int64_t nb = k / 32, np = (n + 15) / 16, gp = BQ_GP, ng = (np + gp - 1) / gp;
    int par = m * k * n >= 16 * PAR_MIN_WORK, nt = MAX_THREADS();
    int64_t rows = bq_block_rows(m, k, ng, par, nt), nrb = (m + rows - 1) / rows;
    float *sx = (float *)malloc(sizeof(float) * (size_t)(m * nb));
    size_t per = (size_t)gp * (size_t)nb * (16 * 16 * 4 + 32 * 4); /* bf16 pairs + d, m as float32 */
    uint8_t *buf_all = (uint8_t *)malloc(per * (size_t)nt + 64);
    if (!sx || !buf_all) { free(sx); free(buf_all); return 0; }
    bq_block_sums(x, m, nb, ldx, sx);
    __m512i lut;
    {
        uint16_t l[32];
        for (int i = 0; i < 32; i++) l[i] = f32_to_bf16((float)(i & 15));
        lut = _mm512_loadu_si512(l);
    }
#pragma omp parallel if (par)
    {
    uint32_t *wb = (uint32_t *)(buf_all + per * (size_t)THREAD_ID());
    float *dmf = (float *)(wb + (size_t)gp * nb * 16 * 16);
#pragma omp for collapse(2) schedule(static)
    for (int64_t rb = 0; rb < nrb; rb++)
        for (int64_t gi = 0; gi < ng; gi++) {
            int64_t p0 = gi * gp, npg = np - p0 < gp ? np - p0 : gp;
            for (int64_t q = 0; q < npg; q++)
                for (int64_t b = 0; b < nb; b++) {
                    const uint8_t *src = wp + ((p0 + q) * nb + b) * BQ_PB;
                    _mm512_storeu_ps(dmf + (q * nb + b) * 32, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)src)));
                    _mm512_storeu_ps(dmf + (q * nb + b) * 32 + 16, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + 32))));
                    for (int s = 0; s < 16; s++) {
                        __m512i tt = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(src + 64 + 16 * s)));
                        __m512i w = _mm512_or_si512(_mm512_and_si512(tt, _mm512_set1_epi32(15)),
                                                    _mm512_slli_epi32(_mm512_srli_epi32(tt, 4), 16));
                        _mm512_storeu_si512(wb + ((q * nb + b) * 16 + s) * 16, _mm512_permutexvar_epi16(w, lut));
                    }
                }
            int64_t r0 = rb * rows, r1 = r0 + rows < m ? r0 + rows : m;
            bq_rows(x, ldx, sx, nb, wb, dmf, npg, bias, p0 * 16, n, out, ldo, r0, r1);
        }
    }
    free(sx);
    free(buf_all);
    return 1;
}
#else
int bi_q41_available(void) { return 0; }
int bi_q41_linear(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint8_t *wp, int64_t n,
                  const uint16_t *bias, uint16_t *out, int64_t ldo) { return 0; }
#endif
/* ---- end of the batch-invariant GGUF Q4_1 block ---- */

/* ---- Batch-invariant GGUF Q8_0 x bfloat16 on AVX-512 BF16 (issue 15/14: the bundled model's lm_head) ----
 * bi_q41_linear's scheme for Q8_0 blocks (int8 codes, float16 step d; w = d code). Per output element, one
 * chain whatever the number of rows: for each block b of 32 input features in order, t = VDPBF16PS chain
 * over the block's 16 pairs (x[2i], x[2i+1]) . (code[2i], code[2i+1]) from 0 (codes -127..127 are exact in
 * bf16, their products with bf16 x exact in float32), then acc = fma(d_b, t, acc); out = bf16(acc + bias).
 * bi_q80_pack lays a weight out once per panel of 16 columns and block: d[16] (float16), then 16 pair steps
 * s of 32 bytes: columns 0..7's codes (2s, 2s + 1) in bytes 0..15, columns 8..15's in bytes 16..31, so
 * two sign extensions, two int -> float conversions and one VCVTNE2PS2BF16 turn a step into the 16 bf16
 * pairs of its columns (bz_step): BZ_PB bytes, as many as GGUF's blocks (any int8 code, -128 too; zero past
 * column n). Up to BZ_REG_ROWS rows (decode) the steps are decoded in registers and applied at once
 * (bz_rtile, tasks: groups of BQ_GP panels, each tile prefetching the next one's bytes into L2); more rows
 * run bi_q41_linear's tasks (row block, group of panels): the group decoded to bf16 pairs once in a
 * thread's buffer, its rows over it in BQ_MR x BQ_NP register tiles (bz_tile), the first strip prefetching
 * the next group's packed bytes into L2 (so the decode reads L2, not memory). Every path runs the same
 * chains, so a row's bits never depend on the batch (tests/test_bi_q80.py). Prefetches may run past the
 * packed weight's end (they never fault). */
#define BZ_PB 544      /* bytes per (panel, block) in bi_q80_pack's layout */
#define BZ_REG_ROWS 3  /* most rows decoded in registers (bz_rtile) rather than into a buffer */
void bi_q80_pack(const int8_t *q, const uint16_t *d, int64_t n, int64_t k, uint8_t *out) {
    int64_t nb = k / 32, np = (n + 15) / 16;
#pragma omp parallel for if (n * k >= PAR_MIN_WORK)
    for (int64_t p = 0; p < np; p++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *o = out + (p * nb + b) * BZ_PB;
            uint16_t dd[16];
            for (int c = 0; c < 16; c++) {
                int64_t col = p * 16 + c;
                dd[c] = col < n ? d[col * nb + b] : 0;
                for (int i = 0; i < 32; i++) /* code i of the block: step i / 2, half i % 2 */
                    o[32 + 32 * (i / 2) + 16 * (c / 8) + 2 * (c % 8) + i % 2] = col < n ? (uint8_t)q[(col * nb + b) * 32 + i] : 0;
            }
            memcpy(o, dd, 32);
        }
}
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
int bi_q80_available(void) { return 1; }
/* one step of bi_q80_pack's layout (32 bytes at p) -> the 16 columns' bf16 pairs (lane c: column c) */
static inline __attribute__((always_inline)) __m512bh bz_step(const uint8_t *p) {
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);
}
/* decoded rows (a thread's buffer): wb the pairs [panel][block][step][16 columns], df the steps [panel][block][16]
 * as float32; mr rows x npl panels from panel q0 of the group */
static inline __attribute__((always_inline)) void bz_tile(const uint16_t *x, int64_t ldx, int64_t nb, const uint32_t *wb,
                                                          const float *df, int64_t q0, const int mr, const int npl,
                                                          const uint16_t *bias, int64_t col0, int64_t n, uint16_t *out,
                                                          int64_t ldo, const uint8_t *pf, int64_t pfb) {
    __m512 acc[BQ_MR][4], t[BQ_MR][4];
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < npl; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        if (pf) /* the next task's packed weight into L2 while this one computes (pfb bytes per block) */
            for (int64_t i = 0; i < pfb; i += 64) _mm_prefetch((const char *)pf + b * pfb + i, _MM_HINT_T1);
        for (int r = 0; r < mr; r++)
            for (int j = 0; j < npl; j++) t[r][j] = _mm512_setzero_ps();
        for (int s = 0; s < 16; s++) {
            __m512bh w[4];
            for (int j = 0; j < npl; j++) w[j] = (__m512bh)_mm512_loadu_si512(wb + (((q0 + j) * nb + b) * 16 + s) * 16);
            for (int r = 0; r < mr; r++) {
                __m512bh xv = (__m512bh)_mm512_set1_epi32((int)ld_pair(x + r * ldx + (b * 16 + s) * 2));
                for (int j = 0; j < npl; j++) t[r][j] = _mm512_dpbf16_ps(t[r][j], xv, w[j]);
            }
        }
        for (int j = 0; j < npl; j++) {
            __m512 dv = _mm512_loadu_ps(df + ((q0 + j) * nb + b) * 16);
            for (int r = 0; r < mr; r++) acc[r][j] = _mm512_fmadd_ps(dv, t[r][j], acc[r][j]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < npl; j++) {
            int64_t col = col0 + (q0 + j) * 16;
            if (col < n) bi_dp_out(acc[r][j], bias, col, n, out + r * ldo);
        }
}
/* the same chains with the steps decoded in registers from the packed weight: mr rows x npl panels from
 * panel p0 (wp: bi_q80_pack's layout) */
static inline __attribute__((always_inline)) void bz_rtile(const uint16_t *x, int64_t ldx, int64_t nb, const uint8_t *wp,
                                                           int64_t p0, const int mr, const int npl,
                                                           const uint16_t *bias, int64_t n, uint16_t *out,
                                                           int64_t ldo) {
    __m512 acc[BZ_REG_ROWS][8], t[BZ_REG_ROWS][8];
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < npl; j++) acc[r][j] = _mm512_setzero_ps();
    const uint8_t *pf = wp + (p0 + npl) * nb * BZ_PB; /* the next tile's bytes, a block's share per block */
    for (int64_t b = 0; b < nb; b++) {
        for (int64_t i = 0; i < npl * BZ_PB; i += 64) _mm_prefetch((const char *)pf + b * npl * BZ_PB + i, _MM_HINT_T1);
        for (int r = 0; r < mr; r++)
            for (int j = 0; j < npl; j++) t[r][j] = _mm512_setzero_ps();
        for (int s = 0; s < 16; s++) {
            __m512bh xv[BZ_REG_ROWS];
            for (int r = 0; r < mr; r++) xv[r] = (__m512bh)_mm512_set1_epi32((int)ld_pair(x + r * ldx + (b * 16 + s) * 2));
            for (int j = 0; j < npl; j++) {
                __m512bh w = bz_step(wp + ((p0 + j) * nb + b) * BZ_PB + 32 + 32 * s);
                for (int r = 0; r < mr; r++) t[r][j] = _mm512_dpbf16_ps(t[r][j], xv[r], w);
            }
        }
        for (int j = 0; j < npl; j++) {
            __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wp + ((p0 + j) * nb + b) * BZ_PB)));
            for (int r = 0; r < mr; r++) acc[r][j] = _mm512_fmadd_ps(dv, t[r][j], acc[r][j]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < npl; j++) {
            int64_t col = (p0 + j) * 16;
            if (col < n) bi_dp_out(acc[r][j], bias, col, n, out + r * ldo);
        }
}
/* MR rows (1..BQ_MR) from r across a group's npg panels: tiles of NP panels, then 2, then 1 (as BQ_STRIP);
 * the strip of row r0 (the task's first) prefetches pfn bytes at pf over its tiles' blocks */
#define BZ_STRIP(MR, NP)                                                                                          \
    {                                                                                                             \
        int64_t q = 0, nt = npg / (NP) + ((NP) > 2 && npg % (NP) >= 2) + ((NP) > 2 ? npg % 2 : npg % (NP)), ti = 0; \
        int64_t pfb = pf && r == r0 ? ((pfn + nt * nb - 1) / (nt * nb) + 63) / 64 * 64 : 0;                       \
        for (; q + (NP) <= npg; q += (NP), ti++)                                                                  \
            bz_tile(x + r * ldx, ldx, nb, wb, df, q, MR, NP, bias, col0, n, out + r * ldo, ldo,                   \
                    pfb ? pf + ti * nb * pfb : NULL, pfb);                                                        \
        if ((NP) > 2 && q + 2 <= npg) {                                                                           \
            bz_tile(x + r * ldx, ldx, nb, wb, df, q, MR, 2, bias, col0, n, out + r * ldo, ldo,                    \
                    pfb ? pf + ti * nb * pfb : NULL, pfb);                                                        \
            q += 2, ti++;                                                                                         \
        }                                                                                                         \
        for (; q < npg; q++, ti++)                                                                                \
            bz_tile(x + r * ldx, ldx, nb, wb, df, q, MR, 1, bias, col0, n, out + r * ldo, ldo,                    \
                    pfb ? pf + ti * nb * pfb : NULL, pfb);                                                        \
    }
static void bz_rows(const uint16_t *x, int64_t ldx, int64_t nb, const uint32_t *wb, const float *df, int64_t npg,
                    const uint16_t *bias, int64_t col0, int64_t n, uint16_t *out, int64_t ldo, int64_t r0, int64_t r1,
                    const uint8_t *pf, int64_t pfn) {
    int64_t r = r0;
    for (; r + BQ_MR <= r1; r += BQ_MR) BZ_STRIP(BQ_MR, BQ_NP)
    BQ_LAST_ROWS(r1 - r, BZ_STRIP)
}
#undef BZ_STRIP
/* rows r0 .. r0 + mr (1..BZ_REG_ROWS) over panels [p0, p1), decoded in registers: NP panels per tile, then 1 */
#define BZ_RSTRIP(MR, NP)                                                                                         \
    {                                                                                                             \
        int64_t p = p0;                                                                                           \
        for (; p + (NP) <= p1; p += (NP)) bz_rtile(x + r0 * ldx, ldx, nb, wp, p, MR, NP, bias, n, out + r0 * ldo, ldo); \
        for (; p < p1; p++) bz_rtile(x + r0 * ldx, ldx, nb, wp, p, MR, 1, bias, n, out + r0 * ldo, ldo);         \
    }
static void bz_rrows(const uint16_t *x, int64_t ldx, int64_t nb, const uint8_t *wp, int64_t p0, int64_t p1,
                     const uint16_t *bias, int64_t n, uint16_t *out, int64_t ldo, int64_t r0, int mr) {
    switch (mr) {
    case 3: BZ_RSTRIP(3, 4) break;
    case 2: BZ_RSTRIP(2, 4) break;
    default: BZ_RSTRIP(1, 4) break;
    }
}
#undef BZ_RSTRIP
/* out [m, n] (rows ldo apart) = x [m, k] (bf16 rows ldx apart) W^T (+ bias), W from bi_q80_pack; k a
 * multiple of 32. Returns 0 when buffers cannot be allocated, else 1. */
int bi_q80_linear(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint8_t *wp, int64_t n,
                  const uint16_t *bias, uint16_t *out, int64_t ldo) {
    int64_t nb = k / 32, np = (n + 15) / 16, gp = BQ_GP, ng = (np + gp - 1) / gp;
    int par = m * k * n >= 16 * PAR_MIN_WORK, nt = MAX_THREADS();
    if (m <= BZ_REG_ROWS) {
#pragma omp parallel for schedule(static) if (m * k * n >= PAR_MIN_WORK)
        for (int64_t gi = 0; gi < ng; gi++) {
            int64_t p0 = gi * gp, p1 = p0 + gp < np ? p0 + gp : np;
            bz_rrows(x, ldx, nb, wp, p0, p1, bias, n, out, ldo, 0, (int)m);
        }
        return 1;
    }
    int64_t rows = bq_block_rows(m, k, ng, par, nt), nrb = (m + rows - 1) / rows;
    size_t per = (size_t)gp * (size_t)nb * (16 * 16 * 4 + 16 * 4); /* bf16 pairs + d as float32 */
    uint8_t *buf_all = (uint8_t *)malloc(per * (size_t)nt + 64);
    if (!buf_all) return 0;
#pragma omp parallel if (par)
    {
    uint32_t *wb = (uint32_t *)(buf_all + per * (size_t)THREAD_ID());
    float *df = (float *)(wb + (size_t)gp * nb * 16 * 16);
#pragma omp for collapse(2) schedule(static)
    for (int64_t rb = 0; rb < nrb; rb++)
        for (int64_t gi = 0; gi < ng; gi++) {
            int64_t p0 = gi * gp, npg = np - p0 < gp ? np - p0 : gp;
            for (int64_t q = 0; q < npg; q++)
                for (int64_t b = 0; b < nb; b++) {
                    const uint8_t *src = wp + ((p0 + q) * nb + b) * BZ_PB;
                    _mm512_storeu_ps(df + (q * nb + b) * 16, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)src)));
                    for (int s = 0; s < 16; s++)
                        _mm512_storeu_si512(wb + ((q * nb + b) * 16 + s) * 16, (__m512i)bz_step(src + 32 + 32 * s));
                }
            int64_t r0 = rb * rows, r1 = r0 + rows < m ? r0 + rows : m, g1 = gi + 1 < ng ? gi + 1 : 0;
            int64_t np1 = np - g1 * gp < gp ? np - g1 * gp : gp; /* the next group's panels */
            bz_rows(x, ldx, nb, wb, df, npg, bias, p0 * 16, n, out, ldo, r0, r1, wp + g1 * gp * nb * BZ_PB,
                    np1 * nb * BZ_PB);
        }
    }
    free(buf_all);
    return 1;
}
#else
int bi_q80_available(void) { return 0; }
int bi_q80_linear(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint8_t *wp, int64_t n,
                  const uint16_t *bias, uint16_t *out, int64_t ldo) { return 0; }
#endif
/* ---- end of the batch-invariant GGUF Q8_0 block ---- */


#define DEFINE_BI_KERNELS(SUF, T)                                                                              \
/* Pack w [n, k] into bi_linear's layout: ceil(n / BI_PANEL) panels, each [k][BI_PANEL] (the panel's           \
 * columns side by side for every k), zero past column n. wp holds ceil(n / BI_PANEL) * BI_PANEL * k. */       \
void bi_linear_pack_##SUF(const T *w, int64_t n, int64_t k, T *wp) {                                           \
    BI_DP_PACK_##SUF(w, n, k, wp) /* AVX-512 BF16: pairs (section comment above) */                            \
    int64_t np = (n + BI_PANEL - 1) / BI_PANEL;                                                                \
    _Pragma("omp parallel for if (n * k >= PAR_MIN_WORK)")                                                     \
    for (int64_t p = 0; p < np; p++)                                                                           \
        for (int64_t kk = 0; kk < k; kk++)                                                                     \
            for (int64_t c = 0; c < BI_PANEL; c++) {                                                           \
                int64_t col = p * BI_PANEL + c;                                                                \
                wp[(p * k + kk) * BI_PANEL + c] = col < n ? w[col * k + kk] : (T)0;                            \
            }                                                                                                  \
}                                                                                                              \
                                                                                                               \
/* BI_MR rows times one panel: acc[r][c] = the fmaf chain over kk in order (see the section comment);          \
 * AVX2 intrinsics where the compiler targets them (accumulators kept in registers), plain C otherwise:        \
 * both compute the same chains, so both give the same bits. */                                                \
static inline void bi_tile_rows_##SUF(const float *x, int64_t ldx, const T *w, int64_t k, float *acc) {        \
    BI_TILE_ROWS_SIMD_##SUF                                                                                    \
    float a[BI_MR][BI_PANEL] = {{0}};                                                                          \
    for (int64_t kk = 0; kk < k; kk++)                                                                         \
        for (int r = 0; r < BI_MR; r++)                                                                        \
            for (int c = 0; c < BI_PANEL; c++)                                                                 \
                a[r][c] = __builtin_fmaf(x[r * ldx + kk], LD_##SUF(w + kk * BI_PANEL + c), a[r][c]);           \
    for (int r = 0; r < BI_MR; r++)                                                                            \
        for (int c = 0; c < BI_PANEL; c++) acc[r * BI_PANEL + c] = a[r][c];                                    \
}                                                                                                              \
                                                                                                               \
/* One row times BI_NP panels (the same chains as bi_tile_rows, more of them side by side for one row). */     \
static inline void bi_tile_cols_##SUF(const float *x, const T *w, int64_t k, int64_t np, float *acc) {         \
    BI_TILE_COLS_SIMD_##SUF                                                                                    \
    float a[BI_NP][BI_PANEL] = {{0}};                                                                          \
    for (int64_t kk = 0; kk < k; kk++) {                                                                       \
        float xv = x[kk];                                                                                      \
        for (int p = 0; p < BI_NP; p++)                                                                        \
            for (int c = 0; c < BI_PANEL; c++)                                                                 \
                a[p][c] = __builtin_fmaf(xv, LD_##SUF(w + (p * k + kk) * BI_PANEL + c), a[p][c]);              \
    }                                                                                                          \
    for (int p = 0; p < np; p++)                                                                               \
        for (int c = 0; c < BI_PANEL; c++) acc[p * BI_PANEL + c] = a[p][c];                                    \
}                                                                                                              \
                                                                                                               \
/* out[r, col] = T(chain(x[r], w[col]) + bias[col]) for r < m, col < n: x [m, k] (rows ldx apart), wp          \
 * from bi_linear_pack, bias [n] or NULL, out rows ldo apart. Rows are converted to float32 (exact);           \
 * tiles of BI_MR rows x 1 panel, the rows left over one by one across BI_NP panels; the threads split         \
 * (row block, panel group) pairs. Returns 0 if the row buffer cannot be allocated, else 1. */                 \
int bi_linear_##SUF(const T *x, int64_t m, int64_t k, int64_t ldx, const T *wp, int64_t n, const T *bias,      \
                    T *out, int64_t ldo) {                                                                     \
    BI_DP_LINEAR_##SUF(x, m, k, ldx, wp, n, bias, out, ldo) /* AVX-512 BF16: the pair chains */                \
    int64_t np = (n + BI_PANEL - 1) / BI_PANEL, ngroups = (np + BI_NP - 1) / BI_NP;                            \
    int64_t nrb = (m + BI_ROWS - 1) / BI_ROWS;                                                                 \
    float *xf = (float *)malloc(sizeof(float) * (size_t)(m * k));                                              \
    if (!xf) return 0;                                                                                         \
    _Pragma("omp parallel for if (m * k >= PAR_MIN_WORK)")                                                     \
    for (int64_t r = 0; r < m; r++)                                                                            \
        for (int64_t kk = 0; kk < k; kk++) xf[r * k + kk] = LD_##SUF(x + r * ldx + kk);                        \
    _Pragma("omp parallel for collapse(2) schedule(static) if (m * k * n >= 16 * PAR_MIN_WORK)")               \
    for (int64_t rb = 0; rb < nrb; rb++)                                                                       \
        for (int64_t gi = 0; gi < ngroups; gi++) {                                                             \
            float acc[BI_MR * BI_NP * BI_PANEL];                                                               \
            int64_t r0 = rb * BI_ROWS, r1 = r0 + BI_ROWS < m ? r0 + BI_ROWS : m;                               \
            int64_t p0 = gi * BI_NP, pn = np - p0 < BI_NP ? np - p0 : BI_NP;                                   \
            int64_t r = r0;                                                                                    \
            for (; r + BI_MR <= r1; r += BI_MR)                                                                \
                for (int64_t p = p0; p < p0 + pn; p++) {                                                       \
                    bi_tile_rows_##SUF(xf + r * k, k, wp + p * k * BI_PANEL, k, acc);                          \
                    for (int64_t i = 0; i < BI_MR; i++)                                                        \
                        for (int64_t c = 0; c < BI_PANEL && p * BI_PANEL + c < n; c++) {                       \
                            int64_t col = p * BI_PANEL + c;                                                    \
                            float v = acc[i * BI_PANEL + c] + (bias ? LD_##SUF(bias + col) : 0.f);             \
                            ST_##SUF(out + (r + i) * ldo + col, v);                                            \
                        }                                                                                      \
                }                                                                                              \
            for (; r < r1; r++) {                                                                              \
                if (pn == BI_NP) bi_tile_cols_##SUF(xf + r * k, wp + p0 * k * BI_PANEL, k, pn, acc);           \
                else for (int64_t p = 0; p < pn; p++) {  /* the last group: fewer panels, the same chains */   \
                    float a[BI_PANEL] = {0};                                                                   \
                    const T *w = wp + (p0 + p) * k * BI_PANEL;                                                 \
                    for (int64_t kk = 0; kk < k; kk++)                                                         \
                        for (int c = 0; c < BI_PANEL; c++) a[c] = __builtin_fmaf(xf[r * k + kk], LD_##SUF(w + kk * BI_PANEL + c), a[c]); \
                    for (int c = 0; c < BI_PANEL; c++) acc[p * BI_PANEL + c] = a[c];                           \
                }                                                                                              \
                for (int64_t c = 0; c < pn * BI_PANEL && p0 * BI_PANEL + c < n; c++) {                         \
                    int64_t col = p0 * BI_PANEL + c;                                                           \
                    float v = acc[c] + (bias ? LD_##SUF(bias + col) : 0.f);                                    \
                    ST_##SUF(out + r * ldo + col, v);                                                          \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
    free(xf);                                                                                                  \
    return 1;                                                                                                  \
}                                                                                                              \
                                                                                                               \
/* One task of chunk_attn in the portable arithmetic: rows e0..e1 (entries of rows / limits) of one item (sl: its \
 * nkeys slots), kv head kh; kf / vf / qf / acc / mx / sm: the thread's buffers */                             \
static void ca_task_##SUF(const T *q, int64_t q_stride, const T *k_cache, const T *v_cache, const int64_t *sl, \
                          int64_t nkeys, const int64_t *rows, const int64_t *limits, int64_t e0, int64_t e1, int64_t kh, \
                          int64_t nh, int64_t nkv, int64_t d, float scale, const ca_state_t *st, const ca_next_t *nx, \
                          T *out, float *kf, float *vf, float *qf, float *acc, float *mx, float *sm) {         \
    int64_t grp = nh / nkv, maxlim = 0;                                                                        \
    for (int64_t e = e0; e < e1; e++) {                                                                        \
        int64_t lim = limits ? limits[e] : nkeys;                                                              \
        if (lim > maxlim) maxlim = lim;                                                                        \
        int ld = ca_loads(st, rows[e], nkv, kh);                                                               \
        for (int64_t g = 0; g < grp; g++) {                                                                    \
            int64_t hd = kh * grp + g, si = (e - e0) * grp + g;                                                \
            for (int64_t i = 0; i < d; i++) qf[si * d + i] = LD_##SUF(q + rows[e] * q_stride + hd * d + i);    \
            mx[si] = ld ? st->m[rows[e] * nh + hd] : -INFINITY;                                                \
            sm[si] = ld ? st->l[rows[e] * nh + hd] : 0.f;                                                      \
            for (int64_t i = 0; i < d; i++) acc[si * d + i] = ld ? st->acc[(rows[e] * nh + hd) * d + i] : 0.f; \
        }                                                                                                      \
    }                                                                                                          \
    for (int64_t c0 = 0; c0 < maxlim; c0 += BI_CHUNK) {                                                        \
        int64_t c1 = c0 + BI_CHUNK < maxlim ? c0 + BI_CHUNK : maxlim;                                          \
        if (c1 - c0 < BI_CHUNK) /* a short last chunk: scores past it are computed and ignored */              \
            for (int64_t i = 0; i < d; i++) for (int64_t j = c1 - c0; j < BI_CHUNK; j++) kf[i * BI_CHUNK + j] = 0.f; \
        ca_gather_##SUF(k_cache, v_cache, sl + c0, c1 - c0, nkv * d, kh * d, d, kf, vf);                       \
        if (c1 < maxlim)                                                                                       \
            ca_prefetch(k_cache, v_cache, sl + c1, (maxlim - c1 < BI_CHUNK ? maxlim - c1 : BI_CHUNK),          \
                        (int64_t)sizeof(T) * nkv * d, (int64_t)sizeof(T) * kh * d, (int64_t)sizeof(T) * d);    \
        else if (nx && nx->sl)                                                                                 \
            ca_prefetch(k_cache, v_cache, nx->sl, nx->n, (int64_t)sizeof(T) * nkv * d, (int64_t)sizeof(T) * nx->off, \
                        (int64_t)sizeof(T) * d);                                                               \
        for (int64_t e = e0; e < e1; e++) {                                                                    \
            int64_t lim = limits ? limits[e] : nkeys;                                                          \
            if (lim <= c0) continue;                                                                           \
            int64_t nn = (lim < c1 ? lim : c1) - c0;                                                           \
            for (int64_t g0 = 0; g0 < grp; g0 += CA_NQ) { /* up to CA_NQ heads of row e at once */             \
                int nq = grp - g0 < CA_NQ ? (int)(grp - g0) : CA_NQ;                                           \
                int64_t si0 = (e - e0) * grp + g0;                                                             \
                float sc[CA_NQ * BI_CHUNK], acl[CA_NQ * BI_MAX_D], mcs[CA_NQ], lcs[CA_NQ];                     \
                ca_scores(qf + si0 * d, nq, d, kf, sc);                                                        \
                /* keys past nn get score -inf, hence p = 0, which adds nothing */                             \
                for (int n = 0; n < nq; n++) ca_softmax(sc + n * BI_CHUNK, nn, scale, mcs + n, lcs + n);       \
                ca_pv(sc, nq, nn, vf, d, acl);                                                                 \
                for (int n = 0; n < nq; n++) {                                                                 \
                    int64_t si = si0 + n;                                                                      \
                    const float *ac = acl + n * d;                                                             \
                    float mc = mcs[n], lc = lcs[n], mo = mx[si], mn = mo > mc ? mo : mc;                       \
                    float a = fast_expf(mo - mn), b = fast_expf(mc - mn);                                      \
                    sm[si] = sm[si] * a + lc * b;                                                              \
                    float *ar = acc + si * d;                                                                  \
                    for (int64_t i = 0; i < d; i++) ar[i] = ar[i] * a + ac[i] * b;                             \
                    mx[si] = mn;                                                                               \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
    }                                                                                                          \
    for (int64_t e = e0; e < e1; e++)                                                                          \
        for (int64_t g = 0; g < grp; g++) {                                                                    \
            int64_t hd = kh * grp + g, si = (e - e0) * grp + g;                                                \
            const float *ar = acc + si * d;                                                                    \
            if (st->store) {                                                                                   \
                st->m[rows[e] * nh + hd] = mx[si];                                                             \
                st->l[rows[e] * nh + hd] = sm[si];                                                             \
                for (int64_t i = 0; i < d; i++) st->acc[(rows[e] * nh + hd) * d + i] = ar[i];                  \
                if (st->has && g == 0) st->has[rows[e] * nkv + kh] = 1;                                        \
            } else {                                                                                           \
                float l = sm[si];                                                                              \
                for (int64_t i = 0; i < d; i++) ST_##SUF(out + (rows[e] * nh + hd) * d + i, l > 0.f ? ar[i] / l : 0.f); \
            }                                                                                                  \
        }                                                                                                      \
}                                                                                                              \
                                                                                                               \
/* The calls of one chunk_attn run in order (a barrier between them: a later call continues the states an      \
 * earlier one stored), each call's tasks (item, block of BI_ATT_ROWS rows, kv head) taken from a shared       \
 * counter by the threads; each thread takes its next task before running the current one, so the current      \
 * one's last chunk prefetches the next one's first keys. Calls before the last store their states into st     \
 * (has marks them); the last stores them when store_last, else writes out. Returns 0 when buffers cannot be   \
 * allocated or d is too large, -1 when a row's limit is negative or past its item's keys, -2 for a quantised  \
 * pool (kvq, read by the pair paths only) where they do not run, else 1. */                                   \
static int ca_run_##SUF(const T *q, int64_t q_stride, const T *k_cache, const T *v_cache, const ca_call_t *calls, \
                        int64_t n_calls, int64_t nh, int64_t nkv, int64_t d, float scale, float *st_m, float *st_l, \
                        float *st_acc, uint8_t *has, int store_last, int a8, T *out, const ca_q8_t *kvq) {    \
    int64_t grp = nh / nkv, n_off = 0, work = 0, max_blk = 0;                                                  \
    const int dp = ca_dp_##SUF(d); /* AVX-512 BF16: ca_task_pp_bf16's pair chains (section comment above) */   \
    const int k8 = dp && a8 && ca_k8_##SUF(d); /* int8 attention (ca_quant_kv8_bf16's section comment) */    \
    if (d > BI_MAX_D) return 0;                                                                                \
    if (kvq && !dp) return -2; /* a quantised pool is read by the pair paths only (chunk_attn_q8) */           \
    /* the caches' bytes (a quantised pool's codes) for the prefetches */                                      \
    const void *kc = kvq ? (const void *)kvq->k : (const void *)k_cache;                                       \
    const void *vc = kvq ? (const void *)kvq->v : (const void *)v_cache;                                       \
    const int64_t esz = kvq ? 1 : (int64_t)sizeof(T);                                                          \
    for (int64_t c = 0; c < n_calls; c++) n_off += calls[c].n_items + 1;                                       \
    /* per call and item: task_off (its first task), cb (its first int8 key block), seen (its keys a row sees) */ \
    int64_t *task_off = (int64_t *)scratch(SCRATCH_CA_TASKS, sizeof(int64_t) * (size_t)(3 * n_off + 3 * n_calls + 2)); \
    if (!task_off) return 0;                                                                                   \
    int64_t *cb_all = task_off + n_off, *seen_all = cb_all + n_off, *base = seen_all + n_off;                  \
    int64_t *ctr = base + n_calls;                                                                             \
    n_off = 0;                                                                                                 \
    for (int64_t c = 0; c < n_calls; c++) {                                                                    \
        const ca_call_t *cl = calls + c;                                                                       \
        int64_t *to = task_off + n_off, *cb = cb_all + n_off, *sn = seen_all + n_off;                          \
        base[c] = n_off;                                                                                       \
        ctr[c] = 0;                                                                                            \
        to[0] = cb[0] = 0;                                                                                     \
        for (int64_t i = 0; i < cl->n_items; i++) {                                                            \
            int64_t nr = cl->row_off[i + 1] - cl->row_off[i], nk = cl->key_off[i + 1] - cl->key_off[i];        \
            to[i + 1] = to[i] + nkv * ((nr + BI_ATT_ROWS - 1) / BI_ATT_ROWS);                                  \
            work += nr * nk;                                                                                   \
            int64_t seen = nr ? nk : 0; /* keys some row of the item sees: the only ones int8 quantises */     \
            if (nr && cl->limits) {                                                                            \
                seen = 0;                                                                                      \
                for (int64_t e = cl->row_off[i]; e < cl->row_off[i + 1]; e++) {                                \
                    if (cl->limits[e] < 0 || cl->limits[e] > nk) return -1; /* nothing read yet */             \
                    if (cl->limits[e] > seen) seen = cl->limits[e];                                            \
                }                                                                                              \
            }                                                                                                  \
            sn[i] = seen;                                                                                      \
            cb[i + 1] = cb[i] + nkv * ((seen + BI_CHUNK - 1) / BI_CHUNK);                                      \
        }                                                                                                      \
        if (cb[cl->n_items] > max_blk) max_blk = cb[cl->n_items];                                              \
        n_off += cl->n_items + 1;                                                                              \
    }                                                                                                          \
    /* int8 keys of the running call: its key blocks (chunk, kv head) in item order */                         \
    uint32_t *k8buf = k8 ? ca_k8_buffer_##SUF((size_t)(max_blk > 0 ? max_blk : 1) * CA8_WORDS(d)) : NULL;      \
    if (k8 && !k8buf) return 0;                                                                                \
    int64_t *cum = ctr + n_calls, bg_ctr = 0; /* the background prefetch's numbering of every call's keys */   \
    cum[0] = 0;                                                                                                \
    for (int64_t c = 0; c < n_calls; c++) cum[c + 1] = cum[c] + calls[c].key_off[calls[c].n_items];            \
    if (n_calls > 1) bg_ctr = cum[1];                                                                          \
    size_t per_thread = (size_t)(2 * BI_CHUNK * d + 2 * BI_ATT_ROWS * grp * d + 2 * BI_ATT_ROWS * grp);        \
    int nt = MAX_THREADS();                                                                                    \
    float *buf_all = (float *)scratch(SCRATCH_CA, sizeof(float) * per_thread * (size_t)nt);                    \
    if (!buf_all) return 0;                                                                                    \
    _Pragma("omp parallel if (work * nh * d >= PAR_MIN_WORK)")                                                 \
    {                                                                                                          \
    float *kf = buf_all + per_thread * (size_t)THREAD_ID(), *vf = kf + BI_CHUNK * d;                           \
    float *qf = vf + BI_CHUNK * d, *acc = qf + BI_ATT_ROWS * grp * d;                                          \
    float *mx = acc + BI_ATT_ROWS * grp * d, *sm = mx + BI_ATT_ROWS * grp;                                     \
    for (int64_t c = 0; c < n_calls; c++) {                                                                    \
        const ca_call_t *cl = calls + c;                                                                       \
        const int64_t *to = task_off + base[c];                                                                \
        int64_t ntasks = to[cl->n_items];                                                                      \
        ca_state_t st = {st_m, st_l, st_acc, has, c + 1 < n_calls ? 1 : store_last};                           \
        ca_bg_t bg = {calls, cum, n_calls, c, esz * nkv * d, &bg_ctr};                                        \
        /* the background prefetch runs in calls with more rows than items (keys shared by rows) */            \
        const ca_bg_t *bgp = c + 1 < n_calls && cl->row_off[cl->n_items] >= 2 * cl->n_items ? &bg : NULL;      \
        const int64_t *cb = cb_all + base[c], *sn = seen_all + base[c];                                        \
        if (k8buf) { /* the call's keys to int8 once, read by all its tasks (the barrier of the omp for) */    \
            _Pragma("omp for schedule(static)")                                                                \
            for (int64_t b = 0; b < cb[cl->n_items]; b += nkv) { /* a chunk's blocks, all its kv heads */      \
                int64_t lo = 0, hi = cl->n_items - 1; /* the item of block b: cb[lo] <= b < cb[lo + 1] */      \
                while (lo < hi) { int64_t mid = (lo + hi + 1) / 2; if (cb[mid] <= b) lo = mid; else hi = mid - 1; } \
                int64_t c0 = (b - cb[lo]) / nkv * BI_CHUNK, nk = sn[lo] - c0;                                  \
                ca_quant_kv8_##SUF(k_cache, v_cache, cl->slots + cl->key_off[lo] + c0, nk < BI_CHUNK ? nk : BI_CHUNK, \
                                   nkv * d, d, k8buf + b * CA8_WORDS(d), kvq);                                 \
            }                                                                                                  \
        }                                                                                                      \
        int64_t t = __atomic_fetch_add(ctr + c, 1, __ATOMIC_RELAXED), it = 0;                                  \
        while (t < ntasks) {                                                                                   \
            int64_t tn = __atomic_fetch_add(ctr + c, 1, __ATOMIC_RELAXED);                                     \
            int64_t lo = 0, hi = cl->n_items - 1; /* the item of task t: to[it] <= t < to[it + 1] */           \
            while (lo < hi) { int64_t mid = (lo + hi + 1) / 2; if (to[mid] <= t) lo = mid; else hi = mid - 1; } \
            it = lo;                                                                                           \
            ca_next_t nx = {NULL, 0, 0, bgp};                                                                  \
            if (tn < ntasks) {                                                                                 \
                int64_t in = it;                                                                               \
                while (to[in + 1] <= tn) in++;                                                                 \
                int64_t nk = cl->key_off[in + 1] - cl->key_off[in];                                            \
                nx.sl = cl->slots + cl->key_off[in];                                                           \
                nx.n = nk < BI_CHUNK ? nk : BI_CHUNK;                                                          \
                nx.off = ((tn - to[in]) % nkv) * d;                                                            \
            }                                                                                                  \
            int64_t local = t - to[it], kh = local % nkv, blk = local / nkv;                                   \
            if (local == 0 && it + 1 < cl->n_items) /* a new item: its successor's keys into L2 */             \
                ca_prefetch_item(kc, vc, cl->slots + cl->key_off[it + 1],                                      \
                                 cl->key_off[it + 2] - cl->key_off[it + 1], esz * nkv * d);                    \
            int64_t e0 = cl->row_off[it] + blk * BI_ATT_ROWS, e1 = e0 + BI_ATT_ROWS;                           \
            if (e1 > cl->row_off[it + 1]) e1 = cl->row_off[it + 1];                                            \
            int64_t nkeys = cl->key_off[it + 1] - cl->key_off[it];                                             \
            const int64_t *sl = cl->slots + cl->key_off[it];                                                   \
            if (dp) /* AVX-512 BF16: both products as pair chains (ca_task_pp_bf16) */                         \
                ca_task_pp_##SUF(q, q_stride, k_cache, v_cache, sl, nkeys, cl->rows, cl->limits, e0, e1, kh, nh, nkv, d, \
                                 scale, &st, &nx, out, (uint32_t *)kf, (uint32_t *)vf, acc, mx, sm, (uint32_t *)qf, \
                                 k8buf ? k8buf + cb[it] * CA8_WORDS(d) : NULL, kvq);                           \
            else                                                                                               \
                ca_task_##SUF(q, q_stride, k_cache, v_cache, sl, nkeys, cl->rows, cl->limits, e0, e1, kh, nh, nkv, d, \
                              scale, &st, &nx, out, kf, vf, qf, acc, mx, sm);                                  \
            t = tn;                                                                                            \
        }                                                                                                      \
        _Pragma("omp barrier")                                                                                 \
    }                                                                                                          \
    }                                                                                                          \
    scratch_trim(SCRATCH_K8);                                                                                  \
    return 1;                                                                                                  \
}                                                                                                              \
                                                                                                               \
/* Attention with one reduction order per query row (deterministic inference). Item i: keys                    \
 * slots[key_off[i]:key_off[i+1]] of k_cache / v_cache ([num_slots, nkv, d]), the first of them at an          \
 * absolute position that is a multiple of BI_CHUNK; query rows rows[row_off[i]:row_off[i+1]] of q             \
 * ([*, nh, d], rows q_stride apart); row entry j sees the first limits[j] keys (limits NULL: all).            \
 * Per (row, head): keys in chunks of BI_CHUNK from the item's first key; per chunk the scaled scores          \
 * (q.k as one fmaf chain over the head dimension), their max mc, p = exp(s - mc), lc = sum p (16              \
 * lanes, then the lanes in order) and ac = sum p v (fmaf chains in key order); folded into the state (m, l, acc) in chunk order: m' = max(m, mc), \
 * l' = l e^(m - m') + lc e^(mc - m'), acc' likewise (FlashAttention's rescaling, Dao et al. 2022).            \
 * The state of row r, head h starts from st_m[r, h], st_l[r, h], st_acc[r, h, :] when st_m is not             \
 * NULL (else -inf, 0, 0); store != 0 writes it back there (a shared segment, continued by a later             \
 * call), store == 0 writes out[r, h, :] = T(acc / l) (0 for a row that saw no key). Rows must be              \
 * distinct across a call's items; d <= BI_MAX_D. lut not NULL: k_cache / v_cache hold a quantised pool's codes \
 * (ks / vs, ss, lut: ca_q8_t; chunk_attn_q8(d) must hold). Returns 0 if buffers cannot be allocated or d is too \
 * large, -1 when a row's limit is negative or past its item's keys (nothing read), -2 for a quantised pool    \
 * where chunk_attn_q8(d) does not hold, else 1. */                                                            \
int chunk_attn_##SUF(const T *q, int64_t q_stride, const T *k_cache, const T *v_cache, int64_t n_items,        \
                     const int64_t *key_off, const int64_t *slots, const int64_t *row_off, const int64_t *rows, \
                     const int64_t *limits, int64_t nh, int64_t nkv, int64_t d, float scale, float *st_m,      \
                     float *st_l, float *st_acc, int store, T *out, int a8, const float *ks, const float *vs,  \
                     int64_t ss, const float *lut) {                                                          \
    ca_call_t call = {n_items, key_off, slots, row_off, rows, limits};                                         \
    ca_tabs_t tabs;                                                                                            \
    ca_q8_t kvq = {(const uint8_t *)k_cache, (const uint8_t *)v_cache, ks, vs, lut, ss, lut ? CA_TABS(tabs, lut) : NULL}; \
    return ca_run_##SUF(q, q_stride, k_cache, v_cache, &call, 1, nh, nkv, d, scale, st_m, st_l, st_acc, NULL, store, \
                        a8, out, lut ? &kvq : NULL);                                                          \
}                                                                                                              \
                                                                                                               \
/* All of one layer's chunk_attn calls in one: desc [n_calls, 6] int64 per call (n_items, then the addresses of \
 * key_off, slots, row_off, rows, limits; limits 0: none), in fold order (shared segments, then the tails); every \
 * call but the last continues its rows' softmax state in buffers of its own (n_rows x nh states: the rows index \
 * q's first n_rows rows), a row a call meets first starts empty, and the last call writes out. The bits of the \
 * calls made one by one through a state filled with (-inf, 0, 0). ks, vs, ss, lut: chunk_attn's. Returns 0 when \
 * buffers cannot be allocated or d is too large, -1 when a row's limit is negative or past its item's keys, -2   \
 * for a quantised pool where chunk_attn_q8(d) does not hold, else 1. */                                       \
int chunk_attn_layer_##SUF(const T *q, int64_t q_stride, const T *k_cache, const T *v_cache, int64_t n_calls,  \
                           const int64_t *desc, int64_t n_rows, int64_t nh, int64_t nkv, int64_t d, float scale, \
                           T *out, int a8, const float *ks, const float *vs, int64_t ss, const float *lut) {  \
    ca_call_t calls_small[8], *calls = n_calls <= 8 ? calls_small : (ca_call_t *)malloc(sizeof(ca_call_t) * (size_t)n_calls); \
    if (!calls || n_calls < 1) return calls != NULL;                                                           \
    for (int64_t c = 0; c < n_calls; c++) {                                                                    \
        const int64_t *x = desc + 6 * c;                                                                       \
        calls[c] = (ca_call_t){x[0], (const int64_t *)(intptr_t)x[1], (const int64_t *)(intptr_t)x[2],         \
                               (const int64_t *)(intptr_t)x[3], (const int64_t *)(intptr_t)x[4],               \
                               (const int64_t *)(intptr_t)x[5]};                                               \
    }                                                                                                          \
    float *st = NULL;                                                                                          \
    uint8_t *has = NULL;                                                                                       \
    if (n_calls > 1) {                                                                                         \
        st = (float *)malloc(sizeof(float) * (size_t)(n_rows * nh * (d + 2)));                                 \
        has = (uint8_t *)calloc((size_t)(n_rows * nkv), 1);                                                    \
    }                                                                                                          \
    ca_tabs_t tabs;                                                                                            \
    ca_q8_t kvq = {(const uint8_t *)k_cache, (const uint8_t *)v_cache, ks, vs, lut, ss, lut ? CA_TABS(tabs, lut) : NULL}; \
    int ok = !(n_calls == 1 || (st && has)) ? 0 : /* ca_run's 1, 0, -1 or -2 */                               \
             ca_run_##SUF(q, q_stride, k_cache, v_cache, calls, n_calls, nh, nkv, d, scale, st, st ? st + n_rows * nh : NULL, \
                          st ? st + 2 * n_rows * nh : NULL, has, 0, a8, out, lut ? &kvq : NULL);              \
    free(st);                                                                                                  \
    free(has);                                                                                                 \
    if (calls != calls_small) free(calls);                                                                     \
    return ok;                                                                                                 \
}

DEFINE_BI_KERNELS(f32, float)
DEFINE_BI_KERNELS(bf16, uint16_t)

/* 1 where chunk_attn_bf16 / chunk_attn_layer_bf16 take int8 attention when asked (a8) for head dimension d */
int chunk_attn_int8(int64_t d) { return ca_k8_bf16(d); }
/* 1 where chunk_attn_bf16 / chunk_attn_layer_bf16 read a quantised pool (lut not NULL: k_cache / v_cache its codes,
 * ks / vs its scales, ss their slot stride; the arithmetic in ca_q8_t's comment) for head dimension d: the pair
 * paths; elsewhere they return -2 */
int chunk_attn_q8(int64_t d) { return ca_dp_bf16(d); }

/* ---- Ragged attention on AMX (bfloat16) ------------------------------------------------------------
 * Many query rows against shared key lists read straight from the KV pool: the shared segments of
 * cascade attention (every row sees every key) and the tails of requests extending by several
 * tokens (row j sees the first limits[j] keys: causal). One call attends n_items items; item i has
 * the keys slots[key_off[i]:key_off[i+1]] (L_i of them) and the query token rows
 * rows[row_off[i]:row_off[i+1]] of q ([*, nh, d] bfloat16, rows q_stride elements apart).
 * Query head hd reads kv head hd / (nh / nkv); the nh / nkv query heads of a kv head are stacked as
 * rows ("vectors"), so each kv head's keys are packed once and read by 16 vectors per tile.
 *
 * Per (item, kv head): K is packed into AMX's pair-interleaved ("VNNI") B layout for S = Q K^T and V
 * likewise for O = P V, into `work` (2 * nkv * L32_i * d bfloat16 per item, L32 = L rounded up to
 * 32). Per block of 16 vectors: scores in float32 by TDPBF16PS (bfloat16 products exact, float32
 * sums), softmax in float32 over chunks of RAGGED_KC keys with the running max / sum rescaling of
 * FlashAttention (Dao et al., arXiv 2205.14135), probabilities rounded to bfloat16 for the P V tile
 * product (as PyTorch's CPU flash kernel does for bfloat16) and summed after rounding, output in
 * float32. Result per (row, head): merge == 0 writes out [*, nh, d] float32 and lse [*, nh] (natural
 * log-sum-exp of the scaled scores, -inf for a row that sees no key); merge != 0 folds it into what
 * out/lse hold (log-sum-exp weighting, as merge_*), so rows must be distinct across a call's items.
 * Returns 1 when done; 0 without touching anything where AMX is unusable (no CPU support, the kernel
 * refused the tile state) or d is not a multiple of 32 up to 256; -1 when work (work_bytes long) is
 * smaller than the packing needs. packed != 0: work already holds these items' packing (from an
 * earlier call on the same keys, e.g. a shared prefix at the previous decode step) and is read as is. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define RAGGED_KC 256 /* keys per softmax chunk: a multiple of 32 */
/* 16-vector blocks of one kv head per task: its packed K/V, read from memory by the first block, is
 * still in the core's L2 for the others */
#define RAGGED_TASK_BLOCKS 2

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static int amx_state = -1;

/* e^x on 16 lanes, 0 where k is clear, for softmax probabilities that are then rounded to bfloat16:
 * x = n ln2 + f as in fast_expf (n rounded by the 1.5 * 2^23 trick), a degree-4 Taylor polynomial of
 * e^f (relative error < 5e-5, far below bfloat16's 2^-9) by FMAs, 2^n applied by VSCALEF (which
 * underflows to 0 and overflows to inf cleanly). */
static inline __m512 exp_ps(__mmask16 k, __m512 x) {
    const __m512 magic = _mm512_set1_ps(12582912.f);
    __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), magic), magic);
    __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    f = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), f);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.f / 24), f, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_maskz_scalef_ps(k, p, n);
}

/* 1 if this process may use AMX tiles (Linux asks each process to request the tile state once). */
int amx_available(void) {
    if (amx_state < 0) amx_state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                           18 /* XFEATURE_XTILEDATA */) == 0;
    return amx_state;
}

/* r[i] element j -> r[j] element i, for 16 vectors of 16 32-bit elements: pairs within 128-bit lanes
 * (unpack 32 then 64), then 4 x 4 transposes of the 128-bit lanes (two rounds of VSHUFI32X4). */
static inline void transpose16x16_epi32(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* u[4i + c], lane L: rows 4i..4i+3 of column 4L + c */
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
        __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44), v3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
        r[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        r[4 + c] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
        r[8 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
    }
}

/* Pack keys j0 .. j0+31 of one item (slots sl, len keys, j0 a multiple of 32) for every kv head h:
 * K into kp + h * l32 * d/2 (uint32) in TDPBF16PS's B layout for S = Q K^T, V into vp + h * l32 * d
 * likewise for O = P V; keys past len are zeros. All heads of a slot are one 384-byte pool row for
 * SmolLM2, so packing them together reads each row once, whole; the next block's rows are fetched
 * ahead (a request's slots are scattered over the pool and miss the caches). */
static void ragged_pack(const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *sl, int64_t len,
                        int64_t j0, int64_t nkv, int64_t d, int64_t l32, uint32_t *kp, uint16_t *vp) {
    int64_t half = d / 2, ng = d / 16, row = nkv * d;
    for (int64_t h = 0; h < nkv; h++) {
        uint32_t *kh = kp + h * l32 * half;
        uint16_t *vh = vp + h * l32 * d;
        /* K: block kb of 16 keys, pair p -> kh[(kb * half + p) * 16 + n] holds key kb*16+n's pair p:
         * per 16 pairs a 16 x 16 transpose of 32-bit elements in registers */
        for (int64_t kb = j0 / 16; kb < j0 / 16 + 2; kb++) {
            const uint32_t *src[16];
            for (int64_t n = 0; n < 16; n++) {
                int64_t j = kb * 16 + n;
                src[n] = j < len ? (const uint32_t *)(k_cache + sl[j] * row + h * d) : NULL;
            }
            for (int64_t c = 0; c < half / 16; c++) {
                __m512i r[16];
                for (int n = 0; n < 16; n++) r[n] = src[n] ? _mm512_loadu_si512(src[n] + 16 * c) : _mm512_setzero_si512();
                transpose16x16_epi32(r);
                for (int p = 0; p < 16; p++) _mm512_storeu_si512(kh + (kb * half + 16 * c + p) * 16, r[p]);
            }
        }
        /* V: block of 32 keys, group of 16 dims -> 16 key pairs x 16 dims x 2 (keys 2i, 2i+1 interleaved) */
        for (int64_t kp2 = j0 / 2; kp2 < j0 / 2 + 16; kp2++) {
            int64_t ja = 2 * kp2, jb = ja + 1;
            const uint16_t *a = ja < len ? v_cache + sl[ja] * row + h * d : NULL;
            const uint16_t *b = jb < len ? v_cache + sl[jb] * row + h * d : NULL;
            for (int64_t g = 0; g < ng; g++) {
                __m512i lo = a ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(a + 16 * g))) : _mm512_setzero_si512();
                __m512i hi = b ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(b + 16 * g))) : _mm512_setzero_si512();
                uint16_t *dst = vh + (((kp2 / 16) * ng + g) * 16 + kp2 % 16) * 32;
                _mm512_storeu_si512(dst, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
            }
        }
    }
}

/* One block of up to 16 vectors (v0 .. v0+15 of an item's row x group-head stack) for kv head h. */
static void ragged_block(const uint16_t *q, int64_t q_stride, const int64_t *rows, const int64_t *limits,
                         int64_t nrows, int64_t len, int64_t v0, int64_t h, int64_t nh, int64_t grp, int64_t d,
                         float scale, const uint32_t *kp, const uint16_t *vp, float *out, float *lse, int merge) {
    __attribute__((aligned(64))) uint16_t qa[16 * 256];
    __attribute__((aligned(64))) float S[16 * RAGGED_KC];
    __attribute__((aligned(64))) uint16_t P[16 * RAGGED_KC];
    __attribute__((aligned(64))) float O[16 * 256];
    float mrow[16], lrow[16];
    int64_t lim[16], maxlim = 0, half = d / 2, ng = d / 16, nvec = nrows * grp;
    for (int m = 0; m < 16; m++) {
        int64_t v = v0 + m;
        if (v < nvec) {
            int64_t r = v / grp;
            memcpy(qa + m * d, q + rows[r] * q_stride + (h * grp + v % grp) * d, d * 2);
            lim[m] = limits ? (limits[r] < len ? limits[r] : len) : len;
        } else {
            memset(qa + m * d, 0, d * 2);
            lim[m] = 0;
        }
        if (lim[m] > maxlim) maxlim = lim[m];
        mrow[m] = -INFINITY;
        lrow[m] = 0.f;
    }
    memset(O, 0, sizeof(float) * 16 * d);
    for (int64_t c0 = 0; c0 < maxlim; c0 += RAGGED_KC) {
        int64_t nk = maxlim - c0 < RAGGED_KC ? maxlim - c0 : RAGGED_KC, nk32 = (nk + 31) / 32 * 32;
        if (d == 64) { _tile_loadd(0, qa, 128); _tile_loadd(1, qa + 32, 128); }
        int64_t kb = 0;
        if (d == 64)  /* two key blocks a step: two independent accumulation chains */
            for (; kb + 2 <= nk32 / 16; kb += 2) {
                const uint32_t *kb_p = kp + ((c0 / 16 + kb) * half) * 16;
                _tile_zero(4);
                _tile_zero(5);
                _tile_loadd(2, kb_p, 64);
                _tile_loadd(3, kb_p + 16 * 16, 64);
                _tile_loadd(6, kb_p + 32 * 16, 64);
                _tile_loadd(7, kb_p + 48 * 16, 64);
                _tile_dpbf16ps(4, 0, 2);
                _tile_dpbf16ps(5, 0, 6);
                _tile_dpbf16ps(4, 1, 3);
                _tile_dpbf16ps(5, 1, 7);
                _tile_stored(4, S + kb * 16, RAGGED_KC * 4);
                _tile_stored(5, S + kb * 16 + 16, RAGGED_KC * 4);
            }
        for (; kb < nk32 / 16; kb++) {
            const uint32_t *kb_p = kp + ((c0 / 16 + kb) * half) * 16;
            _tile_zero(4);
            if (d == 64) {
                _tile_loadd(2, kb_p, 64);
                _tile_loadd(3, kb_p + 16 * 16, 64);
                _tile_dpbf16ps(4, 0, 2);
                _tile_dpbf16ps(4, 1, 3);
            } else {
                for (int64_t c = 0; c < d / 32; c++) {
                    _tile_loadd(0, qa + 32 * c, d * 2);
                    _tile_loadd(2, kb_p + c * 16 * 16, 64);
                    _tile_dpbf16ps(4, 0, 2);
                }
            }
            _tile_stored(4, S + kb * 16, RAGGED_KC * 4);
        }
        for (int m = 0; m < 16; m++) {
            int64_t valid = lim[m] - c0;
            valid = valid < 0 ? 0 : (valid > nk ? nk : valid);
            float *s = S + m * RAGGED_KC, mx = mrow[m];
            uint16_t *p = P + m * RAGGED_KC;
            /* max and sum each over four / two independent chains (latency, not throughput, bound) */
            __m512 vm[4] = {_mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY),
                            _mm512_set1_ps(-INFINITY)};
            int64_t j = 0;
            for (; j + 64 <= valid; j += 64)
                for (int u = 0; u < 4; u++) vm[u] = _mm512_max_ps(vm[u], _mm512_loadu_ps(s + j + 16 * u));
            for (; j < valid; j += 16) {
                __mmask16 k = valid - j >= 16 ? 0xffff : (__mmask16)((1u << (valid - j)) - 1);
                vm[0] = _mm512_mask_max_ps(vm[0], k, vm[0], _mm512_loadu_ps(s + j));
            }
            __m512 vmax = _mm512_max_ps(_mm512_max_ps(vm[0], vm[1]), _mm512_max_ps(vm[2], vm[3]));
            float cm = valid ? _mm512_reduce_max_ps(vmax) * scale : -INFINITY; /* scale > 0: max commutes */
            mx = cm > mx ? cm : mx;
            if (mx == -INFINITY) { memset(p, 0, nk32 * 2); continue; }
            __m512 vmx = _mm512_set1_ps(mx), vsc = _mm512_set1_ps(scale);
            __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
            for (j = 0; j < nk32; j += 32)
                for (int u = 0; u < 2; u++) {
                    int64_t jj = j + 16 * u;
                    __mmask16 k = jj >= valid ? 0 : (valid - jj >= 16 ? 0xffff : (__mmask16)((1u << (valid - jj)) - 1));
                    __m512 e = exp_ps(k, _mm512_fmsub_ps(_mm512_loadu_ps(s + jj), vsc, vmx));
                    _mm256_storeu_si256((__m256i *)(p + jj), (__m256i)_mm512_cvtneps_pbh(e));
                    acc[u] = _mm512_add_ps(acc[u], e);
                }
            float sum = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
            float alpha = mrow[m] == -INFINITY ? 0.f : (mrow[m] == mx ? 1.f : fast_expf(mrow[m] - mx));
            if (alpha != 1.f) for (int64_t i = 0; i < d; i++) O[m * d + i] *= alpha;
            lrow[m] = lrow[m] * alpha + sum;
            mrow[m] = mx;
        }
        for (int64_t g0 = 0; g0 < ng; g0 += 4) {
            int64_t nt = ng - g0 < 4 ? ng - g0 : 4;
            float *o = O + g0 * 16;
            _tile_loadd(4, o, d * 4);
            _tile_loadd(5, o + 16, d * 4);
            if (nt > 2) _tile_loadd(6, o + 32, d * 4);
            if (nt > 3) _tile_loadd(7, o + 48, d * 4);
            for (int64_t kb = 0; kb < nk32 / 32; kb++) {
                const uint16_t *vb = vp + ((c0 / 32 + kb) * ng + g0) * 512;
                _tile_loadd(0, P + kb * 32, RAGGED_KC * 2);
                _tile_loadd(1, vb, 64);
                _tile_dpbf16ps(4, 0, 1);
                _tile_loadd(1, vb + 512, 64);
                _tile_dpbf16ps(5, 0, 1);
                if (nt > 2) { _tile_loadd(1, vb + 1024, 64); _tile_dpbf16ps(6, 0, 1); }
                if (nt > 3) { _tile_loadd(1, vb + 1536, 64); _tile_dpbf16ps(7, 0, 1); }
            }
            _tile_stored(4, o, d * 4);
            _tile_stored(5, o + 16, d * 4);
            if (nt > 2) _tile_stored(6, o + 32, d * 4);
            if (nt > 3) _tile_stored(7, o + 48, d * 4);
        }
    }
    for (int m = 0; m < 16 && v0 + m < nvec; m++) {
        int64_t v = v0 + m, hd = h * grp + v % grp, r = rows[v / grp];
        float *orow = out + (r * nh + hd) * d, *ol = lse + r * nh + hd;
        if (lrow[m] == 0.f) {
            if (!merge) { memset(orow, 0, d * 4); *ol = -INFINITY; }
            continue;
        }
        float nl = mrow[m] + logf(lrow[m]), inv = 1.0f / lrow[m];
        if (!merge || *ol == -INFINITY) {
            for (int64_t i = 0; i < d; i++) orow[i] = O[m * d + i] * inv;
            *ol = nl;
            continue;
        }
        float mm = *ol > nl ? *ol : nl, w1 = expf(*ol - mm), w2 = expf(nl - mm), s = w1 + w2;
        for (int64_t i = 0; i < d; i++) orow[i] = (orow[i] * w1 + O[m * d + i] * inv * w2) / s;
        *ol = mm + logf(s);
    }
}

int ragged_attn_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                     int64_t n_items, const int64_t *key_off, const int64_t *slots, const int64_t *row_off,
                     const int64_t *rows, const int64_t *limits, int64_t nh, int64_t nkv, int64_t d, float scale,
                     float *out, float *lse, int64_t merge, uint16_t *work, int64_t work_bytes,
                     int64_t packed) {
    if (d % 32 || d > 256 || nh % nkv || !amx_available()) return 0;
    int64_t grp = nh / nkv;
    /* per item: pk its packing offset (uint16 units), poff its first 32-key packing task, toff its first
     * (kv head, 16-vector block) task */
    int64_t *pk = (int64_t *)malloc(sizeof(int64_t) * 3 * (n_items + 1));
    if (!pk) return 0;
    int64_t *toff = pk + n_items + 1, *poff = toff + n_items + 1, flops = 0;
    pk[0] = toff[0] = poff[0] = 0;
    for (int64_t i = 0; i < n_items; i++) {
        int64_t len = key_off[i + 1] - key_off[i], nr = row_off[i + 1] - row_off[i];
        pk[i + 1] = pk[i] + 2 * nkv * ((len + 31) / 32 * 32) * d;
        toff[i + 1] = toff[i] + nkv * (((nr * grp + 15) / 16 + RAGGED_TASK_BLOCKS - 1) / RAGGED_TASK_BLOCKS);
        poff[i + 1] = poff[i] + (len + 31) / 32;
        flops += nr * nh * len * d;
    }
    if (pk[n_items] * 2 > work_bytes) { free(pk); return -1; }
#pragma omp parallel if (flops >= 64 * PAR_MIN_WORK)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < (packed ? 0 : poff[n_items]); t++) {
            int64_t lo = 0, hi = n_items - 1;
            while (lo < hi) { int64_t mid = (lo + hi + 1) / 2; if (poff[mid] <= t) lo = mid; else hi = mid - 1; }
            int64_t i = lo, len = key_off[i + 1] - key_off[i], l32 = (len + 31) / 32 * 32;
            uint16_t *base = work + pk[i];
            ragged_pack(k_cache, v_cache, slots + key_off[i], len, (t - poff[i]) * 32, nkv, d, l32,
                        (uint32_t *)base, base + nkv * l32 * d);
        }
        tile_config cfg;
        memset(&cfg, 0, sizeof(cfg));
        cfg.palette_id = 1;
        for (int t = 0; t < 8; t++) { cfg.colsb[t] = 64; cfg.rows[t] = 16; }
        _tile_loadconfig(&cfg);
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < toff[n_items]; t++) {
            int64_t lo = 0, hi = n_items - 1;
            while (lo < hi) { int64_t mid = (lo + hi + 1) / 2; if (toff[mid] <= t) lo = mid; else hi = mid - 1; }
            int64_t i = lo, len = key_off[i + 1] - key_off[i], nr = row_off[i + 1] - row_off[i];
            int64_t nblk = (nr * grp + 15) / 16, nch = (nblk + RAGGED_TASK_BLOCKS - 1) / RAGGED_TASK_BLOCKS;
            int64_t h = (t - toff[i]) / nch, b0 = (t - toff[i]) % nch * RAGGED_TASK_BLOCKS;
            int64_t l32 = (len + 31) / 32 * 32;
            const uint16_t *base = work + pk[i];
            for (int64_t b = b0; b < b0 + RAGGED_TASK_BLOCKS && b < nblk; b++)
                ragged_block(q, q_stride, rows + row_off[i], limits ? limits + row_off[i] : NULL, nr, len, b * 16, h,
                             nh, grp, d, scale, (const uint32_t *)(base + h * l32 * d), base + (nkv + h) * l32 * d,
                             out, lse, (int)merge);
        }
        _tile_release();
    }
    free(pk);
    return 1;
}

/* ---- Decode-sized linear layers on AMX (bfloat16) --------------------------------------------------
 * out[m, n] = bf16(sum_k x[m, k] w[n, k] + bias[n]) for m <= 64 rows, from a weight packed once
 * (amx_linear_pack) into TDPBF16PS's B layout: per block of 32 output columns and chunk of 32 inputs,
 * two 16 x 16 tiles of input pairs x columns, so a block's 64 * k bytes are contiguous and each
 * thread streams its blocks in order, fetching AMX_LINEAR_PREFETCH bytes ahead into L2. Rows go 32 at
 * a time (2 x 2 tiles: each weight tile feeds two row tiles) then 16; float32 sums rounded to
 * bfloat16 once, to nearest even, as oneDNN does. For a decode step's 120 SmolLM2 layers (64 rows,
 * weights streamed from memory) 15 ms against 21 ms in oneDNN here, whose per-call cost is higher. */
#define AMX_LINEAR_PREFETCH 16384
void amx_linear_pack_bf16(const uint16_t *w, int64_t n, int64_t k, uint16_t *wp) {
#pragma omp parallel for if (n * k >= 64 * PAR_MIN_WORK)
    for (int64_t nb = 0; nb < n / 32; nb++)
        for (int64_t kc = 0; kc < k / 32; kc++)
            for (int64_t t = 0; t < 2; t++)
                for (int64_t p = 0; p < 16; p++)
                    for (int64_t c = 0; c < 16; c++) {
                        const uint16_t *src = w + (nb * 32 + t * 16 + c) * k + kc * 32 + 2 * p;
                        uint16_t *dst = wp + ((((nb * (k / 32) + kc) * 2 + t) * 16 + p) * 16 + c) * 2;
                        dst[0] = src[0];
                        dst[1] = src[1];
                    }
}

static inline void amx_store_rows(const float *c, int64_t rows, const uint16_t *bias, int64_t col0, uint16_t *out,
                                  int64_t ldo) {
    __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                          _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(bias + col0))), 16))
                    : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; r++)
        _mm256_storeu_si256((__m256i *)(out + r * ldo + col0),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(c + r * 16), b)));
}

/* One weight block's k chunks against `rows` (16 or 32) rows of x from row r0: C tiles 4-7. */
static inline void amx_linear_block(const uint16_t *xa, int64_t lda, int64_t r0, int64_t rows, const uint16_t *wb,
                                    int64_t kch, int prefetch) {
    _tile_zero(4); _tile_zero(5);
    if (rows == 32) { _tile_zero(6); _tile_zero(7); }
    for (int64_t kc = 0; kc < kch; kc++) {
        if (prefetch)
            for (int c = 0; c < 2048; c += 64)
                _mm_prefetch((const char *)(wb + kc * 1024) + AMX_LINEAR_PREFETCH + c, _MM_HINT_T1);
        _tile_loadd(0, xa + r0 * lda + kc * 32, lda * 2);
        _tile_loadd(2, wb + kc * 1024, 64);
        _tile_loadd(3, wb + kc * 1024 + 512, 64);
        _tile_dpbf16ps(4, 0, 2);
        _tile_dpbf16ps(5, 0, 3);
        if (rows == 32) {
            _tile_loadd(1, xa + (r0 + 16) * lda + kc * 32, lda * 2);
            _tile_dpbf16ps(6, 1, 2);
            _tile_dpbf16ps(7, 1, 3);
        }
    }
}

/* Returns 1 when done, 0 (nothing written) for m outside 1..64, n or k not multiples of 32, no AMX. */
int amx_linear_bf16(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *wp, int64_t n,
               const uint16_t *bias, uint16_t *out, int64_t ldo) {
    if (m < 1 || m > 64 || n % 32 || k % 32 || !amx_available()) return 0;
    int64_t nblk = n / 32, kch = k / 32, mp = (m + 15) / 16 * 16, lda = ldx;
    const uint16_t *xa = x;
    uint16_t *xp = NULL;
    if (mp != m) { /* rows past m read zeros */
        xp = (uint16_t *)calloc((size_t)(mp * k), 2);
        if (!xp) return 0;
        for (int64_t r = 0; r < m; r++) memcpy(xp + r * k, x + r * ldx, k * 2);
        xa = xp;
        lda = k;
    }
#pragma omp parallel if (n * k >= 8 * PAR_MIN_WORK)
    {
        tile_config cfg;
        memset(&cfg, 0, sizeof(cfg));
        cfg.palette_id = 1;
        for (int t = 0; t < 8; t++) { cfg.colsb[t] = 64; cfg.rows[t] = 16; }
        _tile_loadconfig(&cfg);
        __attribute__((aligned(64))) float cbuf[4][256];
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < nblk; nb++) {
            const uint16_t *wb = wp + nb * kch * 1024;
            for (int64_t r0 = 0; r0 < mp; r0 += 32) {
                int64_t rows = mp - r0 >= 32 ? 32 : 16;
                amx_linear_block(xa, lda, r0, rows, wb, kch, r0 == 0);
                _tile_stored(4, cbuf[0], 64);
                _tile_stored(5, cbuf[1], 64);
                int64_t v0 = m - r0 < 16 ? m - r0 : 16;
                amx_store_rows(cbuf[0], v0, bias, nb * 32, out + r0 * ldo, ldo);
                amx_store_rows(cbuf[1], v0, bias, nb * 32 + 16, out + r0 * ldo, ldo);
                if (rows == 32 && m > r0 + 16) {
                    int64_t v1 = m - r0 - 16 < 16 ? m - r0 - 16 : 16;
                    _tile_stored(6, cbuf[2], 64);
                    _tile_stored(7, cbuf[3], 64);
                    amx_store_rows(cbuf[2], v1, bias, nb * 32, out + (r0 + 16) * ldo, ldo);
                    amx_store_rows(cbuf[3], v1, bias, nb * 32 + 16, out + (r0 + 16) * ldo, ldo);
                }
            }
        }
        _tile_release();
    }
    free(xp);
    return 1;
}
#else
int amx_available(void) { return 0; }
void amx_linear_pack_bf16(const uint16_t *w, int64_t n, int64_t k, uint16_t *wp) {}
int amx_linear_bf16(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *wp, int64_t n,
               const uint16_t *bias, uint16_t *out, int64_t ldo) {
    return 0;
}
int ragged_attn_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                     int64_t n_items, const int64_t *key_off, const int64_t *slots, const int64_t *row_off,
                     const int64_t *rows, const int64_t *limits, int64_t nh, int64_t nkv, int64_t d, float scale,
                     float *out, float *lse, int64_t merge, uint16_t *work, int64_t work_bytes,
                     int64_t packed) {
    return 0;
}
#endif

/* ---- Quantised weights, weight-only (issue 14) --------------------------------------------------------
 * The weight stays in its stored format and is turned into float32 in registers, a few elements at a
 * time, inside the dot product: at decode, where every weight is read once per step, the bytes read are
 * the quantised ones (1 byte per weight for int8, 5 bits for Q4_1 instead of 4 for float32).
 * q8_linear: int8 q [n, k] with one float32 scale per output row (symmetric per channel):
 *   out[r, c] = T(scale[c] * sum_k x[r, k] q[c, k] + bias[c]).
 * Every output element is one float32 sum in a fixed order (8 lanes over k, lanes summed in a fixed
 * tree; the scalar build in k order), the same for any number of rows. Threads split output columns.
 * x rows are converted to float32 once (exact); returns 0 if that buffer cannot be allocated, else 1.
 * The GGUF block formats (q41_linear, q80_linear) have their own section below. */
#if defined(__F16C__)
#include <immintrin.h>
static inline float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); } /* IEEE half -> float, exact */
#else
static inline float f16_to_f32(uint16_t h) { /* IEEE half -> float, exact (subnormals, inf, NaN kept) */
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal half: normalise */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400u));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
static inline float hsum8(__m256 v) { /* fixed order: (lo + hi) then pairs */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
#endif

static inline float dot_q8(const float *x, const int8_t *q, int64_t k) {
#if defined(__AVX2__) && defined(__FMA__)
    if (k % 16 == 0) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0;
        for (int64_t i = 0; i < k; i += 16) {
            __m128i b = _mm_loadu_si128((const __m128i *)(q + i));
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8),
                                 _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))), a1);
        }
        return hsum8(_mm256_add_ps(a0, a1));
    }
#endif
    float s = 0.f;
    for (int64_t i = 0; i < k; i++) s += x[i] * (float)q[i];
    return s;
}

#define Q_COLS 16 /* output columns per thread task */

#define DEFINE_QUANT_KERNELS(SUF, T)                                                                           \
static float *rows_to_f32_##SUF(const T *x, int64_t m, int64_t k, int64_t ldx) {                               \
    size_t bytes = (sizeof(float) * (size_t)(m * k > 0 ? m * k : 1) + 63) / 64 * 64; /* rows on cache lines */ \
    float *xf = (float *)aligned_alloc(64, bytes);                                                             \
    if (!xf) return NULL;                                                                                      \
    for (int64_t r = 0; r < m; r++)                                                                            \
        for (int64_t i = 0; i < k; i++) xf[r * k + i] = LD_##SUF(x + r * ldx + i);                             \
    return xf;                                                                                                 \
}                                                                                                              \
int q8_linear_##SUF(const T *x, int64_t m, int64_t k, int64_t ldx, const int8_t *q, const float *scale,        \
                    int64_t n, const T *bias, T *out, int64_t ldo) {                                           \
    float *xf = rows_to_f32_##SUF(x, m, k, ldx);                                                               \
    if (!xf) return 0;                                                                                         \
    int64_t ntask = (n + Q_COLS - 1) / Q_COLS;                                                                 \
    _Pragma("omp parallel for if (m * n * k >= PAR_MIN_WORK)")                                                 \
    for (int64_t t = 0; t < ntask; t++)                                                                        \
        for (int64_t c = t * Q_COLS; c < n && c < (t + 1) * Q_COLS; c++)                                       \
            for (int64_t r = 0; r < m; r++) {                                                                  \
                float v = scale[c] * dot_q8(xf + r * k, q + c * k, k);                                         \
                if (bias) v += LD_##SUF(bias + c);                                                             \
                ST_##SUF(out + r * ldo + c, v);                                                                \
            }                                                                                                  \
    free(xf);                                                                                                  \
    return 1;                                                                                                  \
}

DEFINE_QUANT_KERNELS(f32, float)
DEFINE_QUANT_KERNELS(bf16, uint16_t)

/* ---- Packed int8 weights x bfloat16 activations on AVX-512 BF16 + VBMI (issue 14, W8A16) --------------
 * q8_linear's product for bfloat16 models, on a weight packed once per weight change (q8_pack) so that a
 * decode row streams it as one linear run of int8 bytes. Columns go in panels of 16, panels in tiles of
 * Q8P_TP (the last tile: what is left); a tile is [K / 4] steps, each step its panels' 64-byte blocks side by
 * side. A block holds 2 input-feature pairs x 16 columns: byte 16 L + j is, for j < 8, feature 4 b + j % 2 of
 * column 4 L + j / 2, for j >= 8 feature 4 b + 2 + j % 2 of the same column set (so VPUNPCKL/HBW of its low
 * and high bytes gives the bf16 pairs of the two steps, 16 columns each). Codes (-127..127, exact in
 * bfloat16) become bfloat16 in registers: |code| looked up by VPERMI2B in the low / high byte tables of
 * bf16(0..127), the sign OR-ed back. Per output element one chain, whatever the number of rows or the tile:
 *   acc = VDPBF16PS(acc, (x[2p], x[2p+1]), (q[c][2p], q[c][2p+1])) over the K / 2 pairs p in order, from 0;
 *   out[r, c] = bf16(acc * scale[c] (+ bias[c]))
 * (exact products, float32 sums; another order than q8_linear's, by design, as bi_linear's pair chain is
 * another order than its fmaf chain). Batches of up to Q8P_DIRECT rows run together on codes decoded in
 * registers, threads splitting the tiles; larger ones decode a tile into a per-thread buffer of bf16 pairs
 * once per (row block, tile) task and run register tiles of up to Q8P_MR rows over it: the same chains,
 * the same bits (tests/test_quant_linear.py). */
#define Q8P_TP 6      /* panels per tile (SmolLM2's 36, 60, 192 and 3072 panels: an even number of tiles) */
#define Q8P_DIRECT 4  /* most rows of the register-decode path */
#define Q8P_MR 6      /* rows per register tile of the buffered path */
#define Q8P_ROWS 64   /* rows per thread task of the buffered path */
/* byte offset of panel p's block b in q8_pack's layout (np panels, kb = k / 4 blocks per panel) */
static inline int64_t q8p_at(int64_t p, int64_t b, int64_t np, int64_t kb) {
    int64_t t0 = p / Q8P_TP * Q8P_TP, tp = np - t0 < Q8P_TP ? np - t0 : Q8P_TP;
    return (t0 * kb + b * tp + (p - t0)) * 64;
}
/* q int8 [n, k] (k a multiple of 4, codes in -127..127) -> q8_pack's layout, int8 [ceil(n / 16) * k * 16],
 * zero past column n. Returns 0 (nothing written) if a code is -128, else 1. */
int q8_pack(const int8_t *q, int64_t n, int64_t k, int8_t *wp) {
    int64_t np = (n + 15) / 16, kb = k / 4;
    for (int64_t i = 0; i < n * k; i++)
        if (q[i] == -128) return 0;
#pragma omp parallel for if (n * k >= PAR_MIN_WORK)
    for (int64_t p = 0; p < np; p++)
        for (int64_t b = 0; b < kb; b++) {
            int8_t *o = wp + q8p_at(p, b, np, kb);
            for (int j = 0; j < 64; j++) {
                int64_t col = p * 16 + 4 * (j / 16) + (j % 8) / 2, f = 4 * b + 2 * ((j % 16) / 8) + j % 2;
                o[j] = col < n ? q[col * k + f] : 0;
            }
        }
    return 1;
}
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__) && defined(__AVX512BW__) && defined(__AVX512F__)
int q8p_available(void) { return 1; }
typedef struct { __m512i lo0, lo1, hi0, hi1; } Q8PTabs;
static inline Q8PTabs q8p_tabs(void) {
    uint8_t lo[128], hi[128];
    for (int c = 0; c < 128; c++) {
        uint16_t h = f32_to_bf16((float)c);
        lo[c] = (uint8_t)(h & 0xff);
        hi[c] = (uint8_t)(h >> 8);
    }
    Q8PTabs t;
    t.lo0 = _mm512_loadu_si512(lo); t.lo1 = _mm512_loadu_si512(lo + 64);
    t.hi0 = _mm512_loadu_si512(hi); t.hi1 = _mm512_loadu_si512(hi + 64);
    return t;
}
/* one 64-byte block -> the bf16 pairs of its two steps (*a: pair 2b, *b: pair 2b + 1; 16 columns each) */
static inline __attribute__((always_inline)) void q8p_cvt(const Q8PTabs *t, const int8_t *p, __m512i *a, __m512i *b) {
    __m512i x = _mm512_loadu_si512(p);
    __m512i m = _mm512_abs_epi8(x);
    __m512i lo = _mm512_permutex2var_epi8(t->lo0, m, t->lo1);
    __m512i hi = _mm512_permutex2var_epi8(t->hi0, m, t->hi1);
    hi = _mm512_ternarylogic_epi32(hi, x, _mm512_set1_epi8((char)0x80), 0xF8); /* hi | (x & 0x80) */
    *a = _mm512_unpacklo_epi8(lo, hi);
    *b = _mm512_unpackhi_epi8(lo, hi);
}
static inline void q8p_out(__m512 acc, const float *scale, const uint16_t *bias, int64_t col, int64_t n, uint16_t *out) {
    __mmask16 mask = n - col >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - col)) - 1u);
    acc = _mm512_mul_ps(acc, _mm512_maskz_loadu_ps(mask, scale + col));
    if (bias)
        acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, (const __m256i *)(bias + col))), 16)));
    bi_store_bf16x16(out + col, acc, mask);
}
/* mr rows x np panels (the tile's panels j0..j0+np, tp panels per step at w), codes decoded in registers */
static inline __attribute__((always_inline)) void q8p_tile(const Q8PTabs *t, const uint16_t *x, int64_t ldx,
                                                           const int8_t *w, int64_t kb, int64_t tp, int64_t j0,
                                                           const int mr, const int np, const float *scale,
                                                           const uint16_t *bias, int64_t col0, int64_t n,
                                                           uint16_t *out, int64_t ldo) {
    __m512 acc[Q8P_DIRECT][Q8P_TP];
    for (int r = 0; r < mr; r++)
        for (int p = 0; p < np; p++) acc[r][p] = _mm512_setzero_ps();
    for (int64_t b = 0; b < kb; b++) {
        __m512bh xa[Q8P_DIRECT], xb[Q8P_DIRECT];
        for (int r = 0; r < mr; r++) {
            xa[r] = (__m512bh)_mm512_set1_epi32((int)ld_pair(x + r * ldx + 4 * b));
            xb[r] = (__m512bh)_mm512_set1_epi32((int)ld_pair(x + r * ldx + 4 * b + 2));
        }
        const int8_t *ws = w + (b * tp + j0) * 64;
        for (int p = 0; p < np; p++) {
            __m512i wa, wb;
            q8p_cvt(t, ws + p * 64, &wa, &wb);
            for (int r = 0; r < mr; r++) {
                acc[r][p] = _mm512_dpbf16_ps(acc[r][p], xa[r], (__m512bh)wa);
                acc[r][p] = _mm512_dpbf16_ps(acc[r][p], xb[r], (__m512bh)wb);
            }
        }
    }
    for (int r = 0; r < mr; r++)
        for (int p = 0; p < np; p++) {
            int64_t col = col0 + (j0 + p) * 16;
            if (col < n) q8p_out(acc[r][p], scale, bias, col, n, out + r * ldo);
        }
}
#define Q8P_T(MR, J0, NP) q8p_tile(&t, x, ldx, w, kb, tp, J0, MR, NP, scale, bias, col0, n, out, ldo)
/* m (1..Q8P_DIRECT) rows over tiles [t0, t1) */
static void q8p_direct(const Q8PTabs *tabs, const uint16_t *x, int64_t m, int64_t ldx, const int8_t *wp, int64_t kb,
                       int64_t np, int64_t t0, int64_t t1, const float *scale, const uint16_t *bias, int64_t n,
                       uint16_t *out, int64_t ldo) {
    const Q8PTabs t = *tabs;
    for (int64_t ti = t0; ti < t1; ti++) {
        const int64_t p0 = ti * Q8P_TP, tp = np - p0 < Q8P_TP ? np - p0 : Q8P_TP, col0 = p0 * 16;
        const int8_t *w = wp + p0 * kb * 64;
        if (tp == Q8P_TP) {
            switch (m) {
            case 1: Q8P_T(1, 0, Q8P_TP); break;
            case 2: Q8P_T(2, 0, Q8P_TP); break;
            case 3: Q8P_T(3, 0, Q8P_TP); break;
            default: Q8P_T(4, 0, Q8P_TP / 2); Q8P_T(4, Q8P_TP / 2, Q8P_TP / 2); break;
            }
        } else {
            for (int64_t j = 0; j < tp; j++) switch (m) {
            case 1: Q8P_T(1, j, 1); break;
            case 2: Q8P_T(2, j, 1); break;
            case 3: Q8P_T(3, j, 1); break;
            default: Q8P_T(4, j, 1); break;
            }
        }
    }
}
#undef Q8P_T
/* MR rows x NP panels over a tile decoded into wb ([panel][k / 2][16][2] bf16 words), its panel q0 on */
static inline __attribute__((always_inline)) void q8p_buf_tile(const uint16_t *x, int64_t ldx, const uint16_t *wb,
                                                               int64_t k2, int64_t q0, const int mr, const int np,
                                                               const float *scale, const uint16_t *bias,
                                                               int64_t col0, int64_t n, uint16_t *out, int64_t ldo) {
    __m512 a[Q8P_MR][Q8P_TP / 2];
    for (int r = 0; r < mr; r++)
        for (int p = 0; p < np; p++) a[r][p] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k2; kk++) {
        __m512bh wv[Q8P_TP / 2];
        for (int p = 0; p < np; p++) wv[p] = (__m512bh)_mm512_loadu_si512(wb + ((q0 + p) * k2 + kk) * 32);
        for (int r = 0; r < mr; r++) {
            __m512bh xv = (__m512bh)_mm512_set1_epi32((int)ld_pair(x + r * ldx + 2 * kk));
            for (int p = 0; p < np; p++) a[r][p] = _mm512_dpbf16_ps(a[r][p], xv, wv[p]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int p = 0; p < np; p++) {
            int64_t col = col0 + (q0 + p) * 16;
            if (col < n) q8p_out(a[r][p], scale, bias, col, n, out + r * ldo);
        }
}
#define Q8P_BSTRIP(MR)                                                                                         \
    do {                                                                                                       \
        if (tp == Q8P_TP) {                                                                                    \
            q8p_buf_tile(x + r * ldx, ldx, wb, k2, 0, MR, Q8P_TP / 2, scale, bias, col0, n, out + r * ldo, ldo);          \
            q8p_buf_tile(x + r * ldx, ldx, wb, k2, Q8P_TP / 2, MR, Q8P_TP / 2, scale, bias, col0, n, out + r * ldo, ldo); \
        } else for (int64_t q = 0; q < tp; q++)                                                                \
            q8p_buf_tile(x + r * ldx, ldx, wb, k2, q, MR, 1, scale, bias, col0, n, out + r * ldo, ldo);        \
    } while (0)
/* rows [0, m) of x over tile ti: decoded into wb once, then register tiles */
static void q8p_buffered(const Q8PTabs *tabs, const uint16_t *x, int64_t m, int64_t ldx, const int8_t *wp, int64_t kb,
                         int64_t np, int64_t ti, const float *scale, const uint16_t *bias, int64_t n, uint16_t *out,
                         int64_t ldo, uint16_t *wb) {
    const Q8PTabs t = *tabs;
    const int64_t k2 = 2 * kb, p0 = ti * Q8P_TP, tp = np - p0 < Q8P_TP ? np - p0 : Q8P_TP, col0 = p0 * 16;
    const int8_t *w = wp + p0 * kb * 64;
    for (int64_t b = 0; b < kb; b++)
        for (int64_t q = 0; q < tp; q++) {
            __m512i wa, wc;
            q8p_cvt(&t, w + (b * tp + q) * 64, &wa, &wc);
            _mm512_storeu_si512(wb + (q * k2 + 2 * b) * 32, wa);
            _mm512_storeu_si512(wb + (q * k2 + 2 * b + 1) * 32, wc);
        }
    int64_t r = 0;
    for (; r + Q8P_MR <= m; r += Q8P_MR) Q8P_BSTRIP(Q8P_MR);
    switch (m - r) {
    case 5: Q8P_BSTRIP(5); break;
    case 4: Q8P_BSTRIP(4); break;
    case 3: Q8P_BSTRIP(3); break;
    case 2: Q8P_BSTRIP(2); break;
    case 1: Q8P_BSTRIP(1); break;
    default: break;
    }
}
#undef Q8P_BSTRIP
/* out [m, n] (rows ldo apart) = (x [m, k] (bf16 rows ldx apart) q^T) * scale (+ bias), q from q8_pack (k a
 * multiple of 4). Returns 0 when the buffers cannot be allocated, else 1. */
int q8p_linear_bf16(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const int8_t *wp, const float *scale,
                    int64_t n, const uint16_t *bias, uint16_t *out, int64_t ldo) {
    const int64_t np = (n + 15) / 16, kb = k / 4, ntile = (np + Q8P_TP - 1) / Q8P_TP;
    const int par = m * k * n >= 8 * PAR_MIN_WORK;
    const Q8PTabs t = q8p_tabs();
    if (m <= Q8P_DIRECT) { /* threads split the tiles */
        int64_t nt = par ? MAX_THREADS() : 1;
        if (nt > ntile) nt = ntile;
#pragma omp parallel for schedule(static) if (par && nt > 1)
        for (int64_t i = 0; i < nt; i++)
            q8p_direct(&t, x, m, ldx, wp, kb, np, i * ntile / nt, (i + 1) * ntile / nt, scale, bias, n, out, ldo);
        return 1;
    }
    const int64_t nrb = (m + Q8P_ROWS - 1) / Q8P_ROWS;
    const size_t per = (size_t)Q8P_TP * (size_t)k * 32 + 64; /* bytes of a tile's bf16 pairs */
    uint8_t *buf_all = (uint8_t *)malloc(per * (size_t)MAX_THREADS());
    if (!buf_all) return 0;
#pragma omp parallel if (par)
    {
        uint16_t *wb = (uint16_t *)(buf_all + per * (size_t)THREAD_ID());
#pragma omp for collapse(2) schedule(static)
        for (int64_t rb = 0; rb < nrb; rb++)
            for (int64_t ti = 0; ti < ntile; ti++) {
                int64_t r0 = rb * Q8P_ROWS, r1 = r0 + Q8P_ROWS < m ? r0 + Q8P_ROWS : m;
                q8p_buffered(&t, x + r0 * ldx, r1 - r0, ldx, wp, kb, np, ti, scale, bias, n, out + r0 * ldo, ldo, wb);
            }
    }
    free(buf_all);
    return 1;
}
#else
int q8p_available(void) { return 0; }
int q8p_linear_bf16(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const int8_t *wp, const float *scale,
                    int64_t n, const uint16_t *bias, uint16_t *out, int64_t ldo) { return 0; }
#endif
/* ---- end of the packed int8 x bfloat16 block ---- */

/* ---- Decode attention over a quantised KV cache (issue 14) -------------------------------------------
 * decode_attn's contract with K/V stored as one byte per element (int8 or fp8, decoded by lut[256] into
 * float32) and float32 scales: key j of kv head h is lut[k_bytes] * k_scale[slot * ss + h], where ss is
 * the scale's stride over slots: nkv for a scale per (slot, head) (int8's dynamic per-token scales), 0
 * for one scale per head (fp8's static, calibrated scales). The K scale multiplies the dot product
 * (q . k = s_k (q . lut[kb])), folded into the softmax factor; V's multiplies each key's probability with
 * per-slot scales (p v = (p s_v) lut[vb]) and the head's output once with per-head scales (sum_j p_j s_v
 * lut[vb_j] = s_v sum_j p_j lut[vb_j]), so a per-head cache costs one table read per element and nothing
 * per key beyond a bfloat16 cache. No dequantised copy: rows are decoded as they are read. Softmax in
 * float32, two passes, as decode_attn. The AVX2 path (decode_avx2_core) gives these loops' bits; on an
 * AVX-512 VBMI + BF16 CPU a bfloat16 model runs decode_attn_q8_avx512 (another q.k order, by design). */
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__) && defined(__AVX512BW__) && defined(__AVX512F__)
/* decode_attn_q8 for bfloat16 with d a multiple of 64 (up to 256) and up to 16 query heads per KV head:
 * decode_attn_bf16_avx512's loops (q.k by VDPBF16PS, p.v in float32 FMAs) over K/V rows decoded by
 * q8_to_bf16_64; the scales as the scalar kernel applies them. Returns 0 (the other paths run) outside
 * that shape or without memory. */
static int decode_attn_q8_avx512(const uint16_t *q, int64_t q_stride, const int64_t *qrow, const uint8_t *k_cache,
                                 const uint8_t *v_cache, const float *k_scale, const float *v_scale, int64_t ss,
                                 const float *lut, const int64_t *slots, const int64_t *off, int64_t nb,
                                 int64_t nh, int64_t nkv, int64_t d, float scale, float *out_f, uint16_t *out_t,
                                 float *lse, const int64_t *orow) {
    int64_t grp = nh / nkv, nv = d / 32, max_len = 0, total = 0;
    if (d % 64 || d > 256 || grp > 16 || grp < 1) return 0;
    for (int64_t b = 0; b < nb; b++) {
        int64_t len = off[b + 1] - off[b];
        if (len > max_len) max_len = len;
        total += len;
    }
    int64_t per = grp * (max_len > 0 ? max_len : 1);
    float *sc_all = (float *)malloc(sizeof(float) * (size_t)(per * MAX_THREADS()));
    if (!sc_all) return 0;
    /* an int8 table holds the codes 0..127; fp8 codes 128..255 are 0..127 negated */
    const int is_int8 = lut[255] == -1.0f && lut[1] == 1.0f;
    const Q8Tabs tabs = q8_tabs(lut, is_int8);
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
            const float kf_head = k_scale ? k_scale[kh] * scale : scale; /* per-head (ss 0) K factor */
            for (int64_t g = 0; g < grp; g++) {
                const uint16_t *qr = q + qrow[b] * q_stride + (kh * grp + g) * d;
                for (int64_t v = 0; v < nv; v++) qv[g][v] = (__m512bh)_mm512_loadu_si512(qr + 32 * v);
                mx[g] = -INFINITY;
            }
            for (int64_t j = 0; j < len; j++) {
                const uint8_t *kr = k_cache + (sl[j] * nkv + kh) * d;
                if (j + 6 < len) {
                    const char *kn = (const char *)(k_cache + (sl[j + 6] * nkv + kh) * d);
                    for (int64_t c = 0; c < d; c += 64) _mm_prefetch(kn + c, _MM_HINT_T0);
                }
                const char *vn = (const char *)(v_cache + (sl[j] * nkv + kh) * d);
                for (int64_t c = 0; c < d; c += 64) _mm_prefetch(vn + c, _MM_HINT_T1);
                __m512i kw[8];
                for (int64_t v = 0; v < nv; v += 2) q8_to_bf16_64(&tabs, kr + 32 * v, &kw[v], &kw[v + 1]);
                float kf = ss && k_scale ? k_scale[sl[j] * ss + kh] * scale : kf_head;
                for (int64_t g = 0; g < grp; g++) {
                    __m512 a = _mm512_setzero_ps();
                    for (int64_t v = 0; v < nv; v++) a = _mm512_dpbf16_ps(a, qv[g][v], (__m512bh)kw[v]);
                    float s = _mm512_reduce_add_ps(a) * kf;
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
                const uint8_t *vr = v_cache + (sl[j] * nkv + kh) * d;
                __m512 vf[16];
                for (int64_t v = 0; v < nv; v += 2) {
                    __m512i wa, wb;
                    q8_to_bf16_64(&tabs, vr + 32 * v, &wa, &wb);
                    vf[2 * v] = q8_bf16_lo_ps(wa); vf[2 * v + 1] = q8_bf16_hi_ps(wa);
                    vf[2 * v + 2] = q8_bf16_lo_ps(wb); vf[2 * v + 3] = q8_bf16_hi_ps(wb);
                }
                float vs = v_scale && ss ? v_scale[sl[j] * ss + kh] : 1.f;
                for (int64_t g = 0; g < grp; g++) {
                    __m512 pj = _mm512_set1_ps(v_scale && ss ? sc[g * len + j] * vs : sc[g * len + j]);
                    for (int64_t v = 0; v < 2 * nv; v++) acc[g][v] = _mm512_fmadd_ps(pj, vf[v], acc[g][v]);
                }
            }
            for (int64_t g = 0; g < grp; g++) {
                int64_t hd = kh * grp + g;
                float inv = len > 0 ? 1.0f / sum[g] : 0.f;
                float o[256];
                __m512 head = _mm512_set1_ps(v_scale && !ss ? v_scale[kh] : 1.f);
                for (int64_t v = 0; v < 2 * nv; v++)
                    _mm512_storeu_ps(o + 16 * v, _mm512_mul_ps(_mm512_mul_ps(acc[g][v], head), _mm512_set1_ps(inv)));
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
#define FAST_DECODE_Q8_512_bf16(...) if (decode_attn_q8_avx512(__VA_ARGS__)) return;
#else
#define FAST_DECODE_Q8_512_bf16(...)
#endif
#define FAST_DECODE_Q8_512_f32(...)
#define DEFINE_DECODE_Q8(SUF, T)                                                                               \
void decode_attn_q8_##SUF(const T *q, int64_t q_stride, const int64_t *qrow, const uint8_t *k_cache,           \
                          const uint8_t *v_cache, const float *k_scale, const float *v_scale, int64_t ss,      \
                          const float *lut, const int64_t *slots, const int64_t *off, int64_t nb, int64_t nh,  \
                          int64_t nkv, int64_t d, float scale, float *out_f, T *out_t, float *lse,             \
                          const int64_t *orow) {                                                               \
    FAST_DECODE_Q8_512_##SUF(q, q_stride, qrow, k_cache, v_cache, k_scale, v_scale, ss, lut, slots, off, nb, nh, \
                             nkv, d, scale, out_f, out_t, lse, orow)                                           \
    FAST_DECODE_Q8(SUF, q, q_stride, qrow, k_cache, v_cache, k_scale, v_scale, ss, lut, slots, off, nb, nh, nkv, \
                   d, scale, out_f, out_t, lse, orow)                                                          \
    int64_t grp = nh / nkv, max_len = 0, total = 0;                                                            \
    for (int64_t b = 0; b < nb; b++) {                                                                         \
        int64_t len = off[b + 1] - off[b];                                                                     \
        if (len > max_len) max_len = len;                                                                      \
        total += len;                                                                                          \
    }                                                                                                          \
    int64_t per = grp * (max_len > 0 ? max_len : 1);                                                           \
    float *sc_all = (float *)malloc(sizeof(float) * (size_t)(per * MAX_THREADS()));                            \
    if (!sc_all) return;                                                                                       \
    _Pragma("omp parallel if (total * nh * d >= PAR_MIN_WORK)")                                                \
    {                                                                                                          \
    float *sc = sc_all + per * THREAD_ID();                                                                    \
    float qf[grp][d], acc[grp][d], kf[d];                                                                      \
    _Pragma("omp for schedule(dynamic, 1)") /* one work item per (request, KV head), as decode_attn */         \
    for (int64_t it = 0; it < nb * nkv; it++) {                                                                \
        int64_t b = it / nkv, kh = it % nkv;                                                                   \
        int64_t len = off[b + 1] - off[b];                                                                     \
        const int64_t *sl = slots + off[b];                                                                    \
        {                                                                                                      \
            float mx[grp], sum[grp];                                                                           \
            for (int64_t g = 0; g < grp; g++) {                                                                \
                for (int64_t i = 0; i < d; i++)                                                                \
                    qf[g][i] = LD_##SUF(q + qrow[b] * q_stride + (kh * grp + g) * d + i);                      \
                mx[g] = -INFINITY;                                                                             \
            }                                                                                                  \
            for (int64_t j = 0; j < len; j++) {                                                                \
                const uint8_t *kr = k_cache + (sl[j] * nkv + kh) * d;                                          \
                for (int64_t i = 0; i < d; i++) kf[i] = lut[kr[i]];                                            \
                float ks = k_scale[sl[j] * ss + kh] * scale;                                                   \
                for (int64_t g = 0; g < grp; g++) {                                                            \
                    float p[16] = {0};                                                                         \
                    int64_t i = 0;                                                                             \
                    for (; i + 16 <= d; i += 16)                                                               \
                        for (int l = 0; l < 16; l++) p[l] += qf[g][i + l] * kf[i + l];                        \
                    for (; i < d; i++) p[0] += qf[g][i] * kf[i];                                               \
                    float s = 0.f;                                                                             \
                    for (int l = 0; l < 16; l++) s += p[l];                                                    \
                    s *= ks;                                                                                   \
                    sc[g * len + j] = s;                                                                       \
                    if (s > mx[g]) mx[g] = s;                                                                  \
                }                                                                                              \
            }                                                                                                  \
            for (int64_t g = 0; g < grp; g++) {                                                                \
                sum[g] = 0.f;                                                                                  \
                for (int64_t j = 0; j < len; j++) {                                                            \
                    float e = fast_expf(sc[g * len + j] - mx[g]);                                              \
                    sc[g * len + j] = e;                                                                       \
                    sum[g] += e;                                                                               \
                }                                                                                              \
                for (int64_t i = 0; i < d; i++) acc[g][i] = 0.f;                                               \
            }                                                                                                  \
            for (int64_t j = 0; j < len; j++) {                                                                \
                const uint8_t *vr = v_cache + (sl[j] * nkv + kh) * d;                                          \
                for (int64_t i = 0; i < d; i++) kf[i] = lut[vr[i]];                                            \
                for (int64_t g = 0; g < grp; g++) {                                                            \
                    float pj = ss ? sc[g * len + j] * v_scale[sl[j] * ss + kh] : sc[g * len + j];              \
                    for (int64_t i = 0; i < d; i++) acc[g][i] += pj * kf[i];                                   \
                }                                                                                              \
            }                                                                                                  \
            if (!ss)                                                                                           \
                for (int64_t g = 0; g < grp; g++)                                                              \
                    for (int64_t i = 0; i < d; i++) acc[g][i] *= v_scale[kh];                                  \
            dec_out_##SUF(grp, d, &acc[0][0], mx, sum, len, kh, nh, orow[b], out_f, out_t, lse);               \
        }                                                                                                      \
    }                                                                                                          \
    }                                                                                                          \
    free(sc_all);                                                                                              \
}

DEFINE_DECODE_Q8(f32, float)
DEFINE_DECODE_Q8(bf16, uint16_t)

/* Write n rows into a quantised KV cache layer: for row r and kv head h, x = src[r][h] ([d], rows
 * src_stride apart) is stored at slot slots[r] as y = x / s, one byte per element: int8 (mbits 0: y
 * rounded half to even, clamped to +-127) or fp8 with mbits mantissa bits and exponent bias `bias` (e4m3:
 * 3, 7; e5m2: 2, 15: y clamped to +-fmax — saturation, the calibrated scale's headroom aside — and
 * rounded to the nearest code, ties to even, sign in bit 7). dynamic: s = max|x| / fmax, written to
 * scale[slots[r] * nkv + h] (the per-token scale; x itself is stored when s is 0); else s = scale[h], the
 * per-head static scale, read only. The same bytes as idleless.quant.kv.QuantizedKV.write (PyTorch's
 * conversions round to nearest even). */
static inline uint8_t fp8_code(float y, int64_t mbits, int64_t bias, float min_normal, float sub_mul) {
    float a = fabsf(y);
    uint32_t u, c;
    /* below the smallest normal 2^(1 - bias): a multiple of the subnormal step 2^(1 - bias - mbits), code
     * a / step (sub_mul = 1 / step; 2^mbits, the rounding's top, is the first normal's code) */
    if (a < min_normal) c = (uint32_t)rintf(a * sub_mul);
    else {
        memcpy(&u, &a, 4);
        int sh = 23 - (int)mbits;
        u += (1u << (sh - 1)) - 1u + ((u >> sh) & 1u); /* round the mantissa to mbits bits, ties to even */
        c = (u >> sh) - ((uint32_t)(127 - bias) << mbits);
    }
    return (uint8_t)c | (signbit(y) ? 0x80 : 0);
}

#define DEFINE_KV_WRITE_Q8(SUF, T)                                                                             \
void kv_write_q8_##SUF(uint8_t *cache, float *scale, const T *src, int64_t src_stride, const int64_t *slots,   \
                       int64_t n, int64_t nkv, int64_t d, int64_t mbits, int64_t bias, float fmax,             \
                       int64_t dynamic) {                                                                      \
    const float min_normal = ldexpf(1.f, (int)(1 - bias)), sub_mul = ldexpf(1.f, (int)(bias - 1 + mbits));       \
    _Pragma("omp parallel for if (n * nkv * d >= PAR_MIN_WORK)")                                               \
    for (int64_t r = 0; r < n; r++)                                                                            \
        for (int64_t h = 0; h < nkv; h++) {                                                                    \
            const T *x = src + r * src_stride + h * d;                                                         \
            uint8_t *dst = cache + (slots[r] * nkv + h) * d;                                                   \
            float s;                                                                                           \
            if (dynamic) {                                                                                     \
                float amax = 0.f;                                                                              \
                for (int64_t i = 0; i < d; i++) {                                                              \
                    float a = fabsf(LD_##SUF(x + i));                                                          \
                    amax = a > amax ? a : amax;                                                                \
                }                                                                                              \
                s = amax / fmax;                                                                               \
                scale[slots[r] * nkv + h] = s;                                                                 \
            } else s = scale[h];                                                                               \
            float div = s != 0.f ? s : 1.f;                                                                    \
            for (int64_t i = 0; i < d; i++) {                                                                  \
                float y = LD_##SUF(x + i) / div;                                                               \
                y = y > fmax ? fmax : (y < -fmax ? -fmax : y);                                                 \
                dst[i] = mbits == 0 ? (uint8_t)(int8_t)rintf(y) : fp8_code(y, mbits, bias, min_normal, sub_mul); \
            }                                                                                                  \
        }                                                                                                      \
}

DEFINE_KV_WRITE_Q8(f32, float)
DEFINE_KV_WRITE_Q8(bf16, uint16_t)

/* Read rows of a quantised KV cache layer into the model dtype: out[r, h, i] = T(lut[code] * scale[slot *
 * ss + h]) (the product in float32, rounded once), slot = slots[r] (or first + r with slots NULL), for r <
 * n; the rows the PyTorch attention backends gather, with the bits of idleless.quant.kv.QuantizedKV's
 * PyTorch path. On an AVX-512 VBMI CPU the codes are decoded by q8_to_bf16_64 (exact) 64 at a time. */
#define DEFINE_KV_READ_Q8(SUF, T)                                                                              \
void kv_read_q8_##SUF(const uint8_t *cache, const float *scale, int64_t ss, const float *lut,                  \
                      const int64_t *slots, int64_t first, int64_t n, int64_t nkv, int64_t d, T *out) {        \
    KV_READ_Q8_SETUP                                                                                           \
    _Pragma("omp parallel for if (n * nkv * d >= 4 * PAR_MIN_WORK)")                                           \
    for (int64_t r = 0; r < n; r++) {                                                                          \
        int64_t slot = slots ? slots[r] : first + r;                                                           \
        for (int64_t h = 0; h < nkv; h++) {                                                                    \
            const uint8_t *c = cache + (slot * nkv + h) * d;                                                   \
            T *o = out + (r * nkv + h) * d;                                                                    \
            float s = scale[slot * ss + h];                                                                    \
            int64_t i = KV_READ_Q8_FAST_##SUF(c, s, o, d);                                                     \
            for (; i < d; i++) ST_##SUF(o + i, lut[c[i]] * s);                                                 \
        }                                                                                                      \
    }                                                                                                          \
}
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define KV_READ_Q8_SETUP const Q8Tabs tabs = q8_tabs(lut, lut[255] == -1.0f && lut[1] == 1.0f);
/* 64 elements at a time: exact bfloat16 codes -> float32, times s, rounded to T as ST_ does */
static inline int64_t kv_read_q8_fast_f32(const Q8Tabs *t, const uint8_t *c, float s, float *o, int64_t d) {
    int64_t i = 0;
    __m512 vs = _mm512_set1_ps(s);
    for (; i + 64 <= d; i += 64) {
        __m512i a, b;
        q8_to_bf16_64(t, c + i, &a, &b);
        _mm512_storeu_ps(o + i, _mm512_mul_ps(q8_bf16_lo_ps(a), vs));
        _mm512_storeu_ps(o + i + 16, _mm512_mul_ps(q8_bf16_hi_ps(a), vs));
        _mm512_storeu_ps(o + i + 32, _mm512_mul_ps(q8_bf16_lo_ps(b), vs));
        _mm512_storeu_ps(o + i + 48, _mm512_mul_ps(q8_bf16_hi_ps(b), vs));
    }
    return i;
}
/* float32 -> bfloat16 as f32_to_bf16 (round to nearest even, NaN kept quiet), 16 at a time */
static inline __m256i q8_rd_bf16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                                   _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                            _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
}
static inline int64_t kv_read_q8_fast_bf16(const Q8Tabs *t, const uint8_t *c, float s, uint16_t *o, int64_t d) {
    int64_t i = 0;
    __m512 vs = _mm512_set1_ps(s);
    for (; i + 64 <= d; i += 64) {
        __m512i a, b;
        q8_to_bf16_64(t, c + i, &a, &b);
        _mm256_storeu_si256((__m256i *)(o + i), q8_rd_bf16(_mm512_mul_ps(q8_bf16_lo_ps(a), vs)));
        _mm256_storeu_si256((__m256i *)(o + i + 16), q8_rd_bf16(_mm512_mul_ps(q8_bf16_hi_ps(a), vs)));
        _mm256_storeu_si256((__m256i *)(o + i + 32), q8_rd_bf16(_mm512_mul_ps(q8_bf16_lo_ps(b), vs)));
        _mm256_storeu_si256((__m256i *)(o + i + 48), q8_rd_bf16(_mm512_mul_ps(q8_bf16_hi_ps(b), vs)));
    }
    return i;
}
#define KV_READ_Q8_FAST_f32(c, s, o, d) kv_read_q8_fast_f32(&tabs, c, s, o, d)
#define KV_READ_Q8_FAST_bf16(c, s, o, d) kv_read_q8_fast_bf16(&tabs, c, s, o, d)
#else
#define KV_READ_Q8_SETUP
#define KV_READ_Q8_FAST_f32(c, s, o, d) 0
#define KV_READ_Q8_FAST_bf16(c, s, o, d) 0
#endif
DEFINE_KV_READ_Q8(f32, float)
DEFINE_KV_READ_Q8(bf16, uint16_t)

/* ---- W8A8: int8 weights and int8 activations (issue 14) -------------------------------------------------
 * Each row of x is quantised per token (scale sx = max|x| / 127, codes rint(x / sx) clamped to +-127, as
 * idleless.quant.formats.quantize_rows) and multiplied with the int8 weight rows as integers: int8
 * pairs widened to int16 and multiply-added into int32 lanes (AVX2 vpmaddwd; scalar elsewhere), an
 * exact sum in any order, so the result is batch-invariant and equal on every path:
 *   out[r, c] = T(float(sum_k xq[r, k] q[c, k]) * sx[r] * scale[c] + bias[c]).
 * With AVX512-VNNI (+VL), 32 pairs per vpdpbusd (unsigned x signed bytes into int32, no intermediate
 * saturation) through the sign trick |a| * (b * sign(a)): exact because both operands' codes lie in
 * [-127, 127] (quantize_rows' clamp), so b * sign(a) never wraps.
 * Returns 0 if the row buffers cannot be allocated, else 1. */
static inline int32_t dot_i8(const int8_t *a, const int8_t *b, int64_t k) {
    int64_t i = 0;
    int32_t s = 0;
#if defined(__AVX2__)
    __m256i acc = _mm256_setzero_si256();
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    for (; i + 32 <= k; i += 32) {
        __m256i va = _mm256_loadu_si256((const __m256i *)(a + i)), vb = _mm256_loadu_si256((const __m256i *)(b + i));
        acc = _mm256_dpbusd_epi32(acc, _mm256_abs_epi8(va), _mm256_sign_epi8(vb, va));
    }
#endif
    for (; i + 16 <= k; i += 16) {
        __m256i va = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(a + i)));
        __m256i vb = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + i)));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(va, vb));
    }
    int32_t lanes[8];
    _mm256_storeu_si256((__m256i *)lanes, acc);
    for (int l = 0; l < 8; l++) s += lanes[l];
#endif
    for (; i < k; i++) s += (int32_t)a[i] * (int32_t)b[i];
    return s;
}

#define DEFINE_W8A8(SUF, T)                                                                                    \
int w8a8_linear_##SUF(const T *x, int64_t m, int64_t k, int64_t ldx, const int8_t *q, const float *scale,      \
                      int64_t n, const T *bias, T *out, int64_t ldo) {                                         \
    int8_t *xq = (int8_t *)malloc((size_t)(m * k > 0 ? m * k : 1));                                            \
    float *sx = (float *)malloc(sizeof(float) * (size_t)(m > 0 ? m : 1));                                      \
    if (!xq || !sx) { free(xq); free(sx); return 0; }                                                          \
    for (int64_t r = 0; r < m; r++) {                                                                          \
        float amax = 0.f;                                                                                      \
        for (int64_t i = 0; i < k; i++) {                                                                      \
            float a = fabsf(LD_##SUF(x + r * ldx + i));                                                        \
            amax = a > amax ? a : amax;                                                                        \
        }                                                                                                      \
        float s = amax / 127.f, div = s != 0.f ? s : 1.f;                                                      \
        sx[r] = s;                                                                                             \
        for (int64_t i = 0; i < k; i++) {                                                                      \
            float y = rintf(LD_##SUF(x + r * ldx + i) / div);                                                  \
            xq[r * k + i] = (int8_t)(y > 127.f ? 127.f : (y < -127.f ? -127.f : y));                           \
        }                                                                                                      \
    }                                                                                                          \
    int64_t ntask = (n + Q_COLS - 1) / Q_COLS;                                                                 \
    _Pragma("omp parallel for if (m * n * k >= PAR_MIN_WORK)")                                                 \
    for (int64_t t = 0; t < ntask; t++)                                                                        \
        for (int64_t c = t * Q_COLS; c < n && c < (t + 1) * Q_COLS; c++)                                       \
            for (int64_t r = 0; r < m; r++) {                                                                  \
                float v = (float)dot_i8(xq + r * k, q + c * k, k) * sx[r] * scale[c];                          \
                if (bias) v += LD_##SUF(bias + c);                                                             \
                ST_##SUF(out + r * ldo + c, v);                                                                \
            }                                                                                                  \
    free(xq);                                                                                                  \
    free(sx);                                                                                                  \
    return 1;                                                                                                  \
}

DEFINE_W8A8(f32, float)
DEFINE_W8A8(bf16, uint16_t)

/* ---- W8A8 on a packed weight: vpdpbusd register tiles for many rows (prefill; issue 14) --------------
 * The product of w8a8_linear (the same bits: exact int32 sums, the same float32 epilogue
 *   out[r, c] = T(float(sum_k xq[r, k] q[c, k]) * sx[r] * scale[c] + bias[c])),
 * on a weight packed once per weight change (w8a8_pack): panels of W8_NP = 16 output columns, byte e of
 * column j of panel p in group g = q[16 p + j][4 g + e] + 128 as an unsigned byte (128, a zero weight, past
 * n and k); the panels in runs of W8_NV (the last run the np % W8_NV left), a run interleaved group by
 * group: [ceil(k / 4)][run width][16][4] bytes, so a tile of one run reads one contiguous stream (three
 * panels one after another measured 18% slower at M = 1 with the weights coming from memory). vpdpbusd
 * multiplies unsigned by signed bytes and adds each 4 products into an int32 lane (no saturation), so the weight's unsigned bytes meet the signed activation codes:
 *   sum_k (q + 128) xq = sum_k q xq + 128 * xs[r],   xs[r] = sum_k xq[r, k],
 * and the correction is subtracted in int32 (exact: |sum| <= k * 255 * 127 < 2^31 for k <= 65536, the
 * wrapper's limit). Register tile (AVX512-VNNI): W8_MR rows x W8_NV panels of zmm int32 accumulators (8 x 3:
 * 24 registers), each row's 4 codes of a group broadcast from memory; thread tasks are W8_NV panels x all
 * rows, columns outermost (a task's weight, 48 x k bytes, stays in L1/L2 while the activation rows stream
 * past). Rows are quantised as w8a8_linear does (quantize_rows' codes), vectorised with AVX-512. The
 * portable build runs scalar loops over the same layout (same integers, same float order). */
#define W8_NP 16 /* output columns per packed panel */
#ifndef W8_MR
#define W8_MR 8  /* rows per register tile */
#endif
#ifndef W8_NV
#define W8_NV 3  /* panels per register tile and per thread task */
#endif
#ifndef W8_ROW_BYTES
#define W8_ROW_BYTES (256 * 1024) /* activation codes per row block of w8a8_gemm's tasks (within a core's L2) */
#endif

/* q int8 [n, k] -> wp [ceil(n / 16) * ceil(k / 4) * 64] (see above) */
void w8a8_pack(const int8_t *q, int64_t n, int64_t k, uint8_t *wp) {
    int64_t np = (n + W8_NP - 1) / W8_NP, kg = (k + 3) / 4;
    for (int64_t p = 0; p < np; p++) {
        int64_t p0 = p / W8_NV * W8_NV, nv = np - p0 < W8_NV ? np - p0 : W8_NV; /* p's run and its width */
        for (int64_t g = 0; g < kg; g++)
            for (int j = 0; j < W8_NP; j++)
                for (int e = 0; e < 4; e++) {
                    int64_t c = p * W8_NP + j, i = 4 * g + e;
                    wp[((p0 * kg + g * nv + p - p0) * W8_NP + j) * 4 + e] =
                        (uint8_t)((c < n && i < k ? (int)q[c * k + i] : 0) + 128);
                }
    }
}

/* 1 where this build runs w8a8_gemm on vpdpbusd (else its scalar loops: correct, slow) */
int w8a8_gemm_vnni(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX2__) && defined(__FMA__)
/* res[r][16 j + l] (r < R, j < NV) = sum_k column l of panel j of the run at wp (NV wide; unsigned) * xq[r]
 * (signed), rows kq apart */
static inline __attribute__((always_inline)) void w8_tile(const int8_t *xq, int64_t kq, const uint8_t *wp, int64_t kg,
                                                          int R, int NV, int32_t *res) {
    __m512i acc[W8_MR][W8_NV];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 3
        for (int j = 0; j < NV; j++) acc[r][j] = _mm512_setzero_si512();
    for (int64_t g = 0; g < kg; g++) {
        __m512i w[W8_NV];
#pragma GCC unroll 3
        for (int j = 0; j < NV; j++) w[j] = _mm512_loadu_si512((const void *)(wp + (g * NV + j) * 64));
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            int32_t x4;
            memcpy(&x4, xq + r * kq + 4 * g, 4);
            __m512i xb = _mm512_set1_epi32(x4);
#pragma GCC unroll 3
            for (int j = 0; j < NV; j++) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], w[j], xb);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 3
        for (int j = 0; j < NV; j++) _mm512_storeu_si512((void *)(res + (r * NV + j) * W8_NP), acc[r][j]);
}
#define W8_TILE_CASE(RR, VV) case RR * 8 + VV: w8_tile(xq, kq, wp, kg, RR, VV, res); break;
#if W8_NV >= 4
#define W8_TILE_ROWS(RR) W8_TILE_CASE(RR, 1) W8_TILE_CASE(RR, 2) W8_TILE_CASE(RR, 3) W8_TILE_CASE(RR, 4)
#else
#define W8_TILE_ROWS(RR) W8_TILE_CASE(RR, 1) W8_TILE_CASE(RR, 2) W8_TILE_CASE(RR, 3)
#endif
static void w8_tile_any(const int8_t *xq, int64_t kq, const uint8_t *wp, int64_t kg, int R, int NV, int32_t *res) {
    switch (R * 8 + NV) {
        W8_TILE_ROWS(1) W8_TILE_ROWS(2) W8_TILE_ROWS(3) W8_TILE_ROWS(4)
        W8_TILE_ROWS(5) W8_TILE_ROWS(6)
#if W8_MR >= 7
        W8_TILE_ROWS(7)
#endif
#if W8_MR >= 8
        W8_TILE_ROWS(8)
#endif
    }
}
/* amax of x[0..k) (NaN skipped, as the scalar max) */
#define W8_AMAX_SIMD(SUF)                                                                                      \
    __m512 mx = _mm512_setzero_ps();                                                                           \
    for (; i + 16 <= k; i += 16) mx = _mm512_max_ps(_mm512_abs_ps(v16_ld_##SUF(x + i)), mx);                 \
    amax = _mm512_reduce_max_ps(mx);
/* codes of x[0..k) / div, rounded to nearest even and clamped to +-127, and their sum */
#define W8_CODES_SIMD(SUF)                                                                                     \
    __m512i tot = _mm512_setzero_si512();                                                                      \
    const __m512 vdiv = _mm512_set1_ps(div), lim = _mm512_set1_ps(127.f), nlim = _mm512_set1_ps(-127.f);        \
    for (; i + 16 <= k; i += 16) {                                                                             \
        __m512 y = _mm512_roundscale_ps(_mm512_div_ps(v16_ld_##SUF(x + i), vdiv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); \
        __m512i c = _mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(y, lim), nlim));                           \
        tot = _mm512_add_epi32(tot, c);                                                                        \
        _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtepi32_epi8(c));                                         \
    }                                                                                                          \
    sum = _mm512_reduce_add_epi32(tot);
/* the epilogue of 16 columns c .. c + 16 of one row (all inside n): T(float(acc - corr) * sx * scale + bias),
 * 16 lanes at once (the scalar loop's operations in its order) */
#define W8_STORE16(SUF)                                                                                        \
    {                                                                                                          \
        __m512i a = _mm512_sub_epi32(_mm512_loadu_si512((const void *)acc), _mm512_set1_epi32(corr));          \
        __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(s)), _mm512_loadu_ps(scale + c)); \
        if (bias) v = _mm512_add_ps(v, v16_ld_##SUF(bias + c));                                               \
        v16_st_##SUF(o + c, v);                                                                               \
    }
#define W8_VNNI 1
#else
static void w8_tile_any(const int8_t *xq, int64_t kq, const uint8_t *wp, int64_t kg, int R, int NV, int32_t *res) {
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NV; j++)
            for (int l = 0; l < W8_NP; l++) {
                int32_t s = 0;
                for (int64_t g = 0; g < kg; g++)
                    for (int e = 0; e < 4; e++)
                        s += (int32_t)wp[((g * NV + j) * W8_NP + l) * 4 + e] * (int32_t)xq[r * kq + 4 * g + e];
                res[(r * NV + j) * W8_NP + l] = s;
            }
}
#define W8_AMAX_SIMD(SUF)
#define W8_CODES_SIMD(SUF)
#define W8_STORE16(SUF)
#endif

#define DEFINE_W8A8_GEMM(SUF, T)                                                                               \
/* row x [k] -> codes q [kq] (zero past k), returns sx; *xsum: the codes' sum (w8a8_linear's quantiser) */      \
static inline float w8_quant_row_##SUF(const T *x, int64_t k, int64_t kq, int8_t *q, int32_t *xsum) {          \
    float amax = 0.f;                                                                                          \
    int64_t i = 0;                                                                                             \
    W8_AMAX_SIMD(SUF)                                                                                          \
    for (; i < k; i++) {                                                                                       \
        float a = fabsf(LD_##SUF(x + i));                                                                      \
        amax = a > amax ? a : amax;                                                                            \
    }                                                                                                          \
    float s = amax / 127.f, div = s != 0.f ? s : 1.f;                                                          \
    int32_t sum = 0;                                                                                           \
    i = 0;                                                                                                     \
    W8_CODES_SIMD(SUF)                                                                                         \
    for (; i < k; i++) {                                                                                       \
        float y = rintf(LD_##SUF(x + i) / div);                                                                \
        int32_t c = (int32_t)(y > 127.f ? 127.f : (y < -127.f ? -127.f : y));                                  \
        q[i] = (int8_t)c;                                                                                      \
        sum += c;                                                                                              \
    }                                                                                                          \
    for (; i < kq; i++) q[i] = 0;                                                                              \
    *xsum = sum;                                                                                               \
    return s;                                                                                                  \
}                                                                                                              \
/* W8A8 with the weight in w8a8_pack's layout (wp, n columns): x [m, k] (rows ldx apart) -> out [m, n] (rows   \
 * ldo apart); w8a8_linear's bits. Returns 0 if the activation buffers cannot be allocated, else 1. */         \
int w8a8_gemm_##SUF(const T *x, int64_t m, int64_t k, int64_t ldx, const uint8_t *wp, const float *scale,      \
                    int64_t n, const T *bias, T *out, int64_t ldo) {                                           \
    int64_t kg = (k + 3) / 4, kq = 4 * kg, np = (n + W8_NP - 1) / W8_NP, mm = m > 0 ? m : 1;                    \
    float *sx = (float *)scratch(SCRATCH_W8A8, (size_t)mm * (8 + kq)); /* sx, xs, then the codes */           \
    if (!sx) return 0;                                                                                         \
    int32_t *xs = (int32_t *)(sx + mm);                                                                        \
    int8_t *xq = (int8_t *)(xs + mm);                                                                          \
    _Pragma("omp parallel for if (m * k >= 8 * PAR_MIN_WORK)")                                                 \
    for (int64_t r = 0; r < m; r++) sx[r] = w8_quant_row_##SUF(x + r * ldx, k, kq, xq + r * kq, xs + r);     \
    /* tasks (block of rows, W8_NV panels), row blocks outermost: a thread sweeps all columns of a block of     \
     * W8_ROW_BYTES of codes, which stays in its L2, rather than streaming every row from L3 per panel run */  \
    int64_t ntask = (np + W8_NV - 1) / W8_NV, nrb = (m * kq + W8_ROW_BYTES - 1) / W8_ROW_BYTES;                \
    int64_t rb = (m + nrb - 1) / nrb; /* blocks of one size (up to W8_MR), so the threads' halves balance */   \
    rb = (rb + W8_MR - 1) / W8_MR * W8_MR;                                                                     \
    nrb = (m + rb - 1) / rb;                                                                                   \
    _Pragma("omp parallel for collapse(2) schedule(static) if (m * n * k >= PAR_MIN_WORK)")                    \
    for (int64_t b = 0; b < nrb; b++)                                                                          \
    for (int64_t t = 0; t < ntask; t++) {                                                                      \
        int64_t p0 = t * W8_NV, rend = (b + 1) * rb < m ? (b + 1) * rb : m;                                    \
        int NV = np - p0 < W8_NV ? (int)(np - p0) : W8_NV;                                                     \
        _Alignas(64) int32_t res[W8_MR * W8_NV * W8_NP];                                                       \
        for (int64_t r0 = b * rb; r0 < rend; r0 += W8_MR) {                                                    \
            int R = rend - r0 < W8_MR ? (int)(rend - r0) : W8_MR;                                              \
            w8_tile_any(xq + r0 * kq, kq, wp + p0 * kg * 64, kg, R, NV, res);                                  \
            for (int i = 0; i < R; i++) {                                                                      \
                int32_t corr = 128 * xs[r0 + i];                                                               \
                float s = sx[r0 + i];                                                                          \
                T *o = out + (r0 + i) * ldo;                                                                   \
                for (int j = 0; j < NV; j++) {                                                                 \
                    int64_t c = (p0 + j) * W8_NP, ce = c + W8_NP < n ? c + W8_NP : n;                          \
                    const int32_t *acc = res + (i * NV + j) * W8_NP;                                           \
                    if (ce - c == W8_NP) { W8_STORE16(SUF) if (W8_VNNI_ON) continue; }                         \
                    for (int64_t cc = c; cc < ce; cc++) {                                                      \
                        float v = (float)(acc[cc - c] - corr) * s * scale[cc];                                 \
                        if (bias) v += LD_##SUF(bias + cc);                                                    \
                        ST_##SUF(o + cc, v);                                                                   \
                    }                                                                                          \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
    }                                                                                                          \
    scratch_trim(SCRATCH_W8A8);                                                                                \
    return 1;                                                                                                  \
}

#ifdef W8_VNNI
#define W8_VNNI_ON 1
#else
#define W8_VNNI_ON 0
#endif
DEFINE_W8A8_GEMM(f32, float)
DEFINE_W8A8_GEMM(bf16, uint16_t)

/* ---- GGUF block weights (weight-only): Q4_1 and Q8_0, one product for every number of rows ----------
 * Blocks of 32 weights along k with float16 factors (ggml's block_q4_1 / block_q8_0): Q4_1 codes 0..15
 * two per byte (element j in the low nibble of byte j, element j + 16 in its high nibble) with step d and
 * minimum m, w = fmaf(d, code, m) (d * code + m rounded once to float32: within half an ulp of
 * formats.dequantize_q4_1, which rounds twice); Q8_0 int8 codes with step d, w = d * code in float32.
 *   out[r, c] = T(dot8(x[r], w[c]) + bias[c]),
 * dot8: eight float32 lanes, lane l a chain of fused multiply-adds over k = l, l + 8, l + 16, ... in order
 * from 0, then the lanes summed in a fixed tree (hsum8). The chain of an output element is the same
 * whatever the number of rows and whichever tile computes it, so a row's bits never depend on its batch
 * (deterministic inference), and the scalar build computes the same chains (fmaf), so it gives the same
 * bits as the AVX2 one. Two tilings of that one arithmetic: up to GGUF_GEMM_MIN_ROWS rows, the blocks are
 * decoded in registers and applied to up to 4 rows at once (decode, where the weight is read once per
 * step); from there on, a panel of GGUF_PANEL output columns is decoded once into a float32 buffer that
 * stays in L2 and a 6 x 2 register tile of outputs runs over it (prefill: the decode is paid once per
 * panel, the tile does 8 loads per 12 fused multiply-adds); a k over 1.5 GGUF_KB is taken in passes of
 * GGUF_KB with the lane chains carried between passes (the same chains: at k = 1536 six rows of x no
 * longer fit L1 and were read from L2 for every column pair). Threads split output columns. */
#define GGUF_PANEL 32         /* output columns per decoded panel (32 x 1536 floats: 192 kB) */
#define GGUF_GEMM_MIN_ROWS 8  /* rows from which the panel tiling runs */
#define GGUF_MR 6             /* rows per register tile of the panel tiling */
#define GGUF_NR 2             /* columns per register tile of the panel tiling */
#define GGUF_KB 512           /* k per pass of the panel tiling (6 rows' floats: 12 kB, in L1) */
#define GGUF_RR 4             /* rows per tile of the register decode */
#define GGUF_CG 4             /* columns decoded side by side in the register decode */
#define GGUF_Q41 0
#define GGUF_Q80 1

typedef struct {  /* a GGUF weight [n, k]: format, codes, float16 steps d and (Q4_1) minima m */
    int fmt;
    const uint8_t *q;
    const uint16_t *d, *m;
    int64_t nb;
} gguf_w;

#if defined(__AVX2__) && defined(__FMA__)
typedef __m256 f8;
static inline f8 f8_zero(void) { return _mm256_setzero_ps(); }
static inline f8 f8_fmav(f8 x, f8 w, f8 acc) { return _mm256_fmadd_ps(x, w, acc); }
static inline f8 f8_fma(const float *x, f8 w, f8 acc) { return f8_fmav(_mm256_loadu_ps(x), w, acc); }
static inline f8 f8_ld(const float *p) { return _mm256_loadu_ps(p); }
static inline void f8_st(float *p, f8 v) { _mm256_storeu_ps(p, v); }
static inline float f8_sum(f8 v) { return hsum8(v); }
#define F8_IN_REGISTER(v) __asm__("" : "+x"(v))
/* block b of column c as 4 vectors of 8 float32 weights (k order): fmt a constant where inlined */
static inline __attribute__((always_inline)) void gguf_block(const gguf_w *W, int fmt, int64_t c, int64_t b,
                                                             f8 w[4]) {
    int64_t i = c * W->nb + b;
    __m256 db = _mm256_set1_ps(f16_to_f32(W->d[i]));
    if (fmt == GGUF_Q41) {
        /* the 16 bytes in both 128-bit lanes; byte shuffles put codes 0..3 | 4..7 (then 8..11 | 12..15) of
         * the low (then high) nibbles into the low byte of each 32-bit lane, zeros above */
        const __m256i low = _mm256_set1_epi8(0x0f);
        const __m256i s0 = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                            4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
        const __m256i s1 = _mm256_add_epi32(s0, _mm256_set1_epi32(8));
        __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(W->q + 16 * i)));
        __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        __m256 mb = _mm256_set1_ps(f16_to_f32(W->m[i]));
        w[0] = _mm256_fmadd_ps(db, _mm256_cvtepi32_ps(_mm256_shuffle_epi8(lo, s0)), mb);
        w[1] = _mm256_fmadd_ps(db, _mm256_cvtepi32_ps(_mm256_shuffle_epi8(lo, s1)), mb);
        w[2] = _mm256_fmadd_ps(db, _mm256_cvtepi32_ps(_mm256_shuffle_epi8(hi, s0)), mb);
        w[3] = _mm256_fmadd_ps(db, _mm256_cvtepi32_ps(_mm256_shuffle_epi8(hi, s1)), mb);
    } else {
        const int8_t *qb = (const int8_t *)W->q + 32 * i;
        for (int s = 0; s < 4; s++)
            w[s] = _mm256_mul_ps(db, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qb + 8 * s)))));
    }
}
#else
typedef struct { float v[8]; } f8;
static inline f8 f8_zero(void) { f8 r = {{0}}; return r; }
static inline f8 f8_fmav(f8 x, f8 w, f8 acc) {
    for (int l = 0; l < 8; l++) acc.v[l] = __builtin_fmaf(x.v[l], w.v[l], acc.v[l]);
    return acc;
}
static inline f8 f8_fma(const float *x, f8 w, f8 acc) {
    for (int l = 0; l < 8; l++) acc.v[l] = __builtin_fmaf(x[l], w.v[l], acc.v[l]);
    return acc;
}
static inline f8 f8_ld(const float *p) { f8 r; memcpy(r.v, p, sizeof r.v); return r; }
#define F8_IN_REGISTER(v) ((void)0)
static inline void f8_st(float *p, f8 v) { memcpy(p, v.v, sizeof v.v); }
static inline float f8_sum(f8 v) { /* hsum8's tree: (lo + hi), then lanes 0 + 2 and 1 + 3, then those two */
    float s[4];
    for (int l = 0; l < 4; l++) s[l] = v.v[l] + v.v[l + 4];
    return (s[0] + s[2]) + (s[1] + s[3]);
}
static inline void gguf_block(const gguf_w *W, int fmt, int64_t c, int64_t b, f8 w[4]) {
    int64_t i = c * W->nb + b;
    float db = f16_to_f32(W->d[i]);
    if (fmt == GGUF_Q41) {
        const uint8_t *q = W->q + 16 * i;
        float mb = f16_to_f32(W->m[i]);
        for (int j = 0; j < 16; j++) {
            w[j / 8].v[j % 8] = __builtin_fmaf(db, (float)(q[j] & 0x0f), mb);
            w[2 + j / 8].v[j % 8] = __builtin_fmaf(db, (float)(q[j] >> 4), mb);
        }
    } else {
        const int8_t *q = (const int8_t *)W->q + 32 * i;
        for (int j = 0; j < 32; j++) w[j / 8].v[j % 8] = db * (float)q[j];
    }
}
#endif

/* Register tiling: rows x[0..R) (k apart) times columns c0 .. c0 + C of W, each block decoded once and
 * applied to the R rows; res[r * C + j] = the dot8 sum of row r and column c0 + j. */
static inline __attribute__((always_inline)) void gguf_regs(const float *x, int64_t k, const gguf_w *W, int fmt,
                                                            int64_t c0, int R, int C, float *res) {
    f8 acc[GGUF_RR][GGUF_CG];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) acc[r][j] = f8_zero();
    for (int64_t b = 0; b < W->nb; b++)
        for (int j = 0; j < C; j++) {
            f8 w[4];
            gguf_block(W, fmt, c0 + j, b, w);
            for (int r = 0; r < R; r++)
                for (int s = 0; s < 4; s++) acc[r][j] = f8_fma(x + r * k + 32 * b + 8 * s, w[s], acc[r][j]);
        }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) res[r * C + j] = f8_sum(acc[r][j]);
}

/* Panel tiling over k in [i0, i1): rows x[0..R) (k apart) times float32 weight rows w[0..C) (k apart, a
 * decoded panel); the R x C chains continue from acc[r * GGUF_NR + j] and are left there, so a pass over k
 * in blocks runs the same fused multiply-adds in the same order as one pass. */
static inline __attribute__((always_inline)) void gguf_tile(const float *x, const float *w, int64_t k, int64_t i0,
                                                            int64_t i1, int R, int C, f8 *acc_io) {
    f8 acc[GGUF_MR][GGUF_NR];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) acc[r][j] = acc_io[r * GGUF_NR + j];
    for (int64_t i = i0; i < i1; i += 8) {
        f8 wv[GGUF_NR];
        for (int j = 0; j < C; j++) wv[j] = f8_ld(w + j * k + i);
        for (int r = 0; r < R; r++) {
            f8 xv = f8_ld(x + r * k + i);
            F8_IN_REGISTER(xv); /* one load of x for both columns (the compiler would fold it into each FMA) */
            for (int j = 0; j < C; j++) acc[r][j] = f8_fmav(xv, wv[j], acc[r][j]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) acc_io[r * GGUF_NR + j] = acc[r][j];
}

#define GGUF_REGS_R(FMT, C, c0, res)                                                                      \
    switch (R) {                                                                                           \
    case 4: gguf_regs(x, k, W, FMT, c0, 4, C, res); break;                                                 \
    case 3: gguf_regs(x, k, W, FMT, c0, 3, C, res); break;                                                 \
    case 2: gguf_regs(x, k, W, FMT, c0, 2, C, res); break;                                                 \
    default: gguf_regs(x, k, W, FMT, c0, 1, C, res); break;                                                \
    }
static void gguf_regs_fmt(const float *x, int64_t k, const gguf_w *W, int fmt, int64_t c0, int R, int C,
                          float *res) {
    if (C == GGUF_CG) {
        if (fmt == GGUF_Q41) { GGUF_REGS_R(GGUF_Q41, GGUF_CG, c0, res) }
        else { GGUF_REGS_R(GGUF_Q80, GGUF_CG, c0, res) }
        return;
    }
    for (int j = 0; j < C; j++) {  /* the last columns, one at a time */
        float v[GGUF_RR];
        if (fmt == GGUF_Q41) { GGUF_REGS_R(GGUF_Q41, 1, c0 + j, v) }
        else { GGUF_REGS_R(GGUF_Q80, 1, c0 + j, v) }
        for (int r = 0; r < R; r++) res[r * C + j] = v[r];
    }
}

#define GGUF_TILE_R(C)                                                                                     \
    switch (R) {                                                                                           \
    case 6: gguf_tile(x, w, k, i0, i1, 6, C, acc); break;                                                  \
    case 5: gguf_tile(x, w, k, i0, i1, 5, C, acc); break;                                                  \
    case 4: gguf_tile(x, w, k, i0, i1, 4, C, acc); break;                                                  \
    case 3: gguf_tile(x, w, k, i0, i1, 3, C, acc); break;                                                  \
    case 2: gguf_tile(x, w, k, i0, i1, 2, C, acc); break;                                                  \
    default: gguf_tile(x, w, k, i0, i1, 1, C, acc); break;                                                 \
    }
static void gguf_tile_any(const float *x, const float *w, int64_t k, int64_t i0, int64_t i1, int R, int C,
                          f8 *acc) {
    if (C == GGUF_NR) { GGUF_TILE_R(GGUF_NR) }
    else { GGUF_TILE_R(1) }
}

/* columns c0 .. c0 + nc of W decoded into wp [nc][k] (the weights gguf_block gives) */
static void gguf_panel(const gguf_w *W, int64_t c0, int64_t nc, float *wp) {
    int64_t k = 32 * W->nb;
    for (int64_t j = 0; j < nc; j++)
        for (int64_t b = 0; b < W->nb; b++) {
            f8 w[4];
            if (W->fmt == GGUF_Q41) gguf_block(W, GGUF_Q41, c0 + j, b, w);
            else gguf_block(W, GGUF_Q80, c0 + j, b, w);
            for (int s = 0; s < 4; s++) f8_st(wp + j * k + 32 * b + 8 * s, w[s]);
        }
}

/* out [m, n] (rows ldo apart) = xf [m, k] W^T (+ bias), stored through st(out + r * ldo + c, value). The
 * dot8 sums of every output; bias added in float32 after. Returns 0 if the panel buffers cannot be
 * allocated, else 1. */
#define DEFINE_GGUF_LINEAR(SUF, T)                                                                             \
/* The panel tiling for output columns c0 .. c0 + nc (decoded in wp [nc][k]) and all m rows: per tile of       \
 * GGUF_MR rows, k in blocks of GGUF_KB (the rows' block stays in L1 while every column pair of the panel      \
 * runs over it; the chains carried between blocks in acc), then the dot8 sums, bias, store. */                \
static void gguf_panel_rows_##SUF(const float *xf, int64_t m, int64_t k, const float *wp, int64_t nc,          \
                                  int64_t c0, const T *bias, T *out, int64_t ldo) {                            \
    int64_t kb = k > GGUF_KB + GGUF_KB / 2 ? GGUF_KB : k;                                                      \
    for (int64_t r = 0; r < m; r += GGUF_MR) {                                                                 \
        int R = m - r < GGUF_MR ? (int)(m - r) : GGUF_MR;                                                      \
        f8 acc[GGUF_PANEL / GGUF_NR][GGUF_MR * GGUF_NR];                                                       \
        for (int64_t p = 0; p < (nc + GGUF_NR - 1) / GGUF_NR; p++)                                             \
            for (int i = 0; i < GGUF_MR * GGUF_NR; i++) acc[p][i] = f8_zero();                                 \
        for (int64_t i0 = 0; i0 < k; i0 += kb) {                                                               \
            int64_t i1 = i0 + kb < k ? i0 + kb : k;                                                            \
            for (int64_t j = 0; j < nc; j += GGUF_NR) {                                                        \
                int C = nc - j < GGUF_NR ? (int)(nc - j) : GGUF_NR;                                            \
                gguf_tile_any(xf + r * k, wp + j * k, k, i0, i1, R, C, acc[j / GGUF_NR]);                      \
            }                                                                                                  \
        }                                                                                                      \
        for (int i = 0; i < R; i++)                                                                            \
            for (int64_t j = 0; j < nc; j++) {                                                                 \
                float v = f8_sum(acc[j / GGUF_NR][i * GGUF_NR + j % GGUF_NR]);                                 \
                if (bias) v += LD_##SUF(bias + c0 + j);                                                        \
                ST_##SUF(out + (r + i) * ldo + c0 + j, v);                                                     \
            }                                                                                                  \
    }                                                                                                          \
}                                                                                                              \
static int gguf_linear_##SUF(const float *xf, int64_t m, int64_t k, const gguf_w *W, int64_t n, const T *bias,  \
                             T *out, int64_t ldo) {                                                            \
    int panels = m >= GGUF_GEMM_MIN_ROWS;                                                                      \
    int64_t cols = panels ? GGUF_PANEL : GGUF_CG, ntask = (n + cols - 1) / cols;                               \
    float *wbuf = NULL;                                                                                        \
    if (panels) {                                                                                              \
        wbuf = (float *)aligned_alloc(64, sizeof(float) * (size_t)(GGUF_PANEL * k) * (size_t)MAX_THREADS());  \
        if (!wbuf) return 0;                                                                                   \
    }                                                                                                          \
    _Pragma("omp parallel for schedule(static) if (m * n * k >= PAR_MIN_WORK)")                                \
    for (int64_t t = 0; t < ntask; t++) {                                                                      \
        int64_t c0 = t * cols, nc = n - c0 < cols ? n - c0 : cols;                                             \
        float *wp = panels ? wbuf + (size_t)THREAD_ID() * (size_t)(GGUF_PANEL * k) : NULL;                     \
        if (panels) gguf_panel(W, c0, nc, wp);                                                                 \
        if (panels) { gguf_panel_rows_##SUF(xf, m, k, wp, nc, c0, bias, out, ldo); continue; }               \
        for (int64_t r = 0; r < m; r += GGUF_RR) {                                                             \
            int R = m - r < GGUF_RR ? (int)(m - r) : GGUF_RR;                                                  \
            for (int64_t j = 0; j < nc; j += GGUF_CG) {                                                        \
                int C = nc - j < GGUF_CG ? (int)(nc - j) : GGUF_CG;                                            \
                float res[GGUF_RR * GGUF_CG];                                                                  \
                gguf_regs_fmt(xf + r * k, k, W, W->fmt, c0 + j, R, C, res);                                    \
                for (int i = 0; i < R; i++)                                                                    \
                    for (int jj = 0; jj < C; jj++) {                                                           \
                        float v = res[i * C + jj];                                                             \
                        if (bias) v += LD_##SUF(bias + c0 + j + jj);                                           \
                        ST_##SUF(out + (r + i) * ldo + c0 + j + jj, v);                                        \
                    }                                                                                          \
            }                                                                                                  \
        }                                                                                                      \
    }                                                                                                          \
    free(wbuf);                                                                                                \
    return 1;                                                                                                  \
}                                                                                                              \
int q41_linear_##SUF(const T *x, int64_t m, int64_t k, int64_t ldx, const uint8_t *qs, const uint16_t *d,      \
                     const uint16_t *mn, int64_t n, const T *bias, T *out, int64_t ldo) {                      \
    int direct = sizeof(T) == sizeof(float) && ldx == k; /* float32 rows read in place */                      \
    float *xf = direct ? (float *)x : rows_to_f32_##SUF(x, m, k, ldx);                                         \
    if (!xf) return 0;                                                                                         \
    gguf_w W = {GGUF_Q41, qs, d, mn, k / 32};                                                                  \
    int ok = gguf_linear_##SUF(xf, m, k, &W, n, bias, out, ldo);                                               \
    if (!direct) free(xf);                                                                                     \
    return ok;                                                                                                 \
}                                                                                                              \
int q80_linear_##SUF(const T *x, int64_t m, int64_t k, int64_t ldx, const int8_t *q, const uint16_t *d,        \
                     int64_t n, const T *bias, T *out, int64_t ldo) {                                          \
    int direct = sizeof(T) == sizeof(float) && ldx == k; /* float32 rows read in place */                      \
    float *xf = direct ? (float *)x : rows_to_f32_##SUF(x, m, k, ldx);                                         \
    if (!xf) return 0;                                                                                         \
    gguf_w W = {GGUF_Q80, (const uint8_t *)q, d, NULL, k / 32};                                                \
    int ok = gguf_linear_##SUF(xf, m, k, &W, n, bias, out, ldo);                                               \
    if (!direct) free(xf);                                                                                     \
    return ok;                                                                                                 \
}

DEFINE_GGUF_LINEAR(f32, float)
DEFINE_GGUF_LINEAR(bf16, uint16_t)

/* ---- Dequantising a tile of output rows (the product of larger batches runs in the GEMM library) ----
 * Rows [0, n) of a GGUF block tensor to float32 w [n, k]: Q4_1 m + d * code, Q8_0 d * code (products in
 * float32, as idleless.quant.formats' dequantize functions). */
void q41_dequant(const uint8_t *qs, const uint16_t *d, const uint16_t *mn, int64_t n, int64_t k, float *w) {
    int64_t nb = k / 32;
    _Pragma("omp parallel for if (n * k >= PAR_MIN_WORK)")
    for (int64_t r = 0; r < n; r++)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *q = qs + (r * nb + b) * 16;
            float db = f16_to_f32(d[r * nb + b]), mb = f16_to_f32(mn[r * nb + b]);
            float *o = w + r * k + 32 * b;
            for (int j = 0; j < 16; j++) {
                o[j] = mb + db * (float)(q[j] & 0x0f);
                o[j + 16] = mb + db * (float)(q[j] >> 4);
            }
        }
}

void q80_dequant(const int8_t *q, const uint16_t *d, int64_t n, int64_t k, float *w) {
    int64_t nb = k / 32;
    _Pragma("omp parallel for if (n * k >= PAR_MIN_WORK)")
    for (int64_t r = 0; r < n; r++)
        for (int64_t b = 0; b < nb; b++) {
            float db = f16_to_f32(d[r * nb + b]);
            for (int j = 0; j < 32; j++) w[r * k + 32 * b + j] = db * (float)q[(r * nb + b) * 32 + j];
        }
}

/* ---- fp8 weights per output channel: q8_linear with the bytes decoded through lut[256] --------------
 * (the format's value of each byte pattern), so any 8-bit float format runs on one kernel:
 *   out[r, c] = T(scale[c] * sum_k x[r, k] lut[q[c, k]] + bias[c]); fixed-order float32 sums. */
static inline float dot_lut8(const float *x, const uint8_t *q, const float *lut, int64_t k) {
#if defined(__AVX2__) && defined(__FMA__)
    if (k % 8 == 0) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t i = 0; i < k; i += 8) {
            __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + i)));
            a = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_i32gather_ps(lut, idx, 4), a);
        }
        return hsum8(a);
    }
#endif
    float s = 0.f;
    for (int64_t i = 0; i < k; i++) s += x[i] * lut[q[i]];
    return s;
}

#define DEFINE_LUT8(SUF, T)                                                                                    \
int lut8_linear_##SUF(const T *x, int64_t m, int64_t k, int64_t ldx, const uint8_t *q, const float *lut,       \
                      const float *scale, int64_t n, const T *bias, T *out, int64_t ldo) {                     \
    float *xf = rows_to_f32_##SUF(x, m, k, ldx);                                                               \
    if (!xf) return 0;                                                                                         \
    int64_t ntask = (n + Q_COLS - 1) / Q_COLS;                                                                 \
    _Pragma("omp parallel for if (m * n * k >= PAR_MIN_WORK)")                                                 \
    for (int64_t t = 0; t < ntask; t++)                                                                        \
        for (int64_t c = t * Q_COLS; c < n && c < (t + 1) * Q_COLS; c++)                                       \
            for (int64_t r = 0; r < m; r++) {                                                                  \
                float v = scale[c] * dot_lut8(xf + r * k, q + c * k, lut, k);                                  \
                if (bias) v += LD_##SUF(bias + c);                                                             \
                ST_##SUF(out + r * ldo + c, v);                                                                \
            }                                                                                                  \
    free(xf);                                                                                                  \
    return 1;                                                                                                  \
}

DEFINE_LUT8(f32, float)
DEFINE_LUT8(bf16, uint16_t)

/* ---- GGUF block weights times 8-bit activations (W4A8 on Q4_1, W8A8 on Q8_0): integer dot products ----
 * llama.cpp's scheme (ggml's Q8_1 activations against Q4_1 / Q8_0 weights), our own code. Each row of x
 * is quantised per block of 32 input features (a8_quantize): d_x = amax / 127 (float32), codes
 * q_x = rint(x / d_x) (IEEE division, nearest-even; all zero when amax is 0) and s_x = d_x * float(sum q_x).
 * A Q4_1 block (step d_w, minimum m_w, codes u 0..15) times an activation block is then
 *   sum_i (d_w u_i + m_w) d_x q_i = (d_w d_x) sum_i u_i q_i + m_w s_x,
 * a Q8_0 block (d_w, codes q_w) (d_w d_x) sum_i q_w,i q_i. The integer sums are exact; the float order
 * is fixed: eight float32 lanes per output, each an int32 partial sum of a block converted (exactly) and
 * fused-multiply-added with that block's d_w * d_x, in block order from 0; the lanes summed in hsum8's
 * tree. Q8_0: per block, lane l = features 4l .. 4l + 3. Q4_1: blocks in pairs (2p, 2p + 1; an odd last
 * block alone, lanes 4..7 then adding 0 * 0), lanes 0..3 block 2p and 4..7 block 2p + 1, lane l of a block
 * = features 4l .. 4l + 3 and 16 + 4l .. 16 + 4l + 3 (a8_tile_q41). Q4_1's m_w s_x terms likewise in eight
 * float32 lanes, lane l a fused-multiply-add chain over blocks l, l + 8, ... (a8_minima), added after:
 *   out[r, c] = T(hsum8(acc) [+ minima] + bias[c]).
 * AVX2: vpmaddubsw (unsigned times signed bytes, pairs: no int16 overflow, 15 * 127 * 2 and 128 * 127 * 2
 * < 32767; Q8_0's signed codes through the sign trick |q_w| * sign(q_x, q_w); Q4_1's two nibble halves
 * added as int16, at most 4 * 15 * 127), vpmaddwd with ones into the eight lanes; with AVX512-VNNI (+VL)
 * one vpdpbusd per 32 bytes instead (the same exact lane sums, no int16 step: a8_dot1 / a8_dot2); the
 * scalar build computes the same lanes with fmaf, so all give the same bits. An output's chain never depends on the other rows
 * of the call nor on the tile that computes it (batch-invariant). Register tiles of 4 rows x 2 columns
 * (fewer rows: 2 or 1 x 4; a single Q4_1 row on AVX2: 8 columns, a8_row8_q41, the same chains) decode each
 * weight block once per tile and load each activation block once per tile; thread tasks are A8_COLS columns x A8_ROWS rows, columns outermost (a thread reads its share of the
 * weight once); the weight is prefetched A8_AHEAD columns ahead. The codes come in W4A8's own layouts,
 * 8 (Q4_1) or 4 (Q8_0) columns interleaved unit by unit (a8_at; the float16 steps and minima stay GGUF's
 * [n][nb]): a one-row tile reads one contiguous stream instead of one per column (benchmarks/README.md,
 * "W4A8 weight layouts"). */
#define A8_RR 4       /* most rows per register tile (4 x 2; 2 x 4 and 1 x 4 for fewer rows) */
#define A8_CG 4       /* most columns per register tile */
#define A8_COLS 16    /* output columns per thread task */
#define A8_ROWS 32    /* rows per thread task */
#define A8_STACK 16384 /* activation codes and scales up to this many bytes live on the stack */
#define A8_PAR_MIN_WORK PAR_MIN_WORK /* m * n * k from which threads split the output columns */
#define A8_AHEAD 8    /* software prefetch of the weight this many columns ahead (the next tiles') */

/* the scales d_w * d_x of blocks 0 .. nb of weight row wd and activation row xd (float32 products) */
static inline void a8_scales(const uint16_t *wd, const float *xd, int64_t nb, float *sc) {
    int64_t b = 0;
#if defined(__AVX2__) && defined(__F16C__)
    for (; b + 8 <= nb; b += 8)
        _mm256_storeu_ps(sc + b, _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wd + b))),
                                               _mm256_loadu_ps(xd + b)));
#endif
    for (; b < nb; b++) sc[b] = f16_to_f32(wd[b]) * xd[b];
}

/* Q4_1's minima term sum_b m_w,b s_x,b: eight lanes, lane l the fused multiply-add chain over blocks
 * b = l, l + 8, ... in order, lanes summed in hsum8's tree (the last nb % 8 blocks on scalars: no store
 * forwarding stall from a padded vector) */
static inline float a8_minima(const uint16_t *wm, const float *xs, int64_t nb) {
    float a[8] = {0};
    int64_t b = 0;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    __m256 acc = _mm256_setzero_ps();
    for (; b + 8 <= nb; b += 8)
        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wm + b))), _mm256_loadu_ps(xs + b), acc);
    _mm256_storeu_ps(a, acc);
#endif
    for (; b < nb; b++) a[b % 8] = __builtin_fmaf(f16_to_f32(wm[b]), xs[b], a[b % 8]);
    float h[4];
    for (int l = 0; l < 4; l++) h[l] = a[l] + a[l + 4];
    return (h[0] + h[2]) + (h[1] + h[3]);
}

/* prefetch the float16 factors (steps wd, Q4_1's minima wm) of columns c .. c + C: read once per tile, far
 * apart in time, they missed the caches where the codes' stream did not */
static inline void a8_prefetch_factors(const uint16_t *wd, const uint16_t *wm, int64_t c, int C, int64_t nb,
                                       int64_t n) {
    if (c >= n) return;
    int64_t bytes = 2 * (c + C <= n ? C : n - c) * nb;
    for (int64_t off = 0; off < bytes; off += 64) {
        __builtin_prefetch((const char *)(wd + c * nb) + off);
        if (wm) __builtin_prefetch((const char *)(wm + c * nb) + off);
    }
}

/* Q4_1's activation layout: blocks in pairs, 64 bytes per pair: features 0..15 of block 2p, of block 2p + 1,
 * then 16..31 of block 2p, of block 2p + 1 (the order of the weight's nibbles two blocks at a time); the
 * offset of feature e of block b in a row */
static inline int64_t a8_pair_at(int64_t b, int e) { return 64 * (b / 2) + 32 * (e / 16) + 16 * (b % 2) + e % 16; }

/* The weight layouts here (W4A8's own, repacked once at load: formats.interleave_q4_1 / interleave_q8_0):
 * output columns in groups of G (the last group the n % G left), a group's 32-byte units in order, each unit
 * holding every column of the group in order. Q4_1 (G = A8_GROUP): unit p = GGUF's 16 bytes of block 2p,
 * then of block 2p + 1 (zero where nb is odd and 2p + 1 = nb); Q8_0 (G = A8_CG): unit b = block b's 32
 * codes. A one-row tile of a whole group reads one contiguous stream; the address of column c's unit i,
 * nu units per column: */
#define A8_GROUP 8
_Static_assert(A8_COLS % A8_GROUP == 0, "a8_row8_q41 reads whole groups: thread tasks must start on one");
static inline const uint8_t *a8_at(const uint8_t *wq, int64_t n, int64_t nu, int G, int64_t c, int64_t i) {
    int64_t g = c / G * G, w = n - g < G ? n - g : G;
    return wq + 32 * (g * nu + i * w + (c - g));
}
#define a8_q41_at(wq, n, np, c, p) a8_at(wq, n, np, A8_GROUP, c, p)
#define a8_q80_at(wq, n, nb, c, b) ((const int8_t *)a8_at(wq, n, nb, A8_CG, c, b))

#if defined(__AVX2__) && defined(__FMA__)
/* lane l (of 8) = sum of the products of bytes 4l .. 4l + 3 of u (unsigned) and s (signed), exact where no
 * pair of products exceeds int16 (a8_dot1), or of two such byte vectors (a8_dot2: the pairs' int16 sums
 * added as int16 first, exact where their sum fits): vpdpbusd with AVX512-VNNI, else vpmaddubsw + vpmaddwd */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
static inline __attribute__((always_inline)) __m256i a8_dot1(__m256i u, __m256i s) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
}
static inline __attribute__((always_inline)) __m256i a8_dot2(__m256i u0, __m256i s0, __m256i u1, __m256i s1) {
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u0, s0), u1, s1);
}
#else
static inline __attribute__((always_inline)) __m256i a8_dot1(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
static inline __attribute__((always_inline)) __m256i a8_dot2(__m256i u0, __m256i s0, __m256i u1, __m256i s1) {
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1)),
                             _mm256_set1_epi16(1));
}
#endif
/* the eight lanes of one Q8_0 block's integer dot product (sign trick), converted to float32 (exact) */
static inline __attribute__((always_inline)) __m256 a8_lanes(__m256i w, __m256i wa, __m256i x) {
    return _mm256_cvtepi32_ps(a8_dot1(wa, _mm256_sign_epi8(x, w)));
}
/* Q8_0: rows xq[0..R) (k apart, scales xd nb apart) times columns c0 .. c0 + C: res[r * C + j] = hsum8(acc);
 * sc: room for R * C * nb floats (the block scales d_w * d_x, computed first). Named accumulators (an
 * array of them was kept in memory by the compiler); R, C constants where inlined: 1-2 x 4, 3-4 x 2. */
#define A8_ACC(r, j)                                                                                       \
    if (R > r && C > j)                                                                                    \
        a##r##j = _mm256_fmadd_ps(a8_lanes(w##j, wa##j, x##r), _mm256_broadcast_ss(sc + (r * C + j) * nb + b), \
                                  a##r##j);
#define A8_CODES(j)                                                                                        \
    if (C > j) {                                                                                           \
        const int8_t *wp = a8_q80_at(wq, n, nb, c0 + j, b);                                                \
        _mm_prefetch((const char *)(wp + 32 * A8_AHEAD * nb), _MM_HINT_T0); /* A8_AHEAD columns on */      \
        w##j = _mm256_loadu_si256((const __m256i *)wp);                                                    \
        wa##j = _mm256_sign_epi8(w##j, w##j);                                                              \
    }
static inline __attribute__((always_inline)) void a8_tile_q80(const int8_t *xq, const float *xd, int64_t k,
                                                          const uint8_t *wq, int64_t n, const uint16_t *wd,
                                                          int64_t c0, int R, int C, float *sc, float *res) {
    int64_t nb = k / 32;
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) a8_scales(wd + (c0 + j) * nb, xd + r * nb, nb, sc + (r * C + j) * nb);
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00,
           a20 = a00, a21 = a00, a30 = a00, a31 = a00;
    for (int64_t b = 0; b < nb; b++) {
        __m256i w0 = _mm256_setzero_si256(), w1 = w0, w2 = w0, w3 = w0, wa0 = w0, wa1 = w0, wa2 = w0, wa3 = w0;
        A8_CODES(0) A8_CODES(1) A8_CODES(2) A8_CODES(3)
        __m256i x0 = _mm256_loadu_si256((const __m256i *)(xq + 32 * b)), x1 = x0, x2 = x0, x3 = x0;
        if (R > 1) x1 = _mm256_loadu_si256((const __m256i *)(xq + k + 32 * b));
        if (R > 2) x2 = _mm256_loadu_si256((const __m256i *)(xq + 2 * k + 32 * b));
        if (R > 3) x3 = _mm256_loadu_si256((const __m256i *)(xq + 3 * k + 32 * b));
        A8_ACC(0, 0) A8_ACC(0, 1) A8_ACC(0, 2) A8_ACC(0, 3)
        A8_ACC(1, 0) A8_ACC(1, 1) A8_ACC(1, 2) A8_ACC(1, 3)
        A8_ACC(2, 0) A8_ACC(2, 1) A8_ACC(3, 0) A8_ACC(3, 1)
    }
    __m256 acc[4][4] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}, {a20, a21}, {a30, a31}};
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) res[r * C + j] = hsum8(acc[r][j]);
}
/* Q4_1 two blocks at a time (b, b + 1 of a column are 32 adjacent bytes, a8_q41_at; columns n): low nibbles
 * = features 0..15 of both, high nibbles = features 16..31 of both, against activation codes stored in that order (a8_pair_at);
 * the two vpmaddubsw results added as int16 (at most 4 * 15 * 127: exact) and summed by vpmaddwd into lanes
 * 0..3 (block b, lane l: features 4l..4l+3 and 16+4l..16+4l+3) and 4..7 (block b + 1), each scaled by its
 * block's d_w d_x (a zero scale and zero codes past the last block). */
#define A8P_ACC(r, j)                                                                                      \
    if (R > r && C > j)                                                                                    \
        a##r##j = _mm256_fmadd_ps(                                                                         \
            _mm256_cvtepi32_ps(a8_dot2(lo##j, _mm256_loadu_si256((const __m256i *)(xq + r * ldq + 64 * p)), \
                                       hi##j, _mm256_loadu_si256((const __m256i *)(xq + r * ldq + 64 * p + 32)))), \
            _mm256_permutevar8x32_ps(_mm256_loadu_ps(sc + (r * C + j) * nb8 + (2 * p & ~(int64_t)7)), idx), a##r##j);
#define A8P_CODES(j)                                                                                       \
    if (C > j) {                                                                                           \
        const uint8_t *wp = a8_q41_at(wq, n, np, c0 + j, p);                                               \
        _mm_prefetch((const char *)(wp + 32 * A8_GROUP * np), _MM_HINT_T0); /* the next group's */         \
        __m256i v = _mm256_loadu_si256((const __m256i *)wp);                                               \
        lo##j = _mm256_and_si256(v, low);                                                                  \
        hi##j = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);                                            \
    }
#define A8P_STEP                                                                                           \
    {                                                                                                      \
        __m256i idx = _mm256_add_epi32(_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_set1_epi32(2 * (int)(p & 3))); \
        __m256i lo0 = _mm256_setzero_si256(), lo1 = lo0, lo2 = lo0, lo3 = lo0, hi0 = lo0, hi1 = lo0, hi2 = lo0, hi3 = lo0; \
        A8P_CODES(0) A8P_CODES(1) A8P_CODES(2) A8P_CODES(3)                                                \
        A8P_ACC(0, 0) A8P_ACC(0, 1) A8P_ACC(0, 2) A8P_ACC(0, 3)                                            \
        A8P_ACC(1, 0) A8P_ACC(1, 1) A8P_ACC(1, 2) A8P_ACC(1, 3)                                            \
        A8P_ACC(2, 0) A8P_ACC(2, 1) A8P_ACC(3, 0) A8P_ACC(3, 1)                                            \
    }
static inline __attribute__((always_inline)) void a8_tile_q41(const int8_t *xq, int64_t ldq, const float *xd,
                                                              int64_t nb, const uint8_t *wq, int64_t n, const uint16_t *wd,
                                                              int64_t c0, int R, int C, float *sc, float *res) {
    int64_t nb8 = (nb + 7) / 8 * 8, np = (nb + 1) / 2;
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) {
            float *s = sc + (r * C + j) * nb8;
            a8_scales(wd + (c0 + j) * nb, xd + r * nb, nb, s);
            for (int64_t b = nb; b < nb8; b++) s[b] = 0.f;
        }
    const __m256i low = _mm256_set1_epi8(0x0f);
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00,
           a20 = a00, a21 = a00, a30 = a00, a31 = a00;
    int64_t p = 0;
    for (; 2 * p < nb; p++) A8P_STEP /* an odd last block: its pair's zero codes past it */
    __m256 acc[4][4] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}, {a20, a21}, {a30, a31}};
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) res[r * C + j] = hsum8(acc[r][j]);
}
#else
static inline void a8_tile_q80(const int8_t *xq, const float *xd, int64_t k, const uint8_t *wq, int64_t n,
                               const uint16_t *wd, int64_t c0, int R, int C, float *sc, float *res) {
    int64_t nb = k / 32;
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) {
            float acc[8] = {0};
            a8_scales(wd + (c0 + j) * nb, xd + r * nb, nb, sc);
            for (int64_t b = 0; b < nb; b++) {
                const int8_t *w = a8_q80_at(wq, n, nb, c0 + j, b);
                const int8_t *x = xq + r * k + 32 * b;
                for (int l = 0; l < 8; l++) {
                    int32_t s = 0;
                    for (int e = 4 * l; e < 4 * l + 4; e++) s += (int32_t)w[e] * (int32_t)x[e];
                    acc[l] = __builtin_fmaf((float)s, sc[b], acc[l]);
                }
            }
            float h[4];
            for (int l = 0; l < 4; l++) h[l] = acc[l] + acc[l + 4];
            res[r * C + j] = (h[0] + h[2]) + (h[1] + h[3]);
        }
}
/* the portable a8_tile_q41: the same lanes (see there), products summed exactly, one fmaf per lane and pair */
static inline void a8_tile_q41(const int8_t *xq, int64_t ldq, const float *xd, int64_t nb, const uint8_t *wq,
                               int64_t n, const uint16_t *wd, int64_t c0, int R, int C, float *sc, float *res) {
    for (int r = 0; r < R; r++)
        for (int j = 0; j < C; j++) {
            float acc[8] = {0};
            a8_scales(wd + (c0 + j) * nb, xd + r * nb, nb, sc);
            for (int64_t p = 0; 2 * p < nb; p++)
                for (int l = 0; l < 8; l++) {
                    int64_t b = 2 * p + l / 4;
                    int32_t s = 0;
                    float scale = 0.f;
                    if (b < nb) {
                        const uint8_t *w = a8_q41_at(wq, n, (nb + 1) / 2, c0 + j, b / 2) + 16 * (b % 2);
                        for (int e = 4 * (l % 4); e < 4 * (l % 4) + 4; e++)
                            s += (w[e] & 0x0f) * (int32_t)xq[r * ldq + a8_pair_at(b, e)] +
                                 (w[e] >> 4) * (int32_t)xq[r * ldq + a8_pair_at(b, e + 16)];
                        scale = sc[b];
                    }
                    acc[l] = __builtin_fmaf((float)s, scale, acc[l]);
                }
            float h[4];
            for (int l = 0; l < 4; l++) h[l] = acc[l] + acc[l + 4];
            res[r * C + j] = (h[0] + h[2]) + (h[1] + h[3]);
        }
}
#endif

#define A8_TILE_RC(CALL)                                                                                   \
    switch (R * 8 + C) {                                                                                   \
    case 4 * 8 + 2: CALL(4, 2); break;                                                                     \
    case 3 * 8 + 2: CALL(3, 2); break;                                                                     \
    case 2 * 8 + 4: CALL(2, 4); break;                                                                     \
    case 1 * 8 + 4: CALL(1, 4); break;                                                                     \
    case 4 * 8 + 1: CALL(4, 1); break;                                                                     \
    case 3 * 8 + 1: CALL(3, 1); break;                                                                     \
    case 2 * 8 + 1: CALL(2, 1); break;                                                                     \
    default: CALL(1, 1); break;                                                                            \
    }
#define A8_CALL_Q41(RR, CC) a8_tile_q41(xq, ldq, xd, k / 32, wq, n, wd, c0, RR, CC, sc, res)
#define A8_CALL_Q80(RR, CC) a8_tile_q80(xq, xd, k, wq, n, wd, c0, RR, CC, sc, res)
/* a register tile of R rows x C columns: (4 or 3) x 2, (2 or 1) x 4, or any R x 1; xq rows ldq apart
 * (Q4_1: the pair layout, a8_pair_at; Q8_0: k); wq in a8_at's layouts (n columns) */
static void a8_tile_any(int fmt, const int8_t *xq, int64_t ldq, const float *xd, int64_t k, const uint8_t *wq, int64_t n,
                        const uint16_t *wd, int64_t c0, int R, int C, float *sc, float *res) {
    if (fmt == GGUF_Q41) { A8_TILE_RC(A8_CALL_Q41) }
    else { A8_TILE_RC(A8_CALL_Q80) }
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define A8_WIDE A8_GROUP /* Q4_1 columns per one-row tile (a8_row8_q41): one group of a8_q41_at's layout */
/* the sums of eight vectors v[0..8) in hsum8's tree at once: lane j = hsum8(v[j]) (a transpose-add: lanes
 * l + (l + 4) of v[j] and v[j + 4] in one vector, then the pairs (h0 + h2), (h1 + h3), then their sum) */
static inline __attribute__((always_inline)) __m256 a8_hsum8x8(const __m256 *v) {
    __m256 t[4];
    for (int j = 0; j < 4; j++)
        t[j] = _mm256_add_ps(_mm256_permute2f128_ps(v[j], v[j + 4], 0x20), _mm256_permute2f128_ps(v[j], v[j + 4], 0x31));
    __m256 u0 = _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], 0x44), _mm256_shuffle_ps(t[0], t[1], 0xee));
    __m256 u1 = _mm256_add_ps(_mm256_shuffle_ps(t[2], t[3], 0x44), _mm256_shuffle_ps(t[2], t[3], 0xee));
    return _mm256_add_ps(_mm256_shuffle_ps(u0, u1, 0x88), _mm256_shuffle_ps(u0, u1, 0xdd));
}
/* a8_row8_q41's step over block pair p of its 8 columns (w8: their group's codes, a8_q41_at; dwf: their steps
 * as float32; np pairs per column); tail: an odd last block, its pair's codes zero past it, lanes 4..7 zero
 * times zero. The pair's 8 columns are 256 contiguous bytes: the next group's (np pairs on) prefetched. */
static inline __attribute__((always_inline)) void a8_row8_pair(const int8_t *xq, const uint8_t *w8, const float *dwf,
                                                               __m256 xp, int64_t nb, int64_t np, int64_t p, int tail,
                                                               __m256 *acc) {
    const __m256i low = _mm256_set1_epi8(0x0f), pick = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    __m256i x0 = _mm256_loadu_si256((const __m256i *)(xq + 64 * p)), x1 = _mm256_loadu_si256((const __m256i *)(xq + 64 * p + 32));
    const uint8_t *wb = w8 + 32 * A8_WIDE * p;
    const float *db = dwf + 2 * p;
#pragma GCC unroll 8
    for (int j = 0; j < A8_WIDE; j++) {
        const uint8_t *wp = wb + 32 * j;
        if (j % 2 == 0) _mm_prefetch((const char *)(wp + 32 * A8_WIDE * np), _MM_HINT_T0);
        __m256i v = _mm256_loadu_si256((const __m256i *)wp);
        __m256i s = a8_dot2(_mm256_and_si256(v, low), x0, _mm256_and_si256(_mm256_srli_epi16(v, 4), low), x1);
        __m256 sc = _mm256_mul_ps(_mm256_permutevar8x32_ps(_mm256_loadu_ps(db + j * nb), pick), xp);
        if (tail) sc = _mm256_blend_ps(sc, _mm256_setzero_ps(), 0xf0);
        acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), sc, acc[j]);
    }
}
/* Q4_1, one row times the 8 columns c0 .. c0 + 8 (one whole group of a8_q41_at's layout), the same lanes, chains and trees as a8_tile_q41 plus
 * a8_minima (so the same bits): out[j] = hsum8(acc_j) + minima_j. For one row (batch-1 decode) the work
 * around the integer dot products is shared by the 8 columns: their float16 steps and minima (8 nb
 * contiguous values each) converted in one pass, the step products d_w d_x formed in registers (xpair[p]
 * = d_x of blocks 2p (lanes 0..3) and 2p + 1 (lanes 4..7), zero past the last block), the minima terms as
 * one small GEMV against xsp (the row's s_x, zero-padded to a multiple of 8), the 16 horizontal sums as
 * two transpose-adds. */
static inline void a8_row8_q41(const int8_t *xq, const __m256 *xpair, const float *xsp, int64_t nb,
                               const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, int64_t c0, float *out) {
    float dwf[A8_WIDE * nb + 8], mwf[A8_WIDE * nb + 8];
    const uint16_t *d8 = wd + c0 * nb, *m8 = wm + c0 * nb;
    for (int64_t i = 0; i < A8_WIDE * nb; i += 8) {
        _mm256_storeu_ps(dwf + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d8 + i))));
        _mm256_storeu_ps(mwf + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m8 + i))));
    }
    _mm256_storeu_ps(dwf + A8_WIDE * nb, _mm256_setzero_ps());
    _mm256_storeu_ps(mwf + A8_WIDE * nb, _mm256_setzero_ps());
    int64_t np = (nb + 1) / 2;
    const uint8_t *w8 = wq + 32 * c0 * np;
    __m256 acc[A8_WIDE];
    for (int j = 0; j < A8_WIDE; j++) acc[j] = _mm256_setzero_ps();
    int64_t p = 0;
    for (; 2 * p + 1 < nb; p++) a8_row8_pair(xq, w8, dwf, xpair[p], nb, np, p, 0, acc);
    if (2 * p < nb) a8_row8_pair(xq, w8, dwf, xpair[p], nb, np, p, 1, acc); /* an odd last block */
    /* the minima: lane l of column j the chain over blocks l, l + 8, ...; past nb zero times zero */
    int64_t nf = nb / 8 * 8;
    const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(nb - nf)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    __m256 mac[A8_WIDE];
    for (int j = 0; j < A8_WIDE; j++) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t b = 0; b < nf; b += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(mwf + j * nb + b), _mm256_loadu_ps(xsp + b), a);
        if (nf < nb) a = _mm256_fmadd_ps(_mm256_and_ps(_mm256_loadu_ps(mwf + j * nb + nf), keep), _mm256_loadu_ps(xsp + nf), a);
        mac[j] = a;
    }
    _mm256_storeu_ps(out, _mm256_add_ps(a8_hsum8x8(acc), a8_hsum8x8(mac)));
}
/* one row's activation factors for a8_row8_q41: xpair [(nb + 1) / 2] and xsp [nb rounded up to 8] */
static inline void a8_row8_factors(const float *xd, const float *xs, int64_t nb, __m256 *xpair, float *xsp) {
    for (int64_t p = 0; 2 * p < nb; p++)
        xpair[p] = _mm256_set_m128(_mm_set1_ps(2 * p + 1 < nb ? xd[2 * p + 1] : 0.f), _mm_set1_ps(xd[2 * p]));
    for (int64_t b = 0; b < (nb + 7) / 8 * 8; b++) xsp[b] = b < nb ? xs[b] : 0.f;
}
#endif

/* one block of 32: its codes qb, returns its step d_x; *sum: the sum of its codes. AVX2 where the compiler
 * targets it (the same IEEE division and nearest-even rounding lane by lane), plain C otherwise */
#if defined(__AVX2__) && defined(__FMA__)
#define DEFINE_A8_BLOCK(SUF, T)                                                                                \
static inline float a8_block_##SUF(const T *xb, int8_t *qb, int32_t *sum) {                                    \
    __m256 v[4], mx = _mm256_setzero_ps();                                                                     \
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));                                    \
    for (int i = 0; i < 4; i++) {                                                                              \
        v[i] = v_ld_##SUF(xb + 8 * i);                                                                         \
        mx = _mm256_max_ps(mx, _mm256_and_ps(v[i], absm));                                                     \
    }                                                                                                          \
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));                           \
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));                                                                    \
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));                                                                \
    float db = _mm_cvtss_f32(h) / 127.f;                                                                       \
    __m256 div = _mm256_set1_ps(db != 0.f ? db : 1.f);                                                         \
    const __m256 lim = _mm256_set1_ps(127.f);                                                                  \
    __m256i c[4], tot = _mm256_setzero_si256();                                                                \
    for (int i = 0; i < 4; i++) {                                                                              \
        __m256 y = _mm256_round_ps(_mm256_div_ps(v[i], div), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);   \
        y = _mm256_max_ps(_mm256_min_ps(y, lim), _mm256_sub_ps(_mm256_setzero_ps(), lim));                     \
        c[i] = _mm256_cvtps_epi32(y);                                                                          \
        tot = _mm256_add_epi32(tot, c[i]);                                                                     \
    }                                                                                                          \
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));            \
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));                             \
    _mm256_storeu_si256((__m256i *)qb, p);                                                                     \
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(tot), _mm256_extracti128_si256(tot, 1));                  \
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));                                                          \
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));                                                          \
    *sum = _mm_cvtsi128_si32(t);                                                                               \
    return db;                                                                                                 \
}
#else
#define DEFINE_A8_BLOCK(SUF, T)                                                                                \
static inline float a8_block_##SUF(const T *xb, int8_t *qb, int32_t *sum) {                                    \
    float amax = 0.f;                                                                                          \
    for (int e = 0; e < 32; e++) {                                                                             \
        float a = fabsf(LD_##SUF(xb + e));                                                                     \
        amax = a > amax ? a : amax;                                                                            \
    }                                                                                                          \
    float db = amax / 127.f, div = db != 0.f ? db : 1.f;                                                       \
    int32_t s = 0;                                                                                             \
    for (int e = 0; e < 32; e++) {                                                                             \
        float y = rintf(LD_##SUF(xb + e) / div);                                                               \
        int32_t c = (int32_t)(y > 127.f ? 127.f : (y < -127.f ? -127.f : y));                                  \
        qb[e] = (int8_t)c;                                                                                     \
        s += c;                                                                                                \
    }                                                                                                          \
    *sum = s;                                                                                                  \
    return db;                                                                                                 \
}
#endif

/* in a8_task: a single row (R == 1) of Q4_1 in tiles of 8 columns (a8_row8_q41, the same bits as the
 * register tiles) while 8 are left; nothing without AVX2 */
#ifdef A8_WIDE
#define A8_ROW8(SUF)                                                                                           \
    if (R == 1 && J->fmt == GGUF_Q41 && c1 - c >= A8_WIDE) {                                                   \
        __m256 xpair[(nb + 1) / 2];                                                                            \
        float xsp[(nb + 7) / 8 * 8], res8[A8_WIDE];                                                            \
        a8_row8_factors(J->xd + r * nb, J->xs + r * nb, nb, xpair, xsp);                                       \
        for (; c1 - c >= A8_WIDE; c += A8_WIDE) {                                                              \
            if (r == r0) a8_prefetch_factors(J->wd, J->wm, c + A8_AHEAD, A8_WIDE, nb, n);                      \
            a8_row8_q41(J->xq + r * J->ldq, xpair, xsp, nb, J->wq, J->wd, J->wm, c, res8);                     \
            for (int j = 0; j < A8_WIDE; j++) {                                                                \
                float v = res8[j];                                                                             \
                if (J->bias) v += LD_##SUF(J->bias + c + j);                                                   \
                ST_##SUF(J->out + r * J->ldo + c + j, v);                                                      \
            }                                                                                                  \
        }                                                                                                      \
    }
#else
#define A8_ROW8(SUF)
#endif

#define DEFINE_A8(SUF, T)                                                                                      \
DEFINE_A8_BLOCK(SUF, T)                                                                                        \
/* rows r0 .. r1 of x quantised: codes into q (rows ldq apart; paired: Q4_1's pair layout, a8_pair_at, the   \
 * halves of a missing last block zero), steps d and sums s (rows k / 32 apart) */                              \
static void a8_quantize_rows_##SUF(const T *x, int64_t r0, int64_t r1, int64_t k, int64_t ldx, int8_t *q,      \
                                   int64_t ldq, int paired, float *d, float *s) {                              \
    int64_t nb = k / 32;                                                                                       \
    for (int64_t r = r0; r < r1; r++) {                                                                        \
        int8_t *qr = q + r * ldq;                                                                              \
        for (int64_t b = 0; b < nb; b++) {                                                                     \
            int32_t sum;                                                                                       \
            int8_t tmp[32];                                                                                    \
            float db = a8_block_##SUF(x + r * ldx + 32 * b, paired ? tmp : qr + 32 * b, &sum);                 \
            if (paired) {                                                                                      \
                memcpy(qr + a8_pair_at(b, 0), tmp, 16);                                                        \
                memcpy(qr + a8_pair_at(b, 16), tmp + 16, 16);                                                  \
            }                                                                                                  \
            d[r * nb + b] = db;                                                                                \
            s[r * nb + b] = db * (float)sum;                                                                   \
        }                                                                                                      \
        if (paired && nb % 2) {                                                                                \
            memset(qr + a8_pair_at(nb, 0), 0, 16);                                                             \
            memset(qr + a8_pair_at(nb, 16), 0, 16);                                                            \
        }                                                                                                      \
    }                                                                                                          \
}                                                                                                              \
static void a8_quantize_into_##SUF(const T *x, int64_t m, int64_t k, int64_t ldx, int8_t *q, int64_t ldq,      \
                                   int paired, float *d, float *s) {                                           \
    if (m * k < 8 * PAR_MIN_WORK || MAX_THREADS() == 1) { /* no OpenMP region: its set-up costs a microsecond */ \
        a8_quantize_rows_##SUF(x, 0, m, k, ldx, q, ldq, paired, d, s);                                         \
        return;                                                                                                \
    }                                                                                                          \
    _Pragma("omp parallel for")                                                                                \
    for (int64_t r = 0; r < m; r++) a8_quantize_rows_##SUF(x, r, r + 1, k, ldx, q, ldq, paired, d, s);         \
}                                                                                                              \
/* x [m, k] (rows ldx apart) -> codes q [m, k], steps d [m, k / 32], d * float(sum of codes) s [m, k / 32] */   \
void a8_quantize_##SUF(const T *x, int64_t m, int64_t k, int64_t ldx, int8_t *q, float *d, float *s) {        \
    a8_quantize_into_##SUF(x, m, k, ldx, q, k, 0, d, s);                                                       \
}                                                                                                              \
typedef struct { /* one a8 product: quantised rows, weight blocks, output */                                   \
    int fmt;                                                                                                   \
    const int8_t *xq;                                                                                          \
    const float *xd, *xs;                                                                                      \
    int64_t m, k, n, ldo, ldq;                                                                                 \
    const uint8_t *wq;                                                                                         \
    const uint16_t *wd, *wm;                                                                                   \
    const T *bias;                                                                                             \
    T *out;                                                                                                    \
} a8_job_##SUF;                                                                                                \
/* thread task t: output columns (t / nrt) * A8_COLS .., rows (t % nrt) * A8_ROWS .. */                         \
static void a8_task_##SUF(const a8_job_##SUF *J, int64_t t, int64_t nrt) {                                     \
    int64_t m = J->m, k = J->k, n = J->n, nb = k / 32;                                                         \
    int64_t c0 = (t / nrt) * A8_COLS, c1 = c0 + A8_COLS < n ? c0 + A8_COLS : n;                                \
    int64_t r0 = (t % nrt) * A8_ROWS, r1 = r0 + A8_ROWS < m ? r0 + A8_ROWS : m;                                \
    float sc[8 * ((nb + 7) / 8 * 8)]; /* R * C <= 8 */                                                         \
    for (int64_t r = r0; r < r1;) {                                                                            \
        int R = r1 - r >= 4 ? 4 : (int)(r1 - r), CT = R > 2 ? 2 : 4; /* 4 x 2 tiles, the last rows 3 x 2 ... */ \
        int64_t c = c0;                                                                                        \
        A8_ROW8(SUF)                                                                                           \
        while (c < c1) {                                                                                       \
            int C = c1 - c >= CT ? CT : 1; /* the last columns one at a time */                                \
            if (r == r0) a8_prefetch_factors(J->wd, J->wm, c + A8_AHEAD, C, nb, n);                           \
            float res[A8_RR * A8_CG];                                                                          \
            a8_tile_any(J->fmt, J->xq + r * J->ldq, J->ldq, J->xd + r * nb, k, J->wq, n, J->wd, c, R, C, sc, res); \
            for (int i = 0; i < R; i++)                                                                        \
                for (int j = 0; j < C; j++) {                                                                  \
                    float v = res[i * C + j];                                                                  \
                    if (J->wm) v += a8_minima(J->wm + (c + j) * nb, J->xs + (r + i) * nb, nb);                 \
                    if (J->bias) v += LD_##SUF(J->bias + c + j);                                               \
                    ST_##SUF(J->out + (r + i) * J->ldo + c + j, v);                                            \
                }                                                                                              \
            c += C;                                                                                            \
        }                                                                                                      \
        r += R;                                                                                                \
    }                                                                                                          \
}                                                                                                              \
static int a8_linear_##SUF(int fmt, const T *x, int64_t m, int64_t k, int64_t ldx, const uint8_t *wq,          \
                           const uint16_t *wd, const uint16_t *wm, int64_t n, const T *bias, T *out,           \
                           int64_t ldo) {                                                                      \
    int64_t nb = k / 32, ldq = fmt == GGUF_Q41 ? 64 * ((nb + 1) / 2) : k;                                      \
    size_t qbytes = (size_t)(m * ldq + 31) / 32 * 32, need = qbytes + 2 * sizeof(float) * (size_t)(m * nb);   \
    _Alignas(32) char stack[A8_STACK];                                                                         \
    char *buf = need <= A8_STACK ? stack : (char *)malloc(need);                                               \
    if (!buf) return 0;                                                                                        \
    int8_t *xq = (int8_t *)buf;                                                                                \
    float *xd = (float *)(buf + qbytes), *xs = xd + m * nb;                                                    \
    a8_quantize_into_##SUF(x, m, k, ldx, xq, ldq, fmt == GGUF_Q41, xd, xs);                                    \
    a8_job_##SUF J = {fmt, xq, xd, xs, m, k, n, ldo, ldq, wq, wd, wm, bias, out};                              \
    int64_t nrt = (m + A8_ROWS - 1) / A8_ROWS, ntask = (n + A8_COLS - 1) / A8_COLS * nrt;                      \
    if (m * n * k < A8_PAR_MIN_WORK || MAX_THREADS() == 1) {                                                   \
        for (int64_t t = 0; t < ntask; t++) a8_task_##SUF(&J, t, nrt);                                         \
    } else {                                                                                                   \
        _Pragma("omp parallel for schedule(static)")                                                           \
        for (int64_t t = 0; t < ntask; t++) a8_task_##SUF(&J, t, nrt);                                         \
    }                                                                                                          \
    if (buf != stack) free(buf);                                                                               \
    return 1;                                                                                                  \
}                                                                                                              \
int q41_a8_linear_##SUF(const T *x, int64_t m, int64_t k, int64_t ldx, const uint8_t *qs, const uint16_t *d,   \
                        const uint16_t *mn, int64_t n, const T *bias, T *out, int64_t ldo) {                   \
    return a8_linear_##SUF(GGUF_Q41, x, m, k, ldx, qs, d, mn, n, bias, out, ldo);                              \
}                                                                                                              \
int q80_a8_linear_##SUF(const T *x, int64_t m, int64_t k, int64_t ldx, const int8_t *q, const uint16_t *d,     \
                        int64_t n, const T *bias, T *out, int64_t ldo) {                                       \
    return a8_linear_##SUF(GGUF_Q80, x, m, k, ldx, (const uint8_t *)q, d, NULL, n, bias, out, ldo);            \
}

DEFINE_A8(f32, float)
DEFINE_A8(bf16, uint16_t)
