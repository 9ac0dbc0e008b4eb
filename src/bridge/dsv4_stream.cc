// DeepSeek-V4 segments: see dsv4_stream.h.
#include "bridge/dsv4_stream.h"

#include <cstring>

namespace hetero {
namespace {

std::string layer_name(int64_t layer, const char* what) {
  return "layers." + std::to_string(layer) + "." + what;
}

Tensor rows_tensor(const std::vector<uint16_t>& rows, int64_t width) {
  const int64_t n = width > 0 ? static_cast<int64_t>(rows.size()) / width : 0;
  Tensor t(DType::kBF16, {1, n, width});
  if (!rows.empty()) std::memcpy(t.bytes.data(), rows.data(), rows.size() * 2);
  return t;
}

// The arrays a segment [pos0, pos0+n) carries, with their shapes, in order: the pooled rows, and
// with_state (always at T) the state at its end.
std::vector<std::pair<std::string, std::vector<int64_t>>> expected_arrays(
    const DecoderCacheLayout& l, int64_t pos0, int64_t n, int64_t T, bool with_state) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  const int64_t end = pos0 + n;
  for (int64_t i = 0; i < l.layers; ++i) {
    const int64_t r = l.ratios[static_cast<size_t>(i)];
    if (r == 0) continue;
    const int64_t rows = end / r - pos0 / r;
    out.push_back({layer_name(i, "pool.pooled"), {1, rows, l.head_dim}});
    if (r == 4) out.push_back({layer_name(i, "index.pooled"), {1, rows, l.index_head_dim}});
  }
  if (end != T && !with_state) return out;
  for (int64_t i = 0; i < l.layers; ++i) {
    const int64_t r = l.ratios[static_cast<size_t>(i)];
    out.push_back({layer_name(i, "window"), {1, 1, -1, l.head_dim}});
    if (r == 0) continue;
    const int64_t width = r == 4 ? 2 * l.head_dim : l.head_dim;
    out.push_back({layer_name(i, "pool.buf_kv"), {1, end % r, width}});
    out.push_back({layer_name(i, "pool.buf_gate"), {1, end % r, width}});
    if (r != 4) continue;
    out.push_back({layer_name(i, "index.buf_kv"), {1, end % 4, 2 * l.index_head_dim}});
    out.push_back({layer_name(i, "index.buf_gate"), {1, end % 4, 2 * l.index_head_dim}});
  }
  out.push_back({"window_idx", {1}});
  return out;
}

}  // namespace

void dsv4_feed_arrays(const Dsv4DecoderWeights& weights, int64_t layer, Dsv4NewRows rows,
                      std::vector<WireArray>* arrays) {
  const int64_t r = weights.layers[static_cast<size_t>(layer)].ratio;
  if (r > 0)
    arrays->push_back(
        {layer_name(layer, "pool.pooled"), rows_tensor(rows.pool, weights.layout.head_dim)});
  if (r == 4)
    arrays->push_back(
        {layer_name(layer, "index.pooled"), rows_tensor(rows.index, weights.index_head_dim)});
}

Status dsv4_close_arrays(const Dsv4DecoderWeights& weights, int64_t window_idx,
                         const std::function<Result<Dsv4LayerArrays>(int64_t)>& finish_layer,
                         std::vector<WireArray>* arrays) {
  for (int64_t l = 0; l < weights.layout.layers; ++l) {
    HETERO_ASSIGN_OR_RETURN(Dsv4LayerArrays a, finish_layer(l));
    arrays->push_back({layer_name(l, "window"), std::move(a.window)});
    if (a.ratio == 0) continue;
    arrays->push_back({layer_name(l, "pool.buf_kv"), std::move(a.pool.buf_kv)});
    arrays->push_back({layer_name(l, "pool.buf_gate"), std::move(a.pool.buf_gate)});
    if (a.ratio != 4) continue;
    arrays->push_back({layer_name(l, "index.buf_kv"), std::move(a.index.buf_kv)});
    arrays->push_back({layer_name(l, "index.buf_gate"), std::move(a.index.buf_gate)});
  }
  Tensor idx(DType::kI64, {1});
  idx.data<int64_t>()[0] = window_idx;
  arrays->push_back({"window_idx", std::move(idx)});
  return Status::ok();
}

void Dsv4BoundaryStates::keep(int64_t layers, int64_t end, int64_t layer, Dsv4LayerArrays state) {
  auto& at = at_[end];
  at.resize(static_cast<size_t>(layers));
  at[static_cast<size_t>(layer)] = std::move(state);
}

Status Dsv4BoundaryStates::close(const Dsv4DecoderWeights& weights, int64_t end,
                                 std::vector<WireArray>* arrays) {
  auto it = at_.find(end);
  if (it == at_.end()) return internal_error("no state at row " + std::to_string(end));
  std::vector<Dsv4LayerArrays> state = std::move(it->second);
  at_.erase(it);
  return dsv4_close_arrays(
      weights, std::min(end, weights.window),
      [&state](int64_t l) -> Result<Dsv4LayerArrays> {
        return std::move(state[static_cast<size_t>(l)]);
      },
      arrays);
}

