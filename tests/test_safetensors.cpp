// safetensors in and out of a bare module, and every damaged file the
// reader refuses (lockstep/safetensors.h). The wrappers' saves and loads are
// in test_safetensors_wrappers.cpp; files of Python's safetensors package in
// python/safetensors_interop.py.

#include <lockstep/safetensors.h>

#include "../src/io/safetensors_format.h"
#include "../src/util/torch_compat.h"
#include "support/errors.h"
#include "support/scratch.h"
#include "support/warnings.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>

namespace lockstep {
namespace {

bool same_bytes(const torch::Tensor& a, const torch::Tensor& b) {
  const auto x = a.contiguous();
  const auto y = b.contiguous();
  return x.scalar_type() == y.scalar_type() && x.sizes() == y.sizes() && x.nbytes() == y.nbytes() &&
      (x.nbytes() == 0 || std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0); // an empty tensor's data is null
}

// Random bits of `dtype` (any pattern, NaNs included; 0 or 1 for bool).
torch::Tensor random_bits(torch::ScalarType dtype, std::vector<int64_t> shape) {
  const int64_t numel = c10::multiply_integers(shape);
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  auto raw = torch::randint(0, dtype == torch::kBool ? 2 : 256, {bytes}, torch::kByte);
  auto out = torch::empty(shape, torch::TensorOptions().dtype(dtype));
  std::memcpy(out.data_ptr(), raw.data_ptr(), bytes);
  return out;
}

std::vector<torch::ScalarType> every_dtype() {
  std::vector<torch::ScalarType> dtypes{torch::kDouble, torch::kFloat, torch::kHalf, torch::kBFloat16,
                                        torch::kLong,   torch::kInt,   torch::kShort, torch::kChar,
                                        torch::kByte,   torch::kBool,  torch::kComplexFloat};
  for (const auto& [name, dtype] : detail::versioned_safetensors_dtypes()) {
    dtypes.push_back(dtype);
  }
  return dtypes;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

// A file of `json` as its header and `data` after it, as a damaged writer
// might make it.
std::string raw_file(const std::string& json, const std::string& data) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) {
    out[i] = static_cast<char>((json.size() >> (8 * i)) & 0xff);
  }
  return out + json + data;
}

std::string parse_error(const std::string& bytes) {
  return testing::error_of([&] { detail::parse_safetensors(bytes.data(), bytes.size(), "bad.safetensors"); });
}

torch::nn::Sequential net() {
  return torch::nn::Sequential(torch::nn::Linear(3, 4), torch::nn::BatchNorm1d(4), torch::nn::Linear(4, 2));
}

TEST(Safetensors, EveryDtypeRoundTripsBitwise) {
  torch::manual_seed(0);
  torch::OrderedDict<std::string, torch::Tensor> tensors;
  for (auto dtype : every_dtype()) {
    tensors.insert(std::string("t_") + c10::toString(dtype), random_bits(dtype, {3, 5}));
  }
  tensors.insert("scalar", torch::tensor(2.5));
  tensors.insert("empty", torch::empty({0, 4}));
  const auto path = testing::scratch("every_dtype.safetensors");
  write_safetensors(tensors, path, {{"step", "1200"}});
  const auto read = read_safetensors(path);
  ASSERT_EQ(read.size(), tensors.size());
  for (const auto& item : tensors) {
    ASSERT_TRUE(read.contains(item.key())) << item.key();
    EXPECT_TRUE(same_bytes(read[item.key()], item.value())) << item.key();
  }
  const auto metadata = read_safetensors_metadata(path);
  EXPECT_EQ(metadata, (SafetensorsMetadata{{"format", "pt"}, {"step", "1200"}}));
}

// A view's values are written, not the memory under it: a transposed,
// offset or expanded tensor, and a conjugate or negative view, whose memory
// holds the values before the conjugation or negation.
TEST(Safetensors, ViewsAreWrittenAsTheirValues) {
  torch::manual_seed(0);
  const auto z = torch::randn({2, 3}, torch::kComplexFloat);
  torch::OrderedDict<std::string, torch::Tensor> tensors;
  tensors.insert("transposed", torch::randn({3, 4}).t());
  tensors.insert("offset", torch::arange(10, torch::kFloat).narrow(0, 3, 4));
  tensors.insert("expanded", torch::randn({1, 3}).expand({4, 3}));
  tensors.insert("conjugate", z.conj());
  tensors.insert("negative", torch::imag(z.conj()));
  ASSERT_TRUE(tensors["conjugate"].is_conj());
  ASSERT_TRUE(tensors["negative"].is_neg());
  const auto path = testing::scratch("views.safetensors");
  write_safetensors(tensors, path);
  const auto read = read_safetensors(path);
  for (const auto& item : tensors) {
    EXPECT_TRUE(torch::equal(read[item.key()], item.value().resolve_conj().resolve_neg())) << item.key();
  }
}

TEST(Safetensors, HeaderFollowsTheSpecAlignedTo8) {
  torch::OrderedDict<std::string, torch::Tensor> tensors;
  tensors.insert("b", torch::ones({3}, torch::kHalf));
  tensors.insert("a", torch::ones({1}, torch::kDouble));
  const auto path = testing::scratch("aligned.safetensors");
  write_safetensors(tensors, path);
  const auto bytes = read_file(path);
  uint64_t length = 0;
  std::memcpy(&length, bytes.data(), 8);
  EXPECT_EQ(length % 8, 0u);
  const auto header = nlohmann::json::parse(bytes.substr(8, length));
  EXPECT_EQ(header["__metadata__"]["format"], "pt");
  EXPECT_EQ(header["a"]["dtype"], "F64");
  EXPECT_EQ(header["a"]["data_offsets"], nlohmann::json({0, 8})); // the widest first: every tensor aligned
  EXPECT_EQ(header["b"]["data_offsets"], nlohmann::json({8, 14}));
  EXPECT_EQ(bytes.size(), 8 + length + 14);
}

TEST(Safetensors, ReadTensorsAreCopiesOnWriteOfTheFile) {
  torch::OrderedDict<std::string, torch::Tensor> tensors;
  tensors.insert("x", torch::zeros({4}));
  const auto path = testing::scratch("cow.safetensors");
  write_safetensors(tensors, path);
  read_safetensors(path)["x"].fill_(7);
  EXPECT_EQ(read_safetensors(path)["x"].sum().item<float>(), 0.0f);
}

TEST(Safetensors, ModuleSavesUnderItsStateDictNames) {
  torch::manual_seed(1);
  auto model = net();
  model->forward(torch::randn({5, 3})); // running statistics that are not the defaults
  const auto path = testing::scratch("net.safetensors");
  save_safetensors(model, path);
  const auto read = read_safetensors(path);
  std::vector<std::string> names = read.keys();
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"0.bias", "0.weight", "1.bias", "1.num_batches_tracked",
                                              "1.running_mean", "1.running_var", "1.weight", "2.bias", "2.weight"}));
  auto other = net();
  load_safetensors(other, path);
  for (const auto& item : model->named_parameters()) {
    EXPECT_TRUE(same_bytes(other->named_parameters()[item.key()], item.value())) << item.key();
  }
  for (const auto& item : model->named_buffers()) {
    EXPECT_TRUE(same_bytes(other->named_buffers()[item.key()], item.value())) << item.key();
  }
}

