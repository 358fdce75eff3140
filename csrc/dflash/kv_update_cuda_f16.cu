// Kernel instantiations for F16 pools (see kv_update_kernel.cuh).
#include "dflash/kv_update_kernel.cuh"

DFLASH_INSTANTIATE_POOL(F16)
