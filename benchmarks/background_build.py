"""Request latencies while a replica tunes in the background, in one process (no Ray): MiniLM via
sentence-transformers, batches of 8 sentences, one torch thread, backends ["onnxruntime"], an empty cache.

A warm eager reference first (the same requests, before aitune is enabled), then `aitune_hf.serving.Replica` with
`background=True` and no warm-up call, and a request loop in the main thread from the first request (which records)
until the replica has settled: every block tuned while those requests were served. Prints one JSON line and,
with `--out`, writes it. Issue 20: the ONNX Runtime builds of a background tuning run in a worker process.

    python benchmarks/background_build.py --out /tmp/after.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _request() -> list[str]:
    return [f"sentence number {i} about a quick brown fox and a lazy dog" for i in range(8)]


class _Count(logging.Handler):
    """Counts the ONNX Runtime backend's records that a block was built in this process instead of the build one."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.here = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.here += "building it here" in record.getMessage() or "exporting here" in record.getMessage()


def measure(eager_requests: int, limit_s: float) -> dict[str, Any]:
    import torch
    from sentence_transformers import SentenceTransformer

    from aitune_hf.serving import Replica
    from aitune_hf.testing import minilm_path

    torch.set_num_threads(1)
    count = _Count()
    backend_logger = logging.getLogger("aitune_hf.backends.onnxruntime")
    backend_logger.addHandler(count)
    backend_logger.setLevel(logging.DEBUG)
    model = SentenceTransformer(str(minilm_path()), device="cpu")

    def run(obj: Any) -> Any:
        return obj.encode(_request(), batch_size=8)

    eager = []
    for _ in range(eager_requests):
        start = time.perf_counter()
        run(model)
        eager.append(time.perf_counter() - start)
    with tempfile.TemporaryDirectory(prefix="aitune_bench_background_") as cache_dir:
        t0 = time.perf_counter()
        replica = Replica(lambda: model, None, cache_dir=cache_dir, cache="rw", backends=["onnxruntime"],
                          progress=False)  # fmt: skip
        during, settled_s = [], None
        while time.perf_counter() - t0 < limit_s:
            start = time.perf_counter()
            run(replica.obj)
            during.append(time.perf_counter() - start)
            if replica.health()["settled"]:
                settled_s = time.perf_counter() - t0
                break
        after = []
        for _ in range(eager_requests):
            start = time.perf_counter()
            run(replica.obj)
            after.append(time.perf_counter() - start)
        health = replica.health()
    warm = statistics.median(eager[len(eager) // 2 :])
    return {
        "warm_eager_ms": round(warm * 1e3, 1),
        "requests_during_tuning": len(during),
        "median_during_ms": round(statistics.median(during) * 1e3, 1) if during else None,
        "worst_during_ms": round(max(during) * 1e3, 1) if during else None,
        "over_3x": sum(d > 3 * warm for d in during),
        "tuned_median_ms": round(statistics.median(after) * 1e3, 1),
        "settled_s": round(settled_s, 1) if settled_s is not None else None,
        "tuned": health["tuned"],
        "eager": health["eager"],
        "builds_in_this_process": count.here,  # fell back from the build process (0 before issue 20's change too)
        "latencies_during_ms": [round(d * 1e3, 1) for d in during],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--eager-requests", type=int, default=20)
    parser.add_argument("--limit-s", type=float, default=600.0, help="stop the request loop after this long")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = measure(args.eager_requests, args.limit_s)
    text = json.dumps(result)
    print(text)
    if args.out:
        with open(args.out, "w") as file:
            file.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
