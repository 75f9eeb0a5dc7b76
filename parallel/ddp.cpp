// Placeholder: DistributedDataParallel.
#include "parallel/ddp.h"
