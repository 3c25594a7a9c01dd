/* Verify-while-copying: a DRAM load in one pass over the arena (connector/native/verified_copy.py);
 * and the plain copy of a store, the other way.
 *
 * Each block's slot is hashed (xxh3-64, the project's block checksum) as it is copied to the
 * engine's KV, so the slot is read from memory once instead of twice (a verify pass, then a copy
 * pass). Two kernels: the fused one (below, AVX2 or AVX-512: one load per 64-byte stripe feeds
 * both the store and the hash) where rows are whole stripes, and otherwise pieces: 16 KiB hashed,
 * then copied while still in the core's cache. Threads (as many as the caller allows) take blocks
 * one at a time as they go.
 *
 * The destination of a block is L x H x N rows of `row` bytes at byte strides s_layer, s_head,
 * s_token from dst_base + dst_block[b] * s_block (vLLM's [B, H, N, C] views in any KVCacheLayout,
 * stacked over layers; the reference engine's pool is one row per block). The slot holds the same
 * rows back to back in (layer, head, token) order. Returns how many leading blocks verified; the
 * bytes of a block that failed, and of any block after it, may have been copied and must not be
 * used (the caller reports them failed, and the engine recomputes them).
 *
 * A large load writes the engine's KV with non-temporal stores (SSE2, 16-byte aligned rows):
 * a regular store first reads each destination line into the cache (read for ownership), a
 * third memory pass that the engine does not need, since the KV it loads is far larger than
 * the cache. Small loads use memcpy, so what the forward pass reads next stays in cache.
 *
 * A store (`tierd_store_rows`) copies each block's rows from the engine's memory back to back
 * into its slot, taken by threads the same way, with non-temporal stores when large (the
 * slots are not read again soon: the daemon hashes them once). No hash here: the daemon
 * checksums committed slots itself.
 *
 * For the pieces, xxh3 is xxHash's streaming API (xxh3.c, the same code as the checksums); the
 * fused kernel is checked against block_checksum when the library is loaded.
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "xxh3_api.h"

struct load {
    int verify;                /* 1: a load (slots -> engine blocks, hashed); 0: a store */
    int64_t nblocks;
    const uint64_t *slot;      /* address of each block's slot */
    const int64_t *block;      /* engine block id of each block */
    const uint64_t *want;      /* stored checksum of each block (loads) */
    uint64_t base;             /* engine memory: block b's first row is at base + b * s_block */
    int64_t layers, heads, tokens, row;
    int64_t s_layer, s_block, s_head, s_token;
    int64_t first_bad;         /* shared: lowest failed block index, nblocks if none */
    int64_t next;              /* shared: the next block index a thread takes */
    int stream;                /* non-temporal stores (a load of at least STREAM_MIN bytes) */
    int isa;                   /* a load: the fused kernel to use where it fits (ISA_*) */
};

enum { PIECE = 16 * 1024 };  /* bytes hashed, then copied while in L1/L2 */
enum { STREAM_MIN = 8 << 20 };  /* loads of at least this many bytes use non-temporal stores */

/* Copy one piece; with `stream`, non-temporal stores where dst is 16-byte aligned. */
static void copy_piece(unsigned char *dst, const unsigned char *src, size_t len, int stream) {
#if defined(__SSE2__)
    if (stream && len >= 64 && ((uintptr_t)dst & 15) == 0) {
        size_t n = len & ~(size_t)63;
        for (size_t i = 0; i < n; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
            _mm_stream_si128((__m128i *)(dst + i), a);
            _mm_stream_si128((__m128i *)(dst + i + 16), b);
            _mm_stream_si128((__m128i *)(dst + i + 32), c);
            _mm_stream_si128((__m128i *)(dst + i + 48), d);
        }
        if (n < len)
            memcpy(dst + n, src + n, len - n);
        return;
    }
#else
    (void)stream;
#endif
    memcpy(dst, src, len);
}

static int64_t first_bad(struct load *j) {
    return __atomic_load_n(&j->first_bad, __ATOMIC_RELAXED);
}

