"""PRMTrainer: the stepwise tokenisation by hand, a tiny run that changes every parameter (the new step head
too), data errors, LoRA, held-out step accuracy, and a trained PRM as an online trainer's reward."""

import pytest
import torch
from tests.helpers.preference import TINY, assert_all_changed, config_kwargs, snapshot

from posttrain.core.process_rewards import IGNORE
from posttrain.tasks.builtin import task_stepwise_dataset
from posttrain.data.formats import FormatError
from posttrain.data.tokenize import encode_steps
from posttrain.models.loading import load_tokenizer
from posttrain.trainers.prm import PRMConfig, PRMTrainer

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_encode_steps_labels_each_step_at_its_separator():
    tok = load_tokenizer(None, model=TINY)
    row = encode_steps(tok, "reverse 12 =", ["digit 1 is 2", "digit 2 is 1"], [True, False], step_separator="\n")
    prompt, s1, s2, sep = ids(tok, "reverse 12 ="), ids(tok, "digit 1 is 2"), ids(tok, "digit 2 is 1"), ids(tok, "\n")
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    assert row["input_ids"] == bos + prompt + s1 + sep + s2 + sep
    n_prompt = len(bos + prompt)
    expected = [IGNORE] * n_prompt + [IGNORE] * (len(s1 + sep) - 1) + [1] + [IGNORE] * (len(s2 + sep) - 1) + [0]
    assert row["labels"] == expected
    last = encode_steps(tok, "reverse 12 =", ["digit 1 is 2", "digit 2 is 1"], [True, False], step_separator="\n",
                        last_step_only=True)
    assert [y for y in last["labels"] if y != IGNORE] == [0]
    cut = encode_steps(tok, "reverse 12 =", ["digit 1 is 2", "digit 2 is 1"], [True, False], step_separator="\n",
                       max_prompt_length=2, max_completion_length=len(s1 + sep))
    assert cut["input_ids"] == prompt[-2:] + s1 + sep and [y for y in cut["labels"] if y != IGNORE] == [1]


def test_tiny_run_changes_every_parameter_and_evaluates_step_accuracy(tmp_path):
    args = PRMConfig(**config_kwargs(tmp_path, per_device_train_batch_size=8, eval_strategy="steps", eval_steps=2))
    trainer = PRMTrainer(TINY, args=args, train_dataset=task_stepwise_dataset("add", "train", 32),
                         eval_dataset=task_stepwise_dataset("add", "test", 16))
    model = trainer.model
    assert type(model).__name__.endswith("ForTokenClassification") and model.config.num_labels == 2
    before = snapshot(model)
    trainer.train()
    assert_all_changed(before, model)  # the fresh step head and the body
    logged = {k for row in trainer.state.log_history for k in row}
    assert {"loss", "accuracy", "eval_loss", "eval_accuracy"} <= logged


def test_train_on_last_step_only_keeps_every_eval_label(tmp_path):
    args = PRMConfig(**config_kwargs(tmp_path, train_on_last_step_only=True))
    data = task_stepwise_dataset("reverse", "test", 8)
    trainer = PRMTrainer(TINY, args=args, train_dataset=data, eval_dataset=data)
    labelled = [sum(y != IGNORE for y in row["labels"]) for row in trainer.train_dataset]
    assert labelled == [1] * 8
    assert [sum(y != IGNORE for y in row["labels"]) for row in trainer.eval_dataset] == \
        [len(r["labels"]) for r in data]


@pytest.mark.parametrize("rows, message", [
    ([{"prompt": "q", "completions": ["a", "b"], "labels": [True]}], "row 0: 2 steps in 'completions' but 1 'labels'"),
    ([{"prompt": "q", "completions": "a", "labels": [True]}], "row 0: 'completions' must be a non-empty list"),
    ([{"prompt": "q", "completions": ["a"], "labels": [1]}], "row 0: 'labels' must be a list of bools"),
    ([{"prompt": "q", "completion": "a", "label": True}], r"no \['completions', 'labels'\] column"),
])
def test_bad_rows_are_named(tmp_path, rows, message):
    with pytest.raises(FormatError, match=message):
        PRMTrainer(TINY, args=PRMConfig(**config_kwargs(tmp_path)), train_dataset=rows)


