"""Tools, environments and rollout functions in the online trainers: tiny runs (every trainable
parameter changes, tool metrics logged), the whole episode given to reward functions, fed tool
turns out of the loss, and the same engine under GRPO, RLOO and REINFORCE++."""


import pytest
import torch
from tests.helpers.online import CRITIC_METRICS, batch_loss_and_grads, online_args, train_and_check

from posttrain.data.tokenize import encode_prompt
from posttrain.data.tools import environment_tools, tool_schemas
from posttrain.models.loading import load_causal_lm, load_tokenizer
from posttrain.tasks.environments import GuessNumberEnv
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer
from posttrain.trainers.ppo import PPOConfig, PPOTrainer
from posttrain.trainers.reinforce_pp import ReinforcePPConfig, ReinforcePPTrainer
from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer

TOOL_METRICS = ["tools/calls_per_completion", "tools/failure_rate", "tools/turns_per_episode"]


def ping(x: int) -> int:
    """Add one.

    Args:
        x: A number.
    """
    return x + 1


def _call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


GO = [{"role": "user", "content": "Go"}]
FIND = [{"role": "user", "content": "Find my number from 1 to 1."}]
TRACES = [  # (messages, tools): what the fixture's model learns to write
    (GO + [{"role": "assistant", "content": "", "tool_calls": [_call("ping", x=1)]},
           {"role": "tool", "name": "ping", "content": "2"}, {"role": "assistant", "content": "2"}],
     tool_schemas([ping])),
    (FIND + [{"role": "assistant", "content": "", "tool_calls": [_call("guess", n=1)]},
             {"role": "tool", "name": "guess", "content": "correct"}, {"role": "assistant", "content": "1"}],
     tool_schemas(environment_tools(GuessNumberEnv()))),
]


@pytest.fixture(scope="module")
def caller():
    return fit_caller()


def fit_caller(steps: int = 75, lr: float = 1e-2) -> dict:
    """tiny-qwen2's weights fitted on the two traces (completion tokens only), so its rollouts call the tools
    (75 steps: at 60 on an Intel CPU, MKL's float rounding left `guess` called with `x` instead of `n`; from 100 on,
    the sampled groups are alike, so no advantage; 70-80 pass on Intel and the 60 of before on AMD Zen 5)."""
    tok = load_tokenizer("posttrain/tiny-qwen2")
    torch.manual_seed(0)
    model = load_causal_lm("posttrain/tiny-qwen2")
    rows = []
    for messages, tools in TRACES:
        ids = tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True)["input_ids"]
        P = len(encode_prompt(tok, messages[:1], tools=tools))
        rows.append((torch.tensor([ids]), torch.tensor([[-100] * P + ids[P:]])))
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        for ids, labels in rows:
            model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _model(state):
    model = load_causal_lm("posttrain/tiny-qwen2")
    model.load_state_dict(state)
    return model


def _dataset(prompt, n=8, **columns):
    from datasets import Dataset

    return Dataset.from_list([{"prompt": prompt, **columns} for _ in range(n)])


def _logged(trainer, name):
    return [entry[name] for entry in trainer.state.log_history if name in entry]


@pytest.mark.parametrize("trainer_class,config_class", [(GRPOTrainer, GRPOConfig), (RLOOTrainer, RLOOConfig),
                                                        (ReinforcePPTrainer, ReinforcePPConfig)])
