// Placeholder: the Gloo backend.
#include "parallel/process_group.h"
