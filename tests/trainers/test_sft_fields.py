"""SFT fields and inputs TRL users set: loss_type (nll / dft), chat_template_path, chat_template_kwargs,
dataset_kwargs, a plain TrainingArguments, image columns, PEFT prompt tuning, a mixture-of-experts
router loss, and streamed datasets."""

import pytest
import torch
from datasets import Dataset, IterableDataset
from transformers import TrainingArguments

from posttrain.data.collate import IGNORE_INDEX
from posttrain.models.loading import load_tokenizer
from posttrain.tasks.builtin import task_dataset, zen
from posttrain.trainers.sft import SFTConfig, SFTTrainer

MODEL = "posttrain/tiny-qwen2"


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def config(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-3,
                logging_steps=1, disable_tqdm=True, seed=0, dataloader_pin_memory=False)
    return SFTConfig(**{**base, **kw})


def batch_of(trainer, n):
    return trainer.data_collator([trainer.train_dataset[i] for i in range(n)])


def target_logps(model, batch):
    """(N,) float64 log-probs of the batch's target tokens under a plain forward."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.double()
    labels = batch["labels"][:, 1:]
    keep = labels != IGNORE_INDEX
    logps = logits[:, :-1].log_softmax(-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return logps[keep]


# ------------------------------------------------------------------ loss_type


def test_dft_loss_and_gradient_match_a_float64_reference(tmp_path):
    trainer = SFTTrainer(MODEL, args=config(tmp_path, loss_type="dft"), train_dataset=task_dataset("reverse", size=6))
    model, batch = trainer.model.eval(), batch_of(trainer, 6)
    loss = trainer.compute_loss(model, batch)
    logps = target_logps(model, batch)
    reference = (-logps.detach().exp() * logps).sum() / logps.numel()
    assert loss.item() == pytest.approx(reference.item(), abs=1e-6)
    assert loss.item() < -logps.mean().item()  # the weights p < 1 make it smaller than the NLL
    # the gradient treats the weight p as a constant: d/dθ = -p * dlogp/dθ, unlike d(-p log p)/dθ
    weight = model.model.norm.weight
    (ours,) = torch.autograd.grad(loss, weight)
    (expected,) = torch.autograd.grad(reference, weight, retain_graph=True)
    (undetached,) = torch.autograd.grad((-logps.exp() * logps).sum() / logps.numel(), weight)
    torch.testing.assert_close(ours, expected.float(), atol=1e-6, rtol=1e-4)
    assert not torch.allclose(expected, undetached, atol=1e-5)


def test_dft_training_does_not_depend_on_how_the_batch_is_split(tmp_path):
    """3 full-batch steps on 8 rows: one batch of 8, 4 x 2 accumulation and packed rows give the same losses."""
    data = task_dataset("reverse", size=8)

    def losses(**kw):
        trainer = SFTTrainer(MODEL, args=config(tmp_path, loss_type="dft", max_steps=3, **kw), train_dataset=data)
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    reference = losses(per_device_train_batch_size=8)
    # -p log p rises while the targets' p < 1/e: an untrained model's rising DFT loss means it learns
    assert len(reference) == 3 and reference[-1] > reference[0]
    assert losses(per_device_train_batch_size=4, gradient_accumulation_steps=2) == pytest.approx(reference, abs=1e-5)
    assert losses(per_device_train_batch_size=8, packing=True, max_length=40) == pytest.approx(reference, abs=1e-5)


def test_nll_is_the_default_and_unknown_loss_types_are_refused(tmp_path):
    assert SFTConfig(output_dir=str(tmp_path)).loss_type == "nll"
    with pytest.raises(ValueError, match="loss_type='focal'.*dft"):
        SFTConfig(output_dir=str(tmp_path), loss_type="focal")


# ------------------------------------------------------------------ chat templates and dataset_kwargs

TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m.role }}{% if shout %}!{% endif %}"
            "{{ '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}")
CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]


def test_chat_template_path_from_a_jinja_file_or_a_tokenizer_folder(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    data = Dataset.from_list([{"messages": CHAT}])
    trainer = SFTTrainer(MODEL, args=config(tmp_path, chat_template_path=str(path)), train_dataset=data,
                         processing_class=load_tokenizer(MODEL))
    tok = trainer.processing_class
    expected = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
    assert tok.decode(trainer.train_dataset[0]["input_ids"]) == expected
    # a tokenizer folder: its template is used, and the special token it writes is added (embeddings grown)
    source = load_tokenizer(MODEL)
    source.add_tokens(["<|think|>"], special_tokens=True)
    source.chat_template = "{{ '<|think|>' }}" + TEMPLATE.replace("m.role", "m.role | upper")
    source.save_pretrained(tmp_path / "tok")
    trainer = SFTTrainer(MODEL, args=config(tmp_path, chat_template_path=str(tmp_path / "tok")), train_dataset=data,
                         processing_class=load_tokenizer(MODEL))
    tok, ids = trainer.processing_class, trainer.train_dataset[0]["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|think|>") == 1024
    assert tok.decode(ids[1:]).startswith("<|im_start|>USER")
    assert trainer.model.get_input_embeddings().weight.shape[0] == 1025
    assert trainer.train().global_step == 2
    with pytest.raises(ValueError, match="neither a Jinja template file nor a tokenizer folder"):
        SFTTrainer(MODEL, args=config(tmp_path, chat_template_path=str(tmp_path / "nothing")), train_dataset=data)


def test_chat_template_kwargs_from_the_config_and_from_each_row(tmp_path):
    tok = load_tokenizer(MODEL)
    tok.chat_template = TEMPLATE
    data = Dataset.from_list([{"messages": CHAT, "chat_template_kwargs": {"shout": True}},
                              {"messages": CHAT, "chat_template_kwargs": {"shout": False}}])
    trainer = SFTTrainer(MODEL, args=config(tmp_path), train_dataset=data, processing_class=tok)
    texts = [tok.decode(row["input_ids"]) for row in trainer.train_dataset]
    assert texts[0].startswith("<|im_start|>user!\nhi") and texts[1].startswith("<|im_start|>user\nhi")
    plain = Dataset.from_list([{"messages": CHAT}])
    trainer = SFTTrainer(MODEL, args=config(tmp_path, chat_template_kwargs={"shout": True}), train_dataset=plain,
                         processing_class=tok)
    assert tok.decode(trainer.train_dataset[0]["input_ids"]).startswith("<|im_start|>user!\nhi")


def test_dataset_kwargs_skip_prepare_dataset_uses_tokenised_rows_as_they_are(tmp_path):
    tok = load_tokenizer(MODEL)
    ids = [tok(f"number {i} is here")["input_ids"] for i in range(4)]
    rows = [{"input_ids": x, "loss_mask": [0] * (len(x) - 3) + [1] * 3} for x in ids]
    data = Dataset.from_list(rows)
    trainer = SFTTrainer(MODEL, args=config(tmp_path, dataset_kwargs={"skip_prepare_dataset": True}),
                         train_dataset=data)
    assert trainer.train_dataset is data
    batch = batch_of(trainer, 4)
    assert (batch["labels"] != IGNORE_INDEX).sum().item() == 4 * 3
    assert trainer.train().training_loss > 0
    # TRL's own mask column of pre-tokenised rows serves too
    trl_rows = Dataset.from_list([{"input_ids": r["input_ids"], "completion_mask": r["loss_mask"]} for r in rows])
    trainer = SFTTrainer(MODEL, args=config(tmp_path, dataset_kwargs={"skip_prepare_dataset": True}),
                         train_dataset=trl_rows)
    assert (batch_of(trainer, 4)["labels"] != IGNORE_INDEX).sum().item() == 4 * 3
    with pytest.raises(ValueError, match="'input_ids' column"):
        SFTTrainer(MODEL, args=config(tmp_path, dataset_kwargs={"skip_prepare_dataset": True}), train_dataset=zen())
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['add_special_tokens'\]"):
        SFTConfig(output_dir=str(tmp_path), dataset_kwargs={"add_special_tokens": False})


def test_the_fields_from_the_command_line():
    from posttrain.cli import parse

    _, args = parse("sft", ["--model_name_or_path", MODEL, "--dataset_name", "zen", "--output_dir", "x",
                            "--loss_type", "dft", "--dataset_kwargs", '{"skip_prepare_dataset": true}',
                            "--chat_template_kwargs", '{"enable_thinking": false}'])
    assert (args.loss_type, args.dataset_kwargs) == ("dft", {"skip_prepare_dataset": True})
    assert args.chat_template_kwargs == {"enable_thinking": False}


# ------------------------------------------------------------------ TrainingArguments, images


def test_plain_training_arguments_become_an_sft_config_keeping_every_field(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, learning_rate=3e-3, per_device_train_batch_size=2,
                             weight_decay=0.05, logging_steps=1, seed=7, disable_tqdm=True, report_to="none",
                             save_strategy="no")
    trainer = SFTTrainer(MODEL, args=args, train_dataset=zen())
    assert isinstance(trainer.args, SFTConfig)
    for name in ("output_dir", "max_steps", "learning_rate", "per_device_train_batch_size", "weight_decay", "seed"):
        assert getattr(trainer.args, name) == getattr(args, name), name
    assert trainer.args.max_length == 1024 and trainer.args.loss_type == "nll"  # SFT's own defaults
    assert trainer.train().global_step == 2


def test_classic_documentation_call_runs_as_written(tmp_path):
    from posttrain.models.loading import load_causal_lm

    model, tokenizer = load_causal_lm(MODEL), load_tokenizer(MODEL)
    rows = [{"instruction": f"reverse {n} =", "output": f" {str(n)[::-1]}"} for n in (12, 345, 6789, 10)]
    with pytest.warns(FutureWarning, match=r"\['max_length', 'packing'\].*SFTConfig"):
        trainer = SFTTrainer(model=model, args=config(tmp_path), tokenizer=tokenizer, train_dataset=rows,
                             packing=True, max_length=512)
    assert trainer.processing_class is tokenizer and (trainer.args.packing, trainer.args.max_length) == (True, 512)
    assert len(trainer.train_dataset) == 1  # the four short rows share one packed row
    assert trainer.model.model_tags[:2] == ["posttrain", "sft"]
    # the classic docs' max_seq_length is the old name of max_length
    with pytest.warns(FutureWarning, match="max_seq_length is deprecated"):
        trainer = SFTTrainer(MODEL, args=config(tmp_path), train_dataset=rows, max_seq_length=12)
    assert trainer.args.max_length == 12 and max(len(r["input_ids"]) for r in trainer.train_dataset) == 12
    with pytest.raises(ValueError, match="disagree"):
        SFTConfig(output_dir=str(tmp_path), max_length=64, max_seq_length=32)
    with pytest.raises(ValueError, match="train_dataset is required"):
        SFTTrainer(MODEL, args=config(tmp_path), train_dataset=None)


def test_padding_free_with_a_custom_collator_is_refused(tmp_path):
    from posttrain.data.collate import LanguageModelingCollator

    with pytest.raises(ValueError, match="padding_free=True.*custom data_collator"):
        SFTTrainer(MODEL, args=config(tmp_path, padding_free=True), train_dataset=zen(),
                   data_collator=LanguageModelingCollator(0))
    # padding-free without packing and without max_length is supported: one flat row per batch
    trainer = SFTTrainer(MODEL, args=config(tmp_path, padding_free=True, max_length=None), train_dataset=zen())
    batch = batch_of(trainer, 4)
    assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch
    assert trainer.train().global_step == 2


def test_image_columns_are_refused_naming_the_column(tmp_path):
    from PIL import Image

    picture = Image.new("RGB", (4, 4))
    with pytest.raises(ValueError, match="column 'images' holds images"):
        SFTTrainer(MODEL, args=config(tmp_path),
                   train_dataset=Dataset.from_list([{"messages": CHAT, "images": ["x.png"]}]))
    with pytest.raises(ValueError, match="column 'photo' holds images"):
        SFTTrainer(MODEL, args=config(tmp_path), train_dataset=Dataset.from_list([{"text": "a", "photo": picture}]))


# ------------------------------------------------------------------ PEFT prompt learning


@pytest.mark.parametrize("kind", ["prompt_tuning", "p_tuning"])
def test_peft_prompt_learning_trains_the_virtual_tokens(tmp_path, kind):
    from peft import PromptEncoderConfig, PromptTuningConfig

    peft_config = (PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4) if kind == "prompt_tuning" else
                   PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, encoder_hidden_size=16))
    trainer = SFTTrainer(MODEL, args=config(tmp_path, learning_rate=1e-2), peft_config=peft_config,
                         train_dataset=task_dataset("reverse", size=8))
    model, batch = trainer.model, batch_of(trainer, 4)
    model.eval()
    with torch.no_grad():  # the model's own loss: labels shifted past the virtual tokens by PEFT
        expected = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         labels=batch["labels"]).loss
        loss = trainer.compute_loss(model, batch)
    assert torch.isfinite(loss) and loss.item() == pytest.approx(expected.item(), rel=1e-5)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert before and all("prompt_encoder" in n for n in before)
    result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    for name, param in model.named_parameters():
        if name in before:
            assert not torch.equal(param, before[name]), name
    with pytest.raises(ValueError, match="virtual tokens.*packing=False"):
        SFTTrainer(MODEL, args=config(tmp_path, packing=True, max_length=32), train_dataset=zen(),
                   peft_config=PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))


# ------------------------------------------------------------------ mixture of experts


def tiny_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2MoeConfig(vocab_size=len(load_tokenizer(MODEL)), hidden_size=32, intermediate_size=32,
                         moe_intermediate_size=16, shared_expert_intermediate_size=16, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                         output_router_logits=True, router_aux_loss_coef=0.5)
    return Qwen2MoeForCausalLM(cfg)


def test_moe_router_aux_loss_is_added_to_the_loss(tmp_path):
    trainer = SFTTrainer(tiny_moe(), args=config(tmp_path), train_dataset=task_dataset("reverse", size=8),
                         processing_class=load_tokenizer(MODEL))
    assert trainer.aux_loss_enabled and trainer.aux_loss_coef == 0.5
    model, batch = trainer.model.eval(), batch_of(trainer, 4)
    with torch.no_grad():
        loss = trainer.compute_loss(model, batch)
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"],
                    output_router_logits=True)
    nll = -target_logps(model, batch).mean()
    assert out.aux_loss.item() > 0
    assert loss.item() == pytest.approx(nll.item() + 0.5 * out.aux_loss.item(), abs=1e-5)
    trainer.model.train()
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert logged and all(h["aux_loss"] > 0 for h in logged)
    dense = SFTTrainer(MODEL, args=config(tmp_path), train_dataset=zen())
    assert dense.aux_loss_enabled is False


# ------------------------------------------------------------------ streaming


def test_streamed_train_and_eval_datasets(tmp_path):
    data = task_dataset("reverse", size=16)
    streamed = data.to_iterable_dataset()
    assert isinstance(streamed, IterableDataset)
    with pytest.raises(ValueError, match="max_steps"):
        SFTTrainer(MODEL, args=config(tmp_path, max_steps=-1), train_dataset=streamed)
    trainer = SFTTrainer(MODEL, args=config(tmp_path), train_dataset=streamed,
                         eval_dataset={"a": data.select(range(4)).to_iterable_dataset(), "b": data.select(range(4))})
    # the streamed rows tokenise as the in-memory ones do
    eager = SFTTrainer.prepare_dataset(data, trainer.processing_class, trainer.args, packing=False)
    first = next(iter(trainer.train_dataset))
    assert first["input_ids"] == eager[0]["input_ids"] and first["loss_mask"] == eager[0]["loss_mask"]
    assert trainer.train().global_step == 2
    metrics = trainer.evaluate()
    assert metrics["eval_a_loss"] == pytest.approx(metrics["eval_b_loss"], rel=1e-5)
    packed = SFTTrainer.prepare_dataset(streamed, trainer.processing_class, config(tmp_path, packing=True,
                                                                                    max_length=32), packing=True)
    rows = list(packed)
    assert sum(len(r["seq_lengths"]) for r in rows) == 16 and all(len(r["input_ids"]) <= 32 for r in rows)


def test_evaluate_prepares_a_raw_dataset_given_later(tmp_path):
    data = task_dataset("reverse", size=8)
    trainer = SFTTrainer(MODEL, args=config(tmp_path), train_dataset=data, eval_dataset=data.select(range(4)))
    given_at_init = trainer.evaluate()["eval_loss"]
    assert trainer.evaluate(eval_dataset=data.select(range(4)))["eval_loss"] == pytest.approx(given_at_init)
    sharegpt = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}]
    assert trainer.evaluate(eval_dataset=sharegpt)["eval_loss"] > 0
