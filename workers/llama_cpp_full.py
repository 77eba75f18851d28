"""The whole GGUF on llama.cpp in one process: layers [0, n_layers), head and tail.

It is the layer-range backend over the full range (same context settings, so its logits are the
bit-identical reference for agreement tests), plus the text helpers the bus needs: tokenizer,
detokenizer, special token ids and the chat template.
"""

from __future__ import annotations

from pathlib import Path

from workers.errors import UnsupportedModel
from workers.llama_cpp_range import LlamaCppRangeBackend


class LlamaCppFullBackend(LlamaCppRangeBackend):
    backend_id = "llama-cpp-full"

    def __init__(self, model_path: str | Path, *, benchmark: bool = False, **opts):
        super().__init__(model_path, None, None, benchmark=benchmark, **opts)
        if not (self.is_head and self.is_tail):
            self.close()
            raise UnsupportedModel(f"{model_path} is a layer-range slice, not a whole model")

    # -- text --------------------------------------------------------------------------------

    def tokenize(self, text: str, add_bos: bool = True, special: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_bos`` adds the model's BOS (if it uses one), ``special``
        parses special-token text such as ``<|im_start|>``."""
        return self.model.tokenize(text, add_special=add_bos, parse_special=special)

    def detokenize(self, ids: list[int], special: bool = False) -> str:
        """Text of ``ids``; ``special`` renders special tokens as text instead of dropping them."""
        return self.model.detokenize([int(i) for i in ids], remove_special=False, unparse_special=special)

    @property
    def bos_id(self) -> int:
        return self.model.token("bos")

    @property
    def eos_id(self) -> int:
        return self.model.token("eos")

    def is_eog(self, token_id: int) -> bool:
        """End of generation: EOS, EOT and the like."""
        return self.model.is_eog(token_id)

    @property
    def chat_template(self) -> str | None:
        return self.model.meta("tokenizer.chat_template")
