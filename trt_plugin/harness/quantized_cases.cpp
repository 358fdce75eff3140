// The quantized pool formats in every addressing form: the builder's and runtime's sequence for
// kINT8 pools with static scales (per head, per tensor), kINT8 and kFP8 pools with a scale pool
// (the field scale_pool = 1: input scale_pool, output present_scale_pool aliasing it), and int4
// pools (kUINT8 [2, N, 128, H, D / 2], a scale pool only).
#include "cases.h"
#include "sequence.h"

namespace harness {

namespace {

// The form's batch-like sizes dynamic (as the form's own cases have them), the rest fixed.
void playQuantized(Case opt, IPluginResourceContext* context) {
  Case min = opt, max = opt;
  if (opt.contract == Contract::kSlot) {
    min.B = min.L = min.S = 1;
    max.B = opt.N / opt.pagesPerSlot;
    max.L = 256;
    max.S = opt.pagesPerSlot * kP;
  } else {
    min.T = 1, max.T = 1024;
    if (opt.contract == Contract::kPaged) min.B = 1, max.B = 16;
  }
  Played played = playContract(min, opt, max, context);
  if (played.rt != nullptr) enqueueEmpty(played.rt, opt);
}

Case formBase(Contract contract) {
  Case c;
  c.contract = contract;
  c.H = 8, c.D = 128, c.R = 64;
  if (contract == Contract::kSlot) {
    c.B = 4, c.L = 16, c.N = 12, c.pagesPerSlot = 2, c.Rb = 1, c.S = 200;
  } else {
    c.T = 24, c.N = 16;
    if (contract == Contract::kPaged) c.B = 4, c.M = 4;
  }
  return c;
}

}  // namespace

void quantizedContractCases(IPluginResourceContext* context) {
  Group group(kQuantizedContractGroup);
  requireGroup(kQuantizedContractGroup);
  for (Contract contract : {Contract::kSlot, Contract::kPaged, Contract::kSlotMapping}) {
    std::string const form = dflash::addressing_form(contract).name;
    Case const base = formBase(contract);
    {
      Case c = base;
      c.name = form + "_int8_per_head_scales";
      c.delta = DataType::kHALF, c.pool = DataType::kINT8, c.scaleHeads = c.H;
      playQuantized(c, context);
    }
    {
      Case c = base;
      c.name = form + "_int8_per_tensor_scales_k_norm_v_norm";
      c.delta = DataType::kBF16, c.pool = DataType::kINT8, c.scaleHeads = 1;
      c.kNorm = c.vNorm = true, c.eps = 1e-5f;
      playQuantized(c, context);
    }
    {
      Case c = base;
      c.name = form + "_int8_scale_pool";
      c.delta = DataType::kFLOAT, c.pool = DataType::kINT8, c.scalePool = true;
      c.ring = contract == Contract::kPaged;
      playQuantized(c, context);
    }
    {
      Case c = base;
      c.name = form + "_float8_e4m3fn_scale_pool_k_norm";
      c.delta = DataType::kHALF, c.pool = DataType::kFP8, c.scalePool = true, c.kNorm = true;
      playQuantized(c, context);
    }
    {
      Case c = base;
      c.name = form + "_int4_scale_pool";
      c.delta = DataType::kBF16, c.pool = DataType::kUINT8, c.scalePool = true;
      playQuantized(c, context);
    }
    {
      Case c = base;
      c.name = form + "_int4_scale_pool_k_norm_v_norm_odd_sizes";
      c.delta = DataType::kHALF, c.pool = DataType::kUINT8, c.scalePool = true;
      c.H = 3, c.D = 6, c.R = 2, c.kNorm = c.vNorm = true;
      playQuantized(c, context);
    }
  }
}

}  // namespace harness
