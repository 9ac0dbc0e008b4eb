// One declarative option table per component: flag, env alias (HETERO_*), default, help.
// --help and docs/options.md are generated from the same table; the environment is read once,
// at parse time, and flags override it.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/status.h"

namespace hetero {

struct OptionSpec {
  std::string name;           // flag without dashes: "chunk" for --chunk
  std::string env;            // "HETERO_PREFILL_CHUNK", or empty
  std::string default_value;  // as text; "" means unset
  std::string help;
  bool is_bool = false;  // a bare --flag means "true"
  // The allowed values (empty: any); a flag or environment value outside them fails parse().
  std::vector<std::string> choices = {};
};

class Options {
 public:
  Options(std::string command, std::string summary, std::vector<OptionSpec> specs);
  // Parses argv (after the subcommand). Unknown flags, missing values and values outside an
  // option's choices (from a flag or the environment) are errors.
  Status parse(int argc, char** argv);
  bool help_requested() const { return help_; }
  std::string help_text() const;
  std::string markdown_table() const;  // for docs/options.md

  bool has(const std::string& name) const;  // set by flag, env or a non-empty default
  std::string get(const std::string& name) const;
  Result<int64_t> get_int(const std::string& name) const;
  Result<double> get_double(const std::string& name) const;
  bool get_bool(const std::string& name) const;
  nlohmann::json effective() const;  // the configuration in force, to log once
  const std::vector<std::string>& positional() const { return positional_; }
  const std::string& command() const { return command_; }
  const std::vector<OptionSpec>& specs() const { return specs_; }
  // The row for `name`, to share it with another command's table (one default, one help).
  const OptionSpec& spec(const std::string& name) const;

 private:
  const OptionSpec* find(const std::string& name) const;
  std::string command_, summary_;
  std::vector<OptionSpec> specs_;
  std::map<std::string, std::string> values_;
  std::vector<std::string> positional_;
  bool help_ = false;
};

}  // namespace hetero
