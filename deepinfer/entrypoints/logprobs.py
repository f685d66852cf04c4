"""Logprobs in the shapes clients read: OpenAI's legacy completions object, OpenAI's chat
entries, and vLLM's `prompt_logprobs` list.

JSON has no -inf: OpenAI reports -9999.0 for impossible tokens, and so do we.
"""

from __future__ import annotations

from deepinfer.outputs import Logprob

_FLOOR = -9999.0


def _value(lp: Logprob) -> float:
    return max(lp.logprob, _FLOOR)


def _chosen(entry: dict[int, Logprob], token_id: int) -> Logprob:
    return entry.get(token_id) or next(iter(entry.values()))


class CompletionLogprobs:
    """OpenAI's legacy `logprobs` object (tokens, token_logprobs, top_logprobs, text_offset),
    built up across positions; `text_offset` counts characters from the start of the choice's
    text (which, with echo, starts with the prompt)."""

    def __init__(self) -> None:
        self.offset = 0

    def positions(self, token_ids, entries) -> dict:
        """The object for these positions (an entry of None: no logprob, the first prompt token)."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, entries):
            if entry is None:
                text, value, ranked = None, None, None
            else:
                chosen = _chosen(entry, token_id)
                text, value = chosen.decoded_token or "", _value(chosen)
                ranked = {lp.decoded_token or "": _value(lp) for lp in entry.values()}
            tokens.append(text if text is not None else "")
            token_logprobs.append(value)
            top.append(ranked)
            offsets.append(self.offset)
            self.offset += len(text or "")
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def join_completion_logprobs(parts: list[dict]) -> dict:
    return {key: [v for part in parts for v in part[key]]
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def chat_logprob(entry: dict[int, Logprob], token_id: int, top: int) -> dict:
    """One position in OpenAI's chat logprobs shape."""
    chosen = _chosen(entry, token_id)
    ranked = sorted(entry.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)[:top]
    return {**_token_logprob(chosen), "top_logprobs": [_token_logprob(lp) for _, lp in ranked]}


def _token_logprob(lp: Logprob) -> dict:
    text = lp.decoded_token or ""
    return {"token": text, "logprob": _value(lp), "bytes": list(text.encode("utf-8"))}


def prompt_logprobs_json(entries) -> list:
    """vLLM's `prompt_logprobs`: per prompt position None (the first) or
    {token_id: {"logprob", "rank", "decoded_token"}}."""
    return [None if entry is None else
            {str(token_id): {"logprob": _value(lp), "rank": lp.rank, "decoded_token": lp.decoded_token}
             for token_id, lp in entry.items()}
            for entry in entries]
