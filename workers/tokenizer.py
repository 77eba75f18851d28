"""The model's own tokenizer, read from a GGUF (whole model or slice) through llama.cpp.

A vocab-only load: no weights, no context. The head of a route tokenizes prompts (and applies
the model's chat template); the tail turns sampled token ids back into text.

Chat templates: the GGUF's own (``tokenizer.chat_template``, Jinja) when it has one; else the
template llama.cpp has built in for the architecture's family (the shipped Gemma 3 270M GGUF
carries none, and llama.cpp's ``gemma`` template is its turn format).
"""

from __future__ import annotations

import codecs
import ctypes
from pathlib import Path

import llama_cpp
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

# Architectures whose GGUFs may lack a chat template -> llama.cpp's built-in template for them.
BUILTIN_TEMPLATES = {"gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma"}


class Tokenizer:
    def __init__(self, model_path: Path | str):
        self._llama = llama_cpp.Llama(str(model_path), vocab_only=True, verbose=False)
        self.vocab_size = self._llama.n_vocab()
        self.bos_id = self._llama.token_bos()
        self.eos_id = self._llama.token_eos()
        meta = self._llama.metadata
        self.add_bos = meta.get("tokenizer.ggml.add_bos_token", "true") == "true"
        self.chat_template = meta.get("tokenizer.chat_template")
        self.builtin_template = (
            None if self.chat_template else BUILTIN_TEMPLATES.get(meta.get("general.architecture", ""))
        )
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
        if self.builtin_template:
            return _builtin_chat(self.builtin_template, messages, add_generation_prompt)
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        formatter = Jinja2ChatFormatter(
            self.chat_template,
            eos_token=self.piece(self.eos_id).decode("utf-8", "replace"),
            bos_token=self.piece(self.bos_id).decode("utf-8", "replace"),
            add_generation_prompt=add_generation_prompt,
        )
        return formatter(messages=messages).prompt  # type: ignore[arg-type]  # role/content dicts, as the template reads them

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> tuple[str, list[int]]:
        """The chat rendered by the model's template, and its token ids (BOS once, as the model wants it)."""
        text = self.apply_chat_template(messages, add_generation_prompt)
        bos = self.decode([self.bos_id], special=True) if self.bos_id >= 0 else ""
        starts_with_bos = bool(bos) and text.startswith(bos)  # Jinja templates often write it themselves
        return text, self.encode(text, add_bos=self.add_bos and not starts_with_bos)

    def stream_decoder(self) -> TextStream:
        return TextStream(self)


def _builtin_chat(name: str, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    """``messages`` in llama.cpp's built-in chat template ``name``."""
    keep = [(str(m.get("role", "")).encode(), str(m.get("content", "")).encode()) for m in messages]
    chat = (llama_cpp.llama_chat_message * len(keep))(*[llama_cpp.llama_chat_message(r, c) for r, c in keep])
    size = 256 + 2 * sum(len(r) + len(c) for r, c in keep)
    for _ in range(2):
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_chat_apply_template(name.encode(), chat, len(keep), add_generation_prompt, buf, size)
        if n < 0:
            raise ValueError(f"llama.cpp's {name} chat template cannot render these messages")
        if n <= size:
            return buf.raw[:n].decode("utf-8", "replace")
        size = n
    raise ValueError(f"llama.cpp's {name} chat template: output did not fit")


class TextStream:
    """Turns token ids into text deltas, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self._tok.piece(token_id))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
