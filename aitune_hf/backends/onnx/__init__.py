"""The ONNX export shared by the runtimes that read it (ONNX Runtime, OpenVINO): not a backend, a room of its own.

- `export`: the exporter (on a private copy of the module, quiet, one ATen -> ONNX table per process).
- `reuse`: one export per module state per process (`Skeleton`, `forget_exports`).
- `worker`: the export and a runtime's heavy steps in the build process, for background tuning.
- `model`: where a runtime's build gets its model (`CallLayout`, `obtain`).
"""

from aitune_hf.backends.onnx.reuse import forget_exports

__all__ = ["forget_exports"]