TEST(Safetensors, StrictLoadListsMissingAndUnexpectedNamesAsPythonAndLoadsNothing) {
  torch::OrderedDict<std::string, torch::Tensor> tensors;
  auto model = net();
  for (const auto& item : model->named_parameters()) {
    if (item.key() != "2.bias") {
      tensors.insert(item.key(), torch::zeros_like(item.value()));
    }
  }
  tensors.insert("3.weight", torch::zeros({1}));
  const auto path = testing::scratch("missing.safetensors");
  write_safetensors(tensors, path);
  const auto before = model->named_parameters()["0.weight"].clone();
  EXPECT_ERROR_SAYS(load_safetensors(model, path), path.c_str(), "nothing was loaded",
                    "Missing key(s) in state_dict: \"2.bias\", \"1.running_mean\"",
                    "Unexpected key(s) in state_dict: \"3.weight\".", "strict(false)");
  EXPECT_TRUE(same_bytes(model->named_parameters()["0.weight"], before));
  load_safetensors(model, path, SafetensorsLoadOptions().strict(false));
  EXPECT_EQ(model->named_parameters()["0.weight"].abs().sum().item<float>(), 0.0f);
  EXPECT_NE(model->named_parameters()["2.bias"].abs().sum().item<float>(), 0.0f);
}

