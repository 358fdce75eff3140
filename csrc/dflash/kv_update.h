// The DFlash target KV-cache update: parameters, layout math, guards (docs/SPEC.md).
//
// This header is the one place that says where token t lands in the paged pool, for both
// contracts (slot and paged), mirrored in jax_dflash/reference.py. The arithmetic of what is
// stored there (RoPE, norms, FP8) is numerics.h. The CPU implementation, the CUDA kernel, the XLA
// FFI handlers and the TensorRT plugin all include it; operands.h turns tensor shapes into these
// parameters, once, for every runtime.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DFLASH_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define DFLASH_HOST_DEVICE inline
#endif

namespace dflash {

// Element types the operands can have: the contract's (contract.h says which operand takes
// which), and the others a runtime can hand over, named in messages. Every runtime adapter maps
// all of them, so that a new pool format is a row of contract.h, not an edit of each adapter.
enum class DType : int32_t {
  kFloat16 = 0,
  kBFloat16 = 1,
  kFloat32 = 2,
  kFloat8E4M3 = 3,  // float8_e4m3fn
  kFloat8E5M2 = 4,
  kInt32 = 5,
  kInt64 = 6,
  kOther = 7,
  kBool = 8,
  kInt8 = 9,
  kUInt8 = 10,
  kInt16 = 11,
  kUInt16 = 12,
  kUInt32 = 13,
  kUInt64 = 14,
  kFloat64 = 15,
};

inline int64_t dtype_bytes(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
    case DType::kBFloat16: return 2;
    case DType::kFloat32:
    case DType::kInt32:
    case DType::kUInt32: return 4;
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2:
    case DType::kBool:
    case DType::kInt8:
    case DType::kUInt8: return 1;
    case DType::kInt16:
    case DType::kUInt16: return 2;
    case DType::kInt64:
    case DType::kUInt64:
    case DType::kFloat64: return 8;
    default: return 0;
  }
}

inline char const* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat32: return "float32";
    case DType::kFloat8E4M3: return "float8_e4m3fn";
    case DType::kFloat8E5M2: return "float8_e5m2";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kBool: return "bool";
    case DType::kInt8: return "int8";
    case DType::kUInt8: return "uint8";
    case DType::kInt16: return "int16";
    case DType::kUInt16: return "uint16";
    case DType::kUInt32: return "uint32";
    case DType::kUInt64: return "uint64";
    case DType::kFloat64: return "float64";
    default: return "another dtype";
  }
}

inline bool is_delta_dtype(DType d) {
  return d == DType::kFloat16 || d == DType::kBFloat16 || d == DType::kFloat32;
}

// How tokens are addressed (SPEC.md): slot b owns a fixed range of pages (batch-major deltas),
// or each token names its sequence and position and a page table maps pages (token-major).
// or each token names its slot in the flat [N * P] rows of a plane (vLLM's slot mapping).
enum class Contract : int32_t { kSlot = 0, kPaged = 1, kSlotMapping = 2 };

// The norms' epsilon when a caller gives none (HF RMSNorm's default in Qwen3 drafts).
inline constexpr float kDefaultNormEps = 1e-6f;

// Everything one launch needs. Shapes without the optional leading layer axis:
//   k_delta, v_delta   slot [B, L, H, D] | paged [T, H, D]         delta_dtype
//   pool               [2, N, P, H, D]                              pool_dtype, updated in place
//   rope_cos_sin       slot [Rb, S, R]   | paged [T, R]             float32
//   slot:  delta_start_positions [B], delta_lengths [B]             int32
//   paged: delta_positions [T], token_to_sequence [T], page_table [B, 2, M]   int32
//   k_scale, v_scale   [] or [H] (FP8 pools only)                   float32
//   k_norm_weight      [D] (k_norm only)                            delta_dtype
// With num_layers > 1, k/v/pool carry a leading layer axis; the others carry one only when the
// *_per_layer flags say so (otherwise every layer shares them).
struct KVUpdateParams {
  Contract contract = Contract::kSlot;

