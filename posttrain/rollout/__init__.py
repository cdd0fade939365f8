"""The sampler (`generate`: one loop over a backend), its backends, multi-turn rollouts with tools, reward scoring
and the vLLM engine."""