// A Python DistributedDataParallel's state_dict() names every tensor
// "module.<name>": the error says so, and strict(false), which loads
// nothing, says so too (as load_state_dict(strict=False), it is no error).
TEST(Safetensors, NamesWithPythonWrappersPrefixAreNamedAsSuch) {
  torch::OrderedDict<std::string, torch::Tensor> tensors;
  auto model = net();
  for (const auto& item : model->named_parameters()) {
    tensors.insert("module." + item.key(), torch::zeros_like(item.value()));
  }
  const auto path = testing::scratch("ddp_prefix.safetensors");
  write_safetensors(tensors, path);
  EXPECT_ERROR_SAYS(load_safetensors(model, path), "Unexpected key(s) in state_dict: \"module.0.bias\"",
                    "carry the prefix \"module.\" of a Python DistributedDataParallel's");
  const std::string warned =
      testing::warning_text_of([&] { load_safetensors(model, path, SafetensorsLoadOptions().strict(false)); });
  for (const char* says : {"holds none of the module's 9 names, so nothing was loaded",
                           "the file's first is \"module.0.bias\"", "carry the prefix \"module.\""}) {
    EXPECT_NE(warned.find(says), std::string::npos) << warned;
  }
}

TEST(Safetensors, ShapeMismatchIsAnErrorEvenWhenNotStrict) {
  torch::OrderedDict<std::string, torch::Tensor> tensors;
  tensors.insert("0.weight", torch::zeros({3, 4}));
  const auto path = testing::scratch("shape.safetensors");
  write_safetensors(tensors, path);
  auto model = net();
  EXPECT_ERROR_SAYS(load_safetensors(model, path, SafetensorsLoadOptions().strict(false)),
                    "size mismatch for 0.weight: copying a param with shape [3, 4] from checkpoint, the shape in "
                    "current model is [4, 3].");
}

TEST(Safetensors, DtypeMismatchIsAnErrorUnlessConverted) {
  auto model = net();
  torch::OrderedDict<std::string, torch::Tensor> tensors;
  for (const auto& item : model->named_parameters()) {
    tensors.insert(item.key(), torch::full_like(item.value(), 0.5, torch::kBFloat16));
  }
  for (const auto& item : model->named_buffers()) {
    tensors.insert(item.key(), item.value().clone());
  }
  const auto path = testing::scratch("bf16.safetensors");
  write_safetensors(tensors, path);
  EXPECT_ERROR_SAYS(load_safetensors(model, path), "dtype mismatch for 0.weight: the file has BFloat16, the model Float",
                    "convert_dtypes(true)");
  load_safetensors(model, path, SafetensorsLoadOptions().convert_dtypes(true));
  EXPECT_EQ(model->named_parameters()["0.weight"].scalar_type(), torch::kFloat);
  EXPECT_EQ(model->named_parameters()["0.weight"].mean().item<float>(), 0.5f);
}

// A module of one buffer, w.
struct Holder : torch::nn::Module {
  explicit Holder(const torch::Tensor& value) : w(register_buffer("w", value)) {}
  torch::Tensor w;
};

