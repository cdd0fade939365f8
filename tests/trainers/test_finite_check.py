"""guards.first_non_finite, which FiniteGuard runs on every step's gradients and weights: its cheap 2-norm pass
must never call a finite tensor non-finite (a 2-norm overflows on large finite values) nor miss a NaN or an
infinity; the answer is checked against torch.isfinite element by element. The trainers' clipping
(`clip_grad_norm_exact`) gives torch's norm and gradients bit for bit, and a NaN gradient still stops a run."""

import pytest
import torch

from posttrain.trainers.guards import clip_grad_norm_exact, first_non_finite


def _expected(named):
    return next((n for n, t in named if not bool(torch.isfinite(t).all())), None)


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), float("-inf")])
def test_names_the_first_non_finite_tensor_even_beside_overflowing_finite_values(bad):
    huge = torch.full((4, 4), 3e38)  # finite, but its 2-norm is infinite in float32
    named = [("a", torch.randn(3)), ("huge", huge), ("b", torch.randn(2, 5)), ("c", torch.randn(7))]
    if bad is not None:
        named[2][1][1, 3] = bad
        named[3][1][0] = bad
    assert first_non_finite(named) == _expected(named) == (None if bad is None else "b")


def test_random_tensors_agree_with_isfinite():
    gen = torch.Generator().manual_seed(0)
    for trial in range(50):
        named = [(f"t{i}", torch.randn(int(torch.randint(1, 40, (1,), generator=gen)), generator=gen)
                  * 10 ** float(torch.randint(0, 39, (1,), generator=gen))) for i in range(4)]
        if trial % 3 == 0:
            name, t = named[int(torch.randint(0, 4, (1,), generator=gen))]
            t[int(torch.randint(0, len(t), (1,), generator=gen))] = float("nan") if trial % 2 else float("inf")
        assert first_non_finite(named) == _expected(named), trial
    assert first_non_finite([("empty", torch.zeros(0)), ("none", None)]) is None


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3, float("nan"), float("inf")])
def test_clipping_equals_torch_bit_for_bit(scale):
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(shape, generator=gen) * scale for shape in ((5, 7), (3,), (2, 2, 2))]
    ours, theirs = ([torch.nn.Parameter(torch.zeros_like(g)) for g in grads] for _ in range(2))
    for a, b, g in zip(ours, theirs, grads):
        a.grad, b.grad = g.clone(), g.clone()
    theirs.append(torch.nn.Parameter(torch.zeros(2)))  # a parameter without a gradient is left out by both
    norm = clip_grad_norm_exact(ours + theirs[-1:], 1.0)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    assert torch.equal(norm, expected) or (norm.isnan() and expected.isnan())
    for a, b in zip(ours, theirs):
        assert torch.equal(a.grad, b.grad) or (a.grad.isnan().all() and b.grad.isnan().all())


def test_a_nan_gradient_still_stops_training_after_clipping(tmp_path):
    from posttrain.trainers.guards import NonFiniteError
    from posttrain.trainers.sft import SFTConfig, SFTTrainer

    from datasets import Dataset

    args = SFTConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, report_to="none",
                     disable_tqdm=True, max_grad_norm=1.0)
    trainer = SFTTrainer("posttrain/tiny-qwen2", args=args, train_dataset=Dataset.from_list([{"text": "ab cd"}] * 4))
    weight = trainer.model.get_input_embeddings().weight
    weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    before = weight.detach().clone()
    with pytest.raises(NonFiniteError, match="the gradient of .* is NaN or infinite"):
        trainer.train()
    assert torch.equal(weight.detach(), before)
    assert trainer.finite_guard.grad_norm is None  # read by the guard, which then checked the gradients itself


def test_guard_takes_the_steps_finite_gradient_norm_instead_of_its_own_pass(tmp_path):
    from types import SimpleNamespace

    from posttrain.trainers.guards import FiniteGuard, NonFiniteError

    model = torch.nn.Linear(3, 2)
    model.weight.grad, model.bias.grad = torch.ones(2, 3), torch.tensor([1.0, float("nan")])
    trainer = SimpleNamespace(model=model, accelerator=SimpleNamespace(scaler=None))
    guard, args, state = FiniteGuard(trainer), SimpleNamespace(output_dir=str(tmp_path)), SimpleNamespace(global_step=0)
    guard.grad_norm = torch.tensor(2.5)  # the clipping's norm: finite, so the guard does not look
    guard.on_pre_optimizer_step(args, state, None)
    assert guard.grad_norm is None  # used once: the next step's guard looks unless it gets a new norm
    with pytest.raises(NonFiniteError, match="bias"):
        guard.on_pre_optimizer_step(args, state, None)
    for norm in (torch.tensor(float("nan")), torch.tensor(float("inf"))):  # a non-finite norm: the guard's own pass names the tensor
        guard.grad_norm = norm
        with pytest.raises(NonFiniteError, match="gradient of bias"):
            guard.on_pre_optimizer_step(args, state, None)


def test_weights_are_checked_before_they_are_saved_evaluated_or_returned_not_every_step(tmp_path, monkeypatch):
    """The guard's weight check runs where the weights are read as a result (a checkpoint, the end of training),
    not after every optimizer step: a 4-step run saving at step 2 checks them twice and passes over the gradients
    never (the clipping's finite norm stands in)."""
    from datasets import Dataset

    from posttrain.trainers import guards
    from posttrain.trainers.sft import SFTConfig, SFTTrainer

    checked = []
    monkeypatch.setattr(guards, "first_non_finite",
                        lambda named, real=guards.first_non_finite: checked.append(trainer.state.global_step)
                        or real(named))
    args = SFTConfig(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2, report_to="none",
                     disable_tqdm=True, max_grad_norm=1.0, save_strategy="steps", save_steps=2, save_only_model=True)
    trainer = SFTTrainer("posttrain/tiny-qwen2", args=args, train_dataset=Dataset.from_list([{"text": "ab cd"}] * 8))
    trainer.train()
    assert checked == [2, 4]  # the step-2 checkpoint, the end (its save finds them checked already)
