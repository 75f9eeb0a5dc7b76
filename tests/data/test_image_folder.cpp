// Image folder tests on tiny PNG/BMP/JPEG files written with stb_image_write at run time:
// sorted classes become labels, pixels come back channels-first, channels are converted to one
// count, and a size mismatch or an unreadable image is reported naming the file.
#include "data/image_folder.h"
#include "tests/data/fixtures.h"

namespace loom::data::test {
namespace {

#define REQUIRE_IMAGE_WRITER()                                                                  \
  if (!kCanWriteImages)                                                                         \
  GTEST_SKIP() << "built without stb_image or stb_image_write (libstb-dev); cannot make image " \
                  "fixtures"

// (h, w, c) interleaved pattern whose value says where it came from: 10*c + x + 3*y + seed.
std::vector<uint8_t> hwc_image(int h, int w, int c, int seed) {
  std::vector<uint8_t> px;
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x)
      for (int k = 0; k < c; ++k) px.push_back(static_cast<uint8_t>(10 * k + x + 3 * y + seed));
  return px;
}

TEST(ImageFolder, SortedClassesAndChannelsFirstPixels) {
  REQUIRE_IMAGE_WRITER();
  TempDir t;
  write_image(t.file("dog/b.png"), 2, 3, 3, hwc_image(2, 3, 3, 40));
  write_image(t.file("dog/a.BMP"), 2, 3, 3, hwc_image(2, 3, 3, 20));
  write_image(t.file("cat/x.png"), 2, 3, 3, hwc_image(2, 3, 3, 0));
  write_text(t.file("cat/notes.txt"), "not an image");
  write_image(t.file("cat/.thumb.png"), 9, 9, 3, hwc_image(9, 9, 3, 0));
  const ImageSet s = load_image_folder(t.path());
  EXPECT_EQ(s.class_names, (std::vector<std::string>{"cat", "dog"}));
  EXPECT_EQ(s.labels, (std::vector<int64_t>{0, 1, 1}));
  EXPECT_EQ(s.count, 3);
  EXPECT_EQ(s.channels, 3);
  EXPECT_EQ(s.height, 2);
  EXPECT_EQ(s.width, 3);
  // Image 1 is dog/a.BMP (sorted before b.png); pixel (c=2, y=1, x=2) = 20 + 2 + 3 + 20.
  EXPECT_EQ(s.image(1)[2 * 6 + 1 * 3 + 2], 45);
  EXPECT_EQ(s.image(2)[0], 40);
}

TEST(ImageFolder, ChannelsFollowFirstImageOrRequest) {
  REQUIRE_IMAGE_WRITER();
  TempDir t;
  write_image(t.file("a/1.png"), 4, 4, 1, hwc_image(4, 4, 1, 0));
  write_image(t.file("a/2.png"), 4, 4, 3, hwc_image(4, 4, 3, 0));
  write_image(t.file("b/3.jpg"), 4, 4, 3, std::vector<uint8_t>(48, 128));
  EXPECT_EQ(load_image_folder(t.path()).channels, 1);
  const ImageSet rgb = load_image_folder(t.path(), 3);
  EXPECT_EQ(rgb.channels, 3);
  EXPECT_EQ(rgb.pixels.size(), 3u * 3 * 4 * 4);
  EXPECT_EQ(rgb.image(0)[16 + 5], rgb.image(0)[5]);  // gray expanded to equal R, G, B
  EXPECT_NEAR(rgb.image(2)[7], 128, 3);               // JPEG is lossy
}

TEST(ImageFolderErrors, SizeMismatchNamesFile) {
  REQUIRE_IMAGE_WRITER();
  TempDir t;
  write_image(t.file("a/1.png"), 4, 4, 3, hwc_image(4, 4, 3, 0));
  write_image(t.file("b/2.png"), 5, 4, 3, hwc_image(5, 4, 3, 0));
  EXPECT_LOOM_ERROR(load_image_folder(t.path()), t.file("b/2.png"), "4x5", t.file("a/1.png"),
                    "must share one size");
}

TEST(ImageFolderErrors, UnreadableImageNamesFile) {
  REQUIRE_IMAGE_WRITER();
  TempDir t;
  write_image(t.file("a/1.png"), 4, 4, 3, hwc_image(4, 4, 3, 0));
  write_text(t.file("a/2.png"), "this is not a png");
  EXPECT_LOOM_ERROR(load_image_folder(t.path()), t.file("a/2.png"), "cannot read as an image", "stb_image");
}

TEST(ImageFolderErrors, TruncatedImageNamesFile) {
  REQUIRE_IMAGE_WRITER();
  TempDir t;
  write_image(t.file("a/1.png"), 16, 16, 3, hwc_image(16, 16, 3, 0));
  std::vector<uint8_t> b = read_bytes(t.file("a/1.png"));
  b.resize(b.size() / 2);
  write_bytes(t.file("a/1.png"), b);
  EXPECT_LOOM_ERROR(load_image_folder(t.path()), t.file("a/1.png"), "cannot decode");
}

TEST(ImageFolderErrors, MissingDirectory) {
  TempDir t;
  EXPECT_LOOM_ERROR(load_image_folder(t.file("gone")), t.file("gone"),
                    image_folder_available() ? "no such directory" : "libstb-dev");
}

TEST(ImageFolderErrors, NoClassFolders) {
  REQUIRE_IMAGE_WRITER();
  TempDir t;
  write_image(t.file("loose.png"), 2, 2, 1, hwc_image(2, 2, 1, 0));
  EXPECT_LOOM_ERROR(load_image_folder(t.path()), t.path(), "no class subfolders");
}

TEST(ImageFolderErrors, EmptyClassFolder) {
  REQUIRE_IMAGE_WRITER();
  TempDir t;
  write_image(t.file("a/1.png"), 2, 2, 1, hwc_image(2, 2, 1, 0));
  write_text(t.file("b/readme.txt"), "x");
  EXPECT_LOOM_ERROR(load_image_folder(t.path()), t.file("b"), "holds no .png");
}

TEST(ImageFolderErrors, BadChannelCount) {
  TempDir t;
  EXPECT_LOOM_ERROR(load_image_folder(t.path(), 5), t.path(), "channels = 5");
}

}  // namespace
}  // namespace loom::data::test
