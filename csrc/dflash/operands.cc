#include "dflash/operands.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <string>

namespace dflash {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

bool known(int64_t d) { return d != kUnknownDim; }
// Equal, or one side not known yet.
bool same(int64_t a, int64_t b) { return !known(a) || !known(b) || a == b; }
// A size that several dims hold: the first of them that is known (they were checked equal).
int64_t first_known(std::initializer_list<int64_t> dims) {
  for (int64_t d : dims)
    if (known(d)) return d;
  return kUnknownDim;
}

std::string dims_text(TensorDesc const& t) {
  std::string text = "[";
  for (int32_t i = 0; i < t.rank && i < kMaxRank; ++i)
    text += (i ? ", " : "") + (known(t.dims[i]) ? str(t.dims[i]) : std::string("?"));
  return text + "]";
}

// The scale operands the call carries: 2 (k_scale and v_scale, decided by the count; the pool's
// dtype must then agree), 1 (scale_pool, decided by the call's attribute) or 0. -1 when the count
// fits no layout.
int32_t scale_operands(UpdateAttrs const& attrs, int32_t count) {
  int32_t const extras = count - base_operand_count(attrs.contract) - (attrs.k_norm ? 1 : 0);
  if (attrs.scale_pool) return extras == 1 ? 1 : -1;
  return extras == 0 || extras == 2 ? extras : -1;
}

// The checks of one operand: a small fluent helper that records the first failure.
class Checker {
 public:
  Checker(TensorDesc const* operands, UpdateAttrs const& attrs, int32_t count)
      : ops_(operands), attrs_(attrs), count_(count) {}

  bool ok() const { return error_.empty(); }
  std::string const& error() const { return error_; }
  TensorDesc const& op(int32_t i) const { return ops_[i]; }
  UpdateAttrs const& attrs() const { return attrs_; }
  char const* name(int32_t i) const { return operand_name(attrs_, i, count_); }

  bool fail(int32_t i, std::string const& message) {
    if (error_.empty()) error_ = std::string(name(i)) + ": " + message;
    return false;
  }
  bool fail_shape(int32_t i, std::string const& expected) {
    return fail(i, "expected " + expected + ", got shape " + dims_text(op(i)));
  }
  bool dtype(int32_t i, DType wanted, char const* why = nullptr) {
    if (op(i).dtype == wanted) return true;
    return fail(i, std::string("expected dtype ") + dtype_name(wanted) + (why ? why : "") + ", got " +
                       dtype_name(op(i).dtype));
  }
  bool dims_valid(int32_t i) {
    TensorDesc const& t = op(i);
    if (t.rank < 0 || t.rank > kMaxRank) return fail(i, "rank " + str(t.rank) + " is not supported");
    for (int32_t d = 0; d < t.rank; ++d)
      if (t.dims[d] < 0 && known(t.dims[d])) return fail_shape(i, "non-negative dimensions");
    return true;
  }

