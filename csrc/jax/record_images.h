// The kernel images of the FFI record stage: per pool format, the CUBIN of its pool unit
// (kv_update_cuda_<format>.cu) compiled for one architecture (DFLASH_RECORD_ARCH), embedded by
// cmake/FfiRecordStage.cmake's generated record_images.cc. Built only with DFLASH_FFI_RECORD.
#pragma once

#include <cstddef>

#include "dflash/kv_update.h"

namespace dflash::jax {

struct RecordImage {
  unsigned char const* data;
  size_t size;  // 0: no image for this pool format
};

RecordImage record_image(DType pool);

}  // namespace dflash::jax
