"""eval_mode and disable_dropout: the model's mode comes back after the block, every dropout layer goes to p = 0."""

import pytest
import torch

from posttrain.models.modes import disable_dropout, eval_mode


def net():
    return torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5),
                               torch.nn.Sequential(torch.nn.Dropout(0.2), torch.nn.ReLU()))


@pytest.mark.parametrize("training", [True, False])
def test_eval_mode_restores_the_models_own_mode_even_after_an_error(training):
    model = net().train(training)
    with eval_mode(model) as inside:
        assert inside is model and not any(m.training for m in model.modules())
    assert all(m.training == training for m in model.modules())
    with pytest.raises(RuntimeError), eval_mode(model):
        raise RuntimeError("a failed forward")
    assert all(m.training == training for m in model.modules())


def test_disable_dropout_zeroes_every_dropout_layer_and_nothing_else():
    model = net()
    before = [p.clone() for p in model.parameters()]
    disable_dropout(model)
    assert [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)] == [0.0, 0.0]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    x = torch.ones(4, 2)
    torch.testing.assert_close(model.train()(x), model.eval()(x))  # training forward = eval forward
