// The core's checker and descriptors, bound into the CPU extension (contract_bindings.cc).
#pragma once

#include <nanobind/nanobind.h>

namespace dflash::jax {

void bind_contract(nanobind::module_& m);

}  // namespace dflash::jax
