"""Fixtures shared by the rollout tests."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # plain helper modules next to the tests (rollout_helpers)
