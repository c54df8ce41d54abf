// lockstep-train's data: IDX files of any size, gzipped or not, damaged
// ones named in one line, the main job's Fashion-MNIST, and --init-from's
// weights.

#include <lockstep/lockstep.h>

#include "support/errors.h"
#include "support/launch.h"
#include "support/processes.h"

#include <examples/checkpoint.h>
#include <examples/data.h>
#include <examples/idx.h>
#include <examples/models.h>
#include <examples/weights.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <functional>
#include <map>
#include <random>
#include <regex>

namespace lockstep {
namespace {

using namespace testing::jobs;
using testing::Process;

// --- IDX data files ---------------------------------------------------------------

// Writes an MNIST-format split of n rows into dir, gzipped or not; the images'
// header may declare more rows than are written (a truncated file).
void write_split(const std::string& dir, const std::string& prefix, uint32_t n, bool gz, uint32_t declared = 0) {
  auto be32 = [](uint32_t v) {
    return std::string{static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8),
                       static_cast<char>(v)};
  };
  std::mt19937 random(n);
  std::string images = be32(0x803) + be32(declared > 0 ? declared : n) + be32(28) + be32(28);
  std::string labels = be32(0x801) + be32(n);
  for (uint32_t i = 0; i < n; ++i) {
    const int label = static_cast<int>(i % 10);
    labels += static_cast<char>(label);
    for (int p = 0; p < 28 * 28; ++p) { // a learnable pattern: a bright band whose row is the label
      images += static_cast<char>(p / 28 / 3 == label ? 200 + random() % 50 : random() % 40);
    }
  }
  for (const auto& [name, bytes] : {std::make_pair(prefix + "-images-idx3-ubyte", images),
                                    std::make_pair(prefix + "-labels-idx1-ubyte", labels)}) {
    if (gz) {
      gzFile file = gzopen((dir + "/" + name + ".gz").c_str(), "wb");
      gzwrite(file, bytes.data(), static_cast<unsigned>(bytes.size()));
      gzclose(file);
    } else {
      std::ofstream(dir + "/" + name, std::ios::binary) << bytes;
    }
  }
}

Process train_on(const std::string& dir, const std::string& name) {
  return testing::run({LOCKSTEP_TRAIN, "--data", dir, "--batch-size", "50", "--epochs", "1", "--out", dir + "/out"}, {},
                      temp(name + ".log"),
                      kDeadline);
}

std::string fresh_dir(const std::string& name) {
  const std::string dir = temp(name);
  EXPECT_EQ(mkdir(dir.c_str(), 0755), 0);
  return dir;
}

TEST(TrainerData, SmallerAndGzippedIdxFilesAreAccepted) {
  // 600/200 rows, not MNIST's 60000/10000; the test split gzipped.
  const std::string dir = fresh_dir("idx_subset");
  write_split(dir, "train", 600, false);
  write_split(dir, "t10k", 200, true);
  auto p = train_on(dir, "idx_subset");
  EXPECT_EQ(p.exit_code, 0) << p.output;
  EXPECT_NE(p.output.find("600 train / 200 test samples"), std::string::npos) << p.output;
}

TEST(TrainerData, TruncatedIdxFilesAreOneLineErrorsNamingTheFile) {
  struct Case {
    std::string name;
    bool gz;
    uint32_t declared;
  };
  for (const auto& c : {Case{"idx_cut_plain", false, 400}, Case{"idx_cut_gz", true, 400}, Case{"idx_header_only", false, 1}}) {
    const std::string dir = fresh_dir(c.name);
    write_split(dir, "train", c.name == "idx_header_only" ? 0 : 200, c.gz, c.declared);
    write_split(dir, "t10k", 100, false);
    auto p = train_on(dir, c.name);
    const std::string file = dir + "/train-images-idx3-ubyte" + (c.gz ? ".gz" : "");
    EXPECT_EQ(p.exit_code, 1) << p.output;
    EXPECT_NE(p.output.find("lockstep-train: " + file + ": truncated: the header declares " + std::to_string(c.declared) +
                            " rows"),
              std::string::npos)
        << p.output;
  }
}

TEST(TrainerData, HeaderClaimingMillionsOfRowsAllocatesNothingBeforeTheShortRead) {
  // A 16-byte header may declare 2^24 images (13 GB) in a file of a few
  // bytes (found by fuzz_idx): the reader allocated all of it first. With
  // 1 GB of address space to spare it must still end on the truncation error.
  const std::string path = temp("huge_header.idx");
  const unsigned char header[] = {0, 0, 8, 3, 1, 0, 0, 0, 0, 0, 0, 28, 0, 0, 0, 28, 7, 7, 7};
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(header), sizeof(header));
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  // A sanitizer's shadow memory needs far more address space than the limit.
  EXPECT_THROW(examples::read_idx(path, 3), examples::IdxError);
#else
  auto read_with_1gb_spare = [&path] {
    long pages = 0; // the address space in use: LibTorch's CUDA build maps gigabytes of libraries
    std::ifstream("/proc/self/statm") >> pages;
    rlimit limit{};
    limit.rlim_cur = limit.rlim_max = static_cast<rlim_t>(pages) * static_cast<rlim_t>(sysconf(_SC_PAGESIZE)) + (rlim_t{1} << 30);
    setrlimit(RLIMIT_AS, &limit);
    try {
      examples::read_idx(path, 3);
    } catch (const examples::IdxError& e) {
      std::fprintf(stderr, "%s\n", e.what());
      std::exit(0);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "not an IdxError: %s\n", e.what());
    }
    std::exit(1);
  };
  ::testing::FLAGS_gtest_death_test_style = "threadsafe";
  EXPECT_EXIT(read_with_1gb_spare(), ::testing::ExitedWithCode(0), "truncated: the header declares 16777216 rows");
