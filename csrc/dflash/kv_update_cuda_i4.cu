// Kernel instantiations for int4 pools (see kv_update_kernel.cuh).
#include "dflash/kv_update_kernel.cuh"

DFLASH_INSTANTIATE_POOL(I4)
