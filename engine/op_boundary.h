// Op boundaries: callbacks that run once the op now running has finished. An op reading a
// storage's data may run the storage's acquire hook (engine/storage.h) while it still holds
// pointers to other storages' data; what such a hook wants done only after the op (freeing
// memory the op may still be reading: parallel/fsdp.h's prefetch releases the unit before)
// it asks for here. The autograd engine marks a boundary where an op records its node (the
// end of every differentiable op run with gradients on) and after each node of a backward
// pass has run; ops run with gradients off mark none.
#pragma once

#include <functional>

namespace loom {

// Runs `callback` at the next op boundary on this thread (once; in the order asked).
void after_current_op(std::function<void()> callback);
// Runs and forgets the callbacks asked for so far on this thread (the engine calls it). A
// callback may ask for another, which runs at the next boundary, not this one.
void run_op_boundary();

}  // namespace loom
