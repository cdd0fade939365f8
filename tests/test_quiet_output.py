"""A CPU run says what matters and no more: no pin_memory warning without an accelerator, no escape codes
in transformers' load report when stderr is not a terminal, no completion tables with
num_completions_to_print=0, none of the optional packages' known CPU noise (issue #34)."""

import logging
import warnings

from posttrain import cli
from posttrain.callbacks import CompletionsTable
from posttrain.models import loading


def test_no_pin_memory_without_an_accelerator(tmp_path):
    import torch

    from posttrain import SFTConfig, SFTTrainer

    if loading.torch.cuda.is_available() or (hasattr(torch, "accelerator") and torch.accelerator.is_available()):
        args = SFTConfig(output_dir=str(tmp_path), max_steps=1, report_to="none", use_cpu=True)
    else:
        args = SFTConfig(output_dir=str(tmp_path), max_steps=1, report_to="none")
    assert args.dataloader_pin_memory  # transformers' default
    trainer = SFTTrainer("posttrain/tiny-qwen2", args=args, train_dataset=[{"prompt": "a", "completion": " b"}] * 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert not trainer.args.dataloader_pin_memory
    assert not [w for w in caught if "pin_memory" in str(w.message)]


def test_load_report_has_no_escape_codes_when_redirected(capsys):
    record = logging.LogRecord("transformers.modeling_utils", logging.WARNING, __file__, 1,
                               "\x1b[1mQwen2ForSequenceClassification LOAD REPORT\x1b[0m from: x", None, None)
    assert loading._PlainWhenRedirected().filter(record)  # pytest's stderr is not a terminal
    assert record.msg == "Qwen2ForSequenceClassification LOAD REPORT from: x"
    assert any(isinstance(f, loading._PlainWhenRedirected)
               for f in logging.getLogger("transformers.modeling_utils").filters)


def test_zero_completions_to_print_writes_the_file_only(tmp_path, capsys):
    table = CompletionsTable(str(tmp_path), num_to_print=0)
    table.write(1, ["2+2="], ["4"], {"accuracy": [1.0]})
    assert capsys.readouterr().out == ""
    assert (tmp_path / "completions.jsonl").read_text().count("\n") == 1
    CompletionsTable(str(tmp_path), num_to_print=1).write(2, ["2+2="], ["4"], {"accuracy": [1.0]})
    assert "completions at step 2" in capsys.readouterr().out


def test_known_noise_is_dropped_and_the_rest_kept(caplog):
    cli.quiet_known_noise()
    cli.quiet_known_noise()  # once per logger, however often main runs
    for name, start in cli.KNOWN_NOISE:
        logger = logging.getLogger(name)
        assert sum(isinstance(f, cli._DropMessage) for f in logger.filters) == 1
        with caplog.at_level(logging.INFO, logger=name):
            logger.warning(start + " and more")
            logger.warning("something else")
        assert [r.getMessage() for r in caplog.records if r.name == name] == ["something else"]
        caplog.clear()
