"""llama.cpp's own logits for a GGUF, in a fresh interpreter: llama.cpp's CPU threads beside torch's in
one pytest process have crashed it."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

__all__ = ["llama_logits"]

_SCRIPT = """
import json, sys
import numpy as np
import llama_cpp
model, adapter, ids, out, round_trip = json.loads(sys.argv[1])
kw = {"lora_path": adapter} if adapter else {}
llm = llama_cpp.Llama(model_path=model, n_ctx=256, n_threads=2, verbose=False, logits_all=True,
                      type_k=0, type_v=0, **kw)
if round_trip:
    assert llm.tokenize(llm.detokenize(ids, special=True), add_bos=False, special=True) == ids
llm.eval(ids)
np.save(out, np.array(llm.scores[: len(ids)], dtype=np.float32))
"""


def llama_logits(ids: list[int], model: Path, adapter: Path | None = None, round_trip: bool = False) -> torch.Tensor:
    """llama.cpp's logits (f32 KV cache, as torch keeps it) at every position of ``ids``; with
    ``round_trip``, after checking that its tokenizer gives ``ids`` back from their text."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "logits.npy"
        arg = json.dumps([str(model), str(adapter) if adapter else None, ids, str(out), round_trip])
        done = subprocess.run([sys.executable, "-c", _SCRIPT, arg], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return torch.from_numpy(np.load(out))
