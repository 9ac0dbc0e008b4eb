// `hetero bench <name> [args]`: the benchmark drivers live in bench/ (Python, beside the
// decoder they measure); this runs one with the pinned interpreter.
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "commands.h"
#include "stack.h"

namespace hetero {

int cmd_bench(int argc, char** argv) {
  const char* names[][2] = {{"cold", "bench/cold.py"}, {"prefill-cpu", "bench/prefill_cpu.py"}};
  if (argc < 1 || !std::strcmp(argv[0], "--help")) {
    std::fprintf(stderr,
                 "usage: hetero bench {cold|prefill-cpu} [options]   (--help per driver)\n");
    return argc < 1 ? 2 : 0;
  }
  for (auto& [name, script] : names) {
    if (std::strcmp(argv[0], name) != 0) continue;
    const char* env_python = std::getenv("HETERO_PYTHON");
    const std::string python = resolve_path(env_python ? env_python : ".venv/bin/python");
    const std::string path = (std::filesystem::path(repo_root()) / script).string();
    std::vector<std::string> args = {python, path};
    for (int i = 1; i < argc; ++i) args.push_back(argv[i]);
    std::vector<char*> cargs;
    for (auto& a : args) cargs.push_back(a.data());
    cargs.push_back(nullptr);
    setenv("PYTHONPATH", (std::filesystem::path(repo_root()) / "python").c_str(), 1);
    execv(python.c_str(), cargs.data());
    std::perror(("bench: cannot run " + python).c_str());
    return 1;
  }
  std::fprintf(stderr, "bench: unknown benchmark '%s' (cold, prefill-cpu)\n", argv[0]);
  return 2;
}

}  // namespace hetero
