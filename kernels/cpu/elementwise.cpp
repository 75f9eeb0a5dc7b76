// PLACEHOLDER: replaced by the elementwise kernels.
#include "kernels/cpu/kernels.h"
#include "kernels/core/error.h"

namespace loom::cpu {

void fill(const Strided& out, double value, StreamHandle stream) {
  LOOM_FAIL("cpu kernel fill is not written yet");
}

void copy(const Strided& out, const Strided& in, StreamHandle stream) {
  LOOM_FAIL("cpu kernel copy is not written yet");
}

void arange(const Strided& out, double start, double step, StreamHandle stream) {
  LOOM_FAIL("cpu kernel arange is not written yet");
}

void unary(UnaryOp op, const Strided& out, const Strided& in, double param, StreamHandle stream) {
  LOOM_FAIL("cpu kernel unary is not written yet");
}

void unary_backward(UnaryOp op, const Strided& grad_in, const Strided& grad_out, const Strided& in,
                    const Strided& out, double param, StreamHandle stream) {
  LOOM_FAIL("cpu kernel unary_backward is not written yet");
}

void binary(BinaryOp op, const Strided& out, const Strided& a, const Strided& b, StreamHandle stream) {
  LOOM_FAIL("cpu kernel binary is not written yet");
}

void where(const Strided& out, const Strided& cond, const Strided& a, const Strided& b, StreamHandle stream) {
  LOOM_FAIL("cpu kernel where is not written yet");
}

}  // namespace loom::cpu
