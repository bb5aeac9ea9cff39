/*
 * Fused block quantization for commhooks.hooks.quantized.blocks, compiled on first use by
 * commhooks.cpu_kernels.
 *
 * PyTorch runs quantize_ as six passes over the bucket (absolute maximum, scaling, rounding,
 * the cast to codes, the error); here each block of a row is read from memory once, its
 * absolute maximum found while it sits in the first-level cache, and its codes and error
 * written in a second sweep of that cached block: one read and one write of the bucket.
 *
 * The arithmetic is PyTorch's, operation for operation, so that both paths give the same bits:
 *   scale = absmax / qmax             (torch.div)
 *   per_unit = (1 / absmax) * qmax    (reciprocal_, mul_)
 *   level = rint(x * per_unit)        (mul, round_: to nearest, ties to even)
 *   error = fma(-level, scale, x)     (addcmul_ by the negated scale, fused on vector CPUs)
 *   decoded = code * scale            (8 bits) or fma(nibble, scale, -8 * scale) (4 bits)
 * and a sum of decoded rows adds them in row order, as the eager form does row by row. An
 * addition asked for before quantizing (the remembered error) is one rounding, as torch.add.
 * The absolute maximum compares the bit patterns of |x| as integers: the same maximum for
 * finite values, and a pattern above infinity's (NaN) or equal to it when the block holds NaN
 * or inf, so that such a block gets a non-finite scale, as with PyTorch's amax.
 *
 * Nothing here allocates or keeps state; the callers check shapes, strides and alignment.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "_parallel.h"

#define SMALLEST_ABSMAX 1e-30f
#define NIBBLE_OFFSET 8
#define CHUNK 512 /* elements of a 4-bit block handled at a time; even */

typedef struct {
    int64_t rows, length, block, stride; /* stride: bytes from one packet to the next */
    int64_t columns;       /* elements of each row handled: length, or fewer when decoding */
    int bits, qmax, keep_error, sum; /* qmax: the largest code magnitude when quantizing */
    float *x;              /* quantize: rows x length, float32; dequantize: the output */
    int64_t x_stride;      /* elements from one row of x to the next */
    uint8_t *packets;      /* rows x stride bytes: codes, then float32 scales */
    const float *first, *second; /* quantize: x's first `added` elements (row-major, rows */
    int64_t added;               /* contiguous) become first + second before quantizing */
} Job;

typedef struct {
    const Job *job;
    int64_t first, last; /* the blocks of a row this worker handles: [first, last) */
} Slice;

static float absmax_of(const float *restrict x, int64_t n)
{
    const uint32_t *restrict bits = (const uint32_t *)x;
    uint32_t most = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t magnitude = bits[i] & 0x7fffffffu;
        most = magnitude > most ? magnitude : most;
    }
    float found;
    memcpy(&found, &most, sizeof found);
    return found < SMALLEST_ABSMAX ? SMALLEST_ABSMAX : found;
}

/* A finite block's levels are always within [-qmax, qmax]; a non-finite block's may be NaN,
 * which C may not convert to an integer: those become 0 (the block is never decoded). */
static inline float in_range(float level, float qmax)
{
    return level >= -qmax && level <= qmax ? level : 0.0f;
}

static void quantize_block8(float *restrict x, int64_t n, float qmax, int8_t *restrict codes,
                            float *restrict scale, int keep_error)
{
    float absmax = absmax_of(x, n);
    float step = absmax / qmax, per_unit = (1.0f / absmax) * qmax;
    *scale = step;
    for (int64_t i = 0; i < n; i++) {
        float level = in_range(rintf(x[i] * per_unit), qmax);
        codes[i] = (int8_t)level;
        if (keep_error)
            x[i] = fmaf(-level, step, x[i]);
    }
}