  void const* k_delta = nullptr;
  void const* v_delta = nullptr;
  void* pool = nullptr;
  float const* rope_cos_sin = nullptr;
  int32_t const* delta_start_positions = nullptr;  // slot
  int32_t const* delta_lengths = nullptr;          // slot
  int32_t const* delta_positions = nullptr;        // paged
  int32_t const* token_to_sequence = nullptr;      // paged
  int32_t const* page_table = nullptr;             // paged
  void const* slot_mapping = nullptr;              // slot mapping: int32 or int64 [T]
  bool slot_mapping_int64 = false;
  float const* k_scale = nullptr;                  // FP8 pools
  float const* v_scale = nullptr;
  // Per-token-head dynamic scales, [layers?, 2, N, P, H] float32, updated where rows are stored
  // (null: static scales or none).
  float* scale_pool = nullptr;
  void const* k_norm_weight = nullptr;  // k_norm

  DType delta_dtype = DType::kFloat16;
  DType pool_dtype = DType::kFloat16;
  // Pool elements per stored byte along D (contract.h's per_byte: 2 for int4). The layout math
  // counts elements; pool_byte_offset turns them into bytes.
  int32_t pool_per_byte = 1;

  int64_t num_layers = 1;
  int64_t batch = 0;         // B: slot sequences, or page-table rows (paged)
  int64_t delta_len = 0;     // L (slot)
  int64_t num_tokens = 0;    // T (paged)
  int64_t num_kv_heads = 0;  // H
  int64_t head_dim = 0;      // D
  int64_t num_pages = 0;     // N, pool dim 1
  int64_t page_size = 0;     // P, tokens per page
  int64_t pages_per_slot = 0;  // slot
  int64_t table_pages = 0;     // M (paged)
  int64_t rotary_dim = 0;      // R
  int64_t rope_batch = 1;      // Rb (slot)
  int64_t rope_seq_len = 0;    // S (slot); T (paged: token-aligned rows)
  int64_t scale_heads = 1;     // 1 (per tensor) or H (per head)
  bool rope_per_layer = false;
  bool positions_per_layer = false;  // slot: starts + lengths; paged: positions + owners
  bool table_per_layer = false;
  bool scale_per_layer = false;
  bool weight_per_layer = false;
  bool ring = false;  // paged: page index (p / P) % M instead of dropping p / P >= M
  // Paged, layer-batched: layer l's ring is ring_layers[l] != 0, in place of `ring` (a draft whose
  // sliding-window layers share a launch with its full ones); null when every layer has `ring`.
  // Host memory, read while a launch is set up (never by a GPU thread).
  int8_t const* ring_layers = nullptr;
  bool k_norm = false;
  bool v_norm = false;
  float norm_eps = kDefaultNormEps;
};

DFLASH_HOST_DEVICE int64_t max_batch(KVUpdateParams const& p) { return p.num_pages / p.pages_per_slot; }
DFLASH_HOST_DEVICE int64_t slot_capacity(KVUpdateParams const& p) { return p.pages_per_slot * p.page_size; }
// Tokens of one layer's deltas: B * L (slot) or T (paged).
DFLASH_HOST_DEVICE int64_t tokens_per_layer(KVUpdateParams const& p) {
  return p.contract == Contract::kSlot ? p.batch * p.delta_len : p.num_tokens;
}

// ---- layout math ------------------------------------------------------------------------------

// Elements between consecutive tokens (rows) of one pool plane, and of one delta.
DFLASH_HOST_DEVICE int64_t token_stride(KVUpdateParams const& p) { return p.num_kv_heads * p.head_dim; }
// Elements in one page of one pool plane: P rows.
DFLASH_HOST_DEVICE int64_t pool_page_elems(KVUpdateParams const& p) { return p.page_size * token_stride(p); }
// Elements in one plane (K or V) of one layer's pool.
DFLASH_HOST_DEVICE int64_t pool_plane_elems(KVUpdateParams const& p) {
  return p.num_pages * p.page_size * token_stride(p);
}
DFLASH_HOST_DEVICE int64_t pool_layer_elems(KVUpdateParams const& p) { return 2 * pool_plane_elems(p); }

