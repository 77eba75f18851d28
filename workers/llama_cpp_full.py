"""The whole GGUF on llama.cpp in one process: layers [0, n_layers), head and tail.

It is the layer-range backend over the full range (same context settings, so its logits are the
bit-identical reference for agreement tests), plus the text helpers the bus needs: tokenizer,
detokenizer, special token ids and the chat template.
"""

from __future__ import annotations

import functools
from pathlib import Path

from workers.llama_cpp_range import LlamaCppRangeBackend
from workers.tokenizer import Tokenizer


class LlamaCppFullBackend(LlamaCppRangeBackend):
    backend_id = "llama-cpp-full"

    def __init__(self, model_path: str | Path, *, benchmark: bool = False, **opts):
        """``model_path`` must be a whole model: a slice would run as one, silently (the bus's
        `execution.open_reference` refuses slices before it gets here)."""
        super().__init__(model_path, None, None, benchmark=benchmark, **opts)

    # -- text (one tokenizer implementation for the whole project: workers.tokenizer) ----------

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        return Tokenizer(self.file)

    def tokenize(self, text: str, add_bos: bool = True, special: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_bos`` adds the model's BOS (if it uses one), ``special``
        parses special-token text such as ``<|im_start|>``."""
        return self.tokenizer.encode(text, add_bos=add_bos and self.tokenizer.add_bos, special=special)

    def detokenize(self, ids: list[int], special: bool = False) -> str:
        """Text of ``ids``; ``special`` renders special tokens as text instead of dropping them."""
        return self.tokenizer.decode([int(i) for i in ids], special=special)

    @property
    def bos_id(self) -> int:
        return self.tokenizer.bos_id

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_id

    def is_eog(self, token_id: int) -> bool:
        """End of generation: EOS, EOT and the like."""
        return self.tokenizer.is_end_of_generation(token_id)

    @property
    def chat_template(self) -> str | None:
        return self.tokenizer.chat_template
