// Image decoding with stb_image, compiled into this one file with STB_IMAGE_STATIC, so Loom needs
// only the header (Debian's libstb-dev) and its symbols cannot clash with another copy of stb
// linked into the same program.
#include <cstdlib>
#include <memory>

#include "data/image_decode.h"
#include "kernels/core/error.h"

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
#pragma GCC diagnostic ignored "-Wsign-compare"
#pragma GCC diagnostic ignored "-Wimplicit-fallthrough"
#define STB_IMAGE_STATIC
#define STB_IMAGE_IMPLEMENTATION
#define STBI_ONLY_PNG
#define STBI_ONLY_JPEG
#define STBI_ONLY_BMP
#include <stb/stb_image.h>
#pragma GCC diagnostic pop

namespace loom::data {


ImageInfo read_image_info(const std::string& path) {
  ImageInfo info;
  LOOM_CHECK(stbi_info(path.c_str(), &info.width, &info.height, &info.channels) == 1, path,
             ": cannot read as an image (stb_image: ", stbi_failure_reason(),
             "); expected a PNG, JPEG or BMP file");
  return info;
}

DecodedImage decode_image(const std::string& path, int channels) {
  LOOM_ASSERT(channels >= 1 && channels <= 4, "channels ", channels);
  DecodedImage img;
  int native = 0;
  std::unique_ptr<stbi_uc, void (*)(void*)> data(
      stbi_load(path.c_str(), &img.width, &img.height, &native, channels), stbi_image_free);
  LOOM_CHECK(data != nullptr, path, ": cannot decode (stb_image: ", stbi_failure_reason(),
             "); expected a readable PNG, JPEG or BMP file: corrupt or truncated?");
  img.channels = channels;
  const size_t n = static_cast<size_t>(img.width) * img.height * channels;
  img.pixels.assign(data.get(), data.get() + n);
  return img;
}

}  // namespace loom::data
