/* Copy-while-checksumming: a store in one pass over the engine's KV (checksummed_copy.py).
 *
 * The reverse of verified_copy.c: each block's rows are read from the engine's memory (L x H x
 * N rows of `row` bytes at byte strides s_layer, s_head, s_token from src_base +
 * src_block[b] * s_block), hashed (xxh3-64, the project's block checksum) in cache-sized
 * pieces, and each piece is copied into the block's slot right after it was hashed, while it
 * is still in the core's cache; the slot holds the rows back to back in (layer, head, token)
 * order. Blocks are split between threads. Writes the checksum of every block to `out`.
 * Large stores write the arena with non-temporal stores (nothing reads a slot soon after it
 * was written: the next reader is another engine's load or the daemon's SSD write-behind).
 *
 * xxh3 comes in as function pointers from the python-xxhash extension already loaded in the
 * process, so the checksums are the ones the daemon and every reader compute.
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

typedef void *(*create_fn)(void);
typedef int (*free_fn)(void *);
typedef int (*reset_fn)(void *);
typedef int (*update_fn)(void *, const void *, size_t);
typedef uint64_t (*digest_fn)(const void *);

struct xxh3 { create_fn create; free_fn free; reset_fn reset; update_fn update; digest_fn digest; };

struct store {
    const struct xxh3 *h;
    int64_t nblocks;
    const uint64_t *dst;        /* address of each block's slot */
    const int64_t *src_block;   /* engine block id of each block */
    uint64_t *out;              /* checksum of each block */
    uint64_t src_base;
    int64_t layers, heads, tokens, row;
    int64_t s_layer, s_block, s_head, s_token;
    int failed;                 /* shared: a thread could not get a hash state */
    int stream;
};

struct part { struct store *job; int64_t lo, hi; };

enum { PIECE = 16 * 1024 };
enum { STREAM_MIN = 8 << 20 };

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

static void one_block(struct store *j, void *state, int64_t b) {
    unsigned char *dst = (unsigned char *)(uintptr_t)j->dst[b];
    const unsigned char *block =
        (const unsigned char *)(uintptr_t)(j->src_base + j->src_block[b] * j->s_block);
    j->h->reset(state);
    for (int64_t l = 0; l < j->layers; l++)
        for (int64_t h = 0; h < j->heads; h++)
            for (int64_t t = 0; t < j->tokens; t++, dst += j->row) {
                const unsigned char *src = block + l * j->s_layer + h * j->s_head + t * j->s_token;
                for (int64_t off = 0; off < j->row; off += PIECE) {
                    size_t len = (size_t)(j->row - off < PIECE ? j->row - off : PIECE);
                    j->h->update(state, src + off, len);
                    copy_piece(dst + off, src + off, len, j->stream);
                }
            }
    j->out[b] = j->h->digest(state);
}

static void *run_part(void *arg) {
    struct part *p = arg;
    struct store *j = p->job;
    void *state = j->h->create();
    if (state == NULL) { __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED); return NULL; }
    for (int64_t b = p->lo; b < p->hi; b++)
        one_block(j, state, b);
    j->h->free(state);
#if defined(__SSE2__)
    _mm_sfence();
#endif
    return NULL;
}

enum { MAX_THREADS = 64 };

/* Returns 0 when every block was copied and its checksum written to `out`, -1 otherwise. */
int tierd_store_checksummed(const struct xxh3 *h, int64_t nblocks, const uint64_t *dst,
                            const int64_t *src_block, uint64_t *out, uint64_t src_base,
                            int64_t layers, int64_t heads, int64_t tokens, int64_t row,
                            int64_t s_layer, int64_t s_block, int64_t s_head, int64_t s_token,
                            int threads) {
    struct store job = {h, nblocks, dst, src_block, out, src_base, layers, heads, tokens, row,
                        s_layer, s_block, s_head, s_token, 0,
                        nblocks * layers * heads * tokens * row >= STREAM_MIN};
    struct part parts[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    if (nblocks <= 0) return 0;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > nblocks) threads = (int)nblocks;
    for (int t = 0; t < threads; t++) {
        parts[t] = (struct part){&job, nblocks * t / threads, nblocks * (t + 1) / threads};
        if (t > 0)
            started[t] = pthread_create(&ids[t], NULL, run_part, &parts[t]) == 0;
    }
    run_part(&parts[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t]) pthread_join(ids[t], NULL);
        else run_part(&parts[t]);
    }
    return job.failed ? -1 : 0;
}
