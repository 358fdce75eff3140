// The harness's process-wide logger.
#include "doubles.h"

namespace harness {

RecordingLogger& logger() {
  static RecordingLogger instance;
  return instance;
}
TestLoggerFinder& loggerFinder() {
  static TestLoggerFinder instance(&logger());
  return instance;
}

}  // namespace harness
