/* One pass of Adam/AdamW over a range of a shard whose state is kept in fewer bytes.
 *
 * The chain of torch operations this replaces reads and writes every element about ten times
 * (decode the two moments, widen the master and the gradient, the fused update, round the
 * master back, encode the moments): on a host with two cores that chain, not the disk, bounded
 * an 8 B full fine-tune's optimizer step. Here each block of INT8_BLOCK elements is converted
 * into four fp32 arrays that stay in the first-level cache, updated, and converted back.
 *
 * The arithmetic is the one the Python side documents (fused_adam.py): torch's fused CPU Adam
 * on fp32 values, the codecs of state_codecs.py and the stochastic rounding of
 * master_rounding.py, operation for operation. Built with -ffp-contract=off so that the
 * compiler fuses no multiply and add that torch's kernel keeps apart; the one fused
 * multiply-add torch's kernel does (its lerp) is written as fmaf.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define INT8_BLOCK 2048
#define NOISE_CHUNK (1 << 20)
#define CODE_SHIFT 20
#define CODE_ONE (0x3F800000 >> CODE_SHIFT)

enum { STATE_FP32 = 0, STATE_BF16 = 1, STATE_INT8 = 2 };

/* Mirrored field for field by the ctypes Structure in fused_adam.py. */
typedef struct {
    void *param;            /* the master: bf16 bits rounded stochastically, or fp32 */
    const void *grad;       /* bf16 or fp32 */
    void *state[2];         /* exp_avg, exp_avg_sq: fp32, bf16 bits, or int8 codes */
    float *scales[2];       /* int8: one scale per block */
    const int32_t *param_noise;      /* a permutation of [0, 65536) */
    const int32_t *state_noise;      /* the codec's table */
    const int64_t *state_offsets[2]; /* per noise chunk of the shard */
    int64_t param_offset;
    int64_t begin, end;     /* elements of the shard, begin a multiple of INT8_BLOCK */
    int64_t tail_start;     /* the first element past torch's last whole vector */
    int32_t param_bf16, grad_bf16, state_kind, maximize, decoupled;
    float grad_factor, lerp_weight, beta2, sq_coeff, bc2_sqrt, eps, neg_step_size;
    float decay_mul, decay;
} update_args;

static inline uint32_t bits_of(float value) {
    uint32_t bits;
    memcpy(&bits, &value, 4);
    return bits;
}

static inline float float_of(uint32_t bits) {
    float value;
    memcpy(&value, &bits, 4);
    return value;
}

static void decode_int8(const uint8_t *codes, float scale, int top, int signed_state, float *out,
                        int n) {
    const int32_t lift = CODE_ONE - top;
    for (int i = 0; i < n; i++) {
        int32_t code = codes[i];
        uint32_t sign = 0;
        if (signed_state) {
            sign = (uint32_t)(code & 128) << 24;
            code &= 127;
        }
        int32_t keep = code > 0 ? 1 : 0;
        uint32_t bits = (uint32_t)(((code + lift) << CODE_SHIFT) * keep);
        out[i] = float_of(bits_of(float_of(bits) * scale) | sign);
    }
}

/* The largest magnitude, as torch.amax takes it (a NaN wins). A magnitude's bits order as
 * unsigned integers as the floats do, and a NaN's are above infinity's. */
static float block_max(const float *restrict values, int n) {
    uint32_t largest = 0;
    for (int i = 0; i < n; i++) {
        uint32_t magnitude = bits_of(values[i]) & 0x7FFFFFFFu;
        largest = magnitude > largest ? magnitude : largest;
    }
    return float_of(largest);
}

