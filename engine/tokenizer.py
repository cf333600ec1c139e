"""Text <-> token ids: a local ``tokenizer.json`` through ``tokenizers``, else raw UTF-8 bytes."""

from __future__ import annotations

from pathlib import Path


class Tokenizer:
    """Encodes prompts and decodes outputs. Stateless after construction; thread-safe.

    With no ``tokenizer.json`` in the model directory, token id i < 256 is byte
    i (the vocabulary must have at least 256 entries) and ids >= 256 decode to
    nothing.
    """

    def __init__(self, model_dir: str | Path, vocab_size: int) -> None:
        path = Path(model_dir) / "tokenizer.json"
        self._tok = None
        if path.is_file():
            from tokenizers import Tokenizer as HFTokenizer

            self._tok = HFTokenizer.from_file(str(path))
        elif vocab_size < 256:
            raise ValueError(f"tokenizer: {model_dir} has no tokenizer.json and vocab_size={vocab_size} < 256 "
                             "cannot hold raw bytes")
        self.vocab_size = vocab_size

    @property
    def is_bytes(self) -> bool:
        return self._tok is None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens=False`` skips the post-processor's BOS/EOS (for text a
        chat template rendered, which wrote its special tokens already)."""
        if self._tok is None:
            return list(text.encode("utf-8"))
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def token_id(self, token: str) -> int | None:
        """The id of one vocabulary entry (e.g. ``"<|im_end|>"``), None when it is not one token."""
        if self._tok is None:
            data = token.encode("utf-8")
            return data[0] if len(data) == 1 else None
        return self._tok.token_to_id(token)

    def decode(self, ids: list[int]) -> str:
        if self._tok is None:
            return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
        return self._tok.decode(ids)
