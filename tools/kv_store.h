#pragma once

// The key-value store through which elastic lockstep-run launchers meet
// (Note [Elastic rendezvous] in tools/rendezvous.h): one launcher serves it
// on --rdzv-endpoint, every launcher (that one too) is its client.
//
// It is lockstep-run's own, not c10d's TCPStore, so that the launcher keeps
// linking no LibTorch, and so that every operation has a deadline: a client
// whose link is cut must fail within the timeout and say so, never wait on a
// socket forever. Three operations suffice for the rendezvous: ADD (an
// atomic counter), SET and GET (a value, or nothing). The wire format is one
// text line per request and per reply.

#include <common/sockets.h>

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace lockstep {
namespace tools {

/// A store operation that failed: the store's host is gone, or out of reach.
struct KvError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// What the rendezvous needs of a store.
class KeyValue {
 public:
  virtual ~KeyValue() = default;
  /// Adds `delta` to the counter `key` (0 if absent) and returns the sum.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  virtual void set(const std::string& key, const std::string& value) = 0;
  virtual std::optional<std::string> get(const std::string& key) = 0;
};

/// The store's content, in memory: the server's, and the unit tests'.
class MemoryKeyValue : public KeyValue {
 public:
  int64_t add(const std::string& key, int64_t delta) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& value = values_[key];
    const int64_t sum = (value.empty() ? 0 : std::stoll(value)) + delta;
    value = std::to_string(sum);
    return sum;
  }
  void set(const std::string& key, const std::string& value) override {
    std::lock_guard<std::mutex> lock(mutex_);
    values_[key] = value;
  }
  std::optional<std::string> get(const std::string& key) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = values_.find(key);
    return it == values_.end() ? std::nullopt : std::optional<std::string>(it->second);
  }

  /// One request line in, one reply line out (without the newlines): the
  /// wire protocol, apart from the sockets.
  std::string serve(const std::string& request) {
    const size_t space = request.find(' ');
    const std::string op = request.substr(0, space);
    const std::string rest = space == std::string::npos ? "" : request.substr(space + 1);
    const size_t second = rest.find(' ');
    const std::string key = rest.substr(0, second);
    const std::string value = second == std::string::npos ? "" : rest.substr(second + 1);
    if (key.empty()) {
      return "ERR no key";
    }
    if (op == "ADD") {
      char* end = nullptr;
      const long long delta = std::strtoll(value.c_str(), &end, 10);
      if (value.empty() || *end != '\0' || !counter_or_absent(key)) {
        return "ERR not a counter";
      }
      return "V " + std::to_string(add(key, delta));
    }
    if (op == "SET") {
      set(key, value);
      return "OK";
    }
    if (op == "GET") {
      const auto found = get(key);
      return found ? "V " + *found : "NONE";
    }
    return "ERR unknown operation " + op;
  }

 private:
  bool counter_or_absent(const std::string& key) {
    const auto found = get(key);
    if (!found) {
      return true;
    }
    char* end = nullptr;
    std::strtoll(found->c_str(), &end, 10);
    return !found->empty() && *end == '\0';
  }

  std::mutex mutex_;
  std::map<std::string, std::string> values_;
};

/// Serves a MemoryKeyValue on a listening socket from a thread of its own,
/// until destroyed. `seed` is there before the first client is answered.
class KvServer {
 public:
  explicit KvServer(int listen_fd, const std::map<std::string, std::string>& seed = {}) : listen_fd_(listen_fd) {
    for (const auto& [key, value] : seed) {
      content_.set(key, value);
    }
    thread_ = std::thread([this] { loop(); });
  }
  ~KvServer() {
    stop_ = true;
    thread_.join();
    ::close(listen_fd_);
    for (const auto& c : clients_) {
      ::close(c.fd);
    }
  }
  KvServer(const KvServer&) = delete;
  KvServer& operator=(const KvServer&) = delete;

 private:
  struct Client {
    int fd;
    std::string pending;
  };

