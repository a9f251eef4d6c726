// The C++ store behind a Python strata._Store (python/src/store_bindings.cc),
// for binding files that bootstrap through one (strata.init under torchrun).
#pragma once

#include <memory>

#include "strata/comm/store.h"

namespace strata::bindings {

struct PyStore {
  std::shared_ptr<Store> store;
};

}  // namespace strata::bindings
