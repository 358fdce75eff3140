// Kernel instantiations for E5M2 pools (see kv_update_kernel.cuh).
#include "dflash/kv_update_kernel.cuh"

DFLASH_INSTANTIATE_POOL(E5M2)