static void lower_first_bad(struct load *j, int64_t b) {
    int64_t cur = first_bad(j);
    while (b < cur && !__atomic_compare_exchange_n(&j->first_bad, &cur, b, 0, __ATOMIC_RELAXED,
                                                   __ATOMIC_RELAXED)) {}
}

/* One block: walk its rows in slot order; before a row's bytes are copied, the slot is hashed
 * up to past them, PIECE bytes at a time, so every byte is copied right after it was hashed
 * (while it is still in cache). Returns 1 if the checksum matched. */
static int one_block(struct load *j, XXH3_state_t *state, int64_t b) {
    const unsigned char *src = (const unsigned char *)(uintptr_t)j->slot[b];
    const unsigned char *hashed = src;
    const unsigned char *end = src + j->layers * j->heads * j->tokens * j->row;
    unsigned char *block = (unsigned char *)(uintptr_t)(j->base + j->block[b] * j->s_block);
    XXH3_64bits_reset(state);
    for (int64_t l = 0; l < j->layers; l++)
        for (int64_t h = 0; h < j->heads; h++)
            for (int64_t t = 0; t < j->tokens; t++, src += j->row) {
                unsigned char *dst = block + l * j->s_layer + h * j->s_head + t * j->s_token;
                for (int64_t off = 0; off < j->row; off += PIECE) {
                    size_t len = (size_t)(j->row - off < PIECE ? j->row - off : PIECE);
                    while (hashed < src + off + (int64_t)len) {
                        size_t n = (size_t)(end - hashed < PIECE ? end - hashed : PIECE);
                        TIERD_XXH3_64_UPDATE(state, hashed, n);
                        hashed += n;
                    }
                    copy_piece(dst + off, src + off, len, j->stream);
                }
            }
    return XXH3_64bits_digest(state) == j->want[b];
}

/* One block of a store: its rows, in (layer, head, token) order, back to back into its slot. */
static void store_block(struct load *j, int64_t b) {
    unsigned char *dst = (unsigned char *)(uintptr_t)j->slot[b];
    const unsigned char *block =
        (const unsigned char *)(uintptr_t)(j->base + j->block[b] * j->s_block);
    for (int64_t l = 0; l < j->layers; l++)
        for (int64_t h = 0; h < j->heads; h++)
            for (int64_t t = 0; t < j->tokens; t++, dst += j->row)
                copy_piece(dst, block + l * j->s_layer + h * j->s_head + t * j->s_token,
                           (size_t)j->row, j->stream);
}

/* ---- One pass, one load: xxh3 folded in as the bytes are copied (x86-64, AVX2 or AVX-512) ----
 *
 * The piece path above reads every byte twice (once to hash, once to copy, the second time from
 * cache). Where the slot is a whole number of 64-byte stripes (every row a multiple of 64 bytes,
 * more than 240 bytes in all: every real KV block), each stripe is instead loaded once into
 * vector registers, stored to the engine's block and folded into xxh3's eight accumulators.
 * This is xxh3-64's long-input algorithm with its default secret and seed 0 (XXH3_64bits), as
 * its specification gives it: per stripe, lane i adds lo32(d ^ s) * hi32(d ^ s) to itself and
 * d to its neighbour (i ^ 1); every 16 stripes (1 KiB) the accumulators are scrambled; the last
 * stripe is folded with the secret at offset 121 and the accumulators merged with the length.
 * The Python side checks the result against python-xxhash at load (verified_copy._fused_agrees)
 * and keeps the piece path if they ever disagree.
 */
enum { ISA_PIECES = 0, ISA_AVX2 = 2, ISA_AVX512 = 3 };

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

static const unsigned char kSecret[192] __attribute__((aligned(64))) = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};
enum { STRIPE = 64, STRIPES_PER_BLOCK = 16, SCRAMBLE_AT = 192 - 64, LAST_AT = 192 - 64 - 7,
       MERGE_AT = 11 };
#define P32_1 0x9E3779B1U
#define P32_2 0x85EBCA77U
#define P32_3 0xC2B2AE3DU
#define P64_1 0x9E3779B185EBCA87ULL
#define P64_2 0xC2B2AE3D27D4EB4FULL
#define P64_3 0x165667B19E3779F9ULL
#define P64_4 0x85EBCA77C2B2AE63ULL
#define P64_5 0x27D4EB2F165667C5ULL

