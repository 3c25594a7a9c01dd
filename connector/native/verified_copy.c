/* Verify-while-copying: a DRAM load in one pass over the arena (connector/native/verified_copy.py);
 * and the plain copy of a store, the other way.
 *
 * Each block's slot is hashed (xxh3-64, the project's block checksum) in cache-sized pieces,
 * and each piece is copied to the engine's KV right after it was hashed, while it is still in
 * the core's cache: the slot is read from memory once instead of twice (a verify pass, then a
 * copy pass). Blocks are split between threads (as many as the caller allows).
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
 * into its slot, split between threads the same way, with non-temporal stores when large (the
 * slots are not read again soon: the daemon hashes them once). No hash here: the daemon
 * checksums committed slots itself.
 *
 * xxh3 comes in as function pointers from the python-xxhash extension already loaded in the
 * process (the same code that computed the stored checksums), so nothing here links a library.
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

struct load {
    const struct xxh3 *h;      /* NULL: a store (engine blocks -> slots, no hash) */
    int64_t nblocks;
    const uint64_t *slot;      /* address of each block's slot */
    const int64_t *block;      /* engine block id of each block */
    const uint64_t *want;      /* stored checksum of each block (loads) */
    uint64_t base;             /* engine memory: block b's first row is at base + b * s_block */
    int64_t layers, heads, tokens, row;
    int64_t s_layer, s_block, s_head, s_token;
    int64_t first_bad;         /* shared: lowest failed block index, nblocks if none */
    int stream;                /* non-temporal stores (a load of at least STREAM_MIN bytes) */
};

struct part { struct load *job; int64_t lo, hi; };

enum { PIECE = 16 * 1024 };  /* bytes hashed, then copied while in L1/L2: 16 KiB measured best */
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
static int one_block(struct load *j, void *state, int64_t b) {
    const unsigned char *src = (const unsigned char *)(uintptr_t)j->slot[b];
    const unsigned char *hashed = src;
    const unsigned char *end = src + j->layers * j->heads * j->tokens * j->row;
    unsigned char *block = (unsigned char *)(uintptr_t)(j->base + j->block[b] * j->s_block);
    j->h->reset(state);
    for (int64_t l = 0; l < j->layers; l++)
        for (int64_t h = 0; h < j->heads; h++)
            for (int64_t t = 0; t < j->tokens; t++, src += j->row) {
                unsigned char *dst = block + l * j->s_layer + h * j->s_head + t * j->s_token;
                for (int64_t off = 0; off < j->row; off += PIECE) {
                    size_t len = (size_t)(j->row - off < PIECE ? j->row - off : PIECE);
                    while (hashed < src + off + (int64_t)len) {
                        size_t n = (size_t)(end - hashed < PIECE ? end - hashed : PIECE);
                        j->h->update(state, hashed, n);
                        hashed += n;
                    }
                    copy_piece(dst + off, src + off, len, j->stream);
                }
            }
    return j->h->digest(state) == j->want[b];
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

static void *run_part(void *arg) {
    struct part *p = arg;
    struct load *j = p->job;
    if (j->h == NULL) {
        for (int64_t b = p->lo; b < p->hi; b++)
            store_block(j, b);
#if defined(__SSE2__)
        _mm_sfence();
#endif
        return NULL;
    }
    void *state = j->h->create();
    if (state == NULL) { lower_first_bad(j, p->lo); return NULL; }
    for (int64_t b = p->lo; b < p->hi && b < first_bad(j); b++)
        if (!one_block(j, state, b)) { lower_first_bad(j, b); break; }
    j->h->free(state);
#if defined(__SSE2__)
    _mm_sfence();  /* the non-temporal stores are visible before the caller is told */
#endif
    return NULL;
}

enum { MAX_THREADS = 64 };

/* Run `job` on up to `threads` threads (this one included), blocks split evenly. */
static void run(struct load *job, int threads) {
    struct part parts[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > job->nblocks) threads = (int)job->nblocks;
    for (int t = 0; t < threads; t++) {
        parts[t] = (struct part){job, job->nblocks * t / threads, job->nblocks * (t + 1) / threads};
        if (t > 0)
            started[t] = pthread_create(&ids[t], NULL, run_part, &parts[t]) == 0;
    }
    run_part(&parts[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t]) pthread_join(ids[t], NULL);
        else run_part(&parts[t]);  /* no thread: do its share here */
    }
}

/* A load (`h` the hash API), or with `h` NULL a store: see tierd_store_rows. */
int64_t tierd_load_verified(const struct xxh3 *h, int64_t nblocks, const uint64_t *slot,
                            const int64_t *block, const uint64_t *want, uint64_t base,
                            int64_t layers, int64_t heads, int64_t tokens, int64_t row,
                            int64_t s_layer, int64_t s_block, int64_t s_head, int64_t s_token,
                            int threads) {
    struct load job = {h, nblocks, slot, block, want, base, layers, heads, tokens, row,
                       s_layer, s_block, s_head, s_token, nblocks,
                       nblocks * layers * heads * tokens * row >= STREAM_MIN};
    if (nblocks <= 0) return 0;
    run(&job, threads);
    return job.first_bad;
}

void tierd_store_rows(int64_t nblocks, const uint64_t *slot, const int64_t *block, uint64_t base,
                      int64_t layers, int64_t heads, int64_t tokens, int64_t row,
                      int64_t s_layer, int64_t s_block, int64_t s_head, int64_t s_token,
                      int threads) {
    /* No hash API: the job is a store (run_part), the same split and stores as a load. */
    tierd_load_verified(NULL, nblocks, slot, block, NULL, base, layers, heads, tokens, row,
                        s_layer, s_block, s_head, s_token, threads);
}
