// TensorBoard event files (--tensorboard DIR): the curves of a training run as TensorBoard reads
// them, written while it trains. A file events.out.tfevents.<seconds>.<host> in DIR holds
// TFRecords (u64 length, masked CRC-32C of the length, the data, masked CRC-32C of the data),
// each an Event protocol buffer: first the file version "brain.Event:2", then one scalar
// summary per figure and step. Records are flushed after every step, so a run killed midway
// leaves the curves up to its last step. The loops write the same figures as the --metrics
// file (tandem/report.h, StepFigures): rank 0 writes, the other ranks hold a writer that does
// nothing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "tandem/report.h"

namespace tandem::tensorboard {

// CRC-32C (Castagnoli), as TFRecord frames records with, and TFRecord's mask of it.
uint32_t crc32c(const void* data, size_t n);
uint32_t masked_crc32c(const void* data, size_t n);
// One TFRecord holding `payload`.
std::string frame_record(const std::string& payload);

// An Event as read back.
struct Event {
  double wall_time = 0.0;
  int64_t step = 0;
  std::string file_version;  // the first event of a file
  std::string tag;           // a scalar's
  float value = 0.0f;
};
// Every event of an event file, each record's CRCs checked; throws std::runtime_error naming the
// file and the offset of a record that is cut short, fails its CRC or does not parse.
std::vector<Event> read_events(const std::string& path);

// Creates `dir` (and its parents) and checks that a file can be written in it; throws
// std::invalid_argument naming the directory and what to do otherwise. Commands call it before
// training starts.
void check_dir(const std::string& dir);

// One event file in a directory.
class Writer {
 public:
  // Creates the directory (check_dir) and a new event file in it, and writes the file version.
  // Throws as check_dir does.
  explicit Writer(const std::string& dir);
  void scalar(const std::string& tag, double value, int64_t step);  // float32, as TensorBoard keeps them
  void flush();  // throws std::runtime_error naming the file when the writes failed (disk full?)
  const std::string& path() const { return path_; }

 private:
  void write_event(const std::string& event);  // the encoded Event, framed
  std::string path_;
  std::ofstream out_;
};

// A training loop's live curves: nothing unless `dir` is set and `writer` (rank 0) is true.
// Tags: train/loss, train/lr, train/samples_per_second, train/grad_norm (when the engine
// computed it), train/loss_scale, train/peak_rss_bytes, train/comm_share per step; after the
// loop final/samples_per_second and, where evaluated, final/test_accuracy and
// final/eval_loss, at the last step.
class Log {
 public:
  Log(const std::string& dir, bool writer);
  ~Log();
  Log(const Log&) = delete;
  Log& operator=(const Log&) = delete;
  bool active() const { return writer_ != nullptr; }
  void step(int64_t step, double loss, const StepFigures& f);  // writes and flushes
  void finish(const Report& rep);                              // the run's figures, flushed

 private:
  std::unique_ptr<Writer> writer_;
};

}  // namespace tandem::tensorboard
