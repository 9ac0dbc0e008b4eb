// What the DeepSeek-V4 prefill service must do whatever its engine (the CPU engine, or the CUDA
// layer pipeline with the staged GPU programs): stream a request through the service and
// assemble it; give a waiting request its turn and still send the arrays it sends alone; stream
// a later turn's tail from the first turn's checkpoints. Shared by tests/unit/dsv4_tail_test.cc
// and tests/gpu/dsv4_served_gpu_test.cc.
#pragma once

#include <gtest/gtest.h>
#include <httplib.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "bridge/dsv4_program.h"
#include "bridge/dsv4_stream.h"
#include "bridge/wire.h"
#include "prefill/service.h"

namespace hetero {

inline std::vector<int64_t> join_calls(std::vector<int64_t> a, const std::vector<int64_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

inline int64_t total_calls(const std::vector<int64_t>& calls) {
  int64_t n = 0;
  for (int64_t c : calls) n += c;
  return n;
}

// A service over some engine, the decoder weights its programs use, and the prompt's ids.
struct Dsv4Served {
  PrefillService* service;
  const Dsv4DecoderWeights* weights;
  const std::vector<int32_t>* ids;

  // A response's frames into the assembler, keep-alives skipped (status of the assembly).
  static Status assemble(const std::string& bytes, Dsv4Assembler* a) {
    FrameParser parser(int64_t{1} << 28);
    parser.feed(bytes.data(), bytes.size());
    for (;;) {
      HETERO_ASSIGN_OR_RETURN(auto frame, parser.next());
      if (!frame) return data_loss("no manifest");
      const std::string kind = frame->header.value("kind", "");
      if (kind == "keepalive") continue;
      if (kind == "manifest") {
        HETERO_ASSIGN_OR_RETURN(Manifest got, decode_manifest(*frame));
        return a->finish(got);
      }
      HETERO_ASSIGN_OR_RETURN(Segment s, decode_segment(*frame));
      HETERO_RETURN_IF_ERROR(a->accept(s));
    }
  }

  // Runs a request in-process and assembles its stream (the manifest's reason in *reason).
  Status run(int64_t T, int64_t start, const std::vector<int64_t>& calls, Dsv4Assembler* a,
             std::string* reason = nullptr) const {
    PrefillRequest req;
    req.ids.assign(ids->begin(), ids->begin() + T);
    req.fingerprint = weights->layout.fingerprint;
    req.start = start;
    req.decoder_calls = calls;
    std::string bytes;
    const Manifest m = service->run(req, [&](std::string f) {
      bytes += f;
      return true;
    });
    if (reason) *reason = m.reason;
    return assemble(bytes, a);
  }
};

// Turns: a long request (T tokens, `calls`) that has held the engine past --turn-ms while a short
// one (S tokens) waits gives it up at a chunk boundary, keeping the engine's checkpoint there,
// and resumes from it after the short one with the decoder's calls from that boundary: its
// stream gives the arrays it gives alone. Starts and stops the service's HTTP server.
inline void expect_turn_given_and_same_arrays(const Dsv4Served& s, int64_t T,
                                              const std::vector<int64_t>& calls, int64_t S,
                                              const std::vector<int64_t>& short_calls) {
  const DecoderCacheLayout& layout = s.weights->layout;
  Dsv4Assembler alone(layout, T);
  std::string reason;
  const Status st = s.run(T, 0, calls, &alone, &reason);  // no HTTP: never gives the engine up
  ASSERT_TRUE(st.is_ok()) << st.to_string() << "; " << reason;
  s.service->set_turn_ms(1);
  ASSERT_TRUE(s.service->start("127.0.0.1", 0).is_ok());
  auto post = [&](int64_t n, const std::vector<int64_t>& c, Dsv4Assembler* a,
                  std::chrono::steady_clock::time_point* done) {
    httplib::Client cli("127.0.0.1", s.service->bound_port());
    cli.set_read_timeout(120, 0);
    const nlohmann::json body = {{"ids", std::vector<int32_t>(s.ids->begin(), s.ids->begin() + n)},
                                 {"fingerprint", layout.fingerprint},
                                 {"decoder_calls", c}};
    auto res = cli.Post("/v1/prefill", body.dump(), "application/json");
    *done = std::chrono::steady_clock::now();
    if (!res || res->status != 200) return internal_error(res ? res->body : "no response");
    return Dsv4Served::assemble(res->body, a);
  };
  Dsv4Assembler long_one(layout, T), short_one(layout, S);
  std::chrono::steady_clock::time_point long_done, short_done;
  Status long_st, short_st;
  std::thread a([&] { long_st = post(T, calls, &long_one, &long_done); });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the long one holds the engine
  std::thread b([&] { short_st = post(S, short_calls, &short_one, &short_done); });
  a.join();
  b.join();
  s.service->stop();
  ASSERT_TRUE(long_st.is_ok()) << long_st.to_string();
  ASSERT_TRUE(short_st.is_ok()) << short_st.to_string();
  EXPECT_LT(short_done, long_done);  // the short one did not wait for the whole long one
  const TensorMap want = alone.arrays(T).value(), got = long_one.arrays(T).value();
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, t] : want) EXPECT_EQ(got.at(name).bytes, t.bytes) << name;
}

