"""The typed boundary between the scheduler and the model runner. Read this file first.

Every engine step is:  plan = scheduler.schedule()  ->  result = runner.execute(plan)
->  outputs = scheduler.update(plan, result).  Nothing else crosses between the two: the runner
never sees a Request, the scheduler never sees a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepinfer.outputs import Logprob
from deepinfer.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """Sent once when a request (re)joins the runner: what it must keep per request."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]   # non-empty when a preempted request resumes
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]


@dataclass
class ScheduledChunk:
    """Compute KV for tokens [start, start + num_tokens) of one request this step."""

    request_id: str
    start: int
    num_tokens: int
    block_ids: list[list[int]]    # the full block table of every layer group
    # True when the chunk reaches the end of the known tokens, so its last position is sampled.
    sample: bool
    prompt_logprobs: bool = False  # also return logprobs of the prompt tokens in this chunk
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify (DSpark issue)


@dataclass
class SchedulerPlan:
    new_requests: list[NewRequestData]
    chunks: list[ScheduledChunk]
    finished_request_ids: list[str]   # the runner drops their state
    num_scheduled_tokens: int
    # Structured output: a sample.structured.StepBitmask with one row per sampled request that
    # has a grammar, filled by a worker thread while the forward runs; None when no row has one.
    grammar_bitmask: Any = None

    @property
    def is_empty(self) -> bool:
        return not self.chunks


# Per position: {token_id: Logprob}; the sampled token first, then the top-k.
PositionLogprobs = dict[int, Logprob]


@dataclass
class RunnerResult:
    """What one forward produced, keyed by request id."""

    sampled_token_ids: dict[str, list[int]]              # one token now; accepted drafts later
    logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[PositionLogprobs | None]] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    """What the scheduler reports per request after applying a result."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    finish_reason: str | None = None      # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None              # with finish_reason "abort": why the request failed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
