"""The distillation family beyond Distillation/GKD/MiniLLM: a teacher behind an HTTP server (TRL's protocol, served
here on 127.0.0.1 by a real tiny teacher), IWOPDTrainer and GOLDTrainer (a teacher with a byte-level tokenizer):
every trainable parameter changes, the losses are what they should be on a known batch, resume is bit-identical,
and bad settings or a bad server get clear errors."""

import base64
import contextlib
import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from tests.helpers.online import online_args
from tests.helpers.resume import assert_resumes_identically
from tests.trainers.test_distillation import changed_everything, reverse, uneven

from posttrain.models.loading import load_causal_lm
from posttrain.rollout.teacher_server import TeacherServer, TeacherServerError
from posttrain.trainers.distillation import DistillationConfig, DistillationTrainer
from posttrain.trainers.gold import GOLDConfig, GOLDTrainer
from posttrain.trainers.iw_opd import IWOPDConfig, IWOPDTrainer


# ---------------------------------------------------------------- a teacher server on 127.0.0.1
def teacher_logprobs(model, body: dict) -> dict:
    """TRL's /get_sequence_logprobs answer from `model`: top-k and actual-token log-probs of each completion."""
    k, temperature = body["top_logprobs"], body["temperature"]
    top, ids, actual = [], [], []
    with torch.no_grad():
        for sequence, p in zip(body["sequences"], body["prompt_lengths"]):
            x = torch.tensor([sequence])
            logp = (model(x).logits[0, p - 1:-1].double() / temperature).log_softmax(-1)
            values, index = logp.topk(k, -1)
            top.append(values.tolist())
            ids.append(index.tolist())
            actual.append(logp.gather(-1, x[0, p:, None]).tolist())
    if body["response_format"] != "binary":
        return {"logprobs": top, "logprob_token_ids": ids, "actual_logprobs": actual}
    C = max(map(len, top))

    def packed(rows, width, dtype):
        arr = np.zeros((len(rows), C, width), dtype=dtype)
        for i, row in enumerate(rows):
            arr[i, :len(row)] = row
        return base64.b64encode(arr.tobytes()).decode()

    return {"shape": [len(top), C, k], "completion_lengths": list(map(len, top)),
            "logprobs_b64": packed(top, k, np.float32), "token_ids_b64": packed(ids, k, np.int32),
            "actual_logprobs_b64": packed(actual, 1, np.float32)}


class Served:
    """A teacher server in a thread; `mode` picks how it misbehaves ("ok", "redirect", "slow", "short", "500")."""

    def __init__(self, model, mode: str = "ok"):
        served, self.model, self.mode, self.calls = self, model, mode, 0

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                served.calls += 1
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if served.mode == "redirect":
                    self.send_response(302)
                    self.send_header("Location", "http://example.com/")
                    self.end_headers()
                    return
                if served.mode == "500" or (served.mode == "500-once" and served.calls == 1):
                    self.send_response(503)
                    self.end_headers()
                    self.wfile.write(b"warming up")
                    return
                if served.mode == "slow":
                    time.sleep(2.0)
                if served.mode == "short":  # JSON lists, one position short
                    body["response_format"] = "json"
                reply = teacher_logprobs(served.model, body)
                if served.mode == "short":
                    reply = {"logprobs": [r[:-1] for r in reply["logprobs"]],
                             "logprob_token_ids": reply["logprob_token_ids"]}
                data = json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address):
                pass  # the "slow" reply goes to a client that gave up: a broken pipe, expected

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def tiny_teacher():
    return load_causal_lm("posttrain/tiny-llama").eval()


@pytest.mark.parametrize("beta, top_k, response_format", [(0.5, 1, "binary"), (1.0, 1, "json"), (0.0, 3, "binary")])
def test_server_teacher_gives_the_local_teachers_loss(tmp_path, tiny_teacher, beta, top_k, response_format):
    fields = {**online_args(tmp_path), "lmbda": 0.0, "beta": beta, "loss_top_k": top_k, "temperature": 0.8,
              "gradient_accumulation_steps": 1}
    local = DistillationTrainer("posttrain/tiny-qwen2", teacher_model=tiny_teacher,
                                args=DistillationConfig(**fields), train_dataset=uneven())
    (mb,) = local.make_experience(next(iter(local.get_train_dataloader())))
    with Served(tiny_teacher) as served:
        remote = DistillationTrainer("posttrain/tiny-qwen2", args=DistillationConfig(
            **fields, use_teacher_server=True, teacher_model_server_url=served.url + "/"), train_dataset=uneven())
        assert remote.teacher_model is None
        remote.teacher_server.response_format = response_format
        with torch.no_grad():
            got, want = remote.compute_loss(remote.model, mb), local.compute_loss(local.model, mb)
        assert served.calls == 1
    assert float(got) == pytest.approx(float(want), rel=1e-5) and float(want) > 0


