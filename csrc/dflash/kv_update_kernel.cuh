// The CUDA kernel of the update, for both contracts, every delta/pool dtype pair and the fused
// norms; included by the instantiation units kv_update_cuda_<pool>.cu. What is stored is
// numerics.h, where it lands is kv_update.h.
//
// One thread owns one work item of one head of one token, for K and V alike: a rotate-half pair
// of VEC-channel vectors (channels c and c + R/2, so each key element is read once and each
// cos/sin entry once per head), or one pass-through vector past R. A block is (items of one head,
// heads, tokens): threadIdx.x walks a head's items, threadIdx.y heads, threadIdx.z tokens;
// grid.y is the slot (slot contract) and grid.z the layer, so no thread divides to find its token:
// at decode sizes the index math before the first load is a visible part of the kernel's time.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "dflash/contract.h"
#include "dflash/kv_update_cuda.h"
#include "dflash/numerics.h"

// Tuning knobs, set with -D (bench/kernel_variants builds variants this way).
#ifndef DFLASH_BLOCK_THREADS
#define DFLASH_BLOCK_THREADS 128  // ties 256 at decode sizes, best at the bandwidth-bound ones
#endif
#ifndef DFLASH_STREAMING_STORES
#define DFLASH_STREAMING_STORES 1  // pool rows are not read again by this kernel
#endif
#ifndef DFLASH_MAX_VEC_BYTES
#define DFLASH_MAX_VEC_BYTES 32  // widest delta vector per work item (two 16-byte loads)
#endif
#ifndef DFLASH_BYTE_POOL_VEC
// Channels of a work item from 16-bit deltas into a 1-byte pool (int8, FP8 with static scales): 8,
// or 16 (two 16-byte delta loads and one 16-byte store a vector, half the items and so half the
// per-item addressing a channel; not compiled in unless set).
#define DFLASH_BYTE_POOL_VEC 8
#endif
static_assert(DFLASH_BYTE_POOL_VEC == 8 || DFLASH_BYTE_POOL_VEC == 16, "DFLASH_BYTE_POOL_VEC: 8 or 16");
#ifndef DFLASH_GROUP_MIN_BLOCKS
// Blocks per SM the scale-pool group kernel is compiled for (__launch_bounds__'s minimum): 0, the
// compiler's choice (4 for the four-chunk kernel, at 128 registers); 5 holds it to 96 registers,
// with 56 bytes of spills a thread for float16 deltas.
#define DFLASH_GROUP_MIN_BLOCKS 0
#endif
#if DFLASH_GROUP_MIN_BLOCKS > 0
#define DFLASH_GROUP_BOUNDS __launch_bounds__(dflash::kernel::kGroupThreads, DFLASH_GROUP_MIN_BLOCKS)
#else
#define DFLASH_GROUP_BOUNDS __launch_bounds__(dflash::kernel::kGroupThreads)
#endif
#ifndef DFLASH_UPDATE_MIN_BLOCKS
// Blocks per SM the update kernels are compiled for (__launch_bounds__'s minimum): 0, the
// compiler's choice; 7 holds them to 72 registers, where the paged bfloat16-to-e4m3 key-norm
// kernel needs 74 without it (6 resident blocks instead of 7), with 8-16 bytes of spills a
// thread in some kernels.
#define DFLASH_UPDATE_MIN_BLOCKS 0
#endif
#if DFLASH_UPDATE_MIN_BLOCKS > 0
#define DFLASH_UPDATE_BOUNDS __launch_bounds__(DFLASH_BLOCK_THREADS, DFLASH_UPDATE_MIN_BLOCKS)
#else
#define DFLASH_UPDATE_BOUNDS __launch_bounds__(DFLASH_BLOCK_THREADS)
#endif
#ifndef DFLASH_LEAN_OFFSETS
// 1: the scale-pool group kernel takes a row's offsets from indices: its deltas' from its item
// index (the deltas' head rows in launch order) instead of from its coordinates (three divisions
// a row), its pool row's from its scale's index (one head row a scale); 0: from the coordinates
// and the layout's strides. With the bracket (numerics.h) 2-8% faster on every scale-pool row
// of bench/kernel_variants (BENCHMARKS.md).
#define DFLASH_LEAN_OFFSETS 1
#endif
#ifndef DFLASH_ROPE_AT_USE
// 1: the scale-pool group kernel's lanes of several chunks load each rotary chunk's cos/sin just
// before its rotation (fewer registers: 116 instead of 128 without the norm, with the other
// candidates); 0: all of them before the copies' wait.
#define DFLASH_ROPE_AT_USE 0
#endif
#ifndef DFLASH_ADDRESS_AHEAD
// The scale-pool group kernels, by the chunks a lane holds (a bit set: 1, 2, 4), whose warps load
// the next row group's address words (the slot form's start and length, the paged form's owner
// and position, the mapped form's slot) while they store the current group, so that a group's
// rope row and pool rows wait on one load, not two in a chain. 4: the four-chunk kernel, which
// runs where the rows fill a pass of its resident blocks (DFLASH_WIDE_BY_ROWS), so that each warp
// has several groups (on an H200 at B=8 L=2048, 1-6% faster on the int8 and int4 rows, 2% slower
// on e4m3; on an H100 within 1%). In the two-chunk kernel, whose warps have one group at decode
// sizes, it was 4-7% slower.
#define DFLASH_ADDRESS_AHEAD 4
#endif
#ifndef DFLASH_ROPE_AHEAD
// 1: in the scale-pool group kernels with DFLASH_ADDRESS_AHEAD, a group's row address and rope row
// are taken right after the group before it is stored (its address words two groups ahead), so
// that the rope row's latency runs under the next copies and their wait; 0: after that wait
// (where the compiler puts the rope loads), the address words one group ahead. 1: on an H100 at
// B=8 L=2048, 0.4-3.0% faster on every scale-pool and int4 row; decode sizes take the two-chunk
// kernel, which it leaves as it is (BENCHMARKS.md).
#define DFLASH_ROPE_AHEAD 1
#endif
#ifndef DFLASH_ROPE_AFTER_KEYS
// 1: the scale-pool four-chunk kernel (with DFLASH_ROPE_AHEAD) stores a row group's K before its V
// and takes the next group's row and rope row right after K's rotation, so that the rope row is in
// flight under the K stores and the whole V plane as well as the next copies and their wait;
// 0: V first, the next group's row taken once both planes are stored.
#define DFLASH_ROPE_AFTER_KEYS 0
#endif
#ifndef DFLASH_STORE_BASE
// 1: the scale-pool group kernel forms a row's store address once (one 64-bit register, each
// chunk's store at an immediate offset from it), where 0 lets the compiler form it again under
// each chunk's predicate (the pool pointer reloaded and a 64-bit addition a chunk: 8 loads of the
// constant bank fewer in the four-chunk int8 kernel). Off until timed on an H200: on an H100, 1
// was 1.1-3.4% faster on the scale-pool rows with their inputs in L2 and within the noise from
// DRAM (BENCHMARKS.md).
#define DFLASH_STORE_BASE 0
#endif
#ifndef DFLASH_SHARED_ROWS
// 1: the scale-pool four-chunk kernel (with DFLASH_ROPE_AHEAD) works out each row's place once a
// warp instead of once in every lane of its group: once every G row groups each lane takes one row
// of the next G groups (its coordinates, address words, scale-pool entries and rope row) and each
// group's lanes shuffle their row's entries and rope row from the lane that took it (a few
// shuffles a group, where every lane ran the whole chain). 0: every lane its own row's. Off until
// timed on an H200: on an H100, with DFLASH_STORE_BASE, 5.2-8.0% faster on every scale-pool row
// with its inputs in L2 and 1.0-2.9% from DRAM but the fused norm's rows (+0.3%, +0.4%)
// (BENCHMARKS.md). 2: the same, the bfloat16 fused-norm kernels included (see kSharedRows).
#define DFLASH_SHARED_ROWS 0
#endif
#ifndef DFLASH_EXACT_QUOTIENTS
// 1: the scale-pool group kernel stores a row whose scale s lies in [2^-80, 2^100] from each
// element's quotient RN(y / s) computed exactly from the correctly rounded reciprocal
// (exact_quotient_words): no bracket, no per-element proof and no fallback branch. Other rows
// (zero, non-finite, extreme scales) as with 0: the bracket, and the division where it fails. On
// an H100, 11-19% faster at B=64 L=16 and 4-7% at B=8 L=2048 on every scale-pool row
// (BENCHMARKS.md).
#define DFLASH_EXACT_QUOTIENTS 1
#endif
#ifndef DFLASH_PLANE_BRACKET
// 1: an int8 or int4 scale-pool plane whose values the kernel computed (rotated or normed) and
// whose scale has exact quotients takes its codes from the bracket first (product_words: two FMAs
// and a comparison an element, where the exact quotient takes four operations), every chunk of
// the lane's plane stored as it is made, and one branch for the plane: where any element's ends
// round apart, the plane's chunks are made again from the exact quotients and stored over them
// (the same lane's later stores). Not for planes of deltas as loaded: a 16-bit element of exactly
// half the row's maximum (q = 63.5 or 3.5 up to the scale's rounding) is common there, and with
// unit-normal float16 values about a third of the warps' V planes would be made twice (about 3%
// of the rotated K planes). 2: every plane. 0: none. Off: untimed.
#define DFLASH_PLANE_BRACKET 0
#endif
#ifndef DFLASH_VALUES_FIRST
// 1: the scale-pool group kernel stores a row's V before its K, so that the V row's work runs
// while the K row's rope row is in flight (on an H200 1-10% faster on every scale-pool row of
// bench/kernel_variants, on an H100 2-7% at B=8 L=2048); 0: K first.
#define DFLASH_VALUES_FIRST 1
#endif
#ifndef DFLASH_WORDS_AT_ONCE
// 1: the scale-pool kernels issue both address words of a row (slot start and length, paged owner
// and position) where they are asked for, as one pair of loads (word_now). Plain loads let the
// compiler sink the start position's below the branch on the length (nothing is written past the
// length), so that at decode sizes a row waited on three loads in a chain: its length, its start,
// its rope row (bench/results/ncu_h200_decode_696896f.txt); the static kernels issue the two
// together. 0: plain loads; on an H100 the pair made no row faster (the int8 scale-pool rows
// 0.1-1.2% slower, about that card's noise; BENCHMARKS.md).
#define DFLASH_WORDS_AT_ONCE 0
#endif
#ifndef DFLASH_COPY_IMMEDIATES
// 1: the scale-pool group kernel's copies of heads of exactly its chunks take their offsets as
// constants from the lane's first chunk (one 64-bit address a plane, eight copies at immediate
// offsets), where 0 adds each copy's own offset, selected by whether its chunk is inside D: about
// 18 fewer instructions a row group in the four-chunk int8 kernel, 6 fewer registers. 0: on an
// H100 it was within the noise at decode sizes and 0.3-0.7% slower at B=8 L=2048 (BENCHMARKS.md).
#define DFLASH_COPY_IMMEDIATES 0
#endif
#ifndef DFLASH_STATIC_RANGE_BY_MAXIMUM
// 1: a static-scale int8 chunk's codes skip their clamp where the chunk's largest magnitude proves
// that none saturates (product_words): 8 float maxima and one bracket end for 8 codes, where 0
// clamps each code (16 maxima). 1: on an H100 with the inputs in L2 the int8 static rows take
// 3% less; at B=8 L=2048 from DRAM they are unchanged (BENCHMARKS.md).
#define DFLASH_STATIC_RANGE_BY_MAXIMUM 1
#endif
#ifndef DFLASH_PAIR_QUOTIENTS
// 1: a static-scale int8 item's two packs (the halves of its rotate-half pairs, one scale) are
// quantized as one chunk of 2 VEC codes (encode_pair): one range test and one fallback branch for
// both, where 0 takes each pack on its own. Off: untimed.
#define DFLASH_PAIR_QUOTIENTS 0
#endif
#ifndef DFLASH_INT4_WORDS
// 1: the int4 scale-pool stores gather eight codes' low bytes into two words (even elements, odd
// ones) by byte permutes and join them by a shift and a mask, and the group kernel stores the word
// as it is: 9 instructions for 8 codes, where 0 masks, shifts and ORs in each code (about 15) and
// the compiler splits the 4-byte pack into bytes that it masks and joins again (7 more). 1: on
// an H100, int4 rows 3.6% faster at B=64 L=16, 0.4% at B=8 L=2048 (BENCHMARKS.md).
#define DFLASH_INT4_WORDS 1
#endif
#ifndef DFLASH_FP8_END_WORDS
// 1: the scale-pool FP8 stores convert four elements' low bracket ends into one word and their
// high ends into another (numerics.h's float4_to_e4m3x4_raw), the low word being the stored
// codes and the two compared whole: 26 instructions for 8 codes (16 FMUL, 8 F2FP, 2 ISETP),
// where 0 converts each element's pair into 16 bits that are widened by a mask, joined by byte
// permutes and compared by shifts (47). 1: on an H100, e4m3 scale-pool rows 5% faster at B=64
// L=16, 2.5% at B=8 L=2048 (BENCHMARKS.md).
#define DFLASH_FP8_END_WORDS 1
#endif
#ifndef DFLASH_WIDE_BY_ROWS
// 1: scale-pool calls of wide heads (launch_wide) below a pass of the four-chunk kernel's
// resident blocks take two chunks a lane (14-20% faster at B=64 L=16, the same at B=8 L=2048);
// 0: four at every size.
#define DFLASH_WIDE_BY_ROWS 1
#endif
// Three scheduling choices of the paged kernels, as bit sets over five kinds of kernel (kPagedKind):
// 1 plain into a 16/32-bit pool, 2 plain into an FP8 pool, 4 fused norm into a 16/32-bit pool,
// 8 fused norm into an FP8 pool from float16 or float32 deltas, 16 the same from bfloat16 deltas.
// Each default is what bench/kernel_variants measured best on the H200 (the measurements are in
// bench/results/HISTORY.md, "Kernel design notes").
#ifndef DFLASH_PAGED_VALUES_EARLY
// The kernels that compute their stored values while the page ids are in flight (keep_computed).
// The fused norm into a 16/32-bit pool computes them after, as does the fused norm from bfloat16
// deltas into an FP8 pool: early, both were slower where bandwidth bounds the kernel.
#define DFLASH_PAGED_VALUES_EARLY 11
#endif
#ifndef DFLASH_PAGED_STREAMING_LOADS
// The kernels that read the delta rows with evict-first loads in launches of at least
// DFLASH_STREAMING_LOADS_BYTES of K and V deltas (a second instantiation, picked at launch), so
// that rows read once do not push the pool's lines out of L2: the plain and the fused-norm
// kernels into FP8 pools from 16/32-bit deltas, which it makes faster (the others it leaves as
// they are or slows). Below the size, cached loads: at decode the projection has just written the
// deltas into L2.
#define DFLASH_PAGED_STREAMING_LOADS 10
#endif
#ifndef DFLASH_STREAMING_LOADS_BYTES
#define DFLASH_STREAMING_LOADS_BYTES (32 << 20)  // half the H200's L2
#endif
#ifndef DFLASH_PAGED_INDEX_BRANCH
// The kernels that look their page ids up under a uniform branch. In one block with the delta
// loads, the compiler schedules the position-dependent index math before the last of them, which
// then wait for the positions (the plain 16/32-bit kernel is slower that way at decode); the
// other kinds measured faster without the branch.
#define DFLASH_PAGED_INDEX_BRANCH 1
#endif

