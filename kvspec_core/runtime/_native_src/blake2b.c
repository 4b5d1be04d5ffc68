/* BLAKE2b (RFC 7693), the hash of kvspec's prefix-cache blocks; see blake2b.h. */
#include <string.h>

#include "blake2b.h"

static const uint64_t blake2b_iv[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL,
    0xa54ff53a5f1d36f1ULL, 0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL,
    0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

static const uint8_t blake2b_sigma[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

static inline uint64_t rotr64(uint64_t x, unsigned n) { return (x >> n) | (x << (64 - n)); }

static inline uint64_t load64_le(const uint8_t *p) {
    return (uint64_t)p[0] | ((uint64_t)p[1] << 8) | ((uint64_t)p[2] << 16)
        | ((uint64_t)p[3] << 24) | ((uint64_t)p[4] << 32) | ((uint64_t)p[5] << 40)
        | ((uint64_t)p[6] << 48) | ((uint64_t)p[7] << 56);
}

#define G(a, b, c, d, x, y)            \
    do {                               \
        v[a] = v[a] + v[b] + (x);      \
        v[d] = rotr64(v[d] ^ v[a], 32); \
        v[c] = v[c] + v[d];            \
        v[b] = rotr64(v[b] ^ v[c], 24); \
        v[a] = v[a] + v[b] + (y);      \
        v[d] = rotr64(v[d] ^ v[a], 16); \
        v[c] = v[c] + v[d];            \
        v[b] = rotr64(v[b] ^ v[c], 63); \
    } while (0)

static void blake2b_compress(uint64_t h[8], const uint8_t block[128], uint64_t counter, int last) {
    uint64_t v[16], m[16];
    for (int i = 0; i < 16; i++) m[i] = load64_le(block + 8 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = blake2b_iv[i];
    }
    v[12] ^= counter; /* messages here are far below 2**64 bytes: the high word stays 0 */
    if (last) v[14] = ~v[14];
    /* Rounds unrolled with constant message indices, so v and m stay in registers. */
#define ROUND(r)                                                                   \
    do {                                                                           \
        G(0, 4, 8, 12, m[blake2b_sigma[r][0]], m[blake2b_sigma[r][1]]);           \
        G(1, 5, 9, 13, m[blake2b_sigma[r][2]], m[blake2b_sigma[r][3]]);           \
        G(2, 6, 10, 14, m[blake2b_sigma[r][4]], m[blake2b_sigma[r][5]]);          \
        G(3, 7, 11, 15, m[blake2b_sigma[r][6]], m[blake2b_sigma[r][7]]);          \
        G(0, 5, 10, 15, m[blake2b_sigma[r][8]], m[blake2b_sigma[r][9]]);          \
        G(1, 6, 11, 12, m[blake2b_sigma[r][10]], m[blake2b_sigma[r][11]]);        \
        G(2, 7, 8, 13, m[blake2b_sigma[r][12]], m[blake2b_sigma[r][13]]);         \
        G(3, 4, 9, 14, m[blake2b_sigma[r][14]], m[blake2b_sigma[r][15]]);         \
    } while (0)
    ROUND(0); ROUND(1); ROUND(2); ROUND(3); ROUND(4); ROUND(5);
    ROUND(6); ROUND(7); ROUND(8); ROUND(9); ROUND(10); ROUND(11);
#undef ROUND
    for (int i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

static inline void blake2b_output(const uint64_t h[8], uint8_t *out, size_t out_len) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(out, h, out_len);
#else
    for (size_t i = 0; i < out_len; i++) out[i] = (uint8_t)(h[i / 8] >> (8 * (i % 8)));
#endif
}

void kv_blake2b_one_block(const uint8_t block[128], size_t len, uint8_t *out,
                                     size_t out_len) {
    uint64_t h[8];
    memcpy(h, blake2b_iv, sizeof h);
    h[0] ^= 0x01010000ULL ^ (uint64_t)out_len;
    blake2b_compress(h, block, (uint64_t)len, 1);
    blake2b_output(h, out, out_len);
}

void kv_blake2b_digest(const uint8_t *data, size_t len, uint8_t *out, size_t out_len) {
    uint64_t h[8];
    uint8_t block[128];
    uint64_t counter = 0;
    memcpy(h, blake2b_iv, sizeof h);
    h[0] ^= 0x01010000ULL ^ (uint64_t)out_len;
    while (len > 128) {
        counter += 128;
        blake2b_compress(h, data, counter, 0);
        data += 128;
        len -= 128;
    }
    memset(block, 0, sizeof block);
    memcpy(block, data, len);
    counter += len;
    blake2b_compress(h, block, counter, 1);
    blake2b_output(h, out, out_len);
}
