"""The settings of LoRA serving, vLLM's names (EngineConfig.lora; `--enable-lora`, `--max-loras`, ...).

Both halves read it: the front end checks an adapter against max_lora_rank before any request of
it is accepted (lora/registry.py), the scheduler runs at most max_loras adapters at once, and the
runner sizes its device slots (lora/slots.py) and its host copies (lora/manager.py) from it.
The adapters a server starts with are a server flag (`--lora-modules`, ServerOptions), as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRAConfig:
    """The string under each field is its --help text (cli/flags.py)."""

    enable_lora: bool = False
    """Serve LoRA adapters (PEFT format) beside the base model: requests name one (a server
    request's `model`, LLM.generate's lora_request), and requests of different adapters and of
    the base model batch together."""
    max_loras: int = 1
    """The most adapters one step runs (each takes a device slot); requests of further adapters
    wait until one of them has no running request left. Base-model requests always fit."""
    max_lora_rank: int = 16
    """The largest LoRA rank (r) accepted; every slot is sized for it. An adapter of a higher
    rank is refused with an error naming both."""
    max_cpu_loras: int | None = None
    """Adapters kept read in host memory, so one leaving its device slot comes back without
    reading its files again (least recently used out first). Unset: max_loras."""

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        cpu = self.max_cpu_loras
        if cpu is not None and (isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < self.max_loras):
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), got {cpu!r}")

    @property
    def cpu_loras(self) -> int:
        """Adapters kept in host memory: max_cpu_loras, else max_loras."""
        return self.max_cpu_loras or self.max_loras