namespace dflash {
namespace kernel {

// Makes the values of `pack` be computed here, in program order: an empty asm that reads them.
// Without it the compiler sinks the paged kernel's arithmetic below the branch on the page ids,
// so that it runs only after the page-table load returns instead of while it is in flight.
template <typename P> __device__ __forceinline__ void keep_computed(P const& pack) {
  constexpr int kWords = (int(sizeof(P)) + 3) / 4;
  uint32_t words[kWords] = {};
  memcpy(words, &pack, sizeof(P));
#pragma unroll
  for (int i = 0; i < kWords; ++i) asm volatile("" ::"r"(words[i]));
}

// Element types, as tags with their storage bits and conversions.
struct F16 {
  using Bits = uint16_t;
  static constexpr DType kDType = DType::kFloat16;
  static __device__ __forceinline__ float decode(Bits b) { return float16_bits_to_float(b); }
  static __device__ __forceinline__ Bits encode(float f) { return float_to_float16_bits(f); }
  static __device__ __forceinline__ uint32_t encode2(float a, float b) {
    return float2_to_float16x2_bits(a, b);
  }
};
struct BF16 {
  using Bits = uint16_t;
  static constexpr DType kDType = DType::kBFloat16;
  static __device__ __forceinline__ float decode(Bits b) { return bfloat16_bits_to_float(b); }
  static __device__ __forceinline__ Bits encode(float f) { return float_to_bfloat16_bits(f); }
};
struct F32 {
  using Bits = uint32_t;
  static constexpr DType kDType = DType::kFloat32;
  static __device__ __forceinline__ float decode(Bits b) { return __uint_as_float(b); }
  static __device__ __forceinline__ Bits encode(float f) { return float_to_float32_bits(f); }
};
struct E4M3 {
  using Bits = uint8_t;
  static constexpr DType kDType = DType::kFloat8E4M3;
  static __device__ __forceinline__ Bits encode(float f) { return float_to_e4m3_bits(f); }
  static __device__ __forceinline__ uint16_t encode2(float a, float b) { return float2_to_e4m3x2_bits(a, b); }
  static __device__ __forceinline__ uint32_t encode4(float a, float b, float c, float d) {
    return float4_to_e4m3x4_bits(a, b, c, d);
  }
};
struct E5M2 {
  using Bits = uint8_t;
  static constexpr DType kDType = DType::kFloat8E5M2;
  static __device__ __forceinline__ Bits encode(float f) { return float_to_e5m2_bits(f); }
  static __device__ __forceinline__ uint16_t encode2(float a, float b) { return float2_to_e5m2x2_bits(a, b); }
  static __device__ __forceinline__ uint32_t encode4(float a, float b, float c, float d) {
    return float4_to_e5m2x4_bits(a, b, c, d);
  }
};
struct I8 {
  using Bits = uint8_t;
  static constexpr DType kDType = DType::kInt8;
  static __device__ __forceinline__ Bits encode(float q) { return float_to_int8_bits(q); }
};
// int4: bytes of two elements (numerics.h's pack_int4), stored with a scale pool only, by the
// dynamic-scale kernel (no per-element encode).
struct I4 {
  using Bits = uint8_t;
  static constexpr DType kDType = DType::kUInt8;
};
template <typename T> inline constexpr bool kIsFp8 = std::is_same_v<T, E4M3> || std::is_same_v<T, E5M2>;
// A pool element type whose format stores values times the reciprocal of k_scale / v_scale
// (contract.h): the kernels load the scales and pass their reciprocals to the stores.
template <typename T> inline constexpr bool kScaledPool = takes_scales(T::kDType);
// A scaled pool whose stores divide by the scale (contract.h's Conversion): they get the scale's
// Divisor (quotient_bytes) where the others get its reciprocal.
template <typename T> inline constexpr bool kDividingPool = divides_by_scale(T::kDType);
// A pool element type a scale pool can scale (static-scale formats and the dynamic-only ones).
template <typename T> inline constexpr bool kScalePoolFormat =
    takes_scales(T::kDType) || needs_scale_pool(T::kDType);
// Elements per stored byte along D: 2 for int4.
template <typename T> inline constexpr int64_t kPerByte = pool_per_byte(T::kDType);

// Widening a delta vector, and the fused norms' round trips through the delta dtype, two channels
// per packed conversion (on values: no reinterpreted memory). The round trips skip the canonical
// NaN: a NaN stays a NaN through the rest of the arithmetic and is made canonical when stored.
template <typename Delta, int VEC>
__device__ __forceinline__ void decode_pack(typename Delta::Bits const (&bits)[VEC], float (&out)[VEC]) {
#pragma unroll
  for (int i = 0; i < VEC; ++i) out[i] = Delta::decode(bits[i]);
}

// x[i] and x[i + 1] rounded to the delta dtype and widened again.
template <typename Delta> __device__ __forceinline__ void round_pair(float& a, float& b) {
  if constexpr (std::is_same_v<Delta, F16>) {
    float2 const f = __half22float2(__float22half2_rn(make_float2(a, b)));
    a = f.x, b = f.y;
  } else if constexpr (std::is_same_v<Delta, BF16>) {
    float2 const f = __bfloat1622float2(__float22bfloat162_rn(make_float2(a, b)));
    a = f.x, b = f.y;
  }
}

// VEC elements moved as one or two aligned words (at most 16 bytes per memory instruction).
template <typename Bits, int VEC> struct alignas(sizeof(Bits) * VEC > 16 ? 16 : sizeof(Bits) * VEC) Pack {
  Bits v[VEC];
};

template <int BYTES> struct Word;
template <> struct Word<16> {
  using type = uint4;
};
template <> struct Word<8> {
  using type = uint2;
};
template <> struct Word<4> {
  using type = unsigned int;
};
template <> struct Word<2> {
  using type = unsigned short;
};
template <> struct Word<1> {
  using type = unsigned char;
};

template <typename P, bool STREAMING = false> __device__ __forceinline__ P load_pack(void const* ptr) {
  constexpr int kBytes = sizeof(P) > 16 ? 16 : int(sizeof(P));
  using W = typename Word<kBytes>::type;
  P pack;
  W const* src = static_cast<W const*>(ptr);
  W* dst = reinterpret_cast<W*>(&pack);
#pragma unroll
  for (int i = 0; i < int(sizeof(P)) / kBytes; ++i) {
    if constexpr (STREAMING)
      dst[i] = __ldcs(src + i);
    else
      dst[i] = src[i];
  }
  return pack;
}

template <typename P> __device__ __forceinline__ void store_pack(void* ptr, P const& pack) {
  constexpr int kBytes = sizeof(P) > 16 ? 16 : int(sizeof(P));
  using W = typename Word<kBytes>::type;
  W* dst = static_cast<W*>(ptr);
  W const* src = reinterpret_cast<W const*>(&pack);
#pragma unroll
  for (int i = 0; i < int(sizeof(P)) / kBytes; ++i) {
#if DFLASH_STREAMING_STORES
    __stcs(dst + i, src[i]);
#else
    dst[i] = src[i];
#endif
  }
}

// The k-norm weight's VEC channels as a kernel holds them: 16-bit channels in pairs, one word
// each, as loaded and as the packed weight product takes them (apply_norm); else one element each.
template <typename Delta, int VEC> inline constexpr bool kWeightWords =
    sizeof(typename Delta::Bits) == 2 && VEC % 2 == 0;
template <typename Delta, int VEC> using WeightPack =
    std::conditional_t<kWeightWords<Delta, VEC>, Pack<uint32_t, (VEC + 1) / 2>,
                       Pack<typename Delta::Bits, VEC>>;

// A weight pack at `ptr`: vector loads where the row is aligned for them, else element loads put
// together into the same words. Held as 16-bit elements instead, the pack made the compiler split
// the vector load's words at once, which waits for the load there, before the kernel's other
// loads issue.
template <typename Delta, int VEC>
__device__ __forceinline__ WeightPack<Delta, VEC> load_weight_pack(typename Delta::Bits const* ptr,
                                                                   bool vectors) {
  using WP = WeightPack<Delta, VEC>;
  if (vectors) return load_pack<WP>(ptr);
  WP pack;
  if constexpr (kWeightWords<Delta, VEC>) {
#pragma unroll
    for (int i = 0; i < VEC / 2; ++i) pack.v[i] = uint32_t(ptr[2 * i]) | uint32_t(ptr[2 * i + 1]) << 16;
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) pack.v[i] = ptr[i];
  }
  return pack;
}

// Launch geometry. A head row of D channels is cut into work items of VEC channels: the first
// R / (2 VEC) items each own a rotate-half pair, the rest one pass-through vector.
struct Geometry {
  uint32_t head_items;   // R / (2 VEC) + (D - R) / VEC
  uint32_t pair_items;   // R / (2 VEC)
  uint32_t item_chunks;  // blocks along one head's items (1 unless a head is very wide)
  uint32_t head_groups;  // blocks along (heads x item chunks) per token chunk
  Divisor31 head_group_divisor;  // of head_groups: a block's token chunk by a multiply and a shift
  Divisor31 item_chunk_divisor;  // of item_chunks
  uint32_t slot_base;    // first slot of this launch (grids are at most 65535 slots tall)
  uint32_t layer_base;   // first layer of this launch (and 65535 layers deep)
  // The fused norms' sum of squares by a butterfly over the head's items (each owning chunks c
  // and c + leaves/2 of 8 channels: SPEC.md's order), else by every thread over the whole row.
  bool norm_butterfly;
  float inv_head_dim;   // 1 / D, exact: the butterfly's heads are a power of two wide
  bool weight_vectors;  // the k-norm weight can be read VEC at a time (aligned)
};

// A launch's constants: the geometry, and the paged contract's own. The paged ones follow the
// geometry in the paged kernels' parameters only: ptxas' allocation of the slot kernels depends on
// their parameter layout (with these constants in it the slot k-norm took more registers and one
// resident block fewer), and this layout is the one measured for the paged kernels.
template <Contract C> struct Launch {
  Geometry g;
};
template <> struct Launch<Contract::kPaged> {
  Geometry g;
  PagedAddressing paged;  // the page-table steps' constants
  int64_t layer_elems;    // pool_layer_elems
  int64_t page_elems;     // pool_page_elems
};

// A rotary chunk's cos/sin: 16 bytes at a time for VEC a multiple of 4, whose launches require a
// 16-byte aligned table (widest_vec, dynamic_group_width; R / 2 a multiple of VEC keeps every row
// and chunk aligned). A runtime choice here instead compiled to both sets of loads, predicated:
// sixteen issue slots a rotated item spent on loads that never ran.
template <int VEC> __device__ __forceinline__ void load_cos_sin(float const* cos, float const* sin,
                                                                float (&c)[VEC], float (&s)[VEC]) {
  if constexpr (VEC % 4 == 0) {
#pragma unroll
    for (int i = 0; i < VEC; i += 4) {
      float4 const c4 = __ldg(reinterpret_cast<float4 const*>(cos + i));
      float4 const s4 = __ldg(reinterpret_cast<float4 const*>(sin + i));
      c[i] = c4.x, c[i + 1] = c4.y, c[i + 2] = c4.z, c[i + 3] = c4.w;
      s[i] = s4.x, s[i + 1] = s4.y, s[i + 2] = s4.z, s[i + 3] = s4.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) c[i] = __ldg(cos + i), s[i] = __ldg(sin + i);
  }
}

// Which fused-norm code a kernel carries: none (the plain kernels), the butterfly (VEC = 8 and a
// head of 8 * 2G channels, see butterfly_fits), or the row form for every other head width; the
// butterfly in two forms, for the k-norm alone (the common draft: no code or registers for a norm
// of V) and for any norm with v_norm. Separate instantiations, so that each carries only its own
// registers and stack (the row form's sum needs an array).
enum NormForm : int { kNoNorm = 0, kButterflyNorm = 1, kRowNorm = 2, kButterflyKeyNorm = 3 };
template <int NORM> inline constexpr bool kIsButterfly = NORM == kButterflyNorm || NORM == kButterflyKeyNorm;

// The bit of a paged kernel in DFLASH_PAGED_VALUES_EARLY, DFLASH_PAGED_STREAMING_LOADS and
// DFLASH_PAGED_INDEX_BRANCH.
template <typename Delta, typename Pool, int NORM> inline constexpr int kPagedKind =
    NORM == kNoNorm               ? (kScaledPool<Pool> ? 2 : 1)
    : !kScaledPool<Pool>          ? 4
    : std::is_same_v<Delta, BF16> ? 16
                                  : 8;

// The inverse RMS of one head by a butterfly: this thread's own chunks (its pair of VEC = 8
// channel vectors, chunks c and c + G of 2G) summed, then an xor butterfly over the G lanes of the
// head, widest offset first; every lane ends with the canonical sum (float addition commutes
// exactly). Every lane of the warp must call it (a constant full mask: a computed one costs a
// convergence check per shuffle, on the critical path at decode sizes). For the common head of
// 128 channels (G = 8) the lane gathers the other seven lanes' sums at once and adds them as the
// butterfly would: the butterfly's value at lane i after the offsets 4, 2, 1 is
// ((a_i + a_i^4) + (a_i^2 + a_i^6)) + ((a_i^1 + a_i^5) + (a_i^3 + a_i^7)), with a_j lane j's sum,
// the same additions of the same operands; seven independent shuffles take one shuffle's latency
// where three dependent ones took three.
template <typename Delta, int VEC>
__device__ __forceinline__ float butterfly_inverse_rms(KVUpdateParams const& p, Geometry const& g,
                                                       typename Delta::Bits const (&bits0)[VEC],
                                                       typename Delta::Bits const (&bits1)[VEC]) {
  float x0[VEC], x1[VEC];
  decode_pack<Delta, VEC>(bits0, x0);
  decode_pack<Delta, VEC>(bits1, x1);
  auto own = [](float const(&x)[VEC]) {
    float s = mul_rn(x[0], x[0]);
#pragma unroll
    for (int i = 1; i < VEC; ++i) {
      // The square of a float16 value is exact in float32 (11-bit significands, exponents within
      // range), so one fused multiply-add rounds the same sum as SPEC.md's product and sum.
      if constexpr (std::is_same_v<Delta, F16>)
        s = __fmaf_rn(x[i], x[i], s);
      else
        s = add_rn(s, mul_rn(x[i], x[i]));
    }
    return s;
  };
  float sum = add_rn(own(x0), own(x1));
  // Other heads: the butterfly's offsets, widest first. Unrolled over all five with a test per
  // offset, the loop compiles to five shuffles whose unneeded results are discarded, on the
  // critical path; so it is a loop.
  if (g.head_items == 8) {
    float lane[8];  // lane[k]: the sum of lane i ^ k
    lane[0] = sum;
#pragma unroll
    for (int k = 1; k < 8; ++k) lane[k] = __shfl_xor_sync(0xffffffffu, sum, k);
#pragma unroll
    for (int offset = 4; offset > 0; offset /= 2) {
#pragma unroll
      for (int k = 0; k < offset; ++k) lane[k] = add_rn(lane[k], lane[k + offset]);
    }
    sum = lane[0];
  } else {
#pragma unroll 1
    for (uint32_t offset = g.head_items / 2; offset > 0; offset /= 2)
      sum = add_rn(sum, __shfl_xor_sync(0xffffffffu, sum, offset));
  }
  return inverse_rms_scaled(sum, g.inv_head_dim, p.norm_eps);
}

// The row form: the whole row read again from memory, summed in the same order.
template <typename Delta>
__device__ __forceinline__ float row_inverse_rms(KVUpdateParams const& p, typename Delta::Bits const* row) {
  float const sum = sum_squares([row](int64_t j) { return Delta::decode(row[j]); }, p.head_dim);
  return inverse_rms(sum, p.head_dim, p.norm_eps);
}

// x[i] <- the normed value of channel `channel + i` (SPEC.md "Fused norms" 4-5).
template <typename Delta, int VEC>
__device__ __forceinline__ void apply_norm(float (&x)[VEC], float inv_rms,
                                           WeightPack<Delta, VEC> const* weight) {
  if constexpr (kWeightWords<Delta, VEC>) {
#pragma unroll
    for (int i = 0; i < VEC; i += 2) {
      float a = mul_rn(x[i], inv_rms), b = mul_rn(x[i + 1], inv_rms);
      if (weight != nullptr) {
        uint32_t const w_pair = weight->v[i / 2];  // channels i and i + 1
        float2 const f =
            std::is_same_v<Delta, F16> ? f16_pair_times(a, b, w_pair) : bf16_pair_times(a, b, w_pair);
        a = f.x, b = f.y;
      } else {
        round_pair<Delta>(a, b);
      }
      x[i] = a, x[i + 1] = b;
    }
  } else {
    float w[VEC];
    if (weight != nullptr) decode_pack<Delta, VEC>(weight->v, w);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      float u = Delta::decode(Delta::encode(mul_rn(x[i], inv_rms)));
      if (weight != nullptr) u = Delta::decode(Delta::encode(mul_rn(u, w[i])));
      x[i] = u;
    }
  }
}

// The k-norm of a float16 key pack into float16 codes (apply_norm's values, not widened): the
// kernels that norm the key before its dependent load returns (kNormEarlyPacked) keep it in the
// registers that held the delta.
template <int VEC> __device__ __forceinline__ void norm_f16_pack(Pack<uint16_t, VEC>& key, float inv_rms,
                                                                 WeightPack<F16, VEC> const& weight) {
  static_assert(kWeightWords<F16, VEC>, "float16 weights are held in pairs");
  float x[VEC];
  decode_pack<F16, VEC>(key.v, x);
  static_assert(alignof(Pack<uint16_t, VEC>) >= 4, "float16 packs of two or more codes are word-aligned");
  uint32_t* const words = reinterpret_cast<uint32_t*>(key.v);
#pragma unroll
  for (int i = 0; i < VEC; i += 2)
    words[i / 2] = f16_pair_times_bits(mul_rn(x[i], inv_rms), mul_rn(x[i + 1], inv_rms), weight.v[i / 2]);
}

