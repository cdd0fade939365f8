"""Model-facing log-probs: the fused output layer, packing of groups and pairs, the completion forwards."""
