/*
 * 4-bit codes of 13 levels packed eight to 30 bits, for commhooks.hooks.quantized.packing;
 * compiled on first use by commhooks.cpu_kernels.
 *
 * A byte of 4-bit codes holds two nibbles in [2, 14] (codes in [-6, 6] offset by 8). Each byte
 * becomes a pair p = (low - 2) + 13 (high - 2) in [0, 168]; four pairs (eight codes) become
 * v = p0 + 169 p1 + 169^2 p2 + 169^3 p3 < 13^8 < 2^30. Four such values (32 codes) take 15
 * bytes: the low three bytes of each, least significant first, then the four top 6-bit parts
 * as one 24-bit number, the first value's in its lowest bits. Reading back, every value is
 * taken apart modulo 169 and 13, so that any 15 bytes decode to nibbles in [2, 14].
 *
 * The eager PyTorch form in packing.py computes the same bytes; the callers check shapes and
 * strides.
 */
#include <stdint.h>

#define PAIR_BASE 169
#define LEVELS 13
#define LOWEST 2 /* the nibble of code -6 */

static inline uint32_t pair_of(uint8_t byte)
{
    uint32_t low = (uint32_t)(byte & 15u) - LOWEST, high = (uint32_t)(byte >> 4) - LOWEST;
    return low + LEVELS * high;
}

static inline uint8_t byte_of(uint32_t pair)
{
    return (uint8_t)((pair % LEVELS + LOWEST) | ((pair / LEVELS + LOWEST) << 4));
}

void commhooks_pack13(const uint8_t *nibbles, int64_t in_stride, uint8_t *out, int64_t out_stride,
                      int64_t rows, int64_t quads)
{
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *in = nibbles + r * in_stride;
        uint8_t *o = out + r * out_stride;
        for (int64_t q = 0; q < quads; q++, in += 16, o += 15) {
            uint32_t top = 0;
            for (int g = 0; g < 4; g++) {
                const uint8_t *b = in + 4 * g;
                uint32_t v = pair_of(b[3]);
                v = v * PAIR_BASE + pair_of(b[2]);
                v = v * PAIR_BASE + pair_of(b[1]);
                v = v * PAIR_BASE + pair_of(b[0]);
                o[3 * g] = (uint8_t)v;
                o[3 * g + 1] = (uint8_t)(v >> 8);
                o[3 * g + 2] = (uint8_t)(v >> 16);
                top |= (v >> 24) << (6 * g);
            }
            o[12] = (uint8_t)top;
            o[13] = (uint8_t)(top >> 8);
            o[14] = (uint8_t)(top >> 16);
        }
    }
}

void commhooks_unpack13(const uint8_t *packed, int64_t in_stride, uint8_t *nibbles,
                        int64_t out_stride, int64_t rows, int64_t quads)
{
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *p = packed + r * in_stride;
        uint8_t *out = nibbles + r * out_stride;
        for (int64_t q = 0; q < quads; q++, p += 15, out += 16) {
            uint32_t top = p[12] | ((uint32_t)p[13] << 8) | ((uint32_t)p[14] << 16);
            for (int g = 0; g < 4; g++) {
                uint32_t v = p[3 * g] | ((uint32_t)p[3 * g + 1] << 8) |
                             ((uint32_t)p[3 * g + 2] << 16) | (((top >> (6 * g)) & 63u) << 24);
                for (int k = 0; k < 4; k++, v /= PAIR_BASE)
                    out[4 * g + k] = byte_of(v % PAIR_BASE);
            }
        }
    }
}