// The larger of a and b, NaN when either is NaN (max.NaN; fmaxf would drop it).
__device__ __forceinline__ float max_or_nan(float a, float b) {
  float out;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(out) : "f"(a), "f"(b));
  return out;
}
// The largest magnitude of N values (N a power of two), NaN when any is NaN, as a tree of maxima
// log2 N deep: a max is exact, so any order gives the same bits, and a chain of N dependent maxima
// was a row's longest wait between its loads and its stores at decode sizes.
template <int N> __device__ __forceinline__ float largest_magnitude(float const (&x)[N]) {
  static_assert(N >= 2 && (N & (N - 1)) == 0, "a power of two");
  float m[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) m[i] = max_or_nan(fabsf(x[i]), fabsf(x[i + N / 2]));
#pragma unroll
  for (int w = N / 4; w >= 1; w /= 2)
#pragma unroll
    for (int i = 0; i < w; ++i) m[i] = max_or_nan(m[i], m[i + w]);
  return m[0];
}

// A chunk's stored codes as whole words (both paths below hand over words, so that joining them
// costs no byte shuffles).
template <typename Pool, int N> struct CodeWords {
  static_assert(N % (4 * kPerByte<Pool>) == 0, "whole words of codes");
  uint32_t v[N / 4 / kPerByte<Pool>];
};

// Integer codes (two's complement in each one's low bits) as a chunk's words: the low bytes of
// four codes a word, in order; int4's nibbles byte j element 2j's low, 2j + 1's high (the even
// elements' bytes and the odd ones' shifted by a nibble, joined by one mask).
template <typename Pool, int N>
__device__ __forceinline__ void integer_code_words(uint32_t const (&codes)[N], CodeWords<Pool, N>& out) {
  auto low_bytes = [](uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
    return __byte_perm(__byte_perm(a, b, 0x0040), __byte_perm(c, d, 0x0040), 0x5410);
  };
  if constexpr (kPerByte<Pool> == 2) {
#pragma unroll
    for (int i = 0; i < N; i += 8) {
      uint32_t const evens = low_bytes(codes[i], codes[i + 2], codes[i + 4], codes[i + 6]);
      uint32_t const odds = low_bytes(codes[i + 1], codes[i + 3], codes[i + 5], codes[i + 7]);
      out.v[i / 8] = (evens & 0x0f0f0f0fu) | ((odds << 4) & 0xf0f0f0f0u);
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; i += 4)
      out.v[i / 4] = low_bytes(codes[i], codes[i + 1], codes[i + 2], codes[i + 3]);
  }
}

// Two values that bracket an FP8 code's quotient q = y / s (product_words' comment).
__device__ __forceinline__ void fp8_ends(float y, Divisor const& d, float& lo, float& hi) {
  if constexpr (DFLASH_BRACKETED_CODES) {
    fp8_bracket(y, d, lo, hi);
  } else {
    float const p = mul_rn(y, d.reciprocal);
    lo = mul_rn(p, 1.0f - 0x1p-19f), hi = mul_rn(p, 1.0f + 0x1p-19f);
  }
}

// The stored codes of the quotients y[i] / s of N elements from their products with the
// reciprocal. Returns false where the proof fails for some element; the caller then divides
// (divided_words). BOUNDED: the elements are a dynamic-scale row's own (integer_code).
template <typename Pool, int N, bool BOUNDED>
__device__ __forceinline__ bool product_words(float const (&y)[N], Divisor const& d,
                                              CodeWords<Pool, N>& out) {
  bool divide = false;
  if constexpr (kIsFp8<Pool>) {
    // lo and hi bracket q: with the product's distance, |p - q| < |p| 2^-21 and each bound rounds
    // by at most 2^-24, so p (1 - 2^-19) <= q <= p (1 + 2^-19) as magnitudes (a subnormal p is
    // within 2^-140 of q, and both convert to a zero of the product's sign); with the bracket,
    // fp8_bracket. The conversion is monotonic: where lo's and hi's codes agree, q's is the same.
    // One packed conversion gives both (lo in the low byte); with DFLASH_FP8_END_WORDS, two give
    // four elements' low ends and high ends.
    if constexpr (DFLASH_FP8_END_WORDS) {
      // The four low ends' codes in one word and the four high ends' in another: the low word is
      // the stored one, and the codes agree where the words do.
      uint32_t differ = 0;
#pragma unroll
      for (int i = 0; i < N; i += 4) {
        float lo[4], hi[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) fp8_ends(y[i + k], d, lo[k], hi[k]);
        uint32_t const lows = std::is_same_v<Pool, E4M3> ? float4_to_e4m3x4_raw(lo[0], lo[1], lo[2], lo[3])
                                                         : float4_to_e5m2x4_raw(lo[0], lo[1], lo[2], lo[3]);
        uint32_t const highs = std::is_same_v<Pool, E4M3> ? float4_to_e4m3x4_raw(hi[0], hi[1], hi[2], hi[3])
                                                          : float4_to_e5m2x4_raw(hi[0], hi[1], hi[2], hi[3]);
        differ |= lows ^ highs;
        out.v[i / 4] = lows;
      }
      divide = differ != 0;
    } else {
#pragma unroll
      for (int i = 0; i < N; i += 4) {
        uint32_t pairs[4];  // lo hi of each element
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          float lo, hi;
          fp8_ends(y[i + k], d, lo, hi);
          pairs[k] = std::is_same_v<Pool, E4M3> ? float2_to_e4m3x2_raw(lo, hi) : float2_to_e5m2x2_raw(lo, hi);
        }
        uint32_t const w01 = __byte_perm(pairs[0], pairs[1], 0x5410);  // lo0 hi0 lo1 hi1
        uint32_t const w23 = __byte_perm(pairs[2], pairs[3], 0x5410);
        divide |= (((w01 ^ (w01 >> 8)) | (w23 ^ (w23 >> 8))) & 0x00ff00ffu) != 0;
        out.v[i / 4] = __byte_perm(w01, w23, 0x6420);  // lo0 lo1 lo2 lo3
      }
    }
  } else {
    constexpr int kQMax = kPerByte<Pool> == 2 ? 7 : 127;
    uint32_t codes[N];
    // Each element's bracket ends are at most |y| |above| in magnitude, and rounding is monotonic
    // and symmetric: where the chunk's largest |y| times |above| rounds to QMAX or less, no end of
    // any element rounds past it and a static scale's codes need no clamp either. A NaN element
    // (max.NaN) or an overflowing product fails the test and clamps, as before.
    bool in_range = BOUNDED;
    if constexpr (!BOUNDED && DFLASH_STATIC_RANGE_BY_MAXIMUM && DFLASH_BRACKETED_CODES) {
      in_range = fma_rn(largest_magnitude(y), fabsf(d.above), kIntegerMagic) <= kIntegerMagic + float(kQMax);
    }
    if (in_range) {
#pragma unroll
      for (int i = 0; i < N; ++i) codes[i] = integer_code<kQMax, true>(y[i], d, divide);
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) codes[i] = integer_code<kQMax, false>(y[i], d, divide);
    }
    if constexpr (kPerByte<Pool> == 2 && !DFLASH_INT4_WORDS) {  // each nibble masked, shifted, joined
#pragma unroll
      for (int i = 0; i < N; i += 8) {
        uint32_t w = 0;
#pragma unroll
        for (int k = 0; k < 8; ++k) w |= (codes[i + k] & 0xfu) << (4 * k);
        out.v[i / 8] = w;
      }
    } else {
      integer_code_words(codes, out);
    }
  }
  return !divide;
}

// The same codes for the chunks product_words refuses: each element by its own proof, and the
// elements it refuses (every element where the reciprocal has none) by the division, as numerics.h
// states the stores. A refused chunk usually has one such element: a quotient on a rounding
// boundary, such as y = a / 2 in a dynamic row (127 y / a = 63.5, the scale's rounding deciding
// its side), which no product can place. Not inlined, so that it stays on its own rarely taken
// branch (inlined, the compiler may evaluate it for every chunk and select). DYNAMIC: a scale-pool
// row's quotient (a zero scale stores zeros; its elements' products need no clamp).
template <typename Pool, int N, bool DYNAMIC>
__device__ __noinline__ CodeWords<Pool, N> divided_words(Pack<float, N> y, Divisor d) {
  // An element's code (int4: in the low nibble): its proof's, or where that fails, the quotient's.
  auto code = [&d](float v) -> uint32_t {
    bool divide = !d.by_product;
    uint32_t proven = 0;
    if constexpr (kIsFp8<Pool>) {
      float lo, hi;
      fp8_ends(v, d, lo, hi);
      proven = Pool::encode(lo);
      divide |= proven != Pool::encode(hi);
    } else {  // the integer's two's-complement code in the low bits of its magic sum
      constexpr int kQMax = kPerByte<Pool> == 2 ? 7 : 127;
      proven = integer_code<kQMax, DYNAMIC>(v, d, divide) & (kPerByte<Pool> == 2 ? 0x0fu : 0xffu);
    }
    if (!divide) return proven;
    float const q = DYNAMIC ? dynamic_quotient(v, d.scale) : div_rn(v, d.scale);
    if constexpr (kPerByte<Pool> == 2)
      return float_to_int4_bits(q);
    else
      return Pool::encode(q);
  };
  CodeWords<Pool, N> out;
  uint8_t bytes[N / kPerByte<Pool>];
#pragma unroll
  for (int i = 0; i < N; i += kPerByte<Pool>) {
    if constexpr (kPerByte<Pool> == 2)
      bytes[i / 2] = uint8_t(code(y.v[i]) | (code(y.v[i + 1]) << 4));  // pack_int4's nibbles
    else
      bytes[i] = uint8_t(code(y.v[i]));
  }
  memcpy(out.v, bytes, sizeof(bytes));
  return out;
}

// The stored codes of y / s, as bytes (or, Out, as whole words): by the product where
// product_words proves it exact, else divided (a dynamic row's zero scale: zeros, SPEC.md).
template <typename Pool, int N, bool DYNAMIC, typename Out = Pack<uint8_t, N / kPerByte<Pool>>>
__device__ __forceinline__ Out quotient_bytes(float const (&y)[N], Divisor const& d) {
  CodeWords<Pool, N> words;
  if (!d.by_product || !product_words<Pool, N, DYNAMIC>(y, d, words)) {
    if (DYNAMIC && d.scale == 0.0f) {  // a zero row (or one whose maximum underflows): zeros
      words = CodeWords<Pool, N>{};
    } else {
      Pack<float, N> values;
#pragma unroll
      for (int i = 0; i < N; ++i) values.v[i] = y[i];
      words = divided_words<Pool, N, DYNAMIC>(values, d);
    }
  }
  Out out;
  static_assert(sizeof(out) == sizeof(words), "the words are the pack");
  memcpy(&out, &words, sizeof(out));
  return out;
}

// The stored codes of a dynamic row's elements from their quotients q = RN(y / s), each computed
// exactly (Markstein): with r = RN(1 / s) and q0 = RN(y r), the residual y - s q0 is exact in one
// FMA and RN(q0 + (y - s q0) r) = RN(y / s), where nothing underflows. For s in [2^-80, 2^100]
// and |q| >= 2^-23 nothing does; below that every format's code is a zero of q's sign, which the
// negated residual keeps (y = -0 gives -0). A dynamic row's |q| <= qmax (1 + 2^-23): no clamp.
template <typename Pool, int N>
__device__ __forceinline__ CodeWords<Pool, N> exact_quotient_words(float const (&y)[N], float s, float r) {
  float q[N];
#pragma unroll
  for (int i = 0; i < N; ++i) {
    float const q0 = mul_rn(y[i], r);
    float const negated_residual = fma_rn(q0, s, -y[i]);
    q[i] = fma_rn(-negated_residual, r, q0);
  }
  CodeWords<Pool, N> out;
  if constexpr (kIsFp8<Pool>) {
#pragma unroll
    for (int i = 0; i < N; i += 4)
      out.v[i / 4] = std::is_same_v<Pool, E4M3> ? float4_to_e4m3x4_raw(q[i], q[i + 1], q[i + 2], q[i + 3])
                                                : float4_to_e5m2x4_raw(q[i], q[i + 1], q[i + 2], q[i + 3]);
  } else {
    uint32_t codes[N];
#pragma unroll
    for (int i = 0; i < N; ++i) codes[i] = bits_of(add_rn(q[i], kIntegerMagic));
    integer_code_words(codes, out);
  }
  return out;
}

// `inv_scale` is the scale's reciprocal, or, for a dividing pool (kDividingPool), its Divisor.
template <typename Pool, int VEC, typename Scale>
__device__ __forceinline__ Pack<typename Pool::Bits, VEC> encode_pack(float const (&y)[VEC],
                                                                      Scale const& inv_scale) {
  Pack<typename Pool::Bits, VEC> out;
  if constexpr (kDividingPool<Pool> && VEC % 4 == 0) {
    out = quotient_bytes<Pool, VEC, false>(y, inv_scale);
  } else if constexpr (kIsFp8<Pool> && VEC % 4 == 0 && DFLASH_FP8_HARDWARE) {
    // Four codes per word: two packed conversions, then one NaN mend for the four.
    static_assert(alignof(decltype(out)) >= 4, "FP8 packs of four or more codes are word-aligned");
    uint32_t* const words = reinterpret_cast<uint32_t*>(out.v);
#pragma unroll
    for (int i = 0; i < VEC; i += 4)
      words[i / 4] = Pool::encode4(mul_rn(y[i], inv_scale), mul_rn(y[i + 1], inv_scale),
                                   mul_rn(y[i + 2], inv_scale), mul_rn(y[i + 3], inv_scale));
  } else if constexpr (std::is_same_v<Pool, F16> && VEC % 2 == 0) {
    // Two codes per word: one packed conversion and one NaN mend for the two.
    static_assert(alignof(decltype(out)) >= 4, "float16 packs of two or more codes are word-aligned");
    uint32_t* const words = reinterpret_cast<uint32_t*>(out.v);
#pragma unroll
    for (int i = 0; i < VEC; i += 2) words[i / 2] = Pool::encode2(y[i], y[i + 1]);
  } else if constexpr (kIsFp8<Pool> && VEC % 2 == 0 && DFLASH_FP8_HARDWARE) {
#pragma unroll
    for (int i = 0; i < VEC; i += 2) {
      uint16_t const two = Pool::encode2(mul_rn(y[i], inv_scale), mul_rn(y[i + 1], inv_scale));
      out.v[i] = uint8_t(two), out.v[i + 1] = uint8_t(two >> 8);
    }
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      if constexpr (kDividingPool<Pool>)
        out.v[i] = Pool::encode(div_rn(y[i], inv_scale.scale));
      else if constexpr (kIsFp8<Pool>)
        out.v[i] = Pool::encode(mul_rn(y[i], inv_scale));
      else
        out.v[i] = Pool::encode(y[i]);
    }
  }
  return out;
}

// A pair item's two packs with one scale into a dividing pool (DFLASH_PAIR_QUOTIENTS), as one
// chunk of 2 VEC codes; a lone pack as encode_pack.
template <typename Pool, int VEC>
__device__ __forceinline__ void encode_pair(float const (&y0)[VEC], float const (&y1)[VEC], bool pair,
                                            Divisor const& d, Pack<typename Pool::Bits, VEC>& out0,
                                            Pack<typename Pool::Bits, VEC>& out1) {
  static_assert(kDividingPool<Pool> && VEC % 4 == 0, "whole words of a dividing pool's codes");
  if (!pair) {
    out0 = encode_pack<Pool, VEC>(y0, d);
    return;
  }
  float y[2 * VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) y[i] = y0[i], y[VEC + i] = y1[i];
  auto const both = quotient_bytes<Pool, 2 * VEC, false>(y, d);
  static_assert(sizeof(both) == 2 * sizeof(out0), "the two packs are the chunk");
  memcpy(&out0, &both, sizeof(out0));
  memcpy(&out1, reinterpret_cast<char const*>(&both) + sizeof(out0), sizeof(out1));
}

