// Paged attention for decode (one query token per sequence) over tierd's paged KV cache.
//
// Follows vLLM's original PagedAttention kernel:
//   - one thread block per (query head, sequence): grid = (num_heads, num_seqs);
//   - NUM_WARPS warps take the sequence's KV blocks round-robin (warp w: blocks w, w + NUM_WARPS..);
//   - inside a warp, a thread group of THREAD_GROUP_SIZE = 32 / BLOCK_SIZE lanes owns one key
//     token; the group reads each 16-byte x-vector of that token's K together (each lane
//     16 / THREAD_GROUP_SIZE bytes), so a warp's loads of one x-row of a block are contiguous;
//   - q.k is reduced inside the group with shuffles, the max and the softmax sum within the warp
//     and then across warps through shared memory; P.V accumulates HEAD_SIZE / rows-per-iteration
//     outputs per lane, reduced across lanes and then across warps.
// Layout (elements of the cache type; x = 16 bytes / element size):
//   K: block * kv_block_stride + kv_head * kv_head_stride + [HEAD_SIZE / x][BLOCK_SIZE][x]
//   V: block * kv_block_stride + kv_head * kv_head_stride + [HEAD_SIZE][BLOCK_SIZE]
// tierd's pool rows hold every layer's K and V of a block, so kv_block_stride is one pool row.
//
// Self-contained: no CUDA headers. 16-bit floats travel as raw bits (unsigned short) and are
// converted with PTX; FP8 is decoded in software, so the same source builds for sm_80 and sm_90.
// Type codes (template arguments, chosen by cupy_attention.py through name expressions):
//   0 float32, 1 float16, 2 bfloat16, 3 fp8 e4m3 (finite-only "fn" variant), 4 fp8 e5m2.

#define TIERD_WARP_SIZE 32
#define TIERD_FULL_MASK 0xffffffffu
#define TIERD_LOWEST_F (-3.402823466e+38f)
#define TIERD_DIV_UP(a, b) (((a) + (b) - 1) / (b))

template <int CODE> struct Storage;
template <> struct Storage<0> { typedef float type; };
template <> struct Storage<1> { typedef unsigned short type; };
template <> struct Storage<2> { typedef unsigned short type; };
template <> struct Storage<3> { typedef unsigned char type; };
template <> struct Storage<4> { typedef unsigned char type; };

// N elements loaded or stored as one aligned access (16, 8 or 4 bytes).
template <typename T, int N> struct alignas(sizeof(T) * N) Vec { T v[N]; };