def test_server_teacher_trains_every_parameter_on_policy(tmp_path, tiny_teacher):
    with Served(tiny_teacher, mode="500-once") as served:  # a restarting server: the first request is retried
        args = DistillationConfig(**{**online_args(tmp_path), "learning_rate": 1e-2, "lmbda": 1.0, "beta": 0.5,
                                     "use_teacher_server": True, "teacher_model_server_url": served.url,
                                     "max_steps": 2})
        trainer = DistillationTrainer("posttrain/tiny-qwen2", args=args, train_dataset=reverse(16))
        trainer.teacher_server.backoff = 0.01
        last = changed_everything(trainer)
        assert served.calls >= 3 and last["divergence"] > 0


@pytest.mark.parametrize("mode, message", [
    ("down", "did not answer .* is it running"), ("redirect", "HTTP 302 to 'http://example.com/' .redirects are not"),
    ("slow", "did not answer"), ("short", "has 3 completion tokens but 2 positions"), ("500", "answered HTTP 503")])
def test_server_errors_are_clear(tiny_teacher, mode, message):
    if mode == "down":  # a port nothing listens on any more
        with Served(tiny_teacher) as served:
            url = served.url
    with contextlib.ExitStack() as stack:
        if mode != "down":
            url = stack.enter_context(Served(tiny_teacher, mode)).url
        client = TeacherServer(url, timeout=0.5, retries=1, backoff=0.01)
        started = time.time()
        with pytest.raises(TeacherServerError, match=message):
            client.sequence_logprobs([[5, 6, 7, 8, 9]], [2], 1, 1.0)
        assert time.time() - started < 3.0  # the deadline holds: two tries of at most 0.5 s


