"""Helpers of the rollout tests."""


def varied(name):
    """The tiny model with larger random weights (the seeded one repeats one token), biases included."""
    import torch

    from posttrain.models.loading import load_causal_lm

    model = load_causal_lm(name)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.1) + (p.dim() == 1))
    return model.eval()
