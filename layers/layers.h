// Everything in layers/ in one include, for programs: modules in loom::nn, optimizers,
// schedules and clipping in loom::optim.
#pragma once

#include "layers/activation.h"
#include "layers/batch_norm.h"
#include "layers/checkpoint.h"
#include "layers/conv.h"
#include "layers/dropout.h"
#include "layers/embedding.h"
#include "layers/flatten.h"
#include "layers/layer_norm.h"
#include "layers/linear.h"
#include "layers/module.h"
#include "layers/pool.h"
#include "layers/models/resnet.h"
#include "layers/models/simple_cnn.h"
#include "layers/sequential.h"
#include "layers/optim/adam.h"
#include "layers/optim/clip.h"
#include "layers/optim/optimizer.h"
#include "layers/optim/schedule.h"
#include "layers/optim/sgd.h"
