"""Policy + critic in one module, for PPO.

Two ways to give PPO a critic V(s_t), both returning the policy's logits and a per-token
`value` from one call:

* `CausalLMWithValueHead`: a linear head on the policy's last hidden state (the critic shares
  the policy's body; one forward gives logits and values).
* `PolicyWithCritic`: a separate sequence-classification model as the critic; its per-token
  values are its score head applied to every position of its backbone's hidden states (the
  classifier normally reads only the last one).

The forward returns the policy's own output with `value` (B, K) added (K = logits_to_keep or T);
with `use_cache=True` (generation) the critic is skipped and `value` is None.
`value[:, t]` is V of the prefix ending at token t, i.e. it sits at the same position as the
logits that predict token t+1, so a caller slices values exactly as it slices logits.
Both save the policy as an ordinary checkpoint (loadable with AutoModelForCausalLM) and the
critic next to it; `load_critic` reads the critic back in place (resuming from a checkpoint).

`AutoModelForCausalLMWithValueHead` is the class classic TRL code imports: a
`CausalLMWithValueHead` whose forward returns the classic tuple (lm_logits, loss, value) and whose
head has the classic `v_head.summary` name. Given to PPOTrainer, its policy and head are the ones
trained. Departure: the head starts at zero (V = 0), as PPO's own value head does, where classic TRL
initialised it at random. posttrain has no encoder-decoder support, so
`AutoModelForSeq2SeqLMWithValueHead` only refuses, saying so.
"""

from __future__ import annotations

import os

from torch import nn

from posttrain.models import compat

VALUE_HEAD_FILE = "value_head.safetensors"
CRITIC_FOLDER = "value_model"


class _PolicyWrapper(nn.Module):
    """What both critics share: the policy is `self.policy`; the rest passes through to it."""

    policy: nn.Module

    @property
    def config(self):
        return self.policy.config

    @property
    def generation_config(self):
        return self.policy.generation_config

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            # A PEFT policy makes the wrapper count as a PEFT model, so the adapter-disabled
            # policy can serve as the reference (BaseTrainer.make_reference/reference_context).
            if name in ("disable_adapter", "peft_config"):
                return getattr(super().__getattr__("policy"), name)
            # transformers.Trainer reads these from the model it trains after loading a checkpoint into the policy
            if name in ("_keys_to_ignore_on_save", "tie_weights"):
                return getattr(super().__getattr__("policy"), name)
            raise

    def activation_checkpointing_enable(self, **kwargs):
        """transformers' Trainer calls this (newer 5.x) or gradient_checkpointing_enable (older 5.x)."""
        compat.enable_activation_checkpointing(self.policy, **kwargs)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, **kwargs):
        compat.enable_activation_checkpointing(self.policy, gradient_checkpointing_kwargs, **kwargs)

    def generate(self, *args, **kwargs):
        return self.policy.generate(*args, **kwargs)


class CausalLMWithValueHead(_PolicyWrapper):
    """A causal LM plus a scalar head on its last hidden state."""

    def __init__(self, pretrained_model: nn.Module):
        super().__init__()
        self.policy = pretrained_model
        self.v_head = nn.Linear(pretrained_model.config.hidden_size, 1)
        # zero head: V = 0 at the start, so early advantages are the raw returns
        nn.init.zeros_(self.v_head.weight)
        nn.init.zeros_(self.v_head.bias)

    def forward(self, input_ids=None, attention_mask=None, logits_to_keep: int = 0, use_cache=None, **kwargs):
        out = self.policy(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=logits_to_keep,
                          use_cache=use_cache, output_hidden_states=not use_cache, **kwargs)
        value = None
        if not use_cache:
            hidden = out.hidden_states[-1]  # (B, T, H), after the final norm
            if logits_to_keep:
                hidden = hidden[:, -logits_to_keep:]
            value = self.v_head(hidden.to(self.v_head.weight.dtype)).squeeze(-1)
        out["value"] = value
        return out

    def save_pretrained(self, save_directory: str, **kwargs):
        from safetensors.torch import save_file

        self.policy.save_pretrained(save_directory, **kwargs)
        state = {k: v.detach().contiguous().cpu() for k, v in self.v_head.state_dict().items()}
        save_file(state, os.path.join(save_directory, VALUE_HEAD_FILE))

    @classmethod
    def from_pretrained(cls, path, **kwargs) -> "CausalLMWithValueHead":
        """The policy from `path` and the head saved with it (a fresh zero head if there is none). `path` may
        be a model object too, as TRL accepts: it becomes the policy as it is, with a fresh head; a model that
        has a value head already is returned as it is."""
        from posttrain.models.loading import load_causal_lm

        if isinstance(path, CausalLMWithValueHead):
            return path
        model = cls(load_causal_lm(path, **kwargs))
        if isinstance(path, str) and os.path.isfile(os.path.join(path, VALUE_HEAD_FILE)):
            model.load_critic(path)
        return model

    def load_critic(self, path: str):
        """In place: the value head that `save_pretrained` wrote to `path` (a checkpoint being resumed)."""
        from safetensors.torch import load_file

        head = os.path.join(path, VALUE_HEAD_FILE)
        if not os.path.isfile(head):
            raise FileNotFoundError(f"{path} has no {VALUE_HEAD_FILE}: it was not saved from a policy with a value "
                                    "head (CausalLMWithValueHead.save_pretrained)")
        self.v_head.load_state_dict(load_file(head))


