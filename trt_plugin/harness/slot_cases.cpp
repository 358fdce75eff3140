// The slot contract (Edge-LLM 0.10): the builder's and runtime's sequence for every pool dtype,
// FP8 pools with per-head and per-tensor scales, and the fused norms.
#include "cases.h"
#include "sequence.h"

namespace harness {

namespace {

// B, L and S dynamic (min 1, max past opt), everything else fixed.
void playSlot(Case opt, IPluginResourceContext* context) {
  Case min = opt, max = opt;
  min.B = min.L = min.S = 1;
  max.B = opt.N / opt.pagesPerSlot;
  max.L = 256;
  max.S = opt.pagesPerSlot * kP;
  Played played = playContract(min, opt, max, context);
  if (played.rt != nullptr) enqueueEmpty(played.rt, opt);
}

}  // namespace

void slotContractCases(IPluginResourceContext* context) {
  Group group(kSlotContractGroup);
  requireGroup(kSlotContractGroup);
  Case base;
  base.contract = Contract::kSlot;
  base.B = 4, base.L = 16, base.H = 8, base.D = 128, base.N = 12, base.pagesPerSlot = 2;
  base.Rb = 1, base.S = 200, base.R = 64;
  for (DataType type : {DataType::kHALF, DataType::kBF16, DataType::kFLOAT}) {
    Case c = base;
    c.name = "slot_" + dtypeName(type);
    c.delta = c.pool = type;
    playSlot(c, context);
  }
  {
    Case c = base;
    c.name = "slot_fp8_per_head_scales";
    c.delta = DataType::kHALF, c.pool = DataType::kFP8, c.scaleHeads = c.H;
    playSlot(c, context);
  }
  {
    Case c = base;
    c.name = "slot_fp8_per_tensor_scales_k_norm_v_norm";
    c.delta = DataType::kBF16, c.pool = DataType::kFP8, c.scaleHeads = 1;
    c.kNorm = c.vNorm = true, c.eps = 1e-5f;
    playSlot(c, context);
  }
  {
    Case c = base;
    c.name = "slot_float32_pool_bfloat16_delta_k_norm";
    c.delta = DataType::kBF16, c.pool = DataType::kFLOAT, c.kNorm = true;
    playSlot(c, context);
  }
}

}  // namespace harness
