// STRATA_EXPORT marks the public API of libstrata. The library is built with
// hidden visibility, so only marked classes and functions are exported.
#pragma once

#define STRATA_EXPORT __attribute__((visibility("default")))
