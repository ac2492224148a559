"""The notebooks in notebooks/ run end to end (tiny sizes, ONNX Runtime only, one build per shape) and are committed
with outputs.

Each notebook is executed with nbclient in a fresh ``python3`` kernel (the kernelspec that ipykernel installs
into the environment; jupyter_client starts it with this interpreter), in a temporary working directory, after
its ``parameters`` cell is replaced with tiny settings. Inductor is covered by the core and pipeline tests.
"""

from __future__ import annotations

import base64
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="needs the notebooks extra: pip install aitune-hf[notebooks]")
nbclient = pytest.importorskip("nbclient", reason="needs the notebooks extra: pip install aitune-hf[notebooks]")
pytest.importorskip("ipykernel", reason="needs the notebooks extra: pip install aitune-hf[notebooks]")
pytest.importorskip("matplotlib", reason="needs the notebooks extra: pip install aitune-hf[notebooks]")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
NAMES = ("01_stable_diffusion_blocks.ipynb", "02_flux_transformer.ipynb", "03_transformers_minilm.ipynb")
TINY = 'SIZE = "tiny"; THREADS = 1; BACKENDS = ["onnxruntime"]; ROUNDS = 2; SHAPES = "exact"'
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
#: PNG outputs per notebook: the report plot, and in 01 the fp32 eager and `precision="auto"` images side by side.
PNGS = {"01_stable_diffusion_blocks.ipynb": 2}


def _read(name: str):
    return nbformat.read(NOTEBOOKS / name, as_version=4)


def _parameters_cell(nb):
    cells = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(cells) == 1, "exactly one cell tagged 'parameters'"
    first_code = next(c for c in nb.cells if c.cell_type == "code")
    assert cells[0] is first_code, "the parameters cell is the first code cell"
    return cells[0]


def _outputs(nb) -> list:
    return [output for cell in nb.cells if cell.cell_type == "code" for output in cell.get("outputs", [])]


def _text(nb) -> str:
    parts = []
    for output in _outputs(nb):
        if output.output_type == "stream":
            parts.append(output.text)
        elif output.output_type in ("execute_result", "display_data"):
            parts.extend(output.data.get(kind, "") for kind in ("text/plain", "text/html"))
    return "\n".join(parts)


def _pngs(nb) -> list[bytes]:
    return [
        base64.b64decode(output.data["image/png"])
        for output in _outputs(nb)
        if output.output_type in ("execute_result", "display_data") and "image/png" in output.data
    ]


def _check_outputs(nb, name: str) -> None:
    errors = [f"{o.ename}: {o.evalue}" for o in _outputs(nb) if o.output_type == "error"]
    assert not errors, f"{name}: {errors}"
    text = _text(nb)
    assert "end to end: eager" in text and "(measured)" in text, f"{name}: no measured end-to-end line"
    assert "<table>" in text, f"{name}: the report was not shown as HTML"
    assert "-> PASS" in text, f"{name}: the tuned output was not checked against eager"
    pngs = _pngs(nb)
    expected = PNGS.get(name, 1)
    assert len(pngs) == expected and all(p.startswith(PNG_MAGIC) for p in pngs), f"{name}: not {expected} PNG(s)"
    if name.startswith(("01", "03")):
        _check_precision_section(text, name)


def _number(pattern: str, text: str, name: str) -> float:
    found = re.search(pattern, text)
    assert found, f"{name}: no line matching {pattern!r}"
    return float(found.group(1))


def _check_precision_section(text: str, name: str) -> None:
    """The reduced-precision section: what `auto` offered (or that it offered nothing, with the skipped reasons), the
    quality of the whole output against fp32 eager within its budget, and the speed-up printed beside it."""
    offered = re.search(r"  candidates: (.*)", text)
    assert offered, f"{name}: the candidates precision='auto' offered are not printed"
    if "auto offers nothing here" in text:
        assert "precision=" not in offered.group(1), f"{name}: says auto offers nothing, yet {offered.group(1)}"
        assert re.search(r"(bf16|int8) skipped: \S", text), f"{name}: offers nothing without a skipped reason"
    else:
        assert "precision=" in offered.group(1), f"{name}: no reduced candidate in {offered.group(1)!r}"
    assert "report's quality line: " in text, f"{name}: the report's quality line is not printed"
    if name.startswith("01"):
        found = re.search(r"auto vs fp32 eager image: PSNR (\S+) dB \(>= ([0-9.]+)\) -> PASS", text)
        assert found, f"{name}: no passing PSNR line for the auto image"
        assert float(found.group(1)) >= float(found.group(2)) >= 35, found.group(0)
        _number(r"precision='auto' ([0-9.]+)x at PSNR ", text, name)  # the speed-up beside its quality
    else:
        assert _number(r"min cosine of the sentence embeddings: ([0-9.]+)", text, name) >= 0.99
        assert _number(r"Spearman rank correlation (-?[0-9.]+) over 28 pairs", text, name) >= 0.95
        _number(r"precision='auto' ([0-9.]+)x at min sentence cosine ", text, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_with_tiny_sizes(name: str, tmp_path: Path) -> None:
    nb = _read(name)
    _parameters_cell(nb).source = TINY
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=600, resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError, naming the cell, when one fails
    _check_outputs(nb, name)
    assert "size 'tiny', backends ['onnxruntime'], rounds 2" in _text(nb), "the tiny parameters were not used"


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_committed_with_outputs_of_a_small_run(name: str) -> None:
    nb = _read(name)
    nbformat.validate(nb)
    source = _parameters_cell(nb).source
    for line in ('SIZE = "small"', "THREADS = 1", 'BACKENDS = ["inductor", "onnxruntime"]', "ROUNDS = 5"):
        assert line in source, f"{name}: parameters cell lacks {line!r}"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code), f"{name}: not every code cell was executed"
    assert [c.execution_count for c in code] == sorted(c.execution_count for c in code), f"{name}: run out of order"
    _check_outputs(nb, name)
    assert "size 'small', backends ['inductor', 'onnxruntime'], rounds 5" in _text(nb)
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"