// convert_dtypes(true) turned F32 values past F16's range into inf, wrapped
// I64 into I32, and truncated floats into integers, without a word.
TEST(Safetensors, ConversionsThatLoseValuesAreRefusedAndLoadNothing) {
  const auto convert = SafetensorsLoadOptions().convert_dtypes(true);
  auto file_of = [](const std::string& name, const torch::Tensor& w) {
    torch::OrderedDict<std::string, torch::Tensor> tensors;
    tensors.insert("w", w);
    const auto path = testing::scratch(name);
    write_safetensors(tensors, path);
    return path;
  };
  Holder half(torch::zeros({3}, torch::kHalf));
  const auto wide = file_of("wide.safetensors", torch::tensor({1.0f, 1e5f, -2e5f}));
  EXPECT_ERROR_SAYS(load_safetensors(half, wide, convert), "wide.safetensors): w: 2 of its 3 values (the first: 100000) "
                    "do not fit in Half, the model's dtype, when converted from the file's Float");
  EXPECT_EQ(half.w.abs().sum().item<float>(), 0.0f) << "it loaded part of the file";
  const auto fits = file_of("fits.safetensors", torch::tensor({1.0f, 6e4f, std::numeric_limits<float>::infinity()}));
  load_safetensors(half, fits, convert);
  EXPECT_EQ(half.w[1].item<float>(), 6e4f);
  Holder int32(torch::zeros({3}, torch::kInt));
  EXPECT_ERROR_SAYS(load_safetensors(int32, file_of("big.safetensors", torch::tensor({int64_t{1} << 40, int64_t{1},
                                                                                      int64_t{2}})), convert),
                    "1 of its 3 values (the first: 1099511627776) do not fit in Int");
  Holder int64(torch::zeros({3}, torch::kLong));
  EXPECT_ERROR_SAYS(load_safetensors(int64, wide, convert), "dtype mismatch for w: the file has Float, the model Long, "
                    "and convert_dtypes(true) converts only between floating-point dtypes, between complex ones or "
                    "between integer ones");
}

TEST(Safetensors, LargeModelsSplitIntoFilesWithAnIndex) {
  torch::manual_seed(2);
  auto model = net();
  const auto folder = testing::scratch("split");
  std::filesystem::create_directory(folder);
  const auto path = folder + "/model.safetensors";
  save_safetensors(model, path); // one file, superseded by the split save below
  save_safetensors(model, path, SafetensorsSaveOptions().max_shard_bytes(40));
  EXPECT_FALSE(std::filesystem::exists(path));
  const auto index = nlohmann::json::parse(read_file(path + ".index.json"));
  EXPECT_EQ(index["weight_map"]["0.weight"], "model-00001-of-00005.safetensors");
  EXPECT_EQ(index["metadata"]["total_size"], 4 * (12 + 4 + 4 * 4 + 8 + 2) + 8);
  EXPECT_TRUE(std::filesystem::exists(folder + "/model-00005-of-00005.safetensors"));
  auto other = net();
  load_safetensors(other, path); // through the index beside the absent file
  for (const auto& item : model->named_parameters()) {
    EXPECT_TRUE(same_bytes(other->named_parameters()[item.key()], item.value())) << item.key();
  }
  EXPECT_EQ(read_safetensors(path + ".index.json").size(), 9u);
}

TEST(Safetensors, AFileOfAnotherSaveBesideAnIndexIsAnErrorNamingIt) {
  const auto first = testing::scratch("first");
  const auto second = testing::scratch("second");
  std::filesystem::create_directory(first);
  std::filesystem::create_directory(second);
  auto model = net();
  save_safetensors(model, first + "/model.safetensors", SafetensorsSaveOptions().max_shard_bytes(40));
  save_safetensors(model, second + "/model.safetensors", SafetensorsSaveOptions().max_shard_bytes(40));
  std::filesystem::copy_file(second + "/model-00002-of-00005.safetensors", first + "/model-00002-of-00005.safetensors",
                             std::filesystem::copy_options::overwrite_existing);
  EXPECT_ERROR_SAYS(load_safetensors(model, first + "/model.safetensors"), "model-00002-of-00005.safetensors",
                    "belongs to another save than its index", "Save the model again");
}

