// Contract harness of the TensorRT plugin: makes the calls a TensorRT builder and runtime make,
// in their order, through the library's C entry points and TensorRT's interfaces only (plus the
// plugin's setPagesPerSlot()), with test doubles for what TensorRT would provide.
//
//   dflash_trt_contract_harness [--report FILE]        every form's call sequence, every
//                                                      bad-input path, registration (no GPU needed)
//   ... --gpu [--dump DIR]                             also enqueue on device buffers; inputs and
//                                                      pools as .npy under DIR
//   ... --check-shapes FILE                            only the plugin's verdict on FILE's cases
// Prints one PASS/FAIL line per check and a SUMMARY line; exits 0 only when every check passed.
#include <cstdio>
#include <string>

#include "cases.h"
#include "sequence.h"

int main(int argc, char** argv) {
  using namespace harness;
  bool gpu = false;
  std::string dumpDir, reportPath, shapesPath;
  for (int i = 1; i < argc; ++i) {
    std::string const arg = argv[i];
    if (arg == "--gpu") {
      gpu = true;
    } else if (arg == "--dump" && i + 1 < argc) {
      dumpDir = argv[++i];
    } else if (arg == "--report" && i + 1 < argc) {
      reportPath = argv[++i];
    } else if (arg == "--check-shapes" && i + 1 < argc) {
      shapesPath = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s [--report FILE] [--gpu [--dump DIR] | --check-shapes FILE]\n", argv[0]);
      return 2;
    }
  }
  if (!dumpDir.empty() && !gpu) {
    std::fprintf(stderr, "--dump DIR needs --gpu\n");
    return 2;
  }
  setLoggerFinder(&loggerFinder());  // as TensorRT does when it loads the library

  RecordingErrorRecorder recorder;
  TestResourceContext context(&recorder);
  std::string mode;
  if (!shapesPath.empty()) {
    mode = "check-shapes";
    if (!shapeCases(shapesPath, &context)) return 2;
  } else {
    mode = gpu ? "gpu" : "cpu";
    slotContractCases(&context);
    pagedContractCases(&context);
    slotMappingContractCases(&context);
    quantizedContractCases(&context);
    fieldCases();
    slotBadInputs(&context, &recorder);
    pagedBadInputs(&context);
    overflowCases(&context);
    quantizedBadInputs(&context);
    registration();
    requireGroup(kRegistrationGroup);
    if (gpu) gpuCases(dumpDir, &context);
  }
  std::printf("SUMMARY passed=%d failed=%d mode=%s\n", passedCount(), failedCount(), mode.c_str());
  if (!reportPath.empty() && !writeReport(reportPath, mode)) return 2;
  return failedCount() == 0 ? 0 : 1;
}
