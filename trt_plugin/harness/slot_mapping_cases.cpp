// The slot-mapping form (vLLM's reshape_and_cache_flash addressing): the builder's and runtime's
// sequence with the form field, int32 and int64 slots, every pool dtype, FP8 pools and the norms.
#include "cases.h"
#include "sequence.h"

namespace harness {

namespace {

// T dynamic, everything else fixed.
void playSlotMapping(Case opt, IPluginResourceContext* context) {
  Case min = opt, max = opt;
  min.T = 1;
  max.T = 1024;
  Played played = playContract(min, opt, max, context);
  if (played.rt != nullptr) enqueueEmpty(played.rt, opt);
}

}  // namespace

void slotMappingContractCases(IPluginResourceContext* context) {
  Group group(kSlotMappingContractGroup);
  requireGroup(kSlotMappingContractGroup);
  Case base;
  base.contract = Contract::kSlotMapping;
  base.T = 24, base.H = 8, base.D = 128, base.N = 16, base.R = 64;
  for (DataType type : {DataType::kHALF, DataType::kBF16, DataType::kFLOAT}) {
    Case c = base;
    c.name = "slot_mapping_" + dtypeName(type);
    c.delta = c.pool = type;
    playSlotMapping(c, context);
  }
  {
    Case c = base;
    c.name = "slot_mapping_int32_slots";
    c.slotIndex = DataType::kINT32;
    playSlotMapping(c, context);
  }
  {
    Case c = base;
    c.name = "slot_mapping_fp8_per_head_scales_k_norm_v_norm";
    c.delta = DataType::kBF16, c.pool = DataType::kFP8, c.scaleHeads = c.H;
    c.kNorm = c.vNorm = true, c.eps = 1e-5f;
    playSlotMapping(c, context);
  }
}

}  // namespace harness
