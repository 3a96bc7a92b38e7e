"""The adapter from a framework's options to GSPOConfig (``gspo_kernels.integrations.adapter``): a declaration's renames,
constants, derived values and refusals applied to an options object, and each integration's declaration."""

from __future__ import annotations

import types

import pytest

from gspo_kernels import GSPOConfig
from gspo_kernels.integrations import adapter

FRAMEWORK = adapter.Declaration("Toyframe", rules=(
    adapter.rename("epsilon_low", "clip_low"),
    adapter.rename("epsilon_high", "nested.clip_high", convert=float),
    adapter.rename("beta", "kl_coef", default=0.0),
    adapter.constant("loss_type", "dapo"),
    adapter.derived("importance_sampling_level", lambda o: "sequence" if o.seq else "token"),
    adapter.constant("clip_ratio_c", 3.0, when=lambda o: not o.seq),
), refusals=(
    adapter.Refusal("mode", lambda value: value in ("a", "b"), "{option}={value!r} (supported: a, b)"),
))


def _options(**overrides):
    values = dict(clip_low=0.1, nested=types.SimpleNamespace(clip_high=2), seq=False, mode="a")
    values.update(overrides)
    return types.SimpleNamespace(**values)


def test_a_declaration_maps_renames_constants_and_derived_values():
    config = adapter.build_config(FRAMEWORK, _options())
    assert isinstance(config, GSPOConfig)
    assert (config.epsilon_low, config.epsilon_high, config.beta) == (0.1, 2.0, 0.0)
    assert type(config.epsilon_high) is float  # converted
    assert (config.loss_type, config.importance_sampling_level, config.clip_ratio_c) == ("dapo", "token", 3.0)
    assert config.delta is None and config.temperature == GSPOConfig().temperature  # undeclared: the defaults


def test_a_rule_applies_only_where_its_condition_holds_and_a_later_rule_overrides():
    kwargs = adapter.config_options(FRAMEWORK, _options(seq=True, kl_coef=0.04))
    assert "clip_ratio_c" not in kwargs and kwargs["importance_sampling_level"] == "sequence"
    assert kwargs["beta"] == 0.04
    later = FRAMEWORK.extend(adapter.constant("epsilon_low", 0.3))
    assert adapter.config_options(later, _options())["epsilon_low"] == 0.3


def test_options_are_read_from_a_mapping_or_attributes():
    mapping = dict(clip_low=0.15, nested=dict(clip_high=0.25))
    plain = adapter.Declaration("Toyframe", rules=(adapter.rename("epsilon_low", "clip_low"),
                                                   adapter.rename("epsilon_high", "nested.clip_high")))
    assert adapter.config_options(plain, mapping) == dict(epsilon_low=0.15, epsilon_high=0.25)


def test_a_refused_value_names_the_frameworks_option():
    with pytest.raises(ValueError, match=r"^mode='c' \(supported: a, b\)$"):
        adapter.build_config(FRAMEWORK, _options(mode="c"))
    assert adapter.refused(FRAMEWORK, _options(mode="c")) == ["mode='c' (supported: a, b)"]
    assert adapter.refused(FRAMEWORK, _options()) == []


def test_a_missing_option_without_default_names_it_and_the_framework():
    options = _options()
    del options.clip_low
    with pytest.raises(ValueError, match="Toyframe's options have no 'clip_low'"):
        adapter.build_config(FRAMEWORK, options)


def test_a_declaration_onto_an_unknown_field_is_refused():
    with pytest.raises(ValueError, match="Toyframe's declaration maps onto unknown GSPOConfig field.*'epsilon'"):
        adapter.Declaration("Toyframe", rules=(adapter.rename("epsilon", "clip"),))


def test_the_config_still_validates_the_mapped_values():
    with pytest.raises(ValueError, match="epsilon_low"):
        adapter.build_config(FRAMEWORK, _options(clip_low=-1.0))


def test_the_trainers_declarations():
    from gspo_kernels.train.hf_trainer import TRAINER_OPTIONS, GSPOTrainerConfig
    from gspo_kernels.train.toy_trainer import TRAIN_OPTIONS, TrainConfig

    config = adapter.build_config(TRAINER_OPTIONS, GSPOTrainerConfig(left_clip_range=0.002, max_new_tokens=7, beta=0.1))
    assert (config.epsilon_low, config.epsilon_high, config.max_completion_length, config.beta) == (0.002, 4e-4, 7, 0.1)
    with pytest.raises(ValueError, match="give the clip band as left_clip_range or as epsilon_low, not both"):
        GSPOTrainerConfig(left_clip_range=0.002, epsilon_low=0.003)
    run = adapter.build_config(TRAIN_OPTIONS, TrainConfig(algorithm="grpo", epsilon_high=0.3))
    assert (run.importance_sampling_level, run.epsilon_low, run.epsilon_high) == ("token", 0.2, 0.3)
    with pytest.raises(ValueError, match="algorithm must be one of"):
        TrainConfig(algorithm="ppo").loss_config()


def test_the_trl_declaration_reads_the_trainers_resolved_options_and_refuses_by_name():
    """TRL's declaration on a trainer-shaped object: the band from the trainer's ``epsilon_low`` / ``epsilon_high``
    (TRL resolved them from ``epsilon`` / ``epsilon_high``), the objective's own options from ``args`` only for it."""
    from gspo_kernels.integrations import trl as drop_in

    args = types.SimpleNamespace(epsilon=0.2, epsilon_high=0.28, use_bias_correction_kl=0, delta=1.5,
                                 sapo_temperature_pos=0.9, sapo_temperature_neg=1.1)
    trainer = types.SimpleNamespace(args=args, importance_sampling_level="token", loss_type="sapo", epsilon_low=0.2,
                                    epsilon_high=0.28, beta=0.0, max_completion_length=16, off_policy_mask_threshold=None,
                                    use_vllm=False, vllm_importance_sampling_correction=False)
    config = adapter.build_config(drop_in.TRL, trainer)
    assert (config.loss_type, config.epsilon_low, config.epsilon_high) == ("sapo", 0.2, 0.28)
    assert (config.sapo_temperature_pos, config.sapo_temperature_neg, config.delta) == (0.9, 1.1, None)
    assert config.use_bias_correction_kl is False
    trainer.loss_type = "grpo"
    assert adapter.build_config(drop_in.TRL, trainer).delta == 1.5
    trainer.loss_type, trainer.importance_sampling_level = "reinforce", "tokens"
    assert adapter.refused(drop_in.TRL, trainer) == [
        "loss_type='reinforce' (supported: " + ", ".join(drop_in.TRL_LOSS_TYPES) + ")",
        "importance_sampling_level='tokens' (supported: token, sequence, sequence_token)"]
