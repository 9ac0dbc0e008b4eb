// `hetero compare GOT WANT`: every tensor of WANT against the same-named tensor of GOT with
// the project's one comparison helper. Prints one JSON object; exit 0 only if all pass.
#include <cstdio>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "common/compare.h"
#include "common/safetensors.h"
#include "front/front.h"

namespace hetero {

Options compare_options() {
  return Options("compare", "Compare tensors of two safetensors files (GOT WANT).",
                 {
                     {"max-ulp", "", "0", "allowed distance in ULPs of the dtype"},
                     {"max-abs", "", "0", "allowed absolute difference (either suffices)"},
                     {"min-cosine", "", "-2", "cosine floor per tensor"},
                     {"reason", "", "bit-exact", "why this tolerance (required when loose)"},
                 });
}

int cmd_compare(int argc, char** argv) {
  Options opts = compare_options();
  if (int rc = parse_options(opts, argc, argv); rc >= 0) return rc;
  if (opts.positional().size() != 2)
    return std::fprintf(stderr, "compare: need GOT and WANT files\n"), 2;
  auto got = read_safetensors(opts.positional()[0]);
  auto want = read_safetensors(opts.positional()[1]);
  if (!got.is_ok() || !want.is_ok())
    return std::fprintf(stderr, "compare: %s\n",
                        (got.is_ok() ? want.status() : got.status()).to_string().c_str()),
           1;
  CompareSpec spec;
  auto max_ulp = opts.get_int("max-ulp");
  auto max_abs = opts.get_double("max-abs");
  auto min_cosine = opts.get_double("min-cosine");
  for (const Status& st : {max_ulp.status(), max_abs.status(), min_cosine.status()})
    if (!st.is_ok()) return std::fprintf(stderr, "compare: %s\n", st.message().c_str()), 2;
  spec.max_ulp = max_ulp.value();
  spec.max_abs = max_abs.value();
  spec.min_cosine = min_cosine.value();
  spec.reason = opts.get("reason");
  nlohmann::json report = {{"tolerance",
                            {{"max_ulp", spec.max_ulp},
                             {"max_abs", spec.max_abs},
                             {"min_cosine", spec.min_cosine},
                             {"reason", spec.reason}}}};
  bool all = true;
  int64_t exact = 0;
  nlohmann::json failures = nlohmann::json::array();
  int64_t worst_ulp = 0;
  double min_eq = 1.0;
  for (const auto& [name, w] : want->tensors) {
    auto it = got->tensors.find(name);
    if (it == got->tensors.end()) {
      all = false;
      failures.push_back({{"name", name}, {"message", "missing"}});
      continue;
    }
    CompareReport r = compare_tensors(it->second, w, spec);
    worst_ulp = std::max(worst_ulp, r.max_ulp);
    min_eq = std::min(min_eq, r.equal_fraction);
    if (r.equal_fraction == 1.0) ++exact;
    if (!r.pass) {
      all = false;
      nlohmann::json f = r.to_json();
      f["name"] = name;
      failures.push_back(f);
    }
  }
  report["tensors"] = want->tensors.size();
  report["bit_exact_tensors"] = exact;
  report["max_ulp"] = worst_ulp;
  report["min_equal_fraction"] = min_eq;
  report["failures"] = failures;
  report["pass"] = all;
  std::printf("%s\n", report.dump().c_str());
  return all ? 0 : 1;
}

int cmd_options_doc(int, char**) {
  for (Options o : {prefill_options(), front_options(), up_options(), doctor_options(),
                    verify_options(), program_options(), compare_options()})
    std::fputs(o.markdown_table().c_str(), stdout);
  return 0;
}

}  // namespace hetero