Status Dsv4SegmentProgram::run(int64_t layer, int64_t pos0, int64_t n, const uint16_t* x,
                               std::vector<WireArray>* arrays) {
  Dsv4NewRows rows;
  HETERO_RETURN_IF_ERROR(program_.feed(layer, pos0, n, x, &rows));
  dsv4_feed_arrays(*weights_, layer, std::move(rows), arrays);
  if (pos0 + n < program_.tokens()) {
    HETERO_ASSIGN_OR_RETURN(Dsv4LayerArrays state, program_.boundary_layer(layer));
    boundaries_.keep(weights_->layout.layers, pos0 + n, layer, std::move(state));
  }
  return Status::ok();
}

Status Dsv4SegmentProgram::close_segment(int64_t pos0, int64_t n, std::vector<WireArray>* arrays) {
  const int64_t end = pos0 + n;
  if (end == program_.tokens())
    return dsv4_close_arrays(
        *weights_, program_.window_idx(), [this](int64_t l) { return program_.finish_layer(l); },
        arrays);
  return boundaries_.close(*weights_, end, arrays);
}

Dsv4Assembler::Dsv4Assembler(DecoderCacheLayout expected, int64_t requested_tokens,
                             std::string store_dir, int64_t start)
    : layout_(std::move(expected)),
      requested_(requested_tokens),
      start_(start),
      covered_(start),
      store_dir_(std::move(store_dir)) {
  HETERO_CHECK(start_ >= 0 && start_ < requested_);
  for_each_pooled_array([this](const std::string& name, int64_t width, int64_t rows) {
    rows_[name] = 0;
    if (store_dir_.empty()) pooled_[name].reserve(static_cast<size_t>(rows * width));
  });
}

Dsv4Assembler::~Dsv4Assembler() = default;  // an unpublished entry removes itself

void Dsv4Assembler::for_each_pooled_array(
    const std::function<void(const std::string&, int64_t, int64_t)>& fn) const {
  for (int64_t i = 0; i < layout_.layers; ++i) {
    const int64_t r = layout_.ratios[static_cast<size_t>(i)];
    if (r == 0) continue;
    const int64_t rows = requested_ / r - start_ / r;  // the most a request's stream makes
    fn(layer_name(i, "pool.pooled"), layout_.head_dim, rows);
    if (r == 4) fn(layer_name(i, "index.pooled"), layout_.index_head_dim, rows);
  }
}

Result<TensorMap> Dsv4Assembler::pooled_arrays() const {
  TensorMap out;
  Status st;
  for_each_pooled_array([&](const std::string& name, int64_t width, int64_t) {
    const int64_t n = rows_.at(name);
    Tensor t(DType::kBF16, {1, n, width});
    if (entry_) {
      if (st.is_ok()) st = entry_->file().read_rows(name, 0, n, t.data<uint16_t>());
    } else if (n > 0) {
      std::memcpy(t.bytes.data(), pooled_.at(name).data(), static_cast<size_t>(n * width * 2));
    }
    out.emplace(name, std::move(t));
  });
  HETERO_RETURN_IF_ERROR(st);
  return out;
}

nlohmann::json Dsv4Assembler::entry_extra() const {
  nlohmann::json j = {{"window_idx", window_idx_}};
  if (start_ > 0) j["start"] = start_;
  return j;
}

int64_t Dsv4Assembler::max_segment_bytes() const {
  int64_t bytes = 0;  // the one segment [start, T): every pooled row, the window at its longest
  for (const auto& [name, shape] :
       expected_arrays(layout_, start_, requested_ - start_, requested_, true)) {
    int64_t n = name == "window_idx" ? 8 : 2;
    for (int64_t d : shape) n *= d == -1 ? requested_ : d;
    bytes += n;
  }
  return bytes;
}

