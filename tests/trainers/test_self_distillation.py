"""SDPOTrainer (and SDFT's sampled-token mode): the sampled-token reverse KL and the whole SDPO loss against float64
references computed here by hand, the teacher's reprompts built from successful peers and feedback, every
parameter trained, bit-identical resume, the CLI, clear errors; and (slow) held-out accuracy rising on `reverse`
for SDFT and SDPO from a student that reads a demonstration in its prompt (tests/helpers/self_distillation.py)."""

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from tests.helpers.online import online_args, prompts
from tests.helpers.resume import assert_resumes_identically
from tests.trainers.test_distillation import changed_everything

from posttrain.core.divergences import sampled_reverse_kl
from posttrain.trainers.sdpo import SDPOConfig, SDPOTrainer


def parity_reward(completion_ids, **kwargs):
    """1 for a completion whose first token id is odd: successes and failures in most groups of a random model."""
    return [float(ids[0] % 2) if ids else 0.0 for ids in completion_ids]


def first_row_reward(completion_ids, **kwargs):
    """Only each batch's first completion succeeds: its group's other rows are reprompted with it, no other row."""
    return [1.0] + [0.0] * (len(completion_ids) - 1)


def sdpo(reward=parity_reward, **fields):
    args = SDPOConfig(**{**online_args(fields.get("output_dir", "unused")), "learning_rate": 1e-2,
                         "num_generations": 4, **fields})
    return SDPOTrainer("posttrain/tiny-qwen2", reward, args=args, train_dataset=prompts(16))


# ---------------------------------------------------------------- the losses, by hand in float64
def test_sampled_reverse_kl_is_the_log_ratio_with_the_score_function_gradient():
    s = torch.tensor([[-0.5, -2.0], [-1.25, -0.1]], dtype=torch.float64, requires_grad=True)
    t = torch.tensor([[-1.0, -1.0], [-1.25, -3.1]], dtype=torch.float64)
    value = sampled_reverse_kl(s, t)
    assert torch.allclose(value, torch.tensor([[0.5, -1.0], [0.0, 3.0]], dtype=torch.float64))
    value.sum().backward()  # TRL's loss (s - t).detach() * s has the gradient s - t
    assert torch.allclose(s.grad, torch.tensor([[0.5, -1.0], [0.0, 3.0]], dtype=torch.float64))


