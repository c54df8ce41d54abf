#pragma once

// lockstep-run's ranks as processes: how each is started (fork, its own
// process group, pipes), how what it writes reaches the launcher's output
// and its log line by line, and how its end is told. Attempt
// (tools/lockstep_run.cpp) decides when; this says how.

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <deque>
#include <fstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace lockstep {
namespace tools {

constexpr size_t kStderrTail = 20;
constexpr size_t kTailLineBytes = 2000; // a longer line is cut in the failure summary

// The cores this launcher may run on: its affinity mask (taskset, a Slurm
// or cgroup cpuset), which the ranks inherit, not every core the machine
// has; the ranks would otherwise start more threads than they have cores.
inline int usable_cores() {
  cpu_set_t mask;
  CPU_ZERO(&mask);
  if (::sched_getaffinity(0, sizeof(mask), &mask) == 0 && CPU_COUNT(&mask) > 0) {
    return CPU_COUNT(&mask);
  }
  return static_cast<int>(std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN)));
}

// One rank of this node: its process, its pipes and their unfinished
// lines, its log, the last lines of its stderr, and how it ended.
struct Rank {
  int local_rank = 0;
  int global_rank = 0;
  pid_t pid = -1;
  int out_fd = -1;
  int err_fd = -1;
  std::string out_partial, err_partial;
  std::deque<std::string> err_tail;
  std::ofstream log;
  int exit_fd = -1; // a pidfd: readable once the rank has ended (Note [When a rank ended])
  bool done = false;
  int end_order = 0; // 1 for the first rank of the attempt to end, 2 for the next, ...
  int status = 0;
  bool running_at_stop = false; // still running when the job was stopped
  bool killed_after_grace = false; // ignored SIGTERM: got SIGKILL
  bool shown = true; // its output reaches the console (--local-ranks-filter); the log and the tail take it anyway
};

// A line of a rank's stderr as the failure summary repeats it: cut short,
// saying so, if a program wrote megabytes without a newline.
inline std::string summary_line(const std::string& line) {
  if (line.size() <= kTailLineBytes) {
    return line;
  }
  return line.substr(0, kTailLineBytes) + " ... [cut: " + std::to_string(line.size()) + " bytes]";
}

// How a rank ended, in words.
inline std::string describe_status(int status) {
  if (WIFEXITED(status)) {
    return "exit code " + std::to_string(WEXITSTATUS(status));
  }
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    const char* name = ::sigabbrev_np(sig);
    return "killed by signal " + std::to_string(sig) + (name ? std::string(" (SIG") + name + ")" : "");
  }
  return "status " + std::to_string(status);
}

inline bool failed(int status) {
  return !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

inline std::string now_text() {
  const std::time_t now = std::time(nullptr);
  char text[64];
  std::strftime(text, sizeof(text), "%Y-%m-%d %H:%M:%S %z", std::localtime(&now));
  return text;
}

// The environment a rank starts with: the launcher's, with `extra` added
// (replacing variables of the same name), as execve takes it.
inline std::vector<std::string> rank_environment(const std::vector<std::pair<std::string, std::string>>& extra) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    const std::string name = entry.substr(0, entry.find('='));
    bool replaced = false;
    for (const auto& [key, value] : extra) {
      replaced = replaced || key == name;
    }
    if (!replaced) {
      env.push_back(entry);
    }
  }
  for (const auto& [key, value] : extra) {
    env.push_back(key + "=" + value);
  }
  return env;
}

// NULL-terminated pointers into `strings`, as execve takes them; valid while
// `strings` is.
inline std::vector<char*> c_strings(const std::vector<std::string>& strings) {
  std::vector<char*> pointers;
  for (const auto& text : strings) {
    pointers.push_back(const_cast<char*>(text.c_str()));
  }
  pointers.push_back(nullptr);
  return pointers;
}

// What a forked rank executes, all made before fork(): after it, a child of
// a threaded process may only call async-signal-safe functions.
struct RankExec {
  std::string program;
  std::vector<std::string> env_strings;
  std::vector<char*> envp;
  std::vector<char*> argv; // into the caller's command, which outlives the fork
  std::string cannot_run;
  int null_in = -1; // stdin for the rank, when the launcher's is a terminal
};

inline void prepare_exec(RankExec& exec, const std::string& program, const std::vector<std::string>& command,
                         const std::vector<std::pair<std::string, std::string>>& env) {
  exec.program = program;
  // A terminal on stdin stays the launcher's: the ranks run in a process
  // group of their own, in the background of the terminal's session, and
  // the first to read it would be stopped (SIGTTIN) with its whole group,
  // silently, while the launcher waited for good. They read /dev/null
  // (end of file) instead; a pipe or a file on stdin stays shared.
  exec.null_in = ::isatty(0) ? ::open("/dev/null", O_RDONLY | O_CLOEXEC) : -1;
  exec.env_strings = rank_environment(env);
  exec.envp = c_strings(exec.env_strings);
  exec.argv = c_strings(command);
  exec.cannot_run = "lockstep-run: cannot run " + program + ": ";
}

