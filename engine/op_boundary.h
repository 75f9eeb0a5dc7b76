// Op boundaries: callbacks that run once the op now running has finished. An op reading a
// storage's data may run the storage's acquire hook (engine/storage.h) while it still holds
// pointers to other storages' data; what such a hook wants done only after the op (freeing
// memory the op may still be reading: parallel/fsdp.h's prefetch releases the unit before)
// it asks for here. The autograd engine marks a boundary where an op records its node (the
// end of every differentiable op run with gradients on and an input that needs a gradient) and
// after each node of a backward pass has run; other ops mark none, and the callbacks then
// wait for the next boundary. A boundary is also marked where an op calls another that
// records (a cast or a view of an input), so an op must take the raw pointers it reads from
// its inputs after such calls, as Loom's ops do: they launch their kernels last, before they
// record. A callback that throws passes the error on; those after it wait for the next one.
#pragma once

#include <functional>

namespace loom {

// Runs `callback` at the next op boundary on this thread (once; in the order asked).
void after_current_op(std::function<void()> callback);
// Runs and forgets the callbacks asked for so far on this thread (the engine calls it). A
// callback may ask for another, which runs at the next boundary, not this one.
void run_op_boundary();

}  // namespace loom