// NORM: the fused-norm form the kernel carries (NormForm), a template parameter so that the plain
// kernels carry none of its registers and the butterfly none of the row form's stack.
// Long: the kernel is the order of its loads and waits (what is issued before the dependent load,
// what is computed while it is in flight, what after), and that order is read in one body.
template <Contract C, typename Delta, typename Pool, int VEC, int NORM, bool STREAM_LOADS = false>
__global__ void DFLASH_UPDATE_BOUNDS update_kernel(KVUpdateParams p, Launch<C> constants) {
  // Launched with programmatic dependent launch (pdl_enabled), this grid may start before the
  // kernel ahead of it on the stream has finished, and any of its inputs, or the pool, may be that
  // kernel's output: the wait, before every load and store, holds until that grid has completed
  // and its writes are visible. Without the launch attribute it returns at once. Only the
  // parameters (constant memory, written at launch) are read before it.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  // The layout helpers (kv_update.h) test p.contract, which the launch sets to C: told so, the
  // compiler drops the other contract's arithmetic and selects.
  __builtin_assume(p.contract == C);
  Geometry const& g = constants.g;
  using DBits = typename Delta::Bits;
  using PBits = typename Pool::Bits;
  using DPack = Pack<DBits, VEC>;
  constexpr bool kSame = std::is_same_v<Delta, Pool>;
  constexpr bool kSlot = C == Contract::kSlot;
  constexpr bool kPaged = C == Contract::kPaged;
  constexpr bool kMapped = C == Contract::kSlotMapping;  // flat slots: the slot contract's stores
  // The butterfly's shuffles need every lane of the warp (its launch pads the heads so that the
  // warps are whole): its lanes past the last token or head read the last one's data, take part
  // in the shuffles, and leave before storing. Every other kernel's such lanes leave at once.
  constexpr bool kButterfly = kIsButterfly<NORM>;

  uint32_t const b = kSlot ? g.slot_base + blockIdx.y : 0;
  uint32_t const layer = g.layer_base + blockIdx.z;
  // Uniform per block, and head_groups is 1 for every head width up to 128 items; but under a
  // branch on it the compiler predicated the division (a dozen issue slots in every thread).
  uint32_t const token_chunk = quotient(g.head_group_divisor, blockIdx.x);  // grid.x < 2^31
  uint32_t const group = blockIdx.x - token_chunk * g.head_groups;
  uint32_t const tokens = uint32_t(kSlot ? p.delta_len : p.num_tokens);
  uint32_t const lane_token = token_chunk * blockDim.z + threadIdx.z;
  uint32_t const t = kButterfly ? min(lane_token, tokens - 1) : lane_token;

  // The addressing data first: every store waits for it, so its loads leave before anything else.
  int64_t start = 0, length = 0, written = -1, slot = -1;
  int32_t owner = -1, pos = -1;
  if constexpr (kSlot) {
    start = __ldg(p.delta_start_positions + position_index(p, layer, b));
    length = __ldg(p.delta_lengths + position_index(p, layer, b));
  }
  if constexpr (kMapped) {
    if (t < tokens) {
      int64_t const index = position_index(p, layer, t);
      slot = p.slot_mapping_int64 ? int64_t(__ldg(static_cast<long long const*>(p.slot_mapping) + index))
                                  : int64_t(__ldg(static_cast<int32_t const*>(p.slot_mapping) + index));
    }
  }
  if constexpr (kPaged) {
    if (t < tokens) {
      owner = __ldg(p.token_to_sequence + position_index(p, layer, t));
      pos = __ldg(p.delta_positions + position_index(p, layer, t));
    }
  }

  // A head's items over item_chunks blocks (1 but for very wide heads, whose blocks then hold one
  // head a row: blockDim.y = 1), by the divisor's multiply and shift for the same reason.
  uint32_t const chunk_head = quotient(g.item_chunk_divisor, group);
  uint32_t const lane_head = chunk_head * blockDim.y + threadIdx.y;
  uint32_t const head_item = threadIdx.x + (group - chunk_head * g.item_chunks) * blockDim.x;
  bool const in_range =
      lane_token < tokens && lane_head < uint32_t(p.num_kv_heads) && head_item < g.head_items;
  if (!kButterfly && !in_range) return;
  uint32_t const h = kButterfly ? min(lane_head, uint32_t(p.num_kv_heads) - 1) : lane_head;
  bool const pair = head_item < g.pair_items;
  int64_t const half = p.rotary_dim / 2;
  // Channel of this item's (first) vector; a pair's second vector sits at channel + R/2.
  int64_t const channel =
      pair ? int64_t(head_item) * VEC : p.rotary_dim + int64_t(head_item - g.pair_items) * VEC;
  int64_t const head_start = delta_token_offset(p, layer, b, t) + int64_t(h) * p.head_dim;
  int64_t const src = head_start + channel;

  DBits const* k_delta = static_cast<DBits const*>(p.k_delta);
  DBits const* v_delta = static_cast<DBits const*>(p.v_delta);
  // Every load that does not depend on the addressing data is issued before waiting for it: the
  // delta rows are always in bounds. Plain (cached) loads, as at decode the deltas were just
  // written by the projection and are likely still in L2; evict-first in STREAM_LOADS kernels.
  auto load_delta = [](DBits const* ptr) { return load_pack<DPack, STREAM_LOADS>(ptr); };
  DPack k0 = load_delta(k_delta + src);
  DPack const v0 = load_delta(v_delta + src);
  DPack k1, v1;
  if (pair) {
    k1 = load_delta(k_delta + src + half);
    v1 = load_delta(v_delta + src + half);
  }
  // Scales and norm weights do not depend on the addressing data either.
  float k_scale = 1.0f, v_scale = 1.0f;
  if constexpr (kScaledPool<Pool>) {
    k_scale = __ldg(p.k_scale + scale_index(p, layer, h));
    v_scale = __ldg(p.v_scale + scale_index(p, layer, h));
  }
  WeightPack<Delta, VEC> w0, w1;
  bool const k_norm = NORM != kNoNorm && p.k_norm;
  bool const v_norm = NORM != kNoNorm && NORM != kButterflyKeyNorm && p.v_norm;
  // The weight first: read after the butterfly's sums (fewer registers held across them), its
  // latency is on the decode path, and it was no faster elsewhere.
  if (k_norm) {
    DBits const* weight = static_cast<DBits const*>(p.k_norm_weight) + weight_offset(p, layer) + channel;
    // A butterfly kernel's weight is aligned (the launch sends an unaligned one to the row form), so
    // it has the vector load alone: with the element loads beside it under a runtime test, the
    // fused norms were slower at every size.
    bool const vectors = kButterfly || g.weight_vectors;
    w0 = load_weight_pack<Delta, VEC>(weight, vectors);
    if (pair) w1 = load_weight_pack<Delta, VEC>(weight + half, vectors);
  }
  // The slot-mapping form's slot is its only dependent load, so it takes the paged kinds' choice.
  constexpr bool kValuesEarly =
      (kPaged || kMapped) && (DFLASH_PAGED_VALUES_EARLY & kPagedKind<Delta, Pool, NORM>);
  // Paged and mapped rope rows are token-aligned: known before the page ids or the slot arrive.
  float c[VEC], s[VEC];
  if (!kSlot && pair) {
    float const* cos = p.rope_cos_sin + rope_row_offset(p, layer, 0, t) + channel;
    load_cos_sin<VEC>(cos, cos + half, c, s);
  }

  // The dependent load: the slot contract's rope row (at the position), the paged contract's page
  // ids. A butterfly's sums are computed while it is in flight.
  PoolRows rows;
  bool rotate = pair;
  int32_t k_page = -1, v_page = -1;
  uint32_t page_row = 0;
  if constexpr (kSlot) {
    written = written_position(start, length, t, slot_capacity(p));
    rows = slot_rows(p, b, written);
    if (!kButterfly && rows.k_row < 0) return;
    rotate = pair && rows.k_row >= 0 && written < p.rope_seq_len;
    if (rotate) {
      float const* cos = p.rope_cos_sin + rope_row_offset(p, layer, b, written) + channel;
      load_cos_sin<VEC>(cos, cos + half, c, s);
    }
  } else if constexpr (kMapped) {
    // No return here: a token whose slot writes nothing leaves before its stores, so that the
    // values are computed while the slot is in flight (kValuesEarly) and rotate does not wait
    // for it.
    rows = mapped_rows(p, slot);
  } else {
    // The layer's K and V table rows, addressed before the positions arrive, so that only the
    // entry's own steps lie between them and the page-table loads.
    int32_t const* const k_table = p.page_table + int64_t(layer) * constants.paged.table_layer;
    int32_t const* const v_table = k_table + p.table_pages;
    keep_computed(k_table), keep_computed(v_table);
    // The launch's layers are at most 64 deep under per-layer rings (the launcher splits them).
    bool const ring = layer_ring(constants.paged, blockIdx.z);
    auto look_up = [&] {
      int64_t const entry = page_table_entry(constants.paged, ring, owner, pos, &page_row);
      if (entry >= 0) {
        k_page = __ldg(k_table + entry);
        v_page = __ldg(v_table + entry);
      }
    };
    if constexpr (DFLASH_PAGED_INDEX_BRANCH & kPagedKind<Delta, Pool, NORM>) {
      if (constants.paged.table_pages != 0) look_up();  // an empty table has no entries
    } else {
      look_up();
    }
  }
  float k_inv_rms = 1.0f, v_inv_rms = 1.0f;
  if constexpr (kButterfly) {
    if (k_norm) k_inv_rms = butterfly_inverse_rms<Delta, VEC>(p, g, k0.v, k1.v);
    if (v_norm) v_inv_rms = butterfly_inverse_rms<Delta, VEC>(p, g, v0.v, v1.v);
  }
  // The float16 key into a 16/32-bit pool is normed here, while the dependent load is in flight,
  // into its own registers; after it only RoPE and the store remain, as in the plain kernel (faster
  // at decode sizes in both contracts). Into a scaled pool and from bfloat16 deltas, where it
  // measured slower, the norm stays after the load.
  constexpr bool kNormEarlyPacked = kButterfly && std::is_same_v<Delta, F16> && !kScaledPool<Pool>;
  if constexpr (kNormEarlyPacked) {
    if (k_norm) {
      norm_f16_pack<VEC>(k0, k_inv_rms, w0);
      if (pair) norm_f16_pack<VEC>(k1, k_inv_rms, w1);
    }
  }
  using Out = Pack<PBits, VEC>;
  constexpr bool kPairQuotients = DFLASH_PAIR_QUOTIENTS && kDividingPool<Pool> && VEC % 4 == 0;
  auto const store_scale = [](float scale) {
    if constexpr (kDividingPool<Pool>)
      return divisor_of(scale);
    else
      return kScaledPool<Pool> ? div_rn(1.0f, scale) : 1.0f;
  };
  auto const inv_k = store_scale(k_scale), inv_v = store_scale(v_scale);
  // The stored packs of K and of V (the second of each unused unless pair).
  auto key_packs = [&](Out& out0, Out& out1) {
    if (kSame && !k_norm && !rotate) {
      out0 = *reinterpret_cast<Out const*>(&k0);
      if (pair) out1 = *reinterpret_cast<Out const*>(&k1);
      return;
    }
    float x0[VEC], x1[VEC];
    decode_pack<Delta, VEC>(k0.v, x0);
    decode_pack<Delta, VEC>(k1.v, x1);
    if constexpr (NORM != kNoNorm && !kNormEarlyPacked) {
      if (k_norm) {
        if constexpr (NORM == kRowNorm) k_inv_rms = row_inverse_rms<Delta>(p, k_delta + head_start);
        apply_norm<Delta, VEC>(x0, k_inv_rms, &w0);
        if (pair) apply_norm<Delta, VEC>(x1, k_inv_rms, &w1);
      }
    }
    if (rotate) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        float const a = x0[i], b1 = x1[i];
        x0[i] = rope_channel(a, b1, c[i], s[i], /*first_half=*/true);
        x1[i] = rope_channel(b1, a, c[i], s[i], /*first_half=*/false);
      }
    }
    if constexpr (kPairQuotients) {
      encode_pair<Pool, VEC>(x0, x1, pair, inv_k, out0, out1);
      return;
    }
    out0 = encode_pack<Pool, VEC>(x0, inv_k);
    if (pair) out1 = encode_pack<Pool, VEC>(x1, inv_k);
  };
  auto value_packs = [&](Out& out0, Out& out1) {
    if (kSame && !v_norm) {
      out0 = *reinterpret_cast<Out const*>(&v0);
      if (pair) out1 = *reinterpret_cast<Out const*>(&v1);
      return;
    }
    float x0[VEC], x1[VEC];
    decode_pack<Delta, VEC>(v0.v, x0);
    decode_pack<Delta, VEC>(v1.v, x1);
    if constexpr (NORM != kNoNorm) {
      if (v_norm) {
        if constexpr (NORM == kRowNorm) v_inv_rms = row_inverse_rms<Delta>(p, v_delta + head_start);
        apply_norm<Delta, VEC>(x0, v_inv_rms, nullptr);
        if (pair) apply_norm<Delta, VEC>(x1, v_inv_rms, nullptr);
      }
    }
    if constexpr (kPairQuotients) {
      encode_pair<Pool, VEC>(x0, x1, pair, inv_v, out0, out1);
      return;
    }
    out0 = encode_pack<Pool, VEC>(x0, inv_v);
    if (pair) out1 = encode_pack<Pool, VEC>(x1, inv_v);
  };
  PBits *k_dst, *v_dst;
  Out k_out0, k_out1, v_out0, v_out1;
  if constexpr (kPaged) {
    // This item's place in head h of the token's row of page 0 of the layer's pool, so that the
    // page ids, once they arrive, are checked and added as they are (computing paged_rows' 64-bit
    // page * P + row there instead was slower at decode sizes in the fused norms into 16/32-bit
    // pools). With kValuesEarly it and every stored value are computed
    // while the ids are in flight (at decode sizes this is most of the path after they arrive),
    // else the values after them; keeping the place computed in those kernels too held two more
    // registers across the wait and gained nothing.
    if constexpr (kValuesEarly) key_packs(k_out0, k_out1), value_packs(v_out0, v_out1);
    PBits* const head_row = static_cast<PBits*>(p.pool) + int64_t(layer) * constants.layer_elems +
                            int64_t(page_row) * token_stride(p) + int64_t(h) * p.head_dim + channel;
    if constexpr (kValuesEarly) {
      keep_computed(k_out0), keep_computed(v_out0), keep_computed(head_row);
      if (pair) keep_computed(k_out1), keep_computed(v_out1);
    }
    if (!in_range || !page_ids_valid(constants.paged, k_page, v_page)) return;
    // paged_rows' page * P + row, in row strides.
    k_dst = head_row + int64_t(uint32_t(k_page)) * constants.page_elems;
    v_dst = head_row + int64_t(uint32_t(v_page)) * constants.page_elems;
  } else {
    if constexpr (kValuesEarly) {
      key_packs(k_out0, k_out1), value_packs(v_out0, v_out1);
      keep_computed(k_out0), keep_computed(v_out0);
      if (pair) keep_computed(k_out1), keep_computed(v_out1);
    }
    // Lanes with nothing to store leave here (a token not written, a butterfly's padding lanes).
    if (!in_range || rows.k_row < 0) return;
    PBits* const layer_pool = static_cast<PBits*>(p.pool) + int64_t(layer) * pool_layer_elems(p);
    k_dst = layer_pool + rows.k_row * token_stride(p) + int64_t(h) * p.head_dim + channel;
    v_dst = layer_pool + rows.v_row * token_stride(p) + int64_t(h) * p.head_dim + channel;
  }
  if constexpr (!kValuesEarly) key_packs(k_out0, k_out1);
  store_pack(k_dst, k_out0);
  if (pair) store_pack(k_dst + half, k_out1);
  if constexpr (!kValuesEarly) value_packs(v_out0, v_out1);
  store_pack(v_dst, v_out0);
  if (pair) store_pack(v_dst + half, v_out1);
}

