#pragma once
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>
