"""The files a tokenizer leaves in a folder, written atomically.

Every kind writes `tokenizer.zebra.json`, a record holding at least its
"kind" and spec, so one reader finds the right class. A kind with a standard
format of its own writes that too (BPE: the HF `tokenizer.json`).
"""

import json
import os

RECORD = "tokenizer.zebra.json"
HF_FILE = "tokenizer.json"  # only ever in the HF `tokenizers` format


def write_text(directory: str, name: str, text: str) -> None:
  """`directory/name` via a tmp file + rename: never half written."""
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, name)
  tmp = f"{path}.{os.getpid()}.tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(text)
  os.replace(tmp, path)


def write_record(directory: str, record: dict) -> None:
  write_text(directory, RECORD, json.dumps(record, ensure_ascii=False))
