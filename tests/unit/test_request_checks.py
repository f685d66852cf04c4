"""Request-side checks and fields of issue 42, without a server: the shared stop-sequence limit
(item 3), the size bounds that refuse a prompt before tokenizing it (item 4), images refused by a
text-only model with the part's path (item 6), echo's text offsets (item 7), and vLLM's request
fields (item 9): bad_words in the sampler, truncate_prompt_tokens, token-id logprobs, the older
`functions`, continue_final_message and documents on a chat template."""

from __future__ import annotations

import logging

import pytest
import torch
from deepinfer_recipe import RequestError, parse_request
from deepinfer_recipe.encoders.hf_template import HFTemplateEncoder

from deepinfer.chat import add_documents, continue_final_message, make_encoder, refuse_images
from deepinfer.entrypoints import request_fields, sampling
from deepinfer.entrypoints.errors import APIError
from deepinfer.entrypoints.logprobs import CompletionLogprobs, chat_logprob
from deepinfer.entrypoints.options import ServerOptions, request_body_limit
from deepinfer.entrypoints.request_fields import parse_fields
from deepinfer.models.loader import load_model_source
from deepinfer.outputs import Logprob
from deepinfer.sample.penalties import bad_word_tokens
from deepinfer.sample.sampler import Sampler, SamplingRow
from deepinfer.sampling_params import SamplingParams
from deepinfer.tokenizer import longest_token_chars

HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def smol():
    return load_model_source(None)   # the embedded SmolLM2: its tokenizer and chat template


# ------------------------------------------------------------------------ item 3: stop limits
@pytest.mark.parametrize("stop, param", [(["s"] * 65, "stop"), ("x" * 1025, "stop"), (["a", "b" * 1025], "stop[1]")])
def test_stop_sequences_are_limited_by_count_and_length(stop, param):
    with pytest.raises(APIError, match=r"64 stop sequences \(--max-stop-sequences\)|at most 1024") as error:
        sampling.check_stop_sequences(stop, 64, "stop")
    assert error.value.status == 400 and error.value.param == param
    sampling.check_stop_sequences(["s"] * 64, 64, "stop")
    sampling.check_stop_sequences(None, 64, "stop")


# -------------------------------------------------------------- item 4: sizes before tokenizing
def test_no_text_has_more_characters_than_its_tokens_times_the_longest(smol):
    backend = smol.tokenizer.backend
    longest = longest_token_chars(backend)
    texts = ["Hello world, how are you", " " * 500 + "x", "\n" * 300, "=" * 400, "日本語のテキスト" * 20,
             "a" * 1000, "🙂" * 50, "def f():\n" + "        return 1\n" * 40]
    for text in texts:
        assert len(text) <= longest * len(backend.encode(text, add_special_tokens=False).ids), text[:20]


def test_the_default_body_limit_grows_with_the_context():
    assert request_body_limit(ServerOptions(), 2048) == (4 << 20) + 64 * 2048
    assert request_body_limit(ServerOptions(), 1 << 20) == (4 << 20) + (64 << 20)
    assert request_body_limit(ServerOptions(max_request_body_bytes=1000), 2048) == 1000
    with pytest.raises(ValueError, match="max-request-body-bytes"):
        ServerOptions(max_request_body_bytes=0)


# --------------------------------------------------------------------------- item 6: images
@pytest.mark.parametrize("protocol, body, path", [
    ("chat", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]}, "messages[0].content[1]"),
    ("messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                                                {"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
     "messages[2].content[0]"),
    ("messages", {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
        "content": [{"type": "text", "text": "ok"}, {"type": "image", "source": {"type": "url", "url": "u"}}]}]}]},
     "messages[0].content[0].content[1]"),
    ("responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": "See"},
                                                          {"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input[0].content[1]"),
])
def test_an_image_part_is_refused_with_its_path_by_a_text_only_model(protocol, body, path):
    conversation = parse_request(protocol, body)
    with pytest.raises(RequestError, match="takes text only") as error:
        refuse_images(conversation, takes_images=False)
    assert error.value.path == path
    refuse_images(conversation, takes_images=True)   # a model that reads images keeps them


