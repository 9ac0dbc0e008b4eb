// safetensors reader/writer. The header is validated fully (offsets in range, sizes matching
// shape x dtype, no overlap past the data) before any byte is trusted.
#include "common/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/json_text.h"

namespace hetero {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// One file's parsed and validated header: every tensor's dtype, shape and data range.
struct Header {
  std::map<std::string, TensorEntry> entries;  // offsets from the start of the file
  std::map<std::string, std::string> metadata;
};

// Parses the header of the open file `in` (path for messages). Sizes from the header are checked
// without overflow against the file: a negative dim or a product that wraps cannot make a tensor
// look like it fits.
Result<Header> read_header(std::istream& in, const std::string& path) {
  in.seekg(0, std::ios::end);
  const int64_t file_bytes = static_cast<int64_t>(in.tellg());
  in.seekg(0);
  uint64_t header_bytes = 0;
  if (file_bytes < 8 || !in.read(reinterpret_cast<char*>(&header_bytes), 8))
    return data_loss(path + ": too short for a safetensors header");
  if (header_bytes > static_cast<uint64_t>(file_bytes - 8) || header_bytes > (100u << 20))
    return data_loss(path + ": header length " + std::to_string(header_bytes) + " out of range");
  std::string header(header_bytes, '\0');
  in.read(header.data(), static_cast<std::streamsize>(header_bytes));
  auto parsed = parse_untrusted_json(header);
  if (!parsed.is_ok() || !parsed->is_object())
    return data_loss(path + ": header is not a JSON object");
  const json& h = parsed.value();
  const int64_t data_start = 8 + static_cast<int64_t>(header_bytes);
  const int64_t data_bytes = file_bytes - data_start;

  Header out;
  for (auto& [name, info] : h.items()) {
    if (name == "__metadata__") {
      if (info.is_object())
        for (auto& [k, v] : info.items())
          if (v.is_string()) out.metadata[k] = v.get<std::string>();
      continue;
    }
    if (!info.is_object() || !info.contains("dtype") || !info["dtype"].is_string() ||
        !info.contains("shape") || !info["shape"].is_array() || !info.contains("data_offsets") ||
        !info["data_offsets"].is_array() || info["data_offsets"].size() != 2 ||
        !info["data_offsets"][0].is_number_integer() ||
        !info["data_offsets"][1].is_number_integer())
      return data_loss(path + ": tensor '" + name + "' has an incomplete header entry");
    auto dt = dtype_from_name(info["dtype"].get<std::string>());
    if (!dt.is_ok()) return data_loss(path + ": tensor '" + name + "': " + dt.status().message());
    TensorEntry t;
    t.dtype = dt.value();
    int64_t want = dtype_size(t.dtype);
    for (auto& d : info["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0 ||
          __builtin_mul_overflow(want, d.get<int64_t>(), &want) || want > data_bytes)
        return data_loss(path + ": tensor '" + name + "' has a bad shape " + info["shape"].dump());
      t.shape.push_back(d.get<int64_t>());
    }
    const int64_t begin = info["data_offsets"][0].get<int64_t>();
    const int64_t end = info["data_offsets"][1].get<int64_t>();
    if (begin < 0 || end < begin || end > data_bytes || end - begin != want)
      return data_loss(path + ": tensor '" + name + "' offsets [" + std::to_string(begin) + "," +
                       std::to_string(end) + ") do not match shape " + info["shape"].dump());
    t.offset = data_start + begin;
    t.bytes = want;
    out.entries.emplace(name, std::move(t));
  }
  return out;
}

// model.safetensors, or else every *.safetensors file of dir, sorted.
Result<std::vector<std::string>> checkpoint_files(const std::string& dir) {
  std::vector<std::string> files;
  if (fs::exists(fs::path(dir) / "model.safetensors")) {
    files.push_back((fs::path(dir) / "model.safetensors").string());
  } else {
    std::error_code ec;
    for (auto& e : fs::directory_iterator(dir, ec))
      if (e.path().extension() == ".safetensors") files.push_back(e.path().string());
    if (ec) return not_found("cannot list checkpoint directory " + dir + ": " + ec.message());
    std::sort(files.begin(), files.end());
  }
  if (files.empty()) return not_found("no .safetensors files in " + dir);
  return files;
}

}  // namespace

int64_t TensorEntry::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

Result<SafetensorsFile> read_safetensors(const std::string& path, const TensorFilter& keep) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return not_found("cannot open " + path);
  HETERO_ASSIGN_OR_RETURN(Header h, read_header(in, path));
  SafetensorsFile out;
  out.metadata = std::move(h.metadata);
  for (auto& [name, e] : h.entries) {
    if (keep && !keep(name)) continue;
    Tensor t;
    t.dtype = e.dtype;
    t.shape = e.shape;
    t.bytes.resize(static_cast<size_t>(e.bytes));
    in.seekg(e.offset);
    if (e.bytes > 0 && !in.read(reinterpret_cast<char*>(t.bytes.data()), e.bytes))
      return data_loss(path + ": short read of tensor '" + name + "'");
    out.tensors.emplace(name, std::move(t));
  }
  return out;
}