inline bool aligned(void const* ptr, int64_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

inline int multiprocessor_count() {
  static int const count = [] {
    int device = 0, sms = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
      sms = 132;
    return sms;
  }();
  return count;
}

// Whether the fused norms can use the butterfly: VEC = 8 = the norm chunk, every channel in a
// rotate-half pair (R = D), D = 8 * 2G with G a power of two <= 32 (so a head's G items are lanes
// of one warp, aligned).
inline bool butterfly_fits(KVUpdateParams const& p, int vec) {
  if (vec != kNormChunk || p.rotary_dim != p.head_dim || p.head_dim % (2 * kNormChunk) != 0) return false;
  int64_t const lanes = p.head_dim / (2 * kNormChunk);
  return lanes >= 1 && lanes <= 32 && (lanes & (lanes - 1)) == 0;
}

template <Contract C> using KernelFn = void (*)(KVUpdateParams, Launch<C>);

// A kernel in its evict-first instantiation where the launch streams its deltas and the kind has
// one (DFLASH_PAGED_STREAMING_LOADS), else in its cached one.
template <Contract C, typename Delta, typename Pool, int VEC, int NORM>
KernelFn<C> with_loads(bool streaming) {
  constexpr bool kHasStreaming = DFLASH_PAGED_STREAMING_LOADS & kPagedKind<Delta, Pool, NORM>;
  if constexpr (C == Contract::kPaged && kHasStreaming) {
    if (streaming) return update_kernel<C, Delta, Pool, VEC, NORM, true>;
  }
  return update_kernel<C, Delta, Pool, VEC, NORM>;
}

// The kernel of a launch: the plain one, the butterfly (which exists for VEC = 8 only, see
// butterfly_fits) or the row form.
template <Contract C, typename Delta, typename Pool, int VEC>
KernelFn<C> pick_kernel(KVUpdateParams const& p, bool butterfly) {
  int64_t const delta_bytes =
      2 * p.num_layers * tokens_per_layer(p) * token_stride(p) * int64_t(sizeof(typename Delta::Bits));
  bool const streaming = delta_bytes >= DFLASH_STREAMING_LOADS_BYTES;  // K and V deltas
  if (!p.k_norm && !p.v_norm) return with_loads<C, Delta, Pool, VEC, kNoNorm>(streaming);
  if constexpr (VEC == kNormChunk) {
    if (butterfly && !p.v_norm) return with_loads<C, Delta, Pool, VEC, kButterflyKeyNorm>(streaming);
    if (butterfly) return with_loads<C, Delta, Pool, VEC, kButterflyNorm>(streaming);
  }
  return with_loads<C, Delta, Pool, VEC, kRowNorm>(streaming);
}

// The launches of an update with VEC-channel items, handed one at a time to
// visit(kernel, grid, block, constants) (the kernel's parameters are p and constants): the one
// place for the kernel's layout, shared by the launch below and the record stage of the JAX FFI
// handlers (plan_widest). Returns visit's first failure, or cudaErrorInvalidConfiguration where
// the kernel's 32-bit index math would overflow.
template <Contract C, typename Delta, typename Pool, int VEC, typename Visit>
cudaError_t for_each_launch(KVUpdateParams const& p, Visit&& visit) {
  bool const norm = p.k_norm || p.v_norm;
  constexpr int64_t kBlockThreads = DFLASH_BLOCK_THREADS;
  constexpr int64_t kMaxGridYZ = 65535;
  int64_t const head_items = p.rotary_dim / (2 * VEC) + (p.head_dim - p.rotary_dim) / VEC;
  Launch<C> constants;
  Geometry& g = constants.g;
  g.head_items = uint32_t(head_items);
  g.pair_items = uint32_t(p.rotary_dim / (2 * VEC));
  g.weight_vectors =
      p.k_norm && aligned(p.k_norm_weight, std::min<int64_t>(16, VEC * sizeof(typename Delta::Bits)));
  // The butterfly kernels read the k-norm weight VEC at a time only: an unaligned weight (a view
  // at an odd offset, through the raw launchers; XLA's and TensorRT's buffers are aligned) takes
  // the row form, which stores the same bits.
  g.norm_butterfly = norm && butterfly_fits(p, VEC) && (!p.k_norm || g.weight_vectors);
  g.inv_head_dim = 1.0f / float(p.head_dim);
  if constexpr (C == Contract::kPaged) {
    constants.paged = paged_addressing(p);
    constants.layer_elems = pool_layer_elems(p);
    constants.page_elems = pool_page_elems(p);
  }
  int64_t const items_x = std::min(head_items, kBlockThreads);
  int64_t const item_chunks = (head_items + items_x - 1) / items_x;
  int64_t heads_y = item_chunks == 1 ? std::min(p.num_kv_heads, kBlockThreads / items_x) : 1;
  if (g.norm_butterfly) {
    // Whole warps for the butterfly's full-mask shuffles: rows of heads padded to a multiple of
    // 32 / items_x (items_x = the head's lanes, a power of two <= 32; still within the block).
    int64_t const quantum = 32 / items_x;
    heads_y = (heads_y + quantum - 1) / quantum * quantum;
  }
  int64_t const head_groups = (p.num_kv_heads + heads_y - 1) / heads_y * item_chunks;
  int64_t const tokens = C == Contract::kSlot ? p.delta_len : p.num_tokens;
  int64_t const sequences = C == Contract::kSlot ? p.batch : 1;
  // Several tokens per block when a token has few items, but small updates (decode) spread over
  // every multiprocessor: there, latency, not bandwidth, sets the time.
  int64_t const max_tokens = std::max<int64_t>(1, kBlockThreads / (items_x * heads_y));
  int64_t const blocks_wanted = 2 * int64_t(multiprocessor_count());
  int64_t const token_blocks = p.num_layers * sequences * tokens * head_groups;
  int64_t const spread = (token_blocks + blocks_wanted - 1) / blocks_wanted;
  constexpr int64_t kMaxBlockZ = 64;  // CUDA's limit on blockDim.z
  int64_t const tokens_z = std::max<int64_t>(1, std::min({max_tokens, spread, tokens, kMaxBlockZ}));
  int64_t const grid_x = (tokens + tokens_z - 1) / tokens_z * head_groups;
  if (grid_x >= (int64_t(1) << 31) || sequences >= (int64_t(1) << 31) || p.num_layers >= (int64_t(1) << 31) ||
      tokens >= (int64_t(1) << 32))
    return cudaErrorInvalidConfiguration;  // 32-bit index math in the kernel
  g.item_chunks = uint32_t(item_chunks);
  g.head_groups = uint32_t(head_groups);
  g.head_group_divisor = divisor31(g.head_groups);
  g.item_chunk_divisor = divisor31(g.item_chunks);
  KernelFn<C> const kernel = pick_kernel<C, Delta, Pool, VEC>(p, g.norm_butterfly);
  dim3 const block{unsigned(items_x), unsigned(heads_y), unsigned(tokens_z)};
  // Slots and layers beyond a grid's 65535 go to further launches; per-layer rings, whose bits a
  // launch carries for 64 layers, to launches of 64 layers.
  int64_t const layers_per_launch =
      C == Contract::kPaged && p.ring_layers != nullptr ? kRingMaskLayers : kMaxGridYZ;
  for (int64_t layer = 0; layer < p.num_layers; layer += layers_per_launch) {
    if constexpr (C == Contract::kPaged) constants.paged.ring_bits = ring_mask(p, layer);
    for (int64_t slot = 0; slot < sequences; slot += kMaxGridYZ) {
      g.slot_base = uint32_t(slot);
      g.layer_base = uint32_t(layer);
      dim3 const grid{unsigned(grid_x), unsigned(std::min(kMaxGridYZ, sequences - slot)),
                      unsigned(std::min(layers_per_launch, p.num_layers - layer))};
      if (cudaError_t const status = visit(kernel, grid, block, constants); status != cudaSuccess)
        return status;
    }
  }
  return cudaSuccess;
}

template <Contract C, typename Delta, typename Pool, int VEC>
cudaError_t launch(KVUpdateParams const& p, cudaStream_t stream) {
  cudaLaunchConfig_t config = {};
  config.stream = stream;
  // Programmatic dependent launch: the launch overlaps the previous kernel's tail; the kernel
  // waits for that kernel's completion before touching memory (update_kernel's first line).
  cudaLaunchAttribute overlap;
  overlap.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  overlap.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &overlap;
  config.numAttrs = pdl_enabled() ? 1 : 0;
  return for_each_launch<C, Delta, Pool, VEC>(
      p, [&](KernelFn<C> kernel, dim3 grid, dim3 block, Launch<C> const& constants) {
        config.gridDim = grid;
        config.blockDim = block;
        cudaError_t const status = cudaLaunchKernelEx(&config, kernel, p, constants);
        if (status != cudaSuccess) (void)cudaGetLastError();  // reported once, by the return value
        return status;
      });
}

// Whether a call from Delta into Pool may take 16-channel items (DFLASH_BYTE_POOL_VEC).
template <typename Delta, typename Pool> inline constexpr bool kByteVec16 =
    DFLASH_BYTE_POOL_VEC == 16 && sizeof(typename Delta::Bits) == 2 && sizeof(typename Pool::Bits) == 1 &&
    kPerByte<Pool> == 1;

// The widest vector (VEC in {16 (kByteVec16), 8, 2, 1} channels, at most DFLASH_MAX_VEC_BYTES of
// delta) that divides the head and the rotary half and that every tensor's alignment allows.
template <typename Delta, typename Pool> int widest_vec(KVUpdateParams const& p) {
  auto fits = [&](int vec) {
    auto bytes = [vec](int64_t elem) { return std::min<int64_t>(16, vec * elem); };
    int64_t const delta = sizeof(typename Delta::Bits), pool = sizeof(typename Pool::Bits);
    return vec * delta <= DFLASH_MAX_VEC_BYTES && p.head_dim % vec == 0 && (p.rotary_dim / 2) % vec == 0 &&
           aligned(p.k_delta, bytes(delta)) && aligned(p.v_delta, bytes(delta)) &&
           aligned(p.pool, bytes(pool)) && (vec % 4 != 0 || p.rotary_dim == 0 || aligned(p.rope_cos_sin, 16));
  };
  if (kByteVec16<Delta, Pool> && fits(16)) return 16;
  if (fits(8)) return 8;
  if (fits(2)) return 2;
  return 1;
}

// The launch of a call without a scale pool, at the widest vector.
template <Contract C, typename Delta, typename Pool>
cudaError_t launch_static(KVUpdateParams const& p, cudaStream_t stream) {
  switch (widest_vec<Delta, Pool>(p)) {
    case 16:
      if constexpr (kByteVec16<Delta, Pool>) return launch<C, Delta, Pool, 16>(p, stream);
      [[fallthrough]];
    case 8: return launch<C, Delta, Pool, 8>(p, stream);
    case 2: return launch<C, Delta, Pool, 2>(p, stream);
    default: return launch<C, Delta, Pool, 1>(p, stream);
  }
}

// The launches launch_static makes for p, appended to *out instead of launched (kv_update_cuda.h's
// plan_target_kv_cache_update); a call with a scale pool (its own kernel) has no plan here.
template <Contract C, typename Delta, typename Pool, int VEC>
cudaError_t plan_vec(KVUpdateParams const& p, std::vector<KernelLaunch>* out) {
  static_assert(sizeof(Launch<C>) <= sizeof(KernelLaunch::constants), "KernelLaunch::constants too small");
  return for_each_launch<C, Delta, Pool, VEC>(
      p, [&](KernelFn<C> kernel, dim3 grid, dim3 block, Launch<C> const& constants) {
        KernelLaunch step;
        step.kernel = reinterpret_cast<void const*>(kernel);
        step.grid = grid;
        step.block = block;
        std::memcpy(step.constants, &constants, sizeof(constants));
        step.constants_size = sizeof(constants);
        out->push_back(step);
        return cudaSuccess;
      });
}
template <Contract C, typename Delta, typename Pool>
cudaError_t plan_widest(KVUpdateParams const& p, std::vector<KernelLaunch>* out) {
  // Dynamic scales (and int4, which has no other kind) take their own kernel, not recorded.
  if (p.scale_pool != nullptr) return cudaErrorNotSupported;
  if constexpr (needs_scale_pool(Pool::kDType)) {
    return cudaErrorNotSupported;
  } else {
    switch (widest_vec<Delta, Pool>(p)) {
      case 16:
        if constexpr (kByteVec16<Delta, Pool>) return plan_vec<C, Delta, Pool, 16>(p, out);
        [[fallthrough]];
      case 8: return plan_vec<C, Delta, Pool, 8>(p, out);
      case 2: return plan_vec<C, Delta, Pool, 2>(p, out);
      default: return plan_vec<C, Delta, Pool, 1>(p, out);
    }
  }
}

// ---- per-token-head dynamic scales (SPEC.md, "Dynamic scales") -----------------------------------
// A row's scale needs its whole row (max_j |y_j|) before any element is stored, so these calls
// take their own kernel: one warp per (token, head), K and V in turn. Each lane holds the
// channels lane, lane + 32, ...; the row's maximum is a warp reduction (a max is exact, so any
// order gives its bits), and the fused norms' sum is numerics.h's sum_squares in SPEC.md's order,
// evaluated by every lane (the same bits in each).

template <typename T> inline constexpr float kMaxFinite = pool_format(T::kDType)->max_finite;
inline constexpr int kDynamicRows = 4;  // warps (rows) per block

// Channel j of one head's float32 value: widened, normed when inv_rms is given (times the k-norm
// weight when given), in the delta dtype's rounding (SPEC.md "Fused norms" 4-5).
template <typename Delta> __device__ __forceinline__ float dynamic_value(typename Delta::Bits const* row,
                                                                         int64_t j, bool norm, float inv_rms,
                                                                         typename Delta::Bits const* weight) {
  float x = Delta::decode(row[j]);
  if (!norm) return x;
  x = round_to(Delta::kDType, mul_rn(x, inv_rms));
  if (weight != nullptr) x = round_to(Delta::kDType, mul_rn(x, Delta::decode(weight[j])));
  return x;
}

// Channel j of the row that would be stored: normed, then rotated (cos_sin null: not rotated).
template <typename Delta>
__device__ __forceinline__ float dynamic_channel(KVUpdateParams const& p, typename Delta::Bits const* row,
                                                 int64_t j, bool norm, float inv_rms,
                                                 typename Delta::Bits const* weight, float const* cos_sin) {
  float const x = dynamic_value<Delta>(row, j, norm, inv_rms, weight);
  int64_t const half = p.rotary_dim / 2;
  if (cos_sin == nullptr || j >= p.rotary_dim) return x;
  bool const first = j < half;
  int64_t const i = first ? j : j - half;
  float const partner = dynamic_value<Delta>(row, first ? j + half : j - half, norm, inv_rms, weight);
  return rope_channel(x, partner, cos_sin[i], cos_sin[half + i], first);
}

// One head row of one plane: its scale at *scale (lane 0), its elements at dst.
template <typename Delta, typename Pool>
__device__ __forceinline__ void dynamic_row(KVUpdateParams const& p, typename Delta::Bits const* row,
                                            bool norm, typename Delta::Bits const* weight,
                                            float const* cos_sin, typename Pool::Bits* dst, float* scale) {
  unsigned const lane = threadIdx.x;
  float inv_rms = 0.0f;
  if (norm)
    inv_rms = inverse_rms(sum_squares([row](int64_t j) { return Delta::decode(row[j]); }, p.head_dim),
                          p.head_dim, p.norm_eps);
  RowMax r;
  for (int64_t j = lane; j < p.head_dim; j += 32)
    r.add(dynamic_channel<Delta>(p, row, j, norm, inv_rms, weight, cos_sin));
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    RowMax other;
    other.max = __shfl_xor_sync(0xffffffffu, r.max, offset);
    other.finite = __shfl_xor_sync(0xffffffffu, int(r.finite), offset) != 0;
    r.merge(other);
  }
  float const s = dynamic_scale(r, kMaxFinite<Pool>);
  if (lane == 0) *scale = s;
  auto quotient = [&](int64_t j) {
    return dynamic_quotient(dynamic_channel<Delta>(p, row, j, norm, inv_rms, weight, cos_sin), s);
  };
  if constexpr (kPerByte<Pool> == 2) {  // int4: byte j holds elements 2j (low nibble) and 2j + 1
    for (int64_t j = lane; j < p.head_dim / 2; j += 32)
      dst[j] = pack_int4(quotient(2 * j), quotient(2 * j + 1));
  } else {
    for (int64_t j = lane; j < p.head_dim; j += 32) dst[j] = Pool::encode(quotient(j));
  }
}

// Where row `item` of a launch comes from and lands, item = ((layer * sequences + b) * tokens + t) *
// H + h over the launch's layers.
struct DynamicItem {
  PoolRows rows;                   // k_row < 0: nothing is written
  float const* cos_sin = nullptr;  // null: not rotated
  int64_t src = 0;                 // element offset of the head's delta row
  int64_t layer = 0;
  int64_t local_layer = 0;  // the layer in the launch
  int64_t b = 0;            // the sequence (slot form)
  int64_t t = 0;            // the token
  int64_t h = 0;            // the head
};

// The divisors of an item's coordinates (dynamic_coordinates), decoded once at the launch.
struct ItemDivisors {
  Divisor31 heads, tokens, sequences;
};
template <Contract C> ItemDivisors item_divisors(KVUpdateParams const& p) {
  ItemDivisors d;
  d.heads = divisor31(cap_at_int32(p.num_kv_heads));
  d.tokens = divisor31(cap_at_int32(C == Contract::kSlot ? p.delta_len : p.num_tokens));
  d.sequences = divisor31(cap_at_int32(C == Contract::kSlot ? p.batch : 1));
  return d;
}
// Items below this take the narrow path: uint32_t arithmetic and the divisors' multiply-shifts
// (Divisor31: numerators below 2^31). 64-bit divisions cost more than the row's loads at decode
// sizes, and their latency delays every load of the row.
inline constexpr int64_t kNarrowItems = int64_t(1) << 31;

// The item's coordinates and source row, arithmetic only (no load): NARROW, uint32_t arithmetic
// with the divisors (item < kNarrowItems), else int64_t divisions.
template <Contract C, bool NARROW>
__device__ __forceinline__ DynamicItem dynamic_coordinates(KVUpdateParams const& p, ItemDivisors const& d,
                                                           int64_t layer_base, int64_t item_) {
  using Index = std::conditional_t<NARROW, uint32_t, int64_t>;
  auto divide = [](Index n, Divisor31 const& v, Index divisor) -> Index {
    if constexpr (NARROW)
      return quotient(v, n);
    else
      return n / divisor;
  };
  Index const item = Index(item_);
  Index const heads = Index(p.num_kv_heads);
  Index const tokens = Index(C == Contract::kSlot ? p.delta_len : p.num_tokens);
  Index const sequences = Index(C == Contract::kSlot ? p.batch : 1);
  Index const token_row = divide(item, d.heads, heads);
  Index const sequence_row = divide(token_row, d.tokens, tokens);
  DynamicItem it;
  it.t = int64_t(token_row - sequence_row * tokens);
  Index const local_layer =
      C == Contract::kSlot ? divide(sequence_row, d.sequences, sequences) : sequence_row;
  it.b = C == Contract::kSlot ? int64_t(sequence_row - local_layer * sequences) : 0;
  it.local_layer = int64_t(local_layer);
  it.h = int64_t(item - token_row * heads);
  it.layer = layer_base + it.local_layer;
  it.src = delta_token_offset(p, it.layer, it.b, it.t) + it.h * p.head_dim;
  return it;
}

