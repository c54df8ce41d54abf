// Fuzz target: the launch-environment parser (torchrun's and MPI launchers'
// variables, LOCKSTEP_TIMEOUT) and the ProcessGroupOptions it merges them with.
// Input: NAME=VALUE lines; the options come from the input's last bytes.
// A c10::Error is the right answer to bad input; anything else is a failure,
// as is a result that breaks the parser's own promises.

#include "comm/launch_env.h"

#include <fuzzer/FuzzedDataProvider.h>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider input(data, size);
  lockstep::ProcessGroupOptions options;
  options.rank(input.ConsumeIntegralInRange<int64_t>(-2, 8));
  options.world_size(input.ConsumeIntegralInRange<int64_t>(-2, 8));
  options.master_port(input.ConsumeIntegral<int16_t>());
  options.timeout(std::chrono::milliseconds(input.ConsumeIntegral<int32_t>()));
  if (input.ConsumeBool()) {
    options.master_addr(input.ConsumeRandomLengthString(32));
  }
  std::map<std::string, std::string> variables;
  const std::string text = input.ConsumeRemainingBytesAsString();
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) {
      end = text.size();
    }
    const std::string line = text.substr(start, end - start);
    const size_t equals = line.find('=');
    if (equals != std::string::npos) {
      // getenv never returns a value with a NUL inside: cut there, as the C string would.
      variables[line.substr(0, equals)] = line.substr(equals + 1).c_str();
    }
    start = end + 1;
  }
  auto get = [&](const char* name) -> const char* {
    const auto it = variables.find(name);
    return it == variables.end() ? nullptr : it->second.c_str();
  };
  try {
    const auto env = lockstep::detail::parse_launch_env(options, get);
    // What the parser promises of a result it returns.
    if (env.world_size < 1 || env.rank < 0 || env.rank >= env.world_size || env.timeout.count() <= 0 ||
        env.local_rank < 0 || env.local_world_size < 1 || env.restart_count < 0) {
      std::abort();
    }
    if (env.world_size > 1 && env.mpi_launcher == nullptr &&
        (env.master_addr.empty() || env.master_port < 1 || env.master_port > 65535)) {
      std::abort();
    }
  } catch (const c10::Error&) {
  }
  return 0;
}