// Both contracts see one layer's pool as rows [2N * P] of [H, D]: K rows first, then V rows.
// A written token has a K row and a V row; everything else about addressing is which rows.
struct PoolRows {
  int64_t k_row = -1;  // -1: nothing is written for this token
  int64_t v_row = -1;
};

// Slot contract: token t of sequence `slot` with start and length. Nothing is written for
// padding (t >= length, negative lengths included), positions past the slot capacity or negative
// ones. Slot b owns pages [b * pages_per_slot, (b + 1) * pages_per_slot), so page * P + row is
// simply slot * cap + pos (the pool is [2, maxBatch, cap, H, D] in memory): no division on the
// hot path. Arithmetic is 64-bit so that no int32 start can wrap around into the slot.
DFLASH_HOST_DEVICE int64_t written_position(int64_t start, int64_t length, int64_t t, int64_t capacity) {
  if (t >= length) return -1;
  int64_t const pos = start + t;
  if (pos < 0 || pos >= capacity) return -1;
  return pos;
}
// The slot form's row and rope-row products over a geometry `g` whose factors have the index type
// the products are taken in: the call's own (SlotFactors, int64_t), or uint32_t where
// narrow_addressing(p) holds (the CUDA group kernel's, decoded once at the launch: the compiler
// forms a 32-bit product of 64-bit parameters as a 64-bit one, three instructions for one).
template <typename Geometry, typename Index>
DFLASH_HOST_DEVICE PoolRows slot_rows_in(Geometry const& g, Index slot, int64_t pos) {
  PoolRows rows;
  if (pos < 0) return rows;
  Index const k_row = slot * g.capacity() + Index(pos);
  rows.k_row = int64_t(k_row);
  rows.v_row = int64_t(g.plane_rows() + k_row);
  return rows;
}
// Offset (floats) of the rope row cos_sin[layer?, b?, pos] (b = 0 when the batch shares a table).
template <typename Geometry, typename Index>
DFLASH_HOST_DEVICE Index slot_rope_row_in(Geometry const& g, Index layer, Index b, Index pos) {
  Index const table = g.rope_per_layer() ? layer : Index(0);
  Index const batch = g.rope_batch() == 1 ? Index(0) : b;
  return ((table * g.rope_batch() + batch) * g.rope_seq_len() + pos) * g.rotary_dim();
}
// The call's own factors, read where they are used.
struct SlotFactors {
  KVUpdateParams const& p;
  DFLASH_HOST_DEVICE int64_t capacity() const { return slot_capacity(p); }
  DFLASH_HOST_DEVICE int64_t plane_rows() const { return p.num_pages * p.page_size; }
  DFLASH_HOST_DEVICE bool rope_per_layer() const { return p.rope_per_layer; }
  DFLASH_HOST_DEVICE int64_t rope_batch() const { return p.rope_batch; }
  DFLASH_HOST_DEVICE int64_t rope_seq_len() const { return p.rope_seq_len; }
  DFLASH_HOST_DEVICE int64_t rotary_dim() const { return p.rotary_dim; }
};
DFLASH_HOST_DEVICE PoolRows slot_rows(KVUpdateParams const& p, int64_t slot, int64_t pos) {
  return slot_rows_in(SlotFactors{p}, slot, pos);
}

// Division of numerators n < 2^31 by a constant d in [1, 2^31] as a multiply and a shift
// (Granlund & Montgomery): with l = ceil(log2 d) and m = floor(2^(31+l) / d) + 1, which is below
// 2^32, n / d == (m * n) >> (31 + l) exactly, since m * d - 2^(31+l) lies in (0, d] and so the
// product's excess stays below 1 / d. One branch-free form for every page size and M. d = 0
// gives quotient 0.
struct Divisor31 {
  uint32_t d = 0;
  uint32_t magic = 0;
  uint32_t shift = 0;
};
DFLASH_HOST_DEVICE Divisor31 divisor31(uint32_t d) {
  Divisor31 v;
  if (d == 0) return v;
  uint32_t l = 0;
  while ((uint64_t(1) << l) < d) ++l;
  v.d = d;
  v.magic = uint32_t((uint64_t(1) << (31 + l)) / d + 1);
  v.shift = 31 + l;
  return v;
}
DFLASH_HOST_DEVICE uint32_t quotient(Divisor31 const& v, uint32_t n) {
  return uint32_t((uint64_t(v.magic) * n) >> v.shift);
}