// The first words an item's addressing loads, which the rest of it waits on: the slot form's
// start and length, the paged form's owner and position, the mapped form's slot.
struct AddressWords {
  int64_t slot = 0;    // the mapped form's slot (64-bit where the mapping is)
  int32_t first = 0;   // start or owner
  int32_t second = 0;  // length or position
};
// An address word loaded here, in program order (DFLASH_WORDS_AT_ONCE: an asm volatile, which the
// compiler neither moves into a branch nor drops); the wait for it is at its value's first use.
__device__ __forceinline__ int32_t word_now(int32_t const* ptr) {
  if constexpr (DFLASH_WORDS_AT_ONCE) {
    int32_t word;
    asm volatile("ld.global.nc.s32 %0, [%1];" : "=r"(word) : "l"(ptr));
    return word;
  } else {
    return *ptr;
  }
}
template <Contract C>
__device__ __forceinline__ AddressWords address_words(KVUpdateParams const& p, DynamicItem const& it) {
  AddressWords w;
  if constexpr (C == Contract::kSlot) {
    w.first = word_now(p.delta_start_positions + position_index(p, it.layer, it.b));
    w.second = word_now(p.delta_lengths + position_index(p, it.layer, it.b));
  } else if constexpr (C == Contract::kPaged) {
    w.first = word_now(p.token_to_sequence + position_index(p, it.layer, it.t));
    w.second = word_now(p.delta_positions + position_index(p, it.layer, it.t));
  } else {
    w.slot = mapped_slot(p, position_index(p, it.layer, it.t));
  }
  return w;
}

// The slot form's factors as uint32_t (narrow_addressing(p); capacity 0: not narrow), decoded
// once at the launch, for slot_rows_in and slot_rope_row_in.
struct NarrowSlotFactors {
  uint32_t capacity_ = 0, plane_rows_ = 0, rope_batch_ = 0, rope_seq_len_ = 0, rotary_dim_ = 0;
  bool rope_per_layer_ = false;
  __device__ uint32_t capacity() const { return capacity_; }
  __device__ uint32_t plane_rows() const { return plane_rows_; }
  __device__ bool rope_per_layer() const { return rope_per_layer_; }
  __device__ uint32_t rope_batch() const { return rope_batch_; }
  __device__ uint32_t rope_seq_len() const { return rope_seq_len_; }
  __device__ uint32_t rotary_dim() const { return rotary_dim_; }
};
inline NarrowSlotFactors narrow_slot_factors(KVUpdateParams const& p) {
  NarrowSlotFactors n;
  if (p.contract != Contract::kSlot || !narrow_addressing(p)) return n;
  n.capacity_ = uint32_t(slot_capacity(p));
  n.plane_rows_ = uint32_t(p.num_pages * p.page_size);
  n.rope_batch_ = uint32_t(p.rope_batch);
  n.rope_seq_len_ = uint32_t(p.rope_seq_len);
  n.rotary_dim_ = uint32_t(p.rotary_dim);
  n.rope_per_layer_ = p.rope_per_layer;
  return n;
}

// Where the item's rows land (it.rows) and its rope row (it.cos_sin), from its address words.
// With `narrow` (where narrow_slot_factors gave a capacity) the slot form's row and rope-row
// products are uint32_t; the position's tests stay 64-bit.
template <Contract C>
__device__ __forceinline__ void dynamic_address(KVUpdateParams const& p, PagedAddressing const& paged,
                                                DynamicItem& it, AddressWords const& w,
                                                NarrowSlotFactors const* narrow = nullptr) {
  if constexpr (C == Contract::kSlot) {
    int64_t const pos = written_position(w.first, w.second, it.t, slot_capacity(p));
    bool const rotated = pos >= 0 && pos < p.rope_seq_len && p.rotary_dim > 0;
    if (narrow != nullptr) {
      it.rows = slot_rows_in(*narrow, uint32_t(it.b), pos);
      if (rotated)
        it.cos_sin =
            p.rope_cos_sin + slot_rope_row_in(*narrow, uint32_t(it.layer), uint32_t(it.b), uint32_t(pos));
    } else {
      it.rows = slot_rows(p, it.b, pos);
      if (rotated) it.cos_sin = p.rope_cos_sin + rope_row_offset(p, it.layer, it.b, pos);
    }
  } else {
    if constexpr (C == Contract::kPaged) {
      uint32_t row;
      int64_t const entry =
          page_table_entry(paged, layer_ring(paged, uint32_t(it.local_layer)), w.first, w.second, &row);
      if (entry >= 0) {
        int32_t const* table = p.page_table + it.layer * paged.table_layer;
        it.rows = paged_rows(paged, table[entry], table[entry + p.table_pages], row);
      }
    } else {
      it.rows = mapped_rows(p, w.slot);
    }
    if (p.rotary_dim > 0) it.cos_sin = p.rope_cos_sin + rope_row_offset(p, it.layer, 0, it.t);
  }
}
// The same with the item's own address words, loaded here.
template <Contract C> __device__ __forceinline__ void dynamic_address(KVUpdateParams const& p,
                                                                      PagedAddressing const& paged,
                                                                      DynamicItem& it) {
  dynamic_address<C>(p, paged, it, address_words<C>(p, it));
}

// Element offset in the pool of item's head row in plane 0 (K) or 1 (V); a packed pool's head rows
// start on whole bytes (D is even).
__device__ __forceinline__ int64_t dynamic_dst(KVUpdateParams const& p, DynamicItem const& it, int64_t row,
                                               int64_t h) {
  return it.layer * pool_layer_elems(p) + row * token_stride(p) + h * p.head_dim;
}

// Any head: one warp per row, lanes strided over the channels (dynamic_row).
template <Contract C, typename Delta, typename Pool> __global__ void __launch_bounds__(32 * kDynamicRows)
    dynamic_scale_kernel(KVUpdateParams p, PagedAddressing paged, int64_t layer_base, int64_t items) {
  using DBits = typename Delta::Bits;
  int64_t const stride = int64_t(gridDim.x) * kDynamicRows;
  for (int64_t item = int64_t(blockIdx.x) * kDynamicRows + threadIdx.y; item < items; item += stride) {
    DynamicItem it = dynamic_coordinates<C, false>(p, ItemDivisors{}, layer_base, item);
    dynamic_address<C>(p, paged, it);
    if (it.rows.k_row < 0) continue;
    int64_t const h = it.h;
    int64_t const k_dst = dynamic_dst(p, it, it.rows.k_row, h);
    int64_t const v_dst = dynamic_dst(p, it, it.rows.v_row, h);
    auto* const pool = static_cast<typename Pool::Bits*>(p.pool);
    DBits const* weight =
        p.k_norm ? static_cast<DBits const*>(p.k_norm_weight) + weight_offset(p, it.layer) : nullptr;
    dynamic_row<Delta, Pool>(p, static_cast<DBits const*>(p.k_delta) + it.src, p.k_norm, weight, it.cos_sin,
                             pool + k_dst / kPerByte<Pool>,
                             p.scale_pool + scale_pool_index(p, it.layer, it.rows.k_row, h));
    dynamic_row<Delta, Pool>(p, static_cast<DBits const*>(p.v_delta) + it.src, p.v_norm, nullptr, nullptr,
                             pool + v_dst / kPerByte<Pool>,
                             p.scale_pool + scale_pool_index(p, it.layer, it.rows.v_row, h));
  }
}

// The common heads (D a multiple of 8, at most 32 chunks of 8; the rotary half a multiple of 8; the
// tensors aligned for vector access): a group of G lanes per row, lane c holding the CHUNKS chunks
// c + kG (channels [8(c + kG), 8(c + kG) + 8)), which are the norm's chunks (numerics.h,
// kNormChunk). Every value is loaded once and held in registers: the norm's chunk sums are the
// lanes' own; of its halving tree, the levels that add chunk c + wG to chunk c (w = CHUNKS / 2,
// ..., 1: the tree has CHUNKS * G leaves) are the lane's own additions, the rest a shuffle down the
// group (a G wider than the tree's leaves only adds zeros first, which changes no bits). The
// rotary partner of a chunk is the chunk half / 8 away: with several chunks a lane the kernel is
// taken only where that is the lane's chunk k + CHUNKS / 2 (R = D = 8 CHUNKS G, or no rotation),
// so the rotation needs no shuffle; with CHUNKS = 1 it is half / 8 lanes away. The row maximum is a
// butterfly; each lane stores each chunk's 8 (int4: 4 bytes of) quotients (quotient_bytes) with
// one vector store. Every lane runs every shuffle (rows not written, lanes past D included): only
// loads and stores are guarded. Each lane's share of a row's work (its coordinates, addresses and
// scale) is the same for any CHUNKS, so more chunks a lane spread it over more channels.
//
// The grid is resident (launch_group), each warp looping over row groups. A row cannot store
// until its whole row's maximum is known; rather than hold its deltas in registers across that
// chain, each thread copies its chunks of the rows kGroupStages - 1 groups ahead into shared
// memory (cp.async: nothing held in registers while they are in flight) and reads the current
// group's back once they have landed; every thread reads only what it copied itself, so no
// barrier is needed. The copies of later rows are issued before this row's stores: the deltas and
// the pool are distinct tensors (a scale pool's codes are 8-bit, the deltas 16- or 32-bit floats),
// so the order changes no bits. On the H200 this kernel is bound by issued instructions more than
// by bytes in flight (BENCHMARKS.md): hence the wide kernel's several chunks a lane.
inline constexpr int kGroupThreads = 128;
inline constexpr int kGroupChunk = 8;
// The wide kernel, for the heads of 72 to 128 channels (a norm tree of 16 leaves): CHUNKS chunks a
// lane, 4 for 16-bit deltas, 2 for float32 ones (whose 4 would need more shared memory a block than
// a static allocation has); with DFLASH_WIDE_BY_ROWS, calls of fewer rows than a pass of the
// four-chunk kernel's resident blocks take 2 (launch_wide).
template <typename Delta> inline constexpr int kWideChunks = sizeof(typename Delta::Bits) == 4 ? 2 : 4;
template <typename Delta> inline constexpr int kWideGroup = 16 / kWideChunks<Delta>;
static_assert(kGroupChunk == kNormChunk, "a lane's channels are one chunk of the norm's sum");
// Row groups in shared memory per warp (the current one and those being copied): at most 32 KB a
// block, so that the registers, not the shared memory, bound the resident blocks.
template <typename Delta, int CHUNKS> inline constexpr int kGroupStageBytes =
    int(sizeof(typename Delta::Bits)) * CHUNKS * 2 * kGroupChunk * kGroupThreads;
template <typename Delta, int CHUNKS> inline constexpr int kGroupStages =
    kGroupStageBytes<Delta, CHUNKS> * 3 <= 32 * 1024 ? 3 : 2;

// 16 bytes from global memory into shared memory, asynchronously; read = false fills them with
// zeros instead (src is not read).
__device__ __forceinline__ void copy_async_16(void* dst, void const* src, bool read) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  unsigned const shared = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(shared), "l"(src), "r"(read ? 16 : 0)
               : "memory");
#else
  *static_cast<uint4*>(dst) = read ? *static_cast<uint4 const*>(src) : make_uint4(0, 0, 0, 0);
#endif
}
// The copies issued since the last commit, as one group.
__device__ __forceinline__ void commit_copies() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
// Waits until at most PENDING groups of this thread's copies are in flight; what the others
// copied is then in shared memory, visible to this thread.
template <int PENDING> __device__ __forceinline__ void wait_copies() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
#endif
}

// The larger magnitude of m and x, NaN when either is NaN.
__device__ __forceinline__ float max_magnitude(float m, float x) { return max_or_nan(m, fabsf(x)); }

// 16-bit deltas: the larger magnitudes of two words' halves, lane by lane (max.NaN: NaN when
// either is NaN), one instruction with its operands' absolute values.
template <typename Delta> inline constexpr bool kPairMaxima =
    std::is_same_v<Delta, F16> || std::is_same_v<Delta, BF16>;
template <typename Delta> __device__ __forceinline__ uint32_t pair_magnitudes(uint32_t a, uint32_t b) {
  uint32_t out;
  if constexpr (std::is_same_v<Delta, F16>)
    asm("{ .reg .b32 x, y; abs.f16x2 x, %1; abs.f16x2 y, %2; max.NaN.f16x2 %0, x, y; }"
        : "=r"(out)
        : "r"(a), "r"(b));
  else
    asm("{ .reg .b32 x, y; abs.bf16x2 x, %1; abs.bf16x2 y, %2; max.NaN.bf16x2 %0, x, y; }"
        : "=r"(out)
        : "r"(a), "r"(b));
  return out;
}
// The largest magnitude of N words of 16-bit deltas (N a power of two), decoded: the same float as
// the maximum of the decoded elements' magnitudes (the decoding is exact and monotonic, a NaN
// stays a NaN), in half as many maxima.
template <typename Delta, int WIDTH, int N>
__device__ __forceinline__ void fold_pair_magnitudes(uint32_t (&w)[N]) {
#pragma unroll
  for (int i = 0; i < WIDTH / 2; ++i) w[i] = pair_magnitudes<Delta>(w[i], w[i + WIDTH / 2]);
  if constexpr (WIDTH > 2) fold_pair_magnitudes<Delta, WIDTH / 2>(w);
}
template <typename Delta, int N> __device__ __forceinline__ float largest_pair_magnitude(uint32_t (&w)[N]) {
  static_assert(N >= 2 && (N & (N - 1)) == 0, "a power of two");
  fold_pair_magnitudes<Delta, N>(w);
  return Delta::decode(typename Delta::Bits(pair_magnitudes<Delta>(w[0], w[0] >> 16)));
}

// The fused norm's inverse RMS of a row group's plane (SPEC.md "Fused norms"): the row's sum of
// squares by the halving tree. Chunks past D hold zeros.
template <int G, int CHUNKS>
__device__ __forceinline__ float group_inverse_rms(float const (&x)[CHUNKS][kGroupChunk],
                                                   bool const (&has)[CHUNKS], float eps, int64_t head_dim) {
  float s[CHUNKS];
#pragma unroll
  for (int k = 0; k < CHUNKS; ++k) {
    s[k] = 0.0f;
    if (has[k]) {
      s[k] = mul_rn(x[k][0], x[k][0]);
#pragma unroll
      for (int i = 1; i < kGroupChunk; ++i) s[k] = add_rn(s[k], mul_rn(x[k][i], x[k][i]));
    }
  }
#pragma unroll
  for (int w = CHUNKS / 2; w >= 1; w /= 2)  // the tree's levels h = wG: the lane's own chunks
#pragma unroll
    for (int k = 0; k < w; ++k) s[k] = add_rn(s[k], s[k + w]);
  float sum = s[0];
#pragma unroll
  for (int h = G / 2; h >= 1; h /= 2) sum = add_rn(sum, __shfl_down_sync(0xffffffffu, sum, h, G));
  return inverse_rms(__shfl_sync(0xffffffffu, sum, 0, G), head_dim, eps);
}

// The fused norm of a row group's plane, through apply_norm as the other kernels norm (two channels
// a packed conversion, the k-norm weight as a packed product of two), and with `weighted` the
// weight's product too. Chunks past D (zeros, zero weights) change neither the sum nor the row's
// maximum.
template <typename Delta, int G, int CHUNKS>
__device__ __forceinline__ void group_norm(float (&x)[CHUNKS][kGroupChunk], bool const (&has)[CHUNKS],
                                           WeightPack<Delta, kGroupChunk> const (&weight)[CHUNKS],
                                           bool weighted, float eps, int64_t head_dim) {
  float const inv_rms = group_inverse_rms<G, CHUNKS>(x, has, eps, head_dim);
#pragma unroll
  for (int k = 0; k < CHUNKS; ++k) {
    // Two calls, not one with a selected pointer: a pointer into the weight array that may be
    // null puts the array on the stack.
    if (weighted)
      apply_norm<Delta, kGroupChunk>(x[k], inv_rms, &weight[k]);
    else
      apply_norm<Delta, kGroupChunk>(x[k], inv_rms, nullptr);
  }
}