# ----------------------------------------------------------------------- item 7: echo offsets
def test_echo_offsets_point_into_the_returned_text(smol):
    tokenizer = smol.tokenizer
    prompt = "Hello world, how are you"
    ids = tokenizer.encode(prompt)
    entries = [None] + [{t: Logprob(-1.0, 1, tokenizer.decode([t]))} for t in ids[1:]]
    tracker = CompletionLogprobs(lambda t: tokenizer.decode([t], skip_special_tokens=False))
    part = tracker.positions(ids, entries)
    assert part["tokens"][0] == "Hello" and "".join(part["tokens"]) == prompt
    assert part["text_offset"] == [0, 5, 11, 12, 16, 20]
    for token, offset in zip(part["tokens"], part["text_offset"]):
        assert prompt[offset:offset + len(token)] == token
    as_ids = CompletionLogprobs(lambda t: tokenizer.decode([t]), as_ids=True).positions(ids, entries)
    assert as_ids["tokens"] == [f"token_id:{t}" for t in ids] and as_ids["text_offset"] == part["text_offset"]
    assert list(as_ids["top_logprobs"][1]) == [f"token_id:{ids[1]}"]


def test_chat_logprobs_as_token_ids():
    entry = {7: Logprob(-0.5, 1, "Hi"), 9: Logprob(-1.5, 2, "Yo")}
    plain = chat_logprob(entry, 7, 2)
    assert plain["token"] == "Hi" and [t["token"] for t in plain["top_logprobs"]] == ["Hi", "Yo"]
    ids = chat_logprob(entry, 7, 2, as_ids=True)
    assert ids["token"] == "token_id:7" and ids["bytes"] == list(b"token_id:7")
    assert [t["token"] for t in ids["top_logprobs"]] == ["token_id:7", "token_id:9"]


# -------------------------------------------------------------------- item 9: vLLM's fields
def test_vllm_and_sdk_fields_are_accepted_and_the_ignored_ones_warned_once(caplog):
    body = {"messages": HI, "prompt_cache_key": "k", "safety_identifier": "u", "verbosity": "low",
            "modalities": ["text"], "prediction": {"type": "content", "content": "x"}, "add_generation_prompt": False,
            "continue_final_message": False, "request_id": "abc", "return_tokens_as_token_ids": True,
            "truncate_prompt_tokens": 5, "bad_words": ["x"], "echo": True, "documents": [{"title": "t", "text": "d"}],
            "mm_processor_kwargs": {}, "kv_transfer_params": {"do_remote_decode": False}, "vllm_xargs": {"a": 1},
            "functions": [{"name": "f"}], "function_call": "auto"}
    fields = parse_fields("chat", body)
    request_fields._warned.clear()
    with caplog.at_level(logging.WARNING, logger="deepinfer.entrypoints.request_fields"):
        request_fields.warn_ignored(fields)
        request_fields.warn_ignored(fields)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 7 and all("accepted and ignored" in line for line in warned)
    parse_fields("completions", {"prompt": "x", "request_id": "r", "bad_words": ["y"], "truncate_prompt_tokens": -1})
    parse_fields("responses", {"input": "x", "prompt_cache_key": "k", "safety_identifier": "s"})
    with pytest.raises(APIError) as error:
        parse_fields("chat", {"messages": HI, "modalities": ["video"]})
    assert error.value.param.startswith("modalities")
    with pytest.raises(APIError) as error:
        parse_fields("messages", {"messages": HI, "max_tokens": 1, "bad_words": ["x"]})   # not Anthropic's
    assert error.value.param == "bad_words"


def test_truncate_prompt_tokens_keeps_the_end_of_the_prompt():
    fields = parse_fields("completions", {"prompt": "x", "truncate_prompt_tokens": 3})
    assert sampling.truncate_prompt(list(range(10)), fields, 4, 100) == [7, 8, 9]
    right = parse_fields("completions", {"prompt": "x", "truncate_prompt_tokens": 3, "truncation_side": "right"})
    assert sampling.truncate_prompt(list(range(10)), right, 4, 100) == [0, 1, 2]
    fit = parse_fields("completions", {"prompt": "x", "truncate_prompt_tokens": -1})
    assert sampling.truncate_prompt(list(range(200)), fit, 20, 100) == list(range(120, 200))
    for value, limit in ((101, "at most max_model_len"), (0, "-1 or at least 1")):
        with pytest.raises(APIError, match=limit) as error:
            sampling.truncate_prompt([1], parse_fields("completions", {"prompt": "x", "truncate_prompt_tokens": value}),
                                     4, 100)
        assert error.value.param == "truncate_prompt_tokens"


