// The C interface of the TensorBoard event codec (libtandem_tensorboard_events.so), the one
// module that links protobuf. tandem/tensorboard.h's writer loads it with RTLD_DEEPBIND (see
// src/engine/tensorboard.cpp), so only plain C types cross it. Private to src/engine.
#pragma once

#include <cstddef>
#include <cstdint>

extern "C" {

// An Event at `wall_time` and `step`: the file version when `file_version` is not null, else a
// summary of one scalar `tag` = `value`. Writes the encoding into out[0, cap) when it fits and
// returns its size (a caller whose buffer was short calls again with that size).
size_t tandem_tb_encode_event(double wall_time, int64_t step, const char* file_version, const char* tag, float value,
                              char* out, size_t cap);

// Parses an Event. Returns 1 for a file version (its text in `text`), 2 for a summary whose
// first value is a scalar (its tag in `text`, the value in *value), 0 for anything else or
// bytes that do not parse. `text` receives at most text_cap - 1 characters and a NUL.
int tandem_tb_decode_event(const char* data, size_t n, double* wall_time, int64_t* step, char* text, size_t text_cap,
                           float* value);
}
