"""The online engine's prompt data: a dataset's prompt column checked, rows collated into prompts and their token
ids (text, chat, image or pre-tokenised prompts), and the dataloader over `prompts.py`'s batches (map-style or
streamed), with dynamic sampling's extra prompts. A mixin of `OnlineTrainer` (online.py)."""

from __future__ import annotations

import functools
import logging

import torch

from posttrain.data.tokenize import encode_prompt
from posttrain.rollout.images import encode_image_prompts, has_image_prompts, text_tokenizer
from posttrain.trainers.base import is_streamed
from posttrain.trainers.prompts import (PromptBatches, _collate_streamed, _PromptStream, new_stream_position,
                                        top_up_prompts)

logger = logging.getLogger(__name__)


class OnlinePromptData:
    """Prompt collation and the train dataloader of `OnlineTrainer`; reads the trainer's args, processor, tooling,
    accelerator and stream positions."""

    @staticmethod
    def _check_dataset(dataset, what: str):
        if dataset is None:
            return
        if is_streamed(dataset):  # the first row's columns (a stream may not know its features)
            columns = dataset.column_names or list(next(iter(dataset), {}))
        else:
            columns = getattr(dataset, "column_names", None) or (list(dataset[0]) if len(dataset) else [])
        if "prompt" not in columns and "input_ids" not in columns:
            raise ValueError(f"{what} needs a 'prompt' column (text or chat messages) or a tokenised 'input_ids' "
                             f"column; it has {columns}")

    def _collate(self, rows: list[dict]) -> dict:
        """Prompts (as given, for reward functions), their token ids (left-cut to max_prompt_length), other columns."""
        tok, limit = text_tokenizer(self.processing_class), self.args.max_prompt_length
        vision = None
        if "prompt" in rows[0] and has_image_prompts(rows):  # image prompts: ids with the image tokens, and pixels
            prompts = [row["prompt"] for row in rows]
            prompt_ids, vision = encode_image_prompts(self.processing_class, rows, self.args.chat_template_kwargs,
                                                      limit, [self.tooling.schemas_for(row) for row in rows]
                                                      if self.tooling else None)
        elif "prompt" in rows[0]:
            prompts = [row["prompt"] for row in rows]
            prompt_ids = [encode_prompt(tok, p, tools=self.tooling.schemas_for(row) if self.tooling else None,
                                        template_kwargs=self.args.chat_template_kwargs)
                          for p, row in zip(prompts, rows)]
        else:  # pre-tokenised prompts, as in classic PPO/RLOO datasets
            prompt_ids = [list(row["input_ids"]) for row in rows]
            prompts = tok.batch_decode(prompt_ids, skip_special_tokens=True)
        if limit:
            prompt_ids = [ids[-limit:] for ids in prompt_ids]
        positions, completion = getattr(self, "_positions", None), self.args.max_completion_length
        longest = max(map(len, prompt_ids), default=0)
        if positions and not limit and longest + completion > positions:
            self._positions = None  # said once
            logger.warning(f"a prompt of {longest} tokens + max_completion_length={completion} exceeds the model's "
                           f"max_position_embeddings={positions}: max_prompt_length=None does not cut prompts, so "
                           "training goes past the positions the model was trained on; set max_prompt_length")
        skip = ("prompt", "input_ids", "attention_mask")
        columns = {key: [row[key] for row in rows] for key in rows[0] if key not in skip}
        if vision is None:
            return {"prompt": prompts, "prompt_ids": prompt_ids, "columns": columns}
        return {"prompt": prompts, "prompt_ids": prompt_ids, "columns": columns, "vision": vision}

    def get_train_dataloader(self):
        args = self.args
        if is_streamed(self.train_dataset):
            # a resumed run (`_stream_position` restored) reads on from the checkpoint's place; a fresh one from the start
            resumed, self._stream_resumed = self._stream_resumed and not args.ignore_data_skip, False
            if not resumed:
                self._stream_pos = new_stream_position()
            stream = _PromptStream(self.train_dataset, args.per_process_generation // args.num_generations,
                                   self.accelerator.num_processes, self.accelerator.process_index,
                                   args.steps_per_generation * args.num_iterations, self._stream_pos,
                                   placeholders=self._stream_pos["yielded"] if resumed else 0)
            return torch.utils.data.DataLoader(stream, batch_size=None,
                                               collate_fn=functools.partial(_collate_streamed, self._collate))
        return PromptBatches(self.train_dataset, self._collate, args.per_process_generation // args.num_generations,
                             self.accelerator.num_processes, self.accelerator.process_index,
                             args.steps_per_generation * args.num_iterations, args.shuffle_dataset, args.seed,
                             ahead=self.rollouts.depth if getattr(self, "rollouts", None) else 0)

    def _top_up_prompts(self) -> dict:
        """This process's prompts of one more generation batch for dynamic sampling, collated; read from the
        train dataset in an order of its own whose place (`_top_up_position`) each checkpoint keeps."""
        if self._top_up is None:
            args, acc = self.args, self.accelerator
            self._top_up = top_up_prompts(self.train_dataset, is_streamed(self.train_dataset),
                                          args.per_process_generation // args.num_generations, acc.num_processes,
                                          acc.process_index, self._top_up_pos, args.shuffle_dataset, args.seed)
        return self._collate(next(self._top_up))
