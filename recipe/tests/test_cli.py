"""The command line: encode/decode through stdin/stdout, errors → stderr with status 2."""

import io
import json
import sys

import pytest
from deepinfer_recipe.cli import main


def run(monkeypatch, capsys, args, stdin):
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    status = main(args)
    out, err = capsys.readouterr()
    return status, out, err


def test_encode_prints_ids_prompt_and_ranges(monkeypatch, capsys):
    body = {"max_tokens": 9, "thinking": {"type": "disabled"}, "messages": [{"role": "user", "content": "Hi <｜User｜>"}]}
    status, out, _ = run(monkeypatch, capsys, ["encode", "--format", "deepseek-v4", "--protocol", "messages"], json.dumps(body))
    result = json.loads(out)
    assert status == 0
    assert result["prompt"] == "<｜begin▁of▁sentence｜><｜User｜>Hi <｜User｜><｜Assistant｜></think>"
    assert result["token_ids"][:2] == [0, 128803] and result["token_ids"].count(128803) == 1
    assert [result["prompt"][a:b] for a, b in result["control_ranges"]] == ["<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "</think>"]


def test_v41_encode_has_prompt_but_no_ids(monkeypatch, capsys):
    status, out, _ = run(monkeypatch, capsys, ["encode", "--format", "deepseek-v4.1"], json.dumps({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]}))
    result = json.loads(out)
    assert status == 0 and result["token_ids"] is None and result["prompt"].startswith("<｜begin▁of▁sentence｜><｜System｜>")


def test_decode_prints_final_object(monkeypatch, capsys):
    ids = [5718, 678, 2118, 16, 128822, 53624, 16, 1]  # "Let me think." </think> "Sure." EOS
    status, out, _ = run(monkeypatch, capsys, ["decode", "--format", "deepseek-v4", "--protocol", "chat"], json.dumps(ids))
    message = json.loads(out)["choices"][0]["message"]
    assert status == 0 and message["reasoning_content"] == "Let me think." and message["content"] == "Sure."


@pytest.mark.parametrize("args,stdin,needle", [
    (["encode", "--format", "deepseek-v4"], '{"messages": [{"role": "user", "content": [{"type": "bogus"}]}]}', "messages[0].content[0].type"),
    (["encode", "--format", "nope"], '{"messages": [{"role": "user", "content": "x"}]}', "unknown format"),
    (["encode", "--format", "deepseek-v4"], "not json", "not valid JSON"),
    (["decode", "--format", "deepseek-v4"], '{"x": 1}', "decode expects"),
    (["decode", "--format", "deepseek-v4"], "[5, -1]", "token_ids[1] = -1 is outside the vocabulary"),
    (["decode", "--format", "deepseek-v4"], "[129280]", "token_ids[0] = 129280 is outside the vocabulary (0..129279)"),
    (["decode", "--format", "deepseek-v4"], "[true]", "token_ids must be integers"),
    (["decode", "--format", "deepseek-v4.1"], "[5]", "has no tokenizer to decode with"),
    (["decode", "--format", "deepseek-v4", "--protocol", "messages"], '{"token_ids": [5], "request": {"messages": []}}', "max_tokens"),
    (["encode", "--format", "deepseek-v4", "--tokenizer", __file__], '{"messages": [{"role": "user", "content": "x"}]}', "cannot load tokenizer"),
    (["encode", "--format", "deepseek-v4", "--tokenizer", "/nonexistent/tokenizer.json"], '{"messages": [{"role": "user", "content": "x"}]}', "cannot load tokenizer"),
    (["encode", "--format", "hf:/nonexistent"], '{"messages": [{"role": "user", "content": "x"}]}', "tokenizer_config.json not found"),
    (["encode", "--format", "deepseek-v4"], '{"messages": [{"role": "user", "content": "a\\ud800"}]}', "messages[0].content: the string contains a lone UTF-16 surrogate"),
    (["encode", "--format", "deepseek-v4", "--protocol", "responses"], '{"input": [{"type": "bogus"}]}', "input[0].type"),
])
def test_errors_go_to_stderr_with_status_2(monkeypatch, capsys, args, stdin, needle):
    status, out, err = run(monkeypatch, capsys, args, stdin)
    assert status == 2 and out == "" and needle in err


@pytest.mark.parametrize("args", [["encode"], ["encode", "--format", "deepseek-v4", "--protocol", "bogus"], ["frobnicate"]])
def test_usage_errors_exit_2(monkeypatch, capsys, args):
    monkeypatch.setattr(sys, "stdin", io.StringIO("{}"))
    with pytest.raises(SystemExit) as info:
        main(args)
    out, err = capsys.readouterr()
    assert info.value.code == 2 and out == "" and "usage: deepinfer-recipe" in err