TEST(Safetensors, AnIndexNamingAFileOutsideItsFolderIsRefused) {
  const auto path = testing::scratch("escape.safetensors.index.json");
  write_file(path, R"({"weight_map": {"w": "../w.safetensors"}})");
  EXPECT_ERROR_SAYS(read_safetensors(path), "tensor 'w' maps to '../w.safetensors', which is not the name of a file");
}

TEST(Safetensors, AnIndexNamingNoTensorIsRefused) {
  const auto path = testing::scratch("empty.safetensors.index.json");
  write_file(path, R"({"weight_map": {}})");
  EXPECT_ERROR_SAYS(read_safetensors_metadata(path), "naming at least one tensor");
}

TEST(Safetensors, AFailedWriteLeavesNoFile) {
  torch::OrderedDict<std::string, torch::Tensor> tensors;
  tensors.insert("x", torch::zeros({4}));
  const auto path = testing::scratch("absent_folder") + "/x.safetensors";
  EXPECT_ERROR_SAYS(write_safetensors(tensors, path), "lockstep::write_safetensors", "cannot create");
  EXPECT_FALSE(std::filesystem::exists(path));
}

// A tensor with no dense bytes is refused before any file is written, naming
// the file and the tensor.
TEST(Safetensors, ASparseOrMetaTensorIsRefusedNamingIt) {
  const auto path = testing::scratch("no_bytes.safetensors");
  torch::OrderedDict<std::string, torch::Tensor> sparse;
  sparse.insert("s", torch::eye(3).to_sparse());
  EXPECT_ERROR_SAYS(write_safetensors(sparse, path), "write_safetensors(", "no_bytes.safetensors): tensor 's' is Sparse",
                    ".to_dense()");
  torch::OrderedDict<std::string, torch::Tensor> meta;
  meta.insert("m", torch::empty({2}, torch::TensorOptions().device(torch::kMeta)));
  EXPECT_ERROR_SAYS(write_safetensors(meta, path), "tensor 'm' is on the meta device");
  EXPECT_FALSE(std::filesystem::exists(path));
  // A load into a module on the meta device kept no values, without a word.
  Holder real(torch::zeros({3}));
  const auto saved = testing::scratch("for_meta.safetensors");
  save_safetensors(real, saved);
  Holder deferred(torch::empty({3}, torch::TensorOptions().device(torch::kMeta)));
  EXPECT_ERROR_SAYS(load_safetensors(deferred, saved), "load_safetensors(", "for_meta.safetensors): 'w' is on the meta "
                    "device");
}

TEST(Safetensors, AMissingFileIsAnErrorNamingIt) {
  auto model = net();
  EXPECT_ERROR_SAYS(load_safetensors(model, "/nonexistent/model.safetensors"),
                    "cannot open the safetensors file /nonexistent/model.safetensors: there is no such file");
}

// Damaged files: each refused with a line naming the file and the tensor.
TEST(SafetensorsFormat, ATruncatedFileIsRefused) {
  EXPECT_NE(parse_error(std::string("\x10\0\0", 3)).find("bad.safetensors: 3 bytes, too short for a safetensors file"),
            std::string::npos);
  const auto whole = raw_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", std::string(8, '\0'));
  EXPECT_NE(parse_error(whole.substr(0, whole.size() - 3)).find("tensor 'w' ends at byte 8 of the data, but the file "
                                                                 "holds 5 bytes of data. The file is truncated"),
            std::string::npos);
}