#endif
}

// An --export-mnist into a folder of the real, gzipped files wrote the
// plain ones beside them, and --data then read the export without a word.
TEST(TrainerData, AFileAndItsGzipBothThereIsAnError) {
  const std::string dir = fresh_dir("idx_both");
  std::ofstream(dir + "/train-images-idx3-ubyte") << "x";
  std::ofstream(dir + "/train-images-idx3-ubyte.gz") << "x";
  try {
    examples::idx_path(dir, "train-images-idx3-ubyte");
    ADD_FAILURE() << "no error";
  } catch (const examples::IdxError& e) {
    EXPECT_EQ(std::string(e.what()), dir + "/train-images-idx3-ubyte and " + dir + "/train-images-idx3-ubyte.gz both "
              "exist, and either could be the data meant; remove (or move) the one that is not");
  }
  const std::string gz_only = fresh_dir("idx_gz_only");
  std::ofstream(gz_only + "/t10k-labels-idx1-ubyte.gz") << "x";
  EXPECT_ERROR_SAYS(examples::export_synthetic(gz_only, 1), "--export-mnist: ", "t10k-labels-idx1-ubyte.gz exists",
                    "Export into another folder.");
  EXPECT_NE(access((gz_only + "/train-images-idx3-ubyte").c_str(), F_OK), 0) << "it wrote before refusing";
}

// A file the reader cannot open said "cannot open it" and not why.
TEST(TrainerData, AnIdxFileThatCannotBeOpenedSaysWhy) {
  const std::string path = temp("no_such_file.idx");
  try {
    examples::read_idx(path, 3);
    ADD_FAILURE() << "no error";
  } catch (const examples::IdxError& e) {
    EXPECT_EQ(std::string(e.what()), path + ": cannot open it (" + std::strerror(ENOENT) + ")");
  }
}

TEST(TrainerData, ForeignOrMissingFilesAreOneLineErrors) {
  const std::string dir = fresh_dir("idx_foreign");
  write_split(dir, "train", 100, false);
  std::ofstream(dir + "/t10k-images-idx3-ubyte") << "this is not an IDX file at all";
  std::ofstream(dir + "/t10k-labels-idx1-ubyte") << "neither is this one";
  auto p = train_on(dir, "idx_foreign");
  EXPECT_EQ(p.exit_code, 1) << p.output;
  EXPECT_NE(p.output.find(dir + "/t10k-images-idx3-ubyte: not an IDX file"), std::string::npos) << p.output;
  auto missing = train_on(fresh_dir("idx_nowhere"), "idx_nowhere"); // an empty directory
  EXPECT_EQ(missing.exit_code, 1) << missing.output;
  EXPECT_NE(missing.output.find("idx_nowhere/train-images-idx3-ubyte(.gz): no such file"), std::string::npos)
      << missing.output;
}

