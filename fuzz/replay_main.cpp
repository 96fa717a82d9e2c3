// A main for the fuzz targets in builds without libFuzzer (g++, the dev and asan presets):
// runs every file named on the command line, and every regular file of every directory
// named (not recursively, in name order), through LLVMFuzzerTestOneInput once, like
// libFuzzer's StandaloneFuzzTargetMain. A target that finds a broken property aborts, so
// the process fails on the first bad input; ctest replays each target's corpus this way.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);

namespace {

namespace fs = std::filesystem;

bool run_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::cerr << "replay: cannot read " << path << '\n';
    return false;
  }
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)),
                                std::istreambuf_iterator<char>());
  // A copy in a buffer of its own size, so reading past the input is caught by ASan.
  std::vector<std::uint8_t> input(bytes.begin(), bytes.end());
  LLVMFuzzerTestOneInput(input.data(), input.size());
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<fs::path> files;
  for (int i = 1; i < argc; ++i) {
    const fs::path arg(argv[i]);
    std::error_code ec;
    if (fs::is_directory(arg, ec)) {
      std::vector<fs::path> in_dir;
      for (const auto& entry : fs::directory_iterator(arg)) {
        if (entry.is_regular_file()) in_dir.push_back(entry.path());
      }
      std::sort(in_dir.begin(), in_dir.end());
      files.insert(files.end(), in_dir.begin(), in_dir.end());
    } else {
      files.push_back(arg);
    }
  }
  if (files.empty()) {
    std::cerr << "usage: " << argv[0] << " FILE_OR_DIR...: runs each input through the target\n";
    return 2;
  }
  std::size_t ran = 0;
  for (const fs::path& f : files) {
    std::cerr << "replay: " << f.string() << '\n';  // names the input of a finding
    if (!run_file(f)) return 1;
    ++ran;
  }
  std::cout << "replay: " << ran << " input(s) ran without a finding\n";
  return 0;
}