DFLASH_HOST_DEVICE uint32_t cap_at_int32(int64_t n) {
  return n <= 0 ? 0u : n >= (int64_t(1) << 31) ? uint32_t(1) << 31 : uint32_t(n);
}

// Paged contract: the launch's constants, decoded once (by the CPU loop and the CUDA launch).
// Owners, positions and page ids are int32 data, so every limit is capped at 2^31 and every test
// below is one unsigned 32-bit compare, negative values included: on the GPU these steps sit
// between the arrival of the positions and the page-table load, on every decode step's path.
struct PagedAddressing {
  uint32_t batch = 0;        // B: owner b is written iff uint32(b) < batch
  uint32_t table_pages = 0;  // M: page index i is in the table iff i < M
  Divisor31 page;            // P (capped: the same quotient and remainder for any int32 position)
  Divisor31 table;           // M (capped), for the ring's remainder
  int64_t page_size = 0;     // P
  int64_t table_row = 0;     // 2M: entries of one sequence's [2, M] table rows
  int64_t table_layer = 0;   // entries of one layer's [B, 2, M] table; 0 when the layers share it
  uint32_t k_pages = 0;      // K ids in [0, k_pages): N
  uint32_t v_first = 0;      // V ids in [v_first, v_first + v_pages): [N, 2N), as far as int32
  uint32_t v_pages = 0;      // reaches (none when N >= 2^31)
  // Bit i: layer first + i of the addressed layers takes the ring, page index (p / P) % M instead
  // of dropping p / P >= M (never when M = 0). Every bit alike when all layers share `ring`, so any
  // layer may read it; per-layer rings address at most 64 layers at a time.
  uint64_t ring_bits = 0;
};

inline constexpr int64_t kRingMaskLayers = 64;

// The ring bits of layers [first, first + 64), on the host (ring_layers is host memory).
inline uint64_t ring_mask(KVUpdateParams const& p, int64_t first) {
  if (p.table_pages <= 0) return 0;
  if (p.ring_layers == nullptr) return p.ring ? ~uint64_t(0) : 0;
  uint64_t mask = 0;
  for (int64_t i = 0; i < kRingMaskLayers && first + i < p.num_layers; ++i)
    mask |= uint64_t(p.ring_layers[first + i] != 0) << i;
  return mask;
}

// The constants of the layers from `first` on (the ring bits of 64 of them).
inline PagedAddressing paged_addressing(KVUpdateParams const& p, int64_t first = 0) {
  PagedAddressing a;
  a.batch = cap_at_int32(p.batch);
  a.table_pages = cap_at_int32(p.table_pages);
  a.ring_bits = ring_mask(p, first);
  a.page = divisor31(cap_at_int32(p.page_size));
  a.table = divisor31(a.table_pages);
  a.page_size = p.page_size;
  a.table_row = 2 * p.table_pages;
  a.table_layer = p.table_per_layer ? p.batch * a.table_row : 0;
  a.k_pages = cap_at_int32(p.num_pages);
  int64_t const int32_end = int64_t(1) << 31;  // V ids past it are not int32
  if (p.num_pages < int32_end) {
    a.v_first = uint32_t(p.num_pages);
    a.v_pages = uint32_t(p.num_pages < int32_end - p.num_pages ? p.num_pages : int32_end - p.num_pages);
  }
  return a;
}