class ValueHead(nn.Linear):
    """The scalar value head; `summary` is the classic TRL name of its linear layer (there a dropout plus a
    `summary` Linear; here the Linear itself, so its checkpoint keys are those of CausalLMWithValueHead's head)."""

    @property
    def summary(self) -> nn.Linear:
        return self


class AutoModelForCausalLMWithValueHead(CausalLMWithValueHead):
    """Classic TRL's causal LM with a value head: `from_pretrained(name_or_path)`, `save_pretrained`, `generate`,
    `pretrained_model`, `v_head` (with `.summary`), and a forward returning (lm_logits, loss, value)."""

    def __init__(self, pretrained_model: nn.Module):
        super().__init__(pretrained_model)
        self.v_head = ValueHead(pretrained_model.config.hidden_size, 1)
        nn.init.zeros_(self.v_head.weight)
        nn.init.zeros_(self.v_head.bias)

    @property
    def pretrained_model(self) -> nn.Module:
        return self.policy

    def forward(self, input_ids=None, past_key_values=None, attention_mask=None, return_past_key_values=False,
                **kwargs):
        """(lm_logits (B, T, V), loss (with `labels`, else None), value (B, T)) as classic TRL returned them,
        plus past_key_values with `return_past_key_values`."""
        kwargs.pop("output_hidden_states", None)
        if past_key_values is not None:
            kwargs.update(compat.cache_kwargs(self.policy, past_key_values))
        out = self.policy(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, **kwargs)
        hidden = out.hidden_states[-1]
        value = self.v_head(hidden.to(self.v_head.weight.dtype)).squeeze(-1)
        result = (out.logits, getattr(out, "loss", None), value)
        return result + (compat.output_cache(self.policy, out),) if return_past_key_values else result


class AutoModelForSeq2SeqLMWithValueHead:
    """Refused: posttrain trains decoder-only causal LMs and has no encoder-decoder (seq2seq) support."""

    _message = ("AutoModelForSeq2SeqLMWithValueHead is not available: posttrain trains decoder-only causal LMs and "
                "has no encoder-decoder (seq2seq) support. Use a causal LM with AutoModelForCausalLMWithValueHead "
                "(or give PPOTrainer the causal LM itself; its value head is added)")

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(self._message)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        raise NotImplementedError(cls._message)


def _backbone_and_head(value_model: nn.Module) -> tuple[nn.Module, nn.Module]:
    backbone = getattr(value_model, getattr(value_model, "base_model_prefix", "model"), None)
    head = getattr(value_model, "score", None) or getattr(value_model, "classifier", None)
    if backbone is None or head is None:
        raise ValueError(f"value model {type(value_model).__name__} is not a sequence classifier with a "
                         "backbone and a `score` head; pass an AutoModelForSequenceClassification model "
                         "(num_labels=1), or no value_model to use a value head on the policy")
    return backbone, head


class PolicyWithCritic(_PolicyWrapper):
    """A causal LM and a separate sequence-classification critic, trained together."""

    def __init__(self, policy: nn.Module, value_model: nn.Module):
        super().__init__()
        _backbone_and_head(value_model)  # fail early on a model without a score head
        self.policy, self.value_model = policy, value_model

    def forward(self, input_ids=None, attention_mask=None, logits_to_keep: int = 0, use_cache=None, **kwargs):
        out = self.policy(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=logits_to_keep,
                          use_cache=use_cache, **kwargs)
        value = None
        if not use_cache:
            backbone, head = _backbone_and_head(self.value_model)
            hidden = backbone(input_ids=input_ids, attention_mask=attention_mask,
                              position_ids=kwargs.get("position_ids"), use_cache=False).last_hidden_state
            if logits_to_keep:
                hidden = hidden[:, -logits_to_keep:]
            value = head(hidden)[..., 0]  # (B, K): label 0 of the score head at every position
        out["value"] = value
        return out

    def save_pretrained(self, save_directory: str, **kwargs):
        self.policy.save_pretrained(save_directory, **kwargs)
        self.value_model.save_pretrained(os.path.join(save_directory, CRITIC_FOLDER), **kwargs)

    def load_critic(self, path: str):
        """In place: the critic that `save_pretrained` wrote to `path`/value_model (a checkpoint being resumed)."""
        folder = os.path.join(path, CRITIC_FOLDER)
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"{path} has no {CRITIC_FOLDER}/ folder: it was not saved from a policy with a "
                                    "separate critic (PolicyWithCritic.save_pretrained)")
        # from_pretrained reads any layout save_pretrained writes (sharded or not); the weights are then copied
        saved = type(self.value_model).from_pretrained(folder, dtype=self.value_model.dtype)
        self.value_model.load_state_dict(saved.state_dict())
