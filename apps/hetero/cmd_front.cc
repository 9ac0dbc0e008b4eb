// `hetero front`: the front door alone, for a decoder and prefill host started elsewhere.
#include <sys/stat.h>

#include <cstdio>

#include "commands.h"
#include "common/log.h"
#include "front/front.h"

namespace hetero {

int cmd_front(int argc, char** argv) {
  ::umask(077);  // the store holds prompts' caches: the user's alone
  Options opts = front_options();
  if (int rc = parse_options(opts, argc, argv); rc >= 0) return rc;
  auto cfg = front_config(opts);
  if (!cfg.is_ok()) return std::fprintf(stderr, "front: %s\n", cfg.status().message().c_str()), 2;
  log_line("front", "options " + opts.effective().dump());
  FrontServer front(cfg.value());
  if (Status st = front.start(); !st.is_ok())
    return std::fprintf(stderr, "front: %s\n", st.to_string().c_str()), 1;
  log_line("front", "serving on http://" + cfg->host + ":" + std::to_string(front.bound_port()));
  wait_for_signal();
  front.stop();
  return 0;
}

}  // namespace hetero