  void loop() {
    while (!stop_) {
      std::vector<pollfd> fds{{listen_fd_, POLLIN, 0}};
      for (const auto& c : clients_) {
        fds.push_back({c.fd, POLLIN, 0});
      }
      if (::poll(fds.data(), fds.size(), 50) <= 0) {
        continue;
      }
      std::vector<Client> alive;
      for (size_t i = 1; i < fds.size(); ++i) {
        Client& c = clients_[i - 1];
        if ((fds[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0 || serve(c)) {
          alive.push_back(std::move(c));
        } else {
          ::close(c.fd);
        }
      }
      clients_ = std::move(alive);
      if (fds[0].revents & POLLIN) {
        const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
        if (fd >= 0) {
          clients_.push_back({fd, ""});
        }
      }
    }
  }

  // Answers the whole requests that client `c` has sent; false once it hung up.
  bool serve(Client& c) {
    char buffer[4096];
    const ssize_t n = ::recv(c.fd, buffer, sizeof(buffer), 0);
    if (n <= 0) {
      return false;
    }
    c.pending.append(buffer, static_cast<size_t>(n));
    size_t newline;
    while ((newline = c.pending.find('\n')) != std::string::npos) {
      const std::string reply = content_.serve(c.pending.substr(0, newline)) + "\n";
      c.pending.erase(0, newline + 1);
      if (::send(c.fd, reply.data(), reply.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(reply.size())) {
        return false;
      }
    }
    return c.pending.size() < (1 << 20);
  }

  int listen_fd_;
  std::atomic<bool> stop_{false};
  MemoryKeyValue content_;
  std::vector<Client> clients_;
  std::thread thread_;
};

/// A client of a KvServer; every operation ends within `timeout` or throws
/// KvError naming the store.
class KvClient : public KeyValue {
 public:
  KvClient(const std::string& host, int port, std::chrono::milliseconds timeout)
      : where_(host + ":" + std::to_string(port)), timeout_(timeout) {
    const auto addresses = detail::resolve_tcp(host, port);
    if (addresses.first() == nullptr) {
      throw KvError("cannot resolve " + host + ": " + addresses.error);
    }
    const addrinfo* a = addresses.first();
    fd_ = ::socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd_ < 0) {
      throw KvError(std::string("socket: ") + std::strerror(errno));
    }
    if (::connect(fd_, a->ai_addr, a->ai_addrlen) != 0 && errno != EINPROGRESS) {
      fail(std::string("cannot connect: ") + std::strerror(errno));
    }
    pollfd p{fd_, POLLOUT, 0};
    int error = 0;
    socklen_t length = sizeof(error);
    if (::poll(&p, 1, static_cast<int>(timeout_.count())) <= 0) {
      fail("no answer within " + std::to_string(timeout_.count()) + " ms");
    }
    ::getsockopt(fd_, SOL_SOCKET, SO_ERROR, &error, &length);
    if (error != 0) {
      fail(std::string("cannot connect: ") + std::strerror(error));
    }
    const int one = 1;
    ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  }
  ~KvClient() override {
    if (fd_ >= 0) {
      ::close(fd_);
    }
  }
  KvClient(const KvClient&) = delete;
  KvClient& operator=(const KvClient&) = delete;

  int64_t add(const std::string& key, int64_t delta) override {
    const std::string value = value_of(request("ADD " + key + " " + std::to_string(delta)));
    char* end = nullptr;
    errno = 0;
    const long long sum = std::strtoll(value.c_str(), &end, 10);
    if (value.empty() || *end != '\0' || errno != 0) {
      fail("a counter that is not a number ('" + value + "' for " + key + ")");
    }
    return sum;
  }
  void set(const std::string& key, const std::string& value) override {
    request("SET " + key + " " + value);
  }
  std::optional<std::string> get(const std::string& key) override {
    const std::string reply = request("GET " + key);
    return reply == "NONE" ? std::nullopt : std::optional<std::string>(value_of(reply));
  }

  const std::string& where() const {
    return where_;
  }
  /// The deadline of each later operation.
  void set_timeout(std::chrono::milliseconds timeout) {
    timeout_ = timeout;
  }

 private:
  [[noreturn]] void fail(const std::string& why) {
    throw KvError("the rendezvous store at " + where_ + ": " + why);
  }

  std::string value_of(const std::string& reply) {
    if (reply.rfind("V ", 0) != 0) {
      fail("unexpected reply '" + reply + "'");
    }
    return reply.substr(2);
  }

  // Sends one request line and returns the reply line, within the timeout.
  std::string request(const std::string& line) {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    const std::string out = line + "\n";
    for (size_t sent = 0; sent < out.size();) {
      wait_for(POLLOUT, deadline);
      const ssize_t n = ::send(fd_, out.data() + sent, out.size() - sent, MSG_NOSIGNAL);
      if (n < 0 && errno != EAGAIN && errno != EINTR) {
        fail(std::string("lost the connection: ") + std::strerror(errno));
      }
      sent += n > 0 ? static_cast<size_t>(n) : 0;
    }
    size_t newline;
    while ((newline = pending_.find('\n')) == std::string::npos) {
      wait_for(POLLIN, deadline);
      char buffer[4096];
      const ssize_t n = ::recv(fd_, buffer, sizeof(buffer), 0);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
        fail(n == 0 ? "its host closed the connection" : std::string("lost the connection: ") + std::strerror(errno));
      }
      pending_.append(buffer, static_cast<size_t>(std::max<ssize_t>(n, 0)));
    }
    std::string reply = pending_.substr(0, newline);
    pending_.erase(0, newline + 1);
    return reply;
  }

  void wait_for(short events, std::chrono::steady_clock::time_point deadline) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    pollfd p{fd_, events, 0};
    if (left.count() <= 0 || ::poll(&p, 1, static_cast<int>(left.count())) <= 0) {
      fail("no answer within " + std::to_string(timeout_.count()) + " ms");
    }
  }

