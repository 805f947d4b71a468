"""Models the benchmarks time: ``transformers`` Llama-style decoders with random weights (no download).

``llama-tiny`` has llama-small's ops on tensors of a few hundred elements: capture's per-op
fixed cost alone. ``llama-small`` (4 layers, width 256, 256 tokens: ~20 ms per forward on one core, ~400 ATen ops
that move numbers, most of them small) shows per-op fixed costs; ``llama-mid`` (4 layers, width
768, 128 tokens: ~100 ms) is a real size, where the statistics' memory traffic and the write
dominate; ``llama-mid512`` (4 layers, width 512, 2 sequences of 256 tokens: a 232 MB full bundle) is
the model issue 34's full-capture goal names. ``demo`` is ``hooks.demo_model.build_large``.
"""

from __future__ import annotations

from typing import Any

import torch

SIZES: dict[str, dict[str, int]] = {
    "llama-tiny": {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
                   "num_attention_heads": 2, "seq": 8},
    "llama-small": {"vocab_size": 1000, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
                    "num_attention_heads": 4, "seq": 256},
    "llama-mid": {"vocab_size": 4000, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 4,
                  "num_attention_heads": 12, "seq": 128},
    "llama-mid512": {"vocab_size": 4000, "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 4,
                     "num_attention_heads": 8, "seq": 256, "batch": 2},
}
MODELS = ("demo", *SIZES)


def build(name: str, seed: int = 0) -> tuple[torch.nn.Module, tuple[Any, ...]]:
    """``(model, (inputs,))`` in eval mode; Llama weights are random (seeded), attention is eager."""
    if name == "demo":
        from hooks import demo_model

        return demo_model.build_large()
    from transformers import LlamaConfig, LlamaForCausalLM

    size = dict(SIZES[name])
    seq = size.pop("seq")
    batch = size.pop("batch", 1)
    torch.manual_seed(seed)
    cfg = LlamaConfig(**size, num_key_value_heads=size["num_attention_heads"], max_position_embeddings=2 * seq,
                      attn_implementation="eager")
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))
    return model, (ids,)


def steady_allocator() -> bool:
    """glibc's malloc hands large freed blocks back to the kernel (munmap, heap trim) and faults them
    in again on the next allocation: kernel time that lands on whichever run comes next, 10 ms or more
    on a 25 ms forward, in no fixed pattern. Keep freed memory in the process instead (the same for
    the plain and the captured runs). False where this is not glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
        return all(libc.mallopt(opt, value) == 1 for opt, value in
                   ((m_mmap_threshold, 1 << 30), (m_trim_threshold, 1 << 31), (m_top_pad, 256 << 20)))
    except (OSError, AttributeError):
        return False