// Tails: without a first turn a tail is refused (its start has no checkpoint); after one, the
// second turn's tail streams from the first turn's checkpoints the rows the whole request gives
// past the first turn (its pooled rows, joined after the first turn's, are the whole request's)
// and the same state at its end; and the chain goes on (the first turn's checkpoint is still
// held for another tail).
inline void expect_tail_from_first_turn(const Dsv4Served& s, const std::vector<int64_t>& turn1,
                                        const std::vector<int64_t>& turn2) {
  const DecoderCacheLayout& layout = s.weights->layout;
  const int64_t C = total_calls(turn1), T = C + total_calls(turn2);
  Dsv4Assembler none(layout, T, "", C);
  std::string reason;
  EXPECT_FALSE(s.run(T, C, turn2, &none, &reason).is_ok());
  EXPECT_NE(reason.find("no checkpoint of exactly the first " + std::to_string(C) + " tokens"),
            std::string::npos)
      << reason;

  Dsv4Assembler whole(layout, T);  // the truth: one request with both turns' calls
  Status st = s.run(T, 0, join_calls(turn1, turn2), &whole, &reason);
  ASSERT_TRUE(st.is_ok()) << st.to_string() << "; " << reason;
  Dsv4Assembler first(layout, C);
  st = s.run(C, 0, turn1, &first, &reason);
  ASSERT_TRUE(st.is_ok()) << st.to_string() << "; " << reason;
  Dsv4Assembler tail(layout, T, "", C);
  st = s.run(T, C, turn2, &tail, &reason);
  ASSERT_TRUE(st.is_ok()) << st.to_string() << "; " << reason;
  ASSERT_TRUE(tail.can_mount(T));
  EXPECT_EQ(tail.entry_extra()["start"].get<int64_t>(), C);
  const TensorMap want = whole.arrays(T).value(), got = tail.arrays(T).value(),
                  head = first.arrays(C).value();
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, t] : want) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(got.count(name));
    if (name.ends_with(".pooled")) {  // the first turn's rows, then the tail's
      const int64_t r = s.weights->layers[std::stoul(name.substr(7))].ratio;  // "layers.{i}.*"
      EXPECT_EQ(head.at(name).shape[1], C / r);
      std::vector<uint8_t> joined = head.at(name).bytes;
      joined.insert(joined.end(), got.at(name).bytes.begin(), got.at(name).bytes.end());
      EXPECT_EQ(joined, t.bytes);
    } else {
      EXPECT_EQ(got.at(name).shape, t.shape);
      EXPECT_EQ(got.at(name).bytes, t.bytes);
    }
  }
  Dsv4Assembler again(layout, T, "", C);
  st = s.run(T, C, turn2, &again, &reason);
  EXPECT_TRUE(st.is_ok()) << st.to_string() << "; " << reason;
}

}  // namespace hetero
