"""The online config reads its estimator / policy-loss / aggregation facts from the core registries: names, help
text, group checks and options follow a registration, including one made after import."""

from dataclasses import fields
from types import SimpleNamespace

import pytest
from tests.helpers.online import first_token_reward, online_args, prompts, train_and_check

import posttrain.core.advantages as advantages
import posttrain.core.policy_losses as policy_losses
from posttrain.core.advantages import ADVANTAGES, register_advantage
from posttrain.core.masked import AGGREGATIONS
from posttrain.core.policy_losses import POLICY_LOSSES, register_policy_loss
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer
from posttrain.trainers.online import OnlineTrainer
from posttrain.trainers.online_config import OnlineConfig, loss_types


@pytest.fixture
def scratch_registries(monkeypatch):
    """Registrations made in a test stay in that test."""
    monkeypatch.setattr(advantages, "ADVANTAGES", ADVANTAGES.copy())
    monkeypatch.setattr(policy_losses, "POLICY_LOSSES", POLICY_LOSSES.copy())
    monkeypatch.setattr("posttrain.trainers.online_config.ADVANTAGES", advantages.ADVANTAGES)
    monkeypatch.setattr("posttrain.trainers.online_config.POLICY_LOSSES", policy_losses.POLICY_LOSSES)
    monkeypatch.setattr("posttrain.trainers.online.ADVANTAGES", advantages.ADVANTAGES)
    monkeypatch.setattr("posttrain.trainers.online.POLICY_LOSSES", policy_losses.POLICY_LOSSES)
    return advantages.ADVANTAGES, policy_losses.POLICY_LOSSES


def config(**overrides):
    return OnlineConfig(**{"output_dir": "x", "per_device_train_batch_size": 4, "num_generations": 2,
                           "report_to": "none", **overrides})


def test_help_text_lists_every_registered_name():
    helps = {f.name: f.metadata["help"] for f in fields(OnlineConfig)}
    for name in ADVANTAGES:
        assert name in helps["advantage_estimator"]
    for name in POLICY_LOSSES:
        assert name in helps["policy_loss"]
    for name in list(AGGREGATIONS) + [n for n, loss in POLICY_LOSSES.items() if loss.aggregation]:
        assert name in helps["loss_type"]


def test_loss_types_come_from_the_registries():
    types = loss_types()
    assert types["dr_grpo"] == ("seq_mean_token_sum_norm", True) and types["bnpo"] == ("token_mean", False)
    assert all(types[mode] == (mode, True) for mode in AGGREGATIONS)
    assert types["luspo"] == ("seq_mean_token_sum", True) and types["cispo"] == ("token_mean", True)
    assert "clipped" not in types  # a policy loss without its own aggregation is not a loss_type
    c = config(loss_type="luspo")
    assert c.policy_loss == "luspo"


def test_an_estimator_registered_later_is_checked_with_its_facts(scratch_registries):
    @register_advantage("test_needs_three", per_token=False, critic=False, min_group=3)
    def needs_three(inp, *, gamma: float = 1.0):
        return inp.mask.float(), None

    with pytest.raises(ValueError, match="'test_needs_three' compares .* num_generations >= 3"):
        config(advantage_estimator="test_needs_three", num_generations=2)
    assert config(advantage_estimator="test_needs_three", num_generations=4).advantage_estimator == "test_needs_three"


def test_an_option_without_a_config_field_is_refused_by_the_config(scratch_registries):
    @register_advantage("test_unknown_option", per_token=False, critic=False, min_group=1)
    def unknown_option(inp, *, no_such_field: float = 1.0):
        return inp.mask.float(), None

    with pytest.raises(ValueError, match=r"advantage_estimator='test_unknown_option' \(.*unknown_option\) takes "
                                         r"option\(s\) \['no_such_field'\], which OnlineConfig has no field for"):
        config(advantage_estimator="test_unknown_option")

    @register_policy_loss("test_loss", aggregation="token_mean")
    def loss(logp, old_logp, advantages, mask, *, no_such_loss_field: float = 0.0):
        return -advantages * logp, {}

    with pytest.raises(ValueError, match=r"policy_loss='test_loss' .* \['no_such_loss_field'\]"):
        config(loss_type="test_loss")  # a loss_type of its name, registered after import


def test_trainer_options_raise_for_an_option_without_a_field(scratch_registries):
    """OnlineTrainer._options passes each option from its config field; one without a field raises (it used to
    be dropped, leaving the option at its default)."""
    args = config(advantage_estimator="leave_one_out", normalize_advantage=True, policy_loss="sapo")
    trainer = SimpleNamespace(args=args)
    assert OnlineTrainer._options(trainer, "advantage_estimator") == {"normalize_advantage": True}
    assert OnlineTrainer._options(trainer, "policy_loss") == {
        "sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05, "importance_sampling_level": "token"}

    @register_advantage("test_late_option", per_token=False, critic=False, min_group=2)
    def late_option(inp, *, normalize_advantage: bool = False, no_such_field: int = 3):
        return inp.mask.float(), None

    args.advantage_estimator = "test_late_option"  # set after the config's own check
    with pytest.raises(ValueError, match=r"test_late_option.*\['no_such_field'\]"):
        OnlineTrainer._options(trainer, "advantage_estimator")


def test_grpo_trains_with_the_opo_estimator(tmp_path):
    args = GRPOConfig(**online_args(tmp_path, num_generations=4, beta=0.1, advantage_estimator="opo"))
    trainer = GRPOTrainer("posttrain/tiny-qwen2", first_token_reward, args=args, train_dataset=prompts())
    logged = train_and_check(trainer)
    assert trainer.state.global_step == 2
    # OPO's advantages average to 0 over each group's tokens, so the token-mean policy loss at ratio 1 is 0
    assert all(abs(v) < 1e-6 for v in logged["loss/policy_avg"])