TEST(TrainerData, BadOutputPathsAndUnevenBatchesAreRefusedUpFront) {
  auto args = trainer("bad_paths");
  args.insert(args.end(), {"--checkpoint", temp("no_such_folder") + "/run.ckpt"});
  auto p = testing::run(args, {}, temp("bad_paths.log"), kDeadline);
  EXPECT_EQ(p.exit_code, 2) << p.output;
  EXPECT_NE(p.output.find("--checkpoint " + temp("no_such_folder") + "/run.ckpt: cannot write into"), std::string::npos)
      << p.output;
  EXPECT_EQ(p.output.find("epoch 1/"), std::string::npos) << "trained before refusing: " << p.output;

  auto uneven = with_flag(trainer("uneven"), "--batch-size", "65"); // over 2 ranks
  auto q = launch({"--nproc-per-node", "2", "--master-port", port()}, uneven, "uneven", {kOneThread});
  EXPECT_NE(q.exit_code, 0) << q.output;
  EXPECT_NE(q.output.find("--batch-size 65 does not split evenly over 2 ranks"), std::string::npos) << q.output;
}

// --- the main job's data: Debian's Fashion-MNIST ------------------------------

const std::string kFashionMnist = "/usr/share/datasets/fashion-mnist";

// The first `n` rows of Fashion-MNIST's `prefix` split, written into `dir` as
// IDX files of n rows, gzipped or not; the images file cut in half if `cut`.
void slice_fashion_mnist(const std::string& dir, const std::string& prefix, uint32_t n, bool gz, bool cut = false) {
  for (const auto& [kind, header, row] : {std::make_tuple("images-idx3-ubyte", 16, 28 * 28),
                                          std::make_tuple("labels-idx1-ubyte", 8, 1)}) {
    const std::string name = prefix + "-" + kind;
    gzFile in = gzopen((kFashionMnist + "/" + name + ".gz").c_str(), "rb");
    ASSERT_NE(in, nullptr) << kFashionMnist << " is missing: scripts/setup.sh installs dataset-fashion-mnist";
    std::string bytes(static_cast<size_t>(header + n * row), '\0');
    ASSERT_EQ(gzread(in, bytes.data(), static_cast<unsigned>(bytes.size())), static_cast<int>(bytes.size()));
    gzclose(in);
    for (int i = 0; i < 4; ++i) { // the row count, big-endian, after the magic number
      bytes[4 + i] = static_cast<char>(n >> (24 - 8 * i));
    }
    if (cut && row > 1) {
      bytes.resize(bytes.size() / 2);
    }
    if (gz) {
      gzFile out = gzopen((dir + "/" + name + ".gz").c_str(), "wb");
      gzwrite(out, bytes.data(), static_cast<unsigned>(bytes.size()));
      gzclose(out);
    } else {
      std::ofstream(dir + "/" + name, std::ios::binary) << bytes;
    }
  }
}

TEST(FashionMnist, PlainAndGzippedSlicesTrainAndACutFileIsNamed) {
  const std::string dir = fresh_dir("fashion_slices");
  slice_fashion_mnist(dir, "train", 300, false);
  slice_fashion_mnist(dir, "t10k", 100, true);
  auto p = train_on(dir, "fashion_slices");
  EXPECT_EQ(p.exit_code, 0) << p.output;
  EXPECT_NE(p.output.find("300 train / 100 test samples"), std::string::npos) << p.output;
  slice_fashion_mnist(dir, "train", 300, false, /*cut=*/true);
  auto cut = train_on(dir, "fashion_cut");
  EXPECT_EQ(cut.exit_code, 1) << cut.output;
  EXPECT_NE(cut.output.find(dir + "/train-images-idx3-ubyte: truncated"), std::string::npos) << cut.output;
}

