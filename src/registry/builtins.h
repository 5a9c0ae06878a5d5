// The built-in models and datasets, registered by the registry itself on its first use
// (explicit calls rather than static objects: nothing for the linker to drop, and no
// dependence on the order in which the library's static objects are constructed).
#pragma once

namespace tandem::models {
void register_builtin_models();  // models/registry.cpp
}  // namespace tandem::models

namespace tandem::data {
void register_builtin_datasets();  // src/data/datasets.cpp
}  // namespace tandem::data