Result<TensorMap> read_checkpoint_tensors(const std::string& dir, const TensorFilter& keep) {
  HETERO_ASSIGN_OR_RETURN(std::vector<std::string> files, checkpoint_files(dir));
  TensorMap all;
  for (auto& f : files) {
    auto r = read_safetensors(f, keep);
    if (!r.is_ok()) return r.status();
    for (auto& [k, v] : r->tensors) all.emplace(k, std::move(v));
  }
  return all;
}

Result<CheckpointReader> CheckpointReader::open(const std::string& dir) {
  HETERO_ASSIGN_OR_RETURN(std::vector<std::string> files, checkpoint_files(dir));
  CheckpointReader r;
  for (const std::string& f : files) {
    std::ifstream in(f, std::ios::binary);
    if (!in) return not_found("cannot open " + f);
    HETERO_ASSIGN_OR_RETURN(Header h, read_header(in, f));
    const int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return not_found("cannot open " + f + ": " + std::strerror(errno));
    r.fds_.push_back(fd);
    r.files_.push_back(f);
    for (auto& [name, e] : h.entries) {
      e.file = static_cast<int>(r.files_.size()) - 1;
      if (!r.entries_.emplace(name, std::move(e)).second)
        return data_loss("tensor '" + name + "' is in two files of " + dir + " (" +
                         r.files_[static_cast<size_t>(r.entries_.at(name).file)] + " and " + f +
                         ")");
    }
  }
  return r;
}

CheckpointReader::CheckpointReader(CheckpointReader&& o) noexcept { *this = std::move(o); }

CheckpointReader& CheckpointReader::operator=(CheckpointReader&& o) noexcept {
  if (this != &o) {
    for (int fd : fds_) ::close(fd);
    files_ = std::move(o.files_);
    fds_ = std::move(o.fds_);
    entries_ = std::move(o.entries_);
    o.fds_.clear();
  }
  return *this;
}

CheckpointReader::~CheckpointReader() {
  for (int fd : fds_) ::close(fd);
}

const TensorEntry* CheckpointReader::find(const std::string& name) const {
  auto it = entries_.find(name);
  return it == entries_.end() ? nullptr : &it->second;
}

Status CheckpointReader::read(const TensorEntry& e, int64_t offset, int64_t n, void* dst) const {
  if (offset < 0 || n < 0 || offset + n > e.bytes)
    return invalid_argument("read of [" + std::to_string(offset) + ", +" + std::to_string(n) +
                            ") past a tensor of " + std::to_string(e.bytes) + " bytes");
  auto* out = static_cast<char*>(dst);
  const int fd = fds_[static_cast<size_t>(e.file)];
  int64_t done = 0;
  while (done < n) {
    const ssize_t got = ::pread(fd, out + done, static_cast<size_t>(n - done),
                                static_cast<off_t>(e.offset + offset + done));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0)
      return data_loss("short read of " + files_[static_cast<size_t>(e.file)] + ": " +
                       (got < 0 ? std::strerror(errno) : "end of file"));
    done += got;
  }
  return Status::ok();
}

Status write_safetensors(const std::string& path, const TensorMap& tensors,
                         const std::map<std::string, std::string>& metadata) {
  TensorViews views;
  for (const auto& [name, t] : tensors) views.emplace(name, TensorView::of(t));
  return write_safetensors(path, views, metadata);
}

Status write_safetensors(const std::string& path, const TensorViews& tensors,
                         const std::map<std::string, std::string>& metadata) {
  json h = json::object();
  int64_t offset = 0;
  for (auto& [name, t] : tensors) {
    h[name] = {{"dtype", dtype_name(t.dtype)},
               {"shape", t.shape},
               {"data_offsets", {offset, offset + t.nbytes}}};
    offset += t.nbytes;
  }
  if (!metadata.empty()) h["__metadata__"] = metadata;
  std::string header = h.dump();
  while (header.size() % 8 != 0) header.push_back(' ');  // keep the data 8-byte aligned
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return unavailable("cannot write " + tmp);
    uint64_t n = header.size();
    out.write(reinterpret_cast<const char*>(&n), 8);
    out.write(header.data(), static_cast<std::streamsize>(header.size()));
    for (auto& [name, t] : tensors)
      out.write(static_cast<const char*>(t.data), static_cast<std::streamsize>(t.nbytes));
    if (!out) return unavailable("short write to " + tmp);
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) return unavailable("cannot rename " + tmp + ": " + ec.message());
  return Status::ok();
}

}  // namespace hetero