__device__ __forceinline__ float half_bits_to_float(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

__device__ __forceinline__ unsigned short float_to_half_bits(float f) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

__device__ __forceinline__ unsigned short float_to_bf16_bits(float f) {
  unsigned int u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return (unsigned short)(u >> 16);
}

__device__ __forceinline__ float e4m3_bits_to_float(unsigned char b) {
  const unsigned int sign = ((unsigned int)b & 0x80u) << 24;
  const unsigned int exponent = ((unsigned int)b >> 3) & 0xfu;
  const unsigned int mantissa = (unsigned int)b & 0x7u;
  if (exponent == 0xfu && mantissa == 0x7u) return __uint_as_float(sign | 0x7fc00000u);  // NaN
  if (exponent == 0u) {  // subnormal: mantissa * 2^-9
    const float f = (float)mantissa * 0.001953125f;
    return sign ? -f : f;
  }
  return __uint_as_float(sign | ((exponent + 120u) << 23) | (mantissa << 20));  // bias 7 -> 127
}

template <int CODE> __device__ __forceinline__ float to_float(typename Storage<CODE>::type v);
template <> __device__ __forceinline__ float to_float<0>(float v) { return v; }
template <> __device__ __forceinline__ float to_float<1>(unsigned short v) {
  return half_bits_to_float(v);
}
template <> __device__ __forceinline__ float to_float<2>(unsigned short v) {
  return __uint_as_float(((unsigned int)v) << 16);
}
template <> __device__ __forceinline__ float to_float<3>(unsigned char v) {
  return e4m3_bits_to_float(v);
}
template <> __device__ __forceinline__ float to_float<4>(unsigned char v) {
  return half_bits_to_float((unsigned short)(((unsigned int)v) << 8));  // e5m2 = fp16's top byte
}

template <int CODE> __device__ __forceinline__ typename Storage<CODE>::type from_float(float f);
template <> __device__ __forceinline__ float from_float<0>(float f) { return f; }
template <> __device__ __forceinline__ unsigned short from_float<1>(float f) {
  return float_to_half_bits(f);
}
template <> __device__ __forceinline__ unsigned short from_float<2>(float f) {
  return float_to_bf16_bits(f);
}

// Sum over the whole thread block: within each warp by shuffles, then across warps.
template <int NUM_WARPS>
__device__ __forceinline__ float block_sum(float* red_smem, float sum) {
  const int warp = threadIdx.x / TIERD_WARP_SIZE;
  const int lane = threadIdx.x % TIERD_WARP_SIZE;
#pragma unroll
  for (int mask = TIERD_WARP_SIZE / 2; mask >= 1; mask /= 2) {
    sum += __shfl_xor_sync(TIERD_FULL_MASK, sum, mask);
  }
  if (lane == 0) red_smem[warp] = sum;
  __syncthreads();
  sum = lane < NUM_WARPS ? red_smem[lane] : 0.f;
#pragma unroll
  for (int mask = NUM_WARPS / 2; mask >= 1; mask /= 2) {
    sum += __shfl_xor_sync(TIERD_FULL_MASK, sum, mask);
  }
  return __shfl_sync(TIERD_FULL_MASK, sum, 0);
}

// Dynamic shared memory: max(ceil(max_seq_len / BLOCK_SIZE) * BLOCK_SIZE,
// (NUM_THREADS / 64) * HEAD_SIZE) floats (logits first, then the cross-warp output reduction).
template <int Q_CODE, int CACHE_CODE, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS>
__global__ void __launch_bounds__(NUM_THREADS) paged_attention_decode(
    typename Storage<Q_CODE>::type* __restrict__ out,  // [num_seqs, num_heads, HEAD_SIZE]
    const typename Storage<Q_CODE>::type* __restrict__ q,  // rows of [num_heads, HEAD_SIZE]
    const typename Storage<CACHE_CODE>::type* __restrict__ k_cache,
    const typename Storage<CACHE_CODE>::type* __restrict__ v_cache,
    const int* __restrict__ block_tables,  // [num_seqs, max_num_blocks_per_seq]
    const int* __restrict__ seq_lens,      // [num_seqs], each >= 1
    const int num_kv_heads,
    const float scale,
    const int max_num_blocks_per_seq,
    const long long q_stride,         // elements between consecutive sequences' query rows
    const long long kv_block_stride,  // elements between consecutive pool blocks
    const long long kv_head_stride,   // elements between KV heads inside a block
    const float k_scale,
    const float v_scale) {
  typedef typename Storage<Q_CODE>::type scalar_t;
  typedef typename Storage<CACHE_CODE>::type cache_t;
  constexpr int X = 16 / (int)sizeof(cache_t);
  constexpr int THREAD_GROUP_SIZE = TIERD_WARP_SIZE / BLOCK_SIZE;
  constexpr int NUM_WARPS = NUM_THREADS / TIERD_WARP_SIZE;
  constexpr int VEC_SIZE = X / THREAD_GROUP_SIZE;  // elements per lane per 16-byte x-vector
  constexpr int NUM_X_VECS = HEAD_SIZE / X;        // x-vectors per key token
  static_assert(BLOCK_SIZE <= TIERD_WARP_SIZE && TIERD_WARP_SIZE % BLOCK_SIZE == 0,
                "a warp covers whole blocks: BLOCK_SIZE must divide 32");
  static_assert(X % THREAD_GROUP_SIZE == 0, "a thread group splits one 16-byte vector");
  static_assert(HEAD_SIZE % X == 0, "HEAD_SIZE must be a multiple of x");
  static_assert(NUM_WARPS >= 1 && (NUM_WARPS & (NUM_WARPS - 1)) == 0, "warps: a power of two");
  typedef Vec<cache_t, VEC_SIZE> KVec;

  const int head_idx = blockIdx.x;
  const int seq_idx = blockIdx.y;
  const int num_heads = gridDim.x;
  const int kv_head_idx = head_idx / (num_heads / num_kv_heads);
  const int seq_len = seq_lens[seq_idx];
  const int num_seq_blocks = TIERD_DIV_UP(seq_len, BLOCK_SIZE);
  const int tid = threadIdx.x;
  const int warp_idx = tid / TIERD_WARP_SIZE;
  const int lane = tid % TIERD_WARP_SIZE;
  const int group_idx = lane / THREAD_GROUP_SIZE;      // key token within the block
  const int group_offset = lane % THREAD_GROUP_SIZE;   // slice of each x-vector

  extern __shared__ float shared_mem[];
  float* logits = shared_mem;
  __shared__ float q_smem[HEAD_SIZE];
  __shared__ float red_smem[2 * NUM_WARPS];

  const scalar_t* q_ptr = q + seq_idx * q_stride + (long long)head_idx * HEAD_SIZE;
  for (int i = tid; i < HEAD_SIZE; i += NUM_THREADS) q_smem[i] = to_float<Q_CODE>(q_ptr[i]);
  __syncthreads();

  const int* block_table = block_tables + (long long)seq_idx * max_num_blocks_per_seq;
  const long long head_offset = (long long)kv_head_idx * kv_head_stride;

  // 1. Logits: warps over blocks, thread groups over key tokens, 16-byte vectors over head_dim.
  float qk_max = TIERD_LOWEST_F;
  for (int block_idx = warp_idx; block_idx < num_seq_blocks; block_idx += NUM_WARPS) {
    const long long block = block_table[block_idx];
    const int token_idx = block_idx * BLOCK_SIZE + group_idx;
    const cache_t* k_ptr = k_cache + block * kv_block_stride + head_offset + group_idx * X +
                           group_offset * VEC_SIZE;
    const float* q_vec = q_smem + group_offset * VEC_SIZE;
    float qk = 0.f;
#pragma unroll
    for (int j = 0; j < NUM_X_VECS; j++) {
      const KVec k_vec = *reinterpret_cast<const KVec*>(k_ptr + j * BLOCK_SIZE * X);
#pragma unroll
      for (int e = 0; e < VEC_SIZE; e++) qk += q_vec[j * X + e] * to_float<CACHE_CODE>(k_vec.v[e]);
    }
#pragma unroll
    for (int mask = THREAD_GROUP_SIZE / 2; mask >= 1; mask /= 2) {
      qk += __shfl_xor_sync(TIERD_FULL_MASK, qk, mask);
    }
    qk *= scale * k_scale;
    if (group_offset == 0) {
      const bool past_end = token_idx >= seq_len;  // padding slots of the last block
      logits[token_idx] = past_end ? 0.f : qk;
      qk_max = past_end ? qk_max : fmaxf(qk_max, qk);
    }
  }

  // 2. Max: across the warp's thread groups, then across warps.
#pragma unroll
  for (int mask = TIERD_WARP_SIZE / 2; mask >= THREAD_GROUP_SIZE; mask /= 2) {
    qk_max = fmaxf(qk_max, __shfl_xor_sync(TIERD_FULL_MASK, qk_max, mask));
  }
  if (lane == 0) red_smem[warp_idx] = qk_max;
  __syncthreads();
  qk_max = lane < NUM_WARPS ? red_smem[lane] : TIERD_LOWEST_F;
#pragma unroll
  for (int mask = NUM_WARPS / 2; mask >= 1; mask /= 2) {
    qk_max = fmaxf(qk_max, __shfl_xor_sync(TIERD_FULL_MASK, qk_max, mask));
  }
  qk_max = __shfl_sync(TIERD_FULL_MASK, qk_max, 0);

  // 3. Softmax: exp(x - max) / sum, the sum reduced over the block.
  float exp_sum = 0.f;
  for (int i = tid; i < seq_len; i += NUM_THREADS) {
    const float val = __expf(logits[i] - qk_max);
    logits[i] = val;
    exp_sum += val;
  }
  exp_sum = block_sum<NUM_WARPS>(&red_smem[NUM_WARPS], exp_sum);
  const float inv_sum = __fdividef(1.f, exp_sum);
  for (int i = tid; i < seq_len; i += NUM_THREADS) logits[i] *= inv_sum;
  __syncthreads();

  // 4. P.V: V rows are head_dim positions with tokens innermost; each lane accumulates
  //    NUM_ROWS_PER_THREAD rows over V_VEC_SIZE tokens at a time.
  constexpr int V_VEC_SIZE = X < BLOCK_SIZE ? X : BLOCK_SIZE;
  constexpr int NUM_V_VECS_PER_ROW = BLOCK_SIZE / V_VEC_SIZE;
  constexpr int NUM_ROWS_PER_ITER = TIERD_WARP_SIZE / NUM_V_VECS_PER_ROW;
  constexpr int NUM_ROWS_PER_THREAD = TIERD_DIV_UP(HEAD_SIZE, NUM_ROWS_PER_ITER);
  typedef Vec<cache_t, V_VEC_SIZE> VVec;
  float accs[NUM_ROWS_PER_THREAD];
#pragma unroll
  for (int i = 0; i < NUM_ROWS_PER_THREAD; i++) accs[i] = 0.f;

  const int v_token_offset = (lane % NUM_V_VECS_PER_ROW) * V_VEC_SIZE;
  for (int block_idx = warp_idx; block_idx < num_seq_blocks; block_idx += NUM_WARPS) {
    const long long block = block_table[block_idx];
    const int token_idx = block_idx * BLOCK_SIZE + v_token_offset;
    float probs[V_VEC_SIZE];
#pragma unroll
    for (int e = 0; e < V_VEC_SIZE; e++) probs[e] = logits[token_idx + e];
    const cache_t* v_ptr = v_cache + block * kv_block_stride + head_offset + v_token_offset;
#pragma unroll
    for (int i = 0; i < NUM_ROWS_PER_THREAD; i++) {
      const int row = lane / NUM_V_VECS_PER_ROW + i * NUM_ROWS_PER_ITER;
      if (row < HEAD_SIZE) {
        const VVec v_vec = *reinterpret_cast<const VVec*>(v_ptr + row * BLOCK_SIZE);
        float acc = 0.f;
#pragma unroll
        for (int e = 0; e < V_VEC_SIZE; e++) {
          // Select, not multiply: a padding slot may hold anything, even NaN.
          acc += token_idx + e < seq_len ? probs[e] * to_float<CACHE_CODE>(v_vec.v[e]) : 0.f;
        }
        accs[i] += acc;
      }
    }
  }

  // 5. Reduce the lanes that share a row, then the warps (halving), through shared memory.
#pragma unroll
  for (int i = 0; i < NUM_ROWS_PER_THREAD; i++) {
    float acc = accs[i];
#pragma unroll
    for (int mask = NUM_V_VECS_PER_ROW / 2; mask >= 1; mask /= 2) {
      acc += __shfl_xor_sync(TIERD_FULL_MASK, acc, mask);
    }
    accs[i] = acc;
  }
  __syncthreads();  // logits are dead: reuse shared_mem for the cross-warp reduction
  float* out_smem = shared_mem;
  const bool row_owner = lane % NUM_V_VECS_PER_ROW == 0;
#pragma unroll
  for (int i = NUM_WARPS; i > 1; i /= 2) {
    const int mid = i / 2;
    if (warp_idx >= mid && warp_idx < i) {
      float* dst = out_smem + (warp_idx - mid) * HEAD_SIZE;
#pragma unroll
      for (int r = 0; r < NUM_ROWS_PER_THREAD; r++) {
        const int row = lane / NUM_V_VECS_PER_ROW + r * NUM_ROWS_PER_ITER;
        if (row < HEAD_SIZE && row_owner) dst[row] = accs[r];
      }
    }
    __syncthreads();
    if (warp_idx < mid) {
      const float* src = out_smem + warp_idx * HEAD_SIZE;
#pragma unroll
      for (int r = 0; r < NUM_ROWS_PER_THREAD; r++) {
        const int row = lane / NUM_V_VECS_PER_ROW + r * NUM_ROWS_PER_ITER;
        if (row < HEAD_SIZE && row_owner) accs[r] += src[row];
      }
    }
    __syncthreads();
  }

  if (warp_idx == 0) {
    scalar_t* out_ptr = out + ((long long)seq_idx * num_heads + head_idx) * HEAD_SIZE;
#pragma unroll
    for (int r = 0; r < NUM_ROWS_PER_THREAD; r++) {
      const int row = lane / NUM_V_VECS_PER_ROW + r * NUM_ROWS_PER_ITER;
      if (row < HEAD_SIZE && row_owner) out_ptr[row] = from_float<Q_CODE>(accs[r] * v_scale);
    }
  }
}

#ifdef TIERD_INSTANTIATE_ALL
// A set of configurations the tests compile with nvcc: every query type, cache type, head size
// and block size appears at least once (CuPy instantiates the one it needs on demand instead).
#define TIERD_PARAMS(Q, C)                                                                     \
  Storage<Q>::type*, const Storage<Q>::type*, const Storage<C>::type*, const Storage<C>::type*, \
      const int*, const int*, int, float, int, long long, long long, long long, float, float
#define TIERD_INST(Q, C, H, B) \
  template __global__ void paged_attention_decode<Q, C, H, B, 128>(TIERD_PARAMS(Q, C));
TIERD_INST(0, 0, 64, 8)
TIERD_INST(0, 0, 128, 32)
TIERD_INST(1, 1, 128, 16)
TIERD_INST(1, 1, 64, 32)
TIERD_INST(1, 3, 128, 16)
TIERD_INST(1, 4, 64, 8)
TIERD_INST(2, 2, 128, 8)
TIERD_INST(2, 2, 64, 16)
TIERD_INST(2, 3, 64, 32)
TIERD_INST(0, 4, 128, 16)
#endif
