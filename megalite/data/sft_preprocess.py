"""SFT records (JSON lines) -> tokens and a per-token loss mask, in two indexed pairs.

    preprocess_sft(["train.jsonl"], "data/sft", tokenizer="byte")
    # -> data/sft.{bin,idx}            the tokens, one document per record
    #    data/sft_loss_mask.{bin,idx}  uint8, 1 where the token is trained on, the same offsets

A record is either
  {"prompt": "...", "completion": "..."}   tokens = encode(prompt) + encode(completion) + [eod];
                                           the completion and the eod (learning to stop) are trained;
  {"messages": [{"role": ..., "content": ...}, ...]}   rendered by the tokenizer's chat template
                                           (transformers' apply_chat_template, the [hf] extra); every
                                           assistant message's content and what the template closes it
                                           with are trained, the rest (system, user, the assistant
                                           header) is not; the eod after the record is a boundary only.
A record's kind is decided by its keys; one without either is refused naming its line, and chat
records with a tokenizer that has no chat template are refused in one line (--tokenizer must then be a
directory saved by transformers, or its tokenizer.json, beside a tokenizer_config.json that has one).

The mask of a token says whether predicting that token counts: the dataset (sft_dataset.py) turns
mask 0 into label -100 at the position before it.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import numpy as np

from megalite.data.indexed_dataset import DataError, IndexedDatasetWriter
from megalite.data.preprocess import PreprocessStats, json_object, list_input_files
from megalite.data.tokenizer import load_tokenizer
from megalite.extras import require

MASK_SUFFIX = "_loss_mask"  # the mask pair's prefix: PREFIX + MASK_SUFFIX


def mask_prefix(prefix: str) -> str:
    return prefix + MASK_SUFFIX


SFT_SHAPE = '{"prompt": ..., "completion": ...} or {"messages": [...]}'  # one SFT record, for messages


def _records(path: str) -> Iterator[tuple[int, dict]]:
    """(line number, record) of each non-empty line; DataError naming a line that is no JSON object."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            yield number, json_object(path, number, line, shape=SFT_SHAPE)


class ChatTemplate:
    """transformers' tokenizer of a directory, for records with "messages": the template renders them and
    its offsets say which tokens fall in an assistant message."""

    def __init__(self, spec: str):
        transformers = require("transformers", "chat records (\"messages\")")  # the [hf] extra
        directory = Path(spec).parent if Path(spec).is_file() else Path(spec)
        try:
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise DataError(f"--tokenizer {spec}: transformers cannot load a tokenizer from {directory} "
                            f"({' '.join(str(exc).split())[:200]}); give the directory saved with the model") from None
        if not getattr(self.tokenizer, "chat_template", None):
            raise DataError(f"--tokenizer {spec}: the tokenizer in {directory} has no chat template, so \"messages\" "
                            f"records cannot be rendered; use a tokenizer directory whose tokenizer_config.json "
                            f"has one, or write the records as \"prompt\"/\"completion\"")

    def _render(self, messages: list, generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def prompt(self, text: str) -> str:
        """`text` as one user turn, with the template's opening of the assistant's answer (for sampling)."""
        return self._render([{"role": "user", "content": text}], generation_prompt=True)

    def encode(self, messages: list, where: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids int64, mask uint8) of the rendered conversation."""
        full = self._render(messages)
        spans = []  # [start, end) characters of each assistant message, as the template renders it
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            before, through = self._render(messages[:i], generation_prompt=True), self._render(messages[:i + 1])
            if not (full.startswith(before) and full.startswith(through)):
                raise DataError(f"{where}: the chat template does not render this conversation's turns as prefixes "
                                f"of the whole (e.g. it rewrites earlier turns), so the assistant tokens cannot be "
                                f"found; write the record as \"prompt\"/\"completion\"")
            spans.append((len(before), len(through)))
        encoded = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        mask = np.array([any(s <= start < e for s, e in spans) for start, _ in encoded["offset_mapping"]],
                        dtype=np.uint8)
        return np.asarray(encoded["input_ids"], dtype=np.int64), mask


def _check_messages(messages, where: str) -> None:
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise DataError(f"{where}: \"messages\" must be a non-empty list of {{\"role\": ..., \"content\": ...}} "
                        f"objects with string values")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: no \"assistant\" message, so nothing would be trained on; add the answer")


def encode_record(record: dict, where: str, tokenizer, chat: ChatTemplate | None) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) of one record, the eod appended (trained after a completion, not after a chat)."""
    if isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
        prompt, completion = tokenizer.encode(record["prompt"]), tokenizer.encode(record["completion"])
        if not completion:
            raise DataError(f"{where}: an empty \"completion\", so nothing would be trained on")
        ids = np.asarray(prompt + completion + [tokenizer.eod], dtype=np.int64)
        mask = np.concatenate([np.zeros(len(prompt), np.uint8), np.ones(len(completion) + 1, np.uint8)])
        return ids, mask
    if "messages" in record:
        _check_messages(record["messages"], where)
        if chat is None:
            raise DataError(f"{where}: a chat record (\"messages\") needs a tokenizer with a chat template: pass "
                            f"--tokenizer DIR (a directory saved by transformers)")
        ids, mask = chat.encode(record["messages"], where)
        return np.append(ids, tokenizer.eod), np.append(mask, np.uint8(0))
    raise DataError(f"{where}: no \"prompt\" and \"completion\" strings and no \"messages\" (keys: {sorted(record)}); "
                    f"an SFT record is {{\"prompt\": ..., \"completion\": ...}} or {{\"messages\": [...]}}")


def _token_tokenizer(spec: str | None):
    """megalite's tokenizer of `spec` (a directory means its tokenizer.json): the ids' vocabulary and eod."""
    if spec is not None and os.path.isdir(spec):
        spec = os.path.join(spec, "tokenizer.json")
    return load_tokenizer(spec)


def preprocess_sft(inputs: list[str], output_prefix: str, tokenizer: str | None = None) -> PreprocessStats:
    """SFT JSON lines -> PREFIX.{bin,idx} (tokens) and PREFIX_loss_mask.{bin,idx} (uint8 mask)."""
    tokens = _token_tokenizer(tokenizer)
    chat: list[ChatTemplate | None] = []  # made at the first chat record (transformers only when needed)
    stats = PreprocessStats()
    writers = (IndexedDatasetWriter(output_prefix, tokens.vocab_size, tokens.eod),
               IndexedDatasetWriter(mask_prefix(output_prefix), 2, 0, dtype=np.uint8))
    try:
        for path in list_input_files(inputs):
            for number, record in _records(path):
                if "messages" in record and not chat and tokenizer not in (None, "byte"):
                    chat.append(ChatTemplate(tokenizer))
                ids, mask = encode_record(record, f"{path}:{number}", tokens, chat[0] if chat else None)
                writers[0].add_document(ids)
                writers[1].add_document(mask)
                stats.documents += 1
                stats.tokens += ids.size
            stats.text_bytes += os.path.getsize(path)
        if stats.documents == 0:
            raise DataError(f"--input {' '.join(inputs)}: no SFT record found; give JSON lines with "
                            f"\"prompt\"/\"completion\" or \"messages\"")
        for writer in writers:
            writer.finalize()
    except BaseException:
        for writer in writers:
            writer.abort()
        raise
    stats.outputs = {"sft": output_prefix, "loss_mask": mask_prefix(output_prefix)}
    return stats