def test_tools_train_every_parameter_and_log_tool_metrics(caller, tmp_path, trainer_class, config_class):
    seen = []

    def answered_two(completions, **kwargs):
        # plus a small length term, so that a group whose episodes all answer alike still has distinct rewards
        # (which episodes answer "2" depends on the CPU's float rounding through the sampler)
        seen.extend(completions)
        return [float(bool(c) and c[-1]["role"] == "assistant" and c[-1]["content"].strip() == "2")
                + 1e-3 * len(str(c)) for c in completions]

    args = config_class(**online_args(tmp_path, num_generations=4, max_completion_length=96,
                                      max_tool_calling_iterations=2))
    trainer = trainer_class(_model(caller), answered_two, args=args, train_dataset=_dataset(GO), tools=[ping])
    logged = train_and_check(trainer, metrics=TOOL_METRICS, reward_names=("answered_two",))
    assert max(logged["tools/calls_per_completion"]) > 0
    # reward functions get the whole episode: assistant turns with tool calls, then the tool results
    # (an episode whose call did not parse has the error text as its tool turn and no tool_calls)
    episode = next(c for c in seen if len(c) >= 3 and c[0].get("tool_calls"))
    assert episode[0]["tool_calls"][0]["function"]["name"] == "ping"
    assert episode[1] == {"role": "tool", "name": "ping", "content": str(episode[0]["tool_calls"][0]["function"]
                                                                          ["arguments"].get("x", 0) + 1)} \
        or episode[1]["content"].startswith("Error")


def test_tool_turns_are_out_of_the_loss(caller, tmp_path):
    args = GRPOConfig(**online_args(tmp_path, num_generations=4, max_completion_length=96,
                                    gradient_accumulation_steps=1, max_steps=1))
    trainer = GRPOTrainer(_model(caller), lambda completions, **kw: [float(len(c)) for c in completions],
                          args=args, train_dataset=_dataset(GO), tools=[ping])
    batch = trainer._collate([trainer.train_dataset[i] for i in range(1)])
    prompts = batch["prompt"] * 4
    columns = {}
    rollout, episodes = trainer.roll_out(batch, prompts, columns)
    micro = trainer.build_experience(rollout, torch.arange(4.0))
    mb = micro[0]
    tool = rollout.tool_mask[:, : mb["loss_mask"].shape[1]]
    assert tool.sum() > 0
    expected = rollout.completion_mask[:, : tool.shape[1]] * (1 - tool)
    assert mb["loss_mask"].tolist() == expected.tolist()  # token by token: sampled tokens only
    assert (mb["advantages"][tool.bool()] == 0).all()
    assert (mb["completion_mask"][tool.bool()] == 1).all()  # still attended
    # the fed ids are the chat template's tool turn and the next assistant header
    done = [i for i in range(4) if rollout.tool_mask[i].any() and not rollout.is_truncated[i]]
    assert done, "no episode with a tool turn ran to its end"
    text = trainer.processing_class.decode(rollout.completion_ids[done[0]][rollout.tool_mask[done[0]].bool()])
    assert "<|im_start|>tool" in text and text.endswith("<|im_start|>assistant\n")


