/* BLAKE2b from RFC 7693: unkeyed, no salt or personalisation, as
 * hashlib.blake2b(data, digest_size=n); byte-identical digests. */
#ifndef KVSPEC_BLAKE2B_H
#define KVSPEC_BLAKE2B_H

#include <stddef.h>
#include <stdint.h>

/* hashlib.blake2b(data, digest_size=out_len).digest() into out; 1 <= out_len <= 64. */
void kv_blake2b_digest(const uint8_t *data, size_t len, uint8_t *out, size_t out_len);

/* The digest of a message of ``len`` <= 128 bytes already zero-padded to one block. */
void kv_blake2b_one_block(const uint8_t block[128], size_t len, uint8_t *out, size_t out_len);

#endif
