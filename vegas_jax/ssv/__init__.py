"""SSV for models with Native Sparse Attention: precision classes, the planner, and the choice for one run."""