def test_guess_number_environment(caller, tmp_path):
    args = GRPOConfig(**online_args(tmp_path, num_generations=4, max_completion_length=96))
    data = _dataset(FIND, secret=1, low=1, high=1)
    trainer = GRPOTrainer(_model(caller), args=args, train_dataset=data, environment_factory=GuessNumberEnv)
    assert trainer.reward_scorer.names == ["GuessNumberEnv"]  # get_reward is the reward; reward_funcs optional
    logged = train_and_check(trainer, metrics=TOOL_METRICS, reward_names=("GuessNumberEnv",))
    assert max(logged["tools/calls_per_completion"]) > 0
    assert max(logged["rewards/GuessNumberEnv/mean"]) > 0  # some rollouts found the number through the tool


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_split_does_not_change_the_update_with_tool_turns(caller, tmp_path, loss_type):
    """One multi-turn rollout (tool turns fed mid-completion) trained as batch 8 x accumulation 1, 4 x 2 and
    2 x 4: the same summed loss and the same gradients (the masked holes leave the denominators global)."""
    model = _model(caller)
    rollout = scores = None
    results = []
    for bs, ga in [(8, 1), (4, 2), (2, 4)]:
        args = GRPOConfig(**online_args(tmp_path, num_generations=4, max_completion_length=96, loss_type=loss_type,
                                        per_device_train_batch_size=bs, gradient_accumulation_steps=ga,
                                        steps_per_generation=8 // bs, replay_linear_outputs=False))
        trainer = GRPOTrainer(model, lambda completions, **kw: [float(len(c)) for c in completions], args=args,
                              train_dataset=_dataset(GO), tools=[ping])
        if rollout is None:
            batch = trainer._collate([trainer.train_dataset[i] for i in range(2)])
            rollout, episodes = trainer.roll_out(batch, [p for p in batch["prompt"] for _ in range(4)], {})
            assert rollout.tool_mask.any() and (rollout.completion_mask * (1 - rollout.tool_mask)).any()
            scores = torch.tensor([float(len(c)) for c in episodes.completions(rollout)])
            assert scores.unique().numel() > 1
        results.append(batch_loss_and_grads(trainer, model, rollout, scores))
    (loss0, grads0), *others = results
    assert grads0 and any(g.abs().sum() > 0 for g in grads0.values())
    for loss, grads in others:
        assert loss == pytest.approx(loss0, rel=1e-5, abs=1e-7)
        for name in grads0:
            torch.testing.assert_close(grads[name], grads0[name], rtol=1e-4, atol=1e-7, msg=name)


def test_ppo_with_tools_masks_the_critic_on_tool_turns(caller, tmp_path):
    """PPO on the same engine: tools= trains the policy and the critic (every parameter changes, tool and
    critic metrics logged); on a batch, the fed tool turns are out of the loss mask, and their advantages
    and returns are 0 (GAE steps over them, reading no value there)."""
    def answered_two(completions, **kwargs):
        return [float(bool(c) and c[-1]["role"] == "assistant" and c[-1]["content"].strip() == "2")
                for c in completions]

    args = PPOConfig(**online_args(tmp_path, num_generations=1, max_completion_length=96, max_tool_calling_iterations=2,
                                   num_ppo_epochs=1, per_device_train_batch_size=4, gradient_accumulation_steps=1))
    trainer = PPOTrainer(args=args, processing_class=load_tokenizer("posttrain/tiny-qwen2"), model=_model(caller),
                         reward_funcs=answered_two, train_dataset=_dataset(GO), tools=[ping])
    batch = trainer._collate([trainer.train_dataset[i] for i in range(4)])
    rollout, _ = trainer.roll_out(batch, batch["prompt"], {})
    mb = trainer.build_experience(rollout, torch.arange(4.0))[0]
    tool = rollout.tool_mask[:, : mb["loss_mask"].shape[1]].bool()
    assert tool.any(), "no rollout called the tool"
    assert mb["loss_mask"].tolist() == (rollout.completion_mask[:, : tool.shape[1]] * ~tool).tolist()
    assert (mb["advantages"][tool] == 0).all() and (mb["returns"][tool] == 0).all()
    logged = train_and_check(trainer, metrics=TOOL_METRICS + CRITIC_METRICS, reward_names=("answered_two",))
    assert max(logged["tools/calls_per_completion"]) > 0


def test_ppo_takes_an_environment_as_its_only_reward(caller, tmp_path):
    args = PPOConfig(**online_args(tmp_path, num_generations=1, max_completion_length=96, num_ppo_epochs=1))
    trainer = PPOTrainer(args=args, processing_class=load_tokenizer("posttrain/tiny-qwen2"), model=_model(caller),
                         train_dataset=_dataset(FIND, secret=1, low=1, high=1), environment_factory=GuessNumberEnv)
    assert trainer.reward_scorer.names == ["GuessNumberEnv"]  # no reward_funcs: get_reward scores the episodes
    logged = train_and_check(trainer, metrics=TOOL_METRICS + CRITIC_METRICS, reward_names=("GuessNumberEnv",))
    assert max(logged["rewards/GuessNumberEnv/mean"]) > 0


class FindOne(GuessNumberEnv):
    """The guessing game on [1, 1], whose prompt the fixture's model has learned to answer."""

    def reset(self, **row):
        return super().reset(secret=1, low=1, high=1, **row)


def test_environment_without_a_dataset_writes_the_prompts_through_reset(caller, tmp_path):
    """No train_dataset: each rollout's prompt is the text reset() returns (GuessNumberEnv states its range),
    reward functions see that prompt, and max_steps bounds training; without max_steps, or with a reset()
    that returns no text, a clear error."""
    seen = []

    def prompts_seen(prompts, completions, **kwargs):
        seen.extend(prompts)
        return [0.0] * len(completions)

    args = GRPOConfig(**online_args(tmp_path, num_generations=4, max_completion_length=96, max_steps=3))
    trainer = GRPOTrainer(_model(caller), prompts_seen, args=args, environment_factory=FindOne)
    logged = train_and_check(trainer, metrics=TOOL_METRICS, reward_names=("prompts_seen", "FindOne"))
    assert trainer.state.global_step == 3
    assert len(seen) == 3 * 8 and all(p == FIND for p in seen)
    assert max(logged["rewards/FindOne/mean"]) > 0
    with pytest.raises(ValueError, match="set max_steps"):
        GRPOTrainer(_model(caller), prompts_seen, args=GRPOConfig(**online_args(tmp_path, max_steps=-1)),
                    environment_factory=FindOne)

    class Silent(GuessNumberEnv):
        def reset(self, **row):
            super().reset(**row)

    trainer = GRPOTrainer(_model(caller), prompts_seen, args=GRPOConfig(**online_args(tmp_path, num_generations=4)),
                          environment_factory=Silent)
    with pytest.raises(ValueError, match=r"Silent.reset\(\) must return the prompt"):
        trainer.train()


def test_rollout_func_replaces_the_sampler(tmp_path):
    tok = load_tokenizer("posttrain/tiny-qwen2")
    given = []

    def rollout_func(prompts, trainer):
        given.append((list(prompts), trainer))
        ids = [encode_prompt(tok, p) for p in prompts]
        completions = [[5 + i, 6, tok.eos_token_id] for i in range(len(prompts))]
        return {"prompt_ids": ids, "completion_ids": completions, "logprobs": [[-1.0] * 3 for _ in prompts],
                "hint": [i for i in range(len(prompts))]}

    def uses_hint(completions, hint, **kwargs):
        return [float(h) for h in hint]

    args = GRPOConfig(**online_args(tmp_path, num_generations=4))
    trainer = GRPOTrainer("posttrain/tiny-qwen2", uses_hint, args=args, train_dataset=_dataset(GO), rollout_func=rollout_func)
    train_and_check(trainer, metrics=["reward"], reward_names=("uses_hint",))
    prompts, who = given[0]
    assert len(prompts) == 8 and prompts[0] == GO and who is trainer  # one prompt per completion
    assert _logged(trainer, "reward")[0] == pytest.approx(3.5)


def test_refusals(tmp_path):
    args = GRPOConfig(**online_args(tmp_path, num_generations=4))
    with pytest.raises(ValueError, match="reward_funcs is required"):
        GRPOTrainer("posttrain/tiny-qwen2", args=args, train_dataset=_dataset(GO), tools=[ping])
    with pytest.raises(ValueError, match="not both"):
        GRPOTrainer("posttrain/tiny-qwen2", args=args, train_dataset=_dataset(GO), tools=[ping],
                    environment_factory=GuessNumberEnv)
    with pytest.raises(ValueError, match="max_tool_calling_iterations"):
        GRPOConfig(**online_args(tmp_path, max_tool_calling_iterations=-1))
    text = _dataset("Go", 8)
    trainer = GRPOTrainer("posttrain/tiny-qwen2", lambda completions, **kw: [0.0] * len(completions), args=args,
                          train_dataset=text, environment_factory=GuessNumberEnv)
    with pytest.raises(Exception, match="conversational"):
        trainer.train()