static void quantize_block4(float *restrict x, int64_t n, float qmax, uint8_t *restrict codes,
                            float *restrict scale, int keep_error)
{
    float absmax = absmax_of(x, n);
    float step = absmax / qmax, per_unit = (1.0f / absmax) * qmax;
    *scale = step;
    uint8_t nibbles[CHUNK]; /* offset codes of a chunk of the block, packed after */
    for (int64_t start = 0; start < n; start += CHUNK) {
        int64_t size = n - start < CHUNK ? n - start : CHUNK;
        float *restrict part = x + start;
        for (int64_t i = 0; i < size; i++) {
            float level = in_range(rintf(part[i] * per_unit), qmax);
            nibbles[i] = (uint8_t)((int)level + NIBBLE_OFFSET);
            if (keep_error)
                part[i] = fmaf(-level, step, part[i]);
        }
        uint8_t *restrict packed = codes + start / 2;
        for (int64_t j = 0; j < size / 2; j++)
            packed[j] = (uint8_t)(nibbles[2 * j] | (nibbles[2 * j + 1] << 4));
    }
}

/* x[i] = first[i] + second[i] for the elements of a block still within the sum. x may be
 * first itself, element for element (the owner adds its memory to its row in place), so
 * neither is restrict. */
static void add_into(float *x, const float *first, const float *restrict second, int64_t start,
                     int64_t n, int64_t added)
{
    int64_t count = added - start < n ? added - start : n;
    for (int64_t i = 0; i < count; i++)
        x[i] = first[start + i] + second[start + i];
}

static void quantize_slice(const Slice *slice)
{
    const Job *job = slice->job;
    float qmax = (float)job->qmax;
    int64_t payload = job->length * job->bits / 8;
    for (int64_t r = 0; r < job->rows; r++) {
        float *row = job->x + r * job->x_stride;
        uint8_t *codes = job->packets + r * job->stride;
        float *scales = (float *)(codes + payload);
        for (int64_t b = slice->first; b < slice->last; b++) {
            float *x = row + b * job->block;
            int64_t start = r * job->length + b * job->block;
            if (start < job->added)
                add_into(x, job->first, job->second, start, job->block, job->added);
            if (job->bits == 8)
                quantize_block8(x, job->block, qmax, (int8_t *)codes + b * job->block,
                                scales + b, job->keep_error);
            else
                quantize_block4(x, job->block, qmax, codes + b * job->block / 2, scales + b,
                                job->keep_error);
        }
    }
}

static void decode_block(const uint8_t *restrict codes, float step, int64_t n, int bits,
                         float *restrict out, int add)
{
    if (bits == 8) {
        const int8_t *restrict signed_codes = (const int8_t *)codes;
        if (add)
            for (int64_t i = 0; i < n; i++)
                out[i] += (float)signed_codes[i] * step;
        else
            for (int64_t i = 0; i < n; i++)
                out[i] = (float)signed_codes[i] * step;
        return;
    }
    float base = step * -(float)NIBBLE_OFFSET;
    uint8_t nibbles[CHUNK];
    for (int64_t start = 0; start < n; start += CHUNK) {
        int64_t size = n - start < CHUNK ? n - start : CHUNK;
        const uint8_t *restrict packed = codes + start / 2;
        for (int64_t j = 0; j < (size + 1) / 2; j++) { /* an odd size ends mid-byte */
            nibbles[2 * j] = packed[j] & 15;
            nibbles[2 * j + 1] = packed[j] >> 4;
        }
        float *restrict part = out + start;
        if (add)
            for (int64_t i = 0; i < size; i++)
                part[i] += fmaf((float)nibbles[i], step, base);
        else
            for (int64_t i = 0; i < size; i++)
                part[i] = fmaf((float)nibbles[i], step, base);
    }
}

static void dequantize_slice(const Slice *slice)
{
    const Job *job = slice->job;
    int64_t payload = job->length * job->bits / 8;
    for (int64_t r = 0; r < job->rows; r++) {
        const uint8_t *codes = job->packets + r * job->stride;
        const float *scales = (const float *)(codes + payload);
        float *row = job->x + (job->sum ? 0 : r * job->x_stride);
        for (int64_t b = slice->first; b < slice->last; b++) {
            int64_t start = b * job->block;
            int64_t n = job->columns - start < job->block ? job->columns - start : job->block;
            decode_block(codes + start * job->bits / 8, scales[b], n, job->bits, row + start,
                         job->sum && r > 0);
        }
    }
}

