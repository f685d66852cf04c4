"""run-batch's file side, without an engine: each input line read as a request or as the reason
it is none, OpenAI's output object for both, and the resume bookkeeping (a cut-off last line
removed, answered lines found by custom_id or, without one, by line number)."""

from __future__ import annotations

import json

from deepinfer.entrypoints.batch import parse_line, repair_and_read_done, result_line


def test_lines_that_are_no_request_say_why():
    cases = {"not json": "invalid_json", "[1, 2]": "invalid_request", '{"url": "/v1/completions"}': "missing_custom_id",
             '{"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}': "invalid_method",
             '{"custom_id": "a", "url": "/v1/score", "body": {}}': "invalid_url",
             '{"custom_id": "a", "url": "/v1/embeddings", "body": "hi"}': "invalid_body",
             '{"custom_id": "a", "url": "/v1/chat/completions", "body": {"stream": true}}': "invalid_body"}
    for text, code in cases.items():
        line = parse_line(7, text)
        assert line.problem is not None and line.problem[0] == code, text
        result = result_line(line)
        assert result["response"] is None and result["error"]["code"] == code and result["error"]["line"] == 7
    ok = parse_line(3, '{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}')
    assert ok.problem is None and ok.custom_id == "a"
    result = result_line(ok, 200, {"object": "list"})
    assert result["id"].startswith("batch_req_") and result["error"] is None
    assert result["response"]["status_code"] == 200 and result["response"]["body"] == {"object": "list"}


def test_resume_reads_answered_lines_and_cuts_a_partial_last_one(tmp_path):
    path = tmp_path / "out.jsonl"
    assert repair_and_read_done(str(path)) == (set(), set())
    answered = [result_line(parse_line(1, '{"custom_id": "a", "url": "/v1/completions", "body": {}}'), 200, {}),
                result_line(parse_line(2, "{oops"))]
    whole = "".join(json.dumps(r) + "\n" for r in answered)
    path.write_text(whole + '{"id": "batch_req_x", "custom_id": "b", "resp')
    assert repair_and_read_done(str(path)) == ({"a"}, {2})
    assert path.read_text() == whole   # the cut-off line is gone, so the next write starts a fresh line
