// Writes the fuzz targets' seed corpora (fuzz/corpus/<target>/): well-formed inputs of each
// kind, from the project's own writers, for libFuzzer to mutate. Deterministic; the corpora
// are committed, and `make fuzz` rewrites them first so they follow the formats.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "bridge/prefill_request.h"
#include "bridge/wire.h"
#include "common/safetensors.h"
#include "fuzz_layouts.h"

namespace fs = std::filesystem;
using namespace hetero;

namespace {

void put(const fs::path& dir, const std::string& name, const std::string& bytes) {
  fs::create_directories(dir);
  std::ofstream(dir / name, std::ios::binary) << bytes;
}

// A llama segment of rows [pos0, pos0 + n) in fuzz::llama_layout's shapes.
Segment llama_segment(int64_t seq, int64_t pos0, int64_t n) {
  const DecoderCacheLayout l = fuzz::llama_layout();
  Segment s;
  s.seq = seq, s.family = l.family, s.fingerprint = l.fingerprint, s.pos0 = pos0, s.n_tokens = n;
  for (int64_t layer = 0; layer < l.layers; ++layer)
    for (const char* kind : {".keys", ".values"}) {
      Tensor t(DType::kBF16, {l.kv_heads, n, l.head_dim});
      for (int64_t i = 0; i < t.numel(); ++i) t.data<uint16_t>()[i] = static_cast<uint16_t>(i);
      s.arrays.push_back({"layers." + std::to_string(layer) + kind, std::move(t)});
    }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  const fs::path root = argc > 1 ? argv[1] : "fuzz/corpus";
  const int64_t T = fuzz::kRequestedTokens;
  const std::string whole = encode_segment(llama_segment(0, 0, 16)) +
                            encode_segment(llama_segment(1, 16, T - 16)) +
                            encode_manifest({"fp", T, T, 2, true, "", "exact"});
  const std::string broken = encode_segment(llama_segment(0, 0, 16)) +
                             encode_manifest({"fp", T, 16, 1, false, "engine failed", "exact"});
  // The first byte: bit 0 the family (llama 0), bit 1 tagged frames, the rest the piece length.
  put(root / "wire", "llama-whole-bytewise", std::string(1, '\x00') + whole);
  put(root / "wire", "llama-whole-8", std::string(1, '\x1c') + whole);
  put(root / "wire", "llama-ended-early", std::string(1, '\x3c') + broken);
  put(root / "wire", "dsv4-manifest-only",
      std::string(1, '\x01') + encode_manifest({"fp", T, 0, 0, false, "refused", "fast"}));
  // The whole stream as a host holding the secret sends it: each frame, then its salt and tag
  // (the salts are random: the seed differs each time it is made).
  const FrameTagger tagger(fuzz::kSecret, fuzz::kNonce);
  std::string tagged;
  uint64_t index = 0;
  for (std::string f : {encode_segment(llama_segment(0, 0, 16), nullptr, &tagger),
                        encode_segment(llama_segment(1, 16, T - 16), nullptr, &tagger),
                        encode_manifest({"fp", T, T, 2, true, "", "exact"}, &tagger)}) {
    tagger.seal(index++, &f);
    tagged += f;
  }
  put(root / "wire", "llama-whole-tagged-8", std::string(1, '\x1e') + tagged);

  put(root / "prefill_request", "plain", prefill_request_json({{1, 2, 3}, "fp", 0, {}}).dump());
  put(root / "prefill_request", "scheduled",
      prefill_request_json({{5, 6, 7, 8}, "fp", 2, {3, 1}, fuzz::kNonce}).dump());
  put(root / "prefill_request", "wrong-fingerprint", R"({"ids":[1],"fingerprint":"other"})");

  put(root / "front_request", "chat",
      R"({"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":4,)"
      R"("stream":true,"stream_options":{"include_usage":true},"temperature":0.5})");
  put(root / "front_request", "completion", R"({"prompt":"hello","max_tokens":8,"top_p":1})");

  const fs::path st = fs::temp_directory_path() / "hetero-fuzz-seed.safetensors";
  TensorMap tensors;
  tensors.emplace("w", Tensor(DType::kBF16, {2, 3}));
  tensors.emplace("b", Tensor(DType::kF32, {3}));
  if (!write_safetensors(st.string(), tensors, {{"format", "pt"}}).is_ok()) return 1;
  std::ifstream in(st, std::ios::binary);
  put(root / "safetensors", "two-tensors", std::string(std::istreambuf_iterator<char>(in), {}));
  fs::remove(st);
  std::printf("seeds written under %s\n", root.c_str());
  return 0;
}
