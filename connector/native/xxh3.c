/* xxh3-64, the project's block checksum, from xxHash's own code (xxhash/, vendored,
 * BSD-2-Clause: see xxhash/LICENSE): this file holds its implementation, for the verified
 * copy's streaming hash (xxh3_api.h) and the daemon's checksums. On x86 xxHash's dispatcher (xxhash/xxh_x86dispatch.c, built
 * beside it) picks SSE2, AVX2 or AVX-512 at run time. The same algorithm as python-xxhash's
 * xxh3_64, so the same checksums (tests/test_checksum.py and verified_copy's check at load).
 */
#define XXH_IMPLEMENTATION
#include "xxh3_api.h"

/* xxh3-64 of `len` bytes at `data` (the daemon's checksum of a committed slot). */
TIERD_API uint64_t tierd_xxh3_64(const void *data, size_t len) {
#if defined(__x86_64__) || defined(__i386__)
    return XXH3_64bits_dispatch(data, len);
#else
    return XXH3_64bits(data, len);
#endif
}
