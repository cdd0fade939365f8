"""The online trainers train from a streamed dataset (datasets.IterableDataset): prompts are taken in stream order,
grouped into generation batches (each process taking the positions of its rank), the stream begins again when it
ends, and a run resumed from a checkpoint reads on from the prompts it had consumed: bit-identical on CPU."""

import pytest
import torch
from datasets import IterableDataset
from tests.helpers.online import first_token_reward, online_args, prompts
from tests.helpers.resume import assert_resumes_identically

from posttrain.trainers.base import STATE_FILE
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer
from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer

MODEL = "posttrain/tiny-qwen2"


def stream(n: int) -> IterableDataset:
    rows = list(prompts(n))
    return IterableDataset.from_generator(lambda: iter(rows))


def grpo(data, **fields):
    args = GRPOConfig(**{**online_args(fields.pop("output_dir"), num_generations=4, beta=0.1), **fields})
    return GRPOTrainer(MODEL, first_token_reward, args=args, train_dataset=data)


def test_trains_on_the_stream_in_order_and_begins_it_again(tmp_path):
    seen = []

    def reward(prompts, completion_ids, **kwargs):
        seen.extend(prompts)
        return first_token_reward(completion_ids)

    # 2 prompts (x 4 completions) per optimizer step; 5 prompts: 2 batches a pass, the fifth prompt dropped
    args = GRPOConfig(**online_args(tmp_path, num_generations=4, max_steps=3))
    trainer = GRPOTrainer(MODEL, reward, args=args, train_dataset=stream(5))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert all(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    order = list(prompts(5)["prompt"])
    assert seen == [p for p in order[:4] + order[:2] for _ in range(4)]
    assert trainer._stream_position == {"passes": 1, "prompts": 2, "micro": 0, "yielded": 6}


def test_each_process_takes_the_positions_of_its_rank():
    from posttrain.trainers.prompts import _PromptStream, new_stream_position

    rows = [{"prompt": str(i)} for i in range(7)]
    shares = []
    for rank in range(2):  # 2 processes x 2 prompts = 4 a generation batch; each yielded twice (micro 0, 1)
        items = iter(_PromptStream(rows, 2, 2, rank, 2, new_stream_position()))
        shares.append([next(items) for _ in range(6)])
    assert [([r["prompt"] for r in mine], micro) for mine, micro in shares[0]] == [
        (["0", "2"], 0), (["0", "2"], 1), (["0", "2"], 0), (["0", "2"], 1), (["0", "2"], 0), (["0", "2"], 1)]
    assert [([r["prompt"] for r in mine], micro) for mine, micro in shares[1][:2]] == [(["1", "3"], 0), (["1", "3"], 1)]


def test_resumed_stream_run_is_identical(tmp_path):
    # 5 prompts, 2 a step: stopped after step 3 (in the second pass), resumed at prompt 2 of that pass
    resumed = assert_resumes_identically(lambda **f: grpo(stream(5), **f), tmp_path, max_steps=5, stop_at=3)
    saved = torch.load(tmp_path / "stopped" / "checkpoint-3" / STATE_FILE, weights_only=True)
    assert saved["_stream_position"] == {"passes": 1, "prompts": 2, "micro": 0, "yielded": 6}
    assert resumed._stream_position == {"passes": 2, "prompts": 2, "micro": 0, "yielded": 10}


def test_resumed_inside_a_generation_batch_is_identical(tmp_path):
    # RLOO's classic defaults: 4 passes over each batch of 4 prompts x 2, one optimizer step each; stopped after
    # step 3, in the middle of the first batch, the resumed run reads that batch again and goes on at its micro 6
    def make(**fields):
        return RLOOTrainer(RLOOConfig(**{**online_args(fields["output_dir"]), **fields}), None, MODEL, None,
                           first_token_reward, stream(9))

    assert_resumes_identically(make, tmp_path, max_steps=5, stop_at=3)
    saved = torch.load(tmp_path / "stopped" / "checkpoint-3" / STATE_FILE, weights_only=True)
    assert saved["_stream_position"] == {"passes": 0, "prompts": 0, "micro": 6, "yielded": 6}


def test_a_streamed_eval_dataset_evaluates_as_the_same_rows(tmp_path):
    trainer = grpo(stream(8), output_dir=str(tmp_path), num_generations_eval=2)
    trainer.generator.manual_seed(5)
    from_stream = trainer.evaluate(eval_dataset=stream(3))
    trainer.generator.manual_seed(5)
    from_rows = trainer.evaluate(eval_dataset=prompts(3))
    assert from_stream == from_rows and "eval_reward" in from_stream


def test_max_steps_is_required_and_a_short_stream_is_refused(tmp_path):
    with pytest.raises(ValueError, match="set max_steps"):
        grpo(stream(8), output_dir=str(tmp_path), max_steps=-1)
    with pytest.raises(ValueError, match=r"streamed train_dataset holds 1 prompts, fewer than one generation batch"):
        grpo(stream(1), output_dir=str(tmp_path)).train()
    with pytest.raises(ValueError, match=r"needs a 'prompt' column"):
        grpo(IterableDataset.from_generator(lambda: iter([{"text": "a"}])), output_dir=str(tmp_path))


def test_total_episodes_bounds_a_streamed_run(tmp_path):
    # 16 completions at 8 per optimizer step (2 prompts x 4): 2 steps, with max_steps left unset
    trainer = grpo(stream(8), output_dir=str(tmp_path), max_steps=-1, total_episodes=16)
    trainer.train()
    assert trainer.state.global_step == 2
    assert trainer._stream_position["yielded"] == 2 * trainer.args.gradient_accumulation_steps


def test_ppo_trains_from_a_stream_and_its_manual_loop_reads_it_in_order(tmp_path):
    from posttrain.trainers.ppo import PPOConfig, PPOTrainer

    trainer = PPOTrainer(args=PPOConfig(**online_args(tmp_path, max_steps=1)), model=MODEL,
                         reward_funcs=first_token_reward, train_dataset=stream(8))
    trainer.train()
    assert trainer.state.global_step == 1
    batches = list(trainer.dataloader)  # the classic loop: batches of prompts, in stream order, never shuffled
    assert [q for b in batches for q in b["query"]] == list(prompts(8)["prompt"])
