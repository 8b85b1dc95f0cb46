#pragma once

// Which addresses a host name stands for, and which local address reaches a host: what a job's
// store, rendezvous and Gloo need to serve and bind where other hosts can reach them.

#include <string>

namespace paratrain {
namespace dist {

/// Whether every address `host` resolves to is a loopback address (127.0.0.0/8, ::1). Such a
/// store cannot be reached from another host.
bool resolves_to_loopback_only(const std::string& host);

/// Whether `host` is a name (not an address literal) for loopback only: Debian names its own host
/// 127.0.1.1 in /etc/hosts, so `$(hostname)` as a job's address would serve where no other host
/// reaches, where c10d's TCPStore, serving every address, hid the mistake.
bool is_loopback_name(const std::string& host);

/// The local address this host uses to reach `host` (the kernel's route and source choice); ""
/// when there is no route or it does not resolve. Gloo binds there: its own default resolves the
/// hostname, which on many machines (and in network namespaces) names a loopback address that
/// other hosts cannot reach.
std::string route_source_address(const std::string& host, int port);

}  // namespace dist
}  // namespace paratrain