static uint64_t read64(const unsigned char *p) { uint64_t v; memcpy(&v, p, 8); return v; }

static uint64_t merge(const uint64_t acc[8], uint64_t len) {
    uint64_t h = len * P64_1;
    for (int i = 0; i < 4; i++) {
        __uint128_t p = (__uint128_t)(acc[2 * i] ^ read64(kSecret + MERGE_AT + 16 * i)) *
                        (acc[2 * i + 1] ^ read64(kSecret + MERGE_AT + 16 * i + 8));
        h += (uint64_t)p ^ (uint64_t)(p >> 64);
    }
    h ^= h >> 37;
    h *= 0x165667919E3779F9ULL;
    return h ^ (h >> 32);
}

/* `n` stripes from src to dst, folded into acc; *k counts stripes (scramble after every 16th). */
typedef void (*stripes_fn)(uint64_t acc[8], const unsigned char *src, unsigned char *dst,
                           int64_t n, int64_t *k, const unsigned char *secret_of_last, int stream);

#define FOLD512(a, d, s) do {                                                              \
        __m512i key_ = _mm512_xor_si512((d), _mm512_loadu_si512((const void *)(s)));       \
        __m512i prod_ = _mm512_mul_epu32(key_, _mm512_srli_epi64(key_, 32));                \
        (a) = _mm512_add_epi64((a), _mm512_add_epi64(prod_,                               \
                               _mm512_shuffle_epi32((d), (_MM_PERM_ENUM)0x4E)));            \
    } while (0)

/* With secret_of_last set, the n stripes are the slot's last ones and the last of them is
 * folded with that secret instead (the caller passes kSecret + LAST_AT). */
__attribute__((target("avx512f")))
static void stripes_avx512(uint64_t acc[8], const unsigned char *src, unsigned char *dst,
                           int64_t n, int64_t *k, const unsigned char *secret_of_last,
                           int stream) {
    __m512i a = _mm512_loadu_si512((const void *)acc);
    const __m512i prime = _mm512_set1_epi32((int)P32_1);
    const int nt = stream && ((uintptr_t)dst & 63) == 0;
    int64_t normal = secret_of_last ? n - 1 : n;
    for (int64_t i = 0; i < n; i++, src += STRIPE, dst += STRIPE) {
        __m512i d = _mm512_loadu_si512((const void *)src);
        if (nt) _mm512_stream_si512((void *)dst, d);
        else _mm512_storeu_si512((void *)dst, d);
        if (i == normal) { FOLD512(a, d, secret_of_last); break; }
        int64_t m = (*k)++ & (STRIPES_PER_BLOCK - 1);
        FOLD512(a, d, kSecret + 8 * m);
        if (m == STRIPES_PER_BLOCK - 1) {
            __m512i x = _mm512_xor_si512(a, _mm512_srli_epi64(a, 47));
            x = _mm512_xor_si512(x, _mm512_loadu_si512((const void *)(kSecret + SCRAMBLE_AT)));
            a = _mm512_add_epi64(_mm512_mul_epu32(x, prime),
                                 _mm512_slli_epi64(_mm512_mul_epu32(_mm512_srli_epi64(x, 32),
                                                                    prime), 32));
        }
    }
    _mm512_storeu_si512((void *)acc, a);
}

#define FOLD256(a, d, s) do {                                                              \
        __m256i key_ = _mm256_xor_si256((d), _mm256_loadu_si256((const __m256i *)(s)));    \
        __m256i prod_ = _mm256_mul_epu32(key_, _mm256_srli_epi64(key_, 32));                \
        (a) = _mm256_add_epi64((a), _mm256_add_epi64(prod_, _mm256_shuffle_epi32((d), 0x4E))); \
    } while (0)

