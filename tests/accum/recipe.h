#pragma once
// The recipe both accumulation suites start from: an MLP on 256 synthetic examples in float64,
// micro-batches of 8, 5 SGD steps.

inline const char* const kAccumRecipe = R"(
[run]
seed = 11
steps = 5
dtype = "float64"

[model]
name = "mlp"
hidden = [24, 16]
activation = "tanh"

[data]
name = "synthetic-classification"
samples = 256
validation_samples = 0
features = 10
classes = 5
micro_batch = 8

[optimizer]
name = "sgd"
lr = 0.1
)";