// NORMS: whether the kernel carries the fused norms' code (false: a call with neither norm; the
// norm weight's registers cost the plain calls occupancy).
template <Contract C, typename Delta, typename Pool, int G, int CHUNKS, bool NORMS>
__global__ void DFLASH_GROUP_BOUNDS dynamic_group_kernel(KVUpdateParams p, PagedAddressing paged,
                                                         ItemDivisors divisors, int64_t layer_base,
                                                         int64_t items, uint32_t layer_rows,
                                                         NarrowSlotFactors narrow_factors) {
  static_assert(CHUNKS == 1 || CHUNKS == 2 || CHUNKS == 4, "whole halves of rotary partners a lane");
  __builtin_assume(p.contract == C);  // as in update_kernel
  using DBits = typename Delta::Bits;
  using DeltaPack = Pack<DBits, kGroupChunk>;
  constexpr int kRowsPerWarp = 32 / G;
  constexpr int kStages = kGroupStages<Delta, CHUNKS>;
  constexpr int kWords = int(sizeof(DeltaPack)) / 16;  // 16-byte copies a chunk
  constexpr int kWordElems = 16 / int(sizeof(DBits));
  static_assert(sizeof(DeltaPack) % 16 == 0, "a chunk is whole 16-byte copies");
  static_assert(kGroupStageBytes<Delta, CHUNKS> * kStages <= 48 * 1024, "a static shared allocation");
  // [stage][plane * CHUNKS + chunk][word][thread]: a warp's 16-byte accesses are consecutive.
  __shared__ uint4 staged[kStages][2 * CHUNKS][kWords][kGroupThreads];
  constexpr unsigned kAll = 0xffffffffu;
  unsigned const lane = threadIdx.x % 32;
  int const chunk = int(lane % G);
  int64_t const warp = (int64_t(blockIdx.x) * kGroupThreads + threadIdx.x) / 32;
  int64_t const warps = int64_t(gridDim.x) * (kGroupThreads / 32);
  int64_t const step = warps * kRowsPerWarp;  // rows between a warp's groups
  int channel[CHUNKS];  // D <= 256 here (dynamic_group_width)
  bool has[CHUNKS];
#pragma unroll
  for (int k = 0; k < CHUNKS; ++k) {
    channel[k] = (chunk + k * G) * kGroupChunk;
    has[k] = channel[k] < int(p.head_dim);
  }
  bool const narrow = items + kStages * step <= kNarrowItems;
  auto coordinates = [&](int64_t item) {
    return narrow ? dynamic_coordinates<C, true>(p, divisors, layer_base, item)
                  : dynamic_coordinates<C, false>(p, divisors, layer_base, item);
  };
  DBits const* const deltas[2] = {static_cast<DBits const*>(p.k_delta), static_cast<DBits const*>(p.v_delta)};
  // The launch's first head row in the deltas: [layers, tokens of a layer, H, D], items in order.
  int64_t const first_row = layer_base * tokens_per_layer(p) * p.num_kv_heads;
  // The byte offsets in a head row of the lane's copies: a chunk past D reads nothing and takes
  // its row's start, an address inside the deltas. Loop-invariant.
  uint32_t read_bytes[CHUNKS][kWords];
#pragma unroll
  for (int k = 0; k < CHUNKS; ++k)
#pragma unroll
    for (int w = 0; w < kWords; ++w)
      read_bytes[k][w] = has[k] ? (channel[k] + w * kWordElems) * sizeof(DBits) : 0;
  // The lane's chunks of the group at `base` into stage `slot`, as one group of copies (zeros for
  // rows past the last and channels past D). The group's coordinates are computed again when it
  // is stored: held instead, they would take registers for kGroupStages - 1 more groups, and the
  // kernel's occupancy is bound by its registers. (With DFLASH_LEAN_OFFSETS the copies need none.)
  // With DFLASH_COPY_IMMEDIATES, heads of exactly CHUNKS * G chunks take their copies' offsets as
  // constants from the lane's first chunk.
  bool const whole_rows = p.head_dim == CHUNKS * G * kGroupChunk;
  int const first_chunk_bytes = channel[0] * int(sizeof(DBits));
  auto stage_group = [&](int64_t base, int slot) {
    int64_t const item = base + lane / G;
    bool const live = item < items;
    // With DFLASH_LEAN_OFFSETS the deltas' head rows are the items, in order. A row past the last
    // reads nothing and takes the launch's first row (the deltas' first, without the lean offsets),
    // so that every copy's address is inside the deltas.
    int64_t src = 0;
    if constexpr (DFLASH_LEAN_OFFSETS)
      src = (first_row + (live ? item : 0)) * p.head_dim;
    else
      src = live ? coordinates(item).src : 0;
    if constexpr (DFLASH_COPY_IMMEDIATES) {
      if (whole_rows) {  // every chunk inside D: each copy at a constant distance from the first
#pragma unroll
        for (int plane = 0; plane < 2; ++plane) {
          char const* row = reinterpret_cast<char const*>(deltas[plane] + src) + first_chunk_bytes;
#pragma unroll
          for (int k = 0; k < CHUNKS; ++k)
#pragma unroll
            for (int w = 0; w < kWords; ++w)
              copy_async_16(&staged[slot][plane * CHUNKS + k][w][threadIdx.x],
                            row + (k * G * kGroupChunk + w * kWordElems) * int(sizeof(DBits)), live);
        }
        commit_copies();
        return;
      }
    }
#pragma unroll
    for (int plane = 0; plane < 2; ++plane) {
      char const* row = reinterpret_cast<char const*>(deltas[plane] + src);
      // Opaque to the compiler, which would otherwise fold each copy's offset into a 64-bit product
      // of its own with D (three instructions more a copy than one 64-bit addition).
      asm("" : "+l"(row));
#pragma unroll
      for (int k = 0; k < CHUNKS; ++k)
#pragma unroll
        for (int w = 0; w < kWords; ++w)
          copy_async_16(&staged[slot][plane * CHUNKS + k][w][threadIdx.x], row + read_bytes[k][w],
                        live && has[k]);
    }
    commit_copies();
  };
  int const half = int(p.rotary_dim / 2);
  // The lane's (first) chunk: in the first rotary half, the second, or past R (several chunks a
  // lane: the first).
  bool const first = channel[0] < half;
  bool const rotary = channel[0] < 2 * half;
  int const partner_lane = first ? chunk + half / kGroupChunk : rotary ? chunk - half / kGroupChunk : chunk;
  // The rotary chunks whose cos/sin the lane reads: its first-half ones (CHUNKS / 2 of them), or
  // with one chunk a lane that chunk, of either half.
  constexpr int kRopeChunks = CHUNKS == 1 ? 1 : CHUNKS / 2;
  // DFLASH_ROPE_AT_USE: a lane of several chunks loads each rotary chunk's cos/sin just before
  // its rotation, not before the copies' wait (16 registers fewer held, the loads' latency less
  // hidden).
  constexpr bool kRopeAtUse = DFLASH_ROPE_AT_USE && CHUNKS > 1;
  auto* const pool = static_cast<typename Pool::Bits*>(p.pool);
  int64_t base = warp * kRowsPerWarp;
#pragma unroll
  for (int s = 0; s + 1 < kStages; ++s) stage_group(base + s * step, s);
  // With kAddressAhead, the address words of the lane's row of the current group, loaded while the
  // warp stored the group before it (the first group's, here); else each group loads its own.
  constexpr bool kAddressAhead = (DFLASH_ADDRESS_AHEAD & CHUNKS) != 0;
  // With kRopeAhead, the words are two groups ahead, and a group's row (its coordinates and
  // address) and its rope row are taken once the group before it has been stored (the first
  // group's, here), so that the rope row's latency runs under the next copies and their wait.
  constexpr bool kRopeAhead = kAddressAhead && DFLASH_ROPE_AHEAD && !kRopeAtUse;
  constexpr bool kRopeAfterKeys = kRopeAhead && DFLASH_ROPE_AFTER_KEYS && CHUNKS > 1;
  // With kSharedRows (DFLASH_SHARED_ROWS), the warp's groups in batches of G (32 rows, a row a
  // lane): lane l holds the row at l % kRowsPerWarp of the batch's group l / kRowsPerWarp.
  // Not with bfloat16 deltas and the fused norms: there the held rows take the kernel from 156-160
  // registers to 166-194, from 3 resident blocks to 2 in the slot and paged forms (float16 deltas
  // stay at 3); DFLASH_SHARED_ROWS 2 takes them too, to time that trade.
  constexpr bool kSharedRows = DFLASH_SHARED_ROWS && kRopeAhead && !kRopeAfterKeys && DFLASH_LEAN_OFFSETS &&
                               !(NORMS && std::is_same_v<Delta, BF16> && DFLASH_SHARED_ROWS < 2);
  AddressWords words;
  if constexpr (kAddressAhead && !kSharedRows) {
    if (base + lane / G < items) words = address_words<C>(p, coordinates(base + lane / G));
  }
  DynamicItem it;  // the lane's row of the current group
  bool rotate = false;
  float c[kRopeChunks][kGroupChunk], sn[kRopeChunks][kGroupChunk];
  // The cos/sin of the lane's rotary chunks from the row's rope row (it.cos_sin). With several
  // chunks a lane R is 2 kHalf (dynamic_group_width) and the lane's chunks are all in the first
  // half, so each load is at a constant distance from the lane's first chunk: one address for all.
  auto load_rope = [&]() {
    if constexpr (CHUNKS > 1) {
      constexpr int kHalf = CHUNKS * G * kGroupChunk / 2;
      float const* const row = it.cos_sin + channel[0];
#pragma unroll
      for (int k = 0; k < kRopeChunks; ++k)
        load_cos_sin<kGroupChunk>(row + k * G * kGroupChunk, row + kHalf + k * G * kGroupChunk, c[k], sn[k]);
    } else {
      int const index = first ? channel[0] : channel[0] - half;
      load_cos_sin<kGroupChunk>(it.cos_sin + index, it.cos_sin + half + index, c[0], sn[0]);
    }
  };
  // Row `item`'s coordinates and address into `row` (row_words: its address words), empty past
  // the last. take_row keeps its own copy of these lines: written through this one, the compiler
  // schedules two default four-chunk instantiations differently (8 instructions more each), and
  // the default ones are the binaries the benchmarks timed.
  auto address_row = [&](DynamicItem& row, int64_t item, AddressWords row_words) {
    // Words loaded a group before: opaque here, so that the compiler widens them where they are
    // used, not right after their loads (where the warp would wait for them).
    asm volatile("" : "+r"(row_words.first), "+r"(row_words.second));
    row = DynamicItem{};
    if (item < items) {
      row = coordinates(item);
      if (C == Contract::kSlot && narrow_factors.capacity() != 0)
        dynamic_address<C>(p, paged, row, row_words, &narrow_factors);
      else
        dynamic_address<C>(p, paged, row, row_words);
    }
  };
  // layer_rows: narrow_layer_rows(p), 0 where an entry may pass 2^31.
  auto scale_entry = [&](int64_t layer, int64_t row, int64_t h) -> int64_t {
    return layer_rows != 0
               ? int64_t(narrow_scale_pool_index(p, layer_rows, uint32_t(layer), uint32_t(row), uint32_t(h)))
               : scale_pool_index(p, layer, row, h);
  };
  // The lane's row `item` (row_words: its address words), and its rope row where it is rotated.
  auto take_row = [&](int64_t item, AddressWords row_words) {
    // Words loaded a group before: opaque here, so that the compiler widens them where they are
    // used, not right after their loads (where the warp would wait for them).
    asm volatile("" : "+r"(row_words.first), "+r"(row_words.second));
    bool const live = item < items;
    it = DynamicItem{};
    if (live) {
      it = coordinates(item);
      if (C == Contract::kSlot && narrow_factors.capacity() != 0)
        dynamic_address<C>(p, paged, it, row_words, &narrow_factors);
      else
        dynamic_address<C>(p, paged, it, row_words);
    }
    rotate = live && has[0] && rotary && it.cos_sin != nullptr;
    if (rotate) load_rope();
  };
  // kSharedRows: the row this lane holds for its batch (`batch_item`; entries -1 where nothing is
  // written, rope -1 where it is not rotated), the current group's place in its batch, and the
  // current group's entries of the lane's row, shuffled from the lane holding it (`holder`).
  struct HeldRow {
    int64_t k_entry = -1, v_entry = -1, rope = -1;
    int32_t layer = 0;
  };
  HeldRow held;
  int64_t batch_item = 0;
  if constexpr (kSharedRows) batch_item = base + int64_t(lane / kRowsPerWarp) * step + lane % kRowsPerWarp;
  int batch_group = 0;
  auto hold_row = [&](AddressWords row_words) {
    DynamicItem row;
    address_row(row, batch_item, row_words);
    held = HeldRow{};
    if (batch_item < items) {
      if (row.rows.k_row >= 0) {
        held.k_entry = scale_entry(row.layer, row.rows.k_row, row.h);
        held.v_entry = scale_entry(row.layer, row.rows.v_row, row.h);
      }
      if (row.cos_sin != nullptr) held.rope = row.cos_sin - p.rope_cos_sin;
      held.layer = int32_t(row.layer);
    }
  };
  auto holder = [&]() { return batch_group * kRowsPerWarp + int(lane / G); };
  auto shuffled_entry = [&](int64_t entry) -> int64_t {
    if (layer_rows != 0) return __shfl_sync(kAll, int32_t(entry), holder());  // below 2^31
    return __shfl_sync(kAll, static_cast<long long>(entry), holder());
  };
  // The current group's rope row, from its holder.
  auto take_shared_rope = [&]() {
    int64_t const rope = __shfl_sync(kAll, static_cast<long long>(held.rope), holder());
    rotate = rope >= 0 && has[0] && rotary;
    it.cos_sin = p.rope_cos_sin + (rotate ? rope : 0);
    if (rotate) load_rope();
  };
  if constexpr (kSharedRows) {
    if (batch_item < items) words = address_words<C>(p, coordinates(batch_item));
    hold_row(words);
    if (batch_item + G * step < items) words = address_words<C>(p, coordinates(batch_item + G * step));
    take_shared_rope();
  } else if constexpr (kRopeAhead) {
    take_row(base + lane / G, words);
    if (base + step + lane / G < items) words = address_words<C>(p, coordinates(base + step + lane / G));
  }
  int slot = 0;
  for (; base < items; base += step) {  // uniform in the warp
    stage_group(base + (kStages - 1) * step, slot == 0 ? kStages - 1 : slot - 1);
    int64_t const item = base + lane / G;
    bool const live = item < items;
    AddressWords next_words;  // the next group's (kRopeAhead: the one after it)
    if constexpr (!kRopeAhead) {
      it = DynamicItem{};
      if (live) it = coordinates(item);
      if constexpr (kAddressAhead) {
        if (item + step < items) next_words = address_words<C>(p, coordinates(item + step));
      }
    }
    using Weight = WeightPack<Delta, kGroupChunk>;
    Weight weight[CHUNKS] = {};
    if (NORMS && p.k_norm && p.k_norm_weight != nullptr) {
      int64_t layer = it.layer;
      if constexpr (kSharedRows) layer = __shfl_sync(kAll, held.layer, holder());
#pragma unroll
      for (int k = 0; k < CHUNKS; ++k)
        if (live && has[k])
          weight[k] = load_pack<Weight>(static_cast<DBits const*>(p.k_norm_weight) + weight_offset(p, layer) +
                                        channel[k]);
    }
    if constexpr (!kRopeAhead) {
      if (live) {
        if constexpr (kAddressAhead)
          dynamic_address<C>(p, paged, it, words);
        else
          dynamic_address<C>(p, paged, it);
      }
      rotate = live && has[0] && rotary && it.cos_sin != nullptr;
      if (rotate && !kRopeAtUse) load_rope();
    }
    int64_t entries[2] = {-1, -1};  // kSharedRows: the row's K and V entries
    if constexpr (kSharedRows)
      entries[0] = shuffled_entry(held.k_entry), entries[1] = shuffled_entry(held.v_entry);
    bool const write = kSharedRows ? entries[0] >= 0 : live && it.rows.k_row >= 0;
    DynamicItem const cur = it;  // this group's row (kRopeAfterKeys takes the next one into it)
    int64_t const h = it.h;
    wait_copies<kStages - 1>();  // this group's copies have landed
#pragma unroll
    for (int order = 0; order < 2; ++order) {
      int const plane = DFLASH_VALUES_FIRST && !kRopeAfterKeys ? 1 - order : order;
      float x[CHUNKS][kGroupChunk];
      // V's values are its deltas where no norm changes them: with 16-bit deltas the row's maximum
      // is taken from the words as loaded (largest_pair_magnitude).
      [[maybe_unused]] bool const values_as_loaded = plane == 1 && !(NORMS && p.v_norm);
      constexpr int kChunkWords = int(sizeof(DeltaPack)) / 4;
      [[maybe_unused]] uint32_t loaded[kPairMaxima<Delta> ? CHUNKS * kChunkWords : 1];
#pragma unroll
      for (int k = 0; k < CHUNKS; ++k) {
        DeltaPack row;
#pragma unroll
        for (int w = 0; w < kWords; ++w) {
          uint4 const word = staged[slot][plane * CHUNKS + k][w][threadIdx.x];
          memcpy(reinterpret_cast<uint4*>(&row) + w, &word, 16);
          if constexpr (kPairMaxima<Delta>) {
            loaded[(k * kWords + w) * 4 + 0] = word.x, loaded[(k * kWords + w) * 4 + 1] = word.y;
            loaded[(k * kWords + w) * 4 + 2] = word.z, loaded[(k * kWords + w) * 4 + 3] = word.w;
          }
        }
#pragma unroll
        for (int i = 0; i < kGroupChunk; ++i) x[k][i] = Delta::decode(row.v[i]);
      }
      if (NORMS && (plane == 0 ? p.k_norm : p.v_norm)) {  // uniform in the launch
        group_norm<Delta, G, CHUNKS>(x, has, weight, plane == 0 && p.k_norm_weight != nullptr, p.norm_eps,
                                     p.head_dim);
      }
      if (plane == 0 && p.rotary_dim > 0) {  // uniform in the launch
        if constexpr (CHUNKS > 1) {          // chunk k in the first half, its partner k + CHUNKS / 2
          if (rotate) {
#pragma unroll
            for (int k = 0; k < CHUNKS / 2; ++k) {
              if constexpr (kRopeAtUse) {  // chunk k is in the first half
                load_cos_sin<kGroupChunk>(it.cos_sin + channel[k], it.cos_sin + half + channel[k], c[k],
                                          sn[k]);
              }
#pragma unroll
              for (int i = 0; i < kGroupChunk; ++i) {
                float const x0 = x[k][i], x1 = x[k + CHUNKS / 2][i];
                x[k][i] = rope_channel(x0, x1, c[k][i], sn[k][i], true);
                x[k + CHUNKS / 2][i] = rope_channel(x1, x0, c[k][i], sn[k][i], false);
              }
            }
          }
        } else {  // the shuffles run in every lane
          float partner[kGroupChunk];
#pragma unroll
          for (int i = 0; i < kGroupChunk; ++i) partner[i] = __shfl_sync(kAll, x[0][i], partner_lane, G);
          if (rotate) {
#pragma unroll
            for (int i = 0; i < kGroupChunk; ++i)
              x[0][i] = rope_channel(x[0][i], partner[i], c[0][i], sn[0][i], first);
          }
        }
      }
      if constexpr (kRopeAfterKeys) {
        if (plane == 0) {  // this group's cos/sin are used: the next group's row and rope row
          take_row(item + step, words);
          if (item + 2 * step < items) words = address_words<C>(p, coordinates(item + 2 * step));
        }
      }
      // The row's maximum magnitude: NaN if any element is NaN, else infinite if any is, so the
      // one maximum gives RowMax's max and finiteness at once (a max is exact: any order, same bits).
      float magnitude = 0.0f;
      bool by_words = false;
      if constexpr (kPairMaxima<Delta>) {
        if (values_as_loaded) magnitude = largest_pair_magnitude<Delta>(loaded), by_words = true;
      }
      if (!by_words) {
        magnitude = largest_magnitude(x[0]);
#pragma unroll
        for (int k = 1; k < CHUNKS; ++k) magnitude = max_or_nan(magnitude, largest_magnitude(x[k]));
      }
#pragma unroll
      for (int offset = G / 2; offset > 0; offset /= 2)
        magnitude = max_magnitude(magnitude, __shfl_xor_sync(kAll, magnitude, offset, G));
      RowMax r;
      r.max = magnitude;
      r.finite = bits_of(magnitude) < 0x7f800000u;  // false for inf and NaN (of either sign)
      // dynamic_scale's quotient, by the constant's reciprocal (quotient_by_constant).
      constexpr float kQMax = kMaxFinite<Pool>, kQMaxReciprocal = 1.0f / kMaxFinite<Pool>;
      float const scale =
          r.finite ? quotient_by_constant(r.max, kQMax, kQMaxReciprocal) : float_of(kFloat32NaN);
      if (!write) continue;
      int64_t const row = plane == 0 ? cur.rows.k_row : cur.rows.v_row;
      int64_t entry = 0;
      if constexpr (kSharedRows)
        entry = entries[plane];
      else
        entry = scale_entry(cur.layer, row, h);
      if (chunk == 0) p.scale_pool[entry] = scale;
      // With DFLASH_LEAN_OFFSETS the pool's head rows are the scale pool's entries; the lane's
      // chunks at fixed distances from its first.
      int64_t const dst = DFLASH_LEAN_OFFSETS ? entry * p.head_dim : dynamic_dst(p, cur, row, h);
      auto* out = pool + (dst + channel[0]) / kPerByte<Pool>;
      // With DFLASH_STORE_BASE (its comment), opaque to the compiler: one address for the row.
      if constexpr (DFLASH_STORE_BASE) asm("" : "+l"(out));
      if constexpr (DFLASH_EXACT_QUOTIENTS) {
        if (scale >= kExactQuotientsFrom && scale <= kExactQuotientsTo) {
          float const r = reciprocal_in_range(scale);
          if constexpr (DFLASH_PLANE_BRACKET && !kIsFp8<Pool> && DFLASH_BRACKETED_CODES) {
            bool const computed =
                DFLASH_PLANE_BRACKET == 2 || (plane == 0 ? rotate || (NORMS && p.k_norm) : NORMS && p.v_norm);
            if (computed) {
              Divisor const d = divisor_in_range(scale, r);
              bool proven = true;
#pragma unroll
              for (int k = 0; k < CHUNKS; ++k) {
                CodeWords<Pool, kGroupChunk> words;
                proven &= product_words<Pool, kGroupChunk, true>(x[k], d, words);
                Pack<uint32_t, sizeof(words) / 4> pack;
                memcpy(&pack, &words, sizeof(pack));
                if (has[k]) store_pack(out + k * G * kGroupChunk / kPerByte<Pool>, pack);
              }
              if (proven) continue;
            }
          }
          // Every chunk's codes, and only the stores under has[k] (chunks past D hold zeros): a
          // predicated store, where a branch around each chunk's work took four instructions.
#pragma unroll
          for (int k = 0; k < CHUNKS; ++k) {
            auto const words = exact_quotient_words<Pool, kGroupChunk>(x[k], scale, r);
            Pack<uint32_t, sizeof(words) / 4> pack;
            memcpy(&pack, &words, sizeof(pack));
            if (has[k]) store_pack(out + k * G * kGroupChunk / kPerByte<Pool>, pack);
          }
          continue;
        }
      }
      Divisor const divisor = divisor_of(scale);
#pragma unroll
      for (int k = 0; k < CHUNKS; ++k) {
        if (!has[k]) continue;
        auto* const chunk_out = out + k * G * kGroupChunk / kPerByte<Pool>;
        if constexpr (kPerByte<Pool> == 2 && DFLASH_INT4_WORDS)  // the word as product_words made it
          store_pack(chunk_out,
                     quotient_bytes<Pool, kGroupChunk, true, Pack<uint32_t, kGroupChunk / 8>>(x[k], divisor));
        else
          store_pack(chunk_out, quotient_bytes<Pool, kGroupChunk, true>(x[k], divisor));
      }
    }
    slot = slot + 1 == kStages ? 0 : slot + 1;
    if constexpr (kSharedRows) {  // the next group's rope row; at a batch's end, the next batch's rows
      if (++batch_group == G) {
        batch_group = 0;
        batch_item += G * step;
        hold_row(words);
        if (batch_item + G * step < items) words = address_words<C>(p, coordinates(batch_item + G * step));
      }
      take_shared_rope();
    } else if constexpr (kRopeAhead) {
      if constexpr (!kRopeAfterKeys) {  // else taken after K's rotation
        take_row(item + step, words);
        if (item + 2 * step < items) words = address_words<C>(p, coordinates(item + 2 * step));
      }
    } else if constexpr (kAddressAhead) {
      words = next_words;
    }
  }
  wait_copies<0>();  // the copies of groups past the last (zeros) land before the block leaves
}