#define SCRAMBLE256(a, s) do {                                                             \
        __m256i x_ = _mm256_xor_si256((a), _mm256_srli_epi64((a), 47));                     \
        x_ = _mm256_xor_si256(x_, _mm256_loadu_si256((const __m256i *)(s)));                \
        (a) = _mm256_add_epi64(_mm256_mul_epu32(x_, prime),                               \
                               _mm256_slli_epi64(_mm256_mul_epu32(_mm256_srli_epi64(x_, 32), \
                                                                  prime), 32));            \
    } while (0)

__attribute__((target("avx2")))
static void stripes_avx2(uint64_t acc[8], const unsigned char *src, unsigned char *dst,
                         int64_t n, int64_t *k, const unsigned char *secret_of_last,
                         int stream) {
    __m256i a0 = _mm256_loadu_si256((const __m256i *)acc);
    __m256i a1 = _mm256_loadu_si256((const __m256i *)(acc + 4));
    const __m256i prime = _mm256_set1_epi32((int)P32_1);
    const int nt = stream && ((uintptr_t)dst & 31) == 0;
    int64_t normal = secret_of_last ? n - 1 : n;
    for (int64_t i = 0; i < n; i++, src += STRIPE, dst += STRIPE) {
        __m256i d0 = _mm256_loadu_si256((const __m256i *)src);
        __m256i d1 = _mm256_loadu_si256((const __m256i *)(src + 32));
        if (nt) {
            _mm256_stream_si256((__m256i *)dst, d0);
            _mm256_stream_si256((__m256i *)(dst + 32), d1);
        } else {
            _mm256_storeu_si256((__m256i *)dst, d0);
            _mm256_storeu_si256((__m256i *)(dst + 32), d1);
        }
        if (i == normal) {
            FOLD256(a0, d0, secret_of_last);
            FOLD256(a1, d1, secret_of_last + 32);
            break;
        }
        int64_t m = (*k)++ & (STRIPES_PER_BLOCK - 1);
        FOLD256(a0, d0, kSecret + 8 * m);
        FOLD256(a1, d1, kSecret + 8 * m + 32);
        if (m == STRIPES_PER_BLOCK - 1) {
            SCRAMBLE256(a0, kSecret + SCRAMBLE_AT);
            SCRAMBLE256(a1, kSecret + SCRAMBLE_AT + 32);
        }
    }
    _mm256_storeu_si256((__m256i *)acc, a0);
    _mm256_storeu_si256((__m256i *)(acc + 4), a1);
}

static stripes_fn stripes_for(int isa) {
    __builtin_cpu_init();
    if (isa == ISA_AVX512 && __builtin_cpu_supports("avx512f")) return stripes_avx512;
    if (isa == ISA_AVX2 && __builtin_cpu_supports("avx2")) return stripes_avx2;
    return NULL;
}

/* The best fused kernel this CPU runs (ISA_PIECES: none). */
TIERD_API int tierd_fused_isa(void) {
    if (stripes_for(ISA_AVX512)) return ISA_AVX512;
    if (stripes_for(ISA_AVX2)) return ISA_AVX2;
    return ISA_PIECES;
}

/* One block in one pass (see above). Returns 1 if the checksum matched. */
static int fused_block(struct load *j, stripes_fn stripes, int64_t b) {
    const unsigned char *src = (const unsigned char *)(uintptr_t)j->slot[b];
    const int64_t total = j->layers * j->heads * j->tokens * j->row, per_row = j->row / STRIPE;
    unsigned char *block = (unsigned char *)(uintptr_t)(j->base + j->block[b] * j->s_block);
    uint64_t acc[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};
    int64_t k = 0;
    for (int64_t l = 0; l < j->layers; l++)
        for (int64_t h = 0; h < j->heads; h++)
            for (int64_t t = 0; t < j->tokens; t++, src += j->row) {
                unsigned char *dst = block + l * j->s_layer + h * j->s_head + t * j->s_token;
                int last = (k + per_row) * STRIPE == total;
                stripes(acc, src, dst, per_row, &k, last ? kSecret + LAST_AT : NULL, j->stream);
            }
    return merge(acc, (uint64_t)total) == j->want[b];
}
#else
TIERD_API TIERD_API int tierd_fused_isa(void) { return ISA_PIECES; }
#endif

