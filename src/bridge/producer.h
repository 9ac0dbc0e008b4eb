// The bridge producer: the tap's consumer on the prefill host. It copies each attention input
// into a bounded queue (so the forward does not wait on it unless the program falls a few
// layers behind), runs the cache program on its own thread, and emits one segment as soon as
// every layer has passed a chunk boundary, then a manifest.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <string>
#include <thread>

#include "bridge/llama_program.h"
#include "bridge/wire.h"
#include "common/queue.h"
#include "engine/tap.h"

namespace hetero {

class LlamaBridgeProducer {
 public:
  // sink receives each encoded frame in order; returning false cancels the capture.
  using FrameSink = std::function<bool(std::string frame)>;
  LlamaBridgeProducer(const LlamaCacheProgram* program, FrameSink sink,
                      size_t max_queued_inputs = 4);
  ~LlamaBridgeProducer();

  AttentionInputTap tap();
  // Ends the stream: drains the queue, then sends the manifest. engine_status says whether
  // the forward finished; the manifest is complete only when it did and every row was sent.
  Manifest finish(int64_t requested_tokens, const Status& engine_status);
  bool cancelled() const { return cancelled_.load(); }

 private:
  struct Work {
    int32_t layer;
    int64_t pos0, n;
    std::vector<uint16_t> x;
  };
  struct Pending {
    int64_t n = 0;
    int64_t layers_done = 0;
    std::vector<KvRows> rows;
  };
  void run();

  const LlamaCacheProgram* program_;
  FrameSink sink_;
  BoundedQueue<Work> queue_;
  std::thread worker_;
  std::map<int64_t, Pending> pending_;  // by pos0; touched by the worker only
  int64_t next_seq_ = 0, covered_ = 0;
  std::atomic<bool> cancelled_{false};
  bool finished_ = false;
};

}  // namespace hetero
