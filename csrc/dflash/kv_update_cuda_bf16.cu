// Kernel instantiations for BF16 pools (see kv_update_kernel.cuh).
#include "dflash/kv_update_kernel.cuh"

DFLASH_INSTANTIATE_POOL(BF16)
