/*
 * The bf16 hook's cast (commhooks.hooks.default), compiled on first use by
 * commhooks.compress.cpu_kernels.
 *
 * What a rank sends is its gradient rounded to bfloat16, then divided by the world size.
 * PyTorch does that in two passes (the cast, then the division, which reads and writes the
 * bfloat16 values again), and its conversions to bfloat16 are integer arithmetic in vector
 * registers, slower than its float16 ones, which the CPU does in one instruction. Here the cast
 * and the division are one read of float32 and one write of bfloat16.
 *
 * The arithmetic is PyTorch's, so that both paths give the same bits:
 *   rounded = bf16(x)                       to nearest, ties to even, as tensor.to(bfloat16)
 *   sent = bf16(float(rounded) * factor)    factor = 1 / world, where that is exact (a power
 *                                           of two), or
 *   sent = bf16(float(rounded) / world)     div_(world), for any world size
 * Every NaN becomes the one quiet NaN 0x7fc0, as PyTorch's conversion gives it. The integer
 * rounding used here never consults the floating-point environment and keeps subnormals.
 *
 * Nothing here allocates or keeps state; the caller checks dtypes, lengths and contiguity.
 */
#include <stdint.h>
#include <string.h>

#include "_parallel.h"

static inline float widen(uint16_t h)
{
    uint32_t bits = (uint32_t)h << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static inline uint16_t narrow(float value)
{
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return (bits & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0u : (uint16_t)rounded;
}

typedef struct {
    const float *x;     /* the float32 values */
    uint16_t *out;      /* what is sent */
    int64_t first, last;
    float factor;       /* multiplied by, or divided by with `divide` */
    int divide;
} Part;

static void *scale_down_part(void *arg)
{
    Part *part = (Part *)arg;
    const float *restrict x = part->x;
    uint16_t *restrict out = part->out;
    float factor = part->factor;
    if (part->divide) {
        for (int64_t i = part->first; i < part->last; i++)
            out[i] = narrow(widen(narrow(x[i])) / factor);
    } else {
        for (int64_t i = part->first; i < part->last; i++)
            out[i] = narrow(widen(narrow(x[i])) * factor);
    }
    return NULL;
}

void commhooks_bf16_scale_down(const float *x, uint16_t *out, int64_t n, float factor, int divide,
                               int threads)
{
    int count = commhooks_parts(threads, n);
    Part parts[COMMHOOKS_MAX_THREADS];
    for (int t = 0; t < count; t++) {
        parts[t] = (Part){.x = x, .out = out, .factor = factor, .divide = divide};
        parts[t].first = n * t / count;
        parts[t].last = n * (t + 1) / count;
    }
    commhooks_run_parts(parts, sizeof parts[0], count, scale_down_part);
}
