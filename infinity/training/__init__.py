"""The training path: module and gradient hooks, the wrapped optimizer and its tiled step, gradients
and their views, operations on attached parameters, where updates run, precision, activation
offload."""
