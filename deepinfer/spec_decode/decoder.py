"""The scheduler's side of speculative decoding: propose, choose what to verify, learn from it.

Each step the scheduler calls `plan(running, budget, base_tokens)` before it builds chunks:
  1. the requests that are generating (all known tokens computed but the last sampled one) and
     have room left ask the drafter for up to k drafts;
  2. the calibrator turns each draft's confidences into survival probabilities;
  3. the policy (fixed or adaptive) picks how many drafts of each request to verify under the
     budget left after every running request's own tokens.
After the step, `observe(request_id, verified, accepted)` feeds calibration and the counters.

Requests under a structured-output grammar keep only the drafts their grammar allows (a draft
outside it would be rejected anyway) and never a draft past the grammar's end; the bitmask is
then filled for every draft position (structured/manager.py), so verification samples from the
same masked distribution plain decoding would.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from deepinfer.config import SpeculativeConfig
from deepinfer.spec_decode.calibration import AcceptanceCalibrator
from deepinfer.spec_decode.cost_model import StepCostModel
from deepinfer.spec_decode.method import SpeculativeMethod
from deepinfer.spec_decode.policy import Candidate, admit_adaptive, admit_fixed
from deepinfer.types.drafter import Draft, Drafter, DraftRequest
from deepinfer.types.spec_stats import SpecDecodeStats

# Adaptive verification explores: a request whose first draft falls in a calibration cell with
# fewer observations than this verifies that one draft anyway. Without it a drafter whose raw
# confidence starts low would never be verified, so never be found to be better than it says.
MIN_EVIDENCE = 8.0

if TYPE_CHECKING:
    from deepinfer.types.request import Request

logger = logging.getLogger(__name__)


def _grammar_prefix(grammar, token_ids: list[int]) -> int:
    """Leading drafts the grammar accepts, stopping before any that would end the grammar (no
    mask exists after the end). The matcher is left as it was."""
    accepted, ended = 0, False
    for token_id in token_ids:
        if not grammar.accept(token_id):
            break
        accepted += 1
        if grammar.is_terminated:
            ended = True
            break
    grammar.rollback(accepted)
    return accepted - 1 if ended else accepted


class SpeculativeDecoder:
    def __init__(self, config: SpeculativeConfig | SpeculativeMethod, drafter: Drafter, max_model_len: int,
                 cost_model: StepCostModel | None = None) -> None:
        """`config`: the method resolved (build_speculative_decoder's), or the config to resolve."""
        self.method = config if isinstance(config, SpeculativeMethod) else SpeculativeMethod.resolve(config)
        config = self.method.config
        if self.method.adaptive and cost_model is None:
            raise ValueError("adaptive verification needs a step-cost model")
        self.config = config
        self.k = config.num_speculative_tokens
        self.drafter = drafter
        self.max_model_len = max_model_len
        self.cost_model = cost_model
        self.calibrator = AcceptanceCalibrator(self.k)
        self.stats = SpecDecodeStats(self.k)
        self._confidences: dict[str, list[float]] = {}   # of the drafts sent for verification
        # The last plan's survival probabilities of the drafts it admitted (adaptive only).
        self._survival: dict[str, list[float]] = {}

    def plan(self, running: list[Request], budget: int, base_tokens: int) -> dict[str, list[int]]:
        """Drafts to verify this step, per request id (absent: none).

        budget: tokens left for drafts; base_tokens: tokens the running requests need anyway.
        """
        self.drafter.release({r.request_id for r in running})
        wanted = []
        for r in running:
            if r.num_tokens - r.num_computed_tokens != 1:
                continue
            # Positions must stay inside the context, and drafts past max_tokens are wasted.
            room = min(self.k, r.max_tokens - r.num_output_tokens - 1, self.max_model_len - r.num_tokens)
            if room > 0:
                wanted.append(DraftRequest(r.request_id, r.all_token_ids, room))
        if not wanted or budget <= 0:
            return {}
        drafts = self.drafter.propose(wanted)
        grammars = {r.request_id: r.grammar for r in running if r.grammar is not None}
        for request_id, grammar in grammars.items():
            draft = drafts.get(request_id)
            if draft is not None and draft.token_ids:
                n = _grammar_prefix(grammar, draft.token_ids)
                drafts[request_id] = Draft(draft.token_ids[:n], draft.confidences[:n])
        fixed = not self.method.adaptive
        candidates = []
        for w in wanted:
            draft = drafts.get(w.request_id)
            if draft is None or not draft.token_ids:
                continue
            self.stats.num_proposed_tokens += len(draft.token_ids)
            # Fixed verification reads only the drafts' lengths: no survival to estimate (at batch
            # 64 that was a few hundred calibrator lookups a step).
            candidates.append(Candidate(w.request_id, [] if fixed else self.calibrator.survival(
                draft.confidences[:w.max_drafts]), min(len(draft.token_ids), w.max_drafts)))
        if fixed:
            admitted = admit_fixed(candidates, budget)
        else:
            cost, num_seqs = self.cost_model, len(running)
            admitted = admit_adaptive(candidates, budget, len(wanted), base_tokens,
                                      lambda num_tokens: cost.costs(num_seqs, num_tokens))
            spare = budget - sum(admitted.values())
            for c in candidates:
                if spare <= 0:
                    break
                if c.request_id not in admitted and self.calibrator.evidence(
                        0, drafts[c.request_id].confidences[0]) < MIN_EVIDENCE:
                    admitted[c.request_id] = 1
                    spare -= 1
        out = {}
        for request_id, n in admitted.items():
            draft = drafts[request_id]
            out[request_id] = draft.token_ids[:n]
            if not fixed:   # what calibration learns from (only adaptive verification reads it)
                self._confidences[request_id] = draft.confidences[:n]
        if not fixed:
            self._survival = {c.request_id: c.survival[:admitted[c.request_id]]
                              for c in candidates if c.request_id in admitted}
        return out

    def expected_emitted(self, chunks) -> float | None:
        """Tokens a decode-shaped step of these chunks (the last plan's) is expected to emit: one
        per request, plus each verified draft's survival probability (calibration.py). None
        under fixed verification, which estimates no survival. The loop chooser prices a
        speculative step by this rather than by what it emitted: at batch 1 one step emits 1 to
        k + 1 tokens, and a few unlucky steps in a row would read as speculation not paying."""
        if not self.method.adaptive:
            return None
        return sum(1.0 + sum(self._survival.get(c.request_id, ())[:len(c.spec_token_ids)]) for c in chunks)

    def observe(self, request_id: str, num_verified: int, num_accepted: int) -> None:
        confidences = self._confidences.pop(request_id, None)
        if confidences is not None:
            self.calibrator.observe(confidences[:num_verified], num_accepted)
        self.stats.record(num_verified, num_accepted)

    def observe_step(self, plan, seconds: float) -> None:
        """A finished step's wall time, for the step-cost model when the step was decode-shaped
        (every chunk one known token plus its drafts; prefill chunks cost differently)."""
        if self.cost_model is not None and plan.is_decode_only:
            self.cost_model.observe(len(plan.chunks), plan.num_scheduled_tokens, seconds)

    def forget(self, request_id: str) -> None:
        """The request's verification did not happen (aborted or preempted in between)."""
        self._confidences.pop(request_id, None)