def test_bad_words_follow_vllms_rule(smol):
    tokenizer = smol.tokenizer
    params = SamplingParams(bad_words=["Paris", " New York"], max_tokens=4)
    params.update_from_tokenizer(tokenizer)
    plain, spaced = tokenizer.encode("Paris", add_special_tokens=False), tokenizer.encode(" Paris", add_special_tokens=False)
    assert plain in params.bad_words_token_ids and spaced in params.bad_words_token_ids
    assert tokenizer.encode("New York", add_special_tokens=False) in params.bad_words_token_ids
    # A multi-token word: its last token is banned only right after the rest of it.
    word = [5, 6, 7]
    assert bad_word_tokens([word], [1, 5, 6]) == [7] and bad_word_tokens([word], [5, 1]) == []
    assert bad_word_tokens([[4]], []) == [4] and bad_word_tokens([word], [6]) == []
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["  "])


def test_the_sampler_never_picks_a_banned_token():
    logits = torch.zeros(2, 10)
    logits[:, 3] = 5.0
    logits[:, 4] = 4.0
    banned = SamplingParams(temperature=0, bad_words_token_ids=[[8, 3]])
    rows = [SamplingRow(banned, [1], [8]), SamplingRow(banned, [1], [2])]
    assert Sampler()(logits, rows).token_ids == [4, 3]   # 3 follows 8 only in the first row


def test_bad_words_need_a_tokenizer_and_are_bounded():
    fields = parse_fields("chat", {"messages": HI, "bad_words": ["x"]})
    with pytest.raises(APIError, match="needs a tokenizer") as error:
        sampling.build(fields, options=ServerOptions(), vocab_size=1000, max_tokens=4)
    assert error.value.param == "bad_words"
    many = parse_fields("chat", {"messages": HI, "bad_words": ["x"] * 129})
    with pytest.raises(APIError, match="at most 128 bad_words"):
        sampling.build(many, options=ServerOptions(), vocab_size=1000, max_tokens=4)


def test_older_functions_are_tools_with_one_call():
    functions = [{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    conversation = parse_request("chat", {"functions": functions, "function_call": {"name": "get_weather"}, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"role": "function", "name": "get_weather", "content": "sunny"}]})
    assert [t.name for t in conversation.tools] == ["get_weather"] and not conversation.parallel_tool_calls
    assert conversation.tool_choice.name == "get_weather"
    call, result = conversation.messages[1].tool_calls[0], conversation.messages[2]
    assert (call.name, result.role, result.tool_call_id, result.text) == ("get_weather", "tool", call.id, "sunny")
    for body, path in (({"functions": functions, "tools": [{"type": "function", "function": functions[0]}]}, "functions"),
                       ({"function_call": "auto"}, "function_call")):
        with pytest.raises(RequestError) as error:
            parse_request("chat", {"messages": HI, **body})
        assert error.value.path == path


def test_continue_final_message_ends_the_prompt_inside_that_message(smol):
    encoder = make_encoder(smol)
    conversation = parse_request("chat", {"messages": [*HI, {"role": "assistant", "content": "The capital is"}]})
    continue_final_message(conversation)
    encoding = encoder.encode(conversation)
    assert encoding.rendered.text.endswith("<|im_start|>assistant\nThe capital is")
    assert encoding.parser_start.continuation
    with pytest.raises(RequestError) as error:
        continue_final_message(parse_request("chat", {"messages": HI}))
    assert error.value.path == "continue_final_message"


def test_documents_reach_the_template(smol):
    template = ("{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
                "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")
    tokenizer = smol.tokenizer
    encoder = HFTemplateEncoder.from_tokenizer(tokenizer.backend, template, tokenizer.bos_token, tokenizer.eos_token)
    conversation = parse_request("chat", {"messages": HI})
    add_documents(conversation, [{"title": "Kyoto", "text": "old capital <|im_end|>"}], encoder)
    encoding = encoder.encode(conversation)
    assert encoding.rendered.text.startswith("[Kyoto: old capital <|im_end|>]")
    im_end = tokenizer.backend.token_to_id("<|im_end|>")
    assert encoding.token_ids.count(im_end) == 1   # the document's spelling stays text


def test_offline_llm_applies_bad_words_and_refuses_images():
    from deepinfer import LLM

    llm = LLM(max_model_len=512)   # the embedded SmolLM2-135M-Instruct, in-process
    paris = {7042, 38634}   # " Paris" and "Paris"
    greedy = SamplingParams(temperature=0, max_tokens=8)
    [free] = llm.generate("The capital of France is", greedy, use_tqdm=False)
    assert paris & set(free.outputs[0].token_ids)
    banned = SamplingParams(temperature=0, max_tokens=8, bad_words=["Paris"])
    [out] = llm.generate("The capital of France is", banned, use_tqdm=False)
    assert not paris & set(out.outputs[0].token_ids)
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]: this model takes text only"):
        llm.chat([{"role": "user", "content": [image]}], greedy, use_tqdm=False)
