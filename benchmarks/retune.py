"""Tuning again in one process: what the exports kept for reuse save (docs/backends.md, "One export per module state
per process"). A small Stable Diffusion pipeline built locally, `enable_aitune("blocks", backends=["onnxruntime"])`,
no persistent cache, one torch thread:

1. first: a pipeline loaded with `from_pretrained`, tuned (every block exports);
2. second: the same folder loaded again, every UNet and VAE weight scaled by 1.05 (other weights, same architecture);
3. again after an edit: the first pipeline, `disable_aitune()`, its UNet weights scaled (as a fused LoRA changes
   them), enabled and tuned again;
4. cold again: the third case after `aitune_hf.backends.forget_exports()`, as a process that kept nothing would.

Each row, from one `aitune_hf.session.run_session` (the session `aitune-hf tune` runs): the tuning call's seconds
(wall), how many candidates were built from a kept export, and the largest difference between the tuned images and
that pipeline's own eager images (the same call, fixed seed).

    python benchmarks/retune.py                       # tiny, results in benchmarks/results/retune.md
    python benchmarks/retune.py --size small --out /tmp/retune.md
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from machine import cpu_model

from aitune_hf import AITunePipeline
from aitune_hf.backends import forget_exports
from aitune_hf.session import run_session
from aitune_hf.testing import build_pipeline, default_call_kwargs

RESULTS = Path(__file__).resolve().parent / "results" / "retune.md"


def _scale(*modules: torch.nn.Module) -> None:
    with torch.no_grad():
        for module in modules:
            for parameter in module.parameters():
                parameter.mul_(1.05)


def _tune(pipe: AITunePipeline, call: dict[str, Any]) -> dict[str, Any]:
    """One tuning session (`aitune_hf.session.run_session`: eager, enable, record, tune, serve, check); the figures
    of one row."""
    session = run_session(
        pipe,
        lambda: pipe(**call, generator=torch.Generator().manual_seed(0)).images,
        "blocks",
        backends=["onnxruntime"],
        cache="off",
        progress=False,
    )
    modules = session.report.to_dict()["modules"].values()
    candidates = [c for m in modules for s in m["signatures"] for c in s["candidates"] if c["backend"] == "onnxruntime"]
    figures = {
        "tuning_call_s": round(session.tuning_call_seconds, 1),
        "reused": sum(bool(c.get("reused")) for c in candidates),
        "built": len(candidates),
        "max_abs_diff": session.max_abs_diff,
    }
    pipe.disable_aitune()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    call = {**default_call_kwargs("sd", args.size), "output_type": "np"}
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="aitune_bench_retune_") as root:
        folder = build_pipeline("sd", Path(root) / "sd", size=args.size)

        def load() -> AITunePipeline:
            pipe = AITunePipeline.from_pretrained(folder, local_files_only=True)
            pipe.set_progress_bar_config(disable=True)
            return pipe

        first = load()
        rows["first pipeline"] = _tune(first, call)
        second = load()
        _scale(second.unet, second.vae)
        rows["second pipeline, other weights"] = _tune(second, call)
        _scale(first.unet)
        rows["first again, after a weight edit"] = _tune(first, call)
        _scale(first.unet)
        forget_exports()
        rows["the same, nothing kept (forget_exports)"] = _tune(first, call)
    result = {"size": args.size, "cpu": cpu_model(), "threads": 1, "rows": rows}
    print(json.dumps(result))
    lines = [
        f"# Tuning again in one process (SD {args.size}, blocks, ONNX Runtime only, no cache, 1 thread)",
        "",
        f"CPU: {result['cpu']}. Command: `python benchmarks/retune.py --size {args.size}`.",
        "",
        "| case | tuning call (s) | candidates from a kept export | max abs diff vs its own eager |",
        "|---|---|---|---|",
    ]
    for name, row in rows.items():
        lines.append(
            f"| {name} | {row['tuning_call_s']:.1f} | {row['reused']} of {row['built']} | {row['max_abs_diff']:.1e} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
