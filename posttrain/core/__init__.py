"""Pure-torch building blocks shared by every trainer: masked reductions, KL estimators,
advantage estimators, policy and preference losses."""
