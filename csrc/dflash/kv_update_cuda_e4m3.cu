// Kernel instantiations for E4M3 pools (see kv_update_kernel.cuh).
#include "dflash/kv_update_kernel.cuh"

DFLASH_INSTANTIATE_POOL(E4M3)