TEST(FashionMnist, TwoRankEvaluationEqualsOneProcessOnTheSavedModel) {
  const std::string out = temp("fashion_out");
  // 301 test images: the ranks' shares differ by one.
  auto p = launch({"--nproc-per-node", "2", "--master-port", port()},
                  {LOCKSTEP_TRAIN, "--train-samples", "640", "--test-samples", "301", "--batch-size", "64", "--epochs",
                   "2", "--log-every", "4", "--eval-every", "6", "--out", out},
                  "fashion");
  ASSERT_EQ(p.exit_code, 0) << p.output;
  EXPECT_NE(p.output.find("MNIST-format data at " + kFashionMnist), std::string::npos) << p.output;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(p.output, m, std::regex("test accuracy [0-9.]+% \\(([0-9]+) of 301 test images, over 2 "
                                                        "rank\\(s\\)\\)"))) << p.output;
  const int64_t correct = std::stoll(m[1].str());

  // One process, the saved model, the same 301 images.
  examples::ConvNet net;
  torch::load(net, out + "/model.pt");
  net->eval();
  auto [images, labels] = examples::read_mnist_split(kFashionMnist, "t10k");
  torch::NoGradGuard no_grad;
  auto predicted = net(images.narrow(0, 0, 301)).argmax(1);
  EXPECT_EQ(predicted.eq(labels.narrow(0, 0, 301)).sum().item<int64_t>(), correct);
  // model.safetensors beside it holds the same parameters and buffers.
  examples::ConvNet from_safetensors;
  load_safetensors(from_safetensors, out + "/model.safetensors");
  for (const auto& item : net->named_parameters()) {
    EXPECT_TRUE(torch::equal(from_safetensors->named_parameters()[item.key()], item.value())) << item.key();
  }
  for (const auto& item : net->named_buffers()) {
    EXPECT_TRUE(torch::equal(from_safetensors->named_buffers()[item.key()], item.value())) << item.key();
  }

  // metrics.jsonl: 20 steps, a training record every 4, an evaluation at
  // steps 6, 12 and 18, and one record per epoch.
  std::map<std::string, std::vector<nlohmann::json>> records;
  std::istringstream lines(read_text(out + "/metrics.jsonl"));
  for (std::string line; std::getline(lines, line);) {
    auto record = nlohmann::json::parse(line); // throws, failing the test, if malformed
    records[record.at("kind").get<std::string>()].push_back(record);
  }
  ASSERT_EQ(records["train"].size(), 5u);
  ASSERT_EQ(records["eval"].size(), 3u);
  ASSERT_EQ(records["epoch"].size(), 2u);
  EXPECT_EQ(records["eval"][1].at("step").get<int64_t>(), 12);
  EXPECT_NEAR(records["train"][0].at("lr").get<double>(), 0.1 * 4 / 100, 1e-12); // warmup: step 4 of 100
  EXPECT_DOUBLE_EQ(records["epoch"][1].at("test_accuracy").get<double>(), correct / 301.0);
  EXPECT_GT(records["epoch"][1].at("samples_per_second").get<double>(), 0);
  struct stat info {};
  ASSERT_EQ(stat((out + "/curves.png").c_str(), &info), 0) << p.output;
  EXPECT_GT(info.st_size, 1000);
  EXPECT_NE(p.output.find("outputs in " + out + "/: metrics.jsonl, model.pt, model.safetensors, checkpoint.ckpt, "
                          "curves.png"),
            std::string::npos) << p.output;
}

TEST(FashionMnist, WithoutGnuplotTheMetricsStayAndOneLineSaysWhy) {
  const std::string out = temp("no_gnuplot_out");
  auto p = testing::run({LOCKSTEP_TRAIN, "--train-samples", "256", "--test-samples", "100", "--epochs", "1", "--out", out},
                        {"PATH=/nonexistent"}, temp("no_gnuplot.log"), kDeadline);
  ASSERT_EQ(p.exit_code, 0) << p.output;
  EXPECT_NE(p.output.find("lockstep-train: gnuplot is not installed, so no curves.png (install gnuplot-nox"),
            std::string::npos) << p.output;
  EXPECT_NE(access((out + "/curves.png").c_str(), F_OK), 0);
  EXPECT_NE(read_text(out + "/metrics.jsonl").find("\"kind\":\"epoch\""), std::string::npos);
  EXPECT_NE(read_text(out + "/curves.gp").find("plot $test"), std::string::npos);
}

// gnuplot runs in the output folder without a shell: a folder's name is never
// parsed as a command, and one with quotes in it gets its curves too.
TEST(FashionMnist, AnyOutputFolderNameGetsItsCurvesAndRunsNothing) {
  // The quotes balance in the command that the shell was given: touch ran.
  const std::string injected = temp("injected_by_out");
  const std::string out = temp("quoted_out") + "';touch " + injected + ";'";
  auto p = testing::run({LOCKSTEP_TRAIN, "--train-samples", "256", "--test-samples", "100", "--epochs", "1", "--out", out},
                        {}, temp("quoted_out.log"), kDeadline);
  ASSERT_EQ(p.exit_code, 0) << p.output;
  EXPECT_NE(access(injected.c_str(), F_OK), 0) << "the --out name ran a command";
  struct stat info {};
  ASSERT_EQ(stat((out + "/curves.png").c_str(), &info), 0) << p.output;
  EXPECT_GT(info.st_size, 1000);
  EXPECT_NE(p.output.find("outputs in " + out + "/: metrics.jsonl, model.pt, model.safetensors, checkpoint.ckpt, "
                          "curves.png"), std::string::npos) << p.output;
}

