"""When a request's next token ends it: EOS, a stop token id, or its length limit.

Stop strings are not here: they need the detokenized text, which the output processor holds
(output_processor.py); the scheduler stops on token ids and lengths, which it knows itself.
"""

from __future__ import annotations

from deepinfer.types.request import Request, RequestStatus


def at_length_limit(request: Request, max_model_len: int, extra_tokens: int = 0) -> bool:
    """Whether the request stops for length once it has `extra_tokens` more output tokens
    (min_tokens first: no stop before them)."""
    num_output = request.num_output_tokens + extra_tokens
    return (num_output >= request.sampling_params.min_tokens
            and (num_output >= request.max_tokens or request.num_tokens + extra_tokens >= max_model_len))


def stop_status(request: Request, token_id: int, max_model_len: int) -> RequestStatus | None:
    """The status `token_id`, just appended to the request's output, finishes it with; None: it
    goes on. A stop token id is remembered as the request's stop_reason."""
    params = request.sampling_params
    if request.num_output_tokens < params.min_tokens:
        return None
    if not params.ignore_eos and token_id in request.eos_token_ids:
        return RequestStatus.FINISHED_STOPPED
    if params.stop_token_ids and token_id in params.stop_token_ids:
        request.stop_reason = token_id
        return RequestStatus.FINISHED_STOPPED
    if at_length_limit(request, max_model_len):
        return RequestStatus.FINISHED_LENGTH
    return None
