// Placeholder: the NCCL backend.
#include "parallel/process_group.h"
