// Image folders, torchvision's ImageFolder layout: root/<class>/<image>, one subfolder per
// class, class names sorted to give labels 0..K-1. PNG, JPEG and BMP are decoded with stb_image.
// Images are not resized: every image must share one height and width (the first file that
// differs is named), while channels are converted to one count, so a stray grayscale PNG in an
// RGB set is no error.
#pragma once

#include <string>

#include "image_set.h"

namespace loom::data {

// False when Loom was built without stb_image; load_image_folder then throws saying so.
bool image_folder_available();

// Reads every .png/.jpg/.jpeg/.bmp file (any case) under each class folder, recursively and in
// sorted order, skipping hidden files and folders. `channels` is 1..4, or 0 for the first image's
// own count. Returns (count, channels, height, width) with labels and class_names.
ImageSet load_image_folder(const std::string& root, int channels = 0);

}  // namespace loom::data