 private:
  TensorDesc const* ops_;
  UpdateAttrs const& attrs_;
  int32_t count_;
  std::string error_;
};

// "a float16", "an int8": a dtype's name with its article, for messages.
std::string with_article(DType d) {
  return std::string(dtype_name(d)[0] == 'i' ? "an " : "a ") + dtype_name(d);
}

// Why a pool format with a scale pool only (int4) was refused without one.
std::string int4_needs_scale_pool(DType pool) {
  return std::string("an ") + pool_format(pool)->name + " pool (" + dtype_name(pool) +
         " [2, N, P, H, D/2]) is stored with per-token-head dynamic scales only: expected scale_pool "
         "(float32 [2, N, P, H], past_key_value's dims without its last), got none";
}

// ceil(n / d) for n >= 0, d > 0, without forming n + d - 1 (which overflows for n near INT64_MAX).
int64_t ceil_div(int64_t n, int64_t d) { return n / d + (n % d != 0 ? 1 : 0); }

// The rules between known sizes, when some dims are not known yet (TensorRT's build time): each
// size still unknown takes the smallest value its rules allow given the known ones, then
// check_params runs, so that it fails on a rule between known sizes only, or on a size in bytes
// that overflows int64 whatever the unknown sizes turn out to be. An unknown pages_per_slot (a
// field TensorRT may set after parsing) leaves numPages unknown too: its rules need it.
std::string check_known_sizes(KVUpdateParams p) {
  auto fill = [](int64_t& size, int64_t value) {
    if (!known(size)) size = value;
  };
  fill(p.num_layers, 1);
  fill(p.num_kv_heads, p.scale_heads > 1 ? p.scale_heads : 0);
  fill(p.rotary_dim, 0);
  fill(p.head_dim, p.rotary_dim);
  if (p.contract == Contract::kSlot) {
    fill(p.rope_seq_len, 0);
    fill(p.delta_len, 0);
    if (!known(p.pages_per_slot)) p.num_pages = kUnknownDim;
    if (!known(p.page_size))  // S <= pages_per_slot * P
      p.page_size = known(p.pages_per_slot) && p.pages_per_slot > 0
                        ? std::max<int64_t>(1, ceil_div(p.rope_seq_len, p.pages_per_slot))
                        : 1;
    fill(p.pages_per_slot, std::max<int64_t>(1, ceil_div(p.rope_seq_len, p.page_size)));
    // An unknown B takes a known Rb other than 1 (Rb is 1 or B), unless the pool's slots rule
    // that out: then neither rule is between known sizes, and both are left to the shapes.
    bool const batch_from_rope = !known(p.batch) && known(p.rope_batch) && p.rope_batch != 1 &&
                                 (!known(p.num_pages) || p.rope_batch <= p.num_pages / p.pages_per_slot);
    bool const batch_known = known(p.batch);
    fill(p.batch, batch_from_rope ? p.rope_batch : 0);
    if (!known(p.rope_batch))
      p.rope_batch = p.batch == 0 ? 0 : 1;
    else if (!batch_known && !batch_from_rope && p.rope_batch != 1)
      p.rope_batch = 1;
    int64_t pages = 0;
    if (!known(p.num_pages) && __builtin_mul_overflow(p.pages_per_slot, p.batch, &pages))
      return "past_key_value: numPages N must be >= B * pages_per_slot, which overflows int64 (B = " +
             str(p.batch) + ", pages_per_slot = " + str(p.pages_per_slot) + ")";
    fill(p.num_pages, pages);
  } else {
    fill(p.num_tokens, known(p.rope_seq_len) ? p.rope_seq_len : 0);
    fill(p.rope_seq_len, p.num_tokens);
    fill(p.batch, 0);
    fill(p.table_pages, 0);
    fill(p.num_pages, p.table_pages);
    fill(p.page_size, 1);
  }
  return check_params(p);
}

// Element count of t, or -1 when it overflows int64 (unknown dims count as 0).
int64_t element_count(TensorDesc const& t) {
  int64_t n = 1;
  for (int32_t d = 0; d < t.rank; ++d) {
    int64_t const dim = known(t.dims[d]) ? t.dims[d] : 0;
    if (__builtin_mul_overflow(n, dim, &n)) return -1;
  }
  return n;
}

// TensorRT's profile (UpdateAttrs::tensorrt), before the contract's own rules.
std::string check_tensorrt_profile(Checker& c, int32_t count, bool* type_error) {
  TensorDesc const& pool = c.op(kPoolOperand);
  std::string const page = str(kTensorRTPageSize);
  TensorDesc const& k = c.op(kKDeltaOperand);
  AddressingForm const& form = addressing_form(c.attrs().contract);
  if (c.attrs().contract == Contract::kPaged && k.rank == addressing_form(Contract::kSlot).delta_rank &&
      pool.rank == 5 && count == form.base_count)
    return c.fail(kKDeltaOperand,
                  "expected rank 3 [T, H, D] for the 7-input node, got shape " + dims_text(k) +
                      ": 7 inputs with a batch-major k_delta are Edge-LLM 0.10.1's call (the slot "
                      "inputs and a page table), which is not served: export Edge-LLM 0.11's "
                      "token-major node or 0.10's node"),
           c.error();
  if (pool.rank != 5)
    return c.fail_shape(kPoolOperand,
                        "rank 5 [2, N, " + page + ", H, D] (TensorRT's contract has no layers axis)"),
           c.error();
  if (known(pool.dims[2]) && pool.dims[2] != kTensorRTPageSize)
    return c.fail_shape(kPoolOperand, "dim 2 == " + page + " tokens per page (the TensorRT contract)"),
           c.error();
  if (PoolFormat const* format = pool_format(pool.dtype); format != nullptr && !format->tensorrt)
    return *type_error = true,
           c.fail(kPoolOperand, "expected dtype " + pool_dtype_list(true) + " (TensorRT's kFP8 is e4m3; " +
                                    format->name + " pools are JAX-only), got " + dtype_name(pool.dtype)),
           c.error();
  int32_t const base = base_operand_count(c.attrs().contract);
  if (scale_operands(c.attrs(), count) == 2)
    for (int32_t i = base; i < base + 2; ++i)
      if (c.op(i).rank != 1) {
        int64_t const heads = pool.dims[3];
        return c.fail(i, "expected shape [1] or [H] = [" + (known(heads) ? str(heads) : std::string("?")) +
                             "], got " + dims_text(c.op(i))),
               c.error();
      }
  return {};
}

// Per-layer rings (UpdateAttrs::ring_layers): a form with ring, the layer-batched form, one entry
// per layer, each 0 or 1.
std::string check_ring_layers(UpdateAttrs const& attrs, TensorDesc const& pool, bool layered,
                              bool need_data) {
  if (attrs.ring_layer_count < 0) return {};
  AddressingForm const& form = addressing_form(attrs.contract);
  std::string const given =
      "entries for " + str(attrs.ring_layer_count) + (attrs.ring_layer_count == 1 ? " layer" : " layers");
  if (!form.has_ring) return std::string("ring: the ") + form.name + " form takes no ring, got " + given;
  if (!layered)
    return "ring: per-layer entries are for the layer-batched form (past_key_value of rank 6, [layers, 2, N, "
           "P, H, D]); expected a bool for past_key_value of shape " +
           dims_text(pool) + ", got " + given;
  if (known(pool.dims[0]) && attrs.ring_layer_count != pool.dims[0])
    return "ring: expected one entry per layer, " + str(pool.dims[0]) + " (past_key_value dim 0), got " +
           given;
  if (attrs.ring_layers == nullptr)
    return need_data && attrs.ring_layer_count > 0 ? "ring: the per-layer entries are null" : "";
  for (int64_t l = 0; l < attrs.ring_layer_count; ++l)
    if (attrs.ring_layers[l] != 0 && attrs.ring_layers[l] != 1)
      return "ring: expected per-layer entries 0 or 1 (false or true), got " + str(attrs.ring_layers[l]) +
             " for layer " + str(l);
  return {};
}

}  // namespace

