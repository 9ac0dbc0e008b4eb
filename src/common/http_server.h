// What every HTTP server of the project sets on cpp-httplib before it binds.
#pragma once

#include <string>

#include "common/options.h"

namespace httplib {
class Server;
}

namespace hetero {

// The most connections a server serves at once, each on its own thread (see below).
inline constexpr int kDefaultMaxConnections = 512;

// The option for it, one spec for every server (--max-connections, HETERO_MAX_CONNECTIONS).
OptionSpec max_connections_option();

// Every server of the project calls this before it binds:
// - SO_REUSEADDR only: cpp-httplib's default also sets SO_REUSEPORT, which let a second prefill
//   host bind the port of a running one and take half its connections.
// - Each connection on its own thread, up to max_connections at once (more wait for one to
//   end). cpp-httplib's default pool has 8 threads, one per connection: 8 clients that trickle
//   their headers starved /health for as long as they kept trickling. Work is bounded where
//   it is done (the front door's completion slots and bridge queue, the prefill host's one
//   prefill at a time), not by how many sockets may wait.
void configure_server(httplib::Server& server, int max_connections = kDefaultMaxConnections);

// A handler that throws is a bug: the client gets HTTP 500 with `json_body` (which names no
// internals), `component`'s log line gets the exception's text, and the server keeps serving.
void answer_exceptions_with(httplib::Server& server, std::string component, std::string json_body);

}  // namespace hetero
