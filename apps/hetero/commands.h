// The hetero subcommands, wired in main.cc. Each parses its own option table.
#pragma once

#include <functional>
#include <string>

namespace hetero {

int cmd_prefill(int argc, char** argv);
int cmd_program(int argc, char** argv);
int cmd_compare(int argc, char** argv);
int cmd_verify(int argc, char** argv);
int cmd_options_doc(int argc, char** argv);
int cmd_front(int argc, char** argv);
int cmd_up(int argc, char** argv);
int cmd_doctor(int argc, char** argv);
int cmd_bench(int argc, char** argv);

// SIGINT/SIGTERM set a flag instead of killing the process, so children are stopped by pid.
void install_stop_handlers();
// Blocks until SIGINT or SIGTERM (also if one arrived since install_stop_handlers()).
void wait_for_signal();
// The same, polling give_up() every 100 ms: false as soon as it says so, true on the signal.
bool wait_for_signal_or(const std::function<bool()>& give_up);

// The repository root (parent of the directory holding the hetero binary), for defaults such
// as models/ and python/.
std::string repo_root();

}  // namespace hetero

#include "common/options.h"

namespace hetero {

// Parses a command's options; returns -1 to go on, else the exit code (help printed: 0,
// bad option: 2).
int parse_options(Options& opts, int argc, char** argv);

// Option tables, shared with `hetero options-doc`.
Options prefill_options();
Options program_options();
Options verify_options();
Options compare_options();
Options up_options();
Options doctor_options();

}  // namespace hetero
