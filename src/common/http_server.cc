// HTTP server settings: see http_server.h.
#include "common/http_server.h"

#include <httplib.h>
#include <sys/socket.h>

namespace hetero {

void exclusive_port(httplib::Server& server) {
  server.set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
}

}  // namespace hetero
