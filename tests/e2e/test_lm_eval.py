"""lm-evaluation-harness, as users run it against a vLLM server, against ours.

`--model local-completions` scores a multiple-choice task through /v1/completions with `echo`,
`logprobs` and `max_tokens: 1`, tokenizing through the server (`tokenizer_backend=remote`:
/tokenizer_info and /tokenize); the loglikelihoods it reports must match transformers' on the
same float32 weights within 0.02. `--model local-chat-completions` runs a generation task
through /v1/chat/completions. The tasks are local files written here (no download).

Before the hardening commit /v1/completions refused `echo`, prompt logprobs were ignored and
/tokenizer_info did not exist, so neither run got past its first request.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

from deepinfer.models.bundled import default_model_path
from tests.e2e.server_process import API_KEY, start_server, stop_server

QUESTIONS = [
    {"question": "What is the capital of France?", "choices": ["Paris", "Berlin", "Madrid"], "answer": 0},
    {"question": "What is the capital of Japan?", "choices": ["Beijing", "Tokyo", "Seoul"], "answer": 1},
    {"question": "How many legs does a spider have?", "choices": ["six", "four", "eight"], "answer": 2},
    {"question": "Which planet is closest to the Sun?", "choices": ["Mercury", "Mars", "Venus"], "answer": 0},
]

MC_TASK = """task: deepinfer_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""

GEN_TASK = """task: deepinfer_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}} Answer in one word."
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
  do_sample: false
metric_list:
  - metric: exact_match
    ignore_case: true
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(str(tmp_path_factory.mktemp("server") / "server.log"), "--dtype", "float32")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tasks")
    data = directory / "questions.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (directory / "mc.yaml").write_text(MC_TASK.format(data=data))
    (directory / "gen.yaml").write_text(GEN_TASK.format(data=data))
    return directory


def run_lm_eval(tmp_path, tasks, *args: str) -> dict:
    out = tmp_path / "results"
    env = {**os.environ, "OPENAI_API_KEY": API_KEY, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "lm_eval", *args, "--include_path", str(tasks), "--output_path", str(out),
               "--log_samples"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    samples = {}
    for path in glob.glob(str(out / "**" / "samples_*.jsonl"), recursive=True):
        task = os.path.basename(path).split("_", 1)[1].rsplit("_", 1)[0]
        samples[task] = [json.loads(line) for line in open(path)]
    results = json.load(open(glob.glob(str(out / "**" / "results_*.json"), recursive=True)[0]))
    return {"samples": samples, "results": results["results"]}


def hf_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """What lm-eval's loglikelihood means, computed with transformers: the continuation's token
    logprobs given the context, tokenized as lm-eval's API models split the pair."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    context_ids = tokenizer.encode(context, add_special_tokens=False)
    with torch.no_grad():
        logprobs = model(torch.tensor([whole])).logits[0].float().log_softmax(-1)
    return sum(logprobs[i - 1, whole[i]].item() for i in range(len(context_ids), len(whole)))


def test_local_completions_multiple_choice_matches_transformers(server, tasks, tmp_path):
    import transformers

    run = run_lm_eval(tmp_path, tasks, "--model", "local-completions", "--tasks", "deepinfer_mc", "--model_args",
                      f"model=SmolLM2-135M-Instruct,base_url={server.base_url}/v1/completions,"
                      f"tokenizer_backend=remote,auth_token={API_KEY},num_concurrent=2,max_retries=1")
    assert "acc,none" in run["results"]["deepinfer_mc"]
    samples = run["samples"]["deepinfer_mc"]
    assert len(samples) == len(QUESTIONS)
    directory, name = os.path.split(default_model_path())
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    compared = 0
    for sample in samples:
        # lm-eval logs each request's arguments as {"gen_args_i": {"arg_0": context, "arg_1": continuation}}
        # and its result as [[loglikelihood, is_greedy]], both as text.
        for arguments, response in zip(sample["arguments"].values(), sample["resps"]):
            context, continuation = arguments["arg_0"], arguments["arg_1"]
            ours = float(response[0][0])
            reference = hf_loglikelihood(model, tokenizer, context, continuation)
            assert ours == pytest.approx(reference, abs=0.02), (context, continuation)
            compared += 1
    assert compared == sum(len(q["choices"]) for q in QUESTIONS)


def test_local_chat_completions_generation_runs(server, tasks, tmp_path):
    run = run_lm_eval(tmp_path, tasks, "--model", "local-chat-completions", "--tasks", "deepinfer_gen",
                      "--apply_chat_template", "--model_args",
                      f"model=SmolLM2-135M-Instruct,base_url={server.base_url}/v1/chat/completions,"
                      "num_concurrent=2,max_retries=1")
    samples = run["samples"]["deepinfer_gen"]
    assert len(samples) == len(QUESTIONS)
    answers = [s["filtered_resps"][0] for s in samples]
    assert all(isinstance(a, str) and a.strip() for a in answers), answers
    assert "exact_match,none" in run["results"]["deepinfer_gen"]
