#pragma once

// Starting programs from tests: with extra environment variables, output to a
// file, a deadline after which they are killed.

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <dirent.h>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace lockstep {
namespace testing {

// Note [Ports below the ephemeral range]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A test gives its job a port (a store's, a rendezvous endpoint's) some time
// before the job listens on it. A port the kernel picked with bind(0) is in
// the ephemeral range, which it also gives every outgoing connection: under
// ctest -j2, another test's Gloo connections took one in that window, no
// launcher could listen, and an elastic job waited out its join_timeout. So
// the tests' ports come from below that range, where the kernel gives
// none on its own; each is free when picked.

/// Whether nothing is bound to 127.0.0.1:`port` now.
inline bool port_is_free(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const bool free = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return free;
}

/// A port nobody uses right now, below the ephemeral range (Note [Ports below
/// the ephemeral range]); one the kernel picks if none is found there.
inline int free_port() {
  int first_ephemeral = 32768;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> first_ephemeral;
  const int low = std::max(1024, first_ephemeral - 16384);
  static std::mt19937 random(static_cast<unsigned>(getpid()) * 2654435761u ^
                             static_cast<unsigned>(std::chrono::steady_clock::now().time_since_epoch().count()));
  for (int attempt = 0; attempt < 200 && low < first_ephemeral; ++attempt) {
    const int port = low + static_cast<int>(random() % static_cast<unsigned>(first_ephemeral - low));
    if (port_is_free(port)) {
      return port;
    }
  }
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

/// A socket listening on 127.0.0.1 at a port the kernel picked: connections
/// are accepted (into the backlog) but never answered. Closes on destruction.
struct ListeningSocket {
  ListeningSocket() {
    fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ok = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 && listen(fd, 16) == 0;
    socklen_t len = sizeof(addr);
    getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    port = ntohs(addr.sin_port);
  }
  ~ListeningSocket() {
    close(fd);
  }
  ListeningSocket(const ListeningSocket&) = delete;
  ListeningSocket& operator=(const ListeningSocket&) = delete;
  int fd = -1;
  int port = 0;
  bool ok = false;
};

/// A running program whose stdout and stderr go to `log`.
struct Process {
  pid_t pid = -1;
  std::string log;
  std::chrono::steady_clock::time_point start;
  int exit_code = -1; // 128 + signal when killed; -1 while running or killed at the deadline
  double seconds = 0;
  std::string output;
};

inline Process start(const std::vector<std::string>& argv, const std::vector<std::string>& extra_env, const std::string& log) {
  Process p;
  p.log = log;
  // `extra_env` replaces variables of the same name: getenv finds the first.
  auto overridden = [&extra_env](const std::string& entry) {
    for (const auto& extra : extra_env) {
      if (entry.compare(0, extra.find('=') + 1, extra, 0, extra.find('=') + 1) == 0) {
        return true;
      }
    }
    return false;
  };
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    if (!overridden(*e)) {
      env_strings.emplace_back(*e);
    }
  }
  env_strings.insert(env_strings.end(), extra_env.begin(), extra_env.end());
  std::vector<char*> env, args;
  for (auto& s : env_strings) {
    env.push_back(s.data());
  }
  env.push_back(nullptr);
  std::vector<std::string> argv_copy = argv;
  for (auto& a : argv_copy) {
    args.push_back(a.data());
  }
  args.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  // A process group of its own, so that a program killed at the deadline
  // takes its children with it (torchrun's ranks would outlive it).
  posix_spawnattr_t attributes;
  posix_spawnattr_init(&attributes);
  posix_spawnattr_setflags(&attributes, POSIX_SPAWN_SETPGROUP);
  posix_spawnattr_setpgroup(&attributes, 0);
  p.start = std::chrono::steady_clock::now();
  if (posix_spawn(&p.pid, args[0], &actions, &attributes, args.data(), env.data()) != 0) {
    p.pid = -1;
  }
  posix_spawnattr_destroy(&attributes);
  posix_spawn_file_actions_destroy(&actions);
  return p;
}

/// Waits for every process, at most `deadline` from now; kills the rest.
inline void wait_all(std::vector<Process>& processes, std::chrono::seconds deadline) {
  const auto until = std::chrono::steady_clock::now() + deadline;
  size_t running = 0;
  for (auto& p : processes) {
    running += p.pid > 0;
  }
  while (running > 0 && std::chrono::steady_clock::now() < until) {
    for (auto& p : processes) {
      int status = 0;
      if (p.pid > 0 && waitpid(p.pid, &status, WNOHANG) == p.pid) {
        p.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        p.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - p.start).count();
        p.pid = 0;
        --running;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (auto& p : processes) {
    if (p.pid > 0) {
      kill(-p.pid, SIGKILL);
      waitpid(p.pid, nullptr, 0);
      p.pid = 0;
    }
    std::ifstream in(p.log);
    std::stringstream text;
    text << in.rdbuf();
    p.output = text.str();
  }
}

/// Runs one program to the end (or the deadline).
inline Process run(const std::vector<std::string>& argv, const std::vector<std::string>& extra_env, const std::string& log,
                   std::chrono::seconds deadline) {
  std::vector<Process> one{start(argv, extra_env, log)};
  wait_all(one, deadline);
  return one[0];
}

/// Processes whose command line contains `marker`.
inline std::vector<int> processes_with(const std::string& marker) {
  std::vector<int> found;
  DIR* proc = opendir("/proc");
  while (dirent* entry = readdir(proc)) {
    const int pid = std::atoi(entry->d_name);
    if (pid <= 0 || pid == getpid()) {
      continue;
    }
    std::ifstream in("/proc/" + std::string(entry->d_name) + "/cmdline");
    std::string cmdline((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (cmdline.find(marker) != std::string::npos) {
      found.push_back(pid);
    }
  }
  closedir(proc);
  return found;
}

} // namespace testing
} // namespace lockstep
