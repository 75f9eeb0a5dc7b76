// Built in place of image_decode_stb.cpp when meson found no <stb/stb_image.h>: every call
// fails with what to install, so a program using image folders fails clearly, not at link time.
#include "data/image_decode.h"
#include "kernels/core/error.h"

namespace loom::data {

namespace {
[[noreturn]] void unavailable(const std::string& path) {
  LOOM_FAIL(path, ": cannot decode images: Loom was built without stb_image (no <stb/stb_image.h> at "
            "configure time); install libstb-dev and run meson setup --reconfigure");
}
}  // namespace

ImageInfo read_image_info(const std::string& path) { unavailable(path); }
DecodedImage decode_image(const std::string& path, int) { unavailable(path); }

}  // namespace loom::data
