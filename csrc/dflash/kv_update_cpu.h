// The CPU implementation of the update (see kv_update.h for the contract).
#pragma once

#include "dflash/kv_update.h"

namespace dflash {

// Writes the accepted tokens into p.pool in place. p must have passed check_params().
void target_kv_cache_update_cpu(KVUpdateParams const& p);

}  // namespace dflash