static void encode_int8(const float *values, float *scale_out, uint8_t *codes, int top,
                        int signed_state, const int32_t *noise, int n) {
    float largest = block_max(values, n);
    *scale_out = largest;
    float divisor = largest < 1e-38f ? 1e-38f : largest;
    if (largest != largest) divisor = largest;
    const int32_t lift = CODE_ONE - top;
    for (int i = 0; i < n; i++) {
        float quotient = fabsf(values[i]) / divisor;
        int32_t code = (int32_t)((bits_of(quotient) + (uint32_t)noise[i]) >> CODE_SHIFT) - lift;
        if (signed_state) {
            code = code < 0 ? 0 : (code > top ? top : code);
            code |= (int32_t)((bits_of(values[i]) >> 24) & 128);
        } else {
            code = code < 1 ? 1 : (code > top ? top : code);
            code = values[i] != 0.0f ? code : 0;
        }
        codes[i] = (uint8_t)code;
    }
}

/* The noise of ``count`` elements from element ``at`` of the shard: a chunk's values are the
 * table from the chunk's offset on (state_codecs._Noise). A block never spans two chunks. */
static const int32_t *state_noise_at(const update_args *a, int which, int64_t at) {
    int64_t chunk = at / NOISE_CHUNK;
    return a->state_noise + a->state_offsets[which][chunk] + (at - chunk * NOISE_CHUNK);
}

static void load_state(const update_args *a, int which, int64_t at, int n, float *out) {
    if (a->state_kind == STATE_FP32) {
        memcpy(out, (const float *)a->state[which] + at, (size_t)n * 4);
    } else if (a->state_kind == STATE_BF16) {
        const uint16_t *stored = (const uint16_t *)a->state[which] + at;
        for (int i = 0; i < n; i++) out[i] = float_of((uint32_t)stored[i] << 16);
    } else {
        decode_int8((const uint8_t *)a->state[which] + at, a->scales[which][at / INT8_BLOCK],
                    which ? 255 : 127, !which, out, n);
    }
}

static void store_state(const update_args *a, int which, int64_t at, int n, const float *in) {
    if (a->state_kind == STATE_FP32) {
        memcpy((float *)a->state[which] + at, in, (size_t)n * 4);
    } else if (a->state_kind == STATE_BF16) {
        const int32_t *noise = state_noise_at(a, which, at);
        uint16_t *stored = (uint16_t *)a->state[which] + at;
        for (int i = 0; i < n; i++)
            stored[i] = (uint16_t)((bits_of(in[i]) + (uint32_t)noise[i]) >> 16);
    } else {
        encode_int8(in, &a->scales[which][at / INT8_BLOCK], (uint8_t *)a->state[which] + at,
                    which ? 255 : 127, !which, state_noise_at(a, which, at), n);
    }
}

enum { DECAY_NONE = 0, DECAY_DECOUPLED = 1, DECAY_L2 = 2 };

/* torch's kernel, as its x86 builds compile it (GCC fusing a multiply into the add that uses
 * it): the vectorized loops fuse the second moment's second product, the scalar loop over the
 * tensor's last elements the first. Every setting is a local and the mode a constant of each
 * instance, so that the loop vectorizes. */
static inline __attribute__((always_inline)) void adam_range(
    const update_args *a, float *restrict p, const float *restrict g, float *restrict m,
    float *restrict v, int n, const int tail, const int decay_mode) {
    const float weight = a->lerp_weight;
    const int small = fabsf(weight) < 0.5f;
    const float coeff = small ? weight : weight - 1.0f;
    const float sign = a->maximize ? -1.0f : 1.0f; /* a product by one is exact */
    const float beta2 = a->beta2, sq_coeff = a->sq_coeff, bc2_sqrt = a->bc2_sqrt;
    const float eps = a->eps, neg_step_size = a->neg_step_size;
    const float decay = a->decay, decay_mul = a->decay_mul;
    for (int i = 0; i < n; i++) {
        float grad = g[i] * sign;
        float param = p[i];
        if (decay_mode == DECAY_DECOUPLED) param = param * decay_mul;
        if (decay_mode == DECAY_L2) grad = fmaf(param, decay, grad);
        /* exp_avg.lerp_(grad, 1 - beta1), as torch's kernel: from the nearer end */
        float base = small ? m[i] : grad;
        float avg = fmaf(coeff, grad - m[i], base);
        float sq = tail ? fmaf(v[i], beta2, sq_coeff * grad * grad)
                        : fmaf(sq_coeff * grad, grad, v[i] * beta2);
        float denom = sqrtf(sq) / bc2_sqrt + eps;
        m[i] = avg;
        v[i] = sq;
        p[i] = param + neg_step_size * avg / denom;
    }
}

