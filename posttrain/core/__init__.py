"""Pure-torch building blocks shared by every trainer: log-softmax, masked reductions, KL estimators,
advantage estimators, policy and preference losses, reward shaping, and the `Registry` of named functions.
Imports nothing of posttrain outside core/ (tests/test_architecture.py)."""