@pytest.mark.parametrize("fields, message", [
    ({"use_teacher_server": True}, "needs teacher_model_server_url"),
    ({"use_teacher_server": True, "teacher_model_server_url": "http://x", "loss_top_k": 5}, "needs loss_top_k=1"),
    ({"use_teacher_server": True, "teacher_model_server_url": "http://x", "beta": 0.0, "loss_top_k": 0},
     "beta=0 needs loss_top_k > 0"),
    ({"use_teacher_server": True, "teacher_model_server_url": "http://x", "reverse_kl_top_1_mode": "argmax"},
     "reverse_kl_top_1_mode='sampled'"),
])
def test_server_config_refuses(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        DistillationConfig(output_dir=str(tmp_path), **fields)


# ---------------------------------------------------------------- IW-OPD
def iwopd(**fields):
    args = IWOPDConfig(**{**online_args(fields.get("output_dir", "unused")), "learning_rate": 1e-2, **fields})
    return IWOPDTrainer("posttrain/tiny-qwen2", teacher_model="posttrain/tiny-llama", args=args,
                        train_dataset=reverse(16))


def test_iwopd_trains_every_parameter(tmp_path):
    trainer = iwopd(output_dir=str(tmp_path), max_steps=3)
    last = changed_everything(trainer)
    assert {"iw_opd/mean_weight", "iw_opd/min_weight", "iw_opd/max_weight", "iw_opd/mean_advantage"} <= set(last)
    assert 1.0 <= last["iw_opd/min_weight"] <= last["iw_opd/max_weight"] <= 1.5  # gamma = 0.5


def test_iwopd_loss_is_the_weighted_sampled_token_gradient(tmp_path):
    trainer = iwopd(output_dir=str(tmp_path), gradient_accumulation_steps=1)
    (mb,) = trainer.make_experience(next(iter(trainer.get_train_dataloader())))
    loss = trainer.compute_loss(trainer.model, mb)
    # by hand, one row at a time: -sum_t w_t a_t log q(y_t) / tokens, a_t = log p_T - log q, w from |a| before t
    total, tokens = 0.0, 0
    with torch.no_grad():
        for i in range(len(mb["completion_ids"])):
            p = mb["prompt_ids"][i][mb["prompt_mask"][i].bool()]
            c = mb["completion_ids"][i][mb["completion_mask"][i].bool()]
            ids = torch.cat([p, c])[None]

            def sampled(model):
                return model(ids).logits[0, len(p) - 1:-1].double().log_softmax(-1).gather(-1, c[:, None])[:, 0]

            s, t = sampled(trainer.model), sampled(trainer.teacher_model)
            a = t - s
            before = a.abs().cumsum(0) - a.abs()
            w = 1 + 0.5 * (1 - before / a.abs().sum())
            total += float(-(w * a * s).sum())
            tokens += len(c)
    assert float(loss.detach()) == pytest.approx(total / tokens, rel=1e-4)
    loss.backward()  # and its gradient is the policy gradient with advantage w a (a detached)
    assert all(p.grad is not None for p in trainer.model.parameters() if p.requires_grad)


def test_iwopd_jsd_objective_is_the_distillation_loss(tmp_path):
    trainer = iwopd(output_dir=str(tmp_path), distillation_objective="jsd", gradient_accumulation_steps=1)
    (mb,) = trainer.make_experience(next(iter(trainer.get_train_dataloader())))
    with torch.no_grad():
        assert float(trainer.compute_loss(trainer.model, mb)) == float(DistillationTrainer.compute_loss(
            trainer, trainer.model, mb))


def test_iwopd_resumes_identically(tmp_path):
    assert_resumes_identically(lambda **f: iwopd(**f), tmp_path, max_steps=3, stop_at=2)


@pytest.mark.parametrize("fields, message", [
    ({"lmbda": 0.5}, "on-policy: set lmbda=1.0"), ({"distillation_objective": "kl"}, "distillation_objective='kl'"),
    ({"iw_opd_gamma": -1.0}, "iw_opd_gamma must be >= 0"), ({"reverse_kl_top_1_mode": "argmax"}, "sampled tokens"),
])
def test_iwopd_config_refuses(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        IWOPDConfig(output_dir=str(tmp_path), **fields)


# ---------------------------------------------------------------- GOLD
def byte_level_teacher(folder):
    """A tiny Llama whose tokenizer is byte-level with no merges (one token per byte): a vocabulary and token
    boundaries unlike the student's BPE. Returns (model, tokenizer folder)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer, core.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=specials[0], eos_token=specials[2],
                                  additional_special_tokens=[specials[1]])
    tok.save_pretrained(folder)
    torch.manual_seed(7)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                         pad_token_id=0, eos_token_id=2, bos_token_id=None, tie_word_embeddings=True))
    return model, str(folder)


def gold(tmp_path, teacher=None, **fields):
    """GOLD with ULD from tiny-qwen2 (BPE) to a byte-level teacher."""
    teacher = teacher or byte_level_teacher(tmp_path / "teacher-tokenizer")
    args = GOLDConfig(**{**online_args(tmp_path), "learning_rate": 1e-2, "use_uld_loss": True,
                         "teacher_tokenizer_name_or_path": teacher[1], **fields})
    return GOLDTrainer("posttrain/tiny-qwen2", teacher_model=teacher[0], args=args, train_dataset=reverse(16))


@pytest.mark.parametrize("hybrid", [False, True])
def test_gold_cross_tokenizer_trains_every_parameter(tmp_path, hybrid):
    trainer = gold(tmp_path, uld_use_hybrid_loss=hybrid, uld_crossentropy_weight=0.1, lmbda=0.5, max_steps=3)
    assert len(trainer.teacher_tokenizer) != len(trainer.processing_class)
    last = changed_everything(trainer)
    assert last["divergence"] > 0 and last["uld/crossentropy"] > 0
    if hybrid:
        s_ids, t_ids = trainer._matched
        assert len(s_ids) == len(t_ids) > 200  # the byte alphabet is in both vocabularies


def test_gold_alignment_covers_every_completion_token(tmp_path):
    trainer = gold(tmp_path, lmbda=0.0, gradient_accumulation_steps=1)
    (mb,) = trainer.make_experience(next(iter(trainer.get_train_dataloader())))
    t_mb, aligned = trainer.teacher_batch(mb)
    s_tok, t_tok = trainer.processing_class, trainer.teacher_tokenizer
    for i, groups in enumerate(aligned):
        body = mb["completion_ids"][i][mb["completion_mask"][i].bool()].tolist()[:-1]  # the EOS is skipped
        t_body = t_mb["completion_ids"][i][t_mb["completion_mask"][i].bool()].tolist()[:-1]
        assert sorted(p for g in groups["student"] for p in g) == list(range(len(body)))
        assert sorted(p for g in groups["teacher"] for p in g) == list(range(len(t_body)))
        for s, t in zip(groups["student"], groups["teacher"]):  # each group spells the same text on both sides
            assert s_tok.decode([body[p] for p in s]) == t_tok.decode([t_body[p] for p in t])
        assert len(t_body) >= len(body)  # one token per byte


def test_gold_uld_is_zero_against_the_student_itself(tmp_path):
    # no teacher: the frozen copy of the student, with the student's tokenizer; GKD without use_uld_loss
    args = GOLDConfig(**{**online_args(tmp_path), "use_uld_loss": True, "lmbda": 1.0})
    trainer = GOLDTrainer("posttrain/tiny-qwen2", args=args, train_dataset=reverse(16))
    assert trainer.teacher_tokenizer is trainer.processing_class
    (mb,) = trainer.make_experience(next(iter(trainer.get_train_dataloader())))[:1]
    with torch.no_grad():
        assert float(trainer.compute_loss(trainer.model, mb)) == pytest.approx(0.0, abs=1e-6)
    assert GOLDConfig(output_dir=str(tmp_path)).top_p == 0.95 and GOLDConfig(output_dir=str(tmp_path)).lmbda == 0.5


def test_gold_resumes_identically(tmp_path):
    teacher = byte_level_teacher(tmp_path / "teacher-tokenizer")
    assert_resumes_identically(lambda **f: gold(tmp_path, teacher, lmbda=0.5, **f), tmp_path, max_steps=3, stop_at=2)


@pytest.mark.parametrize("fields, message", [
    ({"use_uld_loss": True, "seq_kd": True}, "seq_kd=True with use_uld_loss"),
    ({"use_uld_loss": True, "uld_use_hybrid_loss": True, "uld_hybrid_matched_weight": 0.5}, "set both"),
    ({"use_uld_loss": True, "uld_student_temperature": 0.0}, "must be > 0"),
    ({"use_transformers_paged": True}, "use_transformers_paged"),
])
def test_gold_config_refuses(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        GOLDConfig(output_dir=str(tmp_path), **fields)


# ---------------------------------------------------------------- SDFT
def with_context(n: int = 16, context="The answer is {}."):
    from datasets import Dataset

    return Dataset.from_list([{"prompt": r["prompt"], "privileged_context": context.format(r["answer"])}
                              for r in reverse(n)])


def sdft(dataset=None, **fields):
    from posttrain.trainers.sdft import SDFTConfig, SDFTTrainer

    args = SDFTConfig(**{**online_args(fields.get("output_dir", "unused")), "learning_rate": 1e-2,
                         "num_generations": 2, **fields})
    return SDFTTrainer("posttrain/tiny-qwen2", args=args, train_dataset=with_context() if dataset is None else dataset)


@pytest.mark.parametrize("mode", ["full_logits", "topk_logits", "sampled_token"])
def test_sdft_trains_every_parameter(tmp_path, mode):
    fields = {"distillation_alpha": 1.0} if mode == "sampled_token" else {}
    trainer = sdft(output_dir=str(tmp_path), distillation_mode=mode, distillation_topk=5, max_steps=2, **fields)
    last = changed_everything(trainer)
    assert last["divergence"] > 0


def test_sdft_teacher_reads_the_privileged_context(tmp_path):
    trainer = sdft(output_dir=str(tmp_path))
    mb = trainer.make_experience(next(iter(trainer.get_train_dataloader())))[0]
    tok = trainer.processing_class
    for student, teacher in zip(mb["prompt_ids"], mb["teacher_prompt_ids"]):
        s, t = tok.decode(student, skip_special_tokens=True), tok.decode(teacher, skip_special_tokens=True)
        assert t.startswith(s + "\n\nThe answer is ") and t.endswith(".")
    # without context (an empty one, a template that adds nothing) the base teacher is the student: no loss
    same = sdft(with_context(context=""), output_dir=str(tmp_path / "same"), teacher_prompt_template="{prompt}"
                "{privileged_context}", distillation_mode="full_logits")
    mb = same.make_experience(next(iter(same.get_train_dataloader())))[0]
    with torch.no_grad():
        assert float(same.compute_loss(same.model, mb)) == pytest.approx(0.0, abs=1e-6)


def test_sdft_ema_teacher_follows_the_student_and_resumes_identically(tmp_path):
    trainer = sdft(output_dir=str(tmp_path / "hard"), teacher_model_kind="ema", teacher_update_rate=1.0,
                   teacher_sync_steps=1, max_steps=1)
    trainer.train()  # rate 1 after every step: the teacher is the student
    student = dict(trainer.model.named_parameters())
    assert all(torch.equal(p, student[n]) for n, p in trainer.teacher_model.named_parameters())
    assert_resumes_identically(lambda **f: sdft(teacher_model_kind="ema", teacher_update_rate=0.5,
                                                teacher_sync_steps=1, **f), tmp_path, max_steps=3, stop_at=2)


@pytest.mark.parametrize("fields, message", [
    ({"teacher_model_kind": "old"}, "teacher_model_kind='old'"), ({"distillation_mode": "logits"}, "distillation_mode"),
    ({"teacher_prompt_template": "{prompt}"}, "must contain both"), ({"lmbda": 0.5}, "lmbda=1.0"),
    ({"beta": 0.1}, "no reference model"), ({"num_loss_tokens_to_skip": -1}, "num_loss_tokens_to_skip=-1"),
])
def test_sdft_config_refuses(tmp_path, fields, message):
    from posttrain.trainers.sdft import SDFTConfig

    with pytest.raises(ValueError, match=message):
        SDFTConfig(output_dir=str(tmp_path), **fields)


def test_sdft_needs_the_privileged_context_column(tmp_path):
    trainer = sdft(reverse(16).remove_columns(["completion"]), output_dir=str(tmp_path))
    with pytest.raises(ValueError, match="'privileged_context' column"):
        trainer.train()


@pytest.mark.parametrize("command, trainer, extra", [
    ("iw_opd", "IWOPDTrainer", ["--max_completion_length", "4"]),
    ("gold", "GOLDTrainer", ["--max_completion_length", "4", "--use_uld_loss", "true", "--uld_use_hybrid_loss",
                             "true", "--lmbda", "1.0"]),
])
def test_cli_commands_train(tmp_path, command, trainer, extra):
    from posttrain import cli

    run = cli.run([command, "--model_name_or_path", "posttrain/tiny-qwen2", "--teacher_model_name_or_path",
                   "posttrain/tiny-llama", "--dataset_name", "reverse", "--output_dir", str(tmp_path / command),
                   "--max_steps", "1", "--per_device_train_batch_size", "4", "--disable_tqdm", "true", *extra])
    assert run.state.global_step == 1 and type(run).__name__ == trainer and run.teacher_model is not None


def test_evaluate(tmp_path):
    """evaluate() of each new trainer: the student's samples of the eval prompts, the divergence to the teacher."""
    trainers = [iwopd(output_dir=str(tmp_path / "iwopd")), gold(tmp_path, output_dir=str(tmp_path / "gold")),
                sdft(output_dir=str(tmp_path / "sdft"))]
    for trainer, data in zip(trainers, (reverse(4), reverse(4), with_context(4))):
        metrics = trainer.evaluate(data)
        assert math.isfinite(metrics["eval_loss"]) and metrics["eval_loss"] > 0, type(trainer).__name__
        assert metrics["eval_completions/mean_length"] > 0


def test_sdft_lora_student_with_the_adapter_disabled_model_as_teacher(tmp_path):
    from peft import LoraConfig

    from posttrain.trainers.sdft import SDFTConfig, SDFTTrainer

    args = SDFTConfig(**{**online_args(tmp_path), "learning_rate": 1e-2, "num_generations": 2, "max_steps": 2})
    trainer = SDFTTrainer("posttrain/tiny-qwen2", args=args, train_dataset=with_context(),
                          peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert trainer.teacher_model is None  # the base weights, adapter off: no second copy
    changed_everything(trainer)


# ---------------------------------------------------------------- FSDP2
@pytest.mark.slow
def test_fsdp2_student_and_teacher_match_one_process(tmp_path):
    """Student sharded by FSDP2 over 2 CPU processes, teacher sharded by the trainer as a reference model: the
    first step's loss and every weight's move equal one plain process's on the same 8 rows (up to the other
    summation order of the reduce-scattered gradients)."""
    import os
    import sys

    from tests.helpers.launch import free_port, run_launch

    script = os.path.join(os.path.dirname(__file__), "fsdp_distillation.py")
    one, two = str(tmp_path / "one.json"), str(tmp_path / "two.json")
    run_launch([sys.executable, script, one, "8"], tmp_path, timeout=240, path=os.path.dirname(__file__))
    run_launch([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                "--master_port", str(free_port()), script, two, "4"], tmp_path, timeout=240,
               path=os.path.dirname(__file__))
    a, b = (json.load(open(p)) for p in (one, two))
    assert (a["processes"], b["processes"]) == (1, 2)
    assert all(json.load(open(f"{two}.{rank}"))["sharded"] for rank in (0, 1))  # student and teacher
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
    assert all(norm > 0 for norm, _ in a["moves"].values())  # every weight moved
    for name, (norm, projection) in a["moves"].items():
        assert b["moves"][name][0] == pytest.approx(norm, rel=1e-4, abs=1e-7), name
        assert b["moves"][name][1] == pytest.approx(projection, rel=1e-4, abs=1e-7), name