char const* operand_name(UpdateAttrs const& attrs, int32_t index, int32_t count) {
  AddressingForm const& form = addressing_form(attrs.contract);
  if (index < 0) return "operand";
  if (index < form.base_count) return form.base[index].name;
  if (index == count) return kResultName;
  int32_t extra = index - form.base_count;
  if (attrs.scale_pool) {
    if (extra == 0) return kScalePoolName;
    extra -= 1;
  } else if (scale_operands(attrs, count) == 2) {
    if (extra < 2) return kScaleNames[extra];
    extra -= 2;
  }
  if (attrs.k_norm && extra == 0) return kNormWeightName;
  return "operand";
}

namespace {

// "a, b or c" of the pool formats `listed` takes, by element dtype (with the format's name where
// the two differ).
template <typename Listed> std::string format_list(Listed listed_format) {
  std::string text;
  size_t n = 0, listed = 0;
  for (PoolFormat const& f : kPoolFormats) n += listed_format(f);
  for (PoolFormat const& f : kPoolFormats) {
    if (!listed_format(f)) continue;
    std::string const name = dtype_name(f.element);
    text += std::string(listed == 0       ? ""
                        : listed + 1 == n ? " or "
                                          : ", ") +
            name + (name != f.name ? std::string(" (") + f.name + ")" : "");
    ++listed;
  }
  return text;
}

}  // namespace

std::string pool_dtype_list(bool tensorrt) {
  return format_list([tensorrt](PoolFormat const& f) { return !tensorrt || f.tensorrt; });
}

std::string scaled_dtype_list(bool dynamic) {
  return format_list([dynamic](PoolFormat const& f) {
    return f.scales == ScaleGranularity::kStatic || (dynamic && f.scales == ScaleGranularity::kDynamic);
  });
}

std::string base_operand_list(AddressingForm const& form) {
  std::string text;
  for (int32_t i = 0; i < form.base_count; ++i) text += std::string(i ? ", " : "") + form.base[i].name;
  return text;
}

std::string check_operand_dtype(UpdateAttrs const& attrs, int32_t index, int32_t count, DType given,
                                DType delta_dtype, DType pool_dtype) {
  // The messages are built only on failure: this runs for every operand of every call.
  auto name = [&] { return std::string(operand_name(attrs, index, count)); };
  AddressingForm const& form = addressing_form(attrs.contract);
  bool const scales_given = scale_operands(attrs, count) > 0;
  auto expect = [&](DType wanted, char const* why) -> std::string {
    if (given == wanted) return {};
    return name() + ": expected dtype " + dtype_name(wanted) + why + ", got " + dtype_name(given);
  };
  if (index == count) {
    if (given == pool_dtype) return {};
    return expect(pool_dtype, " (past_key_value's: the output is the pool)");
  }
  if (index < form.base_count) {
    switch (form.base[index].role) {
      case OperandRole::kKDelta:
        if (is_delta_dtype(given)) return {};
        return name() + ": expected dtype float16, bfloat16 or float32, got " + dtype_name(given);
      case OperandRole::kVDelta: return expect(delta_dtype, " (k_delta's: k and v must agree)");
      case OperandRole::kPool:
        if (!is_pool_dtype(given) || (attrs.tensorrt && !pool_format(given)->tensorrt))
          return name() + ": expected dtype " + pool_dtype_list(attrs.tensorrt) + ", got " +
                 dtype_name(given);
        if (needs_scale_pool(given) && !attrs.scale_pool) return name() + ": " + int4_needs_scale_pool(given);
        if (takes_scales(given) && !scales_given)
          return name() + ": " + with_article(given) + " pool needs the k_scale and v_scale operands";
        if (scales_given && !(attrs.scale_pool ? takes_scale_pool(given) : takes_scales(given)))
          return name() + ": " + (attrs.scale_pool ? "scale_pool is" : "k_scale and v_scale are") +
                 " given, so a pool format with scales (" + scaled_dtype_list(attrs.scale_pool) +
                 ") is expected, got " + dtype_name(given);
        return {};
      case OperandRole::kRope: return expect(DType::kFloat32, "");
      case OperandRole::kIndex:
      case OperandRole::kPageTable: return expect(DType::kInt32, "");
      case OperandRole::kSlotIndex:
        if (given == DType::kInt32 || given == DType::kInt64) return {};
        return name() + ": expected dtype int32 or int64, got " + dtype_name(given);
    }
  }
  if (attrs.scale_pool && index == form.base_count) return expect(DType::kFloat32, "");
  if (scales_given && !attrs.scale_pool && index < form.base_count + 2) return expect(DType::kFloat32, "");
  if (attrs.k_norm && index == count - 1) return expect(delta_dtype, " (k_delta's)");
  return name() + ": unexpected operand " + std::to_string(index) + " of " + std::to_string(count);
}

