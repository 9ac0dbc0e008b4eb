// What every HTTP server of the project sets on cpp-httplib before it binds.
#pragma once

namespace httplib {
class Server;
}

namespace hetero {

// SO_REUSEADDR only: cpp-httplib's default also sets SO_REUSEPORT, which let a second prefill
// host bind the port of a running one and take half its connections.
void exclusive_port(httplib::Server& server);

}  // namespace hetero
