"""The model's own tokenizer, read from a GGUF (whole model or slice) through llama.cpp.

A vocab-only load: no weights, no context. The head of a route tokenizes prompts (and applies
the model's chat template); the tail turns sampled token ids back into text.
"""

from __future__ import annotations

import codecs
from pathlib import Path

import llama_cpp
from llama_cpp.llama_chat_format import Jinja2ChatFormatter


class Tokenizer:
    def __init__(self, model_path: Path | str):
        self._llama = llama_cpp.Llama(str(model_path), vocab_only=True, verbose=False)
        self.vocab_size = self._llama.n_vocab()
        self.bos_id = self._llama.token_bos()
        self.eos_id = self._llama.token_eos()
        meta = self._llama.metadata
        self.add_bos = meta.get("tokenizer.ggml.add_bos_token", "true") == "true"
        self.chat_template = meta.get("tokenizer.chat_template")
        self._vocab = self._llama._model.vocab

    def encode(self, text: str, add_bos: bool | None = None, special: bool = True) -> list[int]:
        """Token ids; with ``special``, special tokens written in the text (<|im_start|>) are parsed."""
        bos = self.add_bos if add_bos is None else add_bos
        return self._llama.tokenize(text.encode("utf-8"), add_bos=bos, special=special)

    def piece(self, token_id: int) -> bytes:
        return self._llama.detokenize([token_id])

    def decode(self, ids: list[int], special: bool = False) -> str:
        """Text of ``ids``; with ``special``, special tokens are rendered as text too."""
        return self._llama.detokenize(ids, special=special).decode("utf-8", errors="replace")

    def is_end_of_generation(self, token_id: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token_id))

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        formatter = Jinja2ChatFormatter(
            self.chat_template,
            eos_token=self.piece(self.eos_id).decode("utf-8", "replace"),
            bos_token=self.piece(self.bos_id).decode("utf-8", "replace"),
            add_generation_prompt=add_generation_prompt,
        )
        return formatter(messages=messages).prompt

    def stream_decoder(self) -> "TextStream":
        return TextStream(self)


class TextStream:
    """Turns token ids into text deltas, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self._tok.piece(token_id))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
