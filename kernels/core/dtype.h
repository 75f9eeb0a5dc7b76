// Element types shared by every layer of Loom. The enum sits at the bottom of the
// build (kernels/core) so kernels, the engine and the distributed runtime agree on
// one list without any of them including upwards.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace loom {

// f64 exists for finite-difference gradient checks and for users who need it on
// the CPU; the training dtypes are f32, bf16 and f16. Comparisons produce u8.
enum class DType : uint8_t { f32, f64, bf16, f16, i32, i64, u8 };

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::f64:
    case DType::i64: return 8;
    case DType::f32:
    case DType::i32: return 4;
    case DType::bf16:
    case DType::f16: return 2;
    case DType::u8: return 1;
  }
  return 0;
}

constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::u8: return "u8";
  }
  return "?";
}

constexpr bool is_floating(DType t) {
  return t == DType::f32 || t == DType::f64 || t == DType::bf16 || t == DType::f16;
}

// Host-side 16-bit floats: storage only, arithmetic goes through float.
// Conversion rounds to nearest even, as the hardware does.
struct bf16 {
  uint16_t bits = 0;
  bf16() = default;
  explicit bf16(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN stays NaN
      bits = uint16_t((u >> 16) | 0x40);
      return;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    bits = uint16_t(u >> 16);
  }
  operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
  }
};

struct f16 {
  uint16_t bits = 0;
  f16() = default;
  explicit f16(float f);
  operator float() const;
};

}  // namespace loom
