// Loading DeepSeek-V4 in the official precision from sharded safetensors: how fast, and with
// how much host memory.
//
//   --write DIR [--layers N] [--shape flash|tiny] [--seed S]
//       writes an official-layout checkpoint (model/dsv4_checkpoint_writer.h) at Flash's real
//       widths (a few GB per layer) or the tiny test widths; CPU only. Run it in its own process:
//       the loader's peak RSS below must not include the writer's shards.
//   --load DIR [--tokens T] [--chunk C]
//       streams it onto GPU 0 with weight dtype `checkpoint`, then prefills T random tokens
//       (default 8192) to show the loaded engine runs. One JSON line: bytes on disk, load
//       seconds and GB/s, the host's peak RSS (VmHWM) before and after loading, device bytes
//       of the weights and of the engine, widened FP4 groups that lost bits, prefill tok/s.
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include "bench_common.h"
#include "dsv4_flash_decoder.h"
#include "engine/cuda/dsv4_cuda.h"
#include "model/dsv4_checkpoint_writer.h"

namespace hetero {
namespace {

namespace fs = std::filesystem;

// kB of /proc/self/status's field (VmHWM: peak resident set; VmRSS: now).
int64_t status_kb(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(field, 0) == 0) return std::atoll(line.c_str() + std::strlen(field) + 1);
  return -1;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int run(int argc, char** argv) {
  std::string write_dir, load_dir, shape = "flash";
  int64_t layers = 2, tokens = 8192, chunk = 8192;
  uint64_t seed = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--write")
      write_dir = next();
    else if (a == "--load")
      load_dir = next();
    else if (a == "--layers")
      layers = std::atoll(next().c_str());
    else if (a == "--shape")
      shape = next();
    else if (a == "--seed")
      seed = std::strtoull(next().c_str(), nullptr, 10);
    else if (a == "--tokens")
      tokens = std::atoll(next().c_str());
    else if (a == "--chunk")
      chunk = std::atoll(next().c_str());
    else
      return std::fprintf(stderr,
                          "usage: %s --write DIR [--layers 2] [--shape flash|tiny] [--seed 1] | "
                          "--load DIR [--tokens 8192] [--chunk 8192]\n",
                          argv[0]),
             2;
  }
  if (!write_dir.empty()) {
    if (shape != "flash" && shape != "tiny") return std::fprintf(stderr, "--shape flash|tiny\n"), 2;
    Dsv4Config c = bench::flash_config(layers);
    if (shape == "tiny") {  // the GPU tests' widths, Flash's layer pattern
      c.vocab = 512, c.hidden = 256, c.heads = 8, c.head_dim = 128, c.q_lora_rank = 128;
      c.o_groups = 2, c.o_lora_rank = 64, c.n_routed_experts = 8, c.experts_per_tok = 2;
      c.moe_inter = 128, c.index_n_heads = 16, c.index_topk = 16, c.sliding_window = 32;
      c.index_block = 8, c.index_keep = 4;
    }
    const auto t0 = std::chrono::steady_clock::now();
    const Status st = write_dsv4_official_checkpoint(write_dir, c, seed);
    if (!st.is_ok()) return std::fprintf(stderr, "%s\n", st.to_string().c_str()), 1;
    std::fprintf(stderr, "wrote %s (%lld layers, %s) in %.1f s\n", write_dir.c_str(),
                 static_cast<long long>(layers), shape.c_str(), seconds_since(t0));
    return 0;
  }
  if (load_dir.empty()) return std::fprintf(stderr, "--write or --load\n"), 2;
  int64_t disk = 0;
  int shards = 0;
  for (auto& e : fs::directory_iterator(load_dir))
    if (e.path().extension() == ".safetensors") disk += fs::file_size(e.path()), ++shards;
  cudaFree(nullptr);  // the CUDA context first: its memory is not the loader's
  const int64_t hwm_before = status_kb("VmHWM:");
  Dsv4CudaOptions o;
  o.weight_dtype = cuda::WeightDtype::kCheckpoint;
  const auto t0 = std::chrono::steady_clock::now();
  auto engine = Dsv4CudaEngine::load(load_dir, o);
  if (!engine.is_ok()) return std::fprintf(stderr, "%s\n", engine.status().to_string().c_str()), 1;
  const double load_s = seconds_since(t0);
  const int64_t hwm_after = status_kb("VmHWM:");
  Dsv4CudaEngine& e = **engine;
  Status st = e.reserve(tokens, chunk);
  std::mt19937 rng(3);
  std::vector<int32_t> ids(static_cast<size_t>(tokens));
  for (auto& v : ids) v = static_cast<int32_t>(rng() % static_cast<uint32_t>(e.config().vocab));
  const auto t1 = std::chrono::steady_clock::now();
  for (int64_t at = 0; st.is_ok() && at < tokens; at += chunk)
    st = e.prefill_chunk({ids.begin() + at, ids.begin() + std::min(tokens, at + chunk)}, {});
  if (st.is_ok()) st = e.synchronize();
  if (!st.is_ok()) return std::fprintf(stderr, "prefill: %s\n", st.to_string().c_str()), 1;
  const double prefill_s = seconds_since(t1);
  auto lossy = e.fp4_lossy_groups();
  std::printf(
      "{\"bench\":\"dsv4_checkpoint_load\",\"gpu\":\"%s\",\"dir\":\"%s\",\"layers\":%lld,"
      "\"shards\":%d,\"disk_bytes\":%lld,\"load_s\":%.2f,\"load_gb_s\":%.2f,"
      "\"host_peak_rss_before_mib\":%.1f,\"host_peak_rss_after_mib\":%.1f,"
      "\"weight_device_bytes\":%lld,\"engine_device_bytes\":%lld,\"fp4_lossy_groups\":%lld,"
      "\"tokens\":%lld,\"chunk\":%lld,\"prefill_s\":%.3f,\"prefill_tok_s\":%.1f}\n",
      bench::gpu_name().c_str(), load_dir.c_str(), static_cast<long long>(e.config().layers),
      shards, static_cast<long long>(disk), load_s, disk / load_s / 1e9, hwm_before / 1024.0,
      hwm_after / 1024.0, static_cast<long long>(e.weight_bytes()),
      static_cast<long long>(e.device_bytes()), static_cast<long long>(lossy.is_ok() ? *lossy : -1),
      static_cast<long long>(tokens), static_cast<long long>(chunk), prefill_s, tokens / prefill_s);
  return 0;
}

}  // namespace
}  // namespace hetero

int main(int argc, char** argv) { return hetero::run(argc, argv); }
