"""A trained process reward model as a reward function of the online trainers (GRPO, RLOO, Online DPO, ...).

    from posttrain import GRPOTrainer, ProcessRewardFunction
    prm = ProcessRewardFunction("path/to/prm", step_separator="\\n", aggregation="min")
    trainer = GRPOTrainer(model, reward_funcs=[prm, exact_match], ...)

Each completion is split into steps at `step_separator` (the separator the PRM was trained with, PRMConfig's),
tokenised as `PRMTrainer` tokenises its rows (`data.tokenize.encode_steps`), and the PRM's probability that each
step is correct is read at the step's last token. `aggregation` (`core.process_rewards.STEP_AGGREGATIONS`) turns
the step probabilities into the completion's reward: "min" (as good as its worst step), "prod", "last" or
"mean"; a completion with no step gets 0. `step_scores` gives the per-step probabilities themselves.
"""

from __future__ import annotations

import torch

from posttrain.core.process_rewards import IGNORE, STEP_AGGREGATIONS
from posttrain.tasks.builtin import completion_text
from posttrain.data.collate import pad
from posttrain.data.tokenize import encode_steps
from posttrain.models import loading


class ProcessRewardFunction:
    """reward_funcs entry: completions -> one reward each, from a process reward model's step scores."""

    def __init__(self, model, tokenizer=None, *, step_separator: str = "\n", aggregation: str = "min",
                 max_length: int | None = None, batch_size: int = 32):
        if aggregation not in STEP_AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {sorted(STEP_AGGREGATIONS)}, got {aggregation!r}")
        if not step_separator:
            raise ValueError("step_separator must be a non-empty string (the one the PRM was trained with)")
        self.tokenizer = loading.load_tokenizer(tokenizer, model=model)
        self.model = loading.load_token_classifier(model).eval()
        if getattr(self.model.config, "num_labels", 2) != 2:
            raise ValueError(f"a process reward model has 2 labels per token (step wrong, right); this model has "
                             f"{self.model.config.num_labels}")
        self.step_separator, self.aggregation = step_separator, aggregation
        self.max_length, self.batch_size = max_length, batch_size
        self.__name__ = f"prm_{aggregation}"  # the reward's name in the logs

    def _prompt_text(self, prompt) -> str:
        if isinstance(prompt, str):
            return prompt
        return self.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)

    def steps(self, completion) -> list[str]:
        """A completion's steps: its text split at the separator, empty pieces dropped."""
        return [s for s in completion_text(completion).split(self.step_separator) if s.strip()]

    @torch.no_grad()
    def step_scores(self, prompts: list, completions: list) -> list[list[float]]:
        """P(step correct) of every step of every completion, in order (an empty list for a completion with none)."""
        rows = [encode_steps(self.tokenizer, self._prompt_text(p), self.steps(c), [1] * len(self.steps(c)),
                             step_separator=self.step_separator, max_length=self.max_length)
                for p, c in zip(prompts, completions)]
        device = next(self.model.parameters()).device
        scores = []
        for lo in range(0, len(rows), self.batch_size):
            batch = rows[lo:lo + self.batch_size]
            ids = pad([r["input_ids"] for r in batch], self.tokenizer.pad_token_id).to(device)
            mask = pad([[1] * len(r["input_ids"]) for r in batch], 0).to(device)
            probs = self.model(input_ids=ids, attention_mask=mask).logits.float().softmax(-1)[..., 1]  # (b, T)
            for r, p in zip(batch, probs):
                ends = torch.tensor([i for i, y in enumerate(r["labels"]) if y != IGNORE], dtype=torch.long)
                scores.append(p[ends.to(device)].tolist())
        return scores

    def __call__(self, prompts: list, completions: list, **kwargs) -> list[float]:
        reduce = STEP_AGGREGATIONS[self.aggregation]
        return [float(reduce(torch.tensor(s))) if s else 0.0 for s in self.step_scores(prompts, completions)]
