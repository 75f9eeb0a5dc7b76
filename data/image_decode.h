// Image decoding behind one small interface, so that image_folder.cpp does not depend on stb:
// image_decode_stb.cpp implements it with stb_image where the header was found at configure
// time, image_decode_none.cpp (built otherwise) says what to install.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace loom::data {

struct ImageInfo {
  int height = 0, width = 0, channels = 0;
};

struct DecodedImage {
  std::vector<uint8_t> pixels;  // (height, width, channels), as decoders produce it
  int height = 0, width = 0, channels = 0;
};

// Size and channel count from the file's header alone; throws naming the file when it is not
// an image the decoder can read.
ImageInfo read_image_info(const std::string& path);
// Decodes a PNG/JPEG/BMP file to `channels` channels (1 gray, 2 gray+alpha, 3 RGB, 4 RGBA),
// converting as needed; throws naming the file when it cannot be decoded.
DecodedImage decode_image(const std::string& path, int channels);

}  // namespace loom::data
