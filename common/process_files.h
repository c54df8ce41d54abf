#pragma once

// Small POSIX helpers that lockstep-run and lockstep-train share: finding a
// program as execvp would, and removing the files that a process names after
// its pid once that process has gone.
//
// It includes nothing of LibTorch, because lockstep-run links no LibTorch:
// it only starts and watches processes. Both include it as
// <common/process_files.h> (CMakeLists.txt).

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>

namespace lockstep {
namespace common {

/// Opens `path` for appending, creating it if missing, and closes it: ""
/// if that worked, else the system's reason. A check that the file can be
/// written where access() would not tell (root writes into read-only
/// folders, but not into /proc or a read-only mount).
inline std::string open_for_append(const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) {
    return std::strerror(errno);
  }
  ::close(fd);
  return "";
}

/// `name` as execvp would find it: itself when it contains a '/', else the
/// first executable regular file `name` in a directory of PATH (an empty
/// entry is the current directory). "" when there is none.
inline std::string find_program(const std::string& name) {
  auto executable = [](const std::string& path) {
    struct stat st {};
    return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(path.c_str(), X_OK) == 0;
  };
  if (name.find('/') != std::string::npos) {
    return executable(name) ? name : "";
  }
  const char* path = std::getenv("PATH");
  const std::string dirs = path != nullptr ? path : "/usr/bin:/bin";
  size_t start = 0;
  while (start <= dirs.size()) {
    const size_t end = dirs.find(':', start);
    const std::string dir = dirs.substr(start, end == std::string::npos ? std::string::npos : end - start);
    const std::string candidate = (dir.empty() ? "." : dir) + "/" + name;
    if (executable(candidate)) {
      return candidate;
    }
    if (end == std::string::npos) {
      break;
    }
    start = end + 1;
  }
  return "";
}

/// What a bare program name is in the current directory.
enum class InThisDirectory { kNothing, kProgram, kNotExecutable, kFolder };

/// What `name` is in the current directory.
inline InThisDirectory in_this_directory(const std::string& name) {
  struct stat info {};
  if (::stat(name.c_str(), &info) != 0) {
    return InThisDirectory::kNothing;
  }
  if (S_ISDIR(info.st_mode)) {
    return InThisDirectory::kFolder;
  }
  return ::access(name.c_str(), X_OK) == 0 ? InThisDirectory::kProgram : InThisDirectory::kNotExecutable;
}

/// What to say of a PROGRAM that is not found (or not executable), where
/// `here` is what a file of that name in the current directory is: torchrun
/// would run `python NAME`, and a shell `./NAME`.
inline std::string program_missing_message(const std::string& name, InThisDirectory here) {
  const bool bare = name.find('/') == std::string::npos;
  std::string message = "program '" + name + "' not found" + (bare ? " in PATH" : "") + " or not executable.";
  if (bare && here == InThisDirectory::kProgram) {
    message += " ./" + name + " is in this directory: lockstep-run runs PROGRAM as a shell would (as torchrun "
               "--no-python does), so write ./" + name + ".";
  }
  const bool python = name.size() > 3 && name.compare(name.size() - 3, 3, ".py") == 0;
  if (python) {
    message += " A Python script needs its interpreter: lockstep-run ... python3 " + name + ".";
  } else if (bare && here == InThisDirectory::kNotExecutable) {
    message += " ./" + name + " is in this directory but not executable: make it so (chmod +x " + name +
               ") and write ./" + name + ", or name the program that runs it.";
  }
  return message;
}

/// Whether no process `pid` runs on this machine. A process of another user
/// still counts as running: kill() then fails with EPERM, not ESRCH.
inline bool process_gone(long pid) {
  return pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

/// Removes `path`: a file, or a folder of files (not of folders).
inline void remove_shallow(const std::string& path) {
  if (::unlink(path.c_str()) == 0 || errno != EISDIR) {
    return;
  }
  if (DIR* folder = ::opendir(path.c_str())) {
    while (const dirent* entry = ::readdir(folder)) {
      const std::string name = entry->d_name;
      if (name != "." && name != "..") {
        ::unlink((path + "/" + name).c_str());
      }
    }
    ::closedir(folder);
  }
  ::rmdir(path.c_str());
}

/// Removes the files (or folders of files) named `path_prefix` + PID, or `path_prefix` + PID + "-"
/// + anything, whose process PID no longer runs on this machine: what a
/// writer killed with SIGKILL leaves behind. The files of running processes
/// stay, and so does every other name. `path_prefix` is a folder and the
/// start of a file name ("/tmp/lockstep-store-"); without a '/', the folder
/// is the current one. Only the machine that wrote such files can judge
/// their pids: on a folder that several machines share, call this from one.
inline void remove_files_of_dead_processes(const std::string& path_prefix) {
  const auto slash = path_prefix.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "." : path_prefix.substr(0, slash);
  const std::string name_prefix = slash == std::string::npos ? path_prefix : path_prefix.substr(slash + 1);
  DIR* folder = ::opendir(dir.c_str());
  if (folder == nullptr) {
    return;
  }
  while (const dirent* entry = ::readdir(folder)) {
    const std::string name = entry->d_name;
    if (name.rfind(name_prefix, 0) != 0) {
      continue;
    }
    char* end = nullptr;
    const long pid = std::strtol(name.c_str() + name_prefix.size(), &end, 10);
    if ((*end == '\0' || *end == '-') && process_gone(pid)) {
      remove_shallow(dir + "/" + name);
    }
  }
  ::closedir(folder);
}

} // namespace common
} // namespace lockstep
