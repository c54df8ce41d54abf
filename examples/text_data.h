#pragma once

// lockstep-train --model gpt's data: the bytes of a text, by default the
// cookies of Debian's `fortunes` package, cut into sequences.
//
// Why fortunes: its files are plain text, read as they are, about 2.5 MB of
// English in many registers (quotations, verse, dialogue, definitions,
// programs) from Debian's main archive. bible-kjv-text, the other candidate,
// ships its text compressed in its reader's own format.

#include "data.h"

#include <torch/torch.h>

#include <sys/stat.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

namespace lockstep {
namespace examples {

/// Where Debian's fortunes package puts its cookies: the default text.
constexpr char kFortunes[] = "/usr/share/games/fortunes";

/// Every tenth sequence of the text is held out for testing.
constexpr int64_t kHeldOutEvery = 10;

/// The files of kFortunes that hold cookies: those without an extension
/// (`.dat` files are strfile's indexes, `.u8` ones links), by name.
inline std::vector<std::string> fortune_files() {
  std::vector<std::string> files;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(kFortunes, error)) {
    if (entry.is_regular_file() && !entry.path().has_extension()) {
      files.push_back(entry.path().string());
    }
  }
  std::sort(files.begin(), files.end());
  return files;
}

/// The most text read: its sequences take 8 bytes a byte (int64 tokens).
constexpr size_t kMaxTextBytes = size_t{1} << 30;

/// The bytes of `paths`, one after another: regular files, or pipes (a
/// shell's <(...)). A device such as /dev/zero would be read until memory
/// ran out.
inline std::string read_text(const std::vector<std::string>& paths) {
  std::string text;
  for (const auto& path : paths) {
    struct stat info {};
    TORCH_CHECK(::stat(path.c_str(), &info) == 0 && (S_ISREG(info.st_mode) || S_ISFIFO(info.st_mode)),
                "lockstep-train: --text ", path, " is not a file (a device, or gone); give a file of text.");
    std::ifstream in(path, std::ios::binary);
    TORCH_CHECK(in, "lockstep-train: cannot read the text file ", path);
    std::vector<char> chunk(size_t{1} << 16);
    while (in.read(chunk.data(), static_cast<std::streamsize>(chunk.size())) || in.gcount() > 0) {
      text.append(chunk.data(), static_cast<size_t>(in.gcount()));
      TORCH_CHECK(text.size() <= kMaxTextBytes, "lockstep-train: --text ", path, ": more than ", kMaxTextBytes >> 30,
                  " GiB of text, whose sequences would take 8 times as much memory; give a smaller file (head -c "
                  "100M ", path, " > part.txt).");
    }
  }
  return text;
}

/// `text` cut into sequences of context + 1 bytes, side by side and
/// without overlap: the training split and the test split (every
/// kHeldOutEvery-th sequence). A sample's inputs are the first `context`
/// bytes of its sequence, its labels the byte after each of them.
inline std::pair<Samples, Samples> text_splits(const std::string& text, int64_t context, const std::string& source) {
  const int64_t span = context + 1;
  const auto count = static_cast<int64_t>(text.size()) / span;
  TORCH_CHECK(count >= kHeldOutEvery, "lockstep-train: ", source, " has ", text.size(), " bytes: fewer than ",
              kHeldOutEvery, " sequences of --context ", context, " + 1 bytes, of which every ", kHeldOutEvery,
              "th is held out for testing; give a longer --text, or a smaller --context.");
  auto bytes = torch::from_blob(const_cast<char*>(text.data()), {count, span}, torch::kUInt8).to(torch::kLong);
  auto held_out = torch::arange(count).remainder(kHeldOutEvery).eq(kHeldOutEvery - 1);
  const auto split = [&](const torch::Tensor& rows) {
    auto sequences = bytes.index_select(0, rows.nonzero().flatten());
    return Samples{sequences.narrow(1, 0, context).contiguous(), sequences.narrow(1, 1, context).contiguous()};
  };
  return {split(held_out.logical_not()), split(held_out)};
}

/// The text dataset `options` ask for: --text, else Debian's fortunes.
inline Dataset load_text_dataset(const DataOptions& options) {
  std::vector<std::string> files{options.text};
  std::string source = options.text;
  if (options.text.empty()) {
    files = fortune_files();
    TORCH_CHECK(!files.empty(), "lockstep-train: --model gpt trains on Debian's fortunes by default, and they are "
                "not in ", kFortunes, "; install them (apt install fortunes, as scripts/setup.sh does), or give "
                "--text FILE.");
    source = std::string("Debian's fortunes in ") + kFortunes;
  }
  const std::string text = read_text(files);
  Dataset data;
  std::tie(data.train, data.test) = text_splits(text, options.context, source);
  data.source = "the text of " + source + " (" + std::to_string(text.size()) + " bytes, sequences of " +
                std::to_string(options.context) + ")";
  if (options.first_train) {
    data.train = first_rows(data.train, options.train_size, "--train-samples", "training", source);
  }
  if (options.first_test) {
    data.test = first_rows(data.test, options.test_size, "--test-samples", "test", source);
  }
  return data;
}

} // namespace examples
} // namespace lockstep
