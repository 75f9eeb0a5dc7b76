// Placeholder: the checks and the debug ledger shared by every backend.
#include "parallel/process_group.h"
