"""The scheduler's LoRA rule: at most max_loras distinct adapters among the running requests.

The runner holds exactly the scheduler's running requests (types/plan.py), and keeps an adapter
in its device slot while a request it holds uses it (lora/manager.py). So if the running requests
never use more than max_loras adapters, every step's adapters are resident together and the
runner always finds a slot for a newly admitted request's adapter. Base-model requests take no
slot and are never held back.

Admission order stays the policy's, with one exception: a waiting request whose adapter would be
one too many is passed over, and the requests behind it are considered. Passed over, it must not
wait forever behind later requests that keep its rivals' adapters running; so once a request has
been passed over in a schedule, no further adapter request is admitted in that schedule (base-model
requests still are): the running adapters drain, and the passed request's turn comes.
"""

from __future__ import annotations

from collections.abc import Iterable

from deepinfer.types.request import Request


class AdapterAdmission:
    """One schedule's view of the adapters in use: built from the running requests, told of each
    request admitted. max_loras None: LoRA is off, every request is admitted (none has an adapter:
    EngineCore.add_request refuses them)."""

    def __init__(self, max_loras: int | None, running: Iterable[Request]) -> None:
        self.max_loras = max_loras
        self.in_use = {r.lora.lora_int_id for r in running if r.lora is not None} if max_loras is not None else set()
        self.passed_one = False   # a waiting request was passed over for want of a slot

    def admits(self, request: Request) -> bool:
        """Whether `request` may be admitted now; False passes it over (see the module docstring)."""
        if request.lora is None or self.max_loras is None:
            return True
        fits = not self.passed_one and (request.lora.lora_int_id in self.in_use or len(self.in_use) < self.max_loras)
        self.passed_one = self.passed_one or not fits
        return fits

    def admitted(self, request: Request) -> None:
        if request.lora is not None:
            self.in_use.add(request.lora.lora_int_id)