def test_lora_trains_the_adapter_and_the_step_head(tmp_path):
    from peft import LoraConfig

    trainer = PRMTrainer(TINY, args=PRMConfig(**config_kwargs(tmp_path)),
                         train_dataset=task_stepwise_dataset("add", "train", 16),
                         peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    assert trainer.model.peft_config["default"].task_type == "TOKEN_CLS"
    before = snapshot(trainer.model)
    assert any("score" in n for n in before) and all("lora_" in n or "score" in n for n in before)
    trainer.train()
    assert_all_changed(before, trainer.model)


def step_accuracy_by_label(trainer, dataset) -> dict[int, float]:
    """Held-out accuracy on the correct (1) and on the wrong (0) steps separately."""
    rows = trainer.prepare_eval_dataset(dataset)
    batch = trainer.data_collator([rows[i] for i in range(len(rows))])
    model = trainer.model.eval()
    with torch.no_grad():
        pred = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.argmax(-1)
    labels = batch["labels"]
    return {y: float((pred[labels == y] == y).float().mean()) for y in (0, 1)}


@pytest.mark.slow
def test_prm_learns_to_find_the_wrong_step_on_held_out_rows(tmp_path):
    """Random-init tiny-qwen2 on `reverse` stepwise rows whose wrong steps are malformed (a digit replaced by a
    letter): held-out accuracy on the wrong steps rises from the fresh head's 0 while the correct ones stay right.

    Semantic errors (corruption="digit", a wrong digit of the right form) the 2-layer tiny model does not learn to
    flag; measured on held-out rows (accuracy on the wrong steps, the correct ones at 1.00 after):
      reverse, random init, 600 steps at 3e-3: no separation;
      reverse, body first SFT'd on the correct stepwise solutions (LM loss 0.008: it writes every step right),
        600 steps at 1e-3: wrong steps 1.00 (fresh head) -> 0.04;
      add, random init, 1000 steps at 1e-3: 0.22 -> 0.28 (column steps "x+y+c=s" 0.31, the answer step 0.23);
      add, body SFT'd on correct stepwise solutions, 600 steps at 1e-3: 0.16 -> 0.25; at 3e-3: -> 0.00.
    Since then `add`'s digit errors sit in the column steps only, whose correctness is in their own tokens (sums
    written as two digits, a wrong carry digit 0 or 1): random init, batch 32, all steps labelled, 1500 steps at
    3e-3: the training accuracy stays at the label prior (0.77) and held-out wrong steps end at 0.00 (every step
    called correct); runs at 1e-2 (stopped at 900 steps) and of small-qwen2, 4 layers 128 wide (stopped at 300
    steps at 1e-3), were still at the prior when stopped. With a carry digit 2-9
    allowed (wrong by its form), 3000 steps at 3e-3 reached 0.60 on the wrong steps: the form, not the sum.
    train_on_last_step_only=True is the wrong setting for such rows: a correct row's last step is always the
    answer step, so the head learns "a column step is wrong" (held-out wrong 1.00, correct 0.28).
    Why: a step's label sits on its separator, the token after its last digit. For `reverse`, deciding "digit i is
    d" there takes three dependent steps: read i, fetch the prompt's digit at the mirrored position, compare it
    with d. Attention at layer l reads only layer l-1's outputs of earlier positions, so a 2-layer model chains
    two; the SFT'd body does compute the right digit, but at the position before d and in its last layer, which
    no later position reads. For `add`, the separator must gather x, y, c and s and compare (x + y + c) mod 10
    with s's last digit, a 200 x 10 table learned from the wrong column steps (about a quarter of the labels);
    within these budgets the head settles on "correct". Twice as wide (hidden 128), it learns them:
    test_prm_learns_wrong_arithmetic_steps_on_held_out_rows."""
    args = PRMConfig(**config_kwargs(tmp_path, per_device_train_batch_size=16, max_steps=200, learning_rate=1e-3,
                                     logging_steps=50))
    trainer = PRMTrainer(TINY, args=args, train_dataset=task_stepwise_dataset("reverse", "train"))
    test = task_stepwise_dataset("reverse", "test")
    before = step_accuracy_by_label(trainer, test)
    trainer.train()
    after = step_accuracy_by_label(trainer, test)
    print(f"PRM held-out step accuracy, wrong steps {before[0]:.2f} -> {after[0]:.2f}, "
          f"correct steps {before[1]:.2f} -> {after[1]:.2f}")
    assert before[0] < 0.5 and after[0] > 0.9 and after[1] > 0.9


# the arithmetic-step run: 600 steps of 32 rows (400 steps reached 0.29 on the wrong steps; 600 of 16 rows, 0.00)
STEPS, BATCH = 600, 32


def wide_prm(seed: int = 0):
    """A fresh two-label token classifier of tiny-qwen2's shape, twice as wide (hidden 128, MLP 384): the PRM
    that learns `add`'s arithmetic steps, where tiny-qwen2 (hidden 64) stays at the label prior."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    from posttrain.models.tiny import tiny_model_path

    config = AutoConfig.from_pretrained(tiny_model_path("tiny-qwen2"))
    config.hidden_size, config.intermediate_size, config.num_labels = 128, 384, 2
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForTokenClassification.from_config(config)


@pytest.mark.slow
def test_prm_learns_wrong_arithmetic_steps_on_held_out_rows(tmp_path):
    """`add` stepwise rows whose wrong step has a wrong result of the right form (corruption="digit": a column
    step "x+y+c=s" with one digit of s replaced, the carry digit staying 0 or 1): the wide PRM (`wide_prm`) flags
    held-out wrong steps while keeping the correct ones; evaluated on 200 held-out rows that each end at a wrong
    step (`corrupted_fraction=1.0`: 200 wrong steps and the correct steps before them).

    Why the tiny PRM did not learn them (test above): the separator token that carries a step's label must gather
    x, y, c and both digits of s from fixed offsets before it and check x + y + c = s, a 200-entry table of
    (x, y, c) -> s, from about a thousand wrong labels; at hidden 64 (4 heads of 16) the 2-layer model stays at
    the prior (every step "correct"). Measured with a plain loop (batch 32, AdamW, clip 1.0), wrong / correct
    held-out accuracy: hidden 64, lr 3e-3 constant, 2000 steps: 0.11 / 0.98, never above 0.28 on the way; hidden
    64 with its body first trained as a language model on correct solutions (LM loss 0.004: it computes every
    sum), 1000 steps at 1e-3: 0.00 / 1.00 (presumably because the sum is formed at the position before each
    digit, in the last layer, which no later position reads); a class weight of 2 on the wrong steps, hidden 128,
    lr 2e-3 constant: oscillates (0.92 / 0.36, 0.20 / 0.94, 0.61 / 0.76, 0.04 / 0.99); hidden 128, lr 1e-3, 50
    warm-up steps then cosine over 1500 steps: 0.41 / 0.95 at 600, 0.51 / 0.98 at 900, 0.60 / 0.98 at 1500.
    This test (PRMTrainer, cosine over 600 steps): 0.16 -> 0.51 on the wrong steps, 0.90 -> 1.00 on the correct
    ones; about 45 CPU seconds."""
    from posttrain.models.loading import load_tokenizer

    args = PRMConfig(**config_kwargs(tmp_path, per_device_train_batch_size=BATCH, max_steps=STEPS, learning_rate=1e-3,
                                     lr_scheduler_type="cosine", warmup_steps=50, logging_steps=100))
    trainer = PRMTrainer(wide_prm(), args=args, processing_class=load_tokenizer(None, model=TINY),
                         train_dataset=task_stepwise_dataset("add", "train", corruption="digit"))
    test = task_stepwise_dataset("add", "test", corruption="digit", corrupted_fraction=1.0)
    before = step_accuracy_by_label(trainer, test)
    trainer.train()
    after = step_accuracy_by_label(trainer, test)
    print(f"PRM (hidden 128) held-out accuracy on wrong arithmetic steps {before[0]:.2f} -> {after[0]:.2f}, "
          f"on correct steps {before[1]:.2f} -> {after[1]:.2f}")
    assert after[0] > 0.3 and after[1] > 0.85 and after[0] + after[1] > before[0] + before[1] + 0.2


def test_process_reward_function_scores_steps_and_runs_in_grpo(tmp_path):
    from posttrain.rollout.process_rewards import ProcessRewardFunction
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    trainer = PRMTrainer(TINY, args=PRMConfig(**config_kwargs(tmp_path / "prm")),
                         train_dataset=task_stepwise_dataset("reverse", "train", 16))
    trainer.train()
    trainer.save_model(str(tmp_path / "prm"))
    prm = ProcessRewardFunction(str(tmp_path / "prm"), step_separator="\n", aggregation="min")
    prompts, completions = ["reverse 12 =", "reverse 34 ="], ["digit 1 is 2\ndigit 2 is 1\n", "\n"]
    scores = prm.step_scores(prompts, completions)
    assert [len(s) for s in scores] == [2, 0]  # two steps; a completion of separators only has none
    # the same probabilities from the model's own forward on PRMTrainer's tokenisation
    row = encode_steps(prm.tokenizer, prompts[0], ["digit 1 is 2", "digit 2 is 1"], [1, 1], step_separator="\n")
    with torch.no_grad():
        probs = prm.model(input_ids=torch.tensor([row["input_ids"]])).logits.softmax(-1)[0, :, 1]
    ends = [i for i, y in enumerate(row["labels"]) if y != IGNORE]
    assert scores[0] == pytest.approx(probs[ends].tolist(), rel=1e-5)
    assert prm(prompts, completions) == pytest.approx([min(scores[0]), 0.0], rel=1e-6)

    args = GRPOConfig(output_dir=str(tmp_path / "grpo"), per_device_train_batch_size=4, num_generations=4,
                      max_steps=1, max_completion_length=8, logging_steps=1, disable_tqdm=True, report_to="none")
    grpo = GRPOTrainer(TINY, reward_funcs=[prm], args=args,
                       train_dataset=[{"prompt": "reverse 12 ="}, {"prompt": "reverse 34 ="}] * 2)
    grpo.train()
    assert "rewards/prm_min/mean" in grpo.state.log_history[0]


def test_streamed_stepwise_rows_train(tmp_path):
    from datasets import IterableDataset

    rows = list(task_stepwise_dataset("add", "train", 16))
    stream = IterableDataset.from_generator(lambda: iter(rows))
    trainer = PRMTrainer(TINY, args=PRMConfig(**config_kwargs(tmp_path, max_steps=3)), train_dataset=stream)
    trainer.train()
    assert trainer.state.global_step == 3
    assert all(0 <= r["accuracy"] <= 1 for r in trainer.state.log_history if "accuracy" in r)