static void adam_mode(const update_args *a, float *p, const float *g, float *m, float *v, int n,
                      int tail) {
    int mode = a->decay == 0.0f ? DECAY_NONE : (a->decoupled ? DECAY_DECOUPLED : DECAY_L2);
    if (tail) {
        if (mode == DECAY_NONE) adam_range(a, p, g, m, v, n, 1, DECAY_NONE);
        if (mode == DECAY_DECOUPLED) adam_range(a, p, g, m, v, n, 1, DECAY_DECOUPLED);
        if (mode == DECAY_L2) adam_range(a, p, g, m, v, n, 1, DECAY_L2);
    } else {
        if (mode == DECAY_NONE) adam_range(a, p, g, m, v, n, 0, DECAY_NONE);
        if (mode == DECAY_DECOUPLED) adam_range(a, p, g, m, v, n, 0, DECAY_DECOUPLED);
        if (mode == DECAY_L2) adam_range(a, p, g, m, v, n, 0, DECAY_L2);
    }
}

static void adam(const update_args *a, int64_t at, float *p, float *g, float *m, float *v,
                 int n) {
    int64_t whole = a->tail_start - at;
    int body = whole <= 0 ? 0 : (whole >= n ? n : (int)whole);
    adam_mode(a, p, g, m, v, body, 0);
    if (body < n) adam_mode(a, p + body, g + body, m + body, v + body, n - body, 1);
}

/* The updated masters rounded stochastically into bf16 (master_rounding.py). */
static void round_masters(const float *restrict values, const int32_t *restrict noise,
                          uint16_t *restrict master, int n) {
    for (int i = 0; i < n; i++)
        master[i] = (uint16_t)((bits_of(values[i]) + (uint32_t)noise[i]) >> 16);
}

void infinity_fused_adam(const update_args *a) {
    float p[INT8_BLOCK], g[INT8_BLOCK], m[INT8_BLOCK], v[INT8_BLOCK];
    for (int64_t at = a->begin; at < a->end; at += INT8_BLOCK) {
        int n = (int)(a->end - at < INT8_BLOCK ? a->end - at : INT8_BLOCK);
        if (a->param_bf16) {
            const uint16_t *master = (const uint16_t *)a->param + at;
            for (int i = 0; i < n; i++) p[i] = float_of((uint32_t)master[i] << 16);
        } else {
            memcpy(p, (const float *)a->param + at, (size_t)n * 4);
        }
        if (a->grad_bf16) {
            const uint16_t *grad = (const uint16_t *)a->grad + at;
            for (int i = 0; i < n; i++) g[i] = float_of((uint32_t)grad[i] << 16);
        } else {
            memcpy(g, (const float *)a->grad + at, (size_t)n * 4);
        }
        if (a->grad_factor == 0.0f) {
            memset(g, 0, (size_t)n * 4); /* as a gradient zeroed in place: NaN included */
        } else if (a->grad_factor != 1.0f) {
            const float factor = a->grad_factor;
            for (int i = 0; i < n; i++) g[i] = g[i] * factor;
        }
        load_state(a, 0, at, n, m);
        load_state(a, 1, at, n, v);
        adam(a, at, p, g, m, v, n);
        store_state(a, 0, at, n, m);
        store_state(a, 1, at, n, v);
        if (a->param_bf16) {
            /* the noise runs on from (offset + element) % 65536: two runs at most, since a
             * block starts on a multiple of its size and 65536 is one too */
            uint16_t *master = (uint16_t *)a->param + at;
            int64_t from = (a->param_offset + at) & 0xFFFF;
            int first = (int)(65536 - from < n ? 65536 - from : n);
            round_masters(p, a->param_noise + from, master, first);
            round_masters(p + first, a->param_noise, master + first, n - first);
        } else {
            memcpy((float *)a->param + at, p, (size_t)n * 4);
        }
    }
}
