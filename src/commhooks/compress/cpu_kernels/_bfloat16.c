/*
 * bfloat16 kernels for the bf16 hook (commhooks.hooks._half), compiled on first use by
 * commhooks.cpu_kernels.
 *
 * What a rank sends is its gradient rounded to bfloat16, then divided by the world size, and the
 * hook wants to know on the way whether any rounded value is infinite or NaN. PyTorch does that
 * in two passes (the cast, then its gradient scaler's unscaling kernel, which reads and writes
 * the bfloat16 values again), and its conversions to bfloat16 are integer arithmetic in vector
 * registers, slower than its float16 ones, which the CPU does in one instruction. Here the cast,
 * the check and the division are one read of float32 and one write of bfloat16; the sum of two
 * ranks' values, added as they arrive, is one more kernel.
 *
 * The arithmetic is PyTorch's, so that both paths give the same bits:
 *   rounded = bf16(x)                       to nearest, ties to even, as tensor.to(bfloat16)
 *   sent = bf16(float(rounded) * factor)    the unscaling kernel, factor = 1 / world (exact for
 *                                           one or two ranks), or
 *   sent = bf16(float(rounded) / world)     div_(world), for any world size
 *   sum = bf16(float(a) + float(b))         torch.add of two bfloat16 tensors
 * Every NaN becomes the one quiet NaN 0x7fc0, whatever its payload, so that two ranks adding the
 * same NaNs in either order hold the same bits. The integer rounding used here never consults the
 * floating-point environment and keeps subnormals, as PyTorch's does.
 *
 * Nothing here allocates or keeps state; the callers check dtypes, lengths and contiguity.
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
    const float *x;     /* scale down: the float32 values */
    uint16_t *out;      /* scale down: what is sent; add: the first addend and the sum */
    const uint16_t *y;  /* add: the second addend */
    int64_t first, last;
    float factor;       /* scale down: multiplied by, or divided by with `divide` */
    int divide;
    int nonfinite;      /* scale down: set where a rounded value is infinite or NaN */
} Part;

static void scale_down_part(Part *part)
{
    const float *restrict x = part->x;
    uint16_t *restrict out = part->out;
    float factor = part->factor;
    uint32_t nonfinite = 0;
    if (part->divide) {
        for (int64_t i = part->first; i < part->last; i++) {
            uint16_t rounded = narrow(x[i]);
            nonfinite |= (rounded & 0x7f80u) == 0x7f80u;
            out[i] = narrow(widen(rounded) / factor);
        }
    } else {
        for (int64_t i = part->first; i < part->last; i++) {
            uint16_t rounded = narrow(x[i]);
            nonfinite |= (rounded & 0x7f80u) == 0x7f80u;
            out[i] = narrow(widen(rounded) * factor);
        }
    }
    part->nonfinite = nonfinite != 0;
}

static void add_part(Part *part)
{
    uint16_t *restrict out = part->out;
    const uint16_t *restrict y = part->y;
    for (int64_t i = part->first; i < part->last; i++)
        out[i] = narrow(widen(out[i]) + widen(y[i]));
}

static void *run_scale_down(void *part)
{
    scale_down_part((Part *)part);
    return NULL;
}

static void *run_add(void *part)
{
    add_part((Part *)part);
    return NULL;
}

/* Cut [0, n) into parts, one per thread; whether any part saw a non-finite value. */
static int run(Part job, int64_t n, int threads, void *(*work)(void *))
{
    int count = commhooks_parts(threads, n);
    Part parts[COMMHOOKS_MAX_THREADS];
    for (int t = 0; t < count; t++) {
        parts[t] = job;
        parts[t].first = n * t / count;
        parts[t].last = n * (t + 1) / count;
    }
    commhooks_run_parts(parts, sizeof parts[0], count, work);
    int nonfinite = 0;
    for (int t = 0; t < count; t++)
        nonfinite |= parts[t].nonfinite;
    return nonfinite;
}

int commhooks_bf16_scale_down(const float *x, uint16_t *out, int64_t n, float factor, int divide,
                              int threads)
{
    Part job = {.x = x, .out = out, .factor = factor, .divide = divide};
    return run(job, n, threads, run_scale_down);
}

void commhooks_bf16_add(uint16_t *out, const uint16_t *y, int64_t n, int threads)
{
    Part job = {.out = out, .y = y};
    run(job, n, threads, run_add);
}
