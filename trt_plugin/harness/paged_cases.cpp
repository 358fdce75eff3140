// The paged contract (Edge-LLM 0.11): the builder's and runtime's sequence for every pool dtype
// (the field-less node first), ring addressing, FP8 pools and the fused norms.
#include "cases.h"
#include "sequence.h"

namespace harness {

namespace {

// T and the table's B dynamic, everything else fixed.
void playPaged(Case opt, IPluginResourceContext* context) {
  Case min = opt, max = opt;
  min.T = 1, min.B = 1;
  max.T = 1024, max.B = 16;
  Played played = playContract(min, opt, max, context);
  if (played.rt != nullptr) enqueueEmpty(played.rt, opt);
}

}  // namespace

void pagedContractCases(IPluginResourceContext* context) {
  Group group(kPagedContractGroup);
  requireGroup(kPagedContractGroup);
  Case base;
  base.contract = Contract::kPaged;
  base.T = 24, base.H = 8, base.D = 128, base.N = 16, base.B = 4, base.M = 4, base.R = 64;
  for (DataType type : {DataType::kHALF, DataType::kBF16, DataType::kFLOAT}) {
    Case c = base;
    c.name = "paged_" + dtypeName(type) + (type == DataType::kHALF ? "_edge_llm_0_11_fieldless" : "");
    c.delta = c.pool = type;
    playPaged(c, context);
  }
  {
    Case c = base;
    c.name = "paged_fp8_per_head_scales_ring";
    c.delta = DataType::kHALF, c.pool = DataType::kFP8, c.scaleHeads = c.H, c.ring = true;
    playPaged(c, context);
  }
  {
    Case c = base;
    c.name = "paged_fp8_per_tensor_scales_k_norm_v_norm";
    c.delta = DataType::kFLOAT, c.pool = DataType::kFP8, c.scaleHeads = 1;
    c.kNorm = c.vNorm = true, c.eps = 1e-5f;
    playPaged(c, context);
  }
  {
    Case c = base;
    c.name = "paged_bfloat16_k_norm_partial_rotary";
    c.delta = c.pool = DataType::kBF16, c.kNorm = true, c.R = 32;
    playPaged(c, context);
  }
}

}  // namespace harness
