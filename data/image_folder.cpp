// Image folder reader, in three passes: list the files, read every header (so a size mismatch or
// an unreadable file fails before any decoding, naming the file), then decode the first image
// and allocate for count x its real decoded size before decoding the rest — the only size taken
// on trust is one the decoder has already produced.
#include "data/image_folder.h"

#include <algorithm>
#include <cctype>
#include <filesystem>

#include "data/data_config.h"
#include "data/file_io.h"
#include "data/image_decode.h"
#include "kernels/core/error.h"

namespace loom::data {

namespace fs = std::filesystem;

namespace {

bool is_image_name(const fs::path& p) {
  std::string ext = p.extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return std::tolower(c); });
  return ext == ".png" || ext == ".jpg" || ext == ".jpeg" || ext == ".bmp";
}

std::vector<std::string> list_class_dirs(const std::string& root) {
  std::vector<std::string> names;
  std::error_code ec;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!is_hidden(name) && it->is_directory(ec)) names.push_back(name);
  }
  LOOM_CHECK(!ec, root, ": cannot list (", ec.message(), ")");
  std::sort(names.begin(), names.end());
  return names;
}

std::vector<std::string> list_images(const std::string& dir) {
  std::vector<std::string> files;
  std::error_code ec;
  fs::recursive_directory_iterator it(dir, ec), end;
  for (; !ec && it != end; it.increment(ec)) {
    const fs::path& p = it->path();
    if (is_hidden(p.filename().string())) {
      if (it->is_directory(ec)) it.disable_recursion_pending();
      continue;
    }
    if (is_image_name(p) && it->is_regular_file(ec)) files.push_back(p.string());
  }
  LOOM_CHECK(!ec, dir, ": cannot list (", ec.message(), ")");
  std::sort(files.begin(), files.end());
  return files;
}

// (height, width, channels) -> (channels, height, width)
void hwc_to_chw(const DecodedImage& img, uint8_t* dst) {
  const int64_t hw = int64_t{img.height} * img.width;
  for (int64_t i = 0; i < hw; ++i) {
    for (int c = 0; c < img.channels; ++c) dst[c * hw + i] = img.pixels[i * img.channels + c];
  }
}

}  // namespace

bool image_folder_available() { return LOOM_DATA_WITH_STB_IMAGE; }

ImageSet load_image_folder(const std::string& root, int channels) {
  LOOM_CHECK(channels >= 0 && channels <= 4, root, ": channels = ", channels,
             ", expected 1 (gray), 2 (gray+alpha), 3 (RGB), 4 (RGBA), or 0 for the first image's");
  LOOM_CHECK(image_folder_available(), root, ": cannot read image folders: Loom was built without "
             "stb_image (no <stb/stb_image.h> at configure time); install libstb-dev and run "
             "meson setup --reconfigure");
  const char* layout = "expected an image folder: root/<class name>/<image>.png|jpg|bmp";
  require_directory(root, layout);

  ImageSet s;
  s.class_names = list_class_dirs(root);
  LOOM_CHECK(!s.class_names.empty(), root, ": has no class subfolders; ", layout);
  std::vector<std::string> files;
  for (size_t k = 0; k < s.class_names.size(); ++k) {
    const std::string dir = join_path(root, s.class_names[k]);
    const std::vector<std::string> images = list_images(dir);
    LOOM_CHECK(!images.empty(), dir, ": class folder holds no .png, .jpg, .jpeg or .bmp files; "
               "remove it or add its images");
    files.insert(files.end(), images.begin(), images.end());
    s.labels.insert(s.labels.end(), images.size(), static_cast<int64_t>(k));
  }

  const ImageInfo first = read_image_info(files[0]);
  for (size_t i = 1; i < files.size(); ++i) {
    const ImageInfo info = read_image_info(files[i]);
    LOOM_CHECK(info.height == first.height && info.width == first.width, files[i], ": image is ",
               info.width, "x", info.height, " (width x height) but ", files[0], " is ", first.width,
               "x", first.height, "; all images in an image folder must share one size (resize them first)");
  }

  s.channels = channels != 0 ? channels : first.channels;
  s.source = files[0];
  s.count = static_cast<int64_t>(files.size());
  for (size_t i = 0; i < files.size(); ++i) {
    const DecodedImage img = decode_image(files[i], static_cast<int>(s.channels));
    LOOM_CHECK(img.height == first.height && img.width == first.width, files[i], ": decodes to ",
               img.width, "x", img.height, " but its header said ", first.width, "x", first.height,
               ": corrupt file?");
    if (i == 0) {
      s.height = img.height;
      s.width = img.width;
      s.pixels.resize(static_cast<size_t>(s.count * s.image_bytes()));
    }
    hwc_to_chw(img, s.pixels.data() + i * s.image_bytes());
  }
  return s;
}

}  // namespace loom::data