std::string check_norm_eps(double eps) {
  // Tested on the bits of its float32 value, so that a flush-to-zero mode cannot change the verdict.
  float const as_float = float(eps);
  uint32_t bits;
  std::memcpy(&bits, &as_float, sizeof bits);
  uint32_t const exponent = (bits >> 23) & 0xFFu;
  if (std::isfinite(eps) && eps > 0.0 && (bits >> 31) == 0 && exponent != 0 && exponent != 0xFFu) return {};
  char text[64];
  std::snprintf(text, sizeof text, "%.9g", eps);
  return std::string(
             "norm_eps: expected a finite float > 0 that is a normal float32 (>= 1.17549435e-38), got ") +
         text;
}

std::string check_params(KVUpdateParams const& p) {
  bool const slot = p.contract == Contract::kSlot;
  if (p.num_layers < 1) return "num_layers: expected >= 1, got " + str(p.num_layers);
  if (p.batch < 0 || p.delta_len < 0 || p.num_tokens < 0 || p.num_kv_heads < 0 || p.head_dim < 0 ||
      p.num_pages < 0 || p.table_pages < 0 || p.rope_seq_len < 0 || p.rope_batch < 0)
    return "dimensions must be non-negative";
  if (p.page_size <= 0) return "past_key_value: expected a page size P > 0, got " + str(p.page_size);
  if (p.rotary_dim < 0 || p.rotary_dim % 2 != 0 || p.rotary_dim > p.head_dim)
    return "rope_cos_sin: rotary dim R must be even and <= head dim D = " + str(p.head_dim) +
           ", got R = " + str(p.rotary_dim);
  if (slot) {
    if (p.pages_per_slot <= 0) return "pages_per_slot: expected an int > 0, got " + str(p.pages_per_slot);
    if (p.num_pages % p.pages_per_slot != 0)
      return "past_key_value: numPages N must be divisible by pages_per_slot = " + str(p.pages_per_slot) +
             ", got N = " + str(p.num_pages);
    if (p.batch > max_batch(p))
      return "k_delta: batch B must be <= the pool's slots numPages / pages_per_slot = " + str(max_batch(p)) +
             ", got B = " + str(p.batch);
    if (p.rope_batch != 1 && p.rope_batch != p.batch)
      return "rope_cos_sin: batch Rb must be 1 or B = " + str(p.batch) + ", got " + str(p.rope_batch);
    int64_t capacity;
    if (__builtin_mul_overflow(p.pages_per_slot, p.page_size, &capacity))
      return "pages_per_slot: pages_per_slot * P overflows int64";
    if (p.rope_seq_len > capacity)
      return "rope_cos_sin: length S must be <= the slot capacity pages_per_slot * P = " + str(capacity) +
             ", got S = " + str(p.rope_seq_len);
  } else {
    if (p.contract == Contract::kPaged && p.table_pages > p.num_pages)
      return "kv_page_table: pages per sequence M (last dim) must be <= numPages N = " + str(p.num_pages) +
             ", got M = " + str(p.table_pages);
    if (p.rope_seq_len != p.num_tokens)
      return "rope_cos_sin: expected one row per token (T = " + str(p.num_tokens) + "), got " +
             str(p.rope_seq_len);
  }
  if (takes_scales(p.pool_dtype) && p.scale_heads != 1 && p.scale_heads != p.num_kv_heads)
    return "k_scale: expected 1 or H = " + str(p.num_kv_heads) + " scales per layer, got " +
           str(p.scale_heads);
  if (std::string e = check_norm_eps(p.norm_eps); !e.empty()) return e;

  // Every element offset the kernels form must fit int64: the tensors' element counts (and bytes).
  auto fits = [](std::initializer_list<int64_t> factors, int64_t bytes) {
    int64_t n = bytes;
    for (int64_t f : factors)
      if (__builtin_mul_overflow(n, f, &n)) return false;
    return true;
  };
  int64_t const pool_bytes = dtype_bytes(p.pool_dtype), delta_bytes = dtype_bytes(p.delta_dtype);
  if (!fits({p.num_layers, 2, p.num_pages, p.page_size, p.num_kv_heads, p.head_dim}, pool_bytes))
    return "past_key_value: its size in bytes overflows int64";
  int64_t const tokens = slot ? p.delta_len : p.num_tokens;
  if (!fits({p.num_layers, slot ? p.batch : 1, tokens, p.num_kv_heads, p.head_dim}, delta_bytes))
    return "k_delta: its size in bytes overflows int64";
  if (!fits({p.num_layers, p.rope_batch, p.rope_seq_len, p.rotary_dim}, 4))
    return "rope_cos_sin: its size in bytes overflows int64";
  if (p.contract == Contract::kPaged && !fits({p.num_layers, p.batch, 2, p.table_pages}, 4))
    return "kv_page_table: its size in bytes overflows int64";
  return {};
}