// The forked child: joins process group `group`, puts its stdout and stderr
// on the pipes' write ends, and executes; async-signal-safe calls only.
[[noreturn]] inline void exec_rank(const RankExec& exec, pid_t group, pid_t parent, int out_fd, int err_fd) {
  ::setpgid(0, group); // one process group per attempt: signal_all reaches every rank and its children
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != parent) {
    ::_exit(1); // the launcher died between fork and prctl
  }
  ::dup2(out_fd, 1); // dup2 clears O_CLOEXEC on the copies; the originals close at exec
  ::dup2(err_fd, 2);
  if (exec.null_in >= 0) {
    ::dup2(exec.null_in, 0);
  }
  ::signal(SIGINT, SIG_DFL);
  ::signal(SIGTERM, SIG_DFL);
  ::signal(SIGHUP, SIG_DFL);
  ::execve(exec.program.c_str(), exec.argv.data(), exec.envp.data());
  const char* why = ::strerror(errno);
  (void)!::write(2, exec.cannot_run.data(), exec.cannot_run.size());
  (void)!::write(2, why, ::strlen(why));
  (void)!::write(2, "\n", 1);
  ::_exit(127);
}

// Forks rank `r` into process group `group` (0: a new one, whose id, the
// first rank's pid, is stored there), with its stdout and stderr on pipes
// that pump() reads, and executes `program` there with `command` as its
// arguments and `env` added to the environment. Everything the child needs
// is made before fork(): an elastic launcher has a thread (its store's
// server), and after fork a child of a threaded process may only call
// async-signal-safe functions until it executes (no malloc, no stdio).
inline void spawn_rank(Rank& r, const std::string& program, const std::vector<std::string>& command,
                       const std::vector<std::pair<std::string, std::string>>& env, pid_t& group) {
  int out[2], err[2];
  if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) {
    std::perror("lockstep-run: pipe");
    std::exit(1);
  }
  RankExec exec;
  prepare_exec(exec, program, command, env);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) {
    exec_rank(exec, group, parent, out[1], err[1]);
  }
  if (pid < 0) {
    std::perror("lockstep-run: fork");
    std::exit(1);
  }
  if (group == 0) {
    group = pid;
  }
  ::setpgid(pid, group); // also from here: no race with the first signal
  ::close(out[1]);
  ::close(err[1]);
  if (exec.null_in >= 0) {
    ::close(exec.null_in);
  }
  r.pid = pid;
  r.out_fd = out[0];
  r.err_fd = err[0];
  r.exit_fd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)); // -1 before Linux 5.3: pump's timeout instead
}

// One line of rank r's stdout or stderr: to the launcher's own, prefixed
// with the rank, to its log, and (stderr) to the tail the failure summary
// repeats.
inline void emit(Rank& r, const std::string& line, bool is_err) {
  std::FILE* stream = is_err ? stderr : stdout;
  if (r.shown) {
    std::fprintf(stream, "[rank %d] %s\n", r.global_rank, line.c_str());
    std::fflush(stream);
  }
  if (r.log.is_open()) {
    r.log << line << '\n';
    r.log.flush();
  }
  if (is_err) {
    r.err_tail.push_back(summary_line(line));
    if (r.err_tail.size() > kStderrTail) {
      r.err_tail.pop_front();
    }
  }
}

// Reads what the ranks wrote, for up to `timeout_ms`, and passes whole lines on.
inline void pump(std::vector<Rank>& ranks, int timeout_ms) {
  std::vector<pollfd> fds;
  std::vector<std::pair<size_t, bool>> owners; // rank, is_stderr
  for (const auto& r : ranks) { // first: nothing to read, they only end the wait
    if (r.exit_fd >= 0) {
      fds.push_back({r.exit_fd, POLLIN, 0});
    }
  }
  const size_t exits = fds.size();
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i].out_fd >= 0) {
      fds.push_back({ranks[i].out_fd, POLLIN, 0});
      owners.push_back({i, false});
    }
    if (ranks[i].err_fd >= 0) {
      fds.push_back({ranks[i].err_fd, POLLIN, 0});
      owners.push_back({i, true});
    }
  }
  if (fds.empty()) {
    if (timeout_ms > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(timeout_ms));
    }
    return;
  }
  if (::poll(fds.data(), fds.size(), timeout_ms) <= 0) {
    return;
  }
  char buffer[65536];
  for (size_t k = exits; k < fds.size(); ++k) {
    if ((fds[k].revents & (POLLIN | POLLHUP | POLLERR)) == 0) {
      continue;
    }
    Rank& r = ranks[owners[k - exits].first];
    const bool is_err = owners[k - exits].second;
    const ssize_t n = ::read(fds[k].fd, buffer, sizeof(buffer));
    if (n <= 0) {
      ::close(fds[k].fd);
      (is_err ? r.err_fd : r.out_fd) = -1;
      continue;
    }
    std::string& partial = is_err ? r.err_partial : r.out_partial;
    partial.append(buffer, static_cast<size_t>(n));
    size_t newline;
    while ((newline = partial.find('\n')) != std::string::npos) {
      emit(r, partial.substr(0, newline), is_err);
      partial.erase(0, newline + 1);
    }
  }
}

// Closes the pipes still open at the end of an attempt: a rank's last
// output read in the final pump, or a child of a rank that keeps them open,
// leaves its read ends here, and each attempt and each round would leak
// two (until pipe2 fails after enough restarts).
inline void close_pipes(std::vector<Rank>& ranks) {
  for (auto& r : ranks) {
    for (int* fd : {&r.out_fd, &r.err_fd, &r.exit_fd}) {
      if (*fd >= 0) {
        ::close(*fd);
        *fd = -1;
      }
    }
  }
}

// What the ranks wrote after their last newline.
inline void flush_partials(std::vector<Rank>& ranks) {
  for (auto& r : ranks) {
    if (!r.out_partial.empty()) {
      emit(r, r.out_partial, false);
    }
    if (!r.err_partial.empty()) {
      emit(r, r.err_partial, true);
    }
    r.out_partial.clear();
    r.err_partial.clear();
  }
}

} // namespace tools
} // namespace lockstep