TEST(SafetensorsFormat, AHeaderLengthPastTheFileIsRefused) {
  auto bytes = raw_file("{}", "");
  bytes[0] = 100;
  EXPECT_NE(parse_error(bytes).find("the header's length is 100 bytes, past the end of the file (10 bytes)"),
            std::string::npos);
  bytes[7] = 1;
  EXPECT_NE(parse_error(bytes).find("more than safetensors allows"), std::string::npos);
}

// torch.save's archives are the usual wrong file: the error says what the
// file is and how to convert it.
TEST(SafetensorsFormat, APyTorchArchiveIsNamedAsOne) {
  const std::string zip = std::string("PK\x03\x04", 4) + std::string(60, 'x');
  EXPECT_NE(parse_error(zip).find("It begins as a zip archive, which is what torch.save and torch::save write"),
            std::string::npos);
  const std::string pickle = std::string("\x80\x02\x8a\x0a", 4) + std::string(60, 'x'); // torch.save's, to a LONG1
  EXPECT_NE(parse_error(pickle).find("It begins as a Python pickle"), std::string::npos);
  EXPECT_EQ(parse_error(std::string(8, '\xff') + "x").find("It begins as"), std::string::npos);
}

TEST(SafetensorsFormat, MalformedJsonIsRefused) {
  EXPECT_NE(parse_error(raw_file("{\"w\": ", "")).find("the safetensors header is not valid JSON"), std::string::npos);
  EXPECT_NE(parse_error(raw_file("[1, 2]", "")).find("not an object of tensors"), std::string::npos);
  EXPECT_NE(parse_error(raw_file(R"({"w":{"dtype":"F32"}})", "")).find("tensor 'w' needs \"dtype\", \"shape\""),
            std::string::npos);
  EXPECT_NE(parse_error(raw_file(R"({"__metadata__":{"step":3}})", "")).find("__metadata__ entry 'step' is not a string"),
            std::string::npos);
}

// "__metadata__": null is no metadata, as the Rust reader (and so Python's
// safetensors) takes it.
TEST(SafetensorsFormat, NullMetadataIsNoMetadata) {
  const auto bytes = raw_file(R"({"__metadata__":null,"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})", "ab");
  const auto header = detail::parse_safetensors(bytes.data(), bytes.size(), "null.safetensors");
  EXPECT_TRUE(header.metadata.empty());
  ASSERT_EQ(header.entries.size(), 1u);
  EXPECT_EQ(header.entries[0].name, "w");
}

// A name or metadata text that is not UTF-8 cannot be in the JSON header:
// refused before anything is written, naming it, not an exception of the
// JSON library's.
TEST(Safetensors, NamesAndMetadataThatAreNotUtf8AreRefused) {
  const auto path = testing::scratch("not_utf8.safetensors");
  torch::OrderedDict<std::string, torch::Tensor> tensors;
  tensors.insert("w\xff", torch::ones({2}));
  EXPECT_ERROR_SAYS(write_safetensors(tensors, path), "tensor name 'w\\xff' is not valid UTF-8", "Rename it");
  torch::OrderedDict<std::string, torch::Tensor> fine;
  fine.insert("w", torch::ones({2}));
  EXPECT_ERROR_SAYS(write_safetensors(fine, path, {{"note", "caf\xe9"}}), "metadata value 'caf\\xe9' is not valid UTF-8");
  EXPECT_FALSE(std::filesystem::exists(path));
}

// The last value of a repeated key was written without a word.
TEST(Safetensors, AMetadataKeyGivenTwiceIsRefused) {
  const auto path = testing::scratch("twice.safetensors");
  torch::OrderedDict<std::string, torch::Tensor> tensors;
  tensors.insert("w", torch::ones({2}));
  EXPECT_ERROR_SAYS(write_safetensors(tensors, path, {{"note", "a"}, {"note", "b"}}),
                    "the safetensors metadata has the key \"note\" twice (\"a\" and \"b\")");
  EXPECT_FALSE(std::filesystem::exists(path));
}

