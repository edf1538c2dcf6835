"""The decode loop compiled on the device: one `lax.while_loop` (loop) of chain or tree iterations (iteration,
tree_iteration), what drafts and selects (drafters, selection, draft_kernel, adaptive_gamma) and what every
emitted token passes through (sampling, penalties, stops, logprobs)."""