Status Dsv4Assembler::accept(const Segment& s) {
  HETERO_RETURN_IF_ERROR(check_segment_order(layout_, requested_, covered_, segments_, s));
  const int64_t end = s.pos0 + s.n_tokens;
  // Before T a segment may carry the state at its end, or not (a program that makes none).
  auto want = expected_arrays(layout_, s.pos0, s.n_tokens, requested_, true);
  if (end != requested_ && s.arrays.size() != want.size())
    want = expected_arrays(layout_, s.pos0, s.n_tokens, requested_, false);
  if (s.arrays.size() != want.size())
    return data_loss("segment has " + std::to_string(s.arrays.size()) + " arrays, expected " +
                     std::to_string(want.size()));
  int64_t window_rows = -1, idx = -1;
  for (size_t k = 0; k < want.size(); ++k) {
    const WireArray& a = s.arrays[k];
    const auto& [name, shape] = want[k];
    if (a.name != name)
      return data_loss("segment array '" + a.name + "' where '" + name + "' belongs");
    if (name == "window_idx") {
      if (a.tensor.dtype != DType::kI64 || a.tensor.shape != shape)
        return data_loss("window_idx is not i64 [1]");
      std::memcpy(&idx, a.data(), sizeof(idx));
      continue;
    }
    std::vector<int64_t> expect = shape;
    if (expect[2] == -1) {  // window rows: the same S in every layer, min(b, window) <= S <= b
      if (a.tensor.shape.size() != 4)
        return data_loss("'" + name + "' is " + a.tensor.shape_string() + ", not 4-D");
      const int64_t S = a.tensor.shape[2];
      if (window_rows < 0) window_rows = S;
      if (S != window_rows || S < std::min(end, layout_.window) || S > end)
        return data_loss("'" + name + "' holds " + std::to_string(S) + " rows at row " +
                         std::to_string(end) + ", window " + std::to_string(layout_.window));
      expect[2] = S;
    }
    if (a.tensor.dtype != DType::kBF16 || a.tensor.shape != expect)
      return data_loss("segment array '" + name + "' is " + dtype_name(a.tensor.dtype) +
                       a.tensor.shape_string() + ", expected BF16 of the decoder's layout");
  }
  if (idx >= 0 && (idx > window_rows || idx < 0))
    return data_loss("window_idx " + std::to_string(idx) + " outside the window's " +
                     std::to_string(window_rows) + " rows");
  // Everything checked: keep it, the pooled rows in the store's file or in memory (a state
  // replaces the one before it).
  if (!store_dir_.empty() && !entry_) {
    std::vector<StoreArray> arrays;
    for_each_pooled_array([&arrays](const std::string& name, int64_t width, int64_t rows) {
      arrays.push_back({name, 1, rows, width});
    });
    std::vector<std::string> state;
    for (const auto& [name, shape] : expected_arrays(layout_, 0, requested_, requested_, true))
      if (!name.ends_with(".pooled") && name != "window_idx") state.push_back(name);
    HETERO_ASSIGN_OR_RETURN(entry_, IncomingEntry::create(store_dir_, layout_, arrays, state));
  }
  if (idx >= 0) tail_.clear();
  for (const WireArray& a : s.arrays) {
    if (a.name == "window_idx") continue;
    if (a.name.ends_with(".pooled")) {
      const auto* src = reinterpret_cast<const uint16_t*>(a.data());
      const int64_t n = a.tensor.shape[1];
      if (entry_)
        HETERO_RETURN_IF_ERROR(entry_->file().write_rows(a.name, rows_[a.name], n, src));
      else
        pooled_[a.name].insert(pooled_[a.name].end(), src, src + a.tensor.numel());
      rows_[a.name] += n;
    } else {
      tail_[a.name] = a.owned();
    }
  }
  if (idx >= 0) window_idx_ = idx, state_at_ = end;
  covered_ += s.n_tokens;
  ++segments_;
  return Status::ok();
}

Status Dsv4Assembler::finish(const Manifest& m) {
  return check_manifest(layout_, requested_, covered_, segments_, m, start_);
}

Result<TensorMap> Dsv4Assembler::arrays(int64_t b) const {
  HETERO_CHECK(can_mount(b));
  HETERO_ASSIGN_OR_RETURN(TensorMap out, pooled_arrays());
  for (const auto& [name, t] : tail_) out[name] = t;
  return out;
}

Result<StoreEntry> Dsv4Assembler::store(const std::string& store_dir,
                                        const DecoderCacheLayout& layout,
                                        const std::vector<int32_t>& ids, int64_t b,
                                        int64_t requested_tokens) {
  if (!can_mount(b) || b > static_cast<int64_t>(ids.size()))
    return invalid_argument(
        "a DeepSeek-V4 store entry needs B at a verified segment's end that "
        "carried its state, not " +
        std::to_string(b));
  TensorViews tail;
  for (const auto& [name, t] : tail_) tail.emplace(name, TensorView::of(t));
  if (entry_ && store_dir == store_dir_) {  // the rows are in the store's file already
    const std::unique_ptr<IncomingEntry> entry = std::move(entry_);  // published or removed
    return entry->publish(layout, ids, b, requested_tokens, entry_extra(), rows_, tail);
  }
  if (entry_) return Assembler::store(store_dir, layout, ids, b, requested_tokens);
  // In memory: the entry written straight from the rows held (no second copy of them).
  TensorViews views = tail;
  for_each_pooled_array([&](const std::string& name, int64_t width, int64_t) {
    views.emplace(name, TensorView{DType::kBF16,
                                   {1, rows_.at(name), width},
                                   pooled_.at(name).data(),
                                   rows_.at(name) * width * 2});
  });
  return write_store_entry(store_dir, layout, ids, b, requested_tokens, views, entry_extra());
}

std::unique_ptr<Assembler> make_assembler(const DecoderCacheLayout& layout,
                                          int64_t requested_tokens, const std::string& store_dir,
                                          int64_t start) {
  if (layout.family == "deepseek_v4")
    return std::make_unique<Dsv4Assembler>(layout, requested_tokens, store_dir, start);
  return std::make_unique<CacheAssembler>(layout, requested_tokens, store_dir, start);
}

}  // namespace hetero
