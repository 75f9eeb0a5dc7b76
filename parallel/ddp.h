// Placeholder: DistributedDataParallel.
#pragma once
