"""Helpers shared by the test modules: `from tests.helpers.online import ...` (online trainers),
`.preference` (reward, DPO, BCO, KTO), `.resume` (stop-and-resume checks), `.rollout` (sampler)."""