// A Hugging Face model's folder is what users have at hand: the error says
// it is a folder and what to pass instead, not that there is no such file.
TEST(Safetensors, AFolderIsRefusedNamingWhatToPass) {
  const auto folder = testing::scratch("model_folder");
  std::filesystem::create_directories(folder);
  EXPECT_ERROR_SAYS(read_safetensors(folder), "is a folder", "model.safetensors");
}

TEST(SafetensorsFormat, DuplicateNamesAreRefused) {
  const auto bytes = raw_file(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                              R"("w":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                              "ab");
  EXPECT_NE(parse_error(bytes).find("names tensor 'w' twice"), std::string::npos);
  // A field given twice in one entry (nlohmann keeps the last, here F32 over I32).
  const auto fields = raw_file(R"({"v":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                               R"("w":{"dtype":"I32","dtype":"F32","shape":[1],"data_offsets":[1,5]}})",
                               "abcde");
  EXPECT_NE(parse_error(fields).find("gives 'dtype' twice in the entry of 'w'"), std::string::npos)
      << parse_error(fields);
  // A metadata key twice is taken as Python's package takes it: the last.
  const auto metadata = raw_file(R"({"__metadata__":{"note":"a","note":"b"},)"
                                 R"("w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})",
                                 "a");
  const auto header = detail::parse_safetensors(metadata.data(), metadata.size(), "notes.safetensors");
  EXPECT_EQ(header.metadata, (SafetensorsMetadata{{"note", "b"}}));
}

TEST(SafetensorsFormat, AnUnknownDtypeIsRefusedNamingTheKnownOnes) {
  const auto bytes = raw_file(R"({"w":{"dtype":"Q9","shape":[1],"data_offsets":[0,1]}})", "a");
  EXPECT_NE(parse_error(bytes).find("tensor 'w' has dtype \"Q9\", which is not a safetensors dtype this LibTorch has "
                                    "(it has F64, F32"),
            std::string::npos);
}

TEST(SafetensorsFormat, AByteCountThatDisagreesWithTheShapeIsRefused) {
  const auto bytes = raw_file(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", std::string(8, '\0'));
  EXPECT_NE(parse_error(bytes).find("tensor 'w' has 8 bytes, but its shape [3] of F32 needs 3 × 4"), std::string::npos);
  const auto huge = raw_file(R"({"w":{"dtype":"F32","shape":[4611686018427387904,8],"data_offsets":[0,8]}})", "");
  EXPECT_NE(parse_error(huge).find("too large to address"), std::string::npos);
}

TEST(SafetensorsFormat, OverlappingGappedOrTrailingBytesAreRefused) {
  const auto overlap = raw_file(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                                R"("b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}})",
                                "abc");
  EXPECT_NE(parse_error(overlap).find("tensors 'a' and 'b' overlap"), std::string::npos);
  const auto gap = raw_file(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})", "ab");
  EXPECT_NE(parse_error(gap).find("bytes 0 to 1 of the data belong to no tensor"), std::string::npos);
  const auto trailing = raw_file(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", "ab");
  EXPECT_NE(parse_error(trailing).find("holds 2 bytes of data but its tensors end at byte 1"), std::string::npos);
  const auto backwards = raw_file(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[1,0]}})", "a");
  EXPECT_NE(parse_error(backwards).find("which end before they begin"), std::string::npos);
}

TEST(SafetensorsFormat, ADamagedFileLoadsNothingIntoTheModule) {
  auto model = net();
  const auto path = testing::scratch("damaged.safetensors");
  save_safetensors(model, path);
  auto bytes = read_file(path);
  write_file(path, bytes.substr(0, bytes.size() - 1));
  const auto before = model->named_parameters()["2.weight"].clone();
  auto other = net();
  EXPECT_ERROR_SAYS(load_safetensors(other, path), path.c_str(), "The file is");
  EXPECT_FALSE(same_bytes(other->named_parameters()["2.weight"], before));
}

} // namespace
} // namespace lockstep
