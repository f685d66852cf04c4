"""Logprobs in the shapes clients read: OpenAI's legacy completions object, OpenAI's chat
entries, and vLLM's `prompt_logprobs` list.

JSON has no -inf: OpenAI reports -9999.0 for impossible tokens, and so do we.
"""

from __future__ import annotations

from collections.abc import Callable

from deepinfer.outputs import Logprob

_FLOOR = -9999.0


def token_id_string(token_id: int) -> str:
    """vLLM's `return_tokens_as_token_ids` form of a token in logprobs."""
    return f"token_id:{token_id}"


def _value(lp: Logprob) -> float:
    return max(lp.logprob, _FLOOR)


def _chosen(entry: dict[int, Logprob], token_id: int) -> Logprob:
    return entry.get(token_id) or next(iter(entry.values()))


class CompletionLogprobs:
    """OpenAI's legacy `logprobs` object (tokens, token_logprobs, top_logprobs, text_offset),
    built up across positions. `text_offset[i]` is where token i's text starts in the choice's
    text (which, with echo, starts with the prompt): the sum of the earlier tokens' text lengths.

    decode: a token id's text, for positions without a logprob entry (the first prompt token).
    as_ids: tokens (and top_logprobs keys) as "token_id:N" (vLLM's return_tokens_as_token_ids);
    the offsets still count the tokens' text, so they point into the returned text."""

    def __init__(self, decode: Callable[[int], str] | None = None, as_ids: bool = False) -> None:
        self.offset = 0
        self.decode = decode
        self.as_ids = as_ids

    def positions(self, token_ids, entries) -> dict:
        """The object for these positions (an entry of None: no logprob, the first prompt token)."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, entries):
            if entry is None:
                text = self.decode(token_id) if self.decode is not None else ""
                value, ranked = None, None
            else:
                chosen = _chosen(entry, token_id)
                text, value = chosen.decoded_token or "", _value(chosen)
                ranked = {self._name(i, lp): _value(lp) for i, lp in entry.items()}
            tokens.append(token_id_string(token_id) if self.as_ids else text)
            token_logprobs.append(value)
            top.append(ranked)
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def _name(self, token_id: int, lp: Logprob) -> str:
        return token_id_string(token_id) if self.as_ids else lp.decoded_token or ""


def join_completion_logprobs(parts: list[dict]) -> dict:
    return {key: [v for part in parts for v in part[key]]
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def chat_logprob(entry: dict[int, Logprob], token_id: int, top: int, as_ids: bool = False) -> dict:
    """One position in OpenAI's chat logprobs shape (as_ids: tokens as "token_id:N", whose
    `bytes` are that string's, as vLLM gives them)."""
    chosen = _chosen(entry, token_id)
    chosen_id = token_id if token_id in entry else next(iter(entry))
    ranked = sorted(entry.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)[:top]
    return {**_token_logprob(chosen_id, chosen, as_ids),
            "top_logprobs": [_token_logprob(i, lp, as_ids) for i, lp in ranked]}


def _token_logprob(token_id: int, lp: Logprob, as_ids: bool) -> dict:
    text = token_id_string(token_id) if as_ids else lp.decoded_token or ""
    return {"token": text, "logprob": _value(lp), "bytes": list(text.encode("utf-8"))}


def prompt_logprobs_json(entries) -> list:
    """vLLM's `prompt_logprobs`: per prompt position None (the first) or
    {token_id: {"logprob", "rank", "decoded_token"}}."""
    return [None if entry is None else
            {str(token_id): {"logprob": _value(lp), "rank": lp.rank, "decoded_token": lp.decoded_token}
             for token_id, lp in entry.items()}
            for entry in entries]