def completion_logp64(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """Float64 log-softmax (B, C, V) at each completion position, row by row without padding (independent of
    posttrain's forward code)."""
    rows = []
    for p, pm, c, cm in zip(prompt_ids, prompt_mask, completion_ids, completion_mask):
        prompt, completion = p[pm.bool()], c[cm.bool()]
        logits = model(torch.cat([prompt, completion])[None]).logits[0].double()
        out = logits[len(prompt) - 1:len(prompt) - 1 + len(completion)].log_softmax(-1)
        rows.append(torch.cat([out, out.new_zeros(len(c) - len(completion), out.shape[-1])]))
    return torch.stack(rows)


@pytest.mark.parametrize("mode, alpha, weight", [("full_logits", 0.5, 0.5), ("sampled_token", 1.0, 1.0),
                                                 ("full_logits", 0.0, 0.0)])
def test_sdpo_loss_and_gradients_match_a_float64_reference(tmp_path, mode, alpha, weight):
    """(1 - w) * the clipped surrogate (ratio 1: -A per token) + w * the divergence to the reprompted teacher, both
    over the optimizer step's tokens (loss_type 'dapo'); the teacher is the EMA copy, equal to the student at step 0,
    shown a successful peer. Value and every gradient against float64 arithmetic written out here."""
    torch.manual_seed(0)
    trainer = sdpo(first_row_reward, output_dir=str(tmp_path), per_device_train_batch_size=8,
                   gradient_accumulation_steps=1, distillation_mode=mode, distillation_alpha=alpha,
                   distillation_weight=weight)
    mb = trainer.make_experience(next(iter(trainer.get_train_dataloader())))[0]
    assert mb["self_distillation_mask"].tolist() == [0, 1, 1, 1, 0, 0, 0, 0]  # row 0's peers only
    model = trainer.model
    model.zero_grad()
    loss = trainer.compute_loss(model, mb)
    loss.backward()
    got = {n: p.grad.double().clone() for n, p in model.named_parameters()}

    ref = copy.deepcopy(model).double()
    mask, sd, denom = mb["loss_mask"].double(), mb["self_distillation_mask"].double()[:, None], float(mb["denominator"])
    student = completion_logp64(ref, mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"], mb["completion_mask"])
    with torch.no_grad():
        teacher = completion_logp64(ref, mb["teacher_prompt_ids"], mb["teacher_prompt_mask"], mb["completion_ids"],
                                    mb["completion_mask"])
    sampled = student.gather(-1, mb["completion_ids"][..., None])[..., 0]
    policy = -mb["advantages"].double() * torch.exp(sampled - sampled.detach())
    ps, pt = student.exp(), teacher.exp()
    if mode == "sampled_token":
        gap = (sampled - teacher.gather(-1, mb["completion_ids"][..., None])[..., 0]).detach()
        distill = gap + gap * (sampled - sampled.detach())
    elif alpha == 0.0:
        distill = (pt * (teacher - student)).sum(-1)
    else:
        m = alpha * pt + (1 - alpha) * ps
        distill = (alpha * (pt * (teacher - m.log())).sum(-1) + (1 - alpha) * (ps * (student - m.log())).sum(-1))
    expected = ((1 - weight) * (policy * mask).sum() + weight * (distill * mask * sd).sum()) / denom
    expected.backward()
    assert float(loss) == pytest.approx(float(expected), rel=1e-4, abs=1e-7)
    for name, param in ref.named_parameters():
        assert torch.allclose(got[name], param.grad, rtol=1e-3, atol=1e-6), name


# ---------------------------------------------------------------- the teacher's reprompts
def test_reprompts_show_a_successful_peer_and_the_feedback(tmp_path):
    trainer = sdpo(output_dir=str(tmp_path), include_environment_feedback=True,
                   environment_feedback_only_without_solution=True)
    tok = trainer.processing_class
    texts = [" 11", " 22", " 33", " 44", " 55", " 66", " 77", " 88"]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, ids))
    rollout = SimpleNamespace(completion_ids=torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in ids]),
                              completion_mask=torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in ids]))
    prompts_ = ["reverse 12 ="] * 4 + ["reverse 34 ="] * 4
    feedback = ["", "", "", "", "too long", "too long", "", ""]
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.5])  # threshold 1.0: group 2 has no success
    out = trainer.reprompt(prompts_, {"privileged_context": feedback}, rollout, scores)
    solution = "\nCorrect solution:\n\n{}\n\n"
    tail = "\n\nCorrectly solve the original question.\n"
    expected = ["reverse 12 =" + solution.format(texts[3]) + tail]  # row 0: itself excluded, its peer row 3
    expected += ["reverse 12 =" + solution.format(texts[0]) + tail] * 3
    said = "\nThe following is feedback from your unsuccessful earlier attempt:\n\ntoo long\n\n"
    expected += ["reverse 34 =" + said + tail] * 2 + ["reverse 34 ="] * 2  # feedback only; nothing: own prompt
    got = [tok.decode(r[m.bool()]) for r, m in zip(out["teacher_prompt_ids"], out["teacher_prompt_mask"])]
    assert got == expected
    assert out["self_distillation_mask"].tolist() == [1, 1, 1, 1, 1, 1, 0, 0]
    self_success = sdpo(output_dir=str(tmp_path / "self"), dont_reprompt_on_self_success=False)
    assert self_success.demonstrations(scores)[:4] == [0, 0, 0, 0]
    assert sdpo(output_dir=str(tmp_path / "off"), use_successful_as_teacher=False).demonstrations(scores) == [None] * 8


# ---------------------------------------------------------------- training, resume, CLI, errors
@pytest.mark.parametrize("fields", [{}, {"distillation_mode": "topk_logits", "distillation_topk": 5,
                                         "distillation_alpha": 0.5, "distillation_weight": 0.5,
                                         "teacher_model_kind": "live"}])
def test_sdpo_trains_every_parameter(tmp_path, fields):
    last = changed_everything(sdpo(output_dir=str(tmp_path), **fields))
    assert last["self_distillation/reprompt_sample_fraction"] > 0 and math.isfinite(last["divergence"])


def test_sdpo_resumes_identically(tmp_path):
    assert_resumes_identically(lambda **f: sdpo(**f), tmp_path, max_steps=3, stop_at=2)


def test_sdpo_cli(tmp_path):
    from posttrain import cli

    run = cli.run(["sdpo", "--model_name_or_path", "posttrain/tiny-qwen2", "--dataset_name", "reverse",
                   "--reward_funcs", "digit_match", "--success_reward_threshold", "0.5", "--num_generations", "4",
                   "--output_dir", str(tmp_path / "sdpo"), "--max_steps", "1", "--per_device_train_batch_size", "8",
                   "--max_completion_length", "4", "--disable_tqdm", "true"])
    assert run.state.global_step == 1 and type(run).__name__ == "SDPOTrainer"


@pytest.mark.parametrize("fields, message", [
    ({"distillation_alpha": 0.5}, "distillation_alpha=1.0"), ({"distillation_weight": 1.5}, "must be in \\[0, 1\\]"),
    ({"solution_template": "{solution}"}, "lacks {successful_previous_attempt}"),
    ({"max_reprompt_len": 0}, "max_reprompt_len=0"), ({"distillation_mode": "topk_logits"}, "distillation_topk > 0"),
])
def test_sdpo_config_refuses(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        SDPOConfig(output_dir=str(tmp_path), **fields)


def test_sdpo_needs_reward_functions(tmp_path):
    with pytest.raises(ValueError, match="SDPOTrainer needs reward_funcs"):
        SDPOTrainer("posttrain/tiny-qwen2", None, args=SDPOConfig(**online_args(tmp_path)), train_dataset=prompts(8))
