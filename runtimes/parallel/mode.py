"""How the ranks synchronise, and how the sync mode compresses (kept apart so the CLI imports no torch)."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["Mode", "CommHook"]


class Mode(StrEnum):
    """How the ranks synchronise."""

    SYNC = "sync"          # gradients averaged every step
    LOCALSGD = "localsgd"  # local epochs (or steps), then models averaged and the strategy applied


class CommHook(StrEnum):
    """Torch's DDP communication hooks for the sync mode (``runtimes.parallel.hooks``).

    ``none``: no hook, the aggregation core's float32 all-reduce.
    """

    NONE = "none"
    FP16 = "fp16"          # default_hooks.fp16_compress_hook: half the bytes
    BF16 = "bf16"          # default_hooks.bf16_compress_hook: NCCL only
    POWERSGD = "powersgd"  # powerSGD_hook.powerSGD_hook: rank-1 factors with error feedback
