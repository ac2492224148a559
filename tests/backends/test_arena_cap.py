"""The cap on ONNX Runtime's shared CPU arena (`arena_cap()`): a block whose working memory exceeds it is served eager
with the reason, where it would otherwise have taken the machine's memory; blocks that fit are tuned as before.

The arena is made once per process, so the capped run is a child process with `AITUNE_HF_ORT_ARENA_GIB` set."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from aitune_hf import hardware
from aitune_hf.backends import onnxruntime as ort_backend
from aitune_hf.errors import ConfigError

# Two blocks tuned in one registration under a 48 MiB cap. `Attention` at 2048 tokens x 2 heads: a plain ONNX graph
# holds the 2 x 2048 x 2048 score matrix and its softmax (32 MiB each, 64 MiB together) where eager's SDPA works in
# tiles; `MLP` needs well under 1 MiB. The child prints each block's decision, its eager-vs-served error and the cap.
_CHILD = r"""
import json
import torch
import torch.nn.functional as F
from torch import nn
from aitune_hf import register
from aitune_hf.backends import arena_cap


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, 16)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


torch.manual_seed(0)
torch.set_num_threads(1)
blocks = {"attention": Attention().eval(), "mlp": MLP().eval()}
calls = {"attention": torch.randn(1, 2048, 16), "mlp": torch.randn(4, 32, 16)}
config = {"backends": ["onnxruntime"], "shapes": "exact", "min_speedup": 0, "cache": "off", "progress": False}
with torch.no_grad():
    eager = {name: block(calls[name]) for name, block in blocks.items()}
    registration = register(blocks, config)
    for name, block in blocks.items():
        block(calls[name])
    registration.tune()
    served = {name: block(calls[name]) for name, block in blocks.items()}
rows = {}
for name in blocks:
    (signature,) = registration.targets[name].report().signatures
    error = (served[name] - eager[name]).abs().max().item()
    rows[name] = {"chosen": signature.chosen, "reason": signature.reason, "error": error}
registration.detach()
print(json.dumps({"cap": arena_cap(), "rows": rows}))
"""


def test_a_block_over_the_arena_cap_is_served_eager_with_the_reason_and_one_under_it_is_tuned() -> None:
    env = {**os.environ, "AITUNE_HF_ORT_ARENA_GIB": str(48 / 1024)}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["cap"] == 48 * 2**20
    attention, mlp = result["rows"]["attention"], result["rows"]["mlp"]
    assert attention["chosen"] == "eager"
    assert "needs more working memory than the shared ONNX Runtime arena's cap of 0.05 GiB" in attention["reason"]
    assert "MiB with" in attention["reason"], attention["reason"]  # what was asked for, and what was left
    assert attention["error"] == 0.0  # eager serves: the very same output
    assert mlp["chosen"] == "onnxruntime", mlp["reason"]
    assert mlp["error"] < 1e-5


def test_the_cap_is_read_from_the_environment_or_half_the_available_memory() -> None:
    assert ort_backend._cap_of("off", 8 * 2**30) == 0
    assert ort_backend._cap_of(" 1.5 ", None) == int(1.5 * 2**30)
    assert ort_backend._cap_of("", 8 * 2**30) == 4 * 2**30
    assert ort_backend._cap_of("", None) == 0  # memory unknown (not Linux): no default cap
    for bad in ("-1", "0", "nan", "lots"):
        with pytest.raises(ConfigError, match=rf"AITUNE_HF_ORT_ARENA_GIB={bad!r} is not valid; valid values"):
            ort_backend._cap_of(bad, None)
    if sys.platform == "linux":  # the default's base: MemAvailable, in bytes
        available = hardware.available_memory()
        assert available is not None and 2**20 < available < 2**50


def test_the_reason_names_the_operator_and_the_bytes_asked_where_onnx_runtime_says_them() -> None:
    message = (
        "Non-zero status code returned while running Softmax node. Name:'node_softmax' Status Message: "
        "bfc_arena.cc:360 BFCArena::AllocateRawInternal Available memory of 1048576 is smaller than requested bytes "
        "of 4194304"
    )
    assert "(Softmax asked for 4.0 MiB with 1.0 MiB left;" in ort_backend._over_cap(message, 2**30)
    assert "cap of 1.00 GiB (an allocation failed;" in ort_backend._over_cap("BFCArena: out of memory", 2**30)