static void *run_quantize(void *slice)
{
    quantize_slice((const Slice *)slice);
    return NULL;
}

static void *run_dequantize(void *slice)
{
    dequantize_slice((const Slice *)slice);
    return NULL;
}

/* Cut a row's blocks into slices, one per thread. */
static void run(const Job *job, int threads, void *(*work)(void *))
{
    int64_t blocks = (job->columns + job->block - 1) / job->block;
    int count = commhooks_parts(threads, blocks);
    Slice slices[COMMHOOKS_MAX_THREADS];
    for (int t = 0; t < count; t++) {
        slices[t].job = job;
        slices[t].first = blocks * t / count;
        slices[t].last = blocks * (t + 1) / count;
    }
    commhooks_run_parts(slices, sizeof slices[0], count, work);
}

void commhooks_quantize(float *x, int64_t x_stride, int64_t rows, int64_t length, int64_t block,
                        int bits, int qmax, uint8_t *packets, int64_t stride, int keep_error,
                        const float *first, const float *second, int64_t added, int threads)
{
    Job job = {.rows = rows, .length = length, .block = block, .stride = stride, .bits = bits,
               .qmax = qmax,
               .columns = length, .keep_error = keep_error, .x = x, .x_stride = x_stride,
               .packets = packets,
               .first = first, .second = second, .added = added};
    run(&job, threads, run_quantize);
}

void commhooks_dequantize(uint8_t *packets, int64_t stride, int64_t rows, int64_t length,
                          int64_t columns, int64_t block, int bits, float *out, int64_t out_stride,
                          int sum, int threads)
{
    Job job = {.rows = rows, .length = length, .block = block, .stride = stride, .bits = bits,
               .columns = columns, .sum = sum, .x = out, .x_stride = out_stride, .packets = packets};
    run(&job, threads, run_dequantize);
}

/* The two calls above with their arguments in one array, in the same order (pointers as
 * integers): ctypes converts each argument of a call on the host, about a quarter of a
 * microsecond apiece, so a call bound once to its buffers passes one pointer instead of
 * fourteen or eleven. */
void commhooks_quantize_packed(const int64_t *a)
{
    commhooks_quantize((float *)(intptr_t)a[0], a[1], a[2], a[3], a[4], (int)a[5], (int)a[6],
                       (uint8_t *)(intptr_t)a[7], a[8], (int)a[9],
                       (const float *)(intptr_t)a[10], (const float *)(intptr_t)a[11], a[12],
                       (int)a[13]);
}

void commhooks_dequantize_packed(const int64_t *a)
{
    commhooks_dequantize((uint8_t *)(intptr_t)a[0], a[1], a[2], a[3], a[4], a[5], (int)a[6],
                         (float *)(intptr_t)a[7], a[8], (int)a[9], (int)a[10]);
}

/* A step's memories kept as they were where the step was not finite: if any of the `rows`
 * packets' `blocks` scales (at `scales` bytes into each packet) is inf or NaN, `n` floats of
 * `kept` are copied over `now`; otherwise nothing happens. The scales are compared as bits,
 * so that no floating-point exception or flush changes the verdict. */
void commhooks_keep_if_not_finite(const uint8_t *packets, int64_t stride, int64_t rows,
                                  int64_t scales, int64_t blocks, float *now, const float *kept,
                                  int64_t n)
{
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *at = packets + r * stride + scales;
        for (int64_t b = 0; b < blocks; b++) {
            uint32_t bits;
            memcpy(&bits, at + 4 * b, sizeof bits);
            if ((bits & 0x7f800000u) == 0x7f800000u) {
                memcpy(now, kept, (size_t)n * sizeof *now);
                return;
            }
        }
    }
}
