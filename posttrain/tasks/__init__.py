"""Built-in tasks, offline: datasets, answer checkers and reward functions (`builtin`: `reverse`, `add`, ...),
and tool environments for multi-turn RL (`environments`: calculator, guess-the-number)."""