// A full disk (/dev/full behind the file's name): a picture cut short is
// removed and said so, and a metrics record that was not written stops the run.
TEST(FashionMnist, WritesThatFailAreSaidNeverListedAsOutputs) {
  const std::vector<std::string> args{LOCKSTEP_TRAIN, "--train-samples", "256", "--test-samples", "100", "--epochs", "1",
                                      "--out"};
  const std::string png_out = temp("full_png_out");
  ASSERT_EQ(mkdir(png_out.c_str(), 0700), 0);
  ASSERT_EQ(symlink("/dev/full", (png_out + "/curves.png").c_str()), 0);
  auto png_args = args;
  png_args.push_back(png_out);
  auto p = testing::run(png_args, {}, temp("full_png.log"), kDeadline);
  ASSERT_EQ(p.exit_code, 0) << p.output;
  // gnuplot 5.4 exits with 0 after its writes fail; one that says so takes
  // the "gnuplot failed" path instead.
  const bool said = p.output.find("lockstep-train: gnuplot left " + png_out + "/curves.png missing or cut short (is "
                                  "the disk full?), so it was removed") != std::string::npos ||
                    p.output.find("lockstep-train: gnuplot failed on " + png_out + "/curves.gp") != std::string::npos;
  EXPECT_TRUE(said) << p.output;
  EXPECT_NE(p.output.find("outputs in " + png_out + "/: metrics.jsonl, model.pt, model.safetensors, checkpoint.ckpt\n"),
            std::string::npos) << p.output;

  const std::string metrics_out = temp("full_metrics_out");
  ASSERT_EQ(mkdir(metrics_out.c_str(), 0700), 0);
  ASSERT_EQ(symlink("/dev/full", (metrics_out + "/metrics.jsonl").c_str()), 0);
  auto metrics_args = args;
  metrics_args.push_back(metrics_out);
  p = testing::run(metrics_args, {}, temp("full_metrics.log"), kDeadline);
  EXPECT_NE(p.exit_code, 0) << p.output;
  EXPECT_NE(p.output.find("lockstep-train: could not write " + metrics_out + "/metrics.jsonl (No space left on device; "
                          "is the disk full?)"), std::string::npos) << p.output;
}

// --init-from a file holding a NaN trained to NaN, and the run then advised
// a lower --lr.
TEST(TrainerData, InitFromWeightsWithANanIsRefusedNamingTheTensor) {
  examples::TrainerNet saved("cnn");
  {
    torch::NoGradGuard no_grad;
    saved->named_parameters()["fc2.bias"][3] = std::numeric_limits<float>::quiet_NaN();
  }
  const std::string path = temp("nan_weights.safetensors");
  lockstep::save_safetensors(saved, path);
  examples::TrainerNet net("cnn");
  EXPECT_ERROR_SAYS(examples::init_from(net, path), "nan_weights.safetensors: fc2.bias holds 1 NaN or infinite value");
  saved->named_parameters()["fc2.bias"].detach().zero_();
  lockstep::save_safetensors(saved, path);
  EXPECT_NO_THROW(examples::init_from(net, path));
}

TEST(TrainerData, NoTrainingBatchIsAnError) {
  auto args = with_flag(trainer("no_batch"), "--train-samples", "1"); // one row for two ranks
  auto p = launch({"--nproc-per-node", "2", "--master-port", port()}, args, "no_batch");
  EXPECT_EQ(p.exit_code, 1) << p.output;
  EXPECT_NE(p.output.find("the 1 training samples cannot give each of the 2 ranks a row: give more samples"),
            std::string::npos) << p.output;
  EXPECT_EQ(p.output.find("epoch 1/"), std::string::npos) << "refused only after training began: " << p.output;
  EXPECT_EQ(p.output.find("nan"), std::string::npos) << p.output;
}

} // namespace
} // namespace lockstep