  std::string where_;
  std::chrono::milliseconds timeout_;
  int fd_ = -1;
  std::string pending_;
};

// Note [One store, one job]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every key of a job is under its id (--rdzv-id, else Slurm's job and step:
// Note [The rendezvous's id] in tools/run_id.h), so two jobs could share one
// store; but the store lives in one launcher of the first job, and goes when
// that job ends: a second job that met there would then fail for no fault of
// its own. So the launcher that serves the store writes the id of its job
// there before anyone can ask (kServedJobKey, a key without '/', which no
// job's key is), and every launcher reads it first: a launcher of another
// job is refused at start, told which job holds the port. The same read
// tells a lockstep-run store from another program that holds the port: that
// one answers with something else, or not at all.
// Two jobs that both have no id pass this check; their programs tell them
// apart (Note [The job's first node sets its terms] in tools/job_record.h).

/// The key under which the store names the job it serves.
inline const std::string kServedJobKey = "served-rdzv-id";

/// A job as the messages name it: its --rdzv-id.
inline std::string describe_job(const std::string& rdzv_id) {
  return rdzv_id.empty() ? "a job without --rdzv-id" : "job '" + rdzv_id + "'";
}

/// Empty when the store at --rdzv-endpoint `where` serves the job whose
/// --rdzv-id is `rdzv_id`; else the message that refuses this launcher.
/// See Note [One store, one job].
inline std::string check_served_job(KeyValue& kv, const std::string& rdzv_id, const std::string& where) {
  std::optional<std::string> served;
  try {
    served = kv.get(kServedJobKey);
  } catch (const KvError& e) {
    return "--rdzv-endpoint " + where + " is held by a program that is not a lockstep-run rendezvous store (" +
        e.what() + "); pick a free port for --rdzv-endpoint.";
  }
  if (!served) {
    return "--rdzv-endpoint " + where + " is held by a program that is not a lockstep-run rendezvous store (it names "
        "no job); pick a free port for --rdzv-endpoint.";
  }
  if (*served == rdzv_id) {
    return "";
  }
  return "--rdzv-endpoint " + where + " already serves the rendezvous of " + describe_job(*served) + ", and this node "
      "is of " + describe_job(rdzv_id) + ": two jobs cannot share one rendezvous store (it ends with the job that "
      "serves it). Give this job a port of its own in --rdzv-endpoint" + (served->empty() ? "" : ", or --rdzv-id " +
      *served + " if this node belongs to that job") + ".";
}

} // namespace tools
} // namespace lockstep
