// Option table parsing: see options.h.
#include "common/options.h"

#include <algorithm>
#include <cstdlib>

namespace hetero {
namespace {

// "a, b or c"
std::string choices_text(const OptionSpec& s) {
  std::string out;
  for (size_t i = 0; i < s.choices.size(); ++i)
    out += (i == 0 ? "" : i + 1 == s.choices.size() ? " or " : ", ") + s.choices[i];
  return out;
}

}  // namespace

Options::Options(std::string command, std::string summary, std::vector<OptionSpec> specs)
    : command_(std::move(command)), summary_(std::move(summary)), specs_(std::move(specs)) {
  for (auto& s : specs_) {
    if (!s.default_value.empty()) values_[s.name] = s.default_value;
    if (!s.env.empty()) {
      if (const char* v = std::getenv(s.env.c_str())) values_[s.name] = v;
    }
  }
}

const OptionSpec* Options::find(const std::string& name) const {
  for (auto& s : specs_)
    if (s.name == name) return &s;
  return nullptr;
}

const OptionSpec& Options::spec(const std::string& name) const {
  const OptionSpec* s = find(name);
  HETERO_CHECK(s != nullptr);  // a row that is not in the table is a bug
  return *s;
}

Status Options::parse(int argc, char** argv) {
  for (int i = 0; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      help_ = true;
      continue;
    }
    if (arg.rfind("--", 0) != 0) {
      positional_.push_back(arg);
      continue;
    }
    std::string name = arg.substr(2), value;
    bool has_value = false;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1), name = name.substr(0, eq), has_value = true;
    }
    const OptionSpec* spec = find(name);
    if (!spec) return invalid_argument(command_ + ": unknown option --" + name + " (see --help)");
    if (!has_value) {
      if (spec->is_bool) {
        value = "true";
      } else if (i + 1 < argc) {
        value = argv[++i];
      } else {
        return invalid_argument(command_ + ": --" + name + " needs a value");
      }
    }
    values_[name] = value;
  }
  for (const auto& s : specs_) {
    if (s.choices.empty() || !has(s.name)) continue;
    const std::string v = get(s.name);
    if (std::find(s.choices.begin(), s.choices.end(), v) == s.choices.end())
      return invalid_argument(command_ + ": --" + s.name + " must be " + choices_text(s) +
                              ", got '" + v + "'" +
                              (s.env.empty() ? "" : " (flag or " + s.env + ")"));
  }
  return Status::ok();
}

bool Options::has(const std::string& name) const {
  auto it = values_.find(name);
  return it != values_.end() && !it->second.empty();
}

std::string Options::get(const std::string& name) const {
  HETERO_CHECK(find(name) != nullptr);  // asking for an option not in the table is a bug
  auto it = values_.find(name);
  return it == values_.end() ? "" : it->second;
}

Result<int64_t> Options::get_int(const std::string& name) const {
  std::string v = get(name);
  char* end = nullptr;
  long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0')
    return invalid_argument("--" + name + " must be an integer, got '" + v + "'");
  return static_cast<int64_t>(x);
}

Result<double> Options::get_double(const std::string& name) const {
  std::string v = get(name);
  char* end = nullptr;
  double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end != '\0')
    return invalid_argument("--" + name + " must be a number, got '" + v + "'");
  return x;
}

bool Options::get_bool(const std::string& name) const {
  std::string v = get(name);
  return v == "1" || v == "true" || v == "yes" || v == "on";
}

nlohmann::json Options::effective() const {
  nlohmann::json j = nlohmann::json::object();
  for (auto& s : specs_) j[s.name] = get(s.name);
  return j;
}

std::string Options::help_text() const {
  std::string out = "usage: hetero " + command_ + " [options]\n\n" + summary_ + "\n\noptions:\n";
  for (auto& s : specs_) {
    std::string left = "  --" + s.name + (s.is_bool ? "" : " V");
    if (left.size() < 26) left.resize(26, ' ');
    out += left + " " + s.help;
    if (!s.choices.empty()) out += " {" + choices_text(s) + "}";
    if (!s.default_value.empty()) out += " [default: " + s.default_value + "]";
    if (!s.env.empty()) out += " [env: " + s.env + "]";
    out += "\n";
  }
  return out;
}

std::string Options::markdown_table() const {
  std::string out = "### hetero " + command_ + "\n\n" + summary_ +
                    "\n\n| flag | env | default | meaning |\n|---|---|---|---|\n";
  for (auto& s : specs_)
    out += "| `--" + s.name + "` | " + (s.env.empty() ? "" : "`" + s.env + "`") + " | " +
           (s.default_value.empty() ? "" : "`" + s.default_value + "`") + " | " + s.help +
           (s.choices.empty() ? "" : " (" + choices_text(s) + ")") + " |\n";
  return out + "\n";
}

}  // namespace hetero