// Whether a call takes dynamic_group_kernel (its comment's conditions): the group width, 0 for
// none; *chunks, the chunks a lane holds.
template <typename Delta, typename Pool> int dynamic_group_width(KVUpdateParams const& p, int* chunks) {
  int64_t const delta_bytes = kGroupChunk * sizeof(typename Delta::Bits);
  int64_t const pool_bytes = kGroupChunk / kPerByte<Pool>;
  bool const fits = p.head_dim % kGroupChunk == 0 && p.head_dim <= 32 * kGroupChunk &&
                    p.rotary_dim % (2 * kGroupChunk) == 0 &&
                    aligned(p.k_delta, std::min<int64_t>(16, delta_bytes)) &&
                    aligned(p.v_delta, std::min<int64_t>(16, delta_bytes)) && aligned(p.pool, pool_bytes) &&
                    (!p.k_norm || p.k_norm_weight == nullptr ||
                     aligned(p.k_norm_weight, std::min<int64_t>(16, delta_bytes))) &&
                    (p.rotary_dim == 0 || aligned(p.rope_cos_sin, 16));  // cos/sin as float4
  if (!fits) return 0;
  // The wide kernel where the rotary partners are the lane's own chunks and the norm tree has
  // kWideChunks * G leaves: the heads of 72 to 128 channels, R = D = 128 or no rotation (one
  // instantiation more a format, for the common head; the others take one chunk a lane).
  constexpr int kChunks = kWideChunks<Delta>, kGroup = kWideGroup<Delta>;
  if (norm_tree_leaves(p.head_dim) == kChunks * kGroup && p.head_dim > kGroupChunk * kChunks * kGroup / 2 &&
      (p.rotary_dim == 0 || p.rotary_dim == kGroupChunk * kChunks * kGroup)) {
    *chunks = kChunks;
    return kGroup;
  }
  *chunks = 1;
  return p.head_dim <= 16 * kGroupChunk ? 16 : 32;
}

// The rows one pass of an instantiation of dynamic_group_kernel covers: its blocks resident
// together (the occupancy API, asked once per instantiation) times the rows of a block.
template <Contract C, typename Delta, typename Pool, int G, int CHUNKS, bool NORMS> int64_t resident_rows() {
  static int const per_multiprocessor = [] {
    int blocks = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks,
                                                      dynamic_group_kernel<C, Delta, Pool, G, CHUNKS, NORMS>,
                                                      kGroupThreads, 0) != cudaSuccess ||
        blocks < 1) {
      (void)cudaGetLastError();  // the launch reports any real problem
      blocks = 1;
    }
    return blocks;
  }();
  return int64_t(per_multiprocessor) * multiprocessor_count() * (kGroupThreads / G);
}

// One launch of dynamic_group_kernel over `items` rows from layer `layer`: a row per group, every
// row at once up to one pass of the resident blocks; beyond that each warp loops over row groups
// (the kernel's comment).
template <Contract C, typename Delta, typename Pool, int G, int CHUNKS, bool NORMS>
void launch_group(KVUpdateParams const& p, PagedAddressing const& paged, int64_t layer, int64_t items,
                  cudaStream_t stream) {
  int64_t const rows_per_block = kGroupThreads / G;
  int64_t const blocks =
      std::min<int64_t>((items + rows_per_block - 1) / rows_per_block,
                        resident_rows<C, Delta, Pool, G, CHUNKS, NORMS>() / rows_per_block);
  dynamic_group_kernel<C, Delta, Pool, G, CHUNKS, NORMS><<<unsigned(blocks), kGroupThreads, 0, stream>>>(
      p, paged, item_divisors<C>(p), layer, items, narrow_layer_rows(p), narrow_slot_factors(p));
}

// The kernel for the wide heads (dynamic_group_width's chunks > 1): kWideChunks chunks a lane,
// or with DFLASH_WIDE_BY_ROWS four chunks a lane (16-bit deltas) only where their rows fill a pass
// of the resident blocks, else two. Four chunks a lane leave half the warps of two; below a full
// pass the row's chain of dependent loads sets the time, and fewer warps hide less of it
// (BENCHMARKS.md: at B=64 L=16 four chunks were 9-14% slower, at B=8 L=2048 10-17% faster).
template <Contract C, typename Delta, typename Pool, bool NORMS>
void launch_wide(KVUpdateParams const& p, PagedAddressing const& paged, int64_t layer, int64_t items,
                 cudaStream_t stream) {
  constexpr int kChunks = kWideChunks<Delta>, kGroup = kWideGroup<Delta>;
  if constexpr (kChunks == 4 && DFLASH_WIDE_BY_ROWS) {
    if (items < resident_rows<C, Delta, Pool, kGroup, kChunks, NORMS>()) {
      launch_group<C, Delta, Pool, 16 / 2, 2, NORMS>(p, paged, layer, items, stream);  // the same tree
      return;
    }
  }
  launch_group<C, Delta, Pool, kGroup, kChunks, NORMS>(p, paged, layer, items, stream);
}

// The launch of a call with a scale pool; per-layer rings in launches of 64 layers (the ring bits
// a PagedAddressing carries).
template <Contract C, typename Delta, typename Pool>
cudaError_t launch_dynamic(KVUpdateParams const& p, cudaStream_t stream) {
  int64_t const tokens = C == Contract::kSlot ? p.delta_len : p.num_tokens;
  int64_t const sequences = C == Contract::kSlot ? p.batch : 1;
  int64_t const layers_per_launch =
      C == Contract::kPaged && p.ring_layers != nullptr ? kRingMaskLayers : p.num_layers;
  for (int64_t layer = 0; layer < p.num_layers; layer += layers_per_launch) {
    int64_t const layers = std::min(layers_per_launch, p.num_layers - layer);
    PagedAddressing paged;
    if constexpr (C == Contract::kPaged) paged = paged_addressing(p, layer);
    int64_t const items = layers * sequences * tokens * p.num_kv_heads;
    int64_t const max_blocks = int64_t(multiprocessor_count()) * 32;
    int chunks = 1;
    if (int const g = dynamic_group_width<Delta, Pool>(p, &chunks); g != 0) {
      if (chunks > 1 && (p.k_norm || p.v_norm))
        launch_wide<C, Delta, Pool, true>(p, paged, layer, items, stream);
      else if (chunks > 1)
        launch_wide<C, Delta, Pool, false>(p, paged, layer, items, stream);
      else if (g == 32)
        launch_group<C, Delta, Pool, 32, 1, true>(p, paged, layer, items, stream);
      else
        launch_group<C, Delta, Pool, 16, 1, true>(p, paged, layer, items, stream);
    } else {
      int64_t const blocks = std::min<int64_t>((items + kDynamicRows - 1) / kDynamicRows, 2 * max_blocks);
      dynamic_scale_kernel<C, Delta, Pool>
          <<<unsigned(blocks), dim3(32, kDynamicRows), 0, stream>>>(p, paged, layer, items);
    }
    if (cudaError_t const status = cudaGetLastError(); status != cudaSuccess) return status;
  }
  return cudaSuccess;
}

// The launch of a call: its own kernel for per-token-head dynamic scales, else launch_static.
template <Contract C, typename Delta, typename Pool>
cudaError_t launch_widest(KVUpdateParams const& p, cudaStream_t stream) {
  if (p.scale_pool != nullptr) {  // per-token-head dynamic scales: their own kernel
    if constexpr (kScalePoolFormat<Pool>) return launch_dynamic<C, Delta, Pool>(p, stream);
    return cudaErrorInvalidValue;  // the checker admits no scale pool for this pool
  }
  if constexpr (needs_scale_pool(Pool::kDType)) {
    return cudaErrorInvalidValue;  // the checker admits no such call
  } else {
    return launch_static<C, Delta, Pool>(p, stream);
  }
}

}  // namespace kernel
}  // namespace dflash

// Every (form, delta) instantiation of launch_widest for one pool type, each preceded by SPEC
// (`extern` to declare it, nothing to define it): a new addressing form is one line here.
#define DFLASH_FORM_INSTANCES(SPEC, C, POOL)                                                               \
  SPEC template cudaError_t launch_widest<C, F16, POOL>(KVUpdateParams const&, cudaStream_t);              \
  SPEC template cudaError_t launch_widest<C, BF16, POOL>(KVUpdateParams const&, cudaStream_t);             \
  SPEC template cudaError_t launch_widest<C, F32, POOL>(KVUpdateParams const&, cudaStream_t);              \
  SPEC template cudaError_t plan_widest<C, F16, POOL>(KVUpdateParams const&, std::vector<KernelLaunch>*);  \
  SPEC template cudaError_t plan_widest<C, BF16, POOL>(KVUpdateParams const&, std::vector<KernelLaunch>*); \
  SPEC template cudaError_t plan_widest<C, F32, POOL>(KVUpdateParams const&, std::vector<KernelLaunch>*);
#define DFLASH_POOL_INSTANCES(SPEC, POOL)                   \
  namespace dflash::kernel {                                \
  DFLASH_FORM_INSTANCES(SPEC, Contract::kSlot, POOL)        \
  DFLASH_FORM_INSTANCES(SPEC, Contract::kPaged, POOL)       \
  DFLASH_FORM_INSTANCES(SPEC, Contract::kSlotMapping, POOL) \
  }

// The dispatcher (kv_update_cuda.cu) only declares these; the units below define them (one
// translation unit per pool type keeps the build parallel).
#define DFLASH_DECLARE_POOL(POOL) DFLASH_POOL_INSTANCES(extern, POOL)
#define DFLASH_INSTANTIATE_POOL(POOL) DFLASH_POOL_INSTANCES(, POOL)