// Whether layer first + i (i < 64) takes the ring: one bit test, the same for a whole layer.
DFLASH_HOST_DEVICE bool layer_ring(PagedAddressing const& a, uint32_t i) {
  return ((a.ring_bits >> (i & uint32_t(kRingMaskLayers - 1))) & 1u) != 0;
}

// Steps 1-2: the entry of token (owner, pos) in its sequence's K row of the page table,
// [b, 0, page] (the V page is M entries further), counted from the layer's table; -1 when nothing
// is written (owner outside [0, B), negative position, page index past M without ring).
// *row = pos % P. Branch-free but for the ring's choice (layer_ring), which is the same for every
// token of a layer. A layer's table starts layer * table_layer entries in.
DFLASH_HOST_DEVICE int64_t page_table_entry(PagedAddressing const& a, bool ring, int32_t owner, int32_t pos,
                                            uint32_t* row) {
  uint32_t const upos = uint32_t(pos);  // for pos < 0 the quotients below are unused
  uint32_t const page = quotient(a.page, upos);
  *row = upos - page * a.page.d;
  // page % M under ring; else the page itself, which is the entry whenever it is in the table (the
  // remainder's two products stay off the GPU's path from the positions to the page-table load).
  uint32_t const wrapped = ring ? page - quotient(a.table, page) * a.table.d : page;
  bool const in_table = page < a.table_pages || ring;
  // Selected, not branched to: the product then reads its constant before the test is known.
  // Unsigned, as it is also formed for owners outside [0, B), whose products are never used.
  uint64_t const entry = uint64_t(uint32_t(owner)) * uint64_t(a.table_row) + wrapped;
  return pos < 0 || uint32_t(owner) >= a.batch || !in_table ? -1 : int64_t(entry);
}
// Step 3, given the K and V page ids read at that entry (V at entry + M): K ids must lie in
// [0, N) and V ids in [N, 2N), else neither plane is written. V ids index the [2N, P, H, D]
// view directly, which is why they carry the +N offset. Rows are page * P + row.
DFLASH_HOST_DEVICE bool page_ids_valid(PagedAddressing const& a, int32_t k_page, int32_t v_page) {
  return uint32_t(k_page) < a.k_pages && uint32_t(v_page) - a.v_first < a.v_pages;
}
DFLASH_HOST_DEVICE PoolRows paged_rows(PagedAddressing const& a, int32_t k_page, int32_t v_page,
                                       uint32_t row) {
  PoolRows rows;
  if (!page_ids_valid(a, k_page, v_page)) return rows;
  rows.k_row = int64_t(uint32_t(k_page)) * a.page_size + row;
  rows.v_row = int64_t(uint32_t(v_page)) * a.page_size + row;
  return rows;
}
// Slot-mapping form: token t's slot s in the flat rows [N * P] of a plane (s = page * P + row);
// nothing is written for s < 0 or s >= N * P (64-bit: no slot is narrowed). The V row is the
// same row of the V plane.
DFLASH_HOST_DEVICE PoolRows mapped_rows(KVUpdateParams const& p, int64_t slot) {
  PoolRows rows;
  int64_t const plane_rows = p.num_pages * p.page_size;
  if (slot < 0 || slot >= plane_rows) return rows;
  rows.k_row = slot;
  rows.v_row = plane_rows + slot;
  return rows;
}
// The slot of token t of a layer (int32 or int64 data, widened).
DFLASH_HOST_DEVICE int64_t mapped_slot(KVUpdateParams const& p, int64_t index) {
  return p.slot_mapping_int64 ? static_cast<int64_t const*>(p.slot_mapping)[index]
                              : int64_t(static_cast<int32_t const*>(p.slot_mapping)[index]);
}

// Offset (elements) of the first delta element of token t of sequence b (slot), or of token t
// (paged: b ignored), in layer `layer`.
DFLASH_HOST_DEVICE int64_t delta_token_offset(KVUpdateParams const& p, int64_t layer, int64_t b, int64_t t) {
  int64_t const token = p.contract == Contract::kSlot ? b * p.delta_len + t : t;
  return (layer * tokens_per_layer(p) + token) * token_stride(p);
}