std::string check_result(TensorDesc const& result, TensorDesc const& pool) {
  bool same_dims = result.rank == pool.rank;
  for (int32_t i = 0; same_dims && i < pool.rank; ++i) same_dims = result.dims[i] == pool.dims[i];
  if (!same_dims || result.dtype != pool.dtype)
    return std::string("present_key_value: expected the pool's shape ") + dims_text(pool) + " and dtype " +
           dtype_name(pool.dtype) + " (the result is the pool, updated in place), got " + dims_text(result) +
           " " + dtype_name(result.dtype);
  return {};
}

std::string check_scale_result(TensorDesc const& result, TensorDesc const& scale_pool) {
  bool same_dims = result.rank == scale_pool.rank;
  for (int32_t i = 0; same_dims && i < scale_pool.rank; ++i) same_dims = result.dims[i] == scale_pool.dims[i];
  if (!same_dims || result.dtype != scale_pool.dtype)
    return std::string(kScaleResultName) + ": expected scale_pool's shape " + dims_text(scale_pool) +
           " and dtype " + dtype_name(scale_pool.dtype) +
           " (the result is the scale pool, updated in place), got " + dims_text(result) + " " +
           dtype_name(result.dtype);
  return {};
}

std::string params_from_operands(TensorDesc const* operands, int32_t count, UpdateAttrs const& attrs,
                                 KVUpdateParams* out, bool need_data, bool allow_unknown, bool* type_error) {
  bool ignored;
  bool& is_type = type_error ? *type_error : ignored;
  is_type = false;
  bool const slot = attrs.contract == Contract::kSlot;
  int32_t const base = base_operand_count(attrs.contract);
  int32_t const scales = scale_operands(attrs, count);
  if (operands == nullptr || out == nullptr) return "operands: null";
  std::string missing;
  for (int32_t i = count; i < base; ++i)
    missing += std::string(missing.empty() ? "" : ", ") + operand_name(attrs, i, base);
  if (!missing.empty()) missing += count + 1 == base ? " is missing: " : " are missing: ";
  if (attrs.scale_pool && count == base + 3 + (attrs.k_norm ? 1 : 0))
    return is_type = true,
           std::string(
               "scale_pool: per-token-head scales replace the static k_scale and v_scale; expected "
               "one or the other, got k_scale, v_scale and scale_pool");
  if (count < base || scales < 0)
    return is_type = true,
           missing + "expected " + str(base) + " operands (" +
               base_operand_list(addressing_form(attrs.contract)) +
               (attrs.scale_pool ? "), then scale_pool (per-token-head scales)"
                                 : "), then k_scale and v_scale for a pool format with scales") +
               (attrs.k_norm ? ", then k_norm_weight (k_norm is on)" : "") + "; got " + str(count) +
               " operands";
  Checker c(operands, attrs, count);
  for (int32_t i = 0; i < count; ++i)
    if (!c.dims_valid(i)) return c.error();
  if (!allow_unknown)
    for (int32_t i = 0; i < count; ++i)
      for (int32_t d = 0; d < c.op(i).rank; ++d)
        if (!known(c.op(i).dims[d])) return c.fail_shape(i, "concrete dimensions"), c.error();

  KVUpdateParams p;
  p.contract = attrs.contract;
  p.ring = attrs.ring;
  p.k_norm = attrs.k_norm;
  p.v_norm = attrs.v_norm;
  p.norm_eps = attrs.norm_eps;
  p.pages_per_slot = attrs.pages_per_slot;

  // The pool decides the layout: rank 6 is the layer-batched form.
  TensorDesc const& pool = c.op(kPoolOperand);
  if (attrs.tensorrt) {
    if (std::string e = check_tensorrt_profile(c, count, &is_type); !e.empty()) return e;
  } else if (pool.rank != 5 && pool.rank != 6) {
    return c.fail_shape(kPoolOperand, "rank 5 [2, N, P, H, D] (or rank 6 with a leading layers axis)"),
           c.error();
  }
  bool const layered = pool.rank == 6;
  int32_t const lead = layered ? 1 : 0;
  int64_t const layers = layered ? pool.dims[0] : 1;
  if (!same(pool.dims[lead], 2))
    return c.fail_shape(kPoolOperand, "dim " + str(lead) + " == 2 (K and V planes)"), c.error();
  if (std::string e = check_ring_layers(attrs, pool, layered, need_data); !e.empty()) return e;
  p.ring_layers = attrs.ring_layer_count >= 0 ? attrs.ring_layers : nullptr;
  p.num_layers = layers;
  p.num_pages = pool.dims[lead + 1];
  p.page_size = pool.dims[lead + 2];
  p.num_kv_heads = pool.dims[lead + 3];
  p.head_dim = pool.dims[lead + 4];

  // dtypes, position by position (the rules TensorRT's supportsFormatCombination asks for too).
  DType const delta_dtype = c.op(kKDeltaOperand).dtype, pool_dtype = pool.dtype;
  // Whether the scales are there is a question of values, not dtypes: asked before the dtypes.
  if (scales == 1 && is_pool_dtype(pool_dtype) && !takes_scale_pool(pool_dtype))
    return is_type = true,
           "scale_pool: " + with_article(pool_dtype) +
               " pool takes no scale pool (only pool formats with scales do: " + scaled_dtype_list(true) +
               "), got scale_pool of shape " + dims_text(c.op(base));
  if (needs_scale_pool(pool_dtype) && scales == 2)
    return "past_key_value: an " + std::string(pool_format(pool_dtype)->name) +
           " pool takes no static k_scale, v_scale (per-token-head dynamic scales only): expected scale_pool "
           "(float32 [2, N, P, H]) in their place, got k_scale of shape " +
           dims_text(c.op(base));
  if (needs_scale_pool(pool_dtype) && scales == 0)
    return "past_key_value: " + int4_needs_scale_pool(pool_dtype);
  if (scales != 1 && is_pool_dtype(pool_dtype) && takes_scales(pool_dtype) != (scales == 2))
    return scales == 2
               ? "past_key_value: " + with_article(pool_dtype) +
                     " pool takes no k_scale, v_scale (only pool formats with scales do), got k_scale of "
                     "shape " +
                     dims_text(c.op(base))
               : "past_key_value: " + with_article(pool_dtype) +
                     " pool needs k_scale and v_scale (float32, [] or [1] per tensor, [H] per KV head), got "
                     "none";
  for (int32_t i = 0; i < count; ++i)
    if (std::string e = check_operand_dtype(attrs, i, count, c.op(i).dtype, delta_dtype, pool_dtype);
        !e.empty())
      return is_type = true, e;
  p.delta_dtype = delta_dtype;
  p.pool_dtype = pool_dtype;

  // k_delta / v_delta: [layers?, B, L, H, D] (slot) or [layers?, T, H, D] (paged).
  TensorDesc const& k = c.op(kKDeltaOperand);
  int32_t const delta_rank = (slot ? 4 : 3) + lead;
  if (k.rank != delta_rank)
    return c.fail_shape(kKDeltaOperand, "rank " + str(delta_rank) + " " + (layered ? "[layers, " : "[") +
                                            (slot ? "B, L, H, D]" : "T, H, D]")),
           c.error();
  TensorDesc const& v = c.op(kVDeltaOperand);
  bool v_same = v.rank == k.rank;
  for (int32_t i = 0; v_same && i < k.rank; ++i) v_same = same(v.dims[i], k.dims[i]);
  if (!v_same) return c.fail_shape(kVDeltaOperand, "k_delta's shape " + dims_text(k)), c.error();
  if (layered && !same(k.dims[0], layers))
    return c.fail_shape(kKDeltaOperand, str(layers) + " layers (past_key_value dim 0)"), c.error();
  // A packed pool's last dim counts bytes: D / per_byte (int4: D / 2), so D must divide.
  p.pool_per_byte = pool_per_byte(pool_dtype);
  if (int64_t const per = p.pool_per_byte; per > 1) {
    int64_t const d = first_known({k.dims[k.rank - 1], v.dims[k.rank - 1]});
    std::string const format = pool_format(pool_dtype)->name;
    std::string const packing = "an " + format + " pool packs " + str(per) + " elements per byte along D";
    if (known(d) && d % per != 0)
      return c.fail(kPoolOperand, packing + ", so the head dim D must be " +
                                      (per == 2 ? std::string("even") : "a multiple of " + str(per)) +
                                      ", got k_delta's D = " + str(d)),
             c.error();
    if (known(d) && !same(p.head_dim, d / per))
      return c.fail_shape(kPoolOperand, "last dim D/" + str(per) + " = " + str(d / per) + " (" + packing +
                                            "; k_delta's D = " + str(d) + ")"),
             c.error();
    p.head_dim = known(p.head_dim) ? p.head_dim * per : d;
  }
  if (!same(k.dims[k.rank - 2], p.num_kv_heads) || !same(k.dims[k.rank - 1], p.head_dim))
    return c.fail_shape(kKDeltaOperand, "H, D = " + str(p.num_kv_heads) + ", " + str(p.head_dim) +
                                            " (from past_key_value " + dims_text(pool) + ")"),
           c.error();
  // Each size from the first tensor that knows it (only TensorRT's build time has unknown dims).
  p.num_kv_heads = first_known({p.num_kv_heads, k.dims[k.rank - 2], v.dims[k.rank - 2]});
  p.head_dim = first_known({p.head_dim, k.dims[k.rank - 1], v.dims[k.rank - 1]});
  if (slot) {
    p.batch = first_known({k.dims[lead], v.dims[lead]});
    p.delta_len = first_known({k.dims[lead + 1], v.dims[lead + 1]});
  } else {
    p.num_tokens = first_known({k.dims[lead], v.dims[lead]});
  }

  // rope_cos_sin: [layers?, Rb, S, R] (slot) or [layers?, T, R] (paged).
  TensorDesc const& rope = c.op(kRopeOperand);
  int32_t const rope_rank = slot ? 3 : 2;
  if (rope.rank != rope_rank && !(layered && rope.rank == rope_rank + 1))
    return c.fail_shape(
               kRopeOperand,
               std::string(slot ? "rank 3 [Rb, S, R]" : "rank 2 [T, R]") +
                   (layered ? (slot ? " or rank 4 [layers, Rb, S, R]" : " or rank 3 [layers, T, R]") : "")),
           c.error();
  p.rope_per_layer = rope.rank == rope_rank + 1;
  if (p.rope_per_layer && !same(rope.dims[0], layers))
    return c.fail_shape(kRopeOperand, str(layers) + " layers (past_key_value dim 0)"), c.error();
  int32_t const rl = p.rope_per_layer ? 1 : 0;
  if (slot) {
    p.rope_batch = rope.dims[rl];
    p.rope_seq_len = rope.dims[rl + 1];
  } else {
    p.rope_seq_len = rope.dims[rl];
    if (!same(p.rope_seq_len, p.num_tokens))
      return c.fail_shape(kRopeOperand,
                          "one row per token, T = " + str(p.num_tokens) + " (k_delta dim " + str(lead) + ")"),
             c.error();
    p.num_tokens = p.rope_seq_len = first_known({p.num_tokens, p.rope_seq_len});
  }
  p.rotary_dim = rope.dims[rl + (slot ? 2 : 1)];
  int64_t const per_step = slot ? p.batch : p.num_tokens;  // entries of the int32 arrays

  // The index arrays: starts + lengths (slot), positions + owners (paged), the slots (slot
  // mapping): [n] or [layers, n], all in one layout.
  int32_t const first = 4;
  int32_t const index_operands = attrs.contract == Contract::kSlotMapping ? 1 : 2;
  bool per_layer = false;
  for (int32_t i = first; i < first + index_operands; ++i) {
    TensorDesc const& t = c.op(i);
    bool const flat = t.rank == 1 && same(t.dims[0], per_step);
    bool const stacked = layered && t.rank == 2 && same(t.dims[0], layers) && same(t.dims[1], per_step);
    if (!flat && !stacked)
      return c.fail_shape(i, "[" + str(per_step) + "]" +
                                 (layered ? " or [" + str(layers) + ", " + str(per_step) + "]" : "") +
                                 (slot ? " (B entries)" : " (T entries)")),
             c.error();
    if (i == first)
      per_layer = stacked;
    else if (stacked != per_layer)
      return c.fail_shape(i, std::string("the layout of ") + c.name(first) + " " + dims_text(c.op(first))),
             c.error();
    int64_t& entries = slot ? p.batch : p.num_tokens;
    entries = first_known({entries, t.dims[t.rank - 1]});
  }
  if (!slot) p.rope_seq_len = p.num_tokens;  // one row per token
  p.positions_per_layer = per_layer;

  // kv_page_table: [layers?, B, 2, M].
  if (attrs.contract == Contract::kPaged) {
    TensorDesc const& table = c.op(6);
    if (table.rank != 3 && !(layered && table.rank == 4))
      return c.fail_shape(6,
                          std::string("rank 3 [B, 2, M]") + (layered ? " or rank 4 [layers, B, 2, M]" : "")),
             c.error();
    p.table_per_layer = table.rank == 4;
    int32_t const tl = p.table_per_layer ? 1 : 0;
    if (p.table_per_layer && !same(table.dims[0], layers))
      return c.fail_shape(6, str(layers) + " layers (past_key_value dim 0)"), c.error();
    if (!same(table.dims[tl + 1], 2))
      return c.fail_shape(6, "[B, 2, M]: dim " + str(tl + 1) + " == 2 (K and V pages)"), c.error();
    p.batch = table.dims[tl];
    p.table_pages = table.dims[tl + 2];
  }

  // Extras: k_scale, v_scale ([] / [1] / [H], layered also [layers, 1] / [layers, H]), k_norm_weight.
  int32_t next = base;
  if (scales == 2) {
    TensorDesc const& ks = c.op(next);
    TensorDesc const& vs = c.op(next + 1);
    bool const per_layer_scale = layered && ks.rank == 2;
    if (!(ks.rank == 0 || ks.rank == 1 || per_layer_scale))
      return c.fail_shape(next, std::string("[] or [1] or [H] (H = ") + str(p.num_kv_heads) + ")" +
                                    (layered ? " or [layers, 1] / [layers, H]" : "")),
             c.error();
    int64_t const v_heads = vs.rank == ks.rank && ks.rank > 0 ? vs.dims[vs.rank - 1] : kUnknownDim;
    int64_t const heads = ks.rank == 0 ? 1 : first_known({ks.dims[ks.rank - 1], v_heads});
    if (known(heads) && heads != 1 && !same(heads, p.num_kv_heads))
      return c.fail_shape(next, "1 or H = " + str(p.num_kv_heads) + " scales"), c.error();
    if (per_layer_scale && !same(ks.dims[0], layers))
      return c.fail_shape(next, str(layers) + " layers (past_key_value dim 0)"), c.error();
    bool vs_same = vs.rank == ks.rank;
    for (int32_t i = 0; vs_same && i < ks.rank; ++i) vs_same = same(vs.dims[i], ks.dims[i]);
    if (!vs_same) return c.fail_shape(next + 1, "k_scale's shape " + dims_text(ks)), c.error();
    p.scale_heads = known(heads) ? heads : 1;
    if (!known(p.num_kv_heads) && p.scale_heads > 1) p.num_kv_heads = p.scale_heads;
    p.scale_per_layer = per_layer_scale;
    p.k_scale = static_cast<float const*>(ks.data);
    p.v_scale = static_cast<float const*>(vs.data);
    next += 2;
  }
  if (scales == 1) {  // scale_pool: the pool's dims without D
    TensorDesc const& sp = c.op(next);
    bool fits = sp.rank == pool.rank - 1;
    for (int32_t i = 0; fits && i < sp.rank; ++i) fits = same(sp.dims[i], pool.dims[i]);
    if (!fits) {
      std::string expected = "[";
      for (int32_t i = 0; i + 1 < pool.rank; ++i)
        expected += (i ? ", " : "") + (known(pool.dims[i]) ? str(pool.dims[i]) : std::string("?"));
      return c.fail_shape(next, expected + "] (" + (layered ? "[layers, 2, N, P, H]" : "[2, N, P, H]") +
                                    ": past_key_value's dims without D)"),
             c.error();
    }
    p.scale_pool = static_cast<float*>(const_cast<void*>(sp.data));
    next += 1;
  }
  if (attrs.k_norm) {
    TensorDesc const& w = c.op(next);
    bool const flat = w.rank == 1 && same(w.dims[0], p.head_dim);
    bool const stacked = layered && w.rank == 2 && same(w.dims[0], layers) && same(w.dims[1], p.head_dim);
    if (!flat && !stacked)
      return c.fail_shape(next, "[D] = [" + str(p.head_dim) + "]" + (layered ? " or [layers, D]" : "")),
             c.error();
    p.weight_per_layer = stacked;
    p.k_norm_weight = w.data;
    p.head_dim = first_known({p.head_dim, w.dims[w.rank - 1]});
  }

  p.k_delta = c.op(kKDeltaOperand).data;
  p.v_delta = c.op(kVDeltaOperand).data;
  p.pool = const_cast<void*>(pool.data);
  p.rope_cos_sin = static_cast<float const*>(rope.data);
  if (slot) {
    p.delta_start_positions = static_cast<int32_t const*>(c.op(4).data);
    p.delta_lengths = static_cast<int32_t const*>(c.op(5).data);
  } else if (attrs.contract == Contract::kSlotMapping) {
    p.slot_mapping = c.op(4).data;
    p.slot_mapping_int64 = c.op(4).dtype == DType::kInt64;
  } else {
    p.delta_positions = static_cast<int32_t const*>(c.op(4).data);
    p.token_to_sequence = static_cast<int32_t const*>(c.op(5).data);
    p.page_table = static_cast<int32_t const*>(c.op(6).data);
  }

  bool all_known = true;
  for (int32_t i = 0; all_known && i < count; ++i)
    for (int32_t d = 0; d < c.op(i).rank; ++d) all_known &= known(c.op(i).dims[d]);
  if (all_known) {
    for (int32_t i = 0; i < count; ++i)
      if (element_count(c.op(i)) < 0) return std::string(c.name(i)) + ": its element count overflows int64";
    if (std::string e = check_params(p); !e.empty()) return e;
    if (need_data)
      for (int32_t i = 0; i < count; ++i)
        if (c.op(i).data == nullptr && element_count(c.op(i)) > 0)
          return std::string(c.name(i)) + ": the data pointer is null for shape " + dims_text(c.op(i));
  } else if (std::string e = check_known_sizes(p); !e.empty()) {
    return e;
  }
  *out = p;
  return {};
}

}  // namespace dflash