/* The next block for this thread, or nblocks when all are taken (or past a failed one). */
static int64_t take(struct load *j) {
    int64_t b = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
    return b < j->nblocks && b < first_bad(j) ? b : j->nblocks;
}

/* One thread's share: blocks taken one at a time from a shared counter, so a thread that the
 * OS descheduled (the engine's own threads share these cores) holds up one block, not half the
 * job. A load stops at a failed block; the count of leading verified blocks stays exact, since
 * every block below the lowest failure was taken before it was found and is finished. */
static void *run_part(void *arg) {
    struct load *j = arg;
    if (!j->verify) {
        for (int64_t b; (b = take(j)) < j->nblocks;)
            store_block(j, b);
#if defined(__SSE2__)
        _mm_sfence();
#endif
        return NULL;
    }
#if defined(__x86_64__) && defined(__GNUC__)
    stripes_fn stripes = j->row % STRIPE == 0 && j->layers * j->heads * j->tokens * j->row > 240
                         ? stripes_for(j->isa) : NULL;
    if (stripes != NULL) {
        for (int64_t b; (b = take(j)) < j->nblocks;)
            if (!fused_block(j, stripes, b)) { lower_first_bad(j, b); break; }
        _mm_sfence();
        return NULL;
    }
#endif
    XXH3_state_t *state = XXH3_createState();
    if (state == NULL) { lower_first_bad(j, 0); return NULL; }  /* no memory: all a miss */
    for (int64_t b; (b = take(j)) < j->nblocks;)
        if (!one_block(j, state, b)) { lower_first_bad(j, b); break; }
    XXH3_freeState(state);
#if defined(__SSE2__)
    _mm_sfence();  /* the non-temporal stores are visible before the caller is told */
#endif
    return NULL;
}

enum { MAX_THREADS = 64 };

/* Run `job` on up to `threads` threads (this one included), each taking blocks as it goes. */
static void run(struct load *job, int threads) {
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > job->nblocks) threads = (int)job->nblocks;
    for (int t = 1; t < threads; t++)  /* a thread that does not start leaves its blocks to us */
        started[t] = pthread_create(&ids[t], NULL, run_part, job) == 0;
    run_part(job);
    for (int t = 1; t < threads; t++)
        if (started[t]) pthread_join(ids[t], NULL);
}

static int64_t run_job(int verify, int64_t nblocks, const uint64_t *slot, const int64_t *block,
                       const uint64_t *want, uint64_t base, int64_t layers, int64_t heads,
                       int64_t tokens, int64_t row, int64_t s_layer, int64_t s_block,
                       int64_t s_head, int64_t s_token, int threads, int isa) {
    struct load job = {verify, nblocks, slot, block, want, base, layers, heads, tokens, row,
                       s_layer, s_block, s_head, s_token, nblocks, 0,
                       nblocks * layers * heads * tokens * row >= STREAM_MIN, isa};
    if (nblocks <= 0) return 0;
    run(&job, threads);
    return job.first_bad;
}

/* A load: `isa` is the fused kernel to use where the rows allow (ISA_PIECES for none). */
TIERD_API int64_t tierd_load_verified(int64_t nblocks, const uint64_t *slot, const int64_t *block,
                                      const uint64_t *want, uint64_t base, int64_t layers,
                                      int64_t heads, int64_t tokens, int64_t row, int64_t s_layer,
                                      int64_t s_block, int64_t s_head, int64_t s_token,
                                      int threads, int isa) {
    return run_job(1, nblocks, slot, block, want, base, layers, heads, tokens, row, s_layer,
                   s_block, s_head, s_token, threads, isa);
}

/* A store: the same threads and stores as a load, no hash. */
TIERD_API void tierd_store_rows(int64_t nblocks, const uint64_t *slot, const int64_t *block,
                                uint64_t base, int64_t layers, int64_t heads, int64_t tokens,
                                int64_t row, int64_t s_layer, int64_t s_block, int64_t s_head,
                                int64_t s_token, int threads) {
    run_job(0, nblocks, slot, block, NULL, base, layers, heads, tokens, row, s_layer, s_block,
            s_head, s_token, threads, 0);
}