// Index into the per-sequence (slot) or per-token (paged) int32 arrays.
DFLASH_HOST_DEVICE int64_t position_index(KVUpdateParams const& p, int64_t layer, int64_t i) {
  int64_t const per_layer = p.contract == Contract::kSlot ? p.batch : p.num_tokens;
  return (p.positions_per_layer ? layer * per_layer : 0) + i;
}

// Offset (floats) of the rope row: slot cos_sin[layer?, rb, pos] (slot_rope_row_in); paged
// cos_sin[layer?, t] (token-aligned, `row` = t).
DFLASH_HOST_DEVICE int64_t rope_row_offset(KVUpdateParams const& p, int64_t layer, int64_t b, int64_t row) {
  int64_t const rl = p.rope_per_layer ? layer : 0;
  if (p.contract != Contract::kSlot) return (rl * p.num_tokens + row) * p.rotary_dim;
  return slot_rope_row_in(SlotFactors{p}, layer, b, row);
}

// Index of head h's scale in k_scale / v_scale.
DFLASH_HOST_DEVICE int64_t scale_index(KVUpdateParams const& p, int64_t layer, int64_t h) {
  return (p.scale_per_layer ? layer * p.scale_heads : 0) + (p.scale_heads == 1 ? 0 : h);
}

// Index in scale_pool of the scale of head h of pool row `row` (K rows, then V rows) of `layer`:
// the scale pool is the pool without D.
DFLASH_HOST_DEVICE int64_t scale_pool_index(KVUpdateParams const& p, int64_t layer, int64_t row, int64_t h) {
  return (layer * 2 * p.num_pages * p.page_size + row) * p.num_kv_heads + h;
}
// The same index in uint32_t arithmetic, for calls whose every entry is below 2^31 (layer_rows:
// narrow_layer_rows(p), the rows of a layer's pool, K rows then V rows). A kernel's rows take
// two entries each, and a 64-bit product costs three instructions.
DFLASH_HOST_DEVICE uint32_t narrow_scale_pool_index(KVUpdateParams const& p, uint32_t layer_rows,
                                                    uint32_t layer, uint32_t row, uint32_t h) {
  return (layer * layer_rows + row) * uint32_t(p.num_kv_heads) + h;
}
// The rows of a layer's pool where every scale-pool entry of the call is below 2^31 (so that
// narrow_scale_pool_index gives them), else 0.
inline uint32_t narrow_layer_rows(KVUpdateParams const& p) {
  int64_t const layer_rows = 2 * p.num_pages * p.page_size;
  return p.num_layers * layer_rows * p.num_kv_heads <= (int64_t(1) << 31) ? uint32_t(layer_rows) : 0;
}

// Whether every pool row of a layer and every float of the rope table lie below 2^31, so that the
// slot form's row and rope-row products may be taken in uint32_t arithmetic (the CUDA group
// kernel's NarrowSlotFactors).
inline bool narrow_addressing(KVUpdateParams const& p) {
  int64_t const tables = p.rope_per_layer ? p.num_layers : 1;
  return narrow_layer_rows(p) != 0 &&
         tables * p.rope_batch * p.rope_seq_len * p.rotary_dim < (int64_t(1) << 31);
}

// Offset (bytes) in the pool of head h of pool row `row` of layer `layer`: its element offset in
// bytes. A packed format (int4, two elements per byte) has an even D, so every head row starts on
// a byte of its own.
inline int64_t pool_byte_offset(KVUpdateParams const& p, int64_t layer, int64_t row, int64_t h) {
  int64_t const elements = layer * pool_layer_elems(p) + row * token_stride(p) + h * p.head_dim;
  return elements / p.pool_per_byte * dtype_bytes(p.pool_dtype);
}

// Offset (elements) of the k-norm weight row of a layer.
DFLASH_HOST_DEVICE int64_t weight_offset(KVUpdateParams const& p, int64_t layer) {
  return p.weight_per_layer ? layer * p.head_dim : 0;
}

}  // namespace dflash
